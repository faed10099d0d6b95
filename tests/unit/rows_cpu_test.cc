// The vectorised, threaded CPU layer-op entries (kernels/cpu/rows_cpu.cc, issue 18) against the
// scalar references of kernels/layer_ops.h, at shapes that take every path: several row blocks
// and column blocks across the OpenMP team, rows that are not a whole number of vectors.
//
//   ExactOpsTest       ops with no reduction reordered (bias, residual, embedding, RoPE, the
//                      cross-entropy backward, AdamW with and without its FP8 shard, the weight
//                      and bias gradients, which are column sums in row order): bit for bit the
//                      reference.
//   ReducingOpsTest    ops whose row sums run lane-wise (the norms, the softmax of the
//                      cross-entropy): within the bound of two FP32 summation orders, derived
//                      below from the standard bound |fl(sum) - sum| <= (c - 1) u sum |terms|.
//   AttentionTest      the attention core: within the dot-product bound, dv bit for bit.
//   ThreadCountTest    every entry gives the same bits on 1 and on 3 threads.
#include <omp.h>

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdint>
#include <functional>
#include <limits>
#include <random>
#include <span>
#include <vector>

#include "gtest/gtest.h"
#include "kernels/layer_ops.h"
#include "kernels/ops.h"
#include "tests/support/attention_check.h"

namespace fp8rt::kernels {
namespace {

constexpr double kU = 0x1p-24;  // FP32 unit roundoff
const LayerOps& Ops() { return *CpuOps().layer; }

std::vector<float> Random(size_t n, uint32_t seed, float lo, float hi) {
  std::mt19937 rng(seed);
  std::uniform_real_distribution<float> dist(lo, hi);
  std::vector<float> v(n);
  for (float& x : v) x = dist(rng);
  return v;
}

template <typename T>
std::span<T> S(std::vector<T>& v) {
  return std::span<T>(v);
}
template <typename T>
std::span<const T> C(const std::vector<T>& v) {
  return std::span<const T>(v);
}

::testing::AssertionResult SameBits(const std::vector<float>& got, const std::vector<float>& want) {
  if (got.size() != want.size()) return ::testing::AssertionFailure() << "sizes differ";
  for (size_t i = 0; i < got.size(); ++i) {
    if (std::bit_cast<uint32_t>(got[i]) != std::bit_cast<uint32_t>(want[i])) {
      return ::testing::AssertionFailure()
             << "first difference at " << i << ": " << got[i] << " vs " << want[i];
    }
  }
  return ::testing::AssertionSuccess();
}

// |got - want| <= tol[i] at every i, and the largest difference is reported.
::testing::AssertionResult Within(const std::vector<float>& got, const std::vector<float>& want,
                                  const std::vector<double>& tol) {
  for (size_t i = 0; i < got.size(); ++i) {
    const double diff = std::fabs(double{got[i]} - double{want[i]});
    if (!(diff <= tol[i])) {
      return ::testing::AssertionFailure() << "at " << i << ": " << got[i] << " vs reference "
                                           << want[i] << " (tolerance " << tol[i] << ")";
    }
  }
  return ::testing::AssertionSuccess();
}

struct Shape {
  int64_t n, c;
};
// 67 rows: several row blocks of the team; c = 1027 ends rows on a partial vector and spans five
// 256-column blocks; c = 5 is shorter than a vector.
const Shape kShapes[] = {{67, 1024}, {67, 1027}, {9, 5}};

class ExactOpsTest : public ::testing::TestWithParam<Shape> {};
class ReducingOpsTest : public ::testing::TestWithParam<Shape> {};

TEST_P(ExactOpsTest, BiasResidualAndEmbeddingEqualTheReferences) {
  const auto [n, c] = GetParam();
  const Stream s{};
  const std::vector<float> x = Random(n * c, 1, -2, 2), bias = Random(c, 2, -1, 1),
                           dout = Random(n * c, 3, -1, 1);
  std::vector<float> got = x, want = x;
  ASSERT_TRUE(Ops().bias_forward(got.data(), bias.data(), n, c, s).ok());
  BiasForward(S(want), C(bias), n, c);
  EXPECT_TRUE(SameBits(got, want)) << "bias forward";
  std::vector<float> dg = Random(c, 4, -1, 1), dw = dg;
  ASSERT_TRUE(Ops().bias_backward(dg.data(), dout.data(), n, c, s).ok());
  BiasBackward(S(dw), C(dout), n, c);
  EXPECT_TRUE(SameBits(dg, dw)) << "bias backward";

  std::vector<float> r(n * c), rw(n * c);
  ASSERT_TRUE(Ops().residual_forward(r.data(), x.data(), dout.data(), n * c, s).ok());
  ResidualForward(S(rw), C(x), C(dout), n * c);
  EXPECT_TRUE(SameBits(r, rw)) << "residual forward";
  std::vector<float> da = Random(n * c, 5, -1, 1), db = Random(n * c, 6, -1, 1), daw = da, dbw = db;
  ASSERT_TRUE(Ops().residual_backward(da.data(), db.data(), dout.data(), n * c, s).ok());
  ResidualBackward(S(daw), S(dbw), C(dout), n * c);
  EXPECT_TRUE(SameBits(da, daw) && SameBits(db, dbw)) << "residual backward";

  // Embedding, with repeated tokens (their gradient rows add in row order).
  const int64_t v = 11;
  std::vector<int32_t> tokens(n);
  for (int64_t i = 0; i < n; ++i) tokens[i] = static_cast<int32_t>((i * 7) % v);
  const std::vector<float> table = Random(v * c, 7, -1, 1);
  std::vector<float> e(n * c), ew(n * c);
  ASSERT_TRUE(Ops().embedding_forward(e.data(), tokens.data(), table.data(), n, v, c, s).ok());
  EmbeddingForward(S(ew), C(tokens), C(table), n, v, c);
  EXPECT_TRUE(SameBits(e, ew)) << "embedding forward";
  std::vector<float> dt = Random(v * c, 8, -1, 1), dtw = dt;
  ASSERT_TRUE(Ops().embedding_backward(dt.data(), dout.data(), tokens.data(), n, v, c, s).ok());
  EmbeddingBackward(S(dtw), C(dout), C(tokens), n, v, c);
  EXPECT_TRUE(SameBits(dt, dtw)) << "embedding backward";
}

TEST_P(ExactOpsTest, RopeAndTheCrossEntropyBackwardEqualTheReferences) {
  const auto [n, c] = GetParam();
  const Stream s{};
  // RoPE over h heads of dh channels with c = h * dh rounded to even head sizes; t = 13 positions.
  const int64_t dh = c >= 64 ? 64 : 2, h = c / dh, t = 13;
  const int64_t size = n * h * dh;
  const std::vector<float> x = Random(size, 9, -2, 2), dout = Random(size, 10, -1, 1);
  std::vector<float> got(size), want(size);
  ASSERT_TRUE(Ops().rope_forward(got.data(), x.data(), n, t, h, dh, 10000.0f, s).ok());
  RopeForward(S(want), C(x), n, t, h, dh, 10000.0f);
  EXPECT_TRUE(SameBits(got, want)) << "rope forward";
  std::vector<float> in_place = x;
  ASSERT_TRUE(Ops().rope_forward(in_place.data(), in_place.data(), n, t, h, dh, 10000.0f, s).ok());
  EXPECT_TRUE(SameBits(in_place, want)) << "rope forward in place";
  std::vector<float> dx = Random(size, 11, -1, 1), dxw = dx;
  ASSERT_TRUE(Ops().rope_backward(dx.data(), dout.data(), n, t, h, dh, 10000.0f, s).ok());
  RopeBackward(S(dxw), C(dout), n, t, h, dh, 10000.0f);
  EXPECT_TRUE(SameBits(dx, dxw)) << "rope backward";

  // The cross-entropy backward from the reference's probabilities.
  const int64_t v = c;
  std::vector<int32_t> targets(n);
  for (int64_t i = 0; i < n; ++i) targets[i] = static_cast<int32_t>((i * 31) % v);
  const std::vector<float> logits = Random(n * v, 12, -4, 4);
  std::vector<float> probs(n * v);
  CrossEntropyForward(S(probs), C(logits), C(targets), n, v);
  std::vector<float> dl = Random(n * v, 13, -1, 1), dlw = dl;
  ASSERT_TRUE(
      Ops().cross_entropy_backward(dl.data(), probs.data(), targets.data(), n, v, 0.75f, s).ok());
  CrossEntropyBackward(S(dlw), C(probs), C(targets), n, v, 0.75f);
  EXPECT_TRUE(SameBits(dl, dlw)) << "cross-entropy backward";
}

TEST_P(ExactOpsTest, NormWeightGradientsEqualTheReferences) {
  // The weight and bias gradients are column sums in row order: bit for bit. (dx reduces rows
  // lane-wise and is checked by ReducingOpsTest.)
  const auto [n, c] = GetParam();
  const Stream s{};
  const std::vector<float> x = Random(n * c, 14, -2, 2), w = Random(c, 15, 0.5, 1.5),
                           dout = Random(n * c, 16, -1, 1), rstd = Random(n, 17, 0.5, 2),
                           mean = Random(n, 18, -0.5, 0.5);
  std::vector<float> dx(n * c), dxw(n * c), dwg = Random(c, 19, -1, 1), dww = dwg;
  ASSERT_TRUE(Ops()
                  .rmsnorm_backward(dx.data(), dwg.data(), dout.data(), x.data(), w.data(),
                                    rstd.data(), n, c, s)
                  .ok());
  RmsNormBackward(S(dxw), S(dww), C(dout), C(x), C(w), C(rstd), n, c);
  EXPECT_TRUE(SameBits(dwg, dww)) << "rmsnorm dweight";
  std::vector<float> dbg = Random(c, 20, -1, 1), dbw = dbg;
  dwg = Random(c, 21, -1, 1);
  dww = dwg;
  ASSERT_TRUE(Ops()
                  .layernorm_backward(dx.data(), dwg.data(), dbg.data(), dout.data(), x.data(),
                                      w.data(), mean.data(), rstd.data(), n, c, s)
                  .ok());
  LayerNormBackward(S(dxw), S(dww), S(dbw), C(dout), C(x), C(w), C(mean), C(rstd), n, c);
  EXPECT_TRUE(SameBits(dwg, dww)) << "layernorm dweight";
  EXPECT_TRUE(SameBits(dbg, dbw)) << "layernorm dbias";
}

// AdamW without and with its FP8 shard (tensor scaling in both formats, 128 x 128 blocks).
TEST_P(ExactOpsTest, AdamWAndItsFp8ShardEqualAdamWUpdate) {
  const auto [n, c] = GetParam();
  const int64_t count = n * c;
  struct Case {
    bool fp8, block;
    Fp8Format format;
  };
  for (const Case k : {Case{false, false, Fp8Format::kE4M3}, Case{true, false, Fp8Format::kE4M3},
                       Case{true, false, Fp8Format::kE5M2}, Case{true, true, Fp8Format::kE4M3}}) {
    SCOPED_TRACE(::testing::Message() << "fp8 " << k.fp8 << " block " << k.block);
    struct State {
      std::vector<float> master, grad, m, v;
      std::vector<uint8_t> codes;
      std::vector<float> scale_inv;
      QuantStats stats;
    };
    auto make = [&]() {
      State st{Random(count, 22, -2, 2), Random(count, 23, -1, 1), Random(count, 24, -0.1f, 0.1f),
               Random(count, 25, 0, 0.01f), std::vector<uint8_t>(count, 0xAA),
               std::vector<float>(static_cast<size_t>((n + 127) / 128 * ((c + 127) / 128)), -1.0f),
               QuantStats{}};
      st.grad[3] = 0.0f;
      st.master[5] = 1e-12f;  // no step (zero gradient and moment): underflows in FP8
      st.grad[5] = 0.0f;
      st.m[5] = 0.0f;
      if (!k.block) {
        // Tensor scaling: saturating (|x| * scale far past the format's max) and non-finite
        // values, in the vectorised part and in the scalar tail of the quantizer's spans.
        for (const int64_t i : {int64_t{40}, count - 3}) {
          st.master[i] = 1e4f;
          st.grad[i] = 0.0f;
          st.m[i] = 0.0f;
        }
        for (const int64_t i : {int64_t{9}, count - 2}) {
          st.master[i] = -std::numeric_limits<float>::infinity();
          st.grad[i] = 0.0f;
          st.m[i] = 0.0f;
        }
      }
      return st;
    };
    auto args = [&](State& st) {
      AdamWArgs a;
      a.master = st.master.data();
      a.grad = st.grad.data();
      a.m = st.m.data();
      a.v = st.v.data();
      a.count = count;
      a.lr = 1e-3f;
      a.decay = 1e-4f;
      a.clip_scale = 0.8f;
      a.beta1 = 0.9f;
      a.one_minus_beta1 = 0.1f;
      a.beta2 = 0.95f;
      a.one_minus_beta2 = 0.05f;
      a.bias1 = 0.41f;
      a.bias2 = 0.23f;
      a.eps = 1e-8f;
      if (k.fp8) {
        a.fp8.codes = st.codes.data();
        a.fp8.scale_inv = st.scale_inv.data();
        a.fp8.stats = &st.stats;
        a.fp8.format = k.format;
        a.fp8.block = k.block;
        a.fp8.scale = 37.5f;
        a.fp8.rows = n;
        a.fp8.cols = c;
      }
      return a;
    };
    State got = make(), want = make();
    ASSERT_TRUE(Ops().adamw(args(got), Stream{}).ok());
    ASSERT_TRUE(AdamWUpdate(args(want)).ok());
    EXPECT_TRUE(SameBits(got.master, want.master)) << "master";
    EXPECT_TRUE(SameBits(got.m, want.m)) << "m";
    EXPECT_TRUE(SameBits(got.v, want.v)) << "v";
    EXPECT_EQ(got.codes, want.codes);
    EXPECT_TRUE(SameBits(got.scale_inv, want.scale_inv)) << "scale_inv";
    EXPECT_EQ(std::bit_cast<uint32_t>(got.stats.amax), std::bit_cast<uint32_t>(want.stats.amax));
    EXPECT_EQ(got.stats.count, want.stats.count);
    EXPECT_EQ(got.stats.underflow, want.stats.underflow);
    EXPECT_EQ(got.stats.subnormal, want.stats.subnormal);
    EXPECT_EQ(got.stats.saturated, want.stats.saturated);
    EXPECT_EQ(got.stats.nonfinite, want.stats.nonfinite);
    if (k.fp8) {
      EXPECT_GT(got.stats.underflow, 0) << "the case must exercise the statistics";
    }
    if (k.fp8 && !k.block) {
      EXPECT_EQ(got.stats.saturated, 2) << "the case must exercise the saturation count";
      EXPECT_EQ(got.stats.nonfinite, 2) << "the case must exercise the non-finite count";
    }
  }
}

// ---- Reducing ops: two summation orders of the same c terms. Each result is within
// (c - 1) u sum|terms| of the exact sum, so two of them differ by at most 2 c u sum|terms|;
// every bound below is that difference carried through the op's formula, plus a few roundings
// of the result itself (8 u), and a factor 2 of margin.

TEST_P(ReducingOpsTest, RmsNormWithinTheSummationBound) {
  const auto [n, c] = GetParam();
  const Stream s{};
  const std::vector<float> x = Random(n * c, 30, -2, 2), w = Random(c, 31, 0.5, 1.5),
                           dout = Random(n * c, 32, -1, 1);
  const double g = 2.0 * 2.0 * static_cast<double>(c) * kU;  // 2 x the two-order difference
  std::vector<float> out(n * c), outw(n * c), r(n), rw(n);
  ASSERT_TRUE(
      Ops().rmsnorm_forward(out.data(), r.data(), x.data(), w.data(), n, c, 1e-5f, s).ok());
  RmsNormForward(S(outw), S(rw), C(x), C(w), n, c, 1e-5f);
  // rstd = (sum / c + eps)^-1/2: half the sum's relative difference, then 3 roundings.
  std::vector<double> tr(n), to(n * c);
  for (int64_t i = 0; i < n; ++i) tr[i] = (g / 2 + 8 * kU) * std::fabs(rw[i]);
  for (int64_t i = 0; i < n * c; ++i) to[i] = (g / 2 + 16 * kU) * std::fabs(outw[i]) + 1e-30;
  EXPECT_TRUE(Within(r, rw, tr)) << "rstd";
  EXPECT_TRUE(Within(out, outw, to)) << "out";

  // dx = r dy w - (r^3 sum_j(dy w x) / c) x: the sum's difference times r^3 |x| / c.
  std::vector<float> dx = Random(n * c, 33, -1, 1), dxw = dx, dwg(c), dww(c);
  ASSERT_TRUE(Ops()
                  .rmsnorm_backward(dx.data(), dwg.data(), dout.data(), x.data(), w.data(),
                                    rw.data(), n, c, s)
                  .ok());
  RmsNormBackward(S(dxw), S(dww), C(dout), C(x), C(w), C(rw), n, c);
  std::vector<double> td(n * c);
  for (int64_t i = 0; i < n; ++i) {
    double mag = 0;
    for (int64_t j = 0; j < c; ++j) mag += std::fabs(double{dout[i * c + j]} * w[j] * x[i * c + j]);
    const double rr = rw[i], coef_mag = rr * rr * rr * mag / c;
    for (int64_t j = 0; j < c; ++j) {
      const int64_t at = i * c + j;
      td[at] = g * coef_mag * std::fabs(x[at]) +
               16 * kU * (rr * std::fabs(dout[at] * w[j]) + coef_mag * std::fabs(x[at]) +
                          std::fabs(dxw[at]));
    }
  }
  EXPECT_TRUE(Within(dx, dxw, td)) << "dx";
}

TEST_P(ReducingOpsTest, LayerNormWithinTheSummationBound) {
  const auto [n, c] = GetParam();
  const Stream s{};
  // An offset mean, so the mean's summation carries a real error.
  const std::vector<float> x = Random(n * c, 40, 1, 5), w = Random(c, 41, 0.5, 1.5),
                           b = Random(c, 42, -0.5, 0.5), dout = Random(n * c, 43, -1, 1);
  const double g = 2.0 * 2.0 * static_cast<double>(c) * kU;
  std::vector<float> out(n * c), outw(n * c), m(n), mw(n), r(n), rw(n);
  ASSERT_TRUE(Ops()
                  .layernorm_forward(out.data(), m.data(), r.data(), x.data(), w.data(), b.data(),
                                     n, c, 1e-5f, s)
                  .ok());
  LayerNormForward(S(outw), S(mw), S(rw), C(x), C(w), C(b), n, c, 1e-5f);
  std::vector<double> tm(n), tr(n), to(n * c);
  for (int64_t i = 0; i < n; ++i) {
    double abs_mean = 0;
    for (int64_t j = 0; j < c; ++j) abs_mean += std::fabs(x[i * c + j]);
    abs_mean /= c;
    tm[i] = g * abs_mean + 8 * kU * std::fabs(mw[i]);
    // The variance sums (x - m)^2: its own summation difference, and the mean's difference
    // dm moves each term by 2 |x - m| dm (first order), i.e. the sum by 2 dm sum|x - m|.
    double dev = 0, sq = 0;
    for (int64_t j = 0; j < c; ++j) {
      const double d = x[i * c + j] - double{mw[i]};
      dev += std::fabs(d);
      sq += d * d;
    }
    const double rel_var = g + 2.0 * tm[i] * dev / sq;
    tr[i] = (rel_var / 2 + 8 * kU) * std::fabs(rw[i]);
    for (int64_t j = 0; j < c; ++j) {
      const int64_t at = i * c + j;
      const double y = std::fabs(double{outw[at]} - b[j]);  // |(x - m) r w|
      to[at] = tm[i] * rw[i] * std::fabs(w[j]) + (rel_var / 2 + 16 * kU) * y +
               8 * kU * std::fabs(outw[at]) + 1e-30;
    }
  }
  EXPECT_TRUE(Within(m, mw, tm)) << "mean";
  EXPECT_TRUE(Within(r, rw, tr)) << "rstd";
  EXPECT_TRUE(Within(out, outw, to)) << "out";

  // dx = (g - mean(g) - xhat mean(g xhat)) r with g = dy w: the two means' differences.
  std::vector<float> dx = Random(n * c, 44, -1, 1), dxw = dx, dwg(c), dww(c), dbg(c), dbw(c);
  ASSERT_TRUE(Ops()
                  .layernorm_backward(dx.data(), dwg.data(), dbg.data(), dout.data(), x.data(),
                                      w.data(), mw.data(), rw.data(), n, c, s)
                  .ok());
  LayerNormBackward(S(dxw), S(dww), S(dbw), C(dout), C(x), C(w), C(mw), C(rw), n, c);
  std::vector<double> td(n * c);
  for (int64_t i = 0; i < n; ++i) {
    double g_abs = 0, gx_abs = 0;
    for (int64_t j = 0; j < c; ++j) {
      const double xh = (double{x[i * c + j]} - mw[i]) * rw[i];
      const double gj = double{dout[i * c + j]} * w[j];
      g_abs += std::fabs(gj);
      gx_abs += std::fabs(gj * xh);
    }
    g_abs /= c;
    gx_abs /= c;
    for (int64_t j = 0; j < c; ++j) {
      const int64_t at = i * c + j;
      const double xh = std::fabs((double{x[at]} - mw[i]) * rw[i]);
      td[at] = g * rw[i] * (g_abs + xh * gx_abs) +
               16 * kU * (rw[i] * (std::fabs(double{dout[at]} * w[j]) + g_abs + xh * gx_abs) +
                          std::fabs(dxw[at]));
    }
  }
  EXPECT_TRUE(Within(dx, dxw, td)) << "dx";
}

TEST_P(ReducingOpsTest, CrossEntropyForwardWithinTheSoftmaxBound) {
  const auto [n, c] = GetParam();
  const int64_t v = c;
  std::vector<int32_t> targets(n);
  for (int64_t i = 0; i < n; ++i) targets[i] = static_cast<int32_t>((i * 17) % v);
  std::vector<float> logits = Random(n * v, 50, -6, 6);
  logits[3] = -1e30f;  // a vanishing probability, where the vector exp underflows to 0
  std::vector<float> probs(n * v), losses(n);
  ASSERT_TRUE(Ops()
                  .cross_entropy_forward(probs.data(), losses.data(), logits.data(),
                                         targets.data(), n, v, Stream{})
                  .ok());
  for (int64_t i = 0; i < n; ++i) {
    std::vector<float> pw(v);
    const float lw = CrossEntropyForward(std::span<float>(pw), std::span(logits).subspan(i * v, v),
                                         std::span<const int32_t>(targets).subspan(i, 1), 1, v);
    // Both denominators are within (v - 1) u of the exact sum of terms exp(l - max) <= 1, whose
    // sum is >= 1, and the exps within a few ulps (glibc's expf, Highway's Exp: 4 u allowed):
    // each probability differs by 2 (v + 4) u relative at most; the loss by that much of the
    // log's argument (absolute, through log), plus roundings of max + log - l.
    const float* li = logits.data() + i * v;
    const double mx = *std::max_element(li, li + v);
    for (int64_t j = 0; j < v; ++j) {
      const double tol = 2.0 * 2.0 * (v + 4) * kU * pw[j] + 1e-45;
      ASSERT_LE(std::fabs(double{probs[i * v + j]} - pw[j]), tol) << "probs[" << i << ", " << j << "]";
    }
    const double tol =
        2.0 * (2.0 * (v + 4) * kU + 4 * kU * (std::fabs(mx) + std::fabs(li[targets[i]]) +
                                              std::fabs(lw)));
    EXPECT_LE(std::fabs(double{losses[i]} - lw), tol) << "loss of row " << i;
  }
  EXPECT_EQ(probs[3], 0.0f);
}

// ---- Attention: the table's tiled flash attention and the reference, each against the contract
// evaluated in FP64, within the per-element bounds derived in tests/support/attention_check.h.
// Shapes: one tile and several (kAttentionTileQ = kAttentionTileK = 64), ragged last tiles,
// grouped-query and multi-query heads, head dims that are not a multiple of the vector width, and
// seq_len 2048 (32 tiles a row: the online softmax rescales up to 32 times).
using attention_check::AttnData;
using attention_check::AttnShape;
class AttentionTest : public ::testing::TestWithParam<AttnShape> {};

TEST_P(AttentionTest, TableAndReferenceWithinTheBoundsOfTheExactValues) {
  const AttnShape sh = GetParam();
  const AttnData x(sh, 70);
  const Stream s{};
  const attention_check::ForwardWant fw = attention_check::ExactForward(x);
  std::vector<float> out(x.size), lse(x.lse_size), out_ref(x.size), lse_ref(x.lse_size);
  ASSERT_TRUE(Ops().attention_forward(out.data(), lse.data(), x.q.data(), x.k.data(), x.v.data(),
                                      sh.b, sh.t, sh.h, sh.hkv, sh.dh, s).ok());
  AttentionForward(S(out_ref), S(lse_ref), C(x.q), C(x.k), C(x.v), sh.b, sh.t, sh.h, sh.hkv,
                   sh.dh);
  using attention_check::OutOfBounds;
  EXPECT_EQ(OutOfBounds("table out", out, fw.out, fw.out_bound), "");
  EXPECT_EQ(OutOfBounds("table lse", lse, fw.lse, fw.lse_bound), "");
  EXPECT_EQ(OutOfBounds("reference out", out_ref, fw.out, fw.out_bound), "");
  EXPECT_EQ(OutOfBounds("reference lse", lse_ref, fw.lse, fw.lse_bound), "");

  // The backward on the table's out and lse, onto the pre-filled gradients.
  const attention_check::BackwardWant bw = attention_check::ExactBackward(x, out, lse);
  std::vector<float> dq = x.dq0, dk = x.dk0, dv = x.dv0;
  std::vector<float> dq_ref = x.dq0, dk_ref = x.dk0, dv_ref = x.dv0;
  ASSERT_TRUE(Ops().attention_backward(dq.data(), dk.data(), dv.data(), x.dout.data(), x.q.data(),
                                       x.k.data(), x.v.data(), out.data(), lse.data(), sh.b, sh.t,
                                       sh.h, sh.hkv, sh.dh, s).ok());
  AttentionBackward(S(dq_ref), S(dk_ref), S(dv_ref), C(x.dout), C(x.q), C(x.k), C(x.v), C(out),
                    C(lse), sh.b, sh.t, sh.h, sh.hkv, sh.dh);
  EXPECT_EQ(OutOfBounds("table dq", dq, bw.dq, bw.dq_bound), "");
  EXPECT_EQ(OutOfBounds("table dk", dk, bw.dk, bw.dk_bound), "");
  EXPECT_EQ(OutOfBounds("table dv", dv, bw.dv, bw.dv_bound), "");
  EXPECT_EQ(OutOfBounds("reference dq", dq_ref, bw.dq, bw.dq_bound), "");
  EXPECT_EQ(OutOfBounds("reference dk", dk_ref, bw.dk, bw.dk_bound), "");
  EXPECT_EQ(OutOfBounds("reference dv", dv_ref, bw.dv, bw.dv_bound), "");
}

// The bounds are tight enough to see a slightly wrong kernel: a normalisation off by a relative
// 1e-3 (lse + 1e-3 in the backward, every output 1 + 1e-3 times too large in the forward) is out
// of bounds, while the true results are within them (the test above).
TEST(AttentionBoundsTest, ARelativeErrorOf1e3IsOutOfBounds) {
  const AttnShape sh{1, 130, 2, 1, 64};
  const AttnData x(sh, 71);
  const attention_check::ForwardWant fw = attention_check::ExactForward(x);
  std::vector<float> out(x.size), lse(x.lse_size);
  ASSERT_TRUE(Ops().attention_forward(out.data(), lse.data(), x.q.data(), x.k.data(), x.v.data(),
                                      sh.b, sh.t, sh.h, sh.hkv, sh.dh, Stream{}).ok());
  std::vector<float> off = out;
  for (float& o : off) o *= 1.0f + 1e-3f;
  EXPECT_NE(attention_check::OutOfBounds("out", off, fw.out, fw.out_bound), "");
  std::vector<float> lse_off = lse;
  for (float& l : lse_off) l += 1e-3f;
  const attention_check::BackwardWant bw = attention_check::ExactBackward(x, out, lse);
  std::vector<float> dq = x.dq0, dk = x.dk0, dv = x.dv0;
  ASSERT_TRUE(Ops().attention_backward(dq.data(), dk.data(), dv.data(), x.dout.data(), x.q.data(),
                                       x.k.data(), x.v.data(), out.data(), lse_off.data(), sh.b,
                                       sh.t, sh.h, sh.hkv, sh.dh, Stream{}).ok());
  EXPECT_NE(attention_check::OutOfBounds("dv", dv, bw.dv, bw.dv_bound), "");
}

INSTANTIATE_TEST_SUITE_P(
    Shapes, AttentionTest,
    ::testing::Values(AttnShape{2, 37, 4, 2, 64}, AttnShape{1, 70, 3, 1, 20},
                      AttnShape{3, 5, 2, 2, 7}, AttnShape{1, 130, 4, 4, 64},
                      AttnShape{2, 64, 2, 1, 32}, AttnShape{1, 2048, 2, 1, 64}),
    [](const ::testing::TestParamInfo<AttnShape>& info) {
      return attention_check::ShapeName(info.param);
    });

INSTANTIATE_TEST_SUITE_P(Shapes, ExactOpsTest, ::testing::ValuesIn(kShapes));
INSTANTIATE_TEST_SUITE_P(Shapes, ReducingOpsTest, ::testing::ValuesIn(kShapes));

// ---- The thread count changes nothing: every entry on 1 and on 3 threads, bit for bit.

std::vector<float> RunAll(int threads) {
  omp_set_num_threads(threads);
  constexpr int64_t n = 67, c = 1027, v = 1027;
  const Stream s{};
  const std::vector<float> x = Random(n * c, 60, -2, 2), w = Random(c, 61, 0.5, 1.5),
                           b = Random(c, 62, -0.5, 0.5), dout = Random(n * c, 63, -1, 1);
  std::vector<int32_t> ids(n);
  for (int64_t i = 0; i < n; ++i) ids[i] = static_cast<int32_t>((i * 5) % 7);
  std::vector<float> all;
  auto keep = [&](const std::vector<float>& part) { all.insert(all.end(), part.begin(), part.end()); };
  std::vector<float> out(n * c), m(n), r(n), dx(n * c), dw(c), db(c);
  EXPECT_TRUE(Ops().rmsnorm_forward(out.data(), r.data(), x.data(), w.data(), n, c, 1e-5f, s).ok());
  keep(out), keep(r);
  EXPECT_TRUE(Ops().rmsnorm_backward(dx.data(), dw.data(), dout.data(), x.data(), w.data(),
                                     r.data(), n, c, s).ok());
  keep(dx), keep(dw);
  EXPECT_TRUE(Ops().layernorm_forward(out.data(), m.data(), r.data(), x.data(), w.data(), b.data(),
                                      n, c, 1e-5f, s).ok());
  keep(out), keep(m), keep(r);
  EXPECT_TRUE(Ops().layernorm_backward(dx.data(), dw.data(), db.data(), dout.data(), x.data(),
                                       w.data(), m.data(), r.data(), n, c, s).ok());
  keep(dx), keep(dw), keep(db);
  std::vector<float> probs(n * v), losses(n), dl(n * v);
  EXPECT_TRUE(Ops().cross_entropy_forward(probs.data(), losses.data(), x.data(), ids.data(), n, v,
                                          s).ok());
  EXPECT_TRUE(
      Ops().cross_entropy_backward(dl.data(), probs.data(), ids.data(), n, v, 1.0f, s).ok());
  keep(probs), keep(losses), keep(dl);
  std::vector<float> table(7 * c), e(n * c);
  EXPECT_TRUE(Ops().embedding_backward(table.data(), dout.data(), ids.data(), n, 7, c, s).ok());
  EXPECT_TRUE(Ops().embedding_forward(e.data(), ids.data(), table.data(), n, 7, c, s).ok());
  keep(table), keep(e);
  std::vector<float> rope(n * 1024);
  EXPECT_TRUE(Ops().rope_forward(rope.data(), x.data(), n, 13, 16, 64, 10000.0f, s).ok());
  keep(rope);
  {
    constexpr int64_t ab = 2, at = 33, ah = 4, ahkv = 2, adh = 64;
    const std::vector<float> q = Random(ab * at * ah * adh, 66, -2, 2),
                             kk = Random(ab * at * ahkv * adh, 67, -2, 2),
                             vv = Random(ab * at * ahkv * adh, 68, -1, 1);
    std::vector<float> ao(q.size()), ap(ab * ah * at), dq(q.size()), dk(kk.size()),
        dv(vv.size());
    EXPECT_TRUE(Ops().attention_forward(ao.data(), ap.data(), q.data(), kk.data(), vv.data(), ab,
                                        at, ah, ahkv, adh, s).ok());
    EXPECT_TRUE(Ops().attention_backward(dq.data(), dk.data(), dv.data(), ao.data(), q.data(),
                                         kk.data(), vv.data(), ao.data(), ap.data(), ab, at, ah,
                                         ahkv, adh, s).ok());
    keep(ao), keep(ap), keep(dq), keep(dk), keep(dv);
  }
  std::vector<float> master = x, mom = Random(n * c, 64, -0.1f, 0.1f), var = Random(n * c, 65, 0, 0.01f);
  AdamWArgs a;
  a.master = master.data();
  a.grad = dout.data();
  a.m = mom.data();
  a.v = var.data();
  a.count = n * c;
  a.lr = 1e-3f;
  a.eps = 1e-8f;
  a.beta1 = 0.9f;
  a.one_minus_beta1 = 0.1f;
  a.beta2 = 0.95f;
  a.one_minus_beta2 = 0.05f;
  EXPECT_TRUE(Ops().adamw(a, s).ok());
  keep(master), keep(mom), keep(var);
  omp_set_num_threads(omp_get_num_procs());
  return all;
}

TEST(ThreadCountTest, OneAndThreeThreadsGiveTheSameBits) {
  const std::vector<float> one = RunAll(1), three = RunAll(3);
  ASSERT_FALSE(one.empty());
  EXPECT_TRUE(SameBits(one, three));
}

}  // namespace
}  // namespace fp8rt::kernels
