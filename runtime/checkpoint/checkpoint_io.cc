// Checkpoint shard files: see checkpoint_io.h for the format and the error contract.
//
// Index: little-endian encoding helpers, XXH64 helpers, file helpers (WriteAll, SyncFolder),
// ShardWriter, the verifying parser (ParseShard), ShardReader.
#include "runtime/checkpoint/checkpoint_io.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>
#include <xxhash.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <filesystem>
#include <limits>
#include <mutex>
#include <optional>
#include <set>
#include <string>
#include <utility>

#include "absl/cleanup/cleanup.h"
#include "absl/strings/escaping.h"
#include "absl/strings/str_cat.h"
#include "google/protobuf/io/coded_stream.h"
#include "google/protobuf/io/zero_copy_stream_impl_lite.h"
#include "google/protobuf/message_lite.h"
#include "runtime/core/check.h"
#include "runtime/core/fault_point.h"
#include "runtime/core/status.h"

namespace fp8rt {
namespace {

// Smallest possible section on disk: name length, a 1-byte name, byte length, checksum.
constexpr uint64_t kMinSectionBytes = 4 + 1 + 8 + 8;
constexpr uint64_t kHeaderBytes = 8 + 4 + 4;  // magic, version, section count
constexpr uint64_t kTrailerBytes = 8;

void AppendU32(std::string* out, uint32_t v) {
  for (int i = 0; i < 4; ++i) out->push_back(static_cast<char>((v >> (8 * i)) & 0xff));
}
void AppendU64(std::string* out, uint64_t v) {
  for (int i = 0; i < 8; ++i) out->push_back(static_cast<char>((v >> (8 * i)) & 0xff));
}
uint32_t LoadU32(const std::byte* p) {
  uint32_t v = 0;
  for (int i = 0; i < 4; ++i) v |= static_cast<uint32_t>(p[i]) << (8 * i);
  return v;
}
uint64_t LoadU64(const std::byte* p) {
  uint64_t v = 0;
  for (int i = 0; i < 8; ++i) v |= static_cast<uint64_t>(p[i]) << (8 * i);
  return v;
}

uint64_t Xxh64(const void* data, size_t size) { return XXH64(data, size, /*seed=*/0); }

// A streaming XXH64 (seed 0).
class Xxh64Stream {
 public:
  Xxh64Stream() : state_(XXH64_createState()) {
    FP8RT_CHECK(state_ != nullptr) << "XXH64_createState failed";
    XXH64_reset(state_, 0);
  }
  Xxh64Stream(const Xxh64Stream&) = delete;
  Xxh64Stream& operator=(const Xxh64Stream&) = delete;
  ~Xxh64Stream() { XXH64_freeState(state_); }
  void Update(const void* data, size_t size) { XXH64_update(state_, data, size); }
  uint64_t Digest() const { return XXH64_digest(state_); }

 private:
  XXH64_state_t* const state_;  // owned
};

std::string Hex(uint64_t v) { return absl::StrCat("0x", absl::Hex(v, absl::kZeroPad16)); }

// Writes all of [data, data + size) to fd, retrying on EINTR and short writes.
absl::Status WriteAll(int fd, const void* data, size_t size, const std::string& path) {
  const char* p = static_cast<const char*>(data);
  while (size > 0) {
    const ssize_t n = ::write(fd, p, size);
    if (n < 0) {
      if (errno == EINTR) continue;
      return absl::ErrnoToStatus(errno, absl::StrCat("checkpoint shard: write to ", path));
    }
    p += n;
    size -= static_cast<size_t>(n);
  }
  return absl::OkStatus();
}

// fsyncs the folder holding `path`, so that a rename into it survives a crash.
absl::Status SyncFolder(const std::string& path) {
  const std::filesystem::path parent = std::filesystem::path(path).parent_path();
  const std::string folder = parent.empty() ? std::string(".") : parent.string();
  const int fd = ::open(folder.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (fd < 0) {
    return absl::ErrnoToStatus(
        errno, absl::StrCat("checkpoint shard ", path, ": open folder ", folder, " for fsync"));
  }
  const int rc = ::fsync(fd);
  const int fsync_errno = errno;
  ::close(fd);
  if (rc != 0) {
    return absl::ErrnoToStatus(fsync_errno,
                               absl::StrCat("checkpoint shard ", path, ": fsync folder ", folder));
  }
  return absl::OkStatus();
}

}  // namespace

// ---------------------------------------------------------------------------------------------
// ShardWriter

absl::Status ShardWriter::Add(std::string_view name, std::span<const std::byte> bytes) {
  if (name.empty()) return absl::InvalidArgumentError("checkpoint shard: empty section name");
  if (name.size() > kMaxShardSectionNameBytes) {
    return absl::InvalidArgumentError(
        absl::StrCat("checkpoint shard: section name of ", name.size(), " bytes exceeds ",
                     kMaxShardSectionNameBytes, ": \"", absl::CEscape(std::string(name)), "\""));
  }
  for (const Section& s : sections_) {
    if (s.name == name) {
      return absl::InvalidArgumentError(absl::StrCat("checkpoint shard: duplicate section \"",
                                                     absl::CEscape(std::string(name)), "\""));
    }
  }
  sections_.push_back(Section{std::string(name), std::vector<std::byte>(bytes.begin(), bytes.end()),
                              Xxh64(bytes.data(), bytes.size())});
  return absl::OkStatus();
}

absl::Status ShardWriter::AddProto(std::string_view name,
                                   const google::protobuf::MessageLite& message) {
  std::string serialized;
  {
    google::protobuf::io::StringOutputStream stream(&serialized);
    google::protobuf::io::CodedOutputStream coded(&stream);
    // Deterministic, so that the same state gives the same shard bytes and checksum.
    coded.SetSerializationDeterministic(true);
    if (!message.SerializeToCodedStream(&coded)) {
      return absl::InvalidArgumentError(
          absl::StrCat("checkpoint shard: section \"", absl::CEscape(std::string(name)),
                       "\": cannot serialize ", std::string(message.GetTypeName())));
    }
  }
  return Add(name, std::as_bytes(std::span<const char>(serialized.data(), serialized.size())));
}

absl::StatusOr<ShardWriteResult> ShardWriter::Write(const std::string& path) const {
  const std::string tmp = path + ".tmp";
  int fd = ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (fd < 0) {
    return absl::ErrnoToStatus(errno,
                               absl::StrCat("checkpoint shard ", path, ": create temp file ", tmp));
  }
  // Until the rename succeeds, any return closes and removes the temp file.
  bool renamed = false;
  absl::Cleanup cleanup = [&] {
    if (fd >= 0) ::close(fd);
    if (!renamed) ::unlink(tmp.c_str());
  };
  // Fault points (fault_point.h; no-ops unless FP8RT_FAULT_POINT arms one): the step is the save's.
  FP8RT_RETURN_IF_ERROR(InjectFault(FaultPoint::kShardOpen, -1, tmp));
  const std::optional<uint64_t> fault_after_bytes = FaultByteLimit(-1);

  // `body` hashes everything before the trailer (the trailer's value); `file` hashes everything.
  Xxh64Stream body;
  Xxh64Stream file;
  uint64_t size = 0;
  auto emit = [&](const void* data, size_t n, bool in_body) -> absl::Status {
    if (fault_after_bytes.has_value() && size + n > *fault_after_bytes) {
      // Write up to the armed byte count, then die or fail as a full disk would.
      FP8RT_RETURN_IF_ERROR(WriteAll(fd, data, *fault_after_bytes - size, tmp));
      size = *fault_after_bytes;
      return InjectFault(FaultPoint::kShardBytes, -1, tmp);
    }
    FP8RT_RETURN_IF_ERROR(WriteAll(fd, data, n, tmp));
    if (in_body) body.Update(data, n);
    file.Update(data, n);
    size += n;
    return absl::OkStatus();
  };

  std::string header(kShardMagic);
  AppendU32(&header, kShardFormatVersion);
  AppendU32(&header, static_cast<uint32_t>(sections_.size()));
  FP8RT_RETURN_IF_ERROR(emit(header.data(), header.size(), true));
  for (const Section& s : sections_) {
    std::string head;
    AppendU32(&head, static_cast<uint32_t>(s.name.size()));
    head += s.name;
    AppendU64(&head, s.bytes.size());
    AppendU64(&head, s.xxh64);
    FP8RT_RETURN_IF_ERROR(emit(head.data(), head.size(), true));
    FP8RT_RETURN_IF_ERROR(emit(s.bytes.data(), s.bytes.size(), true));
  }
  std::string trailer;
  AppendU64(&trailer, body.Digest());
  FP8RT_RETURN_IF_ERROR(emit(trailer.data(), trailer.size(), false));

  FP8RT_RETURN_IF_ERROR(InjectFault(FaultPoint::kShardFsync, -1, tmp));
  if (::fsync(fd) != 0) {
    return absl::ErrnoToStatus(errno, absl::StrCat("checkpoint shard ", path, ": fsync ", tmp));
  }
  const int close_rc = ::close(fd);
  fd = -1;
  if (close_rc != 0) {
    return absl::ErrnoToStatus(errno, absl::StrCat("checkpoint shard ", path, ": close ", tmp));
  }
  InjectKill(FaultPoint::kShardRename, -1);
  if (::rename(tmp.c_str(), path.c_str()) != 0) {
    return absl::ErrnoToStatus(errno,
                               absl::StrCat("checkpoint shard ", path, ": rename ", tmp, " to it"));
  }
  renamed = true;
  FP8RT_RETURN_IF_ERROR(SyncFolder(path));
  InjectKill(FaultPoint::kShardRenamed, -1);
  return ShardWriteResult{size, file.Digest()};
}

// ---------------------------------------------------------------------------------------------
// Parsing and ShardReader

namespace {

struct ParsedShard {
  std::vector<std::string> names;
  std::vector<uint64_t> offsets;
  std::vector<uint64_t> sizes;
  std::vector<uint64_t> checksums;  // as stored; verified already unless the shard is ranged
};

// Reads all of [offset, offset + size) of fd into out, retrying on EINTR and short reads.
absl::Status PreadAll(int fd, uint64_t offset, size_t size, std::byte* out,
                      const std::string& path) {
  size_t got = 0;
  while (got < size) {
    const ssize_t r = ::pread(fd, out + got, size - got, static_cast<off_t>(offset + got));
    if (r < 0) {
      if (errno == EINTR) continue;
      return absl::ErrnoToStatus(errno, absl::StrCat("checkpoint shard ", path, ": read"));
    }
    if (r == 0) {
      return absl::DataLossError(absl::StrCat("corrupt checkpoint shard ", path, " at offset ",
                                              offset + got, ": file shrank while being read"));
    }
    got += static_cast<size_t>(r);
  }
  return absl::OkStatus();
}

// What ParseShard reads: the whole file in memory, or an open file read by ranges (then only the
// structure is checked: the section checksums are verified when a section is read, and the
// whole-file checksum not at all).
struct ShardSource {
  uint64_t size = 0;
  std::span<const std::byte> memory;  // the whole file; empty when ranged
  int fd = -1;                        // the open file when ranged
  bool ranged() const { return fd >= 0; }
  // Bytes [offset, offset + n), which the caller checked lie inside the file.
  absl::StatusOr<std::vector<std::byte>> Read(uint64_t offset, size_t n,
                                              const std::string& path) const {
    std::vector<std::byte> out(n);
    if (!ranged()) {
      // n == 0 (an empty or truncated file) may come with a null `memory`: memcpy must not see it.
      if (n > 0) std::memcpy(out.data(), memory.data() + offset, n);
      return out;
    }
    FP8RT_RETURN_IF_ERROR(PreadAll(fd, offset, n, out.data(), path));
    return out;
  }
  // XXH64 of bytes [0, n).
  absl::StatusOr<uint64_t> Hash(uint64_t n, const std::string& path) const {
    if (!ranged()) return Xxh64(memory.data(), n);
    Xxh64Stream stream;
    std::vector<std::byte> buffer(1 << 20);
    for (uint64_t at = 0; at < n;) {
      const size_t chunk = static_cast<size_t>(std::min<uint64_t>(buffer.size(), n - at));
      FP8RT_RETURN_IF_ERROR(PreadAll(fd, at, chunk, buffer.data(), path));
      stream.Update(buffer.data(), chunk);
      at += chunk;
    }
    return stream.Digest();
  }
};

// Verifies the shard in `source` and lists its sections. Every check is bounded by the file size
// before it reads, so a corrupt length never reads out of bounds or allocates by it.
absl::StatusOr<ParsedShard> ParseShard(const std::string& path, const ShardSource& source) {
  const uint64_t n = source.size;
  auto loss = [&](uint64_t offset, std::string_view section, std::string_view what) {
    std::string where =
        section.empty() ? std::string()
                        : absl::StrCat(", section \"", absl::CEscape(std::string(section)), "\"");
    return absl::DataLossError(absl::StrCat("corrupt checkpoint shard ", path, where, " at offset ",
                                            offset, ": ", std::string(what)));
  };

  // Magic: the first differing byte, or truncation inside it.
  FP8RT_ASSIGN_OR_RETURN(
      const std::vector<std::byte> magic,
      source.Read(0, static_cast<size_t>(std::min<uint64_t>(n, kShardMagic.size())), path));
  for (uint64_t i = 0; i < kShardMagic.size(); ++i) {
    if (i >= n) return loss(n, {}, absl::StrCat("truncated: file is ", n, " bytes (in the magic)"));
    if (static_cast<char>(magic[i]) != kShardMagic[i]) {
      return loss(i, {}, absl::StrCat("bad magic (expected \"", std::string(kShardMagic), "\")"));
    }
  }
  if (n < kHeaderBytes + kTrailerBytes) {
    return loss(n, {},
                absl::StrCat("truncated: file is ", n, " bytes, a shard has at least ",
                             kHeaderBytes + kTrailerBytes));
  }
  FP8RT_ASSIGN_OR_RETURN(const std::vector<std::byte> header, source.Read(8, 8, path));
  const uint64_t body_end = n - kTrailerBytes;  // where the trailer starts
  FP8RT_ASSIGN_OR_RETURN(const std::vector<std::byte> trailer_bytes,
                         source.Read(body_end, kTrailerBytes, path));
  const uint64_t trailer = LoadU64(trailer_bytes.data());
  const uint32_t version = LoadU32(&header[0]);
  if (version != kShardFormatVersion) {
    // Intact (its whole-file checksum holds): written by another fp8rt, not corrupt, so refused
    // as such (FailedPrecondition) rather than skipped like a damaged file.
    FP8RT_ASSIGN_OR_RETURN(const uint64_t body_hash, source.Hash(body_end, path));
    if (body_hash == trailer) {
      return absl::FailedPreconditionError(absl::StrCat(
          "checkpoint shard ", path, " is in shard format version ", version,
          ", which this build cannot read (it reads version ", kShardFormatVersion,
          "): written by another fp8rt version"));
    }
    return loss(8, {},
                absl::StrCat("unknown format version ", version, " (this build reads version ",
                             kShardFormatVersion, ")"));
  }
  const uint32_t count = LoadU32(&header[4]);
  if (static_cast<uint64_t>(count) * kMinSectionBytes > body_end - kHeaderBytes) {
    return loss(12, {},
                absl::StrCat("section count ", count, " cannot fit in a ", n,
                             "-byte file (truncated or corrupt)"));
  }

  ParsedShard parsed;
  parsed.names.reserve(count);
  parsed.offsets.reserve(count);
  parsed.sizes.reserve(count);
  parsed.checksums.reserve(count);
  std::set<std::string, std::less<>> seen_names;  // duplicates are corruption
  uint64_t pos = kHeaderBytes;
  for (uint32_t i = 0; i < count; ++i) {
    const std::string label = absl::StrCat("section #", i);
    if (body_end - pos < 4) {
      return loss(pos, {}, absl::StrCat("truncated: ", label, " name length runs past the end"));
    }
    FP8RT_ASSIGN_OR_RETURN(const std::vector<std::byte> len_bytes, source.Read(pos, 4, path));
    const uint32_t name_len = LoadU32(len_bytes.data());
    if (name_len == 0 || name_len > kMaxShardSectionNameBytes) {
      return loss(pos, {},
                  absl::StrCat(label, " name length ", name_len, " is outside [1, ",
                               kMaxShardSectionNameBytes, "]"));
    }
    if (body_end - pos - 4 < name_len) {
      return loss(pos, {}, absl::StrCat("truncated: ", label, " name runs past the end"));
    }
    FP8RT_ASSIGN_OR_RETURN(const std::vector<std::byte> name_bytes,
                           source.Read(pos + 4, name_len, path));
    std::string name(reinterpret_cast<const char*>(name_bytes.data()), name_len);
    const uint64_t name_offset = pos + 4;
    pos += 4 + name_len;
    if (!seen_names.insert(name).second) {
      return loss(name_offset, name, "duplicate section name");
    }
    if (body_end - pos < 16) {
      return loss(pos, name, "truncated: byte length and checksum run past the end");
    }
    FP8RT_ASSIGN_OR_RETURN(const std::vector<std::byte> fields, source.Read(pos, 16, path));
    const uint64_t length = LoadU64(&fields[0]);
    const uint64_t stored = LoadU64(&fields[8]);
    const uint64_t length_offset = pos;
    pos += 16;
    if (length > body_end - pos) {
      return loss(length_offset, name,
                  absl::StrCat("truncated: byte length ", length, " runs past the end (",
                               body_end - pos, " bytes left before the trailer)"));
    }
    if (!source.ranged()) {
      const uint64_t computed = Xxh64(&source.memory[pos], length);
      if (computed != stored) {
        return loss(pos, name,
                    absl::StrCat("section checksum mismatch over bytes [", pos, ", ", pos + length,
                                 "): stored ", Hex(stored), " (at offset ", length_offset + 8,
                                 "), computed ", Hex(computed)));
      }
    }
    parsed.names.push_back(std::move(name));
    parsed.offsets.push_back(pos);
    parsed.sizes.push_back(length);
    parsed.checksums.push_back(stored);
    pos += length;
  }
  if (pos != body_end) {
    return loss(pos, {},
                absl::StrCat(body_end - pos, " unexpected bytes after the last of ", count,
                             " sections (section count or a length is corrupt)"));
  }
  if (!source.ranged()) {
    const uint64_t computed = Xxh64(source.memory.data(), body_end);
    if (computed != trailer) {
      return loss(body_end, {},
                  absl::StrCat("whole-file checksum mismatch over bytes [0, ", body_end,
                               "): stored ", Hex(trailer), ", computed ", Hex(computed)));
    }
  }
  return parsed;
}

std::vector<ShardReader::SectionRef> ToRefs(ParsedShard parsed) {
  std::vector<ShardReader::SectionRef> sections;
  sections.reserve(parsed.names.size());
  for (size_t i = 0; i < parsed.names.size(); ++i) {
    sections.push_back(ShardReader::SectionRef{std::move(parsed.names[i]), parsed.offsets[i],
                                               parsed.sizes[i], parsed.checksums[i]});
  }
  return sections;
}

// Opens `path` for reading, as a regular file, and returns the descriptor and its size.
absl::StatusOr<std::pair<int, uint64_t>> OpenRegular(const std::string& path) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) return absl::ErrnoToStatus(errno, absl::StrCat("checkpoint shard ", path, ": open"));
  struct stat st;
  if (::fstat(fd, &st) != 0) {
    const int e = errno;
    ::close(fd);
    return absl::ErrnoToStatus(e, absl::StrCat("checkpoint shard ", path, ": fstat"));
  }
  if (!S_ISREG(st.st_mode)) {
    ::close(fd);
    return absl::InvalidArgumentError(
        absl::StrCat("checkpoint shard ", path, ": not a regular file"));
  }
  return std::make_pair(fd, static_cast<uint64_t>(st.st_size));
}

}  // namespace

absl::StatusOr<std::unique_ptr<ShardReader>> ShardReader::Open(const std::string& path) {
  FP8RT_ASSIGN_OR_RETURN(const auto opened, OpenRegular(path));
  const int fd = opened.first;
  absl::Cleanup close_fd = [fd] { ::close(fd); };
  std::vector<std::byte> data(static_cast<size_t>(opened.second));
  FP8RT_RETURN_IF_ERROR(PreadAll(fd, 0, data.size(), data.data(), path));
  return FromBytes(path, std::move(data));
}

absl::StatusOr<std::unique_ptr<ShardReader>> ShardReader::FromBytes(std::string name,
                                                                    std::vector<std::byte> data) {
  FP8RT_ASSIGN_OR_RETURN(
      ParsedShard parsed,
      ParseShard(name, ShardSource{.size = data.size(), .memory = data, .fd = -1}));
  const uint64_t file_xxh64 = Xxh64(data.data(), data.size());
  const uint64_t size = data.size();
  return std::unique_ptr<ShardReader>(new ShardReader(std::move(name), std::move(data), size, -1,
                                                      ToRefs(std::move(parsed)), file_xxh64));
}

absl::StatusOr<std::unique_ptr<ShardReader>> ShardReader::OpenRanged(const std::string& path) {
  FP8RT_ASSIGN_OR_RETURN(const auto opened, OpenRegular(path));
  const int fd = opened.first;
  absl::StatusOr<ParsedShard> parsed =
      ParseShard(path, ShardSource{.size = opened.second, .memory = {}, .fd = fd});
  if (!parsed.ok()) {
    ::close(fd);
    return parsed.status();
  }
  return std::unique_ptr<ShardReader>(
      new ShardReader(path, {}, opened.second, fd, ToRefs(*std::move(parsed)), 0));
}

namespace {
std::map<std::string, size_t, std::less<>> IndexByName(const auto& sections) {
  std::map<std::string, size_t, std::less<>> index;
  for (size_t i = 0; i < sections.size(); ++i) index.emplace(sections[i].name, i);
  return index;
}
}  // namespace

ShardReader::ShardReader(std::string path, std::vector<std::byte> data, uint64_t file_size, int fd,
                         std::vector<SectionRef> sections, uint64_t file_xxh64)
    : path_(std::move(path)),
      data_(std::move(data)),
      file_size_(file_size),
      fd_(fd),
      sections_(std::move(sections)),
      index_(IndexByName(sections_)),
      file_xxh64_(file_xxh64) {}

ShardReader::~ShardReader() {
  if (fd_ >= 0) ::close(fd_);
}

std::vector<std::string> ShardReader::SectionNames() const {
  std::vector<std::string> names;
  names.reserve(sections_.size());
  for (const SectionRef& s : sections_) names.push_back(s.name);
  return names;
}

bool ShardReader::HasSection(std::string_view name) const { return index_.contains(name); }

absl::StatusOr<std::span<const std::byte>> ShardReader::Section(std::string_view name) const {
  const auto it = index_.find(name);
  if (it == index_.end()) {
    return absl::NotFoundError(absl::StrCat("checkpoint shard ", path_, " has no section \"",
                                            absl::CEscape(std::string(name)), "\""));
  }
  const SectionRef& s = sections_[it->second];
  if (fd_ < 0) return std::span<const std::byte>(data_.data() + s.offset, s.size);
  // Ranged: read the section once, verify its checksum, keep it.
  std::lock_guard<std::mutex> lock(mu_);
  auto cached = loaded_.find(s.name);
  if (cached == loaded_.end()) {
    std::vector<std::byte> bytes(static_cast<size_t>(s.size));
    FP8RT_RETURN_IF_ERROR(PreadAll(fd_, s.offset, bytes.size(), bytes.data(), path_));
    const uint64_t computed = Xxh64(bytes.data(), bytes.size());
    if (computed != s.xxh64) {
      return absl::DataLossError(absl::StrCat(
          "corrupt checkpoint shard ", path_, ", section \"", absl::CEscape(s.name),
          "\" at offset ", s.offset, ": section checksum mismatch over bytes [", s.offset, ", ",
          s.offset + s.size, "): stored ", Hex(s.xxh64), ", computed ", Hex(computed)));
    }
    bytes_read_ += s.size;
    cached = loaded_.emplace(s.name, std::move(bytes)).first;
  }
  return std::span<const std::byte>(cached->second.data(), cached->second.size());
}

uint64_t ShardReader::bytes_read() const {
  if (fd_ < 0) return file_size_;
  std::lock_guard<std::mutex> lock(mu_);
  return bytes_read_;
}

absl::Status ShardReader::ParseProto(std::string_view name,
                                     google::protobuf::MessageLite* message) const {
  FP8RT_ASSIGN_OR_RETURN(std::span<const std::byte> bytes, Section(name));
  if (bytes.size() > static_cast<size_t>(std::numeric_limits<int>::max()) ||
      !message->ParseFromArray(bytes.data(), static_cast<int>(bytes.size()))) {
    const SectionRef& s = sections_[index_.find(name)->second];
    return absl::DataLossError(absl::StrCat(
        "corrupt checkpoint shard ", path_, ", section \"", absl::CEscape(std::string(name)),
        "\" at offset ", s.offset, ": does not parse as ", std::string(message->GetTypeName())));
  }
  return absl::OkStatus();
}

}  // namespace fp8rt
