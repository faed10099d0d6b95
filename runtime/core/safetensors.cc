// safetensors reading and writing; the format and the checks are in safetensors.h. Index:
//   Dtype names and sizes; Quote (bounded quoting of names from a file)
//   ParseHeader      the JSON header -> entries (no duplicate keys; fields checked)
//   CheckCoverage    the tensors tile the byte buffer exactly
//   SafetensorsFile  Read, Parse, Find, ReadFloat32
//   WriteSafetensors
#include "runtime/core/safetensors.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <bit>
#include <cerrno>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <limits>
#include <set>
#include <utility>

#include "absl/strings/str_cat.h"
#include "nlohmann/json.hpp"
#include "runtime/core/file_io.h"
#include "runtime/core/status.h"
#include "runtime/core/strict_json.h"

namespace fp8rt {
namespace {

constexpr uint64_t kMaxHeaderBytes = 100'000'000;  // the reference implementation's limit
constexpr size_t kQuoteBytes = 64;

struct DtypeInfo {
  SafetensorsDtype dtype;
  const char* name;
  size_t size;
};
constexpr DtypeInfo kDtypes[] = {
    {SafetensorsDtype::kBool, "BOOL", 1},      {SafetensorsDtype::kU8, "U8", 1},
    {SafetensorsDtype::kI8, "I8", 1},          {SafetensorsDtype::kF8E5M2, "F8_E5M2", 1},
    {SafetensorsDtype::kF8E4M3, "F8_E4M3", 1}, {SafetensorsDtype::kI16, "I16", 2},
    {SafetensorsDtype::kF16, "F16", 2},        {SafetensorsDtype::kBF16, "BF16", 2},
    {SafetensorsDtype::kI32, "I32", 4},        {SafetensorsDtype::kF32, "F32", 4},
    {SafetensorsDtype::kF64, "F64", 8},        {SafetensorsDtype::kI64, "I64", 8},
};

const DtypeInfo& Info(SafetensorsDtype dtype) {
  for (const DtypeInfo& d : kDtypes) {
    if (d.dtype == dtype) return d;
  }
  return kDtypes[0];
}

// A name or value from a file, quoted with at most kQuoteBytes bytes of it.
// (Debian's Abseil has its own absl::string_view: std::string_view goes through std::string.)
std::string Quote(std::string_view s) {
  if (s.size() <= kQuoteBytes) return "'" + std::string(s) + "'";
  return absl::StrCat("'", std::string(s.substr(0, kQuoteBytes)), "...' (", s.size(), " bytes)");
}

absl::Status Invalid(const std::string& file, absl::string_view message) {
  return absl::InvalidArgumentError(absl::StrCat(file, ": ", message));
}

uint64_t LoadU64(const std::byte* p) {
  uint64_t v = 0;
  for (int i = 7; i >= 0; --i) v = v << 8 | static_cast<uint64_t>(p[i]);
  return v;
}

struct Entry {
  std::string name;
  SafetensorsDtype dtype;
  std::vector<int64_t> shape;
  uint64_t begin = 0, end = 0;
};

// A non-negative JSON integer that fits int64, or an error naming `what`.
absl::StatusOr<int64_t> NonNegative(const nlohmann::json& v, const std::string& what) {
  if (v.is_number_unsigned()) {
    const uint64_t u = v.get<uint64_t>();
    if (u <= static_cast<uint64_t>(std::numeric_limits<int64_t>::max())) {
      return static_cast<int64_t>(u);
    }
  } else if (v.is_number_integer() && v.get<int64_t>() >= 0) {
    return v.get<int64_t>();
  }
  return absl::InvalidArgumentError(
      absl::StrCat(what, " must be a non-negative integer, got ", Quote(v.dump())));
}

absl::StatusOr<Entry> ParseEntry(const std::string& name, const nlohmann::json& v,
                                 uint64_t buffer_bytes) {
  const std::string at = absl::StrCat("tensor ", Quote(name));
  if (!v.is_object()) {
    return absl::InvalidArgumentError(
        absl::StrCat(at, ": expected an object, got ", Quote(v.dump())));
  }
  for (const auto& [key, unused] : v.items()) {
    if (key != "dtype" && key != "shape" && key != "data_offsets") {
      return absl::InvalidArgumentError(absl::StrCat(at, ": unknown field ", Quote(key),
                                                     " (expected dtype, shape, data_offsets)"));
    }
  }
  for (const char* field : {"dtype", "shape", "data_offsets"}) {
    if (!v.contains(field)) {
      return absl::InvalidArgumentError(absl::StrCat(at, ": missing field '", field, "'"));
    }
  }
  Entry e;
  e.name = name;
  const nlohmann::json& dtype = v["dtype"];
  if (!dtype.is_string()) {
    return absl::InvalidArgumentError(
        absl::StrCat(at, ": dtype must be a string, got ", Quote(dtype.dump())));
  }
  const std::string dtype_name = dtype.get<std::string>();
  const DtypeInfo* info = nullptr;
  for (const DtypeInfo& d : kDtypes) {
    if (dtype_name == d.name) info = &d;
  }
  if (info == nullptr) {
    return absl::InvalidArgumentError(absl::StrCat(
        at, ": dtype ", Quote(dtype_name),
        " is not one fp8rt reads (BOOL, U8, I8, F8_E5M2, F8_E4M3, I16, F16, BF16, I32, F32, F64, "
        "I64)"));
  }
  e.dtype = info->dtype;
  const nlohmann::json& shape = v["shape"];
  if (!shape.is_array()) {
    return absl::InvalidArgumentError(
        absl::StrCat(at, ": shape must be an array, got ", Quote(shape.dump())));
  }
  // The element count, checked against the buffer as it grows so that it cannot overflow.
  uint64_t elements = 1;
  bool zero = false;
  for (size_t i = 0; i < shape.size(); ++i) {
    FP8RT_ASSIGN_OR_RETURN(const int64_t d,
                           NonNegative(shape[i], absl::StrCat(at, ": shape[", i, "]")));
    e.shape.push_back(d);
    if (d == 0) zero = true;
    if (!zero) {
      if (static_cast<uint64_t>(d) > buffer_bytes / elements) {
        return absl::InvalidArgumentError(absl::StrCat(at, ": shape ", Quote(shape.dump()),
                                                       " holds more elements than the ",
                                                       buffer_bytes, "-byte buffer"));
      }
      elements *= static_cast<uint64_t>(d);
    }
  }
  if (zero) elements = 0;
  const nlohmann::json& offsets = v["data_offsets"];
  if (!offsets.is_array() || offsets.size() != 2) {
    return absl::InvalidArgumentError(
        absl::StrCat(at, ": data_offsets must be [begin, end], got ", Quote(offsets.dump())));
  }
  FP8RT_ASSIGN_OR_RETURN(const int64_t begin,
                         NonNegative(offsets[0], absl::StrCat(at, ": data_offsets[0]")));
  FP8RT_ASSIGN_OR_RETURN(const int64_t end,
                         NonNegative(offsets[1], absl::StrCat(at, ": data_offsets[1]")));
  e.begin = static_cast<uint64_t>(begin);
  e.end = static_cast<uint64_t>(end);
  if (e.begin > e.end || e.end > buffer_bytes) {
    return absl::InvalidArgumentError(absl::StrCat(at, ": data_offsets [", begin, ", ", end,
                                                   "] are not inside the ", buffer_bytes,
                                                   "-byte buffer"));
  }
  if (elements > buffer_bytes / info->size || e.end - e.begin != elements * info->size) {
    return absl::InvalidArgumentError(
        absl::StrCat(at, ": data_offsets [", begin, ", ", end, "] hold ", e.end - e.begin,
                     " bytes, but ", elements, " ", info->name, " elements of shape ",
                     Quote(shape.dump()), " need ", elements * info->size));
  }
  return e;
}

// The header's entries (tensors in file order of the JSON) and its metadata.
absl::Status ParseHeader(std::string_view text, uint64_t buffer_bytes, const std::string& file,
                         std::vector<Entry>* entries, std::map<std::string, std::string>* meta) {
  FP8RT_ASSIGN_OR_RETURN(const nlohmann::json header, ParseStrictObject(text, file, "the header"));
  for (const auto& [key, value] : header.items()) {
    if (key == "__metadata__") {
      if (!value.is_object()) {
        return Invalid(file,
                       absl::StrCat("__metadata__ must be an object, got ", Quote(value.dump())));
      }
      for (const auto& [mk, mv] : value.items()) {
        if (!mv.is_string()) {
          return Invalid(file, absl::StrCat("__metadata__ ", Quote(mk), " must be a string, got ",
                                            Quote(mv.dump())));
        }
        (*meta)[mk] = mv.get<std::string>();
      }
      continue;
    }
    absl::StatusOr<Entry> e = ParseEntry(key, value, buffer_bytes);
    if (!e.ok()) return Invalid(file, e.status().message());
    entries->push_back(*std::move(e));
  }
  return absl::OkStatus();
}

// The tensors, sorted by offset, must tile [0, buffer_bytes) exactly.
absl::Status CheckCoverage(std::vector<Entry>& entries, uint64_t buffer_bytes,
                           const std::string& file) {
  std::stable_sort(entries.begin(), entries.end(), [](const Entry& a, const Entry& b) {
    return a.begin != b.begin ? a.begin < b.begin : a.end < b.end;
  });
  uint64_t at = 0;
  const Entry* prev = nullptr;
  for (const Entry& e : entries) {
    if (e.begin < at) {
      return Invalid(
          file, absl::StrCat("tensor ", Quote(e.name), " data_offsets [", e.begin, ", ", e.end,
                             "] overlap tensor ", Quote(prev->name), " (which ends at ", at, ")"));
    }
    if (e.begin > at) {
      return Invalid(file, absl::StrCat("bytes [", at, ", ", e.begin,
                                        ") of the buffer belong to "
                                        "no tensor (before tensor ",
                                        Quote(e.name), ")"));
    }
    at = e.end;
    prev = &e;
  }
  if (at != buffer_bytes) {
    return Invalid(file, absl::StrCat("the tensors cover ", at, " bytes of the ", buffer_bytes,
                                      "-byte buffer (trailing bytes belong to no tensor)"));
  }
  return absl::OkStatus();
}

// `size` bytes of the open file `fd` (`path`).
absl::StatusOr<std::vector<std::byte>> ReadWhole(int fd, size_t size, const std::string& path) {
  std::vector<std::byte> bytes(size);
  FP8RT_RETURN_IF_ERROR(ReadFileStart(fd, bytes.data(), bytes.size(), path));
  return bytes;
}

float HalfToFloat(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  const int exp = (h >> 10) & 0x1f;
  const uint32_t mant = h & 0x3ffu;
  if (exp == 0x1f) return std::bit_cast<float>(sign | 0x7f800000u | (mant << 13));
  if (exp == 0) {
    // Zero or subnormal: mant * 2^-24, exact in FP32.
    const float v = std::ldexp(static_cast<float>(mant), -24);
    return sign != 0 ? -v : v;
  }
  return std::bit_cast<float>(sign | static_cast<uint32_t>(exp - 15 + 127) << 23 | (mant << 13));
}

}  // namespace

std::string_view SafetensorsDtypeName(SafetensorsDtype dtype) { return Info(dtype).name; }
size_t SafetensorsDtypeSize(SafetensorsDtype dtype) { return Info(dtype).size; }

int64_t SafetensorsTensor::NumElements() const {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  return n;
}

absl::StatusOr<SafetensorsFile> SafetensorsFile::Read(const std::string& path) {
  FP8RT_ASSIGN_OR_RETURN(const OpenedFile f, OpenRegularFile(path));
  FdCloser closer(f.fd);
  if (f.size < 8) return Parse(std::vector<std::byte>(f.size), path);  // refused, naming the size
  void* map = ::mmap(nullptr, f.size, PROT_READ, MAP_PRIVATE, f.fd, 0);
  if (map == MAP_FAILED) {
    // A file system that cannot map files (some FUSE ones): read it instead.
    FP8RT_ASSIGN_OR_RETURN(std::vector<std::byte> bytes, ReadWhole(f.fd, f.size, path));
    return Parse(std::move(bytes), path);
  }
  const size_t size = f.size;
  std::shared_ptr<const void> storage(
      map, [size](const void* p) { ::munmap(const_cast<void*>(p), size); });
  return FromBytes(std::move(storage), std::span(static_cast<const std::byte*>(map), size), path);
}

absl::StatusOr<SafetensorsFile> SafetensorsFile::Parse(std::vector<std::byte> bytes,
                                                       std::string name) {
  auto owned = std::make_shared<const std::vector<std::byte>>(std::move(bytes));
  const std::span<const std::byte> view(*owned);
  return FromBytes(std::move(owned), view, std::move(name));
}

absl::StatusOr<SafetensorsFile> SafetensorsFile::FromBytes(std::shared_ptr<const void> storage,
                                                           std::span<const std::byte> bytes,
                                                           std::string name) {
  if (bytes.size() < 8) {
    return Invalid(name, absl::StrCat("the file is ", bytes.size(),
                                      " bytes, shorter than the 8-byte header size"));
  }
  const uint64_t n = LoadU64(bytes.data());
  if (n > kMaxHeaderBytes) {
    return Invalid(
        name, absl::StrCat("header size ", n, " is over the ", kMaxHeaderBytes, "-byte limit"));
  }
  if (n > bytes.size() - 8) {
    return Invalid(name, absl::StrCat("header size ", n, " runs past the end of the ", bytes.size(),
                                      "-byte file"));
  }
  const std::string_view text(reinterpret_cast<const char*>(bytes.data() + 8),
                              static_cast<size_t>(n));
  const uint64_t buffer_bytes = bytes.size() - 8 - n;
  std::vector<Entry> entries;
  SafetensorsFile file;
  FP8RT_RETURN_IF_ERROR(ParseHeader(text, buffer_bytes, name, &entries, &file.metadata_));
  FP8RT_RETURN_IF_ERROR(CheckCoverage(entries, buffer_bytes, name));
  file.name_ = std::move(name);
  file.storage_ = std::move(storage);
  const std::byte* buffer = bytes.data() + 8 + n;
  for (Entry& e : entries) {
    file.tensors_.push_back(SafetensorsTensor{
        .name = std::move(e.name),
        .dtype = e.dtype,
        .shape = std::move(e.shape),
        .data = std::span(buffer + e.begin, static_cast<size_t>(e.end - e.begin))});
    file.index_.emplace(file.tensors_.back().name, file.tensors_.size() - 1);
  }
  return file;
}

const SafetensorsTensor* SafetensorsFile::Find(std::string_view name) const {
  const auto it = index_.find(name);
  return it == index_.end() ? nullptr : &tensors_[it->second];
}

absl::Status SafetensorsFile::CheckFloat32(std::string_view name,
                                           std::span<const int64_t> shape) const {
  const SafetensorsTensor* t = Find(name);
  const auto shape_text = [](std::span<const int64_t> s) {
    std::string out = "[";
    for (size_t i = 0; i < s.size(); ++i) absl::StrAppend(&out, i > 0 ? ", " : "", s[i]);
    return out + "]";
  };
  if (t == nullptr) return Invalid(name_, absl::StrCat("no tensor ", Quote(name)));
  if (!std::equal(t->shape.begin(), t->shape.end(), shape.begin(), shape.end())) {
    return Invalid(name_, absl::StrCat("tensor ", Quote(name), " has shape ", shape_text(t->shape),
                                       ", expected ", shape_text(shape)));
  }
  if (t->dtype != SafetensorsDtype::kF32 && t->dtype != SafetensorsDtype::kBF16 &&
      t->dtype != SafetensorsDtype::kF16) {
    return Invalid(name_, absl::StrCat("tensor ", Quote(name), " is ",
                                       std::string(SafetensorsDtypeName(t->dtype)),
                                       "; weights must be F32, BF16 or F16"));
  }
  return absl::OkStatus();
}

absl::StatusOr<std::vector<float>> SafetensorsFile::ReadFloat32(
    std::string_view name, std::span<const int64_t> shape) const {
  FP8RT_RETURN_IF_ERROR(CheckFloat32(name, shape));
  const SafetensorsTensor* t = Find(name);
  const size_t n = static_cast<size_t>(t->NumElements());
  std::vector<float> out(n);
  switch (t->dtype) {
    case SafetensorsDtype::kF32:
      for (size_t i = 0; i < n; ++i) {
        uint32_t bits = 0;
        for (int b = 3; b >= 0; --b) bits = bits << 8 | static_cast<uint32_t>(t->data[4 * i + b]);
        out[i] = std::bit_cast<float>(bits);
      }
      return out;
    case SafetensorsDtype::kBF16:
    case SafetensorsDtype::kF16:
      for (size_t i = 0; i < n; ++i) {
        const uint16_t h = static_cast<uint16_t>(static_cast<uint32_t>(t->data[2 * i]) |
                                                 static_cast<uint32_t>(t->data[2 * i + 1]) << 8);
        out[i] = t->dtype == SafetensorsDtype::kBF16
                     ? std::bit_cast<float>(static_cast<uint32_t>(h) << 16)
                     : HalfToFloat(h);
      }
      return out;
    default:
      break;
  }
  return absl::InternalError("ReadFloat32: a dtype CheckFloat32 admitted has no conversion");
}

namespace {

constexpr const char* kSingleFile = "model.safetensors";
constexpr const char* kIndexFile = "model.safetensors.index.json";

bool EndsWith(const std::string& s, std::string_view suffix) {
  return s.size() >= suffix.size() &&
         s.compare(s.size() - suffix.size(), suffix.size(), suffix.data(), suffix.size()) == 0;
}

}  // namespace

absl::StatusOr<std::vector<std::pair<std::string, std::string>>> ParseSafetensorsIndex(
    std::string_view text, const std::string& name) {
  // Trailing whitespace (a final newline) is allowed, as in a header.
  FP8RT_ASSIGN_OR_RETURN(const nlohmann::json index, ParseStrictObject(text, name, "the index"));
  if (index.contains("metadata") && !index["metadata"].is_object()) {
    return Invalid(
        name, absl::StrCat("metadata must be an object, got ", Quote(index["metadata"].dump())));
  }
  if (!index.contains("weight_map")) return Invalid(name, "the index has no weight_map");
  const nlohmann::json& map = index["weight_map"];
  if (!map.is_object() || map.empty()) {
    return Invalid(name, absl::StrCat("weight_map must be a non-empty object of tensor name -> "
                                      "file name, got ",
                                      Quote(map.dump())));
  }
  std::vector<std::pair<std::string, std::string>> out;
  out.reserve(map.size());
  // nlohmann's object iterates in key order.
  for (const auto& [tensor, file] : map.items()) {
    const std::string at = absl::StrCat("weight_map ", Quote(tensor));
    if (!file.is_string()) {
      return Invalid(
          name, absl::StrCat(at, ": the file name must be a string, got ", Quote(file.dump())));
    }
    const std::string f = file.get<std::string>();
    if (f.empty() || f.size() > 255 || f == "." || f == ".." || f.find('/') != std::string::npos ||
        f.find('\\') != std::string::npos || f.find('\0') != std::string::npos) {
      return Invalid(
          name, absl::StrCat(at, ": ", Quote(f), " is not the name of a file beside the index"));
    }
    out.emplace_back(tensor, f);
  }
  return out;
}

absl::StatusOr<std::string> ResolveSafetensorsPath(const std::string& path) {
  std::error_code ec;
  if (!std::filesystem::is_directory(path, ec)) return path;
  for (const char* candidate : {kSingleFile, kIndexFile}) {
    const std::string p = (std::filesystem::path(path) / candidate).string();
    if (std::filesystem::exists(p, ec)) return p;
  }
  return absl::NotFoundError(
      absl::StrCat(path, ": a folder with neither ", kSingleFile, " nor ", kIndexFile));
}

SafetensorsSet SafetensorsSet::Of(SafetensorsFile file) {
  SafetensorsSet set;
  set.name_ = file.name();
  for (const SafetensorsTensor& t : file.tensors()) set.file_of_.emplace(t.name, 0);
  set.files_.push_back(std::move(file));
  return set;
}

absl::StatusOr<SafetensorsSet> SafetensorsSet::Open(const std::string& path) {
  FP8RT_ASSIGN_OR_RETURN(const std::string first, ResolveSafetensorsPath(path));
  if (!EndsWith(first, ".json")) {
    FP8RT_ASSIGN_OR_RETURN(SafetensorsFile file, SafetensorsFile::Read(first));
    return Of(std::move(file));
  }
  FP8RT_ASSIGN_OR_RETURN(const std::string text, ReadTextFile(first, kMaxHeaderBytes));
  FP8RT_ASSIGN_OR_RETURN(const auto map, ParseSafetensorsIndex(text, first));
  const std::filesystem::path folder = std::filesystem::path(first).parent_path();
  SafetensorsSet set;
  set.name_ = first;
  std::map<std::string, size_t> file_index;  // file name -> index into files_
  for (const auto& [tensor, file] : map) {
    auto [it, added] = file_index.emplace(file, set.files_.size());
    if (added) {
      absl::StatusOr<SafetensorsFile> f = SafetensorsFile::Read((folder / file).string());
      if (!f.ok()) {
        return absl::Status(f.status().code(),
                            absl::StrCat(f.status().message(), " (listed in ", first, ")"));
      }
      set.files_.push_back(*std::move(f));
    }
    const SafetensorsFile& holder = set.files_[it->second];
    if (holder.Find(tensor) == nullptr) {
      return Invalid(first, absl::StrCat("weight_map puts tensor ", Quote(tensor), " in ",
                                         Quote(file), ", which has no tensor of that name"));
    }
    set.file_of_.emplace(tensor, it->second);
  }
  // Every tensor of every file is listed, with that file: nothing in the files goes unread, and
  // no name is in two files.
  for (size_t i = 0; i < set.files_.size(); ++i) {
    for (const SafetensorsTensor& t : set.files_[i].tensors()) {
      const auto it = set.file_of_.find(t.name);
      if (it == set.file_of_.end()) {
        return Invalid(set.files_[i].name(), absl::StrCat("tensor ", Quote(t.name),
                                                          " is not in the weight_map of ", first));
      }
      if (it->second != i) {
        return Invalid(set.files_[i].name(),
                       absl::StrCat("tensor ", Quote(t.name),
                                    " is also here, but the "
                                    "weight_map of ",
                                    first, " puts it in ", set.files_[it->second].name()));
      }
    }
  }
  return set;
}

const SafetensorsTensor* SafetensorsSet::Find(std::string_view name) const {
  const auto it = file_of_.find(name);
  return it == file_of_.end() ? nullptr : files_[it->second].Find(name);
}

absl::StatusOr<std::vector<float>> SafetensorsSet::ReadFloat32(
    std::string_view name, std::span<const int64_t> shape) const {
  const auto it = file_of_.find(name);
  if (it == file_of_.end()) return Invalid(name_, absl::StrCat("no tensor ", Quote(name)));
  return files_[it->second].ReadFloat32(name, shape);
}

absl::Status SafetensorsSet::CheckFloat32(std::string_view name,
                                          std::span<const int64_t> shape) const {
  const auto it = file_of_.find(name);
  if (it == file_of_.end()) return Invalid(name_, absl::StrCat("no tensor ", Quote(name)));
  return files_[it->second].CheckFloat32(name, shape);
}

absl::Status WriteSafetensors(const std::string& path,
                              std::span<const SafetensorsWriteTensor> tensors,
                              const std::map<std::string, std::string>& metadata) {
  nlohmann::ordered_json header = nlohmann::ordered_json::object();
  if (!metadata.empty()) {
    nlohmann::ordered_json meta = nlohmann::ordered_json::object();
    for (const auto& [k, v] : metadata) meta[k] = v;
    header["__metadata__"] = std::move(meta);
  }
  std::vector<std::span<const std::byte>> parts;
  parts.reserve(tensors.size() + 2);
  uint64_t offset = 0;
  std::set<std::string_view> names;
  for (const SafetensorsWriteTensor& t : tensors) {
    const std::string at = absl::StrCat("tensor ", Quote(t.name));
    if (t.name.empty() || t.name == "__metadata__" || !names.insert(t.name).second) {
      return Invalid(path, absl::StrCat(at, ": the name is empty, reserved or used twice"));
    }
    uint64_t elements = 1;
    for (const int64_t d : t.shape) {
      if (d < 0) return Invalid(path, absl::StrCat(at, ": negative dimension ", d));
      elements *= static_cast<uint64_t>(d);
    }
    const uint64_t bytes = elements * SafetensorsDtypeSize(t.dtype);
    if (bytes > 0 && t.data == nullptr) {
      return Invalid(path, absl::StrCat(at, ": data is null for ", elements, " elements"));
    }
    header[t.name] = {{"dtype", std::string(SafetensorsDtypeName(t.dtype))},
                      {"shape", t.shape},
                      {"data_offsets", {offset, offset + bytes}}};
    parts.emplace_back(static_cast<const std::byte*>(t.data), static_cast<size_t>(bytes));
    offset += bytes;
  }
  std::string text = header.dump();
  text.append((8 - text.size() % 8) % 8, ' ');
  std::byte size[8];
  for (int i = 0; i < 8; ++i) {
    size[i] = static_cast<std::byte>((static_cast<uint64_t>(text.size()) >> (8 * i)) & 0xff);
  }
  parts.insert(parts.begin(), {std::span<const std::byte>(size, 8),
                               std::as_bytes(std::span(text.data(), text.size()))});
  return WriteFileAtomically(path, parts, path);
}

}  // namespace fp8rt
