// Internal to the CPU backend: the statistics of one span of a quantization and the scalar
// encode-and-count of one element (the SIMD kernels' tails, and the fused AdamW + FP8 update).
#ifndef FP8RT_KERNELS_CPU_QUANTIZE_ONE_H_
#define FP8RT_KERNELS_CPU_QUANTIZE_ONE_H_
#include <bit>
#include <cstdint>

#include "kernels/fp8_encode.h"

namespace fp8rt::kernels::cpu_internal {

// Statistics of one span, before conversion to QuantStats. amax_bits is the max of |x| as
// integer bits, which orders NaN above Inf above every finite value.
struct SpanStats {
  uint32_t amax_bits = 0;
  int64_t underflow = 0;
  int64_t subnormal = 0;
  int64_t saturated = 0;
  int64_t nonfinite = 0;
};

struct AmaxPair {
  uint32_t amax_bits = 0;         // NaN-aware max |x|
  uint32_t finite_amax_bits = 0;  // max |x| over finite x
};

inline float LoadAsFloat(const float* p, size_t i) { return p[i]; }
inline float LoadAsFloat(const uint16_t* p, size_t i) {
  return std::bit_cast<float>(static_cast<uint32_t>(p[i]) << 16);
}

// Scalar version of one element of QuantizeSpan, used for tails.
template <Fp8Format F>
inline uint8_t QuantizeOne(float x, float scale, SpanStats& s) {
  using B = internal::Fp8Bits<F>;
  const uint32_t ain = std::bit_cast<uint32_t>(x) & 0x7FFFFFFFu;
  const float y = x * scale;
  const uint8_t code = internal::EncodeFp8Bits<F>(y);
  const bool finite = ain < 0x7F800000u;
  const uint32_t mag = code & 0x7Fu;
  if (ain > s.amax_bits) s.amax_bits = ain;
  s.nonfinite += !finite;
  s.underflow += finite && ain != 0 && mag == 0;
  s.subnormal += mag != 0 && mag < (1u << B::kMantissaBits);
  s.saturated += finite && (std::bit_cast<uint32_t>(y) & 0x7FFFFFFFu) > B::kOverflowAbove;
  return code;
}

}  // namespace fp8rt::kernels::cpu_internal

#endif  // FP8RT_KERNELS_CPU_QUANTIZE_ONE_H_
