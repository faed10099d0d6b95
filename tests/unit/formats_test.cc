// Tests of the scalar number formats in kernels/formats.h: BF16 rounding, FP8 and E8M0 decoding,
// format names and constants.
//
// Index:
//   Bf16Test      FloatToBf16 against an independent round-to-nearest-even reference (2^24 random
//                 patterns plus every tie and edge), Bf16ToFloat exactness, NaN and infinities
//   Fp8DecodeTest DecodeFp8 for all 256 codes of both formats, from the field definitions
//                 (and against NVIDIA's __nv_cvt_fp8_to_halfraw when cuda_fp8.h is available)
//   E8M0Test      DecodeE8M0 for all 256 codes, E8M0FromExponent clamping
//   Fp8InfoTest   GetFp8Info constants, ParseFp8Format / Fp8FormatName
//
// Tolerances: none. Every conversion here is exact or correctly rounded, so all comparisons are
// bit for bit.
#include "kernels/formats.h"

#include <bit>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <random>
#include <string>

#include "absl/status/status.h"
#include "absl/strings/str_format.h"
#include "gtest/gtest.h"
#include "tests/unit/nvidia_fp8_reference.h"

namespace fp8rt::kernels {
namespace {

using namespace test_reference;  // NVIDIA reference and bit helpers

// ---------------------------------------------------------------------------------------------
// BF16

// The value of the BF16 code `t` (no sign bit) as a double, where t == 0x7F80 (the code after
// the largest finite one) stands for 2^128: IEEE rounding decides overflow as if the exponent
// range were unbounded, so the candidate above 0x7F7F is worth 2^128 when choosing the nearer.
double Bf16MagnitudeValue(uint32_t t) {
  if (t == 0x7F80u) return std::ldexp(1.0, 128);
  return static_cast<double>(BitsFloat(t << 16));
}

// Reference FP32 -> BF16, written from the definition: take the two BF16 candidates bracketing
// |x| (truncation and truncation + 1 ulp), pick the nearer in double arithmetic (the differences
// of two floats are exact in double), ties to the even mantissa. NaN is checked separately.
uint16_t ReferenceBf16(float x) {
  const uint32_t bits = FloatBits(x);
  const uint32_t sign = bits & 0x80000000u;
  const uint32_t mag = bits & 0x7FFFFFFFu;
  if (mag == 0x7F800000u) return static_cast<uint16_t>((sign | mag) >> 16);  // +-inf
  const uint32_t lo = mag >> 16;
  const uint32_t hi = lo + 1;
  const double ax = static_cast<double>(BitsFloat(mag));
  const double d_lo = ax - Bf16MagnitudeValue(lo);
  const double d_hi = Bf16MagnitudeValue(hi) - ax;
  uint32_t t;
  if (d_lo < d_hi) {
    t = lo;
  } else if (d_hi < d_lo) {
    t = hi;
  } else {
    t = (lo & 1u) == 0 ? lo : hi;
  }
  return static_cast<uint16_t>((sign >> 16) | t);
}

bool IsBf16NaN(uint16_t b) { return (b & 0x7F80u) == 0x7F80u && (b & 0x007Fu) != 0; }

// Checks one input; returns false (and records a failure) on a mismatch.
bool CheckBf16(float x) {
  const uint32_t bits = FloatBits(x);
  const uint16_t got = FloatToBf16(x);
  if (std::isnan(x)) {
    const bool ok = IsBf16NaN(got) && (got & 0x8000u) == ((bits >> 16) & 0x8000u) &&
                    (got & 0x0040u) != 0;  // quiet bit
    EXPECT_TRUE(ok) << absl::StrFormat(
        "FloatToBf16(NaN 0x%08x) = 0x%04x; want a quiet NaN with the input's sign", bits, got);
    return ok;
  }
  const uint16_t want = ReferenceBf16(x);
  EXPECT_EQ(got, want) << absl::StrFormat("FloatToBf16(0x%08x = %a) = 0x%04x, want 0x%04x", bits, x,
                                          got, want);
  return got == want;
}

TEST(Bf16Test, ReferenceSanity) {
  // A few hand-checked cases of the reference itself.
  EXPECT_EQ(ReferenceBf16(1.0f), 0x3F80);
  EXPECT_EQ(ReferenceBf16(BitsFloat(0x3F808000u)), 0x3F80);  // tie, even stays
  EXPECT_EQ(ReferenceBf16(BitsFloat(0x3F818000u)), 0x3F82);  // tie, odd rounds up
  EXPECT_EQ(ReferenceBf16(BitsFloat(0x3F808001u)), 0x3F81);
  EXPECT_EQ(ReferenceBf16(BitsFloat(0x3F807FFFu)), 0x3F80);
  EXPECT_EQ(ReferenceBf16(std::numeric_limits<float>::max()), 0x7F80);  // overflows to inf
  EXPECT_EQ(ReferenceBf16(BitsFloat(0x7F7F7FFFu)), 0x7F7F);
  EXPECT_EQ(ReferenceBf16(BitsFloat(0xFF7F8000u)), 0xFF80);  // tie at the top, odd -> -inf
  EXPECT_EQ(ReferenceBf16(BitsFloat(0x00008000u)), 0x0000);  // subnormal tie to even zero
  EXPECT_EQ(ReferenceBf16(BitsFloat(0x00018000u)), 0x0002);
}

TEST(Bf16Test, RandomBitPatterns) {
  std::mt19937 rng(20240611);
  int failures = 0;
  for (int i = 0; i < (1 << 24) && failures < 8; ++i) {
    if (!CheckBf16(BitsFloat(static_cast<uint32_t>(rng())))) ++failures;
  }
  EXPECT_EQ(failures, 0);
}

TEST(Bf16Test, AllTiesAndEdges) {
  // For every upper half (all signs, exponents and BF16 mantissas, including NaN/inf ranges),
  // the low halves that decide rounding: exact, just above, just below / at / above the tie,
  // and the largest.
  const uint32_t lows[] = {0x0000, 0x0001, 0x7FFE, 0x7FFF, 0x8000, 0x8001, 0xFFFE, 0xFFFF};
  int failures = 0;
  for (uint32_t hi = 0; hi < 0x10000u && failures < 8; ++hi) {
    for (uint32_t lo : lows) {
      if (!CheckBf16(BitsFloat((hi << 16) | lo))) ++failures;
    }
  }
  EXPECT_EQ(failures, 0);
}

TEST(Bf16Test, SpecialValues) {
  const float inf = std::numeric_limits<float>::infinity();
  EXPECT_EQ(FloatToBf16(inf), 0x7F80);
  EXPECT_EQ(FloatToBf16(-inf), 0xFF80);
  EXPECT_EQ(FloatToBf16(0.0f), 0x0000);
  EXPECT_EQ(FloatToBf16(-0.0f), 0x8000);
  EXPECT_EQ(FloatToBf16(1.0f), 0x3F80);
  EXPECT_EQ(FloatToBf16(-2.0f), 0xC000);
  // Finite values that round past the largest BF16 go to infinity (IEEE RNE overflow).
  EXPECT_EQ(FloatToBf16(std::numeric_limits<float>::max()), 0x7F80);
  EXPECT_EQ(FloatToBf16(-std::numeric_limits<float>::max()), 0xFF80);
  // NaNs of both signs, quiet and signalling, with payloads only in the low 16 bits (which a
  // truncating or rounding conversion would turn into infinity or a wrong code).
  for (uint32_t nan : {0x7FC00000u, 0xFFC00000u, 0x7F800001u, 0xFF800001u, 0x7F80FFFFu, 0x7FBFFFFFu,
                       0xFFFFFFFFu, 0x7FFFFFFFu, 0x7F808000u, 0xFF80FFFFu}) {
    CheckBf16(BitsFloat(nan));
  }
}

TEST(Bf16Test, Bf16ToFloatIsExact) {
  for (uint32_t b = 0; b < 0x10000u; ++b) {
    const float f = Bf16ToFloat(static_cast<uint16_t>(b));
    if (IsBf16NaN(static_cast<uint16_t>(b))) {
      ASSERT_TRUE(std::isnan(f)) << absl::StrFormat("Bf16ToFloat(0x%04x)", b);
      ASSERT_EQ(std::signbit(f), (b & 0x8000u) != 0) << absl::StrFormat("Bf16ToFloat(0x%04x)", b);
      continue;
    }
    // A BF16 value is the FP32 value with the same upper 16 bits and zero lower bits.
    ASSERT_EQ(FloatBits(f), b << 16) << absl::StrFormat("Bf16ToFloat(0x%04x)", b);
    // And rounding an exact BF16 value gives it back.
    ASSERT_EQ(FloatToBf16(f), b) << absl::StrFormat("round trip of 0x%04x", b);
  }
}

// ---------------------------------------------------------------------------------------------
// FP8 decoding

// The value of an FP8 code from the format definition (OFP8 v1.0): sign, biased exponent and
// mantissa fields; exponent field 0 is subnormal (no implicit one, exponent 1 - bias).
double ReferenceDecodeFp8(uint8_t code, Fp8Format format) {
  const bool e4m3 = format == Fp8Format::kE4M3;
  const int mbits = e4m3 ? 3 : 2;
  const int bias = e4m3 ? 7 : 15;
  const int emask = e4m3 ? 0xF : 0x1F;
  const double sign = (code & 0x80) ? -1.0 : 1.0;
  const int e = (code >> mbits) & emask;
  const int m = code & ((1 << mbits) - 1);
  if (e4m3) {
    if ((code & 0x7F) == 0x7F) return std::numeric_limits<double>::quiet_NaN();
  } else if (e == 0x1F) {
    return m == 0 ? sign * std::numeric_limits<double>::infinity()
                  : std::numeric_limits<double>::quiet_NaN();
  }
  if (e == 0) return sign * std::ldexp(static_cast<double>(m), 1 - bias - mbits);
  return sign * std::ldexp(static_cast<double>((1 << mbits) + m), e - bias - mbits);
}

class Fp8DecodeTest : public ::testing::TestWithParam<Fp8Format> {};

TEST_P(Fp8DecodeTest, AllCodesMatchTheFormatDefinition) {
  const Fp8Format format = GetParam();
  int nans = 0, infs = 0;
  for (int c = 0; c < 256; ++c) {
    const uint8_t code = static_cast<uint8_t>(c);
    const double want = ReferenceDecodeFp8(code, format);
    const float got = DecodeFp8(code, format);
    const std::string where = absl::StrFormat("DecodeFp8(0x%02x, %s)", c, Fp8FormatName(format));
    if (std::isnan(want)) {
      ++nans;
      EXPECT_TRUE(std::isnan(got)) << where << " = " << got;
      // A quiet NaN (header: "give a quiet NaN").
      EXPECT_NE(FloatBits(got) & 0x00400000u, 0u) << where << " is not a quiet NaN";
      continue;
    }
    if (std::isinf(want)) ++infs;
    // FP8 values are exact in FP32, so the double reference converts exactly.
    const float want_f = static_cast<float>(want);
    EXPECT_EQ(FloatBits(got), FloatBits(want_f))
        << where << absl::StrFormat(" = %a, want %a", got, want_f);
  }
  if (format == Fp8Format::kE4M3) {
    EXPECT_EQ(nans, 2);  // 0x7F, 0xFF
    EXPECT_EQ(infs, 0);
  } else {
    EXPECT_EQ(nans, 6);  // 0x7D-0x7F, 0xFD-0xFF
    EXPECT_EQ(infs, 2);  // 0x7C, 0xFC
  }
}

TEST_P(Fp8DecodeTest, HandPickedCodes) {
  const Fp8Format format = GetParam();
  const float inf = std::numeric_limits<float>::infinity();
  EXPECT_EQ(FloatBits(DecodeFp8(0x00, format)), FloatBits(0.0f));
  EXPECT_EQ(FloatBits(DecodeFp8(0x80, format)), FloatBits(-0.0f));
  EXPECT_EQ(DecodeFp8(0x01, format), GetFp8Info(format).min_subnormal);
  if (format == Fp8Format::kE4M3) {
    EXPECT_EQ(DecodeFp8(0x7E, format), 448.0f);
    EXPECT_EQ(DecodeFp8(0xFE, format), -448.0f);
    EXPECT_EQ(DecodeFp8(0x38, format), 1.0f);
    EXPECT_EQ(DecodeFp8(0x08, format), 0x1p-6f);
    EXPECT_EQ(DecodeFp8(0x07, format), 7 * 0x1p-9f);
    EXPECT_EQ(DecodeFp8(0x7C, format), 384.0f);  // an ordinary value in E4M3
    EXPECT_TRUE(std::isnan(DecodeFp8(0x7F, format)));
    EXPECT_TRUE(std::isnan(DecodeFp8(0xFF, format)));
  } else {
    EXPECT_EQ(DecodeFp8(0x7B, format), 57344.0f);
    EXPECT_EQ(DecodeFp8(0xFB, format), -57344.0f);
    EXPECT_EQ(DecodeFp8(0x3C, format), 1.0f);
    EXPECT_EQ(DecodeFp8(0x04, format), 0x1p-14f);
    EXPECT_EQ(DecodeFp8(0x03, format), 3 * 0x1p-16f);
    EXPECT_EQ(DecodeFp8(0x7C, format), inf);
    EXPECT_EQ(DecodeFp8(0xFC, format), -inf);
    for (int c : {0x7D, 0x7E, 0x7F, 0xFD, 0xFE, 0xFF}) {
      EXPECT_TRUE(std::isnan(DecodeFp8(static_cast<uint8_t>(c), format))) << c;
    }
  }
}

TEST_P(Fp8DecodeTest, AgreesWithNvidiaHalfConversion) {
#if !defined(FP8RT_HAVE_CUDA_FP8_H)
  GTEST_SKIP() << "cuda_fp8.h not found: NVIDIA's reference conversion is unavailable "
                  "(install the CUDA toolkit headers under /usr/local/cuda/include)";
#else
  const Fp8Format format = GetParam();
  const __nv_fp8_interpretation_t interp = format == Fp8Format::kE4M3 ? __NV_E4M3 : __NV_E5M2;
  for (int c = 0; c < 256; ++c) {
    const double want =
        HalfBitsToDouble(__nv_cvt_fp8_to_halfraw(static_cast<uint8_t>(c), interp).x);
    const float got = DecodeFp8(static_cast<uint8_t>(c), format);
    if (std::isnan(want)) {
      EXPECT_TRUE(std::isnan(got)) << c;
    } else {
      EXPECT_EQ(FloatBits(got), FloatBits(static_cast<float>(want))) << c;
    }
  }
#endif
}

INSTANTIATE_TEST_SUITE_P(Formats, Fp8DecodeTest,
                         ::testing::Values(Fp8Format::kE4M3, Fp8Format::kE5M2),
                         [](const ::testing::TestParamInfo<Fp8Format>& info) {
                           return std::string(Fp8FormatName(info.param));
                         });

// ---------------------------------------------------------------------------------------------
// E8M0

TEST(E8M0Test, DecodeAllCodes) {
  for (int c = 0; c < 255; ++c) {
    // 2^(c-127): a normal FP32 power of two for c >= 1 (biased exponent c), and the subnormal
    // 2^-127 (mantissa bit 22) for c == 0. Both biases are 127, which is why this is so simple.
    const uint32_t want = c == 0 ? 0x00400000u : static_cast<uint32_t>(c) << 23;
    const float got = DecodeE8M0(static_cast<uint8_t>(c));
    EXPECT_EQ(FloatBits(got), want) << absl::StrFormat("DecodeE8M0(%d) = %a", c, got);
    EXPECT_EQ(static_cast<double>(got), std::ldexp(1.0, c - 127)) << c;
  }
  EXPECT_TRUE(std::isnan(DecodeE8M0(0xFF)));
  EXPECT_EQ(kE8M0NaN, 0xFF);
}

TEST(E8M0Test, FromExponentClamps) {
  for (int e = -127; e <= 127; ++e) {
    EXPECT_EQ(E8M0FromExponent(e), e + 127) << e;
    EXPECT_EQ(DecodeE8M0(E8M0FromExponent(e)), static_cast<float>(std::ldexp(1.0, e))) << e;
  }
  // Out of range exponents clamp to the smallest / largest finite scale, never to NaN (0xFF).
  for (int e : {-128, -149, -1000, std::numeric_limits<int>::min()}) {
    EXPECT_EQ(E8M0FromExponent(e), 0x00) << e;
  }
  for (int e : {128, 129, 1000, std::numeric_limits<int>::max()}) {
    EXPECT_EQ(E8M0FromExponent(e), 0xFE) << e;
  }
}

// ---------------------------------------------------------------------------------------------
// Constants and names

TEST(Fp8InfoTest, Constants) {
  constexpr Fp8Info e4m3 = GetFp8Info(Fp8Format::kE4M3);
  EXPECT_EQ(e4m3.max, 448.0f);
  EXPECT_EQ(e4m3.min_normal, std::ldexp(1.0f, -6));
  EXPECT_EQ(e4m3.min_subnormal, std::ldexp(1.0f, -9));
  EXPECT_EQ(e4m3.mantissa_bits, 3);
  EXPECT_EQ(e4m3.exponent_bias, 7);
  EXPECT_EQ(e4m3.max_code, 0x7E);
  EXPECT_EQ(e4m3.emax, 8);

  constexpr Fp8Info e5m2 = GetFp8Info(Fp8Format::kE5M2);
  EXPECT_EQ(e5m2.max, 57344.0f);
  EXPECT_EQ(e5m2.min_normal, std::ldexp(1.0f, -14));
  EXPECT_EQ(e5m2.min_subnormal, std::ldexp(1.0f, -16));
  EXPECT_EQ(e5m2.mantissa_bits, 2);
  EXPECT_EQ(e5m2.exponent_bias, 15);
  EXPECT_EQ(e5m2.max_code, 0x7B);
  EXPECT_EQ(e5m2.emax, 15);

  EXPECT_EQ(kFp8NaN, 0x7F);
}

TEST(Fp8InfoTest, ConstantsAgreeWithDecoding) {
  for (Fp8Format f : {Fp8Format::kE4M3, Fp8Format::kE5M2}) {
    const Fp8Info info = GetFp8Info(f);
    EXPECT_EQ(DecodeFp8(info.max_code, f), info.max);
    EXPECT_EQ(DecodeFp8(0x01, f), info.min_subnormal);
    EXPECT_EQ(DecodeFp8(static_cast<uint8_t>(1 << info.mantissa_bits), f), info.min_normal);
    // emax: the exponent of the largest power of two <= max.
    EXPECT_EQ(std::ldexp(1.0f, info.emax), std::exp2(std::floor(std::log2(info.max))));
    EXPECT_TRUE(std::isnan(DecodeFp8(kFp8NaN, f)));
  }
}

TEST(Fp8InfoTest, ParseAndName) {
  EXPECT_EQ(Fp8FormatName(Fp8Format::kE4M3), "e4m3");
  EXPECT_EQ(Fp8FormatName(Fp8Format::kE5M2), "e5m2");
  for (Fp8Format f : {Fp8Format::kE4M3, Fp8Format::kE5M2}) {
    absl::StatusOr<Fp8Format> parsed = ParseFp8Format(Fp8FormatName(f));
    ASSERT_TRUE(parsed.ok()) << parsed.status();
    EXPECT_EQ(*parsed, f);
  }
  for (const char* bad : {"", "e4m4", "e3m4", "fp8", "bf16", "e5m2x", "4m3", "e4m3e5m2"}) {
    absl::StatusOr<Fp8Format> parsed = ParseFp8Format(bad);
    EXPECT_FALSE(parsed.ok()) << "'" << bad << "' parsed";
    EXPECT_TRUE(absl::IsInvalidArgument(parsed.status())) << parsed.status();
  }
}

}  // namespace
}  // namespace fp8rt::kernels
