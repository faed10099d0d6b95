// Tests of resharding's assembly from recorded logical ranges (runtime/worker/weights.h:
// RangeOf, ShardTensorRanges, AssembleLogical). Shards are written here by hand, their ranges
// chosen in the test, and every value is a function of its parameter and logical index, so the
// expected tensors are computed from the index arithmetic of checkpoint.proto's TensorRange, not
// from the code under test:
//   - three shards whose ranges follow no dp x tp layout (uneven, one tensor held twice) assemble
//     the logical tensors exactly;
//   - with a rank's cut as `need`, only its elements are filled, and ranged readers read only the
//     sections holding them;
//   - shards without a "ranges" section (written before it) are cut by their MANIFEST's layout;
//   - an element no shard holds, a range that does not fit, a section of the wrong size: DataLoss
//     naming the parameter or the file.
#include <stdlib.h>

#include <cstring>
#include <filesystem>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "fp8rt/v1/checkpoint.pb.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "runtime/checkpoint/checkpoint_io.h"
#include "runtime/worker/weights.h"

namespace fp8rt::worker {
namespace {

namespace fs = std::filesystem;
using ::testing::AllOf;
using ::testing::HasSubstr;

// The value every test stores at logical element `i` of parameter `param`.
float ValueAt(const std::string& param, int64_t i) {
  return static_cast<float>(param.size() * 1000 + static_cast<size_t>(i)) * 0.5f;
}

// A hand-written range: rows [r0, +nr) x cols [c0, +nc) of a rows x cols tensor, elements
// [begin, +count) of that piece, `stored` values in the section (padding after count).
v1::TensorRange Range(const std::string& param, int64_t rows, int64_t cols, int64_t r0, int64_t nr,
                      int64_t c0, int64_t nc, int64_t begin, int64_t count, int64_t stored) {
  v1::TensorRange r;
  r.set_param(param);
  r.set_rows(rows);
  r.set_cols(cols);
  r.set_row_begin(r0);
  r.set_row_count(nr);
  r.set_col_begin(c0);
  r.set_col_count(nc);
  r.set_flat_begin(begin);
  r.set_flat_count(count);
  r.set_section_elements(stored);
  return r;
}

// The section values of range `r`, from the TensorRange definition (padding: -1).
std::vector<float> SectionValues(const v1::TensorRange& r) {
  std::vector<float> v(static_cast<size_t>(r.section_elements()), -1.0f);
  for (int64_t i = 0; i < r.flat_count(); ++i) {
    const int64_t li = r.flat_begin() + i;
    const int64_t row = r.row_begin() + li / r.col_count(),
                  col = r.col_begin() + li % r.col_count();
    v[static_cast<size_t>(i)] = ValueAt(r.param(), row * r.cols() + col);
  }
  return v;
}

std::span<const std::byte> AsBytes(const std::vector<float>& v) {
  return std::as_bytes(std::span<const float>(v.data(), v.size()));
}

class ReshardTest : public ::testing::Test {
 protected:
  void SetUp() override {
    std::string tmpl = ::testing::TempDir() + "reshard_test.XXXXXX";
    ASSERT_NE(::mkdtemp(tmpl.data()), nullptr);
    dir_ = tmpl;
    shapes_["a/weight"] = {6, 4, model::TpSplit::kRows};
    shapes_["b/bias"] = {1, 5, model::TpSplit::kNone};
  }
  void TearDown() override { fs::remove_all(dir_); }

  // Writes shard `rank` holding `ranges` (with a "ranges" section when `record`), each range's
  // master/ and adam_m/ sections (adam_m holds the values negated).
  void WriteShard(int rank, const std::vector<v1::TensorRange>& ranges, bool record = true) {
    ShardWriter w;
    v1::ShardRanges proto;
    for (const v1::TensorRange& r : ranges) *proto.add_tensors() = r;
    if (record) {
      ASSERT_TRUE(w.AddProto("ranges", proto).ok());
    }
    for (const v1::TensorRange& r : ranges) {
      std::vector<float> v = SectionValues(r);
      ASSERT_TRUE(w.Add("master/" + r.param(), AsBytes(v)).ok());
      for (float& x : v) x = -x;
      ASSERT_TRUE(w.Add("adam_m/" + r.param(), AsBytes(v)).ok());
    }
    ASSERT_TRUE(w.Write(Path(rank)).ok());
  }
  std::string Path(int rank) const { return dir_ + "/rank-" + std::to_string(rank) + ".shard"; }

  std::vector<std::unique_ptr<ShardReader>> Open(int n, bool ranged) {
    std::vector<std::unique_ptr<ShardReader>> shards;
    for (int r = 0; r < n; ++r) {
      auto reader = ranged ? ShardReader::OpenRanged(Path(r)) : ShardReader::Open(Path(r));
      EXPECT_TRUE(reader.ok()) << reader.status();
      if (reader.ok()) shards.push_back(*std::move(reader));
    }
    return shards;
  }

  // Three shards no dp x tp layout writes: a/weight's row pieces [0,4) and [4,6) cut unevenly
  // (7 + 9 elements of the first piece over shards 0 and 1, the second piece whole on shard 2,
  // with 3 values of padding), b/bias held whole by shards 0 and 2.
  void WriteIrregular() {
    WriteShard(0, {Range("a/weight", 6, 4, 0, 4, 0, 4, 0, 7, 7),
                   Range("b/bias", 1, 5, 0, 1, 0, 5, 0, 5, 5)});
    WriteShard(1, {Range("a/weight", 6, 4, 0, 4, 0, 4, 7, 9, 9)});
    WriteShard(2, {Range("a/weight", 6, 4, 4, 2, 0, 4, 0, 8, 11),
                   Range("b/bias", 1, 5, 0, 1, 0, 5, 0, 5, 5)});
  }

  std::string dir_;
  std::map<std::string, model::LogicalShape> shapes_;
  v1::CheckpointManifest manifest_;  // only named in errors once ranges are recorded
};

TEST_F(ReshardTest, RangesThatFollowNoLayoutAssembleExactly) {
  WriteIrregular();
  const auto shards = Open(3, /*ranged=*/false);
  auto out = AssembleLogical(shards, manifest_, shapes_, {"master/", "adam_m/"});
  ASSERT_TRUE(out.ok()) << out.status();
  for (const auto& [name, s] : shapes_) {
    ASSERT_EQ((*out)[0][name].size(), static_cast<size_t>(s.rows * s.cols)) << name;
    for (int64_t i = 0; i < s.rows * s.cols; ++i) {
      EXPECT_EQ((*out)[0][name][static_cast<size_t>(i)], ValueAt(name, i)) << name << " " << i;
      EXPECT_EQ((*out)[1][name][static_cast<size_t>(i)], -ValueAt(name, i)) << name << " " << i;
    }
  }
}

TEST_F(ReshardTest, ARanksCutFillsOnlyItsElementsAndReadsOnlyTheirSections) {
  WriteIrregular();
  const auto shards = Open(3, /*ranged=*/true);
  // Rank 1 of dp=4 at tp=1: elements [6, 12) of a/weight (rows 1.5-3, all in shard 1), and
  // elements [2, 4) of b/bias (padding rounds 5 up to 8: 2 per rank), first found in shard 0.
  std::map<std::string, model::ShardCut> need;
  need["a/weight"] = model::ShardCut{.shape = shapes_["a/weight"], .fsdp = 4, .fsdp_rank = 1};
  need["b/bias"] = model::ShardCut{.shape = shapes_["b/bias"], .fsdp = 4, .fsdp_rank = 1};
  auto out = AssembleLogical(shards, manifest_, shapes_, {"master/"}, &need);
  ASSERT_TRUE(out.ok()) << out.status();
  const std::vector<float>& a = (*out)[0]["a/weight"];
  for (int64_t i = 0; i < 24; ++i) {
    const bool mine = i >= 6 && i < 12;
    EXPECT_EQ(a[static_cast<size_t>(i)], mine ? ValueAt("a/weight", i) : 0.0f) << i;
  }
  const std::vector<float>& b = (*out)[0]["b/bias"];
  for (int64_t i = 0; i < 5; ++i) {
    EXPECT_EQ(b[static_cast<size_t>(i)], i >= 2 && i < 4 ? ValueAt("b/bias", i) : 0.0f) << i;
  }
  // Shard 0: its a/weight holds elements 0-6 (6 is needed) and its b/bias; shard 1: elements
  // 7-15 (7-11 needed); shard 2: nothing needed that an earlier shard did not give, so no
  // tensor section of it is read. The "ranges" sections are read everywhere.
  auto ranges_bytes = [&](int r) {
    return (*shards[static_cast<size_t>(r)]->Section("ranges")).size();
  };
  EXPECT_EQ(shards[0]->bytes_read(), ranges_bytes(0) + (7 + 5) * sizeof(float));
  EXPECT_EQ(shards[1]->bytes_read(), ranges_bytes(1) + 9 * sizeof(float));
  EXPECT_EQ(shards[2]->bytes_read(), ranges_bytes(2));
}

TEST_F(ReshardTest, ShardsWithoutRangesAreCutByTheirManifestsLayout) {
  // dp=2, tp=1, as a checkpoint written before ranges were recorded: the cut is the ShardCut's.
  manifest_.set_dp(2);
  manifest_.set_tp(1);
  manifest_.set_ep(1);
  manifest_.set_world_size(2);
  for (int rank = 0; rank < 2; ++rank) {
    std::vector<v1::TensorRange> ranges;
    for (const auto& [name, s] : shapes_) {
      // Half of the flattened tensor each, rounded up, the tail padded.
      const int64_t n = s.rows * s.cols, count = (n + 1) / 2, begin = rank * count;
      ranges.push_back(Range(name, s.rows, s.cols, 0, s.rows, 0, s.cols, begin,
                             std::min(count, n - begin), count));
    }
    WriteShard(rank, ranges, /*record=*/false);
  }
  const auto shards = Open(2, /*ranged=*/false);
  auto out = AssembleLogical(shards, manifest_, shapes_, {"master/"});
  ASSERT_TRUE(out.ok()) << out.status();
  for (const auto& [name, s] : shapes_) {
    for (int64_t i = 0; i < s.rows * s.cols; ++i) {
      EXPECT_EQ((*out)[0][name][static_cast<size_t>(i)], ValueAt(name, i)) << name << " " << i;
    }
  }
  // RangeOf agrees with the hand-written range of rank 1's a/weight.
  const v1::TensorRange r =
      RangeOf("a/weight", model::ShardCut{.shape = shapes_["a/weight"], .fsdp = 2, .fsdp_rank = 1});
  EXPECT_EQ(r.flat_begin(), 12);
  EXPECT_EQ(r.flat_count(), 12);
  EXPECT_EQ(r.row_count(), 6);
  EXPECT_EQ(r.section_elements(), 12);
}

TEST_F(ReshardTest, BadRangesAreDataLossNamingTheParameterOrFile) {
  // An element no shard holds: shard 1 of the irregular set is gone.
  WriteShard(0, {Range("a/weight", 6, 4, 0, 4, 0, 4, 0, 7, 7),
                 Range("b/bias", 1, 5, 0, 1, 0, 5, 0, 5, 5)});
  WriteShard(1, {Range("a/weight", 6, 4, 4, 2, 0, 4, 0, 8, 8)});
  {
    auto out = AssembleLogical(Open(2, false), manifest_, shapes_, {"master/"});
    ASSERT_FALSE(out.ok());
    EXPECT_EQ(out.status().code(), absl::StatusCode::kDataLoss);
    EXPECT_THAT(out.status().message(), HasSubstr("9 of 24 elements of parameter a/weight"));
  }
  // A range past its tensor's rows.
  WriteShard(1, {Range("a/weight", 6, 4, 4, 3, 0, 4, 0, 8, 8)});
  {
    auto out = AssembleLogical(Open(2, false), manifest_, shapes_, {"master/"});
    ASSERT_FALSE(out.ok());
    EXPECT_EQ(out.status().code(), absl::StatusCode::kDataLoss);
    EXPECT_THAT(out.status().message(),
                AllOf(HasSubstr(Path(1)), HasSubstr("a/weight"), HasSubstr("does not fit")));
  }
  // A parameter this model does not have: the name is quoted, bounded.
  WriteShard(1, {Range(std::string(300, 'x'), 6, 4, 4, 2, 0, 4, 0, 8, 8)});
  {
    auto out = AssembleLogical(Open(2, false), manifest_, shapes_, {"master/"});
    ASSERT_FALSE(out.ok());
    EXPECT_THAT(out.status().message(), HasSubstr("names no parameter"));
    EXPECT_LT(out.status().message().size(), 300u + 200u);
  }
  // A section that is not the size its range says.
  {
    ShardWriter w;
    v1::ShardRanges proto;
    *proto.add_tensors() = Range("a/weight", 6, 4, 0, 6, 0, 4, 0, 24, 24);
    *proto.add_tensors() = Range("b/bias", 1, 5, 0, 1, 0, 5, 0, 5, 5);
    ASSERT_TRUE(w.AddProto("ranges", proto).ok());
    ASSERT_TRUE(w.Add("master/a/weight", AsBytes(std::vector<float>(23, 1.0f))).ok());
    ASSERT_TRUE(w.Add("master/b/bias", AsBytes(std::vector<float>(5, 1.0f))).ok());
    ASSERT_TRUE(w.Write(Path(0)).ok());
    auto out = AssembleLogical(Open(1, false), manifest_, shapes_, {"master/"});
    ASSERT_FALSE(out.ok());
    EXPECT_EQ(out.status().code(), absl::StatusCode::kDataLoss);
    EXPECT_THAT(out.status().message(),
                AllOf(HasSubstr(Path(0)), HasSubstr("master/a/weight"), HasSubstr("92 bytes")));
  }
}

}  // namespace
}  // namespace fp8rt::worker
