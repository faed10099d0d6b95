// Process-level fault points in the checkpoint write path, for fault tests (issue 9): a test arms
// one named point through the environment, and the process dies (SIGKILL) or the write fails
// with ENOSPC exactly there. A process without the variable pays one cached getenv.
//
// Defines:
//   FaultPoint          the named points (below), in the order a save passes them.
//   InjectFault         a hook that may fail: OK, or ENOSPC (ResourceExhausted) when armed so.
//   InjectKill          a kill-only hook.
//   FaultByteLimit      for shard_bytes: how many bytes of a shard file to write before the fault.
//   SetFaultStep        the step of the save in progress, for hooks that do not know it.
//   ArmFaultPoint       arms a spec in-process (tests), instead of the environment.
//
// The variable, read once per process:
//   FP8RT_FAULT_POINT=<point>:<action>[:rank=R][:step=S][:after_bytes=B]
//     action       kill (SIGKILL self, after a line on stderr) or enospc (the write there fails
//                  with errno ENOSPC; only at shard_open, shard_bytes, shard_fsync and
//                  commit_manifest, where a full disk would fail a call)
//     rank=R       only in the process whose OMPI_COMM_WORLD_RANK (or PMIX_RANK / PMI_RANK) is R;
//                  without it, any process with the variable (e.g. fp8rt-controller)
//     step=S       only in the save of step S; without it, any write that passes the point
//                  (fp8rt-controller's state files use the same writer: give step=S)
//     after_bytes  shard_bytes only (required there): B bytes of the file are written, then the
//                  fault fires (B must be below the file's size, or it never fires)
//   Points (a shard file is a rank's shard, or the MANIFEST that Commit writes the same way):
//     shard_open               ShardWriter::Write: the temp file is created, nothing written
//     shard_bytes              ... after_bytes bytes of it written
//     shard_fsync              ... every byte written, before its fsync
//     shard_rename             ... fsynced and closed, before the rename to the final name
//     shard_renamed            ... renamed and the folder fsynced (a rank: before its ack)
//     shard_acked              worker under a controller: its ack answered, before the ranks agree
//     commit_manifest          CheckpointDir::Commit: shards checked, before MANIFEST is written
//     commit_manifest_written  ... MANIFEST written and the folder fsynced, before its rename
//     commit_renamed           ... renamed to step-N, before prune and the controller's state
//     prune                    CheckpointDir::Prune: an old checkpoint renamed to its temp name,
//                              before it is deleted
//     controller_committed     fp8rt-controller: committed and pruned, before its state is saved
// A malformed value aborts the process (FP8RT_CHECK) naming the variable: a test typo must not
// pass as "no fault".
//
// Threads: the armed spec is fixed at the first hook (or ArmFaultPoint); hooks may then be called
// from any thread. The save step is per thread (a save's writes, Commit and Prune run on one
// thread), so other threads' writes (the controller's state files) do not match step=S.
#ifndef FP8RT_RUNTIME_CORE_FAULT_POINT_H_
#define FP8RT_RUNTIME_CORE_FAULT_POINT_H_

#include <cstdint>
#include <optional>
#include <string_view>

#include "absl/status/status.h"

namespace fp8rt {

inline constexpr std::string_view kFaultPointVariable = "FP8RT_FAULT_POINT";

enum class FaultPoint : uint8_t {
  kShardOpen,
  kShardBytes,
  kShardFsync,
  kShardRename,
  kShardRenamed,
  kShardAcked,
  kCommitManifest,
  kCommitManifestWritten,
  kCommitRenamed,
  kPrune,
  kControllerCommitted,
};

// The point's name in FP8RT_FAULT_POINT ("shard_open", ...).
std::string_view FaultPointName(FaultPoint point);

// When the armed fault matches (point, this process's rank, `step`): kill never returns; enospc
// returns ErrnoToStatus(ENOSPC) naming `path`. Otherwise OK. `step` < 0: the SetFaultStep value.
[[nodiscard]] absl::Status InjectFault(FaultPoint point, int64_t step, std::string_view path);

// A hook where only kill is allowed (the parser refuses enospc there).
void InjectKill(FaultPoint point, int64_t step);

// shard_bytes armed for this process and `step` (< 0: the SetFaultStep value): after_bytes.
std::optional<uint64_t> FaultByteLimit(int64_t step);

// The step of the save this thread is doing (-1: none), for ShardWriter::Write and Prune.
void SetFaultStep(int64_t step);
int64_t FaultStep();

// Arms `spec` (the variable's syntax; empty disarms) instead of the environment. For in-process
// tests; call before any hook runs concurrently. InvalidArgument for a malformed spec.
[[nodiscard]] absl::Status ArmFaultPoint(std::string_view spec);

}  // namespace fp8rt

#endif  // FP8RT_RUNTIME_CORE_FAULT_POINT_H_
