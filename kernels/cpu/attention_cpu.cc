// Flash attention on the CPU (kernels/cpu/attention_cpu.h): tile GEMMs and the online softmax in
// Highway (per-target code, dispatched at run time), tasks on the OpenMP team.
#undef HWY_TARGET_INCLUDE
#define HWY_TARGET_INCLUDE "kernels/cpu/attention_cpu.cc"
#include "hwy/foreach_target.h"  // IWYU pragma: keep
// Highway must come after foreach_target.
#include "hwy/contrib/math/math-inl.h"
#include "hwy/highway.h"

#ifndef FP8RT_KERNELS_CPU_ATTENTION_CPU_ONCE_
#define FP8RT_KERNELS_CPU_ATTENTION_CPU_ONCE_
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>

#include "kernels/cpu/attention_cpu.h"
#endif  // FP8RT_KERNELS_CPU_ATTENTION_CPU_ONCE_

HWY_BEFORE_NAMESPACE();
namespace fp8rt::kernels::cpu_internal {
namespace HWY_NAMESPACE {

namespace hn = hwy::HWY_NAMESPACE;
using D = hn::ScalableTag<float>;
using V = hn::Vec<D>;

constexpr int64_t kTq = kAttentionTileQ;
constexpr int64_t kTk = kAttentionTileK;

HWY_INLINE int64_t Lanes() { return static_cast<int64_t>(hn::Lanes(D())); }

// exp(x), as 0 where the float result is 0 (x < -104 and -Inf: Highway's Exp is not defined far
// below its underflow).
HWY_INLINE V ExpClamped(D d, V x) {
  const V lo = hn::Set(d, -104.0f);
  return hn::IfThenZeroElse(hn::Lt(x, lo), hn::Exp(d, hn::Max(x, lo)));
}

// kRows rows of C (+)= A B over the columns [j0, n): C rows ldc apart, A rows lda apart (kk
// values each), B [kk, n] rows ldb apart. Four vectors of columns at a time, then one, then the
// scalar tail; every product is an FMA into the accumulator, p ascending.
template <int kRows>
HWY_INLINE void GemmRows(float* c, int64_t ldc, const float* a, int64_t lda, const float* b,
                         int64_t ldb, int64_t n, int64_t kk, bool accumulate) {
  const D d;
  const int64_t lanes = Lanes();
  int64_t j = 0;
  for (; j + 4 * lanes <= n; j += 4 * lanes) {
    V acc[kRows][4];
    for (int r = 0; r < kRows; ++r) {
      for (int x = 0; x < 4; ++x) {
        acc[r][x] = accumulate ? hn::LoadU(d, c + r * ldc + j + x * lanes) : hn::Zero(d);
      }
    }
    for (int64_t p = 0; p < kk; ++p) {
      const float* bp = b + p * ldb + j;
      const V b0 = hn::LoadU(d, bp), b1 = hn::LoadU(d, bp + lanes),
              b2 = hn::LoadU(d, bp + 2 * lanes), b3 = hn::LoadU(d, bp + 3 * lanes);
      for (int r = 0; r < kRows; ++r) {
        const V av = hn::Set(d, a[r * lda + p]);
        acc[r][0] = hn::MulAdd(av, b0, acc[r][0]);
        acc[r][1] = hn::MulAdd(av, b1, acc[r][1]);
        acc[r][2] = hn::MulAdd(av, b2, acc[r][2]);
        acc[r][3] = hn::MulAdd(av, b3, acc[r][3]);
      }
    }
    for (int r = 0; r < kRows; ++r) {
      for (int x = 0; x < 4; ++x) hn::StoreU(acc[r][x], d, c + r * ldc + j + x * lanes);
    }
  }
  for (; j + lanes <= n; j += lanes) {
    V acc[kRows];
    for (int r = 0; r < kRows; ++r) {
      acc[r] = accumulate ? hn::LoadU(d, c + r * ldc + j) : hn::Zero(d);
    }
    for (int64_t p = 0; p < kk; ++p) {
      const V bv = hn::LoadU(d, b + p * ldb + j);
      for (int r = 0; r < kRows; ++r) acc[r] = hn::MulAdd(hn::Set(d, a[r * lda + p]), bv, acc[r]);
    }
    for (int r = 0; r < kRows; ++r) hn::StoreU(acc[r], d, c + r * ldc + j);
  }
  for (; j < n; ++j) {
    for (int r = 0; r < kRows; ++r) {
      float acc = accumulate ? c[r * ldc + j] : 0.0f;
      for (int64_t p = 0; p < kk; ++p) acc = std::fma(a[r * lda + p], b[p * ldb + j], acc);
      c[r * ldc + j] = acc;
    }
  }
}

// C [m, n] (+)= A [m, kk] B [kk, n], two rows of C at a time.
void TileGemm(float* c, int64_t ldc, const float* a, int64_t lda, const float* b, int64_t ldb,
              int64_t m, int64_t n, int64_t kk, bool accumulate) {
  int64_t i = 0;
  for (; i + 2 <= m; i += 2) {
    GemmRows<2>(c + i * ldc, ldc, a + i * lda, lda, b, ldb, n, kk, accumulate);
  }
  if (i < m) GemmRows<1>(c + i * ldc, ldc, a + i * lda, lda, b, ldb, n, kk, accumulate);
}

// dst [cols, rows] (leading dimension ld_dst) = the transpose of src [rows, cols] (ld_src).
void TransposeTile(float* dst, int64_t ld_dst, const float* src, int64_t ld_src, int64_t rows,
                   int64_t cols) {
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t c = 0; c < cols; ++c) dst[c * ld_dst + r] = src[r * ld_src + c];
  }
}

// a . b over n values: lane-wise FMAs, then the lanes in Highway's order, then the tail.
HWY_INLINE float DotOf(const float* a, const float* b, int64_t n) {
  const D d;
  const int64_t lanes = Lanes();
  V acc = hn::Zero(d);
  int64_t j = 0;
  for (; j + lanes <= n; j += lanes) acc = hn::MulAdd(hn::LoadU(d, a + j), hn::LoadU(d, b + j), acc);
  float sum = hn::GetLane(hn::SumOfLanes(d, acc));
  for (; j < n; ++j) sum = std::fma(a[j], b[j], sum);
  return sum;
}

// Where the tensors of one (batch row, query head) start and how far their rows are apart.
struct HeadPtrs {
  int64_t ld, ldkv;  // between positions: H * Dh in q, out, dout, dq; Hkv * Dh in k, v, dk, dv
  int64_t q, kv;     // offsets of position 0
};
HWY_INLINE HeadPtrs PtrsOf(int64_t bb, int64_t hh, int64_t t, int64_t h, int64_t hkv,
                           int64_t dh) {
  const int64_t g = hh / (h / hkv);
  return {h * dh, hkv * dh, (bb * t * h + hh) * dh, (bb * t * hkv + g) * dh};
}

// kt [dh, kTk] = the transpose of the rows [j0, j0 + nk) of a kv tensor (rows ld apart).
HWY_INLINE void KeysTransposed(float* kt, const float* x, int64_t ld, int64_t j0, int64_t nk,
                               int64_t dh) {
  TransposeTile(kt, kTk, x + j0 * ld, ld, nk, dh);
}

void AttentionForwardHeadTiles(float* out, float* lse, const float* q, const float* k,
                               const float* v, int64_t bb, int64_t hh, int64_t t, int64_t h,
                               int64_t hkv, int64_t dh, float* scratch) {
  const D d;
  const int64_t lanes = Lanes();
  const float scale = 1.0f / std::sqrt(static_cast<float>(dh));
  const HeadPtrs at = PtrsOf(bb, hh, t, h, hkv, dh);
  float* kt = scratch;             // [dh, kTk]
  float* s = kt + dh * kTk;        // [kTq, kTk]: scores, then probabilities
  float* o = s + kTq * kTk;        // [kTq, dh]: the unnormalised output
  float* m = o + kTq * dh;         // [kTq]: running maxima
  float* l = m + kTq;              // [kTq]: running sums
  const V scale_v = hn::Set(d, scale);
  for (int64_t i0 = 0; i0 < t; i0 += kTq) {
    const int64_t mq = std::min(kTq, t - i0);
    std::fill_n(o, mq * dh, 0.0f);
    std::fill_n(m, mq, -std::numeric_limits<float>::infinity());
    std::fill_n(l, mq, 0.0f);
    for (int64_t j0 = 0; j0 < i0 + mq; j0 += kTk) {
      const int64_t nk = std::min(kTk, i0 + mq - j0);
      KeysTransposed(kt, k + at.kv, at.ldkv, j0, nk, dh);
      TileGemm(s, kTk, q + at.q + i0 * at.ld, at.ld, kt, kTk, mq, nk, dh, false);
      for (int64_t ii = 0; ii < mq; ++ii) {
        float* row = s + ii * kTk;
        const int64_t valid = std::clamp<int64_t>(i0 + ii - j0 + 1, 0, nk);  // keys j <= i
        float tile_max = -std::numeric_limits<float>::infinity();
        int64_t j = 0;
        for (; j + lanes <= valid; j += lanes) {
          const V x = hn::Mul(hn::LoadU(d, row + j), scale_v);
          hn::StoreU(x, d, row + j);
          tile_max = std::max(tile_max, hn::GetLane(hn::MaxOfLanes(d, x)));
        }
        for (; j < valid; ++j) {
          row[j] *= scale;
          tile_max = std::max(tile_max, row[j]);
        }
        const float m_new = std::max(m[ii], tile_max);
        if (valid > 0 && m_new > m[ii]) {
          // The running sum and output were relative to the old maximum.
          const float alpha = m[ii] == -std::numeric_limits<float>::infinity()
                                  ? 0.0f
                                  : std::exp(m[ii] - m_new);
          l[ii] *= alpha;
          float* oi = o + ii * dh;
          for (int64_t c = 0; c < dh; ++c) oi[c] *= alpha;
          m[ii] = m_new;
        }
        const V m_v = hn::Set(d, m[ii]);
        V sum_v = hn::Zero(d);
        j = 0;
        for (; j + lanes <= valid; j += lanes) {
          const V e = ExpClamped(d, hn::Sub(hn::LoadU(d, row + j), m_v));
          hn::StoreU(e, d, row + j);
          sum_v = hn::Add(sum_v, e);
        }
        float sum = hn::GetLane(hn::SumOfLanes(d, sum_v));
        for (; j < valid; ++j) {
          row[j] = std::exp(row[j] - m[ii]);
          sum += row[j];
        }
        std::fill(row + std::max<int64_t>(valid, 0), row + nk, 0.0f);  // masked: future keys
        l[ii] += sum;
      }
      TileGemm(o, dh, s, kTk, v + at.kv + j0 * at.ldkv, at.ldkv, mq, dh, nk, true);
    }
    for (int64_t ii = 0; ii < mq; ++ii) {
      const int64_t i = i0 + ii;
      float* oi = out + at.q + i * at.ld;
      const float* acc = o + ii * dh;
      for (int64_t c = 0; c < dh; ++c) oi[c] = acc[c] / l[ii];
      lse[(bb * h + hh) * t + i] = m[ii] + std::log(l[ii]);
    }
  }
}

void AttentionBackwardGroupTiles(float* dq, float* dk, float* dv, const float* dout,
                                 const float* q, const float* k, const float* v, const float* out,
                                 const float* lse, int64_t bb, int64_t g, int64_t t, int64_t h,
                                 int64_t hkv, int64_t dh, float* scratch) {
  const D d;
  const int64_t lanes = Lanes();
  const int64_t group = h / hkv;
  const float scale = 1.0f / std::sqrt(static_cast<float>(dh));
  float* kt = scratch;         // [dh, kTk]
  float* vt = kt + dh * kTk;   // [dh, kTk]
  float* p = vt + dh * kTk;    // [kTq, kTk]: scores, then probabilities
  float* ds = p + kTq * kTk;   // [kTq, kTk]: dP, then dS
  float* pt = ds + kTq * kTk;  // [kTk, kTq]: P transposed
  float* dst = pt + kTk * kTq; // [kTk, kTq]: dS transposed
  float* row_term = dst + kTk * kTq;  // [kTq]: D_i
  const V scale_v = hn::Set(d, scale);
  for (int64_t hh = g * group; hh < (g + 1) * group; ++hh) {
    const HeadPtrs at = PtrsOf(bb, hh, t, h, hkv, dh);
    const float* lse_h = lse + (bb * h + hh) * t;
    for (int64_t i0 = 0; i0 < t; i0 += kTq) {
      const int64_t mq = std::min(kTq, t - i0);
      for (int64_t ii = 0; ii < mq; ++ii) {
        const int64_t row = at.q + (i0 + ii) * at.ld;
        row_term[ii] = DotOf(dout + row, out + row, dh);
      }
      for (int64_t j0 = 0; j0 < i0 + mq; j0 += kTk) {
        const int64_t nk = std::min(kTk, i0 + mq - j0);
        KeysTransposed(kt, k + at.kv, at.ldkv, j0, nk, dh);
        KeysTransposed(vt, v + at.kv, at.ldkv, j0, nk, dh);
        TileGemm(p, kTk, q + at.q + i0 * at.ld, at.ld, kt, kTk, mq, nk, dh, false);
        TileGemm(ds, kTk, dout + at.q + i0 * at.ld, at.ld, vt, kTk, mq, nk, dh, false);
        for (int64_t ii = 0; ii < mq; ++ii) {
          float* prow = p + ii * kTk;
          float* drow = ds + ii * kTk;
          const int64_t valid = std::clamp<int64_t>(i0 + ii - j0 + 1, 0, nk);
          const float row_lse = lse_h[i0 + ii];
          const V lse_v = hn::Set(d, row_lse), d_v = hn::Set(d, row_term[ii]);
          int64_t j = 0;
          for (; j + lanes <= valid; j += lanes) {
            const V pj = ExpClamped(d, hn::Sub(hn::Mul(hn::LoadU(d, prow + j), scale_v), lse_v));
            hn::StoreU(pj, d, prow + j);
            hn::StoreU(hn::Mul(hn::Mul(pj, hn::Sub(hn::LoadU(d, drow + j), d_v)), scale_v), d,
                       drow + j);
          }
          for (; j < valid; ++j) {
            prow[j] = std::exp(prow[j] * scale - row_lse);
            drow[j] = prow[j] * (drow[j] - row_term[ii]) * scale;
          }
          for (; j < nk; ++j) prow[j] = drow[j] = 0.0f;  // masked: future keys
        }
        TransposeTile(pt, kTq, p, kTk, mq, nk);
        TransposeTile(dst, kTq, ds, kTk, mq, nk);
        // dQ += dS K;  dK += dS^T Q;  dV += P^T dO.
        TileGemm(dq + at.q + i0 * at.ld, at.ld, ds, kTk, k + at.kv + j0 * at.ldkv, at.ldkv, mq, dh,
                 nk, true);
        TileGemm(dk + at.kv + j0 * at.ldkv, at.ldkv, dst, kTq, q + at.q + i0 * at.ld, at.ld, nk,
                 dh, mq, true);
        TileGemm(dv + at.kv + j0 * at.ldkv, at.ldkv, pt, kTq, dout + at.q + i0 * at.ld, at.ld, nk,
                 dh, mq, true);
      }
    }
  }
}

}  // namespace HWY_NAMESPACE
}  // namespace fp8rt::kernels::cpu_internal
HWY_AFTER_NAMESPACE();

#if HWY_ONCE
#include <vector>

namespace fp8rt::kernels::cpu_internal {

HWY_EXPORT(AttentionForwardHeadTiles);
HWY_EXPORT(AttentionBackwardGroupTiles);

namespace {

// Work below this many multiply-adds runs on the calling thread (a parallel region costs more).
constexpr int64_t kSerialBelow = int64_t{1} << 14;

// Scratch floats of one forward task (kt, s, o, m, l) and one backward task (kt, vt, p, ds, pt,
// dst, row_term): the layouts at the top of the two task functions.
int64_t ForwardScratchFloats(int64_t dh) {
  return dh * kAttentionTileK + kAttentionTileQ * kAttentionTileK + kAttentionTileQ * dh +
         2 * kAttentionTileQ;
}
int64_t BackwardScratchFloats(int64_t dh) {
  return 2 * dh * kAttentionTileK + 4 * kAttentionTileQ * kAttentionTileK + kAttentionTileQ;
}

}  // namespace

void AttentionForwardFast(float* out, float* lse, const float* q, const float* k, const float* v,
                          int64_t b, int64_t t, int64_t h, int64_t hkv, int64_t dh) {
  const int64_t tasks = b * h;
#pragma omp parallel if (tasks > 1 && t * t * dh >= kSerialBelow)
  {
    std::vector<float> scratch(static_cast<size_t>(ForwardScratchFloats(dh)));
#pragma omp for schedule(static)
    for (int64_t task = 0; task < tasks; ++task) {
      HWY_DYNAMIC_DISPATCH(AttentionForwardHeadTiles)(out, lse, q, k, v, task / h, task % h, t, h,
                                                      hkv, dh, scratch.data());
    }
  }
}

void AttentionBackwardFast(float* dq, float* dk, float* dv, const float* dout, const float* q,
                           const float* k, const float* v, const float* out, const float* lse,
                           int64_t b, int64_t t, int64_t h, int64_t hkv, int64_t dh) {
  const int64_t tasks = b * hkv;
#pragma omp parallel if (tasks > 1 && t * t * dh >= kSerialBelow)
  {
    std::vector<float> scratch(static_cast<size_t>(BackwardScratchFloats(dh)));
#pragma omp for schedule(static)
    for (int64_t task = 0; task < tasks; ++task) {
      HWY_DYNAMIC_DISPATCH(AttentionBackwardGroupTiles)(dq, dk, dv, dout, q, k, v, out, lse,
                                                        task / hkv, task % hkv, t, h, hkv, dh,
                                                        scratch.data());
    }
  }
}

}  // namespace fp8rt::kernels::cpu_internal
#endif  // HWY_ONCE
