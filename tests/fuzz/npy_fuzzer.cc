// Fuzz target: .npy parsing (runtime/core/npy.h, ParseNpy, the parser behind ReadNpy).
//
// The input is a whole .npy file. An accepted one must hold exactly NumElements() elements of its
// dtype, with no negative dimension; a refused one is InvalidArgument with a message that starts
// with the name it was given.
#include <cstddef>
#include <cstdint>
#include <span>
#include <string>

#include "absl/strings/match.h"
#include "runtime/core/npy.h"
#include "tests/fuzz/fuzz_support.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace fp8rt;
  static const std::string kName = "fuzz.npy";
  const absl::StatusOr<NpyArray> array =
      ParseNpy(std::span<const std::byte>(reinterpret_cast<const std::byte*>(data), size), kName);
  if (!array.ok()) {
    const absl::Status& s = array.status();
    FUZZ_CHECK(absl::IsInvalidArgument(s), "not InvalidArgument: %s", s.ToString().c_str());
    FUZZ_CHECK(absl::StartsWith(s.message(), kName + ": "),
               "error does not start with the name: %s", s.ToString().c_str());
    return 0;
  }
  for (int64_t dim : array->shape) FUZZ_CHECK(dim >= 0, "negative dimension %lld", (long long)dim);
  const int64_t n = array->NumElements();
  FUZZ_CHECK(n >= 0, "NumElements %lld", static_cast<long long>(n));
  FUZZ_CHECK(array->data.size() == static_cast<uint64_t>(n) * NpyDtypeSize(array->dtype),
             "%zu data bytes for %lld elements of %zu bytes", array->data.size(),
             static_cast<long long>(n), NpyDtypeSize(array->dtype));
  FUZZ_CHECK(array->data.size() <= size, "more data bytes than input bytes");
  return 0;
}
