// Tests of ScalingState (runtime/train/scaling.h): the scale rule of DESIGN.md section 3, zero
// and non-finite amaxes, delayed scaling's amax-history window, the config checks, and the
// checkpoint form fp8rt.v1.ScalingState.
//
// Index:
//   ExpectedScale           the rule written out here from DESIGN.md: fp8_max / amax / 2^margin,
//                           in FP32, with the format maxima from the OCP FP8 definitions
//   ScalingRuleTest         TEST_P over E4M3 / E5M2: normal, zero, tiny, huge, Inf and NaN
//                           amaxes, power-of-two scales
//   DelayedScalingTest      empty history, the window of H amaxes with max and most_recent
//   StrategyTest            current and block scaling always compute the scale from the tensor
//   ScalingConfigTest       ValidateScalingConfig and the enum names
//   ScalingStateProtoTest   the wire form, bit-identical round trips, FromProto's rejections
#include <algorithm>
#include <bit>
#include <cfloat>
#include <cmath>
#include <cstdint>
#include <deque>
#include <functional>
#include <limits>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "fp8rt/v1/scaling.pb.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "kernels/formats.h"
#include "runtime/train/scaling.h"

namespace fp8rt::train {
namespace {

using kernels::Fp8Format;
using ::testing::ElementsAreArray;

constexpr float kInf = std::numeric_limits<float>::infinity();
constexpr float kNaN = std::numeric_limits<float>::quiet_NaN();

// Largest finite values (OCP OFP8 v1.0): E4M3 S.1111.110 = 448, E5M2 S.11110.11 = 57344.
float Fp8Max(Fp8Format format) { return format == Fp8Format::kE4M3 ? 448.0f : 57344.0f; }

// DESIGN.md section 3: scale = fp8_max / amax / 2^margin, evaluated left to right in FP32.
// (Dividing by 2^margin is exact in the normal range, so any evaluation order or a double
// evaluation rounded once to FP32 gives the same value for the amaxes used with it here.)
float ExpectedScale(float amax, Fp8Format format, int margin) {
  const float quotient = Fp8Max(format) / amax;
  return quotient / std::ldexp(1.0f, margin);
}

uint32_t Bits(float x) { return std::bit_cast<uint32_t>(x); }

bool IsPowerOfTwo(float x) {
  int exp = 0;
  return x > 0.0f && std::isfinite(x) && std::frexp(x, &exp) == 0.5f;
}

ScalingConfig Delayed(Fp8Format format, int history_len = 16, AmaxAlgo algo = AmaxAlgo::kMax,
                      int margin = 0, bool power_of_two = false) {
  ScalingConfig config;
  config.format = format;
  config.strategy = ScalingStrategy::kDelayed;
  config.history_len = history_len;
  config.algo = algo;
  config.margin = margin;
  config.power_of_two = power_of_two;
  return config;
}

// The scale and its inverse as DESIGN.md pairs them: scale_inv = 1 / scale in FP32.
void ExpectScale(const ScalingState& state, float expected) {
  EXPECT_EQ(Bits(state.scale()), Bits(expected))
      << "scale " << state.scale() << ", expected " << expected;
  EXPECT_EQ(Bits(state.scale_inv()), Bits(1.0f / expected))
      << "scale_inv " << state.scale_inv() << ", expected " << 1.0f / expected;
}

// True when `field` occurs in `message` as a whole identifier (so "scale" does not match
// "scale_inv").
bool MentionsField(std::string_view message, std::string_view field) {
  auto is_ident = [](char ch) {
    return (ch >= 'a' && ch <= 'z') || (ch >= 'A' && ch <= 'Z') || (ch >= '0' && ch <= '9') ||
           ch == '_';
  };
  for (size_t pos = message.find(field); pos != std::string_view::npos;
       pos = message.find(field, pos + 1)) {
    const size_t end = pos + field.size();
    if ((pos == 0 || !is_ident(message[pos - 1])) &&
        (end == message.size() || !is_ident(message[end]))) {
      return true;
    }
  }
  return false;
}

std::string FormatName(Fp8Format f) { return f == Fp8Format::kE4M3 ? "e4m3" : "e5m2"; }

// ---------------------------------------------------------------------------------------------
// The scale rule, per format.

class ScalingRuleTest : public ::testing::TestWithParam<Fp8Format> {};

TEST_P(ScalingRuleTest, FreshStateHasUnitScaleAndNoHistory) {
  const ScalingState state(Delayed(GetParam()));
  EXPECT_TRUE(state.UsesCurrentScaling());
  ExpectScale(state, 1.0f);
  EXPECT_TRUE(state.history().empty());
  EXPECT_EQ(state.updates(), 0);
  EXPECT_EQ(state.zero_amax_count(), 0);
  EXPECT_EQ(state.nonfinite_amax_count(), 0);
}

TEST_P(ScalingRuleTest, NormalAmaxGivesMaxOverAmaxOverTwoToTheMargin) {
  const Fp8Format format = GetParam();
  for (int margin : {0, 1, 3, 7, 32}) {
    for (float amax : {1.0f, 3.7f, 0.001234f, 448.0f, 1000.0f, 12345.678f, 3.0e5f, 1.0e-20f}) {
      SCOPED_TRACE(absl::StrCat("amax ", amax, " margin ", margin));
      ScalingState state(Delayed(format, 16, AmaxAlgo::kMax, margin));
      EXPECT_EQ(state.Update(amax), AmaxUpdate::kRecorded);
      const float expected = ExpectedScale(amax, format, margin);
      ASSERT_TRUE(std::isnormal(expected));  // premise: these amaxes stay in the normal range
      ExpectScale(state, expected);
      EXPECT_THAT(state.history(), ElementsAreArray({amax}));
      EXPECT_EQ(state.updates(), 1);
      EXPECT_FALSE(state.UsesCurrentScaling());
    }
  }
}

TEST_P(ScalingRuleTest, ZeroAmaxKeepsPreviousScale) {
  const Fp8Format format = GetParam();
  ScalingState state(Delayed(format, 4));
  ASSERT_EQ(state.Update(2.5f), AmaxUpdate::kRecorded);
  const float before = ExpectedScale(2.5f, format, 0);
  ExpectScale(state, before);
  for (int i = 1; i <= 3; ++i) {
    EXPECT_EQ(state.Update(0.0f), AmaxUpdate::kKeptZero);
    ExpectScale(state, before);
    EXPECT_THAT(state.history(), ElementsAreArray({2.5f}));  // not recorded
    EXPECT_EQ(state.zero_amax_count(), i);
    EXPECT_EQ(state.updates(), 1);
    EXPECT_EQ(state.nonfinite_amax_count(), 0);
  }
}

TEST_P(ScalingRuleTest, ZeroAmaxOnEmptyHistoryKeepsUnitScale) {
  ScalingState state(Delayed(GetParam()));
  EXPECT_EQ(state.Update(0.0f), AmaxUpdate::kKeptZero);
  ExpectScale(state, 1.0f);
  EXPECT_TRUE(state.history().empty());
  EXPECT_TRUE(state.UsesCurrentScaling());
  EXPECT_EQ(state.zero_amax_count(), 1);
  EXPECT_EQ(state.updates(), 0);
}

TEST_P(ScalingRuleTest, NonFiniteAmaxKeepsPreviousScale) {
  const Fp8Format format = GetParam();
  ScalingState state(Delayed(format, 4));
  ASSERT_EQ(state.Update(7.0f), AmaxUpdate::kRecorded);
  const float before = ExpectedScale(7.0f, format, 0);
  int64_t count = 0;
  for (float amax : {kInf, kNaN, -kInf, -kNaN}) {
    SCOPED_TRACE(amax);
    EXPECT_EQ(state.Update(amax), AmaxUpdate::kKeptNonFinite);
    EXPECT_EQ(state.nonfinite_amax_count(), ++count);
    ExpectScale(state, before);
    EXPECT_THAT(state.history(), ElementsAreArray({7.0f}));
    EXPECT_EQ(state.updates(), 1);
    EXPECT_EQ(state.zero_amax_count(), 0);
  }
}

// fp8_max / amax overflows FP32 for these amaxes (448 / 2^-126 = 448 * 2^126 > 2^128, even after
// dividing by 2^4): the scale saturates to FLT_MAX, finite and positive, instead of becoming Inf.
TEST_P(ScalingRuleTest, TinyAmaxGivesLargestFiniteScale) {
  const Fp8Format format = GetParam();
  for (int margin : {0, 4}) {
    for (float amax : {1e-42f, FLT_MIN, std::numeric_limits<float>::denorm_min()}) {
      SCOPED_TRACE(absl::StrCat("amax ", amax, " margin ", margin));
      ASSERT_TRUE(std::isinf(ExpectedScale(amax, format, margin)));  // premise
      ScalingState state(Delayed(format, 16, AmaxAlgo::kMax, margin));
      EXPECT_EQ(state.Update(amax), AmaxUpdate::kRecorded);
      EXPECT_TRUE(std::isfinite(state.scale()));
      EXPECT_GT(state.scale(), 0.0f);
      ExpectScale(state, FLT_MAX);
      EXPECT_GT(state.scale_inv(), 0.0f);
    }
  }
}

// A tiny amax whose quotient still fits: the rule applies unchanged.
TEST_P(ScalingRuleTest, SmallAmaxBelowOverflowFollowsRule) {
  const Fp8Format format = GetParam();
  const float amax = Fp8Max(format) * 0x1p-120f;  // scale 2^120
  ScalingState state(Delayed(format));
  ASSERT_EQ(state.Update(amax), AmaxUpdate::kRecorded);
  ExpectScale(state, ExpectedScale(amax, format, 0));
  EXPECT_EQ(state.scale(), 0x1p120f);
}

// The opposite end: FLT_MAX / 2^32 underflows FP32; the scale must stay a positive number whose
// inverse is finite (a zero or subnormal scale would quantize everything to zero or give an
// infinite scale_inv).
TEST_P(ScalingRuleTest, HugeAmaxKeepsScalePositive) {
  ScalingState state(Delayed(GetParam(), 16, AmaxAlgo::kMax, 32));
  EXPECT_EQ(state.Update(FLT_MAX), AmaxUpdate::kRecorded);
  EXPECT_GE(state.scale(), FLT_MIN);
  EXPECT_TRUE(std::isfinite(state.scale()));
  EXPECT_TRUE(std::isfinite(state.scale_inv()));
  EXPECT_EQ(Bits(state.scale_inv()), Bits(1.0f / state.scale()));
}

// power_of_two rounds the scale down to a power of two: the largest 2^e <= the rule's scale.
TEST_P(ScalingRuleTest, PowerOfTwoScalesRoundDown) {
  const Fp8Format format = GetParam();
  for (int margin : {0, 1, 5}) {
    for (float amax : {1.0f, 3.7f, 0.001234f, 448.0f, 1000.0f, 12345.678f, 3.0e5f, 1e-42f}) {
      SCOPED_TRACE(absl::StrCat("amax ", amax, " margin ", margin));
      ScalingState state(Delayed(format, 16, AmaxAlgo::kMax, margin, /*power_of_two=*/true));
      EXPECT_EQ(state.Update(amax), AmaxUpdate::kRecorded);
      const float rule = std::min(ExpectedScale(amax, format, margin), FLT_MAX);
      const float s = state.scale();
      EXPECT_TRUE(IsPowerOfTwo(s)) << s;
      EXPECT_LE(s, rule);
      EXPECT_GT(s, rule / 2.0f);
      EXPECT_EQ(Bits(state.scale_inv()), Bits(1.0f / s));
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Formats, ScalingRuleTest,
                         ::testing::Values(Fp8Format::kE4M3, Fp8Format::kE5M2),
                         [](const auto& info) { return FormatName(info.param); });

// ---------------------------------------------------------------------------------------------
// Delayed scaling.

class DelayedScalingTest : public ::testing::TestWithParam<Fp8Format> {};

TEST_P(DelayedScalingTest, UsesCurrentScalingUntilAnAmaxIsRecorded) {
  ScalingState state(Delayed(GetParam(), 4));
  EXPECT_TRUE(state.UsesCurrentScaling());
  state.Update(0.0f);
  EXPECT_TRUE(state.UsesCurrentScaling()) << "a zero amax is not recorded";
  state.Update(kNaN);
  EXPECT_TRUE(state.UsesCurrentScaling()) << "a NaN amax is not recorded";
  state.Update(3.0f);
  EXPECT_FALSE(state.UsesCurrentScaling());
  state.Update(0.0f);
  EXPECT_FALSE(state.UsesCurrentScaling());
}

// With algo max, the scale follows the largest of the last H recorded amaxes: one large amax
// holds the scale down for exactly H steps (the step that records it and H - 1 more).
TEST_P(DelayedScalingTest, MaxOverWindowOfHistoryLen) {
  const Fp8Format format = GetParam();
  for (int h : {1, 2, 5, 16}) {
    SCOPED_TRACE(absl::StrCat("history_len ", h));
    ScalingState state(Delayed(format, h, AmaxAlgo::kMax));
    ASSERT_EQ(state.Update(1000.0f), AmaxUpdate::kRecorded);
    ExpectScale(state, ExpectedScale(1000.0f, format, 0));
    // Smaller amaxes, not in order, so that the window max is not simply the latest.
    const float smaller[] = {3.0f, 9.0f, 2.0f, 5.0f, 1.5f, 7.0f, 2.5f,  4.0f,
                             6.0f, 1.0f, 8.0f, 3.5f, 2.0f, 5.5f, 1.25f, 6.5f};
    std::deque<float> window = {1000.0f};
    for (int i = 0; i < h; ++i) {
      ASSERT_EQ(state.Update(smaller[i]), AmaxUpdate::kRecorded);
      window.push_back(smaller[i]);
      if (static_cast<int>(window.size()) > h) window.pop_front();
      const float window_max = *std::max_element(window.begin(), window.end());
      if (i < h - 1) {
        ASSERT_EQ(window_max, 1000.0f);  // the large amax is still in the window
      } else {
        ASSERT_LT(window_max, 1000.0f);  // it has just left
      }
      SCOPED_TRACE(absl::StrCat("after ", i + 1, " smaller amaxes"));
      ExpectScale(state, ExpectedScale(window_max, format, 0));
      EXPECT_THAT(state.history(), ElementsAreArray(window));
    }
  }
}

// Zero and non-finite amaxes are not recorded, so they do not push old amaxes out of the window.
TEST_P(DelayedScalingTest, SkippedAmaxesDoNotAdvanceWindow) {
  const Fp8Format format = GetParam();
  const int h = 3;
  ScalingState state(Delayed(format, h, AmaxAlgo::kMax));
  state.Update(1000.0f);
  for (int i = 0; i < 2 * h; ++i) {
    state.Update(0.0f);
    state.Update(kNaN);
    state.Update(kInf);
  }
  ExpectScale(state, ExpectedScale(1000.0f, format, 0));
  state.Update(2.0f);
  state.Update(3.0f);
  ExpectScale(state, ExpectedScale(1000.0f, format, 0));
  state.Update(1.0f);
  ExpectScale(state, ExpectedScale(3.0f, format, 0));
  EXPECT_THAT(state.history(), ElementsAreArray({2.0f, 3.0f, 1.0f}));
  EXPECT_EQ(state.updates(), 4);
  EXPECT_EQ(state.zero_amax_count(), 2 * h);
  EXPECT_EQ(state.nonfinite_amax_count(), 4 * h);
}

TEST_P(DelayedScalingTest, MostRecentFollowsLastAmax) {
  const Fp8Format format = GetParam();
  ScalingState state(Delayed(format, 4, AmaxAlgo::kMostRecent, /*margin=*/2));
  for (float amax : {1000.0f, 1.0f, 50.0f, 2.0f, 3.0f, 0.25f}) {
    SCOPED_TRACE(amax);
    ASSERT_EQ(state.Update(amax), AmaxUpdate::kRecorded);
    ExpectScale(state, ExpectedScale(amax, format, 2));
  }
  EXPECT_THAT(state.history(), ElementsAreArray({50.0f, 2.0f, 3.0f, 0.25f}));
  // A skipped amax keeps the scale of the last recorded one.
  EXPECT_EQ(state.Update(0.0f), AmaxUpdate::kKeptZero);
  ExpectScale(state, ExpectedScale(0.25f, format, 2));
}

INSTANTIATE_TEST_SUITE_P(Formats, DelayedScalingTest,
                         ::testing::Values(Fp8Format::kE4M3, Fp8Format::kE5M2),
                         [](const auto& info) { return FormatName(info.param); });

// ---------------------------------------------------------------------------------------------
// Current and block strategies.

TEST(StrategyTest, CurrentAndBlockAlwaysUseCurrentScaling) {
  for (ScalingStrategy strategy : {ScalingStrategy::kCurrent, ScalingStrategy::kBlock}) {
    SCOPED_TRACE(ScalingStrategyName(strategy));
    ScalingConfig config;
    config.strategy = strategy;
    ScalingState state(config);
    EXPECT_TRUE(state.UsesCurrentScaling());
    EXPECT_EQ(state.Update(3.0f), AmaxUpdate::kRecorded);
    EXPECT_TRUE(state.UsesCurrentScaling());
    EXPECT_EQ(state.Update(0.0f), AmaxUpdate::kKeptZero);
    EXPECT_EQ(state.Update(kNaN), AmaxUpdate::kKeptNonFinite);
    EXPECT_TRUE(state.UsesCurrentScaling());
    EXPECT_EQ(state.updates(), 1);
    EXPECT_EQ(state.zero_amax_count(), 1);
    EXPECT_EQ(state.nonfinite_amax_count(), 1);
  }
}

// ---------------------------------------------------------------------------------------------
// Config checks and names.

void ExpectInvalidNaming(const absl::Status& status, std::string_view field) {
  EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument) << status;
  EXPECT_TRUE(MentionsField(std::string(status.message()), field))
      << "message does not name " << field << ": " << status.message();
}

TEST(ScalingConfigTest, AcceptsValidRanges) {
  EXPECT_TRUE(ValidateScalingConfig(ScalingConfig{}).ok());
  for (int h : {1, 16, 1024}) {
    ScalingConfig config;
    config.history_len = h;
    EXPECT_TRUE(ValidateScalingConfig(config).ok()) << h;
  }
  for (int margin : {0, 1, 32}) {
    ScalingConfig config;
    config.margin = margin;
    EXPECT_TRUE(ValidateScalingConfig(config).ok()) << margin;
  }
}

TEST(ScalingConfigTest, RejectsOutOfRangeNamingField) {
  for (int h : {0, -1}) {
    ScalingConfig config;
    config.history_len = h;
    ExpectInvalidNaming(ValidateScalingConfig(config), "history_len");
  }
  for (int margin : {-1, 33}) {
    ScalingConfig config;
    config.margin = margin;
    ExpectInvalidNaming(ValidateScalingConfig(config), "margin");
  }
}

TEST(ScalingConfigTest, NamesRoundTrip) {
  for (ScalingStrategy s :
       {ScalingStrategy::kDelayed, ScalingStrategy::kCurrent, ScalingStrategy::kBlock}) {
    absl::StatusOr<ScalingStrategy> parsed = ParseScalingStrategy(ScalingStrategyName(s));
    ASSERT_TRUE(parsed.ok()) << parsed.status();
    EXPECT_EQ(*parsed, s);
  }
  EXPECT_EQ(ScalingStrategyName(ScalingStrategy::kDelayed), "delayed");
  EXPECT_EQ(ScalingStrategyName(ScalingStrategy::kCurrent), "current");
  EXPECT_EQ(ScalingStrategyName(ScalingStrategy::kBlock), "block");
  EXPECT_EQ(AmaxAlgoName(AmaxAlgo::kMax), "max");
  EXPECT_EQ(AmaxAlgoName(AmaxAlgo::kMostRecent), "most_recent");
  for (AmaxAlgo a : {AmaxAlgo::kMax, AmaxAlgo::kMostRecent}) {
    absl::StatusOr<AmaxAlgo> parsed = ParseAmaxAlgo(AmaxAlgoName(a));
    ASSERT_TRUE(parsed.ok()) << parsed.status();
    EXPECT_EQ(*parsed, a);
  }
  EXPECT_FALSE(ParseScalingStrategy("dynamic").ok());
  EXPECT_FALSE(ParseAmaxAlgo("mean").ok());
}

// ---------------------------------------------------------------------------------------------
// Checkpoint form.

void ExpectSameState(const ScalingState& a, const ScalingState& b) {
  EXPECT_EQ(a.config().format, b.config().format);
  EXPECT_EQ(a.config().strategy, b.config().strategy);
  EXPECT_EQ(a.config().history_len, b.config().history_len);
  EXPECT_EQ(a.config().algo, b.config().algo);
  EXPECT_EQ(a.config().margin, b.config().margin);
  EXPECT_EQ(a.config().power_of_two, b.config().power_of_two);
  EXPECT_EQ(Bits(a.scale()), Bits(b.scale()));
  EXPECT_EQ(Bits(a.scale_inv()), Bits(b.scale_inv()));
  ASSERT_EQ(a.history().size(), b.history().size());
  for (size_t i = 0; i < a.history().size(); ++i) {
    EXPECT_EQ(Bits(a.history()[i]), Bits(b.history()[i])) << "history[" << i << "]";
  }
  EXPECT_EQ(a.updates(), b.updates());
  EXPECT_EQ(a.zero_amax_count(), b.zero_amax_count());
  EXPECT_EQ(a.nonfinite_amax_count(), b.nonfinite_amax_count());
  EXPECT_EQ(a.UsesCurrentScaling(), b.UsesCurrentScaling());
}

// Through the bytes a checkpoint stores.
absl::StatusOr<ScalingState> RoundTrip(const ScalingState& state) {
  v1::ScalingState proto;
  state.ToProto(&proto);
  std::string bytes;
  EXPECT_TRUE(proto.SerializeToString(&bytes));
  v1::ScalingState parsed;
  EXPECT_TRUE(parsed.ParseFromString(bytes));
  return ScalingState::FromProto(parsed);
}

TEST(ScalingStateProtoTest, ToProtoWritesEveryField) {
  ScalingState state(Delayed(Fp8Format::kE5M2, 3, AmaxAlgo::kMostRecent, 2, true));
  for (float amax : {10.0f, 0.0f, kNaN, 20.0f, 30.0f, 40.0f}) state.Update(amax);
  v1::ScalingState proto;
  state.ToProto(&proto);
  EXPECT_EQ(proto.format(), v1::FP8_FORMAT_E5M2);
  EXPECT_EQ(proto.strategy(), v1::SCALING_STRATEGY_DELAYED);
  EXPECT_EQ(proto.history_len(), 3);
  EXPECT_EQ(proto.amax_algo(), v1::AMAX_ALGO_MOST_RECENT);
  EXPECT_EQ(proto.margin(), 2);
  EXPECT_TRUE(proto.power_of_two());
  EXPECT_THAT(proto.amax_history(), ElementsAreArray({20.0f, 30.0f, 40.0f}));
  EXPECT_EQ(Bits(proto.scale()), Bits(state.scale()));
  EXPECT_EQ(Bits(proto.scale_inv()), Bits(state.scale_inv()));
  EXPECT_EQ(proto.updates(), 4);
  EXPECT_EQ(proto.zero_amax_count(), 1);
  EXPECT_EQ(proto.nonfinite_amax_count(), 1);

  const ScalingState e4m3(ScalingConfig{});
  v1::ScalingState e4m3_proto;
  e4m3.ToProto(&e4m3_proto);
  EXPECT_EQ(e4m3_proto.format(), v1::FP8_FORMAT_E4M3);
  EXPECT_EQ(e4m3_proto.amax_algo(), v1::AMAX_ALGO_MAX);
  EXPECT_TRUE(e4m3_proto.amax_history().empty());
}

// Round trips restore the state bit for bit, and the restored state then evolves exactly as the
// original does.
TEST(ScalingStateProtoTest, RoundTripIsBitIdenticalAndContinuesIdentically) {
  std::vector<ScalingConfig> configs;
  for (Fp8Format format : {Fp8Format::kE4M3, Fp8Format::kE5M2}) {
    configs.push_back(Delayed(format, 4, AmaxAlgo::kMax, 0, false));
    configs.push_back(Delayed(format, 1, AmaxAlgo::kMostRecent, 3, true));
    configs.push_back(Delayed(format, 1024, AmaxAlgo::kMax, 32, false));
    ScalingConfig current = Delayed(format);
    current.strategy = ScalingStrategy::kCurrent;
    configs.push_back(current);
    ScalingConfig block = Delayed(format, 8, AmaxAlgo::kMostRecent, 1, true);
    block.strategy = ScalingStrategy::kBlock;
    configs.push_back(block);
  }
  const std::vector<float> before = {3.1f, 0.0f, 1e-42f, kNaN, 250.7f, 0.0123f, kInf, 7.7f};
  const std::vector<float> after = {0.5f, 0.0f, 12345.0f, 1.1f, kNaN, 2.2f, 3.3f, 4.4f, 0.01f};
  for (size_t c = 0; c < configs.size(); ++c) {
    SCOPED_TRACE(absl::StrCat("config ", c));
    ScalingState original(configs[c]);
    {
      // A fresh state (empty history) round-trips too and still asks for current scaling.
      absl::StatusOr<ScalingState> fresh = RoundTrip(original);
      ASSERT_TRUE(fresh.ok()) << fresh.status();
      ExpectSameState(original, *fresh);
    }
    for (float amax : before) original.Update(amax);
    absl::StatusOr<ScalingState> restored = RoundTrip(original);
    ASSERT_TRUE(restored.ok()) << restored.status();
    ExpectSameState(original, *restored);
    for (float amax : after) {
      SCOPED_TRACE(absl::StrCat("then amax ", amax));
      EXPECT_EQ(original.Update(amax), restored->Update(amax));
      ExpectSameState(original, *restored);
    }
  }
}

// FromProto validates every field of a checkpoint: DataLoss (corrupt checkpoint) or
// InvalidArgument, naming the field.
class ScalingStateProtoRejectTest : public ::testing::Test {
 protected:
  void SetUp() override {
    ScalingState state(Delayed(Fp8Format::kE4M3, 4, AmaxAlgo::kMax, 1));
    state.Update(2.0f);
    state.Update(5.0f);
    state.ToProto(&valid_);
    ASSERT_TRUE(ScalingState::FromProto(valid_).ok()) << ScalingState::FromProto(valid_).status();
  }

  // Applies `corrupt` to a copy of the valid proto and expects FromProto to reject it.
  void ExpectRejected(const std::string& what,
                      const std::function<void(v1::ScalingState*)>& corrupt,
                      std::initializer_list<std::string_view> fields) {
    SCOPED_TRACE(what);
    v1::ScalingState proto = valid_;
    corrupt(&proto);
    absl::StatusOr<ScalingState> state = ScalingState::FromProto(proto);
    ASSERT_FALSE(state.ok()) << "accepted";
    const absl::Status& status = state.status();
    EXPECT_TRUE(status.code() == absl::StatusCode::kDataLoss ||
                status.code() == absl::StatusCode::kInvalidArgument)
        << status;
    bool named = false;
    for (std::string_view f : fields)
      named = named || MentionsField(std::string(status.message()), f);
    EXPECT_TRUE(named) << "message does not name the field: " << status.message();
  }

  v1::ScalingState valid_;
};

TEST_F(ScalingStateProtoRejectTest, HistoryLongerThanHistoryLen) {
  ExpectRejected("5 amaxes with history_len 4",
                 [](v1::ScalingState* p) {
                   for (float v : {1.0f, 2.0f, 3.0f}) p->add_amax_history(v);
                 },
                 {"amax_history", "history_len"});
}

TEST_F(ScalingStateProtoRejectTest, BadHistoryValues) {
  for (float bad : {-1.0f, 0.0f, -0.0f, kNaN, kInf}) {
    ExpectRejected(absl::StrCat("history value ", bad),
                   [bad](v1::ScalingState* p) { p->set_amax_history(0, bad); }, {"amax_history"});
  }
}

TEST_F(ScalingStateProtoRejectTest, BadScales) {
  for (float bad : {0.0f, -2.0f, kNaN, kInf}) {
    ExpectRejected(absl::StrCat("scale ", bad), [bad](v1::ScalingState* p) { p->set_scale(bad); },
                   {"scale"});
    ExpectRejected(absl::StrCat("scale_inv ", bad),
                   [bad](v1::ScalingState* p) { p->set_scale_inv(bad); }, {"scale_inv"});
  }
}

TEST_F(ScalingStateProtoRejectTest, UnspecifiedOrUnknownEnums) {
  ExpectRejected("format unspecified",
                 [](v1::ScalingState* p) { p->set_format(v1::FP8_FORMAT_UNSPECIFIED); },
                 {"format"});
  ExpectRejected("format 9",
                 [](v1::ScalingState* p) { p->set_format(static_cast<v1::Fp8Format>(9)); },
                 {"format"});
  ExpectRejected("strategy unspecified",
                 [](v1::ScalingState* p) { p->set_strategy(v1::SCALING_STRATEGY_UNSPECIFIED); },
                 {"strategy"});
  // A delayed site needs to know how its history is reduced.
  ExpectRejected("amax_algo unspecified",
                 [](v1::ScalingState* p) { p->set_amax_algo(v1::AMAX_ALGO_UNSPECIFIED); },
                 {"amax_algo"});
}

TEST_F(ScalingStateProtoRejectTest, ConfigOutOfRange) {
  ExpectRejected("history_len 0", [](v1::ScalingState* p) { p->set_history_len(0); },
                 {"history_len"});
  ExpectRejected("margin 33", [](v1::ScalingState* p) { p->set_margin(33); }, {"margin"});
  ExpectRejected("margin -1", [](v1::ScalingState* p) { p->set_margin(-1); }, {"margin"});
}

TEST_F(ScalingStateProtoRejectTest, NegativeCounters) {
  ExpectRejected("updates -1", [](v1::ScalingState* p) { p->set_updates(-1); }, {"updates"});
  ExpectRejected("zero_amax_count -1", [](v1::ScalingState* p) { p->set_zero_amax_count(-1); },
                 {"zero_amax_count"});
  ExpectRejected("nonfinite_amax_count -1",
                 [](v1::ScalingState* p) { p->set_nonfinite_amax_count(-1); },
                 {"nonfinite_amax_count"});
}

}  // namespace
}  // namespace fp8rt::train
