// Fuzz target: safetensors parsing (runtime/core/safetensors.h, SafetensorsFile::Parse, the parser
// behind Read and `init.from`), and the sharded layout's index (ParseSafetensorsIndex, behind
// SafetensorsSet::Open).
//
// The input is a whole safetensors file, and the same bytes are also read as an index: an
// accepted index names only plain file names beside it (no '/', '\\', "." or ".."), and a refused
// one is InvalidArgument starting with its name, bounded. An accepted one must have tensors that
// tile its byte buffer exactly, in order, each holding NumElements() elements of its dtype, and
// every tensor must be found by its name; a refused one is InvalidArgument with a message that
// starts with the name it was given and stays bounded whatever the input.
#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "absl/strings/match.h"
#include "runtime/core/safetensors.h"
#include "tests/fuzz/fuzz_support.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace fp8rt;
  static const std::string kName = "fuzz.safetensors";
  static const std::string kIndex = "fuzz.index.json";
  const absl::StatusOr<std::vector<std::pair<std::string, std::string>>> index =
      ParseSafetensorsIndex(std::string_view(reinterpret_cast<const char*>(data), size), kIndex);
  if (!index.ok()) {
    const absl::Status& s = index.status();
    FUZZ_CHECK(absl::IsInvalidArgument(s), "index: not InvalidArgument: %s", s.ToString().c_str());
    FUZZ_CHECK(absl::StartsWith(s.message(), kIndex + ": "),
               "index: error does not start with the name: %s", s.ToString().c_str());
    FUZZ_CHECK(s.message().size() < 1024, "index: unbounded error of %zu bytes",
               s.message().size());
  } else {
    FUZZ_CHECK(!index->empty(), "an empty weight_map accepted");
    for (const auto& [tensor, file] : *index) {
      FUZZ_CHECK(!file.empty() && file.size() <= 255 && file != "." && file != ".." &&
                     file.find_first_of(std::string("/\\\0", 3)) == std::string::npos,
                 "file name '%s' of '%s' accepted", file.c_str(), tensor.c_str());
    }
  }
  std::vector<std::byte> bytes(size);
  for (size_t i = 0; i < size; ++i) bytes[i] = static_cast<std::byte>(data[i]);
  const absl::StatusOr<SafetensorsFile> file = SafetensorsFile::Parse(std::move(bytes), kName);
  if (!file.ok()) {
    const absl::Status& s = file.status();
    FUZZ_CHECK(absl::IsInvalidArgument(s), "not InvalidArgument: %s", s.ToString().c_str());
    FUZZ_CHECK(absl::StartsWith(s.message(), kName + ": "),
               "error does not start with the name: %s", s.ToString().c_str());
    FUZZ_CHECK(s.message().size() < 1024, "unbounded error of %zu bytes", s.message().size());
    return 0;
  }
  const std::byte* next = nullptr;
  size_t covered = 0;
  for (const SafetensorsTensor& t : file->tensors()) {
    int64_t n = 1;
    for (int64_t d : t.shape) {
      FUZZ_CHECK(d >= 0, "negative dimension %lld", static_cast<long long>(d));
      n *= d;
    }
    FUZZ_CHECK(t.data.size() == static_cast<uint64_t>(n) * SafetensorsDtypeSize(t.dtype),
               "%zu data bytes for %lld elements", t.data.size(), static_cast<long long>(n));
    FUZZ_CHECK(next == nullptr || t.data.data() == next, "a gap or overlap before '%s'",
               t.name.c_str());
    next = t.data.data() + t.data.size();
    covered += t.data.size();
    FUZZ_CHECK(file->Find(t.name) != nullptr, "tensor '%s' not found by name", t.name.c_str());
  }
  FUZZ_CHECK(covered <= size, "more tensor bytes than input bytes");
  return 0;
}
