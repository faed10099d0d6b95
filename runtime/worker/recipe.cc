// The worker's recipe conversions (see recipe.h).
#include "runtime/worker/recipe.h"

#include <algorithm>

#include "runtime/spec/run_spec.h"

namespace fp8rt::worker {
using v1::RunSpec;

model::ModelRecipe RecipeFromSpec(const RunSpec& spec) {
  const RunSpec::Precision& p = spec.precision();
  model::ModelRecipe recipe;
  switch (p.mode()) {
    case RunSpec::Precision::MODE_FP32:
      recipe.precision = model::GemmPrecision::kFp32;
      break;
    case RunSpec::Precision::MODE_BF16:
      recipe.precision = model::GemmPrecision::kBf16;
      break;
    default:
      recipe.precision = model::GemmPrecision::kFp8;
      break;
  }
  train::ScalingConfig base;
  switch (p.scaling()) {
    case RunSpec::Precision::SCALING_CURRENT:
      base.strategy = train::ScalingStrategy::kCurrent;
      break;
    case RunSpec::Precision::SCALING_BLOCK:
      base.strategy = train::ScalingStrategy::kBlock;
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
  recipe.sites.input = base;
  recipe.sites.weight = base;
  recipe.sites.grad_output = base;
  if (p.format() != RunSpec::Precision::FORMAT_E4M3) {
    recipe.sites.grad_output.format = kernels::Fp8Format::kE5M2;  // HYBRID
  }
  recipe.exclude.assign(p.exclude().begin(), p.exclude().end());
  recipe.fsdp_gather = p.fsdp_gather() == RunSpec::Precision::FSDP_GATHER_BF16
                           ? model::FsdpGatherDType::kBf16
                           : model::FsdpGatherDType::kFp8;
  recipe.grad_reduce = p.grad_reduce() == RunSpec::Precision::GRAD_REDUCE_BF16
                           ? parallel::GradReduceDType::kBF16
                           : parallel::GradReduceDType::kFP32;
  // Absent (a spec built without RunSpecDefaults): the defaults, true.
  recipe.save_fp8_activations = !p.has_save_fp8_activations() || p.save_fp8_activations();
  recipe.reshard_after_forward =
      !spec.parallel().has_reshard_after_forward() || spec.parallel().reshard_after_forward();
  return recipe;
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

// The live part of a recipe (control.proto Recipe) applied onto the model's recipe.
model::ModelRecipe MergeRecipe(model::ModelRecipe base, const v1::Recipe& r) {
  base.exclude.assign(r.exclude().begin(), r.exclude().end());
  for (train::ScalingConfig* c : {&base.sites.input, &base.sites.weight, &base.sites.grad_output}) {
    switch (r.scaling()) {
      case RunSpec::Precision::SCALING_CURRENT:
        c->strategy = train::ScalingStrategy::kCurrent;
        break;
      case RunSpec::Precision::SCALING_BLOCK:
        c->strategy = train::ScalingStrategy::kBlock;
        break;
      default:
        c->strategy = train::ScalingStrategy::kDelayed;
        break;
    }
    if (r.amax_history_len() > 0) c->history_len = r.amax_history_len();
    c->algo = r.amax_compute_algo() == RunSpec::Precision::AMAX_COMPUTE_ALGO_MOST_RECENT
                  ? train::AmaxAlgo::kMostRecent
                  : train::AmaxAlgo::kMax;
    c->margin = r.margin();
  }
  base.fsdp_gather = r.fsdp_gather() == RunSpec::Precision::FSDP_GATHER_BF16
                         ? model::FsdpGatherDType::kBf16
                         : model::FsdpGatherDType::kFp8;
  base.grad_reduce = r.grad_reduce() == RunSpec::Precision::GRAD_REDUCE_BF16
                         ? parallel::GradReduceDType::kBF16
                         : parallel::GradReduceDType::kFP32;
  return base;
}

v1::Recipe RecipeToProto(const model::ModelRecipe& m) {
  v1::Recipe r;
  for (const std::string& e : m.exclude) r.add_exclude(e);
  const train::ScalingConfig& c = m.sites.weight;
  r.set_scaling(c.strategy == train::ScalingStrategy::kCurrent ? RunSpec::Precision::SCALING_CURRENT
                : c.strategy == train::ScalingStrategy::kBlock
                    ? RunSpec::Precision::SCALING_BLOCK
                    : RunSpec::Precision::SCALING_DELAYED);
  r.set_amax_history_len(c.history_len);
  r.set_amax_compute_algo(c.algo == train::AmaxAlgo::kMostRecent
                              ? RunSpec::Precision::AMAX_COMPUTE_ALGO_MOST_RECENT
                              : RunSpec::Precision::AMAX_COMPUTE_ALGO_MAX);
  r.set_margin(c.margin);
  r.set_fsdp_gather(m.fsdp_gather == model::FsdpGatherDType::kBf16
                        ? RunSpec::Precision::FSDP_GATHER_BF16
                        : RunSpec::Precision::FSDP_GATHER_FP8);
  r.set_grad_reduce(m.grad_reduce == parallel::GradReduceDType::kBF16
                        ? RunSpec::Precision::GRAD_REDUCE_BF16
                        : RunSpec::Precision::GRAD_REDUCE_FP32);
  return r;
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
