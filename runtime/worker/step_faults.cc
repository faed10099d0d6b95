// FP8RT_FAULT's parser and the step loop's fault points (see step_faults.h).
#include "runtime/worker/step_faults.h"

#include <algorithm>
#include <chrono>
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <limits>
#include <set>
#include <thread>
#include <utility>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "runtime/core/status.h"

namespace fp8rt::worker {

float FaultSpec::value() const {
  return kind == Kind::kInfGrad || kind == Kind::kInfAct ? std::numeric_limits<float>::infinity()
                                                         : std::numeric_limits<float>::quiet_NaN();
}

absl::StatusOr<FaultSpec> FaultSpec::Parse(const std::string& text) {
  FaultSpec f;
  if (text.empty()) return f;
  auto bad = [&] {
    return absl::InvalidArgumentError(
        absl::StrCat("FP8RT_FAULT='", text,
                     "': expected KIND:rank=R:step=S with KIND nan_grad, inf_grad, kill or hang, "
                     "KIND:rank=R:step=S[:block=B] with KIND nan_act or inf_act, "
                     "outlier_act:rank=R:step=S:layer=NAME[:growth=G][:steps=N], or "
                     "slow_register:rank=R:ms=M"));
  };
  std::vector<std::string> parts = absl::StrSplit(text, ':');
  static const std::pair<const char*, Kind> kKinds[] = {{"nan_grad", Kind::kNanGrad},
                                                        {"inf_grad", Kind::kInfGrad},
                                                        {"nan_act", Kind::kNanAct},
                                                        {"inf_act", Kind::kInfAct},
                                                        {"kill", Kind::kKill},
                                                        {"hang", Kind::kHang},
                                                        {"outlier_act", Kind::kOutlierAct},
                                                        {"slow_register", Kind::kSlowRegister}};
  for (const auto& [name, kind] : kKinds) {
    if (parts[0] == name) f.kind = kind;
  }
  if (f.kind == Kind::kNone) return bad();
  // The keys each kind takes; rank and step are required (slow_register: rank and ms).
  const bool slow_register = f.kind == Kind::kSlowRegister;
  std::vector<std::string> keys = {"rank", slow_register ? "ms" : "step"};
  if (f.act()) keys.push_back("block");
  if (f.kind == Kind::kOutlierAct) keys.insert(keys.end(), {"layer", "growth", "steps"});
  std::set<std::string> seen;
  for (size_t i = 1; i < parts.size(); ++i) {
    std::vector<std::string> kv = absl::StrSplit(parts[i], absl::MaxSplits('=', 1));
    if (kv.size() != 2 || std::find(keys.begin(), keys.end(), kv[0]) == keys.end() ||
        !seen.insert(kv[0]).second) {
      return bad();
    }
    if (kv[0] == "layer") {
      if (kv[1].empty()) return bad();
      f.layer = kv[1];
      continue;
    }
    int64_t value = 0;
    if (!absl::SimpleAtoi(kv[1], &value) || value < 0) return bad();
    if (kv[0] == "rank") f.rank = static_cast<int>(value);
    if (kv[0] == "step") f.step = value;
    if (kv[0] == "block") f.block = value;
    if (kv[0] == "growth") f.growth = value;
    if (kv[0] == "steps") f.grow_steps = value;
    if (kv[0] == "ms") f.delay_ms = value;
  }
  if (!seen.contains("rank")) return bad();
  if (slow_register) {
    // At most ten minutes: a test fault, not a way to park a rank.
    if (!seen.contains("ms") || f.delay_ms > 600'000) return bad();
    return f;
  }
  if (!seen.contains("step") || f.step < 1) return bad();
  if (f.kind == Kind::kOutlierAct && (f.layer.empty() || f.growth < 1 || f.growth > 1024)) {
    return bad();
  }
  return f;
}

absl::StatusOr<FaultSpec> FaultSpec::FromEnvironment() {
  const char* fault = std::getenv("FP8RT_FAULT");
  return Parse(fault == nullptr ? "" : fault);
}

absl::Status StepFaults::CheckModel(int64_t layers,
                                    const std::vector<std::string>& layer_names) const {
  if (spec_.kind == FaultSpec::Kind::kOutlierAct &&
      std::find(layer_names.begin(), layer_names.end(), spec_.layer) == layer_names.end()) {
    return absl::InvalidArgumentError(absl::StrCat("FP8RT_FAULT: layer=", spec_.layer,
                                                   " is not a layer of the model"));
  }
  if (spec_.act() && spec_.block >= layers) {
    return absl::InvalidArgumentError(absl::StrCat("FP8RT_FAULT: block=", spec_.block,
                                                   " but the model has ", layers,
                                                   " blocks (model.layers)"));
  }
  return absl::OkStatus();
}

void StepFaults::BeforeRegister() const {
  if (spec_.kind != FaultSpec::Kind::kSlowRegister || spec_.rank != rank_ || resumed_) return;
  std::fprintf(stderr, "fp8rt-worker: rank %d: FP8RT_FAULT delays its registration by %lld ms\n",
               rank_, static_cast<long long>(spec_.delay_ms));
  std::fflush(nullptr);
  std::this_thread::sleep_for(std::chrono::milliseconds(spec_.delay_ms));
}

void StepFaults::BeforeStep(int64_t step) const {
  const bool kill = spec_.kind == FaultSpec::Kind::kKill;
  if (!(kill || spec_.kind == FaultSpec::Kind::kHang) || !Due(step) || resumed_) return;
  std::fprintf(stderr, "fp8rt-worker: rank %d: FP8RT_FAULT %s this rank at step %lld\n", rank_,
               kill ? "kills" : "stops (SIGSTOP)", static_cast<long long>(step));
  std::fflush(nullptr);
  std::raise(kill ? SIGKILL : SIGSTOP);
}

void StepFaults::BeforeForward(int64_t step, model::Transformer& model) const {
  if (spec_.act() && Due(step)) model.ArmActivationFault(spec_.block, spec_.value());
  if (spec_.kind == FaultSpec::Kind::kOutlierAct && Due(step)) {
    std::fprintf(stderr,
                 "fp8rt-worker: rank %d: FP8RT_FAULT puts a growing outlier (x%lld a step for %lld "
                 "steps) into the input of %s from step %lld\n",
                 rank_, static_cast<long long>(spec_.growth),
                 static_cast<long long>(spec_.grow_steps), spec_.layer.c_str(),
                 static_cast<long long>(step));
    model.ArmInputOutlier(spec_.layer, static_cast<float>(spec_.growth), spec_.grow_steps);
  }
}

absl::StatusOr<bool> StepFaults::AfterReduceGrads(int64_t step, model::Transformer& model,
                                                  const kernels::OpTable& ops) const {
  if (!spec_.grad() || !Due(step)) return false;
  FP8RT_RETURN_IF_ERROR(PutIntoGradShard(model, ops, spec_.value()));
  return true;
}

absl::Status PutIntoGradShard(model::Transformer& model, const kernels::OpTable& ops, float value) {
  model::Param& first = model.params().front();
  if (first.grad.size() == 0) {
    return absl::FailedPreconditionError(
        absl::StrCat("cannot mark the step non-finite: this rank's gradient shard of ", first.name,
                     " is empty"));
  }
  FP8RT_RETURN_IF_ERROR(ops.layer->synchronize({}));
  first.grad[0] = value;
  return absl::OkStatus();
}

}  // namespace fp8rt::worker
