// Inputs and comparisons for the tests that hold the CUDA quantize, amax, convert and
// cast-transpose kernels to the CPU backend bit for bit: ops_cuda_test (on a GPU) and
// quantize_host_test (the same kernels' source on the CPU, over the block emulator).
#ifndef FP8RT_TESTS_GPU_QUANTIZE_DATA_H_
#define FP8RT_TESTS_GPU_QUANTIZE_DATA_H_

#include <gtest/gtest.h>

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "kernels/ops.h"
#include "kernels/quantize.h"

namespace fp8rt::kernels::quantize_data {

inline uint32_t Bits(float x) { return std::bit_cast<uint32_t>(x); }

enum class Dist { kNormal, kLogUniform, kZeros, kSpecials };
inline constexpr Dist kDists[] = {Dist::kNormal, Dist::kLogUniform, Dist::kZeros, Dist::kSpecials};
inline const char* DistName(Dist d) {
  switch (d) {
    case Dist::kNormal:
      return "normal";
    case Dist::kLogUniform:
      return "log-uniform 2^-40..2^40";
    case Dist::kZeros:
      return "signed zeros";
    case Dist::kSpecials:
      return "Inf/NaN/denormals/outliers";
  }
  return "?";
}

inline std::vector<float> MakeData(Dist dist, int64_t n, uint32_t seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> normal(0.0f, 3.0f);
  std::uniform_real_distribution<float> unit(0.0f, 1.0f);
  std::vector<float> x(static_cast<size_t>(n));
  for (auto& v : x) {
    switch (dist) {
      case Dist::kNormal:
        v = normal(rng);
        break;
      case Dist::kLogUniform: {
        const float mag = std::exp2(unit(rng) * 80.0f - 40.0f);
        v = (rng() & 1) ? -mag : mag;
        break;
      }
      case Dist::kZeros:
        v = (rng() & 1) ? -0.0f : 0.0f;
        break;
      case Dist::kSpecials: {
        const uint32_t pick = rng() % 50;
        if (pick == 0) {
          v = std::numeric_limits<float>::quiet_NaN();
        } else if (pick == 1) {
          v = std::bit_cast<float>(0xFFC00123u);  // negative NaN with a payload
        } else if (pick == 2) {
          v = (rng() & 1) ? std::numeric_limits<float>::infinity()
                          : -std::numeric_limits<float>::infinity();
        } else if (pick == 3) {
          v = std::bit_cast<float>(static_cast<uint32_t>(1u + (rng() & 0x7FFFFEu)));  // denormal
        } else if (pick == 4) {
          v = 3.0e38f * ((rng() & 1) ? 1.0f : -1.0f);  // near FLT_MAX: x * scale overflows
        } else if (pick == 5) {
          v = 1e5f * normal(rng);  // outliers
        } else {
          const float mag = std::exp2(unit(rng) * 40.0f - 36.0f);
          v = (rng() & 1) ? -mag : mag;
        }
        break;
      }
    }
  }
  return x;
}

inline std::vector<uint16_t> ToBf16Bits(const std::vector<float>& x) {
  std::vector<uint16_t> out(x.size());
  for (size_t i = 0; i < x.size(); ++i) out[i] = static_cast<uint16_t>(Bits(x[i]) >> 16);
  return out;
}

// Raw input bytes for an input type (BF16: the upper halves of the floats).
inline std::vector<uint8_t> InputBytes(const std::vector<float>& x, InputType type) {
  std::vector<uint8_t> bytes;
  if (x.empty()) return bytes;  // memcpy may not be given the null data() of empty vectors
  if (type == InputType::kF32) {
    bytes.resize(x.size() * 4);
    std::memcpy(bytes.data(), x.data(), bytes.size());
  } else {
    const std::vector<uint16_t> b = ToBf16Bits(x);
    bytes.resize(b.size() * 2);
    std::memcpy(bytes.data(), b.data(), bytes.size());
  }
  return bytes;
}

inline void ExpectSameStats(const QuantStats& gpu, const QuantStats& cpu,
                            const std::string& where) {
  EXPECT_EQ(Bits(gpu.amax), Bits(cpu.amax)) << where << ": amax " << gpu.amax << " vs " << cpu.amax;
  EXPECT_EQ(gpu.count, cpu.count) << where;
  EXPECT_EQ(gpu.underflow, cpu.underflow) << where;
  EXPECT_EQ(gpu.subnormal, cpu.subnormal) << where;
  EXPECT_EQ(gpu.saturated, cpu.saturated) << where;
  EXPECT_EQ(gpu.nonfinite, cpu.nonfinite) << where;
}

// First index where two byte vectors differ, for messages.
template <class T>
std::string FirstDifference(const std::vector<T>& a, const std::vector<T>& b) {
  for (size_t i = 0; i < std::min(a.size(), b.size()); ++i) {
    if (std::memcmp(&a[i], &b[i], sizeof(T)) != 0) {
      return absl::StrCat("first difference at ", i, " of ", a.size());
    }
  }
  return a.size() == b.size() ? "identical" : "sizes differ";
}

template <class T>
void ExpectBitsEqual(const std::vector<T>& gpu, const std::vector<T>& cpu,
                     const std::string& what) {
  ASSERT_EQ(gpu.size(), cpu.size()) << what;
  const bool same = gpu.empty() || std::memcmp(gpu.data(), cpu.data(), gpu.size() * sizeof(T)) == 0;
  EXPECT_TRUE(same) << what << ": " << FirstDifference(gpu, cpu);
}

}  // namespace fp8rt::kernels::quantize_data

#endif  // FP8RT_TESTS_GPU_QUANTIZE_DATA_H_
