// Tests of the quantize and dequantize ops of the CPU op table (kernels/ops.h, kernels/quantize.h)
// against a reference written here from the spec (DESIGN.md section 3, the comments of
// kernels/quantize.h, OCP MX v1.0), with NVIDIA's __nv_cvt_float_to_fp8(x, __NV_SATFINITE, fmt)
// from cuda_fp8.h as the scalar FP32 -> FP8 conversion. The reference re-derives scales, MX
// exponents, statistics and scale grids itself; it calls none of the library's helpers.
//
// Index:
//   QuantizeTest (TEST_P)   format x granularity x shape x input type, each over several data
//                           distributions (normal, log-uniform 2^-40..2^40, all zeros, data with
//                           Inf/NaN/denormals/outliers) and scale options (margin, power of two)
//   FixedScaleTest (TEST_P) tensor quantization with a caller-given scale (has_scale)
//   EdgeBlockTest (TEST_P)  blocks that are all NaN, all Inf, only denormals, FLT_MAX outliers
//   DequantizeTest (TEST_P) all 256 codes under every granularity
//   ScaleHelpersTest        ComputeScale, Mx32ScaleExponent, GetScaleGrid, names, Merge
//   QuantizeMiscTest        optional stats, buffer bounds, any OpenMP thread count, empty input
//   ValidationTest          null pointers, negative shapes, missing scale buffers, bad fixed
//                           scales
//
// Tolerances: none. Quantization is defined bit for bit (x * scale in FP32, then the NVIDIA
// rounding), scales are FP32 quotients, and dequantization is one FP32 product of exact values,
// so codes, scales, statistics and dequantized values are all compared exactly.
#include "kernels/quantize.h"

#include <omp.h>

#include <algorithm>
#include <bit>
#include <cfloat>
#include <cmath>
#include <cstdint>
#include <limits>
#include <random>
#include <string>
#include <tuple>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_format.h"
#include "gtest/gtest.h"
#include "kernels/formats.h"
#include "kernels/ops.h"
#include "tests/unit/nvidia_fp8_reference.h"

namespace fp8rt::kernels {
namespace {

using namespace test_reference;  // NVIDIA reference and bit helpers

// ---------------------------------------------------------------------------------------------
// The reference, from the spec.

// Format constants, from OFP8 v1.0 (not from GetFp8Info).
float Fp8Max(Fp8Format f) { return f == Fp8Format::kE4M3 ? 448.0f : 57344.0f; }
int Fp8Emax(Fp8Format f) { return f == Fp8Format::kE4M3 ? 8 : 15; }

// 2^k as a float for k in [-149, 127], built from bits.
float PowerOfTwo(int k) {
  if (k >= -126) return BitsFloat(static_cast<uint32_t>(k + 127) << 23);
  return BitsFloat(uint32_t{1} << (k + 149));
}

// The value of an FP8 code from its fields (sign, biased exponent, mantissa).
float RefDecode(uint8_t code, Fp8Format format) {
  const bool e4m3 = format == Fp8Format::kE4M3;
  const int mbits = e4m3 ? 3 : 2;
  const int bias = e4m3 ? 7 : 15;
  const int e = (code & 0x7F) >> mbits;
  const int m = code & ((1 << mbits) - 1);
  const float sign = (code & 0x80) ? -1.0f : 1.0f;
  if (e4m3 && (code & 0x7F) == 0x7F) return std::numeric_limits<float>::quiet_NaN();
  if (!e4m3 && e == 0x1F) {
    return m == 0 ? sign * std::numeric_limits<float>::infinity()
                  : std::numeric_limits<float>::quiet_NaN();
  }
  if (e == 0) return sign * static_cast<float>(m) * PowerOfTwo(1 - bias - mbits);
  return sign * static_cast<float>((1 << mbits) + m) * PowerOfTwo(e - bias - mbits);
}

bool RefIsSubnormalCode(uint8_t code, Fp8Format format) {
  const int mbits = format == Fp8Format::kE4M3 ? 3 : 2;
  const int e = (code & 0x7F) >> mbits;
  const int m = code & ((1 << mbits) - 1);
  return e == 0 && m != 0;
}

// scale = fp8_max / amax / 2^margin evaluated in FP32, left to right; FLT_MAX if that overflows,
// FLT_MIN if it underflows below the normal range; 1 for an amax of 0 (or not finite). With
// power_of_two, rounded down to a power of two (clear the mantissa of the normal result).
float RefScale(float amax, Fp8Format format, int margin, bool power_of_two) {
  if (!(amax > 0.0f) || !std::isfinite(amax)) return 1.0f;
  float s = Fp8Max(format) / amax;
  s = s / std::ldexp(1.0f, margin);
  if (std::isinf(s)) s = FLT_MAX;
  if (s < FLT_MIN) s = FLT_MIN;
  if (power_of_two) s = BitsFloat(FloatBits(s) & 0xFF800000u);
  return s;
}

// floor(log2(a)) for finite a > 0, exactly, from the bits (subnormals included).
int RefFloorLog2(float a) {
  const uint32_t b = FloatBits(a) & 0x7FFFFFFFu;
  const int e = static_cast<int>(b >> 23);
  if (e != 0) return e - 127;
  return -149 + (31 - std::countl_zero(b));
}

// OCP MX v1.0 section 6.3: shared exponent floor(log2(amax)) - emax_elem, clamped to the E8M0
// range [-127, 127]; an all-zero block gets the smallest scale.
int RefMxExponent(float amax_finite, Fp8Format format) {
  if (amax_finite == 0.0f) return -127;
  return std::clamp(RefFloorLog2(amax_finite) - Fp8Emax(format), -127, 127);
}

// How a granularity tiles the matrix (block_rows x block_cols), from quantize.h's definitions.
struct RefBlock {
  int64_t rows;
  int64_t cols;
};
RefBlock RefBlockShape(Granularity g, int64_t rows, int64_t cols) {
  switch (g) {
    case Granularity::kTensor:
      return {rows, cols};
    case Granularity::kRow:
      return {1, cols};
    case Granularity::kTile1x128:
      return {1, 128};
    case Granularity::kBlock128x128:
      return {128, 128};
    case Granularity::kMx32:
      return {1, 32};
  }
  return {0, 0};
}
int64_t CeilDiv(int64_t a, int64_t b) { return (a + b - 1) / b; }

struct RefStats {
  float amax = 0.0f;
  int64_t count = 0, underflow = 0, subnormal = 0, saturated = 0, nonfinite = 0;
};

struct ScaleOptions {
  bool has_scale = false;
  float scale = 1.0f;
  int margin = 0;
  bool power_of_two = false;
};

struct RefResult {
  int64_t grid_rows = 0, grid_cols = 0;
  std::vector<uint8_t> codes;
  std::vector<float> scale_inv;  // all granularities but mx32
  std::vector<uint8_t> e8m0;     // mx32
  std::vector<float> dequant;    // decode(code) * scale_inv, or * 2^exp for mx32
  RefStats stats;
};

RefResult RunReference(Fp8Format format, Granularity g, const std::vector<float>& x, int64_t rows,
                       int64_t cols, const ScaleOptions& opt) {
  RefResult r;
  const RefBlock blk = RefBlockShape(g, rows, cols);
  r.grid_rows = CeilDiv(rows, blk.rows);
  r.grid_cols = CeilDiv(cols, blk.cols);
  r.codes.resize(rows * cols);
  r.dequant.resize(rows * cols);
  for (int64_t bi = 0; bi < r.grid_rows; ++bi) {
    for (int64_t bj = 0; bj < r.grid_cols; ++bj) {
      const int64_t r0 = bi * blk.rows, r1 = std::min(rows, r0 + blk.rows);
      const int64_t c0 = bj * blk.cols, c1 = std::min(cols, c0 + blk.cols);
      float amax_finite = 0.0f;
      for (int64_t i = r0; i < r1; ++i) {
        for (int64_t j = c0; j < c1; ++j) {
          const float v = x[i * cols + j];
          if (std::isfinite(v)) amax_finite = std::max(amax_finite, std::fabs(v));
        }
      }
      float scale, descale;  // x is encoded from x * scale; decoded as decode(code) * descale
      if (g == Granularity::kMx32) {
        const int e = RefMxExponent(amax_finite, format);
        r.e8m0.push_back(static_cast<uint8_t>(e + 127));
        scale = PowerOfTwo(-e);
        descale = PowerOfTwo(e);
      } else {
        scale =
            opt.has_scale ? opt.scale : RefScale(amax_finite, format, opt.margin, opt.power_of_two);
        descale = 1.0f / scale;
        r.scale_inv.push_back(descale);
      }
      for (int64_t i = r0; i < r1; ++i) {
        for (int64_t j = c0; j < c1; ++j) {
          const float v = x[i * cols + j];
          const float y = v * scale;  // in FP32, as the spec says
          const uint8_t code = NvEncode(y, format);
          r.codes[i * cols + j] = code;
          r.dequant[i * cols + j] = RefDecode(code, format) * descale;
          if (!std::isfinite(v)) {
            ++r.stats.nonfinite;
          } else {
            if (v != 0.0f && (code & 0x7F) == 0) ++r.stats.underflow;
            if (NvRoundsPastMax(y, format)) ++r.stats.saturated;
          }
          if (RefIsSubnormalCode(code, format)) ++r.stats.subnormal;
        }
      }
    }
  }
  // amax: plain max |x|, NaN if any input is NaN.
  for (float v : x) {
    if (std::isnan(v)) {
      r.stats.amax = std::numeric_limits<float>::quiet_NaN();
      break;
    }
    r.stats.amax = std::max(r.stats.amax, std::fabs(v));
  }
  r.stats.count = rows * cols;
  return r;
}

// ---------------------------------------------------------------------------------------------
// Input data.

enum class Dist { kNormal, kLogUniform, kZeros, kSpecials };
const char* DistName(Dist d) {
  switch (d) {
    case Dist::kNormal:
      return "normal";
    case Dist::kLogUniform:
      return "log-uniform 2^-40..2^40";
    case Dist::kZeros:
      return "all zeros";
    case Dist::kSpecials:
      return "with Inf/NaN/denormals/outliers";
  }
  return "?";
}

std::vector<float> MakeData(Dist dist, int64_t n, uint32_t seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::uniform_real_distribution<float> unit(0.0f, 1.0f);
  std::vector<float> x(n);
  for (int64_t i = 0; i < n; ++i) {
    switch (dist) {
      case Dist::kNormal:
        x[i] = normal(rng) * 3.0f;
        break;
      case Dist::kLogUniform: {
        const float mag = std::exp2(unit(rng) * 80.0f - 40.0f);
        x[i] = (rng() & 1) ? -mag : mag;
        break;
      }
      case Dist::kZeros:
        x[i] = (rng() & 1) ? -0.0f : 0.0f;
        break;
      case Dist::kSpecials: {
        const uint32_t pick = rng() % 100;
        if (pick == 0) {
          x[i] = std::numeric_limits<float>::quiet_NaN();
        } else if (pick == 1) {
          x[i] = BitsFloat(0xFFC00123u);  // negative NaN with a payload
        } else if (pick == 2) {
          x[i] = (rng() & 1) ? std::numeric_limits<float>::infinity()
                             : -std::numeric_limits<float>::infinity();
        } else if (pick <= 5) {  // FP32 denormals
          x[i] = BitsFloat((rng() & 0x807FFFFFu) | 1u);
        } else if (pick == 6) {  // huge outliers, up to FLT_MAX
          x[i] = (rng() & 1) ? FLT_MAX : -std::exp2(unit(rng) * 100.0f + 27.0f);
        } else if (pick == 7) {
          x[i] = (rng() & 1) ? -0.0f : 0.0f;
        } else if (pick == 8) {  // tiny normals that underflow FP8
          x[i] = normal(rng) * 1e-12f;
        } else {
          x[i] = normal(rng);
        }
        break;
      }
    }
  }
  return x;
}

// The quantize input: FP32 values, or BF16 bits (truncated from the FP32 data; any BF16 pattern
// is a valid input) together with the FP32 values they stand for.
struct Input {
  std::vector<float> values;   // what the reference quantizes
  std::vector<float> f32;      // the buffer passed for kF32
  std::vector<uint16_t> bf16;  // the buffer passed for kBF16
  const void* ptr(InputType t) const {
    return t == InputType::kF32 ? static_cast<const void*>(f32.data())
                                : static_cast<const void*>(bf16.data());
  }
};

Input MakeInput(std::vector<float> data, InputType type) {
  Input in;
  if (type == InputType::kF32) {
    in.f32 = data;
    in.values = std::move(data);
    return in;
  }
  in.bf16.resize(data.size());
  in.values.resize(data.size());
  for (size_t i = 0; i < data.size(); ++i) {
    in.bf16[i] = static_cast<uint16_t>(FloatBits(data[i]) >> 16);
    in.values[i] = BitsFloat(static_cast<uint32_t>(in.bf16[i]) << 16);
  }
  return in;
}

// ---------------------------------------------------------------------------------------------
// Running the op and comparing.

struct OpOutput {
  absl::Status status;
  std::vector<uint8_t> codes;
  std::vector<float> scale_inv;
  std::vector<uint8_t> e8m0;
  QuantStats stats;
};

OpOutput RunQuantize(Fp8Format format, Granularity g, InputType type, const Input& in, int64_t rows,
                     int64_t cols, const ScaleOptions& opt, int64_t grid_size) {
  OpOutput out;
  out.codes.assign(rows * cols, 0xAB);
  out.scale_inv.assign(grid_size, -12345.0f);
  out.e8m0.assign(grid_size, 0xAB);
  QuantizeArgs a;
  a.format = format;
  a.granularity = g;
  a.input_type = type;
  a.input = in.ptr(type);
  a.rows = rows;
  a.cols = cols;
  a.has_scale = opt.has_scale;
  a.scale = opt.scale;
  a.margin = opt.margin;
  a.power_of_two_scales = opt.power_of_two;
  a.codes = out.codes.data();
  a.scale_inv = out.scale_inv.data();
  a.e8m0_scales = out.e8m0.data();
  a.stats = &out.stats;
  out.status = CpuOps().quantize(a, Stream{});
  return out;
}

bool SameFloat(float a, float b) {
  return (std::isnan(a) && std::isnan(b)) || FloatBits(a) == FloatBits(b);
}

// Compares everything the op produced with the reference; reports the first few mismatches.
void ExpectMatches(const RefResult& ref, const OpOutput& got, Granularity g,
                   const std::vector<float>& x, int64_t cols, const std::string& what) {
  SCOPED_TRACE(what);
  ASSERT_TRUE(got.status.ok()) << got.status;
  int reported = 0;
  int64_t bad_codes = 0;
  for (size_t k = 0; k < ref.codes.size(); ++k) {
    if (got.codes[k] == ref.codes[k]) continue;
    if (++bad_codes <= 5) {
      ADD_FAILURE() << absl::StrFormat(
          "code (%d, %d): input 0x%08x (%a) -> 0x%02x, reference 0x%02x",
          static_cast<int64_t>(k) / cols, static_cast<int64_t>(k) % cols, FloatBits(x[k]), x[k],
          got.codes[k], ref.codes[k]);
    }
  }
  EXPECT_EQ(bad_codes, 0) << "code mismatches out of " << ref.codes.size();
  if (g == Granularity::kMx32) {
    for (size_t k = 0; k < ref.e8m0.size(); ++k) {
      if (got.e8m0[k] != ref.e8m0[k] && ++reported <= 5) {
        ADD_FAILURE() << absl::StrFormat("e8m0 scale %d (block row %d col %d): 0x%02x, want 0x%02x",
                                         k, k / ref.grid_cols, k % ref.grid_cols, got.e8m0[k],
                                         ref.e8m0[k]);
      }
    }
  } else {
    for (size_t k = 0; k < ref.scale_inv.size(); ++k) {
      if (FloatBits(got.scale_inv[k]) != FloatBits(ref.scale_inv[k]) && ++reported <= 5) {
        ADD_FAILURE() << absl::StrFormat("scale_inv %d (block row %d col %d): %a, want %a", k,
                                         k / ref.grid_cols, k % ref.grid_cols, got.scale_inv[k],
                                         ref.scale_inv[k]);
      }
    }
  }
  EXPECT_EQ(reported, 0) << "scale mismatches";
  EXPECT_TRUE(SameFloat(got.stats.amax, ref.stats.amax))
      << absl::StrFormat("amax %a, want %a", got.stats.amax, ref.stats.amax);
  EXPECT_EQ(got.stats.count, ref.stats.count);
  EXPECT_EQ(got.stats.underflow, ref.stats.underflow);
  EXPECT_EQ(got.stats.subnormal, ref.stats.subnormal);
  EXPECT_EQ(got.stats.saturated, ref.stats.saturated);
  EXPECT_EQ(got.stats.nonfinite, ref.stats.nonfinite);
}

// Dequantizes the reference codes with the reference scales and compares with
// decode(code) * scale_inv (or * 2^exp) bit for bit; NaN codes must give NaN.
void ExpectDequantizeMatches(const RefResult& ref, Fp8Format format, Granularity g, int64_t rows,
                             int64_t cols, const std::string& what) {
  SCOPED_TRACE(what);
  std::vector<float> out(rows * cols, -777.0f);
  DequantizeArgs d;
  d.format = format;
  d.granularity = g;
  d.codes = ref.codes.data();
  d.rows = rows;
  d.cols = cols;
  d.scale_inv = g == Granularity::kMx32 ? nullptr : ref.scale_inv.data();
  d.e8m0_scales = g == Granularity::kMx32 ? ref.e8m0.data() : nullptr;
  d.output = out.data();
  const absl::Status s = CpuOps().dequantize(d, Stream{});
  ASSERT_TRUE(s.ok()) << s;
  int64_t bad = 0;
  for (size_t k = 0; k < out.size(); ++k) {
    if (SameFloat(out[k], ref.dequant[k])) continue;
    if (++bad <= 5) {
      ADD_FAILURE() << absl::StrFormat(
          "dequantize (%d, %d): code 0x%02x -> %a, want %a", static_cast<int64_t>(k) / cols,
          static_cast<int64_t>(k) % cols, ref.codes[k], out[k], ref.dequant[k]);
    }
  }
  EXPECT_EQ(bad, 0) << "dequantize mismatches out of " << out.size();
}

std::string CaseName(Fp8Format f, Granularity g, int64_t rows, int64_t cols, InputType t) {
  return absl::StrFormat("%s_%s_%dx%d_%s", Fp8FormatName(f), GranularityName(g), rows, cols,
                         t == InputType::kF32 ? "f32" : "bf16");
}

void CheckOneCase(Fp8Format format, Granularity g, InputType type, int64_t rows, int64_t cols,
                  Dist dist, const ScaleOptions& opt, uint32_t seed) {
  const Input in = MakeInput(MakeData(dist, rows * cols, seed), type);
  const RefResult ref = RunReference(format, g, in.values, rows, cols, opt);
  const int64_t grid = ref.grid_rows * ref.grid_cols;
  const OpOutput got = RunQuantize(format, g, type, in, rows, cols, opt, grid);
  const std::string what =
      absl::StrFormat("%s, data %s, has_scale %d scale %a margin %d power_of_two %d",
                      CaseName(format, g, rows, cols, type), DistName(dist), opt.has_scale,
                      opt.scale, opt.margin, opt.power_of_two);
  ExpectMatches(ref, got, g, in.values, cols, what);
  ExpectDequantizeMatches(ref, format, g, rows, cols, what);
}

// ---------------------------------------------------------------------------------------------
// The main parameterised test.

constexpr Fp8Format kFormats[] = {Fp8Format::kE4M3, Fp8Format::kE5M2};
constexpr Granularity kGranularities[] = {Granularity::kTensor, Granularity::kRow,
                                          Granularity::kTile1x128, Granularity::kBlock128x128,
                                          Granularity::kMx32};
constexpr InputType kInputTypes[] = {InputType::kF32, InputType::kBF16};

struct Shape {
  int64_t rows;
  int64_t cols;
};
// Small, odd-tailed (not multiples of 32 / 128, partial edge blocks in both directions), and
// large enough for the multi-threaded and SIMD paths (256x256, 300x1031).
constexpr Shape kShapes[] = {{1, 1},     {1, 200},  {3, 129},   {130, 257},
                             {256, 256}, {1, 4099}, {300, 1031}};

using QuantizeParam = std::tuple<Fp8Format, Granularity, Shape, InputType>;

class QuantizeTest : public ::testing::TestWithParam<QuantizeParam> {};

TEST_P(QuantizeTest, MatchesReference) {
  FP8RT_REQUIRE_CUDA_FP8_H();
  const auto [format, g, shape, type] = GetParam();
  std::vector<ScaleOptions> options = {{}, {.power_of_two = true}};
  if (g != Granularity::kMx32) {  // margin applies to computed (non-MX) scales
    options.push_back({.margin = 2});
    options.push_back({.margin = 1, .power_of_two = true});
  }
  uint32_t seed = 1;
  for (Dist dist : {Dist::kNormal, Dist::kLogUniform, Dist::kZeros, Dist::kSpecials}) {
    for (const ScaleOptions& opt : options) {
      // All-zero blocks get scale 1 whatever the options; once is enough.
      if (dist == Dist::kZeros && &opt != &options[0]) continue;
      CheckOneCase(format, g, type, shape.rows, shape.cols, dist, opt,
                   seed++ * 7919u + static_cast<uint32_t>(shape.rows * 31 + shape.cols));
      if (HasFatalFailure()) return;
    }
  }
}

INSTANTIATE_TEST_SUITE_P(All, QuantizeTest,
                         ::testing::Combine(::testing::ValuesIn(kFormats),
                                            ::testing::ValuesIn(kGranularities),
                                            ::testing::ValuesIn(kShapes),
                                            ::testing::ValuesIn(kInputTypes)),
                         [](const ::testing::TestParamInfo<QuantizeParam>& info) {
                           const Shape s = std::get<2>(info.param);
                           return CaseName(std::get<0>(info.param), std::get<1>(info.param), s.rows,
                                           s.cols, std::get<3>(info.param));
                         });

// ---------------------------------------------------------------------------------------------
// A caller-given tensor scale (delayed scaling): one pass with that scale, no amax of its own.

using FixedScaleParam = std::tuple<Fp8Format, InputType>;
class FixedScaleTest : public ::testing::TestWithParam<FixedScaleParam> {};

TEST_P(FixedScaleTest, UsesTheGivenScale) {
  FP8RT_REQUIRE_CUDA_FP8_H();
  const auto [format, type] = GetParam();
  // Scales that fit, that saturate many values, that underflow many, and non-powers of two.
  for (float scale : {1.0f, 0.37f, 1024.0f, 3.0e4f, 0x1p-20f, 0x1p40f, 1.0f / 3.0f}) {
    for (Dist dist : {Dist::kNormal, Dist::kLogUniform, Dist::kSpecials}) {
      for (Shape s : {Shape{1, 1}, Shape{5, 77}, Shape{200, 333}}) {
        CheckOneCase(format, Granularity::kTensor, type, s.rows, s.cols, dist,
                     {.has_scale = true, .scale = scale}, static_cast<uint32_t>(s.cols) + 17u);
        if (HasFatalFailure()) return;
      }
    }
  }
}

INSTANTIATE_TEST_SUITE_P(All, FixedScaleTest,
                         ::testing::Combine(::testing::ValuesIn(kFormats),
                                            ::testing::ValuesIn(kInputTypes)),
                         [](const ::testing::TestParamInfo<FixedScaleParam>& info) {
                           return absl::StrFormat(
                               "%s_%s", Fp8FormatName(std::get<0>(info.param)),
                               std::get<1>(info.param) == InputType::kF32 ? "f32" : "bf16");
                         });

// A tensor scale from an amax the caller keeps in the backend's memory (QuantizeArgs::scale_amax:
// current scaling with the amax max-reduced over TP): scale = fp8_max / amax (OFP8 maxima 448 and
// 57344, margin 0), and 1 for an amax that is zero, negative, infinite or NaN. The codes are those
// of the same tensor quantized with that scale given (FixedScaleTest checks those against the
// reference), the statistics the tensor's own.
TEST(ScaleAmaxTest, ScalesFromTheGivenAmax) {
  std::vector<float> x(300);
  for (size_t i = 0; i < x.size(); ++i) x[i] = std::sin(0.7f * static_cast<float>(i)) * 3.0f;
  for (Fp8Format format : kFormats) {
    const float fp8_max = format == Fp8Format::kE4M3 ? 448.0f : 57344.0f;
    for (float amax :
         {3.0f, 1000.0f, 0.015625f, 0.0f, -2.0f, std::numeric_limits<float>::infinity(),
          std::numeric_limits<float>::quiet_NaN()}) {
      const float want = amax > 0.0f && std::isfinite(amax) ? fp8_max / amax : 1.0f;
      std::vector<uint8_t> codes(x.size()), want_codes(x.size());
      float scale_inv = 0.0f, want_scale_inv = 0.0f;
      QuantStats stats, want_stats;
      QuantizeArgs a;
      a.format = format;
      a.input = x.data();
      a.rows = 3;
      a.cols = 100;
      a.codes = codes.data();
      a.scale_inv = &scale_inv;
      a.stats = &stats;
      a.scale_amax = &amax;
      ASSERT_TRUE(CpuOps().quantize(a, Stream{}).ok());
      QuantizeArgs b = a;
      b.scale_amax = nullptr;
      b.has_scale = true;
      b.scale = want;
      b.codes = want_codes.data();
      b.scale_inv = &want_scale_inv;
      b.stats = &want_stats;
      ASSERT_TRUE(CpuOps().quantize(b, Stream{}).ok());
      EXPECT_EQ(codes, want_codes) << Fp8FormatName(format) << " amax " << amax;
      EXPECT_EQ(scale_inv, 1.0f / want) << Fp8FormatName(format) << " amax " << amax;
      EXPECT_EQ(stats.amax, want_stats.amax);
      EXPECT_EQ(stats.saturated, want_stats.saturated);
    }
  }
}

// ---------------------------------------------------------------------------------------------
// Blocks that stress the scale computation: every block of one row is a different case.

using EdgeParam = std::tuple<Fp8Format, Granularity, InputType>;
class EdgeBlockTest : public ::testing::TestWithParam<EdgeParam> {};

TEST_P(EdgeBlockTest, SpecialBlocks) {
  FP8RT_REQUIRE_CUDA_FP8_H();
  const auto [format, g, type] = GetParam();
  // Each row is one kind of block content, 300 columns (several 32- and 128-wide blocks plus a
  // partial one); row granularity and tiles then see each kind on its own.
  auto fill = [](int kind, int j) -> float {
    switch (kind) {
      case 0:
        return std::numeric_limits<float>::quiet_NaN();  // all NaN: finite amax 0 -> scale 1
      case 1:
        return (j & 1) ? std::numeric_limits<float>::infinity()
                       : -std::numeric_limits<float>::infinity();  // all Inf
      case 2:
        return BitsFloat(0x00000001u + static_cast<uint32_t>(j) * 977u);  // FP32 denormals
      case 3:
        return j == 5 ? FLT_MAX : static_cast<float>(j) * 0.25f;  // one FLT_MAX outlier
      case 4:
        return j % 3 == 0 ? std::numeric_limits<float>::infinity()
                          : static_cast<float>(j - 150) * 1e-3f;  // Inf mixed with data
      case 5:
        return j == 7 ? std::numeric_limits<float>::quiet_NaN()
                      : static_cast<float>(j) * 3.0f;  // NaN mixed with data
      case 6:
        return j % 2 ? 0.0f : -0.0f;  // signed zeros
      case 7:
        return static_cast<float>(j % 5) * 1e-30f;  // tiny normals only
      case 8:
        return j % 17 == 0 ? 1e30f : 1e-3f;  // huge outliers over small values
      default:
        return 1.0f;
    }
  };
  constexpr int kKinds = 9;
  constexpr int64_t kCols = 300;
  std::vector<float> data(kKinds * kCols);
  for (int k = 0; k < kKinds; ++k) {
    for (int64_t j = 0; j < kCols; ++j) data[k * kCols + j] = fill(k, static_cast<int>(j));
  }
  const Input in = MakeInput(data, type);
  // Each kind alone (so tensor and 128x128 granularities see it as a whole block too), then all
  // kinds together.
  for (int k = 0; k <= kKinds; ++k) {
    const int64_t rows = k == kKinds ? kKinds : 1;
    Input part;
    const int64_t first = k == kKinds ? 0 : k * kCols;
    part.values.assign(in.values.begin() + first, in.values.begin() + first + rows * kCols);
    if (type == InputType::kF32) {
      part.f32 = part.values;
    } else {
      part.bf16.assign(in.bf16.begin() + first, in.bf16.begin() + first + rows * kCols);
    }
    for (bool pow2 : {false, true}) {
      const ScaleOptions opt{.power_of_two = pow2};
      const RefResult ref = RunReference(format, g, part.values, rows, kCols, opt);
      const OpOutput got =
          RunQuantize(format, g, type, part, rows, kCols, opt, ref.grid_rows * ref.grid_cols);
      const std::string what = absl::StrFormat("%s, block kind %d (9 = all kinds), power_of_two %d",
                                               CaseName(format, g, rows, kCols, type), k, pow2);
      ExpectMatches(ref, got, g, part.values, kCols, what);
      ExpectDequantizeMatches(ref, format, g, rows, kCols, what);
      if (HasFatalFailure()) return;
    }
  }
}

TEST_P(EdgeBlockTest, SpecValuesOfSpecialBlocks) {
  // Spot values from the spec, independent of the NVIDIA reference: an all-NaN block has scale 1
  // (or E8M0 2^-127) and NaN codes; an all-Inf block saturates; a denormal-only block gets
  // scale FLT_MAX (fp8_max / amax overflows).
  const auto [format, g, type] = GetParam();
  const int64_t cols = 64;
  for (int kind = 0; kind < 3; ++kind) {
    std::vector<float> data(cols);
    for (int64_t j = 0; j < cols; ++j) {
      data[j] = kind == 0   ? std::numeric_limits<float>::quiet_NaN()
                : kind == 1 ? std::numeric_limits<float>::infinity()
                            : BitsFloat(0x00001000u);
    }
    const Input in = MakeInput(data, type);
    const int64_t grid = g == Granularity::kMx32 ? 2 : 1;  // 64 columns
    const OpOutput got = RunQuantize(format, g, type, in, 1, cols, {}, grid);
    ASSERT_TRUE(got.status.ok()) << got.status;
    SCOPED_TRACE(absl::StrFormat("%s kind %d", CaseName(format, g, 1, cols, type), kind));
    const uint8_t max_code = format == Fp8Format::kE4M3 ? 0x7E : 0x7B;
    for (int64_t j = 0; j < cols; ++j) {
      if (kind == 0) {
        EXPECT_EQ(got.codes[j], 0x7F) << j;
      }
      if (kind == 1) {
        EXPECT_EQ(got.codes[j], max_code) << j;
      }
    }
    EXPECT_EQ(got.stats.nonfinite, kind < 2 ? cols : 0);
    EXPECT_EQ(got.stats.saturated, 0);  // non-finite inputs are not counted as saturated
    EXPECT_EQ(got.stats.count, cols);
    if (kind == 0) {
      EXPECT_TRUE(std::isnan(got.stats.amax));
    }
    if (kind == 1) {
      EXPECT_EQ(got.stats.amax, std::numeric_limits<float>::infinity());
    }
    if (g == Granularity::kMx32) {
      for (int64_t b = 0; b < grid; ++b) {
        if (kind < 2) {
          EXPECT_EQ(got.e8m0[b], 0x00) << "finite amax 0 -> exponent -127";
        }
      }
    } else {
      if (kind < 2) {
        EXPECT_EQ(got.scale_inv[0], 1.0f);
      }
      // amax 2^-137: fp8_max / amax overflows FP32, so the scale is FLT_MAX (or 2^127).
      if (kind == 2 && type == InputType::kF32) {
        EXPECT_EQ(got.scale_inv[0], 1.0f / FLT_MAX);
      }
    }
  }
}

INSTANTIATE_TEST_SUITE_P(All, EdgeBlockTest,
                         ::testing::Combine(::testing::ValuesIn(kFormats),
                                            ::testing::ValuesIn(kGranularities),
                                            ::testing::ValuesIn(kInputTypes)),
                         [](const ::testing::TestParamInfo<EdgeParam>& info) {
                           return absl::StrFormat(
                               "%s_%s_%s", Fp8FormatName(std::get<0>(info.param)),
                               GranularityName(std::get<1>(info.param)),
                               std::get<2>(info.param) == InputType::kF32 ? "f32" : "bf16");
                         });

// ---------------------------------------------------------------------------------------------
// Dequantize on its own: every code, with scales that are powers of two, arbitrary, tiny, huge.

using DequantParam = std::tuple<Fp8Format, Granularity>;
class DequantizeTest : public ::testing::TestWithParam<DequantParam> {};

TEST_P(DequantizeTest, AllCodesTimesScale) {
  const auto [format, g] = GetParam();
  const int64_t rows = 131, cols = 300;  // partial blocks in both directions
  const RefBlock blk = RefBlockShape(g, rows, cols);
  const int64_t grid_rows = CeilDiv(rows, blk.rows), grid_cols = CeilDiv(cols, blk.cols);
  std::mt19937 rng(99);
  std::vector<uint8_t> codes(rows * cols);
  for (size_t k = 0; k < codes.size(); ++k) codes[k] = static_cast<uint8_t>(k * 7 + (k >> 8));
  std::vector<float> scale_inv(grid_rows * grid_cols);
  std::vector<uint8_t> e8m0(grid_rows * grid_cols);
  const float picks[] = {1.0f,     0.5f,  1.0f / 3.0f, 1.0f / FLT_MAX,
                         3.0e-39f, 1e30f, 0x1p-100f,   7.25f};
  for (size_t k = 0; k < scale_inv.size(); ++k) {
    scale_inv[k] = picks[rng() % 8] * (1.0f + static_cast<float>(rng() % 1000) / 1000.0f);
    // Every E8M0 code but NaN for a third of the blocks, exponents within +-10 for the rest.
    const uint32_t code = k % 3 == 0 ? rng() % 255 : 117 + rng() % 21;
    e8m0[k] = static_cast<uint8_t>(code);
  }
  std::vector<float> out(rows * cols, -777.0f);
  DequantizeArgs d;
  d.format = format;
  d.granularity = g;
  d.codes = codes.data();
  d.rows = rows;
  d.cols = cols;
  d.scale_inv = g == Granularity::kMx32 ? nullptr : scale_inv.data();
  d.e8m0_scales = g == Granularity::kMx32 ? e8m0.data() : nullptr;
  d.output = out.data();
  ASSERT_TRUE(CpuOps().dequantize(d, Stream{}).ok());
  int64_t bad = 0;
  for (int64_t i = 0; i < rows; ++i) {
    for (int64_t j = 0; j < cols; ++j) {
      const int64_t b = (i / blk.rows) * grid_cols + j / blk.cols;
      const float s =
          g == Granularity::kMx32 ? PowerOfTwo(static_cast<int>(e8m0[b]) - 127) : scale_inv[b];
      const float want = RefDecode(codes[i * cols + j], format) * s;
      if (!SameFloat(out[i * cols + j], want) && ++bad <= 5) {
        ADD_FAILURE() << absl::StrFormat("(%d, %d) code 0x%02x scale %a: %a, want %a", i, j,
                                         codes[i * cols + j], s, out[i * cols + j], want);
      }
    }
  }
  EXPECT_EQ(bad, 0);
}

INSTANTIATE_TEST_SUITE_P(All, DequantizeTest,
                         ::testing::Combine(::testing::ValuesIn(kFormats),
                                            ::testing::ValuesIn(kGranularities)),
                         [](const ::testing::TestParamInfo<DequantParam>& info) {
                           return absl::StrFormat("%s_%s", Fp8FormatName(std::get<0>(info.param)),
                                                  GranularityName(std::get<1>(info.param)));
                         });

// ---------------------------------------------------------------------------------------------
// The public helpers, against the same spec formulas.

std::vector<float> InterestingAmaxes() {
  std::vector<float> v = {0.0f,
                          1.0f,
                          448.0f,
                          57344.0f,
                          0.1f,
                          3.0f,
                          1e-3f,
                          1e30f,
                          FLT_MAX,
                          FLT_MIN,
                          1e-40f,
                          BitsFloat(1),
                          1e-36f,
                          1.2e-36f,
                          1.3e-36f,
                          2e-36f,
                          6e-35f,
                          0x1p-119f,
                          0x1p-120f,
                          0x1p-126f,
                          std::numeric_limits<float>::infinity(),
                          std::numeric_limits<float>::quiet_NaN()};
  for (int e = -149; e <= 127; ++e) v.push_back(std::ldexp(1.0f, e));
  std::mt19937 rng(5);
  for (int i = 0; i < 2000; ++i) v.push_back(BitsFloat(rng() & 0x7F7FFFFFu));
  return v;
}

TEST(ScaleHelpersTest, ComputeScaleMatchesSpec) {
  for (Fp8Format f : kFormats) {
    for (int margin : {0, 1, 2, 5}) {
      for (bool pow2 : {false, true}) {
        for (float amax : InterestingAmaxes()) {
          const float got = ComputeScale(amax, f, margin, pow2);
          const float want = RefScale(amax, f, margin, pow2);
          ASSERT_EQ(FloatBits(got), FloatBits(want))
              << absl::StrFormat("ComputeScale(%a, %s, margin %d, pow2 %d) = %a, want %a", amax,
                                 Fp8FormatName(f), margin, pow2, got, want);
          ASSERT_TRUE(std::isfinite(got) && got > 0.0f);
        }
      }
    }
  }
}

TEST(ScaleHelpersTest, ComputeScaleSpotValues) {
  EXPECT_EQ(ComputeScale(448.0f, Fp8Format::kE4M3, 0, false), 1.0f);
  EXPECT_EQ(ComputeScale(1.0f, Fp8Format::kE4M3, 0, false), 448.0f);
  EXPECT_EQ(ComputeScale(1.0f, Fp8Format::kE4M3, 0, true), 256.0f);
  EXPECT_EQ(ComputeScale(1.0f, Fp8Format::kE4M3, 2, false), 112.0f);
  EXPECT_EQ(ComputeScale(2.0f, Fp8Format::kE5M2, 0, false), 28672.0f);
  EXPECT_EQ(ComputeScale(2.0f, Fp8Format::kE5M2, 0, true), 16384.0f);
  EXPECT_EQ(ComputeScale(0.0f, Fp8Format::kE4M3, 0, false), 1.0f);
  EXPECT_EQ(ComputeScale(std::numeric_limits<float>::infinity(), Fp8Format::kE4M3, 0, false), 1.0f);
  EXPECT_EQ(ComputeScale(std::numeric_limits<float>::quiet_NaN(), Fp8Format::kE5M2, 0, false),
            1.0f);
  EXPECT_EQ(ComputeScale(1e-40f, Fp8Format::kE4M3, 0, false), FLT_MAX);
  EXPECT_EQ(ComputeScale(1e-40f, Fp8Format::kE4M3, 0, true), 0x1p127f);
}

TEST(ScaleHelpersTest, Mx32ScaleExponentMatchesSpec) {
  for (Fp8Format f : kFormats) {
    for (float amax : InterestingAmaxes()) {
      if (!std::isfinite(amax)) continue;  // the function takes a finite amax
      EXPECT_EQ(Mx32ScaleExponent(amax, f), RefMxExponent(amax, f))
          << absl::StrFormat("amax %a, %s", amax, Fp8FormatName(f));
    }
  }
  EXPECT_EQ(Mx32ScaleExponent(0.0f, Fp8Format::kE4M3), -127);
  EXPECT_EQ(Mx32ScaleExponent(448.0f, Fp8Format::kE4M3), 0);
  EXPECT_EQ(Mx32ScaleExponent(512.0f, Fp8Format::kE4M3), 1);
  EXPECT_EQ(Mx32ScaleExponent(511.0f, Fp8Format::kE4M3), 0);
  EXPECT_EQ(Mx32ScaleExponent(1.0f, Fp8Format::kE5M2), -15);
  EXPECT_EQ(Mx32ScaleExponent(FLT_MAX, Fp8Format::kE4M3), 119);
  EXPECT_EQ(Mx32ScaleExponent(BitsFloat(1), Fp8Format::kE4M3), -127);  // clamped
}

TEST(ScaleHelpersTest, ScaleGrid) {
  for (Granularity g : kGranularities) {
    for (Shape s : kShapes) {
      const ScaleGrid grid = GetScaleGrid(g, s.rows, s.cols);
      const RefBlock blk = RefBlockShape(g, s.rows, s.cols);
      SCOPED_TRACE(absl::StrFormat("%s %dx%d", GranularityName(g), s.rows, s.cols));
      EXPECT_EQ(grid.rows, CeilDiv(s.rows, blk.rows));
      EXPECT_EQ(grid.cols, CeilDiv(s.cols, blk.cols));
      EXPECT_EQ(grid.size(), grid.rows * grid.cols);
      if (g == Granularity::kTensor || g == Granularity::kRow) {
        // Any block that covers the matrix (or row) describes the same tiling.
        EXPECT_GE(grid.block_cols, s.cols);
        EXPECT_GE(grid.block_rows, g == Granularity::kRow ? 1 : s.rows);
        if (g == Granularity::kRow) {
          EXPECT_EQ(grid.block_rows, 1);
        }
      } else {
        EXPECT_EQ(grid.block_rows, blk.rows);
        EXPECT_EQ(grid.block_cols, blk.cols);
      }
    }
  }
}

TEST(ScaleHelpersTest, GranularityNames) {
  const std::pair<Granularity, const char*> names[] = {{Granularity::kTensor, "tensor"},
                                                       {Granularity::kRow, "row"},
                                                       {Granularity::kTile1x128, "1x128"},
                                                       {Granularity::kBlock128x128, "128x128"},
                                                       {Granularity::kMx32, "mx32"}};
  for (const auto& [g, name] : names) {
    EXPECT_EQ(GranularityName(g), name);
    absl::StatusOr<Granularity> parsed = ParseGranularity(name);
    ASSERT_TRUE(parsed.ok()) << parsed.status();
    EXPECT_EQ(*parsed, g);
  }
  for (const char* bad : {"", "tile", "1x64", "mx16", "128", "block"}) {
    EXPECT_TRUE(absl::IsInvalidArgument(ParseGranularity(bad).status())) << bad;
  }
}

TEST(ScaleHelpersTest, StatsMerge) {
  QuantStats a{
      .amax = 3.0f, .count = 10, .underflow = 1, .subnormal = 2, .saturated = 3, .nonfinite = 4};
  const QuantStats b{.amax = 5.0f,
                     .count = 20,
                     .underflow = 10,
                     .subnormal = 20,
                     .saturated = 30,
                     .nonfinite = 40};
  a.Merge(b);
  EXPECT_EQ(a.amax, 5.0f);
  EXPECT_EQ(a.count, 30);
  EXPECT_EQ(a.underflow, 11);
  EXPECT_EQ(a.subnormal, 22);
  EXPECT_EQ(a.saturated, 33);
  EXPECT_EQ(a.nonfinite, 44);
  QuantStats nan_part{.amax = std::numeric_limits<float>::quiet_NaN(), .count = 1};
  QuantStats c = a;
  c.Merge(nan_part);  // NaN wins from either side
  EXPECT_TRUE(std::isnan(c.amax));
  nan_part.Merge(a);
  EXPECT_TRUE(std::isnan(nan_part.amax));
  QuantStats inf_part{.amax = std::numeric_limits<float>::infinity()};
  a.Merge(inf_part);
  EXPECT_EQ(a.amax, std::numeric_limits<float>::infinity());
}

TEST(QuantizeMiscTest, StatsAreOptional) {
  FP8RT_REQUIRE_CUDA_FP8_H();
  const Input in = MakeInput(MakeData(Dist::kSpecials, 3 * 200, 3), InputType::kF32);
  const RefResult ref =
      RunReference(Fp8Format::kE4M3, Granularity::kTile1x128, in.values, 3, 200, {});
  std::vector<uint8_t> codes(600);
  std::vector<float> scale_inv(6);
  QuantizeArgs a;
  a.granularity = Granularity::kTile1x128;
  a.input = in.f32.data();
  a.rows = 3;
  a.cols = 200;
  a.codes = codes.data();
  a.scale_inv = scale_inv.data();
  ASSERT_TRUE(CpuOps().quantize(a, Stream{}).ok());
  EXPECT_EQ(codes, ref.codes);
  EXPECT_EQ(scale_inv, ref.scale_inv);
}

TEST(QuantizeMiscTest, DoesNotWritePastTheBuffers) {
  // Guard bytes after codes and scales stay untouched (caller-provided buffers, exact sizes).
  for (Granularity g : kGranularities) {
    const int64_t rows = 129, cols = 257;
    const Input in = MakeInput(MakeData(Dist::kNormal, rows * cols, 11), InputType::kF32);
    const ScaleGrid grid = GetScaleGrid(g, rows, cols);
    std::vector<uint8_t> codes(rows * cols + 64, 0xCD);
    std::vector<float> scale_inv(grid.size() + 16, -1.0f);
    std::vector<uint8_t> e8m0(grid.size() + 16, 0xCD);
    QuantizeArgs a;
    a.granularity = g;
    a.input = in.f32.data();
    a.rows = rows;
    a.cols = cols;
    a.codes = codes.data();
    a.scale_inv = scale_inv.data();
    a.e8m0_scales = e8m0.data();
    ASSERT_TRUE(CpuOps().quantize(a, Stream{}).ok()) << GranularityName(g);
    for (int k = 0; k < 64; ++k) EXPECT_EQ(codes[rows * cols + k], 0xCD) << GranularityName(g);
    for (int k = 0; k < 16; ++k) {
      EXPECT_EQ(scale_inv[grid.size() + k], -1.0f) << GranularityName(g);
      EXPECT_EQ(e8m0[grid.size() + k], 0xCD) << GranularityName(g);
    }
  }
}

TEST(QuantizeMiscTest, SameResultsForAnyThreadCount) {
  // The CPU ops run on the calling thread's OpenMP team (kernels/ops.h); how the work is split
  // must not change a bit of the result.
  FP8RT_REQUIRE_CUDA_FP8_H();
  const int64_t rows = 300, cols = 1031;
  const Input in = MakeInput(MakeData(Dist::kSpecials, rows * cols, 77), InputType::kF32);
  const int saved = omp_get_max_threads();
  for (Granularity g : kGranularities) {
    const RefResult ref = RunReference(Fp8Format::kE4M3, g, in.values, rows, cols, {});
    for (int threads : {1, 2, 3, 8}) {
      omp_set_num_threads(threads);
      const OpOutput got = RunQuantize(Fp8Format::kE4M3, g, InputType::kF32, in, rows, cols, {},
                                       ref.grid_rows * ref.grid_cols);
      ExpectMatches(ref, got, g, in.values, cols,
                    absl::StrFormat("%s with %d OpenMP threads", GranularityName(g), threads));
      ExpectDequantizeMatches(
          ref, Fp8Format::kE4M3, g, rows, cols,
          absl::StrFormat("%s with %d OpenMP threads", GranularityName(g), threads));
    }
  }
  omp_set_num_threads(saved);
}

TEST(QuantizeMiscTest, EmptyMatrix) {
  // A 0 x n or n x 0 matrix is valid: nothing to quantize, nothing counted.
  for (Granularity g : kGranularities) {
    for (Shape s : {Shape{0, 0}, Shape{0, 5}, Shape{7, 0}}) {
      std::vector<float> input(1, 1.0f);
      std::vector<uint8_t> codes(1), e8m0(8);
      std::vector<float> scale_inv(8, 1.0f);
      QuantStats stats{.amax = 5.0f, .count = 9};
      QuantizeArgs a;
      a.granularity = g;
      a.input = input.data();
      a.rows = s.rows;
      a.cols = s.cols;
      a.codes = codes.data();
      a.scale_inv = scale_inv.data();
      a.e8m0_scales = e8m0.data();
      a.stats = &stats;
      const absl::Status st = CpuOps().quantize(a, Stream{});
      ASSERT_TRUE(st.ok()) << GranularityName(g) << " " << s.rows << "x" << s.cols << ": " << st;
      EXPECT_EQ(stats.count, 0);
      EXPECT_EQ(stats.amax, 0.0f);
      EXPECT_EQ(stats.underflow + stats.subnormal + stats.saturated + stats.nonfinite, 0);
      std::vector<float> out(1, -1.0f);
      DequantizeArgs d;
      d.granularity = g;
      d.codes = codes.data();
      d.rows = s.rows;
      d.cols = s.cols;
      d.scale_inv = scale_inv.data();
      d.e8m0_scales = e8m0.data();
      d.output = out.data();
      EXPECT_TRUE(CpuOps().dequantize(d, Stream{}).ok()) << GranularityName(g);
      EXPECT_EQ(out[0], -1.0f);
    }
  }
}

// ---------------------------------------------------------------------------------------------
// Validation: bad arguments are InvalidArgument from both the op and the Validate functions.

class ValidationTest : public ::testing::Test {
 protected:
  QuantizeArgs Good(Granularity g) {
    QuantizeArgs a;
    a.granularity = g;
    a.input = input_.data();
    a.rows = 4;
    a.cols = 64;
    a.codes = codes_.data();
    a.scale_inv = scale_inv_.data();
    a.e8m0_scales = e8m0_.data();
    a.stats = &stats_;
    return a;
  }
  DequantizeArgs GoodDequant(Granularity g) {
    DequantizeArgs d;
    d.granularity = g;
    d.codes = codes_.data();
    d.rows = 4;
    d.cols = 64;
    d.scale_inv = scale_inv_.data();
    d.e8m0_scales = e8m0_.data();
    d.output = output_.data();
    return d;
  }
  void ExpectInvalid(const QuantizeArgs& a, const std::string& what) {
    EXPECT_TRUE(absl::IsInvalidArgument(ValidateQuantizeArgs(a))) << what;
    const absl::Status s = CpuOps().quantize(a, Stream{});
    EXPECT_TRUE(absl::IsInvalidArgument(s)) << what << ": " << s;
  }
  void ExpectInvalid(const DequantizeArgs& d, const std::string& what) {
    EXPECT_TRUE(absl::IsInvalidArgument(ValidateDequantizeArgs(d))) << what;
    const absl::Status s = CpuOps().dequantize(d, Stream{});
    EXPECT_TRUE(absl::IsInvalidArgument(s)) << what << ": " << s;
  }

  std::vector<float> input_ = std::vector<float>(256, 1.0f);
  std::vector<uint8_t> codes_ = std::vector<uint8_t>(256);
  std::vector<float> scale_inv_ = std::vector<float>(256, 1.0f);
  std::vector<uint8_t> e8m0_ = std::vector<uint8_t>(256, 127);
  std::vector<float> output_ = std::vector<float>(256);
  QuantStats stats_;
};

TEST_F(ValidationTest, GoodArgumentsPass) {
  for (Granularity g : kGranularities) {
    EXPECT_TRUE(ValidateQuantizeArgs(Good(g)).ok()) << GranularityName(g);
    EXPECT_TRUE(CpuOps().quantize(Good(g), Stream{}).ok()) << GranularityName(g);
    EXPECT_TRUE(ValidateDequantizeArgs(GoodDequant(g)).ok()) << GranularityName(g);
    EXPECT_TRUE(CpuOps().dequantize(GoodDequant(g), Stream{}).ok()) << GranularityName(g);
    // Only the scale buffer of the granularity is needed.
    QuantizeArgs a = Good(g);
    DequantizeArgs d = GoodDequant(g);
    if (g == Granularity::kMx32) {
      a.scale_inv = nullptr;
      d.scale_inv = nullptr;
    } else {
      a.e8m0_scales = nullptr;
      d.e8m0_scales = nullptr;
    }
    a.stats = nullptr;  // optional
    EXPECT_TRUE(CpuOps().quantize(a, Stream{}).ok()) << GranularityName(g);
    EXPECT_TRUE(CpuOps().dequantize(d, Stream{}).ok()) << GranularityName(g);
  }
}

TEST_F(ValidationTest, QuantizeErrors) {
  for (Granularity g : kGranularities) {
    const std::string n(GranularityName(g));
    QuantizeArgs a = Good(g);
    a.input = nullptr;
    ExpectInvalid(a, n + " null input");
    a = Good(g);
    a.codes = nullptr;
    ExpectInvalid(a, n + " null codes");
    a = Good(g);
    a.rows = -1;
    ExpectInvalid(a, n + " negative rows");
    a = Good(g);
    a.cols = -5;
    ExpectInvalid(a, n + " negative cols");
    a = Good(g);
    if (g == Granularity::kMx32) {
      a.e8m0_scales = nullptr;
      ExpectInvalid(a, n + " null e8m0_scales");
    } else {
      a.scale_inv = nullptr;
      ExpectInvalid(a, n + " null scale_inv");
    }
    // A caller-given scale is for tensor granularity only (quantize.h).
    if (g != Granularity::kTensor) {
      a = Good(g);
      a.has_scale = true;
      a.scale = 2.0f;
      ExpectInvalid(a, n + " has_scale with a block granularity");
    }
  }
  // A scale from a given amax (QuantizeArgs::scale_amax) is for tensor granularity without a
  // fixed scale.
  const float amax = 2.0f;
  for (Granularity g : kGranularities) {
    QuantizeArgs a = Good(g);
    a.scale_amax = &amax;
    if (g == Granularity::kTensor) {
      EXPECT_TRUE(CpuOps().quantize(a, Stream{}).ok());
      a.has_scale = true;
    }
    ExpectInvalid(a, std::string(GranularityName(g)) + " scale_amax");
    EXPECT_NE(ValidateQuantizeArgs(a).message().find("scale_amax"), std::string::npos);
  }
  // A fixed scale must be a usable multiplier: finite and positive.
  for (float bad : {0.0f, -0.0f, -1.0f, std::numeric_limits<float>::infinity(),
                    std::numeric_limits<float>::quiet_NaN()}) {
    QuantizeArgs a = Good(Granularity::kTensor);
    a.has_scale = true;
    a.scale = bad;
    ExpectInvalid(a, absl::StrFormat("fixed scale %f", bad));
  }
}

TEST_F(ValidationTest, DequantizeErrors) {
  for (Granularity g : kGranularities) {
    const std::string n(GranularityName(g));
    DequantizeArgs d = GoodDequant(g);
    d.codes = nullptr;
    ExpectInvalid(d, n + " null codes");
    d = GoodDequant(g);
    d.output = nullptr;
    ExpectInvalid(d, n + " null output");
    d = GoodDequant(g);
    d.rows = -3;
    ExpectInvalid(d, n + " negative rows");
    d = GoodDequant(g);
    d.cols = -1;
    ExpectInvalid(d, n + " negative cols");
    d = GoodDequant(g);
    if (g == Granularity::kMx32) {
      d.e8m0_scales = nullptr;
      ExpectInvalid(d, n + " null e8m0_scales");
    } else {
      d.scale_inv = nullptr;
      ExpectInvalid(d, n + " null scale_inv");
    }
  }
}

}  // namespace
}  // namespace fp8rt::kernels
