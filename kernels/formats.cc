// Scalar format conversions: the reference the SIMD and CUDA kernels are tested against.
#include "kernels/formats.h"

#include <bit>
#include <cmath>
#include <limits>

#include "absl/strings/str_cat.h"
#include "kernels/fp8_encode.h"

namespace fp8rt::kernels {

uint8_t EncodeFp8(float x, Fp8Format format) {
  return format == Fp8Format::kE4M3 ? internal::EncodeFp8Bits<Fp8Format::kE4M3>(x)
                                    : internal::EncodeFp8Bits<Fp8Format::kE5M2>(x);
}

float DecodeFp8(uint8_t code, Fp8Format format) {
  const Fp8Info info = GetFp8Info(format);
  const int m = info.mantissa_bits;
  const int exp_field = (code & 0x7F) >> m;
  const int mantissa = code & ((1 << m) - 1);
  const bool negative = (code & 0x80) != 0;
  const int exp_max = (1 << (7 - m)) - 1;
  if (format == Fp8Format::kE4M3) {
    if ((code & 0x7F) == 0x7F) return std::numeric_limits<float>::quiet_NaN();
  } else if (exp_field == exp_max) {
    if (mantissa != 0) return std::numeric_limits<float>::quiet_NaN();
    return negative ? -std::numeric_limits<float>::infinity()
                    : std::numeric_limits<float>::infinity();
  }
  // Subnormals have exponent 1 - bias and no implicit leading one.
  const float magnitude =
      exp_field == 0
          ? std::ldexp(static_cast<float>(mantissa), 1 - info.exponent_bias - m)
          : std::ldexp(static_cast<float>((1 << m) | mantissa), exp_field - info.exponent_bias - m);
  return negative ? -magnitude : magnitude;
}

float DecodeE8M0(uint8_t code) {
  if (code == kE8M0NaN) return std::numeric_limits<float>::quiet_NaN();
  return std::ldexp(1.0f, static_cast<int>(code) - 127);
}

uint8_t E8M0FromExponent(int exponent) {
  if (exponent < -127) exponent = -127;
  if (exponent > 127) exponent = 127;
  return static_cast<uint8_t>(exponent + 127);
}

std::string_view Fp8FormatName(Fp8Format format) {
  return format == Fp8Format::kE4M3 ? "e4m3" : "e5m2";
}

absl::StatusOr<Fp8Format> ParseFp8Format(std::string_view name) {
  if (name == "e4m3") return Fp8Format::kE4M3;
  if (name == "e5m2") return Fp8Format::kE5M2;
  return absl::InvalidArgumentError(
      absl::StrCat("unknown FP8 format '", std::string(name), "' (expected e4m3 or e5m2)"));
}

}  // namespace fp8rt::kernels
