// Kernel launches and shared memory, spelled through three macros so that the kernels'
// source also compiles as host code: tests/gpu/host_cuda.h defines all three first, and then a test
// runs the very same kernels on the CPU, each CUDA thread a fiber (flash_attention_host_test,
// quantize_host_test, moe_host_test, layer_ops_host_test, gemm_host_test: every kernel file).
//
//   FP8RT_LAUNCH(kernel, grid, block, bytes, stream)(args...)
//       kernel<<<grid, block, bytes, stream>>>(args...)
//   FP8RT_DYNAMIC_SHARED(type, name);
//       extern __shared__ __align__(128) type name[]: the block's dynamic shared memory,
//       128-byte aligned
//   FP8RT_STATIC_SHARED(type, name, dims);
//       __shared__ type name dims: a static shared variable, e.g.
//       FP8RT_STATIC_SHARED(float, tile, [32][33]); (dims empty for a scalar). host_cuda.h fills
//       each with 0xFF bytes before every block; a bare __shared__ does not compile there.
#ifndef FP8RT_KERNELS_CUDA_LAUNCH_CUH_
#define FP8RT_KERNELS_CUDA_LAUNCH_CUH_

#ifndef FP8RT_LAUNCH
#define FP8RT_LAUNCH(kernel, grid, block, bytes, stream) kernel<<<grid, block, bytes, stream>>>
#endif

#ifndef FP8RT_DYNAMIC_SHARED
#define FP8RT_DYNAMIC_SHARED(type, name) extern __shared__ __align__(128) type name[]
#endif

#ifndef FP8RT_STATIC_SHARED
#define FP8RT_STATIC_SHARED(type, name, dims) __shared__ type name dims
#endif

#endif  // FP8RT_KERNELS_CUDA_LAUNCH_CUH_
