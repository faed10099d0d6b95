// Learnable text for training tests that need no data files (the GPU machines have none):
// sentences of nine words from a sixteen-word vocabulary, chosen by a fixed recurrence.
#ifndef FP8RT_TESTS_SUPPORT_LEARNABLE_TEXT_H_
#define FP8RT_TESTS_SUPPORT_LEARNABLE_TEXT_H_

#include <cstddef>
#include <cstdint>
#include <string>

namespace fp8rt::test {

// At least `bytes` bytes of it; the same text on every call.
inline std::string LearnableText(size_t bytes) {
  static const char* kWords[] = {"the",    "model",  "learns", "to",  "predict", "next",
                                 "byte",   "of",     "text",   "in",  "fp8",     "while",
                                 "scales", "follow", "each",   "amax"};
  std::string text;
  uint32_t x = 12345;
  while (text.size() < bytes) {
    for (int w = 0; w < 9; ++w) {
      x = x * 1664525u + 1013904223u;
      text += kWords[(x >> 20) % 16];
      text += w == 8 ? ".\n" : " ";
    }
  }
  return text;
}

}  // namespace fp8rt::test

#endif  // FP8RT_TESTS_SUPPORT_LEARNABLE_TEXT_H_
