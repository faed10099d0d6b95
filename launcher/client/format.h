// How the fp8rt CLI writes the controller's messages: JSON documents for scripts (--json) and
// aligned tables for people.
//
// Defines:
//   ToJson                 a protobuf message as JSON (the CLI's --json mapping, below)
//   EnumWord, EnumWords    an enum value as the word the run spec YAML uses ("delayed")
//   ParseEnumWord          a word given on the command line -> the enum value, or an error
//                          naming the flag
//   Table                  columns padded to their widest cell
//   FormatUnixMs, FormatBytes, FormatPercent   cells
//   NaturalLess            "blocks.2" before "blocks.10"
//
// The --json mapping differs from protobuf's canonical JSON on purpose: every field is written
// (defaults included, so a script never meets a missing key), in the proto's field order, names
// are the proto field names (snake_case, like the run spec YAML), 64-bit integers are JSON
// numbers (not strings), enums are the lower-case value name without the enum's prefix
// (RUN_STATE_STOPPING -> "stopping", TENSOR_ROLE_GRAD_OUTPUT -> "grad_output"), a float is
// written with the shortest digits that read back as the same float (42.666668, not the
// 42.66666793823242 of its double), and a NaN or infinite number is null.
//
// Stateless and thread-safe.
#ifndef FP8RT_LAUNCHER_CLIENT_FORMAT_H_
#define FP8RT_LAUNCHER_CLIENT_FORMAT_H_

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/statusor.h"
#include "google/protobuf/descriptor.h"
#include "google/protobuf/message.h"
#include "nlohmann/json.hpp"

namespace fp8rt::cli {

nlohmann::ordered_json ToJson(const google::protobuf::Message& message);

// The word of the value `number` of `type` (its number as text when the type has no such value).
std::string EnumWord(const google::protobuf::EnumDescriptor* type, int number);
// The words of every value except the *_UNSPECIFIED one, in declaration order.
std::vector<std::string> EnumWords(const google::protobuf::EnumDescriptor* type);
// The value whose word is `word` (case-insensitive); the *_UNSPECIFIED value is not accepted.
// InvalidArgument "<flag>: expected one of a, b, c, got 'word'".
[[nodiscard]] absl::StatusOr<int> ParseEnumWord(const google::protobuf::EnumDescriptor* type,
                                                const std::string& word, const std::string& flag);

class Table {
 public:
  enum class Align { kLeft, kRight };
  struct Column {
    std::string title;
    Align align = Align::kLeft;
  };

  explicit Table(std::vector<Column> columns) : columns_(std::move(columns)) {}

  // `cells` has one entry per column.
  void AddRow(std::vector<std::string> cells);
  // The header and the rows, each line ending in '\n', columns two spaces apart, no trailing
  // spaces.
  std::string Render() const;

 private:
  std::vector<Column> columns_;                 // fixed at construction
  std::vector<std::vector<std::string>> rows_;  // in the order added
};

// "2026-11-29 12:34:56Z" (UTC); "-" for 0.
std::string FormatUnixMs(int64_t unix_ms);
// "512 B", "1.5 KiB", "3.2 GiB".
std::string FormatBytes(uint64_t bytes);
// A ratio as a percentage with 4 decimals ("1.2500" for 0.0125); "-" for NaN.
std::string FormatPercent(double ratio);

// Compares strings with runs of digits compared as numbers, so that layer names sort the way the
// model stacks them (blocks.2 before blocks.10).
bool NaturalLess(std::string_view a, std::string_view b);

}  // namespace fp8rt::cli

#endif  // FP8RT_LAUNCHER_CLIENT_FORMAT_H_
