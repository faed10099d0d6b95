// Test support of the CUDA backend (kernels/cuda/cuda_backend.h, namespace cuda_testing): the
// device FP32 -> FP8 encoder against NVIDIA's hardware conversion on every float bit pattern.
#include <cuda_fp8.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "kernels/cuda/cuda_backend.h"
#include "kernels/cuda/device_math.cuh"
#include "runtime/core/checks.h"

namespace fp8rt::kernels::cuda_testing {
namespace {

template <Fp8Format F>
__global__ void CountMismatchesKernel(unsigned long long* mismatches) {
  constexpr __nv_fp8_interpretation_t kInterp = F == Fp8Format::kE4M3 ? __NV_E4M3 : __NV_E5M2;
  unsigned long long local = 0;
  const uint64_t stride = static_cast<uint64_t>(gridDim.x) * blockDim.x;
  for (uint64_t i = static_cast<uint64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
       i < (uint64_t{1} << 32); i += stride) {
    const float x = __uint_as_float(static_cast<uint32_t>(i));
    const uint32_t ours = cuda_internal::EncodeFp8<F>(x);
    const uint32_t nvidia = __nv_cvt_float_to_fp8(x, __NV_SATFINITE, kInterp);
    local += ours != nvidia;
  }
  local = cuda_internal::WarpSum(local);
  if ((threadIdx.x & 31) == 0 && local != 0) atomicAdd(mismatches, local);
}

}  // namespace

absl::StatusOr<int64_t> CountEncodeMismatchesWithHardware(Fp8Format format) {
  unsigned long long* count = nullptr;
  CUDA_RETURN_IF_ERROR(cudaMalloc(&count, sizeof(*count)));  // test support: synchronous
  unsigned long long host = 0;
  cudaError_t err = cudaMemset(count, 0, sizeof(*count));
  if (err == cudaSuccess) {
    if (format == Fp8Format::kE4M3) {
      CountMismatchesKernel<Fp8Format::kE4M3><<<4096, 256>>>(count);
    } else {
      CountMismatchesKernel<Fp8Format::kE5M2><<<4096, 256>>>(count);
    }
    err = cudaGetLastError();
  }
  if (err == cudaSuccess) err = cudaMemcpy(&host, count, sizeof(host), cudaMemcpyDeviceToHost);
  (void)cudaFree(count);
  CUDA_RETURN_IF_ERROR(err);
  return static_cast<int64_t>(host);
}

}  // namespace fp8rt::kernels::cuda_testing
