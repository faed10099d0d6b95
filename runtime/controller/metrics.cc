// The controller's Prometheus metrics (see metrics.h and docs/metrics.md).
#include "runtime/controller/metrics.h"

#include <set>

#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"

namespace fp8rt::controller {
namespace {

using prometheus::Counter;
using prometheus::Family;
using prometheus::Gauge;

constexpr v1::RunState kStates[] = {v1::RUN_STATE_RUNNING, v1::RUN_STATE_STOPPING,
                                    v1::RUN_STATE_FINISHED, v1::RUN_STATE_FAILED};

Family<Gauge>* NewGauge(prometheus::Registry& registry, const char* name, const char* help) {
  return &prometheus::BuildGauge().Name(name).Help(help).Register(registry);
}

Family<Counter>* NewCounter(prometheus::Registry& registry, const char* name, const char* help) {
  return &prometheus::BuildCounter().Name(name).Help(help).Register(registry);
}

prometheus::Labels SiteLabels(const std::string& run, const v1::SiteStats& site) {
  prometheus::Labels labels{
      {"run", run}, {"layer", site.layer()}, {"tensor", TensorRoleLabel(site.tensor())}};
  if (site.expert() >= 0) labels.emplace("expert", absl::StrCat(site.expert()));
  return labels;
}

// A per-run counter raised to `total` (never lowered).
void RaiseCounter(Family<Counter>& family, const std::string& run, int64_t total) {
  Counter& c = family.Add({{"run", run}});
  const double missing = static_cast<double>(total) - c.Value();
  if (missing > 0) c.Increment(missing);
}

std::string SiteKey(const v1::SiteStats& site) {
  return absl::StrCat(site.layer(), "/", TensorRoleLabel(site.tensor()), "/", site.expert());
}

}  // namespace

std::string TensorRoleLabel(v1::TensorRole role) {
  switch (role) {
    case v1::TENSOR_ROLE_INPUT:
      return "input";
    case v1::TENSOR_ROLE_WEIGHT:
      return "weight";
    case v1::TENSOR_ROLE_GRAD_OUTPUT:
      return "grad_output";
    default:
      return "unspecified";
  }
}

std::string RunStateLabel(v1::RunState state) {
  switch (state) {
    case v1::RUN_STATE_RUNNING:
      return "running";
    case v1::RUN_STATE_STOPPING:
      return "stopping";
    case v1::RUN_STATE_FINISHED:
      return "finished";
    case v1::RUN_STATE_FAILED:
      return "failed";
    default:
      return "unspecified";
  }
}

ControllerMetrics::ControllerMetrics() : registry_(std::make_shared<prometheus::Registry>()) {
  prometheus::Registry& r = *registry_;
  run_state_ = NewGauge(r, "fp8rt_run_state",
                        "1 for the run's current state (running, stopping, finished, failed), "
                        "0 for the others.");
  world_size_ = NewGauge(r, "fp8rt_world_size", "Ranks of the run (dp x tp).");
  workers_connected_ = NewGauge(r, "fp8rt_workers_connected",
                                "Ranks heard from (register or heartbeat) within the heartbeat "
                                "timeout.");
  train_step_ = NewGauge(r, "fp8rt_train_step", "Latest optimizer step reported (1-based).");
  train_loss_ = NewGauge(r, "fp8rt_train_loss", "Training loss of the latest step.");
  eval_loss_ = NewGauge(r, "fp8rt_eval_loss",
                        "Validation loss of the latest eval step (eval.every): the mean over the "
                        "eval batches of every DP rank, before that step's update.");
  learning_rate_ = NewGauge(r, "fp8rt_train_learning_rate", "Learning rate of the latest step.");
  grad_norm_ = NewGauge(r, "fp8rt_grad_norm",
                        "Global gradient norm of the latest step (NaN when it was skipped).");
  tokens_per_second_ =
      NewGauge(r, "fp8rt_tokens_per_second", "Training throughput of the latest step, all ranks.");
  step_time_ = NewGauge(r, "fp8rt_step_time_seconds", "Wall time of the latest step.");
  skipped_steps_ =
      NewCounter(r, "fp8rt_skipped_steps_total",
                 "Optimizer steps skipped for non-finite values (gradients, loss or FP8 amaxes).");
  reports_dropped_ = NewCounter(
      r, "fp8rt_step_reports_dropped_total",
      "Step reports rank 0 could not deliver (its bounded report queue was full, or the call "
      "failed); training never waits for the controller.");
  fp8_stats_step_ =
      NewGauge(r, "fp8rt_fp8_stats_step", "Step of the per-site FP8 statistics (fp8rt_fp8_*).");
  fp8_amax_ = NewGauge(r, "fp8rt_fp8_amax",
                       "Absolute maximum of the tensor at an FP8 site (max over all ranks).");
  fp8_scale_ = NewGauge(r, "fp8rt_fp8_scale", "Scale the FP8 site quantized with.");
  fp8_underflow_ = NewGauge(r, "fp8rt_fp8_underflow_ratio",
                            "Fraction of nonzero values of the FP8 site flushed to zero.");
  fp8_saturation_ = NewGauge(r, "fp8rt_fp8_saturation_ratio",
                             "Fraction of values of the FP8 site clamped to the format's maximum.");
  comm_bytes_ = NewCounter(r, "fp8rt_comm_bytes_total",
                           "Bytes moved by collectives, summed over ranks, by op and dtype.");
  checkpoint_step_ = NewGauge(r, "fp8rt_checkpoint_last_committed_step",
                              "Step of the newest committed checkpoint.");
  checkpoint_time_ = NewGauge(r, "fp8rt_checkpoint_last_committed_timestamp_seconds",
                              "Unix time of the newest checkpoint commit.");
  recipe_version_ = NewGauge(r, "fp8rt_recipe_version", "Newest recipe version of the run.");
  events_ = NewCounter(r, "fp8rt_events_total",
                       "Events recorded for the run, by kind (worker_lost, layer_demoted, ...).");
  expert_tokens_ = NewGauge(r, "fp8rt_moe_expert_tokens",
                            "Token assignments an MoE expert processed in the last reported step, "
                            "summed over ranks.");
  moe_dropped_ = NewGauge(r, "fp8rt_moe_dropped_tokens",
                          "Token assignments an MoE block dropped over capacity in the last "
                          "reported step, summed over ranks.");
  memory_peak_ = NewGauge(r, "fp8rt_memory_peak_bytes",
                          "Most backend memory one rank has held at once since the workers "
                          "started, by category (max over ranks).");
}

Gauge& ControllerMetrics::RunGauge(Family<Gauge>* family, const std::string& run) {
  return family->Add({{"run", run}});
}

void ControllerMetrics::SetRunState(const std::string& run, v1::RunState state, int world_size) {
  for (v1::RunState s : kStates) {
    run_state_->Add({{"run", run}, {"state", RunStateLabel(s)}}).Set(s == state ? 1 : 0);
  }
  RunGauge(world_size_, run).Set(world_size);
}

void ControllerMetrics::SetStep(const std::string& run, const v1::StepMetrics& step) {
  RunGauge(train_step_, run).Set(static_cast<double>(step.step()));
  RunGauge(train_loss_, run).Set(step.loss());
  RunGauge(learning_rate_, run).Set(step.lr());
  RunGauge(grad_norm_, run).Set(step.grad_norm());
  RunGauge(tokens_per_second_, run).Set(step.tokens_per_s());
  RunGauge(step_time_, run).Set(step.step_time_s());
}

void ControllerMetrics::SetEvalLoss(const std::string& run, double val_loss) {
  RunGauge(eval_loss_, run).Set(val_loss);
}

void ControllerMetrics::SetSkippedSteps(const std::string& run, int64_t total) {
  RaiseCounter(*skipped_steps_, run, total);
}

void ControllerMetrics::SetReportsDropped(const std::string& run, int64_t total) {
  RaiseCounter(*reports_dropped_, run, total);
}

void ControllerMetrics::SetSites(const std::string& run, int64_t step,
                                 const std::vector<v1::SiteStats>& sites) {
  RunGauge(fp8_stats_step_, run).Set(static_cast<double>(step));
  absl::MutexLock lock(&mu_);
  std::map<std::string, SiteSeries>& series = sites_[run];
  std::set<std::string> present;
  for (const v1::SiteStats& site : sites) {
    const std::string key = SiteKey(site);
    present.insert(key);
    auto it = series.find(key);
    if (it == series.end()) {
      const prometheus::Labels labels = SiteLabels(run, site);
      it =
          series
              .emplace(key, SiteSeries{&fp8_amax_->Add(labels), &fp8_scale_->Add(labels),
                                       &fp8_underflow_->Add(labels), &fp8_saturation_->Add(labels)})
              .first;
    }
    it->second.amax->Set(site.amax());
    it->second.scale->Set(site.scale());
    it->second.underflow->Set(site.underflow_ratio());
    it->second.saturation->Set(site.saturation_ratio());
  }
  for (auto it = series.begin(); it != series.end();) {
    if (present.contains(it->first)) {
      ++it;
      continue;
    }
    fp8_amax_->Remove(it->second.amax);
    fp8_scale_->Remove(it->second.scale);
    fp8_underflow_->Remove(it->second.underflow);
    fp8_saturation_->Remove(it->second.saturation);
    it = series.erase(it);
  }
}

void ControllerMetrics::AddCommBytes(const std::string& run, const std::string& op,
                                     const std::string& dtype, int64_t bytes) {
  Counter& c = comm_bytes_->Add({{"run", run}, {"op", op}, {"dtype", dtype}});
  if (bytes > 0) c.Increment(static_cast<double>(bytes));
}

void ControllerMetrics::SetCheckpoint(const std::string& run, int64_t step, int64_t unix_ms) {
  RunGauge(checkpoint_step_, run).Set(static_cast<double>(step));
  RunGauge(checkpoint_time_, run).Set(static_cast<double>(unix_ms) / 1000.0);
}

void ControllerMetrics::SetWorkersConnected(const std::string& run, int connected) {
  RunGauge(workers_connected_, run).Set(connected);
}

void ControllerMetrics::SetRecipeVersion(const std::string& run, int64_t version) {
  RunGauge(recipe_version_, run).Set(static_cast<double>(version));
}

void ControllerMetrics::SetExpertLoad(const std::string& run, const v1::ExpertLoad& load) {
  expert_tokens_
      ->Add({{"run", run}, {"layer", load.layer()}, {"expert", std::to_string(load.expert())}})
      .Set(static_cast<double>(load.tokens()));
  moe_dropped_->Add({{"run", run}, {"layer", load.layer()}})
      .Set(static_cast<double>(load.dropped()));
}

void ControllerMetrics::SetMemoryPeaks(const std::string& run,
                                       const std::vector<v1::MemoryPeak>& peaks) {
  absl::MutexLock lock(&mu_);
  std::map<std::string, Gauge*>& series = memory_[run];
  std::set<std::string> present;
  for (const v1::MemoryPeak& p : peaks) {
    present.insert(p.category());
    Gauge*& gauge = series[p.category()];
    if (gauge == nullptr) gauge = &memory_peak_->Add({{"run", run}, {"category", p.category()}});
    gauge->Set(static_cast<double>(p.peak_bytes()));
  }
  for (auto it = series.begin(); it != series.end();) {
    if (present.contains(it->first)) {
      ++it;
      continue;
    }
    memory_peak_->Remove(it->second);
    it = series.erase(it);
  }
}

void ControllerMetrics::CountEvent(const std::string& run, const std::string& kind) {
  events_->Add({{"run", run}, {"kind", kind}}).Increment();
}

}  // namespace fp8rt::controller
