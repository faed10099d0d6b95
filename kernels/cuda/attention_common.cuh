// Device helpers shared by the CUDA attention kernels: the FP32 warp kernels
// (kernels/cuda/attention_cuda.cu) and the fused tensor-core kernels
// (kernels/cuda/flash_attention_cuda.cu). Every reduction has a fixed order (butterflies give
// every lane the same bits), and every operation outside the dot products is an explicit
// round-to-nearest intrinsic, so equal inputs give equal bits in every kernel.
#ifndef FP8RT_KERNELS_CUDA_ATTENTION_COMMON_CUH_
#define FP8RT_KERNELS_CUDA_ATTENTION_COMMON_CUH_

#include <cuda_runtime.h>

#include <cstdint>

namespace fp8rt::kernels::cuda_internal::attention {

inline constexpr unsigned kFullMask = 0xFFFFFFFFu;

__device__ __forceinline__ float WarpAllSum(float v) {
  for (int offset = 16; offset > 0; offset >>= 1) {
    v = __fadd_rn(v, __shfl_xor_sync(kFullMask, v, offset));
  }
  return v;
}

__device__ __forceinline__ float WarpAllMax(float v) {
  for (int offset = 16; offset > 0; offset >>= 1) {
    v = fmaxf(v, __shfl_xor_sync(kFullMask, v, offset));
  }
  return v;
}

// Where one (b, h) pair's rows start in a [B, T, H, Dh] tensor; its lse values are
// lse[bh * T + i]. The rows of positions 0, 1, ... of one head are `stride` = H * Dh floats apart.
struct HeadView {
  int64_t bh;      // b * H + h
  int64_t offset;  // of position 0 of this head in q, out and their gradients (or in k, v)
  int64_t stride;  // between consecutive positions
};

__device__ __forceinline__ HeadView ViewOf(int64_t bh, int64_t t, int64_t h, int64_t dh) {
  const int64_t b = bh / h, hh = bh - b * h;
  return {bh, (b * t * h + hh) * dh, h * dh};
}

// The kv head of query pair bh = b * H + hh in k, v, dk, dv [B, T, Hkv, Dh]: kv head
// hh / (H / Hkv), rows Hkv * Dh apart.
__device__ __forceinline__ HeadView KvViewOf(int64_t bh, int64_t t, int64_t h, int64_t hkv,
                                             int64_t dh) {
  const int64_t b = bh / h, hh = bh - b * h;
  const int64_t g = hh / (h / hkv);
  return {b * hkv + g, (b * t * hkv + g) * dh, hkv * dh};
}

// a . b over n values by one warp: each lane FMAs every 32nd product, then the butterfly. Every
// lane returns the same bits, and equal inputs give equal bits in every kernel.
__device__ __forceinline__ float WarpDot(const float* a, const float* b, int64_t n, int lane) {
  float s = 0.0f;
  for (int64_t d = lane; d < n; d += 32) s = __fmaf_rn(a[d], b[d], s);
  return WarpAllSum(s);
}

// s_ij = (q_i . k_j) * scale by one warp (every lane gets the same bits).
__device__ __forceinline__ float Score(const float* qi, const float* kj, int64_t dh, int lane,
                                       float scale) {
  return __fmul_rn(WarpDot(qi, kj, dh, lane), scale);
}

// p_ij = exp(s_ij - lse_i), the probability recomputed from the forward's log-sum-exp.
__device__ __forceinline__ float Prob(float s, float lse_i) { return expf(__fsub_rn(s, lse_i)); }

// D_i = dout_i . out_i (= sum_{j<=i} p_ij (dout_i . v_j), the softmax Jacobian's rank-one term),
// by one warp.
__device__ __forceinline__ float RowTerm(const float* dout_i, const float* out_i, int64_t dh,
                                         int lane) {
  return WarpDot(dout_i, out_i, dh, lane);
}

// ds_ij = p_ij (dp_ij - D_i) * scale, in the contract's order.
__device__ __forceinline__ float ScoreGrad(float p, float dp, float row_term, float scale) {
  return __fmul_rn(__fmul_rn(p, __fsub_rn(dp, row_term)), scale);
}

}  // namespace fp8rt::kernels::cuda_internal::attention

#endif  // FP8RT_KERNELS_CUDA_ATTENTION_COMMON_CUH_
