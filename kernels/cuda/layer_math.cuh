// Internal: the per-element FP32 arithmetic of the CUDA layer ops (kernels/cuda/layer_ops_cuda.cu),
// each function a line-for-line mirror of the CPU reference expression it stands for
// (kernels/cpu/layer_ops_cpu.cc): the same operations on the same operands in the same order.
//
// Index:
//   AddF32                         a + b: ResidualForward, and every `+=` of a backward
//   GeluForwardOne, GeluBackwardOne  the tanh-approximation GELU and its accumulated gradient
//   RmsNormSquare, RmsNormRstd, RmsNormOut               forward, per element and per row
//   RmsNormGxTerm, RmsNormCoef, RmsNormDx, RmsNormDweightTerm   backward
//   LayerNormMean, LayerNormCentered, LayerNormSquare, LayerNormRstd, LayerNormOut   forward
//   LayerNormXhat, LayerNormG, LayerNormGxTerm, LayerNormDx, LayerNormDweightTerm    backward
//   RopeCosSin, RopeForwardPair, RopeBackwardPair   RoPE's angles (FP64) and rotation of a pair
//   SwigluSigmoid, SwigluForwardOne, SwigluBackwardOne   SwiGLU and its accumulated gradients
//   AdamWOne                       AdamWUpdate of one element
//   kSumSquares*, SumSquaresBlocks, SumSquaresStrided   the grid and the order of sum_squares
//
// Every rounding is an explicit round-to-nearest intrinsic (__fadd_rn, __fsub_rn, __fmul_rn,
// __fdiv_rn, __fsqrt_rn): nvcc never contracts those into a fused multiply-add, so each result is
// the IEEE FP32 result the host computes (the CPU reference is built with -std=c++20, which turns
// contraction off in GCC). Denormals are kept (-ftz=false, kernels/CMakeLists.txt). So AddF32,
// the RMSNorm and LayerNorm functions, the RoPE pair rotations and AdamWOne equal the CPU bit for
// bit on equal inputs; the reductions around the norm functions add in another order on the GPU,
// GELU calls the device tanhf and SwiGLU the device expf, which may differ from the host's by a
// few ulp, and RopeCosSin the device's FP64 pow, cos and sin, whose FP32 roundings may differ from
// the host's by an ulp (tests/gpu/layer_ops_cuda_test.cc bounds all of these).
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

// --- LayerNorm (kernels/layer_ops.h: LayerNormForward / LayerNormBackward) ---------------------

// mean = sum / C.
__device__ __forceinline__ float LayerNormMean(float sum, int64_t c) {
  return __fdiv_rn(sum, static_cast<float>(c));
}

// x - mean.
__device__ __forceinline__ float LayerNormCentered(float x, float mean) {
  return __fsub_rn(x, mean);
}

// One term d^2 (d = x - mean) of the row's sum of squared deviations.
__device__ __forceinline__ float LayerNormSquare(float d) { return __fmul_rn(d, d); }

// rstd = 1 / sqrt(sum_sq / C + eps) (the same expression as RMSNorm's).
__device__ __forceinline__ float LayerNormRstd(float sum_sq, int64_t c, float eps) {
  return RmsNormRstd(sum_sq, c, eps);
}

// out = ((x - mean) * rstd) * weight + bias.
__device__ __forceinline__ float LayerNormOut(float x, float mean, float rstd, float weight,
                                              float bias) {
  return __fadd_rn(__fmul_rn(__fmul_rn(__fsub_rn(x, mean), rstd), weight), bias);
}

// xhat = (x - mean) * rstd.
__device__ __forceinline__ float LayerNormXhat(float x, float mean, float rstd) {
  return __fmul_rn(__fsub_rn(x, mean), rstd);
}

// g = dout * weight.
__device__ __forceinline__ float LayerNormG(float dout, float weight) {
  return __fmul_rn(dout, weight);
}

// One term g * xhat of the backward's second row sum.
__device__ __forceinline__ float LayerNormGxTerm(float g, float xhat) { return __fmul_rn(g, xhat); }

// dx + ((g - g_mean) - xhat * gx_mean) * rstd.
__device__ __forceinline__ float LayerNormDx(float dx, float g, float g_mean, float xhat,
                                             float gx_mean, float rstd) {
  return __fadd_rn(dx, __fmul_rn(__fsub_rn(__fsub_rn(g, g_mean), __fmul_rn(xhat, gx_mean)), rstd));
}

// One term dout * xhat of dweight's column sum.
__device__ __forceinline__ float LayerNormDweightTerm(float dout, float xhat) {
  return __fmul_rn(dout, xhat);
}

// --- RoPE (kernels/layer_ops.h: RopeForward / RopeBackward) --------------------------------------

// cos and sin at position `pos`, frequency index i of a head of dh channels: inv_freq =
// theta^(-2i / dh) and the angle in FP64, cos and sin in FP64, each rounded once to FP32. The
// FP64 functions are the device's here (pow within 2 ulp, cos and sin within 2 ulp of FP64, CUDA
// Math API) and glibc's on the host: the FP32 results agree but where an FP64 value lies within a
// few FP64 ulp of a rounding boundary, an ulp apart then.
__device__ __forceinline__ void RopeCosSin(int64_t pos, int64_t i, int64_t dh, float theta,
                                           float& cos_out, float& sin_out) {
  const double inv_freq =
      pow(static_cast<double>(theta), -2.0 * static_cast<double>(i) / static_cast<double>(dh));
  const double angle = static_cast<double>(pos) * inv_freq;
  cos_out = static_cast<float>(cos(angle));
  sin_out = static_cast<float>(sin(angle));
}

// (a, b) = (x[i], x[i + Dh/2]) -> (a c - b s, b c + a s).
__device__ __forceinline__ void RopeForwardPair(float a, float b, float c, float s, float& out_a,
                                                float& out_b) {
  out_a = __fsub_rn(__fmul_rn(a, c), __fmul_rn(b, s));
  out_b = __fadd_rn(__fmul_rn(b, c), __fmul_rn(a, s));
}

// The transpose, accumulated: dx_a + (a c + b s), dx_b + (b c - a s) for (a, b) of dout.
__device__ __forceinline__ void RopeBackwardPair(float a, float b, float c, float s, float& dx_a,
                                                 float& dx_b) {
  dx_a = __fadd_rn(dx_a, __fadd_rn(__fmul_rn(a, c), __fmul_rn(b, s)));
  dx_b = __fadd_rn(dx_b, __fsub_rn(__fmul_rn(b, c), __fmul_rn(a, s)));
}

// --- SwiGLU (kernels/layer_ops.h: SwigluForward / SwigluBackward) --------------------------------

// s = 1 / (1 + exp(-gate)) (negation is exact).
__device__ __forceinline__ float SwigluSigmoid(float gate) {
  return __fdiv_rn(1.0f, __fadd_rn(1.0f, expf(-gate)));
}

// (gate * s) * up.
__device__ __forceinline__ float SwigluForwardOne(float gate, float up) {
  return __fmul_rn(__fmul_rn(gate, SwigluSigmoid(gate)), up);
}

// dgate + (dout * up) * (s * (1 + gate * (1 - s)));  dup + dout * (gate * s).
__device__ __forceinline__ void SwigluBackwardOne(float dout, float gate, float up, float& dgate,
                                                  float& dup) {
  const float s = SwigluSigmoid(gate);
  const float dsilu = __fmul_rn(s, __fadd_rn(1.0f, __fmul_rn(gate, __fsub_rn(1.0f, s))));
  dgate = __fadd_rn(dgate, __fmul_rn(__fmul_rn(dout, up), dsilu));
  dup = __fadd_rn(dup, __fmul_rn(dout, __fmul_rn(gate, s)));
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
