// The element-wise ops of the CPU op table: amax and FP32 <-> BF16 conversion. References: plain
// loops over the definitions (max |x| with NaN winning; BF16 = FloatToBf16, itself checked in
// formats_test.cc against an independent nearest-even reference).
#include <bit>
#include <cfloat>
#include <cmath>
#include <limits>
#include <random>
#include <vector>

#include "gtest/gtest.h"
#include "kernels/formats.h"
#include "kernels/ops.h"

namespace fp8rt::kernels {
namespace {

std::vector<uint32_t> RandomBits(size_t n, uint32_t seed) {
  std::mt19937 gen(seed);
  std::vector<uint32_t> bits(n);
  for (auto& b : bits) b = gen();
  return bits;
}

TEST(ConvertOpTest, F32ToBf16MatchesTheScalarDefinitionOnRandomBitPatterns) {
  // 2^22 random patterns (NaNs, infinities, subnormals included) plus a tail that is not a
  // multiple of any vector width.
  const auto bits = RandomBits((size_t{1} << 22) + 13, 7);
  std::vector<float> in(bits.size());
  for (size_t i = 0; i < bits.size(); ++i) in[i] = std::bit_cast<float>(bits[i]);
  const float specials[] = {0.0f,
                            -0.0f,
                            INFINITY,
                            -INFINITY,
                            NAN,
                            -NAN,
                            FLT_MAX,
                            -FLT_MAX,
                            0x1.fffffep127f,
                            1.0f + 0x1p-8f,
                            1.0f + 0x1p-8f + 0x1p-23f,
                            1.0f + 0x1p-7f + 0x1p-8f,
                            std::numeric_limits<float>::denorm_min()};
  in.insert(in.begin(), std::begin(specials), std::end(specials));
  std::vector<uint16_t> out(in.size(), 0xDEAD);
  ConvertArgs a{InputType::kF32, InputType::kBF16, in.data(), out.data(),
                static_cast<int64_t>(in.size())};
  ASSERT_TRUE(CpuOps().convert(a, {}).ok());
  for (size_t i = 0; i < in.size(); ++i) {
    const uint16_t want = FloatToBf16(in[i]);
    if (std::isnan(in[i])) {
      ASSERT_TRUE(std::isnan(Bf16ToFloat(out[i]))) << i;
      ASSERT_EQ(out[i] & 0x8000, want & 0x8000) << "NaN keeps its sign, " << i;
    } else {
      ASSERT_EQ(out[i], want) << "input bits 0x" << std::hex << std::bit_cast<uint32_t>(in[i]);
    }
  }
}

TEST(ConvertOpTest, Bf16ToF32IsExactForEveryCode) {
  std::vector<uint16_t> in(65536 + 5);
  for (size_t i = 0; i < in.size(); ++i) in[i] = static_cast<uint16_t>(i);
  std::vector<float> out(in.size());
  ConvertArgs a{InputType::kBF16, InputType::kF32, in.data(), out.data(),
                static_cast<int64_t>(in.size())};
  ASSERT_TRUE(CpuOps().convert(a, {}).ok());
  for (size_t i = 0; i < in.size(); ++i) {
    ASSERT_EQ(std::bit_cast<uint32_t>(out[i]), static_cast<uint32_t>(in[i]) << 16) << i;
  }
}

TEST(ConvertOpTest, SameTypeCopiesAndBadArgumentsAreRejected) {
  std::vector<float> in = {1.5f, -2.0f, 3.25f}, out(3);
  ConvertArgs a{InputType::kF32, InputType::kF32, in.data(), out.data(), 3};
  ASSERT_TRUE(CpuOps().convert(a, {}).ok());
  EXPECT_EQ(out, in);
  a.count = -1;
  EXPECT_EQ(CpuOps().convert(a, {}).code(), absl::StatusCode::kInvalidArgument);
  a.count = 3;
  a.output = nullptr;
  EXPECT_EQ(CpuOps().convert(a, {}).code(), absl::StatusCode::kInvalidArgument);
}

TEST(AmaxOpTest, MaxAbsoluteValueWithNaNWinningAndAFiniteMax) {
  std::mt19937 gen(3);
  std::normal_distribution<float> dist(0.0f, 10.0f);
  std::vector<float> x(1000003);
  for (float& v : x) v = dist(gen);
  float want = 0.0f;
  for (float v : x) want = std::max(want, std::fabs(v));
  float amax = -1.0f, finite = -1.0f;
  AmaxArgs a{InputType::kF32, x.data(), static_cast<int64_t>(x.size()), &amax, &finite};
  ASSERT_TRUE(CpuOps().amax(a, {}).ok());
  EXPECT_EQ(amax, want);
  EXPECT_EQ(finite, want);

  x[777777] = -INFINITY;
  ASSERT_TRUE(CpuOps().amax(a, {}).ok());
  EXPECT_EQ(amax, INFINITY);
  EXPECT_EQ(finite, want);  // the finite max ignores Inf
  x[12] = NAN;
  ASSERT_TRUE(CpuOps().amax(a, {}).ok());
  EXPECT_TRUE(std::isnan(amax));
  EXPECT_EQ(finite, want);

  // BF16 input: the amax of the BF16 values.
  std::vector<uint16_t> b = {FloatToBf16(-3.0f), FloatToBf16(2.5f), FloatToBf16(-0.0f)};
  AmaxArgs ab{InputType::kBF16, b.data(), 3, &amax, nullptr};
  ASSERT_TRUE(CpuOps().amax(ab, {}).ok());
  EXPECT_EQ(amax, 3.0f);
  // Empty input: amax 0.
  AmaxArgs empty{InputType::kF32, nullptr, 0, &amax, nullptr};
  ASSERT_TRUE(CpuOps().amax(empty, {}).ok());
  EXPECT_EQ(amax, 0.0f);
  empty.amax = nullptr;
  EXPECT_EQ(CpuOps().amax(empty, {}).code(), absl::StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace fp8rt::kernels
