// Fused causal attention on tensor cores: the kernels behind the CUDA table's
// attention_forward_bf16 and attention_backward_bf16 entries (kernels/layer_ops.h; the entries,
// with their argument checks, are in kernels/cuda/attention_cuda.cu).
//
// Flash attention (Dao et al. 2022, FlashAttention-2's split of the work): tiles of kTile = 64
// query rows against tiles of 64 keys up to the diagonal, every matrix product on the tensor
// cores through WMMA (16 x 16 x 16, BF16 operands, FP32 accumulators), the tiles in shared
// memory, no [T, T] matrix anywhere. Head sizes up to kFlashMaxDh (128) are padded with zero
// columns to a multiple of 16.
//
// Kernels (four warps of 16 rows each per block; a block loops over its work items):
//   FlashForwardKernel   item (b, h, query tile): S = Q K^T per key tile, the online softmax
//                        (running maximum m and sum l per row, the output rescaled when m
//                        grows), O += P V; then out = O / l and lse = m + log l
//   FlashDqKernel        item (b, h, query tile): per key tile S = Q K^T and dP = dO V^T,
//                        P = exp(scale S - lse), dS = P (dP - D) scale, dQ += dS K; then dq += dQ
//   FlashDkDvKernel      item (b, kv head, key tile): for each query head of the group,
//                        ascending, each query tile from the diagonal on: S^T = K Q^T and
//                        dP^T = V dO^T, P^T and dS^T as above, dV += P^T dO, dK += dS^T Q; then
//                        dk += dK, dv += dV
// dq and the kv gradients come from two kernels, each owning what it writes, so nothing is added
// with atomics: reruns give the same bits. D_i = dout_i . out_i (FP32, one warp per row) is
// computed once per row, by FlashDqKernel as it loads its query tile, and kept in stream-ordered
// scratch ([B, H, T] floats, as lse) for FlashDkDvKernel, which reads it per query tile instead of
// recomputing it for every key tile.
//
// Launches: as many blocks as fit on the device at once (the runtime's occupancy for the kernel's
// shared memory, asked once per kernel, size and device), each looping over its work items. Tiles
// load four floats at a time where the rows allow it (Dh and the row stride multiples of 4, the
// base 16-byte aligned), one at a time otherwise: the same BF16 values either way.
//
// Numerics (the bounds of tests/support/attention_check.h, Precision::Bf16TensorCores): the
// operands of the matrix products (q, k, v, dout, p, ds) are rounded to BF16 (round to nearest
// even); products accumulate in FP32 on the tensor cores. The scale, the softmax (expf, logf),
// its running sums, D_i, the division by l and the final additions into dq, dk and dv are FP32,
// each an explicit round-to-nearest intrinsic as in the FP32 kernels.
#include <cuda_bf16.h>
#include <cuda_runtime.h>
#include <mma.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>

#include "absl/status/status.h"
#include "kernels/cuda/attention_common.cuh"
#include "kernels/cuda/cuda_ops_internal.h"
#include "kernels/cuda/launch.cuh"
#include "runtime/core/checks.h"
#include "runtime/core/status.h"

namespace fp8rt::kernels::cuda_internal {
namespace {

namespace wmma = nvcuda::wmma;
using attention::HeadView;
using attention::KvViewOf;
using attention::Prob;
using attention::ScoreGrad;
using attention::ViewOf;
using attention::WarpAllMax;
using attention::WarpAllSum;
using attention::WarpDot;
using Bf16 = __nv_bfloat16;

constexpr int kTile = 64;  // query rows and keys per tile
constexpr int kWarps = 4;  // each owns 16 rows of a tile
constexpr int kThreads = 32 * kWarps;
constexpr int kLdS = kTile + 4;  // row stride (floats) of [kTile, kTile] score tiles
constexpr int kLdP = kTile + 8;  // row stride (BF16) of [kTile, kTile] probability tiles

using FragA = wmma::fragment<wmma::matrix_a, 16, 16, 16, Bf16, wmma::row_major>;
using FragBRow = wmma::fragment<wmma::matrix_b, 16, 16, 16, Bf16, wmma::row_major>;
using FragBCol = wmma::fragment<wmma::matrix_b, 16, 16, 16, Bf16, wmma::col_major>;
using FragC = wmma::fragment<wmma::accumulator, 16, 16, 16, float>;

// Row strides of the [kTile, dhp] tiles: BF16 operands (a multiple of 8 elements, as WMMA
// requires, padded against bank conflicts) and FP32 accumulators (a multiple of 4).
struct Strides {
  int dhp;  // dh rounded up to 16
  int ldh;  // dhp + 8
  int ldo;  // dhp + 4
};
__host__ __device__ inline Strides StridesOf(int64_t dh) {
  const int dhp = static_cast<int>((dh + 15) / 16 * 16);
  return {dhp, dhp + 8, dhp + 4};
}

// Hands out 128-byte-aligned pieces of the block's dynamic shared memory. With a null base (on
// the host) it only counts the bytes, so that host and device carve the same layout.
struct Carver {
  unsigned char* base;
  size_t used = 0;
  template <class T>
  __host__ __device__ T* Take(size_t count) {
    used = (used + 127) / 128 * 128;
    T* p = reinterpret_cast<T*>(reinterpret_cast<uintptr_t>(base) + used);
    used += count * sizeof(T);
    return p;
  }
};

struct ForwardSmem {
  Bf16 *q, *k, *v, *p;
  float *s, *o, *m, *l, *alpha;
};
__host__ __device__ inline ForwardSmem CarveForward(Carver& c, const Strides& st) {
  ForwardSmem sm;
  sm.q = c.Take<Bf16>(kTile * st.ldh);
  sm.k = c.Take<Bf16>(kTile * st.ldh);
  sm.v = c.Take<Bf16>(kTile * st.ldh);
  sm.p = c.Take<Bf16>(kTile * kLdP);
  sm.s = c.Take<float>(kTile * kLdS);
  sm.o = c.Take<float>(kTile * st.ldo);
  sm.m = c.Take<float>(kTile);
  sm.l = c.Take<float>(kTile);
  sm.alpha = c.Take<float>(kTile);
  return sm;
}

// The backward kernels' tiles: the two [kTile, dhp] operand pairs, scores and their gradients
// (FP32, then BF16), the accumulators, and lse and D of the query tile's rows.
struct BackwardSmem {
  Bf16 *q, *dout, *k, *v, *p, *ds;
  float *s, *dp, *acc0, *acc1, *lse, *row_term;
};
__host__ __device__ inline BackwardSmem CarveBackward(Carver& c, const Strides& st,
                                                      bool two_accumulators) {
  BackwardSmem sm;
  sm.q = c.Take<Bf16>(kTile * st.ldh);
  sm.dout = c.Take<Bf16>(kTile * st.ldh);
  sm.k = c.Take<Bf16>(kTile * st.ldh);
  sm.v = c.Take<Bf16>(kTile * st.ldh);
  sm.p = two_accumulators ? c.Take<Bf16>(kTile * kLdP) : nullptr;
  sm.ds = c.Take<Bf16>(kTile * kLdP);
  sm.s = c.Take<float>(kTile * kLdS);
  sm.dp = c.Take<float>(kTile * kLdS);
  sm.acc0 = c.Take<float>(kTile * st.ldo);
  sm.acc1 = two_accumulators ? c.Take<float>(kTile * st.ldo) : nullptr;
  sm.lse = c.Take<float>(kTile);
  sm.row_term = c.Take<float>(kTile);
  return sm;
}

size_t ForwardSmemBytes(const Strides& st) {
  Carver c{nullptr};
  CarveForward(c, st);
  return c.used;
}
size_t BackwardSmemBytes(const Strides& st, bool two_accumulators) {
  Carver c{nullptr};
  CarveBackward(c, st, two_accumulators);
  return c.used;
}

// dst [kTile, ld] (BF16) = rows row0 .. row0 + kTile - 1 of src (row r at src + r * stride),
// zero for rows >= t and columns >= dh up to dhp. Every thread of the block takes part. Four
// columns at a time (one 16-byte load, two BF16 pairs stored) when every row's start is 16-byte
// aligned and dh a multiple of 4, so that a group of four is all inside dh or all past it; the
// same choice for every thread of the block. ld is a multiple of 8, so the pairs are aligned.
__device__ __forceinline__ void LoadTile(Bf16* dst, int ld, const float* src, int64_t stride,
                                         int64_t row0, int64_t t, int64_t dh, int dhp) {
  if (dh % 4 == 0 && stride % 4 == 0 && reinterpret_cast<uintptr_t>(src) % 16 == 0) {
    const int groups = dhp / 4;
    for (int e = threadIdx.x; e < kTile * groups; e += kThreads) {
      const int r = e / groups, c = (e - r * groups) * 4;
      const int64_t row = row0 + r;
      float4 x = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
      if (row < t && c < dh) x = *reinterpret_cast<const float4*>(src + row * stride + c);
      auto* pair = reinterpret_cast<__nv_bfloat162*>(dst + r * ld + c);
      pair[0] = __floats2bfloat162_rn(x.x, x.y);  // .x is the lower address, column c
      pair[1] = __floats2bfloat162_rn(x.z, x.w);
    }
    return;
  }
  for (int e = threadIdx.x; e < kTile * dhp; e += kThreads) {
    const int r = e / dhp, c = e - r * dhp;
    const int64_t row = row0 + r;
    const float x = row < t && c < dh ? src[row * stride + c] : 0.0f;
    dst[r * ld + c] = __float2bfloat16_rn(x);
  }
}

// C [16, kTile] (floats, row stride kLdS) = A B^T for this warp: A the 16 rows of a at a
// (row stride lda), B the kTile rows of b (row stride ldb), both dhp columns.
__device__ __forceinline__ void RowsTimesRowsT(float* c, const Bf16* a, int lda, const Bf16* b,
                                               int ldb, int dhp) {
  for (int n = 0; n < kTile; n += 16) {
    FragC acc;
    wmma::fill_fragment(acc, 0.0f);
    for (int kk = 0; kk < dhp; kk += 16) {
      FragA fa;
      FragBCol fb;  // B^T's element (kk, n) is b[n * ldb + kk]: column-major
      wmma::load_matrix_sync(fa, a + kk, lda);
      wmma::load_matrix_sync(fb, b + n * ldb + kk, ldb);
      wmma::mma_sync(acc, fa, fb, acc);
    }
    wmma::store_matrix_sync(c + n, acc, kLdS, wmma::mem_row_major);
  }
}

// C [16, dhp] (floats, row stride ldc) += A B for this warp: A [16, kTile] at a (row stride
// kLdP), B [kTile, dhp] at b (row stride ldb).
__device__ __forceinline__ void AccumulateRowsTimes(float* c, int ldc, const Bf16* a, const Bf16* b,
                                                    int ldb, int dhp) {
  for (int n = 0; n < dhp; n += 16) {
    FragC acc;
    wmma::load_matrix_sync(acc, c + n, ldc, wmma::mem_row_major);
    for (int kk = 0; kk < kTile; kk += 16) {
      FragA fa;
      FragBRow fb;
      wmma::load_matrix_sync(fa, a + kk, kLdP);
      wmma::load_matrix_sync(fb, b + kk * ldb + n, ldb);
      wmma::mma_sync(acc, fa, fb, acc);
    }
    wmma::store_matrix_sync(c + n, acc, ldc, wmma::mem_row_major);
  }
}

// lse and D_i = dout_i . out_i (FP32, one warp per row) of the query tile starting at row i0 of
// head view hv, into sm.lse and sm.row_term (0 for rows >= t), and D_i into
// row_terms[bh * t + i] for the rows < t.
__device__ __forceinline__ void ComputeRowStats(const BackwardSmem& sm, float* row_terms,
                                                const float* dout, const float* out,
                                                const float* lse, const HeadView& hv, int64_t i0,
                                                int64_t t, int64_t dh) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  for (int r = warp; r < kTile; r += kWarps) {
    const int64_t i = i0 + r;
    const int64_t at = hv.offset + i * hv.stride;
    const float d = i < t ? WarpDot(dout + at, out + at, dh, lane) : 0.0f;
    if (lane == 0) {
      sm.row_term[r] = d;
      sm.lse[r] = i < t ? lse[hv.bh * t + i] : 0.0f;
      if (i < t) row_terms[hv.bh * t + i] = d;
    }
  }
}

// lse and D_i of the query tile starting at row i0 of head view hv, read from lse and
// row_terms (ComputeRowStats' values), into sm.lse and sm.row_term (0 for rows >= t).
__device__ __forceinline__ void LoadRowStats(const BackwardSmem& sm, const float* row_terms,
                                             const float* lse, const HeadView& hv, int64_t i0,
                                             int64_t t) {
  for (int r = threadIdx.x; r < kTile; r += kThreads) {
    const int64_t i = i0 + r;
    sm.row_term[r] = i < t ? row_terms[hv.bh * t + i] : 0.0f;
    sm.lse[r] = i < t ? lse[hv.bh * t + i] : 0.0f;
  }
}

// dst[r][c] += acc[r][c] for the warp's 16 rows from row0 (rows < t, columns < dh).
__device__ __forceinline__ void AddRowsInto(float* dst, int64_t stride, const float* acc, int ldo,
                                            int r0, int64_t row0, int64_t t, int64_t dh) {
  const int lane = threadIdx.x & 31;
  for (int rr = 0; rr < 16; ++rr) {
    const int64_t row = row0 + r0 + rr;
    if (row >= t) break;  // uniform across the warp
    float* d = dst + row * stride;
    const float* a = acc + (r0 + rr) * ldo;
    for (int64_t c = lane; c < dh; c += 32) d[c] = __fadd_rn(d[c], a[c]);
  }
}

__global__ void __launch_bounds__(kThreads)
    FlashForwardKernel(float* __restrict__ out, float* __restrict__ lse,
                       const float* __restrict__ q, const float* __restrict__ k,
                       const float* __restrict__ v, int64_t b, int64_t t, int64_t h, int64_t hkv,
                       int64_t dh, float scale) {
  FP8RT_DYNAMIC_SHARED(unsigned char, smem);
  const Strides st = StridesOf(dh);
  Carver carver{smem};
  const ForwardSmem sm = CarveForward(carver, st);
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int r0 = warp * 16;  // this warp's rows of the tile
  const int64_t tiles = (t + kTile - 1) / kTile;
  for (int64_t item = blockIdx.x; item < b * h * tiles; item += gridDim.x) {
    // The longest rows (last query tiles) first.
    const int64_t bh = item / tiles;
    const int64_t i0 = (tiles - 1 - (item - bh * tiles)) * kTile;
    const HeadView hv = ViewOf(bh, t, h, dh);
    const HeadView kv = KvViewOf(bh, t, h, hkv, dh);
    __syncthreads();  // the previous item's tiles are no longer read
    LoadTile(sm.q, st.ldh, q + hv.offset, hv.stride, i0, t, dh, st.dhp);
    for (int e = threadIdx.x; e < kTile * st.ldo; e += kThreads) sm.o[e] = 0.0f;
    for (int r = threadIdx.x; r < kTile; r += kThreads) {
      sm.m[r] = -INFINITY;
      sm.l[r] = 0.0f;
    }
    const int64_t keys = min(t, i0 + kTile);  // causal: keys j <= the tile's last row
    for (int64_t j0 = 0; j0 < keys; j0 += kTile) {
      __syncthreads();  // the previous key tile is no longer read (and Q, O, m, l are written)
      LoadTile(sm.k, st.ldh, k + kv.offset, kv.stride, j0, t, dh, st.dhp);
      LoadTile(sm.v, st.ldh, v + kv.offset, kv.stride, j0, t, dh, st.dhp);
      __syncthreads();
      RowsTimesRowsT(sm.s + r0 * kLdS, sm.q + r0 * st.ldh, st.ldh, sm.k, st.ldh, st.dhp);
      __syncwarp();
      // The online softmax of the warp's rows: lane c and c + 32 of each row.
      for (int rr = 0; rr < 16; ++rr) {
        const int r = r0 + rr;
        const int64_t i = i0 + r;
        float x[2];
        bool valid[2];
        float tile_max = -INFINITY;
#pragma unroll
        for (int u = 0; u < 2; ++u) {
          const int64_t j = j0 + lane + 32 * u;
          valid[u] = i < t && j <= i;
          x[u] = valid[u] ? __fmul_rn(sm.s[r * kLdS + lane + 32 * u], scale) : -INFINITY;
          tile_max = fmaxf(tile_max, x[u]);
        }
        tile_max = WarpAllMax(tile_max);
        const float m_old = sm.m[r];
        const float m_new = fmaxf(m_old, tile_max);
        float sum = 0.0f;
#pragma unroll
        for (int u = 0; u < 2; ++u) {
          const float p = valid[u] ? expf(__fsub_rn(x[u], m_new)) : 0.0f;
          sum = __fadd_rn(sum, p);
          sm.p[r * kLdP + lane + 32 * u] = __float2bfloat16_rn(p);
        }
        sum = WarpAllSum(sum);
        // The running sum and output were relative to the old maximum (no rescaling while the
        // maximum stays; none from -inf, where both are still 0).
        const float alpha = m_new == m_old       ? 1.0f
                            : m_old == -INFINITY ? 0.0f
                                                 : expf(__fsub_rn(m_old, m_new));
        const float l_old = sm.l[r];
        __syncwarp();  // every lane has read m and l before lane 0 writes them
        if (lane == 0) {
          sm.m[r] = m_new;
          sm.l[r] = __fadd_rn(__fmul_rn(l_old, alpha), sum);
          sm.alpha[r] = alpha;
        }
      }
      __syncwarp();
      for (int e = lane; e < 16 * st.dhp; e += 32) {
        const int rr = e / st.dhp, c = e - rr * st.dhp;
        float* o = sm.o + (r0 + rr) * st.ldo + c;
        *o = __fmul_rn(*o, sm.alpha[r0 + rr]);
      }
      __syncwarp();
      AccumulateRowsTimes(sm.o + r0 * st.ldo, st.ldo, sm.p + r0 * kLdP, sm.v, st.ldh, st.dhp);
      __syncwarp();
    }
    for (int rr = 0; rr < 16; ++rr) {
      const int r = r0 + rr;
      const int64_t i = i0 + r;
      if (i >= t) break;  // uniform across the warp
      const float l = sm.l[r];
      float* oi = out + hv.offset + i * hv.stride;
      for (int64_t c = lane; c < dh; c += 32) oi[c] = __fdiv_rn(sm.o[r * st.ldo + c], l);
      if (lane == 0) lse[bh * t + i] = __fadd_rn(sm.m[r], logf(l));
    }
  }
}

__global__ void __launch_bounds__(kThreads)
    FlashDqKernel(float* __restrict__ dq, float* __restrict__ row_terms,
                  const float* __restrict__ dout, const float* __restrict__ q,
                  const float* __restrict__ k, const float* __restrict__ v,
                  const float* __restrict__ out, const float* __restrict__ lse, int64_t b,
                  int64_t t, int64_t h, int64_t hkv, int64_t dh, float scale) {
  FP8RT_DYNAMIC_SHARED(unsigned char, smem);
  const Strides st = StridesOf(dh);
  Carver carver{smem};
  const BackwardSmem sm = CarveBackward(carver, st, /*two_accumulators=*/false);
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int r0 = warp * 16;
  const int64_t tiles = (t + kTile - 1) / kTile;
  for (int64_t item = blockIdx.x; item < b * h * tiles; item += gridDim.x) {
    const int64_t bh = item / tiles;
    const int64_t i0 = (tiles - 1 - (item - bh * tiles)) * kTile;
    const HeadView hv = ViewOf(bh, t, h, dh);
    const HeadView kv = KvViewOf(bh, t, h, hkv, dh);
    __syncthreads();
    LoadTile(sm.q, st.ldh, q + hv.offset, hv.stride, i0, t, dh, st.dhp);
    LoadTile(sm.dout, st.ldh, dout + hv.offset, hv.stride, i0, t, dh, st.dhp);
    for (int e = threadIdx.x; e < kTile * st.ldo; e += kThreads) sm.acc0[e] = 0.0f;
    ComputeRowStats(sm, row_terms, dout, out, lse, hv, i0, t, dh);
    const int64_t keys = min(t, i0 + kTile);
    for (int64_t j0 = 0; j0 < keys; j0 += kTile) {
      __syncthreads();
      LoadTile(sm.k, st.ldh, k + kv.offset, kv.stride, j0, t, dh, st.dhp);
      LoadTile(sm.v, st.ldh, v + kv.offset, kv.stride, j0, t, dh, st.dhp);
      __syncthreads();
      RowsTimesRowsT(sm.s + r0 * kLdS, sm.q + r0 * st.ldh, st.ldh, sm.k, st.ldh, st.dhp);
      RowsTimesRowsT(sm.dp + r0 * kLdS, sm.dout + r0 * st.ldh, st.ldh, sm.v, st.ldh, st.dhp);
      __syncwarp();
      for (int e = lane; e < 16 * kTile; e += 32) {
        const int r = r0 + e / kTile, c = e % kTile;
        const int64_t i = i0 + r, j = j0 + c;
        float ds = 0.0f;
        if (i < t && j <= i) {
          const float p = Prob(__fmul_rn(sm.s[r * kLdS + c], scale), sm.lse[r]);
          ds = ScoreGrad(p, sm.dp[r * kLdS + c], sm.row_term[r], scale);
        }
        sm.ds[r * kLdP + c] = __float2bfloat16_rn(ds);
      }
      __syncwarp();
      AccumulateRowsTimes(sm.acc0 + r0 * st.ldo, st.ldo, sm.ds + r0 * kLdP, sm.k, st.ldh, st.dhp);
      __syncwarp();
    }
    AddRowsInto(dq + hv.offset, hv.stride, sm.acc0, st.ldo, r0, i0, t, dh);
  }
}

__global__ void __launch_bounds__(kThreads)
    FlashDkDvKernel(float* __restrict__ dk, float* __restrict__ dv, const float* __restrict__ dout,
                    const float* __restrict__ q, const float* __restrict__ k,
                    const float* __restrict__ v, const float* __restrict__ row_terms,
                    const float* __restrict__ lse, int64_t b, int64_t t, int64_t h, int64_t hkv,
                    int64_t dh, float scale) {
  FP8RT_DYNAMIC_SHARED(unsigned char, smem);
  const Strides st = StridesOf(dh);
  Carver carver{smem};
  const BackwardSmem sm = CarveBackward(carver, st, /*two_accumulators=*/true);
  float* dk_acc = sm.acc0;
  float* dv_acc = sm.acc1;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int r0 = warp * 16;  // this warp's keys of the tile
  const int64_t group = h / hkv;
  const int64_t tiles = (t + kTile - 1) / kTile;
  for (int64_t item = blockIdx.x; item < b * hkv * tiles; item += gridDim.x) {
    // The most queries (first key tiles) first.
    const int64_t bg = item / tiles;  // b * Hkv + g
    const int64_t j0 = (item - bg * tiles) * kTile;
    const int64_t bb = bg / hkv, g = bg - bb * hkv;
    // Query head g * group's kv view is kv head g's.
    const HeadView kv = KvViewOf(bb * h + g * group, t, h, hkv, dh);
    __syncthreads();
    LoadTile(sm.k, st.ldh, k + kv.offset, kv.stride, j0, t, dh, st.dhp);
    LoadTile(sm.v, st.ldh, v + kv.offset, kv.stride, j0, t, dh, st.dhp);
    for (int e = threadIdx.x; e < kTile * st.ldo; e += kThreads) dk_acc[e] = dv_acc[e] = 0.0f;
    for (int64_t hh = g * group; hh < (g + 1) * group; ++hh) {
      const HeadView hv = ViewOf(bb * h + hh, t, h, dh);
      for (int64_t i0 = j0; i0 < t; i0 += kTile) {  // causal: queries i >= the tile's first key
        __syncthreads();                            // the previous query tile is no longer read
        LoadTile(sm.q, st.ldh, q + hv.offset, hv.stride, i0, t, dh, st.dhp);
        LoadTile(sm.dout, st.ldh, dout + hv.offset, hv.stride, i0, t, dh, st.dhp);
        LoadRowStats(sm, row_terms, lse, hv, i0, t);
        __syncthreads();
        // Transposed: the warp's key rows against the tile's queries.
        RowsTimesRowsT(sm.s + r0 * kLdS, sm.k + r0 * st.ldh, st.ldh, sm.q, st.ldh, st.dhp);
        RowsTimesRowsT(sm.dp + r0 * kLdS, sm.v + r0 * st.ldh, st.ldh, sm.dout, st.ldh, st.dhp);
        __syncwarp();
        for (int e = lane; e < 16 * kTile; e += 32) {
          const int r = r0 + e / kTile, c = e % kTile;  // key r, query c of the tiles
          const int64_t j = j0 + r, i = i0 + c;
          float p = 0.0f, ds = 0.0f;
          if (i < t && j <= i) {
            p = Prob(__fmul_rn(sm.s[r * kLdS + c], scale), sm.lse[c]);
            ds = ScoreGrad(p, sm.dp[r * kLdS + c], sm.row_term[c], scale);
          }
          sm.p[r * kLdP + c] = __float2bfloat16_rn(p);
          sm.ds[r * kLdP + c] = __float2bfloat16_rn(ds);
        }
        __syncwarp();
        AccumulateRowsTimes(dv_acc + r0 * st.ldo, st.ldo, sm.p + r0 * kLdP, sm.dout, st.ldh,
                            st.dhp);
        AccumulateRowsTimes(dk_acc + r0 * st.ldo, st.ldo, sm.ds + r0 * kLdP, sm.q, st.ldh, st.dhp);
        __syncwarp();
      }
    }
    AddRowsInto(dk + kv.offset, kv.stride, dk_acc, st.ldo, r0, j0, t, dh);
    AddRowsInto(dv + kv.offset, kv.stride, dv_acc, st.ldo, r0, j0, t, dh);
  }
}

cudaStream_t ToCuda(Stream stream) { return static_cast<cudaStream_t>(stream.handle); }

// Launches `kernel` over `items` work items with `bytes` of dynamic shared memory: as many
// blocks as fit on the device at once (its occupancy at that size, at least one per
// multiprocessor), each looping over its items.
template <class Kernel, class... Args>
absl::Status LaunchFused(Kernel kernel, int64_t items, size_t bytes, cudaStream_t stream,
                         Args... args) {
  const void* fn = reinterpret_cast<const void*>(kernel);
  FP8RT_RETURN_IF_ERROR(AllowDynamicSharedMemory(fn, static_cast<int>(bytes)));
  FP8RT_ASSIGN_OR_RETURN(const int sms, CurrentDeviceSmCount());
  FP8RT_ASSIGN_OR_RETURN(const int per_sm, KernelBlocksPerSm(fn, kThreads, bytes));
  const unsigned grid = static_cast<unsigned>(GridFor(items, 1, sms, std::max(per_sm, 1)));
  FP8RT_LAUNCH(kernel, dim3(grid), dim3(kThreads), bytes, stream)(args...);
  CUDA_RETURN_IF_ERROR(cudaGetLastError());
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<bool> FlashAttentionFits(int64_t dh) {
  if (dh <= 0 || dh > kFlashMaxDh) return false;
  FP8RT_ASSIGN_OR_RETURN(const DeviceFacts facts, CurrentDeviceFacts());  // one cached lookup
  if (facts.compute_capability < 80) return false;                        // BF16 WMMA needs sm_80
  const Strides st = StridesOf(dh);
  const size_t most =
      std::max({ForwardSmemBytes(st), BackwardSmemBytes(st, false), BackwardSmemBytes(st, true)});
  return most <= static_cast<size_t>(facts.shared_optin);
}

absl::Status LaunchFlashForward(float* out, float* lse, const float* q, const float* k,
                                const float* v, int64_t b, int64_t t, int64_t h, int64_t hkv,
                                int64_t dh, float scale, Stream stream) {
  const int64_t tiles = (t + kTile - 1) / kTile;
  return LaunchFused(FlashForwardKernel, b * h * tiles, ForwardSmemBytes(StridesOf(dh)),
                     ToCuda(stream), out, lse, q, k, v, b, t, h, hkv, dh, scale);
}

absl::Status LaunchFlashBackward(float* dq, float* dk, float* dv, const float* dout, const float* q,
                                 const float* k, const float* v, const float* out, const float* lse,
                                 int64_t b, int64_t t, int64_t h, int64_t hkv, int64_t dh,
                                 float scale, Stream stream) {
  const int64_t tiles = (t + kTile - 1) / kTile;
  const Strides st = StridesOf(dh);
  const cudaStream_t s = ToCuda(stream);
  // D_i of every row: written by FlashDqKernel, read by FlashDkDvKernel after it on the stream.
  FP8RT_ASSIGN_OR_RETURN(void* const scratch,
                         AllocateOnStream("attention_backward_bf16",
                                          static_cast<size_t>(b * h * t) * sizeof(float), stream));
  float* const row_terms = static_cast<float*>(scratch);
  const absl::Status launched = [&]() -> absl::Status {
    FP8RT_RETURN_IF_ERROR(LaunchFused(FlashDqKernel, b * h * tiles, BackwardSmemBytes(st, false), s,
                                      dq, row_terms, dout, q, k, v, out, lse, b, t, h, hkv, dh,
                                      scale));
    return LaunchFused(FlashDkDvKernel, b * hkv * tiles, BackwardSmemBytes(st, true), s, dk, dv,
                       dout, q, k, v, static_cast<const float*>(row_terms), lse, b, t, h, hkv, dh,
                       scale);
  }();
  // Freed in stream order after whatever was enqueued, whether or not both launches went through.
  const cudaError_t freed = cudaFreeAsync(scratch, s);
  FP8RT_RETURN_IF_ERROR(launched);
  CUDA_RETURN_IF_ERROR(freed);
  return absl::OkStatus();
}

}  // namespace fp8rt::kernels::cuda_internal
