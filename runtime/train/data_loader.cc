// TokenDataset (mmap + one validating pass) and DataLoader (window arithmetic); see data_loader.h.
#include "runtime/train/data_loader.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <limits>
#include <utility>

#include "absl/strings/str_cat.h"
#include "runtime/core/check.h"

namespace fp8rt::train {
namespace {

// Little-endian decode, independent of the host's byte order (compilers turn it into one load).
inline uint32_t LoadToken(const uint8_t* p, TokenFormat format) {
  switch (format) {
    case TokenFormat::kText:
      return p[0];
    case TokenFormat::kU16:
    case TokenFormat::kLlmc:
      return static_cast<uint32_t>(p[0]) | static_cast<uint32_t>(p[1]) << 8;
    case TokenFormat::kU32:
      return static_cast<uint32_t>(p[0]) | static_cast<uint32_t>(p[1]) << 8 |
             static_cast<uint32_t>(p[2]) << 16 | static_cast<uint32_t>(p[3]) << 24;
  }
  return 0;
}

// Index of the first token >= vocab, or `count` when all are in range.
uint64_t FirstTokenOutOfRange(const uint8_t* data, uint64_t count, TokenFormat format,
                              uint32_t vocab) {
  const size_t width = TokenBytes(format);
  // Formats whose every value is below vocab need no pass.
  if (width < 4 && vocab >= (uint64_t{1} << (8 * width))) return count;
  for (uint64_t i = 0; i < count; ++i) {
    if (LoadToken(data + i * width, format) >= vocab) return i;
  }
  return count;
}

std::string ErrnoText(int err) { return std::strerror(err); }

int32_t LoadInt32(const uint8_t* p) {
  return static_cast<int32_t>(LoadToken(p, TokenFormat::kU32));
}

// llm.c's header (kLlmcMagic): read with pread before the mapping, so that a file that is not a
// token file is refused before anything else is read. DataLoss naming the file and the field.
absl::Status CheckLlmcHeader(int fd, size_t bytes, const std::string& what) {
  if (bytes < kLlmcHeaderBytes) {
    return absl::DataLossError(absl::StrCat(what, ": llmc header: the file is ", bytes,
                                            " bytes, shorter than the ", kLlmcHeaderBytes,
                                            "-byte header"));
  }
  uint8_t head[12];
  if (::pread(fd, head, sizeof(head), 0) != static_cast<ssize_t>(sizeof(head))) {
    return absl::DataLossError(
        absl::StrCat(what, ": llmc header: cannot read it: ", ErrnoText(errno)));
  }
  const int32_t magic = LoadInt32(head), version = LoadInt32(head + 4),
                count = LoadInt32(head + 8);
  if (magic != kLlmcMagic) {
    return absl::DataLossError(absl::StrCat(what, ": llmc header: magic is ", magic,
                                            ", expected ", kLlmcMagic,
                                            " (not an llm.c token file?)"));
  }
  if (version != kLlmcVersion) {
    return absl::DataLossError(absl::StrCat(what, ": llmc header: version is ", version,
                                            ", expected ", kLlmcVersion, " (uint16 tokens)"));
  }
  const size_t body = bytes - kLlmcHeaderBytes;
  if (count < 0 || static_cast<uint64_t>(count) * 2 != body) {
    return absl::DataLossError(absl::StrCat(
        what, ": llmc header: token count is ", count, ", but the ", body,
        " bytes after the header hold ", body / 2, " uint16 tokens",
        body % 2 != 0 ? " and a partial one" : ""));
  }
  if (count == 0) {
    return absl::InvalidArgumentError(absl::StrCat(what, ": llmc file holds no tokens"));
  }
  return absl::OkStatus();
}

}  // namespace

std::string_view TokenFormatName(TokenFormat format) {
  switch (format) {
    case TokenFormat::kText:
      return "text";
    case TokenFormat::kU16:
      return "u16";
    case TokenFormat::kU32:
      return "u32";
    case TokenFormat::kLlmc:
      return "llmc";
  }
  return "?";
}

absl::StatusOr<TokenFormat> ParseTokenFormat(std::string_view name) {
  for (TokenFormat f :
       {TokenFormat::kText, TokenFormat::kU16, TokenFormat::kU32, TokenFormat::kLlmc}) {
    if (name == TokenFormatName(f)) return f;
  }
  return absl::InvalidArgumentError(absl::StrCat("unknown data format '",
                                                 std::string(name.substr(0, 64)),
                                                 "' (expected text, u16, u32 or llmc)"));
}

size_t TokenBytes(TokenFormat format) {
  switch (format) {
    case TokenFormat::kText:
      return 1;
    case TokenFormat::kU16:
    case TokenFormat::kLlmc:
      return 2;
    case TokenFormat::kU32:
      return 4;
  }
  return 1;
}

// ---------------------------------------------------------------------------------------------
// TokenDataset

absl::StatusOr<std::unique_ptr<TokenDataset>> TokenDataset::Open(const std::string& path,
                                                                 TokenFormat format,
                                                                 int32_t vocab) {
  const std::string what = absl::StrCat("data file ", path);
  if (vocab <= 0) {
    return absl::InvalidArgumentError(
        absl::StrCat(what, ": vocab must be at least 1, got ", vocab));
  }
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) {
    const int err = errno;
    if (err == ENOENT) return absl::NotFoundError(absl::StrCat(what, ": no such file"));
    return absl::InvalidArgumentError(absl::StrCat(what, ": cannot open: ", ErrnoText(err)));
  }
  struct stat st {};
  if (::fstat(fd, &st) != 0) {
    const int err = errno;
    ::close(fd);
    return absl::InvalidArgumentError(absl::StrCat(what, ": cannot stat: ", ErrnoText(err)));
  }
  if (!S_ISREG(st.st_mode)) {
    ::close(fd);
    return absl::InvalidArgumentError(absl::StrCat(what, ": not a regular file"));
  }
  const size_t bytes = static_cast<size_t>(st.st_size);
  const size_t width = TokenBytes(format);
  if (bytes == 0) {
    ::close(fd);
    return absl::InvalidArgumentError(absl::StrCat(what, ": file is empty"));
  }
  const size_t header = format == TokenFormat::kLlmc ? kLlmcHeaderBytes : 0;
  if (header > 0) {
    absl::Status checked = CheckLlmcHeader(fd, bytes, what);
    if (!checked.ok()) {
      ::close(fd);
      return checked;
    }
  }
  if ((bytes - header) % width != 0) {
    ::close(fd);
    return absl::DataLossError(
        absl::StrCat(what, ": size ", bytes, " bytes is not a multiple of the ", width, "-byte ",
                     std::string(TokenFormatName(format)),
                     " token (a partial token starts at byte offset ", bytes - bytes % width, ")"));
  }
  void* map = ::mmap(nullptr, bytes, PROT_READ, MAP_PRIVATE, fd, 0);
  const int map_err = errno;
  ::close(fd);  // the mapping keeps the file alive
  if (map == MAP_FAILED) {
    return absl::InternalError(absl::StrCat(what, ": mmap failed: ", ErrnoText(map_err)));
  }
  // Owns the mapping from here: any error below unmaps it.
  std::unique_ptr<TokenDataset> dataset(
      new TokenDataset(path, format, vocab, static_cast<const uint8_t*>(map), bytes));

  const uint64_t bad =
      FirstTokenOutOfRange(dataset->data_, dataset->size_, format, static_cast<uint32_t>(vocab));
  if (bad != dataset->size_) {
    return absl::DataLossError(absl::StrCat(
        what, ": token ", LoadToken(dataset->data_ + bad * width, format), " at byte offset ",
        header + bad * width, " (token ", bad, ") is not below vocab ", vocab));
  }
  return dataset;
}

TokenDataset::TokenDataset(std::string path, TokenFormat format, int32_t vocab, const uint8_t* map,
                           size_t bytes)
    : path_(std::move(path)),
      format_(format),
      vocab_(vocab),
      map_(map),
      bytes_(bytes),
      data_(map + (format == TokenFormat::kLlmc ? kLlmcHeaderBytes : 0)),
      size_((bytes - (format == TokenFormat::kLlmc ? kLlmcHeaderBytes : 0)) /
            TokenBytes(format)) {}

TokenDataset::~TokenDataset() { ::munmap(const_cast<uint8_t*>(map_), bytes_); }

int32_t TokenDataset::token(uint64_t i) const {
  FP8RT_CHECK(i < size_) << "token " << i << " past the end of " << path_ << " (" << size_
                         << " tokens)";
  return static_cast<int32_t>(LoadToken(data_ + i * TokenBytes(format_), format_));
}

void TokenDataset::Read(uint64_t begin, std::span<int32_t> out) const {
  FP8RT_CHECK(begin <= size_ && out.size() <= size_ - begin)
      << "tokens [" << begin << ", " << begin + out.size() << ") outside " << path_ << " (" << size_
      << " tokens)";
  const size_t width = TokenBytes(format_);
  const uint8_t* p = data_ + begin * width;
  // One switch per call, not per token.
  switch (format_) {
    case TokenFormat::kText:
      for (size_t i = 0; i < out.size(); ++i) out[i] = p[i];
      break;
    case TokenFormat::kU16:
    case TokenFormat::kLlmc:
      for (size_t i = 0; i < out.size(); ++i) {
        out[i] = static_cast<int32_t>(LoadToken(p + 2 * i, TokenFormat::kU16));
      }
      break;
    case TokenFormat::kU32:
      for (size_t i = 0; i < out.size(); ++i) {
        out[i] = static_cast<int32_t>(LoadToken(p + 4 * i, TokenFormat::kU32));
      }
      break;
  }
}

// ---------------------------------------------------------------------------------------------
// DataLoader

absl::StatusOr<DataLoader> DataLoader::Create(std::shared_ptr<const TokenDataset> dataset,
                                              const DataLoaderOptions& options) {
  if (dataset == nullptr) return absl::InvalidArgumentError("data loader: no dataset");
  if (options.seq_len < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("data loader: seq_len must be >= 1, got ", options.seq_len));
  }
  if (options.micro_batch < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("data loader: micro_batch must be >= 1, got ", options.micro_batch));
  }
  if (options.dp < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("data loader: dp must be >= 1, got ", options.dp));
  }
  if (options.dp_rank < 0 || options.dp_rank >= options.dp) {
    return absl::InvalidArgumentError(absl::StrCat("data loader: dp_rank must be in [0, ",
                                                   options.dp, "), got ", options.dp_rank));
  }
  const uint64_t window =
      static_cast<uint64_t>(options.micro_batch) * (static_cast<uint64_t>(options.seq_len) + 1);
  const uint64_t windows = dataset->size() / window;
  const uint64_t dp = static_cast<uint64_t>(options.dp);
  if (windows < dp) {
    const std::string need =
        windows == 0
            ? absl::StrCat("shorter than one window of micro_batch * (seq_len + 1) = ", window,
                           " tokens")
            : absl::StrCat("fewer than dp = ", dp,
                           " windows of micro_batch * (seq_len + 1) = ", window,
                           " tokens, so two ranks would read the same window");
    return absl::InvalidArgumentError(
        absl::StrCat("data file ", dataset->path(), " holds ", dataset->size(), " tokens: ", need));
  }
  // WindowAt computes (p mod W) * dp + dp_rank < W * dp, which must fit in 64 bits.
  if (windows > std::numeric_limits<uint64_t>::max() / dp) {
    return absl::InvalidArgumentError(absl::StrCat(
        "data file ", dataset->path(), ": too many windows (", windows, ") for dp ", dp));
  }
  return DataLoader(std::move(dataset), options, windows);
}

DataLoader::DataLoader(std::shared_ptr<const TokenDataset> dataset,
                       const DataLoaderOptions& options, uint64_t num_windows)
    : dataset_(std::move(dataset)),
      options_(options),
      batch_tokens_(static_cast<size_t>(options.micro_batch) *
                    (static_cast<size_t>(options.seq_len) + 1)),
      num_windows_(num_windows) {}

uint64_t DataLoader::WindowAt(uint64_t position) const {
  // (p * dp + r) mod W without overflow: reduce p first.
  return ((position % num_windows_) * static_cast<uint64_t>(options_.dp) +
          static_cast<uint64_t>(options_.dp_rank)) %
         num_windows_;
}

absl::Status DataLoader::BatchAt(uint64_t position, std::span<int32_t> tokens) const {
  if (tokens.size() != batch_tokens_) {
    return absl::InvalidArgumentError(
        absl::StrCat("data loader: batch buffer holds ", tokens.size(), " tokens, expected ",
                     batch_tokens_, " (micro_batch * (seq_len + 1))"));
  }
  dataset_->Read(WindowAt(position) * batch_tokens_, tokens);
  return absl::OkStatus();
}

absl::Status DataLoader::Next(std::span<int32_t> tokens) {
  if (absl::Status s = BatchAt(position_, tokens); !s.ok()) return s;
  ++position_;
  return absl::OkStatus();
}

absl::Status DataLoader::Seek(uint64_t position) {
  position_ = position;
  return absl::OkStatus();
}

}  // namespace fp8rt::train
