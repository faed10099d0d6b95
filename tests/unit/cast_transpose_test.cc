// Tests of CpuOps().cast_transpose (kernels/ops.h): FP8 codes of a matrix and of its transpose in
// one pass, with a given tensor scale.
//
// Reference: the CPU quantize op (granularity tensor, has_scale), itself checked against
// NVIDIA's conversion in quantize_test.cc, followed by a transpose written out here. The
// cast-transpose kernel shares no code with that quantize beyond the scalar encoder of
// kernels/fp8_encode.h (quantize runs the Highway SIMD path), so agreement checks the tiling,
// the transposed indexing and the statistics. Tolerances: none; codes, scale_inv and every
// QuantStats field are defined bit for bit, so all are compared exactly (a NaN amax equals a NaN
// amax).
//
// Index:
//   CastTransposeTest (TEST_P)  format x input type x shape (ragged and aligned, 1-wide edges) x
//                               data (normal, log-uniform 2^-40..2^40, with Inf/NaN/denormals/
//                               saturating outliers) against quantize + transpose
//   CastTransposeMiscTest       thread-count invariance, optional stats, empty shapes,
//                               validation errors naming the field
#include <omp.h>

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdint>
#include <limits>
#include <random>
#include <string>
#include <tuple>
#include <vector>

#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"
#include "kernels/formats.h"
#include "kernels/ops.h"
#include "kernels/quantize.h"

namespace fp8rt::kernels {
namespace {

struct Shape {
  int64_t rows;
  int64_t cols;
};
constexpr Shape kShapes[] = {{1, 1},   {1, 200},   {200, 1},   {63, 65},
                             {64, 64}, {128, 128}, {130, 257}, {1000, 37}};

enum class Data { kNormal, kLogUniform, kSpecials };
constexpr Data kData[] = {Data::kNormal, Data::kLogUniform, Data::kSpecials};

const char* DataName(Data d) {
  switch (d) {
    case Data::kNormal:
      return "normal";
    case Data::kLogUniform:
      return "loguniform";
    case Data::kSpecials:
      return "specials";
  }
  return "?";
}

// FP32 values; BF16 inputs are their upper halves (truncation: any BF16 pattern will do).
std::vector<float> MakeData(Data data, int64_t n, uint32_t seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> normal(0.0f, 3.0f);
  std::uniform_real_distribution<float> unit(0.0f, 1.0f);
  std::vector<float> x(static_cast<size_t>(n));
  for (auto& v : x) {
    switch (data) {
      case Data::kNormal:
        v = normal(rng);
        break;
      case Data::kLogUniform: {
        const float mag = std::exp2(unit(rng) * 80.0f - 40.0f);
        v = (rng() & 1) ? -mag : mag;
        break;
      }
      case Data::kSpecials: {
        const uint32_t pick = rng() % 64;
        if (pick == 0) {
          v = std::numeric_limits<float>::quiet_NaN();
        } else if (pick == 1) {
          v = -std::numeric_limits<float>::infinity();
        } else if (pick == 2) {
          v = std::bit_cast<float>(
              static_cast<uint32_t>(1u + (rng() & 0x7FFFFEu)));  // FP32 denormal
        } else if (pick == 3) {
          v = 1e6f * normal(rng);  // saturates at the scales below
        } else if (pick == 4) {
          v = -0.0f;
        } else {
          // Small magnitudes 2^-40..2^-5: underflows and subnormal codes in both formats.
          const float mag = std::exp2(unit(rng) * 35.0f - 40.0f);
          v = (rng() & 1) ? -mag : mag;
        }
        break;
      }
    }
  }
  return x;
}

std::vector<uint16_t> ToBf16Bits(const std::vector<float>& x) {
  std::vector<uint16_t> out(x.size());
  for (size_t i = 0; i < x.size(); ++i) {
    out[i] = static_cast<uint16_t>(std::bit_cast<uint32_t>(x[i]) >> 16);
  }
  return out;
}

void ExpectSameStats(const QuantStats& got, const QuantStats& want) {
  if (std::isnan(want.amax)) {
    EXPECT_TRUE(std::isnan(got.amax)) << "amax " << got.amax;
  } else {
    EXPECT_EQ(std::bit_cast<uint32_t>(got.amax), std::bit_cast<uint32_t>(want.amax))
        << got.amax << " vs " << want.amax;
  }
  EXPECT_EQ(got.count, want.count);
  EXPECT_EQ(got.underflow, want.underflow);
  EXPECT_EQ(got.subnormal, want.subnormal);
  EXPECT_EQ(got.saturated, want.saturated);
  EXPECT_EQ(got.nonfinite, want.nonfinite);
}

struct Reference {
  std::vector<uint8_t> codes, codes_t;
  float scale_inv = 0.0f;
  QuantStats stats;
};

// Quantize (tensor granularity, the given scale) and transpose the codes.
Reference QuantizeAndTranspose(Fp8Format format, InputType type, const void* input, int64_t rows,
                               int64_t cols, float scale) {
  Reference ref;
  ref.codes.assign(static_cast<size_t>(rows * cols), 0);
  QuantizeArgs q;
  q.format = format;
  q.granularity = Granularity::kTensor;
  q.input_type = type;
  q.input = input;
  q.rows = rows;
  q.cols = cols;
  q.has_scale = true;
  q.scale = scale;
  q.codes = ref.codes.data();
  q.scale_inv = &ref.scale_inv;
  q.stats = &ref.stats;
  const absl::Status s = CpuOps().quantize(q, {});
  EXPECT_TRUE(s.ok()) << s;
  ref.codes_t.assign(ref.codes.size(), 0);
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t c = 0; c < cols; ++c) ref.codes_t[c * rows + r] = ref.codes[r * cols + c];
  }
  return ref;
}

struct Output {
  std::vector<uint8_t> codes, codes_t;
  float scale_inv = -1.0f;
  QuantStats stats;
};

absl::Status RunCastTranspose(Fp8Format format, InputType type, const void* input, int64_t rows,
                              int64_t cols, float scale, Output* out) {
  // Sentinels: an element the kernel forgot to write shows up as 0xA5.
  out->codes.assign(static_cast<size_t>(rows * cols), 0xA5);
  out->codes_t.assign(static_cast<size_t>(rows * cols), 0xA5);
  CastTransposeArgs a;
  a.format = format;
  a.input_type = type;
  a.input = input;
  a.rows = rows;
  a.cols = cols;
  a.scale = scale;
  a.codes = out->codes.data();
  a.codes_t = out->codes_t.data();
  a.scale_inv = &out->scale_inv;
  a.stats = &out->stats;
  return CpuOps().cast_transpose(a, {});
}

using Param = std::tuple<Fp8Format, InputType, Shape, Data>;

class CastTransposeTest : public ::testing::TestWithParam<Param> {};

TEST_P(CastTransposeTest, EqualsQuantizeThenTranspose) {
  const auto [format, type, shape, data] = GetParam();
  const std::vector<float> x = MakeData(data, shape.rows * shape.cols,
                                        static_cast<uint32_t>(shape.rows * 7919 + shape.cols));
  const std::vector<uint16_t> x16 = ToBf16Bits(x);
  const void* input = type == InputType::kF32 ? static_cast<const void*>(x.data())
                                              : static_cast<const void*>(x16.data());
  // A delayed scale from an amax of 8 (not a power of two for E4M3: 448 / 8 = 56).
  const float scale = GetFp8Info(format).max / 8.0f;
  const Reference ref = QuantizeAndTranspose(format, type, input, shape.rows, shape.cols, scale);
  Output out;
  ASSERT_TRUE(RunCastTranspose(format, type, input, shape.rows, shape.cols, scale, &out).ok());
  EXPECT_EQ(out.codes, ref.codes);
  EXPECT_EQ(out.codes_t, ref.codes_t);
  EXPECT_EQ(std::bit_cast<uint32_t>(out.scale_inv), std::bit_cast<uint32_t>(ref.scale_inv));
  ExpectSameStats(out.stats, ref.stats);
  if (data == Data::kSpecials && shape.rows * shape.cols >= 4096) {
    // The data must reach every statistic, or the comparison above proves less than it seems.
    EXPECT_GT(ref.stats.nonfinite, 0);
    EXPECT_GT(ref.stats.saturated, 0);
    EXPECT_GT(ref.stats.underflow, 0);
    EXPECT_GT(ref.stats.subnormal, 0);
    EXPECT_TRUE(std::isnan(ref.stats.amax));
  }
}

INSTANTIATE_TEST_SUITE_P(All, CastTransposeTest,
                         ::testing::Combine(::testing::Values(Fp8Format::kE4M3, Fp8Format::kE5M2),
                                            ::testing::Values(InputType::kF32, InputType::kBF16),
                                            ::testing::ValuesIn(kShapes),
                                            ::testing::ValuesIn(kData)),
                         [](const ::testing::TestParamInfo<Param>& info) {
                           const Shape shape = std::get<2>(info.param);
                           return absl::StrCat(
                               std::string(Fp8FormatName(std::get<0>(info.param))), "_",
                               std::get<1>(info.param) == InputType::kF32 ? "f32" : "bf16", "_",
                               shape.rows, "x", shape.cols, "_", DataName(std::get<3>(info.param)));
                         });

TEST(CastTransposeMiscTest, ResultDoesNotDependOnTheThreadCount) {
  const int64_t rows = 517, cols = 389;
  const std::vector<float> x = MakeData(Data::kSpecials, rows * cols, 3);
  const int saved = omp_get_max_threads();
  Output one, many;
  omp_set_num_threads(1);
  ASSERT_TRUE(
      RunCastTranspose(Fp8Format::kE4M3, InputType::kF32, x.data(), rows, cols, 56.0f, &one).ok());
  omp_set_num_threads(std::max(4, saved));
  ASSERT_TRUE(
      RunCastTranspose(Fp8Format::kE4M3, InputType::kF32, x.data(), rows, cols, 56.0f, &many).ok());
  omp_set_num_threads(saved);
  EXPECT_EQ(one.codes, many.codes);
  EXPECT_EQ(one.codes_t, many.codes_t);
  ExpectSameStats(many.stats, one.stats);
}

TEST(CastTransposeMiscTest, StatsAreOptional) {
  const std::vector<float> x = MakeData(Data::kNormal, 40 * 30, 4);
  std::vector<uint8_t> codes(x.size()), codes_t(x.size());
  float scale_inv = 0.0f;
  CastTransposeArgs a;
  a.input = x.data();
  a.rows = 40;
  a.cols = 30;
  a.scale = 2.0f;
  a.codes = codes.data();
  a.codes_t = codes_t.data();
  a.scale_inv = &scale_inv;
  ASSERT_TRUE(CpuOps().cast_transpose(a, {}).ok());
  EXPECT_EQ(scale_inv, 0.5f);
  EXPECT_EQ(codes_t[29 * 40 + 39], codes[39 * 30 + 29]);
}

TEST(CastTransposeMiscTest, EmptyMatrixWritesScaleAndZeroStats) {
  float scale_inv = 0.0f;
  QuantStats stats;
  stats.count = 99;
  CastTransposeArgs a;
  a.rows = 0;
  a.cols = 17;
  a.scale = 4.0f;
  a.scale_inv = &scale_inv;
  a.stats = &stats;
  ASSERT_TRUE(CpuOps().cast_transpose(a, {}).ok());
  EXPECT_EQ(scale_inv, 0.25f);
  EXPECT_EQ(stats.count, 0);
  EXPECT_EQ(stats.amax, 0.0f);
}

TEST(CastTransposeMiscTest, ValidationNamesTheField) {
  const float x[4] = {1, 2, 3, 4};
  uint8_t codes[4], codes_t[4];
  float scale_inv;
  auto valid = [&] {
    CastTransposeArgs a;
    a.input = x;
    a.rows = 2;
    a.cols = 2;
    a.scale = 1.0f;
    a.codes = codes;
    a.codes_t = codes_t;
    a.scale_inv = &scale_inv;
    return a;
  };
  ASSERT_TRUE(CpuOps().cast_transpose(valid(), {}).ok());
  struct Case {
    const char* field;
    void (*mutate)(CastTransposeArgs&);
  };
  const Case cases[] = {
      {"rows", [](CastTransposeArgs& a) { a.rows = -1; }},
      {"cols", [](CastTransposeArgs& a) { a.cols = -3; }},
      {"scale", [](CastTransposeArgs& a) { a.scale = 0.0f; }},
      {"scale", [](CastTransposeArgs& a) { a.scale = std::numeric_limits<float>::infinity(); }},
      {"scale", [](CastTransposeArgs& a) { a.scale = std::numeric_limits<float>::quiet_NaN(); }},
      {"input", [](CastTransposeArgs& a) { a.input = nullptr; }},
      {"codes", [](CastTransposeArgs& a) { a.codes = nullptr; }},
      {"codes_t", [](CastTransposeArgs& a) { a.codes_t = nullptr; }},
      {"scale_inv", [](CastTransposeArgs& a) { a.scale_inv = nullptr; }},
  };
  for (const Case& c : cases) {
    CastTransposeArgs a = valid();
    c.mutate(a);
    const absl::Status s = CpuOps().cast_transpose(a, {});
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << c.field;
    EXPECT_NE(std::string(s.message()).find(c.field), std::string::npos)
        << c.field << ": " << s.message();
  }
}

}  // namespace
}  // namespace fp8rt::kernels
