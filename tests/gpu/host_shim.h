// The host shim that lets the CUDA kernels' per-value functions (kernels/cuda/device_math.cuh,
// kernels/cuda/layer_math.cuh) compile as host code, for the tests that check them on any machine
// (device_math_host_test, layer_math_host_test). Include it after every other header (its macros
// must not reach them) and before either .cuh.
//
// It defines FP8RT_DEVICE_MATH_HOST_SHIM (which keeps the .cuh files from including
// cuda_runtime.h, and device_math.cuh from defining its device-only reductions), __device__ as
// nothing, __forceinline__ as inline, and the CUDA intrinsics they use as their IEEE definitions,
// in fp8rt::kernels::cuda_internal:
//   __fadd_rn / __fsub_rn / __fmul_rn / __fdiv_rn / __fsqrt_rn  FP32 operations rounded to
//       nearest even (the host's default rounding). Each is a separate non-inlined call, so the
//       compiler cannot contract a product and a sum into an FMA, as nvcc does not for these.
//   __float_as_uint / __uint_as_float  bit casts.
//   __clz  leading zeros of a 32-bit value.
//   max / min  the integer overloads of CUDA's device max and min.
// tanhf is not shimmed: the host's tanhf is the function std::tanh(float) calls.
#ifndef FP8RT_TESTS_GPU_HOST_SHIM_H_
#define FP8RT_TESTS_GPU_HOST_SHIM_H_

#include <bit>
#include <cmath>
#include <cstdint>

#define FP8RT_DEVICE_MATH_HOST_SHIM 1
#define __device__
#define __forceinline__ inline

namespace fp8rt::kernels::cuda_internal {
[[gnu::noinline]] inline float __fadd_rn(float a, float b) { return a + b; }
[[gnu::noinline]] inline float __fsub_rn(float a, float b) { return a - b; }
[[gnu::noinline]] inline float __fmul_rn(float a, float b) { return a * b; }
[[gnu::noinline]] inline float __fdiv_rn(float a, float b) { return a / b; }
[[gnu::noinline]] inline float __fsqrt_rn(float a) { return std::sqrt(a); }
inline uint32_t __float_as_uint(float x) { return std::bit_cast<uint32_t>(x); }
inline float __uint_as_float(uint32_t x) { return std::bit_cast<float>(x); }
inline int __clz(int x) { return std::countl_zero(static_cast<uint32_t>(x)); }
inline uint32_t max(uint32_t a, uint32_t b) { return a > b ? a : b; }
inline int max(int a, int b) { return a > b ? a : b; }
inline int min(int a, int b) { return a < b ? a : b; }
}  // namespace fp8rt::kernels::cuda_internal

#endif  // FP8RT_TESTS_GPU_HOST_SHIM_H_
