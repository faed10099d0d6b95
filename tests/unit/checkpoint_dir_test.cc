// Tests of runtime/checkpoint/checkpoint_dir.h, in a fresh folder under /tmp per test. Names and
// paths are checked against the layout the header documents; shard checksums against XXH64 computed
// here on the bytes read back from disk; corruption is made by hand (one flipped byte, a deleted
// or swapped file) and must be refused with a message naming the file:
//   - names and paths; a full save (PrepareTemp, two ranks' ShardWriter, Commit) lists, verifies
//     and is found, with the MANIFEST readable as a shard and the folder holding exactly its files;
//   - temp folders and misnamed folders are never listed; an absent root lists nothing;
//   - Commit refuses missing / mismatched shards, bad rank coverage, bad file names, a missing
//     temp folder and an existing checkpoint, and none of them makes anything committed;
//   - every single-byte flip of the newest checkpoint's MANIFEST or a shard, a deleted or swapped
//     shard, and a MANIFEST of another step make FindNewestValid fall back to the previous one;
//   - Prune keeps the newest N and never the newest; RemoveStaleTemps removes only temp folders.
#include "runtime/checkpoint/checkpoint_dir.h"

#include <stdlib.h>
#include <xxhash.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <filesystem>
#include <functional>
#include <memory>
#include <random>
#include <span>
#include <string>
#include <vector>

#include "fp8rt/v1/checkpoint.pb.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "runtime/checkpoint/checkpoint_io.h"
#include "tests/support/test_support.h"

namespace fp8rt {
namespace {

using ::testing::ElementsAre;
using ::testing::HasSubstr;
using ::testing::IsEmpty;
using ::testing::SizeIs;

namespace fs = std::filesystem;
using test::ReadFile;
using test::WriteFile;

void FlipByte(const std::string& path, size_t offset) {
  std::string bytes = ReadFile(path);
  ASSERT_LT(offset, bytes.size()) << path;
  bytes[offset] = static_cast<char>(bytes[offset] ^ 0x01);
  WriteFile(path, bytes);
}

std::vector<std::string> Listing(const std::string& dir) {
  std::vector<std::string> names;
  for (const auto& e : fs::directory_iterator(dir)) names.push_back(e.path().filename());
  std::sort(names.begin(), names.end());
  return names;
}

bool SameMessage(const google::protobuf::MessageLite& a, const google::protobuf::MessageLite& b) {
  return a.SerializeAsString() == b.SerializeAsString();
}

class CheckpointDirTest : public ::testing::Test {
 protected:
  void SetUp() override {
    std::string tmpl = "/tmp/checkpoint_dir_test.XXXXXX";
    ASSERT_NE(::mkdtemp(tmpl.data()), nullptr);
    run_dir_ = tmpl;
  }
  void TearDown() override { fs::remove_all(run_dir_); }

  // Writes rank `rank`'s shard of `step` into `folder` (random weights and the step, so every
  // shard of every step differs) and returns its manifest entry.
  v1::CheckpointShard WriteShard(const std::string& folder, int64_t step, int rank) {
    std::mt19937_64 rng(static_cast<uint64_t>(step * 1000 + rank));
    std::vector<std::byte> weights(64 + static_cast<size_t>(rank) * 8);
    for (std::byte& b : weights) b = static_cast<std::byte>(rng() & 0xff);
    const std::string step_text = std::to_string(step);
    ShardWriter writer;
    EXPECT_TRUE(writer.Add("master/w", weights).ok());
    EXPECT_TRUE(writer.Add("step", std::as_bytes(std::span(step_text))).ok());
    const std::string path = (fs::path(folder) / ShardFileName(rank)).string();
    absl::StatusOr<ShardWriteResult> result = writer.Write(path);
    EXPECT_TRUE(result.ok()) << result.status();
    v1::CheckpointShard shard;
    shard.set_rank(rank);
    shard.set_file(ShardFileName(rank));
    if (result.ok()) {
      shard.set_size(result->size);
      shard.set_xxh64(result->xxh64);
    }
    return shard;
  }

  v1::CheckpointManifest BaseManifest(int64_t step, int world_size) {
    v1::CheckpointManifest manifest;
    manifest.set_step(step);
    manifest.set_world_size(world_size);
    manifest.set_dp(world_size);
    manifest.set_tp(1);
    manifest.set_ep(1);
    manifest.mutable_spec()->mutable_model()->set_layers(2);
    manifest.mutable_spec()->mutable_model()->set_d_model(64);
    manifest.mutable_spec()->mutable_checkpoint()->set_keep(3);
    manifest.set_created_unix_ms(1700000000000 + step);
    manifest.set_data_position(static_cast<uint64_t>(step) * 4);
    return manifest;
  }

  // A full save of `step` by `world_size` ranks, committed. Returns the manifest.
  v1::CheckpointManifest Save(const CheckpointDir& dir, int64_t step, int world_size = 2) {
    absl::StatusOr<std::string> temp = dir.PrepareTemp(step);
    EXPECT_TRUE(temp.ok()) << temp.status();
    v1::CheckpointManifest manifest = BaseManifest(step, world_size);
    if (!temp.ok()) return manifest;
    for (int r = 0; r < world_size; ++r) *manifest.add_shards() = WriteShard(*temp, step, r);
    const absl::Status committed = dir.Commit(manifest);
    EXPECT_TRUE(committed.ok()) << committed;
    return manifest;
  }

  std::string run_dir_;
};

TEST_F(CheckpointDirTest, NamesAndPaths) {
  EXPECT_EQ(CheckpointName(0), "step-00000000");
  EXPECT_EQ(CheckpointName(12), "step-00000012");
  EXPECT_EQ(CheckpointName(99999999), "step-99999999");
  EXPECT_EQ(ShardFileName(0), "rank-00000.shard");
  EXPECT_EQ(ShardFileName(3), "rank-00003.shard");
  EXPECT_EQ(ShardFileName(12345), "rank-12345.shard");
  EXPECT_EQ(kManifestFileName, "MANIFEST");

  const CheckpointDir dir(run_dir_);
  EXPECT_EQ(dir.root(), run_dir_ + "/checkpoints");
  EXPECT_EQ(dir.TempDir(7), run_dir_ + "/checkpoints/.tmp-step-00000007");
  EXPECT_EQ(dir.CommittedDir(7), run_dir_ + "/checkpoints/step-00000007");
  // Constructing touches nothing on disk.
  EXPECT_FALSE(fs::exists(dir.root()));
}

TEST_F(CheckpointDirTest, FullSaveListsVerifiesAndIsFound) {
  const CheckpointDir dir(run_dir_);
  absl::StatusOr<std::string> temp = dir.PrepareTemp(100);
  ASSERT_TRUE(temp.ok()) << temp.status();
  EXPECT_EQ(*temp, dir.TempDir(100));
  ASSERT_TRUE(fs::is_directory(*temp));
  EXPECT_THAT(Listing(*temp), IsEmpty());

  v1::CheckpointManifest manifest = BaseManifest(100, 2);
  *manifest.add_shards() = WriteShard(*temp, 100, 1);  // ranks in any order
  *manifest.add_shards() = WriteShard(*temp, 100, 0);
  // Before the commit the save is not a checkpoint.
  EXPECT_THAT(dir.ListCommitted().value(), IsEmpty());
  ASSERT_TRUE(dir.Commit(manifest).ok());

  EXPECT_FALSE(fs::exists(dir.TempDir(100)));
  const std::string committed = dir.CommittedDir(100);
  EXPECT_THAT(Listing(committed), ElementsAre("MANIFEST", "rank-00000.shard", "rank-00001.shard"));
  EXPECT_THAT(Listing(dir.root()), ElementsAre("step-00000100"));

  // The manifest's checksums are XXH64 of the bytes on disk; MANIFEST is a shard file.
  for (const v1::CheckpointShard& shard : manifest.shards()) {
    const std::string bytes = ReadFile(committed + "/" + shard.file());
    EXPECT_EQ(shard.size(), bytes.size());
    EXPECT_EQ(shard.xxh64(), XXH64(bytes.data(), bytes.size(), 0));
  }
  absl::StatusOr<std::unique_ptr<ShardReader>> manifest_file =
      ShardReader::Open(committed + "/MANIFEST");
  ASSERT_TRUE(manifest_file.ok()) << manifest_file.status();
  EXPECT_THAT((*manifest_file)->SectionNames(), ElementsAre("manifest"));
  v1::CheckpointManifest stored;
  ASSERT_TRUE((*manifest_file)->ParseProto("manifest", &stored).ok());
  EXPECT_TRUE(SameMessage(stored, manifest));

  absl::StatusOr<std::vector<int64_t>> listed = dir.ListCommitted();
  ASSERT_TRUE(listed.ok()) << listed.status();
  EXPECT_THAT(*listed, ElementsAre(100));

  absl::StatusOr<v1::CheckpointManifest> verified = dir.Verify(100);
  ASSERT_TRUE(verified.ok()) << verified.status();
  EXPECT_TRUE(SameMessage(*verified, manifest));
  EXPECT_EQ(dir.Verify(200).status().code(), absl::StatusCode::kNotFound);

  const v1::CheckpointManifest second = Save(dir, 200);
  std::vector<std::string> refused;
  absl::StatusOr<ResumePoint> resume = dir.FindNewestValid(&refused);
  ASSERT_TRUE(resume.ok()) << resume.status();
  EXPECT_EQ(resume->step, 200);
  EXPECT_EQ(resume->dir, dir.CommittedDir(200));
  EXPECT_TRUE(SameMessage(resume->manifest, second));
  EXPECT_EQ(resume->manifest.data_position(), 800u);
  EXPECT_THAT(refused, IsEmpty());
  EXPECT_THAT(dir.ListCommitted().value(), ElementsAre(100, 200));
}

TEST_F(CheckpointDirTest, OnlyCommittedFoldersAreListed) {
  const CheckpointDir dir(run_dir_);
  // An absent root: nothing committed, and FindNewestValid says where it looked.
  EXPECT_THAT(dir.ListCommitted().value(), IsEmpty());
  absl::StatusOr<ResumePoint> none = dir.FindNewestValid(nullptr);
  EXPECT_EQ(none.status().code(), absl::StatusCode::kNotFound);
  EXPECT_THAT(none.status().message(), HasSubstr("no committed checkpoint in " + dir.root()));

  Save(dir, 100);
  // A complete save that was never committed, with a MANIFEST of its own: still not listed.
  const std::string temp = dir.PrepareTemp(200).value();
  WriteShard(temp, 200, 0);
  fs::copy_file(dir.CommittedDir(100) + "/MANIFEST", temp + "/MANIFEST");
  // Misnamed folders holding a MANIFEST, a committed-looking folder without one, and a file.
  for (const char* name : {"step-0000300", "step-000000400", "step-0000050x", "Step-00000500",
                           "step-00000600.old", "xstep-00000700"}) {
    fs::create_directory(dir.root() + "/" + name);
    fs::copy_file(dir.CommittedDir(100) + "/MANIFEST", dir.root() + "/" + name + "/MANIFEST");
  }
  fs::create_directory(dir.CommittedDir(800));
  WriteFile(dir.root() + "/" + CheckpointName(900), "not a folder");

  EXPECT_THAT(dir.ListCommitted().value(), ElementsAre(100));
  std::vector<std::string> refused;
  absl::StatusOr<ResumePoint> resume = dir.FindNewestValid(&refused);
  ASSERT_TRUE(resume.ok()) << resume.status();
  EXPECT_EQ(resume->step, 100);
  EXPECT_THAT(refused, IsEmpty());
}

TEST_F(CheckpointDirTest, PrepareTempStartsFreshAndRefusesBadSteps) {
  const CheckpointDir dir(run_dir_);
  const std::string temp = dir.PrepareTemp(5).value();
  WriteFile(temp + "/leftover", "x");
  EXPECT_EQ(dir.PrepareTemp(5).value(), temp);
  EXPECT_THAT(Listing(temp), IsEmpty());

  EXPECT_EQ(dir.PrepareTemp(-1).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(dir.PrepareTemp(100000000).status().code(), absl::StatusCode::kInvalidArgument);
  Save(dir, 6);
  absl::StatusOr<std::string> again = dir.PrepareTemp(6);
  EXPECT_EQ(again.status().code(), absl::StatusCode::kAlreadyExists);
  EXPECT_THAT(again.status().message(), HasSubstr(dir.CommittedDir(6)));
}

// Each case breaks a valid two-rank save of step 300 in one way; Commit must refuse it with the
// expected kind and a message naming `names`, and leave step 300 uncommitted and its temp folder
// in place (the documented choice).
TEST_F(CheckpointDirTest, CommitRefusesBadSavesAndCommitsNothing) {
  const CheckpointDir dir(run_dir_);
  Save(dir, 100);
  struct Case {
    std::string what;
    absl::StatusCode code;
    std::string names;  // substring of the message, "" for none
    std::function<void(const std::string& temp, v1::CheckpointManifest*)> breaks;
  };
  const std::vector<Case> cases = {
      {"missing shard", absl::StatusCode::kFailedPrecondition, "rank-00001.shard",
       [](const std::string& temp, v1::CheckpointManifest*) {
         fs::remove(temp + "/rank-00001.shard");
       }},
      {"checksum differs", absl::StatusCode::kDataLoss, "rank-00000.shard",
       [](const std::string&, v1::CheckpointManifest* m) {
         m->mutable_shards(0)->set_xxh64(m->shards(0).xxh64() ^ 1);
       }},
      {"size differs", absl::StatusCode::kDataLoss, "rank-00001.shard",
       [](const std::string&, v1::CheckpointManifest* m) {
         m->mutable_shards(1)->set_size(m->shards(1).size() + 1);
       }},
      {"byte flipped on disk", absl::StatusCode::kDataLoss, "rank-00000.shard",
       [](const std::string& temp, v1::CheckpointManifest*) {
         FlipByte(temp + "/rank-00000.shard", 40);
       }},
      {"duplicate rank", absl::StatusCode::kInvalidArgument, "rank 0",
       [](const std::string&, v1::CheckpointManifest* m) { m->mutable_shards(1)->set_rank(0); }},
      {"missing rank", absl::StatusCode::kInvalidArgument, "rank 1",
       [](const std::string&, v1::CheckpointManifest* m) { m->mutable_shards()->RemoveLast(); }},
      {"extra rank", absl::StatusCode::kInvalidArgument, "rank 2",
       [](const std::string&, v1::CheckpointManifest* m) {
         v1::CheckpointShard* s = m->add_shards();
         *s = m->shards(0);
         s->set_rank(2);
       }},
      {"world size 0", absl::StatusCode::kInvalidArgument, "world_size",
       [](const std::string&, v1::CheckpointManifest* m) { m->set_world_size(0); }},
      {"file outside the folder", absl::StatusCode::kInvalidArgument, "../rank-00000.shard",
       [](const std::string&, v1::CheckpointManifest* m) {
         m->mutable_shards(0)->set_file("../rank-00000.shard");
       }},
      {"file named MANIFEST", absl::StatusCode::kInvalidArgument, "MANIFEST",
       [](const std::string&, v1::CheckpointManifest* m) {
         m->mutable_shards(0)->set_file("MANIFEST");
       }},
      {"one file for two ranks", absl::StatusCode::kInvalidArgument, "rank-00000.shard",
       [](const std::string&, v1::CheckpointManifest* m) {
         *m->mutable_shards(1) = m->shards(0);
         m->mutable_shards(1)->set_rank(1);
       }},
      {"no temp folder", absl::StatusCode::kFailedPrecondition, ".tmp-step-00000300",
       [](const std::string& temp, v1::CheckpointManifest*) { fs::remove_all(temp); }},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.what);
    const std::string temp = dir.PrepareTemp(300).value();
    v1::CheckpointManifest manifest = BaseManifest(300, 2);
    for (int r = 0; r < 2; ++r) *manifest.add_shards() = WriteShard(temp, 300, r);
    c.breaks(temp, &manifest);
    const absl::Status status = dir.Commit(manifest);
    EXPECT_EQ(status.code(), c.code) << status;
    EXPECT_THAT(status.message(), HasSubstr(c.names));
    EXPECT_FALSE(fs::exists(dir.CommittedDir(300)));
    EXPECT_THAT(dir.ListCommitted().value(), ElementsAre(100));
    if (c.what != "no temp folder") {
      EXPECT_TRUE(fs::is_directory(temp));
      EXPECT_FALSE(fs::exists(temp + "/MANIFEST"));
    }
  }

  // A step that is already committed: AlreadyExists, and the committed one is untouched.
  const std::string before = ReadFile(dir.CommittedDir(100) + "/MANIFEST");
  ASSERT_TRUE(fs::create_directories(dir.TempDir(100)));
  v1::CheckpointManifest again = BaseManifest(100, 1);
  *again.add_shards() = WriteShard(dir.TempDir(100), 100, 0);
  const absl::Status exists = dir.Commit(again);
  EXPECT_EQ(exists.code(), absl::StatusCode::kAlreadyExists) << exists;
  EXPECT_THAT(exists.message(), HasSubstr(dir.CommittedDir(100)));
  EXPECT_EQ(ReadFile(dir.CommittedDir(100) + "/MANIFEST"), before);
  EXPECT_TRUE(dir.Verify(100).ok());

  // A step outside the 8 digits.
  EXPECT_EQ(dir.Commit(BaseManifest(-3, 1)).code(), absl::StatusCode::kInvalidArgument);

  // The refused save of 300, rewritten whole, commits.
  const std::string temp = dir.PrepareTemp(300).value();
  v1::CheckpointManifest good = BaseManifest(300, 2);
  for (int r = 0; r < 2; ++r) *good.add_shards() = WriteShard(temp, 300, r);
  ASSERT_TRUE(dir.Commit(good).ok());
  EXPECT_THAT(dir.ListCommitted().value(), ElementsAre(100, 300));
}

// Saves 100, 200 and 300, breaks 300 with `breaks`, and expects FindNewestValid to return 200 and
// report exactly one refusal naming `names` with `code` from Verify(300).
void ExpectFallback(const std::string& run_dir, const std::string& what, absl::StatusCode code,
                    const std::string& names,
                    const std::function<void(const CheckpointDir& dir)>& breaks,
                    bool check_offset) {
  SCOPED_TRACE(what);
  const CheckpointDir dir(run_dir);
  breaks(dir);
  const absl::Status verify = dir.Verify(300).status();
  EXPECT_EQ(verify.code(), code) << verify;
  EXPECT_THAT(verify.message(), HasSubstr(names));
  if (check_offset) {
    EXPECT_THAT(verify.message(), HasSubstr("offset"));
  }
  EXPECT_THAT(dir.ListCommitted().value(), ElementsAre(100, 200, 300));
  std::vector<std::string> refused;
  absl::StatusOr<ResumePoint> resume = dir.FindNewestValid(&refused);
  ASSERT_TRUE(resume.ok()) << resume.status();
  EXPECT_EQ(resume->step, 200);
  EXPECT_EQ(resume->dir, dir.CommittedDir(200));
  EXPECT_EQ(resume->manifest.step(), 200);
  ASSERT_THAT(refused, SizeIs(1));
  EXPECT_THAT(refused[0], HasSubstr(names));
}

TEST_F(CheckpointDirTest, CorruptNewestFallsBackToThePreviousOne) {
  const CheckpointDir dir(run_dir_);
  Save(dir, 100);
  Save(dir, 200);
  Save(dir, 300);
  const std::string folder = dir.CommittedDir(300);
  const std::string shard0 = folder + "/rank-00000.shard";
  const std::string shard1 = folder + "/rank-00001.shard";
  const std::string manifest = folder + "/MANIFEST";

  // Every single-byte flip of the MANIFEST and of a shard is refused, naming the file.
  for (const std::string& file : {manifest, shard1}) {
    const std::string original = ReadFile(file);
    for (size_t offset = 0; offset < original.size(); ++offset) {
      ExpectFallback(
          run_dir_, file + " byte " + std::to_string(offset), absl::StatusCode::kDataLoss, file,
          [&](const CheckpointDir&) { FlipByte(file, offset); }, /*check_offset=*/true);
      WriteFile(file, original);
      ASSERT_TRUE(dir.Verify(300).ok());
      if (::testing::Test::HasFailure()) return;
    }
  }

  const std::string original0 = ReadFile(shard0);
  ExpectFallback(
      run_dir_, "deleted shard", absl::StatusCode::kNotFound, shard0,
      [&](const CheckpointDir&) { fs::remove(shard0); }, false);
  // A valid shard file, but not the one the rank acknowledged: the manifest's checksum catches it.
  fs::copy_file(dir.CommittedDir(200) + "/rank-00000.shard", shard0);
  ExpectFallback(
      run_dir_, "swapped shard", absl::StatusCode::kDataLoss, shard0, [](const CheckpointDir&) {},
      false);
  WriteFile(shard0, original0);
  ASSERT_TRUE(dir.Verify(300).ok());

  // A valid MANIFEST of another step.
  const std::string original_manifest = ReadFile(manifest);
  ExpectFallback(
      run_dir_, "manifest of step 200", absl::StatusCode::kDataLoss, manifest,
      [&](const CheckpointDir& d) {
        WriteFile(manifest, ReadFile(d.CommittedDir(200) + "/MANIFEST"));
      },
      false);
  WriteFile(manifest, original_manifest);

  // A MANIFEST that is a valid shard without the "manifest" section.
  ShardWriter empty;
  ASSERT_TRUE(empty.Add("other", {}).ok());
  ASSERT_TRUE(empty.Write(manifest).ok());
  ExpectFallback(
      run_dir_, "manifest without its section", absl::StatusCode::kDataLoss, manifest,
      [](const CheckpointDir&) {}, false);
  WriteFile(manifest, original_manifest);

  // Two broken checkpoints: both refused, newest first; all broken: NotFound listing the refusals.
  FlipByte(shard1, 20);
  FlipByte(dir.CommittedDir(200) + "/MANIFEST", 20);
  std::vector<std::string> refused;
  absl::StatusOr<ResumePoint> resume = dir.FindNewestValid(&refused);
  ASSERT_TRUE(resume.ok()) << resume.status();
  EXPECT_EQ(resume->step, 100);
  ASSERT_THAT(refused, SizeIs(2));
  EXPECT_THAT(refused[0], HasSubstr(shard1));
  EXPECT_THAT(refused[1], HasSubstr(dir.CommittedDir(200) + "/MANIFEST"));

  fs::remove(dir.CommittedDir(100) + "/rank-00001.shard");
  refused.clear();
  resume = dir.FindNewestValid(&refused);
  EXPECT_EQ(resume.status().code(), absl::StatusCode::kNotFound);
  EXPECT_THAT(resume.status().message(), HasSubstr("no committed checkpoint in " + dir.root()));
  EXPECT_THAT(resume.status().message(), HasSubstr("3 refused"));
  EXPECT_THAT(refused, SizeIs(3));
}

TEST_F(CheckpointDirTest, PruneKeepsTheNewest) {
  const CheckpointDir dir(run_dir_);
  EXPECT_THAT(dir.Prune(1).value(), IsEmpty());  // absent root
  for (int64_t step : {100, 200, 300, 400, 500}) Save(dir, step, 1);
  EXPECT_EQ(dir.Prune(0).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(dir.Prune(-2).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(dir.Prune(10).value(), IsEmpty());
  EXPECT_THAT(dir.Prune(5).value(), IsEmpty());
  EXPECT_THAT(dir.ListCommitted().value(), ElementsAre(100, 200, 300, 400, 500));

  // A save in progress is not a committed checkpoint and is not touched.
  const std::string temp = dir.PrepareTemp(600).value();
  WriteShard(temp, 600, 0);

  EXPECT_THAT(dir.Prune(2).value(), ElementsAre(100, 200, 300));
  EXPECT_THAT(dir.ListCommitted().value(), ElementsAre(400, 500));
  EXPECT_THAT(Listing(dir.root()),
              ElementsAre(".tmp-step-00000600", "step-00000400", "step-00000500"));
  EXPECT_TRUE(dir.Verify(400).ok());
  EXPECT_TRUE(dir.Verify(500).ok());

  EXPECT_THAT(dir.Prune(1).value(), ElementsAre(400));
  EXPECT_THAT(dir.Prune(1).value(), IsEmpty());
  EXPECT_THAT(dir.ListCommitted().value(), ElementsAre(500));
  EXPECT_TRUE(dir.Verify(500).ok());
  EXPECT_THAT(Listing(temp), ElementsAre("rank-00000.shard"));
}

TEST_F(CheckpointDirTest, RemoveStaleTempsRemovesOnlyTempFolders) {
  const CheckpointDir dir(run_dir_);
  EXPECT_EQ(dir.RemoveStaleTemps().value(), 0);  // absent root
  Save(dir, 3, 1);
  WriteShard(dir.PrepareTemp(4).value(), 4, 0);
  WriteShard(dir.PrepareTemp(5).value(), 5, 0);
  fs::create_directories(dir.TempDir(6) + "/nested/deeper");
  WriteFile(dir.root() + "/.tmp-step-notes", "a file, not a folder");

  EXPECT_EQ(dir.RemoveStaleTemps().value(), 3);
  EXPECT_THAT(Listing(dir.root()), ElementsAre(".tmp-step-notes", "step-00000003"));
  EXPECT_TRUE(dir.Verify(3).ok());
  EXPECT_EQ(dir.RemoveStaleTemps().value(), 0);
}

}  // namespace
}  // namespace fp8rt
