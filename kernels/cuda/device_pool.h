// fp8rt's stream-ordered device memory pool (one per device, in kernels/cuda/memory_cuda.cc),
// for CUDA code outside the op table: NCCL's staging of host values. The pool keeps freed memory
// for reuse; allocating from it, not from the device's default pool, lets that memory serve the
// allocation (the default pool cannot take it, and on a device the pool fills it would fail).
#ifndef FP8RT_KERNELS_CUDA_DEVICE_POOL_H_
#define FP8RT_KERNELS_CUDA_DEVICE_POOL_H_

#include <cuda_runtime_api.h>

#include <cstddef>

namespace fp8rt::kernels::cuda_internal {

// cudaMallocFromPoolAsync of `bytes` on `stream` from the current device's pool. Never waits for
// the device (no trim and retry: safe while holding a lock a watchdog needs). Free it with
// cudaFreeAsync. On failure the CUDA error is returned; a failed allocation is not sticky, but
// the caller should clear it from the thread (cudaGetLastError) so that the next launch's check
// does not report it.
cudaError_t MallocFromDevicePool(void** p, size_t bytes, cudaStream_t stream);

// Waits for the device (so that frees still queued have happened), then gives the memory the
// current device's pool keeps unused back to the driver. For tests that fill the device and must
// leave it as they found it; the backend trims by itself when an allocation fails.
cudaError_t TrimDevicePool();

}  // namespace fp8rt::kernels::cuda_internal

#endif  // FP8RT_KERNELS_CUDA_DEVICE_POOL_H_
