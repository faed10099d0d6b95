// Run spec loading (see run_spec.h). Contents:
//   RunSpecDefaults          the one place defaults are written
//   Parser                   YAML node -> message fields by reflection, with typed errors
//   ApplyOverride            "dotted.path=value" -> the same walk
//   ParseRunSpec/LoadRunSpec the entry points
//   ValidateRunSpec          cross-field checks
#include "runtime/spec/run_spec.h"

#include <yaml-cpp/yaml.h>

#include <algorithm>
#include <cctype>
#include <charconv>
#include <cmath>
#include <cstdint>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <limits>
#include <optional>
#include <set>
#include <sstream>
#include <string>
#include <string_view>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "google/protobuf/descriptor.h"
#include "google/protobuf/message.h"
#include "runtime/core/glob.h"
#include "runtime/core/quote.h"
#include "runtime/core/safetensors.h"
#include "runtime/core/status.h"

namespace fp8rt {

v1::RunSpec RunSpecDefaults() {
  v1::RunSpec spec;
  using P = v1::RunSpec::Precision;
  auto* parallel = spec.mutable_parallel();
  parallel->set_dp(1);
  parallel->set_tp(1);
  parallel->set_ep(1);
  parallel->set_reshard_after_forward(true);
  auto* precision = spec.mutable_precision();
  precision->set_mode(P::MODE_FP8);
  precision->set_format(P::FORMAT_HYBRID);
  precision->set_scaling(P::SCALING_DELAYED);
  precision->set_amax_history_len(16);
  precision->set_amax_compute_algo(P::AMAX_COMPUTE_ALGO_MAX);
  precision->set_margin(0);
  precision->set_fsdp_gather(P::FSDP_GATHER_FP8);
  precision->set_grad_reduce(P::GRAD_REDUCE_FP32);
  precision->set_save_fp8_activations(true);
  precision->set_fp8_fast_accum_forward(true);
  auto* train = spec.mutable_train();
  train->set_micro_batch(1);
  train->set_grad_accum(1);
  train->set_seed(1);
  train->set_lr(3e-4);
  train->set_warmup(0);
  train->set_min_lr(0.0);
  train->set_weight_decay(0.1);
  train->set_clip(1.0);
  spec.mutable_data()->set_format(v1::RunSpec::Data::FORMAT_TEXT);
  spec.mutable_data()->set_shuffle(true);
  spec.mutable_data()->set_val_fraction(0.0);
  spec.mutable_eval()->set_every(0);
  spec.mutable_eval()->set_batches(8);
  spec.mutable_checkpoint()->set_every(0);
  spec.mutable_checkpoint()->set_keep(3);
  spec.mutable_metrics()->set_every(1);
  spec.mutable_metrics()->set_per_rank_fp8_stats(false);
  spec.mutable_health()->set_intervals(3);
  v1::RunSpec::Moe* moe = spec.mutable_moe();
  moe->set_experts(0);
  moe->set_top_k(2);
  moe->set_every(1);
  moe->set_capacity_factor(1.25);
  moe->set_aux_loss_coef(0.01);
  moe->set_drop_tokens(true);
  spec.set_device(v1::RunSpec::DEVICE_CPU);
  return spec;
}

namespace {

namespace pb = google::protobuf;
namespace fs = std::filesystem;

// Keys that have no default, in the order they are reported.
constexpr const char* kRequiredKeys[] = {
    "model.layers",  "model.d_model", "model.heads", "model.d_ff",
    "model.seq_len", "model.vocab",   "train.steps", "data.path",
};

std::string Lower(std::string s) {
  for (char& c : s) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  return s;
}

size_t EditDistance(const std::string& a, const std::string& b) {
  std::vector<size_t> row(b.size() + 1);
  for (size_t j = 0; j <= b.size(); ++j) row[j] = j;
  for (size_t i = 1; i <= a.size(); ++i) {
    size_t diag = row[0];
    row[0] = i;
    for (size_t j = 1; j <= b.size(); ++j) {
      const size_t up = row[j];
      row[j] = std::min({row[j] + 1, row[j - 1] + 1, diag + (a[i - 1] == b[j - 1] ? 0 : 1)});
      diag = up;
    }
  }
  return row[b.size()];
}

// "unknown key (did you mean X?)" when a field name is close, else the list of valid keys.
std::string UnknownKeyMessage(const std::string& key, const pb::Descriptor* desc) {
  std::vector<std::string> names;
  std::string best;
  size_t best_distance = std::numeric_limits<size_t>::max();
  for (int i = 0; i < desc->field_count(); ++i) {
    const std::string& name = desc->field(i)->name();
    names.push_back(name);
    const size_t d = EditDistance(Lower(key), name);
    if (d < best_distance) {
      best_distance = d;
      best = name;
    }
  }
  const size_t limit = std::max<size_t>(2, key.size() / 2);
  if (!best.empty() && best_distance <= limit) {
    return absl::StrCat("unknown key (did you mean ", best, "?)");
  }
  return absl::StrCat("unknown key (expected one of ", absl::StrJoin(names, ", "), ")");
}

// The YAML spelling of an enum's values: the lower-case value name without the prefix its
// *_UNSPECIFIED value carries ("MODE_FP8" -> "fp8"). The unspecified value is not listed.
std::string EnumPrefix(const pb::EnumDescriptor* e) {
  const std::string& zero = e->value(0)->name();
  constexpr std::string_view kSuffix = "UNSPECIFIED";
  if (zero.size() >= kSuffix.size() &&
      zero.compare(zero.size() - kSuffix.size(), kSuffix.size(), kSuffix) == 0) {
    return zero.substr(0, zero.size() - kSuffix.size());
  }
  return "";
}

std::vector<std::pair<std::string, int>> EnumChoices(const pb::EnumDescriptor* e) {
  const std::string prefix = EnumPrefix(e);
  std::vector<std::pair<std::string, int>> out;
  for (int i = 0; i < e->value_count(); ++i) {
    const pb::EnumValueDescriptor* v = e->value(i);
    if (v->number() == 0) continue;
    std::string name = v->name();
    if (name.compare(0, prefix.size(), prefix) == 0) name = name.substr(prefix.size());
    out.emplace_back(Lower(name), v->number());
  }
  return out;
}

// How a node reads in "got ..." messages.
std::string Describe(const YAML::Node& node) {
  switch (node.Type()) {
    case YAML::NodeType::Scalar:
      return absl::StrCat(node.Tag() == "!" ? "the quoted string '" : "'", node.Scalar(), "'");
    case YAML::NodeType::Sequence:
      return "a list";
    case YAML::NodeType::Map:
      return "a map";
    default:
      return "an empty value";
  }
}

bool ParseInt64(std::string_view s, int64_t* out) {
  if (!s.empty() && s[0] == '+') s.remove_prefix(1);
  if (s.empty()) return false;
  const auto [ptr, ec] = std::from_chars(s.data(), s.data() + s.size(), *out);
  return ec == std::errc() && ptr == s.data() + s.size();
}

bool ParseUint64(std::string_view s, uint64_t* out) {
  if (!s.empty() && s[0] == '+') s.remove_prefix(1);
  if (s.empty() || s[0] == '-') return false;
  const auto [ptr, ec] = std::from_chars(s.data(), s.data() + s.size(), *out);
  return ec == std::errc() && ptr == s.data() + s.size();
}

bool ParseDouble(std::string_view s, double* out) {
  if (!s.empty() && s[0] == '+') s.remove_prefix(1);
  if (s.empty()) return false;
  const auto [ptr, ec] = std::from_chars(s.data(), s.data() + s.size(), *out);
  return ec == std::errc() && ptr == s.data() + s.size() && std::isfinite(*out);
}

// Maps YAML onto messages for one source (the file, or one override).
class Parser {
 public:
  // `source` starts every error; `positions` says whether YAML marks are meaningful there.
  // `seen` collects the paths of scalar fields set (for the required-key check).
  Parser(std::string source, bool positions, std::set<std::string>* seen)
      : source_(std::move(source)), positions_(positions), seen_(seen) {}

  absl::Status Error(const YAML::Mark& mark, const std::string& path,
                     const std::string& message) const {
    std::string where = source_;
    if (positions_ && mark.line >= 0) {
      absl::StrAppend(&where, ":", mark.line + 1, ":", mark.column + 1);
    }
    return absl::InvalidArgumentError(
        absl::StrCat(where, ": ", path.empty() ? "" : path + ": ", message));
  }

  // Fills `msg` from a YAML map (null = empty map). `path` is the message's own dotted path.
  absl::Status ApplyMap(const YAML::Node& node, const YAML::Mark& mark, const std::string& path,
                        pb::Message* msg) {
    const pb::Descriptor* desc = msg->GetDescriptor();
    if (node.IsNull()) return absl::OkStatus();
    if (!node.IsMap()) {
      std::vector<std::string> names;
      for (int i = 0; i < desc->field_count(); ++i) names.push_back(desc->field(i)->name());
      return Error(MarkOf(node, mark), path,
                   absl::StrCat("expected a map of keys (", absl::StrJoin(names, ", "), "), got ",
                                Describe(node)));
    }
    std::set<std::string> keys;
    for (const auto& entry : node) {
      // Copies: Node is a handle, and the iterator's pairs are temporaries.
      const YAML::Node key = entry.first;
      const YAML::Node value = entry.second;
      if (!key.IsScalar()) {
        return Error(key.Mark(), path, absl::StrCat("expected a key name, got ", Describe(key)));
      }
      const std::string& name = key.Scalar();
      const std::string field_path = path.empty() ? name : absl::StrCat(path, ".", name);
      const pb::FieldDescriptor* field = desc->FindFieldByName(name);
      if (field == nullptr) {
        return Error(key.Mark(), field_path, UnknownKeyMessage(name, desc));
      }
      if (!keys.insert(name).second) return Error(key.Mark(), field_path, "duplicate key");
      FP8RT_RETURN_IF_ERROR(ApplyField(value, key.Mark(), field_path, field, msg));
    }
    return absl::OkStatus();
  }

  // Sets one field of `msg` from `node`; `key_mark` locates errors about empty values.
  absl::Status ApplyField(const YAML::Node& node, const YAML::Mark& key_mark,
                          const std::string& path, const pb::FieldDescriptor* field,
                          pb::Message* msg) {
    const pb::Reflection* refl = msg->GetReflection();
    if (field->is_map()) return Error(key_mark, path, "map fields are not supported");
    if (field->cpp_type() == pb::FieldDescriptor::CPPTYPE_MESSAGE && !field->is_repeated()) {
      return ApplyMap(node, key_mark, path, refl->MutableMessage(msg, field));
    }
    if (field->is_repeated()) {
      if (field->cpp_type() == pb::FieldDescriptor::CPPTYPE_MESSAGE) {
        // A list of sections (precision.overrides): each item a map of its own fields.
        if (!node.IsSequence() && !node.IsNull()) {
          return Error(MarkOf(node, key_mark), path,
                       absl::StrCat("expected a list of maps, got ", Describe(node)));
        }
        refl->ClearField(msg, field);
        if (node.IsSequence()) {
          size_t i = 0;
          for (const YAML::Node& item : node) {
            const std::string item_path = absl::StrCat(path, "[", i++, "]");
            if (!item.IsMap()) {
              return Error(MarkOf(item, key_mark), item_path,
                           absl::StrCat("expected a map, got ", Describe(item)));
            }
            FP8RT_RETURN_IF_ERROR(
                ApplyMap(item, MarkOf(item, key_mark), item_path, refl->AddMessage(msg, field)));
          }
        }
        seen_->insert(path);
        return absl::OkStatus();
      }
      std::vector<YAML::Node> items;
      if (node.IsSequence()) {
        for (const YAML::Node& item : node) items.push_back(item);
      } else if (node.IsScalar() && !positions_ &&
                 field->cpp_type() == pb::FieldDescriptor::CPPTYPE_STRING) {
        // Override values may be comma-separated: precision.exclude=a,b
        for (const std::string& part :
             std::vector<std::string>(absl::StrSplit(node.Scalar(), ','))) {
          items.push_back(YAML::Node(part));
        }
      } else if (!node.IsNull()) {
        return Error(MarkOf(node, key_mark), path,
                     absl::StrCat("expected a list of ", TypeName(field, /*plural=*/true), ", got ",
                                  Describe(node)));
      }
      refl->ClearField(msg, field);
      for (size_t i = 0; i < items.size(); ++i) {
        FP8RT_RETURN_IF_ERROR(SetScalar(items[i], MarkOf(node, key_mark),
                                        absl::StrCat(path, "[", i, "]"), field, msg));
      }
      seen_->insert(path);
      return absl::OkStatus();
    }
    FP8RT_RETURN_IF_ERROR(SetScalar(node, key_mark, path, field, msg));
    seen_->insert(path);
    return absl::OkStatus();
  }

 private:
  // A node's own mark, or the key's where the node has none (an empty value).
  static YAML::Mark MarkOf(const YAML::Node& node, const YAML::Mark& fallback) {
    return node.IsNull() || node.Mark().line < 0 ? fallback : node.Mark();
  }

  static std::string TypeName(const pb::FieldDescriptor* field, bool plural) {
    switch (field->cpp_type()) {
      case pb::FieldDescriptor::CPPTYPE_INT32:
      case pb::FieldDescriptor::CPPTYPE_INT64:
        return plural ? "integers" : "an integer";
      case pb::FieldDescriptor::CPPTYPE_UINT32:
      case pb::FieldDescriptor::CPPTYPE_UINT64:
        return plural ? "non-negative integers" : "a non-negative integer";
      case pb::FieldDescriptor::CPPTYPE_FLOAT:
      case pb::FieldDescriptor::CPPTYPE_DOUBLE:
        return plural ? "numbers" : "a number";
      case pb::FieldDescriptor::CPPTYPE_BOOL:
        return plural ? "booleans" : "true or false";
      case pb::FieldDescriptor::CPPTYPE_ENUM: {
        std::vector<std::string> names;
        for (const auto& [name, number] : EnumChoices(field->enum_type())) names.push_back(name);
        return absl::StrCat(plural ? "values from " : "one of ", absl::StrJoin(names, ", "));
      }
      case pb::FieldDescriptor::CPPTYPE_STRING:
        return plural ? "strings" : "a string";
      case pb::FieldDescriptor::CPPTYPE_MESSAGE:
        return plural ? "maps" : "a map";
    }
    return "a value";
  }

  // Sets (or, for a repeated field, adds) one scalar value.
  absl::Status SetScalar(const YAML::Node& node, const YAML::Mark& key_mark,
                         const std::string& path, const pb::FieldDescriptor* field,
                         pb::Message* msg) {
    const pb::Reflection* refl = msg->GetReflection();
    const bool repeated = field->is_repeated();
    const YAML::Mark mark = MarkOf(node, key_mark);
    auto mismatch = [&]() {
      return Error(mark, path,
                   absl::StrCat("expected ", TypeName(field, false), ", got ", Describe(node)));
    };
    if (!node.IsScalar()) return mismatch();
    const std::string& text = node.Scalar();
    // A quoted scalar is a string: "10" is not an integer.
    const bool quoted = node.Tag() == "!";
    switch (field->cpp_type()) {
      case pb::FieldDescriptor::CPPTYPE_INT32:
      case pb::FieldDescriptor::CPPTYPE_INT64: {
        int64_t v = 0;
        if (quoted || !ParseInt64(text, &v)) return mismatch();
        if (field->cpp_type() == pb::FieldDescriptor::CPPTYPE_INT32) {
          if (v < std::numeric_limits<int32_t>::min() || v > std::numeric_limits<int32_t>::max()) {
            return Error(mark, path, absl::StrCat("value ", text, " is out of the 32-bit range"));
          }
          repeated ? refl->AddInt32(msg, field, static_cast<int32_t>(v))
                   : refl->SetInt32(msg, field, static_cast<int32_t>(v));
        } else {
          repeated ? refl->AddInt64(msg, field, v) : refl->SetInt64(msg, field, v);
        }
        return absl::OkStatus();
      }
      case pb::FieldDescriptor::CPPTYPE_UINT32:
      case pb::FieldDescriptor::CPPTYPE_UINT64: {
        uint64_t v = 0;
        if (quoted || !ParseUint64(text, &v)) return mismatch();
        if (field->cpp_type() == pb::FieldDescriptor::CPPTYPE_UINT32) {
          if (v > std::numeric_limits<uint32_t>::max()) {
            return Error(mark, path, absl::StrCat("value ", text, " is out of the 32-bit range"));
          }
          repeated ? refl->AddUInt32(msg, field, static_cast<uint32_t>(v))
                   : refl->SetUInt32(msg, field, static_cast<uint32_t>(v));
        } else {
          repeated ? refl->AddUInt64(msg, field, v) : refl->SetUInt64(msg, field, v);
        }
        return absl::OkStatus();
      }
      case pb::FieldDescriptor::CPPTYPE_FLOAT:
      case pb::FieldDescriptor::CPPTYPE_DOUBLE: {
        double v = 0;
        if (quoted || !ParseDouble(text, &v)) return mismatch();
        if (field->cpp_type() == pb::FieldDescriptor::CPPTYPE_FLOAT) {
          repeated ? refl->AddFloat(msg, field, static_cast<float>(v))
                   : refl->SetFloat(msg, field, static_cast<float>(v));
        } else {
          repeated ? refl->AddDouble(msg, field, v) : refl->SetDouble(msg, field, v);
        }
        return absl::OkStatus();
      }
      case pb::FieldDescriptor::CPPTYPE_BOOL: {
        const std::string lower = Lower(text);
        if (quoted || (lower != "true" && lower != "false")) return mismatch();
        repeated ? refl->AddBool(msg, field, lower == "true")
                 : refl->SetBool(msg, field, lower == "true");
        return absl::OkStatus();
      }
      case pb::FieldDescriptor::CPPTYPE_ENUM: {
        const std::string lower = Lower(text);
        for (const auto& [name, number] : EnumChoices(field->enum_type())) {
          if (name == lower) {
            repeated ? refl->AddEnumValue(msg, field, number)
                     : refl->SetEnumValue(msg, field, number);
            return absl::OkStatus();
          }
        }
        return mismatch();
      }
      case pb::FieldDescriptor::CPPTYPE_STRING:
        repeated ? refl->AddString(msg, field, text) : refl->SetString(msg, field, text);
        return absl::OkStatus();
      case pb::FieldDescriptor::CPPTYPE_MESSAGE:
        break;
    }
    return mismatch();
  }

  const std::string source_;
  const bool positions_;
  std::set<std::string>* const seen_;
};

// Applies one "dotted.path=value" override.
absl::Status ApplyOverride(const std::string& text, std::set<std::string>* seen,
                           v1::RunSpec* spec) {
  Parser parser(absl::StrCat("override '", text, "'"), /*positions=*/false, seen);
  const YAML::Mark none = YAML::Mark::null_mark();
  const size_t eq = text.find('=');
  if (eq == std::string::npos || eq == 0) {
    return parser.Error(none, "", "expected KEY=VALUE, e.g. train.steps=20");
  }
  const std::string key = text.substr(0, eq);
  const std::vector<std::string> parts = absl::StrSplit(key, '.');
  pb::Message* msg = spec;
  std::string path;
  for (size_t i = 0; i < parts.size(); ++i) {
    const std::string parent = path;
    path = path.empty() ? parts[i] : absl::StrCat(path, ".", parts[i]);
    if (msg == nullptr) {
      return parser.Error(none, path, absl::StrCat("unknown key (", parent, " is not a section)"));
    }
    const pb::FieldDescriptor* field = msg->GetDescriptor()->FindFieldByName(parts[i]);
    if (field == nullptr) {
      return parser.Error(none, path, UnknownKeyMessage(parts[i], msg->GetDescriptor()));
    }
    if (i + 1 == parts.size()) {
      YAML::Node value;
      try {
        value = YAML::Load(text.substr(eq + 1));
      } catch (const YAML::Exception& e) {
        return parser.Error(none, path, absl::StrCat("invalid YAML value: ", e.msg));
      }
      return parser.ApplyField(value, none, path, field, msg);
    }
    const bool section =
        field->cpp_type() == pb::FieldDescriptor::CPPTYPE_MESSAGE && !field->is_repeated();
    msg = section ? msg->GetReflection()->MutableMessage(msg, field) : nullptr;
  }
  return absl::OkStatus();  // not reached: the loop returns on its last part
}

// "a.b" of a field and the path of its message.
std::string Join(const std::string& prefix, const std::string& name) {
  return prefix.empty() ? name : absl::StrCat(prefix, ".", name);
}

// Enums added after specs were first stored (controller state, programs building a RunSpec by
// hand) whose zero value means their default instead of "not set".
constexpr const char* kUnsetMeansDefault[] = {"device", "model.family", "model.norm", "model.mlp",
                                               "model.positions", "health.action"};

bool UnsetMeansDefault(const std::string& path) {
  return std::any_of(std::begin(kUnsetMeansDefault), std::end(kUnsetMeansDefault),
                     [&](const char* p) { return path == p; });
}

// Enums left unspecified (but those of kUnsetMeansDefault) and non-finite numbers anywhere in the
// message.
absl::Status CheckFieldsSet(const pb::Message& msg, const std::string& prefix) {
  const pb::Descriptor* desc = msg.GetDescriptor();
  const pb::Reflection* refl = msg.GetReflection();
  for (int i = 0; i < desc->field_count(); ++i) {
    const pb::FieldDescriptor* f = desc->field(i);
    if (f->is_repeated()) continue;
    const std::string path = Join(prefix, f->name());
    switch (f->cpp_type()) {
      case pb::FieldDescriptor::CPPTYPE_MESSAGE:
        FP8RT_RETURN_IF_ERROR(CheckFieldsSet(refl->GetMessage(msg, f), path));
        break;
      case pb::FieldDescriptor::CPPTYPE_ENUM:
        if (refl->GetEnumValue(msg, f) == 0 && !UnsetMeansDefault(path)) {
          return absl::InvalidArgumentError(
              absl::StrCat(path, ": not set (expected ", "a value from the schema)"));
        }
        break;
      case pb::FieldDescriptor::CPPTYPE_DOUBLE:
        if (!std::isfinite(refl->GetDouble(msg, f))) {
          return absl::InvalidArgumentError(absl::StrCat(path, ": must be finite"));
        }
        break;
      case pb::FieldDescriptor::CPPTYPE_FLOAT:
        if (!std::isfinite(refl->GetFloat(msg, f))) {
          return absl::InvalidArgumentError(absl::StrCat(path, ": must be finite"));
        }
        break;
      default:
        break;
    }
  }
  return absl::OkStatus();
}

absl::Status FieldError(const std::string& field, const std::string& message) {
  return absl::InvalidArgumentError(absl::StrCat(field, ": ", message));
}

absl::Status CheckPositive(const std::string& field, int64_t value) {
  if (value > 0) return absl::OkStatus();
  return FieldError(field, absl::StrCat("must be positive, got ", value));
}

absl::Status CheckNonNegative(const std::string& field, double value) {
  if (value >= 0) return absl::OkStatus();
  return FieldError(field, absl::StrCat("must be >= 0, got ", value));
}

absl::Status CheckReadableFile(const std::string& field, const std::string& path) {
  if (path.empty()) return FieldError(field, "is empty (a data file is required)");
  std::error_code ec;
  const fs::file_status st = fs::status(path, ec);
  if (st.type() == fs::file_type::not_found) {
    return FieldError(field, absl::StrCat("file '", path, "' does not exist"));
  }
  if (ec) return FieldError(field, absl::StrCat("cannot access '", path, "': ", ec.message()));
  if (fs::is_directory(st)) {
    return FieldError(field, absl::StrCat("'", path, "' is a directory, not a file"));
  }
  if (!fs::is_regular_file(st)) {  // a FIFO or a device would block or never end
    return FieldError(field, absl::StrCat("'", path, "' is not a regular file"));
  }
  std::ifstream in(path, std::ios::binary);
  if (!in) return FieldError(field, absl::StrCat("file '", path, "' is not readable"));
  return absl::OkStatus();
}

// The tokens a data file of `format` holds, from its size alone (TokenDataset::Open checks the
// contents later); nullopt when the size cannot be read or is not a whole number of tokens.
std::optional<uint64_t> TokensInFile(const std::string& path, v1::RunSpec::Data::Format format) {
  std::error_code ec;
  const uintmax_t bytes = fs::file_size(path, ec);
  if (ec) return std::nullopt;
  switch (format) {
    case v1::RunSpec::Data::FORMAT_TEXT:
      return bytes;
    case v1::RunSpec::Data::FORMAT_U16:
      return bytes / 2;
    case v1::RunSpec::Data::FORMAT_U32:
      return bytes / 4;
    case v1::RunSpec::Data::FORMAT_LLMC:  // a 256 x int32 header, then uint16 tokens
      if (bytes < 1024) return std::nullopt;
      return (bytes - 1024) / 2;
    default:
      return std::nullopt;
  }
}

// data.shuffle / val_path / val_fraction and the eval section (see ValidateRunSpec).
absl::Status ValidateEval(const v1::RunSpec& spec, DataFileCheck data_file) {
  const v1::RunSpec::Data& d = spec.data();
  const v1::RunSpec::Eval& e = spec.eval();
  const bool fraction = d.val_fraction() != 0.0;
  if (fraction && !(d.val_fraction() > 0.0 && d.val_fraction() < 1.0)) {
    return FieldError(
        "data.val_fraction",
        absl::StrCat("must be in (0, 1) (the held-out tail of data.path), got ", d.val_fraction()));
  }
  if (fraction && !d.val_path().empty()) {
    return FieldError("data.val_path",
                      "set together with data.val_fraction: the validation data is either a file "
                      "or the tail of data.path, not both");
  }
  FP8RT_RETURN_IF_ERROR(CheckNonNegative("eval.every", static_cast<double>(e.every())));
  if (e.every() == 0) {
    if (data_file == DataFileCheck::kCheck && !d.val_path().empty()) {
      return CheckReadableFile("data.val_path", d.val_path());
    }
    return absl::OkStatus();
  }
  FP8RT_RETURN_IF_ERROR(CheckPositive("eval.batches", e.batches()));
  if (!fraction && d.val_path().empty()) {
    return FieldError("eval.every",
                      absl::StrCat("evaluates every ", e.every(),
                                   " steps but there is no validation data: set data.val_path "
                                   "or data.val_fraction"));
  }
  if (data_file == DataFileCheck::kSkip) return absl::OkStatus();
  const std::string field = fraction ? "data.val_fraction" : "data.val_path";
  if (!fraction) FP8RT_RETURN_IF_ERROR(CheckReadableFile("data.val_path", d.val_path()));
  const std::string& file = fraction ? d.path() : d.val_path();
  const std::optional<uint64_t> total = TokensInFile(file, d.format());
  if (!total.has_value()) return absl::OkStatus();  // the data loader names the problem
  const uint64_t tokens = fraction ? *total - ValidationSplit(*total, d.val_fraction()) : *total;
  const uint64_t row = static_cast<uint64_t>(std::max(1, spec.model().seq_len())) + 1;
  const uint64_t windows = tokens / row;
  const uint64_t need = static_cast<uint64_t>(e.batches()) *
                        static_cast<uint64_t>(std::max(1, spec.train().micro_batch())) *
                        static_cast<uint64_t>(std::max(1, spec.parallel().dp()));
  if (windows < need) {
    return FieldError(
        field, absl::StrCat(fraction ? "the held-out tail of '" : "'", file, "' holds ", tokens,
                            " tokens, ", windows, " windows of model.seq_len + 1 = ", row,
                            " tokens; eval needs eval.batches * train.micro_batch * parallel.dp = ",
                            e.batches(), " * ", spec.train().micro_batch(), " * ",
                            spec.parallel().dp(), " = ", need, " windows"));
  }
  return absl::OkStatus();
}

}  // namespace

namespace {

// The rows one FP8 weight block spans under `spec`'s recipe (the most of the section's and the
// overrides' that leave a layer in FP8): 128 block, 32 mx32, 1; 0 outside fp8 mode.
int64_t RowsPerWeightBlock(const v1::RunSpec& spec) {
  using P = v1::RunSpec::Precision;
  const P& p = spec.precision();
  if (p.mode() != P::MODE_FP8) return 0;
  auto rows = [](P::Scaling s) -> int64_t {
    return s == P::SCALING_BLOCK ? 128 : s == P::SCALING_MX32 ? 32 : 1;
  };
  int64_t need = rows(p.scaling());
  for (const P::Override& o : p.overrides()) {
    if (o.mode() != P::MODE_BF16) need = std::max(need, rows(o.scaling()));
  }
  return need;
}

}  // namespace

int64_t FsdpRowUnit(const v1::RunSpec& spec) {
  const int64_t need = RowsPerWeightBlock(spec);
  if (need == 0) return 0;
  return spec.health().action() == v1::RunSpec::Health::ACTION_BLOCK_SCALING ? 128 : need;
}

absl::Status CheckLiveRecipeShards(const v1::RunSpec& run, const v1::RunSpec& merged) {
  const int64_t need = RowsPerWeightBlock(merged), unit = FsdpRowUnit(run);
  const int64_t dp = run.parallel().dp(), tp = std::max(1, run.parallel().tp());
  if (need <= 1 || dp <= 1) return absl::OkStatus();
  const v1::RunSpec::Model m = ResolveModel(run.model());
  const int64_t heads = m.heads(), kv = m.kv_heads() > 0 ? m.kv_heads() : m.heads();
  const struct {
    const char* field;
    int64_t rows;
  } pieces[] = {{"model.d_model", (heads + 2 * kv) * (m.d_model() / std::max<int64_t>(1, heads)) / tp},
                {"model.d_model", m.d_model()},
                {"model.d_ff", int64_t{m.d_ff()} / tp}};
  for (const auto& [field, rows] : pieces) {
    // model::ShardCut: unit > 0 cuts whole groups of `unit` rows; 0 (a run not in fp8 mode at
    // the start) cuts elements, whole rows only when dp divides the rows.
    const int64_t shard_rows = unit > 0 ? (rows + unit * dp - 1) / (unit * dp) * unit
                               : rows % dp == 0 ? rows / dp
                                                : -1;
    if (shard_rows < 0 || shard_rows % need != 0) {
      return FieldError(
          field, absl::StrCat("FP8 weights with ", rows,
                              " rows per tensor-parallel rank were cut into parallel.dp = ", dp,
                              " FSDP shards of ", shard_rows, " rows when the run started, which ",
                              need, "-row blocks (", need == 128 ? "block" : "mx32",
                              " scaling) would straddle; start the run with that scaling (or "
                              "health.action block_scaling) to cut them for it"));
    }
  }
  return absl::OkStatus();
}

absl::Status ValidatePrecisionOverrides(const v1::RunSpec& spec) {
  using P = v1::RunSpec::Precision;
  const P& pr = spec.precision();
  if (pr.overrides_size() == 0) return absl::OkStatus();
  if (pr.overrides_size() > kMaxPrecisionOverrides) {
    return FieldError("precision.overrides", absl::StrCat("at most ", kMaxPrecisionOverrides,
                                                          " entries, got ", pr.overrides_size()));
  }
  for (int i = 0; i < pr.overrides_size(); ++i) {
    const std::string field = absl::StrCat("precision.overrides[", i, "].layers");
    if (pr.overrides(i).layers().size() > kMaxLayerPatternBytes) {
      return FieldError(field, absl::StrCat("at most ", kMaxLayerPatternBytes, " bytes, got ",
                                            pr.overrides(i).layers().size()));
    }
  }
  if (pr.mode() != P::MODE_FP8) {
    return FieldError("precision.overrides", "per-layer recipes need precision.mode fp8");
  }
  const std::vector<std::string> layers = ModelLayerNames(spec);
  for (int i = 0; i < pr.overrides_size(); ++i) {
    const P::Override& o = pr.overrides(i);
    const std::string at = absl::StrCat("precision.overrides[", i, "]");
    if (o.layers().empty()) return FieldError(at + ".layers", "empty pattern");
    if (!P::Mode_IsValid(o.mode()) || o.mode() == P::MODE_FP32) {
      return FieldError(at + ".mode", "must be fp8 or bf16");
    }
    if (!P::Scaling_IsValid(o.scaling())) {
      return FieldError(at + ".scaling", absl::StrCat(o.scaling(), " is not a value of the enum"));
    }
    if (!P::Format_IsValid(o.format())) {
      return FieldError(at + ".format", absl::StrCat(o.format(), " is not a value of the enum"));
    }
    if (!P::AmaxComputeAlgo_IsValid(o.amax_compute_algo())) {
      return FieldError(at + ".amax_compute_algo",
                        absl::StrCat(o.amax_compute_algo(), " is not a value of the enum"));
    }
    if (o.has_margin() && (o.margin() < 0 || o.margin() > 32)) {
      return FieldError(at + ".margin", absl::StrCat("must be in [0, 32], got ", o.margin()));
    }
    if (o.amax_history_len() < 0 || o.amax_history_len() > 4096) {
      return FieldError(at + ".amax_history_len",
                        absl::StrCat("must be in [1, 4096] (0: the section's), got ",
                                     o.amax_history_len()));
    }
    const bool matches = std::any_of(layers.begin(), layers.end(), [&](const std::string& name) {
      return GlobMatch(o.layers(), name);
    });
    if (!matches) {
      return FieldError(at + ".layers",
                        absl::StrCat(QuoteBounded(o.layers()), " matches no layer of the model (",
                                     layers.size() > 4 ? absl::StrCat(layers[0], ", ", layers[1],
                                                                      ", ... ", layers.back())
                                                       : absl::StrJoin(layers, ", "),
                                     ")"));
    }
  }
  return absl::OkStatus();
}

std::string DescribeOverride(const v1::RunSpec::Precision::Override& o) {
  using P = v1::RunSpec::Precision;
  auto label = [](const std::string& name, std::string_view prefix) {
    std::string v = name.starts_with(prefix) ? name.substr(prefix.size()) : name;
    for (char& c : v) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
    return v;
  };
  std::vector<std::string> parts;
  if (o.mode() != P::MODE_UNSPECIFIED) parts.push_back(label(P::Mode_Name(o.mode()), "MODE_"));
  if (o.scaling() != P::SCALING_UNSPECIFIED) {
    parts.push_back("scaling " + label(P::Scaling_Name(o.scaling()), "SCALING_"));
  }
  if (o.format() != P::FORMAT_UNSPECIFIED) {
    parts.push_back("format " + label(P::Format_Name(o.format()), "FORMAT_"));
  }
  if (o.has_margin()) parts.push_back(absl::StrCat("margin ", o.margin()));
  if (o.amax_history_len() > 0) {
    parts.push_back(absl::StrCat("amax_history_len ", o.amax_history_len()));
  }
  if (o.amax_compute_algo() != P::AMAX_COMPUTE_ALGO_UNSPECIFIED) {
    parts.push_back("amax_compute_algo " +
                    label(P::AmaxComputeAlgo_Name(o.amax_compute_algo()), "AMAX_COMPUTE_ALGO_"));
  }
  return absl::StrCat(QuoteBounded(o.layers()), ": ",
                      parts.empty() ? "(no change)" : absl::StrJoin(parts, ", "));
}

v1::RunSpec::Precision LayerPrecision(const v1::RunSpec::Precision& p, std::string_view layer,
                                      int* matched) {
  using P = v1::RunSpec::Precision;
  P out = p;
  out.clear_overrides();
  out.clear_exclude();
  if (matched != nullptr) *matched = -1;
  if (p.mode() != P::MODE_FP8) return out;
  if (std::find(p.exclude().begin(), p.exclude().end(), layer) != p.exclude().end()) {
    out.set_mode(P::MODE_BF16);
    return out;
  }
  for (int i = 0; i < p.overrides_size(); ++i) {
    const P::Override& o = p.overrides(i);
    if (!GlobMatch(o.layers(), layer)) continue;
    if (matched != nullptr) *matched = i;
    if (o.mode() != P::MODE_UNSPECIFIED) out.set_mode(o.mode());
    if (o.scaling() != P::SCALING_UNSPECIFIED) out.set_scaling(o.scaling());
    if (o.format() != P::FORMAT_UNSPECIFIED) out.set_format(o.format());
    if (o.has_margin()) out.set_margin(o.margin());
    if (o.amax_history_len() > 0) out.set_amax_history_len(o.amax_history_len());
    if (o.amax_compute_algo() != P::AMAX_COMPUTE_ALGO_UNSPECIFIED) {
      out.set_amax_compute_algo(o.amax_compute_algo());
    }
    break;
  }
  return out;
}

std::vector<std::string> ModelLayerNames(const v1::RunSpec& spec) {
  const v1::RunSpec::Model m = ResolveModel(spec.model());
  const bool swiglu = m.mlp() == v1::RunSpec::Model::MLP_SWIGLU;
  const int64_t experts = spec.moe().experts(), every = std::max<int64_t>(1, spec.moe().every());
  const std::vector<const char*> mlp = swiglu ? std::vector<const char*>{"gate", "up", "down"}
                                              : std::vector<const char*>{"fc1", "fc2"};
  std::vector<std::string> names;
  for (int64_t l = 0; l < m.layers(); ++l) {
    const std::string block = absl::StrCat("blocks.", l, ".");
    names.push_back(block + "attn.qkv");
    names.push_back(block + "attn.proj");
    const bool moe = experts > 0 && (l + 1) % every == 0;
    for (int64_t e = 0; e < (moe ? experts : 1); ++e) {
      const std::string prefix = moe ? absl::StrCat(block, "mlp.experts.", e, ".") : block + "mlp.";
      for (const char* s : mlp) names.push_back(prefix + s);
    }
  }
  names.push_back("lm_head");
  return names;
}

uint64_t ValidationSplit(uint64_t tokens, double val_fraction) {
  if (!(val_fraction > 0.0 && val_fraction < 1.0)) return tokens;
  const double split = std::floor(static_cast<double>(tokens) * (1.0 - val_fraction));
  return std::min(tokens, static_cast<uint64_t>(split));
}

absl::StatusOr<v1::RunSpec> ParseRunSpec(const std::string& yaml_text,
                                         const std::string& source_name,
                                         std::span<const std::string> overrides) {
  v1::RunSpec spec = RunSpecDefaults();
  std::set<std::string> seen;
  // yaml-cpp reports errors by exceptions; none leaves this function.
  try {
    YAML::Node root;
    try {
      root = YAML::Load(yaml_text);
    } catch (const YAML::ParserException& e) {
      Parser p(source_name, /*positions=*/true, &seen);
      return p.Error(e.mark, "", absl::StrCat("invalid YAML: ", e.msg));
    }
    Parser parser(source_name, /*positions=*/true, &seen);
    FP8RT_RETURN_IF_ERROR(parser.ApplyMap(root, YAML::Mark(), "", &spec));
    for (const std::string& text : overrides) {
      FP8RT_RETURN_IF_ERROR(ApplyOverride(text, &seen, &spec));
    }
  } catch (const YAML::Exception& e) {
    return absl::InvalidArgumentError(absl::StrCat(source_name, ": ", e.what()));
  }
  for (const char* key : kRequiredKeys) {
    if (!seen.contains(key)) {
      return absl::InvalidArgumentError(
          absl::StrCat(source_name, ": ", key, ": required key missing"));
    }
  }
  return spec;
}

absl::StatusOr<v1::RunSpec> LoadRunSpec(const std::string& path,
                                        std::span<const std::string> overrides) {
  std::error_code ec;
  if (!fs::exists(path, ec)) {
    return absl::NotFoundError(absl::StrCat(path, ": run spec file does not exist"));
  }
  if (fs::is_directory(path, ec)) {
    return absl::InvalidArgumentError(absl::StrCat(path, ": is a directory, not a run spec"));
  }
  std::ifstream in(path, std::ios::binary);
  if (!in) return absl::InvalidArgumentError(absl::StrCat(path, ": cannot read the run spec"));
  std::ostringstream text;
  text << in.rdbuf();
  if (in.bad()) return absl::InvalidArgumentError(absl::StrCat(path, ": read error"));
  return ParseRunSpec(text.str(), path, overrides);
}

v1::RunSpec::Model ResolveModel(const v1::RunSpec::Model& spec_model) {
  using M = v1::RunSpec::Model;
  M m = spec_model;
  if (m.family() == M::FAMILY_UNSPECIFIED) m.set_family(M::FAMILY_PLAIN);
  const bool gpt2 = m.family() == M::FAMILY_GPT2, llama = m.family() == M::FAMILY_LLAMA;
  if (m.norm() == M::NORM_UNSPECIFIED) m.set_norm(gpt2 ? M::NORM_LAYERNORM : M::NORM_RMSNORM);
  if (m.mlp() == M::MLP_UNSPECIFIED) m.set_mlp(llama ? M::MLP_SWIGLU : M::MLP_GELU);
  if (m.positions() == M::POSITIONS_UNSPECIFIED) {
    m.set_positions(gpt2 ? M::POSITIONS_LEARNED : llama ? M::POSITIONS_ROPE : M::POSITIONS_NONE);
  }
  if (m.kv_heads() == 0) m.set_kv_heads(m.heads());
  if (m.max_positions() == 0) m.set_max_positions(m.seq_len());
  if (!m.has_rope_theta()) m.set_rope_theta(10000.0);
  if (!m.has_norm_eps()) m.set_norm_eps(1e-5);
  if (!m.has_bias()) m.set_bias(gpt2);
  if (!m.has_tie_embeddings()) m.set_tie_embeddings(gpt2);
  return m;
}

absl::Status ValidateRunSpec(const v1::RunSpec& spec, int world_size, DataFileCheck data_file) {
  FP8RT_RETURN_IF_ERROR(CheckFieldsSet(spec, ""));

  const v1::RunSpec::Model m = ResolveModel(spec.model());
  FP8RT_RETURN_IF_ERROR(CheckPositive("model.layers", m.layers()));
  FP8RT_RETURN_IF_ERROR(CheckPositive("model.d_model", m.d_model()));
  FP8RT_RETURN_IF_ERROR(CheckPositive("model.heads", m.heads()));
  FP8RT_RETURN_IF_ERROR(CheckPositive("model.d_ff", m.d_ff()));
  FP8RT_RETURN_IF_ERROR(CheckPositive("model.seq_len", m.seq_len()));
  FP8RT_RETURN_IF_ERROR(CheckPositive("model.vocab", m.vocab()));
  if (m.d_model() % m.heads() != 0) {
    return FieldError(
        "model.d_model",
        absl::StrCat("d_model ", m.d_model(), " is not a multiple of model.heads ", m.heads()));
  }
  if (m.kv_heads() < 0 || m.heads() % m.kv_heads() != 0) {
    return FieldError("model.kv_heads", absl::StrCat(m.kv_heads(), " key/value heads do not divide "
                                                     "model.heads ",
                                                     m.heads(), " (1 = multi-query attention)"));
  }
  if (m.positions() == v1::RunSpec::Model::POSITIONS_ROPE && (m.d_model() / m.heads()) % 2 != 0) {
    return FieldError("model.positions", absl::StrCat("rope needs an even head size, got d_model / "
                                                      "heads = ",
                                                      m.d_model() / m.heads()));
  }
  if (!(m.rope_theta() > 0)) {
    return FieldError("model.rope_theta", absl::StrCat("must be positive, got ", m.rope_theta()));
  }
  if (!(m.norm_eps() >= 0)) {
    return FieldError("model.norm_eps", absl::StrCat("must be >= 0, got ", m.norm_eps()));
  }
  if (m.positions() == v1::RunSpec::Model::POSITIONS_LEARNED && m.max_positions() < m.seq_len()) {
    return FieldError("model.max_positions",
                      absl::StrCat(m.max_positions(), " learned positions cannot hold model.seq_len ",
                                   m.seq_len()));
  }

  const auto& par = spec.parallel();
  FP8RT_RETURN_IF_ERROR(CheckPositive("parallel.dp", par.dp()));
  FP8RT_RETURN_IF_ERROR(CheckPositive("parallel.tp", par.tp()));
  FP8RT_RETURN_IF_ERROR(CheckPositive("parallel.ep", par.ep()));
  if (world_size > 0 && int64_t{par.dp()} * par.tp() != world_size) {
    return FieldError("parallel.dp", absl::StrCat("parallel.dp * parallel.tp = ", par.dp(), " * ",
                                                  par.tp(), " = ", int64_t{par.dp()} * par.tp(),
                                                  ", but the world size is ", world_size));
  }
  if (par.dp() % par.ep() != 0) {
    return FieldError("parallel.ep",
                      absl::StrCat("ep ", par.ep(), " does not divide parallel.dp ", par.dp()));
  }
  const struct {
    const char* field;
    int32_t value;
  } tp_split[] = {
      {"model.d_model", m.d_model()},
      {"model.d_ff", m.d_ff()},
      {"model.heads", m.heads()},
      {"model.kv_heads", m.kv_heads()}};
  for (const auto& [field, value] : tp_split) {
    if (value % par.tp() != 0) {
      return FieldError(field, absl::StrCat(value, " is not divisible by parallel.tp ", par.tp()));
    }
  }

  const auto& pr = spec.precision();
  FP8RT_RETURN_IF_ERROR(ValidatePrecisionOverrides(spec));
  // Block or mx32 scaling anywhere (the section's or an override's) needs the model's block
  // shapes: whole 128 (block) or 32 (mx32) columns per tensor-parallel shard, so that no block
  // straddles two ranks and every layout quantizes the same blocks.
  bool any_block = pr.scaling() == v1::RunSpec::Precision::SCALING_BLOCK;
  bool any_mx32 = pr.scaling() == v1::RunSpec::Precision::SCALING_MX32;
  for (const auto& o : pr.overrides()) {
    if (o.mode() == v1::RunSpec::Precision::MODE_BF16) continue;
    any_block |= o.scaling() == v1::RunSpec::Precision::SCALING_BLOCK;
    any_mx32 |= o.scaling() == v1::RunSpec::Precision::SCALING_MX32;
  }
  if (any_block || any_mx32) {
    const int32_t width = any_block ? 128 : 32;
    const struct {
      const char* field;
      int32_t value;
    } block[] = {{"model.d_model", m.d_model()}, {"model.d_ff", m.d_ff()}};
    for (const auto& [field, value] : block) {
      if ((value / par.tp()) % width != 0) {
        return FieldError(
            field, absl::StrCat("precision.scaling ", any_block ? "block" : "mx32",
                                " needs a multiple of ", width,
                                " per tensor-parallel shard, got ", value, " / parallel.tp ",
                                par.tp(), " = ", value / par.tp()));
      }
    }
  }
  // FSDP shards of FP8 weights need no check here: the model cuts them in whole rows, whole
  // 128-row blocks with block scaling and 32-row blocks with mx32, padding the last shards
  // (model::ShardCut::row_unit).
  if (pr.margin() < 0 || pr.margin() > 32) {
    return FieldError("precision.margin", absl::StrCat("must be in [0, 32], got ", pr.margin()));
  }
  if (pr.amax_history_len() < 1 || pr.amax_history_len() > 4096) {
    return FieldError("precision.amax_history_len",
                      absl::StrCat("must be in [1, 4096], got ", pr.amax_history_len()));
  }
  for (int i = 0; i < pr.exclude_size(); ++i) {
    if (pr.exclude(i).empty()) {
      return FieldError(absl::StrCat("precision.exclude[", i, "]"), "empty layer name");
    }
  }

  const auto& h = spec.health();
  for (const auto& [field, value] :
       {std::pair<const char*, double>{"health.saturation_threshold", h.saturation_threshold()},
        {"health.underflow_threshold", h.underflow_threshold()}}) {
    if (!(value >= 0.0 && value <= 1.0)) {
      return FieldError(field, absl::StrCat("must be a ratio in [0, 1] (0 = off), got ", value));
    }
  }
  FP8RT_RETURN_IF_ERROR(CheckPositive("health.intervals", h.intervals()));
  if (!v1::RunSpec::Health::Action_IsValid(h.action())) {
    return FieldError("health.action", absl::StrCat(h.action(), " is not a value of the enum"));
  }
  if (h.margin_step() < 0 || h.margin_step() > 32) {
    return FieldError("health.margin_step",
                      absl::StrCat("must be in [1, 32] (0: 2), got ", h.margin_step()));
  }
  if (h.promote_after() < 0 || h.promote_after() > 1000000) {
    return FieldError("health.promote_after",
                      absl::StrCat("must be in [0, 1000000] (0: never), got ", h.promote_after()));
  }
  if (h.action() == v1::RunSpec::Health::ACTION_BLOCK_SCALING &&
      spec.precision().mode() == v1::RunSpec::Precision::MODE_FP8) {
    // The action adds a block-scaled per-layer recipe at run time: the shapes must allow it now.
    v1::RunSpec block = spec;
    block.mutable_precision()->set_scaling(v1::RunSpec::Precision::SCALING_BLOCK);
    block.mutable_precision()->clear_overrides();
    block.mutable_health()->clear_action();
    const absl::Status s = ValidateRunSpec(block, world_size, DataFileCheck::kSkip);
    if (!s.ok()) {
      return FieldError("health.action",
                        absl::StrCat("block_scaling needs shapes block scaling can split: ",
                                     s.message()));
    }
  }

  const auto& moe = spec.moe();
  if (moe.experts() < 0) return FieldError("moe.experts", "must be >= 0 (0 = no MoE)");
  if (moe.experts() > 0) {
    if (moe.experts() % par.ep() != 0) {
      return FieldError("moe.experts", absl::StrCat(moe.experts(),
                                                    " experts cannot be split over "
                                                    "parallel.ep ",
                                                    par.ep()));
    }
    if (moe.top_k() < 1 || moe.top_k() > moe.experts()) {
      return FieldError("moe.top_k", absl::StrCat("must be in [1, moe.experts = ", moe.experts(),
                                                  "], got ", moe.top_k()));
    }
    FP8RT_RETURN_IF_ERROR(CheckPositive("moe.every", moe.every()));
    if (!(moe.capacity_factor() > 0)) {
      return FieldError("moe.capacity_factor",
                        absl::StrCat("must be positive, got ", moe.capacity_factor()));
    }
    FP8RT_RETURN_IF_ERROR(CheckNonNegative("moe.aux_loss_coef", moe.aux_loss_coef()));
    if (par.tp() != 1) {
      return FieldError("parallel.tp",
                        "MoE blocks need parallel.tp 1 (experts are not "
                        "tensor-parallel; shard them over parallel.ep)");
    }
    // Expert weights are FSDP-sharded over the expert-data-parallel group (dp / ep ranks).
    const int64_t edp = par.dp() / par.ep();
    if (pr.mode() == v1::RunSpec::Precision::MODE_FP8 &&
        (m.d_ff() % edp != 0 || m.d_model() % edp != 0)) {
      return FieldError("parallel.ep",
                        absl::StrCat("expert weights (", m.d_ff(), " and ", m.d_model(),
                                     " rows) cannot be cut into dp / "
                                     "ep = ",
                                     edp, " FSDP shards of whole rows"));
    }
  } else if (par.ep() != 1) {
    return FieldError("parallel.ep", "expert parallelism needs MoE blocks (moe.experts > 0)");
  }

  switch (spec.device()) {
    case v1::RunSpec::DEVICE_UNSPECIFIED:  // cpu (see kUnsetMeansDefault)
    case v1::RunSpec::DEVICE_CPU:
      break;
    case v1::RunSpec::DEVICE_CUDA:
      break;
    default:  // a number from the wire that this schema does not know
      return FieldError("device", absl::StrCat("unknown value ", static_cast<int>(spec.device()),
                                               " (expected cpu or cuda)"));
  }

  const auto& t = spec.train();
  FP8RT_RETURN_IF_ERROR(CheckPositive("train.steps", t.steps()));
  FP8RT_RETURN_IF_ERROR(CheckPositive("train.micro_batch", t.micro_batch()));
  FP8RT_RETURN_IF_ERROR(CheckPositive("train.grad_accum", t.grad_accum()));
  if (!(t.lr() > 0)) return FieldError("train.lr", absl::StrCat("must be positive, got ", t.lr()));
  FP8RT_RETURN_IF_ERROR(CheckNonNegative("train.min_lr", t.min_lr()));
  FP8RT_RETURN_IF_ERROR(CheckNonNegative("train.weight_decay", t.weight_decay()));
  FP8RT_RETURN_IF_ERROR(CheckNonNegative("train.clip", t.clip()));
  FP8RT_RETURN_IF_ERROR(CheckNonNegative("train.warmup", static_cast<double>(t.warmup())));
  if (t.warmup() > t.steps()) {
    return FieldError("train.warmup",
                      absl::StrCat("warmup ", t.warmup(), " is more than train.steps ", t.steps()));
  }
  if (t.min_lr() > t.lr()) {
    return FieldError("train.min_lr",
                      absl::StrCat("min_lr ", t.min_lr(), " is more than train.lr ", t.lr()));
  }

  const auto& d = spec.data();
  if (d.format() == v1::RunSpec::Data::FORMAT_TEXT && m.vocab() < 256) {
    return FieldError("model.vocab", absl::StrCat("data.format text uses byte tokens and needs "
                                                  "vocab >= 256, got ",
                                                  m.vocab()));
  }
  if ((d.format() == v1::RunSpec::Data::FORMAT_U16 ||
       d.format() == v1::RunSpec::Data::FORMAT_LLMC) &&
      m.vocab() > 65536) {
    return FieldError(
        "model.vocab",
        absl::StrCat("data.format ", d.format() == v1::RunSpec::Data::FORMAT_U16 ? "u16" : "llmc",
                     " holds token ids < 65536, got vocab ", m.vocab()));
  }

  FP8RT_RETURN_IF_ERROR(
      CheckNonNegative("checkpoint.every", static_cast<double>(spec.checkpoint().every())));
  FP8RT_RETURN_IF_ERROR(CheckPositive("checkpoint.keep", spec.checkpoint().keep()));
  FP8RT_RETURN_IF_ERROR(CheckPositive("metrics.every", spec.metrics().every()));
  FP8RT_RETURN_IF_ERROR(ValidateEval(spec, data_file));
  if (!spec.init().from().empty() && data_file == DataFileCheck::kCheck) {
    // A folder names the file in it that is read first (model.safetensors or its index).
    absl::StatusOr<std::string> first = ResolveSafetensorsPath(spec.init().from());
    if (!first.ok()) return FieldError("init.from", std::string(first.status().message()));
    FP8RT_RETURN_IF_ERROR(CheckReadableFile("init.from", *first));
  }

  if (data_file == DataFileCheck::kSkip) {
    if (d.path().empty()) return FieldError("data.path", "is empty (a data file is required)");
    return absl::OkStatus();
  }
  return CheckReadableFile("data.path", d.path());
}

}  // namespace fp8rt
