// Recipe and spec checks of the controller (see recipe.h). Contents:
//   LayerNames / IsBlockLayer / LayerList   the layers a recipe may name
//   SameRecipe
//   ValidateSpec / ValidateRecipe
//   DescribeRecipeChange
#include "runtime/controller/recipe.h"

#include <algorithm>
#include <charconv>
#include <cstdint>
#include <set>

#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "google/protobuf/util/message_differencer.h"
#include "runtime/controller/controller.h"
#include "runtime/core/quote.h"
#include "runtime/core/status.h"
#include "runtime/spec/run_spec.h"

namespace fp8rt::controller {
namespace {

using Precision = v1::RunSpec::Precision;

// The layer list for error messages: in full for small models, else the first block's layers
// as a pattern ("blocks.N.attn.qkv, ... for N in 0..L-1, lm_head"; MoE blocks differ from it by
// their experts, which the full list would show).
std::string LayerList(const v1::RunSpec& spec) {
  const std::vector<std::string> names = LayerNames(spec);
  if (names.size() <= 12) return absl::StrJoin(names, ", ");
  std::vector<std::string> first;
  for (const std::string& n : names) {
    if (!n.starts_with("blocks.0.")) break;
    first.push_back("blocks.N." + n.substr(std::string("blocks.0.").size()));
  }
  return absl::StrCat(absl::StrJoin(first, ", "), " for N in 0..", spec.model().layers() - 1,
                      spec.moe().experts() > 0 ? " (MoE blocks: mlp.experts.E.*)" : "",
                      ", lm_head");
}

// "SCALING_BLOCK" -> "block".
std::string EnumLabel(const std::string& value_name, std::string_view prefix) {
  std::string s = value_name;
  if (s.starts_with(prefix)) s = s.substr(prefix.size());
  return absl::AsciiStrToLower(s);
}

std::string ScalingLabel(int v) {
  return EnumLabel(Precision::Scaling_Name(static_cast<Precision::Scaling>(v)), "SCALING_");
}
std::string AlgoLabel(int v) {
  return EnumLabel(Precision::AmaxComputeAlgo_Name(static_cast<Precision::AmaxComputeAlgo>(v)),
                   "AMAX_COMPUTE_ALGO_");
}
std::string GatherLabel(int v) {
  return EnumLabel(Precision::FsdpGather_Name(static_cast<Precision::FsdpGather>(v)),
                   "FSDP_GATHER_");
}
std::string ReduceLabel(int v) {
  return EnumLabel(Precision::GradReduce_Name(static_cast<Precision::GradReduce>(v)),
                   "GRAD_REDUCE_");
}

absl::Status FieldError(const std::string& field, const std::string& message) {
  return absl::InvalidArgumentError(absl::StrCat(field, ": ", message));
}

// Every exclude name is a non-empty layer of the model, listed once; `field` is the list's path.
// The count and every name's length are checked first (CheckExcludeSizes), and a name is quoted
// by a bounded prefix only (runtime/core/quote.h).
absl::Status CheckExcludeSizes(const google::protobuf::RepeatedPtrField<std::string>& exclude,
                               const std::string& field) {
  if (exclude.size() > kMaxRecipeExcludes) {
    return FieldError(field, absl::StrCat("at most ", kMaxRecipeExcludes, " entries, got ",
                                          exclude.size()));
  }
  for (int i = 0; i < exclude.size(); ++i) {
    if (exclude.Get(i).size() > kMaxNameBytes) {
      return FieldError(absl::StrCat(field, "[", i, "]"),
                        absl::StrCat("at most ", kMaxNameBytes, " bytes, got ",
                                     exclude.Get(i).size()));
    }
  }
  return absl::OkStatus();
}
absl::Status CheckExclude(const google::protobuf::RepeatedPtrField<std::string>& exclude,
                          const v1::RunSpec& spec, const std::string& field) {
  FP8RT_RETURN_IF_ERROR(CheckExcludeSizes(exclude, field));
  const std::vector<std::string> names = LayerNames(spec);
  std::set<std::string> seen;
  for (int i = 0; i < exclude.size(); ++i) {
    const std::string item = absl::StrCat(field, "[", i, "]");
    const std::string& name = exclude.Get(i);
    if (name.empty()) return FieldError(item, "empty layer name");
    if (std::find(names.begin(), names.end(), name) == names.end()) {
      return FieldError(item, absl::StrCat("no layer named ", QuoteBounded(name),
                                           " (layers: ", LayerList(spec), ")"));
    }
    if (!seen.insert(name).second) {
      return FieldError(item, absl::StrCat(QuoteBounded(name), " listed twice"));
    }
  }
  return absl::OkStatus();
}

// Each of the precision section's enums holds a value the proto defines (a client can send any
// number; a recipe or spec with one would be stored and read as something else). `prefix` is
// the section's path ("recipe" or "spec.precision").
template <typename Message>
absl::Status CheckPrecisionEnums(const Message& m, const std::string& prefix) {
  struct Field {
    const char* name;
    int value;
    bool valid;
  };
  const Field fields[] = {
      {"scaling", m.scaling(), Precision::Scaling_IsValid(m.scaling())},
      {"amax_compute_algo", m.amax_compute_algo(),
       Precision::AmaxComputeAlgo_IsValid(m.amax_compute_algo())},
      {"fsdp_gather", m.fsdp_gather(), Precision::FsdpGather_IsValid(m.fsdp_gather())},
      {"grad_reduce", m.grad_reduce(), Precision::GradReduce_IsValid(m.grad_reduce())},
  };
  for (const Field& f : fields) {
    if (!f.valid) {
      return FieldError(absl::StrCat(prefix, ".", f.name),
                        absl::StrCat(f.value, " is not a value of the enum"));
    }
  }
  return absl::OkStatus();
}

// ValidateRunSpec without looking for the data file, which only the workers read (see recipe.h).
absl::Status ValidateWithoutDataFile(const v1::RunSpec& spec, int world_size) {
  return ValidateRunSpec(spec, world_size, DataFileCheck::kSkip);
}

}  // namespace

std::vector<std::string> LayerNames(const v1::RunSpec& spec) { return ModelLayerNames(spec); }

bool IsBlockLayer(std::string_view name, const v1::RunSpec& spec) {
  if (!name.starts_with("blocks.")) return false;
  const std::vector<std::string> names = LayerNames(spec);
  return std::find(names.begin(), names.end(), name) != names.end();
}

bool SameRecipe(const v1::Recipe& a, const v1::Recipe& b) {
  return google::protobuf::util::MessageDifferencer::Equals(a, b);
}

absl::Status ValidateSpec(const v1::RunSpec& spec, int world_size) {
  FP8RT_RETURN_IF_ERROR(CheckPrecisionEnums(spec.precision(), "spec.precision"));
  if (!Precision::Mode_IsValid(spec.precision().mode())) {
    return FieldError("spec.precision.mode",
                      absl::StrCat(spec.precision().mode(), " is not a value of the enum"));
  }
  if (!Precision::Format_IsValid(spec.precision().format())) {
    return FieldError("spec.precision.format",
                      absl::StrCat(spec.precision().format(), " is not a value of the enum"));
  }
  // Sizes first: a long exclude name is refused before the spec checks quote it; the names are
  // compared with the model's layers once the model itself is known to be valid.
  FP8RT_RETURN_IF_ERROR(CheckExcludeSizes(spec.precision().exclude(), "spec.precision.exclude"));
  absl::Status s = ValidateWithoutDataFile(spec, world_size);
  if (!s.ok()) return absl::InvalidArgumentError(absl::StrCat("spec.", s.message()));
  return CheckExclude(spec.precision().exclude(), spec, "spec.precision.exclude");
}

absl::Status ValidateRecipe(const v1::Recipe& recipe, const v1::RunSpec& spec, int world_size) {
  FP8RT_RETURN_IF_ERROR(CheckPrecisionEnums(recipe, "recipe"));
  if (recipe.scaling() == Precision::SCALING_UNSPECIFIED) {
    return FieldError("recipe.scaling", "not set (delayed, current, block or mx32)");
  }
  if (recipe.amax_compute_algo() == Precision::AMAX_COMPUTE_ALGO_UNSPECIFIED) {
    return FieldError("recipe.amax_compute_algo", "not set (max or most_recent)");
  }
  if (recipe.fsdp_gather() == Precision::FSDP_GATHER_UNSPECIFIED) {
    return FieldError("recipe.fsdp_gather", "not set (fp8 or bf16)");
  }
  if (recipe.grad_reduce() == Precision::GRAD_REDUCE_UNSPECIFIED) {
    return FieldError("recipe.grad_reduce", "not set (bf16 or fp32)");
  }
  if (recipe.amax_history_len() < 1 || recipe.amax_history_len() > 4096) {
    return FieldError("recipe.amax_history_len",
                      absl::StrCat("must be in [1, 4096], got ", recipe.amax_history_len()));
  }
  if (recipe.margin() < 0 || recipe.margin() > 32) {
    return FieldError("recipe.margin", absl::StrCat("must be in [0, 32], got ", recipe.margin()));
  }
  absl::Status s = CheckExclude(recipe.exclude(), spec, "recipe.exclude");
  if (!s.ok()) return s;
  // The per-layer recipes, named as the recipe's own field.
  s = ValidatePrecisionOverrides(WithRecipe(spec, recipe));
  if (!s.ok()) {
    std::string message(s.message());
    if (message.starts_with("precision.")) message.erase(0, std::string_view("precision.").size());
    return absl::InvalidArgumentError(absl::StrCat("recipe.", message));
  }
  // What is left to fail in the merged spec depends on the scaling: block scaling needs whole
  // 128-wide blocks per tensor-parallel shard and whole 128-row blocks per FSDP shard.
  s = ValidateWithoutDataFile(WithRecipe(spec, recipe), world_size);
  // The run's FSDP shards were cut when it started: larger blocks than they were cut for cannot
  // come in live.
  if (s.ok()) s = CheckLiveRecipeShards(spec, WithRecipe(spec, recipe));
  if (!s.ok()) {
    return FieldError(
        recipe.scaling() == Precision::SCALING_BLOCK || recipe.scaling() == Precision::SCALING_MX32
            ? "recipe.scaling"
            : "recipe",
        absl::StrCat(ScalingLabel(recipe.scaling()),
                     " scaling does not fit the run's model and layout: ", s.message()));
  }
  return absl::OkStatus();
}

std::string DescribeRecipeChange(const v1::Recipe& from, const v1::Recipe& to) {
  std::vector<std::string> parts;
  auto changed = [&](const char* name, const std::string& a, const std::string& b) {
    if (a != b) parts.push_back(absl::StrCat(name, " ", a, " -> ", b));
  };
  changed("scaling", ScalingLabel(from.scaling()), ScalingLabel(to.scaling()));
  changed("amax_history_len", absl::StrCat(from.amax_history_len()),
          absl::StrCat(to.amax_history_len()));
  changed("amax_compute_algo", AlgoLabel(from.amax_compute_algo()),
          AlgoLabel(to.amax_compute_algo()));
  changed("margin", absl::StrCat(from.margin()), absl::StrCat(to.margin()));
  changed("fsdp_gather", GatherLabel(from.fsdp_gather()), GatherLabel(to.fsdp_gather()));
  changed("grad_reduce", ReduceLabel(from.grad_reduce()), ReduceLabel(to.grad_reduce()));
  const std::set<std::string> a(from.exclude().begin(), from.exclude().end());
  const std::set<std::string> b(to.exclude().begin(), to.exclude().end());
  for (const std::string& name : b) {
    if (!a.contains(name)) parts.push_back(absl::StrCat("exclude +", name));
  }
  for (const std::string& name : a) {
    if (!b.contains(name)) parts.push_back(absl::StrCat("exclude -", name));
  }
  const bool same_overrides =
      from.overrides_size() == to.overrides_size() &&
      std::equal(from.overrides().begin(), from.overrides().end(), to.overrides().begin(),
                 [](const auto& a, const auto& b) {
                   return google::protobuf::util::MessageDifferencer::Equals(a, b);
                 });
  if (!same_overrides) {
    std::vector<std::string> now;
    for (const auto& o : to.overrides()) now.push_back(DescribeOverride(o));
    parts.push_back(absl::StrCat("overrides [", now.empty() ? "none" : absl::StrJoin(now, "; "),
                                 "]"));
  }
  return parts.empty() ? "no change" : absl::StrJoin(parts, ", ");
}

}  // namespace fp8rt::controller
