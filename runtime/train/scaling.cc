// ScalingState: delayed / current / block scaling of one FP8 quantization site.
#include "runtime/train/scaling.h"

#include <algorithm>
#include <bit>
#include <cmath>

#include "absl/strings/str_cat.h"
#include "fp8rt/v1/scaling.pb.h"
#include "kernels/quantize.h"

namespace fp8rt::train {

std::string_view ScalingStrategyName(ScalingStrategy strategy) {
  switch (strategy) {
    case ScalingStrategy::kDelayed:
      return "delayed";
    case ScalingStrategy::kCurrent:
      return "current";
    case ScalingStrategy::kBlock:
      return "block";
    case ScalingStrategy::kMx32:
      return "mx32";
  }
  return "?";
}

absl::StatusOr<ScalingStrategy> ParseScalingStrategy(std::string_view name) {
  for (ScalingStrategy s :
       {ScalingStrategy::kDelayed, ScalingStrategy::kCurrent, ScalingStrategy::kBlock,
        ScalingStrategy::kMx32}) {
    if (name == ScalingStrategyName(s)) return s;
  }
  return absl::InvalidArgumentError(absl::StrCat("unknown scaling '", std::string(name),
                                                 "' (expected delayed, current, block or mx32)"));
}

std::string_view AmaxAlgoName(AmaxAlgo algo) {
  return algo == AmaxAlgo::kMax ? "max" : "most_recent";
}

absl::StatusOr<AmaxAlgo> ParseAmaxAlgo(std::string_view name) {
  if (name == "max") return AmaxAlgo::kMax;
  if (name == "most_recent") return AmaxAlgo::kMostRecent;
  return absl::InvalidArgumentError(absl::StrCat("unknown amax_compute_algo '", std::string(name),
                                                 "' (expected max or most_recent)"));
}

absl::Status ValidateScalingConfig(const ScalingConfig& config) {
  if (config.history_len < 1 || config.history_len > 4096) {
    return absl::InvalidArgumentError(
        absl::StrCat("history_len must be in [1, 4096], got ", config.history_len));
  }
  if (config.margin < 0 || config.margin > 32) {
    return absl::InvalidArgumentError(
        absl::StrCat("margin must be in [0, 32], got ", config.margin));
  }
  return absl::OkStatus();
}

ScalingState::ScalingState(const ScalingConfig& config) : config_(config) {}

bool ScalingState::UsesCurrentScaling() const {
  return config_.strategy != ScalingStrategy::kDelayed || history_.empty();
}

AmaxUpdate ScalingState::Update(float amax) {
  if (!std::isfinite(amax)) {
    ++nonfinite_amax_count_;
    return AmaxUpdate::kKeptNonFinite;
  }
  amax = std::fabs(amax);
  if (amax == 0.0f) {
    ++zero_amax_count_;
    return AmaxUpdate::kKeptZero;
  }
  history_.push_back(amax);
  while (static_cast<int>(history_.size()) > config_.history_len) history_.pop_front();
  ++updates_;
  Recompute();
  return AmaxUpdate::kRecorded;
}

void ScalingState::Recompute() {
  const float reduced = config_.algo == AmaxAlgo::kMax
                            ? *std::max_element(history_.begin(), history_.end())
                            : history_.back();
  scale_ = kernels::ComputeScale(reduced, config_.format, config_.margin, config_.power_of_two);
  scale_inv_ = 1.0f / scale_;
}

namespace {

v1::Fp8Format FormatToProto(kernels::Fp8Format f) {
  return f == kernels::Fp8Format::kE4M3 ? v1::FP8_FORMAT_E4M3 : v1::FP8_FORMAT_E5M2;
}

v1::ScalingStrategy StrategyToProto(ScalingStrategy s) {
  switch (s) {
    case ScalingStrategy::kDelayed:
      return v1::SCALING_STRATEGY_DELAYED;
    case ScalingStrategy::kCurrent:
      return v1::SCALING_STRATEGY_CURRENT;
    case ScalingStrategy::kBlock:
      return v1::SCALING_STRATEGY_BLOCK;
    case ScalingStrategy::kMx32:
      return v1::SCALING_STRATEGY_MX32;
  }
  return v1::SCALING_STRATEGY_UNSPECIFIED;
}

absl::Status BadField(const std::string& field, const std::string& problem) {
  return absl::DataLossError(absl::StrCat("scaling state: ", field, ": ", problem));
}

bool FinitePositive(float v) { return std::isfinite(v) && v > 0.0f; }

}  // namespace

void ScalingState::ToProto(v1::ScalingState* proto) const {
  proto->Clear();
  proto->set_format(FormatToProto(config_.format));
  proto->set_strategy(StrategyToProto(config_.strategy));
  proto->set_history_len(config_.history_len);
  proto->set_amax_algo(config_.algo == AmaxAlgo::kMax ? v1::AMAX_ALGO_MAX
                                                      : v1::AMAX_ALGO_MOST_RECENT);
  proto->set_margin(config_.margin);
  proto->set_power_of_two(config_.power_of_two);
  for (float a : history_) proto->add_amax_history(a);
  proto->set_scale(scale_);
  proto->set_scale_inv(scale_inv_);
  proto->set_updates(updates_);
  proto->set_zero_amax_count(zero_amax_count_);
  proto->set_nonfinite_amax_count(nonfinite_amax_count_);
}

absl::StatusOr<ScalingState> ScalingState::FromProto(const v1::ScalingState& proto) {
  ScalingConfig config;
  switch (proto.format()) {
    case v1::FP8_FORMAT_E4M3:
      config.format = kernels::Fp8Format::kE4M3;
      break;
    case v1::FP8_FORMAT_E5M2:
      config.format = kernels::Fp8Format::kE5M2;
      break;
    default:
      return BadField("format", absl::StrCat("unknown or unspecified value ", proto.format()));
  }
  switch (proto.strategy()) {
    case v1::SCALING_STRATEGY_DELAYED:
      config.strategy = ScalingStrategy::kDelayed;
      break;
    case v1::SCALING_STRATEGY_CURRENT:
      config.strategy = ScalingStrategy::kCurrent;
      break;
    case v1::SCALING_STRATEGY_BLOCK:
      config.strategy = ScalingStrategy::kBlock;
      break;
    case v1::SCALING_STRATEGY_MX32:
      config.strategy = ScalingStrategy::kMx32;
      break;
    default:
      return BadField("strategy", absl::StrCat("unknown or unspecified value ", proto.strategy()));
  }
  switch (proto.amax_algo()) {
    case v1::AMAX_ALGO_MAX:
      config.algo = AmaxAlgo::kMax;
      break;
    case v1::AMAX_ALGO_MOST_RECENT:
      config.algo = AmaxAlgo::kMostRecent;
      break;
    default:
      return BadField("amax_algo",
                      absl::StrCat("unknown or unspecified value ", proto.amax_algo()));
  }
  config.history_len = proto.history_len();
  config.margin = proto.margin();
  config.power_of_two = proto.power_of_two();
  if (absl::Status s = ValidateScalingConfig(config); !s.ok()) {
    return absl::DataLossError(absl::StrCat("scaling state: ", s.message()));
  }
  if (proto.amax_history_size() > config.history_len) {
    return BadField("amax_history", absl::StrCat(proto.amax_history_size(),
                                                 " values for history_len ", config.history_len));
  }
  for (int i = 0; i < proto.amax_history_size(); ++i) {
    if (!FinitePositive(proto.amax_history(i))) {
      return BadField(absl::StrCat("amax_history[", i, "]"),
                      absl::StrCat("must be finite and > 0, got ", proto.amax_history(i)));
    }
  }
  if (!FinitePositive(proto.scale())) {
    return BadField("scale", absl::StrCat("must be finite and > 0, got ", proto.scale()));
  }
  if (!FinitePositive(proto.scale_inv())) {
    return BadField("scale_inv", absl::StrCat("must be finite and > 0, got ", proto.scale_inv()));
  }
  for (auto [field, value] : {std::pair{"updates", proto.updates()},
                              std::pair{"zero_amax_count", proto.zero_amax_count()},
                              std::pair{"nonfinite_amax_count", proto.nonfinite_amax_count()}}) {
    if (value < 0) return BadField(field, absl::StrCat("must be >= 0, got ", value));
  }
  ScalingState state(config);
  state.history_.assign(proto.amax_history().begin(), proto.amax_history().end());
  state.scale_ = proto.scale();
  state.scale_inv_ = proto.scale_inv();
  state.updates_ = proto.updates();
  state.zero_amax_count_ = proto.zero_amax_count();
  state.nonfinite_amax_count_ = proto.nonfinite_amax_count();
  return state;
}

}  // namespace fp8rt::train
