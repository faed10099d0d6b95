// Kernel launches and dynamic shared memory, spelled through two macros so that the kernels'
// source also compiles as host code: tests/gpu/host_cuda.h defines both first, and then a test
// runs the very same kernels on the CPU, each CUDA thread a fiber (flash_attention_host_test,
// quantize_host_test, moe_host_test, layer_ops_host_test, gemm_host_test: every kernel file).
//
//   FP8RT_LAUNCH(kernel, grid, block, bytes, stream)(args...)
//       kernel<<<grid, block, bytes, stream>>>(args...)
//   FP8RT_DYNAMIC_SHARED(type, name);
//       extern __shared__ __align__(128) type name[]: the block's dynamic shared memory,
//       128-byte aligned
#ifndef FP8RT_KERNELS_CUDA_LAUNCH_CUH_
#define FP8RT_KERNELS_CUDA_LAUNCH_CUH_

#ifndef FP8RT_LAUNCH
#define FP8RT_LAUNCH(kernel, grid, block, bytes, stream) kernel<<<grid, block, bytes, stream>>>
#endif

#ifndef FP8RT_DYNAMIC_SHARED
#define FP8RT_DYNAMIC_SHARED(type, name) extern __shared__ __align__(128) type name[]
#endif

#endif  // FP8RT_KERNELS_CUDA_LAUNCH_CUH_
