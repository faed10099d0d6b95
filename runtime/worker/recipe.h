// The worker's recipe conversions: the run spec's precision section and the controller's live
// recipe (control.proto Recipe) onto model::ModelRecipe, and back for checkpoints and reports.
//
// Index:
//   RecipeFromSpec  the spec's precision section as the model's recipe, precision.overrides
//                   resolved per layer into ModelRecipe::layers
//   MergeRecipe     the model's recipe under a live recipe (an update, or a checkpoint's):
//                   the spec with the recipe's fields (runtime/spec/spec_recipe.h)
//   FormatFromSpec  the spec's data format as the loader's token format
//   ShapeFromSpec   the spec's model (family defaults resolved) and moe sections as the model's
//                   shape
//
// Pure functions; the enums are parsed here once, so nothing past the worker's start sees the
// spec's strings or proto enums.
#ifndef FP8RT_RUNTIME_WORKER_RECIPE_H_
#define FP8RT_RUNTIME_WORKER_RECIPE_H_

#include "fp8rt/v1/control.pb.h"
#include "fp8rt/v1/run_spec.pb.h"
#include "runtime/model/transformer.h"
#include "runtime/train/data_loader.h"

namespace fp8rt::worker {

model::ModelRecipe RecipeFromSpec(const v1::RunSpec& spec);
// precision.overrides are resolved per layer here (LayerPrecision) into ModelRecipe::layers.
model::ModelRecipe MergeRecipe(const v1::RunSpec& spec, const v1::Recipe& r);
train::TokenFormat FormatFromSpec(const v1::RunSpec& spec);
model::ModelShape ShapeFromSpec(const v1::RunSpec& spec);

}  // namespace fp8rt::worker

#endif  // FP8RT_RUNTIME_WORKER_RECIPE_H_
