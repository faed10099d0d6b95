// JSON, enum words, tables and cells (see format.h). Contents:
//   FieldValue, ToJson                   the --json mapping, by reflection
//   EnumPrefix, EnumWord(s), ParseEnumWord
//   Table
//   FormatUnixMs, FormatBytes, FormatPercent, NaturalLess
#include "launcher/client/format.h"

#include <algorithm>
#include <cctype>
#include <charconv>
#include <cmath>
#include <cstdlib>
#include <ctime>

#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"

namespace fp8rt::cli {
namespace {

namespace pb = google::protobuf;

using Json = nlohmann::ordered_json;

Json Number(double value) { return std::isfinite(value) ? Json(value) : Json(nullptr); }

// The double whose shortest decimal form is the float's shortest decimal form.
Json Number(float value) {
  if (!std::isfinite(value)) return nullptr;
  char text[32];
  const std::to_chars_result end = std::to_chars(text, text + sizeof(text), value);
  *end.ptr = '\0';
  return std::strtod(text, nullptr);
}

// One value of `field` in `message`: element `index` of a repeated field, or the field itself
// when index is -1.
Json FieldValue(const pb::Message& message, const pb::FieldDescriptor* field, int index) {
  const pb::Reflection* r = message.GetReflection();
  const bool rep = index >= 0;
  switch (field->cpp_type()) {
    case pb::FieldDescriptor::CPPTYPE_INT32:
      return rep ? r->GetRepeatedInt32(message, field, index) : r->GetInt32(message, field);
    case pb::FieldDescriptor::CPPTYPE_INT64:
      return rep ? r->GetRepeatedInt64(message, field, index) : r->GetInt64(message, field);
    case pb::FieldDescriptor::CPPTYPE_UINT32:
      return rep ? r->GetRepeatedUInt32(message, field, index) : r->GetUInt32(message, field);
    case pb::FieldDescriptor::CPPTYPE_UINT64:
      return rep ? r->GetRepeatedUInt64(message, field, index) : r->GetUInt64(message, field);
    case pb::FieldDescriptor::CPPTYPE_DOUBLE:
      return Number(rep ? r->GetRepeatedDouble(message, field, index)
                        : r->GetDouble(message, field));
    case pb::FieldDescriptor::CPPTYPE_FLOAT:
      return Number(rep ? r->GetRepeatedFloat(message, field, index) : r->GetFloat(message, field));
    case pb::FieldDescriptor::CPPTYPE_BOOL:
      return rep ? r->GetRepeatedBool(message, field, index) : r->GetBool(message, field);
    case pb::FieldDescriptor::CPPTYPE_ENUM:
      return EnumWord(field->enum_type(), rep ? r->GetRepeatedEnumValue(message, field, index)
                                              : r->GetEnumValue(message, field));
    case pb::FieldDescriptor::CPPTYPE_STRING:
      return rep ? r->GetRepeatedString(message, field, index) : r->GetString(message, field);
    case pb::FieldDescriptor::CPPTYPE_MESSAGE:
      return ToJson(rep ? r->GetRepeatedMessage(message, field, index)
                        : r->GetMessage(message, field));
  }
  return nullptr;
}

// The prefix of a value name that the enum's *_UNSPECIFIED value carries ("SCALING_").
std::string EnumPrefix(const pb::EnumDescriptor* type) {
  constexpr absl::string_view kSuffix = "UNSPECIFIED";
  const std::string& zero = type->value(0)->name();
  if (absl::EndsWith(zero, kSuffix)) return zero.substr(0, zero.size() - kSuffix.size());
  return "";
}

}  // namespace

Json ToJson(const pb::Message& message) {
  Json out = Json::object();
  const pb::Descriptor* descriptor = message.GetDescriptor();
  for (int i = 0; i < descriptor->field_count(); ++i) {
    const pb::FieldDescriptor* field = descriptor->field(i);
    if (field->is_repeated()) {
      Json values = Json::array();
      const int size = message.GetReflection()->FieldSize(message, field);
      for (int j = 0; j < size; ++j) values.push_back(FieldValue(message, field, j));
      out[field->name()] = std::move(values);
    } else {
      out[field->name()] = FieldValue(message, field, -1);
    }
  }
  return out;
}

std::string EnumWord(const pb::EnumDescriptor* type, int number) {
  const pb::EnumValueDescriptor* value = type->FindValueByNumber(number);
  if (value == nullptr) return absl::StrCat(number);
  const std::string prefix = EnumPrefix(type);
  absl::string_view name = value->name();
  if (absl::StartsWith(name, prefix)) name.remove_prefix(prefix.size());
  return absl::AsciiStrToLower(name);
}

std::vector<std::string> EnumWords(const pb::EnumDescriptor* type) {
  std::vector<std::string> words;
  for (int i = 0; i < type->value_count(); ++i) {
    if (type->value(i)->number() == 0) continue;
    words.push_back(EnumWord(type, type->value(i)->number()));
  }
  return words;
}

absl::StatusOr<int> ParseEnumWord(const pb::EnumDescriptor* type, const std::string& word,
                                  const std::string& flag) {
  const std::string lower = absl::AsciiStrToLower(word);
  for (int i = 0; i < type->value_count(); ++i) {
    const int number = type->value(i)->number();
    if (number != 0 && EnumWord(type, number) == lower) return number;
  }
  return absl::InvalidArgumentError(absl::StrCat(
      flag, ": expected one of ", absl::StrJoin(EnumWords(type), ", "), ", got '", word, "'"));
}

void Table::AddRow(std::vector<std::string> cells) {
  cells.resize(columns_.size());
  rows_.push_back(std::move(cells));
}

std::string Table::Render() const {
  std::vector<size_t> widths(columns_.size());
  for (size_t c = 0; c < columns_.size(); ++c) {
    widths[c] = columns_[c].title.size();
    for (const auto& row : rows_) widths[c] = std::max(widths[c], row[c].size());
  }
  auto render_line = [&](const std::vector<std::string>& cells) {
    std::string line;
    for (size_t c = 0; c < cells.size(); ++c) {
      if (c > 0) line += "  ";
      const std::string pad(widths[c] - cells[c].size(), ' ');
      line += columns_[c].align == Align::kRight ? pad + cells[c] : cells[c] + pad;
    }
    line.erase(line.find_last_not_of(' ') + 1);
    return line + "\n";
  };
  std::vector<std::string> titles;
  for (const Column& column : columns_) titles.push_back(column.title);
  std::string out = render_line(titles);
  for (const auto& row : rows_) out += render_line(row);
  return out;
}

std::string FormatUnixMs(int64_t unix_ms) {
  if (unix_ms == 0) return "-";
  const std::time_t seconds = static_cast<std::time_t>(unix_ms / 1000);
  std::tm tm{};
  gmtime_r(&seconds, &tm);
  char text[32];
  std::strftime(text, sizeof(text), "%Y-%m-%d %H:%M:%SZ", &tm);
  return text;
}

std::string FormatBytes(uint64_t bytes) {
  if (bytes < 1024) return absl::StrCat(bytes, " B");
  constexpr const char* kUnits[] = {"KiB", "MiB", "GiB", "TiB", "PiB"};
  double value = static_cast<double>(bytes) / 1024;
  size_t unit = 0;
  while (value >= 1024 && unit + 1 < std::size(kUnits)) {
    value /= 1024;
    ++unit;
  }
  return absl::StrFormat("%.1f %s", value, kUnits[unit]);
}

std::string FormatPercent(double ratio) {
  if (std::isnan(ratio)) return "-";
  return absl::StrFormat("%.4f", ratio * 100);
}

bool NaturalLess(std::string_view a, std::string_view b) {
  size_t i = 0, j = 0;
  auto is_digit = [](char c) { return std::isdigit(static_cast<unsigned char>(c)) != 0; };
  while (i < a.size() && j < b.size()) {
    if (is_digit(a[i]) && is_digit(b[j])) {
      // Compare the digit runs as numbers: skip leading zeros, then the longer run is larger.
      size_t ie = i, je = j;
      while (ie < a.size() && is_digit(a[ie])) ++ie;
      while (je < b.size() && is_digit(b[je])) ++je;
      std::string_view da = a.substr(i, ie - i), db = b.substr(j, je - j);
      da.remove_prefix(std::min(da.find_first_not_of('0'), da.size()));
      db.remove_prefix(std::min(db.find_first_not_of('0'), db.size()));
      if (da.size() != db.size()) return da.size() < db.size();
      if (da != db) return da < db;
      i = ie;
      j = je;
    } else {
      if (a[i] != b[j]) return a[i] < b[j];
      ++i;
      ++j;
    }
  }
  return a.size() - i < b.size() - j;
}

}  // namespace fp8rt::cli
