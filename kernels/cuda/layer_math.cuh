// Internal: the per-element FP32 arithmetic of the CUDA layer ops (kernels/cuda/layer_ops_cuda.cu),
// each function a line-for-line mirror of the CPU reference expression it stands for
// (kernels/cpu/layer_ops_cpu.cc): the same operations on the same operands in the same order.
//
// Index:
//   AddF32                         a + b: ResidualForward, and every `+=` of a backward
//   GeluForwardOne, GeluBackwardOne  the tanh-approximation GELU and its accumulated gradient
//   RmsNormSquare, RmsNormRstd, RmsNormOut               forward, per element and per row
//   RmsNormGxTerm, RmsNormCoef, RmsNormDx, RmsNormDweightTerm   backward
//   AdamWOne                       AdamWUpdate of one element
//   kSumSquares*, SumSquaresBlocks, SumSquaresStrided   the grid and the order of sum_squares
//
// Every rounding is an explicit round-to-nearest intrinsic (__fadd_rn, __fsub_rn, __fmul_rn,
// __fdiv_rn, __fsqrt_rn): nvcc never contracts those into a fused multiply-add, so each result is
// the IEEE FP32 result the host computes (the CPU reference is built with -std=c++20, which turns
// contraction off in GCC). Denormals are kept (-ftz=false, kernels/CMakeLists.txt). So AddF32,
// the RMSNorm functions and AdamWOne equal the CPU bit for bit on equal inputs; the reductions
// around the RMSNorm functions add in another order on the GPU, and GELU calls the device tanhf,
// which may differ from the host's by a few ulp (tests/gpu/layer_ops_cuda_test.cc bounds both).
// A NaN result may carry another payload than on the host; it is a NaN on both.
//
// sum_squares is the exception to "mirror of the CPU": its FP64 sum runs in an order of its own,
// defined below (the CPU adds in index order), the same on every GPU because the grid is a function
// of the count alone. layer_math_host_test checks that order on the host: every element is added
// exactly once, the chain and the trees are the documented ones, and the result is within the
// order's error bound of the exact sum.
//
// These are __device__ functions (the _rn intrinsics are device-only in CUDA 13, so they could
// not be __host__ __device__ without a second host body to keep in step). Like
// kernels/cuda/device_math.cuh they compile as host code when the includer defines
// FP8RT_DEVICE_MATH_HOST_SHIM, __device__, __forceinline__ and the intrinsics as their IEEE
// definitions: tests/gpu/layer_math_host_test.cc checks them against the CPU reference that way,
// on any machine.
#ifndef FP8RT_KERNELS_CUDA_LAYER_MATH_CUH_
#define FP8RT_KERNELS_CUDA_LAYER_MATH_CUH_

#if !defined(FP8RT_DEVICE_MATH_HOST_SHIM)
#include <cuda_runtime.h>
#endif

#include <cmath>
#include <cstdint>
#include <numbers>

#include "kernels/layer_ops.h"

namespace fp8rt::kernels::cuda_internal {

// The GELU constants exactly as the CPU reference defines them: sqrt(2/pi) rounded once to FP32,
// 0.044715, and 3 * 0.044715 rounded to FP32 (the CPU's `3.0f * kGeluCubic * x * x` multiplies
// the two constants first).
inline constexpr float kGeluScale =
    static_cast<float>(std::numbers::sqrt2 * std::numbers::inv_sqrtpi);
inline constexpr float kGeluCubic = 0.044715f;
inline constexpr float kGeluThreeCubic = 3.0f * kGeluCubic;

// a + b rounded to FP32.
__device__ __forceinline__ float AddF32(float a, float b) { return __fadd_rn(a, b); }

// u = sqrt(2/pi) (x + 0.044715 x^3), as ((0.044715 x) x) x.
__device__ __forceinline__ float GeluArgument(float x) {
  return __fmul_rn(kGeluScale, __fadd_rn(x, __fmul_rn(__fmul_rn(__fmul_rn(kGeluCubic, x), x), x)));
}

// 0.5 x (1 + tanh u).
__device__ __forceinline__ float GeluForwardOne(float x) {
  return __fmul_rn(__fmul_rn(0.5f, x), __fadd_rn(1.0f, tanhf(GeluArgument(x))));
}

// dx + dout * (0.5 (1 + tanh u) + 0.5 x (1 - tanh^2 u) sqrt(2/pi) (1 + 3 * 0.044715 x^2)).
__device__ __forceinline__ float GeluBackwardOne(float dx, float dout, float x) {
  const float th = tanhf(GeluArgument(x));
  const float du =
      __fmul_rn(kGeluScale, __fadd_rn(1.0f, __fmul_rn(__fmul_rn(kGeluThreeCubic, x), x)));
  const float grad =
      __fadd_rn(__fmul_rn(0.5f, __fadd_rn(1.0f, th)),
                __fmul_rn(__fmul_rn(__fmul_rn(0.5f, x), __fsub_rn(1.0f, __fmul_rn(th, th))), du));
  return __fadd_rn(dx, __fmul_rn(dout, grad));
}

// One term x^2 of a row's sum of squares.
__device__ __forceinline__ float RmsNormSquare(float x) { return __fmul_rn(x, x); }

// rstd = 1 / sqrt(sum_sq / C + eps).
__device__ __forceinline__ float RmsNormRstd(float sum_sq, int64_t c, float eps) {
  return __fdiv_rn(1.0f, __fsqrt_rn(__fadd_rn(__fdiv_rn(sum_sq, static_cast<float>(c)), eps)));
}

// out = (x * rstd) * weight.
__device__ __forceinline__ float RmsNormOut(float x, float rstd, float weight) {
  return __fmul_rn(__fmul_rn(x, rstd), weight);
}

// One term (dout * weight) * x of the backward's row sum gx.
__device__ __forceinline__ float RmsNormGxTerm(float dout, float weight, float x) {
  return __fmul_rn(__fmul_rn(dout, weight), x);
}

// coef = rstd^3 gx / C, as ((rstd rstd) rstd) gx / C.
__device__ __forceinline__ float RmsNormCoef(float rstd, float gx, int64_t c) {
  return __fdiv_rn(__fmul_rn(__fmul_rn(__fmul_rn(rstd, rstd), rstd), gx), static_cast<float>(c));
}

// dx + ((rstd * dout) * weight - coef * x).
__device__ __forceinline__ float RmsNormDx(float dx, float rstd, float dout, float weight,
                                           float coef, float x) {
  return __fadd_rn(dx, __fsub_rn(__fmul_rn(__fmul_rn(rstd, dout), weight), __fmul_rn(coef, x)));
}

// One term (dout * x) * rstd of dweight's column sum.
__device__ __forceinline__ float RmsNormDweightTerm(float dout, float x, float rstd) {
  return __fmul_rn(__fmul_rn(dout, x), rstd);
}

// AdamWUpdate (kernels/layer_ops.h) of one element: reads master, m and v, writes the new values
// back through the references. The scalars come from `k`; its pointers are not used.
__device__ __forceinline__ void AdamWOne(const AdamWArgs& k, float grad, float& master, float& m,
                                         float& v) {
  const float g = __fmul_rn(grad, k.clip_scale);
  float p = master;
  p = __fsub_rn(p, __fmul_rn(k.decay, p));  // decoupled weight decay, before this step's update
  const float m_new = __fadd_rn(__fmul_rn(k.beta1, m), __fmul_rn(k.one_minus_beta1, g));
  const float v_new =
      __fadd_rn(__fmul_rn(k.beta2, v), __fmul_rn(k.one_minus_beta2, __fmul_rn(g, g)));
  const float m_hat = __fdiv_rn(m_new, k.bias1);
  const float v_hat = __fdiv_rn(v_new, k.bias2);
  p = __fsub_rn(p, __fdiv_rn(__fmul_rn(k.lr, m_hat), __fadd_rn(__fsqrt_rn(v_hat), k.eps)));
  m = m_new;
  v = v_new;
  master = p;
}

// --- sum of squares (LayerOps::sum_squares) ------------------------------------------------------
//
// The order of the FP64 additions, fixed by the count alone (never by the device, so the result
// has the same bits on every GPU), with T = kSumSquaresThreads and B = SumSquaresBlocks(count):
//   pass 1  B blocks of T threads, G = B T threads in all. Global thread g = b T + t adds x[g]^2,
//           x[g + G]^2, x[g + 2G]^2, ... in ascending order onto 0 (SumSquaresStrided). Block b
//           then adds its T sums s[0..T) in a pairwise tree: for w = T/2, T/4, ..., 1, every
//           t < w sets s[t] = s[t] + s[t + w]; s[0] is the block's partial p[b]. With B = 1 that is
//           the result.
//   pass 2  (B > 1) one block of T threads: thread t adds p[t], p[t + T], ... in ascending order
//           onto 0, then the same tree; s[0] is the result.
// Error: a square passes through at most h = ceil(count / G) + log2 T (+ ceil(B / T) + log2 T when
// B > 1) additions, so the result is within gamma_h S of the exact sum S (all terms are >= 0;
// Higham, "Accuracy and Stability of Numerical Algorithms", chapter 4): h is about count / 2^17,
// against count - 1 for the CPU's index order.
inline constexpr int kSumSquaresThreads = 256;  // threads per block, both passes; a power of two
// Pass 1 never has more blocks than this: 512 blocks of 256 threads keep ~4 MB of loads in flight
// (eight per thread), Little's law for an H200's ~4.8 TB/s at ~1 us of latency (sized, not
// measured), and they are one wave on any GPU with 64 or more SMs that hold 8 such blocks each.
inline constexpr int kSumSquaresMaxBlocks = 512;
// One more block per this many elements, up to the cap: a small count pays for one block (and no
// second pass), every thread of a multi-block grid has at least 8192 / 256 = 32 elements.
inline constexpr int64_t kSumSquaresPerBlock = 8192;

// B for `count` elements: ceil(count / kSumSquaresPerBlock), at least 1, at most
// kSumSquaresMaxBlocks. Host code (the entry picks the grid with it).
constexpr int SumSquaresBlocks(int64_t count) {
  const int64_t blocks = count / kSumSquaresPerBlock + (count % kSumSquaresPerBlock > 0 ? 1 : 0);
  if (blocks <= 1) return 1;
  return blocks >= kSumSquaresMaxBlocks ? kSumSquaresMaxBlocks : static_cast<int>(blocks);
}

// x[first]^2 + x[first + stride]^2 + ... over the indices below count, added in ascending order
// onto 0 in FP64: one thread's share of pass 1. Eight loads are in flight per step; the additions
// stay in order. Each square of an FP32 value is exact in FP64 (at most 48 significant bits, and
// 2^-298 <= x^2 < 2^256 for nonzero finite x), so whether the compiler fuses a multiply into its
// add changes nothing. NaN and Inf propagate.
__device__ __forceinline__ double SumSquaresStrided(const float* __restrict__ x, int64_t count,
                                                    int64_t first, int64_t stride) {
  double s = 0.0;
  int64_t i = first;
  for (; i + 7 * stride < count; i += 8 * stride) {
    const double a0 = x[i], a1 = x[i + stride], a2 = x[i + 2 * stride], a3 = x[i + 3 * stride],
                 a4 = x[i + 4 * stride], a5 = x[i + 5 * stride], a6 = x[i + 6 * stride],
                 a7 = x[i + 7 * stride];
    s += a0 * a0;
    s += a1 * a1;
    s += a2 * a2;
    s += a3 * a3;
    s += a4 * a4;
    s += a5 * a5;
    s += a6 * a6;
    s += a7 * a7;
  }
  for (; i < count; i += stride) {
    const double a = x[i];
    s += a * a;
  }
  return s;
}

}  // namespace fp8rt::kernels::cuda_internal

#endif  // FP8RT_KERNELS_CUDA_LAYER_MATH_CUH_
