// RunSpec.precision <-> Recipe (see spec_recipe.h).
#include "runtime/spec/spec_recipe.h"

namespace fp8rt {

v1::Recipe SpecRecipe(const v1::RunSpec& spec) {
  const v1::RunSpec::Precision& p = spec.precision();
  v1::Recipe r;
  *r.mutable_exclude() = p.exclude();
  *r.mutable_overrides() = p.overrides();
  r.set_scaling(p.scaling());
  r.set_amax_history_len(p.amax_history_len());
  r.set_amax_compute_algo(p.amax_compute_algo());
  r.set_margin(p.margin());
  r.set_fsdp_gather(p.fsdp_gather());
  r.set_grad_reduce(p.grad_reduce());
  return r;
}

v1::RunSpec WithRecipe(v1::RunSpec spec, const v1::Recipe& recipe) {
  v1::RunSpec::Precision* p = spec.mutable_precision();
  *p->mutable_exclude() = recipe.exclude();
  *p->mutable_overrides() = recipe.overrides();
  p->set_scaling(recipe.scaling());
  p->set_amax_history_len(recipe.amax_history_len());
  p->set_amax_compute_algo(recipe.amax_compute_algo());
  p->set_margin(recipe.margin());
  p->set_fsdp_gather(recipe.fsdp_gather());
  p->set_grad_reduce(recipe.grad_reduce());
  return spec;
}

}  // namespace fp8rt
