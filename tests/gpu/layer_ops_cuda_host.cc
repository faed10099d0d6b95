// kernels/cuda/layer_ops_cuda.cu compiled as host code over the block emulator (host_cuda.h), and
// the op table that layer_ops_host_test (layer_ops_cuda_test.cc in host mode,
// gpu_test_support.h) runs in place of CudaOps(): HostEmulatedOps, whose layer table is the
// file's own kLayerOps, with the other kernel files' entries compiled the same way
// (attention_cuda_host.cc, flash_attention_cuda_host.cc, moe_cuda_host.cc, quantize_cuda_host.cc)
// and host_cuda_backend.h's stand-ins for memory_cuda.cc and sort_cuda.cu.
#include "kernels/ops.h"
#include "tests/gpu/gpu_test_support.h"
#include "tests/gpu/host_cuda.h"  // before the kernels' file: it defines what their source needs

// The stand-ins first (host_cuda_backend.h refuses to come after the file).
// clang-format off
#define cuda_internal host_cuda_internal
#include "tests/gpu/host_cuda_backend.h"
#include "kernels/cuda/layer_ops_cuda.cu"  // NOLINT(build/include): the kernels under test
#undef cuda_internal
// clang-format on

namespace fp8rt::kernels::gpu_test {

// The quantize family and the layer ops from the kernel files; the GEMM entries are the CPU
// table's, standing in for cuBLASLt and cuBLAS (libraries this emulator cannot run;
// gemm_host_test holds gemm_kernels.cu's fallback GEMM to its documented order).
const OpTable& HostEmulatedOps() {
  static const OpTable table = [] {
    namespace device = host_cuda_internal;
    OpTable t = CpuOps();
    t.backend = Backend::kCuda;
    t.name = "cuda kernels on the block emulator, the CPU's GEMMs";
    t.quantize = &device::QuantizeCuda;
    t.dequantize = &device::DequantizeCuda;
    t.amax = &device::AmaxCuda;
    t.convert = &device::ConvertCuda;
    t.cast_transpose = &device::CastTransposeCuda;
    t.layer = &device::kLayerOps;
    return t;
  }();
  return table;
}

}  // namespace fp8rt::kernels::gpu_test
