// Tests of the FP8-aware collectives (parallel/fp8_collectives.h) over the MPI backend, run by
// ctest under mpirun with 2 and 4 ranks.
//
// Every rank generates the same data from one seeded hash (Unit(), Signed()), so each rank can
// compute, on its own, the reference for the whole group: the unsharded weight quantized by the
// op table in one piece, the spec formula (scale = fp8_max / amax / 2^margin, code =
// EncodeFp8(x * scale), EncodeFp8 being the scalar conversion that is tested bit for bit against
// NVIDIA's cuda_fp8.h), sums of every rank's contribution in double precision, tokens
// regenerated from their ids.
//
// Index:
//   QuantizeFp8ShardFromAmaxTest  the scale from an amax in backend memory: the spec's (power of
//                           two when asked, 1 when non-finite); the codes a given scale gives
//   SyncAmaxesTest          MAX over ranks, bit exact; NaN/Inf on one rank reach every rank and
//                           are reported; one i32 all-reduce; subgroups (through the op table)
//   GatherFp8WeightTest     (TEST_P) format x {tensor-given, tensor-current, 128x128 blocks} x
//                           shape: codes and scales equal to quantizing the unsharded weight,
//                           identical on every rank; statistics; bytes sent
//   GatherFp8WeightMiscTest NaN/Inf in one shard poisons the shared amax; bad arguments
//   Mx32ShardGatherTest     MXFP8: each rank's QuantizeMx32Shard, then StartGatherFp8Shard:
//                           codes, e8m0, col_codes, col_e8m0 on every rank bit for bit equal to
//                           a reference quantization of the unsharded weight written here from
//                           OCP MX v1.0 (no library helper), partial 1x32 blocks, both formats;
//                           bytes sent; rows not a multiple of 32 refused
//   GatherBf16Test          exact round to nearest even, specials (blocking and started)
//   ReduceScatterGradTest   FP32 and BF16 sums within the bounds below, exact for integer
//                           data; accumulate adds, no-accumulate overwrites
//   TokenAllToAllTest       (TEST_P) format x hidden x count pattern (uneven, zero, all to one
//                           rank, none): FP8 dispatch then BF16 combine returns every token to
//                           its origin; codes and 1x128 scales equal to quantizing the tokens
//   TokenCountsTest         count exchange; bad counts rejected before any collective
//   BytesTest               FP8 / BF16 bytes of the MoE dispatch and of the FSDP gather (<= 0.52)
//
// Tolerances (everything else is compared bit for bit):
//   FP32 reduce-scatter: the backend may add the n contributions in any order; each of the n - 1
//     FP32 additions has a relative error <= u = 2^-24 of its partial sum, so
//     |got - exact| <= (n - 1) * u * sum|x_r| * (1 + n u).
//   BF16 reduce-scatter: each contribution is rounded to BF16 (relative error <= 2^-8, the BF16
//     unit roundoff for 8 significant bits), then each of the n - 1 reduction steps adds in FP32
//     (error <= 2^-24) and rounds to BF16 (<= 2^-8) a partial sum bounded by sum|x_r| (1 + 2^-8)^k,
//     so |got - exact| <= n * (2^-8 + 2^-24) * sum|x_r| * (1 + 2^-8)^n; and got is a BF16 value.
//   With small-integer data every partial sum is exact in both formats, so those tests are exact.
#include "parallel/fp8_collectives.h"

#include <algorithm>
#include <bit>
#include <cfloat>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <limits>
#include <memory>
#include <ostream>
#include <set>
#include <span>
#include <string>
#include <type_traits>
#include <vector>

#include "absl/status/status.h"
#include "gtest/gtest.h"
#include "kernels/device_array.h"
#include "kernels/formats.h"
#include "kernels/ops.h"
#include "kernels/quantize.h"
#include "parallel/communicator.h"
#include "tests/mpi/mpi_test_env.h"

namespace fp8rt::parallel {
namespace {

namespace env = ::fp8rt::parallel::testing;
using kernels::Fp8Format;
using kernels::Granularity;

Communicator& World() { return env::Factory().World(); }
const kernels::OpTable& Ops() { return kernels::CpuOps(); }

// ---------------------------------------------------------------------------------------------
// Helpers.

// A collective verdict on a status: passes on every rank iff the status is OK on every rank, so
// that ASSERT_TRUE(AllOk(s)) makes all ranks leave a test together.
::testing::AssertionResult AllOk(const absl::Status& status) {
  if (env::AllRanksOk(status.ok())) return ::testing::AssertionSuccess();
  return ::testing::AssertionFailure()
         << "not OK on every rank; here (rank " << World().rank() << "): " << status;
}

// splitmix64: the same deterministic stream on every rank.
uint64_t Mix(uint64_t x) {
  x += 0x9E3779B97F4A7C15ull;
  x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
  x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
  return x ^ (x >> 31);
}
// Uniform in [0, 1), a function of (seed, index) only.
double Unit(uint64_t seed, uint64_t index) {
  return static_cast<double>(Mix(Mix(seed) ^ index) >> 11) * 0x1p-53;
}
// Uniform in (-1, 1) times 2^e.
float Signed(uint64_t seed, uint64_t index, int e) {
  return static_cast<float>((2.0 * Unit(seed, index) - 1.0) * std::ldexp(1.0, e));
}

uint32_t Bits(float x) { return std::bit_cast<uint32_t>(x); }
float Fp8Max(Fp8Format f) { return f == Fp8Format::kE4M3 ? 448.0f : 57344.0f; }
std::string FormatName(Fp8Format f) { return f == Fp8Format::kE4M3 ? "E4M3" : "E5M2"; }

// Compares two arrays element by element (bitwise for floats), reporting the number of
// mismatches and the first one.
template <typename T>
::testing::AssertionResult SameBits(std::span<const T> got, std::span<const T> want) {
  if (got.size() != want.size()) {
    return ::testing::AssertionFailure() << "size " << got.size() << " != " << want.size();
  }
  int64_t bad = 0, first = -1;
  for (size_t i = 0; i < got.size(); ++i) {
    bool same;
    if constexpr (std::is_same_v<T, float>) {
      same = Bits(got[i]) == Bits(want[i]);
    } else {
      same = got[i] == want[i];
    }
    if (!same) {
      if (bad++ == 0) first = static_cast<int64_t>(i);
    }
  }
  if (bad == 0) return ::testing::AssertionSuccess();
  auto show = [](T v) -> std::string {
    if constexpr (std::is_same_v<T, float>) {
      char buf[64];
      std::snprintf(buf, sizeof buf, "%.9g (0x%08x)", static_cast<double>(v), Bits(v));
      return buf;
    } else {
      return std::to_string(static_cast<int64_t>(v));
    }
  };
  return ::testing::AssertionFailure()
         << bad << " of " << got.size() << " elements differ; first at " << first << ": got "
         << show(got[first]) << ", want " << show(want[first]);
}
template <typename T>
::testing::AssertionResult SameBits(const std::vector<T>& got, const std::vector<T>& want) {
  return SameBits(std::span<const T>(got), std::span<const T>(want));
}

// A host copy of an array the collectives returned, read after its backend's synchronize (as the
// collectives' contract asks; a no-op for the CPU ops these tests use).
template <typename T>
std::vector<T> Host(const kernels::DeviceArray<T>& a) {
  const absl::Status s = a.ops().layer->synchronize(kernels::Stream{});
  EXPECT_TRUE(s.ok()) << s;
  return std::vector<T>(a.begin(), a.end());
}

// The weight every rank can regenerate: values in (-2^e, 2^e) with e depending on the 128x128
// block (-8..+8), so that block scales differ, and exact zeros here and there.
std::vector<float> FullWeight(uint64_t seed, int64_t rows, int64_t cols) {
  std::vector<float> w(static_cast<size_t>(rows * cols));
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t c = 0; c < cols; ++c) {
      const int64_t i = r * cols + c;
      const int e = static_cast<int>((r / 128 * 5 + c / 128 * 3) % 17) - 8;
      w[i] = (Mix(seed + 7 * static_cast<uint64_t>(i)) % 61 == 0)
                 ? 0.0f
                 : Signed(seed, static_cast<uint64_t>(i), e);
    }
  }
  return w;
}

// Quantizes a whole matrix with the op table: the one-rank reference.
struct Quantized {
  std::vector<uint8_t> codes;
  std::vector<float> scale_inv;
};
Quantized QuantizeWhole(const std::vector<float>& x, int64_t rows, int64_t cols, Fp8Format format,
                        Granularity granularity, bool has_scale, float scale, int margin) {
  Quantized q;
  if (x.empty()) return q;  // the kernel wants a scale buffer even for an empty matrix
  q.codes.resize(x.size());
  q.scale_inv.resize(static_cast<size_t>(kernels::GetScaleGrid(granularity, rows, cols).size()));
  kernels::QuantizeArgs a;
  a.format = format;
  a.granularity = granularity;
  a.input = x.data();
  a.rows = rows;
  a.cols = cols;
  a.has_scale = has_scale;
  a.scale = scale;
  a.margin = margin;
  a.codes = q.codes.data();
  a.scale_inv = q.scale_inv.data();
  const absl::Status s = Ops().quantize(a, kernels::Stream{});
  EXPECT_TRUE(s.ok()) << s;
  return q;
}

std::vector<float> Dequantize(const std::vector<uint8_t>& codes,
                              const std::vector<float>& scale_inv, int64_t rows, int64_t cols,
                              Fp8Format format, Granularity granularity) {
  std::vector<float> out(codes.size());
  if (codes.empty()) return out;
  kernels::DequantizeArgs a;
  a.format = format;
  a.granularity = granularity;
  a.codes = codes.data();
  a.rows = rows;
  a.cols = cols;
  a.scale_inv = scale_inv.data();
  a.output = out.data();
  const absl::Status s = Ops().dequantize(a, kernels::Stream{});
  EXPECT_TRUE(s.ok()) << s;
  return out;
}

// The spec's scale: fp8_max / amax / 2^margin in FP32 (amax finite and > 0).
float SpecScale(float amax, Fp8Format format, int margin) {
  return Fp8Max(format) / amax / std::ldexp(1.0f, margin);
}

// Rank 0's copy of `v`, broadcast to every rank (to check that all ranks hold the same bytes).
template <typename T>
std::vector<T> FromRank0(const std::vector<T>& v, DType dtype) {
  std::vector<T> copy = v;
  const absl::Status s =
      World().Broadcast(copy.data(), static_cast<int64_t>(copy.size()), dtype, /*root=*/0);
  EXPECT_TRUE(AllOk(s));
  return copy;
}

// ---------------------------------------------------------------------------------------------
// QuantizeFp8ShardFromAmax: the shard quantized with the scale the op computes from an amax in
// the backend's memory (the model's current-scaled weights, after a stream-ordered max-reduce),
// which is the spec's fp8_max / amax / 2^margin (rounded down to a power of two when asked), and
// scale 1 for a non-finite amax; the codes those scales give, as a one-pass quantization with the
// scale given computes them.

TEST(QuantizeFp8ShardFromAmaxTest, TheSpecScaleOfTheGivenAmax) {
  const int64_t rows = 64, cols = 96;
  const std::vector<float> x = FullWeight(/*seed=*/41, rows, cols);
  struct Case {
    float amax;
    bool power_of_two;
    int margin;
  };
  // The shard's values lie in (-2^-8, 2^-8) (FullWeight's first block): the scale is the given
  // amax's, not the shard's own.
  for (const Fp8Format f : {Fp8Format::kE4M3, Fp8Format::kE5M2}) {
    for (const Case c :
         {Case{3.0f, false, 0}, Case{3.0f, false, 2}, Case{3.0f, true, 0}, Case{1000.0f, true, 1},
          Case{std::numeric_limits<float>::quiet_NaN(), false, 0}}) {
      SCOPED_TRACE(FormatName(f) + " amax " + std::to_string(c.amax) + " margin " +
                   std::to_string(c.margin) + (c.power_of_two ? " power of two" : ""));
      float want_scale = 1.0f;
      if (std::isfinite(c.amax)) {
        want_scale = SpecScale(c.amax, f, c.margin);
        if (c.power_of_two) want_scale = std::exp2(std::floor(std::log2(want_scale)));
      }
      kernels::DeviceArray<float> amax(Ops(), 1, c.amax);
      Fp8Shard out;
      ASSERT_TRUE(QuantizeFp8ShardFromAmax(Ops(), x.data(), rows, cols, f, amax.data(), c.margin,
                                           c.power_of_two, &out)
                      .ok());
      EXPECT_EQ(out.scale, 1.0f) << "the caller sets it once it has read the amax";
      const Quantized want =
          QuantizeWhole(x, rows, cols, f, Granularity::kTensor, true, want_scale, c.margin);
      EXPECT_TRUE(SameBits(Host(out.codes), want.codes)) << "codes";
      ASSERT_EQ(out.scale_inv.size(), 1u);
      EXPECT_EQ(Bits(Host(out.scale_inv)[0]), Bits(1.0f / want_scale)) << want_scale;
    }
  }
  Fp8Shard out;
  const absl::Status null = QuantizeFp8ShardFromAmax(Ops(), x.data(), rows, cols, Fp8Format::kE4M3,
                                                     nullptr, 0, false, &out);
  EXPECT_EQ(null.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(null.message().find("scale_amax"), std::string::npos) << null;
}

// ---------------------------------------------------------------------------------------------
// SyncAmaxes.

// Site i's amax on rank r: signs vary (|amax| is what is reduced), magnitudes from subnormals
// to 2^100, and zeros.
float RankAmax(int r, int i) {
  const uint64_t h = Mix(1000 * static_cast<uint64_t>(r) + static_cast<uint64_t>(i));
  if (h % 11 == 0) return 0.0f;
  const int e = static_cast<int>(h % 241) - 140;  // 2^-140 (subnormal) .. 2^100
  const float v = static_cast<float>(std::ldexp(1.0 + Unit(r, i), e));
  return (h >> 20) % 3 == 0 ? -v : v;
}

TEST(SyncAmaxesTest, EveryRankHoldsTheMaxOverRanksAfterOneI32AllReduce) {
  constexpr int kSites = 53;
  const int n = World().size(), rank = World().rank();
  std::vector<float> amaxes(kSites);
  for (int i = 0; i < kSites; ++i) amaxes[i] = RankAmax(rank, i);
  const CommStats before = World().stats();
  absl::StatusOr<std::vector<int>> bad = SyncAmaxes(World(), amaxes);
  const CommStats after = World().stats();
  ASSERT_TRUE(AllOk(bad.status()));
  EXPECT_TRUE(bad->empty());

  std::vector<float> want(kSites, 0.0f);
  for (int i = 0; i < kSites; ++i) {
    for (int r = 0; r < n; ++r) want[i] = std::max(want[i], std::fabs(RankAmax(r, i)));
  }
  EXPECT_TRUE(SameBits(amaxes, want));
  EXPECT_TRUE(SameBits(FromRank0(amaxes, DType::kF32), amaxes)) << "ranks disagree";

  // One collective for all sites: one i32 all-reduce of kSites values, nothing else.
  EXPECT_EQ(after.Calls(CollectiveOp::kAllReduce, DType::kI32) -
                before.Calls(CollectiveOp::kAllReduce, DType::kI32),
            1);
  EXPECT_EQ(after.Bytes(CollectiveOp::kAllReduce, DType::kI32) -
                before.Bytes(CollectiveOp::kAllReduce, DType::kI32),
            4 * kSites);
  EXPECT_EQ(after.TotalBytes() - before.TotalBytes(), 4 * kSites);
}

TEST(SyncAmaxesTest, NonFiniteAmaxOnOneRankReachesEveryRankAndIsReported) {
  const int n = World().size(), rank = World().rank(), last = n - 1;
  const float nan = std::numeric_limits<float>::quiet_NaN();
  const float inf = std::numeric_limits<float>::infinity();
  std::vector<float> amaxes(12);
  for (int i = 0; i < 12; ++i) amaxes[i] = 1.0f + static_cast<float>(i + rank);
  if (rank == last) amaxes[0] = nan;           // NaN on the last rank only
  if (rank == 0) amaxes[1] = inf;              // Inf on rank 0 only
  if (rank == 0) amaxes[2] = nan;              // NaN on one rank, Inf on another:
  if (rank == last && n > 1) amaxes[2] = inf;  //   NaN wins
  if (rank == 0) amaxes[3] = -nan;             // negative NaN
  if (rank == last) amaxes[4] = -inf;          // -Inf: |amax| = +Inf
  if (rank == last) amaxes[5] = std::bit_cast<float>(0x7F800001u);  // signalling-NaN bits
  if (rank == 0) amaxes[6] = FLT_MAX;                               // finite: not reported

  absl::StatusOr<std::vector<int>> bad = SyncAmaxes(World(), amaxes);
  ASSERT_TRUE(AllOk(bad.status()));
  EXPECT_EQ(*bad, (std::vector<int>{0, 1, 2, 3, 4, 5}));
  EXPECT_TRUE(std::isnan(amaxes[0]));
  EXPECT_EQ(amaxes[1], inf);
  EXPECT_TRUE(std::isnan(amaxes[2]));
  EXPECT_TRUE(std::isnan(amaxes[3]));
  EXPECT_EQ(amaxes[4], inf);
  EXPECT_TRUE(std::isnan(amaxes[5]));
  EXPECT_NE(Bits(amaxes[5]) & 0x00400000u, 0u) << "a signalling NaN must come back quiet";
  EXPECT_EQ(amaxes[6], FLT_MAX);
  for (int i = 7; i < 12; ++i) EXPECT_EQ(amaxes[i], static_cast<float>(i + n)) << "site " << i;
}

TEST(SyncAmaxesTest, EmptyIsANoOp) {
  const CommStats before = World().stats();
  absl::StatusOr<std::vector<int>> bad = SyncAmaxes(World(), std::span<float>());
  ASSERT_TRUE(AllOk(bad.status()));
  EXPECT_TRUE(bad->empty());
  EXPECT_EQ(World().stats().TotalBytes(), before.TotalBytes());
}

// Groups of the ranks of one parity (TP-like subgroups of the world): each group agrees on its
// own max and quantizes its own weight with it.
TEST(SyncAmaxesTest, SubgroupsReduceOverTheirMembersOnly) {
  const int n = World().size(), rank = World().rank();
  const int color = rank % 2;
  absl::StatusOr<std::unique_ptr<Communicator>> group =
      env::Factory().Split(color, /*key=*/rank, "parity");
  ASSERT_TRUE(AllOk(group.status()));
  Communicator& g = **group;
  std::vector<int> members;
  for (int r = color; r < n; r += 2) members.push_back(r);
  ASSERT_EQ(g.size(), static_cast<int>(members.size()));
  ASSERT_EQ(g.rank(), rank / 2);

  std::vector<float> amaxes(5);
  for (int i = 0; i < 5; ++i) amaxes[i] = RankAmax(rank, i);
  absl::StatusOr<std::vector<int>> bad = SyncAmaxes(g, amaxes);
  ASSERT_TRUE(AllOk(bad.status()));
  for (int i = 0; i < 5; ++i) {
    float want = 0.0f;
    for (int r : members) want = std::max(want, std::fabs(RankAmax(r, i)));
    EXPECT_EQ(Bits(amaxes[i]), Bits(want)) << "site " << i;
  }

  // A tensor-current FP8 gather over the subgroup uses the subgroup's amax only.
  constexpr int64_t kShardRows = 24, kCols = 40;
  const std::vector<float> full =
      FullWeight(77 + static_cast<uint64_t>(color), kShardRows * g.size(), kCols);
  Fp8GatherOptions options;
  options.scaling = WeightScaling::kTensorCurrent;
  absl::StatusOr<Fp8Weight> w = GatherFp8Weight(
      g, Ops(), full.data() + g.rank() * kShardRows * kCols, kShardRows, kCols, options);
  ASSERT_TRUE(AllOk(w.status()));
  const Quantized ref = QuantizeWhole(full, kShardRows * g.size(), kCols, options.format,
                                      Granularity::kTensor, false, 1.0f, 0);
  EXPECT_TRUE(SameBits(Host(w->codes), ref.codes));
  EXPECT_TRUE(SameBits(Host(w->scale_inv), ref.scale_inv));
}

// ---------------------------------------------------------------------------------------------
// GatherFp8Weight.

struct GatherCase {
  Fp8Format format;
  WeightScaling scaling;
  int64_t shard_rows;
  int64_t cols;
};

std::string GatherCaseName(const ::testing::TestParamInfo<GatherCase>& info) {
  const GatherCase& c = info.param;
  const char* s = c.scaling == WeightScaling::kTensorGiven     ? "TensorGiven"
                  : c.scaling == WeightScaling::kTensorCurrent ? "TensorCurrent"
                                                               : "Block128";
  return FormatName(c.format) + "_" + s + "_" + std::to_string(c.shard_rows) + "x" +
         std::to_string(c.cols);
}

void PrintTo(const GatherCase& c, std::ostream* os) {
  *os << GatherCaseName(::testing::TestParamInfo<GatherCase>(c, 0));
}

class GatherFp8WeightTest : public ::testing::TestWithParam<GatherCase> {};

TEST_P(GatherFp8WeightTest, EveryRankHoldsTheUnshardedWeightQuantizedWithTheSameScales) {
  const GatherCase& c = GetParam();
  const int n = World().size(), rank = World().rank();
  const int64_t rows = c.shard_rows * n;
  const std::vector<float> full = FullWeight(12345, rows, c.cols);
  const float* shard = full.data() + rank * c.shard_rows * c.cols;

  Fp8GatherOptions options;
  options.format = c.format;
  options.scaling = c.scaling;
  options.margin = c.scaling == WeightScaling::kTensorGiven ? 0 : 1;
  float full_amax = 0.0f, shard_amax = 0.0f;
  for (int64_t i = 0; i < rows * c.cols; ++i) {
    full_amax = std::max(full_amax, std::fabs(full[i]));
    if (i / (c.shard_rows * c.cols) == rank) shard_amax = std::max(shard_amax, std::fabs(full[i]));
  }
  // A given scale that makes the values above half the amax saturate.
  options.scale = 2.0f * Fp8Max(c.format) / full_amax;
  const CommStats before = World().stats();
  absl::StatusOr<Fp8Weight> w =
      GatherFp8Weight(World(), Ops(), shard, c.shard_rows, c.cols, options);
  const CommStats after = World().stats();
  ASSERT_TRUE(AllOk(w.status()));
  EXPECT_EQ(w->rows, rows);
  EXPECT_EQ(w->cols, c.cols);
  EXPECT_EQ(w->shard_stats.count, c.shard_rows * c.cols);

  // Reference 1: the unsharded weight quantized in one piece by the op table.
  const bool block = c.scaling == WeightScaling::kBlock128;
  const Granularity g = block ? Granularity::kBlock128x128 : Granularity::kTensor;
  const Quantized ref = QuantizeWhole(full, rows, c.cols, c.format, g,
                                      /*has_scale=*/c.scaling == WeightScaling::kTensorGiven,
                                      options.scale, options.margin);
  EXPECT_TRUE(SameBits(Host(w->codes), ref.codes)) << "codes";
  EXPECT_TRUE(SameBits(Host(w->scale_inv), ref.scale_inv)) << "scale_inv";

  // Reference 2: the spec, scale by scale and value by value with the scalar encoder.
  const kernels::ScaleGrid grid = kernels::GetScaleGrid(g, rows, c.cols);
  ASSERT_EQ(w->scale_inv.size(), static_cast<size_t>(grid.size()));
  std::vector<float> spec_scale(static_cast<size_t>(grid.size()));
  if (c.scaling == WeightScaling::kTensorGiven) {
    spec_scale[0] = options.scale;
  } else if (c.scaling == WeightScaling::kTensorCurrent) {
    spec_scale[0] = SpecScale(full_amax, c.format, options.margin);
  } else {
    for (int64_t br = 0; br < grid.rows; ++br) {
      for (int64_t bc = 0; bc < grid.cols; ++bc) {
        float amax = 0.0f;
        for (int64_t r = br * 128; r < std::min(rows, br * 128 + 128); ++r) {
          for (int64_t col = bc * 128; col < std::min(c.cols, bc * 128 + 128); ++col) {
            amax = std::max(amax, std::fabs(full[r * c.cols + col]));
          }
        }
        spec_scale[br * grid.cols + bc] = amax > 0.0f ? SpecScale(amax, c.format, 1) : 1.0f;
      }
    }
  }
  std::vector<float> spec_scale_inv(spec_scale.size());
  for (size_t b = 0; b < spec_scale.size(); ++b) spec_scale_inv[b] = 1.0f / spec_scale[b];
  EXPECT_TRUE(SameBits(Host(w->scale_inv), spec_scale_inv)) << "scale_inv vs the spec";
  std::vector<uint8_t> spec_codes(full.size());
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t col = 0; col < c.cols; ++col) {
      const int64_t b = block ? (r / 128) * grid.cols + col / 128 : 0;
      spec_codes[r * c.cols + col] =
          kernels::EncodeFp8(full[r * c.cols + col] * spec_scale[b], c.format);
    }
  }
  EXPECT_TRUE(SameBits(Host(w->codes), spec_codes)) << "codes vs the spec";
  if (c.scaling == WeightScaling::kTensorGiven) {
    // Saturation (quantize.h): x * scale rounds past the largest finite value, i.e.
    // |x * scale| > 464 for E4M3 (the midpoint of 448 and 480 rounds to even 448) and
    // >= 61440 for E5M2 (the midpoint of 57344 and 65536 rounds to even 65536).
    auto saturates = [&](float x) {
      const float y = std::fabs(x * options.scale);
      return c.format == Fp8Format::kE4M3 ? y > 464.0f : y >= 61440.0f;
    };
    int64_t in_shard = 0, in_full = 0;
    for (int64_t i = 0; i < rows * c.cols; ++i) {
      if (!saturates(full[i])) continue;
      ++in_full;
      if (i / (c.shard_rows * c.cols) == rank) ++in_shard;
    }
    EXPECT_GT(in_full, 0) << "the given scale was meant to saturate";
    EXPECT_EQ(w->shard_stats.saturated, in_shard);
  }

  // amax: the synced one for tensor-current, this shard's otherwise.
  EXPECT_EQ(w->amax, c.scaling == WeightScaling::kTensorCurrent ? full_amax : shard_amax);

  // Identical bytes on every rank.
  EXPECT_TRUE(SameBits(FromRank0(Host(w->codes), DType::kU8), Host(w->codes)))
      << "codes differ from rank 0";
  EXPECT_TRUE(SameBits(FromRank0(Host(w->scale_inv), DType::kF32), Host(w->scale_inv)))
      << "scales differ from rank 0";

  // What travelled: this shard's FP8 bytes, its block scales, and one i32 amax for current.
  const auto delta = [&](CollectiveOp op, DType d) {
    return after.Bytes(op, d) - before.Bytes(op, d);
  };
  EXPECT_EQ(delta(CollectiveOp::kAllGather, DType::kU8), c.shard_rows * c.cols);
  EXPECT_EQ(delta(CollectiveOp::kAllGather, DType::kF32), block ? 4 * grid.size() / n : 0);
  EXPECT_EQ(delta(CollectiveOp::kAllReduce, DType::kI32),
            c.scaling == WeightScaling::kTensorCurrent ? 4 : 0);
  EXPECT_EQ(delta(CollectiveOp::kAllGather, DType::kBF16), 0) << "never gathered in BF16";
}

INSTANTIATE_TEST_SUITE_P(
    All, GatherFp8WeightTest,
    ::testing::Values(GatherCase{Fp8Format::kE4M3, WeightScaling::kTensorGiven, 37, 53},
                      GatherCase{Fp8Format::kE5M2, WeightScaling::kTensorGiven, 37, 53},
                      GatherCase{Fp8Format::kE4M3, WeightScaling::kTensorCurrent, 37, 53},
                      GatherCase{Fp8Format::kE5M2, WeightScaling::kTensorCurrent, 37, 53},
                      GatherCase{Fp8Format::kE4M3, WeightScaling::kTensorCurrent, 128, 300},
                      GatherCase{Fp8Format::kE4M3, WeightScaling::kBlock128, 128, 300},
                      GatherCase{Fp8Format::kE5M2, WeightScaling::kBlock128, 128, 300},
                      GatherCase{Fp8Format::kE4M3, WeightScaling::kBlock128, 256, 128},
                      GatherCase{Fp8Format::kE5M2, WeightScaling::kBlock128, 256, 200}),
    GatherCaseName);

TEST(GatherFp8WeightMiscTest, NonFiniteValueInOneShardPoisonsTheSharedAmaxOnEveryRank) {
  const int n = World().size(), rank = World().rank();
  constexpr int64_t kShardRows = 8, kCols = 16;
  for (const float poison :
       {std::numeric_limits<float>::quiet_NaN(), std::numeric_limits<float>::infinity()}) {
    std::vector<float> full = FullWeight(99, kShardRows * n, kCols);
    full[(n - 1) * kShardRows * kCols + 5] = poison;  // in the last rank's shard
    Fp8GatherOptions options;
    options.scaling = WeightScaling::kTensorCurrent;
    absl::StatusOr<Fp8Weight> w = GatherFp8Weight(
        World(), Ops(), full.data() + rank * kShardRows * kCols, kShardRows, kCols, options);
    ASSERT_TRUE(AllOk(w.status()));
    if (std::isnan(poison)) {
      EXPECT_TRUE(std::isnan(w->amax)) << "rank " << rank << " amax " << w->amax;
    } else {
      EXPECT_EQ(w->amax, poison) << "rank " << rank;
    }
    // No usable scale: ComputeScale's fallback of 1, the same on every rank.
    EXPECT_EQ(Host(w->scale_inv), std::vector<float>{1.0f});
    EXPECT_EQ(w->codes[(n - 1) * kShardRows * kCols + 5],
              kernels::EncodeFp8(poison, options.format));
    EXPECT_EQ(w->shard_stats.nonfinite, rank == n - 1 ? 1 : 0);
  }
}

TEST(GatherFp8WeightMiscTest, BadArgumentsAreRejectedNamingTheField) {
  std::vector<float> shard(256 * 8, 1.0f);
  auto expect_invalid = [&](const float* data, int64_t shard_rows, int64_t cols,
                            const Fp8GatherOptions& o, const char* field) {
    absl::StatusOr<Fp8Weight> w = GatherFp8Weight(World(), Ops(), data, shard_rows, cols, o);
    EXPECT_EQ(w.status().code(), absl::StatusCode::kInvalidArgument) << field;
    EXPECT_NE(w.status().message().find(field), std::string::npos) << w.status();
  };
  Fp8GatherOptions current;
  expect_invalid(shard.data(), 0, 8, current, "shard_rows");
  expect_invalid(shard.data(), -3, 8, current, "shard_rows");
  expect_invalid(shard.data(), 4, 0, current, "cols");
  expect_invalid(nullptr, 4, 8, current, "shard");
  Fp8GatherOptions block;
  block.scaling = WeightScaling::kBlock128;
  expect_invalid(shard.data(), 100, 8, block, "shard_rows");
  Fp8GatherOptions given;
  given.scaling = WeightScaling::kTensorGiven;
  for (float bad : {0.0f, -1.0f, std::numeric_limits<float>::quiet_NaN(),
                    std::numeric_limits<float>::infinity()}) {
    given.scale = bad;
    expect_invalid(shard.data(), 4, 8, given, "scale");
  }
  Fp8GatherOptions margin;
  margin.margin = -1;
  expect_invalid(shard.data(), 4, 8, margin, "margin");
}

// ---------------------------------------------------------------------------------------------
// QuantizeMx32Shard + StartGatherFp8Shard (MXFP8).

// OCP MX v1.0 (section 6.3) and OFP8 v1.0, written here from the definitions (no library
// helper): a block of up to 32 values shares 2^e with e = floor(log2(amax)) - emax (8 E4M3,
// 15 E5M2), clamped to [-127, 127], -127 for an all-zero block, stored as the E8M0 code e + 127;
// each value is encoded as x / 2^e rounded to the nearest FP8 value (ties to the even code),
// |x / 2^e| >= max giving +-max (saturation), the sign kept.
int MxMantissaBits(Fp8Format f) { return f == Fp8Format::kE4M3 ? 3 : 2; }
double MxMagnitude(int code, Fp8Format f) {  // finite non-negative code, from its fields
  const int mbits = MxMantissaBits(f), bias = f == Fp8Format::kE4M3 ? 7 : 15;
  const int e = code >> mbits, m = code & ((1 << mbits) - 1);
  return e == 0 ? std::ldexp(m, 1 - bias - mbits) : std::ldexp((1 << mbits) + m, e - bias - mbits);
}
uint8_t MxEncode(double y, Fp8Format f) {
  const int max_code = f == Fp8Format::kE4M3 ? 0x7E : 0x7B;
  const uint8_t sign = std::signbit(y) ? 0x80 : 0x00;
  const double a = std::fabs(y);
  if (a >= MxMagnitude(max_code, f)) return static_cast<uint8_t>(sign | max_code);
  int lo = 0;  // the largest code whose value is <= a
  while (MxMagnitude(lo + 1, f) <= a) ++lo;
  const double below = a - MxMagnitude(lo, f), above = MxMagnitude(lo + 1, f) - a;
  const int code = below < above ? lo : above < below ? lo + 1 : (lo % 2 == 0 ? lo : lo + 1);
  return static_cast<uint8_t>(sign | code);
}
int MxExponent(float amax, Fp8Format f) {
  if (amax == 0.0f) return -127;
  return std::clamp(std::ilogb(amax) - (f == Fp8Format::kE4M3 ? 8 : 15), -127, 127);
}
// `count` blocks of up to 32 values, value j of block b at x[b * block_stride + j * stride]
// (j < len), into codes at the same places and one E8M0 code per block at e8m0[b * e_stride].
void MxQuantizeBlocks(const float* x, int64_t blocks, int64_t block_stride, int64_t len,
                      int64_t stride, Fp8Format f, uint8_t* codes, uint8_t* e8m0,
                      int64_t e_stride) {
  for (int64_t b = 0; b < blocks; ++b) {
    float amax = 0.0f;
    for (int64_t j = 0; j < len; ++j) {
      amax = std::max(amax, std::fabs(x[b * block_stride + j * stride]));
    }
    const int e = MxExponent(amax, f);
    e8m0[b * e_stride] = static_cast<uint8_t>(e + 127);
    for (int64_t j = 0; j < len; ++j) {
      const int64_t at = b * block_stride + j * stride;
      codes[at] = MxEncode(std::ldexp(static_cast<double>(x[at]), -e), f);  // x / 2^e, exact
    }
  }
}
// A rows x cols weight both ways (parallel::Fp8Weight): 1x32 blocks along each row (grid rows x
// ceil(cols/32)) and 32x1 blocks down each column (grid ceil(rows/32) x cols), in W's layout.
struct MxRef {
  std::vector<uint8_t> codes, e8m0, col_codes, col_e8m0;
};
MxRef MxQuantizeBoth(const std::vector<float>& w, int64_t rows, int64_t cols, Fp8Format f) {
  MxRef r;
  const int64_t cb = (cols + 31) / 32, rb = (rows + 31) / 32;
  r.codes.resize(w.size());
  r.col_codes.resize(w.size());
  r.e8m0.resize(static_cast<size_t>(rows * cb));
  r.col_e8m0.resize(static_cast<size_t>(rb * cols));
  for (int64_t row = 0; row < rows; ++row) {
    for (int64_t b = 0; b < cb; ++b) {
      const int64_t c0 = b * 32;
      MxQuantizeBlocks(w.data() + row * cols + c0, 1, 0, std::min<int64_t>(32, cols - c0), 1, f,
                       r.codes.data() + row * cols + c0, r.e8m0.data() + row * cb + b, 0);
    }
  }
  for (int64_t col = 0; col < cols; ++col) {
    for (int64_t b = 0; b < rb; ++b) {
      const int64_t r0 = b * 32;
      MxQuantizeBlocks(w.data() + r0 * cols + col, 1, 0, std::min<int64_t>(32, rows - r0), cols, f,
                       r.col_codes.data() + r0 * cols + col, r.col_e8m0.data() + b * cols + col, 0);
    }
  }
  return r;
}

// A weight every rank can regenerate: values in (-2^k, 2^k), k from the 32x32 tile (-6..6) and
// +3 on every fifth row, so that neighbouring blocks differ both ways; exact zeros in one 1x32
// block (row 1) and one 32x1 block (column 2), so that both grids hold the all-zero code 0.
std::vector<float> MxWeight(uint64_t seed, int64_t rows, int64_t cols) {
  std::vector<float> w(static_cast<size_t>(rows * cols));
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t c = 0; c < cols; ++c) {
      const int64_t i = r * cols + c;
      const int k = static_cast<int>((r / 32 * 5 + c / 32 * 3) % 13) - 6 + (r % 5 == 0 ? 3 : 0);
      const bool zero = (r == 1 && c < 32) || (c == 2 && r < 32);
      w[i] = zero ? 0.0f : Signed(seed, static_cast<uint64_t>(i), k);
    }
  }
  return w;
}

TEST(Mx32ShardGatherTest, EveryRankHoldsBothQuantizationsOfTheUnshardedWeight) {
  const int n = World().size(), rank = World().rank();
  struct Shape {
    int64_t shard_rows, cols;
  };
  // Partial 1x32 blocks at the end of each row (45 = 32 + 13, 70 = 64 + 6), and two 32-row
  // blocks per shard.
  for (const Shape s : {Shape{32, 45}, Shape{64, 70}}) {
    for (const Fp8Format format : {Fp8Format::kE4M3, Fp8Format::kE5M2}) {
      SCOPED_TRACE(::testing::Message()
                   << s.shard_rows << " x " << s.cols << " per rank, " << FormatName(format));
      const int64_t rows = s.shard_rows * n;
      const std::vector<float> full = MxWeight(777, rows, s.cols);
      const float* shard = full.data() + rank * s.shard_rows * s.cols;

      Fp8Shard fp8_shard;
      ASSERT_TRUE(AllOk(QuantizeMx32Shard(Ops(), shard, s.shard_rows, s.cols, format, &fp8_shard)));
      EXPECT_TRUE(fp8_shard.mx32);
      float shard_amax = 0.0f;
      for (int64_t i = 0; i < s.shard_rows * s.cols; ++i) {
        shard_amax = std::max(shard_amax, std::fabs(shard[i]));
      }
      EXPECT_EQ(fp8_shard.stats.amax, shard_amax);
      EXPECT_EQ(fp8_shard.stats.count, s.shard_rows * s.cols);

      Fp8Weight w;
      std::vector<std::unique_ptr<PendingCollective>> pending;
      const CommStats before = World().stats();
      ASSERT_TRUE(AllOk(StartGatherFp8Shard(World(), Ops(), fp8_shard, &w, &pending)));
      absl::Status waited = absl::OkStatus();
      for (std::unique_ptr<PendingCollective>& p : pending) waited.Update(p->Wait());
      ASSERT_TRUE(AllOk(waited));
      const CommStats after = World().stats();
      EXPECT_EQ(w.rows, rows);
      EXPECT_EQ(w.cols, s.cols);
      EXPECT_TRUE(w.scale_inv.empty()) << "mx32 has no scale_inv";

      const MxRef ref = MxQuantizeBoth(full, rows, s.cols, format);
      // The data has what the file comment promises: several scales and the all-zero code.
      const std::set<uint8_t> scales(ref.e8m0.begin(), ref.e8m0.end());
      const std::set<uint8_t> col_scales(ref.col_e8m0.begin(), ref.col_e8m0.end());
      EXPECT_GE(scales.size(), 4u);
      EXPECT_GE(col_scales.size(), 4u);
      EXPECT_EQ(scales.count(0) + col_scales.count(0), 2u);
      EXPECT_TRUE(SameBits(Host(w.codes), ref.codes)) << "codes";
      EXPECT_TRUE(SameBits(Host(w.e8m0), ref.e8m0)) << "e8m0";
      EXPECT_TRUE(SameBits(Host(w.col_codes), ref.col_codes)) << "col_codes";
      EXPECT_TRUE(SameBits(Host(w.col_e8m0), ref.col_e8m0)) << "col_e8m0";
      for (const kernels::DeviceArray<uint8_t>* a :
           {&w.codes, &w.e8m0, &w.col_codes, &w.col_e8m0}) {
        EXPECT_TRUE(SameBits(FromRank0(Host(*a), DType::kU8), Host(*a))) << "differs from rank 0";
      }
      // What travelled: this shard's two code copies and two E8M0 grids, all as bytes.
      EXPECT_EQ(after.Bytes(CollectiveOp::kAllGather, DType::kU8) -
                    before.Bytes(CollectiveOp::kAllGather, DType::kU8),
                static_cast<int64_t>(2 * s.shard_rows * s.cols +
                                     (ref.e8m0.size() + ref.col_e8m0.size()) / n));
    }
  }
}

TEST(Mx32ShardGatherTest, ShardRowsNotAMultipleOf32AreRefused) {
  const std::vector<float> data(64 * 8, 1.0f);
  for (const int64_t rows : {0, 16, 48, 33}) {
    Fp8Shard shard;
    const absl::Status s = QuantizeMx32Shard(Ops(), data.data(), rows, 8, Fp8Format::kE4M3, &shard);
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << rows << ": " << s;
    EXPECT_NE(s.message().find("multiple of 32"), std::string::npos) << s;
  }
}

// ---------------------------------------------------------------------------------------------
// GatherBf16.

// FP32 -> BF16 bits, round to nearest even, written here from the definition.
uint16_t RefBf16(float x) {
  const uint32_t b = Bits(x);
  const uint32_t lsb = (b >> 16) & 1u;
  return static_cast<uint16_t>((b + 0x7FFFu + lsb) >> 16);
}

// Blocking (GatherBf16) and started (StartGatherBf16, whose shard may change once it returns).
class GatherBf16Test : public ::testing::TestWithParam<bool> {};

TEST_P(GatherBf16Test, EveryRankHoldsEveryShardRoundedToNearestEven) {
  const bool started = GetParam();
  const int n = World().size(), rank = World().rank();
  constexpr int64_t kShard = 1001;
  std::vector<float> full(static_cast<size_t>(kShard * n));
  for (size_t i = 0; i < full.size(); ++i) {
    full[i] = Signed(5, i, static_cast<int>(i % 40) - 20);
  }
  // Specials in the last shard: ties to even both ways, -0, Inf, overflow to Inf, subnormals.
  const float specials[] = {1.00390625f /* 1 + 2^-8: tie, down to 1 */,
                            1.01171875f /* 1 + 3 * 2^-8: tie, up to 1 + 2^-6 */,
                            -0.0f,
                            std::numeric_limits<float>::infinity(),
                            FLT_MAX,
                            0x1p-140f,
                            -0x1.0181p-127f};
  float* last = full.data() + (n - 1) * kShard;
  std::copy(std::begin(specials), std::end(specials), last);
  last[10] = std::numeric_limits<float>::quiet_NaN();

  std::vector<uint16_t> want(full.size());
  for (size_t i = 0; i < full.size(); ++i) want[i] = RefBf16(full[i]);

  std::vector<uint16_t> got(full.size(), 0xDEAD);
  const CommStats before = World().stats();
  float* const shard = full.data() + rank * kShard;
  if (started) {
    absl::StatusOr<std::unique_ptr<PendingCollective>> gather =
        StartGatherBf16(World(), Ops(), shard, kShard, got.data());
    ASSERT_TRUE(AllOk(gather.status()));
    std::fill(shard, shard + kShard, 7.0f);  // the shard is free once the start returned
    ASSERT_TRUE(AllOk((*gather)->Wait()));
  } else {
    ASSERT_TRUE(AllOk(GatherBf16(World(), Ops(), shard, kShard, got.data())));
  }
  EXPECT_EQ(World().stats().Bytes(CollectiveOp::kAllGather, DType::kBF16) -
                before.Bytes(CollectiveOp::kAllGather, DType::kBF16),
            2 * kShard);
  const size_t nan_at = static_cast<size_t>((n - 1) * kShard + 10);
  EXPECT_EQ(got[nan_at] & 0x7F80, 0x7F80);
  EXPECT_NE(got[nan_at] & 0x007F, 0) << "NaN must stay NaN";
  got[nan_at] = want[nan_at] = 0;
  EXPECT_TRUE(SameBits(got, want));
  const size_t s = static_cast<size_t>((n - 1) * kShard);
  EXPECT_EQ(got[s + 0], 0x3F80);
  EXPECT_EQ(got[s + 1], 0x3F82);
  EXPECT_EQ(got[s + 2], 0x8000);
  EXPECT_EQ(got[s + 3], 0x7F80);
  EXPECT_EQ(got[s + 4], 0x7F80);
}

INSTANTIATE_TEST_SUITE_P(BlockingAndStarted, GatherBf16Test, ::testing::Bool(),
                         [](const ::testing::TestParamInfo<bool>& info) {
                           return info.param ? "Started" : "Blocking";
                         });

// ---------------------------------------------------------------------------------------------
// ReduceScatterGrad.

// Rank r's gradient for every element of the full parameter.
std::vector<float> RankGrad(int r, int64_t count, bool integers) {
  std::vector<float> g(static_cast<size_t>(count));
  for (int64_t i = 0; i < count; ++i) {
    const uint64_t seed = 400 + static_cast<uint64_t>(r);
    g[i] = integers ? static_cast<float>(static_cast<int64_t>(Mix(seed * 7919 + i) % 33) - 16)
                    : Signed(seed, static_cast<uint64_t>(i), static_cast<int>(i % 9) - 4);
  }
  return g;
}

struct GradRef {
  std::vector<double> sum;      // in double: error <= n * 2^-53 * sum|x|, negligible
  std::vector<double> abs_sum;  // sum |x_r|
};
GradRef ReferenceShard(int64_t shard, bool integers) {
  const int n = World().size(), rank = World().rank();
  GradRef ref{std::vector<double>(shard, 0.0), std::vector<double>(shard, 0.0)};
  for (int r = 0; r < n; ++r) {
    const std::vector<float> g = RankGrad(r, shard * n, integers);
    for (int64_t i = 0; i < shard; ++i) {
      ref.sum[i] += g[rank * shard + i];
      ref.abs_sum[i] += std::fabs(g[rank * shard + i]);
    }
  }
  return ref;
}

TEST(ReduceScatterGradTest, Fp32SumWithinSummationOrderBound) {
  const int n = World().size();
  constexpr int64_t kShard = 1031;
  const std::vector<float> mine = RankGrad(World().rank(), kShard * n, false);
  std::vector<float> got(kShard, std::numeric_limits<float>::quiet_NaN());
  ASSERT_TRUE(AllOk(ReduceScatterGrad(World(), Ops(), mine.data(), kShard, GradReduceDType::kFP32,
                                      /*accumulate=*/false, got.data())));
  const GradRef ref = ReferenceShard(kShard, false);
  const double u = 0x1p-24;
  int bad = 0;
  for (int64_t i = 0; i < kShard; ++i) {
    const double bound = (n - 1) * u * ref.abs_sum[i] * (1 + n * u);
    if (!(std::fabs(got[i] - ref.sum[i]) <= bound) && bad++ < 5) {
      ADD_FAILURE() << "element " << i << ": got " << got[i] << ", exact " << ref.sum[i]
                    << ", bound " << bound;
    }
  }
  EXPECT_EQ(bad, 0);
}

TEST(ReduceScatterGradTest, Bf16SumWithinBf16RoundingBound) {
  const int n = World().size();
  constexpr int64_t kShard = 1031;
  const std::vector<float> mine = RankGrad(World().rank(), kShard * n, false);
  std::vector<float> got(kShard, std::numeric_limits<float>::quiet_NaN());
  const CommStats before = World().stats();
  ASSERT_TRUE(AllOk(ReduceScatterGrad(World(), Ops(), mine.data(), kShard, GradReduceDType::kBF16,
                                      /*accumulate=*/false, got.data())));
  EXPECT_EQ(World().stats().Bytes(CollectiveOp::kReduceScatter, DType::kBF16) -
                before.Bytes(CollectiveOp::kReduceScatter, DType::kBF16),
            2 * kShard * n);
  const GradRef ref = ReferenceShard(kShard, false);
  const double ub = 0x1p-8, u = 0x1p-24;
  int bad = 0;
  for (int64_t i = 0; i < kShard; ++i) {
    const double bound = n * (ub + u) * ref.abs_sum[i] * std::pow(1 + ub, n);
    const bool representable = (Bits(got[i]) & 0xFFFFu) == 0;
    if (!(std::fabs(got[i] - ref.sum[i]) <= bound && representable) && bad++ < 5) {
      ADD_FAILURE() << "element " << i << ": got " << got[i] << ", exact " << ref.sum[i]
                    << ", bound " << bound << (representable ? "" : " (not a BF16 value)");
    }
  }
  EXPECT_EQ(bad, 0);
}

// Integer gradients in [-16, 16]: every partial sum is an integer below 2^8 in magnitude, exact
// in FP32 and BF16 whatever the order, so both paths must be exact; accumulate adds in FP32 and
// no-accumulate overwrites (NaN before).
TEST(ReduceScatterGradTest, ExactForIntegersAccumulateAddsAndOverwriteReplaces) {
  const int n = World().size();
  constexpr int64_t kShard = 517;
  const std::vector<float> mine = RankGrad(World().rank(), kShard * n, true);
  const GradRef ref = ReferenceShard(kShard, true);
  for (GradReduceDType dtype : {GradReduceDType::kFP32, GradReduceDType::kBF16}) {
    const char* name = dtype == GradReduceDType::kFP32 ? "fp32" : "bf16";
    std::vector<float> got(kShard, std::numeric_limits<float>::quiet_NaN());
    ASSERT_TRUE(
        AllOk(ReduceScatterGrad(World(), Ops(), mine.data(), kShard, dtype, false, got.data())));
    std::vector<float> want(kShard);
    for (int64_t i = 0; i < kShard; ++i) want[i] = static_cast<float>(ref.sum[i]);
    EXPECT_TRUE(SameBits(got, want)) << name << " overwrite";

    // Micro-batch accumulation: start from 0.5 * i, add the reduced gradient twice, the
    // temporaries in the caller's buffers (reused by the second call, as in a training loop).
    std::vector<float> acc(kShard), want_acc(kShard);
    for (int64_t i = 0; i < kShard; ++i) {
      acc[i] = 0.5f * static_cast<float>(i);
      want_acc[i] = acc[i] + 2.0f * want[i];
    }
    GradReduceBuffers kept;
    for (int step = 0; step < 2; ++step) {
      ASSERT_TRUE(AllOk(ReduceScatterGrad(World(), Ops(), mine.data(), kShard, dtype,
                                          /*accumulate=*/true, acc.data(), &kept)));
    }
    EXPECT_TRUE(SameBits(acc, want_acc)) << name << " accumulate";
    EXPECT_EQ(kept.reduced_f32.size(), static_cast<size_t>(kShard)) << name;
    EXPECT_EQ(kept.send_bf16.size(),
              dtype == GradReduceDType::kBF16 ? static_cast<size_t>(kShard * n) : 0u)
        << name;
  }
}

// ---------------------------------------------------------------------------------------------
// MoE all-to-all.

enum class Pattern { kUneven, kAllToRank0, kNone, kFull16 };

// Tokens that rank `src` sends to rank `dst`.
int64_t TokenCount(Pattern p, int src, int dst) {
  switch (p) {
    case Pattern::kUneven:
      return ((src * 5 + dst * 3 + 1) % 4) * 3;  // 0, 3, 6 or 9: zeros for some pairs
    case Pattern::kAllToRank0:
      return dst == 0 ? 5 + src : 0;
    case Pattern::kNone:
      return 0;
    case Pattern::kFull16:
      return 16;
  }
  return 0;
}

// Token k of those `src` sends to `dst`, with `hidden` values. Each 1x128 tile starts with its
// amax, +-fp8_max * 2^p, so that its scale is exactly 2^-p; elements 1..4 of the first tile
// carry the token's id as powers of two times 2^p (exact through FP8 and BF16: src, dst, k % 8,
// k / 8); the rest is noise below the amax.
std::vector<float> MakeToken(Fp8Format f, int src, int dst, int64_t k, int64_t hidden) {
  std::vector<float> row(static_cast<size_t>(hidden));
  const uint64_t seed = Mix(static_cast<uint64_t>(src) * 1000003 +
                            static_cast<uint64_t>(dst) * 1009 + static_cast<uint64_t>(k));
  for (int64_t base = 0, t = 0; base < hidden; base += 128, ++t) {
    const int p = static_cast<int>((src * 7 + dst * 3 + k + t) % 9) - 4;
    const float unit = std::ldexp(1.0f, p);
    const float marker = Fp8Max(f) * unit;
    row[base] = ((k + t) % 2 != 0) ? -marker : marker;
    for (int64_t h = base + 1; h < std::min(hidden, base + 128); ++h) {
      row[h] = static_cast<float>(0.9 * (2.0 * Unit(seed, h) - 1.0)) * marker *
               std::ldexp(1.0f, -static_cast<int>(h % 14));
    }
    if (t == 0) {
      row[1] = std::ldexp(unit, src);
      row[2] = -std::ldexp(unit, dst);
      row[3] = std::ldexp(unit, static_cast<int>(k % 8));
      row[4] = std::ldexp(unit, static_cast<int>(k / 8));
    }
  }
  return row;
}

struct TokenCase {
  Fp8Format format;
  int64_t hidden;
  Pattern pattern;
};

std::string TokenCaseName(const ::testing::TestParamInfo<TokenCase>& info) {
  const char* p = info.param.pattern == Pattern::kUneven       ? "Uneven"
                  : info.param.pattern == Pattern::kAllToRank0 ? "AllToRank0"
                  : info.param.pattern == Pattern::kNone       ? "None"
                                                               : "Full16";
  return FormatName(info.param.format) + "_hidden" + std::to_string(info.param.hidden) + "_" + p;
}

void PrintTo(const TokenCase& c, std::ostream* os) {
  *os << TokenCaseName(::testing::TestParamInfo<TokenCase>(c, 0));
}

class TokenAllToAllTest : public ::testing::TestWithParam<TokenCase> {};

TEST_P(TokenAllToAllTest, Fp8DispatchThenBf16CombineReturnsEveryTokenToItsOrigin) {
  const TokenCase& c = GetParam();
  const int n = World().size(), rank = World().rank();
  const int64_t hidden = c.hidden;

  // What this rank sends, grouped by destination.
  std::vector<int64_t> send_counts(n);
  std::vector<float> tokens;
  for (int d = 0; d < n; ++d) {
    send_counts[d] = TokenCount(c.pattern, rank, d);
    for (int64_t k = 0; k < send_counts[d]; ++k) {
      const std::vector<float> t = MakeToken(c.format, rank, d, k, hidden);
      tokens.insert(tokens.end(), t.begin(), t.end());
    }
  }
  const int64_t send_tokens = static_cast<int64_t>(tokens.size()) / hidden;

  // Dispatch in FP8.
  absl::StatusOr<Fp8Tokens> got =
      AllToAllFp8Tokens(World(), Ops(), tokens.data(), hidden, send_counts, c.format);
  ASSERT_TRUE(AllOk(got.status()));
  std::vector<float> expected_rows;
  std::vector<int64_t> want_recv(n);
  for (int s = 0; s < n; ++s) {
    want_recv[s] = TokenCount(c.pattern, s, rank);
    for (int64_t k = 0; k < want_recv[s]; ++k) {
      const std::vector<float> t = MakeToken(c.format, s, rank, k, hidden);
      expected_rows.insert(expected_rows.end(), t.begin(), t.end());
    }
  }
  const int64_t recv_tokens = static_cast<int64_t>(expected_rows.size()) / hidden;
  EXPECT_EQ(got->recv_counts, want_recv);
  ASSERT_EQ(got->tokens, recv_tokens);
  EXPECT_EQ(got->send_stats.count, send_tokens * hidden);
  const int64_t tiles = (hidden + 127) / 128;
  ASSERT_EQ(got->codes.size(), static_cast<size_t>(recv_tokens * hidden));
  ASSERT_EQ(got->scale_inv.size(), static_cast<size_t>(recv_tokens * tiles));

  // The received FP8 codes and 1x128 scales are the senders' tokens quantized by 1x128 tiles.
  const Quantized ref = QuantizeWhole(expected_rows, recv_tokens, hidden, c.format,
                                      Granularity::kTile1x128, false, 1.0f, 0);
  EXPECT_TRUE(SameBits(Host(got->codes), ref.codes)) << "codes";
  EXPECT_TRUE(SameBits(Host(got->scale_inv), ref.scale_inv)) << "scale_inv";
  // By construction each tile's scale_inv is 2^p and its first element decodes to +-amax.
  std::vector<float> deq = Dequantize(Host(got->codes), Host(got->scale_inv), recv_tokens, hidden,
                                      c.format, Granularity::kTile1x128);
  for (int64_t t = 0; t < recv_tokens; ++t) {
    for (int64_t e = 0; e < 5; ++e) {
      EXPECT_EQ(deq[t * hidden + e], expected_rows[t * hidden + e])
          << "token " << t << " element " << e << ": its id did not survive";
    }
  }

  // With the receive counts given (as MoE knows them from its per-expert counts), no count
  // exchange: the same rows arrive, bit for bit.
  {
    TokenScratch scratch;
    Fp8Tokens known;
    ASSERT_TRUE(AllOk(AllToAllFp8TokensInto(World(), Ops(), tokens.data(), hidden, send_counts,
                                            c.format, &scratch, &known, want_recv)));
    ASSERT_TRUE(Ops().layer->synchronize({}).ok());
    EXPECT_EQ(known.recv_counts, want_recv);
    EXPECT_EQ(known.tokens, recv_tokens);
    std::vector<uint8_t> codes = Host(known.codes);
    std::vector<float> scales = Host(known.scale_inv);
    codes.resize(static_cast<size_t>(recv_tokens * hidden));
    scales.resize(static_cast<size_t>(recv_tokens * tiles));
    EXPECT_TRUE(SameBits(codes, ref.codes)) << "codes, receive counts given";
    EXPECT_TRUE(SameBits(scales, ref.scale_inv)) << "scale_inv, receive counts given";
    const std::vector<int64_t> short_counts(static_cast<size_t>(n + 1), 0);
    const absl::Status refused =
        AllToAllFp8TokensInto(World(), Ops(), tokens.data(), hidden, send_counts, c.format,
                              &scratch, &known, short_counts);
    EXPECT_EQ(refused.code(), absl::StatusCode::kInvalidArgument) << refused;
    EXPECT_NE(refused.message().find("recv_counts has"), std::string::npos) << refused;
  }

  // The "expert" doubles every value (exact), then the combine sends the rows back in BF16.
  for (float& v : deq) v *= 2.0f;
  std::vector<float> back(static_cast<size_t>(send_tokens * hidden),
                          std::numeric_limits<float>::quiet_NaN());
  const absl::Status combine = AllToAllBf16Tokens(World(), Ops(), deq.data(), hidden,
                                                  got->recv_counts, send_counts, back.data());
  ASSERT_TRUE(AllOk(combine));

  // Back home: each token is 2 x its own 1x128 quantization, dequantized (exact in BF16).
  const Quantized mine =
      QuantizeWhole(tokens, send_tokens, hidden, c.format, Granularity::kTile1x128, false, 1.0f, 0);
  std::vector<float> want_back = Dequantize(mine.codes, mine.scale_inv, send_tokens, hidden,
                                            c.format, Granularity::kTile1x128);
  for (float& v : want_back) v *= 2.0f;
  EXPECT_TRUE(SameBits(back, want_back));
  for (int64_t t = 0; t < send_tokens; ++t) {
    for (int64_t e = 1; e < 5; ++e) {
      EXPECT_EQ(back[t * hidden + e], 2.0f * tokens[t * hidden + e])
          << "returned token " << t << " has the wrong id (element " << e << ")";
    }
  }
}

INSTANTIATE_TEST_SUITE_P(All, TokenAllToAllTest,
                         ::testing::Values(TokenCase{Fp8Format::kE4M3, 128, Pattern::kUneven},
                                           TokenCase{Fp8Format::kE5M2, 128, Pattern::kUneven},
                                           TokenCase{Fp8Format::kE4M3, 200, Pattern::kUneven},
                                           TokenCase{Fp8Format::kE5M2, 200, Pattern::kAllToRank0},
                                           TokenCase{Fp8Format::kE4M3, 1024, Pattern::kAllToRank0},
                                           TokenCase{Fp8Format::kE4M3, 256, Pattern::kNone},
                                           TokenCase{Fp8Format::kE5M2, 1024, Pattern::kFull16}),
                         TokenCaseName);

TEST(TokenCountsTest, ExchangeTellsEachRankWhatItReceives) {
  const int n = World().size(), rank = World().rank();
  std::vector<int64_t> send(n), want(n);
  for (int d = 0; d < n; ++d) send[d] = TokenCount(Pattern::kUneven, rank, d) + 1000 * rank;
  for (int s = 0; s < n; ++s) want[s] = TokenCount(Pattern::kUneven, s, rank) + 1000 * s;
  const CommStats before = World().stats();
  absl::StatusOr<std::vector<int64_t>> got = ExchangeTokenCounts(World(), send);
  ASSERT_TRUE(AllOk(got.status()));
  EXPECT_EQ(*got, want);
  EXPECT_EQ(World().stats().Calls(CollectiveOp::kAllToAllV, DType::kI64) -
                before.Calls(CollectiveOp::kAllToAllV, DType::kI64),
            1);
}

TEST(TokenCountsTest, BadCountsAreRejectedBeforeAnyCollective) {
  const int n = World().size();
  std::vector<int64_t> wrong_size(n + 1, 0), negative(n, 0);
  negative[0] = -1;
  std::vector<float> buf(128 * 4, 1.0f);
  EXPECT_EQ(ExchangeTokenCounts(World(), wrong_size).status().code(),
            absl::StatusCode::kInvalidArgument);
  absl::StatusOr<Fp8Tokens> r =
      AllToAllFp8Tokens(World(), Ops(), buf.data(), 128, negative, Fp8Format::kE4M3);
  EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(r.status().message().find("send_counts"), std::string::npos) << r.status();
  std::vector<int64_t> zeros(n, 0);
  r = AllToAllFp8Tokens(World(), Ops(), buf.data(), 0, zeros, Fp8Format::kE4M3);
  EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(r.status().message().find("hidden"), std::string::npos) << r.status();
  const absl::Status s =
      AllToAllBf16Tokens(World(), Ops(), buf.data(), 128, zeros, wrong_size, buf.data());
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(s.message().find("recv_counts"), std::string::npos) << s;
}

// ---------------------------------------------------------------------------------------------
// Bytes: FP8 against BF16 for the same data, counted by the communicator.

void ReportRatio(const char* what, double ratio) {
  ::testing::Test::RecordProperty(what, std::to_string(ratio));
  if (World().rank() == 0) std::printf("[ratio] %s: %.4f (np=%d)\n", what, ratio, World().size());
}

TEST(BytesTest, MoeDispatchInFp8SendsAtMost52PercentOfBf16) {
  const int n = World().size(), rank = World().rank();
  constexpr int64_t kHidden = 1024;
  std::vector<int64_t> send_counts(n);
  std::vector<float> tokens;
  for (int d = 0; d < n; ++d) {
    send_counts[d] = TokenCount(Pattern::kFull16, rank, d);
    for (int64_t k = 0; k < send_counts[d]; ++k) {
      const std::vector<float> t = MakeToken(Fp8Format::kE4M3, rank, d, k, kHidden);
      tokens.insert(tokens.end(), t.begin(), t.end());
    }
  }
  const int64_t send_tokens = static_cast<int64_t>(tokens.size()) / kHidden;

  const int64_t b0 = World().stats().TotalBytes();
  absl::StatusOr<Fp8Tokens> fp8 =
      AllToAllFp8Tokens(World(), Ops(), tokens.data(), kHidden, send_counts, Fp8Format::kE4M3);
  ASSERT_TRUE(AllOk(fp8.status()));
  const int64_t b1 = World().stats().TotalBytes();
  std::vector<float> out(static_cast<size_t>(fp8->tokens * kHidden));
  ASSERT_TRUE(AllOk(AllToAllBf16Tokens(World(), Ops(), tokens.data(), kHidden, send_counts,
                                       fp8->recv_counts, out.data())));
  const int64_t b2 = World().stats().TotalBytes();

  // FP8: 1 byte per value, 4 per 1x128 scale, and the counts (8 bytes per rank); BF16: 2 per value.
  EXPECT_EQ(b1 - b0, send_tokens * kHidden + send_tokens * (kHidden / 128) * 4 + 8 * n);
  EXPECT_EQ(b2 - b1, send_tokens * kHidden * 2);
  const double ratio = static_cast<double>(b1 - b0) / static_cast<double>(b2 - b1);
  EXPECT_LE(ratio, 0.52);
  ReportRatio("moe_dispatch_fp8_over_bf16_bytes", ratio);
}

TEST(BytesTest, FsdpGatherInFp8SendsAtMost52PercentOfBf16) {
  const int n = World().size(), rank = World().rank();
  constexpr int64_t kShardRows = 256, kCols = 1024;
  const std::vector<float> full = FullWeight(31, kShardRows * n, kCols);
  const float* shard = full.data() + rank * kShardRows * kCols;

  const int64_t b0 = World().stats().TotalBytes();
  std::vector<uint16_t> bf16(full.size());
  ASSERT_TRUE(AllOk(GatherBf16(World(), Ops(), shard, kShardRows * kCols, bf16.data())));
  const int64_t bf16_bytes = World().stats().TotalBytes() - b0;
  EXPECT_EQ(bf16_bytes, 2 * kShardRows * kCols);

  for (WeightScaling scaling : {WeightScaling::kTensorCurrent, WeightScaling::kBlock128}) {
    Fp8GatherOptions options;
    options.scaling = scaling;
    const int64_t before = World().stats().TotalBytes();
    absl::StatusOr<Fp8Weight> w =
        GatherFp8Weight(World(), Ops(), shard, kShardRows, kCols, options);
    ASSERT_TRUE(AllOk(w.status()));
    const int64_t fp8_bytes = World().stats().TotalBytes() - before;
    const double ratio = static_cast<double>(fp8_bytes) / static_cast<double>(bf16_bytes);
    EXPECT_LE(ratio, 0.52);
    ReportRatio(scaling == WeightScaling::kBlock128 ? "fsdp_gather_block128_fp8_over_bf16_bytes"
                                                    : "fsdp_gather_tensor_fp8_over_bf16_bytes",
                ratio);
  }
}

}  // namespace
}  // namespace fp8rt::parallel
