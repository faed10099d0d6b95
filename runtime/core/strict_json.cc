// Strict JSON objects; see strict_json.h.
#include "runtime/core/strict_json.h"

#include <set>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "runtime/core/quote.h"

namespace fp8rt {
namespace {

absl::Status Invalid(const std::string& file, const std::string& message) {
  return absl::InvalidArgumentError(absl::StrCat(file, ": ", message));
}

// The deepest nesting of arrays and objects in `text`, counting only brackets outside strings;
// stops counting past `limit`.
int NestingDepth(std::string_view text, int limit) {
  int depth = 0, deepest = 0;
  bool in_string = false, escaped = false;
  for (const char c : text) {
    if (in_string) {
      if (escaped) {
        escaped = false;
      } else if (c == '\\') {
        escaped = true;
      } else if (c == '"') {
        in_string = false;
      }
      continue;
    }
    if (c == '"') {
      in_string = true;
    } else if (c == '[' || c == '{') {
      deepest = std::max(deepest, ++depth);
      if (deepest > limit) return deepest;
    } else if (c == ']' || c == '}') {
      --depth;
    }
  }
  return deepest;
}

}  // namespace

absl::StatusOr<nlohmann::json> ParseStrictObject(std::string_view text, const std::string& file,
                                                 const char* what) {
  if (text.empty() || text.front() != '{') {
    return Invalid(file, absl::StrCat(what, " does not start with '{': ",
                                      QuoteBounded(absl::string_view(text.data(), text.size()))));
  }
  if (NestingDepth(text, kMaxJsonDepth) > kMaxJsonDepth) {
    return Invalid(file, absl::StrCat(what, " nests arrays and objects deeper than ", kMaxJsonDepth,
                                      " levels"));
  }
  std::vector<std::set<std::string>> open_objects;  // the keys of each object being parsed
  std::string duplicate;
  const nlohmann::json::parser_callback_t cb =
      [&](int /*depth*/, nlohmann::json::parse_event_t event, nlohmann::json& parsed) {
        using Event = nlohmann::json::parse_event_t;
        if (event == Event::object_start) {
          open_objects.emplace_back();
        } else if (event == Event::object_end) {
          if (!open_objects.empty()) open_objects.pop_back();
        } else if (event == Event::key && parsed.is_string() && !open_objects.empty()) {
          if (!open_objects.back().insert(parsed.get<std::string>()).second && duplicate.empty()) {
            duplicate = parsed.get<std::string>();
          }
        }
        return true;
      };
  nlohmann::json j;
  try {
    j = nlohmann::json::parse(text, cb);
  } catch (const nlohmann::json::parse_error& e) {
    return Invalid(file, absl::StrCat(what, " is not valid JSON (at byte ", e.byte, ")"));
  } catch (const nlohmann::json::exception& e) {
    // out_of_range: a number that overflows (found by safetensors_fuzzer).
    return Invalid(file, absl::StrCat(what, " is not valid JSON (error ", e.id, ")"));
  }
  if (!duplicate.empty()) {
    return Invalid(file, absl::StrCat(what, " has the key ", QuoteBounded(duplicate), " twice"));
  }
  if (!j.is_object()) return Invalid(file, absl::StrCat(what, " is not a JSON object"));
  return j;
}

}  // namespace fp8rt
