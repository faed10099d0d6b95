// kernels/cuda/moe_cuda.cu compiled as host code over the block emulator (host_cuda.h), for
// layer_ops_host_test's table (HostEmulatedOps, layer_ops_cuda_host.cc). The entries are in
// host_cuda_internal (host_cuda_backend.h); cuda_ops_internal.h declares them.
#include "tests/gpu/host_cuda.h"  // first: it defines what the kernels' source needs

// The stand-ins first (host_cuda_backend.h refuses to come after the file).
// clang-format off
#define cuda_internal host_cuda_internal
#include "tests/gpu/host_cuda_backend.h"
#include "kernels/cuda/moe_cuda.cu"  // NOLINT(build/include): the kernels under test
#undef cuda_internal
// clang-format on
