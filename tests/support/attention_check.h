// The attention core's contract (kernels/layer_ops.h: AttentionForward / AttentionBackward, lse
// form) evaluated in FP64, with per-element error bounds for one FP32 implementation of it. The
// CPU reference, the CPU table's tiled (flash) entries and the CUDA entries are each checked
// against the FP64 values within these bounds (tests/unit/layer_ops_test.cc,
// tests/unit/rows_cpu_test.cc, tests/gpu/attention_cuda_test.cc), so no implementation is the
// yardstick of another.
//
// Error model (Higham, "Accuracy and Stability of Numerical Algorithms", ch. 2-3): u = 2^-24;
// each FP32 operation rounds once, |fl(a op b) - a op b| <= u |a op b|; an FMA rounds once; a sum
// of n terms in ANY order (sequential, lanes, tiles, trees) is within (n - 1) u sum|terms| of the
// exact sum to first order. expf and logf are within 4 ulp (glibc 1 ulp, CUDA 2 ulp, Highway's
// Exp/Log 1-2 ulp), and 1 ulp <= 2u |value| for normal values, so c_exp = 8u relative. The inputs
// (q, k, v, dout, the backward's out and lse, the FP32 scale) are exact by definition. Row i of a
// head sees n = i + 1 keys.
//
// Forward, S_ij = scale sum_d |q_id k_jd|, s_ij the exact score, m_i its maximum, R_i = max_j
//   |s_ij - m_i|, lse_i exact:
//   score   e_ij = (Dh + 1) u S_ij + u |s_ij|,  E_i = max_j e_ij
//   lse     E_i (every score moves by <= E_i; the computed maximum cancels)
//           + u R_i (the subtractions s - m) + (r + 1) (c_exp + 2u) (exp per term and per
//           rescaling of a running sum: r = ceil(n / 16) rescalings allowed, which covers tiles of
//           16 keys or more; an implementation with exact maxima has r = 0) + n u (the sum)
//           + c_exp |log l_i| (logf, l_i the sum) + u |lse_i| (the addition m + log l)
//   p_ij    p_ij (e_ij + bound(lse_i) + u |s_ij - lse_i| + c_exp + 4u)  (exp(s - lse) directly,
//           or exp(s - m) scaled by the running rescalings and divided by l: both within it)
//   out_id  sum_j bound(p_ij) |v_jd| + (n + 2 r + 2) u sum_j p_ij |v_jd|
// Backward (lse and out given), A_ij = sum_d |dout_id v_jd|, C_i = sum_d |dout_id out_id|,
//   ds_ij = p_ij (dp_ij - D_i) scale:
//   p_ij    p_ij (e_ij + u |s_ij - lse_i| + c_exp)
//   ds_ij   scale (bound(p_ij) |dp_ij - D_i| + p_ij (Dh u A_ij + Dh u C_i + u |dp_ij - D_i|))
//           + 2u |ds_ij|
//   dq_id   sum_j bound(ds_ij) |k_jd| + (n + 2) u (|dq0_id| + sum_j |ds_ij k_jd|)
//   dk_jd   the same over the group's query heads and rows i >= j with q_id: (c + 2) u, c the
//           number of terms
//   dv_jd   sum bound(p_ij) |dout_id| + (c + 2) u (|dv0_jd| + sum p_ij |dout_id|)
// Checks allow kSafety (2) times the first-order bound, for the second-order terms, plus kTiny
// (2^-120) absolute for values in or next to the subnormal range.
//
// Tensor-core implementations (Precision::Bf16TensorCores(): the CUDA table's
// attention_*_bf16 entries) round the operands of every matrix product to BF16 (q, k, v, dout,
// p and ds; 8 significant bits, b = 2^-8) and accumulate in FP32 inside the MMA, where the
// additions may truncate instead of rounding (Fasi, Higham, Mikaitis, Pranesh, "Numerical
// behavior of NVIDIA tensor cores", PeerJ CS 2021): every sum's u becomes 2u, and each product
// a_d b_d of two rounded operands carries 2b |a_d b_d| more, so the bounds add
//   score e_ij: 2b S_ij;  out_id: 2b sum_j p_ij |v_jd|;  ds_ij: scale p_ij 2b A_ij (dp's operands);
//   dq_id: 2b sum_j |ds_ij k_jd|;  dk_jd: 2b sum |ds_ij q_id|;  dv_jd: 2b sum p_ij |dout_id|.
// The softmax itself, lse, D_i (from the FP32 out and dout) and the final additions stay FP32.
#ifndef FP8RT_TESTS_SUPPORT_ATTENTION_CHECK_H_
#define FP8RT_TESTS_SUPPORT_ATTENTION_CHECK_H_

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"

namespace fp8rt::attention_check {

inline constexpr double kU = 0x1p-24;
inline constexpr double kExp = 8.0 * kU;  // c_exp: expf and logf within 4 ulp
inline constexpr double kTiny = 0x1p-120;
inline constexpr double kSafety = 2.0;

struct AttnShape {
  int64_t b, t, h, hkv, dh;
};

// The arithmetic an implementation is held to: `operand` is the relative rounding of each
// product's operands (0: FP32 values used as they are), `sum` the unit of every addition.
struct Precision {
  double operand = 0.0;
  double sum = kU;
  static Precision Fp32() { return {}; }
  static Precision Bf16TensorCores() { return {0x1p-8, 2.0 * kU}; }
};

inline std::string ShapeName(const AttnShape& s) {
  return absl::StrCat("B", s.b, "_T", s.t, "_H", s.h, "_Hkv", s.hkv, "_Dh", s.dh);
}

inline std::vector<float> NormalValues(size_t n, float sigma, uint32_t seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> dist(0.0f, sigma);
  std::vector<float> x(n);
  for (auto& v : x) v = dist(rng);
  return x;
}

// Inputs of one shape: q and k with sigma 1.5, so that scores have a standard deviation of about
// 2.2 (peaked and flat rows both occur); v, dout and the pre-filled gradients N(0, 1).
struct AttnData {
  explicit AttnData(const AttnShape& shape, uint32_t seed)
      : s(shape),
        size(static_cast<size_t>(s.b * s.t * s.h * s.dh)),
        kv_size(static_cast<size_t>(s.b * s.t * s.hkv * s.dh)),
        lse_size(static_cast<size_t>(s.b * s.h * s.t)),
        group(s.h / s.hkv),
        q(NormalValues(size, 1.5f, seed)),
        k(NormalValues(kv_size, 1.5f, seed + 1)),
        v(NormalValues(kv_size, 1.0f, seed + 2)),
        dout(NormalValues(size, 1.0f, seed + 3)),
        dq0(NormalValues(size, 1.0f, seed + 4)),
        dk0(NormalValues(kv_size, 1.0f, seed + 5)),
        dv0(NormalValues(kv_size, 1.0f, seed + 6)),
        scale(1.0f / std::sqrt(static_cast<float>(s.dh))) {}
  // Index of channel d of position `pos` of query head hh in batch row bb, [B, T, H, Dh].
  size_t At(int64_t bb, int64_t pos, int64_t hh, int64_t d) const {
    return static_cast<size_t>(((bb * s.t + pos) * s.h + hh) * s.dh + d);
  }
  // The same channel of query head hh's kv head hh / (H / Hkv), [B, T, Hkv, Dh].
  size_t KvAt(int64_t bb, int64_t pos, int64_t hh, int64_t d) const {
    return static_cast<size_t>(((bb * s.t + pos) * s.hkv + hh / group) * s.dh + d);
  }
  size_t Row(int64_t bb, int64_t hh, int64_t i) const {
    return static_cast<size_t>((bb * s.h + hh) * s.t + i);
  }

  AttnShape s;
  size_t size, kv_size, lse_size;
  int64_t group;  // query heads per kv head
  std::vector<float> q, k, v, dout, dq0, dk0, dv0;
  float scale;  // the FP32 1/sqrt(Dh) every implementation uses
};

namespace internal {

// sum_d a_d b_d and sum_d |a_d b_d| in FP64.
struct Dot {
  double value, abs;
};
inline Dot DotOf(const float* a, const float* b, int64_t n) {
  Dot dot{0.0, 0.0};
  for (int64_t d = 0; d < n; ++d) {
    const double prod = double{a[d]} * double{b[d]};
    dot.value += prod;
    dot.abs += std::fabs(prod);
  }
  return dot;
}

// Rescalings of a running sum the bounds allow for a row of n keys.
inline double Rescales(int64_t n) { return static_cast<double>((n + 15) / 16); }

}  // namespace internal

struct ForwardWant {
  std::vector<double> out, lse, out_bound, lse_bound;
};

inline ForwardWant ExactForward(const AttnData& x, Precision prec = Precision::Fp32()) {
  const double su = prec.sum, ob = 2.0 * prec.operand;
  const AttnShape& s = x.s;
  ForwardWant w;
  w.out.assign(x.size, 0.0);
  w.out_bound.assign(x.size, 0.0);
  w.lse.assign(x.lse_size, 0.0);
  w.lse_bound.assign(x.lse_size, 0.0);
  std::vector<double> score(static_cast<size_t>(s.t)), err(static_cast<size_t>(s.t)),
      p(static_cast<size_t>(s.t)), p_bound(static_cast<size_t>(s.t));
  for (int64_t bb = 0; bb < s.b; ++bb) {
    for (int64_t hh = 0; hh < s.h; ++hh) {
      for (int64_t i = 0; i < s.t; ++i) {
        const int64_t n = i + 1;
        double m = -std::numeric_limits<double>::infinity(), e_max = 0.0;
        for (int64_t j = 0; j <= i; ++j) {
          const internal::Dot qk =
              internal::DotOf(&x.q[x.At(bb, i, hh, 0)], &x.k[x.KvAt(bb, j, hh, 0)], s.dh);
          score[j] = qk.value * x.scale;
          err[j] = ((s.dh + 1) * su + ob) * qk.abs * x.scale + kU * std::fabs(score[j]);
          e_max = std::max(e_max, err[j]);
          m = std::max(m, score[j]);
        }
        double l = 0.0, spread = 0.0;
        for (int64_t j = 0; j <= i; ++j) {
          l += std::exp(score[j] - m);
          spread = std::max(spread, std::fabs(score[j] - m));
        }
        const double lse = m + std::log(l);
        const double r = internal::Rescales(n);
        const double lse_bound = e_max + kU * spread + (r + 1.0) * (kExp + 2.0 * kU) + n * su +
                                 kExp * std::fabs(std::log(l)) + kU * std::fabs(lse);
        const size_t row = x.Row(bb, hh, i);
        w.lse[row] = lse;
        w.lse_bound[row] = lse_bound;
        for (int64_t j = 0; j <= i; ++j) {
          p[j] = std::exp(score[j] - lse);
          p_bound[j] =
              p[j] * (err[j] + lse_bound + kU * std::fabs(score[j] - lse) + kExp + 4.0 * kU);
        }
        for (int64_t d = 0; d < s.dh; ++d) {
          double o = 0.0, from_p = 0.0, mags = 0.0;
          for (int64_t j = 0; j <= i; ++j) {
            const double vd = x.v[x.KvAt(bb, j, hh, d)];
            o += p[j] * vd;
            from_p += p_bound[j] * std::fabs(vd);
            mags += p[j] * std::fabs(vd);
          }
          w.out[x.At(bb, i, hh, d)] = o;
          w.out_bound[x.At(bb, i, hh, d)] = from_p + ((n + 2.0 * r + 2.0) * su + ob) * mags;
        }
      }
    }
  }
  return w;
}

struct BackwardWant {
  std::vector<double> dq, dk, dv, dq_bound, dk_bound, dv_bound;
};

// The gradients after one accumulating call onto x.dq0, x.dk0 and x.dv0, with the given out and
// lse (FP32 inputs, taken as exact).
inline BackwardWant ExactBackward(const AttnData& x, const std::vector<float>& out,
                                  const std::vector<float>& lse,
                                  Precision prec = Precision::Fp32()) {
  const double su = prec.sum, ob = 2.0 * prec.operand;
  const AttnShape& s = x.s;
  BackwardWant w;
  w.dq.assign(x.dq0.begin(), x.dq0.end());
  w.dk.assign(x.dk0.begin(), x.dk0.end());
  w.dv.assign(x.dv0.begin(), x.dv0.end());
  // Bounds are accumulated in two parts per element: propagated errors and term magnitudes (with
  // the pre-filled value), and the number of terms.
  std::vector<double> dq_prop(x.size, 0.0), dq_mag(x.size), dk_prop(x.kv_size, 0.0),
      dk_mag(x.kv_size), dv_prop(x.kv_size, 0.0), dv_mag(x.kv_size);
  for (size_t e = 0; e < x.size; ++e) dq_mag[e] = std::fabs(x.dq0[e]);
  for (size_t e = 0; e < x.kv_size; ++e) {
    dk_mag[e] = std::fabs(x.dk0[e]);
    dv_mag[e] = std::fabs(x.dv0[e]);
  }
  std::vector<double> p(static_cast<size_t>(s.t)), p_bound(static_cast<size_t>(s.t)),
      ds(static_cast<size_t>(s.t)), ds_bound(static_cast<size_t>(s.t));
  for (int64_t bb = 0; bb < s.b; ++bb) {
    for (int64_t hh = 0; hh < s.h; ++hh) {
      for (int64_t i = 0; i < s.t; ++i) {
        const size_t row = x.Row(bb, hh, i);
        const float* qi = &x.q[x.At(bb, i, hh, 0)];
        const float* doi = &x.dout[x.At(bb, i, hh, 0)];
        const internal::Dot dd = internal::DotOf(doi, &out[x.At(bb, i, hh, 0)], s.dh);
        for (int64_t j = 0; j <= i; ++j) {
          const internal::Dot qk = internal::DotOf(qi, &x.k[x.KvAt(bb, j, hh, 0)], s.dh);
          const double score = qk.value * x.scale;
          const double e = ((s.dh + 1) * su + ob) * qk.abs * x.scale + kU * std::fabs(score);
          p[j] = std::exp(score - lse[row]);
          p_bound[j] = p[j] * (e + kU * std::fabs(score - lse[row]) + kExp);
          const internal::Dot dp = internal::DotOf(doi, &x.v[x.KvAt(bb, j, hh, 0)], s.dh);
          const double diff = dp.value - dd.value;
          ds[j] = p[j] * diff * x.scale;
          ds_bound[j] =
              x.scale *
                  (p_bound[j] * std::fabs(diff) +
                   p[j] * (s.dh * su * (dp.abs + dd.abs) + ob * dp.abs + kU * std::fabs(diff))) +
              2.0 * kU * std::fabs(ds[j]);
        }
        for (int64_t d = 0; d < s.dh; ++d) {
          const size_t qd = x.At(bb, i, hh, d);
          for (int64_t j = 0; j <= i; ++j) {
            const size_t kd = x.KvAt(bb, j, hh, d);
            w.dq[qd] += ds[j] * x.k[kd];
            dq_prop[qd] += ds_bound[j] * std::fabs(x.k[kd]);
            dq_mag[qd] += std::fabs(ds[j] * x.k[kd]);
            w.dk[kd] += ds[j] * qi[d];
            dk_prop[kd] += ds_bound[j] * std::fabs(qi[d]);
            dk_mag[kd] += std::fabs(ds[j] * qi[d]);
            w.dv[kd] += p[j] * doi[d];
            dv_prop[kd] += p_bound[j] * std::fabs(doi[d]);
            dv_mag[kd] += p[j] * std::fabs(doi[d]);
          }
        }
      }
    }
  }
  w.dq_bound.assign(x.size, 0.0);
  for (int64_t bb = 0; bb < s.b; ++bb) {
    for (int64_t i = 0; i < s.t; ++i) {
      for (int64_t hh = 0; hh < s.h; ++hh) {
        for (int64_t d = 0; d < s.dh; ++d) {
          const size_t e = x.At(bb, i, hh, d);
          // dq_mag holds |dq0| too; only the products' terms carry operand rounding.
          w.dq_bound[e] =
              dq_prop[e] + (i + 1 + 2.0) * su * dq_mag[e] + ob * (dq_mag[e] - std::fabs(x.dq0[e]));
        }
      }
    }
  }
  w.dk_bound.assign(x.kv_size, 0.0);
  w.dv_bound.assign(x.kv_size, 0.0);
  for (int64_t bb = 0; bb < s.b; ++bb) {
    for (int64_t j = 0; j < s.t; ++j) {
      for (int64_t g = 0; g < s.hkv; ++g) {
        const double terms = static_cast<double>(x.group * (s.t - j));
        for (int64_t d = 0; d < s.dh; ++d) {
          const size_t e = x.KvAt(bb, j, g * x.group, d);
          w.dk_bound[e] =
              dk_prop[e] + (terms + 2.0) * su * dk_mag[e] + ob * (dk_mag[e] - std::fabs(x.dk0[e]));
          w.dv_bound[e] =
              dv_prop[e] + (terms + 2.0) * su * dv_mag[e] + ob * (dv_mag[e] - std::fabs(x.dv0[e]));
        }
      }
    }
  }
  return w;
}

// Elements of `got` farther from `want` than kSafety * bound + kTiny: one message with the count
// and the first few, empty if none. NaN fails.
inline std::string OutOfBounds(const char* what, const std::vector<float>& got,
                               const std::vector<double>& want, const std::vector<double>& bound) {
  if (got.size() != want.size() || bound.size() != want.size()) {
    return absl::StrCat(what, ": ", got.size(), " values for ", want.size());
  }
  int64_t bad = 0;
  std::string first;
  for (size_t n = 0; n < got.size(); ++n) {
    const double diff = std::fabs(double{got[n]} - want[n]);
    const double allowed = kSafety * bound[n] + kTiny;
    if (!(diff <= allowed)) {
      if (++bad <= 5) {
        absl::StrAppend(&first, "\n  ", what, "[", n, "]: got ", got[n], " exact ", want[n],
                        " |diff| ", diff, " > ", allowed);
      }
    }
  }
  return bad == 0 ? std::string()
                  : absl::StrCat(bad, " of ", got.size(), " elements of ", what, " out of bounds",
                                 first);
}

}  // namespace fp8rt::attention_check

#endif  // FP8RT_TESTS_SUPPORT_ATTENTION_CHECK_H_
