// The step loop's named fault points for FP8RT_FAULT (test faults; the forms are documented in
// runtime/worker/trainer.h and docs/operations.md), so that Trainer::Step() only calls them.
//
// Index:
//   FaultSpec         FP8RT_FAULT parsed: kind, rank, step, block
//   StepFaults        BeforeRegister (slow_register), then the points a step passes, in order:
//                     BeforeStep (kill, hang), BeforeForward (nan_act, inf_act),
//                     AfterReduceGrads (nan_grad, inf_grad)
//   PutIntoGradShard  writes a value into this rank's first gradient shard element (the grad
//                     faults, and the trainer's non-finite skip)
//
// The gradient faults write the rank's FP32 gradient shard after the DP reduction, not the
// full-size gradient before it: the model frees each layer's full gradient as soon as its
// backward has reduce-scattered it (ZeRO-3), so the shard is the only gradient left at the end of
// the step. The optimizer's global norm spans every rank's shards, so a NaN there still makes
// every rank skip the step.
//
// Not thread-safe; one per rank, fixed after Trainer::Create.
#ifndef FP8RT_RUNTIME_WORKER_STEP_FAULTS_H_
#define FP8RT_RUNTIME_WORKER_STEP_FAULTS_H_

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "kernels/ops.h"
#include "runtime/model/transformer.h"

namespace fp8rt::worker {

struct FaultSpec {
  enum class Kind : uint8_t {
    kNone,
    kNanGrad,
    kInfGrad,
    kNanAct,
    kInfAct,
    kKill,
    kHang,
    kOutlierAct,
    kSlowRegister
  } kind = Kind::kNone;
  int rank = -1;
  int64_t step = -1;
  int64_t block = 0;  // nan_act / inf_act: the block whose input is poisoned
  // outlier_act: the layer whose FP8 input gets the outlier, its growth per forward and how many
  // forwards it grows (then it holds).
  std::string layer;
  int64_t growth = 2;
  int64_t grow_steps = 10;
  int64_t delay_ms = 0;  // slow_register: how long the rank waits before it registers
  bool grad() const { return kind == Kind::kNanGrad || kind == Kind::kInfGrad; }
  bool act() const { return kind == Kind::kNanAct || kind == Kind::kInfAct; }
  // The value a nan_* / inf_* fault injects.
  float value() const;
  // InvalidArgument naming FP8RT_FAULT when `text` is not one of the forms of trainer.h.
  static absl::StatusOr<FaultSpec> Parse(const std::string& text);
  // Parse of the FP8RT_FAULT environment variable (unset: no fault).
  static absl::StatusOr<FaultSpec> FromEnvironment();
};

class StepFaults {
 public:
  StepFaults() = default;  // no fault
  // `rank`: this process's world rank; `resumed`: started with --resume (kill and hang fire in a
  // first attempt only, so that the restarted run gets past them).
  StepFaults(const FaultSpec& spec, int rank, bool resumed)
      : spec_(spec), rank_(rank), resumed_(resumed) {}

  // InvalidArgument naming FP8RT_FAULT when an activation fault names a block (`layers`: the
  // model's block count) or a layer (`layer_names`) the model lacks.
  absl::Status CheckModel(int64_t layers, const std::vector<std::string>& layer_names) const;

  // Before this rank registers with the controller: slow_register sleeps for its delay (a rank
  // that registers late, e.g. slow to start on a loaded node), after a line on stderr; not in a
  // resumed run, as kill and hang.
  void BeforeRegister() const;
  // Start of step `step`, before anything of it runs: kill (SIGKILL) or hang (SIGSTOP) this
  // rank, after a line on stderr. Returns when no such fault is due.
  void BeforeStep(int64_t step) const;
  // After the step's gathers, before its first forward: arms nan_act / inf_act in the model (the
  // first micro-batch's forward writes the value into the input of the fault's block), and
  // outlier_act in the fault's layer (from this step on, model::Linear::ArmInputOutlier).
  void BeforeForward(int64_t step, model::Transformer& model) const;
  // After model.ReduceGrads(), before the optimizer: nan_grad / inf_grad put their value into
  // this rank's gradient shard. True when it fired (the rank then counts among the step's
  // non-finite ranks).
  absl::StatusOr<bool> AfterReduceGrads(int64_t step, model::Transformer& model,
                                        const kernels::OpTable& ops) const;

 private:
  bool Due(int64_t step) const { return spec_.rank == rank_ && spec_.step == step; }

  FaultSpec spec_;        // fixed after construction
  int rank_ = -1;         // fixed after construction
  bool resumed_ = false;  // fixed after construction
};

// Element 0 of this rank's gradient shard of the model's first parameter becomes `value`, after
// the backend's stream is synchronised (the reduce-scatter may still be writing it on CUDA).
absl::Status PutIntoGradShard(model::Transformer& model, const kernels::OpTable& ops, float value);

}  // namespace fp8rt::worker

#endif  // FP8RT_RUNTIME_WORKER_STEP_FAULTS_H_
