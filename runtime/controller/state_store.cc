// Run records on disk (see state_store.h).
#include "runtime/controller/state_store.h"

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <filesystem>
#include <system_error>

#include "absl/strings/str_cat.h"
#include "runtime/checkpoint/checkpoint_io.h"
#include "runtime/core/status.h"

namespace fp8rt::controller {
namespace {

namespace fs = std::filesystem;

constexpr std::string_view kSuffix = ".run";
// ShardWriter writes <path>.tmp and renames it over <path>.
constexpr std::string_view kTempSuffix = ".run.tmp";

absl::Status FsError(const std::error_code& ec, const std::string& what) {
  return absl::Status(absl::ErrnoToStatusCode(ec.value()), absl::StrCat(what, ": ", ec.message()));
}

}  // namespace

StateStore::StateStore(std::string state_dir)
    : runs_dir_((fs::path(state_dir) / "runs").string()),
      tokens_path_((fs::path(state_dir) / "run-tokens.tokens").string()) {}

std::string StateStore::PathOf(const std::string& run_id) const {
  return (fs::path(runs_dir_) / (run_id + std::string(kSuffix))).string();
}

absl::Status StateStore::Init() const {
  std::error_code ec;
  fs::create_directories(runs_dir_, ec);
  if (ec) return FsError(ec, absl::StrCat("cannot create the state folder ", runs_dir_));
  return absl::OkStatus();
}

absl::StatusOr<std::vector<v1::RunRecord>> StateStore::LoadAll() const {
  std::vector<std::string> files;
  std::error_code ec;
  fs::directory_iterator it(runs_dir_, ec);
  if (ec) return FsError(ec, absl::StrCat("cannot list the state folder ", runs_dir_));
  for (const fs::directory_entry& entry : it) {
    const std::string name = entry.path().filename().string();
    if (name.ends_with(kTempSuffix)) {
      // A write interrupted before its rename: the previous record (if any) is still complete.
      fs::remove(entry.path(), ec);
      continue;
    }
    if (name.ends_with(kSuffix)) files.push_back(entry.path().string());
  }
  std::sort(files.begin(), files.end());

  std::vector<v1::RunRecord> records;
  for (const std::string& path : files) {
    FP8RT_ASSIGN_OR_RETURN(std::unique_ptr<ShardReader> reader, ShardReader::Open(path));
    v1::RunRecord record;
    absl::Status s = reader->ParseProto(kRunRecordSection, &record);
    if (!s.ok()) {
      return absl::DataLossError(absl::StrCat(path, ": not a run record: ", s.message()));
    }
    const std::string stem = fs::path(path).filename().string();
    const std::string expected_id = stem.substr(0, stem.size() - kSuffix.size());
    if (record.run().run_id() != expected_id) {
      return absl::DataLossError(absl::StrCat(path, ": holds run '", record.run().run_id(),
                                              "', expected '", expected_id, "'"));
    }
    if (record.recipes().empty() || record.run().world_size() < 1) {
      return absl::DataLossError(
          absl::StrCat(path, ": incomplete run record (no recipe version or no world size)"));
    }
    records.push_back(std::move(record));
  }
  return records;
}

absl::Status StateStore::Save(const v1::RunRecord& record) const {
  ShardWriter writer;
  FP8RT_RETURN_IF_ERROR(writer.AddProto(kRunRecordSection, record));
  return writer.Write(PathOf(record.run().run_id())).status();
}

absl::StatusOr<v1::RunTokens> StateStore::LoadTokens() const {
  v1::RunTokens tokens;
  std::error_code ec;
  if (!fs::exists(tokens_path_, ec)) return tokens;
  FP8RT_ASSIGN_OR_RETURN(std::unique_ptr<ShardReader> reader, ShardReader::Open(tokens_path_));
  absl::Status s = reader->ParseProto(kRunTokensSection, &tokens);
  if (!s.ok()) {
    return absl::DataLossError(absl::StrCat(tokens_path_, ": not a run token file: ", s.message()));
  }
  return tokens;
}

absl::Status StateStore::SaveTokens(const v1::RunTokens& tokens) const {
  ShardWriter writer;
  FP8RT_RETURN_IF_ERROR(writer.AddProto(kRunTokensSection, tokens));
  return writer.Write(tokens_path_).status();
}

}  // namespace fp8rt::controller
