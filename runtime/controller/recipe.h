// Recipes and layer names as the controller checks them (proto/fp8rt/v1/control.proto Recipe).
//
// Defines:
//   LayerNames, IsBlockLayer     the layers a recipe may exclude: the spec's ModelLayerNames
//                                (runtime/spec/run_spec.h; per family and MoE layout, the same
//                                list as runtime/model's Transformer::LayerNames).
//   RecipeFromSpec, WithRecipe   RunSpec.precision <-> Recipe.
//   ValidateSpec                 a registered spec, errors prefixed "spec.".
//   ValidateRecipe               an updated recipe against the run's spec, errors prefixed
//                                "recipe.".
//   DescribeRecipeChange         "margin 0 -> 2, exclude +blocks.0.mlp.fc1" for events.
//
// Data files. ValidateRunSpec (runtime/spec/run_spec.h) also requires data.path to name a
// readable file, but the data lives on the workers' machines and the controller never reads it
// (the worker validates its spec with the real path before it registers). So both functions
// call ValidateRunSpec with DataFileCheck::kSkip: data.path must be non-empty, and every other
// check runs unchanged.
//
// Stateless and thread-safe.
#ifndef FP8RT_RUNTIME_CONTROLLER_RECIPE_H_
#define FP8RT_RUNTIME_CONTROLLER_RECIPE_H_

#include <string>
#include <string_view>
#include <vector>

#include "absl/status/status.h"
#include "fp8rt/v1/control.pb.h"
#include "fp8rt/v1/run_spec.pb.h"
#include "runtime/spec/spec_recipe.h"

namespace fp8rt::controller {

// The layers of the spec's model, in model order, lm_head last (ModelLayerNames).
std::vector<std::string> LayerNames(const v1::RunSpec& spec);

// True for the layers of LayerNames(spec) inside the blocks (every one but lm_head).
bool IsBlockLayer(std::string_view name, const v1::RunSpec& spec);

// The part of a run spec's precision section that can change while a run trains, and back
// (runtime/spec/spec_recipe.h, which the workers share).
inline v1::Recipe RecipeFromSpec(const v1::RunSpec& spec) { return SpecRecipe(spec); }
using ::fp8rt::WithRecipe;

// Field-by-field equality.
bool SameRecipe(const v1::Recipe& a, const v1::Recipe& b);

// ValidateRunSpec(spec, world_size) without the data.path check (see the file comment), plus
// every precision.exclude name a layer of the model. InvalidArgument "spec.<field>: ...".
[[nodiscard]] absl::Status ValidateSpec(const v1::RunSpec& spec, int world_size);

// A recipe update for a run of `spec` and `world_size`. InvalidArgument naming the field:
//   recipe.scaling / amax_compute_algo / fsdp_gather / grad_reduce: not set
//   recipe.amax_history_len: must be in [1, 4096], got N
//   recipe.margin: must be in [0, 32], got N
//   recipe.exclude[i]: empty layer name / no layer named 'x' (layers: ...) / listed twice
//   recipe.scaling: the model does not fit (block scaling needs whole 128 blocks: the
//                   ValidateRunSpec message follows)
[[nodiscard]] absl::Status ValidateRecipe(const v1::Recipe& recipe, const v1::RunSpec& spec,
                                          int world_size);

// What changed from `from` to `to`, for event messages ("no change" when nothing did).
std::string DescribeRecipeChange(const v1::Recipe& from, const v1::Recipe& to);

}  // namespace fp8rt::controller

#endif  // FP8RT_RUNTIME_CONTROLLER_RECIPE_H_
