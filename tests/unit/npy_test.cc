// Tests of runtime/core/npy.h against NumPy, the reference implementation:
//   - Fixtures written by NumPy (tests/data/npy/make_fixtures.py) read back with the values the
//     script's formulas give.
//   - WriteNpy output loaded by NumPy itself (skipped where python3 has no numpy).
//   - WriteNpy's byte layout checked against the .npy format specification.
//   - Malformed inputs built byte by byte: each is an error naming the file and the problem, and
//     no truncation or single-byte corruption of a valid file crashes the reader.
#include "runtime/core/npy.h"

#include <sys/stat.h>
#include <unistd.h>

#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace fp8rt {
namespace {

using ::testing::ElementsAre;
using ::testing::ElementsAreArray;
using ::testing::HasSubstr;
using ::testing::IsEmpty;
using ::testing::StartsWith;

namespace fs = std::filesystem;

// Fixtures live in the source tree; ctest runs the binary of this same checkout.
std::string Fixture(const std::string& name) {
  return (fs::path(__FILE__).parent_path() / ".." / "data" / "npy" / name).lexically_normal();
}

// The array's little-endian elements as T.
template <typename T>
std::vector<T> Values(const NpyArray& a) {
  std::vector<T> out(a.data.size() / sizeof(T));
  if (!out.empty()) std::memcpy(out.data(), a.data.data(), out.size() * sizeof(T));
  return out;
}

// Asserts that `status` has `code`, starts with "<name>: " and contains `word`.
void ExpectError(const absl::Status& status, absl::StatusCode code, const std::string& name,
                 const std::string& word) {
  EXPECT_EQ(status.code(), code) << status;
  EXPECT_THAT(std::string(status.message()), StartsWith(name + ": "));
  EXPECT_THAT(std::string(status.message()), HasSubstr(word));
}

// A fresh directory under the test temp dir, removed at the end of the test.
class TempDir {
 public:
  TempDir() {
    std::string tmpl = ::testing::TempDir() + "npy_test.XXXXXX";
    char* made = ::mkdtemp(tmpl.data());
    EXPECT_NE(made, nullptr);
    path_ = tmpl;
  }
  ~TempDir() {
    std::error_code ec;
    fs::remove_all(path_, ec);
  }
  std::string File(const std::string& name) const { return (path_ / name).string(); }
  const fs::path& path() const { return path_; }

 private:
  fs::path path_;
};

// ---------------------------------------------------------------------------------------------
// Building .npy bytes by hand.

std::vector<std::byte> Bytes(std::string_view s) {
  std::vector<std::byte> out(s.size());
  std::memcpy(out.data(), s.data(), s.size());
  return out;
}

// A .npy file with the given version, header dict text (padded with spaces and '\n' to a
// multiple of 64 bytes unless `pad` is false) and raw data.
std::vector<std::byte> MakeNpy(const std::string& dict, const std::string& data, int major = 1,
                               bool pad = true) {
  const size_t preamble = major == 1 ? 10 : 12;
  std::string header = dict;
  if (pad) {
    while ((preamble + header.size() + 1) % 64 != 0) header += ' ';
    header += '\n';
  }
  std::string out = "\x93NUMPY";
  out += static_cast<char>(major);
  out += '\0';
  const uint32_t len = static_cast<uint32_t>(header.size());
  for (size_t i = 0; i < preamble - 8; ++i) out += static_cast<char>((len >> (8 * i)) & 0xff);
  return Bytes(out + header + data);
}

std::string FloatBytes(std::initializer_list<float> values) {
  std::string out(values.size() * sizeof(float), '\0');
  std::memcpy(out.data(), std::data(values), out.size());
  return out;
}

constexpr char kDict23[] = "{'descr': '<f4', 'fortran_order': False, 'shape': (2, 3), }";

std::string Data23() { return FloatBytes({1, 2, 3, 4, 5, 6}); }

// ---------------------------------------------------------------------------------------------
// NumPy-written fixtures (formulas from make_fixtures.py).

TEST(NpyFixtureTest, Float32Matrix) {
  auto a = ReadNpy(Fixture("f32_2d.npy"));
  ASSERT_TRUE(a.ok()) << a.status();
  EXPECT_EQ(a->dtype, NpyDtype::kF32);
  EXPECT_THAT(a->shape, ElementsAre(3, 4));
  EXPECT_EQ(a->NumElements(), 12);
  std::vector<float> expected;
  for (int i = 0; i < 12; ++i) expected.push_back(static_cast<float>(i) * 0.5f - 1.0f);
  EXPECT_THAT(Values<float>(*a), ElementsAreArray(expected));
}

TEST(NpyFixtureTest, Float64Vector) {
  auto a = ReadNpy(Fixture("f64_1d.npy"));
  ASSERT_TRUE(a.ok()) << a.status();
  EXPECT_EQ(a->dtype, NpyDtype::kF64);
  EXPECT_THAT(a->shape, ElementsAre(5));
  std::vector<double> expected;
  for (int i = 0; i < 5; ++i) expected.push_back(i / 3.0);  // both sides round correctly
  EXPECT_THAT(Values<double>(*a), ElementsAreArray(expected));
}

TEST(NpyFixtureTest, Uint8Matrix) {
  auto a = ReadNpy(Fixture("u8_2d.npy"));
  ASSERT_TRUE(a.ok()) << a.status();
  EXPECT_EQ(a->dtype, NpyDtype::kU8);
  EXPECT_THAT(a->shape, ElementsAre(2, 3));
  EXPECT_THAT(Values<uint8_t>(*a), ElementsAre(0, 40, 80, 120, 160, 200));
}

TEST(NpyFixtureTest, Uint16AndUint32AndInt32Vectors) {
  auto u16 = ReadNpy(Fixture("u16_1d.npy"));
  ASSERT_TRUE(u16.ok()) << u16.status();
  EXPECT_EQ(u16->dtype, NpyDtype::kU16);
  EXPECT_THAT(Values<uint16_t>(*u16), ElementsAre(7, 1007, 2007, 65535));

  auto u32 = ReadNpy(Fixture("u32_1d.npy"));
  ASSERT_TRUE(u32.ok()) << u32.status();
  EXPECT_EQ(u32->dtype, NpyDtype::kU32);
  EXPECT_THAT(Values<uint32_t>(*u32), ElementsAre(0u, 1u, 70000u, 4294967295u));

  auto i32 = ReadNpy(Fixture("i32_1d.npy"));
  ASSERT_TRUE(i32.ok()) << i32.status();
  EXPECT_EQ(i32->dtype, NpyDtype::kI32);
  EXPECT_THAT(i32->shape, ElementsAre(6));
  EXPECT_THAT(Values<int32_t>(*i32), ElementsAre(-300000, -200000, -100000, 0, 100000, 200000));
}

TEST(NpyFixtureTest, Int64Scalar) {
  auto a = ReadNpy(Fixture("i64_scalar.npy"));
  ASSERT_TRUE(a.ok()) << a.status();
  EXPECT_EQ(a->dtype, NpyDtype::kI64);
  EXPECT_THAT(a->shape, IsEmpty());
  EXPECT_EQ(a->NumElements(), 1);
  EXPECT_THAT(Values<int64_t>(*a), ElementsAre(-1234567890123));
}

TEST(NpyFixtureTest, Version2And3) {
  auto v2 = ReadNpy(Fixture("v2_f32.npy"));
  ASSERT_TRUE(v2.ok()) << v2.status();
  EXPECT_THAT(v2->shape, ElementsAre(2, 3));
  EXPECT_THAT(Values<float>(*v2), ElementsAre(0.25f, 1.25f, 2.25f, 3.25f, 4.25f, 5.25f));

  auto v3 = ReadNpy(Fixture("v3_f64.npy"));
  ASSERT_TRUE(v3.ok()) << v3.status();
  EXPECT_EQ(v3->dtype, NpyDtype::kF64);
  EXPECT_THAT(Values<double>(*v3), ElementsAre(0.0, -1.5, -3.0, -4.5));
}

TEST(NpyFixtureTest, EmptyArrays) {
  auto a = ReadNpy(Fixture("f32_empty.npy"));
  ASSERT_TRUE(a.ok()) << a.status();
  EXPECT_THAT(a->shape, ElementsAre(0));
  EXPECT_EQ(a->NumElements(), 0);
  EXPECT_THAT(a->data, IsEmpty());

  auto m = ReadNpyAsFloatMatrix(Fixture("f32_empty.npy"));
  ASSERT_TRUE(m.ok()) << m.status();
  EXPECT_EQ(m->rows, 1);
  EXPECT_EQ(m->cols, 0);
  EXPECT_THAT(m->values, IsEmpty());

  auto m2 = ReadNpyAsFloatMatrix(Fixture("f32_empty_2d.npy"));
  ASSERT_TRUE(m2.ok()) << m2.status();
  EXPECT_EQ(m2->rows, 3);
  EXPECT_EQ(m2->cols, 0);
  EXPECT_THAT(m2->values, IsEmpty());
}

TEST(NpyFixtureTest, RejectsFortranOrder) {
  const std::string path = Fixture("f32_fortran.npy");
  ExpectError(ReadNpy(path).status(), absl::StatusCode::kInvalidArgument, path, "Fortran order");
}

TEST(NpyFixtureTest, RejectsBigEndian) {
  const std::string path = Fixture("f32_bigendian.npy");
  ExpectError(ReadNpy(path).status(), absl::StatusCode::kInvalidArgument, path, "big-endian");
  EXPECT_THAT(std::string(ReadNpy(path).status().message()), HasSubstr("'>f4'"));
}

TEST(NpyFixtureTest, RejectsComplexObjectAndStructuredDtypes) {
  const std::string c64 = Fixture("c64_1d.npy");
  ExpectError(ReadNpy(c64).status(), absl::StatusCode::kInvalidArgument, c64,
              "unsupported dtype '<c8'");
  const std::string obj = Fixture("object_1d.npy");
  ExpectError(ReadNpy(obj).status(), absl::StatusCode::kInvalidArgument, obj, "object arrays");
  const std::string rec = Fixture("struct_1d.npy");
  ExpectError(ReadNpy(rec).status(), absl::StatusCode::kInvalidArgument, rec, "structured");
}

TEST(NpyFixtureTest, ReadsEveryRankButMatrixRejectsRank3) {
  const std::string path = Fixture("f32_3d.npy");
  auto a = ReadNpy(path);
  ASSERT_TRUE(a.ok()) << a.status();
  EXPECT_THAT(a->shape, ElementsAre(2, 3, 4));
  EXPECT_EQ(Values<float>(*a)[23], 23.0f);

  ExpectError(ReadNpyAsFloatMatrix(path).status(), absl::StatusCode::kInvalidArgument, path,
              "expected a 1-D or 2-D array, got shape (2, 3, 4)");
}

// ---------------------------------------------------------------------------------------------
// ReadNpyAsFloatMatrix

TEST(NpyFloatMatrixTest, Float32MatrixKeepsLayout) {
  auto m = ReadNpyAsFloatMatrix(Fixture("f32_2d.npy"));
  ASSERT_TRUE(m.ok()) << m.status();
  EXPECT_EQ(m->rank, 2);
  EXPECT_EQ(m->rows, 3);
  EXPECT_EQ(m->cols, 4);
  ASSERT_EQ(m->values.size(), 12u);
  EXPECT_EQ(m->values[1 * 4 + 2], 6 * 0.5f - 1.0f);  // row 1, column 2 is element 6
}

TEST(NpyFloatMatrixTest, Float64VectorIsOneRowRoundedToNearest) {
  auto m = ReadNpyAsFloatMatrix(Fixture("f64_1d.npy"));
  ASSERT_TRUE(m.ok()) << m.status();
  EXPECT_EQ(m->rank, 1);
  EXPECT_EQ(m->rows, 1);
  EXPECT_EQ(m->cols, 5);
  std::vector<float> expected;
  for (int i = 0; i < 5; ++i) expected.push_back(static_cast<float>(i / 3.0));
  EXPECT_THAT(m->values, ElementsAreArray(expected));
  EXPECT_EQ(m->values[1], 0.333333343f);  // 1/3 rounded to the nearest float
}

TEST(NpyFloatMatrixTest, RejectsOtherDtypesAndScalars) {
  const std::string i32 = Fixture("i32_1d.npy");
  ExpectError(ReadNpyAsFloatMatrix(i32).status(), absl::StatusCode::kInvalidArgument, i32,
              "unsupported dtype int32 (expected float32 or float64)");
  const std::string u8 = Fixture("u8_2d.npy");
  ExpectError(ReadNpyAsFloatMatrix(u8).status(), absl::StatusCode::kInvalidArgument, u8, "uint8");

  TempDir dir;
  const std::string scalar = dir.File("scalar.npy");
  const float one = 1.0f;
  ASSERT_TRUE(WriteNpy(scalar, NpyDtype::kF32, {}, &one).ok());
  ExpectError(ReadNpyAsFloatMatrix(scalar).status(), absl::StatusCode::kInvalidArgument, scalar,
              "got shape ()");
}

TEST(NpyFloatMatrixTest, MissingFileIsNotFound) {
  const std::string path = "/nonexistent/dir/weights.npy";
  ExpectError(ReadNpyAsFloatMatrix(path).status(), absl::StatusCode::kNotFound, path,
              "cannot open");
}

// ---------------------------------------------------------------------------------------------
// ReadNpy file handling

TEST(NpyReadTest, MissingFileIsNotFound) {
  TempDir dir;
  const std::string path = dir.File("absent.npy");
  ExpectError(ReadNpy(path).status(), absl::StatusCode::kNotFound, path, "cannot open");
}

TEST(NpyReadTest, DirectoryIsNotFound) {
  TempDir dir;
  const std::string path = dir.path().string();
  ExpectError(ReadNpy(path).status(), absl::StatusCode::kNotFound, path, "not a regular file");
}

TEST(NpyReadTest, HugeDeclaredShapeInSmallFileIsRejectedWithoutAllocating) {
  // 4e12 bytes declared, 24 present: a reader that allocated first would die here.
  TempDir dir;
  const std::string path = dir.File("liar.npy");
  const auto bytes =
      MakeNpy("{'descr': '<f4', 'fortran_order': False, 'shape': (1000000000, 1000), }", Data23());
  std::ofstream(path, std::ios::binary)
      .write(reinterpret_cast<const char*>(bytes.data()),
             static_cast<std::streamsize>(bytes.size()));
  ExpectError(ReadNpy(path).status(), absl::StatusCode::kInvalidArgument, path,
              "truncated data: expected 4000000000000 bytes");
}

TEST(NpyReadTest, FileAndMemoryReadersAgreeOnEveryFixture) {
  for (const char* name :
       {"f32_2d.npy", "f64_1d.npy", "u8_2d.npy", "u16_1d.npy", "u32_1d.npy", "i32_1d.npy",
        "i64_scalar.npy", "v2_f32.npy", "v3_f64.npy", "f32_empty.npy", "f32_3d.npy"}) {
    SCOPED_TRACE(name);
    std::ifstream in(Fixture(name), std::ios::binary);
    const std::string raw((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
    ASSERT_FALSE(raw.empty());
    auto from_file = ReadNpy(Fixture(name));
    auto from_memory = ParseNpy(Bytes(raw), name);
    ASSERT_TRUE(from_file.ok()) << from_file.status();
    ASSERT_TRUE(from_memory.ok()) << from_memory.status();
    EXPECT_EQ(from_file->dtype, from_memory->dtype);
    EXPECT_EQ(from_file->shape, from_memory->shape);
    EXPECT_EQ(from_file->data, from_memory->data);
  }
}

// ---------------------------------------------------------------------------------------------
// ParseNpy: header syntax that NumPy (or another writer) may produce

TEST(NpyParseTest, KeysInAnyOrderWithOtherWhitespaceAndQuotes) {
  auto a = ParseNpy(
      MakeNpy("{ \"shape\" :(2,3) ,\t'fortran_order':False,'descr'  :  \"<f4\"}", Data23()), "mem");
  ASSERT_TRUE(a.ok()) << a.status();
  EXPECT_EQ(a->dtype, NpyDtype::kF32);
  EXPECT_THAT(a->shape, ElementsAre(2, 3));
  EXPECT_THAT(Values<float>(*a), ElementsAre(1, 2, 3, 4, 5, 6));
}

TEST(NpyParseTest, OneDimensionalShapeNeedsNoTrailingSpaceAndAcceptsPython2Longs) {
  auto a = ParseNpy(MakeNpy("{'descr': '<f4', 'fortran_order': False, 'shape': (6L,), }", Data23()),
                    "mem");
  ASSERT_TRUE(a.ok()) << a.status();
  EXPECT_THAT(a->shape, ElementsAre(6));
}

TEST(NpyParseTest, UnpaddedHeaderAndVersion2And3Preambles) {
  auto unpadded = ParseNpy(MakeNpy(kDict23, Data23(), 1, /*pad=*/false), "mem");
  ASSERT_TRUE(unpadded.ok()) << unpadded.status();
  EXPECT_THAT(unpadded->shape, ElementsAre(2, 3));
  for (int major : {2, 3}) {
    auto a = ParseNpy(MakeNpy(kDict23, Data23(), major), "mem");
    ASSERT_TRUE(a.ok()) << "version " << major << ": " << a.status();
    EXPECT_THAT(Values<float>(*a), ElementsAre(1, 2, 3, 4, 5, 6));
  }
}

// ---------------------------------------------------------------------------------------------
// ParseNpy: malformed input. Each error is InvalidArgument, starts with the name and says what.

void ExpectParseError(const std::vector<std::byte>& bytes, const std::string& word) {
  ExpectError(ParseNpy(bytes, "bad.npy").status(), absl::StatusCode::kInvalidArgument, "bad.npy",
              word);
}

TEST(NpyMalformedTest, BadMagic) {
  auto bytes = MakeNpy(kDict23, Data23());
  bytes[5] = std::byte{'X'};  // "\x93NUMPX"
  ExpectParseError(bytes, "bad magic");
  ExpectParseError(Bytes("PK\x03\x04 this is a zip file"), "bad magic");
}

TEST(NpyMalformedTest, TruncatedPreamble) {
  ExpectParseError({}, "truncated header");
  ExpectParseError(Bytes("\x93NUM"), "truncated header");
  ExpectParseError(Bytes(std::string("\x93NUMPY\x01\x00\x46", 9)), "truncated header");
  ExpectParseError(Bytes(std::string("\x93NUMPY\x02\x00\x46\x00", 10)), "truncated header");
}

TEST(NpyMalformedTest, UnsupportedVersion) {
  auto bytes = MakeNpy(kDict23, Data23());
  bytes[6] = std::byte{9};
  ExpectParseError(bytes, "unsupported .npy format version 9.0");
  bytes[6] = std::byte{1};
  bytes[7] = std::byte{1};
  ExpectParseError(bytes, "version 1.1");
}

TEST(NpyMalformedTest, HeaderLengthPastTheEnd) {
  auto bytes = MakeNpy(kDict23, "");
  bytes[8] = std::byte{0xff};
  bytes[9] = std::byte{0x7f};
  ExpectParseError(bytes, "truncated header: header length 32767 runs past the end");
  auto v2 = MakeNpy(kDict23, "", 2);
  v2[11] = std::byte{0xff};  // ~4 GiB header declared
  ExpectParseError(v2, "truncated header");
}

TEST(NpyMalformedTest, TruncatedHeaderText) {
  // The declared header length is honoured, so a cut-off dict is malformed, not read past.
  const std::string dict = kDict23;
  ExpectParseError(MakeNpy(dict.substr(0, 30), "", 1, /*pad=*/false), "malformed header");
}

TEST(NpyMalformedTest, TruncatedData) {
  auto bytes = MakeNpy(kDict23, Data23());
  bytes.resize(bytes.size() - 4);
  ExpectParseError(bytes, "truncated data: expected 24 bytes");
  EXPECT_THAT(std::string(ParseNpy(bytes, "bad.npy").status().message()), HasSubstr("found 20"));
}

TEST(NpyMalformedTest, TrailingBytes) {
  auto bytes = MakeNpy(kDict23, Data23() + "junk");
  ExpectParseError(bytes, "trailing bytes");
  EXPECT_THAT(std::string(ParseNpy(bytes, "bad.npy").status().message()), HasSubstr("found 28"));
}

TEST(NpyMalformedTest, ElementCountOverflow) {
  ExpectParseError(
      MakeNpy("{'descr': '<f4', 'fortran_order': False, 'shape': (99999999999, 99999999999), }",
              ""),
      "overflow");
  // The element count fits in int64 but the byte count does not.
  ExpectParseError(
      MakeNpy("{'descr': '<f8', 'fortran_order': False, 'shape': (4611686018427387904,), }", ""),
      "overflow");
  ExpectParseError(
      MakeNpy("{'descr': '<f4', 'fortran_order': False, 'shape': (99999999999999999999,), }", ""),
      "too large");
}

TEST(NpyMalformedTest, NegativeDimension) {
  ExpectParseError(MakeNpy("{'descr': '<f4', 'fortran_order': False, 'shape': (2, -3), }", ""),
                   "negative dimension -3");
}

TEST(NpyMalformedTest, UnsupportedDtypes) {
  ExpectParseError(MakeNpy("{'descr': '<c8', 'fortran_order': False, 'shape': (1,), }", "12345678"),
                   "unsupported dtype '<c8'");
  ExpectParseError(MakeNpy("{'descr': '>f8', 'fortran_order': False, 'shape': (1,), }", "12345678"),
                   "big-endian");
  ExpectParseError(MakeNpy("{'descr': '|O', 'fortran_order': False, 'shape': (1,), }", "12345678"),
                   "object");
  ExpectParseError(MakeNpy("{'descr': '|i1', 'fortran_order': False, 'shape': (1,), }", "1"),
                   "unsupported dtype '|i1'");
  ExpectParseError(MakeNpy("{'descr': 4, 'fortran_order': False, 'shape': (1,), }", "1"),
                   "'descr' is not a string");
}

TEST(NpyMalformedTest, FortranOrder) {
  ExpectParseError(MakeNpy("{'descr': '<f4', 'fortran_order': True, 'shape': (2, 3), }", Data23()),
                   "Fortran order");
  ExpectParseError(MakeNpy("{'descr': '<f4', 'fortran_order': 0, 'shape': (2, 3), }", Data23()),
                   "'fortran_order' is not True or False");
}

TEST(NpyMalformedTest, MissingUnexpectedAndDuplicateKeys) {
  ExpectParseError(MakeNpy("{'descr': '<f4', 'fortran_order': False}", Data23()),
                   "missing key 'shape'");
  ExpectParseError(MakeNpy("{'fortran_order': False, 'shape': (2, 3)}", Data23()),
                   "missing key 'descr'");
  ExpectParseError(
      MakeNpy("{'descr': '<f4', 'fortran_order': False, 'shape': (2, 3), 'x': 1}", Data23()),
      "unexpected key 'x'");
  ExpectParseError(
      MakeNpy("{'descr': '<f4', 'descr': '<f4', 'fortran_order': False, 'shape': (2, 3)}",
              Data23()),
      "duplicate key 'descr'");
}

TEST(NpyMalformedTest, ShapeThatIsNotATupleOfIntegers) {
  // "(6)" is the integer 6 in Python, not a tuple; NumPy rejects it too.
  ExpectParseError(MakeNpy("{'descr': '<f4', 'fortran_order': False, 'shape': (6), }", Data23()),
                   "'shape' is not a tuple");
  ExpectParseError(MakeNpy("{'descr': '<f4', 'fortran_order': False, 'shape': [2, 3], }", Data23()),
                   "'shape' is not a tuple");
  ExpectParseError(
      MakeNpy("{'descr': '<f4', 'fortran_order': False, 'shape': (2, '3'), }", Data23()),
      "other than integers");
}

TEST(NpyMalformedTest, HeaderSyntaxErrors) {
  for (const char* dict : {
           "",
           "[1, 2]",
           "{'descr': '<f4' 'fortran_order': False, 'shape': (2, 3)}",  // missing comma
           "{'descr': '<f4, 'fortran_order': False, 'shape': (2, 3)}",  // unbalanced quote
           "{'descr': '<f4', 'fortran_order': Falsey, 'shape': (2, 3)}",
           "{'descr': '<f4', 'fortran_order': False, 'shape': (2, 3)",  // no closing brace
           "{'descr': '<f4', 'fortran_order': False, 'shape': (2, 3)} extra",
           "{'descr': '<f4', 'fortran_order': False, 'shape': ((((((((((2,),),),),),),),),),)}",
       }) {
    SCOPED_TRACE(dict);
    ExpectParseError(MakeNpy(dict, Data23()), "malformed header");
  }
}

TEST(NpyMalformedTest, NoTruncationOrByteFlipOfAValidFileCrashes) {
  const auto good = MakeNpy(kDict23, Data23());
  for (size_t n = 0; n < good.size(); ++n) {
    const std::vector<std::byte> cut(good.begin(), good.begin() + n);
    EXPECT_EQ(ParseNpy(cut, "cut.npy").status().code(), absl::StatusCode::kInvalidArgument)
        << "length " << n;
  }
  // Flipping header bytes must never crash; it may still parse (e.g. a changed padding space).
  int rejected = 0;
  for (size_t i = 0; i < good.size() - 24; ++i) {
    for (uint8_t flip : {0x01, 0x20, 0x80, 0xff}) {
      auto bad = good;
      bad[i] ^= std::byte{flip};
      auto a = ParseNpy(bad, "flip.npy");
      if (!a.ok()) {
        ++rejected;
        EXPECT_THAT(std::string(a.status().message()), StartsWith("flip.npy: "));
      } else {
        EXPECT_EQ(static_cast<size_t>(a->NumElements()) * NpyDtypeSize(a->dtype), a->data.size());
      }
    }
  }
  EXPECT_GT(rejected, 0);
}

// ---------------------------------------------------------------------------------------------
// WriteNpy

TEST(NpyWriteTest, LayoutFollowsTheVersion1Spec) {
  TempDir dir;
  const std::string path = dir.File("out.npy");
  const std::vector<float> values = {1, 2, 3, 4, 5, 6};
  const int64_t shape[] = {2, 3};
  ASSERT_TRUE(WriteNpy(path, NpyDtype::kF32, shape, values.data()).ok());

  std::ifstream in(path, std::ios::binary);
  const std::string raw((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  ASSERT_GT(raw.size(), 10u);
  EXPECT_EQ(raw.substr(0, 8), std::string("\x93NUMPY\x01\x00", 8));
  const size_t header_len =
      static_cast<uint8_t>(raw[8]) | static_cast<size_t>(static_cast<uint8_t>(raw[9])) << 8;
  const size_t data_offset = 10 + header_len;
  EXPECT_EQ(data_offset % 64, 0u);
  ASSERT_EQ(raw.size(), data_offset + 24);
  const std::string header = raw.substr(10, header_len);
  EXPECT_THAT(header, StartsWith("{'descr': '<f4', 'fortran_order': False, 'shape': (2, 3), }"));
  EXPECT_EQ(header.back(), '\n');
  EXPECT_EQ(header.find_first_not_of(' ', header.find('}') + 1), header.size() - 1);
  EXPECT_EQ(std::memcmp(raw.data() + data_offset, values.data(), 24), 0);
  // No temporary file is left behind.
  EXPECT_EQ(std::distance(fs::directory_iterator(dir.path()), fs::directory_iterator()), 1);
}

TEST(NpyWriteTest, RoundTripsEveryDtypeAndRank) {
  TempDir dir;
  const std::vector<uint8_t> u8 = {0, 1, 254, 255};
  const std::vector<uint16_t> u16 = {0, 65535, 258};
  const std::vector<uint32_t> u32 = {4294967295u, 16909060u};
  const std::vector<int32_t> i32 = {-2147483647 - 1, 2147483647};
  const std::vector<int64_t> i64 = {-(int64_t{1} << 62)};
  const std::vector<double> f64 = {0.1, -2.5, 1e300, 5e-324, -0.0, 7};
  struct Case {
    NpyDtype dtype;
    std::vector<int64_t> shape;
    const void* data;
    size_t bytes;
  };
  const Case cases[] = {
      {NpyDtype::kU8, {2, 2}, u8.data(), 4},   {NpyDtype::kU16, {3}, u16.data(), 6},
      {NpyDtype::kU32, {1, 2}, u32.data(), 8}, {NpyDtype::kI32, {2}, i32.data(), 8},
      {NpyDtype::kI64, {}, i64.data(), 8},     {NpyDtype::kF64, {1, 2, 3}, f64.data(), 48},
      {NpyDtype::kF32, {4, 0}, nullptr, 0},
  };
  for (const Case& c : cases) {
    const std::string path = dir.File("rt.npy");
    ASSERT_TRUE(WriteNpy(path, c.dtype, c.shape, c.data).ok());
    auto a = ReadNpy(path);
    ASSERT_TRUE(a.ok()) << a.status();
    EXPECT_EQ(a->dtype, c.dtype);
    EXPECT_EQ(a->shape, c.shape);
    ASSERT_EQ(a->data.size(), c.bytes);
    if (c.bytes > 0) {
      EXPECT_EQ(std::memcmp(a->data.data(), c.data, c.bytes), 0);
    }
  }
}

TEST(NpyWriteTest, OverwritesAnExistingFile) {
  TempDir dir;
  const std::string path = dir.File("w.npy");
  const float first[] = {1, 2, 3}, second[] = {9};
  const int64_t three[] = {3}, one[] = {1};
  ASSERT_TRUE(WriteNpy(path, NpyDtype::kF32, three, first).ok());
  ASSERT_TRUE(WriteNpy(path, NpyDtype::kF32, one, second).ok());
  auto m = ReadNpyAsFloatMatrix(path);
  ASSERT_TRUE(m.ok()) << m.status();
  EXPECT_THAT(m->values, ElementsAre(9.0f));
}

TEST(NpyWriteTest, RejectsBadArgumentsNamingThePath) {
  TempDir dir;
  const std::string path = dir.File("bad.npy");
  const float v[] = {1};
  const int64_t negative[] = {2, -1};
  ExpectError(WriteNpy(path, NpyDtype::kF32, negative, v), absl::StatusCode::kInvalidArgument, path,
              "negative dimension");
  const int64_t huge[] = {int64_t{1} << 40, int64_t{1} << 40};
  ExpectError(WriteNpy(path, NpyDtype::kF32, huge, v), absl::StatusCode::kInvalidArgument, path,
              "overflow");
  const int64_t two[] = {2};
  ExpectError(WriteNpy(path, NpyDtype::kF32, two, nullptr), absl::StatusCode::kInvalidArgument,
              path, "null");
  EXPECT_FALSE(fs::exists(path));
}

TEST(NpyWriteTest, FailureLeavesNoFiles) {
  TempDir dir;
  const float v[] = {1};
  const int64_t one[] = {1};

  const std::string in_missing_dir = dir.File("no/such/dir/x.npy");
  ExpectError(WriteNpy(in_missing_dir, NpyDtype::kF32, one, v), absl::StatusCode::kNotFound,
              in_missing_dir, "cannot create");

  // Renaming a file over a non-empty directory fails after the data was written.
  const std::string onto_dir = dir.File("occupied");
  fs::create_directories(fs::path(onto_dir) / "child");
  const absl::Status status = WriteNpy(onto_dir, NpyDtype::kF32, one, v);
  EXPECT_FALSE(status.ok());
  EXPECT_THAT(std::string(status.message()), StartsWith(onto_dir + ": "));
  EXPECT_THAT(std::string(status.message()), HasSubstr("renaming"));
  for (const auto& entry : fs::directory_iterator(dir.path())) {
    EXPECT_EQ(entry.path().filename().string().find(".tmp."), std::string::npos)
        << "left behind: " << entry.path();
  }
}

// ---------------------------------------------------------------------------------------------
// WriteNpy output loaded by NumPy.

// A python3 that can import numpy, or "" if there is none. The one on PATH may be a virtualenv or
// pyenv build without numpy while the system's has it (Debian's python3-numpy).
std::string PythonWithNumpy() {
  for (const char* python : {"python3", "/usr/bin/python3"}) {
    const std::string cmd = absl::StrCat(python, " -c \"import numpy\" >/dev/null 2>&1");
    if (std::system(cmd.c_str()) == 0) return python;
  }
  return "";
}

TEST(NpyNumpyInteropTest, NumpyLoadsWhatWriteNpyWrites) {
  const std::string python = PythonWithNumpy();
  if (python.empty()) GTEST_SKIP() << "no python3 with numpy found; cannot cross-check with NumPy";

  TempDir dir;
  std::vector<float> f32(12);
  for (int i = 0; i < 12; ++i) f32[i] = static_cast<float>(i) * 0.5f - 1.0f;
  const int64_t f32_shape[] = {3, 4};
  ASSERT_TRUE(WriteNpy(dir.File("f32.npy"), NpyDtype::kF32, f32_shape, f32.data()).ok());
  std::vector<double> f64(5);
  for (int i = 0; i < 5; ++i) f64[i] = i / 3.0;
  const int64_t f64_shape[] = {5};
  ASSERT_TRUE(WriteNpy(dir.File("f64.npy"), NpyDtype::kF64, f64_shape, f64.data()).ok());
  const uint8_t u8[] = {0, 40, 80, 120, 160, 200};
  const int64_t u8_shape[] = {2, 3};
  ASSERT_TRUE(WriteNpy(dir.File("u8.npy"), NpyDtype::kU8, u8_shape, u8).ok());
  const uint16_t u16[] = {7, 1007, 2007, 65535};
  const int64_t u16_shape[] = {4};
  ASSERT_TRUE(WriteNpy(dir.File("u16.npy"), NpyDtype::kU16, u16_shape, u16).ok());
  const uint32_t u32[] = {0, 1, 70000, 4294967295u};
  const int64_t u32_shape[] = {2, 2};
  ASSERT_TRUE(WriteNpy(dir.File("u32.npy"), NpyDtype::kU32, u32_shape, u32).ok());
  const int32_t i32[] = {-300000, -200000, -100000, 0, 100000, 200000};
  const int64_t i32_shape[] = {1, 2, 3};
  ASSERT_TRUE(WriteNpy(dir.File("i32.npy"), NpyDtype::kI32, i32_shape, i32).ok());
  const int64_t i64 = -1234567890123;
  ASSERT_TRUE(WriteNpy(dir.File("i64.npy"), NpyDtype::kI64, {}, &i64).ok());
  const int64_t empty_shape[] = {3, 0};
  ASSERT_TRUE(WriteNpy(dir.File("empty.npy"), NpyDtype::kF32, empty_shape, nullptr).ok());

  // The expected arrays are stated independently, in NumPy terms; any mismatch exits nonzero.
  const std::string script = dir.File("check.py");
  std::ofstream(script) << R"py(import os, sys
import numpy as np
d = sys.argv[1]
expected = {
    "f32.npy": np.arange(12, dtype=np.float32).reshape(3, 4) * np.float32(0.5) - 1,
    "f64.npy": np.arange(5, dtype=np.float64) / 3,
    "u8.npy": (np.arange(6) * 40).astype(np.uint8).reshape(2, 3),
    "u16.npy": np.array([7, 1007, 2007, 65535], dtype=np.uint16),
    "u32.npy": np.array([[0, 1], [70000, 4294967295]], dtype=np.uint32),
    "i32.npy": (np.arange(-3, 3, dtype=np.int32) * 100000).reshape(1, 2, 3),
    "i64.npy": np.array(-1234567890123, dtype=np.int64),
    "empty.npy": np.zeros((3, 0), dtype=np.float32),
}
bad = 0
for name, want in expected.items():
    got = np.load(os.path.join(d, name), allow_pickle=False)
    if got.dtype != want.dtype or got.shape != want.shape or not np.array_equal(got, want):
        print("mismatch in", name, got.dtype, got.shape, got, file=sys.stderr)
        bad += 1
sys.exit(1 if bad else 0)
)py";
  const std::string cmd = absl::StrCat(python, " '", script, "' '", dir.path().string(), "'");
  EXPECT_EQ(std::system(cmd.c_str()), 0) << "NumPy disagreed with WriteNpy; see stderr";
}

}  // namespace
}  // namespace fp8rt
