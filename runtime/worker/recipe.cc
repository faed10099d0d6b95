// The worker's recipe conversions (see recipe.h).
#include "runtime/worker/recipe.h"

#include <algorithm>

#include "runtime/spec/run_spec.h"
#include "runtime/spec/spec_recipe.h"

namespace fp8rt::worker {
using v1::RunSpec;

namespace {

model::GemmPrecision ModeOf(RunSpec::Precision::Mode mode) {
  switch (mode) {
    case RunSpec::Precision::MODE_FP32:
      return model::GemmPrecision::kFp32;
    case RunSpec::Precision::MODE_BF16:
      return model::GemmPrecision::kBf16;
    default:
      return model::GemmPrecision::kFp8;
  }
}

// The FP8 sites' configs a precision section (the run's, or one layer's) gives.
model::Fp8SiteConfigs SitesOf(const RunSpec::Precision& p) {
  train::ScalingConfig base;
  switch (p.scaling()) {
    case RunSpec::Precision::SCALING_CURRENT:
      base.strategy = train::ScalingStrategy::kCurrent;
      break;
    case RunSpec::Precision::SCALING_BLOCK:
      base.strategy = train::ScalingStrategy::kBlock;
      break;
    case RunSpec::Precision::SCALING_MX32:
      base.strategy = train::ScalingStrategy::kMx32;
      break;
    default:
      base.strategy = train::ScalingStrategy::kDelayed;
      break;
  }
  base.history_len = p.amax_history_len();
  base.algo = p.amax_compute_algo() == RunSpec::Precision::AMAX_COMPUTE_ALGO_MOST_RECENT
                  ? train::AmaxAlgo::kMostRecent
                  : train::AmaxAlgo::kMax;
  base.margin = p.margin();
  base.format = kernels::Fp8Format::kE4M3;
  model::Fp8SiteConfigs sites{.input = base, .weight = base, .grad_output = base};
  if (p.format() != RunSpec::Precision::FORMAT_E4M3) {
    sites.grad_output.format = kernels::Fp8Format::kE5M2;  // HYBRID
  }
  return sites;
}

}  // namespace

model::ModelRecipe RecipeFromSpec(const RunSpec& spec) {
  const RunSpec::Precision& p = spec.precision();
  model::ModelRecipe recipe;
  recipe.precision = ModeOf(p.mode());
  recipe.sites = SitesOf(p);
  recipe.exclude.assign(p.exclude().begin(), p.exclude().end());
  if (recipe.precision == model::GemmPrecision::kFp8 && p.overrides_size() > 0) {
    for (const std::string& layer : ModelLayerNames(spec)) {
      int matched = -1;
      const RunSpec::Precision lp = LayerPrecision(p, layer, &matched);
      if (matched < 0) continue;
      recipe.layers[layer] = model::LayerRecipe{.precision = ModeOf(lp.mode()), .sites = SitesOf(lp)};
    }
  }
  recipe.fsdp_gather = p.fsdp_gather() == RunSpec::Precision::FSDP_GATHER_BF16
                           ? model::FsdpGatherDType::kBf16
                           : model::FsdpGatherDType::kFp8;
  recipe.grad_reduce = p.grad_reduce() == RunSpec::Precision::GRAD_REDUCE_BF16
                           ? parallel::GradReduceDType::kBF16
                           : parallel::GradReduceDType::kFP32;
  // Absent (a spec built without RunSpecDefaults): the defaults, true.
  recipe.save_fp8_activations = !p.has_save_fp8_activations() || p.save_fp8_activations();
  recipe.fp8_fast_accum_forward = !p.has_fp8_fast_accum_forward() || p.fp8_fast_accum_forward();
  recipe.reshard_after_forward =
      !spec.parallel().has_reshard_after_forward() || spec.parallel().reshard_after_forward();
  // The health policy may switch a layer to block scaling later: cut the shards for it now.
  if (spec.health().action() == RunSpec::Health::ACTION_BLOCK_SCALING) recipe.fsdp_row_unit = 128;
  return recipe;
}

model::ModelRecipe MergeRecipe(const RunSpec& spec, const v1::Recipe& r) {
  return RecipeFromSpec(WithRecipe(spec, r));
}

train::TokenFormat FormatFromSpec(const RunSpec& spec) {
  switch (spec.data().format()) {
    case RunSpec::Data::FORMAT_U16:
      return train::TokenFormat::kU16;
    case RunSpec::Data::FORMAT_U32:
      return train::TokenFormat::kU32;
    case RunSpec::Data::FORMAT_LLMC:
      return train::TokenFormat::kLlmc;
    default:
      return train::TokenFormat::kText;
  }
}

model::ModelShape ShapeFromSpec(const RunSpec& spec) {
  const RunSpec::Model m = ResolveModel(spec.model());
  using M = RunSpec::Model;
  return model::ModelShape{.layers = m.layers(),
                          .d_model = m.d_model(),
                          .heads = m.heads(),
                          .d_ff = m.d_ff(),
                          .seq_len = m.seq_len(),
                          .vocab = m.vocab(),
                          .moe = {.experts = spec.moe().experts(),
                                  .top_k = spec.moe().top_k(),
                                  .capacity_factor = spec.moe().capacity_factor(),
                                  .aux_loss_coef = spec.moe().aux_loss_coef(),
                                  .drop_tokens = spec.moe().drop_tokens()},
                          .moe_every = std::max(1, spec.moe().every()),
                          .kv_heads = m.kv_heads(),
                          .norm = m.norm() == M::NORM_LAYERNORM ? model::NormKind::kLayer
                                                                : model::NormKind::kRms,
                          .norm_eps = static_cast<float>(m.norm_eps()),
                          .mlp = m.mlp() == M::MLP_SWIGLU ? model::MlpKind::kSwiglu
                                                          : model::MlpKind::kGelu,
                          .positions = m.positions() == M::POSITIONS_LEARNED
                                           ? model::PositionKind::kLearned
                                       : m.positions() == M::POSITIONS_ROPE
                                           ? model::PositionKind::kRope
                                           : model::PositionKind::kNone,
                          .max_positions = m.max_positions(),
                          .rope_theta = static_cast<float>(m.rope_theta()),
                          .bias = m.bias(),
                          .tie_embeddings = m.tie_embeddings()};
}

}  // namespace fp8rt::worker
