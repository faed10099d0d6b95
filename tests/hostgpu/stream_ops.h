// The CPU op table as work on the emulated device (host_gpu.h), for whole training runs over the
// NCCL backend on CPU ranks (train_host_nccl_test).
//
// The model's ops then behave towards the host and the NCCL backend as the CUDA table's kernels
// do: each entry checks at the call that its pointer arguments are device memory (registered by
// the emulated runtime: cudaMalloc or cudaMallocHost), as the CUDA entries do, and is then
// launched on its stream (kernels::Stream::handle; null is the legacy default stream) with its
// arguments copied; it runs when the device reaches it, in stream order, after the events that
// stream waits for (FSDP's started gathers and reductions, the stream-ordered collectives). With
// Settings::lazy_streams the device runs only when the host waits, so an op queued without a
// wait for the collective that writes its input reads the input as it was, and a host read of
// an op's output without a synchronisation reads it before the op ran: the run's results change.
// `synchronize` waits for its stream and returns the first error an op returned when it ran.
//
// Memory, as the CUDA table's: allocate and allocate_device come from cudaMalloc, allocate_host
// from cudaMallocHost. deallocate frees allocate_device's arrays in stream order on the legacy
// default stream (cudaFreeAsync: no host wait, as the CUDA table's pool does); the others with
// cudaFree / cudaFreeHost, which wait for the device.
#ifndef FP8RT_TESTS_HOSTGPU_STREAM_OPS_H_
#define FP8RT_TESTS_HOSTGPU_STREAM_OPS_H_

#include <cstdint>

#include "absl/status/status.h"
#include "kernels/ops.h"

namespace fp8rt::hostgpu {

const kernels::OpTable& CpuOpsOnDevice();

// The first error an op returned when it ran on the device (OK: none), and how many ops ran
// there.
absl::Status DeviceOpError();
int64_t DeviceOpsRun();

}  // namespace fp8rt::hostgpu

#endif  // FP8RT_TESTS_HOSTGPU_STREAM_OPS_H_
