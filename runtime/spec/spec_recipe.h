// The live part of a run spec's precision section (control.proto Recipe), both ways: what the
// controller stores as recipe version 1, validates merged into the spec, and what a worker turns
// back into its model's recipe after a live update or a resume.
//
// Defines:
//   SpecRecipe   RunSpec.precision -> Recipe
//   WithRecipe   `spec` with its precision section's recipe fields replaced by a Recipe's
//
// Stateless and thread-safe.
#ifndef FP8RT_RUNTIME_SPEC_SPEC_RECIPE_H_
#define FP8RT_RUNTIME_SPEC_SPEC_RECIPE_H_

#include "fp8rt/v1/control.pb.h"
#include "fp8rt/v1/run_spec.pb.h"

namespace fp8rt {

// The part of a run spec's precision section that can change while a run trains: exclude,
// overrides, scaling, amax_history_len, amax_compute_algo, margin, fsdp_gather, grad_reduce.
v1::Recipe SpecRecipe(const v1::RunSpec& spec);

// `spec` with those fields replaced by `recipe`'s.
v1::RunSpec WithRecipe(v1::RunSpec spec, const v1::Recipe& recipe);

}  // namespace fp8rt

#endif  // FP8RT_RUNTIME_SPEC_SPEC_RECIPE_H_
