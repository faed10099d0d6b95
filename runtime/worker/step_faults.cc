// FP8RT_FAULT's parser and the step loop's fault points (see step_faults.h).
#include "runtime/worker/step_faults.h"

#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <limits>
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
    return absl::InvalidArgumentError(absl::StrCat(
        "FP8RT_FAULT='", text,
        "': expected KIND:rank=R:step=S with KIND nan_grad, inf_grad, kill or hang, or "
        "KIND:rank=R:step=S[:block=B] with KIND nan_act or inf_act"));
  };
  std::vector<std::string> parts = absl::StrSplit(text, ':');
  static const std::pair<const char*, Kind> kKinds[] = {
      {"nan_grad", Kind::kNanGrad}, {"inf_grad", Kind::kInfGrad}, {"nan_act", Kind::kNanAct},
      {"inf_act", Kind::kInfAct},   {"kill", Kind::kKill},        {"hang", Kind::kHang}};
  for (const auto& [name, kind] : kKinds) {
    if (parts[0] == name) f.kind = kind;
  }
  if (f.kind == Kind::kNone) return bad();
  if (parts.size() != 3 && !(f.act() && parts.size() == 4)) return bad();
  bool seen[3] = {false, false, false};  // rank, step, block
  for (size_t i = 1; i < parts.size(); ++i) {
    std::vector<std::string> kv = absl::StrSplit(parts[i], '=');
    if (kv.size() != 2) return bad();
    int64_t value = 0;
    if (!absl::SimpleAtoi(kv[1], &value) || value < 0) return bad();
    if (kv[0] == "rank" && !seen[0]) {
      f.rank = static_cast<int>(value);
      seen[0] = true;
    } else if (kv[0] == "step" && !seen[1]) {
      f.step = value;
      seen[1] = true;
    } else if (kv[0] == "block" && f.act() && !seen[2]) {
      f.block = value;
      seen[2] = true;
    } else {
      return bad();
    }
  }
  if (!seen[0] || !seen[1] || f.step < 1) return bad();
  return f;
}

absl::StatusOr<FaultSpec> FaultSpec::FromEnvironment() {
  const char* fault = std::getenv("FP8RT_FAULT");
  return Parse(fault == nullptr ? "" : fault);
}

absl::Status StepFaults::CheckModel(int64_t layers) const {
  if (spec_.act() && spec_.block >= layers) {
    return absl::InvalidArgumentError(absl::StrCat("FP8RT_FAULT: block=", spec_.block,
                                                   " but the model has ", layers,
                                                   " blocks (model.layers)"));
  }
  return absl::OkStatus();
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
