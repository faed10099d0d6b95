// kernels/cuda/attention_cuda.cu compiled as host code over the block emulator (host_cuda.h): the
// CUDA table's attention and cross-entropy entries, with the FP32 warp kernels, for
// flash_attention_host_test, whose own file compiles the fused kernels the BF16 entries launch.
// The entries are in host_cuda_internal (host_cuda_backend.h); cuda_ops_internal.h declares them.
#include "tests/gpu/host_cuda.h"  // first: it defines what the kernels' source needs

// The stand-ins first (host_cuda_backend.h refuses to come after the file).
// clang-format off
#define cuda_internal host_cuda_internal
#include "tests/gpu/host_cuda_backend.h"
#include "kernels/cuda/attention_cuda.cu"  // NOLINT(build/include): the kernels under test
#undef cuda_internal
// clang-format on
