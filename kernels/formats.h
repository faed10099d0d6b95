// Number formats of fp8rt: E4M3, E5M2, BF16 and E8M0, with scalar conversions.
//
// Definitions (Micikevicius et al. 2022, "FP8 Formats for Deep Learning"; OCP 8-bit Floating
// Point Specification (OFP8) v1.0; OCP Microscaling Formats (MX) Specification v1.0):
//   E4M3  bias 7,  no infinities, NaN = S.1111.111, max 448 (S.1111.110), min normal 2^-6,
//         min subnormal 2^-9.
//   E5M2  bias 15, IEEE-like: inf = S.11111.00, NaN = S.11111.{01,10,11}, max 57344,
//         min normal 2^-14, min subnormal 2^-16.
//   BF16  the upper 16 bits of an IEEE binary32; FP32 -> BF16 rounds to nearest even.
//   E8M0  an unsigned biased exponent (bias 127): code c means 2^(c-127); 0xFF is NaN.
//
// EncodeFp8 is the one scalar definition of FP32 -> FP8 in fp8rt: round to nearest even,
// saturate finite overflow and infinities to the largest finite value (sign kept), NaN -> 0x7F.
// It agrees bit for bit with NVIDIA's __nv_cvt_float_to_fp8(x, __NV_SATFINITE, fmt) from
// cuda_fp8.h for all 2^32 inputs (tests/unit/fp8_exhaustive_test.cc; midpoints and random
// patterns in tests/unit/fp8_conversion_test.cc). The vectorised CPU kernels
// and the CUDA kernels are tested against it. All functions here are pure and thread-safe.
#ifndef FP8RT_KERNELS_FORMATS_H_
#define FP8RT_KERNELS_FORMATS_H_

#include <bit>
#include <cstdint>
#include <string_view>

#include "absl/status/statusor.h"

namespace fp8rt::kernels {

enum class Fp8Format : uint8_t { kE4M3, kE5M2 };

// Constants of one FP8 format.
struct Fp8Info {
  float max;            // largest finite value
  float min_normal;     // smallest positive normal value
  float min_subnormal;  // smallest positive subnormal value
  int mantissa_bits;    // explicit mantissa bits (3 or 2)
  int exponent_bias;    // 7 or 15
  uint8_t max_code;     // code of +max (0x7E or 0x7B)
  int emax;             // exponent of the largest power of two <= max (8 or 15), for MX scales
};

constexpr Fp8Info GetFp8Info(Fp8Format format) {
  return format == Fp8Format::kE4M3 ? Fp8Info{448.0f, 0x1p-6f, 0x1p-9f, 3, 7, 0x7E, 8}
                                    : Fp8Info{57344.0f, 0x1p-14f, 0x1p-16f, 2, 15, 0x7B, 15};
}

// The canonical NaN that EncodeFp8 produces for any NaN input, in both formats.
inline constexpr uint8_t kFp8NaN = 0x7F;

// FP32 -> FP8, round to nearest even, saturating (see the file comment).
uint8_t EncodeFp8(float x, Fp8Format format);

// FP8 -> FP32, exact. E4M3 0x7F/0xFF and E5M2 NaN codes give a quiet NaN; E5M2 0x7C/0xFC give
// +-infinity.
float DecodeFp8(uint8_t code, Fp8Format format);

// FP32 -> BF16 bits, round to nearest even; NaN stays a (quiet) NaN with its sign. Inline and
// branch-free (a select, not a branch) so that loops calling it vectorise.
inline uint16_t FloatToBf16(float x) {
  const uint32_t bits = std::bit_cast<uint32_t>(x);
  // Adding 0x7FFF plus the lowest kept bit rounds to nearest even; a carry into the exponent is
  // the correct rounding (up to infinity past the BF16 max).
  const uint32_t rounded = (bits + 0x7FFFu + ((bits >> 16) & 1u)) >> 16;
  const uint32_t quiet_nan = (bits >> 16) | 0x40u;
  return static_cast<uint16_t>((bits & 0x7FFFFFFFu) > 0x7F800000u ? quiet_nan : rounded);
}
// BF16 bits -> FP32, exact.
inline float Bf16ToFloat(uint16_t bits) {
  return std::bit_cast<float>(static_cast<uint32_t>(bits) << 16);
}

// E8M0 scale codes (OCP MX v1.0): 2^(code - 127); 0xFF is NaN.
inline constexpr uint8_t kE8M0NaN = 0xFF;
float DecodeE8M0(uint8_t code);
// The code of 2^exponent, with the exponent clamped to the representable range [-127, 127].
uint8_t E8M0FromExponent(int exponent);

// Names used on the command line and in configs: "e4m3", "e5m2".
std::string_view Fp8FormatName(Fp8Format format);
absl::StatusOr<Fp8Format> ParseFp8Format(std::string_view name);

}  // namespace fp8rt::kernels

#endif  // FP8RT_KERNELS_FORMATS_H_
