// Fuzz target: checkpoint shard files (runtime/checkpoint/checkpoint_io.h, ShardReader::FromBytes,
// the parser behind ShardReader::Open).
//
// The input is a whole shard file. It is parsed twice: as it is, then with its checksums fixed
// (fuzz_support.h), so that mutations of lengths, names and bytes reach the checks behind the
// checksums. An accepted shard must keep ShardReader's promises: sections in bounds, names
// unique and found, the whole-file XXH64 that of the bytes; a refused one is DataLoss (every
// corruption is) with a message naming the file.
#include <xxhash.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <set>
#include <string>
#include <vector>

#include "fp8rt/v1/checkpoint.pb.h"
#include "runtime/checkpoint/checkpoint_io.h"
#include "tests/fuzz/fuzz_support.h"

namespace fp8rt::fuzz {
namespace {

constexpr char kName[] = "fuzz.shard";

void CheckOne(const std::vector<std::byte>& bytes) {
  absl::StatusOr<std::unique_ptr<ShardReader>> reader = ShardReader::FromBytes(kName, bytes);
  if (!reader.ok()) {
    const absl::Status& s = reader.status();
    // Corrupt bytes are DataLoss; an intact file (whole-file checksum holds) of another shard
    // format version is FailedPrecondition, refused as written by another fp8rt.
    const bool other_version = absl::IsFailedPrecondition(s) &&
                               s.message().find("shard format version") != std::string::npos;
    FUZZ_CHECK(absl::IsDataLoss(s) || other_version, "not DataLoss: %s", s.ToString().c_str());
    FUZZ_CHECK(s.message().find(kName) != std::string::npos, "error does not name the file: %s",
               s.ToString().c_str());
    return;
  }
  const ShardReader& r = **reader;
  FUZZ_CHECK(r.path() == kName, "path %s", r.path().c_str());
  FUZZ_CHECK(r.file_size() == bytes.size(), "file_size %llu of %zu bytes",
             static_cast<unsigned long long>(r.file_size()), bytes.size());
  FUZZ_CHECK(r.file_xxh64() == XXH64(bytes.data(), bytes.size(), 0), "file_xxh64");
  const std::vector<std::string> names = r.SectionNames();
  FUZZ_CHECK(std::set<std::string>(names.begin(), names.end()).size() == names.size(),
             "duplicate section names accepted");
  uint64_t section_bytes = 0;
  for (const std::string& name : names) {
    FUZZ_CHECK(!name.empty() && name.size() <= kMaxShardSectionNameBytes, "bad name length %zu",
               name.size());
    FUZZ_CHECK(r.HasSection(name), "HasSection false for a listed section");
    absl::StatusOr<std::span<const std::byte>> section = r.Section(name);
    FUZZ_CHECK(section.ok(), "listed section not found: %s", section.status().ToString().c_str());
    section_bytes += section->size();
    FUZZ_CHECK(section->size() <= bytes.size(), "section larger than the file");
    if (!section->empty()) {
      // In bounds of what the reader holds (ASan checks the read) and the bytes given to it.
      volatile std::byte first = section->front();
      volatile std::byte last = section->back();
      (void)first;
      (void)last;
    }
    // Whatever a section holds, parsing it as a message is an error or OK, nothing worse.
    v1::CheckpointManifest manifest;
    const absl::Status parsed = r.ParseProto(name, &manifest);
    FUZZ_CHECK(parsed.ok() || absl::IsDataLoss(parsed), "ParseProto: %s",
               parsed.ToString().c_str());
  }
  FUZZ_CHECK(section_bytes <= bytes.size(), "sections hold more bytes than the file");
  // A name the file does not hold. Not a constant alone: libFuzzer learns the strings the code
  // compares with, and once wrote a valid shard with a section of exactly that name (CI,
  // 2026-12-05), so the name is extended until it is absent from the listing.
  std::string absent_name = "no such section \x01";
  while (std::find(names.begin(), names.end(), absent_name) != names.end()) absent_name += '#';
  FUZZ_CHECK(!r.HasSection(absent_name), "HasSection of an absent name");
  const absl::StatusOr<std::span<const std::byte>> absent = r.Section(absent_name);
  FUZZ_CHECK(absl::IsNotFound(absent.status()), "Section of an absent name: %s",
             absent.status().ToString().c_str());
}

}  // namespace
}  // namespace fp8rt::fuzz

FP8RT_FUZZ_QUIET_PROTOBUF_INIT()

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  std::vector<std::byte> bytes = fp8rt::fuzz::ToBytes(data, size);
  fp8rt::fuzz::CheckOne(bytes);
  fp8rt::fuzz::FixShardChecksums(bytes);
  fp8rt::fuzz::CheckOne(bytes);
  return 0;
}
