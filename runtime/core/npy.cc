// .npy reading and writing. Index:
//   HeaderParser       - parses the header's Python dict literal (strings, ints, bools, tuples).
//   ParsePreamble      - magic, version and header length.
//   InterpretHeader    - the dict's 'descr', 'fortran_order' and 'shape' -> dtype, shape, size.
//   ParseNpy / ReadNpy - the two front ends; ReadNpy reads the data straight into the array.
//   ReadNpyAsFloatMatrix, WriteNpy.
//
// Every size a file declares is checked against the bytes actually there before anything is
// allocated, so a corrupt or hostile header costs nothing.
#include "runtime/core/npy.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <bit>
#include <cctype>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <limits>
#include <optional>
#include <system_error>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/string_view.h"
#include "runtime/core/check.h"
#include "runtime/core/file_io.h"
#include "runtime/core/status.h"

namespace fp8rt {
namespace {

static_assert(std::endian::native == std::endian::little,
              "NpyArray holds little-endian bytes; a big-endian host would need byte swapping");

constexpr absl::string_view kMagic = "\x93NUMPY";
constexpr size_t kPreambleV1 = 10;  // magic, 2 version bytes, uint16 header length
constexpr size_t kPreambleV2 = 12;  // magic, 2 version bytes, uint32 header length
constexpr size_t kAlign = 64;       // NumPy aligns the data offset to 64 bytes
constexpr int kMaxNesting = 8;      // deep enough for any header NumPy writes

absl::Status Invalid(absl::string_view name, absl::string_view what) {
  return absl::InvalidArgumentError(absl::StrCat(name, ": ", what));
}

std::string ErrnoText(int error) { return std::generic_category().message(error); }

std::string FormatShape(std::span<const int64_t> shape) {
  if (shape.size() == 1) return absl::StrCat("(", shape[0], ",)");
  return absl::StrCat("(", absl::StrJoin(shape, ", "), ")");
}

const char* DtypeDescr(NpyDtype dtype) {
  switch (dtype) {
    case NpyDtype::kF32:
      return "<f4";
    case NpyDtype::kF64:
      return "<f8";
    case NpyDtype::kU8:
      return "|u1";
    case NpyDtype::kU16:
      return "<u2";
    case NpyDtype::kU32:
      return "<u4";
    case NpyDtype::kI32:
      return "<i4";
    case NpyDtype::kI64:
      return "<i8";
  }
  FP8RT_CHECK(false) << "invalid NpyDtype " << static_cast<int>(dtype);
  return "";
}

const char* DtypeName(NpyDtype dtype) {
  switch (dtype) {
    case NpyDtype::kF32:
      return "float32";
    case NpyDtype::kF64:
      return "float64";
    case NpyDtype::kU8:
      return "uint8";
    case NpyDtype::kU16:
      return "uint16";
    case NpyDtype::kU32:
      return "uint32";
    case NpyDtype::kI32:
      return "int32";
    case NpyDtype::kI64:
      return "int64";
  }
  FP8RT_CHECK(false) << "invalid NpyDtype " << static_cast<int>(dtype);
  return "";
}

std::optional<NpyDtype> DtypeFromDescr(absl::string_view descr) {
  for (NpyDtype d : {NpyDtype::kF32, NpyDtype::kF64, NpyDtype::kU8, NpyDtype::kU16, NpyDtype::kU32,
                     NpyDtype::kI32, NpyDtype::kI64}) {
    if (descr == DtypeDescr(d)) return d;
  }
  return std::nullopt;
}

// Element count and byte size of `shape`, or an error message (without the name prefix) when a
// dimension is negative or either number does not fit in int64.
absl::StatusOr<std::pair<int64_t, int64_t>> CountElements(std::span<const int64_t> shape,
                                                          NpyDtype dtype) {
  int64_t count = 1;
  for (int64_t dim : shape) {
    if (dim < 0) {
      return absl::InvalidArgumentError(
          absl::StrCat("negative dimension ", dim, " in shape ", FormatShape(shape)));
    }
    if (dim != 0 && count > std::numeric_limits<int64_t>::max() / dim) {
      return absl::InvalidArgumentError(absl::StrCat(
          "shape ", FormatShape(shape), " is too large: the element count overflows int64"));
    }
    count *= dim;
  }
  const int64_t size = static_cast<int64_t>(NpyDtypeSize(dtype));
  if (count > std::numeric_limits<int64_t>::max() / size) {
    return absl::InvalidArgumentError(
        absl::StrCat("shape ", FormatShape(shape), " is too large: the byte size overflows int64"));
  }
  return std::make_pair(count, count * size);
}

// ---------------------------------------------------------------------------------------------
// The header is the repr() of a Python dict, e.g.
//   {'descr': '<f4', 'fortran_order': False, 'shape': (3, 4), }
// followed by space padding and '\n'. This parses the subset of Python literals such a header
// can hold; error messages lack the name prefix, which the caller adds.

struct PyValue {
  enum class Kind { kString, kInt, kBool, kNone, kTuple, kList };
  Kind kind = Kind::kNone;
  std::string text;            // kString
  int64_t integer = 0;         // kInt
  bool boolean = false;        // kBool
  std::vector<PyValue> items;  // kTuple, kList
};

class HeaderParser {
 public:
  explicit HeaderParser(absl::string_view text) : text_(text) {}

  absl::StatusOr<std::vector<std::pair<std::string, PyValue>>> ParseDict() {
    std::vector<std::pair<std::string, PyValue>> entries;
    SkipSpace();
    if (!Consume('{')) return Error("expected '{'");
    while (true) {
      SkipSpace();
      if (Consume('}')) break;
      FP8RT_ASSIGN_OR_RETURN(std::string key, ParseString());
      SkipSpace();
      if (!Consume(':')) return Error("expected ':'");
      FP8RT_ASSIGN_OR_RETURN(PyValue value, ParseValue(/*depth=*/1));
      entries.emplace_back(std::move(key), std::move(value));
      SkipSpace();
      if (Consume('}')) break;
      if (!Consume(',')) return Error("expected ',' or '}'");
    }
    SkipSpace();
    if (pos_ != text_.size()) return Error("unexpected text after the dictionary");
    return entries;
  }

 private:
  absl::Status Error(absl::string_view what) const {
    return absl::InvalidArgumentError(
        absl::StrCat("malformed header: ", what, " at offset ", pos_, " of '", Excerpt(), "'"));
  }

  // The header with its padding trimmed, cut short if long.
  std::string Excerpt() const {
    absl::string_view s = text_;
    while (!s.empty() && (s.back() == ' ' || s.back() == '\n')) s.remove_suffix(1);
    std::string out(s.substr(0, 120));
    if (s.size() > 120) out += "...";
    for (char& c : out) {
      if (static_cast<unsigned char>(c) < 0x20 || static_cast<unsigned char>(c) >= 0x7f) c = '?';
    }
    return out;
  }

  void SkipSpace() {
    while (pos_ < text_.size() && (text_[pos_] == ' ' || text_[pos_] == '\t' ||
                                   text_[pos_] == '\n' || text_[pos_] == '\r')) {
      ++pos_;
    }
  }

  bool Consume(char c) {
    if (pos_ < text_.size() && text_[pos_] == c) {
      ++pos_;
      return true;
    }
    return false;
  }

  bool ConsumeWord(absl::string_view word) {
    if (text_.substr(pos_, word.size()) != word) return false;
    const size_t end = pos_ + word.size();
    if (end < text_.size() &&
        (std::isalnum(static_cast<unsigned char>(text_[end])) || text_[end] == '_')) {
      return false;
    }
    pos_ = end;
    return true;
  }

  absl::StatusOr<std::string> ParseString() {
    if (pos_ >= text_.size() || (text_[pos_] != '\'' && text_[pos_] != '"')) {
      return Error("expected a string");
    }
    const char quote = text_[pos_++];
    std::string out;
    while (pos_ < text_.size() && text_[pos_] != quote) {
      if (text_[pos_] == '\n') return Error("unterminated string");
      if (text_[pos_] == '\\') {
        ++pos_;
        if (pos_ >= text_.size()) break;
      }
      out += text_[pos_++];
    }
    if (!Consume(quote)) return Error("unterminated string");
    return out;
  }

  absl::StatusOr<PyValue> ParseInt() {
    const size_t start = pos_;
    const bool negative = Consume('-');
    if (pos_ >= text_.size() || !std::isdigit(static_cast<unsigned char>(text_[pos_]))) {
      return Error("expected a digit");
    }
    // Accumulate as a negative number so that INT64_MIN parses too.
    int64_t value = 0;
    while (pos_ < text_.size() && std::isdigit(static_cast<unsigned char>(text_[pos_]))) {
      const int digit = text_[pos_++] - '0';
      if (value < (std::numeric_limits<int64_t>::min() + digit) / 10) {
        while (pos_ < text_.size() && std::isdigit(static_cast<unsigned char>(text_[pos_]))) {
          ++pos_;
        }
        return absl::InvalidArgumentError(
            absl::StrCat("integer ", text_.substr(start, pos_ - start), " in header is too large"));
      }
      value = value * 10 - digit;
    }
    if (!negative) {
      if (value == std::numeric_limits<int64_t>::min()) {
        return absl::InvalidArgumentError(
            absl::StrCat("integer ", text_.substr(start, pos_ - start), " in header is too large"));
      }
      value = -value;
    }
    // Python 2 wrote long integers with an 'L' suffix; old files still carry it.
    if (pos_ < text_.size() && (text_[pos_] == 'L' || text_[pos_] == 'l')) ++pos_;
    PyValue v;
    v.kind = PyValue::Kind::kInt;
    v.integer = value;
    return v;
  }

  // Items up to `close`; sets `*saw_comma` when any comma separated or followed them.
  absl::StatusOr<std::vector<PyValue>> ParseItems(char close, int depth, bool* saw_comma) {
    std::vector<PyValue> items;
    *saw_comma = false;
    while (true) {
      SkipSpace();
      if (Consume(close)) return items;
      FP8RT_ASSIGN_OR_RETURN(PyValue item, ParseValue(depth + 1));
      items.push_back(std::move(item));
      SkipSpace();
      if (Consume(close)) return items;
      if (!Consume(','))
        return Error(absl::StrCat("expected ',' or '", std::string(1, close), "'"));
      *saw_comma = true;
    }
  }

  absl::StatusOr<PyValue> ParseValue(int depth) {
    if (depth > kMaxNesting) return Error("nesting too deep");
    SkipSpace();
    if (pos_ >= text_.size()) return Error("unexpected end");
    const char c = text_[pos_];
    PyValue v;
    if (c == '\'' || c == '"') {
      v.kind = PyValue::Kind::kString;
      FP8RT_ASSIGN_OR_RETURN(v.text, ParseString());
      return v;
    }
    if (c == '-' || std::isdigit(static_cast<unsigned char>(c))) return ParseInt();
    if (c == '(' || c == '[') {
      ++pos_;
      bool saw_comma = false;
      FP8RT_ASSIGN_OR_RETURN(v.items, ParseItems(c == '(' ? ')' : ']', depth, &saw_comma));
      v.kind = c == '(' ? PyValue::Kind::kTuple : PyValue::Kind::kList;
      // As in Python, "(x)" is x itself, not a 1-tuple; "()" and "(x,)" are tuples.
      if (c == '(' && v.items.size() == 1 && !saw_comma) return std::move(v.items[0]);
      return v;
    }
    if (ConsumeWord("True")) {
      v.kind = PyValue::Kind::kBool;
      v.boolean = true;
      return v;
    }
    if (ConsumeWord("False")) {
      v.kind = PyValue::Kind::kBool;
      return v;
    }
    if (ConsumeWord("None")) return v;
    return Error("unexpected character");
  }

  absl::string_view text_;
  size_t pos_ = 0;
};

// ---------------------------------------------------------------------------------------------

struct Preamble {
  size_t size = 0;          // bytes before the header text
  uint64_t header_len = 0;  // bytes of header text (dict, padding and '\n')
};

// `head` holds the first min(total_size, kPreambleV2) bytes of the file.
absl::StatusOr<Preamble> ParsePreamble(std::span<const std::byte> head, uint64_t total_size,
                                       absl::string_view name) {
  const absl::string_view h(reinterpret_cast<const char*>(head.data()), head.size());
  const size_t magic_seen = std::min(h.size(), kMagic.size());
  if (h.substr(0, magic_seen) != kMagic.substr(0, magic_seen)) {
    return Invalid(name, "not a .npy file (bad magic: the file does not start with \\x93NUMPY)");
  }
  if (h.size() < kMagic.size() + 2) {
    return Invalid(name, absl::StrCat("truncated header: the file is ", total_size,
                                      " bytes, too short for the .npy preamble"));
  }
  const int major = static_cast<unsigned char>(h[6]);
  const int minor = static_cast<unsigned char>(h[7]);
  Preamble p;
  if (major == 1 && minor == 0) {
    p.size = kPreambleV1;
  } else if ((major == 2 || major == 3) && minor == 0) {
    p.size = kPreambleV2;  // 3.0 differs from 2.0 only in allowing UTF-8 in the header
  } else {
    return Invalid(name, absl::StrCat("unsupported .npy format version ", major, ".", minor,
                                      " (supported: 1.0, 2.0, 3.0)"));
  }
  if (total_size < p.size) {
    return Invalid(name, absl::StrCat("truncated header: the file is ", total_size,
                                      " bytes, too short for the version ", major,
                                      ".0 preamble of ", p.size, " bytes"));
  }
  const auto byte = [&](size_t i) { return static_cast<uint64_t>(static_cast<uint8_t>(h[i])); };
  p.header_len = byte(8) | byte(9) << 8;
  if (p.size == kPreambleV2) p.header_len |= byte(10) << 16 | byte(11) << 24;
  if (p.header_len > total_size - p.size) {
    return Invalid(name, absl::StrCat("truncated header: header length ", p.header_len,
                                      " runs past the end of the file (", total_size - p.size,
                                      " bytes follow the preamble)"));
  }
  return p;
}

struct Header {
  NpyDtype dtype = NpyDtype::kF32;
  std::vector<int64_t> shape;
  int64_t num_bytes = 0;  // of the data that follows the header
};

absl::StatusOr<Header> InterpretHeader(absl::string_view text, absl::string_view name) {
  auto entries = HeaderParser(text).ParseDict();
  if (!entries.ok()) return Invalid(name, entries.status().message());

  const PyValue* descr = nullptr;
  const PyValue* fortran_order = nullptr;
  const PyValue* shape = nullptr;
  for (const auto& [key, value] : *entries) {
    const PyValue** slot = key == "descr"           ? &descr
                           : key == "fortran_order" ? &fortran_order
                           : key == "shape"         ? &shape
                                                    : nullptr;
    if (slot == nullptr) return Invalid(name, absl::StrCat("unexpected key '", key, "' in header"));
    if (*slot != nullptr) return Invalid(name, absl::StrCat("duplicate key '", key, "' in header"));
    *slot = &value;
  }
  for (auto [value, key] : {std::pair{descr, "descr"}, std::pair{fortran_order, "fortran_order"},
                            std::pair{shape, "shape"}}) {
    if (value == nullptr) return Invalid(name, absl::StrCat("header is missing key '", key, "'"));
  }

  Header header;
  if (descr->kind == PyValue::Kind::kList) {
    return Invalid(name, "unsupported dtype: structured (record) dtypes are not supported");
  }
  if (descr->kind != PyValue::Kind::kString) {
    return Invalid(name, "malformed header: 'descr' is not a string");
  }
  const std::optional<NpyDtype> dtype = DtypeFromDescr(descr->text);
  if (!dtype.has_value()) {
    std::string why = "supported: <f4 <f8 |u1 <u2 <u4 <i4 <i8";
    if (!descr->text.empty() && descr->text[0] == '>') {
      why = "big-endian data is not supported";
    } else if (descr->text.find('O') != std::string::npos) {
      why = "object arrays are not supported";
    }
    return Invalid(name, absl::StrCat("unsupported dtype '", descr->text, "' (", why, ")"));
  }
  header.dtype = *dtype;

  if (fortran_order->kind != PyValue::Kind::kBool) {
    return Invalid(name, "malformed header: 'fortran_order' is not True or False");
  }
  if (fortran_order->boolean) {
    return Invalid(name, "Fortran order is not supported (save a C-contiguous array)");
  }

  if (shape->kind != PyValue::Kind::kTuple) {
    return Invalid(name, "malformed header: 'shape' is not a tuple");
  }
  for (const PyValue& dim : shape->items) {
    if (dim.kind != PyValue::Kind::kInt) {
      return Invalid(name, "malformed header: 'shape' holds something other than integers");
    }
    header.shape.push_back(dim.integer);
  }
  auto counts = CountElements(header.shape, header.dtype);
  if (!counts.ok()) return Invalid(name, counts.status().message());
  header.num_bytes = counts->second;
  return header;
}

absl::Status CheckDataSize(const Header& header, uint64_t available, absl::string_view name) {
  const uint64_t expected = static_cast<uint64_t>(header.num_bytes);
  if (available < expected) {
    return Invalid(name, absl::StrCat("truncated data: expected ", expected, " bytes for shape ",
                                      FormatShape(header.shape), " of ", DtypeName(header.dtype),
                                      ", found ", available));
  }
  if (available > expected) {
    return Invalid(name, absl::StrCat("trailing bytes: expected ", expected,
                                      " bytes of data, found ", available));
  }
  return absl::OkStatus();
}

absl::Status ReadError(const std::string& path, absl::string_view what) {
  if (errno == 0) {
    return Invalid(path, absl::StrCat("truncated ", what, ": the file shrank while being read"));
  }
  const int error = errno;
  return absl::ErrnoToStatus(error, absl::StrCat(path, ": reading the ", what, " failed"));
}

// The version 1.0 preamble and header for an array, padded so that the data starts at a
// multiple of kAlign.
absl::StatusOr<std::string> BuildHeader(NpyDtype dtype, std::span<const int64_t> shape) {
  std::string dict =
      absl::StrCat("{'descr': '", DtypeDescr(dtype),
                   "', 'fortran_order': False, 'shape': ", FormatShape(shape), ", }");
  const size_t unpadded = kPreambleV1 + dict.size() + 1;  // + '\n'
  const size_t header_len = dict.size() + (kAlign - unpadded % kAlign) % kAlign + 1;
  if (header_len > std::numeric_limits<uint16_t>::max()) {
    return absl::InvalidArgumentError(
        absl::StrCat("a shape of ", shape.size(), " dimensions does not fit a version 1.0 header"));
  }
  std::string out(kMagic);
  out += '\x01';
  out += '\x00';
  out += static_cast<char>(header_len & 0xff);
  out += static_cast<char>(header_len >> 8);
  out += dict;
  out.append(header_len - dict.size() - 1, ' ');
  out += '\n';
  return out;
}

}  // namespace

size_t NpyDtypeSize(NpyDtype dtype) {
  switch (dtype) {
    case NpyDtype::kU8:
      return 1;
    case NpyDtype::kU16:
      return 2;
    case NpyDtype::kF32:
    case NpyDtype::kU32:
    case NpyDtype::kI32:
      return 4;
    case NpyDtype::kF64:
    case NpyDtype::kI64:
      return 8;
  }
  FP8RT_CHECK(false) << "invalid NpyDtype " << static_cast<int>(dtype);
  return 0;
}

int64_t NpyArray::NumElements() const {
  int64_t n = 1;
  for (int64_t dim : shape) n *= dim;
  return n;
}

absl::StatusOr<NpyArray> ParseNpy(std::span<const std::byte> bytes, const std::string& name) {
  FP8RT_ASSIGN_OR_RETURN(
      const Preamble preamble,
      ParsePreamble(bytes.first(std::min(bytes.size(), kPreambleV2)), bytes.size(), name));
  const auto header_bytes = bytes.subspan(preamble.size, preamble.header_len);
  FP8RT_ASSIGN_OR_RETURN(
      Header header,
      InterpretHeader(absl::string_view(reinterpret_cast<const char*>(header_bytes.data()),
                                        header_bytes.size()),
                      name));
  const auto data = bytes.subspan(preamble.size + preamble.header_len);
  FP8RT_RETURN_IF_ERROR(CheckDataSize(header, data.size(), name));

  NpyArray array;
  array.dtype = header.dtype;
  array.shape = std::move(header.shape);
  array.data.assign(data.begin(), data.end());
  return array;
}

absl::StatusOr<NpyArray> ReadNpy(const std::string& path) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) {
    return absl::NotFoundError(absl::StrCat(path, ": cannot open: ", ErrnoText(errno)));
  }
  FdCloser closer(fd);
  struct stat st;
  if (::fstat(fd, &st) != 0) {
    return absl::NotFoundError(absl::StrCat(path, ": cannot stat: ", ErrnoText(errno)));
  }
  if (!S_ISREG(st.st_mode)) {
    return absl::NotFoundError(absl::StrCat(path, ": not a regular file"));
  }
  const uint64_t file_size = static_cast<uint64_t>(st.st_size);

  std::byte head[kPreambleV2];
  const size_t head_size = static_cast<size_t>(std::min<uint64_t>(file_size, kPreambleV2));
  if (!PreadFully(fd, 0, head, head_size)) return ReadError(path, "header");
  FP8RT_ASSIGN_OR_RETURN(const Preamble preamble,
                         ParsePreamble(std::span(head, head_size), file_size, path));

  // Bounded by the file size, which ParsePreamble checked.
  std::string header_text(static_cast<size_t>(preamble.header_len), '\0');
  if (!PreadFully(fd, preamble.size, header_text.data(), header_text.size())) {
    return ReadError(path, "header");
  }
  FP8RT_ASSIGN_OR_RETURN(Header header, InterpretHeader(header_text, path));
  const uint64_t data_offset = preamble.size + preamble.header_len;
  FP8RT_RETURN_IF_ERROR(CheckDataSize(header, file_size - data_offset, path));

  NpyArray array;
  array.dtype = header.dtype;
  array.shape = std::move(header.shape);
  array.data.resize(static_cast<size_t>(header.num_bytes));
  if (!PreadFully(fd, data_offset, array.data.data(), array.data.size())) {
    return ReadError(path, "data");
  }
  return array;
}

absl::StatusOr<FloatMatrix> ReadNpyAsFloatMatrix(const std::string& path) {
  FP8RT_ASSIGN_OR_RETURN(const NpyArray array, ReadNpy(path));
  if (array.dtype != NpyDtype::kF32 && array.dtype != NpyDtype::kF64) {
    return Invalid(path, absl::StrCat("unsupported dtype ", DtypeName(array.dtype),
                                      " (expected float32 or float64)"));
  }
  if (array.shape.size() != 1 && array.shape.size() != 2) {
    return Invalid(
        path, absl::StrCat("expected a 1-D or 2-D array, got shape ", FormatShape(array.shape)));
  }
  FloatMatrix m;
  m.rank = static_cast<int>(array.shape.size());
  m.rows = array.shape.size() == 1 ? 1 : array.shape[0];
  m.cols = array.shape.back();
  const size_t n = static_cast<size_t>(array.NumElements());
  m.values.resize(n);
  if (array.dtype == NpyDtype::kF32 && n > 0) {
    std::memcpy(m.values.data(), array.data.data(), n * sizeof(float));
  } else if (array.dtype == NpyDtype::kF64) {
    for (size_t i = 0; i < n; ++i) {
      double d;
      std::memcpy(&d, array.data.data() + i * sizeof(double), sizeof(double));
      m.values[i] = static_cast<float>(d);  // round to nearest even (the default FP mode)
    }
  }
  return m;
}

absl::Status WriteNpy(const std::string& path, NpyDtype dtype, std::span<const int64_t> shape,
                      const void* data) {
  auto counts = CountElements(shape, dtype);
  if (!counts.ok()) return Invalid(path, counts.status().message());
  const size_t num_bytes = static_cast<size_t>(counts->second);
  if (num_bytes > 0 && data == nullptr) {
    return Invalid(path, absl::StrCat("data is null for ", counts->first, " elements"));
  }
  auto header = BuildHeader(dtype, shape);
  if (!header.ok()) return Invalid(path, header.status().message());

  const std::span<const std::byte> parts[] = {
      std::as_bytes(std::span(header->data(), header->size())),
      std::span(static_cast<const std::byte*>(data), num_bytes)};
  return WriteFileAtomically(path, parts, path);
}

}  // namespace fp8rt
