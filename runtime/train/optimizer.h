// AdamW on FP32 master shards (DESIGN.md section 5).
//
// Index:
//   AdamWConfig          hyperparameters and the learning-rate schedule, one comment per field
//   ValidateAdamWConfig  InvalidArgument naming the field
//   LearningRate         linear warmup, then cosine decay to min_lr
//   ParamShard           one parameter shard: master weights, gradient and both moments
//   StepResult           what one Step() did (skipped or applied, grad norm, lr, applied steps)
//   AdamW                the optimizer: global norm, non-finite skip, clipping, update
//
// Ownership: the caller owns every buffer a ParamShard points to; the optimizer only reads the
// gradients and updates master weights and moments in place. It keeps one piece of state, the
// number of applied (not skipped) steps, which sets the bias corrections and must be saved in a
// checkpoint (applied_steps() / set_applied_steps()).
//
// Numerics: the gradient norm is accumulated in FP64 (sum of squares, shards and elements in
// order) and combined over the norm group in FP64, in rank order, so every rank sees the same
// bits; the update itself is FP32, element by element. A gradient holding NaN or Inf on any rank
// makes the global sum non-finite on every rank, so every rank skips the same step and leaves
// its weights and moments bit for bit as they were.
//
// Not thread-safe: one owner (the training step).
#ifndef FP8RT_RUNTIME_TRAIN_OPTIMIZER_H_
#define FP8RT_RUNTIME_TRAIN_OPTIMIZER_H_

#include <cstdint>
#include <span>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "kernels/device_array.h"
#include "kernels/layer_ops.h"
#include "kernels/ops.h"
#include "parallel/communicator.h"

namespace fp8rt::train {

struct AdamWConfig {
  double lr = 3e-4;           // peak learning rate, reached at the end of warmup; >= 0
  double beta1 = 0.9;         // decay of the first moment (mean of gradients), in [0, 1)
  double beta2 = 0.95;        // decay of the second moment (mean of squares), in [0, 1)
  double eps = 1e-8;          // added to sqrt(v_hat) in the denominator; > 0
  double weight_decay = 0.0;  // decoupled: master -= lr_t * weight_decay * master; >= 0
  double clip = 1.0;          // max global gradient L2 norm; 0 turns clipping off; >= 0
  int64_t warmup = 0;         // steps of linear warmup from lr / warmup up to lr; >= 0
  int64_t steps = 0;          // step at which the cosine reaches min_lr; <= warmup: no decay
  double min_lr = 0.0;        // learning rate at `steps` and after; in [0, lr]
};

// InvalidArgument naming the field (lr, beta1, beta2, eps, weight_decay, clip, warmup, steps,
// min_lr) when a value is out of the range given above or not finite.
absl::Status ValidateAdamWConfig(const AdamWConfig& config);

// Learning rate of 1-based step `step` (step >= 1; aborts otherwise), with W = warmup,
// S = steps:
//   step <= W             lr * step / W                            (lr / W at step 1, lr at W)
//   W < step, S <= W      lr                                       (no decay span)
//   W < step <= S         min_lr + (lr - min_lr) * (1 + cos(pi * (step - W) / (S - W))) / 2
//   step > S > W          min_lr
// Evaluated in double. The cosine starts from lr at step W (the warmup's last value) and
// reaches min_lr exactly at step S.
double LearningRate(const AdamWConfig& config, int64_t step);

// One shard of parameters held by this rank. All four arrays hold `count` FP32 values and are
// owned by the caller; they may be null when count is 0.
struct ParamShard {
  std::string name;         // stable parameter name, e.g. "blocks.3.mlp.fc1/weight"; for errors
  float* master = nullptr;  // FP32 master weights, updated in place
  float* grad = nullptr;    // FP32 gradient (already reduced over data parallel); read only
  float* m = nullptr;       // first moment, updated in place (zero before the first step)
  float* v = nullptr;       // second moment, updated in place (zero before the first step)
  int64_t count = 0;        // elements in each array; >= 0
  bool decay = true;        // apply weight decay (false for norms' gains and biases)
  // Counted in the global norm. False for a replica whose identical twin on another rank is
  // counted (a parameter replicated over tensor parallelism); a NaN or Inf in it still makes the
  // norm non-finite, so the step is still skipped everywhere.
  bool in_norm = true;
  // Optional: this shard's FP8 copy (an FSDP FP8 weight shard, tensor or 128x128 block scaled),
  // written in the same pass as the update (kernels::AdamWFp8Output); backend memory. codes
  // null: none.
  kernels::AdamWFp8Output fp8{};
};

// What one Step() did.
struct StepResult {
  bool skipped = false;       // the global gradient was not finite; nothing was changed
  double grad_norm = 0.0;     // global L2 norm of the gradient before clipping (NaN or Inf when
                              // skipped)
  float clip_scale = 1.0f;    // factor the gradient was multiplied by (1 when not clipped)
  double lr = 0.0;            // LearningRate(config, step); reported even when skipped
  int64_t applied_steps = 0;  // applied (not skipped) steps so far, this one included
};

class AdamW {
 public:
  // `config` must be valid (ValidateAdamWConfig); aborts otherwise. The gradient norm and the
  // update run on `ops` (OpTable::layer's sum_squares and adamw), so every ParamShard buffer must
  // be memory that backend's ops can use; Step synchronises before it returns.
  explicit AdamW(const AdamWConfig& config, const kernels::OpTable& ops = kernels::CpuOps());

  const AdamWConfig& config() const { return config_; }

  // One optimizer step at 1-based schedule step `step` over this rank's shards:
  //  1. sum of squares of every gradient, in FP64, shards and elements in order;
  //  2. combined over `norm_group` (null: this rank's sum is the global one) by gathering every
  //     rank's FP64 sum and adding them in rank order, so the result has the same bits on every
  //     rank (a collective: every rank of the group must call Step for the same step);
  //  3. a non-finite sum (a NaN or Inf in any rank's gradient) skips the step: weights, moments
  //     and applied_steps() are left untouched and StepResult::skipped is set, on every rank;
  //  4. otherwise clip_scale = min(1, clip / (norm + 1e-6)) when clip > 0, and per element, in
  //     FP32, with t = applied_steps() + 1 and g = grad * clip_scale:
  //       master -= lr * weight_decay * master   (decay shards only; decoupled from the moments)
  //       m = beta1 * m + (1 - beta1) * g
  //       v = beta2 * v + (1 - beta2) * g * g
  //       master -= lr * (m / (1 - beta1^t)) / (sqrt(v / (1 - beta2^t)) + eps)
  // The gradients are not modified (clipping is applied on the fly). Returns InvalidArgument
  // for step < 1 or a malformed shard (naming it) before any collective; an error from the
  // collective is returned with nothing changed. An empty shard list is a valid step (a rank
  // may hold no parameters) and still takes part in the norm collective.
  [[nodiscard]] absl::StatusOr<StepResult> Step(std::span<ParamShard> shards, int64_t step,
                                                parallel::Communicator* norm_group);
  // Step in two halves, for a caller that decides something between the skip decision and the
  // update (the step loop updates the FP8 scaling states there, so that the update can write the
  // FP8 weight shards with the next step's scales). ComputeNorm does 1-3 and changes nothing;
  // Apply does 4 with its result (nothing when it says skipped) and returns the final result.
  [[nodiscard]] absl::StatusOr<StepResult> ComputeNorm(std::span<const ParamShard> shards,
                                                       int64_t step,
                                                       parallel::Communicator* norm_group);
  [[nodiscard]] absl::StatusOr<StepResult> Apply(std::span<const ParamShard> shards,
                                                 const StepResult& norm);

  // Applied (not skipped) steps so far: the t of the bias corrections. Saved in checkpoints.
  int64_t applied_steps() const { return applied_steps_; }
  // Restores the count from a checkpoint; n >= 0 (aborts otherwise: validate on load).
  void set_applied_steps(int64_t n);

 private:
  const AdamWConfig config_;     // fixed after construction
  const kernels::OpTable* ops_;  // fixed after construction
  int64_t applied_steps_ = 0;
  kernels::DeviceArray<double> sums_;  // each shard's sum of squares, reused across steps
};

}  // namespace fp8rt::train

#endif  // FP8RT_RUNTIME_TRAIN_OPTIMIZER_H_
