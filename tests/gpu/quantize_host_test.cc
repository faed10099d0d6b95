// The CUDA quantize, dequantize, amax, convert and cast-transpose kernels
// (kernels/cuda/quantize_cuda.cu, with the reductions of kernels/cuda/device_math.cuh) run on the
// CPU: their own source, compiled here as host code over the block emulator of host_cuda.h, and
// held to the CPU backend bit for bit, as ops_cuda_test holds them on a GPU. Needs no GPU and no
// CUDA runtime, only CUDA's headers, so it runs in every CI pass (issue 23: the current-scaling
// path, the scale from an amax in device memory, has not run on a GPU).
//
// What it shows: the kernels' indexing over persistent grids (two emulated multiprocessors, so
// blocks loop over many items), the vector and scalar loads, the block and warp reductions of
// the statistics and amaxes (shared memory, shuffles, one atomic per block), the 32x32 tiles of
// the cast-transpose, the epilogues, and the entries' launch code. The emulator runs each warp as
// far as CUDA allows and its lanes in a random order, so a missing barrier changes the results.
//
// Index:
//   QuantizeHostTest (TEST_P)  format x granularity x input type, over shapes, four value
//                              distributions and three scale options: codes, scales, statistics
//                              and the dequantized values equal the CPU's
//   QuantizeHostTest.UnalignedInputGivesTheSameResult   the scalar loads
//   QuantizeHostTest.ScaleFromADeviceAmaxMatchesTheCpu  QuantizeArgs::scale_amax
//   AmaxHostTest, ConvertHostTest, CastTransposeHostTest  the other entries against the CPU's
#include <gtest/gtest.h>

#include <cstdint>
#include <limits>
#include <random>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "kernels/formats.h"
#include "kernels/ops.h"
#include "kernels/quantize.h"
#include "tests/gpu/host_cuda.h"  // first: it defines what the kernels' source needs
#include "tests/gpu/quantize_data.h"

// The kernels' file, compiled here under another namespace name (host_cuda_backend.h).
// The stand-ins first (host_cuda_backend.h refuses to come after the file).
// clang-format off
#define cuda_internal host_cuda_internal
#include "tests/gpu/host_cuda_backend.h"
#include "kernels/cuda/quantize_cuda.cu"  // NOLINT(build/include): the kernels under test
#undef cuda_internal
// clang-format on

namespace fp8rt::kernels {
namespace {

namespace device = host_cuda_internal;
using quantize_data::Bits;
using quantize_data::Dist;
using quantize_data::DistName;
using quantize_data::ExpectBitsEqual;
using quantize_data::ExpectSameQuantizeResult;
using quantize_data::ExpectSameStats;
using quantize_data::GranularityTestName;
using quantize_data::InputBytes;
using quantize_data::kConvertSpecials;
using quantize_data::kDists;
using quantize_data::kScaleAmaxes;
using quantize_data::MakeData;
using quantize_data::QuantizeResult;
using quantize_data::ScaleCases;

const OpTable& Cpu() { return CpuOps(); }

struct Shape {
  int64_t rows, cols;
};
// Ragged edges both ways, a single value, whole 128 x 128 blocks, and counts that are not a
// multiple of the vector width (8).
constexpr Shape kShapes[] = {{1, 1}, {3, 200}, {31, 33}, {128, 128}, {130, 257}, {2, 4099}};

// One quantize of `input`, then a dequantize of its codes, by the CPU table or the kernels.
QuantizeResult RunQuantize(bool kernels, const QuantizeArgs& base, const void* input) {
  const ScaleGrid grid = GetScaleGrid(base.granularity, base.rows, base.cols);
  const size_t n = static_cast<size_t>(base.rows * base.cols);
  QuantizeResult r;
  r.codes.assign(n, 0xAB);
  r.scale_inv.assign(static_cast<size_t>(grid.size()), -7.0f);
  r.e8m0.assign(static_cast<size_t>(grid.size()), 0xCD);
  r.stats.count = -5;
  QuantizeArgs a = base;
  a.input = input;
  a.codes = r.codes.data();
  a.scale_inv = r.scale_inv.data();
  a.e8m0_scales = r.e8m0.data();
  a.stats = &r.stats;
  const absl::Status q = kernels ? device::QuantizeCuda(a, {}) : Cpu().quantize(a, {});
  EXPECT_TRUE(q.ok()) << q;
  r.dequant.assign(n, -3.0f);
  DequantizeArgs d;
  d.format = a.format;
  d.granularity = a.granularity;
  d.codes = r.codes.data();
  d.rows = a.rows;
  d.cols = a.cols;
  d.scale_inv = r.scale_inv.data();
  d.e8m0_scales = r.e8m0.data();
  d.output = r.dequant.data();
  const absl::Status dq = kernels ? device::DequantizeCuda(d, {}) : Cpu().dequantize(d, {});
  EXPECT_TRUE(dq.ok()) << dq;
  return r;
}

class QuantizeHostTest
    : public ::testing::TestWithParam<std::tuple<Fp8Format, Granularity, InputType>> {};

TEST_P(QuantizeHostTest, MatchesTheCpuBitForBit) {
  const auto [format, granularity, type] = GetParam();
  const bool mx = granularity == Granularity::kMx32;
  for (const Shape& shape : kShapes) {
    for (Dist dist : kDists) {
      const std::vector<uint8_t> bytes =
          InputBytes(MakeData(dist, shape.rows * shape.cols,
                              static_cast<uint32_t>(shape.rows * 31 + shape.cols)),
                     type);
      for (const auto& [a, option] :
           ScaleCases(format, granularity, type, shape.rows, shape.cols)) {
        ExpectSameQuantizeResult(
            RunQuantize(true, a, bytes.data()), RunQuantize(false, a, bytes.data()), mx,
            absl::StrCat(shape.rows, "x", shape.cols, ", ", DistName(dist), ", ", option));
        if (HasFailure()) return;  // one report per parameter set is enough
      }
    }
  }
}

INSTANTIATE_TEST_SUITE_P(
    All, QuantizeHostTest,
    ::testing::Combine(::testing::Values(Fp8Format::kE4M3, Fp8Format::kE5M2),
                       ::testing::Values(Granularity::kTensor, Granularity::kRow,
                                         Granularity::kTile1x128, Granularity::kBlock128x128,
                                         Granularity::kMx32),
                       ::testing::Values(InputType::kF32, InputType::kBF16)),
    [](const auto& info) {
      return absl::StrCat(std::string(Fp8FormatName(std::get<0>(info.param))), "_",
                          GranularityTestName(std::get<1>(info.param)), "_",
                          std::get<2>(info.param) == InputType::kF32 ? "f32" : "bf16");
    });

// Inputs one element past a 16-byte boundary take the kernels' scalar loads.
TEST(QuantizeHostTest, UnalignedInputGivesTheSameResult) {
  const int64_t rows = 33, cols = 301;
  const std::vector<float> x = MakeData(Dist::kSpecials, rows * cols, 5);
  for (InputType type : {InputType::kF32, InputType::kBF16}) {
    for (Granularity g : {Granularity::kTensor, Granularity::kRow, Granularity::kMx32}) {
      const size_t elem = type == InputType::kF32 ? 4 : 2;
      const std::vector<uint8_t> bytes = InputBytes(x, type);
      std::vector<uint8_t> shifted(16 + elem, 0);
      shifted.insert(shifted.end(), bytes.begin(), bytes.end());
      const void* input = shifted.data() + 16 + elem;
      ASSERT_NE(reinterpret_cast<uintptr_t>(input) % 16, 0u);
      QuantizeArgs a;
      a.granularity = g;
      a.input_type = type;
      a.rows = rows;
      a.cols = cols;
      ExpectSameQuantizeResult(RunQuantize(true, a, input), RunQuantize(false, a, bytes.data()),
                               g == Granularity::kMx32, GranularityTestName(g));
    }
  }
}

// Current scaling across ranks: the scale from an amax the op reads from device memory, for
// kScaleAmaxes (subnormal, huge, zero, negative, non-finite), with margins and power-of-two
// scales.
TEST(QuantizeHostTest, ScaleFromADeviceAmaxMatchesTheCpu) {
  const int64_t rows = 37, cols = 300;
  const std::vector<float> x = MakeData(Dist::kNormal, rows * cols, 5);
  for (const auto& [margin, pow2] :
       {std::pair{0, false}, std::pair{3, false}, std::pair{0, true}, std::pair{3, true}}) {
    for (Fp8Format format : {Fp8Format::kE4M3, Fp8Format::kE5M2}) {
      for (float amax : kScaleAmaxes) {
        QuantizeArgs a;
        a.format = format;
        a.rows = rows;
        a.cols = cols;
        a.scale_amax = &amax;
        a.margin = margin;
        a.power_of_two_scales = pow2;
        ExpectSameQuantizeResult(RunQuantize(true, a, x.data()), RunQuantize(false, a, x.data()),
                                 false,
                                 absl::StrCat(std::string(Fp8FormatName(format)), " amax ", amax,
                                              " margin ", margin, " pow2 ", pow2));
      }
    }
  }
}

TEST(AmaxHostTest, MatchesTheCpuBitForBit) {
  for (int64_t count : {int64_t{0}, int64_t{1}, int64_t{7}, int64_t{100003}}) {
    for (Dist dist : kDists) {
      const std::vector<float> x = MakeData(dist, count, static_cast<uint32_t>(count));
      for (InputType type : {InputType::kF32, InputType::kBF16}) {
        const std::vector<uint8_t> bytes = InputBytes(x, type);
        float cpu[2] = {-1.0f, -1.0f}, got[2] = {-2.0f, -2.0f};
        AmaxArgs a;
        a.input_type = type;
        a.input = bytes.data();
        a.count = count;
        a.amax = &cpu[0];
        a.finite_amax = &cpu[1];
        ASSERT_TRUE(Cpu().amax(a, {}).ok());
        a.amax = &got[0];
        a.finite_amax = &got[1];
        const absl::Status st = device::AmaxCuda(a, {});
        ASSERT_TRUE(st.ok()) << st;
        const std::string where = absl::StrCat(count, " values, ", DistName(dist));
        EXPECT_EQ(Bits(got[0]), Bits(cpu[0])) << where;
        EXPECT_EQ(Bits(got[1]), Bits(cpu[1])) << where;
      }
    }
  }
}

TEST(ConvertHostTest, BothDirectionsMatchTheCpuBitForBit) {
  std::mt19937 rng(11);
  const size_t n = (size_t{1} << 16) + 13;  // random patterns: NaNs, Infs, denormals included
  std::vector<uint32_t> bits(n);
  for (auto& b : bits) b = rng();
  std::copy(std::begin(kConvertSpecials), std::end(kConvertSpecials), bits.begin());
  std::vector<uint16_t> cpu16(n), got16(n, 0xFFFF);
  ConvertArgs c;
  c.from = InputType::kF32;
  c.to = InputType::kBF16;
  c.input = bits.data();
  c.count = static_cast<int64_t>(n);
  c.output = cpu16.data();
  ASSERT_TRUE(Cpu().convert(c, {}).ok());
  c.output = got16.data();
  ASSERT_TRUE(device::ConvertCuda(c, {}).ok());
  ExpectBitsEqual(got16, cpu16, "F32 -> BF16");
  std::vector<float> cpu32(n), got32(n, -1.0f);
  c.from = InputType::kBF16;
  c.to = InputType::kF32;
  c.input = cpu16.data();
  c.output = cpu32.data();
  ASSERT_TRUE(Cpu().convert(c, {}).ok());
  c.output = got32.data();
  ASSERT_TRUE(device::ConvertCuda(c, {}).ok());
  ExpectBitsEqual(got32, cpu32, "BF16 -> F32");
  std::vector<uint32_t> copy(n, 0);
  c.from = c.to = InputType::kF32;
  c.input = bits.data();
  c.output = copy.data();
  ASSERT_TRUE(device::ConvertCuda(c, {}).ok());
  ExpectBitsEqual(copy, bits, "F32 copy");
}

class CastTransposeHostTest
    : public ::testing::TestWithParam<std::tuple<Fp8Format, InputType, Shape>> {};

TEST_P(CastTransposeHostTest, MatchesTheCpuBitForBit) {
  const auto [format, type, shape] = GetParam();
  const size_t n = static_cast<size_t>(shape.rows * shape.cols);
  for (Dist dist : kDists) {
    const std::vector<uint8_t> bytes =
        InputBytes(MakeData(dist, shape.rows * shape.cols, 17), type);
    struct Out {
      std::vector<uint8_t> codes, codes_t;
      float scale_inv = -1.0f;
      QuantStats stats;
    } cpu, got;
    for (Out* o : {&cpu, &got}) {
      o->codes.assign(n, 0xAB);
      o->codes_t.assign(n, 0xCD);
      CastTransposeArgs a;
      a.format = format;
      a.input_type = type;
      a.input = bytes.data();
      a.rows = shape.rows;
      a.cols = shape.cols;
      a.scale = GetFp8Info(format).max / 8.0f;
      a.codes = o->codes.data();
      a.codes_t = o->codes_t.data();
      a.scale_inv = &o->scale_inv;
      a.stats = &o->stats;
      const absl::Status st =
          o == &cpu ? Cpu().cast_transpose(a, {}) : device::CastTransposeCuda(a, {});
      ASSERT_TRUE(st.ok()) << st;
    }
    const std::string where = DistName(dist);
    ExpectBitsEqual(got.codes, cpu.codes, where + ": codes");
    ExpectBitsEqual(got.codes_t, cpu.codes_t, where + ": codes_t");
    EXPECT_EQ(Bits(got.scale_inv), Bits(cpu.scale_inv)) << where;
    ExpectSameStats(got.stats, cpu.stats, where);
  }
}

INSTANTIATE_TEST_SUITE_P(All, CastTransposeHostTest,
                         ::testing::Combine(::testing::Values(Fp8Format::kE4M3, Fp8Format::kE5M2),
                                            ::testing::Values(InputType::kF32, InputType::kBF16),
                                            ::testing::Values(Shape{1, 1}, Shape{1, 77},
                                                              Shape{77, 1}, Shape{31, 33},
                                                              Shape{64, 96}, Shape{130, 257})),
                         [](const auto& info) {
                           const Shape shape = std::get<2>(info.param);
                           return absl::StrCat(
                               std::string(Fp8FormatName(std::get<0>(info.param))), "_",
                               std::get<1>(info.param) == InputType::kF32 ? "f32" : "bf16", "_",
                               shape.rows, "x", shape.cols);
                         });

}  // namespace
}  // namespace fp8rt::kernels
