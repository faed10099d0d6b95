// Internal: the bit-level FP32 -> FP8 encoder shared by the scalar reference and the SIMD
// kernels' tails. Branch-light so compilers vectorise the loops that call it.
//
// For y with |y| bits a:  NaN -> 0x7F;  a above the overflow threshold (or Inf) -> +-max;
// a >= min normal -> round the FP32 bits to the FP8 mantissa width (nearest even; a carry into
// the exponent is correct rounding) and rebias; below min normal -> add a magic power of two whose
// ulp is the FP8 subnormal step, so the FPU rounds to nearest even, and read the code off the bits.
#ifndef FP8RT_KERNELS_FP8_ENCODE_H_
#define FP8RT_KERNELS_FP8_ENCODE_H_

#include <bit>
#include <cstdint>

#include "kernels/formats.h"

namespace fp8rt::kernels::internal {

template <Fp8Format F>
struct Fp8Bits {
  static constexpr int kMantissaBits = F == Fp8Format::kE4M3 ? 3 : 2;
  static constexpr int kBias = F == Fp8Format::kE4M3 ? 7 : 15;
  static constexpr int kShift = 23 - kMantissaBits;
  // Values strictly above this (as |y| bits) saturate. E4M3: 464 = max + half an ulp rounds to
  // even (448); E5M2: 61440 = max + half an ulp rounds to even (65536, out of range).
  static constexpr uint32_t kOverflowAbove = F == Fp8Format::kE4M3 ? 0x43E80000u : 0x476FFFFFu;
  static constexpr uint32_t kMinNormalBits = static_cast<uint32_t>(127 + 1 - kBias) << 23;
  static constexpr uint32_t kRebias = static_cast<uint32_t>(127 - kBias) << kMantissaBits;
  // 2^(subnormal exponent + 23): its FP32 ulp is the FP8 subnormal step.
  static constexpr uint32_t kMagicBits =
      static_cast<uint32_t>(127 + (1 - kBias - kMantissaBits) + 23) << 23;
  static constexpr uint8_t kMaxCode = F == Fp8Format::kE4M3 ? 0x7E : 0x7B;
  static constexpr float kMax = F == Fp8Format::kE4M3 ? 448.0f : 57344.0f;
};

template <Fp8Format F>
inline uint8_t EncodeFp8Bits(float y) {
  using B = Fp8Bits<F>;
  const uint32_t bits = std::bit_cast<uint32_t>(y);
  const uint32_t a = bits & 0x7FFFFFFFu;
  const uint8_t sign = static_cast<uint8_t>((bits >> 24) & 0x80u);
  if (a > 0x7F800000u) return kFp8NaN;
  if (a > B::kOverflowAbove) return static_cast<uint8_t>(sign | B::kMaxCode);
  uint32_t code;
  if (a >= B::kMinNormalBits) {
    const uint32_t r = a + ((1u << (B::kShift - 1)) - 1u) + ((a >> B::kShift) & 1u);
    code = (r >> B::kShift) - B::kRebias;
  } else {
    const float magic = std::bit_cast<float>(B::kMagicBits);
    code = std::bit_cast<uint32_t>(std::bit_cast<float>(a) + magic) - B::kMagicBits;
  }
  return static_cast<uint8_t>(sign | code);
}

}  // namespace fp8rt::kernels::internal

#endif  // FP8RT_KERNELS_FP8_ENCODE_H_
