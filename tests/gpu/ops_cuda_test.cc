// The CUDA op table (CudaOps(), kernels/cuda/cuda_backend.h) against the CPU backend on the same
// inputs: the one test that runs every op on both backends and compares them.
//
// Index:
//   QuantizeTest (TEST_P)      format x granularity x shape x input type, each over four data
//                              distributions and three scale options; codes, scales, every
//                              QuantStats field and the dequantized values compared bit for bit
//   QuantizeAlignmentTest      unaligned buffers (the scalar path of the vectorised kernels), a
//                              large tensor (grid-stride loops, many blocks' atomics), statistics
//                              into pinned host memory, a scale from a device amax
//   AmaxTest, ConvertTest      bit for bit, random bit patterns and specials
//   CastTransposeTest (TEST_P) format x input type x shape x data, bit for bit
//   EncoderTest                the device encoder equals NVIDIA's hardware conversion on all 2^32
//                              inputs of both formats
//   Fp8GemmTest (TEST_P)       format pair x shape x tensor/block scaling x output type x path
//                              (cuBLASLt where it applies, or the forced CUDA-core fallback);
//                              exact data bit for bit, random data within written bounds,
//                              accumulate
//   Bf16GemmTest, F32GemmTest  same idea; F32 also checks that TF32 is off
//   ArgumentTest               host pointers and bad arguments are refused without a launch
//
// Tolerances. Element-wise ops: none (bit for bit; both backends write NaN as 0x7FC00000). GEMMs:
// on "exact" data (small integers times powers of two, where every partial sum is exact in FP32
// and in the FP8 tensor cores' narrower accumulator) the results must be identical. On random
// data, with S = sum_k |sa a_k sb b_k| (the scaled products' absolute sum, in double):
//   CPU (oneDNN, FP32 accumulation in some order):  2 (K + 8) 2^-24 S   (Higham, eq. 3.5, with
//       room for the scale products; the bound gemm_test.cc uses)
//   CUDA fallback kernel (FP32 FMA, fixed order):    2 (K + 8) 2^-24 S   (same argument)
//   cuBLASLt BF16 and FP32 (FP32 accumulation whose tensor-core adds may truncate rather than
//       round: unit 2^-23):                          2 (K + 8) 2^-23 S
//   cuBLASLt FP8 (FAST_ACCUM off):                   2^-8 S. Hopper's FP8 tensor cores add the
//       products of each 32-wide group of K with about 14 significant bits (DeepSeek-V3,
//       arXiv:2412.19437, section 3.3.2) and cuBLASLt promotes to FP32 every few groups: at most
//       ~8 additions of relative error 2^-13 per 128-wide slice, each bounded by that slice's
//       share of S, so <= 2^-10 S; 2^-8 leaves 4x for the undocumented details.
// The GPU-CPU difference must be within the sum of the two bounds, plus, for BF16 output, one
// BF16 rounding of each result (2^-8 |value| each).
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <bit>
#include <cctype>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <limits>
#include <random>
#include <string>
#include <tuple>
#include <vector>

#include "absl/strings/str_cat.h"
#include "kernels/cuda/cuda_backend.h"
#include "kernels/formats.h"
#include "kernels/gemm.h"
#include "kernels/host_mirror.h"
#include "kernels/ops.h"
#include "kernels/quantize.h"
#include "tests/gpu/gpu_test_support.h"
#include "tests/gpu/quantize_data.h"

namespace fp8rt::kernels {
namespace {

using gpu_test::CudaStreamTest;
using gpu_test::DeviceBuffer;
using gpu_test::Download;
using gpu_test::Upload;

using quantize_data::Bits;
using quantize_data::Dist;
using quantize_data::DistName;
using quantize_data::ExpectBitsEqual;
using quantize_data::ExpectSameQuantizeResult;
using quantize_data::ExpectSameStats;
using quantize_data::FirstDifference;
using quantize_data::GranularityTestName;
using quantize_data::InputBytes;
using quantize_data::kConvertSpecials;
using quantize_data::kDists;
using quantize_data::kScaleAmaxes;
using quantize_data::MakeData;
using quantize_data::QuantizeResult;
using quantize_data::ScaleCases;
using quantize_data::ToBf16Bits;

// --- fixture -----------------------------------------------------------------------------------

// Skips without a usable device, with the CUDA runtime's reason (fails instead under
// FP8RT_REQUIRE_GPU=1); runs the ops on a stream of its own (not the default stream) and
// synchronises after each.
class CudaTest : public CudaStreamTest {
 protected:
  void SetUp() override {
    CudaStreamTest::SetUp();
    if (Stopped()) return;
    gpu_ = cuda_ops_;
  }
  void TearDown() override {
    cuda_testing::ForceGemmFallback(false);
    CudaStreamTest::TearDown();
  }

  const OpTable& cpu_ = CpuOps();
  const OpTable* gpu_ = nullptr;
};

// --- data --------------------------------------------------------------------------------------

// --- quantize / dequantize ---------------------------------------------------------------------

struct Shape {
  int64_t rows;
  int64_t cols;
};
// Ragged edges in both directions, single rows and columns, exact multiples of 128, and
// sizes whose element count is not a multiple of the kernels' vector width (8).
constexpr Shape kShapes[] = {{1, 1},     {3, 200},   {200, 3},    {31, 33},
                             {128, 128}, {130, 257}, {257, 1000}, {2, 4099}};

// Runs one quantize (then dequantize of its codes) on either backend.
class QuantizeFixture : public CudaTest {
 protected:
  QuantizeResult RunCpu(const QuantizeArgs& base, const void* input) {
    const ScaleGrid grid = GetScaleGrid(base.granularity, base.rows, base.cols);
    const size_t n = static_cast<size_t>(base.rows * base.cols);
    QuantizeResult r;
    r.codes.assign(n, 0);
    r.scale_inv.assign(static_cast<size_t>(grid.size()), 0.0f);
    r.e8m0.assign(static_cast<size_t>(grid.size()), 0);
    QuantizeArgs a = base;
    a.input = input;
    a.codes = r.codes.data();
    a.scale_inv = r.scale_inv.data();
    a.e8m0_scales = r.e8m0.data();
    a.stats = &r.stats;
    const absl::Status s = cpu_.quantize(a, {});
    EXPECT_TRUE(s.ok()) << s;
    r.dequant.assign(n, 0.0f);
    DequantizeArgs d;
    d.format = a.format;
    d.granularity = a.granularity;
    d.codes = r.codes.data();
    d.rows = a.rows;
    d.cols = a.cols;
    d.scale_inv = r.scale_inv.data();
    d.e8m0_scales = r.e8m0.data();
    d.output = r.dequant.data();
    EXPECT_TRUE(cpu_.dequantize(d, {}).ok());
    return r;
  }

  QuantizeResult RunGpu(const QuantizeArgs& base, const DeviceBuffer& input) {
    const ScaleGrid grid = GetScaleGrid(base.granularity, base.rows, base.cols);
    const size_t n = static_cast<size_t>(base.rows * base.cols);
    DeviceBuffer codes(n), scale_inv(static_cast<size_t>(grid.size()) * 4),
        e8m0(static_cast<size_t>(grid.size())), stats(sizeof(QuantStats)), dequant(n * 4);
    QuantizeArgs a = base;
    a.input = input.as();
    a.codes = codes.as<uint8_t>();
    a.scale_inv = scale_inv.as<float>();
    a.e8m0_scales = e8m0.as<uint8_t>();
    a.stats = stats.as<QuantStats>();
    const absl::Status s = gpu_->quantize(a, stream());
    EXPECT_TRUE(s.ok()) << s;
    DequantizeArgs d;
    d.format = a.format;
    d.granularity = a.granularity;
    d.codes = a.codes;
    d.rows = a.rows;
    d.cols = a.cols;
    d.scale_inv = a.scale_inv;
    d.e8m0_scales = a.e8m0_scales;
    d.output = dequant.as<float>();
    EXPECT_TRUE(gpu_->dequantize(d, stream()).ok());
    Sync();
    QuantizeResult r;
    r.codes = Download<uint8_t>(codes, n);
    r.scale_inv = Download<float>(scale_inv, static_cast<size_t>(grid.size()));
    r.e8m0 = Download<uint8_t>(e8m0, static_cast<size_t>(grid.size()));
    r.stats = Download<QuantStats>(stats, 1)[0];
    r.dequant = Download<float>(dequant, n);
    return r;
  }
};

class QuantizeTest
    : public QuantizeFixture,
      public ::testing::WithParamInterface<std::tuple<Fp8Format, Granularity, Shape, InputType>> {};

TEST_P(QuantizeTest, MatchesTheCpuBackendBitForBit) {
  const auto [format, granularity, shape, type] = GetParam();
  const bool mx = granularity == Granularity::kMx32;
  for (Dist dist : kDists) {
    const std::vector<float> x = MakeData(dist, shape.rows * shape.cols,
                                          static_cast<uint32_t>(shape.rows * 31 + shape.cols));
    const std::vector<uint8_t> bytes = InputBytes(x, type);
    const DeviceBuffer input = Upload(bytes);
    for (const auto& [a, option] : ScaleCases(format, granularity, type, shape.rows, shape.cols)) {
      const std::string where = absl::StrCat(DistName(dist), ", ", option);
      ExpectSameQuantizeResult(RunGpu(a, input), RunCpu(a, bytes.data()), mx, where);
      if (HasFailure()) return;  // one report per parameter set is enough
    }
  }
}

INSTANTIATE_TEST_SUITE_P(
    All, QuantizeTest,
    ::testing::Combine(::testing::Values(Fp8Format::kE4M3, Fp8Format::kE5M2),
                       ::testing::Values(Granularity::kTensor, Granularity::kRow,
                                         Granularity::kTile1x128, Granularity::kBlock128x128,
                                         Granularity::kMx32),
                       ::testing::ValuesIn(kShapes),
                       ::testing::Values(InputType::kF32, InputType::kBF16)),
    [](const auto& info) {
      const Shape shape = std::get<2>(info.param);
      return absl::StrCat(std::string(Fp8FormatName(std::get<0>(info.param))), "_",
                          GranularityTestName(std::get<1>(info.param)), "_", shape.rows, "x",
                          shape.cols, "_",
                          std::get<3>(info.param) == InputType::kF32 ? "f32" : "bf16");
    });

class QuantizeAlignmentTest : public QuantizeFixture {};

TEST_F(QuantizeAlignmentTest, UnalignedBuffersGiveTheSameResult) {
  // Input one element and codes one byte past an aligned address: the vectorised tensor kernels
  // must take their scalar path.
  const int64_t rows = 37, cols = 1001;
  const std::vector<float> x = MakeData(Dist::kSpecials, rows * cols, 5);
  for (InputType type : {InputType::kF32, InputType::kBF16}) {
    const size_t elem = type == InputType::kF32 ? 4 : 2;
    std::vector<uint8_t> bytes = InputBytes(x, type);
    std::vector<uint8_t> shifted(elem, 0);
    shifted.insert(shifted.end(), bytes.begin(), bytes.end());
    const DeviceBuffer input = Upload(shifted);
    DeviceBuffer codes(static_cast<size_t>(rows * cols) + 1), scale_inv(4),
        stats(sizeof(QuantStats));
    QuantizeArgs a;
    a.input_type = type;
    a.input = input.as<uint8_t>() + elem;
    a.rows = rows;
    a.cols = cols;
    a.codes = codes.as<uint8_t>() + 1;
    a.scale_inv = scale_inv.as<float>();
    a.stats = stats.as<QuantStats>();
    ASSERT_TRUE(gpu_->quantize(a, stream()).ok());
    Sync();
    std::vector<uint8_t> gpu_codes = Download<uint8_t>(codes, static_cast<size_t>(rows * cols) + 1);
    gpu_codes.erase(gpu_codes.begin());
    const QuantizeResult cpu = RunCpu(a, bytes.data());
    ExpectBitsEqual(gpu_codes, cpu.codes, "unaligned codes");
    ExpectSameStats(Download<QuantStats>(stats, 1)[0], cpu.stats, "unaligned");
    EXPECT_EQ(Bits(Download<float>(scale_inv, 1)[0]), Bits(cpu.scale_inv[0]));
  }
}

TEST_F(QuantizeAlignmentTest, LargeTensorUsesManyBlocks) {
  // 8M values: every thread of the persistent grid loops, and hundreds of blocks' statistics
  // meet in the atomics.
  const int64_t rows = 2048, cols = 4096;
  const std::vector<float> x = MakeData(Dist::kSpecials, rows * cols, 6);
  const DeviceBuffer input = Upload(x);
  for (Granularity g : {Granularity::kTensor, Granularity::kTile1x128, Granularity::kRow}) {
    QuantizeArgs a;
    a.granularity = g;
    a.rows = rows;
    a.cols = cols;
    const QuantizeResult cpu = RunCpu(a, x.data());
    const QuantizeResult gpu = RunGpu(a, input);
    ExpectBitsEqual(gpu.codes, cpu.codes, "codes");
    ExpectBitsEqual(gpu.scale_inv, cpu.scale_inv, "scale_inv");
    ExpectSameStats(gpu.stats, cpu.stats, "large");
  }
}

// Statistics as the model takes them (kernels/host_mirror.h): the quantize kernels combine their
// blocks' statistics with device atomics into device memory (cudaMalloc), and an explicit copy
// queued behind them brings them to pinned host memory, which the host reads after the wait. They
// must be the CPU backend's, rerun after rerun; hundreds of blocks meet in the atomics here.
TEST_F(QuantizeAlignmentTest, StatsThroughAHostMirrorMatchTheCpuBackend) {
  const int64_t rows = 2048, cols = 4096;
  const std::vector<float> x = MakeData(Dist::kSpecials, rows * cols, 7);
  const DeviceBuffer input = Upload(x);
  HostMirror<QuantStats> stats;
  stats.Reset(*cuda_ops_, 1);
  cudaPointerAttributes attr{};
  ASSERT_EQ(cudaPointerGetAttributes(&attr, stats.device()), cudaSuccess);
  EXPECT_EQ(attr.type, cudaMemoryTypeDevice);
  for (Granularity g : {Granularity::kTensor, Granularity::kTile1x128}) {
    QuantizeArgs a;
    a.granularity = g;
    a.rows = rows;
    a.cols = cols;
    const QuantizeResult cpu = RunCpu(a, x.data());
    const ScaleGrid grid = GetScaleGrid(g, rows, cols);
    DeviceBuffer codes(static_cast<size_t>(rows * cols)),
        scale_inv(static_cast<size_t>(grid.size()) * 4);
    a.input = input.as();
    a.codes = codes.as<uint8_t>();
    a.scale_inv = scale_inv.as<float>();
    a.stats = stats.device();
    for (int rerun = 0; rerun < 3; ++rerun) {
      ASSERT_TRUE(gpu_->quantize(a, stream()).ok());
      ASSERT_TRUE(stats.Download(stream()).ok());
      Sync();
      ExpectSameStats(stats[0], cpu.stats, absl::StrCat("host mirror, rerun ", rerun));
    }
  }
}

TEST_F(QuantizeAlignmentTest, EmptyInputWritesUnitScalesAndZeroStats) {
  for (Granularity g : {Granularity::kTensor, Granularity::kRow}) {
    DeviceBuffer scale_inv(5 * 4), stats(sizeof(QuantStats));
    QuantizeArgs a;
    a.granularity = g;
    a.rows = g == Granularity::kTensor ? 0 : 5;
    a.cols = 0;
    a.scale_inv = scale_inv.as<float>();
    a.stats = stats.as<QuantStats>();
    ASSERT_TRUE(gpu_->quantize(a, stream()).ok());
    Sync();
    const std::vector<float> s = Download<float>(scale_inv, g == Granularity::kTensor ? 1 : 5);
    for (float v : s) EXPECT_EQ(v, 1.0f);
    const QuantStats q = Download<QuantStats>(stats, 1)[0];
    EXPECT_EQ(q.count, 0);
    EXPECT_EQ(q.amax, 0.0f);
  }
}

// A tensor scale from an amax in device memory (QuantizeArgs::scale_amax, current scaling with the
// amax max-reduced over TP on the device): codes, scale_inv and statistics as the CPU backend's,
// for amaxes that scale, that saturate, and that give scale 1 (zero, negative, Inf, NaN).
TEST_F(QuantizeAlignmentTest, ScaleFromADeviceAmaxMatchesTheCpuBackend) {
  const int64_t rows = 37, cols = 300;
  const std::vector<float> x = MakeData(Dist::kNormal, rows * cols, 5);
  const DeviceBuffer input = Upload(x);
  // kScaleAmaxes (subnormal, smallest normal and huge too), with margins and power-of-two scales.
  for (const auto& [margin, pow2] :
       {std::pair{0, false}, std::pair{3, false}, std::pair{0, true}, std::pair{3, true}}) {
    for (Fp8Format format : {Fp8Format::kE4M3, Fp8Format::kE5M2}) {
      for (float amax : kScaleAmaxes) {
        std::vector<uint8_t> cpu_codes(x.size());
        float cpu_scale_inv = 0.0f;
        QuantStats cpu_stats;
        QuantizeArgs c;
        c.format = format;
        c.input = x.data();
        c.rows = rows;
        c.cols = cols;
        c.codes = cpu_codes.data();
        c.scale_inv = &cpu_scale_inv;
        c.stats = &cpu_stats;
        c.scale_amax = &amax;
        c.margin = margin;
        c.power_of_two_scales = pow2;
        ASSERT_TRUE(cpu_.quantize(c, {}).ok());
        const DeviceBuffer amax_dev = Upload(std::vector<float>{amax});
        DeviceBuffer codes(x.size()), scale_inv(4), stats(sizeof(QuantStats));
        QuantizeArgs g = c;
        g.input = input.as();
        g.codes = codes.as<uint8_t>();
        g.scale_inv = scale_inv.as<float>();
        g.stats = stats.as<QuantStats>();
        g.scale_amax = amax_dev.as<float>();
        ASSERT_TRUE(gpu_->quantize(g, stream()).ok());
        Sync();
        const std::string where = absl::StrCat(std::string(Fp8FormatName(format)), " amax ", amax,
                                               " margin ", margin, " pow2 ", pow2);
        const std::vector<uint8_t> got = Download<uint8_t>(codes, x.size());
        EXPECT_EQ(got, cpu_codes) << where << ": " << FirstDifference(got, cpu_codes);
        EXPECT_EQ(Bits(Download<float>(scale_inv, 1)[0]), Bits(cpu_scale_inv)) << where;
        ExpectSameStats(Download<QuantStats>(stats, 1)[0], cpu_stats, where);
      }
    }
  }
}

// --- amax, convert -----------------------------------------------------------------------------

class AmaxTest : public CudaTest {};

TEST_F(AmaxTest, MatchesTheCpuBackendBitForBit) {
  for (int64_t count : {int64_t{0}, int64_t{1}, int64_t{7}, int64_t{1000003}}) {
    for (Dist dist : kDists) {
      const std::vector<float> x = MakeData(dist, count, static_cast<uint32_t>(count));
      for (InputType type : {InputType::kF32, InputType::kBF16}) {
        const std::vector<uint8_t> bytes = InputBytes(x, type);
        float cpu_amax = -1.0f, cpu_finite = -1.0f;
        AmaxArgs c;
        c.input_type = type;
        c.input = bytes.data();
        c.count = count;
        c.amax = &cpu_amax;
        c.finite_amax = &cpu_finite;
        ASSERT_TRUE(cpu_.amax(c, {}).ok());
        const DeviceBuffer input = Upload(bytes);
        DeviceBuffer out(8);
        AmaxArgs g = c;
        g.input = input.as();
        g.amax = out.as<float>();
        g.finite_amax = out.as<float>() + 1;
        ASSERT_TRUE(gpu_->amax(g, stream()).ok());
        Sync();
        const std::vector<float> got = Download<float>(out, 2);
        const std::string where = absl::StrCat(count, " values, ", DistName(dist));
        EXPECT_EQ(Bits(got[0]), Bits(cpu_amax)) << where;
        EXPECT_EQ(Bits(got[1]), Bits(cpu_finite)) << where;
      }
    }
  }
}

class ConvertTest : public CudaTest {};

TEST_F(ConvertTest, BothDirectionsMatchTheCpuBackendBitForBit) {
  std::mt19937 rng(11);
  const size_t n = (size_t{1} << 22) + 13;  // random patterns: NaNs, Infs, denormals included
  std::vector<uint32_t> bits(n);
  for (auto& b : bits) b = rng();
  std::copy(std::begin(kConvertSpecials), std::end(kConvertSpecials), bits.begin());
  // F32 -> BF16
  std::vector<uint16_t> cpu16(n);
  ConvertArgs c;
  c.from = InputType::kF32;
  c.to = InputType::kBF16;
  c.input = bits.data();
  c.output = cpu16.data();
  c.count = static_cast<int64_t>(n);
  ASSERT_TRUE(cpu_.convert(c, {}).ok());
  const DeviceBuffer in = Upload(bits);
  DeviceBuffer out16(n * 2);
  ConvertArgs g = c;
  g.input = in.as();
  g.output = out16.as();
  ASSERT_TRUE(gpu_->convert(g, stream()).ok());
  Sync();
  ExpectBitsEqual(Download<uint16_t>(out16, n), cpu16, "F32 -> BF16");
  // BF16 -> F32, and same-type copies
  std::vector<float> cpu32(n);
  c.from = InputType::kBF16;
  c.to = InputType::kF32;
  c.input = cpu16.data();
  c.output = cpu32.data();
  ASSERT_TRUE(cpu_.convert(c, {}).ok());
  DeviceBuffer out32(n * 4);
  g.from = InputType::kBF16;
  g.to = InputType::kF32;
  g.input = out16.as();
  g.output = out32.as();
  ASSERT_TRUE(gpu_->convert(g, stream()).ok());
  Sync();
  ExpectBitsEqual(Download<float>(out32, n), cpu32, "BF16 -> F32");
  DeviceBuffer copy(n * 4);
  g.from = g.to = InputType::kF32;
  g.input = in.as();
  g.output = copy.as();
  ASSERT_TRUE(gpu_->convert(g, stream()).ok());
  Sync();
  ExpectBitsEqual(Download<uint32_t>(copy, n), bits, "F32 copy");
}

// --- cast-transpose ----------------------------------------------------------------------------

class CastTransposeTest
    : public CudaTest,
      public ::testing::WithParamInterface<std::tuple<Fp8Format, InputType, Shape>> {};

TEST_P(CastTransposeTest, MatchesTheCpuBackendBitForBit) {
  const auto [format, type, shape] = GetParam();
  const size_t n = static_cast<size_t>(shape.rows * shape.cols);
  for (Dist dist : kDists) {
    const std::vector<float> x = MakeData(dist, shape.rows * shape.cols, 17);
    const std::vector<uint8_t> bytes = InputBytes(x, type);
    CastTransposeArgs c;
    c.format = format;
    c.input_type = type;
    c.input = bytes.data();
    c.rows = shape.rows;
    c.cols = shape.cols;
    c.scale = GetFp8Info(format).max / 8.0f;
    std::vector<uint8_t> codes(n), codes_t(n);
    float scale_inv = 0.0f;
    QuantStats stats;
    c.codes = codes.data();
    c.codes_t = codes_t.data();
    c.scale_inv = &scale_inv;
    c.stats = &stats;
    ASSERT_TRUE(cpu_.cast_transpose(c, {}).ok());
    const DeviceBuffer input = Upload(bytes);
    DeviceBuffer d_codes(n), d_codes_t(n), d_scale_inv(4), d_stats(sizeof(QuantStats));
    CastTransposeArgs g = c;
    g.input = input.as();
    g.codes = d_codes.as<uint8_t>();
    g.codes_t = d_codes_t.as<uint8_t>();
    g.scale_inv = d_scale_inv.as<float>();
    g.stats = d_stats.as<QuantStats>();
    ASSERT_TRUE(gpu_->cast_transpose(g, stream()).ok());
    Sync();
    const std::string where = DistName(dist);
    ExpectBitsEqual(Download<uint8_t>(d_codes, n), codes, where + ": codes");
    ExpectBitsEqual(Download<uint8_t>(d_codes_t, n), codes_t, where + ": codes_t");
    EXPECT_EQ(Bits(Download<float>(d_scale_inv, 1)[0]), Bits(scale_inv)) << where;
    ExpectSameStats(Download<QuantStats>(d_stats, 1)[0], stats, where);
  }
}

INSTANTIATE_TEST_SUITE_P(
    All, CastTransposeTest,
    ::testing::Combine(::testing::Values(Fp8Format::kE4M3, Fp8Format::kE5M2),
                       ::testing::Values(InputType::kF32, InputType::kBF16),
                       ::testing::Values(Shape{1, 1}, Shape{1, 77}, Shape{77, 1}, Shape{31, 33},
                                         Shape{64, 96}, Shape{130, 257}, Shape{1024, 1000})),
    [](const auto& info) {
      const Shape shape = std::get<2>(info.param);
      return absl::StrCat(std::string(Fp8FormatName(std::get<0>(info.param))), "_",
                          std::get<1>(info.param) == InputType::kF32 ? "f32" : "bf16", "_",
                          shape.rows, "x", shape.cols);
    });

// --- the encoder against the hardware ---------------------------------------------------------

class EncoderTest : public CudaTest {};

TEST_F(EncoderTest, DeviceEncoderEqualsHardwareConversionOnAllFloats) {
  for (Fp8Format format : {Fp8Format::kE4M3, Fp8Format::kE5M2}) {
    absl::StatusOr<int64_t> mismatches = cuda_testing::CountEncodeMismatchesWithHardware(format);
    ASSERT_TRUE(mismatches.ok()) << mismatches.status();
    EXPECT_EQ(*mismatches, 0) << Fp8FormatName(format);
  }
}

// --- GEMMs -------------------------------------------------------------------------------------

struct GemmShape {
  int64_t m, n, k;
};
// cuBLASLt takes the multiples of 16 (and, for block scaling, K a multiple of 128); the others
// and E5M2 x E5M2 run the fallback kernel.
constexpr GemmShape kGemmShapes[] = {{1, 1, 1},       {17, 33, 65},   {128, 128, 128},
                                     {130, 257, 300}, {64, 256, 144}, {256, 512, 384},
                                     {48, 272, 1024}};

// kFastAccum: the automatic path with Fp8GemmArgs::fast_accum (the training forward's default).
enum class GemmPath { kAuto, kFallback, kFastAccum };

const char* PathName(GemmPath path) {
  switch (path) {
    case GemmPath::kAuto:
      return "_auto";
    case GemmPath::kFallback:
      return "_fallback";
    case GemmPath::kFastAccum:
      return "_fast_accum";
  }
  return "";
}
enum class GemmData { kExact, kRandom };

double Fp8Value(uint8_t code, Fp8Format format) {
  return static_cast<double>(DecodeFp8(code, format));
}

// FP8 codes of small integers (exact data) or of N(0, 1) values (random data).
std::vector<uint8_t> Fp8Operand(int64_t rows, int64_t cols, Fp8Format format, GemmData data,
                                uint32_t seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::uniform_int_distribution<int> small(-2, 2);
  std::vector<uint8_t> codes(static_cast<size_t>(rows * cols));
  for (auto& c : codes) {
    const float v = data == GemmData::kExact ? static_cast<float>(small(rng)) : normal(rng) * 4.0f;
    c = EncodeFp8(v, format);
  }
  return codes;
}

// Scales: powers of two between 2^-3 and 2^3 (exact data) or arbitrary positive values, so that
// a scale applied to the wrong block changes the result.
std::vector<float> Scales(int64_t count, GemmData data, uint32_t seed) {
  std::mt19937 rng(seed);
  std::uniform_int_distribution<int> exponent(-3, 3);
  std::uniform_real_distribution<float> uniform(0.05f, 3.0f);
  std::vector<float> s(static_cast<size_t>(count));
  for (auto& v : s) v = data == GemmData::kExact ? std::ldexp(1.0f, exponent(rng)) : uniform(rng);
  return s;
}

float OutputValue(const std::vector<uint8_t>& d, int64_t i, OutputType type) {
  if (type == OutputType::kF32) {
    float v;
    std::memcpy(&v, d.data() + i * 4, 4);
    return v;
  }
  uint16_t b;
  std::memcpy(&b, d.data() + i * 2, 2);
  return Bf16ToFloat(b);
}

// Compares the GPU and CPU outputs: bit for bit on exact data, else within
// (cpu_bound + gpu_bound) * S (+ BF16 roundings), S from the decoded operands.
void CompareGemm(const std::vector<uint8_t>& gpu, const std::vector<uint8_t>& cpu,
                 const std::vector<double>& abs_sum, OutputType out, GemmData data,
                 double cpu_bound, double gpu_bound, const std::string& where) {
  const int64_t count = static_cast<int64_t>(abs_sum.size());
  int64_t bad = 0;
  for (int64_t i = 0; i < count && bad < 5; ++i) {
    const float g = OutputValue(gpu, i, out), c = OutputValue(cpu, i, out);
    if (data == GemmData::kExact) {
      if (g != c) {  // +0 == -0: the sign of an exact zero depends on the summation order
        ADD_FAILURE() << where << ": element " << i << " is " << g << " on the GPU, " << c
                      << " on the CPU (exact data)";
        ++bad;
      }
      continue;
    }
    double tol = (cpu_bound + gpu_bound) * abs_sum[static_cast<size_t>(i)];
    if (out == OutputType::kBF16) tol += std::ldexp(std::fabs(g) + std::fabs(c), -8);
    if (!(std::fabs(static_cast<double>(g) - c) <= tol)) {
      ADD_FAILURE() << where << ": element " << i << " is " << g << " on the GPU, " << c
                    << " on the CPU, allowed difference " << tol;
      ++bad;
    }
  }
}

double HighamBound(int64_t k) { return 2.0 * static_cast<double>(k + 8) * std::ldexp(1.0, -24); }

class Fp8GemmTest
    : public CudaTest,
      public ::testing::WithParamInterface<std::tuple<std::pair<Fp8Format, Fp8Format>, GemmShape,
                                                      GemmScaling, OutputType, GemmPath>> {};

TEST_P(Fp8GemmTest, MatchesTheCpuBackend) {
  const auto [formats, shape, scaling, out, path] = GetParam();
  const auto [a_format, b_format] = formats;
  const int64_t m = shape.m, n = shape.n, k = shape.k;
  const int64_t kb = (k + 127) / 128, nb = (n + 127) / 128;
  const bool block = scaling == GemmScaling::kBlock;
  cuda_testing::ForceGemmFallback(path == GemmPath::kFallback);
  const size_t out_bytes = static_cast<size_t>(m * n) * (out == OutputType::kF32 ? 4 : 2);
  const bool fast = path == GemmPath::kFastAccum;
  for (GemmData data : {GemmData::kExact, GemmData::kRandom}) {
    // Without promotion the tensor cores' sums are not exact even on small integers.
    if (fast && data == GemmData::kExact) continue;
    for (bool accumulate : {false, true}) {
      if (accumulate && out != OutputType::kF32) continue;
      const std::string where = absl::StrCat(data == GemmData::kExact ? "exact" : "random",
                                             accumulate ? ", accumulate" : "");
      const std::vector<uint8_t> a = Fp8Operand(m, k, a_format, data, 1);
      const std::vector<uint8_t> b = Fp8Operand(n, k, b_format, data, 2);
      const std::vector<float> sa = Scales(block ? m * kb : 1, data, 3);
      const std::vector<float> sb = Scales(block ? nb * kb : 1, data, 4);
      std::vector<float> d0(static_cast<size_t>(m * n));  // previous D for accumulate
      std::mt19937 rng(5);
      std::uniform_int_distribution<int> small(-8, 8);
      for (auto& v : d0) v = static_cast<float>(small(rng));
      std::vector<uint8_t> cpu_d(out_bytes, 0);
      if (accumulate) std::memcpy(cpu_d.data(), d0.data(), out_bytes);

      Fp8GemmArgs args;
      args.m = m;
      args.n = n;
      args.k = k;
      args.a_format = a_format;
      args.b_format = b_format;
      args.scaling = scaling;
      args.out_type = out;
      args.accumulate = accumulate;
      args.fast_accum = fast;  // the CPU sums in FP32 either way
      Fp8GemmArgs c = args;
      c.a = a.data();
      c.b = b.data();
      c.a_scale_inv = sa.data();
      c.b_scale_inv = sb.data();
      c.d = cpu_d.data();
      std::vector<uint8_t> cpu_ws(GemmWorkspaceBytes(c) + 64);
      c.workspace = cpu_ws.data() + (64 - reinterpret_cast<uintptr_t>(cpu_ws.data()) % 64) % 64;
      c.workspace_bytes = GemmWorkspaceBytes(c);
      ASSERT_TRUE(cpu_.gemm_fp8(c, {}).ok());

      const DeviceBuffer d_a = Upload(a), d_b = Upload(b), d_sa = Upload(sa), d_sb = Upload(sb);
      DeviceBuffer d_d(out_bytes);
      if (accumulate) {
        ASSERT_EQ(cudaMemcpy(d_d.as(), d0.data(), out_bytes, cudaMemcpyHostToDevice), cudaSuccess);
      }
      const size_t ws_bytes = CudaGemmWorkspaceBytes(args) + kCublasLtWorkspaceBytes;
      DeviceBuffer ws(ws_bytes);
      Fp8GemmArgs g = args;
      g.a = d_a.as<uint8_t>();
      g.b = d_b.as<uint8_t>();
      g.a_scale_inv = d_sa.as<float>();
      g.b_scale_inv = d_sb.as<float>();
      g.d = d_d.as();
      g.workspace = ws.as();
      g.workspace_bytes = ws_bytes;
      const cuda_testing::GemmPathCounts before = cuda_testing::GetGemmPathCounts();
      const absl::Status s = gpu_->gemm_fp8(g, stream());
      ASSERT_TRUE(s.ok()) << s;
      Sync();
      const cuda_testing::GemmPathCounts after = cuda_testing::GetGemmPathCounts();
      const bool used_lt = after.cublaslt > before.cublaslt;
      // The paths the backend documents: cuBLASLt for aligned E4M3 x E4M3 with tensor scales
      // on any FP8 GPU; never when the fallback is forced or the shape is ragged.
      if (path == GemmPath::kFallback || m % 16 != 0 || n % 16 != 0 || k % 16 != 0 ||
          (a_format == Fp8Format::kE5M2 && b_format == Fp8Format::kE5M2)) {
        EXPECT_FALSE(used_lt) << where;
      } else if (!block && a_format == Fp8Format::kE4M3 && b_format == Fp8Format::kE4M3) {
        EXPECT_TRUE(used_lt) << where << ": cuBLASLt declined an aligned E4M3 GEMM";
      }

      // S = sum_k |sa a| |sb b| (+ |D0| for accumulate), in double: |A| and |B| decoded and
      // scaled once (per 1x128 tile / 128x128 block with block scaling), then dot products.
      std::vector<double> abs_sum(static_cast<size_t>(m * n));
      if (data == GemmData::kRandom) {
        std::vector<double> abs_a(a.size()), abs_b(b.size());
        for (int64_t i = 0; i < m; ++i) {
          for (int64_t l = 0; l < k; ++l) {
            abs_a[i * k + l] = std::fabs(Fp8Value(a[i * k + l], a_format)) *
                               (block ? sa[i * kb + l / 128] : sa[0]);
          }
        }
        for (int64_t j = 0; j < n; ++j) {
          for (int64_t l = 0; l < k; ++l) {
            abs_b[j * k + l] = std::fabs(Fp8Value(b[j * k + l], b_format)) *
                               (block ? sb[(j / 128) * kb + l / 128] : sb[0]);
          }
        }
        for (int64_t i = 0; i < m; ++i) {
          for (int64_t j = 0; j < n; ++j) {
            double sum = accumulate ? std::fabs(d0[static_cast<size_t>(i * n + j)]) : 0.0;
            for (int64_t l = 0; l < k; ++l) sum += abs_a[i * k + l] * abs_b[j * k + l];
            abs_sum[static_cast<size_t>(i * n + j)] = sum;
          }
        }
      }
      // cuBLASLt's FP8 tensor cores keep fewer bits than FP32 (2^-8 of S with promotion); fast
      // accumulation (tensor scaling only) rounds more (DeepSeek-V3 saw up to ~2% of the result
      // at K 4096): 2^-6 of S, still far below what a wrong scale or layout gives.
      const double gpu_bound = used_lt ? std::ldexp(1.0, fast && !block ? -6 : -8) : HighamBound(k);
      CompareGemm(Download<uint8_t>(d_d, out_bytes), cpu_d, abs_sum, out, data, HighamBound(k),
                  gpu_bound, where + (used_lt ? " (cuBLASLt)" : " (fallback kernel)"));
      if (HasFailure()) return;
    }
  }
}

INSTANTIATE_TEST_SUITE_P(
    All, Fp8GemmTest,
    ::testing::Combine(::testing::Values(std::pair{Fp8Format::kE4M3, Fp8Format::kE4M3},
                                         std::pair{Fp8Format::kE4M3, Fp8Format::kE5M2},
                                         std::pair{Fp8Format::kE5M2, Fp8Format::kE4M3},
                                         std::pair{Fp8Format::kE5M2, Fp8Format::kE5M2}),
                       ::testing::ValuesIn(kGemmShapes),
                       ::testing::Values(GemmScaling::kTensor, GemmScaling::kBlock),
                       ::testing::Values(OutputType::kF32, OutputType::kBF16),
                       ::testing::Values(GemmPath::kAuto, GemmPath::kFallback,
                                         GemmPath::kFastAccum)),
    [](const auto& info) {
      const auto formats = std::get<0>(info.param);
      const GemmShape s = std::get<1>(info.param);
      return absl::StrCat(std::string(Fp8FormatName(formats.first)), "x",
                          std::string(Fp8FormatName(formats.second)), "_", s.m, "x", s.n, "x", s.k,
                          std::get<2>(info.param) == GemmScaling::kTensor ? "_tensor" : "_block",
                          std::get<3>(info.param) == OutputType::kF32 ? "_f32out" : "_bf16out",
                          PathName(std::get<4>(info.param)));
    });

// kMx32 (OCP MX v1.0 E8M0 scales per 1x32 block of K, issue 20): the CUDA backend against the
// CPU backend on the same codes and scales, within the FP32-summation bound of each; shapes with
// whole and partial 32-blocks, both output types, E4M3 and E5M2 operands.
TEST_F(CudaTest, Mx32GemmMatchesTheCpuBackend) {
  struct Case {
    int64_t m, n, k;
    Fp8Format a_format, b_format;
    OutputType out;
  };
  for (const Case& t :
       {Case{17, 33, 65, Fp8Format::kE4M3, Fp8Format::kE4M3, OutputType::kF32},
        Case{128, 256, 192, Fp8Format::kE4M3, Fp8Format::kE5M2, OutputType::kF32},
        Case{128, 256, 192, Fp8Format::kE4M3, Fp8Format::kE4M3, OutputType::kBF16},
        Case{64, 48, 100, Fp8Format::kE5M2, Fp8Format::kE4M3, OutputType::kF32},
        // K a multiple of 128: cuBLASLt's VEC32_UE8M0 mode on compute
        // capability 10.0+, the fallback kernel before.
        Case{256, 128, 256, Fp8Format::kE4M3, Fp8Format::kE4M3, OutputType::kBF16},
        Case{128, 256, 384, Fp8Format::kE5M2, Fp8Format::kE4M3, OutputType::kF32}}) {
    const std::string where = absl::StrCat(t.m, "x", t.n, "x", t.k);
    const int64_t kb = (t.k + 31) / 32;
    const std::vector<uint8_t> a = Fp8Operand(t.m, t.k, t.a_format, GemmData::kRandom, 11);
    const std::vector<uint8_t> b = Fp8Operand(t.n, t.k, t.b_format, GemmData::kRandom, 12);
    std::mt19937 rng(13);
    std::uniform_int_distribution<int> code(120, 134);  // 2^-7 .. 2^7
    std::vector<uint8_t> ea(static_cast<size_t>(t.m * kb)), eb(static_cast<size_t>(t.n * kb));
    for (auto& e : ea) e = static_cast<uint8_t>(code(rng));
    for (auto& e : eb) e = static_cast<uint8_t>(code(rng));
    const size_t out_bytes = static_cast<size_t>(t.m * t.n) * (t.out == OutputType::kF32 ? 4 : 2);
    Fp8GemmArgs args;
    args.m = t.m;
    args.n = t.n;
    args.k = t.k;
    args.a_format = t.a_format;
    args.b_format = t.b_format;
    args.scaling = GemmScaling::kMx32;
    args.out_type = t.out;
    Fp8GemmArgs c = args;
    std::vector<uint8_t> cpu_d(out_bytes, 0);
    c.a = a.data();
    c.b = b.data();
    c.a_e8m0 = ea.data();
    c.b_e8m0 = eb.data();
    c.d = cpu_d.data();
    std::vector<uint8_t> cpu_ws(GemmWorkspaceBytes(c) + 64);
    c.workspace = cpu_ws.data() + (64 - reinterpret_cast<uintptr_t>(cpu_ws.data()) % 64) % 64;
    c.workspace_bytes = GemmWorkspaceBytes(c);
    ASSERT_TRUE(cpu_.gemm_fp8(c, {}).ok()) << where;

    const DeviceBuffer d_a = Upload(a), d_b = Upload(b), d_ea = Upload(ea), d_eb = Upload(eb);
    DeviceBuffer d_d(out_bytes);
    const size_t ws_bytes = CudaGemmWorkspaceBytes(args) + kCublasLtWorkspaceBytes;
    DeviceBuffer ws(ws_bytes);
    Fp8GemmArgs g = args;
    g.a = d_a.as<uint8_t>();
    g.b = d_b.as<uint8_t>();
    g.a_e8m0 = d_ea.as<uint8_t>();
    g.b_e8m0 = d_eb.as<uint8_t>();
    g.d = d_d.as();
    g.workspace = ws.as();
    g.workspace_bytes = ws_bytes;
    ASSERT_TRUE(gpu_->gemm_fp8(g, stream()).ok()) << where;
    Sync();
    // S = sum_k |a 2^(ea-127)| |b 2^(eb-127)| in double.
    std::vector<double> abs_sum(static_cast<size_t>(t.m * t.n));
    for (int64_t i = 0; i < t.m; ++i) {
      for (int64_t j = 0; j < t.n; ++j) {
        double sum = 0.0;
        for (int64_t l = 0; l < t.k; ++l) {
          sum += std::fabs(Fp8Value(a[i * t.k + l], t.a_format)) *
                 std::ldexp(1.0, ea[i * kb + l / 32] - 127) *
                 std::fabs(Fp8Value(b[j * t.k + l], t.b_format)) *
                 std::ldexp(1.0, eb[j * kb + l / 32] - 127);
        }
        abs_sum[static_cast<size_t>(i * t.n + j)] = sum;
      }
    }
    CompareGemm(Download<uint8_t>(d_d, out_bytes), cpu_d, abs_sum, t.out, GemmData::kRandom,
                HighamBound(t.k), HighamBound(t.k), where + " (mx32)");
    if (HasFailure()) return;
  }
}

// MXFP8 on cuBLASLt (VEC32_UE8M0, its scales rearranged by LaunchMx32ScaleLayout): Blackwell and
// later. Correctness is Mx32GemmMatchesTheCpuBackend's (its K % 128 cases take this path there);
// this checks that the path is taken, so that a layout cuBLASLt refuses does not hide behind the
// fallback kernel.
// Points `g` (shape and scaling set) at the device operands a, b, their scales sa, sb (FP32
// tensor or block scales, or E8M0 codes with mx32 scaling) and the output d, and at a workspace
// of the size the backend wants, which it returns.
DeviceBuffer PointAt(Fp8GemmArgs& g, const DeviceBuffer& a, const DeviceBuffer& b,
                     const DeviceBuffer& sa, const DeviceBuffer& sb, const DeviceBuffer& d) {
  const size_t ws_bytes = CudaGemmWorkspaceBytes(g) + kCublasLtWorkspaceBytes;
  DeviceBuffer ws(ws_bytes);
  g.a = a.as<uint8_t>();
  g.b = b.as<uint8_t>();
  if (g.scaling == GemmScaling::kMx32) {
    g.a_e8m0 = sa.as<uint8_t>();
    g.b_e8m0 = sb.as<uint8_t>();
  } else {
    g.a_scale_inv = sa.as<float>();
    g.b_scale_inv = sb.as<float>();
  }
  g.d = d.as();
  g.workspace = ws.as();
  g.workspace_bytes = ws_bytes;
  return ws;
}

TEST_F(CudaTest, Mx32GemmOnBlackwellRunsOnCublasLt) {
  int device = 0, major = 0;
  ASSERT_EQ(cudaGetDevice(&device), cudaSuccess);
  ASSERT_EQ(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device), cudaSuccess);
  if (major < 10) {
    GTEST_SKIP() << "cuBLASLt's VEC32_UE8M0 (MXFP8) scale mode needs compute capability 10.0 or "
                    "later; this GPU runs mx32 on the fallback kernel";
  }
  const int64_t m = 256, n = 512, k = 384, kb = k / 32;
  const DeviceBuffer a = Upload(Fp8Operand(m, k, Fp8Format::kE4M3, GemmData::kRandom, 1));
  const DeviceBuffer b = Upload(Fp8Operand(n, k, Fp8Format::kE4M3, GemmData::kRandom, 2));
  const DeviceBuffer ea = Upload(std::vector<uint8_t>(static_cast<size_t>(m * kb), 127));
  const DeviceBuffer eb = Upload(std::vector<uint8_t>(static_cast<size_t>(n * kb), 128));
  DeviceBuffer d(static_cast<size_t>(m * n) * 2);
  Fp8GemmArgs g;
  g.m = m;
  g.n = n;
  g.k = k;
  g.scaling = GemmScaling::kMx32;
  g.out_type = OutputType::kBF16;
  const DeviceBuffer ws = PointAt(g, a, b, ea, eb, d);
  const cuda_testing::GemmPathCounts before = cuda_testing::GetGemmPathCounts();
  ASSERT_TRUE(gpu_->gemm_fp8(g, stream()).ok());
  Sync();
  EXPECT_GT(cuda_testing::GetGemmPathCounts().cublaslt, before.cublaslt)
      << "cuBLASLt declined VEC32_UE8M0 scaling for " << m << "x" << n << "x" << k;
}

TEST_F(CudaTest, BlockScaledGemmOnHopperRunsOnCublasLt) {
  int device = 0, major = 0;
  ASSERT_EQ(cudaGetDevice(&device), cudaSuccess);
  ASSERT_EQ(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device), cudaSuccess);
  if (major != 9) GTEST_SKIP() << "cuBLASLt's 128-block scale modes are Hopper's";
  const int64_t m = 256, n = 512, k = 384;
  const DeviceBuffer a = Upload(Fp8Operand(m, k, Fp8Format::kE4M3, GemmData::kRandom, 1));
  const DeviceBuffer b = Upload(Fp8Operand(n, k, Fp8Format::kE4M3, GemmData::kRandom, 2));
  const DeviceBuffer sa = Upload(Scales(m * 3, GemmData::kRandom, 3));
  const DeviceBuffer sb = Upload(Scales(4 * 3, GemmData::kRandom, 4));
  DeviceBuffer d(static_cast<size_t>(m * n) * 4);
  // Correctness of both outputs is Fp8GemmTest's; this checks which path they take. The backend
  // promises cuBLASLt for BF16 output, the training case; FP32 output is recorded.
  for (OutputType out : {OutputType::kBF16, OutputType::kF32}) {
    Fp8GemmArgs g;
    g.m = m;
    g.n = n;
    g.k = k;
    g.scaling = GemmScaling::kBlock;
    g.out_type = out;
    const DeviceBuffer ws = PointAt(g, a, b, sa, sb, d);
    const cuda_testing::GemmPathCounts before = cuda_testing::GetGemmPathCounts();
    ASSERT_TRUE(gpu_->gemm_fp8(g, stream()).ok());
    Sync();
    const bool used_lt = cuda_testing::GetGemmPathCounts().cublaslt > before.cublaslt;
    if (out == OutputType::kBF16) {
      EXPECT_TRUE(used_lt) << "cuBLASLt declined VEC128 x BLK128x128 block scaling, BF16 output";
    } else {
      RecordProperty("block_scaled_f32_output_on_cublaslt", used_lt ? "yes" : "no");
      std::printf("block-scaled FP8 GEMM with FP32 output runs on %s\n",
                  used_lt ? "cuBLASLt" : "the fallback kernel");
    }
  }
}

// B given as K x N (Fp8GemmArgs::b_transposed) is the CPU's: the CUDA table says it does not take
// it, and a call that passes it anyway is refused as Unimplemented before anything is launched
// (the model then transposes, as it does for cuBLASLt's TN layout).
TEST_F(CudaTest, BGivenAsKxNIsRefusedAndNotAdvertised) {
  EXPECT_FALSE(gpu_->gemm_fp8_takes_b_transposed);
  EXPECT_TRUE(cpu_.gemm_fp8_takes_b_transposed);
  const int64_t m = 32, n = 64, k = 64;
  const DeviceBuffer a = Upload(Fp8Operand(m, k, Fp8Format::kE4M3, GemmData::kRandom, 1));
  const DeviceBuffer b = Upload(Fp8Operand(k, n, Fp8Format::kE4M3, GemmData::kRandom, 2));
  const DeviceBuffer sa = Upload(Scales(1, GemmData::kRandom, 3));
  const DeviceBuffer sb = Upload(Scales(1, GemmData::kRandom, 4));
  const std::vector<float> poison(static_cast<size_t>(m * n), 7.0f);
  const DeviceBuffer d = Upload(poison);
  Fp8GemmArgs g;
  g.m = m;
  g.n = n;
  g.k = k;
  g.b_transposed = true;
  const DeviceBuffer ws = PointAt(g, a, b, sa, sb, d);
  const absl::Status s = gpu_->gemm_fp8(g, stream());
  EXPECT_EQ(s.code(), absl::StatusCode::kUnimplemented) << s;
  EXPECT_NE(s.message().find("b_transposed"), std::string::npos) << s;
  Sync();
  EXPECT_EQ(Download<float>(d, poison.size()), poison) << "D was written";
}

class Bf16GemmTest
    : public CudaTest,
      public ::testing::WithParamInterface<
          std::tuple<std::pair<InputType, InputType>, GemmShape, OutputType, GemmPath>> {};

TEST_P(Bf16GemmTest, MatchesTheCpuBackend) {
  const auto [types, shape, out, path] = GetParam();
  const int64_t m = shape.m, n = shape.n, k = shape.k;
  cuda_testing::ForceGemmFallback(path == GemmPath::kFallback);
  const size_t out_bytes = static_cast<size_t>(m * n) * (out == OutputType::kF32 ? 4 : 2);
  for (GemmData data : {GemmData::kExact, GemmData::kRandom}) {
    std::mt19937 rng(7);
    std::normal_distribution<float> normal(0.0f, 1.0f);
    std::uniform_int_distribution<int> small(-8, 8);
    auto make = [&](int64_t count) {
      std::vector<float> v(static_cast<size_t>(count));
      for (auto& x : v) x = data == GemmData::kExact ? static_cast<float>(small(rng)) : normal(rng);
      return v;
    };
    const std::vector<float> a32 = make(m * k), b32 = make(n * k);
    const std::vector<uint8_t> a = InputBytes(a32, types.first), b = InputBytes(b32, types.second);
    Bf16GemmArgs args;
    args.m = m;
    args.n = n;
    args.k = k;
    args.a_type = types.first;
    args.b_type = types.second;
    args.out_type = out;
    Bf16GemmArgs c = args;
    std::vector<uint8_t> cpu_d(out_bytes, 0);
    c.a = a.data();
    c.b = b.data();
    c.d = cpu_d.data();
    std::vector<uint8_t> cpu_ws(GemmWorkspaceBytes(c) + 64);
    c.workspace = cpu_ws.data() + (64 - reinterpret_cast<uintptr_t>(cpu_ws.data()) % 64) % 64;
    c.workspace_bytes = GemmWorkspaceBytes(c);
    ASSERT_TRUE(cpu_.gemm_bf16(c, {}).ok());

    const DeviceBuffer d_a = Upload(a), d_b = Upload(b);
    DeviceBuffer d_d(out_bytes);
    const size_t ws_bytes = CudaGemmWorkspaceBytes(args) + kCublasLtWorkspaceBytes;
    DeviceBuffer ws(ws_bytes);
    Bf16GemmArgs g = args;
    g.a = d_a.as();
    g.b = d_b.as();
    g.d = d_d.as();
    g.workspace = ws.as();
    g.workspace_bytes = ws_bytes;
    const cuda_testing::GemmPathCounts before = cuda_testing::GetGemmPathCounts();
    const absl::Status s = gpu_->gemm_bf16(g, stream());
    ASSERT_TRUE(s.ok()) << s;
    Sync();
    const bool used_lt = cuda_testing::GetGemmPathCounts().cublaslt > before.cublaslt;
    if (path == GemmPath::kFallback) {
      EXPECT_FALSE(used_lt);
    }

    // S from the BF16 operands both backends multiply (FP32 inputs rounded to nearest even,
    // BF16 inputs as given).
    auto abs_bf16 = [](const std::vector<uint8_t>& bytes, InputType type) {
      const size_t count = type == InputType::kF32 ? bytes.size() / 4 : bytes.size() / 2;
      std::vector<double> out(count);
      for (size_t i = 0; i < count; ++i) {
        uint16_t h;
        if (type == InputType::kF32) {
          float f;
          std::memcpy(&f, bytes.data() + 4 * i, 4);
          h = FloatToBf16(f);
        } else {
          std::memcpy(&h, bytes.data() + 2 * i, 2);
        }
        out[i] = std::fabs(static_cast<double>(Bf16ToFloat(h)));
      }
      return out;
    };
    const std::vector<double> abs_a = abs_bf16(a, types.first), abs_b = abs_bf16(b, types.second);
    std::vector<double> abs_sum(static_cast<size_t>(m * n));
    for (int64_t i = 0; i < m; ++i) {
      for (int64_t j = 0; j < n; ++j) {
        double sum = 0.0;
        for (int64_t l = 0; l < k; ++l) sum += abs_a[i * k + l] * abs_b[j * k + l];
        abs_sum[static_cast<size_t>(i * n + j)] = sum;
      }
    }
    const double gpu_bound = used_lt ? 2.0 * HighamBound(k) : HighamBound(k);
    CompareGemm(Download<uint8_t>(d_d, out_bytes), cpu_d, abs_sum, out, data, HighamBound(k),
                gpu_bound,
                absl::StrCat(data == GemmData::kExact ? "exact" : "random",
                             used_lt ? " (cuBLASLt)" : " (fallback kernel)"));
    if (HasFailure()) return;
  }
}

INSTANTIATE_TEST_SUITE_P(
    All, Bf16GemmTest,
    ::testing::Combine(::testing::Values(std::pair{InputType::kF32, InputType::kF32},
                                         std::pair{InputType::kBF16, InputType::kF32},
                                         std::pair{InputType::kBF16, InputType::kBF16}),
                       ::testing::Values(GemmShape{1, 1, 1}, GemmShape{17, 33, 65},
                                         GemmShape{130, 257, 300}, GemmShape{256, 512, 384}),
                       ::testing::Values(OutputType::kF32, OutputType::kBF16),
                       ::testing::Values(GemmPath::kAuto, GemmPath::kFallback)),
    [](const auto& info) {
      const auto types = std::get<0>(info.param);
      const GemmShape s = std::get<1>(info.param);
      return absl::StrCat(types.first == InputType::kF32 ? "f32" : "bf16", "x",
                          types.second == InputType::kF32 ? "f32" : "bf16", "_", s.m, "x", s.n, "x",
                          s.k, std::get<2>(info.param) == OutputType::kF32 ? "_f32out" : "_bf16out",
                          PathName(std::get<3>(info.param)));
    });

class F32GemmTest : public CudaTest, public ::testing::WithParamInterface<GemmShape> {};

TEST_P(F32GemmTest, MatchesTheCpuBackendWithTf32Off) {
  const GemmShape shape = GetParam();
  const int64_t m = shape.m, n = shape.n, k = shape.k;
  std::mt19937 rng(9);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::vector<float> a(static_cast<size_t>(m * k)), b(static_cast<size_t>(n * k)),
      d0(static_cast<size_t>(m * n));
  for (auto* v : {&a, &b, &d0}) {
    for (auto& x : *v) x = normal(rng);
  }
  for (bool accumulate : {false, true}) {
    std::vector<float> cpu_d = accumulate ? d0 : std::vector<float>(d0.size(), 0.0f);
    F32GemmArgs c;
    c.m = m;
    c.n = n;
    c.k = k;
    c.a = a.data();
    c.b = b.data();
    c.d = cpu_d.data();
    c.accumulate = accumulate;
    ASSERT_TRUE(cpu_.gemm_f32(c, {}).ok());
    const DeviceBuffer d_a = Upload(a), d_b = Upload(b);
    const DeviceBuffer d_d = Upload(accumulate ? d0 : std::vector<float>(d0.size(), 0.0f));
    F32GemmArgs g = c;
    g.a = d_a.as<float>();
    g.b = d_b.as<float>();
    g.d = d_d.as<float>();
    const absl::Status s = gpu_->gemm_f32(g, stream());
    ASSERT_TRUE(s.ok()) << s;
    Sync();
    const std::vector<float> gpu_d = Download<float>(d_d, d0.size());
    double err2 = 0.0, ref2 = 0.0;
    for (int64_t i = 0; i < m; ++i) {
      for (int64_t j = 0; j < n; ++j) {
        double abs_sum = accumulate ? std::fabs(d0[static_cast<size_t>(i * n + j)]) : 0.0;
        for (int64_t l = 0; l < k; ++l) {
          abs_sum += std::fabs(static_cast<double>(a[i * k + l]) * b[j * k + l]);
        }
        const size_t at = static_cast<size_t>(i * n + j);
        const double diff = std::fabs(static_cast<double>(gpu_d[at]) - cpu_d[at]);
        // Products are rounded here (FP32 operands), which gamma_K covers: 2 (K+8) 2^-24 each.
        ASSERT_LE(diff, 2.0 * HighamBound(k) * abs_sum) << "element " << at;
        err2 += diff * diff;
        ref2 += static_cast<double>(cpu_d[at]) * cpu_d[at];
      }
    }
    // TF32 (10-bit mantissa inputs) would put the relative RMS difference near 3e-4
    // (METHOD.md's figure); FP32 in two orders stays near sqrt(K) 2^-24 ~ 1e-6.
    if (ref2 > 0.0) {
      EXPECT_LT(std::sqrt(err2 / ref2), 1e-5) << "TF32 on?";
    }
  }
}

INSTANTIATE_TEST_SUITE_P(All, F32GemmTest,
                         ::testing::Values(GemmShape{1, 1, 1}, GemmShape{17, 33, 65},
                                           GemmShape{256, 512, 384}, GemmShape{512, 256, 1024}),
                         [](const auto& info) {
                           return absl::StrCat(info.param.m, "x", info.param.n, "x", info.param.k);
                         });

// --- arguments ---------------------------------------------------------------------------------

class ArgumentTest : public CudaTest {};

TEST_F(ArgumentTest, HostPointersAreRefusedNamingTheField) {
  std::vector<float> host(64, 1.0f);
  std::vector<uint8_t> host_codes(64);
  DeviceBuffer codes(64), scale_inv(4);
  QuantizeArgs a;
  a.input = host.data();  // host memory: must not reach a kernel
  a.rows = 8;
  a.cols = 8;
  a.codes = codes.as<uint8_t>();
  a.scale_inv = scale_inv.as<float>();
  absl::Status s = gpu_->quantize(a, stream());
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(std::string(s.message()).find("input"), std::string::npos) << s;
  const DeviceBuffer input = Upload(host);
  a.input = input.as();
  a.codes = host_codes.data();
  s = gpu_->quantize(a, stream());
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(std::string(s.message()).find("codes"), std::string::npos) << s;
  // The context is still healthy.
  a.codes = codes.as<uint8_t>();
  EXPECT_TRUE(gpu_->quantize(a, stream()).ok());
  Sync();
}

TEST_F(ArgumentTest, GemmWorkspaceIsCheckedAgainstTheCudaRequirement) {
  Fp8GemmArgs g;
  g.m = 64;
  g.n = 256;
  g.k = 256;
  g.scaling = GemmScaling::kBlock;
  DeviceBuffer a(64 * 256), b(256 * 256), sa(64 * 2 * 4), sb(2 * 2 * 4), d(64 * 256 * 4);
  g.a = a.as<uint8_t>();
  g.b = b.as<uint8_t>();
  g.a_scale_inv = sa.as<float>();
  g.b_scale_inv = sb.as<float>();
  g.d = d.as();
  DeviceBuffer ws(CudaGemmWorkspaceBytes(g));
  g.workspace = ws.as();
  g.workspace_bytes = CudaGemmWorkspaceBytes(g) - 1;
  EXPECT_EQ(gpu_->gemm_fp8(g, stream()).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_GT(CudaGemmWorkspaceBytes(g), 0u);
  Fp8GemmArgs t = g;
  t.scaling = GemmScaling::kTensor;
  EXPECT_EQ(CudaGemmWorkspaceBytes(t), 0u);
}

// CudaDevicePciBusId (how the ranks of a host tell their GPUs apart, runtime/worker/
// device_placement.h): each visible device's id is the one its PCI domain, bus and device
// attributes spell, in cudaDeviceGetPCIBusId's "dddd:bb:dd.f" form, and no two devices share one.
TEST_F(CudaTest, PciBusIdsNameEachVisibleDeviceByItsPciAttributes) {
  const int count = CudaDeviceCount(nullptr);
  std::vector<std::string> seen;
  for (int d = 0; d < count; ++d) {
    absl::StatusOr<std::string> id = CudaDevicePciBusId(d);
    ASSERT_TRUE(id.ok()) << id.status();
    int domain = -1, bus = -1, device = -1;
    ASSERT_EQ(cudaDeviceGetAttribute(&domain, cudaDevAttrPciDomainId, d), cudaSuccess);
    ASSERT_EQ(cudaDeviceGetAttribute(&bus, cudaDevAttrPciBusId, d), cudaSuccess);
    ASSERT_EQ(cudaDeviceGetAttribute(&device, cudaDevAttrPciDeviceId, d), cudaSuccess);
    unsigned got_domain = 0, got_bus = 0, got_device = 0, got_function = 0;
    ASSERT_EQ(
        std::sscanf(id->c_str(), "%x:%x:%x.%x", &got_domain, &got_bus, &got_device, &got_function),
        4)
        << "device " << d << ": " << *id;
    EXPECT_EQ(got_domain, static_cast<unsigned>(domain)) << "device " << d << ": " << *id;
    EXPECT_EQ(got_bus, static_cast<unsigned>(bus)) << "device " << d << ": " << *id;
    EXPECT_EQ(got_device, static_cast<unsigned>(device)) << "device " << d << ": " << *id;
    std::string got = *id;
    std::transform(got.begin(), got.end(), got.begin(),
                   [](unsigned char c) { return static_cast<char>(std::tolower(c)); });
    EXPECT_EQ(std::count(seen.begin(), seen.end(), got), 0) << "device " << d << ": " << *id;
    seen.push_back(got);
  }
  EXPECT_EQ(CudaDevicePciBusId(count).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(CudaDevicePciBusId(-1).status().code(), absl::StatusCode::kInvalidArgument);
}

TEST(CudaOpsWithoutDeviceTest, PciBusIdSaysWhyThereIsNone) {
  std::string why;
  if (CudaDeviceCount(&why) > 0) GTEST_SKIP() << "a CUDA device is present";
  absl::StatusOr<std::string> id = CudaDevicePciBusId(0);
  ASSERT_FALSE(id.ok());
  EXPECT_EQ(id.status().code(), absl::StatusCode::kUnavailable);
  EXPECT_NE(std::string(id.status().message()).find(why), std::string::npos) << id.status();
}

TEST(CudaOpsWithoutDeviceTest, SaysWhyItIsUnavailable) {
  std::string why;
  if (CudaDeviceCount(&why) > 0) GTEST_SKIP() << "a CUDA device is present";
  absl::StatusOr<const OpTable*> ops = CudaOps();
  ASSERT_FALSE(ops.ok());
  EXPECT_EQ(ops.status().code(), absl::StatusCode::kUnavailable);
  EXPECT_NE(std::string(ops.status().message()).find(why), std::string::npos) << ops.status();
}

}  // namespace
}  // namespace fp8rt::kernels
