// The per-value numerics of the CUDA kernels (kernels/cuda/device_math.cuh), compiled as host
// code, against the host definitions they mirror (kernels/formats.h, kernels/fp8_encode.h,
// kernels/quantize.h, the CPU quantize op). Needs no GPU, so it runs in every build: a slip in the
// mirror (a wrong constant, a rounding step out of order) fails here, on the CPU, before any GPU
// run; tests/gpu/ops_cuda_test.cc then checks the compiled kernels on a device.
//
// The shim (tests/gpu/host_shim.h) maps the CUDA intrinsics device_math.cuh uses to their IEEE
// definitions: __fadd_rn / __fmul_rn / __fdiv_rn are FP32 operations rounded to nearest even (the
// host's default rounding, no FMA contraction since each is a separate function call),
// __float_as_uint / __uint_as_float are bit casts, __clz counts leading zeros.
//
// Index: encoder on a sweep of all float bit patterns (every 97th) and 2^22 random patterns; the
// per-value statistics through a whole CPU quantize; ComputeScale over amaxes of every binade,
// margins and power-of-two scales; Mx32Exponent; PowerOfTwo; decoding of all 256 FP8 and E8M0
// codes; FloatToBf16; the tiled layout of cuBLASLt's VEC32_UE8M0 scales. Tolerances: none, every
// comparison is bit for bit.
#include <bit>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <random>
#include <vector>

#include "gtest/gtest.h"
#include "kernels/cuda/allocation_registry.h"
#include "kernels/cuda/gemm_route.h"
#include "kernels/cuda/managed_access.h"
#include "kernels/formats.h"
#include "kernels/ops.h"
#include "kernels/quantize.h"
#include "tests/gpu/host_shim.h"
// After the shim, which lets it compile as host code.
#include "kernels/cuda/device_math.cuh"

namespace fp8rt::kernels {
namespace {

namespace dev = cuda_internal;

uint32_t Bits(float x) { return std::bit_cast<uint32_t>(x); }
float FromBits(uint32_t b) { return std::bit_cast<float>(b); }

// Every 97th bit pattern (coprime with every power of two, so all exponents and low mantissa
// bits are visited) plus 2^22 random ones.
std::vector<uint32_t> SweepPatterns() {
  std::vector<uint32_t> out;
  out.reserve((uint64_t{1} << 32) / 97 + (1 << 22) + 16);
  for (uint64_t b = 0; b < (uint64_t{1} << 32); b += 97) out.push_back(static_cast<uint32_t>(b));
  std::mt19937 rng(1);
  for (int i = 0; i < (1 << 22); ++i) out.push_back(rng());
  return out;
}

const std::vector<uint32_t>& Patterns() {
  static const std::vector<uint32_t>* patterns = new std::vector<uint32_t>(SweepPatterns());
  return *patterns;
}

TEST(DeviceMathTest, EncoderEqualsTheHostEncoder) {
  int64_t mismatches[2] = {0, 0};
  for (uint32_t b : Patterns()) {
    const float y = FromBits(b);
    mismatches[0] += dev::EncodeFp8<Fp8Format::kE4M3>(y) != EncodeFp8(y, Fp8Format::kE4M3);
    mismatches[1] += dev::EncodeFp8<Fp8Format::kE5M2>(y) != EncodeFp8(y, Fp8Format::kE5M2);
  }
  EXPECT_EQ(mismatches[0], 0) << "E4M3";
  EXPECT_EQ(mismatches[1], 0) << "E5M2";
}

// The streaming kernels' fast path: where it applies, the full encoder gives the same code and
// the value counts in no statistic.
template <Fp8Format F>
void CheckPlainNormal() {
  int64_t plain = 0, code_mismatches = 0, counted = 0;
  for (uint32_t b : Patterns()) {
    if (!dev::IsPlainNormal<F>(b)) continue;
    ++plain;
    code_mismatches += dev::EncodePlainNormal<F>(b) != EncodeFp8(FromBits(b), F);
    dev::ThreadStats s;
    (void)dev::QuantizeOne<F>(FromBits(b), 1.0f, s);
    counted += s.underflow + s.subnormal + s.saturated + s.nonfinite;
  }
  EXPECT_GT(plain, 100000);
  EXPECT_EQ(code_mismatches, 0);
  EXPECT_EQ(counted, 0);
  // The range ends: min normal and max are plain, their neighbours outside are not.
  using B = internal::Fp8Bits<F>;
  EXPECT_TRUE(dev::IsPlainNormal<F>(B::kMinNormalBits));
  EXPECT_FALSE(dev::IsPlainNormal<F>(B::kMinNormalBits - 1));
  EXPECT_TRUE(dev::IsPlainNormal<F>(Bits(B::kMax) | 0x80000000u));
  EXPECT_FALSE(dev::IsPlainNormal<F>(Bits(B::kMax) + 1));
}

TEST(DeviceMathTest, FastPathEqualsTheFullEncoder) {
  CheckPlainNormal<Fp8Format::kE4M3>();
  CheckPlainNormal<Fp8Format::kE5M2>();
}

// QuantizeOne over a whole tensor, summed, equals the CPU quantize op (codes and statistics).
template <Fp8Format F>
void CheckQuantizeOne(const std::vector<float>& x, float scale) {
  std::vector<uint8_t> cpu_codes(x.size());
  float scale_inv = 0.0f;
  QuantStats cpu;
  QuantizeArgs a;
  a.format = F;
  a.input = x.data();
  a.rows = 1;
  a.cols = static_cast<int64_t>(x.size());
  a.has_scale = true;
  a.scale = scale;
  a.codes = cpu_codes.data();
  a.scale_inv = &scale_inv;
  a.stats = &cpu;
  ASSERT_TRUE(CpuOps().quantize(a, {}).ok());
  dev::ThreadStats s;
  int64_t code_mismatches = 0;
  for (size_t i = 0; i < x.size(); ++i) {
    code_mismatches += dev::QuantizeOne<F>(x[i], scale, s) != cpu_codes[i];
  }
  EXPECT_EQ(code_mismatches, 0);
  const uint32_t cpu_amax_bits = std::isnan(cpu.amax) ? 0x7FC00000u : Bits(cpu.amax);
  const uint32_t dev_amax_bits = s.amax_bits > 0x7F800000u ? dev::kQuietNaNBits : s.amax_bits;
  EXPECT_EQ(dev_amax_bits, cpu_amax_bits);
  EXPECT_EQ(static_cast<int64_t>(s.underflow), cpu.underflow);
  EXPECT_EQ(static_cast<int64_t>(s.subnormal), cpu.subnormal);
  EXPECT_EQ(static_cast<int64_t>(s.saturated), cpu.saturated);
  EXPECT_EQ(static_cast<int64_t>(s.nonfinite), cpu.nonfinite);
  // The data reaches every statistic.
  EXPECT_GT(cpu.underflow, 0);
  EXPECT_GT(cpu.subnormal, 0);
  EXPECT_GT(cpu.saturated, 0);
  EXPECT_GT(cpu.nonfinite, 0);
}

TEST(DeviceMathTest, QuantizeOneEqualsTheCpuQuantize) {
  std::vector<float> x;
  for (size_t i = 0; i < Patterns().size(); i += 7) x.push_back(FromBits(Patterns()[i]));
  for (float scale : {1.0f, 56.0f, 3.0e-5f, 1.7e30f}) {
    CheckQuantizeOne<Fp8Format::kE4M3>(x, scale);
    CheckQuantizeOne<Fp8Format::kE5M2>(x, scale);
  }
}

TEST(DeviceMathTest, ComputeScaleEqualsTheHostFormula) {
  std::mt19937 rng(2);
  int64_t mismatches = 0;
  int64_t checked = 0;
  for (size_t i = 0; i < Patterns().size(); i += 13) {
    const uint32_t amax_bits = Patterns()[i] & 0x7FFFFFFFu;
    if (amax_bits >= 0x7F800000u) continue;  // the kernels pass finite amaxes only
    const int margin = static_cast<int>(rng() % 65);
    const bool pow2 = (rng() & 1) != 0;
    for (Fp8Format f : {Fp8Format::kE4M3, Fp8Format::kE5M2}) {
      const float host = ComputeScale(FromBits(amax_bits), f, margin, pow2);
      const float device = dev::ComputeScale(amax_bits, GetFp8Info(f).max, margin, pow2);
      mismatches += Bits(host) != Bits(device);
      ++checked;
      // scale_inv as both backends write it.
      mismatches += Bits(1.0f / host) != Bits(dev::__fdiv_rn(1.0f, device));
    }
  }
  EXPECT_GT(checked, 1000000);
  EXPECT_EQ(mismatches, 0);
  // Edges: zero, the smallest denormal, FLT_MAX, every margin.
  for (uint32_t amax_bits : {0u, 1u, 0x00800000u, 0x7F7FFFFFu, 0x3F800000u}) {
    for (int margin = 0; margin <= 64; ++margin) {
      for (bool pow2 : {false, true}) {
        const float host = ComputeScale(FromBits(amax_bits), Fp8Format::kE4M3, margin, pow2);
        EXPECT_EQ(Bits(dev::ComputeScale(amax_bits, 448.0f, margin, pow2)), Bits(host))
            << amax_bits << " margin " << margin;
      }
    }
  }
}

// An amax read from memory (QuantizeArgs::scale_amax: a TP-synced one) may be anything: every
// sign, Inf and NaN give what the host's ComputeScale(float) gives.
TEST(DeviceMathTest, ComputeScaleOfAnyValueEqualsTheHost) {
  int64_t mismatches = 0;
  int64_t negative_or_nonfinite = 0;
  for (size_t i = 0; i < Patterns().size(); i += 7) {
    const uint32_t bits = Patterns()[i];
    const float amax = FromBits(bits);
    negative_or_nonfinite += (bits >> 31) != 0 || !std::isfinite(amax);
    for (Fp8Format f : {Fp8Format::kE4M3, Fp8Format::kE5M2}) {
      const int margin = static_cast<int>(i % 3);
      const bool pow2 = (i & 8) != 0;
      mismatches += Bits(ComputeScale(amax, f, margin, pow2)) !=
                    Bits(dev::ComputeScaleOfValue(amax, GetFp8Info(f).max, margin, pow2));
    }
  }
  EXPECT_GT(negative_or_nonfinite, 100000);
  EXPECT_EQ(mismatches, 0);
  for (float v : {-0.0f, -1.0f, std::numeric_limits<float>::infinity(),
                  -std::numeric_limits<float>::infinity(), std::numeric_limits<float>::quiet_NaN(),
                  -std::numeric_limits<float>::quiet_NaN()}) {
    EXPECT_EQ(dev::ComputeScaleOfValue(v, 448.0f, 0, false), 1.0f) << v;
  }
  EXPECT_EQ(dev::ComputeScaleOfValue(2.0f, 448.0f, 0, false), 224.0f);
}

// The CUDA backend's own allocations answer the pointer check without a runtime call
// (kernels/cuda/device.cu CheckDevicePointers): any address inside one, none outside; and the
// free of each (DeallocateEntry) learns its kind without one.
TEST(AllocationRegistryTest, KnowsEveryAddressInsideItsAllocationsAndNoOther) {
  cuda_internal::AllocationRegistry r;
  alignas(64) static char arena[4096];
  char* a = arena + 64;
  char* b = arena + 1024;
  r.Add(a, 100);
  r.Add(b, 0, cuda_internal::AllocationRegistry::Kind::kPinnedHost);  // one byte for zero
  EXPECT_EQ(r.size(), 2u);
  EXPECT_TRUE(r.Contains(a));
  EXPECT_TRUE(r.Contains(a + 99));
  EXPECT_FALSE(r.Contains(a + 100));
  EXPECT_FALSE(r.Contains(a - 1));
  EXPECT_TRUE(r.Contains(b));
  EXPECT_FALSE(r.Contains(b + 1));
  EXPECT_FALSE(r.Contains(arena));
  EXPECT_EQ(r.Remove(a), cuda_internal::AllocationRegistry::Kind::kDevice);
  EXPECT_FALSE(r.Contains(a + 10));
  EXPECT_TRUE(r.Contains(b));
  EXPECT_EQ(r.Remove(a), cuda_internal::AllocationRegistry::Kind::kUnknown);  // already freed
  // never added: ignored
  EXPECT_EQ(r.Remove(arena + 7), cuda_internal::AllocationRegistry::Kind::kUnknown);
  EXPECT_EQ(r.size(), 1u);
  r.Add(nullptr, 10);
  EXPECT_FALSE(r.Contains(nullptr));
  // Each free learns how to free: pinned host memory (cudaFreeHost), stream-ordered device memory
  // (cudaFreeAsync) and managed memory (cudaFree).
  EXPECT_EQ(r.Remove(b), cuda_internal::AllocationRegistry::Kind::kPinnedHost);
  EXPECT_EQ(r.size(), 0u);
  r.Add(a, 8, cuda_internal::AllocationRegistry::Kind::kStreamOrdered);
  EXPECT_TRUE(r.Contains(a + 7));
  EXPECT_EQ(r.Remove(a), cuda_internal::AllocationRegistry::Kind::kStreamOrdered);
}

// A device without concurrent managed access is refused when it is selected, naming it.
TEST(ManagedAccessTest, ADeviceWithoutConcurrentManagedAccessIsRefused) {
  EXPECT_TRUE(cuda_internal::CheckConcurrentManagedAccess(0, 1).ok());
  const absl::Status s = cuda_internal::CheckConcurrentManagedAccess(3, 0);
  EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_NE(s.message().find("CUDA device 3 reports concurrentManagedAccess = 0"),
            std::string::npos)
      << s;
  EXPECT_NE(s.message().find("device: cpu"), std::string::npos) << s;
}

TEST(ManagedAccessTest, ADeviceThisBuildHasNoKernelsForIsRefused) {
  EXPECT_TRUE(cuda_internal::CheckKernelImage(0, 9, 0, true).ok());
  const absl::Status s = cuda_internal::CheckKernelImage(1, 8, 0, false);
  EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_NE(s.message().find("CUDA device 1 has compute capability 8.0, which this build has no "
                             "kernels for"),
            std::string::npos)
      << s;
  EXPECT_NE(s.message().find("-DCMAKE_CUDA_ARCHITECTURES=80"), std::string::npos) << s;
}

TEST(ManagedAccessTest, ADeviceWithoutMemoryPoolsIsRefused) {
  EXPECT_TRUE(cuda_internal::CheckMemoryPools(0, 1).ok());
  const absl::Status s = cuda_internal::CheckMemoryPools(2, 0);
  EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_NE(s.message().find("CUDA device 2 does not support stream-ordered memory pools"),
            std::string::npos)
      << s;
  EXPECT_NE(s.message().find("device: cpu"), std::string::npos) << s;
}

TEST(DeviceMathTest, Mx32ExponentEqualsTheHostDefinition) {
  int64_t mismatches = 0;
  for (uint32_t b : Patterns()) {
    const uint32_t amax_bits = b & 0x7FFFFFFFu;
    if (amax_bits >= 0x7F800000u) continue;
    mismatches +=
        dev::Mx32Exponent(amax_bits, 8) != Mx32ScaleExponent(FromBits(amax_bits), Fp8Format::kE4M3);
    mismatches += dev::Mx32Exponent(amax_bits, 15) !=
                  Mx32ScaleExponent(FromBits(amax_bits), Fp8Format::kE5M2);
  }
  EXPECT_EQ(mismatches, 0);
  EXPECT_EQ(dev::Mx32Exponent(0, 8), -127);
  EXPECT_EQ(dev::Mx32Exponent(1, 8), Mx32ScaleExponent(FromBits(1), Fp8Format::kE4M3));
}

TEST(DeviceMathTest, PowerOfTwoIsExact) {
  for (int k = -149; k <= 127; ++k) {
    EXPECT_EQ(Bits(dev::PowerOfTwo(k)), Bits(std::ldexp(1.0f, k))) << k;
  }
}

TEST(DeviceMathTest, DecodingEqualsTheHostForAllCodes) {
  for (int c = 0; c < 256; ++c) {
    const auto code = static_cast<uint8_t>(c);
    EXPECT_EQ(Bits(dev::DecodeFp8(code, true)), Bits(DecodeFp8(code, Fp8Format::kE4M3))) << c;
    EXPECT_EQ(Bits(dev::DecodeFp8(code, false)), Bits(DecodeFp8(code, Fp8Format::kE5M2))) << c;
    EXPECT_EQ(Bits(dev::DecodeE8M0(code)), Bits(DecodeE8M0(code))) << c;
  }
}

TEST(DeviceMathTest, FloatToBf16EqualsTheHost) {
  int64_t mismatches = 0;
  for (uint32_t b : Patterns())
    mismatches += dev::FloatToBf16(FromBits(b)) != FloatToBf16(FromBits(b));
  EXPECT_EQ(mismatches, 0);
}

// cuBLASLt's VEC32_UE8M0 layout as the cuBLAS documentation draws it, walked in storage order:
// 512-byte tiles, each a 32 x 16 byte array whose row i holds, for the four 32-row groups g of the
// tile's 128 rows, the 4 scale columns of row g * 32 + i; the tiles of one 128-row band follow
// each other along K. Every (row, column) of a padded grid must land on its storage byte, so the
// map is also a bijection onto [0, rows_pad * cols_pad).
TEST(DeviceMathTest, Mx32ScaleTileOffsetIsCublasLtsTiledLayout) {
  for (const auto& [rows_pad, cols_pad] :
       {std::pair<int64_t, int64_t>{128, 4}, {256, 12}, {384, 8}}) {
    const int64_t bands = rows_pad / 128, tiles_per_band = cols_pad / 4;
    for (int64_t storage = 0; storage < rows_pad * cols_pad; ++storage) {
      const int64_t tile = storage / 512, in_tile = storage % 512;
      const int64_t band = tile / tiles_per_band, k_tile = tile % tiles_per_band;
      ASSERT_LT(band, bands);
      const int64_t i = in_tile / 16, j = in_tile % 16;  // the 32 x 16 view
      const int64_t row = band * 128 + (j / 4) * 32 + i;
      const int64_t col = k_tile * 4 + j % 4;
      ASSERT_EQ(dev::Mx32ScaleTileOffset(row, col, cols_pad), storage)
          << "row " << row << " col " << col << " of " << rows_pad << " x " << cols_pad;
    }
  }
}

}  // namespace
}  // namespace fp8rt::kernels

// --- which FP8 GEMMs cuBLASLt takes (kernels/cuda/gemm_route.h) ----------------------------------

namespace fp8rt::kernels {
namespace {

Fp8GemmArgs RouteArgs(int64_t m, int64_t n, int64_t k, GemmScaling scaling) {
  Fp8GemmArgs a;
  a.m = m;
  a.n = n;
  a.k = k;
  a.scaling = scaling;
  return a;
}

TEST(GemmRouteTest, AlignedTensorScaledGemmsTakeCublasLtOnEveryFp8Gpu) {
  for (int cc : {89, 90, 100, 120}) {
    const auto r = cuda_internal::RouteFp8Gemm(RouteArgs(256, 512, 384, GemmScaling::kTensor), cc);
    EXPECT_TRUE(r.cublaslt) << cc << ": " << r.why;
    EXPECT_TRUE(r.why.empty());
  }
  Fp8GemmArgs hybrid = RouteArgs(64, 64, 64, GemmScaling::kTensor);
  hybrid.a_format = Fp8Format::kE5M2;  // dgrad of the hybrid format: E5M2 x E4M3
  EXPECT_TRUE(cuda_internal::RouteFp8Gemm(hybrid, 90).cublaslt);
}

TEST(GemmRouteTest, RaggedShapesAndE5m2PairsFallBack) {
  const auto ragged =
      cuda_internal::RouteFp8Gemm(RouteArgs(130, 256, 384, GemmScaling::kTensor), 90);
  EXPECT_FALSE(ragged.cublaslt);
  EXPECT_FALSE(ragged.architecture);
  EXPECT_NE(ragged.why.find("multiples of 16"), std::string::npos) << ragged.why;
  Fp8GemmArgs e5 = RouteArgs(64, 64, 64, GemmScaling::kTensor);
  e5.a_format = e5.b_format = Fp8Format::kE5M2;
  const auto pair = cuda_internal::RouteFp8Gemm(e5, 90);
  EXPECT_FALSE(pair.cublaslt);
  EXPECT_FALSE(pair.architecture);
  EXPECT_NE(pair.why.find("E5M2 x E5M2"), std::string::npos) << pair.why;
}

// Block scaling has a cuBLASLt kernel on Hopper only, mx32 on Blackwell only: elsewhere the GEMM
// falls back, and the route says why, naming the device and the recipe to use instead.
TEST(GemmRouteTest, ScalingTheDeviceHasNoKernelForIsNamed) {
  const Fp8GemmArgs block = RouteArgs(256, 256, 256, GemmScaling::kBlock);
  EXPECT_TRUE(cuda_internal::RouteFp8Gemm(block, 90).cublaslt);
  for (int cc : {100, 120}) {
    const auto r = cuda_internal::RouteFp8Gemm(block, cc);
    EXPECT_FALSE(r.cublaslt);
    EXPECT_TRUE(r.architecture);
    EXPECT_NE(r.why.find("not " + std::to_string(cc / 10) + ".0"), std::string::npos) << r.why;
    EXPECT_NE(r.why.find("mx32"), std::string::npos) << r.why;
  }
  const Fp8GemmArgs mx = RouteArgs(256, 256, 256, GemmScaling::kMx32);
  EXPECT_TRUE(cuda_internal::RouteFp8Gemm(mx, 100).cublaslt);
  const auto hopper = cuda_internal::RouteFp8Gemm(mx, 90);
  EXPECT_FALSE(hopper.cublaslt);
  EXPECT_TRUE(hopper.architecture);
  EXPECT_NE(hopper.why.find("not 9.0"), std::string::npos) << hopper.why;
  // K not a multiple of 128: a shape matter, not the device's.
  const auto k144 = cuda_internal::RouteFp8Gemm(RouteArgs(64, 256, 144, GemmScaling::kBlock), 90);
  EXPECT_FALSE(k144.cublaslt);
  EXPECT_FALSE(k144.architecture);
}

// What the user is told when a GEMM leaves cuBLASLt: nothing on cuBLASLt's route; otherwise one
// notice per kind (the backend prints each kind once per process), the device's per scaling with
// the route's reason, the shape's and the alignment's naming the GEMM.
TEST(GemmRouteTest, EachWayOffCublasLtHasItsNotice) {
  const Fp8GemmArgs fine = RouteArgs(256, 512, 384, GemmScaling::kTensor);
  EXPECT_EQ(cuda_internal::NoticeFor(fine, cuda_internal::RouteFp8Gemm(fine, 90), true).kind, -1);
  EXPECT_TRUE(
      cuda_internal::NoticeFor(fine, cuda_internal::RouteFp8Gemm(fine, 90), true).text.empty());

  const Fp8GemmArgs ragged = RouteArgs(130, 1000, 384, GemmScaling::kTensor);
  const auto shape =
      cuda_internal::NoticeFor(ragged, cuda_internal::RouteFp8Gemm(ragged, 90), true);
  EXPECT_EQ(shape.kind, 3);
  EXPECT_NE(shape.text.find("M=130 N=1000 K=384"), std::string::npos) << shape.text;
  EXPECT_NE(shape.text.find("multiples of 16"), std::string::npos) << shape.text;
  EXPECT_NE(shape.text.find("once per process"), std::string::npos) << shape.text;

  Fp8GemmArgs e5 = RouteArgs(64, 64, 64, GemmScaling::kTensor);
  e5.a_format = e5.b_format = Fp8Format::kE5M2;
  const auto pair = cuda_internal::NoticeFor(e5, cuda_internal::RouteFp8Gemm(e5, 90), true);
  EXPECT_EQ(pair.kind, 3);
  EXPECT_NE(pair.text.find("E5M2 x E5M2"), std::string::npos) << pair.text;

  const auto unaligned =
      cuda_internal::NoticeFor(fine, cuda_internal::RouteFp8Gemm(fine, 90), false);
  EXPECT_EQ(unaligned.kind, 4);
  EXPECT_NE(unaligned.text.find("M=256 N=512 K=384"), std::string::npos) << unaligned.text;
  EXPECT_NE(unaligned.text.find("16-byte aligned"), std::string::npos) << unaligned.text;

  for (const auto& [scaling, cc] :
       {std::pair{GemmScaling::kBlock, 100}, std::pair{GemmScaling::kMx32, 90}}) {
    const Fp8GemmArgs args = RouteArgs(256, 256, 256, scaling);
    const auto route = cuda_internal::RouteFp8Gemm(args, cc);
    const auto device = cuda_internal::NoticeFor(args, route, true);
    EXPECT_EQ(device.kind, static_cast<int>(scaling));
    EXPECT_EQ(device.text, route.why);
  }
  // Every kind fits the backend's table of "said" flags, and the cheap kind the backend checks
  // first is the notice's.
  for (int kind : {shape.kind, unaligned.kind, static_cast<int>(GemmScaling::kMx32)}) {
    EXPECT_LT(kind, cuda_internal::FallbackNotice::kKinds);
  }
  EXPECT_EQ(cuda_internal::NoticeKind(ragged, cuda_internal::RouteFp8Gemm(ragged, 90), true), 3);
  EXPECT_EQ(cuda_internal::NoticeKind(fine, cuda_internal::RouteFp8Gemm(fine, 90), false), 4);
  EXPECT_EQ(cuda_internal::NoticeKind(fine, cuda_internal::RouteFp8Gemm(fine, 90), true), -1);
}

}  // namespace
}  // namespace fp8rt::kernels
