// Checkpoint shard files: one rank's part of a checkpoint, as named sections of raw bytes.
//
// Defines:
//   ShardWriteResult  size and whole-file XXH64 of a written shard (what the rank acknowledges).
//   ShardWriter       collects sections, then writes them atomically (temp file, fsync, rename).
//   ShardReader       reads a shard and verifies every checksum before handing out a byte; or,
//                     opened ranged, reads only the sections asked for (resharding a resume).
//
// A section is a name (any bytes, 1..kMaxShardSectionNameBytes long, e.g.
// "master/blocks.0.mlp.fc1", "adam_m/blocks.0.mlp.fc1", "scaling/blocks.0.mlp.fc1/weight", "rng",
// "data_position") and its bytes; what the bytes mean is the caller's business.
//
// File format, version 1. All integers little-endian; XXH64 always with seed 0.
//   offset 0   magic          8 bytes, "FP8RTSH1"
//   offset 8   version        uint32, kShardFormatVersion
//   offset 12  section count  uint32
//   offset 16  the sections, in the order they were added, each:
//                name length  uint32
//                name         name length bytes
//                byte length  uint64
//                checksum     uint64, XXH64 of the section's bytes
//                bytes        byte length bytes
//   then       trailer        uint64, XXH64 of every byte before it (magic through last section)
// The file ends right after the trailer. Section names are unique within a file.
//
// Two checksums are in play. The trailer covers the file up to itself; the checksum a writer
// reports (ShardWriteResult::xxh64, ShardReader::file_xxh64) is XXH64 of the WHOLE file, trailer
// included, so anyone can recompute it from the bytes on disk (`xxh64sum FILE`) and compare it
// with what the rank acknowledged to the controller.
//
// Errors name the file. Write: InvalidArgument for a bad or duplicate section name (at Add),
// otherwise the errno kind of the failing call (open, write, fsync, rename) with the path; on any
// failure the temp file is removed, so nothing partial is left and an existing `path` is
// untouched. Open: NotFound if the file does not exist; DataLoss for bad magic, an unknown
// version, a truncated file, a section checksum mismatch, a whole-file checksum mismatch, trailing
// bytes or an impossible length; each DataLoss message names the file, the section when known
// (C-escaped), and the byte offset where the problem was found. Section: NotFound naming the
// section and the file.
//
// Ownership and threads: a ShardWriter owns copies of the bytes it was given (the caller's buffers
// may change after Add returns); it is not thread-safe. A ShardReader owns the whole file in
// memory and is immutable after Open, so any number of threads may read sections concurrently;
// the spans it returns live as long as the reader.
//
// Ranged readers (OpenRanged): the file stays open and only its structure (magic, version,
// section table, lengths) is checked at open, by reading the section headers alone. A section's
// bytes are read when first asked for, and its checksum verified then (DataLoss as above); the
// whole-file checksum is not checked, so use them on a checkpoint whose shards were verified
// against their MANIFEST already (CheckpointDir::Verify). They are thread-safe too.
#ifndef FP8RT_RUNTIME_CHECKPOINT_CHECKPOINT_IO_H_
#define FP8RT_RUNTIME_CHECKPOINT_CHECKPOINT_IO_H_

#include <cstddef>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

namespace google::protobuf {
class MessageLite;
}  // namespace google::protobuf

namespace fp8rt {

inline constexpr std::string_view kShardMagic = "FP8RTSH1";
inline constexpr uint32_t kShardFormatVersion = 1;
// Longest section name; a longer name length in a file is corruption.
inline constexpr uint32_t kMaxShardSectionNameBytes = 4096;

struct ShardWriteResult {
  uint64_t size = 0;   // bytes in the file
  uint64_t xxh64 = 0;  // XXH64 (seed 0) of the whole file, trailer included
};

class ShardWriter {
 public:
  ShardWriter() = default;
  ShardWriter(const ShardWriter&) = delete;
  ShardWriter& operator=(const ShardWriter&) = delete;

  // Adds a section holding a copy of `bytes` (which may be empty). InvalidArgument if the name is
  // empty, longer than kMaxShardSectionNameBytes, or already added.
  [[nodiscard]] absl::Status Add(std::string_view name, std::span<const std::byte> bytes);
  // Adds a section holding the serialized message (deterministic serialization).
  [[nodiscard]] absl::Status AddProto(std::string_view name,
                                      const google::protobuf::MessageLite& message);

  // Writes the sections to `path` atomically: to `path + ".tmp"`, fsync, rename over `path`, fsync
  // of the folder. The writer keeps its sections, so Write may be called again.
  [[nodiscard]] absl::StatusOr<ShardWriteResult> Write(const std::string& path) const;

  size_t section_count() const { return sections_.size(); }

 private:
  struct Section {
    std::string name;
    std::vector<std::byte> bytes;
    uint64_t xxh64;  // of bytes
  };
  std::vector<Section> sections_;  // in the order added; names unique
};

class ShardReader {
 public:
  // Reads `path` whole and verifies it (see the file comment for the errors).
  [[nodiscard]] static absl::StatusOr<std::unique_ptr<ShardReader>> Open(const std::string& path);
  // Verifies `data`, the whole file already in memory, exactly as Open verifies what it read;
  // `name` stands for the path in errors and is what path() returns. Open uses it after reading;
  // the fuzz target (tests/fuzz) calls it directly.
  [[nodiscard]] static absl::StatusOr<std::unique_ptr<ShardReader>> FromBytes(
      std::string name, std::vector<std::byte> data);
  // Opens `path` ranged (see the file comment): reads its section headers only.
  [[nodiscard]] static absl::StatusOr<std::unique_ptr<ShardReader>> OpenRanged(
      const std::string& path);
  ~ShardReader();

  ShardReader(const ShardReader&) = delete;
  ShardReader& operator=(const ShardReader&) = delete;

  const std::string& path() const { return path_; }
  uint64_t file_size() const { return file_size_; }
  // XXH64 of the whole file: compare with the checksum the rank acknowledged. 0 when ranged (the
  // whole file was not read).
  uint64_t file_xxh64() const { return file_xxh64_; }
  bool ranged() const { return fd_ >= 0; }
  // Bytes read from the file: all of it, or (ranged) the sections read so far.
  uint64_t bytes_read() const;

  // Section names in file order.
  std::vector<std::string> SectionNames() const;
  bool HasSection(std::string_view name) const;
  // The section's bytes (valid while the reader lives), or NotFound naming section and file.
  [[nodiscard]] absl::StatusOr<std::span<const std::byte>> Section(std::string_view name) const;
  // Parses the section into `message`: NotFound as above, DataLoss if it does not parse.
  [[nodiscard]] absl::Status ParseProto(std::string_view name,
                                        google::protobuf::MessageLite* message) const;

  struct SectionRef {
    std::string name;
    uint64_t offset;  // of the section's bytes in the file (and in data_)
    uint64_t size;
    uint64_t xxh64;  // as stored in the file
  };

 private:
  ShardReader(std::string path, std::vector<std::byte> data, uint64_t file_size, int fd,
              std::vector<SectionRef> sections, uint64_t file_xxh64);

  // All fixed at Open.
  const std::string path_;
  const std::vector<std::byte> data_;  // the whole file; empty when ranged
  const uint64_t file_size_;
  const int fd_;                                            // the open file when ranged, else -1
  const std::vector<SectionRef> sections_;                  // in file order
  const std::map<std::string, size_t, std::less<>> index_;  // name -> position in sections_
  const uint64_t file_xxh64_;
  // Ranged: the sections read so far (map nodes do not move, so their spans stay valid).
  mutable std::mutex mu_;
  mutable std::map<std::string, std::vector<std::byte>, std::less<>> loaded_;
  mutable uint64_t bytes_read_ = 0;
};

}  // namespace fp8rt

#endif  // FP8RT_RUNTIME_CHECKPOINT_CHECKPOINT_IO_H_
