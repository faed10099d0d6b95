// Quoting client input in error messages: a bounded prefix only, so that an error about a
// megabyte-long field stays a short message (it travels back in gRPC metadata, whose size is
// capped) and still names what was wrong.
#ifndef FP8RT_RUNTIME_CORE_QUOTE_H_
#define FP8RT_RUNTIME_CORE_QUOTE_H_

#include <cstddef>
#include <string>

#include "absl/strings/escaping.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"

namespace fp8rt {

inline constexpr size_t kQuotePrefixBytes = 64;

// 'value' with C escapes; longer than `max` bytes: the first `max` bytes, then "...(N bytes)".
inline std::string QuoteBounded(absl::string_view value, size_t max = kQuotePrefixBytes) {
  if (value.size() <= max) return absl::StrCat("'", absl::CEscape(value), "'");
  return absl::StrCat("'", absl::CEscape(value.substr(0, max)), "'...(", value.size(),
                      " bytes)");
}

}  // namespace fp8rt

#endif  // FP8RT_RUNTIME_CORE_QUOTE_H_
