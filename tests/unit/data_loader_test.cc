// Tests of runtime/train/data_loader.h. Every corpus is written here byte by byte, so each
// expected token, window and error offset is known from the test's own arithmetic:
//   - text, u16 and u32 files read back as the tokens written (little-endian, no header);
//   - llm.c token files (llmc): the header written here from llm.c's definition (256 int32:
//     magic 20240520, version 1, token count) is checked field by field, and the tokens after it
//     read back as written;
//   - a micro-batch is B rows of T + 1 consecutive tokens; targets are inputs shifted by one;
//   - DP ranks read distinct windows at each position, cover the windows without overlap, and
//     an epoch visits every window once;
//   - Seek(p) resumes exactly; two loaders over the same file agree;
//   - shuffled (data.shuffle): EpochPermutation is the documented seeded Fisher-Yates (a
//     permutation, uniform, changing with seed and epoch); no step reads a sequence twice on any
//     rank; each epoch walks its permutation; resume mid-epoch continues the same stream; a
//     step's sequences do not depend on how the global batch is split; shuffle false is file
//     order whatever the seed;
//   - data.val_fraction: nanoGPT's split boundary; training never reads the held-out tail, and
//     validation reads the tail from its start;
//   - bad input (missing, empty, short, partial token, token >= vocab, bad options) is an error
//     of the right kind naming the file (and the byte offset of a bad token).
#include "runtime/train/data_loader.h"

#include <stdlib.h>
#include <unistd.h>

#include <algorithm>
#include <cstdint>
#include <filesystem>
#include <fstream>
#include <limits>
#include <map>
#include <random>
#include <set>
#include <string>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "runtime/spec/run_spec.h"  // ValidationSplit

namespace fp8rt::train {
namespace {

using ::testing::AllOf;
using ::testing::ElementsAre;
using ::testing::ElementsAreArray;
using ::testing::HasSubstr;

namespace fs = std::filesystem;

class DataLoaderTest : public ::testing::Test {
 protected:
  void SetUp() override {
    std::string tmpl = ::testing::TempDir() + "data_loader_test.XXXXXX";
    ASSERT_NE(::mkdtemp(tmpl.data()), nullptr);
    dir_ = tmpl;
  }
  void TearDown() override { fs::remove_all(dir_); }

  std::string WriteBytes(const std::string& name, const std::string& bytes) {
    const std::string path = (fs::path(dir_) / name).string();
    std::ofstream out(path, std::ios::binary);
    out.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
    EXPECT_TRUE(out.good());
    return path;
  }
  // Little-endian, written byte by byte so the test does not rely on the host's order.
  std::string WriteU16(const std::string& name, const std::vector<uint32_t>& tokens) {
    std::string bytes;
    for (uint32_t t : tokens) {
      bytes.push_back(static_cast<char>(t & 0xff));
      bytes.push_back(static_cast<char>((t >> 8) & 0xff));
    }
    return WriteBytes(name, bytes);
  }
  std::string WriteU32(const std::string& name, const std::vector<uint32_t>& tokens) {
    std::string bytes;
    for (uint32_t t : tokens) {
      for (int s = 0; s < 32; s += 8) bytes.push_back(static_cast<char>((t >> s) & 0xff));
    }
    return WriteBytes(name, bytes);
  }
  // llm.c's token file: int32 header[256] = {magic, version, count, 0...}, little-endian, then
  // the uint16 tokens; `extra` bytes appended after them (a corrupt file).
  std::string WriteLlmc(const std::string& name, const std::vector<uint32_t>& tokens,
                        int32_t magic = 20240520, int32_t version = 1, int64_t count = -1,
                        const std::string& extra = "") {
    std::string bytes;
    int32_t header[256] = {};
    header[0] = magic;
    header[1] = version;
    header[2] = static_cast<int32_t>(count >= 0 ? count : static_cast<int64_t>(tokens.size()));
    for (int32_t h : header) {
      const uint32_t u = static_cast<uint32_t>(h);
      for (int s = 0; s < 32; s += 8) bytes.push_back(static_cast<char>((u >> s) & 0xff));
    }
    for (uint32_t t : tokens) {
      bytes.push_back(static_cast<char>(t & 0xff));
      bytes.push_back(static_cast<char>((t >> 8) & 0xff));
    }
    return WriteBytes(name, bytes + extra);
  }
  // A u32 corpus whose token i is i: a batch's first token names its window.
  std::string WriteIota(const std::string& name, uint32_t n) {
    std::vector<uint32_t> tokens(n);
    for (uint32_t i = 0; i < n; ++i) tokens[i] = i;
    return WriteU32(name, tokens);
  }

  std::shared_ptr<const TokenDataset> OpenOrDie(const std::string& path, TokenFormat format,
                                                int32_t vocab) {
    auto dataset = TokenDataset::Open(path, format, vocab);
    EXPECT_TRUE(dataset.ok()) << dataset.status();
    return dataset.ok() ? std::shared_ptr<const TokenDataset>(*std::move(dataset)) : nullptr;
  }
  DataLoader LoaderOrDie(std::shared_ptr<const TokenDataset> dataset, int32_t seq_len,
                         int32_t micro_batch, int32_t dp, int32_t dp_rank) {
    auto loader = DataLoader::Create(
        std::move(dataset),
        {.seq_len = seq_len, .micro_batch = micro_batch, .dp = dp, .dp_rank = dp_rank});
    EXPECT_TRUE(loader.ok()) << loader.status();
    return *std::move(loader);
  }
  static std::vector<int32_t> Next(DataLoader& loader) {
    std::vector<int32_t> batch(loader.batch_tokens());
    EXPECT_TRUE(loader.Next(batch).ok());
    return batch;
  }

  std::string dir_;
};

std::vector<int32_t> Tokens(const TokenDataset& dataset) {
  std::vector<int32_t> out(dataset.size());
  dataset.Read(0, out);
  return out;
}

std::vector<int32_t> Bytes(const std::string& s) {
  std::vector<int32_t> out;
  for (char c : s) out.push_back(static_cast<unsigned char>(c));
  return out;
}

// ---------------------------------------------------------------------------------------------
// Formats

TEST_F(DataLoaderTest, TextFileGivesItsBytes) {
  const std::string text = std::string("In the beginning\n") + '\0' + "\xff\x80";
  auto dataset = OpenOrDie(WriteBytes("a.txt", text), TokenFormat::kText, 256);
  ASSERT_NE(dataset, nullptr);
  EXPECT_EQ(dataset->size(), text.size());
  EXPECT_THAT(Tokens(*dataset), ElementsAreArray(Bytes(text)));
  EXPECT_EQ(dataset->token(0), 'I');
  EXPECT_EQ(dataset->token(17), 0);
  EXPECT_EQ(dataset->token(18), 255);
  EXPECT_EQ(dataset->token(19), 128);
}

TEST_F(DataLoaderTest, U16FileGivesTheTokensWritten) {
  const std::vector<uint32_t> tokens = {0, 1, 255, 256, 0x1234, 50303, 65535};
  auto dataset = OpenOrDie(WriteU16("a.bin", tokens), TokenFormat::kU16, 65536);
  ASSERT_NE(dataset, nullptr);
  EXPECT_EQ(dataset->size(), 7u);
  EXPECT_THAT(Tokens(*dataset), ElementsAre(0, 1, 255, 256, 0x1234, 50303, 65535));
  // Byte order: 0x1234 is stored as 34 12.
  std::ifstream in(dataset->path(), std::ios::binary);
  std::string raw((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  EXPECT_EQ(raw.substr(8, 2), "\x34\x12");
}

TEST_F(DataLoaderTest, U32FileGivesTheTokensWritten) {
  const std::vector<uint32_t> tokens = {0, 65536, 70000, 0x01020304, 2147483646};
  auto dataset = OpenOrDie(WriteU32("a.bin", tokens), TokenFormat::kU32, 2147483647);
  ASSERT_NE(dataset, nullptr);
  EXPECT_THAT(Tokens(*dataset), ElementsAre(0, 65536, 70000, 0x01020304, 2147483646));
  EXPECT_EQ(dataset->token(3), 16909060);
}

TEST_F(DataLoaderTest, LlmcFileGivesTheTokensAfterItsHeader) {
  const std::vector<uint32_t> tokens = {0, 1, 50256, 0x1234, 65535, 7, 8, 9};
  auto dataset = OpenOrDie(WriteLlmc("train.bin", tokens), TokenFormat::kLlmc, 65536);
  ASSERT_NE(dataset, nullptr);
  EXPECT_EQ(dataset->size(), 8u);
  EXPECT_THAT(Tokens(*dataset), ElementsAre(0, 1, 50256, 0x1234, 65535, 7, 8, 9));
  EXPECT_EQ(dataset->token(3), 0x1234);
  // Batches come from the tokens, never from the header.
  DataLoader loader = LoaderOrDie(dataset, /*seq_len=*/3, /*micro_batch=*/1, 1, 0);
  EXPECT_THAT(Next(loader), ElementsAre(0, 1, 50256, 0x1234));
  // A token >= vocab is named by its byte offset in the file (past the 1024-byte header).
  auto small = TokenDataset::Open(WriteLlmc("v.bin", tokens), TokenFormat::kLlmc, 50000);
  ASSERT_FALSE(small.ok());
  EXPECT_THAT(small.status().message(), HasSubstr("token 50256 at byte offset 1028 (token 2)"));
}

TEST_F(DataLoaderTest, LlmcHeaderErrorsNameTheFileAndTheField) {
  const std::vector<uint32_t> tokens = {1, 2, 3, 4};
  struct Case {
    std::string name, path, want;
  };
  const std::vector<Case> cases = {
      {"magic", WriteLlmc("magic.bin", tokens, 20240521),
       "llmc header: magic is 20240521, expected 20240520"},
      {"version", WriteLlmc("version.bin", tokens, 20240520, 2),
       "llmc header: version is 2, expected 1"},
      {"count too large", WriteLlmc("count.bin", tokens, 20240520, 1, 5),
       "llmc header: token count is 5, but the 8 bytes after the header hold 4 uint16 tokens"},
      {"negative count", WriteLlmc("neg.bin", tokens, 20240520, 1, 0x80000000LL),
       "llmc header: token count is -2147483648"},
      {"partial token", WriteLlmc("odd.bin", tokens, 20240520, 1, 4, "x"),
       "4 uint16 tokens and a partial one"},
      {"short", WriteBytes("short.bin", std::string(1000, '\1')),
       "llmc header: the file is 1000 bytes, shorter than the 1024-byte header"},
      // A headerless u16 file given as llmc: its first tokens are read as the magic.
      {"headerless", WriteU16("plain.bin", std::vector<uint32_t>(600, 7)),
       "llmc header: magic is 458759"},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.name);
    auto dataset = TokenDataset::Open(c.path, TokenFormat::kLlmc, 65536);
    ASSERT_FALSE(dataset.ok());
    EXPECT_EQ(dataset.status().code(), absl::StatusCode::kDataLoss);
    EXPECT_THAT(dataset.status().message(), AllOf(HasSubstr(c.path), HasSubstr(c.want)));
  }
  auto empty = TokenDataset::Open(WriteLlmc("empty.bin", {}), TokenFormat::kLlmc, 65536);
  ASSERT_FALSE(empty.ok());
  EXPECT_THAT(empty.status().message(), HasSubstr("holds no tokens"));
}

TEST_F(DataLoaderTest, FormatNamesRoundTrip) {
  for (TokenFormat f :
       {TokenFormat::kText, TokenFormat::kU16, TokenFormat::kU32, TokenFormat::kLlmc}) {
    auto parsed = ParseTokenFormat(TokenFormatName(f));
    ASSERT_TRUE(parsed.ok());
    EXPECT_EQ(*parsed, f);
  }
  EXPECT_EQ(TokenBytes(TokenFormat::kText), 1u);
  EXPECT_EQ(TokenBytes(TokenFormat::kU16), 2u);
  EXPECT_EQ(TokenBytes(TokenFormat::kU32), 4u);
  EXPECT_EQ(TokenBytes(TokenFormat::kLlmc), 2u);
  EXPECT_EQ(TokenFormatName(TokenFormat::kLlmc), "llmc");
  auto bad = ParseTokenFormat("u8");
  EXPECT_EQ(bad.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(bad.status().message(), HasSubstr("'u8'"));
}

// ---------------------------------------------------------------------------------------------
// Batches

TEST_F(DataLoaderTest, RowsAreConsecutiveAndTargetsAreInputsShiftedByOne) {
  // 26 letters; B = 2 rows of T + 1 = 4 tokens: window 0 is "abcdefgh", window 1 "ijklmnop".
  auto dataset =
      OpenOrDie(WriteBytes("abc.txt", "abcdefghijklmnopqrstuvwxyz"), TokenFormat::kText, 256);
  DataLoader loader = LoaderOrDie(dataset, /*seq_len=*/3, /*micro_batch=*/2, 1, 0);
  EXPECT_EQ(loader.batch_tokens(), 8u);
  EXPECT_EQ(loader.num_windows(), 3u);  // 26 / 8: "yz" is never read

  std::vector<int32_t> batch = Next(loader);
  EXPECT_THAT(batch, ElementsAreArray(Bytes("abcdefgh")));
  // Row i: inputs batch[i*(T+1) + 0..T), targets batch[i*(T+1) + 1..T+1).
  const int T = 3;
  for (int row = 0; row < 2; ++row) {
    for (int t = 0; t < T; ++t) {
      const int32_t input = batch[row * (T + 1) + t];
      const int32_t target = batch[row * (T + 1) + t + 1];
      EXPECT_EQ(target, input + 1) << "row " << row << " t " << t;  // next letter
    }
  }
  EXPECT_THAT(Next(loader), ElementsAreArray(Bytes("ijklmnop")));
  EXPECT_THAT(Next(loader), ElementsAreArray(Bytes("qrstuvwx")));
  EXPECT_THAT(Next(loader), ElementsAreArray(Bytes("abcdefgh")));  // next epoch
  EXPECT_EQ(loader.position(), 4u);
}

TEST_F(DataLoaderTest, TwoRanksReadDistinctWindowsAndCoverThemWithoutOverlap) {
  // 1000 tokens, window B * (T + 1) = 2 * 5 = 10 tokens: W = 100.
  auto dataset = OpenOrDie(WriteIota("iota.bin", 1000), TokenFormat::kU32, 1000);
  DataLoader rank0 = LoaderOrDie(dataset, 4, 2, /*dp=*/2, 0);
  DataLoader rank1 = LoaderOrDie(dataset, 4, 2, /*dp=*/2, 1);
  ASSERT_EQ(rank0.num_windows(), 100u);

  std::set<int32_t> seen;
  for (uint64_t p = 0; p < 50; ++p) {
    std::vector<int32_t> a = Next(rank0);
    std::vector<int32_t> b = Next(rank1);
    // Token i is i, so the batch is [10w, 10w + 10) for window w = (2p + r) mod 100.
    std::vector<int32_t> want_a(10), want_b(10);
    for (int i = 0; i < 10; ++i) {
      want_a[i] = static_cast<int32_t>(10 * (2 * p) + i);
      want_b[i] = static_cast<int32_t>(10 * (2 * p + 1) + i);
    }
    EXPECT_EQ(a, want_a) << "position " << p;
    EXPECT_EQ(b, want_b) << "position " << p;
    EXPECT_NE(a[0], b[0]) << "position " << p;
    for (int32_t t : a) EXPECT_TRUE(seen.insert(t).second) << "token " << t << " read twice";
    for (int32_t t : b) EXPECT_TRUE(seen.insert(t).second) << "token " << t << " read twice";
  }
  EXPECT_EQ(seen.size(), 1000u);  // every token of every window, once
}

TEST_F(DataLoaderTest, AnEpochVisitsEveryWindowOnceWhenDpDoesNotDivideTheWindows) {
  // 7 windows of 3 tokens (T = 2, B = 1) plus a 2-token tail; dp = 3.
  auto dataset = OpenOrDie(WriteIota("iota.bin", 23), TokenFormat::kU32, 23);
  std::vector<DataLoader> ranks;
  for (int r = 0; r < 3; ++r) ranks.push_back(LoaderOrDie(dataset, 2, 1, 3, r));
  ASSERT_EQ(ranks[0].num_windows(), 7u);

  // Counters k = 3p + r for k < 7 form one epoch: windows 0..6 each once, the tail never.
  std::vector<int> visits(7, 0);
  for (uint64_t p = 0; p < 3; ++p) {
    std::set<int32_t> this_step;
    for (int r = 0; r < 3; ++r) {
      std::vector<int32_t> batch = Next(ranks[r]);
      const int32_t window = batch[0] / 3;
      EXPECT_EQ(batch, (std::vector<int32_t>{3 * window, 3 * window + 1, 3 * window + 2}));
      EXPECT_EQ(window, static_cast<int32_t>((3 * p + r) % 7));
      EXPECT_TRUE(this_step.insert(window).second) << "two ranks share window " << window;
      if (3 * p + r < 7) ++visits[window];
    }
  }
  EXPECT_THAT(visits, ElementsAre(1, 1, 1, 1, 1, 1, 1));
}

TEST_F(DataLoaderTest, SingleRankEpochIsEveryWindowInOrder) {
  auto dataset = OpenOrDie(WriteIota("iota.bin", 60), TokenFormat::kU32, 60);
  DataLoader loader = LoaderOrDie(dataset, 3, 3, 1, 0);  // windows of 12: W = 5
  for (int epoch = 0; epoch < 2; ++epoch) {
    for (int32_t w = 0; w < 5; ++w) EXPECT_EQ(Next(loader)[0], 12 * w);
  }
}

TEST_F(DataLoaderTest, WindowOfHugePositionsWrapsWithoutOverflow) {
  auto dataset = OpenOrDie(WriteIota("iota.bin", 21), TokenFormat::kU32, 21);
  DataLoader loader = LoaderOrDie(dataset, 2, 1, 2, 1);  // W = 7
  for (uint64_t p : {uint64_t{0}, uint64_t{6}, uint64_t{1} << 63, ~uint64_t{0}}) {
    const unsigned __int128 k = static_cast<unsigned __int128>(p) * 2 + 1;
    EXPECT_EQ(loader.WindowAt(p), static_cast<uint64_t>(k % 7)) << p;
  }
}

TEST_F(DataLoaderTest, SeekResumesExactly) {
  auto dataset = OpenOrDie(WriteIota("iota.bin", 997), TokenFormat::kU32, 997);
  for (uint64_t p : {0, 1, 7, 48, 49, 50, 123}) {
    DataLoader straight = LoaderOrDie(dataset, 4, 3, 2, 1);  // W = 66
    for (uint64_t i = 0; i < p; ++i) Next(straight);
    ASSERT_EQ(straight.position(), p);

    DataLoader resumed = LoaderOrDie(dataset, 4, 3, 2, 1);
    ASSERT_TRUE(resumed.Seek(p).ok());
    EXPECT_EQ(resumed.position(), p);
    for (int i = 0; i < 3; ++i) EXPECT_EQ(Next(resumed), Next(straight)) << p << " + " << i;
    EXPECT_EQ(resumed.position(), p + 3);
  }
  // Seeking back replays.
  DataLoader loader = LoaderOrDie(dataset, 4, 3, 2, 1);
  std::vector<int32_t> first = Next(loader);
  Next(loader);
  ASSERT_TRUE(loader.Seek(0).ok());
  EXPECT_EQ(Next(loader), first);
}

TEST_F(DataLoaderTest, TwoLoadersOverTheSameFileAgree) {
  std::string text;
  for (int i = 0; i < 5000; ++i) text.push_back(static_cast<char>((i * 131 + i / 7) % 256));
  const std::string path = WriteBytes("mix.txt", text);
  DataLoader a = LoaderOrDie(OpenOrDie(path, TokenFormat::kText, 256), 16, 4, 4, 2);
  DataLoader b = LoaderOrDie(OpenOrDie(path, TokenFormat::kText, 256), 16, 4, 4, 2);
  for (int i = 0; i < 40; ++i) {
    std::vector<int32_t> x = Next(a);
    EXPECT_EQ(x, Next(b)) << "batch " << i;
    // And both equal the bytes of window (4i + 2) mod 73.
    const size_t w = (4 * static_cast<size_t>(i) + 2) % (5000 / 68);
    EXPECT_EQ(x, Bytes(text.substr(w * 68, 68))) << "batch " << i;
  }
}

TEST_F(DataLoaderTest, BatchAtDoesNotMove) {
  auto dataset = OpenOrDie(WriteIota("iota.bin", 40), TokenFormat::kU32, 40);
  DataLoader loader = LoaderOrDie(dataset, 1, 2, 1, 0);  // windows of 4: W = 10
  std::vector<int32_t> batch(4);
  ASSERT_TRUE(loader.BatchAt(13, batch).ok());
  EXPECT_THAT(batch, ElementsAre(12, 13, 14, 15));
  EXPECT_EQ(loader.position(), 0u);
}

// ---------------------------------------------------------------------------------------------
// Shuffled order (data.shuffle)

// The permutation as data_loader.h describes it, written here from that text: Fisher-Yates from
// the top, mt19937_64 seeded by seed_seq{seed lo, seed hi, epoch lo, epoch hi}, j by rejection.
std::vector<uint64_t> ReferencePermutation(uint64_t n, uint64_t seed, uint64_t epoch) {
  std::vector<uint64_t> p(n);
  for (uint64_t i = 0; i < n; ++i) p[i] = i;
  std::seed_seq seq{static_cast<uint32_t>(seed & 0xffffffffu), static_cast<uint32_t>(seed >> 32),
                    static_cast<uint32_t>(epoch & 0xffffffffu), static_cast<uint32_t>(epoch >> 32)};
  std::mt19937_64 gen(seq);
  for (uint64_t i = n - 1; i >= 1 && n > 1; --i) {
    const uint64_t bound = i + 1;
    // 2^64 mod bound, from (2^64 - 1) mod bound.
    const uint64_t low = (std::numeric_limits<uint64_t>::max() % bound + 1) % bound;
    uint64_t x = gen();
    while (x < low) x = gen();
    std::swap(p[i], p[x % bound]);
  }
  return p;
}

// A loader with the shuffled order.
DataLoader ShuffledOrDie(std::shared_ptr<const TokenDataset> dataset, int32_t seq_len,
                         int32_t micro_batch, int32_t dp, int32_t dp_rank, int32_t grad_accum,
                         uint64_t seed) {
  auto loader = DataLoader::Create(std::move(dataset), {.seq_len = seq_len,
                                                        .micro_batch = micro_batch,
                                                        .dp = dp,
                                                        .dp_rank = dp_rank,
                                                        .shuffle = true,
                                                        .seed = seed,
                                                        .grad_accum = grad_accum});
  EXPECT_TRUE(loader.ok()) << loader.status();
  return *std::move(loader);
}

// On an iota corpus, a row of T + 1 tokens starting at (T + 1) s is sequence s: the rows of a
// batch as sequence indices, each checked to be whole and consecutive.
std::vector<uint64_t> RowSequences(const std::vector<int32_t>& batch, int32_t seq_len) {
  const size_t row = static_cast<size_t>(seq_len) + 1;
  std::vector<uint64_t> out;
  for (size_t i = 0; i < batch.size() / row; ++i) {
    EXPECT_EQ(batch[i * row] % static_cast<int32_t>(row), 0) << "row " << i << " not aligned";
    for (size_t t = 1; t < row; ++t) EXPECT_EQ(batch[i * row + t], batch[i * row] + t);
    out.push_back(static_cast<uint64_t>(batch[i * row]) / row);
  }
  return out;
}

TEST_F(DataLoaderTest, EpochPermutationIsTheDocumentedSeededPermutation) {
  for (uint64_t n : {uint64_t{0}, uint64_t{1}, uint64_t{2}, uint64_t{7}, uint64_t{1000}}) {
    const std::vector<uint64_t> p = EpochPermutation(n, /*seed=*/1, /*epoch=*/0);
    std::vector<uint64_t> sorted = p;
    std::sort(sorted.begin(), sorted.end());
    std::vector<uint64_t> iota(n);
    for (uint64_t i = 0; i < n; ++i) iota[i] = i;
    EXPECT_EQ(sorted, iota) << "n = " << n << ": not a permutation";
    EXPECT_EQ(p, ReferencePermutation(n, 1, 0)) << "n = " << n;
  }
  // Seeds and epochs above 32 bits use both halves.
  const uint64_t big = (uint64_t{5} << 32) | 3;
  EXPECT_EQ(EpochPermutation(300, big, big + 1), ReferencePermutation(300, big, big + 1));
  // The same seed and epoch give the same order; another seed or epoch another one.
  const std::vector<uint64_t> a = EpochPermutation(1000, 1, 0);
  EXPECT_EQ(a, EpochPermutation(1000, 1, 0));
  EXPECT_NE(a, EpochPermutation(1000, 1, 1));
  EXPECT_NE(a, EpochPermutation(1000, 2, 0));
  EXPECT_NE(EpochPermutation(1000, 1, 1), EpochPermutation(1000, 2, 1));
  EXPECT_NE(EpochPermutation(1000, uint64_t{1} << 32, 0), a);  // the seed's high half counts
  std::vector<uint64_t> iota(1000);
  for (uint64_t i = 0; i < 1000; ++i) iota[i] = i;
  EXPECT_NE(a, iota);
}

TEST_F(DataLoaderTest, EpochPermutationIsUniform) {
  // 24000 epochs of 4 sequences: each of the 24 orders is expected 1000 times (binomial, sd
  // ~31); [850, 1150] is ~5 sd, so a fair shuffle fails with probability ~1e-5, while a biased
  // one (e.g. j uniform in [0, n) instead of [0, i]) puts some orders near 700 or 1400.
  std::map<std::vector<uint64_t>, int> counts;
  for (uint64_t epoch = 0; epoch < 24000; ++epoch) ++counts[EpochPermutation(4, 7, epoch)];
  EXPECT_EQ(counts.size(), 24u);
  for (const auto& [order, count] : counts) {
    EXPECT_GE(count, 850) << ::testing::PrintToString(order);
    EXPECT_LE(count, 1150) << ::testing::PrintToString(order);
  }
}

TEST_F(DataLoaderTest, ShuffledStepsNeverShareASequenceAndEachEpochIsItsPermutation) {
  // T = 2: 100 sequences of 3 tokens and a 2-token tail. B = 2, dp = 3, grad_accum = 2:
  // G = 12 sequences per step, E = 96 per epoch (8 steps), 4 left out per epoch.
  auto dataset = OpenOrDie(WriteIota("iota.bin", 302), TokenFormat::kU32, 302);
  std::vector<DataLoader> ranks;
  for (int r = 0; r < 3; ++r) ranks.push_back(ShuffledOrDie(dataset, 2, 2, 3, r, 2, /*seed=*/9));
  ASSERT_EQ(ranks[0].num_sequences(), 100u);
  ASSERT_EQ(ranks[0].epoch_sequences(), 96u);
  std::vector<std::vector<uint64_t>> epochs(3);  // sequences in counter order, per epoch
  for (int step = 0; step < 24; ++step) {
    std::set<uint64_t> in_step;
    for (int m = 0; m < 2; ++m) {
      for (int r = 0; r < 3; ++r) {
        for (uint64_t s : RowSequences(Next(ranks[r]), 2)) {
          EXPECT_TRUE(in_step.insert(s).second)
              << "step " << step << ": sequence " << s << " read twice (rank " << r << ")";
          epochs[step / 8].push_back(s);
        }
      }
    }
    EXPECT_EQ(in_step.size(), 12u);
  }
  // Counter g = (p * dp + r) * B + i walks epoch e's permutation: its first E entries, in order.
  for (uint64_t e = 0; e < 3; ++e) {
    const std::vector<uint64_t> want = ReferencePermutation(100, 9, e);
    EXPECT_EQ(epochs[e], std::vector<uint64_t>(want.begin(), want.begin() + 96)) << "epoch " << e;
    EXPECT_EQ(std::set<uint64_t>(epochs[e].begin(), epochs[e].end()).size(), 96u);
  }
  EXPECT_NE(epochs[0], epochs[1]);
  EXPECT_EQ(ranks[1].Cursor(), (DataCursor{.epoch = 3, .sequence = 0}));
  // Another seed, another stream.
  DataLoader other = ShuffledOrDie(dataset, 2, 2, 3, 0, 2, /*seed=*/10);
  EXPECT_NE(RowSequences(Next(other), 2), (std::vector<uint64_t>{epochs[0][0], epochs[0][1]}));
}

TEST_F(DataLoaderTest, ShuffledResumeMidEpochContinuesTheSameStream) {
  // 997 tokens, T = 4: 199 sequences; B = 3, dp = 2, grad_accum = 1: G = 6, E = 198 (33 steps,
  // positions 0..32 are epoch 0).
  auto dataset = OpenOrDie(WriteIota("iota.bin", 997), TokenFormat::kU32, 997);
  for (uint64_t p : {0, 1, 17, 32, 33, 34, 70, 123}) {
    DataLoader straight = ShuffledOrDie(dataset, 4, 3, 2, 1, 1, 5);
    for (uint64_t i = 0; i < p; ++i) Next(straight);
    DataLoader resumed = ShuffledOrDie(dataset, 4, 3, 2, 1, 1, 5);
    ASSERT_TRUE(resumed.Seek(p).ok());
    // The cursor names the epoch and the sequences done: g = p * dp * B = 6p.
    EXPECT_EQ(resumed.Cursor(), (DataCursor{.epoch = 6 * p / 198, .sequence = 6 * p % 198})) << p;
    EXPECT_EQ(resumed.Cursor(), straight.Cursor()) << p;
    for (int i = 0; i < 40; ++i) EXPECT_EQ(Next(resumed), Next(straight)) << p << " + " << i;
  }
}

TEST_F(DataLoaderTest, ShuffledStepReadsTheSameSequencesAtEveryLayoutOfTheGlobalBatch) {
  // G = 8 sequences per step, split as dp x grad_accum x micro_batch = 1 x 1 x 8, 2 x 2 x 2 and
  // 4 x 2 x 1: the same set each step (S = 61 sequences of 5 tokens, E = 56).
  auto dataset = OpenOrDie(WriteIota("iota.bin", 305), TokenFormat::kU32, 305);
  struct Layout {
    int32_t dp, accum, b;
  };
  std::vector<std::vector<std::multiset<uint64_t>>> per_layout;
  for (const Layout& l : {Layout{1, 1, 8}, Layout{2, 2, 2}, Layout{4, 2, 1}}) {
    std::vector<DataLoader> ranks;
    for (int r = 0; r < l.dp; ++r)
      ranks.push_back(ShuffledOrDie(dataset, 4, l.b, l.dp, r, l.accum, 3));
    std::vector<std::multiset<uint64_t>> steps;
    for (int step = 0; step < 20; ++step) {  // 7 steps per epoch: crosses two epoch ends
      std::multiset<uint64_t> set;
      for (int m = 0; m < l.accum; ++m) {
        for (DataLoader& rank : ranks) {
          for (uint64_t s : RowSequences(Next(rank), 4)) set.insert(s);
        }
      }
      steps.push_back(set);
    }
    per_layout.push_back(steps);
  }
  EXPECT_EQ(per_layout[1], per_layout[0]);
  EXPECT_EQ(per_layout[2], per_layout[0]);
}

TEST_F(DataLoaderTest, ShuffleFalseIsFileOrderWhateverTheSeed) {
  auto dataset = OpenOrDie(WriteIota("iota.bin", 60), TokenFormat::kU32, 60);
  auto loader = DataLoader::Create(dataset, {.seq_len = 3,
                                             .micro_batch = 3,
                                             .dp = 1,
                                             .dp_rank = 0,
                                             .shuffle = false,
                                             .seed = 12345,
                                             .grad_accum = 4});
  ASSERT_TRUE(loader.ok()) << loader.status();
  for (int epoch = 0; epoch < 2; ++epoch) {  // windows of 12 tokens: W = 5
    for (uint64_t w = 0; w < 5; ++w) {
      EXPECT_EQ(RowSequences(Next(*loader), 3),
                (std::vector<uint64_t>{3 * w, 3 * w + 1, 3 * w + 2}));
    }
  }
  EXPECT_EQ(loader->Cursor(), (DataCursor{.epoch = 2, .sequence = 0}));
}

TEST_F(DataLoaderTest, ShuffledCorpusShorterThanOneStepIsInvalidArgument) {
  // 10 sequences of 5 tokens; a step of B 2 x dp 2 x grad_accum 3 = 12 sequences.
  const std::string path = WriteIota("iota.bin", 50);
  auto dataset = OpenOrDie(path, TokenFormat::kU32, 50);
  auto loader = DataLoader::Create(
      dataset,
      {.seq_len = 4, .micro_batch = 2, .dp = 2, .dp_rank = 0, .shuffle = true, .grad_accum = 3});
  EXPECT_EQ(loader.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(loader.status().message(),
              AllOf(HasSubstr(path), HasSubstr("10 sequences"), HasSubstr("= 12")));
  EXPECT_TRUE(
      DataLoader::Create(
          dataset,
          {.seq_len = 4, .micro_batch = 2, .dp = 2, .dp_rank = 0, .shuffle = true, .grad_accum = 2})
          .ok());
}

// ---------------------------------------------------------------------------------------------
// Validation split (data.val_fraction) and token ranges

TEST_F(DataLoaderTest, ValidationSplitIsNanoGptsBoundary) {
  // Python: int(n * (1 - f)) for the training part.
  EXPECT_EQ(ValidationSplit(1000, 0.1), 900u);
  EXPECT_EQ(ValidationSplit(1001, 0.1), 900u);  // 900.9
  EXPECT_EQ(ValidationSplit(10, 0.25), 7u);     // 7.5
  EXPECT_EQ(ValidationSplit(4, 0.5), 2u);
  EXPECT_EQ(ValidationSplit(3, 0.999), 0u);
  EXPECT_EQ(ValidationSplit(1000, 0.0), 1000u);  // no validation data
}

TEST_F(DataLoaderTest, HeldOutTailIsNeverTrainedOnAndIsReadFromItsStart) {
  // 1000 tokens, val_fraction 0.1: training tokens [0, 900), validation [900, 1000).
  auto dataset = OpenOrDie(WriteIota("iota.bin", 1000), TokenFormat::kU32, 1000);
  const uint64_t split = ValidationSplit(dataset->size(), 0.1);
  ASSERT_EQ(split, 900u);
  for (bool shuffle : {false, true}) {
    auto train = DataLoader::Create(dataset, {.seq_len = 9,
                                              .micro_batch = 2,
                                              .dp = 1,
                                              .dp_rank = 0,
                                              .shuffle = shuffle,
                                              .range = {.begin = 0, .end = split}});
    ASSERT_TRUE(train.ok()) << train.status();
    EXPECT_EQ(train->num_sequences(), 90u);
    std::set<int32_t> seen;
    for (int i = 0; i < 135; ++i) {  // three epochs of 45 batches
      for (int32_t t : Next(*train)) {
        EXPECT_LT(t, 900) << "shuffle " << shuffle << ": a held-out token was trained on";
        seen.insert(t);
      }
    }
    EXPECT_EQ(seen.size(), 900u) << "shuffle " << shuffle;  // and every other token was
  }
  // Validation: file order from the split; windows of B (T + 1) = 20 tokens, 5 of them.
  auto val = DataLoader::Create(
      dataset, {.seq_len = 9, .micro_batch = 2, .dp = 2, .dp_rank = 1, .range = {.begin = split}});
  ASSERT_TRUE(val.ok()) << val.status();
  EXPECT_EQ(val->num_sequences(), 10u);
  std::vector<int32_t> batch(20);
  ASSERT_TRUE(val->BatchAt(0, batch).ok());
  EXPECT_EQ(batch.front(), 920);  // rank 1's first window is the tail's second
  EXPECT_EQ(batch.back(), 939);
  ASSERT_TRUE(val->BatchAt(1, batch).ok());
  EXPECT_EQ(batch.front(), 960);
}

TEST_F(DataLoaderTest, RangeTooShortNamesTheRangeAndTheFile) {
  const std::string path = WriteIota("iota.bin", 1000);
  auto dataset = OpenOrDie(path, TokenFormat::kU32, 1000);
  auto loader = DataLoader::Create(
      dataset, {.seq_len = 9, .micro_batch = 2, .dp = 2, .range = {.begin = 980}});
  EXPECT_EQ(loader.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(loader.status().message(),
              AllOf(HasSubstr("tokens [980, 1000)"), HasSubstr(path), HasSubstr("20 tokens"),
                    HasSubstr("fewer than dp = 2")));
  auto outside = DataLoader::Create(
      dataset, {.seq_len = 9, .micro_batch = 1, .range = {.begin = 1001, .end = 2000}});
  EXPECT_EQ(outside.status().code(), absl::StatusCode::kInvalidArgument);
}

// ---------------------------------------------------------------------------------------------
// Bad input

TEST_F(DataLoaderTest, MissingFileIsNotFoundNamingIt) {
  const std::string path = (fs::path(dir_) / "nope.bin").string();
  auto dataset = TokenDataset::Open(path, TokenFormat::kU16, 50304);
  EXPECT_EQ(dataset.status().code(), absl::StatusCode::kNotFound);
  EXPECT_THAT(dataset.status().message(), AllOf(HasSubstr(path), HasSubstr("no such file")));
}

TEST_F(DataLoaderTest, DirectoryIsInvalidArgument) {
  auto dataset = TokenDataset::Open(dir_, TokenFormat::kText, 256);
  EXPECT_EQ(dataset.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(dataset.status().message(), HasSubstr(dir_));
}

TEST_F(DataLoaderTest, EmptyFileIsInvalidArgumentNamingIt) {
  for (TokenFormat f : {TokenFormat::kText, TokenFormat::kU16, TokenFormat::kU32}) {
    const std::string path = WriteBytes("empty.bin", "");
    auto dataset = TokenDataset::Open(path, f, 256);
    EXPECT_EQ(dataset.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_THAT(dataset.status().message(), AllOf(HasSubstr(path), HasSubstr("empty")));
  }
}

TEST_F(DataLoaderTest, U16FileWithAnOddSizeIsDataLoss) {
  const std::string path = WriteBytes("odd.bin", std::string("\x01\x00\x02\x00\x03", 5));
  auto dataset = TokenDataset::Open(path, TokenFormat::kU16, 65536);
  EXPECT_EQ(dataset.status().code(), absl::StatusCode::kDataLoss);
  EXPECT_THAT(dataset.status().message(),
              AllOf(HasSubstr(path), HasSubstr("size 5 bytes"), HasSubstr("2-byte u16"),
                    HasSubstr("byte offset 4")));
}

TEST_F(DataLoaderTest, U32FileWithAPartialTokenIsDataLoss) {
  const std::string path = WriteBytes("part.bin", std::string(10, '\0'));
  auto dataset = TokenDataset::Open(path, TokenFormat::kU32, 100);
  EXPECT_EQ(dataset.status().code(), absl::StatusCode::kDataLoss);
  EXPECT_THAT(dataset.status().message(),
              AllOf(HasSubstr(path), HasSubstr("4-byte u32"), HasSubstr("byte offset 8")));
}

TEST_F(DataLoaderTest, U16TokenNotBelowVocabIsDataLossWithItsOffset) {
  // Token 3 (bytes 6..7) is 50304 = vocab; token 5 is larger still but the first is reported.
  const std::string path = WriteU16("big.bin", {1, 2, 50303, 50304, 7, 60000});
  auto dataset = TokenDataset::Open(path, TokenFormat::kU16, 50304);
  EXPECT_EQ(dataset.status().code(), absl::StatusCode::kDataLoss);
  EXPECT_THAT(dataset.status().message(),
              AllOf(HasSubstr(path), HasSubstr("token 50304"), HasSubstr("byte offset 6"),
                    HasSubstr("vocab 50304")));
  // The same file with a vocabulary that holds every token opens.
  EXPECT_TRUE(TokenDataset::Open(path, TokenFormat::kU16, 60001).ok());
}

TEST_F(DataLoaderTest, U32TokenNotBelowVocabIsDataLossWithItsOffset) {
  const std::string path = WriteU32("big.bin", {0, 1, 2, 3, 4, 4000000000u});
  auto dataset = TokenDataset::Open(path, TokenFormat::kU32, 65536);
  EXPECT_EQ(dataset.status().code(), absl::StatusCode::kDataLoss);
  EXPECT_THAT(dataset.status().message(),
              AllOf(HasSubstr(path), HasSubstr("token 4000000000"), HasSubstr("byte offset 20")));
}

TEST_F(DataLoaderTest, TextByteNotBelowASmallVocabIsDataLossWithItsOffset) {
  const std::string path = WriteBytes("a.txt", "AAAAz");  // 'z' = 122 at offset 4
  auto dataset = TokenDataset::Open(path, TokenFormat::kText, 100);
  EXPECT_EQ(dataset.status().code(), absl::StatusCode::kDataLoss);
  EXPECT_THAT(dataset.status().message(),
              AllOf(HasSubstr(path), HasSubstr("token 122"), HasSubstr("byte offset 4")));
}

TEST_F(DataLoaderTest, NonPositiveVocabIsInvalidArgument) {
  const std::string path = WriteBytes("a.txt", "abc");
  EXPECT_EQ(TokenDataset::Open(path, TokenFormat::kText, 0).status().code(),
            absl::StatusCode::kInvalidArgument);
}

TEST_F(DataLoaderTest, FileShorterThanOneWindowIsInvalidArgumentNamingIt) {
  const std::string path = WriteBytes("short.txt", "only 19 bytes here.");
  auto dataset = OpenOrDie(path, TokenFormat::kText, 256);
  // B * (T + 1) = 2 * 10 = 20 > 19.
  auto loader = DataLoader::Create(dataset, {.seq_len = 9, .micro_batch = 2, .dp = 1});
  EXPECT_EQ(loader.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(loader.status().message(),
              AllOf(HasSubstr(path), HasSubstr("19 tokens"), HasSubstr("shorter than one window"),
                    HasSubstr("20 tokens")));
  // Exactly one window is enough for one rank ...
  EXPECT_TRUE(DataLoader::Create(dataset, {.seq_len = 9, .micro_batch = 1, .dp = 1}).ok());
  // ... but not for two, who would then share it.
  auto two = DataLoader::Create(dataset, {.seq_len = 8, .micro_batch = 1, .dp = 3});
  EXPECT_EQ(two.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(two.status().message(), AllOf(HasSubstr(path), HasSubstr("fewer than dp = 3")));
}

TEST_F(DataLoaderTest, BadOptionsNameTheOption) {
  auto dataset = OpenOrDie(WriteIota("iota.bin", 100), TokenFormat::kU32, 100);
  struct Case {
    DataLoaderOptions options;
    const char* field;
  };
  for (const Case& c :
       {Case{{.seq_len = 0, .micro_batch = 1}, "seq_len"},
        Case{{.seq_len = 4, .micro_batch = 0}, "micro_batch"},
        Case{{.seq_len = 4, .micro_batch = 1, .dp = 0}, "dp must"},
        Case{{.seq_len = 4, .micro_batch = 1, .dp = 2, .dp_rank = 2}, "dp_rank"},
        Case{{.seq_len = 4, .micro_batch = 1, .dp = 2, .dp_rank = -1}, "dp_rank"}}) {
    auto loader = DataLoader::Create(dataset, c.options);
    EXPECT_EQ(loader.status().code(), absl::StatusCode::kInvalidArgument) << c.field;
    EXPECT_THAT(loader.status().message(), HasSubstr(c.field));
  }
  EXPECT_EQ(DataLoader::Create(nullptr, {.seq_len = 4, .micro_batch = 1}).status().code(),
            absl::StatusCode::kInvalidArgument);
}

TEST_F(DataLoaderTest, WrongBufferSizeIsInvalidArgumentAndDoesNotMove) {
  auto dataset = OpenOrDie(WriteIota("iota.bin", 100), TokenFormat::kU32, 100);
  DataLoader loader = LoaderOrDie(dataset, 4, 2, 1, 0);
  std::vector<int32_t> small(9);
  EXPECT_EQ(loader.Next(small).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(loader.position(), 0u);
}

}  // namespace
}  // namespace fp8rt::train
