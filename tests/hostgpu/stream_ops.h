// The CPU op table as work on the emulated device (host_gpu.h), for whole training runs over the
// NCCL backend on CPU ranks (train_host_nccl_test).
//
// The model's ops then behave towards the host and the NCCL backend as the CUDA table's kernels
// do: each entry checks at the call that its pointers (arguments, and the pointer fields of its
// argument struct) are device memory (registered by the emulated runtime: cudaMalloc,
// cudaMallocAsync or cudaMallocHost; null pointers and a pointer one past an allocation are let
// through, which the CUDA entries refuse when the call has work), and is then launched on its
// stream (kernels::Stream::handle; null is the legacy default stream) with its arguments copied; it
// runs when the device reaches it, in stream order, after the events that stream waits for
// (FSDP's started gathers and reductions, the stream-ordered collectives). With
// Settings::lazy_streams the device runs only when the host waits, so an op queued without a
// wait for the collective that writes its input reads the input as it was, and a host read of
// an op's output without a synchronisation reads it before the op ran: the run's results change.
// `synchronize` waits for its stream and returns the first error an op returned when it ran.
//
// The table says Backend::kCuda, so the model makes the CUDA backend's choices: MoE expert rows
// are padded to the CUDA GEMMs' multiple. Every FP8 GEMM is checked against the rules of
// cuBLASLt on Hopper (kernels/cuda/gemm_route.h, compute capability 9.0): those that would fall
// back to the slow kernel there are counted (Fp8GemmsOffCublasLt).
//
// Each op's pointers are checked against the rules of stream-ordered memory and for data races
// between streams (host_gpu.h, "Stream order"; StreamRaces): a pointer to const is read, any other
// written. So a free of an array that a side-stream collective may still read, a use of an array
// on another stream before its stream-ordered allocation, or an op that reads a gathered weight
// before waiting for its gather, is caught even where the device happened to run the work in a
// harmless order. Allocation itself is immediate and
// never reuses memory (the CUDA pool may hand a freed array out again: the rules above are what
// make that safe).
//
// Memory, as the CUDA table's: allocate comes from cudaMalloc, allocate_device from
// cudaMallocAsync on the legacy default stream (the CUDA table's stream-ordered pool there),
// allocate_host from cudaMallocHost. deallocate frees allocate_device's arrays in stream order on
// the legacy default stream (cudaFreeAsync: no host wait, as the CUDA table's pool does); the
// others with cudaFree / cudaFreeHost, which wait for the device. The arrays count as the
// caller's memory in the NCCL emulation (Stats::caller_memory).
#ifndef FP8RT_TESTS_HOSTGPU_STREAM_OPS_H_
#define FP8RT_TESTS_HOSTGPU_STREAM_OPS_H_

#include <cstdint>
#include <string>

#include "absl/status/status.h"
#include "kernels/ops.h"

namespace fp8rt::hostgpu {

const kernels::OpTable& CpuOpsOnDevice();

// The first error an op returned when it ran on the device (OK: none; ResetDeviceOpError clears
// it), and how many ops ran there.
absl::Status DeviceOpError();
void ResetDeviceOpError();
int64_t DeviceOpsRun();

// How many FP8 GEMMs the emulated device was given, how many of them cuBLASLt would not take on a
// Hopper GPU (shape or formats: RouteFp8Gemm at compute capability 9.0), and the first of those
// (its M, N, K and why; empty when none), since ResetFp8GemmRoutes.
int64_t Fp8GemmsChecked();
int64_t Fp8GemmsOffCublasLt();
std::string FirstFp8GemmOffCublasLt();
void ResetFp8GemmRoutes();

}  // namespace fp8rt::hostgpu

#endif  // FP8RT_TESTS_HOSTGPU_STREAM_OPS_H_
