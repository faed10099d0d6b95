// GlobMatch: shell-style matching of names against a pattern, for layer selections
// (precision.overrides' `layers`): "*" matches any run of characters (also none), "?" exactly
// one, every other character itself. No character classes, no escapes.
#ifndef FP8RT_RUNTIME_CORE_GLOB_H_
#define FP8RT_RUNTIME_CORE_GLOB_H_

#include <cstddef>
#include <string_view>

namespace fp8rt {

// Whether the whole of `text` matches `pattern`. Linear in pattern.size() * text.size() at worst
// (one backtrack point: the last "*").
inline bool GlobMatch(std::string_view pattern, std::string_view text) {
  size_t p = 0, t = 0;
  size_t star = std::string_view::npos, resume = 0;
  while (t < text.size()) {
    if (p < pattern.size() && (pattern[p] == '?' || pattern[p] == text[t])) {
      ++p;
      ++t;
    } else if (p < pattern.size() && pattern[p] == '*') {
      star = p++;
      resume = t;
    } else if (star != std::string_view::npos) {
      p = star + 1;
      t = ++resume;
    } else {
      return false;
    }
  }
  while (p < pattern.size() && pattern[p] == '*') ++p;
  return p == pattern.size();
}

}  // namespace fp8rt

#endif  // FP8RT_RUNTIME_CORE_GLOB_H_
