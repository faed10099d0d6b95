// TokenDataset (mmap + one validating pass), EpochPermutation (seeded Fisher-Yates) and
// DataLoader (window and sequence arithmetic); see data_loader.h.
#include "runtime/train/data_loader.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <limits>
#include <random>
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
// EpochPermutation

std::vector<uint64_t> EpochPermutation(uint64_t sequences, uint64_t seed, uint64_t epoch) {
  std::vector<uint64_t> order(sequences);
  for (uint64_t i = 0; i < sequences; ++i) order[i] = i;
  std::seed_seq seq{static_cast<uint32_t>(seed), static_cast<uint32_t>(seed >> 32),
                    static_cast<uint32_t>(epoch), static_cast<uint32_t>(epoch >> 32)};
  std::mt19937_64 engine(seq);
  for (uint64_t i = sequences; i > 1; --i) {
    // j uniform in [0, i): reject the low (2^64 mod i) draws so that every residue is equally
    // likely (std::uniform_int_distribution is not the same on every standard library).
    const uint64_t threshold = (0 - i) % i;
    uint64_t x = engine();
    while (x < threshold) x = engine();
    std::swap(order[i - 1], order[x % i]);
  }
  return order;
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
  if (options.grad_accum < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("data loader: grad_accum must be >= 1, got ", options.grad_accum));
  }
  const uint64_t end = std::min(options.range.end, dataset->size());
  if (options.range.begin > end) {
    return absl::InvalidArgumentError(
        absl::StrCat("data loader: range [", options.range.begin, ", ", options.range.end,
                     ") outside ", dataset->path(), " (", dataset->size(), " tokens)"));
  }
  const uint64_t tokens = end - options.range.begin;
  // What the messages call the data: the file, or the part of it read.
  const std::string what =
      options.range.begin == 0 && end == dataset->size()
          ? absl::StrCat("data file ", dataset->path(), " holds ", tokens, " tokens")
          : absl::StrCat("tokens [", options.range.begin, ", ", end, ") of data file ",
                         dataset->path(), " hold ", tokens, " tokens");
  const uint64_t row = static_cast<uint64_t>(options.seq_len) + 1;
  const uint64_t b = static_cast<uint64_t>(options.micro_batch);
  const uint64_t dp = static_cast<uint64_t>(options.dp);
  const uint64_t sequences = tokens / row;
  const uint64_t windows = sequences / b;
  if (windows < dp) {
    const std::string need =
        windows == 0
            ? absl::StrCat("shorter than one window of micro_batch * (seq_len + 1) = ", b * row,
                           " tokens")
            : absl::StrCat("fewer than dp = ", dp,
                           " windows of micro_batch * (seq_len + 1) = ", b * row,
                           " tokens, so two ranks would read the same window");
    return absl::InvalidArgumentError(absl::StrCat(what, ": ", need));
  }
  // WindowAt computes (p mod W) * dp + dp_rank < W * dp, which must fit in 64 bits, and the
  // shuffled counters (p * dp + r) * B + i are taken modulo E <= S in 128 bits.
  if (windows > std::numeric_limits<uint64_t>::max() / dp) {
    return absl::InvalidArgumentError(absl::StrCat(
        "data file ", dataset->path(), ": too many windows (", windows, ") for dp ", dp));
  }
  if (options.shuffle) {
    const uint64_t step = b * dp * static_cast<uint64_t>(options.grad_accum);
    if (sequences < step) {
      return absl::InvalidArgumentError(absl::StrCat(
          what, ": ", sequences, " sequences of seq_len + 1 = ", row,
          " tokens, fewer than one optimizer step reads (micro_batch * dp * grad_accum = ", step,
          ")"));
    }
  }
  return DataLoader(std::move(dataset), options, options.range.begin, sequences);
}

DataLoader::DataLoader(std::shared_ptr<const TokenDataset> dataset,
                       const DataLoaderOptions& options, uint64_t begin, uint64_t num_sequences)
    : dataset_(std::move(dataset)),
      options_(options),
      batch_tokens_(static_cast<size_t>(options.micro_batch) *
                    (static_cast<size_t>(options.seq_len) + 1)),
      begin_(begin),
      num_sequences_(num_sequences),
      num_windows_(num_sequences / static_cast<uint64_t>(options.micro_batch)),
      step_sequences_(static_cast<uint64_t>(options.micro_batch) *
                      static_cast<uint64_t>(options.dp) *
                      static_cast<uint64_t>(options.grad_accum)) {}

uint64_t DataLoader::epoch_sequences() const {
  if (!options_.shuffle) return num_windows_ * static_cast<uint64_t>(options_.micro_batch);
  return num_sequences_ / step_sequences_ * step_sequences_;
}

uint64_t DataLoader::WindowAt(uint64_t position) const {
  // (p * dp + r) mod W without overflow: reduce p first.
  return ((position % num_windows_) * static_cast<uint64_t>(options_.dp) +
          static_cast<uint64_t>(options_.dp_rank)) %
         num_windows_;
}

namespace {
using u128 = unsigned __int128;
}  // namespace

uint64_t DataLoader::SequenceAt(uint64_t position, int32_t row) const {
  FP8RT_CHECK(row >= 0 && row < options_.micro_batch)
      << "row " << row << " of a micro-batch of " << options_.micro_batch;
  if (!options_.shuffle) {
    return WindowAt(position) * static_cast<uint64_t>(options_.micro_batch) +
           static_cast<uint64_t>(row);
  }
  // g = (p * dp + r) * B + row in 128 bits: positions are any uint64.
  const u128 g = (static_cast<u128>(position) * static_cast<uint64_t>(options_.dp) +
                  static_cast<uint64_t>(options_.dp_rank)) *
                     static_cast<uint64_t>(options_.micro_batch) +
                 static_cast<uint64_t>(row);
  const uint64_t e = epoch_sequences();
  return PermutationOf(static_cast<uint64_t>(g / e))[static_cast<uint64_t>(g % e)];
}

DataCursor DataLoader::CursorAt(uint64_t position) const {
  const uint64_t dp = static_cast<uint64_t>(options_.dp);
  if (!options_.shuffle) {
    const u128 k = static_cast<u128>(position) * dp;  // rank 0's window counter
    return {.epoch = static_cast<uint64_t>(k / num_windows_),
            .sequence = static_cast<uint64_t>(k % num_windows_) *
                        static_cast<uint64_t>(options_.micro_batch)};
  }
  const u128 g = static_cast<u128>(position) * dp * static_cast<uint64_t>(options_.micro_batch);
  const uint64_t e = epoch_sequences();
  return {.epoch = static_cast<uint64_t>(g / e), .sequence = static_cast<uint64_t>(g % e)};
}

const std::vector<uint64_t>& DataLoader::PermutationOf(uint64_t epoch) const {
  if (permutation_.empty() || cached_epoch_ != epoch) {
    permutation_ = EpochPermutation(num_sequences_, options_.seed, epoch);
    cached_epoch_ = epoch;
  }
  return permutation_;
}

absl::Status DataLoader::BatchAt(uint64_t position, std::span<int32_t> tokens) const {
  if (tokens.size() != batch_tokens_) {
    return absl::InvalidArgumentError(
        absl::StrCat("data loader: batch buffer holds ", tokens.size(), " tokens, expected ",
                     batch_tokens_, " (micro_batch * (seq_len + 1))"));
  }
  const size_t row = static_cast<size_t>(options_.seq_len) + 1;
  if (!options_.shuffle) {  // one window: B consecutive sequences
    dataset_->Read(begin_ + WindowAt(position) * batch_tokens_, tokens);
    return absl::OkStatus();
  }
  for (int32_t i = 0; i < options_.micro_batch; ++i) {
    dataset_->Read(begin_ + SequenceAt(position, i) * row,
                   tokens.subspan(static_cast<size_t>(i) * row, row));
  }
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
