// Fuzz target: checkpoint manifests (runtime/checkpoint/checkpoint_dir.h, ParseManifest: the checks
// CheckpointDir::Verify makes of a MANIFEST before it opens any shard).
//
// The input is a whole MANIFEST file: a shard file with one section "manifest" holding a
// v1::CheckpointManifest. Its checksums are fixed first (fuzz_support.h; the shard target covers
// the checksum checks themselves), then it is checked as the manifest of step 100 (the step of
// the seeds) and as that of the step it claims, so that the shard-list checks are reached too.
// An accepted manifest must keep ParseManifest's promises (its step, ranks 0..world_size-1 once
// each, plain distinct file names); a refused one is DataLoss naming the file.
#include <cstddef>
#include <cstdint>
#include <memory>
#include <set>
#include <string>
#include <vector>

#include "fp8rt/v1/checkpoint.pb.h"
#include "runtime/checkpoint/checkpoint_dir.h"
#include "runtime/checkpoint/checkpoint_io.h"
#include "tests/fuzz/fuzz_support.h"

namespace fp8rt::fuzz {
namespace {

constexpr char kName[] = "checkpoints/step-00000100/MANIFEST";
constexpr int64_t kSeedStep = 100;

void CheckManifest(const ShardReader& file, int64_t step) {
  absl::StatusOr<v1::CheckpointManifest> manifest = ParseManifest(file, step);
  if (!manifest.ok()) {
    const absl::Status& s = manifest.status();
    FUZZ_CHECK(absl::IsDataLoss(s), "not DataLoss: %s", s.ToString().c_str());
    FUZZ_CHECK(s.message().find(kName) != std::string::npos, "error does not name the file: %s",
               s.ToString().c_str());
    return;
  }
  FUZZ_CHECK(manifest->step() == step, "accepted the manifest of another step");
  FUZZ_CHECK(manifest->world_size() >= 1, "accepted world_size %d", manifest->world_size());
  FUZZ_CHECK(manifest->shards_size() == manifest->world_size(), "%d shards for world size %d",
             manifest->shards_size(), manifest->world_size());
  std::set<int> ranks;
  std::set<std::string> files;
  for (const v1::CheckpointShard& shard : manifest->shards()) {
    FUZZ_CHECK(shard.rank() >= 0 && shard.rank() < manifest->world_size(), "rank %d", shard.rank());
    ranks.insert(shard.rank());
    const std::string& f = shard.file();
    FUZZ_CHECK(!f.empty() && f != "." && f != ".." && f != "MANIFEST" &&
                   f.find('/') == std::string::npos && f.find('\0') == std::string::npos,
               "accepted shard file name of %zu bytes", f.size());
    files.insert(f);
  }
  FUZZ_CHECK(ranks.size() == static_cast<size_t>(manifest->world_size()), "ranks not covered");
  FUZZ_CHECK(files.size() == ranks.size(), "a shard file listed twice");
}

}  // namespace
}  // namespace fp8rt::fuzz

FP8RT_FUZZ_QUIET_PROTOBUF_INIT()

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace fp8rt;
  std::vector<std::byte> bytes = fuzz::ToBytes(data, size);
  fuzz::FixShardChecksums(bytes);
  absl::StatusOr<std::unique_ptr<ShardReader>> file =
      ShardReader::FromBytes(fuzz::kName, std::move(bytes));
  if (!file.ok()) return 0;  // the shard target checks these errors
  fuzz::CheckManifest(**file, fuzz::kSeedStep);
  v1::CheckpointManifest claimed;
  if (!(*file)->ParseProto("manifest", &claimed).ok()) return 0;
  if (claimed.step() != fuzz::kSeedStep) fuzz::CheckManifest(**file, claimed.step());
  return 0;
}
