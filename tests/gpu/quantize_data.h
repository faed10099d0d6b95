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
#include <utility>
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

// The scale options the quantize tests run: a scale computed from the tensor, one with a margin
// and rounded to a power of two, and a fixed one (delayed scaling; kTensor only).
struct ScaleOption {
  const char* name;
  bool has_scale;
  float scale;
  int margin;
  bool power_of_two;
};
inline constexpr ScaleOption kScaleOptions[] = {
    {"computed", false, 1.0f, 0, false},
    {"margin 3, power of two", false, 1.0f, 3, true},
    {"fixed 37.5", true, 37.5f, 0, false},
};

// Amaxes for QuantizeArgs::scale_amax: ordinary, zero, negative, subnormal, the smallest normal,
// huge and non-finite (their scales saturate to FLT_MAX or FLT_MIN, or fall back to 1; a device
// that flushed subnormals would differ).
inline constexpr float kScaleAmaxes[] = {3.0f,
                                         0.25f,
                                         0.0f,
                                         -1.0f,
                                         1e-40f,
                                         std::numeric_limits<float>::min(),
                                         65504.0f,
                                         std::numeric_limits<float>::max(),
                                         std::numeric_limits<float>::infinity(),
                                         std::numeric_limits<float>::quiet_NaN()};

// F32 bit patterns that round to BF16 at the edges: the largest finite value, ties, -Inf, a NaN
// with a payload, the smallest subnormal, zero.
inline constexpr uint32_t kConvertSpecials[] = {0x7F7FFFFFu, 0x7F7F8000u, 0x3F808000u, 0x3F818000u,
                                                0xFF800000u, 0x7FC00001u, 0x80000001u, 0x00000000u};

// A granularity as a test name.
inline std::string GranularityTestName(Granularity g) {
  switch (g) {
    case Granularity::kTensor:
      return "tensor";
    case Granularity::kRow:
      return "row";
    case Granularity::kTile1x128:
      return "tile1x128";
    case Granularity::kBlock128x128:
      return "block128x128";
    case Granularity::kMx32:
      return "mx32";
  }
  return "unknown";
}

// The arguments (without buffers) of each scale option that applies to a granularity (mx32
// scales are fixed by the spec, and a fixed scale is kTensor's only), with the option's name.
inline std::vector<std::pair<QuantizeArgs, std::string>> ScaleCases(Fp8Format format,
                                                                    Granularity granularity,
                                                                    InputType type, int64_t rows,
                                                                    int64_t cols) {
  std::vector<std::pair<QuantizeArgs, std::string>> cases;
  for (const ScaleOption& opt : kScaleOptions) {
    if (opt.has_scale && granularity != Granularity::kTensor) continue;
    if ((opt.has_scale || opt.margin != 0) && granularity == Granularity::kMx32) continue;
    QuantizeArgs a;
    a.format = format;
    a.granularity = granularity;
    a.input_type = type;
    a.rows = rows;
    a.cols = cols;
    a.has_scale = opt.has_scale;
    a.scale = opt.scale;
    a.margin = opt.margin;
    a.power_of_two_scales = opt.power_of_two;
    cases.emplace_back(a, opt.name);
  }
  return cases;
}

// What one quantize gives, and the dequantize of its codes.
struct QuantizeResult {
  std::vector<uint8_t> codes;
  std::vector<float> scale_inv;
  std::vector<uint8_t> e8m0;
  QuantStats stats;
  std::vector<float> dequant;
};

// Every output bit for bit (the E8M0 scales for mx32, scale_inv otherwise).
inline void ExpectSameQuantizeResult(const QuantizeResult& got, const QuantizeResult& cpu, bool mx,
                                     const std::string& where) {
  ExpectBitsEqual(got.codes, cpu.codes, where + ": codes");
  if (mx) {
    ExpectBitsEqual(got.e8m0, cpu.e8m0, where + ": E8M0 scales");
  } else {
    ExpectBitsEqual(got.scale_inv, cpu.scale_inv, where + ": scale_inv");
  }
  ExpectSameStats(got.stats, cpu.stats, where);
  ExpectBitsEqual(got.dequant, cpu.dequant, where + ": dequantized");
}

}  // namespace fp8rt::kernels::quantize_data

#endif  // FP8RT_TESTS_GPU_QUANTIZE_DATA_H_
