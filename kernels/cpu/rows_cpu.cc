// The CPU layer ops of rows_cpu.h, vectorised with Highway (per-target code, dispatched at run
// time) and run on the OpenMP team. Rows are independent, so they are split into blocks across
// the team; sums over rows (weight, bias and embedding gradients) are split by column blocks,
// each of which adds the rows in ascending order as the reference does. No operation below is a
// fused multiply-add unless the reference's formula is one: the elementwise results equal the
// references bit for bit.
#undef HWY_TARGET_INCLUDE
#define HWY_TARGET_INCLUDE "kernels/cpu/rows_cpu.cc"
#include "hwy/foreach_target.h"  // IWYU pragma: keep
// Highway must come after foreach_target.
#include "hwy/contrib/math/math-inl.h"
#include "hwy/highway.h"

#ifndef FP8RT_KERNELS_CPU_ROWS_CPU_ONCE_
#define FP8RT_KERNELS_CPU_ROWS_CPU_ONCE_
#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdint>
#include <limits>
#endif  // FP8RT_KERNELS_CPU_ROWS_CPU_ONCE_

HWY_BEFORE_NAMESPACE();
namespace fp8rt::kernels::cpu_internal {
namespace HWY_NAMESPACE {

namespace hn = hwy::HWY_NAMESPACE;
using D = hn::ScalableTag<float>;
using V = hn::Vec<D>;

HWY_INLINE int64_t Lanes() { return static_cast<int64_t>(hn::Lanes(D())); }

// sum_j f(j) over a row of c elements: two vector accumulators over whole vectors (j ascending,
// alternating), combined and reduced in Highway's fixed lane order, then the scalar tail added
// in order. `vec(j)` gives the lanes at j, `one(j)` the scalar term.
template <typename VecTerm, typename OneTerm>
HWY_INLINE float RowSum(int64_t c, const VecTerm& vec, const OneTerm& one) {
  const D d;
  const int64_t lanes = Lanes();
  V acc0 = hn::Zero(d), acc1 = hn::Zero(d);
  int64_t j = 0;
  for (; j + 2 * lanes <= c; j += 2 * lanes) {
    acc0 = hn::Add(acc0, vec(j));
    acc1 = hn::Add(acc1, vec(j + lanes));
  }
  if (j + lanes <= c) {
    acc0 = hn::Add(acc0, vec(j));
    j += lanes;
  }
  float sum = hn::GetLane(hn::SumOfLanes(d, hn::Add(acc0, acc1)));
  for (; j < c; ++j) sum += one(j);
  return sum;
}

// Runs vec(j) over the whole vectors of [0, c) and one(j) over the scalar tail.
template <typename VecOp, typename OneOp>
HWY_INLINE void ForRow(int64_t c, const VecOp& vec, const OneOp& one) {
  const int64_t lanes = Lanes();
  int64_t j = 0;
  for (; j + lanes <= c; j += lanes) vec(j);
  for (; j < c; ++j) one(j);
}

// ---- RMSNorm ----

void RmsNormForwardRows(float* out, float* rstd, const float* x, const float* w, int64_t r0,
                        int64_t r1, int64_t c, float eps) {
  const D d;
  for (int64_t i = r0; i < r1; ++i) {
    const float* xi = x + i * c;
    float* oi = out + i * c;
    const float sum_sq = RowSum(
        c,
        [&](int64_t j) {
          const V v = hn::LoadU(d, xi + j);
          return hn::Mul(v, v);
        },
        [&](int64_t j) { return xi[j] * xi[j]; });
    const float r = 1.0f / std::sqrt(sum_sq / static_cast<float>(c) + eps);
    rstd[i] = r;
    const V rv = hn::Set(d, r);
    ForRow(
        c,
        [&](int64_t j) {
          hn::StoreU(hn::Mul(hn::Mul(hn::LoadU(d, xi + j), rv), hn::LoadU(d, w + j)), d, oi + j);
        },
        [&](int64_t j) { oi[j] = xi[j] * r * w[j]; });
  }
}

// dx only; dweight is a column sum (RmsNormDweightColumns).
void RmsNormBackwardRows(float* dx, const float* dout, const float* x, const float* w,
                         const float* rstd, int64_t r0, int64_t r1, int64_t c) {
  const D d;
  for (int64_t i = r0; i < r1; ++i) {
    const float* xi = x + i * c;
    const float* dyi = dout + i * c;
    float* dxi = dx + i * c;
    const float r = rstd[i];
    const float gx = RowSum(
        c,
        [&](int64_t j) {
          return hn::Mul(hn::Mul(hn::LoadU(d, dyi + j), hn::LoadU(d, w + j)), hn::LoadU(d, xi + j));
        },
        [&](int64_t j) { return dyi[j] * w[j] * xi[j]; });
    const float coef = r * r * r * gx / static_cast<float>(c);
    const V rv = hn::Set(d, r), cv = hn::Set(d, coef);
    ForRow(
        c,
        [&](int64_t j) {
          const V t = hn::Sub(hn::Mul(hn::Mul(rv, hn::LoadU(d, dyi + j)), hn::LoadU(d, w + j)),
                              hn::Mul(cv, hn::LoadU(d, xi + j)));
          hn::StoreU(hn::Add(hn::LoadU(d, dxi + j), t), d, dxi + j);
        },
        [&](int64_t j) { dxi[j] += r * dyi[j] * w[j] - coef * xi[j]; });
  }
}

// dweight[j0, j1) += sum over rows i ascending of dout * x * rstd (the reference's order).
void RmsNormDweightColumns(float* dweight, const float* dout, const float* x, const float* rstd,
                           int64_t n, int64_t c, int64_t j0, int64_t j1) {
  const D d;
  const int64_t lanes = Lanes();
  int64_t j = j0;
  for (; j + lanes <= j1; j += lanes) {
    V acc = hn::LoadU(d, dweight + j);
    for (int64_t i = 0; i < n; ++i) {
      acc = hn::Add(acc, hn::Mul(hn::Mul(hn::LoadU(d, dout + i * c + j), hn::LoadU(d, x + i * c + j)),
                                 hn::Set(d, rstd[i])));
    }
    hn::StoreU(acc, d, dweight + j);
  }
  for (; j < j1; ++j) {
    for (int64_t i = 0; i < n; ++i) dweight[j] += dout[i * c + j] * x[i * c + j] * rstd[i];
  }
}

// ---- LayerNorm ----

void LayerNormForwardRows(float* out, float* mean, float* rstd, const float* x, const float* w,
                          const float* b, int64_t r0, int64_t r1, int64_t c, float eps) {
  const D d;
  for (int64_t i = r0; i < r1; ++i) {
    const float* xi = x + i * c;
    float* oi = out + i * c;
    const float sum = RowSum(
        c, [&](int64_t j) { return hn::LoadU(d, xi + j); }, [&](int64_t j) { return xi[j]; });
    const float m = sum / static_cast<float>(c);
    const V mv = hn::Set(d, m);
    const float sum_sq = RowSum(
        c,
        [&](int64_t j) {
          const V dv = hn::Sub(hn::LoadU(d, xi + j), mv);
          return hn::Mul(dv, dv);
        },
        [&](int64_t j) {
          const float dj = xi[j] - m;
          return dj * dj;
        });
    const float r = 1.0f / std::sqrt(sum_sq / static_cast<float>(c) + eps);
    mean[i] = m;
    rstd[i] = r;
    const V rv = hn::Set(d, r);
    ForRow(
        c,
        [&](int64_t j) {
          const V y = hn::Mul(hn::Mul(hn::Sub(hn::LoadU(d, xi + j), mv), rv), hn::LoadU(d, w + j));
          hn::StoreU(hn::Add(y, hn::LoadU(d, b + j)), d, oi + j);
        },
        [&](int64_t j) { oi[j] = (xi[j] - m) * r * w[j] + b[j]; });
  }
}

// dx only; dweight and dbias are column sums (LayerNormDparamColumns).
void LayerNormBackwardRows(float* dx, const float* dout, const float* x, const float* w,
                           const float* mean, const float* rstd, int64_t r0, int64_t r1,
                           int64_t c) {
  const D d;
  for (int64_t i = r0; i < r1; ++i) {
    const float* xi = x + i * c;
    const float* dyi = dout + i * c;
    float* dxi = dx + i * c;
    const float m = mean[i], r = rstd[i];
    const V mv = hn::Set(d, m), rv = hn::Set(d, r);
    auto xhat = [&](int64_t j) { return hn::Mul(hn::Sub(hn::LoadU(d, xi + j), mv), rv); };
    auto g = [&](int64_t j) { return hn::Mul(hn::LoadU(d, dyi + j), hn::LoadU(d, w + j)); };
    const float g_sum = RowSum(c, g, [&](int64_t j) { return dyi[j] * w[j]; });
    const float gx_sum = RowSum(
        c, [&](int64_t j) { return hn::Mul(g(j), xhat(j)); },
        [&](int64_t j) { return (dyi[j] * w[j]) * ((xi[j] - m) * r); });
    const float g_mean = g_sum / static_cast<float>(c);
    const float gx_mean = gx_sum / static_cast<float>(c);
    const V gm = hn::Set(d, g_mean), gxm = hn::Set(d, gx_mean);
    ForRow(
        c,
        [&](int64_t j) {
          const V t = hn::Mul(hn::Sub(hn::Sub(g(j), gm), hn::Mul(xhat(j), gxm)), rv);
          hn::StoreU(hn::Add(hn::LoadU(d, dxi + j), t), d, dxi + j);
        },
        [&](int64_t j) {
          const float xh = (xi[j] - m) * r;
          const float gj = dyi[j] * w[j];
          dxi[j] += (gj - g_mean - xh * gx_mean) * r;
        });
  }
}

// dweight[j0, j1) += sum_i dout * xhat and dbias[j0, j1) += sum_i dout, rows ascending.
void LayerNormDparamColumns(float* dweight, float* dbias, const float* dout, const float* x,
                            const float* mean, const float* rstd, int64_t n, int64_t c,
                            int64_t j0, int64_t j1) {
  const D d;
  const int64_t lanes = Lanes();
  int64_t j = j0;
  for (; j + lanes <= j1; j += lanes) {
    V dw = hn::LoadU(d, dweight + j), db = hn::LoadU(d, dbias + j);
    for (int64_t i = 0; i < n; ++i) {
      const V dy = hn::LoadU(d, dout + i * c + j);
      const V xhat =
          hn::Mul(hn::Sub(hn::LoadU(d, x + i * c + j), hn::Set(d, mean[i])), hn::Set(d, rstd[i]));
      dw = hn::Add(dw, hn::Mul(dy, xhat));
      db = hn::Add(db, dy);
    }
    hn::StoreU(dw, d, dweight + j);
    hn::StoreU(db, d, dbias + j);
  }
  for (; j < j1; ++j) {
    for (int64_t i = 0; i < n; ++i) {
      const float dy = dout[i * c + j];
      dweight[j] += dy * ((x[i * c + j] - mean[i]) * rstd[i]);
      dbias[j] += dy;
    }
  }
}

// ---- Bias, residual, embedding: elementwise or column sums in row order ----

void BiasForwardRows(float* out, const float* bias, int64_t r0, int64_t r1, int64_t c) {
  const D d;
  for (int64_t i = r0; i < r1; ++i) {
    float* oi = out + i * c;
    ForRow(
        c, [&](int64_t j) { hn::StoreU(hn::Add(hn::LoadU(d, oi + j), hn::LoadU(d, bias + j)), d, oi + j); },
        [&](int64_t j) { oi[j] += bias[j]; });
  }
}

// dst[j0, j1) += sum over rows i ascending of src[row_of(i), :] (row_of(i) = i: the bias
// gradient; the token ids: the embedding gradient, dst[tokens[i]] += dout[i]).
void ColumnSums(float* dst, const float* src, const int32_t* tokens, int64_t n, int64_t c,
                int64_t j0, int64_t j1) {
  const D d;
  const int64_t lanes = Lanes();
  if (tokens == nullptr) {
    int64_t j = j0;
    for (; j + lanes <= j1; j += lanes) {
      V acc = hn::LoadU(d, dst + j);
      for (int64_t i = 0; i < n; ++i) acc = hn::Add(acc, hn::LoadU(d, src + i * c + j));
      hn::StoreU(acc, d, dst + j);
    }
    for (; j < j1; ++j) {
      for (int64_t i = 0; i < n; ++i) dst[j] += src[i * c + j];
    }
    return;
  }
  for (int64_t i = 0; i < n; ++i) {
    float* row = dst + static_cast<int64_t>(tokens[i]) * c;
    const float* s = src + i * c;
    int64_t j = j0;
    for (; j + lanes <= j1; j += lanes) {
      hn::StoreU(hn::Add(hn::LoadU(d, row + j), hn::LoadU(d, s + j)), d, row + j);
    }
    for (; j < j1; ++j) row[j] += s[j];
  }
}

void ResidualForwardSpan(float* out, const float* a, const float* b, int64_t n) {
  const D d;
  ForRow(
      n, [&](int64_t j) { hn::StoreU(hn::Add(hn::LoadU(d, a + j), hn::LoadU(d, b + j)), d, out + j); },
      [&](int64_t j) { out[j] = a[j] + b[j]; });
}

void ResidualBackwardSpan(float* da, float* db, const float* dout, int64_t n) {
  const D d;
  ForRow(
      n,
      [&](int64_t j) {
        const V g = hn::LoadU(d, dout + j);
        hn::StoreU(hn::Add(hn::LoadU(d, da + j), g), d, da + j);
        hn::StoreU(hn::Add(hn::LoadU(d, db + j), g), d, db + j);
      },
      [&](int64_t j) {
        da[j] += dout[j];
        db[j] += dout[j];
      });
}

// ---- RoPE, from a (cos, sin) table [t, dh / 2] ----

void RopeRows(bool forward, float* out, const float* in, const float* cos_t, const float* sin_t,
              int64_t r0, int64_t r1, int64_t t, int64_t h, int64_t dh) {
  const D d;
  const int64_t half = dh / 2;
  for (int64_t r = r0; r < r1; ++r) {
    const float* cr = cos_t + (r % t) * half;
    const float* sr = sin_t + (r % t) * half;
    for (int64_t hh = 0; hh < h; ++hh) {
      const int64_t base = (r * h + hh) * dh;
      const float* ia = in + base;
      const float* ib = in + base + half;
      float* oa = out + base;
      float* ob = out + base + half;
      if (forward) {
        ForRow(
            half,
            [&](int64_t i) {
              const V a = hn::LoadU(d, ia + i), b = hn::LoadU(d, ib + i);
              const V c = hn::LoadU(d, cr + i), s = hn::LoadU(d, sr + i);
              hn::StoreU(hn::Sub(hn::Mul(a, c), hn::Mul(b, s)), d, oa + i);
              hn::StoreU(hn::Add(hn::Mul(b, c), hn::Mul(a, s)), d, ob + i);
            },
            [&](int64_t i) {
              const float a = ia[i], b = ib[i];
              oa[i] = a * cr[i] - b * sr[i];
              ob[i] = b * cr[i] + a * sr[i];
            });
      } else {
        ForRow(
            half,
            [&](int64_t i) {
              const V a = hn::LoadU(d, ia + i), b = hn::LoadU(d, ib + i);
              const V c = hn::LoadU(d, cr + i), s = hn::LoadU(d, sr + i);
              hn::StoreU(hn::Add(hn::LoadU(d, oa + i), hn::Add(hn::Mul(a, c), hn::Mul(b, s))), d,
                         oa + i);
              hn::StoreU(hn::Add(hn::LoadU(d, ob + i), hn::Sub(hn::Mul(b, c), hn::Mul(a, s))), d,
                         ob + i);
            },
            [&](int64_t i) {
              const float a = ia[i], b = ib[i];
              oa[i] += a * cr[i] + b * sr[i];
              ob[i] += b * cr[i] - a * sr[i];
            });
      }
    }
  }
}

// ---- Cross-entropy ----

// exp(x) for x <= 0, as 0 where the float result is 0 (x < -104 and -Inf; Highway's Exp is not
// defined far below its underflow).
HWY_INLINE V ExpNonPositive(D d, V x) {
  const V lo = hn::Set(d, -104.0f);
  return hn::IfThenZeroElse(hn::Lt(x, lo), hn::Exp(d, hn::Max(x, lo)));
}

void CrossEntropyForwardRows(float* probs, float* losses, const float* logits,
                             const int32_t* targets, int64_t r0, int64_t r1, int64_t v) {
  const D d;
  for (int64_t i = r0; i < r1; ++i) {
    const float* li = logits + i * v;
    float* pi = probs + i * v;
    // The reference's max (exact in any order; the same course as the reference for NaNs).
    const float max_logit = *std::max_element(li, li + v);
    const V maxv = hn::Set(d, max_logit);
    const float sum = RowSum(
        v,
        [&](int64_t j) {
          const V e = ExpNonPositive(d, hn::Sub(hn::LoadU(d, li + j), maxv));
          hn::StoreU(e, d, pi + j);
          return e;
        },
        [&](int64_t j) {
          pi[j] = std::exp(li[j] - max_logit);
          return pi[j];
        });
    const float inv_sum = 1.0f / sum;
    const V iv = hn::Set(d, inv_sum);
    ForRow(
        v, [&](int64_t j) { hn::StoreU(hn::Mul(hn::LoadU(d, pi + j), iv), d, pi + j); },
        [&](int64_t j) { pi[j] *= inv_sum; });
    losses[i] = max_logit + std::log(sum) - li[targets[i]];
  }
}

void CrossEntropyBackwardRows(float* dlogits, const float* probs, const int32_t* targets,
                              int64_t r0, int64_t r1, int64_t v, float row_scale) {
  const D d;
  const V sv = hn::Set(d, row_scale);
  for (int64_t i = r0; i < r1; ++i) {
    float* gi = dlogits + i * v;
    const float* pi = probs + i * v;
    const int64_t target = targets[i];
    const float g_target = gi[target];
    ForRow(
        v,
        [&](int64_t j) {
          hn::StoreU(hn::Add(hn::LoadU(d, gi + j), hn::Mul(sv, hn::LoadU(d, pi + j))), d, gi + j);
        },
        [&](int64_t j) { gi[j] += row_scale * pi[j]; });
    // The target's term is row_scale * (p - 1), added to the value it had before.
    gi[target] = g_target + row_scale * (pi[target] - 1.0f);
  }
}

// ---- Transposes: 128-bit squares (4 x 4 floats, 16 x 16 bytes) in registers ----

#if HWY_TARGET != HWY_SCALAR
// dst[c * ld_dst + r] = src[r * ld_src + c] for an N x N square, N the lanes of a 128-bit vector:
// log2(N) perfect shuffles, each interleaving row i with row i + N / 2.
template <typename T>
HWY_INLINE void TransposeSquare(T* dst, int64_t ld_dst, const T* src, int64_t ld_src) {
  const hn::FixedTag<T, 16 / sizeof(T)> d;
  constexpr int64_t kN = 16 / sizeof(T);
  using VT = hn::Vec<decltype(d)>;
  VT r[kN];
  for (int64_t i = 0; i < kN; ++i) r[i] = hn::LoadU(d, src + i * ld_src);
  for (int64_t stage = 1; stage < kN; stage *= 2) {
    VT t[kN];
    for (int64_t i = 0; i < kN / 2; ++i) {
      t[2 * i] = hn::InterleaveLower(d, r[i], r[i + kN / 2]);
      t[2 * i + 1] = hn::InterleaveUpper(d, r[i], r[i + kN / 2]);
    }
    for (int64_t i = 0; i < kN; ++i) r[i] = t[i];
  }
  for (int64_t i = 0; i < kN; ++i) hn::StoreU(r[i], d, dst + i * ld_dst);
}
#endif

// Rows [r0, r1) of src [rows, cols] into dst [cols, rows], in 32-column blocks; whole squares in
// registers, the ragged edges element by element. A copy: bit for bit.
template <typename T>
HWY_INLINE void TransposeRowsOf(T* dst, const T* src, int64_t rows, int64_t cols, int64_t r0,
                                int64_t r1) {
  constexpr int64_t kBlock = 32;
#if HWY_TARGET != HWY_SCALAR
  constexpr int64_t kN = 16 / sizeof(T);
#else
  constexpr int64_t kN = 1 << 30;  // no squares: everything element by element
#endif
  for (int64_t c0 = 0; c0 < cols; c0 += kBlock) {
    const int64_t c1 = std::min(cols, c0 + kBlock);
    int64_t r = r0;
    for (; r + kN <= r1; r += kN) {
      int64_t c = c0;
#if HWY_TARGET != HWY_SCALAR
      for (; c + kN <= c1; c += kN) {
        TransposeSquare(dst + c * rows + r, rows, src + r * cols + c, cols);
      }
#endif
      for (; c < c1; ++c) {
        for (int64_t rr = r; rr < r + kN; ++rr) dst[c * rows + rr] = src[rr * cols + c];
      }
    }
    for (; r < r1; ++r) {
      for (int64_t c = c0; c < c1; ++c) dst[c * rows + r] = src[r * cols + c];
    }
  }
}

void TransposeRowsF32(float* dst, const float* src, int64_t rows, int64_t cols, int64_t r0,
                      int64_t r1) {
  TransposeRowsOf(dst, src, rows, cols, r0, r1);
}
void TransposeRowsU8(uint8_t* dst, const uint8_t* src, int64_t rows, int64_t cols, int64_t r0,
                     int64_t r1) {
  TransposeRowsOf(dst, src, rows, cols, r0, r1);
}

// ---- AdamW ----

// The update of [begin, end) (kernels/layer_ops.h's formula, each operation rounded to FP32).
void AdamWSpan(float* master, const float* grad, float* m, float* v, int64_t begin, int64_t end,
               float lr, float decay, float clip, float b1, float omb1, float b2, float omb2,
               float bias1, float bias2, float eps) {
  const D d;
  const V lr_v = hn::Set(d, lr), decay_v = hn::Set(d, decay), clip_v = hn::Set(d, clip);
  const V b1v = hn::Set(d, b1), omb1v = hn::Set(d, omb1), b2v = hn::Set(d, b2),
          omb2v = hn::Set(d, omb2), bias1v = hn::Set(d, bias1), bias2v = hn::Set(d, bias2),
          epsv = hn::Set(d, eps);
  const int64_t lanes = Lanes();
  int64_t i = begin;
  for (; i + lanes <= end; i += lanes) {
    const V g = hn::Mul(hn::LoadU(d, grad + i), clip_v);
    V p = hn::LoadU(d, master + i);
    p = hn::Sub(p, hn::Mul(decay_v, p));
    const V mi = hn::Add(hn::Mul(b1v, hn::LoadU(d, m + i)), hn::Mul(omb1v, g));
    const V vi = hn::Add(hn::Mul(b2v, hn::LoadU(d, v + i)), hn::Mul(omb2v, hn::Mul(g, g)));
    const V m_hat = hn::Div(mi, bias1v);
    const V v_hat = hn::Div(vi, bias2v);
    p = hn::Sub(p, hn::Div(hn::Mul(lr_v, m_hat), hn::Add(hn::Sqrt(v_hat), epsv)));
    hn::StoreU(mi, d, m + i);
    hn::StoreU(vi, d, v + i);
    hn::StoreU(p, d, master + i);
  }
  for (; i < end; ++i) {
    const float g = grad[i] * clip;
    float p = master[i];
    p -= decay * p;
    const float mi = b1 * m[i] + omb1 * g;
    const float vi = b2 * v[i] + omb2 * (g * g);
    const float m_hat = mi / bias1;
    const float v_hat = vi / bias2;
    p -= lr * m_hat / (std::sqrt(v_hat) + eps);
    m[i] = mi;
    v[i] = vi;
    master[i] = p;
  }
}

}  // namespace HWY_NAMESPACE
}  // namespace fp8rt::kernels::cpu_internal
HWY_AFTER_NAMESPACE();

#if HWY_ONCE
#include <vector>

#include "kernels/cpu/cpu_ops.h"
#include "kernels/cpu/quantize_one.h"
#include "kernels/cpu/rows_cpu.h"
#include "runtime/core/check.h"
#include "runtime/core/status.h"

namespace fp8rt::kernels::cpu_internal {

HWY_EXPORT(RmsNormForwardRows);
HWY_EXPORT(RmsNormBackwardRows);
HWY_EXPORT(RmsNormDweightColumns);
HWY_EXPORT(LayerNormForwardRows);
HWY_EXPORT(LayerNormBackwardRows);
HWY_EXPORT(LayerNormDparamColumns);
HWY_EXPORT(BiasForwardRows);
HWY_EXPORT(ColumnSums);
HWY_EXPORT(ResidualForwardSpan);
HWY_EXPORT(ResidualBackwardSpan);
HWY_EXPORT(RopeRows);
HWY_EXPORT(CrossEntropyForwardRows);
HWY_EXPORT(CrossEntropyBackwardRows);
HWY_EXPORT(AdamWSpan);
HWY_EXPORT(TransposeRowsF32);
HWY_EXPORT(TransposeRowsU8);

namespace {

// Work below this many elements runs on the calling thread (a parallel region costs more).
constexpr int64_t kSerialBelow = int64_t{1} << 14;

// body(r0, r1) over blocks of rows of about kSerialBelow elements, across the team. Rows are
// independent, so the blocking does not change any result.
template <typename Body>
void ForRowBlocks(int64_t n, int64_t row_elems, const Body& body) {
  const int64_t per = std::max<int64_t>(1, kSerialBelow / std::max<int64_t>(1, row_elems));
  const int64_t blocks = (n + per - 1) / per;
#pragma omp parallel for schedule(static) if (blocks > 1)
  for (int64_t b = 0; b < blocks; ++b) body(b * per, std::min(n, (b + 1) * per));
}

// body(j0, j1) over blocks of 256 columns across the team (each block owns its columns, so the
// sums over rows keep their order).
template <typename Body>
void ForColumnBlocks(int64_t n, int64_t c, const Body& body) {
  constexpr int64_t kCols = 256;
  const int64_t blocks = (c + kCols - 1) / kCols;
#pragma omp parallel for schedule(static) if (blocks > 1 && n * c >= kSerialBelow)
  for (int64_t b = 0; b < blocks; ++b) body(b * kCols, std::min(c, (b + 1) * kCols));
}

// body(begin, end) over fixed chunks of a flat range, across the team.
template <typename Body>
void ForChunks(int64_t n, const Body& body) {
  const int64_t chunks = (n + kSerialBelow - 1) / kSerialBelow;
#pragma omp parallel for schedule(static) if (chunks > 1)
  for (int64_t ch = 0; ch < chunks; ++ch) body(ch * kSerialBelow, std::min(n, (ch + 1) * kSerialBelow));
}

void CheckIds(const int32_t* ids, int64_t n, int64_t v, const char* what) {
  for (int64_t i = 0; i < n; ++i) {
    FP8RT_CHECK(ids[i] >= 0 && ids[i] < v)
        << what << " " << ids[i] << " at " << i << " outside [0, " << v << ")";
  }
}

}  // namespace

void RmsNormForwardFast(float* out, float* rstd, const float* x, const float* weight, int64_t n,
                        int64_t c, float eps) {
  ForRowBlocks(n, c, [&](int64_t r0, int64_t r1) {
    HWY_DYNAMIC_DISPATCH(RmsNormForwardRows)(out, rstd, x, weight, r0, r1, c, eps);
  });
}

void RmsNormBackwardFast(float* dx, float* dweight, const float* dout, const float* x,
                         const float* weight, const float* rstd, int64_t n, int64_t c) {
  ForRowBlocks(n, c, [&](int64_t r0, int64_t r1) {
    HWY_DYNAMIC_DISPATCH(RmsNormBackwardRows)(dx, dout, x, weight, rstd, r0, r1, c);
  });
  ForColumnBlocks(n, c, [&](int64_t j0, int64_t j1) {
    HWY_DYNAMIC_DISPATCH(RmsNormDweightColumns)(dweight, dout, x, rstd, n, c, j0, j1);
  });
}

void LayerNormForwardFast(float* out, float* mean, float* rstd, const float* x,
                          const float* weight, const float* bias, int64_t n, int64_t c,
                          float eps) {
  ForRowBlocks(n, c, [&](int64_t r0, int64_t r1) {
    HWY_DYNAMIC_DISPATCH(LayerNormForwardRows)(out, mean, rstd, x, weight, bias, r0, r1, c, eps);
  });
}

void LayerNormBackwardFast(float* dx, float* dweight, float* dbias, const float* dout,
                           const float* x, const float* weight, const float* mean,
                           const float* rstd, int64_t n, int64_t c) {
  ForRowBlocks(n, c, [&](int64_t r0, int64_t r1) {
    HWY_DYNAMIC_DISPATCH(LayerNormBackwardRows)(dx, dout, x, weight, mean, rstd, r0, r1, c);
  });
  ForColumnBlocks(n, c, [&](int64_t j0, int64_t j1) {
    HWY_DYNAMIC_DISPATCH(LayerNormDparamColumns)(dweight, dbias, dout, x, mean, rstd, n, c, j0,
                                                 j1);
  });
}

void CrossEntropyForwardFast(float* probs, float* losses, const float* logits,
                             const int32_t* targets, int64_t n, int64_t v) {
  CheckIds(targets, n, v, "target");
  ForRowBlocks(n, v, [&](int64_t r0, int64_t r1) {
    HWY_DYNAMIC_DISPATCH(CrossEntropyForwardRows)(probs, losses, logits, targets, r0, r1, v);
  });
}

void CrossEntropyBackwardFast(float* dlogits, const float* probs, const int32_t* targets,
                              int64_t n, int64_t v, float dloss) {
  CheckIds(targets, n, v, "target");
  const float row_scale = dloss / static_cast<float>(n);
  ForRowBlocks(n, v, [&](int64_t r0, int64_t r1) {
    HWY_DYNAMIC_DISPATCH(CrossEntropyBackwardRows)(dlogits, probs, targets, r0, r1, v, row_scale);
  });
}

void BiasForwardFast(float* out, const float* bias, int64_t n, int64_t c) {
  ForRowBlocks(n, c, [&](int64_t r0, int64_t r1) {
    HWY_DYNAMIC_DISPATCH(BiasForwardRows)(out, bias, r0, r1, c);
  });
}

void BiasBackwardFast(float* dbias, const float* dout, int64_t n, int64_t c) {
  ForColumnBlocks(n, c, [&](int64_t j0, int64_t j1) {
    HWY_DYNAMIC_DISPATCH(ColumnSums)(dbias, dout, nullptr, n, c, j0, j1);
  });
}

void ResidualForwardFast(float* out, const float* a, const float* b, int64_t n) {
  ForChunks(n, [&](int64_t i0, int64_t i1) {
    HWY_DYNAMIC_DISPATCH(ResidualForwardSpan)(out + i0, a + i0, b + i0, i1 - i0);
  });
}

void ResidualBackwardFast(float* da, float* db, const float* dout, int64_t n) {
  ForChunks(n, [&](int64_t i0, int64_t i1) {
    HWY_DYNAMIC_DISPATCH(ResidualBackwardSpan)(da + i0, db + i0, dout + i0, i1 - i0);
  });
}

void EmbeddingForwardFast(float* out, const int32_t* tokens, const float* table, int64_t n,
                          int64_t v, int64_t c) {
  CheckIds(tokens, n, v, "token");
  ForRowBlocks(n, c, [&](int64_t r0, int64_t r1) {
    for (int64_t i = r0; i < r1; ++i) {
      std::copy_n(table + static_cast<int64_t>(tokens[i]) * c, c, out + i * c);
    }
  });
}

void EmbeddingBackwardFast(float* dtable, const float* dout, const int32_t* tokens, int64_t n,
                           int64_t v, int64_t c) {
  CheckIds(tokens, n, v, "token");
  ForColumnBlocks(n, c, [&](int64_t j0, int64_t j1) {
    HWY_DYNAMIC_DISPATCH(ColumnSums)(dtable, dout, tokens, n, c, j0, j1);
  });
}

void RopeFast(bool forward, float* out, const float* in, int64_t n, int64_t t, int64_t h,
              int64_t dh, float theta) {
  const int64_t half = dh / 2;
  const int64_t positions = std::min(n, t);  // rows r use position r % t
  std::vector<float> cos_t(static_cast<size_t>(positions * half)),
      sin_t(static_cast<size_t>(positions * half));
  for (int64_t pos = 0; pos < positions; ++pos) {
    for (int64_t i = 0; i < half; ++i) {
      RopeCosSin(pos, i, dh, theta, cos_t[pos * half + i], sin_t[pos * half + i]);
    }
  }
  ForRowBlocks(n, h * dh, [&](int64_t r0, int64_t r1) {
    HWY_DYNAMIC_DISPATCH(RopeRows)(forward, out, in, cos_t.data(), sin_t.data(), r0, r1, t, h, dh);
  });
}

namespace {

void Update(const AdamWArgs& k, int64_t begin, int64_t end) {
  HWY_DYNAMIC_DISPATCH(AdamWSpan)(k.master, k.grad, k.m, k.v, begin, end, k.lr, k.decay,
                                  k.clip_scale, k.beta1, k.one_minus_beta1, k.beta2,
                                  k.one_minus_beta2, k.bias1, k.bias2, k.eps);
}

// Each chunk updated, then quantized (vectorised, QuantizeF32Span) while in cache (tensor
// scaling: one scale, stats merged in chunk order, which is order-free: a max and counts).
void AdamWFp8TensorFast(const AdamWArgs& k) {
  const AdamWFp8Output& o = k.fp8;
  const int64_t chunks = (k.count + kSerialBelow - 1) / kSerialBelow;
  std::vector<SpanStats> stats(static_cast<size_t>(chunks));
#pragma omp parallel for schedule(static) if (chunks > 1)
  for (int64_t ch = 0; ch < chunks; ++ch) {
    const int64_t begin = ch * kSerialBelow, end = std::min(k.count, begin + kSerialBelow);
    Update(k, begin, end);
    QuantizeF32Span(k.master + begin, static_cast<size_t>(end - begin), o.scale, o.format,
                    o.codes + begin, &stats[ch]);
  }
  SpanStats s;
  for (const SpanStats& c : stats) {
    s.amax_bits = std::max(s.amax_bits, c.amax_bits);
    s.underflow += c.underflow;
    s.subnormal += c.subnormal;
    s.saturated += c.saturated;
    s.nonfinite += c.nonfinite;
  }
  FinishAdamWTensorShard(o, s, k.count);
}

// Block scaling: each strip of 128 rows is updated across the team, then quantized by the
// quantize op while it is still in cache (a block's scale needs its updated amax).
absl::Status AdamWFp8BlockFast(const AdamWArgs& k) {
  return AdamWFp8BlockStrips(k, [&](int64_t begin, int64_t end) {
    ForChunks(end - begin, [&](int64_t i0, int64_t i1) { Update(k, begin + i0, begin + i1); });
  });
}

}  // namespace

absl::Status AdamWFast(const AdamWArgs& k) {
  if (k.fp8.codes == nullptr) {
    ForChunks(k.count, [&](int64_t i0, int64_t i1) { Update(k, i0, i1); });
    return absl::OkStatus();
  }
  if (k.fp8.block) return AdamWFp8BlockFast(k);
  AdamWFp8TensorFast(k);
  return absl::OkStatus();
}

void TransposeRows(float* dst, const float* src, int64_t rows, int64_t cols, int64_t r0,
                   int64_t r1) {
  HWY_DYNAMIC_DISPATCH(TransposeRowsF32)(dst, src, rows, cols, r0, r1);
}
void TransposeRows(uint8_t* dst, const uint8_t* src, int64_t rows, int64_t cols, int64_t r0,
                   int64_t r1) {
  HWY_DYNAMIC_DISPATCH(TransposeRowsU8)(dst, src, rows, cols, r0, r1);
}

}  // namespace fp8rt::kernels::cpu_internal
#endif  // HWY_ONCE
