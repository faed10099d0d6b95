// Tests of runtime/checkpoint/checkpoint_io.h. Expected bytes and checksums are computed here from
// the format written in the header (magic, little-endian fields, XXH64 with seed 0, called directly
// on the bytes read back from disk), never captured from the writer:
//   - sections round-trip: empty, 1 MiB of random bytes, names with arbitrary bytes, protos;
//   - a one-section file is byte-for-byte the layout the header documents;
//   - the reported checksum is XXH64 of the file; no temp file is left, after success or failure;
//   - every single-byte flip of a small shard (and a sample of a large one) and every truncation
//     is DataLoss naming the file and an offset; a missing section is NotFound naming it;
//   - a ranged reader reads nothing but the section headers at open and each section asked for
//     once (bytes_read), gives the same bytes, and detects every byte flip outside the trailer at
//     open or when the damaged section is read.
#include "runtime/checkpoint/checkpoint_io.h"

#include <stdlib.h>
#include <xxhash.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <random>
#include <string>
#include <vector>

#include "fp8rt/v1/scaling.pb.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace fp8rt {
namespace {

using ::testing::AllOf;
using ::testing::ElementsAre;
using ::testing::HasSubstr;

namespace fs = std::filesystem;

using Bytes = std::vector<std::byte>;

Bytes RandomBytes(size_t n, uint64_t seed) {
  std::mt19937_64 rng(seed);
  Bytes out(n);
  for (std::byte& b : out) b = static_cast<std::byte>(rng() & 0xff);
  return out;
}

Bytes FromString(const std::string& s) {
  Bytes out(s.size());
  for (size_t i = 0; i < s.size(); ++i) out[i] = static_cast<std::byte>(s[i]);
  return out;
}

// Not tests/support's ReadFile/WriteFile: these carry std::byte vectors, the type ShardWriter and
// ShardReader take and give, so expected and actual bytes compare directly.
Bytes ReadFile(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  std::string s((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  return FromString(s);
}

void WriteFile(const std::string& path, const Bytes& bytes) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out.write(reinterpret_cast<const char*>(bytes.data()),
            static_cast<std::streamsize>(bytes.size()));
  ASSERT_TRUE(out.good()) << path;
}

uint64_t Xxh64(const Bytes& b, size_t n) { return XXH64(b.data(), n, 0); }

void PutU32(Bytes* out, uint32_t v) {
  for (int i = 0; i < 4; ++i) out->push_back(static_cast<std::byte>((v >> (8 * i)) & 0xff));
}
void PutU64(Bytes* out, uint64_t v) {
  for (int i = 0; i < 8; ++i) out->push_back(static_cast<std::byte>((v >> (8 * i)) & 0xff));
}

Bytes ToBytes(std::span<const std::byte> s) { return Bytes(s.begin(), s.end()); }

class CheckpointIoTest : public ::testing::Test {
 protected:
  void SetUp() override {
    std::string tmpl = ::testing::TempDir() + "checkpoint_io_test.XXXXXX";
    ASSERT_NE(::mkdtemp(tmpl.data()), nullptr);
    dir_ = tmpl;
  }
  void TearDown() override { fs::remove_all(dir_); }

  std::string Path(const std::string& name) const { return (fs::path(dir_) / name).string(); }

  // Names of the entries of the test folder.
  std::vector<std::string> Listing() const {
    std::vector<std::string> names;
    for (const auto& e : fs::directory_iterator(dir_)) names.push_back(e.path().filename());
    std::sort(names.begin(), names.end());
    return names;
  }

  // Expects Open of `bytes` written to a file to fail with DataLoss naming the file and an offset.
  // Returns the message.
  std::string ExpectDataLoss(const Bytes& bytes, const std::string& what) {
    const std::string path = Path("corrupt.shard");
    WriteFile(path, bytes);
    auto reader = ShardReader::Open(path);
    EXPECT_FALSE(reader.ok()) << what;
    if (reader.ok()) return "";
    EXPECT_EQ(reader.status().code(), absl::StatusCode::kDataLoss)
        << what << ": " << reader.status();
    const std::string message(reader.status().message());
    EXPECT_THAT(message, AllOf(HasSubstr(path), HasSubstr("offset"))) << what;
    return message;
  }

  std::string dir_;
};

// A small shard with an empty section and a binary name, and where each section's bytes lie,
// computed from the documented layout.
struct SmallShard {
  std::vector<std::string> names;
  std::vector<Bytes> contents;
};

SmallShard MakeSmallShard() {
  SmallShard s;
  s.names = {"rng", "empty", std::string("bin\0\xff\x01/name", 10), "data_position"};
  s.contents = {RandomBytes(16, 1), Bytes{}, RandomBytes(5, 2), RandomBytes(8, 3)};
  return s;
}

TEST_F(CheckpointIoTest, RoundTripsSectionsAndReportsChecksumOfTheFile) {
  SmallShard small = MakeSmallShard();
  small.names.push_back("master/blocks.0.mlp.fc1");
  small.contents.push_back(RandomBytes(1 << 20, 4));

  ShardWriter writer;
  for (size_t i = 0; i < small.names.size(); ++i) {
    ASSERT_TRUE(writer.Add(small.names[i], small.contents[i]).ok());
  }
  const std::string path = Path("rank-00000.shard");
  auto result = writer.Write(path);
  ASSERT_TRUE(result.ok()) << result.status();

  const Bytes file = ReadFile(path);
  EXPECT_EQ(result->size, file.size());
  EXPECT_EQ(result->xxh64, Xxh64(file, file.size()));
  EXPECT_THAT(Listing(), ElementsAre("rank-00000.shard"));  // no temp file left

  auto reader = ShardReader::Open(path);
  ASSERT_TRUE(reader.ok()) << reader.status();
  EXPECT_EQ((*reader)->SectionNames(), small.names);
  EXPECT_EQ((*reader)->file_size(), file.size());
  EXPECT_EQ((*reader)->file_xxh64(), result->xxh64);
  for (size_t i = 0; i < small.names.size(); ++i) {
    EXPECT_TRUE((*reader)->HasSection(small.names[i]));
    auto section = (*reader)->Section(small.names[i]);
    ASSERT_TRUE(section.ok()) << section.status();
    EXPECT_EQ(ToBytes(*section), small.contents[i]) << "section " << i;
  }
}

TEST_F(CheckpointIoTest, FileIsTheDocumentedLayout) {
  const Bytes payload = {std::byte{1}, std::byte{2}, std::byte{3}};
  ShardWriter writer;
  ASSERT_TRUE(writer.Add("ab", payload).ok());
  const std::string path = Path("one.shard");
  ASSERT_TRUE(writer.Write(path).ok());

  Bytes expected = FromString("FP8RTSH1");
  PutU32(&expected, 1);  // version
  PutU32(&expected, 1);  // section count
  PutU32(&expected, 2);  // name length
  expected.push_back(std::byte{'a'});
  expected.push_back(std::byte{'b'});
  PutU64(&expected, 3);  // byte length
  PutU64(&expected, Xxh64(payload, payload.size()));
  expected.insert(expected.end(), payload.begin(), payload.end());
  PutU64(&expected, Xxh64(expected, expected.size()));  // trailer
  EXPECT_EQ(ReadFile(path), expected);
}

TEST_F(CheckpointIoTest, EmptyShardRoundTrips) {
  ShardWriter writer;
  const std::string path = Path("empty.shard");
  auto result = writer.Write(path);
  ASSERT_TRUE(result.ok()) << result.status();
  EXPECT_EQ(result->size, 8u + 4 + 4 + 8);
  auto reader = ShardReader::Open(path);
  ASSERT_TRUE(reader.ok()) << reader.status();
  EXPECT_TRUE((*reader)->SectionNames().empty());
}

TEST_F(CheckpointIoTest, ProtoSectionRoundTrips) {
  fp8rt::v1::ScalingState state;
  state.set_format(fp8rt::v1::FP8_FORMAT_E4M3);
  state.set_history_len(4);
  state.add_amax_history(1.5f);
  state.add_amax_history(3.25f);
  state.set_scale(64.0f);
  state.set_scale_inv(1.0f / 64.0f);
  state.set_updates(7);

  ShardWriter writer;
  ASSERT_TRUE(writer.AddProto("scaling/blocks.0.mlp.fc1/weight", state).ok());
  ASSERT_TRUE(writer.Add("junk", RandomBytes(3, 9)).ok());
  const std::string path = Path("proto.shard");
  ASSERT_TRUE(writer.Write(path).ok());

  auto reader = ShardReader::Open(path);
  ASSERT_TRUE(reader.ok()) << reader.status();
  fp8rt::v1::ScalingState back;
  ASSERT_TRUE((*reader)->ParseProto("scaling/blocks.0.mlp.fc1/weight", &back).ok());
  EXPECT_EQ(back.SerializeAsString(), state.SerializeAsString());
  EXPECT_EQ(back.amax_history_size(), 2);
  EXPECT_EQ(back.scale(), 64.0f);
}

TEST_F(CheckpointIoTest, AddRejectsBadNames) {
  ShardWriter writer;
  EXPECT_EQ(writer.Add("", {}).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(writer.Add(std::string(kMaxShardSectionNameBytes + 1, 'x'), {}).code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(writer.Add(std::string(kMaxShardSectionNameBytes, 'x'), {}).ok());
  ASSERT_TRUE(writer.Add("rng", {}).ok());
  const absl::Status dup = writer.Add("rng", {});
  EXPECT_EQ(dup.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(dup.message(), HasSubstr("rng"));
  EXPECT_EQ(writer.section_count(), 2u);
}

TEST_F(CheckpointIoTest, WriteToMissingFolderFailsNamingThePathAndLeavesNothing) {
  ShardWriter writer;
  ASSERT_TRUE(writer.Add("rng", RandomBytes(16, 1)).ok());
  const std::string path = Path("no_such_folder/rank-00000.shard");
  auto result = writer.Write(path);
  ASSERT_FALSE(result.ok());
  EXPECT_THAT(result.status().message(), HasSubstr(path));
  EXPECT_FALSE(fs::exists(path + ".tmp"));
  EXPECT_TRUE(Listing().empty());
}

TEST_F(CheckpointIoTest, FailedRenameRemovesTheTempFile) {
  // The destination is a non-empty folder, so the rename (the last step) fails.
  const std::string path = Path("occupied");
  fs::create_directory(path);
  WriteFile(path + "/keep", RandomBytes(4, 1));
  ShardWriter writer;
  ASSERT_TRUE(writer.Add("rng", RandomBytes(16, 1)).ok());
  auto result = writer.Write(path);
  ASSERT_FALSE(result.ok());
  EXPECT_THAT(result.status().message(), HasSubstr(path));
  EXPECT_THAT(Listing(), ElementsAre("occupied"));
  EXPECT_TRUE(fs::exists(path + "/keep"));
}

TEST_F(CheckpointIoTest, WriteReplacesAnExistingShard) {
  const std::string path = Path("s.shard");
  ShardWriter first;
  ASSERT_TRUE(first.Add("a", RandomBytes(100, 1)).ok());
  ASSERT_TRUE(first.Write(path).ok());
  ShardWriter second;
  ASSERT_TRUE(second.Add("b", RandomBytes(10, 2)).ok());
  ASSERT_TRUE(second.Write(path).ok());
  auto reader = ShardReader::Open(path);
  ASSERT_TRUE(reader.ok()) << reader.status();
  EXPECT_THAT((*reader)->SectionNames(), ElementsAre("b"));
  EXPECT_THAT(Listing(), ElementsAre("s.shard"));
}

TEST_F(CheckpointIoTest, EveryByteFlipOfASmallShardIsDataLoss) {
  const SmallShard small = MakeSmallShard();
  ShardWriter writer;
  for (size_t i = 0; i < small.names.size(); ++i) {
    ASSERT_TRUE(writer.Add(small.names[i], small.contents[i]).ok());
  }
  ASSERT_TRUE(writer.Write(Path("good.shard")).ok());
  const Bytes good = ReadFile(Path("good.shard"));

  // Where each section's bytes lie, from the documented layout.
  std::vector<std::pair<size_t, size_t>> data_ranges;
  size_t pos = 16;
  for (size_t i = 0; i < small.names.size(); ++i) {
    pos += 4 + small.names[i].size() + 16;
    data_ranges.emplace_back(pos, pos + small.contents[i].size());
    pos += small.contents[i].size();
  }
  ASSERT_EQ(pos + 8, good.size());

  for (const uint8_t mask : {uint8_t{0x01}, uint8_t{0x80}, uint8_t{0xff}}) {
    for (size_t i = 0; i < good.size(); ++i) {
      Bytes bad = good;
      bad[i] ^= std::byte{mask};
      const std::string what = "byte " + std::to_string(i) + " ^ " + std::to_string(mask);
      const std::string message = ExpectDataLoss(bad, what);
      if (i < 8) {
        EXPECT_THAT(message, HasSubstr("magic")) << what;
      } else if (i < 12) {
        EXPECT_THAT(message, HasSubstr("version")) << what;
      }
      for (size_t s = 0; s < data_ranges.size(); ++s) {
        if (i >= data_ranges[s].first && i < data_ranges[s].second) {
          EXPECT_THAT(message, AllOf(HasSubstr("checksum"),
                                     HasSubstr("offset " + std::to_string(data_ranges[s].first))))
              << what;
        }
      }
      if (i >= good.size() - 8) {
        EXPECT_THAT(message, HasSubstr("whole-file checksum")) << what;
      }
    }
  }
}

TEST_F(CheckpointIoTest, SampledByteFlipsOfALargeShardAreDataLoss) {
  const Bytes big = RandomBytes(1 << 20, 5);
  ShardWriter writer;
  ASSERT_TRUE(writer.Add("master/blocks.0.mlp.fc1", big).ok());
  ASSERT_TRUE(writer.Add("adam_m/blocks.0.mlp.fc1", RandomBytes(1000, 6)).ok());
  ASSERT_TRUE(writer.Write(Path("big.shard")).ok());
  const Bytes good = ReadFile(Path("big.shard"));

  std::vector<size_t> positions;
  for (size_t i = 0; i < 64; ++i) {
    positions.push_back(i);
    positions.push_back(good.size() - 1 - i);
  }
  std::mt19937_64 rng(7);
  for (int k = 0; k < 100; ++k) positions.push_back(rng() % good.size());
  for (const size_t i : positions) {
    Bytes bad = good;
    bad[i] ^= std::byte{0x20};
    ExpectDataLoss(bad, "byte " + std::to_string(i));
  }
  // A flip inside the 1 MiB section names it.
  Bytes bad = good;
  bad[16 + 4 + 23 + 16 + 500000] ^= std::byte{1};
  EXPECT_THAT(ExpectDataLoss(bad, "inside the big section"), HasSubstr("master/blocks.0.mlp.fc1"));
}

TEST_F(CheckpointIoTest, EveryTruncationIsDataLoss) {
  const SmallShard small = MakeSmallShard();
  ShardWriter writer;
  for (size_t i = 0; i < small.names.size(); ++i) {
    ASSERT_TRUE(writer.Add(small.names[i], small.contents[i]).ok());
  }
  ASSERT_TRUE(writer.Write(Path("good.shard")).ok());
  const Bytes good = ReadFile(Path("good.shard"));
  for (size_t n = 0; n < good.size(); ++n) {
    ExpectDataLoss(Bytes(good.begin(), good.begin() + static_cast<std::ptrdiff_t>(n)),
                   "truncated to " + std::to_string(n));
  }
  // Bytes appended after the trailer are corruption too.
  Bytes longer = good;
  longer.push_back(std::byte{0});
  ExpectDataLoss(longer, "one byte appended");
}

TEST_F(CheckpointIoTest, MissingSectionIsNotFoundNamingIt) {
  ShardWriter writer;
  ASSERT_TRUE(writer.Add("rng", RandomBytes(16, 1)).ok());
  // 0xff bytes: a varint that never ends, which no message parses.
  ASSERT_TRUE(writer.Add("not_proto", Bytes(16, std::byte{0xff})).ok());
  const std::string path = Path("s.shard");
  ASSERT_TRUE(writer.Write(path).ok());
  auto reader = ShardReader::Open(path);
  ASSERT_TRUE(reader.ok()) << reader.status();
  EXPECT_FALSE((*reader)->HasSection("adam_v/blocks.0.mlp.fc1"));
  auto section = (*reader)->Section("adam_v/blocks.0.mlp.fc1");
  ASSERT_FALSE(section.ok());
  EXPECT_EQ(section.status().code(), absl::StatusCode::kNotFound);
  EXPECT_THAT(section.status().message(),
              AllOf(HasSubstr("adam_v/blocks.0.mlp.fc1"), HasSubstr(path)));
  fp8rt::v1::ScalingState state;
  EXPECT_EQ((*reader)->ParseProto("scaling/x", &state).code(), absl::StatusCode::kNotFound);
  // A section whose bytes are not the message is DataLoss.
  EXPECT_EQ((*reader)->ParseProto("not_proto", &state).code(), absl::StatusCode::kDataLoss);
}

TEST_F(CheckpointIoTest, MissingFileIsNotFoundNamingIt) {
  const std::string path = Path("absent.shard");
  auto reader = ShardReader::Open(path);
  ASSERT_FALSE(reader.ok());
  EXPECT_EQ(reader.status().code(), absl::StatusCode::kNotFound);
  EXPECT_THAT(reader.status().message(), HasSubstr(path));
}

TEST_F(CheckpointIoTest, RangedReaderReadsOnlyTheSectionsAskedFor) {
  const Bytes big = RandomBytes(1 << 20, 8), small = RandomBytes(100, 9);
  ShardWriter writer;
  ASSERT_TRUE(writer.Add("master/blocks.0.mlp.fc1", big).ok());
  ASSERT_TRUE(writer.Add("meta/step", small).ok());
  const std::string path = Path("ranged.shard");
  auto written = writer.Write(path);
  ASSERT_TRUE(written.ok()) << written.status();

  auto reader = ShardReader::OpenRanged(path);
  ASSERT_TRUE(reader.ok()) << reader.status();
  const ShardReader& r = **reader;
  EXPECT_TRUE(r.ranged());
  EXPECT_EQ(r.file_size(), written->size);
  EXPECT_EQ(r.bytes_read(), 0u) << "open reads the section headers only";
  EXPECT_THAT(r.SectionNames(), ElementsAre("master/blocks.0.mlp.fc1", "meta/step"));
  auto got = r.Section("meta/step");
  ASSERT_TRUE(got.ok()) << got.status();
  EXPECT_EQ(ToBytes(*got), small);
  EXPECT_EQ(r.bytes_read(), small.size()) << "the 1 MiB section was not read";
  ASSERT_TRUE(r.Section("meta/step").ok());
  EXPECT_EQ(r.bytes_read(), small.size()) << "a section is read once";
  auto whole = r.Section("master/blocks.0.mlp.fc1");
  ASSERT_TRUE(whole.ok()) << whole.status();
  EXPECT_EQ(ToBytes(*whole), big);
  EXPECT_EQ(r.bytes_read(), small.size() + big.size());
  EXPECT_EQ(r.Section("absent").status().code(), absl::StatusCode::kNotFound);
  // A full reader reports the whole file read.
  auto full = ShardReader::Open(path);
  ASSERT_TRUE(full.ok());
  EXPECT_FALSE((*full)->ranged());
  EXPECT_EQ((*full)->bytes_read(), written->size);
}

TEST_F(CheckpointIoTest, RangedReaderDetectsEveryByteFlipOutsideTheTrailer) {
  const SmallShard small = MakeSmallShard();
  ShardWriter writer;
  for (size_t i = 0; i < small.names.size(); ++i) {
    ASSERT_TRUE(writer.Add(small.names[i], small.contents[i]).ok());
  }
  ASSERT_TRUE(writer.Write(Path("good.shard")).ok());
  const Bytes good = ReadFile(Path("good.shard"));
  std::vector<std::pair<size_t, size_t>> data_ranges;  // from the documented layout
  size_t pos = 16;
  for (size_t i = 0; i < small.names.size(); ++i) {
    pos += 4 + small.names[i].size() + 16;
    data_ranges.emplace_back(pos, pos + small.contents[i].size());
    pos += small.contents[i].size();
  }
  ASSERT_EQ(pos + 8, good.size());
  const std::string path = Path("flipped.shard");
  for (size_t i = 0; i < good.size(); ++i) {
    Bytes bad = good;
    bad[i] ^= std::byte{0x10};
    WriteFile(path, bad);
    const std::string what = "byte " + std::to_string(i);
    auto reader = ShardReader::OpenRanged(path);
    if (!reader.ok()) {
      EXPECT_EQ(reader.status().code(), absl::StatusCode::kDataLoss) << what;
      EXPECT_THAT(reader.status().message(), HasSubstr(path)) << what;
      EXPECT_LT(i, good.size() - 8) << what << ": the trailer is not checked when ranged";
      continue;
    }
    // Opened: read every section back, as the loader would.
    std::vector<absl::StatusCode> codes;
    for (size_t s = 0; s < small.names.size(); ++s) {
      auto section = (*reader)->Section(small.names[s]);
      codes.push_back(section.ok() && ToBytes(*section) == small.contents[s]
                          ? absl::StatusCode::kOk
                          : section.status().code());
      const bool inside = i >= data_ranges[s].first && i < data_ranges[s].second;
      if (inside) {
        EXPECT_EQ(section.status().code(), absl::StatusCode::kDataLoss) << what;
        EXPECT_THAT(section.status().message(),
                    AllOf(HasSubstr("checksum"), HasSubstr(path),
                          HasSubstr("offset " + std::to_string(data_ranges[s].first))))
            << what;
      }
    }
    const bool all_ok = std::all_of(codes.begin(), codes.end(),
                                    [](absl::StatusCode c) { return c == absl::StatusCode::kOk; });
    if (i >= good.size() - 8) {
      EXPECT_TRUE(all_ok) << what << ": a trailer flip does not change any section";
    } else {
      EXPECT_FALSE(all_ok) << what << ": a flip outside the trailer went unnoticed";
    }
  }
}

}  // namespace
}  // namespace fp8rt
