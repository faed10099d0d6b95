// Flash attention on the CPU (kernels/cpu/attention_cpu.h): oneDNN sgemm tiles, the online
// softmax in Highway (per-target code, dispatched at run time), tasks on the OpenMP team.
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
#include "oneapi/dnnl/dnnl.h"
#include "runtime/core/check.h"
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

// C [m, n] = alpha op(A) op(B) + beta C, row-major (oneDNN's sgemm; op = transpose where the
// flag is 'T'). Inside the team's tasks it runs on the calling thread (oneDNN runs sgemm
// sequentially within a parallel region), so a task's bits do not depend on the team.
HWY_INLINE void Sgemm(char ta, char tb, int64_t m, int64_t n, int64_t k, float alpha,
                      const float* a, int64_t lda, const float* b, int64_t ldb, float beta,
                      float* c, int64_t ldc) {
  const dnnl_status_t st = dnnl_sgemm(ta, tb, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc);
  FP8RT_CHECK(st == dnnl_success) << "attention tile sgemm " << m << "x" << n << "x" << k
                                  << ": oneDNN status " << static_cast<int>(st);
}

// a . b over n values: lane-wise FMAs, then the lanes in Highway's order, then the tail.
HWY_INLINE float DotOf(const float* a, const float* b, int64_t n) {
  const D d;
  const int64_t lanes = Lanes();
  V acc = hn::Zero(d);
  int64_t j = 0;
  for (; j + lanes <= n; j += lanes)
    acc = hn::MulAdd(hn::LoadU(d, a + j), hn::LoadU(d, b + j), acc);
  float sum = hn::GetLane(hn::SumOfLanes(d, acc));
  for (; j < n; ++j) sum = std::fma(a[j], b[j], sum);
  return sum;
}

// Where the tensors of one (batch row, query head) start and how far their rows are apart.
struct HeadPtrs {
  int64_t ld, ldkv;  // between positions: H * Dh in q, out, dout, dq; Hkv * Dh in k, v, dk, dv
  int64_t q, kv;     // offsets of position 0
};
HWY_INLINE HeadPtrs PtrsOf(int64_t bb, int64_t hh, int64_t t, int64_t h, int64_t hkv, int64_t dh) {
  const int64_t g = hh / (h / hkv);
  return {h * dh, hkv * dh, (bb * t * h + hh) * dh, (bb * t * hkv + g) * dh};
}

void AttentionForwardHeadTiles(float* out, float* lse, const float* q, const float* k,
                               const float* v, int64_t bb, int64_t hh, int64_t t, int64_t h,
                               int64_t hkv, int64_t dh, float* scratch) {
  const D d;
  const int64_t lanes = Lanes();
  const float scale = 1.0f / std::sqrt(static_cast<float>(dh));
  const HeadPtrs at = PtrsOf(bb, hh, t, h, hkv, dh);
  float* s = scratch;        // [kTq, kTk]: scores, then probabilities
  float* o = s + kTq * kTk;  // [kTq, dh]: the unnormalised output
  float* m = o + kTq * dh;   // [kTq]: running maxima
  float* l = m + kTq;        // [kTq]: running sums
  for (int64_t i0 = 0; i0 < t; i0 += kTq) {
    const int64_t mq = std::min(kTq, t - i0);
    std::fill_n(o, mq * dh, 0.0f);
    std::fill_n(m, mq, -std::numeric_limits<float>::infinity());
    std::fill_n(l, mq, 0.0f);
    for (int64_t j0 = 0; j0 < i0 + mq; j0 += kTk) {
      const int64_t nk = std::min(kTk, i0 + mq - j0);
      // S = scale Q K^T over the tile.
      Sgemm('N', 'T', mq, nk, dh, scale, q + at.q + i0 * at.ld, at.ld, k + at.kv + j0 * at.ldkv,
            at.ldkv, 0.0f, s, kTk);
      for (int64_t ii = 0; ii < mq; ++ii) {
        float* row = s + ii * kTk;
        const int64_t valid = std::clamp<int64_t>(i0 + ii - j0 + 1, 0, nk);  // keys j <= i
        float tile_max = -std::numeric_limits<float>::infinity();
        int64_t j = 0;
        if (valid >= lanes) {
          V mx = hn::LoadU(d, row);
          for (j = lanes; j + lanes <= valid; j += lanes) mx = hn::Max(mx, hn::LoadU(d, row + j));
          tile_max = hn::GetLane(hn::MaxOfLanes(d, mx));
        }
        for (; j < valid; ++j) tile_max = std::max(tile_max, row[j]);
        const float m_new = std::max(m[ii], tile_max);
        if (m_new > m[ii]) {  // (never for a row with no visible key: tile_max is -inf)
          // The running sum and output were relative to the old maximum.
          const float alpha =
              m[ii] == -std::numeric_limits<float>::infinity() ? 0.0f : std::exp(m[ii] - m_new);
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
        std::fill(row + valid, row + nk, 0.0f);  // masked: future keys
        l[ii] += sum;
      }
      // O += P V.
      Sgemm('N', 'N', mq, dh, nk, 1.0f, s, kTk, v + at.kv + j0 * at.ldkv, at.ldkv, 1.0f, o, dh);
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

void AttentionBackwardGroupTiles(float* dq, float* dk, float* dv, const float* dout, const float* q,
                                 const float* k, const float* v, const float* out, const float* lse,
                                 int64_t bb, int64_t g, int64_t t, int64_t h, int64_t hkv,
                                 int64_t dh, float* scratch) {
  const D d;
  const int64_t lanes = Lanes();
  const int64_t group = h / hkv;
  const float scale = 1.0f / std::sqrt(static_cast<float>(dh));
  float* p = scratch;                // [kTq, kTk]: scores, then probabilities
  float* ds = p + kTq * kTk;         // [kTq, kTk]: dP, then dS
  float* row_term = ds + kTq * kTk;  // [kTq]: D_i
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
      const float* qt = q + at.q + i0 * at.ld;
      const float* dot = dout + at.q + i0 * at.ld;
      for (int64_t j0 = 0; j0 < i0 + mq; j0 += kTk) {
        const int64_t nk = std::min(kTk, i0 + mq - j0);
        const int64_t kv_tile = at.kv + j0 * at.ldkv;
        // S = scale Q K^T and dP = dO V^T over the tile.
        Sgemm('N', 'T', mq, nk, dh, scale, qt, at.ld, k + kv_tile, at.ldkv, 0.0f, p, kTk);
        Sgemm('N', 'T', mq, nk, dh, 1.0f, dot, at.ld, v + kv_tile, at.ldkv, 0.0f, ds, kTk);
        for (int64_t ii = 0; ii < mq; ++ii) {
          float* prow = p + ii * kTk;
          float* drow = ds + ii * kTk;
          const int64_t valid = std::clamp<int64_t>(i0 + ii - j0 + 1, 0, nk);
          const float row_lse = lse_h[i0 + ii];
          const V lse_v = hn::Set(d, row_lse), d_v = hn::Set(d, row_term[ii]);
          int64_t j = 0;
          for (; j + lanes <= valid; j += lanes) {
            const V pj = ExpClamped(d, hn::Sub(hn::LoadU(d, prow + j), lse_v));
            hn::StoreU(pj, d, prow + j);
            hn::StoreU(hn::Mul(hn::Mul(pj, hn::Sub(hn::LoadU(d, drow + j), d_v)), scale_v), d,
                       drow + j);
          }
          for (; j < valid; ++j) {
            prow[j] = std::exp(prow[j] - row_lse);
            drow[j] = prow[j] * (drow[j] - row_term[ii]) * scale;
          }
          for (; j < nk; ++j) prow[j] = drow[j] = 0.0f;  // masked: future keys
        }
        // dQ += dS K;  dK += dS^T Q;  dV += P^T dO.
        Sgemm('N', 'N', mq, dh, nk, 1.0f, ds, kTk, k + kv_tile, at.ldkv, 1.0f,
              dq + at.q + i0 * at.ld, at.ld);
        Sgemm('T', 'N', nk, dh, mq, 1.0f, ds, kTk, qt, at.ld, 1.0f, dk + kv_tile, at.ldkv);
        Sgemm('T', 'N', nk, dh, mq, 1.0f, p, kTk, dot, at.ld, 1.0f, dv + kv_tile, at.ldkv);
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

// Scratch floats of one forward task (s, o, m, l) and one backward task (p, ds, row_term): the
// layouts at the top of the two task functions.
int64_t ForwardScratchFloats(int64_t dh) {
  return kAttentionTileQ * kAttentionTileK + kAttentionTileQ * dh + 2 * kAttentionTileQ;
}
int64_t BackwardScratchFloats() { return 2 * kAttentionTileQ * kAttentionTileK + kAttentionTileQ; }

// body(task, scratch) for every task in [0, tasks), statically split over the team, each thread
// with its own scratch of `floats`. The region is always active, so oneDNN's sgemm inside runs
// on the calling thread (its results then never depend on the team's size).
template <typename Body>
void OnTheTeam(int64_t tasks, int64_t floats, const Body& body) {
#pragma omp parallel
  {
    std::vector<float> scratch(static_cast<size_t>(floats));
#pragma omp for schedule(static)
    for (int64_t task = 0; task < tasks; ++task) body(task, scratch.data());
  }
}

}  // namespace

void AttentionForwardFast(float* out, float* lse, const float* q, const float* k, const float* v,
                          int64_t b, int64_t t, int64_t h, int64_t hkv, int64_t dh) {
  OnTheTeam(b * h, ForwardScratchFloats(dh), [&](int64_t task, float* scratch) {
    HWY_DYNAMIC_DISPATCH(AttentionForwardHeadTiles)
    (out, lse, q, k, v, task / h, task % h, t, h, hkv, dh, scratch);
  });
}

void AttentionBackwardFast(float* dq, float* dk, float* dv, const float* dout, const float* q,
                           const float* k, const float* v, const float* out, const float* lse,
                           int64_t b, int64_t t, int64_t h, int64_t hkv, int64_t dh) {
  OnTheTeam(b * hkv, BackwardScratchFloats(), [&](int64_t task, float* scratch) {
    HWY_DYNAMIC_DISPATCH(AttentionBackwardGroupTiles)
    (dq, dk, dv, dout, q, k, v, out, lse, task / hkv, task % hkv, t, h, hkv, dh, scratch);
  });
}

}  // namespace fp8rt::kernels::cpu_internal
#endif  // HWY_ONCE
