// AdamW: config checks, the learning-rate schedule, the global gradient norm and the update.
#include "runtime/train/optimizer.h"

#include <algorithm>
#include <bit>
#include <cmath>
#include <numbers>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "runtime/core/check.h"
#include "runtime/core/status.h"

namespace fp8rt::train {
namespace {

// Added to the norm in the clip factor so that a zero gradient never divides by zero.
constexpr double kClipNormEps = 1e-6;

absl::Status OutOfRange(const char* field, double value, const char* range) {
  return absl::InvalidArgumentError(
      absl::StrCat("optimizer field '", field, "' is ", value, "; must be ", range));
}

absl::Status ValidateShard(const ParamShard& s) {
  if (s.count < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("parameter shard '", s.name, "': count is ", s.count, "; must be >= 0"));
  }
  if (s.count > 0 &&
      (s.master == nullptr || s.grad == nullptr || s.m == nullptr || s.v == nullptr)) {
    return absl::InvalidArgumentError(
        absl::StrCat("parameter shard '", s.name, "': ", s.count,
                     " elements but a null master, grad, m or v pointer"));
  }
  if (absl::Status st = kernels::ValidateAdamWFp8Output(s.fp8, s.count, "adamw"); !st.ok()) {
    return absl::InvalidArgumentError(
        absl::StrCat("parameter shard '", s.name, "': ", st.message()));
  }
  return absl::OkStatus();
}

// Adds every rank's FP64 sum in rank order. The doubles travel as their int64 bit patterns in
// an all-gather (the Communicator reduces no FP64), so the sum is exact to FP64 rounding, the
// same bits on every rank, and NaN or Inf from any rank reaches all of them.
absl::StatusOr<double> GlobalSum(double local, parallel::Communicator* group) {
  if (group == nullptr) return local;
  std::vector<int64_t> all(static_cast<size_t>(group->size()));
  const int64_t mine = std::bit_cast<int64_t>(local);
  FP8RT_RETURN_IF_ERROR(group->AllGather(&mine, 1, all.data(), parallel::DType::kI64));
  double sum = 0.0;
  for (int64_t bits : all) sum += std::bit_cast<double>(bits);
  return sum;
}

}  // namespace

absl::Status ValidateAdamWConfig(const AdamWConfig& c) {
  if (!(std::isfinite(c.lr) && c.lr >= 0)) return OutOfRange("lr", c.lr, "finite and >= 0");
  if (!(c.beta1 >= 0 && c.beta1 < 1)) return OutOfRange("beta1", c.beta1, "in [0, 1)");
  if (!(c.beta2 >= 0 && c.beta2 < 1)) return OutOfRange("beta2", c.beta2, "in [0, 1)");
  if (!(std::isfinite(c.eps) && c.eps > 0)) return OutOfRange("eps", c.eps, "finite and > 0");
  if (!(std::isfinite(c.weight_decay) && c.weight_decay >= 0)) {
    return OutOfRange("weight_decay", c.weight_decay, "finite and >= 0");
  }
  if (!(std::isfinite(c.clip) && c.clip >= 0)) {
    return OutOfRange("clip", c.clip, "finite and >= 0 (0 turns clipping off)");
  }
  if (c.warmup < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("optimizer field 'warmup' is ", c.warmup, "; must be >= 0"));
  }
  if (c.steps < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("optimizer field 'steps' is ", c.steps, "; must be >= 0"));
  }
  if (!(c.min_lr >= 0 && c.min_lr <= c.lr)) {
    return OutOfRange("min_lr", c.min_lr, absl::StrCat("in [0, lr = ", c.lr, "]").c_str());
  }
  return absl::OkStatus();
}

double LearningRate(const AdamWConfig& c, int64_t step) {
  FP8RT_CHECK(step >= 1) << "learning-rate step " << step << "; steps are 1-based";
  if (step <= c.warmup) {
    return c.lr * static_cast<double>(step) / static_cast<double>(c.warmup);
  }
  if (c.steps <= c.warmup) return c.lr;
  if (step >= c.steps) return c.min_lr;
  const double progress =
      static_cast<double>(step - c.warmup) / static_cast<double>(c.steps - c.warmup);
  return c.min_lr + (c.lr - c.min_lr) * 0.5 * (1.0 + std::cos(std::numbers::pi * progress));
}

AdamW::AdamW(const AdamWConfig& config, const kernels::OpTable& ops) : config_(config), ops_(&ops) {
  const absl::Status status = ValidateAdamWConfig(config);
  FP8RT_CHECK(status.ok()) << status;
}

void AdamW::set_applied_steps(int64_t n) {
  FP8RT_CHECK(n >= 0) << "applied steps " << n;
  applied_steps_ = n;
}

absl::StatusOr<StepResult> AdamW::Step(std::span<ParamShard> shards, int64_t step,
                                       parallel::Communicator* norm_group) {
  FP8RT_ASSIGN_OR_RETURN(const StepResult norm, ComputeNorm(shards, step, norm_group));
  return Apply(shards, norm);
}

absl::StatusOr<StepResult> AdamW::ComputeNorm(std::span<const ParamShard> shards, int64_t step,
                                              parallel::Communicator* norm_group) {
  if (step < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("optimizer step is ", step, "; steps are 1-based"));
  }
  for (const ParamShard& s : shards) FP8RT_RETURN_IF_ERROR(ValidateShard(s));

  // Each shard's sum of squares on the backend, then their sum on the host, in shard order.
  const kernels::LayerOps& ops = *ops_->layer;
  if (sums_.size() < shards.size()) {
    // Read by the host every step: pinned host memory on CUDA (sum_squares writes it plainly).
    sums_ = kernels::DeviceArray<double>(*ops_, kernels::MemCategory::kOptimizerState,
                                         kernels::Placement::kHostRead);
    sums_.assign(shards.size(), 0.0);
  }
  for (size_t i = 0; i < shards.size(); ++i) {
    FP8RT_RETURN_IF_ERROR(ops.sum_squares(shards[i].grad, shards[i].count, &sums_[i], {}));
  }
  FP8RT_RETURN_IF_ERROR(ops.synchronize({}));
  double local = 0.0;
  for (size_t i = 0; i < shards.size(); ++i) {
    // A shard left out of the norm still poisons it with a NaN or Inf (0 * Inf is NaN).
    local += shards[i].in_norm ? sums_[i] : sums_[i] * 0.0;
  }
  FP8RT_ASSIGN_OR_RETURN(const double global, GlobalSum(local, norm_group));

  StepResult result;
  result.grad_norm = std::sqrt(global);
  result.lr = LearningRate(config_, step);
  if (!std::isfinite(global)) {
    result.skipped = true;
    result.applied_steps = applied_steps_;
    return result;
  }
  if (config_.clip > 0) {
    result.clip_scale =
        static_cast<float>(std::min(1.0, config_.clip / (result.grad_norm + kClipNormEps)));
  }
  result.applied_steps = applied_steps_;
  return result;
}

absl::StatusOr<StepResult> AdamW::Apply(std::span<const ParamShard> shards,
                                        const StepResult& norm) {
  StepResult result = norm;
  if (result.skipped) {
    result.applied_steps = applied_steps_;
    return result;
  }
  for (const ParamShard& s : shards) FP8RT_RETURN_IF_ERROR(ValidateShard(s));
  const kernels::LayerOps& ops = *ops_->layer;

  // Per-step scalars in FP64, rounded once to FP32; the per-element update is FP32.
  const int64_t t = applied_steps_ + 1;
  const double t_d = static_cast<double>(t);
  kernels::AdamWArgs k;
  k.lr = static_cast<float>(result.lr);
  k.clip_scale = result.clip_scale;
  k.beta1 = static_cast<float>(config_.beta1);
  k.one_minus_beta1 = static_cast<float>(1.0 - config_.beta1);
  k.beta2 = static_cast<float>(config_.beta2);
  k.one_minus_beta2 = static_cast<float>(1.0 - config_.beta2);
  k.bias1 = static_cast<float>(1.0 - std::pow(config_.beta1, t_d));
  k.bias2 = static_cast<float>(1.0 - std::pow(config_.beta2, t_d));
  k.eps = static_cast<float>(config_.eps);
  const float decay = static_cast<float>(result.lr * config_.weight_decay);
  for (const ParamShard& s : shards) {
    k.master = s.master;
    k.grad = s.grad;
    k.m = s.m;
    k.v = s.v;
    k.count = s.count;
    k.decay = s.decay ? decay : 0.0f;
    k.fp8 = s.fp8;
    FP8RT_RETURN_IF_ERROR(ops.adamw(k, {}));
  }
  // The host may read the master shards (host-visible memory) once the step returns (a
  // checkpoint): one wait per optimizer step, not per pass.
  FP8RT_RETURN_IF_ERROR(ops.synchronize({}));
  applied_steps_ = t;
  result.applied_steps = t;
  return result;
}

}  // namespace fp8rt::train
