// NVIDIA's host-side FP8 conversions (cuda_fp8.h) as the reference of fp8rt's numerics tests,
// plus the bit helpers those tests share. The header needs no GPU and no CUDA runtime; where it
// is missing (no CUDA toolkit), kHaveReference is false and FP8RT_REQUIRE_CUDA_FP8_H() skips the
// test with a message saying why.
#ifndef FP8RT_TESTS_UNIT_NVIDIA_FP8_REFERENCE_H_
#define FP8RT_TESTS_UNIT_NVIDIA_FP8_REFERENCE_H_

#include <bit>
#include <cmath>
#include <cstdint>
#include <limits>

#include "gtest/gtest.h"
#include "kernels/formats.h"

#if defined(FP8RT_HAVE_CUDA_FP8_H)
#include <cuda_fp8.h>
#endif

namespace fp8rt::kernels::test_reference {

inline uint32_t FloatBits(float x) { return std::bit_cast<uint32_t>(x); }
inline float BitsFloat(uint32_t b) { return std::bit_cast<float>(b); }

// IEEE binary16 bits -> double, from the definition.
inline double HalfBitsToDouble(uint16_t h) {
  const double sign = (h & 0x8000) ? -1.0 : 1.0;
  const int e = (h >> 10) & 0x1F;
  const int m = h & 0x3FF;
  if (e == 0x1F) {
    return m == 0 ? sign * std::numeric_limits<double>::infinity()
                  : std::numeric_limits<double>::quiet_NaN();
  }
  if (e == 0) return sign * std::ldexp(m, -24);
  return sign * std::ldexp(1024 + m, e - 25);
}

#if defined(FP8RT_HAVE_CUDA_FP8_H)
inline constexpr bool kHaveReference = true;

inline __nv_fp8_interpretation_t NvInterpretation(Fp8Format format) {
  return format == Fp8Format::kE4M3 ? __NV_E4M3 : __NV_E5M2;
}

// __nv_cvt_float_to_fp8(x, __NV_SATFINITE, format): what fp8rt's encoder must equal.
inline uint8_t NvEncode(float x, Fp8Format format) {
  return __nv_cvt_float_to_fp8(x, __NV_SATFINITE, NvInterpretation(format));
}

// True when y (not NaN) rounds past the largest finite value: NVIDIA's non-saturating
// conversion then gives NaN (E4M3, which has no infinity) or +-Inf (E5M2).
inline bool NvRoundsPastMax(float y, Fp8Format format) {
  const uint8_t code = __nv_cvt_float_to_fp8(y, __NV_NOSAT, NvInterpretation(format)) & 0x7F;
  return format == Fp8Format::kE4M3 ? code == 0x7F : code == 0x7C;
}
#else
inline constexpr bool kHaveReference = false;
inline uint8_t NvEncode(float, Fp8Format) { return 0; }
inline bool NvRoundsPastMax(float, Fp8Format) { return false; }
#endif

}  // namespace fp8rt::kernels::test_reference

#define FP8RT_REQUIRE_CUDA_FP8_H()                                                          \
  do {                                                                                      \
    if (!::fp8rt::kernels::test_reference::kHaveReference) {                                \
      GTEST_SKIP() << "cuda_fp8.h not found: NVIDIA's reference conversion is unavailable " \
                      "(install the CUDA toolkit headers under /usr/local/cuda/include)";   \
    }                                                                                       \
  } while (false)

#endif  // FP8RT_TESTS_UNIT_NVIDIA_FP8_REFERENCE_H_
