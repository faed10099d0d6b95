// Training data: a token corpus on disk and the per-DP-rank reader over it.
//
// Defines:
//   TokenFormat        kText (one token per byte, 0..255), kU16 / kU32 (flat little-endian token
//                      files with no header, as nanoGPT's .bin files), kLlmc (llm.c's token
//                      file: a 1024-byte header, then uint16 tokens; see kLlmcMagic).
//   TokenDataset       an opened, validated corpus, memory-mapped read-only.
//   DataLoaderOptions  seq_len, micro_batch and the DP layout.
//   DataLoader         hands rank r its micro-batches, deterministically, from a uint64 position
//                      that the checkpoint stores.
//
// Batches. The corpus is cut into W = floor(tokens / (B * (T + 1))) non-overlapping windows of
// B * (T + 1) consecutive tokens (B = micro_batch, T = seq_len); a tail shorter than a window is
// never read. The micro-batch at `position` p of DP rank r is window (p * dp + r) mod W, laid out
// as B rows of T + 1 tokens: row i's inputs are tokens [0, T) and its next-token targets are
// tokens [1, T + 1). Within one position the dp ranks read dp distinct windows (W >= dp is
// required), and the global counter p * dp + r walks the windows in order, so every window is
// read exactly once per W counts (one epoch). The position counts micro-batches (calls to Next),
// not optimizer steps; Seek(p) followed by Next gives exactly the batch a fresh loader gives after
// p calls, which is what makes a resumed run bit-identical.
//
// Errors name the file: NotFound (no such file), InvalidArgument (empty, not a regular file,
// shorter than the windows the layout needs, bad options), DataLoss (size not a multiple of the
// token size, a token >= vocab; the message gives the byte offset of the first bad token).
//
// Ownership and threads: a TokenDataset owns its mapping and is immutable once opened, so any
// number of threads and loaders may read it. A DataLoader shares ownership of its dataset; it is
// not thread-safe (one owner: the rank's step loop), but two loaders may run on two threads.
#ifndef FP8RT_RUNTIME_TRAIN_DATA_LOADER_H_
#define FP8RT_RUNTIME_TRAIN_DATA_LOADER_H_

#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <string_view>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

namespace fp8rt::train {

enum class TokenFormat : uint8_t { kText, kU16, kU32, kLlmc };

std::string_view TokenFormatName(TokenFormat format);  // "text", "u16", "u32", "llmc"
absl::StatusOr<TokenFormat> ParseTokenFormat(std::string_view name);
size_t TokenBytes(TokenFormat format);  // bytes per token on disk: 1, 2, 4, 2

// llm.c's token file (its dev/data scripts write it; its dataloader reads it): a header of 256
// little-endian int32 values -- [0] the magic 20240520, [1] the version 1 (uint16 tokens), [2]
// the token count, the rest unused -- then exactly that many little-endian uint16 tokens.
inline constexpr int32_t kLlmcMagic = 20240520;
inline constexpr int32_t kLlmcVersion = 1;
inline constexpr size_t kLlmcHeaderBytes = 256 * 4;

class TokenDataset {
 public:
  // Maps `path` and checks it: a non-empty regular file whose size is a multiple of the token
  // size, every token < vocab (vocab in [1, 2^31 - 1]). Reads the whole file once to validate.
  // kLlmc: the header is checked first (DataLoss naming the file and the field: magic, version,
  // token count, which must match the bytes after the header, or a file shorter than the header)
  // and the tokens follow it.
  [[nodiscard]] static absl::StatusOr<std::unique_ptr<TokenDataset>> Open(const std::string& path,
                                                                          TokenFormat format,
                                                                          int32_t vocab);

  TokenDataset(const TokenDataset&) = delete;
  TokenDataset& operator=(const TokenDataset&) = delete;
  ~TokenDataset();

  const std::string& path() const { return path_; }
  TokenFormat format() const { return format_; }
  int32_t vocab() const { return vocab_; }
  uint64_t size() const { return size_; }  // tokens

  // Token i (i < size()).
  int32_t token(uint64_t i) const;
  // Copies tokens [begin, begin + out.size()) into out; the range must lie inside the dataset.
  void Read(uint64_t begin, std::span<int32_t> out) const;

 private:
  TokenDataset(std::string path, TokenFormat format, int32_t vocab, const uint8_t* map,
               size_t bytes);

  // All fixed at Open.
  const std::string path_;
  const TokenFormat format_;
  const int32_t vocab_;
  const uint8_t* const map_;   // the mapping, bytes_ long; unmapped by the destructor
  const size_t bytes_;
  const uint8_t* const data_;  // the first token: map_ past the header (kLlmc), else map_
  const uint64_t size_;  // tokens
};

// One struct per concern: the shape of a micro-batch and the DP layout.
struct DataLoaderOptions {
  int32_t seq_len = 0;      // T: tokens per input sequence (each row holds T + 1), >= 1
  int32_t micro_batch = 0;  // B: sequences per micro-batch on this rank, >= 1
  int32_t dp = 1;           // data-parallel ranks reading the corpus, >= 1
  int32_t dp_rank = 0;      // this rank, in [0, dp)
};

class DataLoader {
 public:
  // InvalidArgument naming the option when out of range, or naming the file when it holds fewer
  // than dp windows of micro_batch * (seq_len + 1) tokens. Starts at position 0.
  [[nodiscard]] static absl::StatusOr<DataLoader> Create(
      std::shared_ptr<const TokenDataset> dataset, const DataLoaderOptions& options);

  // Tokens one micro-batch holds: micro_batch * (seq_len + 1).
  size_t batch_tokens() const { return batch_tokens_; }
  // W: windows in the corpus; one epoch is W / dp positions.
  uint64_t num_windows() const { return num_windows_; }
  // The window this rank reads at `position`: (position * dp + dp_rank) mod W.
  uint64_t WindowAt(uint64_t position) const;

  // Writes the micro-batch at position() into `tokens` (batch_tokens() values, B rows of T + 1)
  // and advances the position by one. InvalidArgument when tokens has the wrong size.
  [[nodiscard]] absl::Status Next(std::span<int32_t> tokens);
  // The micro-batch at any position, without moving.
  [[nodiscard]] absl::Status BatchAt(uint64_t position, std::span<int32_t> tokens) const;

  // Micro-batches read so far; stored in the checkpoint.
  uint64_t position() const { return position_; }
  // Continues from a checkpointed position: any value is valid (the window order is periodic).
  [[nodiscard]] absl::Status Seek(uint64_t position);

 private:
  DataLoader(std::shared_ptr<const TokenDataset> dataset, const DataLoaderOptions& options,
             uint64_t num_windows);

  // Fixed at Create (not const so that the loader can be moved).
  std::shared_ptr<const TokenDataset> dataset_;
  DataLoaderOptions options_;
  size_t batch_tokens_;
  uint64_t num_windows_;

  uint64_t position_ = 0;
};

}  // namespace fp8rt::train

#endif  // FP8RT_RUNTIME_TRAIN_DATA_LOADER_H_
