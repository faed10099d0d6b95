// Tests of the FP32 layer ops (kernels/layer_ops.h) against references written here in
// double precision straight from the formulas, independent of the code under test: forwards are
// compared with the double evaluation, backwards with central finite differences of the double
// forward (of the scalar sum(out * dout) for a fixed random dout).
//
// Index:
//   Ref*                     double-precision forwards (embedding, RMSNorm, LayerNorm, bias,
//                            RoPE in Hugging Face's rotate_half form, grouped-query attention,
//                            GELU, SwiGLU, residual, cross-entropy)
//   NumericalGrad            central differences of a double function
//   ExpectForwardNear        FP32 forward vs double reference (kForwardTol)
//   ExpectGradNear           FP32 backward vs double finite differences (kGradTol)
//   ExpectAccumulates        backward twice onto pre-filled gradients adds twice the gradient
//   EmbeddingTest, RmsNormTest, LayerNormTest, BiasTest, RopeTest, AttentionTest,
//   GqaAttentionTest (TEST_P over H / Hkv, MQA included), GeluTest, SwigluTest, ResidualTest,
//   CrossEntropyTest
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

// mean = sum(x) / C, var = sum((x - mean)^2) / C, y = (x - mean) / sqrt(var + eps) * w + b.
DVec RefLayerNorm(const DVec& x, const DVec& w, const DVec& b, int64_t n, int64_t c, double eps,
                  DVec* mean = nullptr, DVec* rstd = nullptr) {
  DVec out(n * c);
  for (int64_t i = 0; i < n; ++i) {
    double m = 0.0;
    for (int64_t j = 0; j < c; ++j) m += x[i * c + j];
    m /= c;
    double var = 0.0;
    for (int64_t j = 0; j < c; ++j) var += (x[i * c + j] - m) * (x[i * c + j] - m);
    var /= c;
    const double r = 1.0 / std::sqrt(var + eps);
    if (mean != nullptr) mean->push_back(m);
    if (rstd != nullptr) rstd->push_back(r);
    for (int64_t j = 0; j < c; ++j) out[i * c + j] = (x[i * c + j] - m) * r * w[j] + b[j];
  }
  return out;
}

// out[n, c] = x[n, c] + bias[c].
DVec RefBias(const DVec& x, const DVec& bias, int64_t n, int64_t c) {
  DVec out(n * c);
  for (int64_t i = 0; i < n; ++i) {
    for (int64_t j = 0; j < c; ++j) out[i * c + j] = x[i * c + j] + bias[j];
  }
  return out;
}

// Hugging Face's apply_rotary_pos_emb, in double: with half = Dh/2, inv_freq[i] =
// 1 / theta^(2i / Dh) for i < half, emb = cat(freqs, freqs) (so channel i and i + half share
// frequency i), out = x * cos(emb) + rotate_half(x) * sin(emb), rotate_half(x) =
// cat(-x[half:], x[:half]). Row r of x [N, H, Dh] is at position r % t.
DVec RefRope(const DVec& x, int64_t n, int64_t t, int64_t h, int64_t dh, double theta) {
  DVec out(x.size());
  const int64_t half = dh / 2;
  for (int64_t r = 0; r < n; ++r) {
    const double pos = static_cast<double>(r % t);
    for (int64_t hh = 0; hh < h; ++hh) {
      const double* xr = x.data() + (r * h + hh) * dh;
      for (int64_t i = 0; i < dh; ++i) {
        const int64_t f = i % half;
        const double inv_freq = 1.0 / std::pow(theta, 2.0 * static_cast<double>(f) / dh);
        const double rotated = i < half ? -xr[i + half] : xr[i - half];
        out[(r * h + hh) * dh + i] =
            xr[i] * std::cos(pos * inv_freq) + rotated * std::sin(pos * inv_freq);
      }
    }
  }
  return out;
}

// Grouped-query attention: q [B, T, H, Dh], k and v [B, T, Hkv, Dh]; query head hh uses kv head
// hh / (H / Hkv).
struct AttentionShape {
  int64_t b, t, h, hkv, dh;
  int64_t size() const { return b * t * h * dh; }
  int64_t kv_size() const { return b * t * hkv * dh; }
  int64_t lse_size() const { return b * h * t; }
  int64_t at(int64_t bb, int64_t pos, int64_t hh) const { return ((bb * t + pos) * h + hh) * dh; }
  // Where the kv head of query head hh sits.
  int64_t kv_at(int64_t bb, int64_t pos, int64_t hh) const {
    return ((bb * t + pos) * hkv + hh / (h / hkv)) * dh;
  }
};

// out_i = sum_{j<=i} softmax_j(q_i . k_j / sqrt(Dh)) v_j per (batch, query head); lse
// [B, H, T] = log sum_{j<=i} exp(q_i . k_j / sqrt(Dh)).
DVec RefAttention(const DVec& q, const DVec& k, const DVec& v, const AttentionShape& s,
                  DVec* lse = nullptr) {
  DVec out(s.size(), 0.0);
  if (lse != nullptr) lse->assign(s.lse_size(), 0.0);
  for (int64_t bb = 0; bb < s.b; ++bb) {
    for (int64_t hh = 0; hh < s.h; ++hh) {
      for (int64_t i = 0; i < s.t; ++i) {
        DVec e(i + 1);
        double sum = 0.0;
        for (int64_t j = 0; j <= i; ++j) {
          double dot = 0.0;
          for (int64_t d = 0; d < s.dh; ++d) {
            dot += q[s.at(bb, i, hh) + d] * k[s.kv_at(bb, j, hh) + d];
          }
          e[j] = std::exp(dot / std::sqrt(static_cast<double>(s.dh)));
          sum += e[j];
        }
        if (lse != nullptr) (*lse)[(bb * s.h + hh) * s.t + i] = std::log(sum);
        for (int64_t j = 0; j <= i; ++j) {
          const double p = e[j] / sum;
          for (int64_t d = 0; d < s.dh; ++d) {
            out[s.at(bb, i, hh) + d] += p * v[s.kv_at(bb, j, hh) + d];
          }
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

// out = gate * sigmoid(gate) * up.
DVec RefSwiglu(const DVec& gate, const DVec& up) {
  DVec out(gate.size());
  for (size_t i = 0; i < gate.size(); ++i) out[i] = gate[i] / (1.0 + std::exp(-gate[i])) * up[i];
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
// LayerNorm

constexpr int64_t kLnN = 5, kLnC = 9;
constexpr float kLnEps = 1e-5f;

struct LayerNormInputs {
  // An offset on x, so that the mean is far from 0 and subtracting it matters.
  Vec x = [] {
    Vec v = Random(kLnN * kLnC, 40, -1.0f, 1.0f);
    for (float& e : v) e += 0.75f;
    return v;
  }();
  Vec w = Random(kLnC, 41, 0.5f, 1.5f);
  Vec b = Random(kLnC, 42, -0.5f, 0.5f);
  Vec dout = Random(kLnN * kLnC, 43);
};

TEST(LayerNormTest, ForwardMatchesFormula) {
  const LayerNormInputs in;
  Vec out(in.x.size()), mean(kLnN), rstd(kLnN);
  LayerNormForward(out, mean, rstd, in.x, in.w, in.b, kLnN, kLnC, kLnEps);
  DVec want_mean, want_rstd;
  const DVec want = RefLayerNorm(ToDouble(in.x), ToDouble(in.w), ToDouble(in.b), kLnN, kLnC, kLnEps,
                                 &want_mean, &want_rstd);
  ExpectForwardNear(out, want, "out");
  ExpectForwardNear(mean, want_mean, "mean");
  ExpectForwardNear(rstd, want_rstd, "rstd");
}

TEST(LayerNormTest, ConstantRowGivesTheBias) {
  // x constant along a row: x - mean is exactly 0, so out is the bias whatever eps and weight.
  const Vec x(2 * kLnC, 3.5f);
  const LayerNormInputs in;
  Vec out(x.size()), mean(2), rstd(2);
  LayerNormForward(out, mean, rstd, x, in.w, in.b, 2, kLnC, kLnEps);
  EXPECT_EQ(mean[0], 3.5f);
  for (int64_t i = 0; i < 2; ++i) {
    for (int64_t j = 0; j < kLnC; ++j) EXPECT_EQ(out[i * kLnC + j], in.b[j]) << i << ", " << j;
  }
}

TEST(LayerNormTest, BackwardMatchesFiniteDifferences) {
  const LayerNormInputs in;
  Vec out(in.x.size()), mean(kLnN), rstd(kLnN);
  LayerNormForward(out, mean, rstd, in.x, in.w, in.b, kLnN, kLnC, kLnEps);
  Vec dx(in.x.size(), 0.0f), dw(kLnC, 0.0f), db(kLnC, 0.0f);
  LayerNormBackward(dx, dw, db, in.dout, in.x, in.w, mean, rstd, kLnN, kLnC);
  const DVec xd = ToDouble(in.x), wd = ToDouble(in.w), bd = ToDouble(in.b);
  auto loss = [&](const DVec& x, const DVec& w, const DVec& b) {
    return Dot(RefLayerNorm(x, w, b, kLnN, kLnC, kLnEps), in.dout);
  };
  ExpectGradNear(dx, NumericalGrad([&](const DVec& v) { return loss(v, wd, bd); }, xd), "dx");
  ExpectGradNear(dw, NumericalGrad([&](const DVec& v) { return loss(xd, v, bd); }, wd), "dweight");
  ExpectGradNear(db, NumericalGrad([&](const DVec& v) { return loss(xd, wd, v); }, bd), "dbias");
}

TEST(LayerNormTest, BackwardAccumulates) {
  const LayerNormInputs in;
  Vec out(in.x.size()), mean(kLnN), rstd(kLnN);
  LayerNormForward(out, mean, rstd, in.x, in.w, in.b, kLnN, kLnC, kLnEps);
  ExpectAccumulates(
      [&](std::vector<Vec>& g) {
        LayerNormBackward(g[0], g[1], g[2], in.dout, in.x, in.w, mean, rstd, kLnN, kLnC);
      },
      {in.x.size(), in.w.size(), in.b.size()});
}

// ---------------------------------------------------------------------------------------------
// Bias

constexpr int64_t kBiasN = 4, kBiasC = 7;

TEST(BiasTest, ForwardAddsTheBiasToEveryRow) {
  const Vec x = Random(kBiasN * kBiasC, 44);
  const Vec bias = Random(kBiasC, 45);
  Vec out = x;
  BiasForward(out, bias, kBiasN, kBiasC);
  // One FP32 addition per element: the correctly rounded double sum.
  const DVec want = RefBias(ToDouble(x), ToDouble(bias), kBiasN, kBiasC);
  for (size_t i = 0; i < out.size(); ++i) EXPECT_EQ(out[i], static_cast<float>(want[i])) << i;
}

TEST(BiasTest, BackwardMatchesFiniteDifferences) {
  const Vec x = Random(kBiasN * kBiasC, 44);
  const Vec bias = Random(kBiasC, 45);
  const Vec dout = Random(x.size(), 46);
  Vec dbias(kBiasC, 0.0f);
  BiasBackward(dbias, dout, kBiasN, kBiasC);
  const DVec xd = ToDouble(x);
  ExpectGradNear(
      dbias,
      NumericalGrad([&](const DVec& b) { return Dot(RefBias(xd, b, kBiasN, kBiasC), dout); },
                    ToDouble(bias)),
      "dbias");
  // The rows are added in ascending order onto dbias.
  for (int64_t j = 0; j < kBiasC; ++j) {
    float want = 0.0f;
    for (int64_t i = 0; i < kBiasN; ++i) want += dout[i * kBiasC + j];
    EXPECT_EQ(dbias[j], want) << j;
  }
}

TEST(BiasTest, BackwardAccumulates) {
  const Vec dout = Random(kBiasN * kBiasC, 46);
  ExpectAccumulates([&](std::vector<Vec>& g) { BiasBackward(g[0], dout, kBiasN, kBiasC); },
                    {kBiasC});
}

// ---------------------------------------------------------------------------------------------
// RoPE

// Seven rows of sequences of three tokens: positions 0, 1, 2, 0, 1, 2, 0.
constexpr int64_t kRopeN = 7, kRopeT = 3, kRopeH = 2, kRopeDh = 8;
constexpr float kRopeTheta = 10000.0f;
constexpr int64_t kRopeSize = kRopeN * kRopeH * kRopeDh;

TEST(RopeTest, ForwardMatchesHuggingFaceRotateHalf) {
  for (const float theta : {kRopeTheta, 500000.0f, 2.0f}) {
    SCOPED_TRACE(::testing::Message() << "theta " << theta);
    const Vec x = Random(kRopeSize, 47);
    Vec out(x.size());
    RopeForward(out, x, kRopeN, kRopeT, kRopeH, kRopeDh, theta);
    ExpectForwardNear(out, RefRope(ToDouble(x), kRopeN, kRopeT, kRopeH, kRopeDh, theta), "out");
  }
  // Long sequences: positions up to 4095, where the angles are large (still in double).
  constexpr int64_t kLongT = 4096, kLongH = 1, kLongDh = 4;
  const Vec x = Random(kLongT * kLongH * kLongDh, 48);
  Vec out(x.size());
  RopeForward(out, x, kLongT, kLongT, kLongH, kLongDh, kRopeTheta);
  ExpectForwardNear(out, RefRope(ToDouble(x), kLongT, kLongT, kLongH, kLongDh, kRopeTheta), "long");
}

TEST(RopeTest, PositionZeroIsTheIdentityAndPositionsRestartEveryT) {
  const Vec x = Random(kRopeSize, 49);
  Vec out(x.size());
  RopeForward(out, x, kRopeN, kRopeT, kRopeH, kRopeDh, kRopeTheta);
  const int64_t row = kRopeH * kRopeDh;
  for (int64_t r = 0; r < kRopeN; ++r) {
    for (int64_t e = 0; e < row; ++e) {
      if (r % kRopeT == 0) {
        EXPECT_EQ(out[r * row + e], x[r * row + e]) << "row " << r;
      }
    }
  }
  // Rows 1 and 4 are both at position 1: the same input there gives the same output.
  Vec x2 = x;
  std::copy_n(x.begin() + 1 * row, row, x2.begin() + 4 * row);
  Vec out2(x.size());
  RopeForward(out2, x2, kRopeN, kRopeT, kRopeH, kRopeDh, kRopeTheta);
  for (int64_t e = 0; e < row; ++e) EXPECT_EQ(out2[4 * row + e], out[1 * row + e]) << e;
  // And a later position is not the identity.
  EXPECT_NE(out[1 * row + 1], x[1 * row + 1]);
}

TEST(RopeTest, InPlaceEqualsOutOfPlace) {
  const Vec x = Random(kRopeSize, 50);
  Vec out(x.size());
  RopeForward(out, x, kRopeN, kRopeT, kRopeH, kRopeDh, kRopeTheta);
  Vec in_place = x;
  RopeForward(in_place, in_place, kRopeN, kRopeT, kRopeH, kRopeDh, kRopeTheta);
  EXPECT_EQ(in_place, out);
}

TEST(RopeTest, BackwardIsTheExactTranspose) {
  // The forward's matrix column by column (forward of unit vectors) and the backward's row by
  // row (backward of unit vectors onto zeros): M_bwd = M_fwd^T exactly. Both are exact products
  // of 0 and 1 with cos and sin, so any difference is a wrong sign, pair or angle.
  constexpr int64_t kN = 3, kT = 3, kH = 1, kDh = 6, kSize = kN * kH * kDh;
  std::vector<Vec> fwd(kSize), bwd(kSize);
  for (int64_t e = 0; e < kSize; ++e) {
    Vec unit(kSize, 0.0f);
    unit[e] = 1.0f;
    fwd[e].assign(kSize, 0.0f);
    RopeForward(fwd[e], unit, kN, kT, kH, kDh, kRopeTheta);  // column e
    bwd[e].assign(kSize, 0.0f);
    RopeBackward(bwd[e], unit, kN, kT, kH, kDh, kRopeTheta);  // row e of the transpose
  }
  int nonzero = 0;
  for (int64_t i = 0; i < kSize; ++i) {
    for (int64_t j = 0; j < kSize; ++j) {
      // fwd[j][i] = M[i][j] (column j of M); bwd[i][j] = M^T[j][i] (column i of M^T) = M[i][j].
      EXPECT_EQ(bwd[i][j], fwd[j][i]) << i << ", " << j;
      nonzero += fwd[j][i] != 0.0f;
    }
  }
  EXPECT_GT(nonzero, kSize) << "the rotation should mix channel pairs";
}

TEST(RopeTest, BackwardMatchesFiniteDifferences) {
  const Vec x = Random(kRopeSize, 51);
  const Vec dout = Random(kRopeSize, 52);
  Vec dx(x.size(), 0.0f);
  RopeBackward(dx, dout, kRopeN, kRopeT, kRopeH, kRopeDh, kRopeTheta);
  ExpectGradNear(dx,
                 NumericalGrad(
                     [&](const DVec& xx) {
                       return Dot(RefRope(xx, kRopeN, kRopeT, kRopeH, kRopeDh, kRopeTheta), dout);
                     },
                     ToDouble(x)),
                 "dx");
}

TEST(RopeTest, BackwardAccumulates) {
  const Vec dout = Random(kRopeSize, 52);
  ExpectAccumulates(
      [&](std::vector<Vec>& g) {
        RopeBackward(g[0], dout, kRopeN, kRopeT, kRopeH, kRopeDh, kRopeTheta);
      },
      {kRopeSize});
}

// ---------------------------------------------------------------------------------------------
// Causal multi-head attention

constexpr AttentionShape kAttn{.b = 2, .t = 5, .h = 2, .hkv = 2, .dh = 4};

struct AttentionInputs {
  // Scores q.k/sqrt(Dh) of a few units keep the softmax away from uniform and from one-hot.
  Vec q = Random(kAttn.size(), 6, -2.0f, 2.0f);
  Vec k = Random(kAttn.size(), 7, -2.0f, 2.0f);
  Vec v = Random(kAttn.size(), 8);
  Vec dout = Random(kAttn.size(), 9);
};

void RunAttentionForward(const AttentionInputs& in, Vec& out, Vec& lse) {
  out.assign(kAttn.size(), 0.0f);
  lse.assign(kAttn.lse_size(), -1.0f);
  AttentionForward(out, lse, in.q, in.k, in.v, kAttn.b, kAttn.t, kAttn.h, kAttn.hkv, kAttn.dh);
}

TEST(AttentionTest, ForwardMatchesFormula) {
  const AttentionInputs in;
  Vec out;
  Vec lse;
  RunAttentionForward(in, out, lse);
  DVec want_lse;
  const DVec want =
      RefAttention(ToDouble(in.q), ToDouble(in.k), ToDouble(in.v), kAttn, &want_lse);
  ExpectForwardNear(out, want, "out");
  ExpectForwardNear(lse, want_lse, "lse");
}

// The probabilities the saved lse defines, p_ij = exp(s_ij - lse_i) over the visible keys,
// sum to one in every row (evaluated in double from the FP32 inputs and lse).
TEST(AttentionTest, SavedLseNormalisesEveryRow) {
  const AttentionInputs in;
  Vec out;
  Vec lse;
  RunAttentionForward(in, out, lse);
  for (int64_t bb = 0; bb < kAttn.b; ++bb) {
    for (int64_t hh = 0; hh < kAttn.h; ++hh) {
      for (int64_t i = 0; i < kAttn.t; ++i) {
        const double row_lse = lse[(bb * kAttn.h + hh) * kAttn.t + i];
        double sum = 0.0;
        for (int64_t j = 0; j <= i; ++j) {
          double dot = 0.0;
          for (int64_t d = 0; d < kAttn.dh; ++d) {
            dot += double{in.q[kAttn.at(bb, i, hh) + d]} * in.k[kAttn.kv_at(bb, j, hh) + d];
          }
          sum += std::exp(dot / std::sqrt(static_cast<double>(kAttn.dh)) - row_lse);
        }
        EXPECT_NEAR(sum, 1.0, 1e-6) << "batch " << bb << " head " << hh << " query " << i;
      }
    }
  }
}

TEST(AttentionTest, FutureKeysAndValuesDoNotChangeEarlierOutputs) {
  const AttentionInputs in;
  Vec out;
  Vec lse;
  RunAttentionForward(in, out, lse);
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
  Vec lse2;
  RunAttentionForward(changed, out2, lse2);
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
  Vec lse;
  RunAttentionForward(in, out, lse);
  // Gradient only on outputs before position 3: keys and values at 3 and later get nothing.
  constexpr int64_t kPos = 3;
  Vec dout = in.dout;
  for (int64_t bb = 0; bb < kAttn.b; ++bb) {
    for (int64_t pos = kPos; pos < kAttn.t; ++pos) {
      std::fill_n(dout.begin() + kAttn.at(bb, pos, 0), kAttn.h * kAttn.dh, 0.0f);
    }
  }
  Vec dq(kAttn.size(), 0.0f), dk(kAttn.size(), 0.0f), dv(kAttn.size(), 0.0f);
  AttentionBackward(dq, dk, dv, dout, in.q, in.k, in.v, out, lse, kAttn.b, kAttn.t, kAttn.h, kAttn.hkv,
                    kAttn.dh);
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
  Vec lse;
  RunAttentionForward(in, out, lse);
  Vec dq(kAttn.size(), 0.0f), dk(kAttn.size(), 0.0f), dv(kAttn.size(), 0.0f);
  AttentionBackward(dq, dk, dv, in.dout, in.q, in.k, in.v, out, lse, kAttn.b, kAttn.t, kAttn.h,
                    kAttn.hkv, kAttn.dh);
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
  Vec lse;
  RunAttentionForward(in, out, lse);
  const size_t n = kAttn.size();
  ExpectAccumulates(
      [&](std::vector<Vec>& g) {
        AttentionBackward(g[0], g[1], g[2], in.dout, in.q, in.k, in.v, out, lse, kAttn.b, kAttn.t,
                          kAttn.h, kAttn.hkv, kAttn.dh);
      },
      {n, n, n});
}

// ---------------------------------------------------------------------------------------------
// Grouped-query attention: H query heads share Hkv kv heads (Hkv = H is multi-head, 1 multi-query)

class GqaAttentionTest : public ::testing::TestWithParam<AttentionShape> {
 protected:
  const AttentionShape s = GetParam();
  Vec q = Random(s.size(), 60, -2.0f, 2.0f);
  Vec k = Random(s.kv_size(), 61, -2.0f, 2.0f);
  Vec v = Random(s.kv_size(), 62);
  Vec dout = Random(s.size(), 63);

  void Forward(Vec& out, Vec& lse) const {
    out.assign(s.size(), 0.0f);
    lse.assign(s.lse_size(), -1.0f);
    AttentionForward(out, lse, q, k, v, s.b, s.t, s.h, s.hkv, s.dh);
  }
  // k or v repeated for every query head: the multi-head inputs of the same attention.
  Vec RepeatKv(const Vec& kv) const {
    Vec out(s.size());
    for (int64_t bb = 0; bb < s.b; ++bb) {
      for (int64_t pos = 0; pos < s.t; ++pos) {
        for (int64_t hh = 0; hh < s.h; ++hh) {
          std::copy_n(kv.begin() + s.kv_at(bb, pos, hh), s.dh, out.begin() + s.at(bb, pos, hh));
        }
      }
    }
    return out;
  }
};

TEST_P(GqaAttentionTest, ForwardMatchesFormula) {
  Vec out, lse;
  Forward(out, lse);
  DVec want_lse;
  const DVec want = RefAttention(ToDouble(q), ToDouble(k), ToDouble(v), s, &want_lse);
  ExpectForwardNear(out, want, "out");
  ExpectForwardNear(lse, want_lse, "lse");
}

TEST_P(GqaAttentionTest, BackwardMatchesFiniteDifferences) {
  Vec out, lse;
  Forward(out, lse);
  Vec dq(s.size(), 0.0f), dk(s.kv_size(), 0.0f), dv(s.kv_size(), 0.0f);
  AttentionBackward(dq, dk, dv, dout, q, k, v, out, lse, s.b, s.t, s.h, s.hkv, s.dh);
  const DVec qd = ToDouble(q), kd = ToDouble(k), vd = ToDouble(v);
  ExpectGradNear(
      dq, NumericalGrad([&](const DVec& x) { return Dot(RefAttention(x, kd, vd, s), dout); }, qd),
      "dq");
  ExpectGradNear(
      dk, NumericalGrad([&](const DVec& x) { return Dot(RefAttention(qd, x, vd, s), dout); }, kd),
      "dk");
  ExpectGradNear(
      dv, NumericalGrad([&](const DVec& x) { return Dot(RefAttention(qd, kd, x, s), dout); }, vd),
      "dv");
}

TEST_P(GqaAttentionTest, BackwardAccumulates) {
  Vec out, lse;
  Forward(out, lse);
  ExpectAccumulates(
      [&](std::vector<Vec>& g) {
        AttentionBackward(g[0], g[1], g[2], dout, q, k, v, out, lse, s.b, s.t, s.h, s.hkv, s.dh);
      },
      {static_cast<size_t>(s.size()), static_cast<size_t>(s.kv_size()),
       static_cast<size_t>(s.kv_size())});
}

// GQA is multi-head attention on kv heads repeated across each group: the forward and dq are bit
// for bit those of the multi-head call (the same operations in the same order), and dk, dv are
// the sums over each group of the multi-head call's (added in another order: within a few FP32
// roundings).
TEST_P(GqaAttentionTest, EqualsMultiHeadAttentionOnRepeatedKvHeads) {
  const AttentionShape mha{s.b, s.t, s.h, s.h, s.dh};
  const Vec k_rep = RepeatKv(k), v_rep = RepeatKv(v);
  Vec out, lse;
  Forward(out, lse);
  Vec out_mha(s.size()), lse_mha(s.lse_size());
  AttentionForward(out_mha, lse_mha, q, k_rep, v_rep, mha.b, mha.t, mha.h, mha.hkv, mha.dh);
  EXPECT_EQ(out, out_mha);
  EXPECT_EQ(lse, lse_mha);

  Vec dq(s.size(), 0.0f), dk(s.kv_size(), 0.0f), dv(s.kv_size(), 0.0f);
  AttentionBackward(dq, dk, dv, dout, q, k, v, out, lse, s.b, s.t, s.h, s.hkv, s.dh);
  Vec dq_mha(s.size(), 0.0f), dk_mha(s.size(), 0.0f), dv_mha(s.size(), 0.0f);
  AttentionBackward(dq_mha, dk_mha, dv_mha, dout, q, k_rep, v_rep, out, lse, mha.b, mha.t, mha.h,
                    mha.hkv, mha.dh);
  EXPECT_EQ(dq, dq_mha);
  DVec dk_sum(s.kv_size(), 0.0), dv_sum(s.kv_size(), 0.0), dk_abs(s.kv_size(), 0.0),
      dv_abs(s.kv_size(), 0.0);
  for (int64_t bb = 0; bb < s.b; ++bb) {
    for (int64_t pos = 0; pos < s.t; ++pos) {
      for (int64_t hh = 0; hh < s.h; ++hh) {
        for (int64_t d = 0; d < s.dh; ++d) {
          const int64_t to = s.kv_at(bb, pos, hh) + d, from = s.at(bb, pos, hh) + d;
          dk_sum[to] += dk_mha[from];
          dv_sum[to] += dv_mha[from];
          dk_abs[to] += std::abs(dk_mha[from]);
          dv_abs[to] += std::abs(dv_mha[from]);
        }
      }
    }
  }
  // Each side is within (T * H + 1) FP32 roundings of the exact sum of its |terms|; 1e-5 of the
  // group's magnitude covers both with a wide margin (and a missing head is an O(1) error).
  for (int64_t i = 0; i < s.kv_size(); ++i) {
    EXPECT_NEAR(dk[i], dk_sum[i], 1e-5 * (dk_abs[i] + 1e-6)) << "dk " << i;
    EXPECT_NEAR(dv[i], dv_sum[i], 1e-5 * (dv_abs[i] + 1e-6)) << "dv " << i;
  }
}

INSTANTIATE_TEST_SUITE_P(Shapes, GqaAttentionTest,
                         ::testing::Values(AttentionShape{2, 5, 4, 2, 4},   // two groups of two
                                           AttentionShape{1, 6, 3, 1, 4},   // multi-query
                                           AttentionShape{2, 4, 6, 3, 3},   // three groups of two
                                           AttentionShape{1, 4, 2, 2, 5}),  // multi-head
                         [](const auto& info) {
                           const AttentionShape& p = info.param;
                           return "B" + std::to_string(p.b) + "_T" + std::to_string(p.t) + "_H" +
                                  std::to_string(p.h) + "_Hkv" + std::to_string(p.hkv) + "_Dh" +
                                  std::to_string(p.dh);
                         });

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
// SwiGLU

constexpr int64_t kSwiN = 24;

TEST(SwigluTest, ForwardMatchesFormula) {
  const Vec gate = Random(kSwiN, 70, -6.0f, 6.0f);
  const Vec up = Random(kSwiN, 71, -2.0f, 2.0f);
  Vec out(kSwiN);
  SwigluForward(out, gate, up, kSwiN);
  ExpectForwardNear(out, RefSwiglu(ToDouble(gate), ToDouble(up)), "out");
}

TEST(SwigluTest, BackwardMatchesFiniteDifferences) {
  const Vec gate = Random(kSwiN, 70, -6.0f, 6.0f);
  const Vec up = Random(kSwiN, 71, -2.0f, 2.0f);
  const Vec dout = Random(kSwiN, 72);
  Vec dgate(kSwiN, 0.0f), dup(kSwiN, 0.0f);
  SwigluBackward(dgate, dup, dout, gate, up, kSwiN);
  const DVec gd = ToDouble(gate), ud = ToDouble(up);
  ExpectGradNear(dgate,
                 NumericalGrad([&](const DVec& g) { return Dot(RefSwiglu(g, ud), dout); }, gd),
                 "dgate");
  ExpectGradNear(dup, NumericalGrad([&](const DVec& u) { return Dot(RefSwiglu(gd, u), dout); }, ud),
                 "dup");
}

TEST(SwigluTest, BackwardAccumulates) {
  const Vec gate = Random(kSwiN, 70, -6.0f, 6.0f);
  const Vec up = Random(kSwiN, 71, -2.0f, 2.0f);
  const Vec dout = Random(kSwiN, 72);
  ExpectAccumulates([&](std::vector<Vec>& g) { SwigluBackward(g[0], g[1], dout, gate, up, kSwiN); },
                    {kSwiN, kSwiN});
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
