// Training data: a token corpus on disk and the per-DP-rank reader over it.
//
// Defines:
//   TokenFormat        kText (one token per byte, 0..255), kU16 / kU32 (flat little-endian token
//                      files with no header, as nanoGPT's .bin files), kLlmc (llm.c's token
//                      file: a 1024-byte header, then uint16 tokens; see kLlmcMagic).
//   TokenDataset       an opened, validated corpus, memory-mapped read-only.
//   TokenRange         the part of a dataset a loader reads (a held-out validation tail).
//   EpochPermutation   the seeded order of the sequences in one epoch (data.shuffle).
//   DataLoaderOptions  seq_len, micro_batch, the DP layout, the order (file or shuffled).
//   DataLoader         hands rank r its micro-batches, deterministically, from a uint64 position
//                      that the checkpoint stores.
//
// Sequences. The range read is cut into S = floor(tokens / (T + 1)) non-overlapping sequences of
// T + 1 consecutive tokens (T = seq_len): sequence s is tokens [s (T + 1), (s + 1) (T + 1)) of the
// range, its inputs tokens [0, T) and its next-token targets tokens [1, T + 1). A micro-batch is
// B rows (B = micro_batch), one sequence each. The position counts micro-batches (calls to Next),
// not optimizer steps; Seek(p) followed by Next gives exactly the batch a fresh loader gives after
// p calls, which is what makes a resumed run bit-identical.
//
// File order (shuffle false, the loader's default). The range is cut into W = floor(S / B)
// windows of B consecutive sequences; a tail shorter than a window is never read. The micro-batch
// at `position` p of DP rank r is window (p * dp + r) mod W. Within one position the dp ranks read
// dp distinct windows (W >= dp is required), and the global counter p * dp + r walks the windows
// in order, so every window is read exactly once per W counts (one epoch).
//
// Shuffled (shuffle true; data.shuffle, the run spec's default). The order is defined over the
// global sequence index, not over per-rank batches: row i of rank r at position p is the sequence
// counter g = (p * dp + r) * B + i, which walks the global batch of each optimizer step, G =
// B * dp * grad_accum sequences, in order (micro-batch m of step t holds g in [t G + m dp B,
// t G + (m + 1) dp B)). An epoch is E = floor(S / G) * G counters: epoch e = g / E reads sequence
// EpochPermutation(S, seed, e)[g mod E], so the S - E sequences left over (fewer than one step)
// are different ones each epoch. Since E is whole steps and the permutation has no repeats, no
// two rows of one optimizer step, on any rank, share a sequence. The set of sequences a step reads
// depends only on G, the seed and the data, not on how G is split into dp, grad_accum and B.
// Cursor() names the point of the stream as (epoch, sequences of the epoch done) so that a run can
// be resumed at another layout with the same G.
//
// Errors name the file: NotFound (no such file), InvalidArgument (empty, not a regular file,
// shorter than the windows the layout needs, bad options), DataLoss (size not a multiple of the
// token size, a token >= vocab; the message gives the byte offset of the first bad token).
//
// Ownership and threads: a TokenDataset owns its mapping and is immutable once opened, so any
// number of threads and loaders may read it. A DataLoader shares ownership of its dataset; it is
// not thread-safe, not even its const methods (one owner: the rank's step loop; BatchAt caches
// the epoch's permutation), but two loaders may run on two threads.
#ifndef FP8RT_RUNTIME_TRAIN_DATA_LOADER_H_
#define FP8RT_RUNTIME_TRAIN_DATA_LOADER_H_

#include <cstddef>
#include <cstdint>
#include <limits>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <vector>

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

// The tokens [begin, end) of a dataset; an `end` past the dataset's size means its end.
struct TokenRange {
  uint64_t begin = 0;
  uint64_t end = std::numeric_limits<uint64_t>::max();
};

// The order of `sequences` sequences in epoch `epoch` of a run seeded with `seed`: a permutation
// of [0, sequences). Fisher-Yates (Durstenfeld: for i = n - 1 down to 1, swap element i with
// element j, j uniform in [0, i]) driven by std::mt19937_64 seeded through std::seed_seq with the
// 32-bit halves {seed lo, seed hi, epoch lo, epoch hi}; j is drawn by rejection, with no modulo
// bias: x = engine() until x >= 2^64 mod (i + 1), then j = x mod (i + 1).
// The standard fixes both engines exactly, so the order is the same on every platform and
// compiler. O(sequences) time and 8 bytes per sequence.
std::vector<uint64_t> EpochPermutation(uint64_t sequences, uint64_t seed, uint64_t epoch);

// One struct per concern: the shape of a micro-batch, the DP layout and the order.
struct DataLoaderOptions {
  int32_t seq_len = 0;      // T: tokens per input sequence (each row holds T + 1), >= 1
  int32_t micro_batch = 0;  // B: sequences per micro-batch on this rank, >= 1
  int32_t dp = 1;           // data-parallel ranks reading the corpus, >= 1
  int32_t dp_rank = 0;      // this rank, in [0, dp)
  // false: file order, window by window (see the top of the file); true: each epoch a seeded
  // permutation of the sequences.
  bool shuffle = false;
  uint64_t seed = 0;       // shuffle: seeds every epoch's permutation (train.seed)
  int32_t grad_accum = 1;  // shuffle: micro-batches per optimizer step (an epoch is whole steps)
  TokenRange range = {};   // the part of the dataset read (default: all of it)
};

// Where a position is in the sequence stream: the epoch, and the sequences of it all ranks have
// read before the position (shuffle: counters g mod E; file order: windows (p * dp) mod W times B).
struct DataCursor {
  uint64_t epoch = 0;
  uint64_t sequence = 0;
  bool operator==(const DataCursor&) const = default;
};

class DataLoader {
 public:
  // InvalidArgument naming the option when out of range, or naming the file when the range holds
  // fewer than dp windows of micro_batch * (seq_len + 1) tokens (file order) or fewer sequences
  // than one optimizer step, micro_batch * dp * grad_accum (shuffled). Starts at position 0.
  [[nodiscard]] static absl::StatusOr<DataLoader> Create(
      std::shared_ptr<const TokenDataset> dataset, const DataLoaderOptions& options);

  // Tokens one micro-batch holds: micro_batch * (seq_len + 1).
  size_t batch_tokens() const { return batch_tokens_; }
  // S: sequences of seq_len + 1 tokens in the range read.
  uint64_t num_sequences() const { return num_sequences_; }
  // W: windows of micro_batch sequences in the range (file order: one epoch is W / dp positions).
  uint64_t num_windows() const { return num_windows_; }
  // Sequences read per epoch over all ranks: W * B in file order, E = floor(S / G) * G shuffled.
  uint64_t epoch_sequences() const;
  // File order: the window this rank reads at `position`, (position * dp + dp_rank) mod W.
  uint64_t WindowAt(uint64_t position) const;
  // The sequence (index in the range) of row `row` of this rank's micro-batch at `position`.
  uint64_t SequenceAt(uint64_t position, int32_t row) const;
  // The stream's cursor at `position` (see DataCursor); Cursor() is CursorAt(position()).
  DataCursor CursorAt(uint64_t position) const;
  DataCursor Cursor() const { return CursorAt(position_); }

  // Writes the micro-batch at position() into `tokens` (batch_tokens() values, B rows of T + 1)
  // and advances the position by one. InvalidArgument when tokens has the wrong size.
  [[nodiscard]] absl::Status Next(std::span<int32_t> tokens);
  // The micro-batch at any position, without moving.
  [[nodiscard]] absl::Status BatchAt(uint64_t position, std::span<int32_t> tokens) const;

  // Micro-batches read so far; stored in the checkpoint.
  uint64_t position() const { return position_; }
  // Continues from a checkpointed position: any value is valid (the order is periodic in the
  // file order, and defined for every epoch shuffled).
  [[nodiscard]] absl::Status Seek(uint64_t position);

 private:
  DataLoader(std::shared_ptr<const TokenDataset> dataset, const DataLoaderOptions& options,
             uint64_t begin, uint64_t num_sequences);
  // Shuffled: the permutation of `epoch`, computed when the epoch changes.
  const std::vector<uint64_t>& PermutationOf(uint64_t epoch) const;

  // Fixed at Create (not const so that the loader can be moved).
  std::shared_ptr<const TokenDataset> dataset_;
  DataLoaderOptions options_;
  size_t batch_tokens_;
  uint64_t begin_;           // first token of the range
  uint64_t num_sequences_;   // S
  uint64_t num_windows_;     // W = S / B
  uint64_t step_sequences_;  // G = B * dp * grad_accum (shuffled)

  uint64_t position_ = 0;
  // Shuffled: the permutation of epoch cached_epoch_ (empty until the first batch).
  mutable uint64_t cached_epoch_ = 0;
  mutable std::vector<uint64_t> permutation_;
};

}  // namespace fp8rt::train

#endif  // FP8RT_RUNTIME_TRAIN_DATA_LOADER_H_
