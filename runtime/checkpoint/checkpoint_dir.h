// Committed checkpoint folders: where a run's checkpoints live, how a save becomes a checkpoint
// (commit by rename), which checkpoint a resume may trust, and which old ones to delete.
//
// Defines:
//   CheckpointName, ShardFileName, kManifestFileName   the names inside the layout below.
//   ResumePoint     the checkpoint a resume starts from: step, folder, manifest.
//   ParseManifest   a MANIFEST already read, checked without the shards (what Verify checks first).
//   CheckResumable  whether a verified checkpoint fits a run's model and layout.
//   SameLayout      whether it was written at the run's layout (else it is resharded).
//   CheckpointDir   PrepareTemp / Commit (save), ListCommitted / Verify / FindNewestValid
//                   (resume), Prune / RemoveStaleTemps (housekeeping).
//
// Layout, under a run folder:
//   <run_dir>/checkpoints/                        root()
//     .tmp-step-00000200/                         a save in progress (or interrupted by a crash)
//     step-00000100/                              a committed checkpoint
//       rank-00000.shard ... rank-NNNNN.shard     one shard file per rank (checkpoint_io.h)
//       MANIFEST                                  v1::CheckpointManifest, written last
// Steps are written with 8 digits (0 .. 99999999), ranks with 5 (0 .. 99999).
//
// Saving. Rank 0 calls PrepareTemp(step); every rank writes its shard into that folder with
// ShardWriter and reports the ShardWriteResult (size, XXH64) to rank 0; rank 0 builds the manifest
// from the reports and calls Commit. Commit checks every shard against the manifest, writes
// MANIFEST (itself a shard file with one section "manifest", so it is checksummed too), fsyncs the
// folder and renames it to step-NNNNNNNN, then fsyncs root(). A checkpoint exists only once that
// rename has happened: a crash at any earlier point leaves a .tmp-step-* folder, which listing
// ignores and RemoveStaleTemps deletes.
//
// Resuming. FindNewestValid walks the committed checkpoints from the newest down and returns the
// first whose MANIFEST and every shard verify (checksums recomputed from the bytes on disk), so a
// torn or bit-rotten checkpoint costs the steps since the previous one, not the run. Refused
// checkpoints are left where they are: they still occupy their step's name (a later Commit of
// that step is AlreadyExists) and still count as committed for ListCommitted and Prune, so a
// caller that resumes past refused checkpoints should move them aside first.
//
// Errors name the file or folder. Filesystem failures are the errno kind of the failing call with
// the path; corruption is DataLoss naming the file (and the byte offset where ShardReader gives
// one). No exception escapes: std::filesystem is used through its error_code overloads.
//
// Threads and processes: a CheckpointDir is immutable after construction and holds no open files;
// its methods may be called from any thread. Saving assumes one committer per run folder (rank 0):
// two processes preparing, committing or pruning the same step at once are not coordinated.
#ifndef FP8RT_RUNTIME_CHECKPOINT_CHECKPOINT_DIR_H_
#define FP8RT_RUNTIME_CHECKPOINT_CHECKPOINT_DIR_H_

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "fp8rt/v1/checkpoint.pb.h"

namespace fp8rt {

// The folder name of the checkpoint of `step`: "step-" and the step with 8 digits, zero-padded
// ("step-00000012"). Meaningful for steps in [0, 99999999]; PrepareTemp and Commit refuse others.
std::string CheckpointName(int64_t step);

// The shard file name of `rank`: "rank-" and the rank with 5 digits, zero-padded, and ".shard"
// ("rank-00003.shard").
std::string ShardFileName(int rank);

// The name of the manifest file inside a checkpoint folder.
inline constexpr std::string_view kManifestFileName = "MANIFEST";

// A verified checkpoint to resume from.
struct ResumePoint {
  int64_t step = 0;                 // the checkpoint's step (== manifest.step())
  std::string dir;                  // its folder, CommittedDir(step)
  v1::CheckpointManifest manifest;  // its MANIFEST, already verified against every shard
};

class ShardReader;

// The manifest of the committed checkpoint of `step`, from `manifest_file`, its MANIFEST already
// opened (so its checksums are verified), checked as far as it can be without the shard files:
// its section "manifest" parses, its step is `step`, and its shards cover the ranks
// 0..world_size-1 exactly once with plain, distinct file names. DataLoss naming
// manifest_file.path() otherwise. Verify calls it before it checks the shards; it touches no file.
[[nodiscard]] absl::StatusOr<v1::CheckpointManifest> ParseManifest(const ShardReader& manifest_file,
                                                                   int64_t step);

// Whether `point` can resume a run of `spec`: FailedPrecondition naming the checkpoint's folder
// and what differs, when its model section does (the differing fields, bounded), or its layout
// does in a way a resume cannot follow: a checkpoint resumes at any dp x tp x ep with the same
// global batch dp x micro_batch x grad_accum (it is resharded as it loads). Called before any rank
// trains, by the controller's Register and by a standalone rank 0, so that such a resume is
// refused up front (the workers exit 2; `fp8rt launch --max-restarts` does not retry it).
[[nodiscard]] absl::Status CheckResumable(const ResumePoint& point, const v1::RunSpec& spec);

// Whether `manifest` was written at the layout of `spec` (parallel.dp, tp and ep, an ep of 0
// counting as 1): if not, a resume reshards it.
bool SameLayout(const v1::CheckpointManifest& manifest, const v1::RunSpec& spec);

class CheckpointDir {
 public:
  // Checkpoints of the run in `run_dir` (which need not exist yet); nothing is touched on disk.
  explicit CheckpointDir(std::string run_dir);

  // <run_dir>/checkpoints.
  const std::string& root() const { return root_; }
  // <root>/.tmp-step-NNNNNNNN: where the save of `step` is written before its commit.
  std::string TempDir(int64_t step) const;
  // <root>/step-NNNNNNNN: the committed checkpoint of `step`.
  std::string CommittedDir(int64_t step) const;

  // Creates root() if needed and a fresh, empty TempDir(step), removing a stale one of the same
  // step first; returns its path. Called by one process (rank 0) before the ranks write their
  // shards. InvalidArgument for a step outside [0, 99999999]; AlreadyExists if CommittedDir(step)
  // exists (the commit would fail, so fail before anyone writes).
  [[nodiscard]] absl::StatusOr<std::string> PrepareTemp(int64_t step) const;

  // Commits the save in TempDir(manifest.step()) as CommittedDir(manifest.step()). Checks, in this
  // order:
  //   InvalidArgument  step outside [0, 99999999], world_size < 1, shards not covering the ranks
  //                    0..world_size-1 exactly once, a shard file name that is not a plain file
  //                    name (empty, ".", "..", containing '/', or MANIFEST), or used twice;
  //   AlreadyExists    CommittedDir(step) exists;
  //   FailedPrecondition  the temp folder, or a listed shard file in it, is missing (naming it);
  //   DataLoss         a shard's size or whole-file XXH64, recomputed from its bytes, differs from
  //                    the manifest (naming the file, both values).
  // Then writes MANIFEST into the temp folder, fsyncs it, renames it to CommittedDir(step) and
  // fsyncs root(). On any failure before the rename nothing committed is visible and the temp
  // folder is LEFT IN PLACE for inspection (RemoveStaleTemps, or the next PrepareTemp of the same
  // step, removes it). If only the final fsync of root() fails, the checkpoint is visible but may
  // not survive a power loss; the error says so.
  [[nodiscard]] absl::Status Commit(const v1::CheckpointManifest& manifest) const;

  // Committed steps, ascending: folders in root() named step-NNNNNNNN (exactly 8 digits) that
  // contain a MANIFEST file. Temp folders and anything else are ignored; nothing is verified. An
  // absent root() gives an empty list.
  [[nodiscard]] absl::StatusOr<std::vector<int64_t>> ListCommitted() const;

  // Verifies the committed checkpoint of `step` and returns its manifest: MANIFEST opens
  // (ShardReader verifies its checksums) and parses, its step is `step`, its shards cover the
  // ranks exactly once with plain file names, and every listed shard exists, opens (every section
  // checksum and the trailer verified) and has the manifest's size and whole-file XXH64. Reads
  // every shard in full, one at a time. NotFound naming the folder or file that is missing;
  // DataLoss naming the file (and the offset where ShardReader gives one) for anything corrupt or
  // inconsistent; the errno kind naming the file for other I/O failures.
  [[nodiscard]] absl::StatusOr<v1::CheckpointManifest> Verify(int64_t step) const;

  // The newest committed checkpoint that verifies. For each newer one that fails, its error
  // message is appended to `refused` (if non-null). NotFound("no committed checkpoint in <root>
  // ...") when none exist or none verifies (the message then counts the refusals and quotes the
  // newest one); the errno kind if root() cannot be listed.
  [[nodiscard]] absl::StatusOr<ResumePoint> FindNewestValid(
      std::vector<std::string>* refused) const;

  // Retention: keeps the `keep` newest committed checkpoints (as ListCommitted sees them; nothing
  // is verified, so call it after a successful Commit) and deletes the older ones, whole folders;
  // the newest is never deleted. Each deleted folder is first renamed to its temp name, so an
  // interrupted delete leaves only a .tmp-step-* folder for RemoveStaleTemps. Returns the deleted
  // steps, ascending. InvalidArgument for keep < 1.
  [[nodiscard]] absl::StatusOr<std::vector<int64_t>> Prune(int keep) const;

  // Removes every .tmp-step-* folder in root() (saves interrupted by a crash, deletes interrupted
  // by Prune); returns how many. An absent root() gives 0. Must not run while a save is in
  // progress.
  [[nodiscard]] absl::StatusOr<int> RemoveStaleTemps() const;

 private:
  const std::string root_;  // <run_dir>/checkpoints; fixed at construction
};

}  // namespace fp8rt

#endif  // FP8RT_RUNTIME_CHECKPOINT_CHECKPOINT_DIR_H_
