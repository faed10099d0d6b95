// StateStore: the controller's runs on disk (--state-dir), so that a restarted controller still
// knows every run, its recipe versions, checkpoints and events.
//
// Layout: <state-dir>/runs/<run_id>.run, one v1::RunRecord (proto/fp8rt/v1/controller_state.proto)
// per run, stored as a shard file (runtime/checkpoint/checkpoint_io.h) with the single section
// kRunRecordSection. The shard format brings the checksums and the atomic write (temp file, fsync,
// rename, fsync of the folder), so a crash leaves either the old record or the new one, and a torn
// or bit-rotten file is detected rather than half-parsed. <state-dir>/run-tokens.tokens holds the
// SHA-256 of every valid run token (v1::RunTokens) the same way.
//
// Errors name the file. Loading refuses the whole state on the first bad file (DataLoss): a
// controller never starts with some of its runs silently missing.
//
// Threads: a StateStore is immutable after construction; Save of different runs may run
// concurrently, Save of the same run must be serialized by the caller.
#ifndef FP8RT_RUNTIME_CONTROLLER_STATE_STORE_H_
#define FP8RT_RUNTIME_CONTROLLER_STATE_STORE_H_

#include <string>
#include <string_view>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "fp8rt/v1/controller_state.pb.h"

namespace fp8rt::controller {

inline constexpr std::string_view kRunRecordSection = "fp8rt.v1.RunRecord";
inline constexpr std::string_view kRunTokensSection = "fp8rt.v1.RunTokens";

class StateStore {
 public:
  explicit StateStore(std::string state_dir);

  // Creates <state-dir>/runs if needed (the errno kind naming the folder on failure).
  [[nodiscard]] absl::Status Init() const;

  // Every run record, sorted by run id. Leftover temp files of interrupted writes are removed;
  // other files are ignored. DataLoss naming the file for one that does not verify or parse, or
  // whose content contradicts its name.
  [[nodiscard]] absl::StatusOr<std::vector<v1::RunRecord>> LoadAll() const;

  // Writes the record of record.run().run_id() atomically.
  [[nodiscard]] absl::Status Save(const v1::RunRecord& record) const;

  // <state-dir>/runs/<run_id>.run
  std::string PathOf(const std::string& run_id) const;

  // The run tokens' hashes (<state-dir>/run-tokens.tokens; empty when the file is missing).
  // DataLoss naming the file for one that does not verify or parse.
  [[nodiscard]] absl::StatusOr<v1::RunTokens> LoadTokens() const;
  // Writes them atomically. Callers serialize calls.
  [[nodiscard]] absl::Status SaveTokens(const v1::RunTokens& tokens) const;

 private:
  const std::string runs_dir_;     // <state-dir>/runs; fixed at construction
  const std::string tokens_path_;  // <state-dir>/run-tokens.tokens; fixed at construction
};

}  // namespace fp8rt::controller

#endif  // FP8RT_RUNTIME_CONTROLLER_STATE_STORE_H_
