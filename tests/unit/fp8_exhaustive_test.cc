// EncodeFp8 against NVIDIA's __nv_cvt_float_to_fp8(x, __NV_SATFINITE, fmt) for all 2^32 float
// bit patterns, in both formats (ctest label 'exhaustive'; minutes on a small machine, so it is
// not in the default unit run). The spot checks of the same property are fp8_conversion_test.
//
// Tolerances: none, the comparison is of codes (DESIGN.md section 3: bit for bit with NVIDIA).
#include <omp.h>

#include <bit>
#include <chrono>
#include <cstdint>
#include <iostream>
#include <mutex>
#include <string>
#include <vector>

#include "absl/strings/str_format.h"
#include "gtest/gtest.h"
#include "kernels/formats.h"
#include "tests/unit/nvidia_fp8_reference.h"

namespace fp8rt::kernels {
namespace {

class Fp8ExhaustiveTest : public ::testing::TestWithParam<Fp8Format> {};

TEST_P(Fp8ExhaustiveTest, AllFloatBitPatternsMatchNvidia) {
#if !defined(FP8RT_HAVE_CUDA_FP8_H)
  GTEST_SKIP() << "cuda_fp8.h not found: NVIDIA's reference conversion is unavailable "
                  "(install the CUDA toolkit headers under /usr/local/cuda/include)";
#else
  const Fp8Format format = GetParam();
  const __nv_fp8_interpretation_t interp = format == Fp8Format::kE4M3 ? __NV_E4M3 : __NV_E5M2;
  constexpr int64_t kChunkBits = 16;
  constexpr int64_t kChunks = int64_t{1} << (32 - kChunkBits);
  constexpr int kMaxReported = 8;

  std::mutex mu;
  std::vector<std::string> reports;  // Guarded by mu.
  int64_t mismatches = 0;
  const auto start = std::chrono::steady_clock::now();
#pragma omp parallel for schedule(dynamic, 64) reduction(+ : mismatches)
  for (int64_t chunk = 0; chunk < kChunks; ++chunk) {
    const uint32_t base = static_cast<uint32_t>(chunk << kChunkBits);
    int64_t local = 0;
    for (uint32_t i = 0; i < (uint32_t{1} << kChunkBits); ++i) {
      const uint32_t bits = base | i;
      const float x = std::bit_cast<float>(bits);
      const uint8_t want = __nv_cvt_float_to_fp8(x, __NV_SATFINITE, interp);
      const uint8_t got = EncodeFp8(x, format);
      if (got != want) {
        if (++local <= kMaxReported) {
          std::lock_guard<std::mutex> lock(mu);
          if (reports.size() < kMaxReported) {
            reports.push_back(absl::StrFormat(
                "EncodeFp8(0x%08x = %a) = 0x%02x, NVIDIA __nv_cvt_float_to_fp8 gives 0x%02x", bits,
                x, got, want));
          }
        }
      }
    }
    mismatches += local;
  }
  const double seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  for (const std::string& r : reports) ADD_FAILURE() << r;
  EXPECT_EQ(mismatches, 0) << "mismatches out of 2^32 inputs (" << Fp8FormatName(format) << ")";
  std::cout << absl::StrFormat("[ exhaustive ] %s: 2^32 inputs in %.1f s on %d threads\n",
                               Fp8FormatName(format), seconds, omp_get_max_threads());
  RecordProperty("seconds", absl::StrFormat("%.1f", seconds));
#endif
}

INSTANTIATE_TEST_SUITE_P(Formats, Fp8ExhaustiveTest,
                         ::testing::Values(Fp8Format::kE4M3, Fp8Format::kE5M2),
                         [](const ::testing::TestParamInfo<Fp8Format>& info) {
                           return std::string(Fp8FormatName(info.param));
                         });

}  // namespace
}  // namespace fp8rt::kernels
