// Tests of the FP32 layer ops (kernels/layer_ops.h) against references written here in
// double precision straight from the formulas, independent of the code under test: forwards are
// compared with the double evaluation, backwards with central finite differences of the double
// forward (of the scalar sum(out * dout) for a fixed random dout).
//
// Index:
//   Ref*                     double-precision forwards (embedding, RMSNorm, attention, GELU,
//                            residual, cross-entropy)
//   NumericalGrad            central differences of a double function
//   ExpectForwardNear        FP32 forward vs double reference (kForwardTol)
//   ExpectGradNear           FP32 backward vs double finite differences (kGradTol)
//   ExpectAccumulates        backward twice onto pre-filled gradients adds twice the gradient
//   EmbeddingTest, RmsNormTest, AttentionTest, GeluTest, ResidualTest, CrossEntropyTest
#include "kernels/layer_ops.h"

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <numbers>
#include <random>
#include <span>
#include <string>
#include <vector>

#include "gtest/gtest.h"

namespace fp8rt::kernels {
namespace {

using Vec = std::vector<float>;
using DVec = std::vector<double>;

// FP32 forward vs the double formula: each output is a sum of at most ~20 products of O(1)
// values plus an exp/tanh/sqrt, each FP32 operation off by at most 2^-24 relative, so the error is
// below ~40 * 6e-8 = 2.4e-6 of the operands' magnitude; 1e-5 of (1 + |want|) leaves a 4x margin.
constexpr double kForwardTol = 1e-5;
// FP32 backward vs double central differences with step 1e-4. The FD is accurate to
// h^2 / 6 * |f'''| ~ 1e-8 (truncation; f''' is O(1) for these O(1) inputs) plus 1e-16 / h ~ 1e-12
// (rounding), so the comparison measures the FP32 backward's own error: a few 2^-24 roundings
// per term of sums of at most ~20 terms, ~1e-6 of the gradient's scale. The tolerance is 1e-4 of
// the gradient tensor's largest magnitude (relative to its own scale, so entries near zero are not
// held to an impossible relative bound): a 100x margin, while a wrong or missing term gives an
// O(1) relative error.
constexpr double kGradTol = 1e-4;
constexpr double kFdStep = 1e-4;

Vec Random(size_t n, uint32_t seed, float lo = -1.0f, float hi = 1.0f) {
  std::mt19937 rng(seed);
  std::uniform_real_distribution<float> dist(lo, hi);
  Vec out(n);
  for (float& x : out) x = dist(rng);
  return out;
}

DVec ToDouble(const Vec& v) { return DVec(v.begin(), v.end()); }

double Dot(const DVec& a, const Vec& b) {
  double s = 0.0;
  for (size_t i = 0; i < a.size(); ++i) s += a[i] * static_cast<double>(b[i]);
  return s;
}

// Central differences (f(x + h e_i) - f(x - h e_i)) / 2h for every i.
DVec NumericalGrad(const std::function<double(const DVec&)>& f, DVec x) {
  DVec grad(x.size());
  for (size_t i = 0; i < x.size(); ++i) {
    const double saved = x[i];
    x[i] = saved + kFdStep;
    const double up = f(x);
    x[i] = saved - kFdStep;
    const double down = f(x);
    x[i] = saved;
    grad[i] = (up - down) / (2.0 * kFdStep);
  }
  return grad;
}

void ExpectForwardNear(const Vec& got, const DVec& want, const std::string& what) {
  ASSERT_EQ(got.size(), want.size()) << what;
  for (size_t i = 0; i < got.size(); ++i) {
    EXPECT_NEAR(got[i], want[i], kForwardTol * (1.0 + std::abs(want[i])))
        << what << "[" << i << "]";
  }
}

void ExpectGradNear(const Vec& got, const DVec& want, const std::string& what) {
  ASSERT_EQ(got.size(), want.size()) << what;
  double scale = 0.0;
  for (double w : want) scale = std::max(scale, std::abs(w));
  ASSERT_GT(scale, 0.0) << what << ": reference gradient is all zero, the test shows nothing";
  for (size_t i = 0; i < got.size(); ++i) {
    EXPECT_NEAR(got[i], want[i], kGradTol * scale) << what << "[" << i << "]";
  }
}

// `backward(grads)` runs the op's backward once into `grads` (one buffer per gradient, sizes
// `sizes`). From zero it yields g; from a random pre-fill p, run twice, it must yield p + 2g.
// Tolerance: p + g + g and p + 2g differ by a few FP32 roundings of |p| + 2|g|.
void ExpectAccumulates(const std::function<void(std::vector<Vec>&)>& backward,
                       const std::vector<size_t>& sizes) {
  std::vector<Vec> once;
  std::vector<Vec> twice;
  std::vector<Vec> prefill;
  for (size_t s = 0; s < sizes.size(); ++s) {
    once.emplace_back(sizes[s], 0.0f);
    prefill.push_back(Random(sizes[s], 1000 + static_cast<uint32_t>(s), -2.0f, 2.0f));
  }
  twice = prefill;
  backward(once);
  backward(twice);
  backward(twice);
  for (size_t s = 0; s < sizes.size(); ++s) {
    bool any_nonzero = false;
    for (size_t i = 0; i < sizes[s]; ++i) {
      const double p = prefill[s][i];
      const double g = once[s][i];
      any_nonzero |= g != 0.0;
      EXPECT_NEAR(twice[s][i], p + 2.0 * g, 1e-6 * (std::abs(p) + 2.0 * std::abs(g)) + 1e-7)
          << "gradient " << s << "[" << i << "]";
    }
    EXPECT_TRUE(any_nonzero) << "gradient " << s << " is all zero, the test shows nothing";
  }
}

// ---------------------------------------------------------------------------------------------
// Double-precision references, written from the formulas.

DVec RefEmbedding(const std::vector<int32_t>& tokens, const DVec& table, int64_t c) {
  DVec out;
  for (int32_t tok : tokens) {
    for (int64_t j = 0; j < c; ++j) out.push_back(table[tok * c + j]);
  }
  return out;
}

// y = x / sqrt(mean(x^2) + eps) * w, per row.
DVec RefRmsNorm(const DVec& x, const DVec& w, int64_t n, int64_t c, double eps,
                DVec* rstd = nullptr) {
  DVec out(n * c);
  for (int64_t i = 0; i < n; ++i) {
    double ms = 0.0;
    for (int64_t j = 0; j < c; ++j) ms += x[i * c + j] * x[i * c + j];
    const double r = 1.0 / std::sqrt(ms / c + eps);
    if (rstd != nullptr) rstd->push_back(r);
    for (int64_t j = 0; j < c; ++j) out[i * c + j] = x[i * c + j] * r * w[j];
  }
  return out;
}

struct AttentionShape {
  int64_t b, t, h, dh;
  int64_t size() const { return b * t * h * dh; }
  int64_t at(int64_t bb, int64_t pos, int64_t hh) const { return ((bb * t + pos) * h + hh) * dh; }
};

// out_i = sum_{j<=i} softmax_j(q_i . k_j / sqrt(Dh)) v_j per (batch, head); probs [B, H, T, T].
DVec RefAttention(const DVec& q, const DVec& k, const DVec& v, const AttentionShape& s,
                  DVec* probs = nullptr) {
  DVec out(s.size(), 0.0);
  if (probs != nullptr) probs->assign(s.b * s.h * s.t * s.t, 0.0);
  for (int64_t bb = 0; bb < s.b; ++bb) {
    for (int64_t hh = 0; hh < s.h; ++hh) {
      for (int64_t i = 0; i < s.t; ++i) {
        DVec e(i + 1);
        double sum = 0.0;
        for (int64_t j = 0; j <= i; ++j) {
          double dot = 0.0;
          for (int64_t d = 0; d < s.dh; ++d) dot += q[s.at(bb, i, hh) + d] * k[s.at(bb, j, hh) + d];
          e[j] = std::exp(dot / std::sqrt(static_cast<double>(s.dh)));
          sum += e[j];
        }
        for (int64_t j = 0; j <= i; ++j) {
          const double p = e[j] / sum;
          if (probs != nullptr) (*probs)[((bb * s.h + hh) * s.t + i) * s.t + j] = p;
          for (int64_t d = 0; d < s.dh; ++d) out[s.at(bb, i, hh) + d] += p * v[s.at(bb, j, hh) + d];
        }
      }
    }
  }
  return out;
}

DVec RefGelu(const DVec& x) {
  DVec out;
  const double c = std::sqrt(2.0 / std::numbers::pi);
  for (double xi : x)
    out.push_back(0.5 * xi * (1.0 + std::tanh(c * (xi + 0.044715 * xi * xi * xi))));
  return out;
}

DVec RefResidual(const DVec& a, const DVec& b) {
  DVec out(a.size());
  for (size_t i = 0; i < a.size(); ++i) out[i] = a[i] + b[i];
  return out;
}

// Mean over rows of -log(exp(l_target) / sum_j exp(l_j)); probs = softmax per row.
double RefCrossEntropy(const DVec& logits, const std::vector<int32_t>& targets, int64_t n,
                       int64_t v, DVec* probs = nullptr) {
  double loss = 0.0;
  for (int64_t i = 0; i < n; ++i) {
    double sum = 0.0;
    for (int64_t j = 0; j < v; ++j) sum += std::exp(logits[i * v + j]);
    loss += -std::log(std::exp(logits[i * v + targets[i]]) / sum);
    if (probs != nullptr) {
      for (int64_t j = 0; j < v; ++j) probs->push_back(std::exp(logits[i * v + j]) / sum);
    }
  }
  return loss / n;
}

// ---------------------------------------------------------------------------------------------
// Embedding

constexpr int64_t kEmbN = 6, kEmbV = 11, kEmbC = 4;
// Tokens 3 and 7 repeat, so the backward must add, not assign.
const std::vector<int32_t> kEmbTokens = {3, 7, 0, 3, 10, 7};

TEST(EmbeddingTest, ForwardCopiesRows) {
  const Vec table = Random(kEmbV * kEmbC, 1);
  Vec out(kEmbN * kEmbC);
  EmbeddingForward(out, kEmbTokens, table, kEmbN, kEmbV, kEmbC);
  const DVec want = RefEmbedding(kEmbTokens, ToDouble(table), kEmbC);
  for (size_t i = 0; i < out.size(); ++i) EXPECT_EQ(out[i], want[i]) << i;
}

TEST(EmbeddingTest, BackwardMatchesFiniteDifferences) {
  const Vec table = Random(kEmbV * kEmbC, 1);
  const Vec dout = Random(kEmbN * kEmbC, 2);
  Vec dtable(table.size(), 0.0f);
  EmbeddingBackward(dtable, dout, kEmbTokens, kEmbN, kEmbV, kEmbC);
  const DVec fd =
      NumericalGrad([&](const DVec& t) { return Dot(RefEmbedding(kEmbTokens, t, kEmbC), dout); },
                    ToDouble(table));
  ExpectGradNear(dtable, fd, "dtable");
  // Rows of tokens that never occur get nothing.
  for (int64_t j = 0; j < kEmbC; ++j) EXPECT_EQ(dtable[1 * kEmbC + j], 0.0f);
}

TEST(EmbeddingTest, BackwardAccumulates) {
  const Vec dout = Random(kEmbN * kEmbC, 2);
  ExpectAccumulates(
      [&](std::vector<Vec>& g) { EmbeddingBackward(g[0], dout, kEmbTokens, kEmbN, kEmbV, kEmbC); },
      {kEmbV * kEmbC});
}

// ---------------------------------------------------------------------------------------------
// RMSNorm

constexpr int64_t kNormN = 6, kNormC = 8;
constexpr float kNormEps = 1e-5f;

TEST(RmsNormTest, ForwardMatchesFormula) {
  const Vec x = Random(kNormN * kNormC, 3);
  const Vec w = Random(kNormC, 4, 0.5f, 1.5f);
  Vec out(x.size());
  Vec rstd(kNormN);
  RmsNormForward(out, rstd, x, w, kNormN, kNormC, kNormEps);
  DVec want_rstd;
  const DVec want = RefRmsNorm(ToDouble(x), ToDouble(w), kNormN, kNormC, kNormEps, &want_rstd);
  ExpectForwardNear(out, want, "out");
  ExpectForwardNear(rstd, want_rstd, "rstd");
}

TEST(RmsNormTest, BackwardMatchesFiniteDifferences) {
  const Vec x = Random(kNormN * kNormC, 3);
  const Vec w = Random(kNormC, 4, 0.5f, 1.5f);
  const Vec dout = Random(x.size(), 5);
  Vec out(x.size());
  Vec rstd(kNormN);
  RmsNormForward(out, rstd, x, w, kNormN, kNormC, kNormEps);
  Vec dx(x.size(), 0.0f);
  Vec dw(w.size(), 0.0f);
  RmsNormBackward(dx, dw, dout, x, w, rstd, kNormN, kNormC);
  const DVec xd = ToDouble(x);
  const DVec wd = ToDouble(w);
  ExpectGradNear(
      dx,
      NumericalGrad(
          [&](const DVec& xx) { return Dot(RefRmsNorm(xx, wd, kNormN, kNormC, kNormEps), dout); },
          xd),
      "dx");
  ExpectGradNear(
      dw,
      NumericalGrad(
          [&](const DVec& ww) { return Dot(RefRmsNorm(xd, ww, kNormN, kNormC, kNormEps), dout); },
          wd),
      "dweight");
}

TEST(RmsNormTest, BackwardAccumulates) {
  const Vec x = Random(kNormN * kNormC, 3);
  const Vec w = Random(kNormC, 4, 0.5f, 1.5f);
  const Vec dout = Random(x.size(), 5);
  Vec out(x.size());
  Vec rstd(kNormN);
  RmsNormForward(out, rstd, x, w, kNormN, kNormC, kNormEps);
  ExpectAccumulates(
      [&](std::vector<Vec>& g) { RmsNormBackward(g[0], g[1], dout, x, w, rstd, kNormN, kNormC); },
      {x.size(), w.size()});
}

// ---------------------------------------------------------------------------------------------
// Causal multi-head attention

constexpr AttentionShape kAttn{.b = 2, .t = 5, .h = 2, .dh = 4};

struct AttentionInputs {
  // Scores q.k/sqrt(Dh) of a few units keep the softmax away from uniform and from one-hot.
  Vec q = Random(kAttn.size(), 6, -2.0f, 2.0f);
  Vec k = Random(kAttn.size(), 7, -2.0f, 2.0f);
  Vec v = Random(kAttn.size(), 8);
  Vec dout = Random(kAttn.size(), 9);
};

void RunAttentionForward(const AttentionInputs& in, Vec& out, Vec& probs) {
  out.assign(kAttn.size(), 0.0f);
  probs.assign(kAttn.b * kAttn.h * kAttn.t * kAttn.t, -1.0f);
  AttentionForward(out, probs, in.q, in.k, in.v, kAttn.b, kAttn.t, kAttn.h, kAttn.dh);
}

TEST(AttentionTest, ForwardMatchesFormula) {
  const AttentionInputs in;
  Vec out;
  Vec probs;
  RunAttentionForward(in, out, probs);
  DVec want_probs;
  const DVec want =
      RefAttention(ToDouble(in.q), ToDouble(in.k), ToDouble(in.v), kAttn, &want_probs);
  ExpectForwardNear(out, want, "out");
  // Includes the masked entries j > i, which must be exactly 0 (pre-filled with -1 above).
  ExpectForwardNear(probs, want_probs, "probs");
}

TEST(AttentionTest, ProbabilitiesAreCausalAndSumToOne) {
  const AttentionInputs in;
  Vec out;
  Vec probs;
  RunAttentionForward(in, out, probs);
  for (int64_t row = 0; row < kAttn.b * kAttn.h; ++row) {
    for (int64_t i = 0; i < kAttn.t; ++i) {
      const float* p = probs.data() + (row * kAttn.t + i) * kAttn.t;
      double sum = 0.0;
      for (int64_t j = 0; j < kAttn.t; ++j) {
        if (j > i) {
          EXPECT_EQ(p[j], 0.0f) << "row " << row << " query " << i << " key " << j;
        }
        sum += p[j];
      }
      EXPECT_NEAR(sum, 1.0, 1e-6);
    }
  }
}

TEST(AttentionTest, FutureKeysAndValuesDoNotChangeEarlierOutputs) {
  const AttentionInputs in;
  Vec out;
  Vec probs;
  RunAttentionForward(in, out, probs);
  // Change k and v of token 3 of batch row 1, every head.
  constexpr int64_t kBatch = 1, kPos = 3;
  AttentionInputs changed = in;
  for (int64_t hh = 0; hh < kAttn.h; ++hh) {
    for (int64_t d = 0; d < kAttn.dh; ++d) {
      changed.k[kAttn.at(kBatch, kPos, hh) + d] += 1.5f;
      changed.v[kAttn.at(kBatch, kPos, hh) + d] -= 0.75f;
    }
  }
  Vec out2;
  Vec probs2;
  RunAttentionForward(changed, out2, probs2);
  bool later_changed = false;
  for (int64_t bb = 0; bb < kAttn.b; ++bb) {
    for (int64_t pos = 0; pos < kAttn.t; ++pos) {
      for (int64_t hh = 0; hh < kAttn.h; ++hh) {
        for (int64_t d = 0; d < kAttn.dh; ++d) {
          const int64_t i = kAttn.at(bb, pos, hh) + d;
          if (bb != kBatch || pos < kPos) {
            EXPECT_EQ(out2[i], out[i]) << "batch " << bb << " pos " << pos << " head " << hh;
          } else {
            later_changed |= out2[i] != out[i];
          }
        }
      }
    }
  }
  EXPECT_TRUE(later_changed) << "the change at the position itself should show";
}

TEST(AttentionTest, BackwardSendsNoGradientToFutureKeysAndValues) {
  const AttentionInputs in;
  Vec out;
  Vec probs;
  RunAttentionForward(in, out, probs);
  // Gradient only on outputs before position 3: keys and values at 3 and later get nothing.
  constexpr int64_t kPos = 3;
  Vec dout = in.dout;
  for (int64_t bb = 0; bb < kAttn.b; ++bb) {
    for (int64_t pos = kPos; pos < kAttn.t; ++pos) {
      std::fill_n(dout.begin() + kAttn.at(bb, pos, 0), kAttn.h * kAttn.dh, 0.0f);
    }
  }
  Vec dq(kAttn.size(), 0.0f), dk(kAttn.size(), 0.0f), dv(kAttn.size(), 0.0f);
  AttentionBackward(dq, dk, dv, dout, in.q, in.k, in.v, probs, kAttn.b, kAttn.t, kAttn.h, kAttn.dh);
  for (int64_t bb = 0; bb < kAttn.b; ++bb) {
    for (int64_t pos = 0; pos < kAttn.t; ++pos) {
      for (int64_t e = 0; e < kAttn.h * kAttn.dh; ++e) {
        const int64_t i = kAttn.at(bb, pos, 0) + e;
        if (pos >= kPos) {
          EXPECT_EQ(dk[i], 0.0f) << "batch " << bb << " pos " << pos;
          EXPECT_EQ(dv[i], 0.0f) << "batch " << bb << " pos " << pos;
        }
      }
    }
  }
}

TEST(AttentionTest, BackwardMatchesFiniteDifferences) {
  const AttentionInputs in;
  Vec out;
  Vec probs;
  RunAttentionForward(in, out, probs);
  Vec dq(kAttn.size(), 0.0f), dk(kAttn.size(), 0.0f), dv(kAttn.size(), 0.0f);
  AttentionBackward(dq, dk, dv, in.dout, in.q, in.k, in.v, probs, kAttn.b, kAttn.t, kAttn.h,
                    kAttn.dh);
  const DVec q = ToDouble(in.q), k = ToDouble(in.k), v = ToDouble(in.v);
  ExpectGradNear(
      dq,
      NumericalGrad([&](const DVec& x) { return Dot(RefAttention(x, k, v, kAttn), in.dout); }, q),
      "dq");
  ExpectGradNear(
      dk,
      NumericalGrad([&](const DVec& x) { return Dot(RefAttention(q, x, v, kAttn), in.dout); }, k),
      "dk");
  ExpectGradNear(
      dv,
      NumericalGrad([&](const DVec& x) { return Dot(RefAttention(q, k, x, kAttn), in.dout); }, v),
      "dv");
}

TEST(AttentionTest, BackwardAccumulates) {
  const AttentionInputs in;
  Vec out;
  Vec probs;
  RunAttentionForward(in, out, probs);
  const size_t n = kAttn.size();
  ExpectAccumulates(
      [&](std::vector<Vec>& g) {
        AttentionBackward(g[0], g[1], g[2], in.dout, in.q, in.k, in.v, probs, kAttn.b, kAttn.t,
                          kAttn.h, kAttn.dh);
      },
      {n, n, n});
}

// ---------------------------------------------------------------------------------------------
// GELU

constexpr int64_t kGeluN = 24;

TEST(GeluTest, ForwardMatchesFormula) {
  const Vec x = Random(kGeluN, 10, -4.0f, 4.0f);
  Vec out(kGeluN);
  GeluForward(out, x, kGeluN);
  ExpectForwardNear(out, RefGelu(ToDouble(x)), "out");
}

TEST(GeluTest, BackwardMatchesFiniteDifferences) {
  const Vec x = Random(kGeluN, 10, -4.0f, 4.0f);
  const Vec dout = Random(kGeluN, 11);
  Vec dx(kGeluN, 0.0f);
  GeluBackward(dx, dout, x, kGeluN);
  ExpectGradNear(
      dx, NumericalGrad([&](const DVec& xx) { return Dot(RefGelu(xx), dout); }, ToDouble(x)), "dx");
}

TEST(GeluTest, BackwardAccumulates) {
  const Vec x = Random(kGeluN, 10, -4.0f, 4.0f);
  const Vec dout = Random(kGeluN, 11);
  ExpectAccumulates([&](std::vector<Vec>& g) { GeluBackward(g[0], dout, x, kGeluN); }, {kGeluN});
}

// ---------------------------------------------------------------------------------------------
// Residual add

constexpr int64_t kResN = 12;

TEST(ResidualTest, ForwardAddsAndWorksInPlace) {
  const Vec a = Random(kResN, 12);
  const Vec b = Random(kResN, 13);
  Vec out(kResN);
  ResidualForward(out, a, b, kResN);
  ExpectForwardNear(out, RefResidual(ToDouble(a), ToDouble(b)), "out");
  Vec in_place = a;
  ResidualForward(in_place, in_place, b, kResN);
  EXPECT_EQ(in_place, out);
}

TEST(ResidualTest, BackwardMatchesFiniteDifferences) {
  const Vec a = Random(kResN, 12);
  const Vec b = Random(kResN, 13);
  const Vec dout = Random(kResN, 14);
  Vec da(kResN, 0.0f), db(kResN, 0.0f);
  ResidualBackward(da, db, dout, kResN);
  const DVec ad = ToDouble(a), bd = ToDouble(b);
  ExpectGradNear(
      da, NumericalGrad([&](const DVec& x) { return Dot(RefResidual(x, bd), dout); }, ad), "da");
  ExpectGradNear(
      db, NumericalGrad([&](const DVec& x) { return Dot(RefResidual(ad, x), dout); }, bd), "db");
}

TEST(ResidualTest, BackwardAccumulates) {
  const Vec dout = Random(kResN, 14);
  ExpectAccumulates([&](std::vector<Vec>& g) { ResidualBackward(g[0], g[1], dout, kResN); },
                    {kResN, kResN});
}

// ---------------------------------------------------------------------------------------------
// Cross-entropy

constexpr int64_t kCeN = 6, kCeV = 11;
const std::vector<int32_t> kCeTargets = {0, 10, 4, 4, 7, 2};

TEST(CrossEntropyTest, ForwardMatchesFormula) {
  const Vec logits = Random(kCeN * kCeV, 15, -3.0f, 3.0f);
  Vec probs(logits.size());
  const float loss = CrossEntropyForward(probs, logits, kCeTargets, kCeN, kCeV);
  DVec want_probs;
  const double want = RefCrossEntropy(ToDouble(logits), kCeTargets, kCeN, kCeV, &want_probs);
  EXPECT_NEAR(loss, want, kForwardTol * (1.0 + want));
  ExpectForwardNear(probs, want_probs, "probs");
}

TEST(CrossEntropyTest, UniformLogitsGiveLogV) {
  const Vec logits(kCeN * kCeV, 2.5f);
  Vec probs(logits.size());
  const float loss = CrossEntropyForward(probs, logits, kCeTargets, kCeN, kCeV);
  EXPECT_NEAR(loss, std::log(static_cast<double>(kCeV)), 1e-6);
  for (float p : probs) EXPECT_NEAR(p, 1.0 / kCeV, 1e-7);
}

TEST(CrossEntropyTest, LargeLogitsStayFinite) {
  // exp(1000) overflows FP32; subtracting the row max keeps loss and probabilities exact enough.
  const Vec logits = Random(kCeN * kCeV, 15, -3.0f, 3.0f);
  Vec shifted = logits;
  for (float& l : shifted) l += 1000.0f;
  Vec probs(logits.size()), probs_shifted(logits.size());
  const float loss = CrossEntropyForward(probs, logits, kCeTargets, kCeN, kCeV);
  const float loss_shifted = CrossEntropyForward(probs_shifted, shifted, kCeTargets, kCeN, kCeV);
  ASSERT_TRUE(std::isfinite(loss_shifted));
  // Adding 1000 rounds each logit to a multiple of 2^-14 (ulp at 1024 is 2^-13): loss moves by
  // at most ~2 * 6e-5; the probabilities similarly.
  EXPECT_NEAR(loss_shifted, loss, 2e-4);
  for (size_t i = 0; i < probs.size(); ++i) EXPECT_NEAR(probs_shifted[i], probs[i], 2e-4) << i;
}

TEST(CrossEntropyTest, BackwardMatchesFiniteDifferences) {
  const Vec logits = Random(kCeN * kCeV, 15, -3.0f, 3.0f);
  Vec probs(logits.size());
  CrossEntropyForward(probs, logits, kCeTargets, kCeN, kCeV);
  Vec dlogits(logits.size(), 0.0f);
  CrossEntropyBackward(dlogits, probs, kCeTargets, kCeN, kCeV);
  ExpectGradNear(
      dlogits,
      NumericalGrad([&](const DVec& l) { return RefCrossEntropy(l, kCeTargets, kCeN, kCeV); },
                    ToDouble(logits)),
      "dlogits");
  // And with a loss scale (gradient accumulation over micro-batches).
  Vec scaled(logits.size(), 0.0f);
  CrossEntropyBackward(scaled, probs, kCeTargets, kCeN, kCeV, 0.25f);
  for (size_t i = 0; i < scaled.size(); ++i) EXPECT_FLOAT_EQ(scaled[i], 0.25f * dlogits[i]) << i;
}

TEST(CrossEntropyTest, BackwardAccumulates) {
  const Vec logits = Random(kCeN * kCeV, 15, -3.0f, 3.0f);
  Vec probs(logits.size());
  CrossEntropyForward(probs, logits, kCeTargets, kCeN, kCeV);
  ExpectAccumulates(
      [&](std::vector<Vec>& g) { CrossEntropyBackward(g[0], probs, kCeTargets, kCeN, kCeV); },
      {logits.size()});
}

}  // namespace
}  // namespace fp8rt::kernels
