// JSON objects read from files whose readers must agree on what they say (safetensors headers,
// their index, Hugging Face's config.json).
//
//   ParseStrictObject  text -> a JSON object: it must start with '{', be valid JSON (numbers that
//                      overflow included), nest at most kMaxJsonDepth levels, and repeat no key
//                      in any object. Errors are InvalidArgument "FILE: WHAT ..." with at most
//                      kQuotePrefixBytes of the input quoted.
//
// Duplicate keys: parsers differ on them (nlohmann keeps the last), so a file that has them means
// different things to different readers. The depth limit keeps the recursive code that walks a
// parsed value (dump, copies) within the stack whatever the input (a megabyte of '[' nests half a
// million levels).
#ifndef FP8RT_RUNTIME_CORE_STRICT_JSON_H_
#define FP8RT_RUNTIME_CORE_STRICT_JSON_H_

#include <string>
#include <string_view>

#include "absl/status/statusor.h"
#include "nlohmann/json.hpp"

namespace fp8rt {

inline constexpr int kMaxJsonDepth = 64;

// `what` names the text in errors ("the header", "the index", "config.json").
absl::StatusOr<nlohmann::json> ParseStrictObject(std::string_view text, const std::string& file,
                                                 const char* what);

}  // namespace fp8rt

#endif  // FP8RT_RUNTIME_CORE_STRICT_JSON_H_
