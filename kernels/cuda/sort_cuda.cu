// SortKeyRowPairsCuda (kernels/cuda/cuda_ops_internal.h): embedding_backward's stable sort of
// (token, row) pairs, CUB's radix sort. Kept apart from kernels/cuda/layer_ops_cuda.cu so that
// the kernels there compile as host code for the block emulator of tests/gpu/host_cuda.h, which
// cannot compile CUB; tests/gpu/host_cuda_backend.h stands in for this file with a stable sort on
// the host, and tests/gpu/layer_ops_cuda_test.cc holds both to the CPU's embedding gradient.
#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>
#include <cub/device/device_radix_sort.cuh>

#include "absl/status/status.h"
#include "kernels/cuda/cuda_ops_internal.h"
#include "kernels/ops.h"
#include "runtime/core/checks.h"

namespace fp8rt::kernels::cuda_internal {

absl::Status SortKeyRowPairsCuda(void* scratch, size_t* scratch_bytes, const uint32_t* keys_in,
                                 uint32_t* keys_out, const int64_t* rows_in, int64_t* rows_out,
                                 int64_t n, int end_bit, Stream stream) {
  // A radix sort is stable: pairs with equal keys keep their input order.
  CUDA_RETURN_IF_ERROR(cub::DeviceRadixSort::SortPairs(scratch, *scratch_bytes, keys_in, keys_out,
                                                       rows_in, rows_out, n, 0, end_bit,
                                                       static_cast<cudaStream_t>(stream.handle)));
  return absl::OkStatus();
}

}  // namespace fp8rt::kernels::cuda_internal
