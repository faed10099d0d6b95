// Tests of AdamW (runtime/train/optimizer.h) against an independent reference: Algorithm 2 of
// Loshchilov & Hutter, "Decoupled Weight Decay Regularization" (ICLR 2019), written out here in
// double precision, and the learning-rate schedule evaluated from its formula.
//
// Index:
//   PaperAdamWStep            the reference: one step of the paper's AdamW, in FP64
//   ShardSet                  hand-sized shards (3, 5 and 1 elements) owning their buffers
//   AdamWReferenceTest        10 steps against the reference, decay and no-decay shards
//   WeightDecayTest           decay=false shards get no weight decay
//   LearningRateTest          warmup then cosine at chosen steps; no-decay and no-warmup cases
//   ClippingTest              clip_scale = clip / (norm + 1e-6) above the threshold, 1 below
//   NonFiniteSkipTest         TEST_P over NaN, +Inf, -Inf: bits unchanged, then the next step
//   AdamWStateTest            empty shard list, restoring applied_steps, bad arguments
#include "runtime/train/optimizer.h"

#include <bit>
#include <cmath>
#include <cstdint>
#include <limits>
#include <numbers>
#include <ostream>
#include <span>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "kernels/ops.h"
#include "kernels/quantize.h"

namespace fp8rt::train {
namespace {

using ::testing::HasSubstr;

constexpr float kNaN = std::numeric_limits<float>::quiet_NaN();
constexpr float kInf = std::numeric_limits<float>::infinity();

// Tolerance of the FP32 optimizer against the FP64 reference over 10 steps. Each step rounds
// the weight twice (decay, update: 2 x 2^-24 relative) and the moments three times (two products
// and a sum, each <= 2^-24); the Adam direction m_hat / (sqrt(v_hat) + eps) carries a few ulps
// more but is multiplied by lr = 1e-2 against weights of magnitude ~1, so it adds < 1e-8
// relative. The gradients below keep one sign per element over the steps, so the moments never
// cancel and their relative error stays a few ulps per step. Ten steps: <= 10 x 2 x 6e-8 =
// 1.2e-6 relative for the weights in the worst case (errors of the moments are damped by
// beta < 1); 2e-6 leaves room for that bound and no more.
constexpr double kRelTol = 2e-6;

// One step of Algorithm 2 (AdamW) of Loshchilov & Hutter, in FP64:
//   t <- t + 1;  m_t = b1 m + (1 - b1) g;  v_t = b2 v + (1 - b2) g^2;
//   m_hat = m_t / (1 - b1^t);  v_hat = v_t / (1 - b2^t);
//   theta_t = theta_{t-1} - eta_t (alpha m_hat / (sqrt(v_hat) + eps) + lambda theta_{t-1})
// fp8rt's lr_t is alpha * eta_t and its decay lr_t * wd is eta_t * lambda: with eta_t = 1 the
// calls below pass alpha = lr and lambda = lr * wd.
struct RefParam {
  std::vector<double> theta, m, v;
};

void PaperAdamWStep(RefParam& p, const std::vector<double>& g, int t, double alpha, double eta,
                    double lambda, double b1, double b2, double eps) {
  for (size_t i = 0; i < p.theta.size(); ++i) {
    p.m[i] = b1 * p.m[i] + (1 - b1) * g[i];
    p.v[i] = b2 * p.v[i] + (1 - b2) * g[i] * g[i];
    const double m_hat = p.m[i] / (1 - std::pow(b1, t));
    const double v_hat = p.v[i] / (1 - std::pow(b2, t));
    p.theta[i] =
        p.theta[i] - eta * (alpha * m_hat / (std::sqrt(v_hat) + eps) + lambda * p.theta[i]);
  }
}

uint32_t Bits(float x) { return std::bit_cast<uint32_t>(x); }

// Gradient of element i of shard `shard` at step `step`: a fixed sign per element and a
// magnitude in [0.5, 1.5] x 2^-shard that changes every step (no cancellation in the moments).
float TestGrad(int shard, int step, int i) {
  const float sign = ((i + shard) % 2 == 0) ? 1.0f : -1.0f;
  const float mag = 0.5f + 0.1f * static_cast<float>((7 * step + 3 * i + shard) % 11);
  return sign * std::ldexp(mag, -shard);
}

// Shards of 3, 5 and 1 elements owning their buffers; shard 1 has no weight decay.
class ShardSet {
 public:
  ShardSet() {
    const int sizes[] = {3, 5, 1};
    for (int s = 0; s < 3; ++s) {
      Buffers& b = buffers_.emplace_back();
      const size_t n = static_cast<size_t>(sizes[s]);
      b.master.resize(n);
      for (size_t i = 0; i < n; ++i) b.master[i] = 0.75f + 0.25f * static_cast<float>(i + s);
      b.grad.assign(n, 0.0f);
      b.m.assign(n, 0.0f);
      b.v.assign(n, 0.0f);
    }
    for (int s = 0; s < 3; ++s) {
      Buffers& b = buffers_[static_cast<size_t>(s)];
      shards_.push_back(ParamShard{"shard" + std::to_string(s), b.master.data(), b.grad.data(),
                                   b.m.data(), b.v.data(), static_cast<int64_t>(b.master.size()),
                                   /*decay=*/s != 1});
    }
  }
  ShardSet(const ShardSet&) = delete;
  ShardSet& operator=(const ShardSet&) = delete;

  std::span<ParamShard> shards() { return shards_; }
  int num() const { return static_cast<int>(buffers_.size()); }
  std::vector<float>& master(int s) { return buffers_[static_cast<size_t>(s)].master; }
  std::vector<float>& grad(int s) { return buffers_[static_cast<size_t>(s)].grad; }
  std::vector<float>& m(int s) { return buffers_[static_cast<size_t>(s)].m; }
  std::vector<float>& v(int s) { return buffers_[static_cast<size_t>(s)].v; }

  void SetGrads(int step) {
    for (int s = 0; s < num(); ++s) {
      for (size_t i = 0; i < grad(s).size(); ++i)
        grad(s)[i] = TestGrad(s, step, static_cast<int>(i));
    }
  }

  // The reference state of shard s, starting from the current buffers.
  RefParam Ref(int s) {
    RefParam r;
    for (size_t i = 0; i < master(s).size(); ++i) {
      r.theta.push_back(master(s)[i]);
      r.m.push_back(m(s)[i]);
      r.v.push_back(v(s)[i]);
    }
    return r;
  }
  std::vector<double> GradAsDouble(int s) { return {grad(s).begin(), grad(s).end()}; }

  // Every bit of every master weight and moment.
  std::vector<uint32_t> StateBits() {
    std::vector<uint32_t> bits;
    for (int s = 0; s < num(); ++s) {
      for (auto* vec : {&master(s), &m(s), &v(s)}) {
        for (float x : *vec) bits.push_back(Bits(x));
      }
    }
    return bits;
  }

 private:
  struct Buffers {
    std::vector<float> master, grad, m, v;
  };
  std::vector<Buffers> buffers_;
  std::vector<ParamShard> shards_;
};

void ExpectNear(const std::vector<float>& actual, const std::vector<double>& expected, double rel,
                const std::string& what) {
  ASSERT_EQ(actual.size(), expected.size()) << what;
  for (size_t i = 0; i < actual.size(); ++i) {
    EXPECT_NEAR(actual[i], expected[i], rel * std::abs(expected[i])) << what << "[" << i << "]";
  }
}

AdamWConfig ConstantLr(double lr, double wd) {
  AdamWConfig c;
  c.lr = lr;
  c.weight_decay = wd;
  c.clip = 0.0;
  c.warmup = 0;
  c.steps = 0;  // no decay span: lr every step
  return c;
}

TEST(AdamWReferenceTest, TenStepsMatchThePaperAlgorithmInDouble) {
  const AdamWConfig config = ConstantLr(1e-2, 0.1);
  AdamW opt(config);
  ShardSet set;
  std::vector<RefParam> ref;
  for (int s = 0; s < set.num(); ++s) ref.push_back(set.Ref(s));

  for (int step = 1; step <= 10; ++step) {
    set.SetGrads(step);
    double sum_sq = 0.0;
    for (int s = 0; s < set.num(); ++s) {
      const std::vector<double> g = set.GradAsDouble(s);
      for (double x : g) sum_sq += x * x;
      const double lambda = set.shards()[static_cast<size_t>(s)].decay ? config.lr * 0.1 : 0.0;
      PaperAdamWStep(ref[static_cast<size_t>(s)], g, step, config.lr, 1.0, lambda, 0.9, 0.95, 1e-8);
    }
    absl::StatusOr<StepResult> r = opt.Step(set.shards(), step, nullptr);
    ASSERT_TRUE(r.ok()) << r.status();
    EXPECT_FALSE(r->skipped);
    EXPECT_EQ(r->applied_steps, step);
    EXPECT_EQ(r->lr, config.lr);
    EXPECT_EQ(r->clip_scale, 1.0f);
    // The same FP64 sum in the same order, so only the final sqrt could differ: it does not.
    EXPECT_DOUBLE_EQ(r->grad_norm, std::sqrt(sum_sq));
  }
  EXPECT_EQ(opt.applied_steps(), 10);
  for (int s = 0; s < set.num(); ++s) {
    const std::string name = "shard" + std::to_string(s);
    ExpectNear(set.master(s), ref[static_cast<size_t>(s)].theta, kRelTol, name + " master");
    ExpectNear(set.m(s), ref[static_cast<size_t>(s)].m, kRelTol, name + " m");
    ExpectNear(set.v(s), ref[static_cast<size_t>(s)].v, kRelTol, name + " v");
  }
}

TEST(WeightDecayTest, AppliedToDecayShardsOnly) {
  // A large decay so that its presence or absence is far outside the tolerance.
  const AdamWConfig config = ConstantLr(1e-2, 5.0);
  AdamW opt(config);
  ShardSet set;
  set.SetGrads(1);
  RefParam no_decay = set.Ref(1), with_decay = set.Ref(1);
  PaperAdamWStep(no_decay, set.GradAsDouble(1), 1, config.lr, 1.0, 0.0, 0.9, 0.95, 1e-8);
  PaperAdamWStep(with_decay, set.GradAsDouble(1), 1, config.lr, 1.0, config.lr * 5.0, 0.9, 0.95,
                 1e-8);
  RefParam decayed0 = set.Ref(0);
  PaperAdamWStep(decayed0, set.GradAsDouble(0), 1, config.lr, 1.0, config.lr * 5.0, 0.9, 0.95,
                 1e-8);
  ASSERT_FALSE(set.shards()[1].decay);
  ASSERT_TRUE(opt.Step(set.shards(), 1, nullptr).ok());
  ExpectNear(set.master(1), no_decay.theta, kRelTol, "no-decay shard");
  for (size_t i = 0; i < set.master(1).size(); ++i) {
    // The decayed weight is 5% smaller: far from the undecayed one.
    EXPECT_GT(std::abs(set.master(1)[i] - with_decay.theta[i]), 1e-3) << i;
  }
  ExpectNear(set.master(0), decayed0.theta, kRelTol, "decay shard");
}

void ExpectSameStats(const kernels::QuantStats& got, const kernels::QuantStats& want) {
  EXPECT_EQ(Bits(got.amax), Bits(want.amax));
  EXPECT_EQ(got.count, want.count);
  EXPECT_EQ(got.underflow, want.underflow);
  EXPECT_EQ(got.subnormal, want.subnormal);
  EXPECT_EQ(got.saturated, want.saturated);
  EXPECT_EQ(got.nonfinite, want.nonfinite);
}

// The FP8 copy written in the update's pass (FSDP's FP8 weight shard) is, bit for bit, what the
// tensor quantize op (itself tested against cuda_fp8.h's conversion) makes of the updated master:
// codes, scale_inv and every statistic, for both formats, with a scale at which some values
// saturate and some underflow. Split into ComputeNorm and Apply, the step is the same as Step.
TEST(Fp8ShardTest, WrittenCodesEqualQuantizingTheUpdatedMaster) {
  for (const kernels::Fp8Format format : {kernels::Fp8Format::kE4M3, kernels::Fp8Format::kE5M2}) {
    const int n = 4096;
    std::vector<float> master(n), grad(n), m(n, 0.0f), v(n, 0.0f);
    for (int i = 0; i < n; ++i) {
      // Magnitudes from 2^-30 to 2^6: below FP8's subnormals and above its max once scaled.
      master[i] = ((i % 2) ? -1.0f : 1.0f) * std::ldexp(1.0f + (i % 7) / 8.0f, (i % 37) - 30);
      grad[i] = TestGrad(0, 1, i);
    }
    std::vector<float> master2 = master, m2 = m, v2 = v;
    std::vector<uint8_t> codes(n, 0);
    float scale_inv = 0.0f;
    kernels::QuantStats stats;
    // E4M3 (max 448, subnormals from 2^-9): 120 * 64 saturates, 2^-14 * 64 is subnormal;
    // E5M2 (max 57344, subnormals from 2^-16): 120 * 1024 saturates, 2^-25 * 1024 is subnormal;
    // the smallest magnitudes underflow in both. lr 1e-10 keeps the update from moving them
    // out of those ranges.
    const float scale = format == kernels::Fp8Format::kE4M3 ? 64.0f : 1024.0f;
    ParamShard s{.name = "w", .master = master.data(), .grad = grad.data(), .m = m.data(),
                 .v = v.data(), .count = n};
    s.fp8 = {.codes = codes.data(), .scale_inv = &scale_inv, .stats = &stats, .format = format,
             .scale = scale};
    ParamShard plain{.name = "w", .master = master2.data(), .grad = grad.data(), .m = m2.data(),
                     .v = v2.data(), .count = n};
    AdamW fused(ConstantLr(1e-10, 0.1)), reference(ConstantLr(1e-10, 0.1));
    auto norm = fused.ComputeNorm(std::span<const ParamShard>(&s, 1), 1, nullptr);
    ASSERT_TRUE(norm.ok()) << norm.status();
    ASSERT_TRUE(fused.Apply(std::span<const ParamShard>(&s, 1), *norm).ok());
    ASSERT_TRUE(reference.Step(std::span<ParamShard>(&plain, 1), 1, nullptr).ok());
    for (int i = 0; i < n; ++i) ASSERT_EQ(Bits(master[i]), Bits(master2[i])) << i;

    std::vector<uint8_t> want(n, 0);
    float want_scale_inv = 0.0f;
    kernels::QuantStats want_stats;
    kernels::QuantizeArgs q;
    q.format = format;
    q.granularity = kernels::Granularity::kTensor;
    q.input = master.data();
    q.rows = 1;
    q.cols = n;
    q.has_scale = true;
    q.scale = scale;
    q.codes = want.data();
    q.scale_inv = &want_scale_inv;
    q.stats = &want_stats;
    ASSERT_TRUE(kernels::CpuOps().quantize(q, {}).ok());
    EXPECT_EQ(codes, want);
    EXPECT_EQ(Bits(scale_inv), Bits(want_scale_inv));
    ExpectSameStats(stats, want_stats);
    // The chosen values do exercise the counters.
    EXPECT_GT(want_stats.underflow, 0);
    EXPECT_GT(want_stats.saturated, 0);
    EXPECT_GT(want_stats.subnormal, 0);
  }
  // FP8 codes without their statistics are refused, naming the shard.
  float x = 1.0f, g = 1.0f, mm = 0.0f, vv = 0.0f;
  uint8_t c = 0;
  ParamShard bad{.name = "blocks.0.mlp.fc1/weight", .master = &x, .grad = &g, .m = &mm, .v = &vv,
                 .count = 1};
  bad.fp8.codes = &c;
  AdamW opt(ConstantLr(1e-3, 0.0));
  const absl::StatusOr<StepResult> r = opt.Step(std::span<ParamShard>(&bad, 1), 1, nullptr);
  ASSERT_FALSE(r.ok());
  EXPECT_THAT(std::string(r.status().message()), HasSubstr("blocks.0.mlp.fc1/weight"));
  EXPECT_THAT(std::string(r.status().message()), HasSubstr("fp8.stats"));
  EXPECT_EQ(x, 1.0f) << "a refused step changed the master";
}

// With 128x128 block scaling the update pass writes the codes, every block's scale_inv and the
// statistics that the block quantize op makes of the updated master as a rows x cols matrix. The
// shape has a partial last strip of rows (320 = 2.5 x 128) and a partial last column block
// (200 = 128 + 72); the blocks' magnitudes differ by powers of two so that their scales differ,
// one block is all zero (scale 1), and some values underflow within their block.
TEST(Fp8ShardTest, BlockScaledCodesEqualBlockQuantizingTheUpdatedMaster) {
  const int64_t rows = 320, cols = 200, n = rows * cols;
  const kernels::ScaleGrid grid =
      kernels::GetScaleGrid(kernels::Granularity::kBlock128x128, rows, cols);
  for (const kernels::Fp8Format format : {kernels::Fp8Format::kE4M3, kernels::Fp8Format::kE5M2}) {
    std::vector<float> master(n), grad(n), m(n, 0.0f), v(n, 0.0f);
    for (int64_t r = 0; r < rows; ++r) {
      for (int64_t c = 0; c < cols; ++c) {
        const int64_t i = r * cols + c, b = (r / 128) * grid.cols + c / 128;
        const bool zero_block = b == 1;
        master[i] = zero_block ? 0.0f
                               : ((i % 2) ? -1.0f : 1.0f) *
                                     std::ldexp(1.0f + (i % 7) / 8.0f,
                                                static_cast<int>(3 * b) - (i % 29 == 0 ? 40 : 4));
        grad[i] = zero_block ? 0.0f : TestGrad(0, 1, static_cast<int>(i));
      }
    }
    std::vector<float> master2 = master, m2 = m, v2 = v;
    std::vector<uint8_t> codes(static_cast<size_t>(n), 0);
    std::vector<float> scale_inv(static_cast<size_t>(grid.size()), 0.0f);
    kernels::QuantStats stats;
    ParamShard s{.name = "w", .master = master.data(), .grad = grad.data(), .m = m.data(),
                 .v = v.data(), .count = n, .decay = false};
    s.fp8 = {.codes = codes.data(), .scale_inv = scale_inv.data(), .stats = &stats,
             .format = format, .block = true, .rows = rows, .cols = cols, .margin = 1};
    ParamShard plain{.name = "w", .master = master2.data(), .grad = grad.data(), .m = m2.data(),
                     .v = v2.data(), .count = n, .decay = false};
    AdamW fused(ConstantLr(1e-12, 0.0)), reference(ConstantLr(1e-12, 0.0));
    ASSERT_TRUE(fused.Step(std::span<ParamShard>(&s, 1), 1, nullptr).ok());
    ASSERT_TRUE(reference.Step(std::span<ParamShard>(&plain, 1), 1, nullptr).ok());
    for (int64_t i = 0; i < n; ++i) ASSERT_EQ(Bits(master[i]), Bits(master2[i])) << i;

    std::vector<uint8_t> want(static_cast<size_t>(n), 0);
    std::vector<float> want_scale_inv(static_cast<size_t>(grid.size()), 0.0f);
    kernels::QuantStats want_stats;
    kernels::QuantizeArgs q;
    q.format = format;
    q.granularity = kernels::Granularity::kBlock128x128;
    q.input = master.data();
    q.rows = rows;
    q.cols = cols;
    q.margin = 1;
    q.codes = want.data();
    q.scale_inv = want_scale_inv.data();
    q.stats = &want_stats;
    ASSERT_TRUE(kernels::CpuOps().quantize(q, {}).ok());
    EXPECT_EQ(codes, want);
    for (int64_t b = 0; b < grid.size(); ++b) {
      EXPECT_EQ(Bits(scale_inv[b]), Bits(want_scale_inv[b])) << "block " << b;
    }
    ExpectSameStats(stats, want_stats);
    // The blocks' scales do differ, the zero block has scale 1, and something underflowed.
    EXPECT_NE(Bits(want_scale_inv[0]), Bits(want_scale_inv[2]));
    EXPECT_EQ(want_scale_inv[1], 1.0f);
    EXPECT_GT(want_stats.underflow, 0);
  }
}

// A block-scaled FP8 output whose shape does not match the shard is refused, naming the field and
// the shard, before anything is written.
TEST(Fp8ShardTest, BlockShapeMismatchIsRefused) {
  std::vector<float> x(256, 1.0f), g(256, 1.0f), mm(256, 0.0f), vv(256, 0.0f);
  std::vector<uint8_t> codes(256, 0);
  std::vector<float> scale_inv(4, 0.0f);
  kernels::QuantStats stats;
  ParamShard s{.name = "blocks.3.attn.qkv/weight", .master = x.data(), .grad = g.data(),
               .m = mm.data(), .v = vv.data(), .count = 256};
  s.fp8 = {.codes = codes.data(), .scale_inv = scale_inv.data(), .stats = &stats,
           .block = true, .rows = 128, .cols = 3};
  AdamW opt(ConstantLr(1e-3, 0.0));
  const absl::StatusOr<StepResult> r = opt.Step(std::span<ParamShard>(&s, 1), 1, nullptr);
  ASSERT_FALSE(r.ok());
  EXPECT_THAT(std::string(r.status().message()), HasSubstr("blocks.3.attn.qkv/weight"));
  EXPECT_THAT(std::string(r.status().message()), HasSubstr("fp8.rows x fp8.cols (128 x 3)"));
  EXPECT_EQ(x[0], 1.0f) << "a refused step changed the master";
  EXPECT_EQ(opt.applied_steps(), 0);
}

// Apply with a skipped norm result changes nothing and counts no step.
TEST(Fp8ShardTest, ApplyOfASkippedStepChangesNothing) {
  float x = 0.5f, g = kNaN, mm = 0.0f, vv = 0.0f;
  ParamShard s{.name = "w", .master = &x, .grad = &g, .m = &mm, .v = &vv, .count = 1};
  AdamW opt(ConstantLr(1e-3, 0.0));
  auto norm = opt.ComputeNorm(std::span<const ParamShard>(&s, 1), 1, nullptr);
  ASSERT_TRUE(norm.ok());
  EXPECT_TRUE(norm->skipped);
  auto r = opt.Apply(std::span<const ParamShard>(&s, 1), *norm);
  ASSERT_TRUE(r.ok());
  EXPECT_TRUE(r->skipped);
  EXPECT_EQ(x, 0.5f);
  EXPECT_EQ(opt.applied_steps(), 0);
}

TEST(LearningRateTest, WarmupThenCosine) {
  AdamWConfig c;
  c.lr = 1e-3;
  c.min_lr = 1e-4;
  c.warmup = 10;
  c.steps = 110;  // decay span of 100 steps
  // Warmup: lr * step / 10.
  EXPECT_DOUBLE_EQ(LearningRate(c, 1), 1e-4);
  EXPECT_DOUBLE_EQ(LearningRate(c, 5), 5e-4);
  EXPECT_DOUBLE_EQ(LearningRate(c, 10), 1e-3);
  // Cosine: min_lr + (lr - min_lr) (1 + cos(pi (step - 10) / 100)) / 2.
  EXPECT_DOUBLE_EQ(LearningRate(c, 35), 1e-4 + 9e-4 * (1 + std::sqrt(0.5)) / 2);  // pi / 4
  EXPECT_DOUBLE_EQ(LearningRate(c, 60), 1e-4 + 9e-4 * 0.5);                       // pi / 2
  EXPECT_DOUBLE_EQ(LearningRate(c, 85), 1e-4 + 9e-4 * (1 - std::sqrt(0.5)) / 2);  // 3 pi / 4
  EXPECT_DOUBLE_EQ(LearningRate(c, 110), 1e-4);
  EXPECT_DOUBLE_EQ(LearningRate(c, 111), 1e-4);
  EXPECT_DOUBLE_EQ(LearningRate(c, 100000), 1e-4);
  double previous = LearningRate(c, 10);
  for (int64_t step = 11; step <= 120; ++step) {
    const double lr = LearningRate(c, step);
    EXPECT_LT(lr, previous + 1e-18) << step;  // never rises after warmup
    EXPECT_GE(lr, c.min_lr) << step;
    previous = lr;
  }
}

TEST(LearningRateTest, NoWarmupAndNoDecaySpan) {
  AdamWConfig c;
  c.lr = 2e-3;
  c.min_lr = 0.0;
  c.warmup = 0;
  c.steps = 4;  // cosine over steps 1..4 from step 0
  EXPECT_DOUBLE_EQ(LearningRate(c, 1), 2e-3 * (1 + std::cos(std::numbers::pi / 4)) / 2);
  EXPECT_DOUBLE_EQ(LearningRate(c, 2), 1e-3);
  EXPECT_DOUBLE_EQ(LearningRate(c, 4), 0.0);
  c.warmup = 4;  // steps <= warmup: constant lr once warmed up
  EXPECT_DOUBLE_EQ(LearningRate(c, 2), 1e-3);
  EXPECT_DOUBLE_EQ(LearningRate(c, 4), 2e-3);
  EXPECT_DOUBLE_EQ(LearningRate(c, 50), 2e-3);
  c.warmup = 0;
  c.steps = 0;
  EXPECT_DOUBLE_EQ(LearningRate(c, 1), 2e-3);
  EXPECT_DOUBLE_EQ(LearningRate(c, 1000), 2e-3);
}

// One step on a single shard holding `grad`; returns the result and leaves the moments in m, v.
struct OneStep {
  StepResult result;
  std::vector<float> master, m, v;
};

OneStep StepOnce(const AdamWConfig& config, std::vector<float> grad) {
  OneStep out;
  out.master.assign(grad.size(), 1.0f);
  out.m.assign(grad.size(), 0.0f);
  out.v.assign(grad.size(), 0.0f);
  ParamShard shard{"w",          out.master.data(), grad.data(),
                   out.m.data(), out.v.data(),      static_cast<int64_t>(grad.size()),
                   false};
  AdamW opt(config);
  absl::StatusOr<StepResult> r = opt.Step(std::span<ParamShard>(&shard, 1), 1, nullptr);
  EXPECT_TRUE(r.ok()) << r.status();
  if (r.ok()) out.result = *r;
  return out;
}

// A replica left out of the norm (a TP-replicated parameter on TP rank > 0): the norm is that of
// the counted shards alone, the replica is still updated, and a NaN in it still skips the step.
TEST(NormTest, ShardOutsideTheNormIsUpdatedButNotCounted) {
  AdamWConfig config;
  config.clip = 0.0;
  std::vector<float> g1 = {3.0f, 4.0f}, g2 = {100.0f, 100.0f};
  std::vector<float> w1(2, 1.0f), w2(2, 1.0f), m1(2, 0.0f), m2(2, 0.0f), v1(2, 0.0f), v2(2, 0.0f);
  ParamShard shards[2] = {
      {.name = "counted", .master = w1.data(), .grad = g1.data(), .m = m1.data(), .v = v1.data(),
       .count = 2},
      {.name = "replica", .master = w2.data(), .grad = g2.data(), .m = m2.data(), .v = v2.data(),
       .count = 2, .in_norm = false}};
  AdamW opt(config);
  absl::StatusOr<StepResult> r = opt.Step(shards, 1, nullptr);
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->grad_norm, 5.0);  // sqrt(3^2 + 4^2): the replica's 100s are not in it
  EXPECT_NE(w2[0], 1.0f);        // but the replica is updated
  g2[1] = std::numeric_limits<float>::infinity();
  const std::vector<float> before = w1;
  r = opt.Step(shards, 2, nullptr);
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_TRUE(r->skipped);
  EXPECT_EQ(w1, before);
}

TEST(ClippingTest, ScalesByClipOverNormAboveTheThreshold) {
  AdamWConfig c = ConstantLr(1e-2, 0.0);
  c.clip = 1.0;
  // |(3, 4, 0)| = 5 exactly; the gradient is scaled by 1 / (5 + 1e-6).
  const OneStep s = StepOnce(c, {3.0f, 4.0f, 0.0f});
  EXPECT_FALSE(s.result.skipped);
  EXPECT_EQ(s.result.grad_norm, 5.0);
  EXPECT_EQ(s.result.clip_scale, static_cast<float>(1.0 / (5.0 + 1e-6)));
  // First moment: (1 - b1) * g * scale; second: (1 - b2) * (g * scale)^2.
  const double scale = 1.0 / (5.0 + 1e-6);
  ExpectNear(s.m, {0.1 * 3 * scale, 0.1 * 4 * scale, 0.0}, 1e-6, "m");
  ExpectNear(s.v, {0.05 * 9 * scale * scale, 0.05 * 16 * scale * scale, 0.0}, 1e-6, "v");
}

TEST(ClippingTest, LeavesGradientsBelowTheThresholdAlone) {
  AdamWConfig c = ConstantLr(1e-2, 0.0);
  c.clip = 1.0;
  const OneStep s = StepOnce(c, {0.3f, 0.4f});  // norm 0.5
  EXPECT_EQ(s.result.clip_scale, 1.0f);
  EXPECT_NEAR(s.result.grad_norm, 0.5, 1e-7);
  ExpectNear(s.m, {0.1 * double{0.3f}, 0.1 * double{0.4f}}, 1e-6, "m");
  // Exactly at the threshold: clip / (norm + 1e-6) < 1 but within 1e-6 of it.
  const OneStep at = StepOnce(c, {0.6f, 0.8f});
  EXPECT_NEAR(at.result.clip_scale, 1.0f, 2e-6);
  // clip = 0 turns clipping off whatever the norm.
  c.clip = 0.0;
  const OneStep off = StepOnce(c, {300.0f, 400.0f});
  EXPECT_EQ(off.result.grad_norm, 500.0);
  EXPECT_EQ(off.result.clip_scale, 1.0f);
  ExpectNear(off.m, {30.0, 40.0}, 1e-6, "m unclipped");
}

TEST(ClippingTest, ZeroGradientIsNotScaled) {
  AdamWConfig c = ConstantLr(1e-2, 0.0);
  c.clip = 1.0;
  const OneStep s = StepOnce(c, {0.0f, 0.0f});
  EXPECT_EQ(s.result.grad_norm, 0.0);
  EXPECT_EQ(s.result.clip_scale, 1.0f);
  EXPECT_EQ(s.master, (std::vector<float>{1.0f, 1.0f}));  // m_hat = 0: no update
}

struct BadValue {
  const char* name;
  float value;
  int shard;
};
void PrintTo(const BadValue& b, std::ostream* os) { *os << b.name; }

class NonFiniteSkipTest : public ::testing::TestWithParam<BadValue> {};

TEST_P(NonFiniteSkipTest, SkipsWithStateBitwiseUnchangedThenProceeds) {
  const BadValue bad = GetParam();
  const AdamWConfig config = ConstantLr(1e-2, 0.1);
  AdamW opt(config);
  ShardSet set;
  std::vector<RefParam> ref;
  for (int s = 0; s < set.num(); ++s) ref.push_back(set.Ref(s));
  auto ref_step = [&](int grad_step, int t) {
    for (int s = 0; s < set.num(); ++s) {
      const double lambda = set.shards()[static_cast<size_t>(s)].decay ? config.lr * 0.1 : 0.0;
      std::vector<double> g;
      for (size_t i = 0; i < set.grad(s).size(); ++i) {
        g.push_back(TestGrad(s, grad_step, static_cast<int>(i)));
      }
      PaperAdamWStep(ref[static_cast<size_t>(s)], g, t, config.lr, 1.0, lambda, 0.9, 0.95, 1e-8);
    }
  };
  // Two finite steps so that the moments are not zero.
  for (int step = 1; step <= 2; ++step) {
    set.SetGrads(step);
    ASSERT_TRUE(opt.Step(set.shards(), step, nullptr).ok());
    ref_step(step, step);
  }
  const std::vector<uint32_t> before = set.StateBits();

  set.SetGrads(3);
  set.grad(bad.shard).back() = bad.value;
  absl::StatusOr<StepResult> r = opt.Step(set.shards(), 3, nullptr);
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_TRUE(r->skipped);
  EXPECT_FALSE(std::isfinite(r->grad_norm));
  if (std::isnan(bad.value)) {
    EXPECT_TRUE(std::isnan(r->grad_norm));
  } else {
    EXPECT_EQ(r->grad_norm, std::numeric_limits<double>::infinity());
  }
  EXPECT_EQ(r->applied_steps, 2);
  EXPECT_EQ(opt.applied_steps(), 2);
  EXPECT_EQ(set.StateBits(), before);

  // The next finite step is the third applied one (t = 3 in the bias corrections).
  set.SetGrads(4);
  r = opt.Step(set.shards(), 4, nullptr);
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_FALSE(r->skipped);
  EXPECT_EQ(r->applied_steps, 3);
  ref_step(4, 3);
  for (int s = 0; s < set.num(); ++s) {
    ExpectNear(set.master(s), ref[static_cast<size_t>(s)].theta, kRelTol, "master");
    ExpectNear(set.m(s), ref[static_cast<size_t>(s)].m, kRelTol, "m");
    ExpectNear(set.v(s), ref[static_cast<size_t>(s)].v, kRelTol, "v");
  }
}

INSTANTIATE_TEST_SUITE_P(
    Values, NonFiniteSkipTest,
    ::testing::Values(BadValue{"NaN_first_shard", kNaN, 0}, BadValue{"NaN_last_shard", kNaN, 2},
                      BadValue{"Inf", kInf, 1}, BadValue{"MinusInf", -kInf, 2}),
    [](const ::testing::TestParamInfo<BadValue>& info) { return std::string(info.param.name); });

TEST(AdamWStateTest, EmptyShardListIsAnAppliedStep) {
  AdamW opt(ConstantLr(1e-2, 0.1));
  absl::StatusOr<StepResult> r = opt.Step({}, 1, nullptr);
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_FALSE(r->skipped);
  EXPECT_EQ(r->grad_norm, 0.0);
  EXPECT_EQ(r->applied_steps, 1);
  // A zero-length shard may have null buffers.
  ParamShard empty{"empty", nullptr, nullptr, nullptr, nullptr, 0, true};
  r = opt.Step(std::span<ParamShard>(&empty, 1), 2, nullptr);
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->applied_steps, 2);
}

TEST(AdamWStateTest, RestoredStepCountContinuesBitIdentically) {
  const AdamWConfig config = ConstantLr(1e-2, 0.1);
  AdamW a(config);
  ShardSet run, resumed;
  for (int step = 1; step <= 3; ++step) {
    run.SetGrads(step);
    ASSERT_TRUE(a.Step(run.shards(), step, nullptr).ok());
  }
  // "Checkpoint": the buffers and the applied-step count.
  for (int s = 0; s < run.num(); ++s) {
    resumed.master(s) = run.master(s);
    resumed.m(s) = run.m(s);
    resumed.v(s) = run.v(s);
  }
  // vector assignment of equal size keeps the data pointers the shards hold.
  AdamW b(config);
  b.set_applied_steps(a.applied_steps());
  EXPECT_EQ(b.applied_steps(), 3);
  for (int step = 4; step <= 6; ++step) {
    run.SetGrads(step);
    resumed.SetGrads(step);
    ASSERT_TRUE(a.Step(run.shards(), step, nullptr).ok());
    ASSERT_TRUE(b.Step(resumed.shards(), step, nullptr).ok());
  }
  EXPECT_EQ(run.StateBits(), resumed.StateBits());
  // Without the count the bias corrections restart at t = 1 and the weights differ.
  ShardSet fresh;
  AdamW c(config);
  for (int s = 0; s < run.num(); ++s) fresh.master(s) = resumed.master(s);
  fresh.SetGrads(7);
  resumed.SetGrads(7);
  ASSERT_TRUE(b.Step(resumed.shards(), 7, nullptr).ok());
  ASSERT_TRUE(c.Step(fresh.shards(), 7, nullptr).ok());
  EXPECT_NE(fresh.StateBits(), resumed.StateBits());
}

TEST(AdamWStateTest, RejectsBadArguments) {
  AdamW opt(ConstantLr(1e-2, 0.1));
  absl::StatusOr<StepResult> r = opt.Step({}, 0, nullptr);
  EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(r.status().message(), HasSubstr("1-based"));

  std::vector<float> w(4, 1.0f);
  ParamShard missing{"blocks.0.attn.qkv/weight", w.data(), nullptr, w.data(), w.data(), 4, true};
  r = opt.Step(std::span<ParamShard>(&missing, 1), 1, nullptr);
  EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(r.status().message(), HasSubstr("blocks.0.attn.qkv/weight"));
  EXPECT_EQ(opt.applied_steps(), 0);
}

TEST(AdamWConfigTest, ValidateNamesTheField) {
  EXPECT_TRUE(ValidateAdamWConfig(AdamWConfig{}).ok());
  struct Case {
    const char* field;
    void (*mutate)(AdamWConfig&);
  };
  const Case cases[] = {
      {"lr", [](AdamWConfig& c) { c.lr = -1; }},
      {"lr", [](AdamWConfig& c) { c.lr = std::numeric_limits<double>::quiet_NaN(); }},
      {"beta1", [](AdamWConfig& c) { c.beta1 = 1.0; }},
      {"beta2", [](AdamWConfig& c) { c.beta2 = -0.1; }},
      {"eps", [](AdamWConfig& c) { c.eps = 0; }},
      {"weight_decay", [](AdamWConfig& c) { c.weight_decay = -0.1; }},
      {"clip", [](AdamWConfig& c) { c.clip = -1; }},
      {"warmup", [](AdamWConfig& c) { c.warmup = -1; }},
      {"steps", [](AdamWConfig& c) { c.steps = -5; }},
      {"min_lr", [](AdamWConfig& c) { c.min_lr = 1.0; }},  // above lr
  };
  for (const Case& k : cases) {
    AdamWConfig c;
    k.mutate(c);
    const absl::Status status = ValidateAdamWConfig(c);
    EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument) << k.field;
    EXPECT_THAT(status.message(), HasSubstr(std::string("'") + k.field + "'")) << k.field;
  }
}

}  // namespace
}  // namespace fp8rt::train
