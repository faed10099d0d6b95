// Tests of runtime/core/safetensors.h against the format's definition (huggingface/safetensors
// README): every file here is assembled byte by byte in the test -- an 8-byte little-endian
// header size, the JSON header, the little-endian row-major buffer -- so the expected bytes and
// values come from the definition, not from the writer under test.
//   - a hand-made file reads back: names, dtypes, shapes, data spans, metadata;
//   - the writer's bytes equal the hand-made bytes (metadata first, tensors in the given order,
//     header padded with spaces to 8 bytes), and write -> read -> write is byte-identical;
//   - F32, BF16 and F16 read as FP32 exactly (F16 subnormals, infinities, signed zero);
//   - every malformed file is refused naming the file and the tensor or field, with a bounded
//     quote: short file, huge header size, header past the end, not JSON, not '{', duplicate
//     keys, unknown dtype, missing field, unknown field, negative dimension, offsets outside the
//     buffer, a size that does not match the shape, overlap, gap, trailing bytes;
//   - a failed write leaves no file;
//   - a file system that cannot map files (mmap refused, as some FUSE ones do; here by an
//     interposed mmap, below) still reads every file, by reading it;
//   - SafetensorsSet: shards listed by a hand-written index read as one set (by the index or its
//     folder; model.safetensors first where both are); every malformed index or inconsistent set
//     of shards is refused naming the index or the shard, the tensor or field, bounded.
#include "runtime/core/safetensors.h"

#include <dlfcn.h>
#include <errno.h>
#include <stdlib.h>
#include <sys/mman.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <atomic>
#include <bit>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <string>
#include <tuple>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/support/test_support.h"

// This test executable's mmap, which the library's SafetensorsFile::Read calls (the executable's
// definition comes before libc's): it answers ENODEV, as a file system without mmap support
// does, for file mappings while g_refuse_file_maps is set, and otherwise passes the call on to
// the next definition (a sanitizer's interceptor or libc's; the plain system call while that is
// being looked up, should the lookup itself map memory).
namespace {
std::atomic<bool> g_refuse_file_maps{false};
std::atomic<int> g_refused_maps{0};

using MmapFn = void* (*)(void*, size_t, int, int, int, off_t);
std::atomic<MmapFn> g_next_mmap{nullptr};
thread_local bool t_resolving = false;
}  // namespace

extern "C" void* mmap(void* addr, size_t length, int prot, int flags, int fd,
                      off_t offset) noexcept {
  if (fd >= 0 && (flags & MAP_ANONYMOUS) == 0 && g_refuse_file_maps.load()) {
    g_refused_maps.fetch_add(1);
    errno = ENODEV;
    return MAP_FAILED;
  }
  MmapFn next = g_next_mmap.load();
  if (next == nullptr && !t_resolving) {
    t_resolving = true;
    next = reinterpret_cast<MmapFn>(dlsym(RTLD_NEXT, "mmap"));
    t_resolving = false;
    g_next_mmap.store(next);
  }
  if (next != nullptr) return next(addr, length, prot, flags, fd, offset);
  return reinterpret_cast<void*>(syscall(SYS_mmap, addr, length, prot, flags, fd, offset));
}

namespace fp8rt {
namespace {

using ::testing::AllOf;
using ::testing::HasSubstr;
using ::testing::Not;

namespace fs = std::filesystem;

std::vector<std::byte> ToBytes(const std::string& s) {
  std::vector<std::byte> out(s.size());
  std::memcpy(out.data(), s.data(), s.size());
  return out;
}

// The file the definition describes: size (8 bytes, little-endian), header, buffer.
std::string File(const std::string& header, const std::string& buffer) {
  std::string out;
  const uint64_t n = header.size();
  for (int i = 0; i < 8; ++i) out.push_back(static_cast<char>((n >> (8 * i)) & 0xff));
  return out + header + buffer;
}

std::string F32Bytes(const std::vector<float>& v) {
  std::string out;
  for (float f : v) {
    const uint32_t b = std::bit_cast<uint32_t>(f);
    for (int i = 0; i < 32; i += 8) out.push_back(static_cast<char>((b >> i) & 0xff));
  }
  return out;
}

std::string U16Bytes(const std::vector<uint16_t>& v) {
  std::string out;
  for (uint16_t h : v) {
    out.push_back(static_cast<char>(h & 0xff));
    out.push_back(static_cast<char>(h >> 8));
  }
  return out;
}

absl::StatusOr<SafetensorsFile> ParseText(const std::string& bytes) {
  return SafetensorsFile::Parse(ToBytes(bytes), "model.safetensors");
}

class SafetensorsTest : public ::testing::Test {
 protected:
  std::string Path(const std::string& name) const { return (dir_ / name).string(); }
  static std::string Slurp(const std::string& path) { return test::ReadFile(path); }
  static void WriteBytes(const fs::path& path, const std::string& bytes) {
    std::ofstream out(path, std::ios::binary | std::ios::trunc);
    out << bytes;
    ASSERT_TRUE(out.good()) << path;
  }
  test::TempDir dir_{"safetensors_test"};
};

const std::string kTwoTensors = R"({"__metadata__":{"format":"pt"},)"
                                R"("w":{"dtype":"F32","shape":[2,1],"data_offsets":[0,8]},)"
                                R"("b":{"dtype":"BF16","shape":[3],"data_offsets":[8,14]}})";

TEST_F(SafetensorsTest, HandMadeFileReadsBack) {
  const std::string buffer = F32Bytes({1.5f, -2.0f}) + U16Bytes({0x3f80, 0xc000, 0x0001});
  absl::StatusOr<SafetensorsFile> f = ParseText(File(kTwoTensors + "   ", buffer));
  ASSERT_TRUE(f.ok()) << f.status();
  ASSERT_EQ(f->tensors().size(), 2u);
  EXPECT_EQ(f->tensors()[0].name, "w");
  EXPECT_EQ(f->tensors()[0].dtype, SafetensorsDtype::kF32);
  EXPECT_EQ(f->tensors()[0].shape, (std::vector<int64_t>{2, 1}));
  EXPECT_EQ(f->tensors()[0].data.size(), 8u);
  EXPECT_EQ(f->tensors()[1].name, "b");
  EXPECT_EQ(f->tensors()[1].NumElements(), 3);
  EXPECT_EQ(f->metadata().at("format"), "pt");
  const int64_t w_shape[] = {2, 1}, b_shape[] = {3};
  EXPECT_EQ(*f->ReadFloat32("w", w_shape), (std::vector<float>{1.5f, -2.0f}));
  // BF16 0x3f80 = 1, 0xc000 = -2, 0x0001 = the smallest BF16 subnormal 2^-133.
  EXPECT_EQ(*f->ReadFloat32("b", b_shape),
            (std::vector<float>{1.0f, -2.0f, std::ldexp(1.0f, -133)}));
  EXPECT_EQ(f->Find("missing"), nullptr);
}

TEST_F(SafetensorsTest, WriterBytesAreTheDefinitionsBytes) {
  const std::vector<float> w = {1.5f, -2.0f};
  const std::vector<uint16_t> b = {0x3f80, 0xc000, 0x0001};
  const SafetensorsWriteTensor tensors[] = {
      {.name = "w", .dtype = SafetensorsDtype::kF32, .shape = {2, 1}, .data = w.data()},
      {.name = "b", .dtype = SafetensorsDtype::kBF16, .shape = {3}, .data = b.data()}};
  const std::string path = Path("out.safetensors");
  ASSERT_TRUE(WriteSafetensors(path, tensors, {{"format", "pt"}}).ok());
  // kTwoTensors is 142 bytes: padded with 2 spaces to 144, a multiple of 8.
  std::string header = kTwoTensors;
  header.append((8 - header.size() % 8) % 8, ' ');
  ASSERT_EQ(header.size() % 8, 0u);
  const std::string want = File(header, F32Bytes(w) + U16Bytes(b));
  EXPECT_EQ(Slurp(path), want);
  // write -> read -> write: the same bytes.
  absl::StatusOr<SafetensorsFile> f = SafetensorsFile::Read(path);
  ASSERT_TRUE(f.ok()) << f.status();
  std::vector<SafetensorsWriteTensor> again;
  for (const SafetensorsTensor& t : f->tensors()) {
    again.push_back({.name = t.name, .dtype = t.dtype, .shape = t.shape, .data = t.data.data()});
  }
  const std::string path2 = Path("again.safetensors");
  ASSERT_TRUE(WriteSafetensors(path2, again, f->metadata()).ok());
  EXPECT_EQ(Slurp(path2), want);
  EXPECT_FALSE(fs::exists(path + ".tmp." + std::to_string(::getpid())));
}

TEST_F(SafetensorsTest, HalfPrecisionWidensExactly) {
  // F16: 0x3c00 = 1, 0x0001 = 2^-24 (subnormal), 0x7c00 = +Inf, 0x8000 = -0, 0x7bff = 65504.
  const std::string header = R"({"h":{"dtype":"F16","shape":[5],"data_offsets":[0,10]}})";
  absl::StatusOr<SafetensorsFile> f =
      ParseText(File(header, U16Bytes({0x3c00, 0x0001, 0x7c00, 0x8000, 0x7bff})));
  ASSERT_TRUE(f.ok()) << f.status();
  const int64_t shape[] = {5};
  const std::vector<float> v = *f->ReadFloat32("h", shape);
  EXPECT_EQ(v[0], 1.0f);
  EXPECT_EQ(v[1], std::ldexp(1.0f, -24));
  EXPECT_TRUE(std::isinf(v[2]) && v[2] > 0);
  EXPECT_EQ(std::bit_cast<uint32_t>(v[3]), 0x80000000u);
  EXPECT_EQ(v[4], 65504.0f);
  // Shape and dtype mismatches name the tensor.
  const int64_t wrong[] = {4};
  EXPECT_THAT(std::string(f->ReadFloat32("h", wrong).status().message()),
              AllOf(HasSubstr("model.safetensors"), HasSubstr("'h' has shape [5], expected [4]")));
  EXPECT_THAT(std::string(f->ReadFloat32("x", shape).status().message()),
              HasSubstr("no tensor 'x'"));
  absl::StatusOr<SafetensorsFile> ints = ParseText(File(
      R"({"i":{"dtype":"I32","shape":[1],"data_offsets":[0,4]}})", std::string("\1\0\0\0", 4)));
  ASSERT_TRUE(ints.ok()) << ints.status();
  const int64_t one[] = {1};
  EXPECT_THAT(std::string(ints->ReadFloat32("i", one).status().message()), HasSubstr("'i' is I32"));
}

TEST_F(SafetensorsTest, MalformedFilesAreRefusedNamingTheProblem) {
  const std::string ok_entry = R"("w":{"dtype":"F32","shape":[2],"data_offsets":[0,8]})";
  const std::string eight(8, '\0');
  std::string huge = File("{}", "");
  huge[4] = '\x01';  // header size 2^32 + 2
  std::string past = File("{}", "");
  past[0] = '\x20';  // 32 bytes of header claimed, 2 there
  const std::string long_name(500, 'n');
  struct Case {
    std::string name, bytes;
    std::vector<std::string> want;
  };
  const std::vector<Case> cases = {
      {"short", "abc", {"3 bytes, shorter than the 8-byte header size"}},
      {"huge header", huge, {"header size 4294967298 is over the 100000000-byte limit"}},
      {"past the end", past, {"header size 32 runs past the end of the 10-byte file"}},
      {"not an object", File("[1,2]", ""), {"does not start with '{'"}},
      {"not json", File("{\"w\":", eight), {"not valid JSON"}},
      {"duplicate tensor",
       File("{" + ok_entry + "," + ok_entry + "}", eight),
       {"the key 'w' twice"}},
      {"duplicate field",
       File(R"({"w":{"dtype":"F32","dtype":"F32","shape":[2],"data_offsets":[0,8]}})", eight),
       {"the key 'dtype' twice"}},
      {"unknown dtype",
       File(R"({"w":{"dtype":"F4","shape":[2],"data_offsets":[0,8]}})", eight),
       {"tensor 'w': dtype 'F4' is not one fp8rt reads"}},
      {"missing field",
       File(R"({"w":{"dtype":"F32","shape":[2]}})", eight),
       {"tensor 'w': missing field 'data_offsets'"}},
      {"unknown field",
       File(R"({"w":{"dtype":"F32","shape":[2],"data_offsets":[0,8],"x":1}})", eight),
       {"tensor 'w': unknown field 'x'"}},
      {"negative dimension",
       File(R"({"w":{"dtype":"F32","shape":[-2],"data_offsets":[0,8]}})", eight),
       {"tensor 'w': shape[0] must be a non-negative integer, got '-2'"}},
      {"outside the buffer",
       File(R"({"w":{"dtype":"F32","shape":[2],"data_offsets":[0,16]}})", eight),
       {"tensor 'w': data_offsets [0, 16] are not inside the 8-byte buffer"}},
      {"size mismatch",
       File(R"({"w":{"dtype":"F32","shape":[3],"data_offsets":[0,8]}})", eight),
       {"tensor 'w'", "hold 8 bytes, but 3 F32 elements", "need 12"}},
      {"overlap",
       File(R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},)"
            R"("b":{"dtype":"F32","shape":[1],"data_offsets":[4,8]}})",
            eight),
       {"tensor 'b' data_offsets [4, 8] overlap tensor 'a'"}},
      {"gap",
       File(R"({"a":{"dtype":"F32","shape":[1],"data_offsets":[4,8]}})", eight),
       {"bytes [0, 4) of the buffer belong to no tensor"}},
      {"trailing",
       File("{" + ok_entry + "}", eight + "xx"),
       {"the tensors cover 8 bytes of the 10-byte buffer"}},
      {"metadata not strings",
       File(R"({"__metadata__":{"format":1}})", ""),
       {"__metadata__ 'format' must be a string"}},
      {"long name bounded",
       File("{\"" + long_name + R"(":{"dtype":"X","shape":[],"data_offsets":[0,0]}})", ""),
       {"'" + std::string(64, 'n') + "...' (500 bytes)"}},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.name);
    absl::StatusOr<SafetensorsFile> f = ParseText(c.bytes);
    ASSERT_FALSE(f.ok());
    EXPECT_EQ(f.status().code(), absl::StatusCode::kInvalidArgument);
    const std::string msg(f.status().message());
    EXPECT_THAT(msg, HasSubstr("model.safetensors: "));
    for (const std::string& w : c.want) EXPECT_THAT(msg, HasSubstr(w));
    EXPECT_LT(msg.size(), 400u) << "an error quotes a bounded prefix";
  }
  // Read (a mapped file) refuses the same way, naming the path: too short to map, and a header
  // that runs past the end.
  for (const auto& [name, bytes, want] :
       {std::tuple<std::string, std::string, std::string>{"empty", "", "the file is 0 bytes"},
        {"seven", "1234567", "the file is 7 bytes, shorter than the 8-byte header size"},
        {"past", past, "header size 32 runs past the end of the 10-byte file"}}) {
    SCOPED_TRACE(name);
    WriteBytes(Path(name + ".safetensors"), bytes);
    absl::StatusOr<SafetensorsFile> f = SafetensorsFile::Read(Path(name + ".safetensors"));
    ASSERT_FALSE(f.ok());
    EXPECT_EQ(f.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_THAT(std::string(f.status().message()),
                AllOf(HasSubstr(Path(name + ".safetensors") + ": "), HasSubstr(want)));
  }
  // A missing file is NotFound naming it.
  absl::StatusOr<SafetensorsFile> missing = SafetensorsFile::Read(Path("none.safetensors"));
  EXPECT_EQ(missing.status().code(), absl::StatusCode::kNotFound);
  EXPECT_THAT(std::string(missing.status().message()), HasSubstr("none.safetensors"));
}

// Hugging Face's sharded layout (transformers' save_pretrained: model.safetensors.index.json,
// {"metadata": {"total_size": ...}, "weight_map": {tensor: file}}, the shards beside it), written
// by hand here: a set of two shards reads as one, by the index, by its folder, and a folder with
// model.safetensors reads that file first (as transformers looks).
TEST_F(SafetensorsTest, IndexedShardsReadAsOneSet) {
  const fs::path sharded = dir_ / "sharded";
  fs::create_directories(sharded);
  WriteBytes(
      sharded / "model-00001-of-00002.safetensors",
      File(R"({"w":{"dtype":"F32","shape":[2,1],"data_offsets":[0,8]}})", F32Bytes({1.5f, -2.0f})));
  WriteBytes(sharded / "model-00002-of-00002.safetensors",
             File(R"({"b":{"dtype":"BF16","shape":[3],"data_offsets":[0,6]}})",
                  U16Bytes({0x3f80, 0xc000, 0x0001})));
  const std::string index = (sharded / "model.safetensors.index.json").string();
  WriteBytes(index, R"({"metadata": {"total_size": 14}, "weight_map": {)"
                    R"("w": "model-00001-of-00002.safetensors", )"
                    R"("b": "model-00002-of-00002.safetensors"}})"
                    "\n");
  const int64_t w_shape[] = {2, 1}, b_shape[] = {3};
  for (const std::string& path : {index, sharded.string()}) {
    SCOPED_TRACE(path);
    absl::StatusOr<SafetensorsSet> set = SafetensorsSet::Open(path);
    ASSERT_TRUE(set.ok()) << set.status();
    EXPECT_EQ(set->name(), index);
    ASSERT_EQ(set->files().size(), 2u);
    // Sorted names: "b" first, so its shard is the first file.
    EXPECT_THAT(set->files()[0].name(), HasSubstr("model-00002-of-00002.safetensors"));
    EXPECT_EQ(*set->ReadFloat32("w", w_shape), (std::vector<float>{1.5f, -2.0f}));
    EXPECT_EQ(*set->ReadFloat32("b", b_shape),
              (std::vector<float>{1.0f, -2.0f, std::ldexp(1.0f, -133)}));
    ASSERT_NE(set->Find("b"), nullptr);
    EXPECT_EQ(set->Find("b")->dtype, SafetensorsDtype::kBF16);
    EXPECT_EQ(set->Find("missing"), nullptr);
    const absl::Status none = set->ReadFloat32("missing", b_shape).status();
    EXPECT_EQ(none.code(), absl::StatusCode::kInvalidArgument);
    EXPECT_THAT(std::string(none.message()), HasSubstr(index + ": no tensor 'missing'"));
    // A shape error names the shard that holds the tensor.
    EXPECT_THAT(std::string(set->ReadFloat32("w", b_shape).status().message()),
                HasSubstr("model-00001-of-00002.safetensors: tensor 'w' has shape [2, 1]"));
  }
  // Beside an index, model.safetensors is read first; a single file opens as a set of one.
  WriteBytes(sharded / "model.safetensors",
             File(kTwoTensors, F32Bytes({1.5f, -2.0f}) + U16Bytes({0x3f80, 0xc000, 1})));
  absl::StatusOr<SafetensorsSet> single = SafetensorsSet::Open(sharded.string());
  ASSERT_TRUE(single.ok()) << single.status();
  EXPECT_EQ(single->files().size(), 1u);
  EXPECT_EQ(single->name(), (sharded / "model.safetensors").string());
  EXPECT_EQ(*single->ReadFloat32("w", w_shape), (std::vector<float>{1.5f, -2.0f}));
  // A folder with neither is NotFound naming it and both names.
  const fs::path empty = dir_ / "empty";
  fs::create_directories(empty);
  const absl::Status e = SafetensorsSet::Open(empty.string()).status();
  EXPECT_EQ(e.code(), absl::StatusCode::kNotFound);
  EXPECT_THAT(std::string(e.message()),
              AllOf(HasSubstr(empty.string()), HasSubstr("model.safetensors.index.json")));
}

// Every malformed index or set of shards is refused before any tensor is used, naming the index
// (or the shard at fault) and the tensor or field, with a bounded quote.
TEST_F(SafetensorsTest, BadIndexesAreRefusedNamingTheIndexOrShard) {
  const std::string w_file =
      File(R"({"w":{"dtype":"F32","shape":[1],"data_offsets":[0,4]}})", F32Bytes({1.0f}));
  const std::string wb_file = File(R"({"w":{"dtype":"F32","shape":[1],"data_offsets":[0,4]},)"
                                   R"("b":{"dtype":"F32","shape":[1],"data_offsets":[4,8]}})",
                                   F32Bytes({1.0f, 2.0f}));
  WriteBytes(dir_ / "w.safetensors", w_file);
  WriteBytes(dir_ / "wb.safetensors", wb_file);
  WriteBytes(dir_ / "broken.safetensors", "abc");
  const std::string long_name(1000, 'n');
  struct Case {
    std::string name, index;
    std::vector<std::string> want;
    std::string at = "";  // the path the message starts with (empty: the index's)
    absl::StatusCode code = absl::StatusCode::kInvalidArgument;
  };
  const std::vector<Case> cases = {
      {"not an object", "[1]", {"the index does not start with '{'"}},
      {"not json", R"({"weight_map":)", {"the index is not valid JSON"}},
      {"duplicate key",
       R"({"weight_map":{"w":"w.safetensors","w":"wb.safetensors"}})",
       {"the index has the key 'w' twice"}},
      {"metadata not an object",
       R"({"metadata":[],"weight_map":{"w":"w.safetensors"}})",
       {"metadata must be an object, got '[]'"}},
      {"no weight_map", R"({"metadata":{}})", {"the index has no weight_map"}},
      {"empty weight_map", R"({"weight_map":{}})", {"weight_map must be a non-empty object"}},
      {"file name not a string",
       R"({"weight_map":{"w":3}})",
       {"weight_map 'w': the file name must be a string, got '3'"}},
      {"file name with ..",
       R"({"weight_map":{"w":"../w.safetensors"}})",
       {"weight_map 'w': '../w.safetensors' is not the name of a file beside the index"}},
      {"file name in a folder",
       R"({"weight_map":{"w":"sub/w.safetensors"}})",
       {"'sub/w.safetensors' is not the name of a file beside the index"}},
      {"file name ..", R"({"weight_map":{"w":".."}})", {"'..' is not the name of a file"}},
      {"file name too long",
       "{\"weight_map\":{\"w\":\"" + std::string(256, 'f') + "\"}}",
       {"'" + std::string(64, 'f') + "...' (256 bytes) is not the name of a file"}},
      {"missing shard",
       R"({"weight_map":{"w":"absent.safetensors"}})",
       {"absent.safetensors: no such file (listed in ", "bad.index.json)"},
       (dir_ / "absent.safetensors").string(),
       absl::StatusCode::kNotFound},
      {"broken shard",
       R"({"weight_map":{"w":"broken.safetensors"}})",
       {"shorter than the 8-byte header size"},
       (dir_ / "broken.safetensors").string()},
      {"tensor not in its shard",
       R"({"weight_map":{"w":"w.safetensors","x":"w.safetensors"}})",
       {"weight_map puts tensor 'x' in 'w.safetensors', which has no tensor of that name"}},
      {"tensor not listed",
       R"({"weight_map":{"w":"wb.safetensors"}})",
       {"tensor 'b' is not in the weight_map of", "bad.index.json"},
       (dir_ / "wb.safetensors").string()},
      {"tensor in two shards",
       R"({"weight_map":{"w":"w.safetensors","b":"wb.safetensors"}})",
       {"tensor 'w' is also here, but the weight_map of", "puts it in",
        (dir_ / "w.safetensors").string()},
       (dir_ / "wb.safetensors").string()},
      {"long name bounded",
       "{\"weight_map\":{\"" + long_name + "\":\"/\"}}",
       {"'" + std::string(64, 'n') + "...' (1000 bytes)"}},
  };
  const std::string path = Path("bad.index.json");
  for (const Case& c : cases) {
    SCOPED_TRACE(c.name);
    WriteBytes(path, c.index);
    absl::StatusOr<SafetensorsSet> set = SafetensorsSet::Open(path);
    ASSERT_FALSE(set.ok());
    EXPECT_EQ(set.status().code(), c.code) << set.status();
    const std::string msg(set.status().message());
    EXPECT_EQ(msg.rfind((c.at.empty() ? path : c.at) + ": ", 0), 0u)
        << "the message starts with the path at fault";
    for (const std::string& w : c.want) EXPECT_THAT(msg, HasSubstr(w));
    EXPECT_LT(msg.size(), 600u) << "an error quotes a bounded prefix";
  }
}

// JSON nested past 64 levels, in a header or an index, is refused naming the file before anything
// walks it (the recursive code that prints or copies a value would overflow the stack on the
// half a million levels a megabyte of '[' holds).
TEST_F(SafetensorsTest, DeeplyNestedJsonIsRefused) {
  const std::string deep = std::string(100000, '[') + std::string(100000, ']');
  absl::StatusOr<SafetensorsFile> f = ParseText(File(R"({"__metadata__":)" + deep + "}", ""));
  EXPECT_THAT(std::string(f.status().message()),
              AllOf(HasSubstr("model.safetensors: the header nests arrays and objects deeper "
                              "than 64 levels")));
  EXPECT_THAT(
      std::string(
          ParseSafetensorsIndex(R"({"weight_map":)" + deep + "}", "i.json").status().message()),
      HasSubstr("i.json: the index nests arrays and objects deeper than 64 levels"));
  // 64 levels are read (and then refused for what they are, not for their depth).
  const std::string ok_depth = std::string(63, '[') + std::string(63, ']');
  f = ParseText(File(R"({"__metadata__":)" + ok_depth + "}", ""));
  EXPECT_THAT(std::string(f.status().message()),
              AllOf(HasSubstr("__metadata__ must be an object"), Not(HasSubstr("deeper"))));
}

TEST_F(SafetensorsTest, EmptyAndScalarTensorsAreValid) {
  const std::string header = R"({"e":{"dtype":"F32","shape":[0,4],"data_offsets":[0,0]},)"
                             R"("s":{"dtype":"F32","shape":[],"data_offsets":[0,4]}})";
  absl::StatusOr<SafetensorsFile> f = ParseText(File(header, F32Bytes({7.0f})));
  ASSERT_TRUE(f.ok()) << f.status();
  const int64_t empty_shape[] = {0, 4};
  EXPECT_TRUE(f->ReadFloat32("e", empty_shape)->empty());
  EXPECT_EQ(*f->ReadFloat32("s", {}), std::vector<float>{7.0f});
}

// Where mmap is refused, Read reads the file instead: the same tensors and values, the same
// errors for a bad file (naming it), and the interposed mmap was asked (so the path ran).
TEST_F(SafetensorsTest, FilesThatCannotBeMappedAreRead) {
  const std::string buffer = F32Bytes({1.5f, -2.0f}) + U16Bytes({0x3f80, 0xc000, 0x0001});
  WriteBytes(Path("m.safetensors"), File(kTwoTensors, buffer));
  WriteBytes(Path("bad.safetensors"), File(R"({"w":{"dtype":"F32","shape":[3],)"
                                           R"("data_offsets":[0,8]}})",
                                           F32Bytes({1.0f, 2.0f})));
  absl::StatusOr<SafetensorsFile> mapped = SafetensorsFile::Read(Path("m.safetensors"));
  ASSERT_TRUE(mapped.ok()) << mapped.status();
  const absl::StatusOr<SafetensorsFile> bad_mapped = SafetensorsFile::Read(Path("bad.safetensors"));
  EXPECT_EQ(g_refused_maps.load(), 0);

  g_refuse_file_maps = true;
  absl::StatusOr<SafetensorsFile> read = SafetensorsFile::Read(Path("m.safetensors"));
  absl::StatusOr<SafetensorsFile> bad = SafetensorsFile::Read(Path("bad.safetensors"));
  g_refuse_file_maps = false;
  EXPECT_EQ(g_refused_maps.load(), 2);  // both Reads asked to map and were refused
  ASSERT_TRUE(read.ok()) << read.status();
  const int64_t w_shape[] = {2, 1}, b_shape[] = {3};
  EXPECT_EQ(*read->ReadFloat32("w", w_shape), (std::vector<float>{1.5f, -2.0f}));
  EXPECT_EQ(*read->ReadFloat32("b", b_shape),
            (std::vector<float>{1.0f, -2.0f, std::ldexp(1.0f, -133)}));
  EXPECT_EQ(*read->ReadFloat32("w", w_shape), *mapped->ReadFloat32("w", w_shape));
  EXPECT_EQ(read->metadata(), mapped->metadata());
  ASSERT_FALSE(bad.ok());
  EXPECT_EQ(bad.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(bad.status().message()),
              AllOf(HasSubstr(Path("bad.safetensors")), HasSubstr("'w'")));
  EXPECT_EQ(bad.status(), bad_mapped.status());  // the same error either way
}

TEST_F(SafetensorsTest, BadWritesAreRefusedAndLeaveNoFile) {
  const float x = 1.0f;
  const std::string path = Path("bad.safetensors");
  const SafetensorsWriteTensor dup[] = {
      {.name = "w", .dtype = SafetensorsDtype::kF32, .shape = {1}, .data = &x},
      {.name = "w", .dtype = SafetensorsDtype::kF32, .shape = {1}, .data = &x}};
  EXPECT_THAT(std::string(WriteSafetensors(path, dup, {}).message()),
              AllOf(HasSubstr("tensor 'w'"), HasSubstr("used twice")));
  const SafetensorsWriteTensor null_data[] = {
      {.name = "w", .dtype = SafetensorsDtype::kF32, .shape = {2}, .data = nullptr}};
  EXPECT_THAT(std::string(WriteSafetensors(path, null_data, {}).message()),
              HasSubstr("data is null for 2 elements"));
  const SafetensorsWriteTensor reserved[] = {
      {.name = "__metadata__", .dtype = SafetensorsDtype::kF32, .shape = {1}, .data = &x}};
  EXPECT_FALSE(WriteSafetensors(path, reserved, {}).ok());
  EXPECT_FALSE(fs::exists(path));
  // Into a missing folder: the error names the path, and nothing is left.
  const std::string nowhere = Path("no/such/dir/x.safetensors");
  const SafetensorsWriteTensor one[] = {
      {.name = "w", .dtype = SafetensorsDtype::kF32, .shape = {1}, .data = &x}};
  const absl::Status s = WriteSafetensors(nowhere, one, {});
  EXPECT_THAT(std::string(s.message()), AllOf(HasSubstr(nowhere), HasSubstr("cannot create")));
  EXPECT_THAT(std::string(s.message()), Not(HasSubstr("\n")));
}

}  // namespace
}  // namespace fp8rt
