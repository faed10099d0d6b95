// ControllerMetrics: the controller's Prometheus metrics (prometheus-cpp), one registry that
// fp8rt-controller exposes on /metrics. Every name, type and label is listed in docs/metrics.md;
// change both together.
//
// Labels: `run` on every series; per-site FP8 series add `layer`, `tensor` (input, weight,
// grad_output) and `expert` (only for sites of an MoE expert, expert >= 0); memory peaks add
// `category`.
//
// Threads: every method may be called from any thread (prometheus-cpp metrics are atomic; the
// per-site label bookkeeping has its own mutex).
#ifndef FP8RT_RUNTIME_CONTROLLER_METRICS_H_
#define FP8RT_RUNTIME_CONTROLLER_METRICS_H_

#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"
#include "fp8rt/v1/control.pb.h"
#include "prometheus/counter.h"
#include "prometheus/family.h"
#include "prometheus/gauge.h"
#include "prometheus/registry.h"

namespace fp8rt::controller {

// "input", "weight", "grad_output" ("unspecified" for the zero value).
std::string TensorRoleLabel(v1::TensorRole role);
// "running", "stopping", "finished", "failed" ("unspecified" for the zero value).
std::string RunStateLabel(v1::RunState state);

class ControllerMetrics {
 public:
  ControllerMetrics();
  ControllerMetrics(const ControllerMetrics&) = delete;
  ControllerMetrics& operator=(const ControllerMetrics&) = delete;

  const std::shared_ptr<prometheus::Registry>& registry() const { return registry_; }

  // fp8rt_run_state{run,state}: 1 for `state`, 0 for the other states; fp8rt_world_size.
  void SetRunState(const std::string& run, v1::RunState state, int world_size);
  // fp8rt_train_step, _loss, _learning_rate, fp8rt_grad_norm, fp8rt_tokens_per_second,
  // fp8rt_step_time_seconds from the latest step.
  void SetStep(const std::string& run, const v1::StepMetrics& step);
  // fp8rt_eval_loss: the validation loss of the newest eval step (eval.every).
  void SetEvalLoss(const std::string& run, double val_loss);
  // fp8rt_skipped_steps_total raised to `total` (never lowered).
  void SetSkippedSteps(const std::string& run, int64_t total);
  // fp8rt_step_reports_dropped_total raised to `total` (never lowered).
  void SetReportsDropped(const std::string& run, int64_t total);
  // Replaces the per-site series of `run` by `sites` (series of sites not listed are removed)
  // and sets fp8rt_fp8_stats_step.
  void SetSites(const std::string& run, int64_t step, const std::vector<v1::SiteStats>& sites);
  // fp8rt_comm_bytes_total{run,op,dtype} += bytes.
  void AddCommBytes(const std::string& run, const std::string& op, const std::string& dtype,
                    int64_t bytes);
  // fp8rt_checkpoint_last_committed_step and _timestamp_seconds.
  void SetCheckpoint(const std::string& run, int64_t step, int64_t unix_ms);
  void SetWorkersConnected(const std::string& run, int connected);
  void SetRecipeVersion(const std::string& run, int64_t version);
  // fp8rt_events_total{run,kind} += 1.
  void CountEvent(const std::string& run, const std::string& kind);
  // MoE: the tokens an expert processed in the reported step, and dropped assignments.
  void SetExpertLoad(const std::string& run, const v1::ExpertLoad& load);
  // Replaces the fp8rt_memory_peak_bytes{run,category} series of `run` by `peaks` (categories not
  // listed are removed, so a run has at most one report's worth of series).
  void SetMemoryPeaks(const std::string& run, const std::vector<v1::MemoryPeak>& peaks);

 private:
  prometheus::Gauge& RunGauge(prometheus::Family<prometheus::Gauge>* family,
                              const std::string& run);

  const std::shared_ptr<prometheus::Registry> registry_;
  // Families live in registry_; the pointers are fixed after construction.
  prometheus::Family<prometheus::Gauge>* run_state_;
  prometheus::Family<prometheus::Gauge>* world_size_;
  prometheus::Family<prometheus::Gauge>* workers_connected_;
  prometheus::Family<prometheus::Gauge>* train_step_;
  prometheus::Family<prometheus::Gauge>* train_loss_;
  prometheus::Family<prometheus::Gauge>* eval_loss_;
  prometheus::Family<prometheus::Gauge>* learning_rate_;
  prometheus::Family<prometheus::Gauge>* grad_norm_;
  prometheus::Family<prometheus::Gauge>* tokens_per_second_;
  prometheus::Family<prometheus::Gauge>* step_time_;
  prometheus::Family<prometheus::Counter>* skipped_steps_;
  prometheus::Family<prometheus::Counter>* reports_dropped_;
  prometheus::Family<prometheus::Gauge>* fp8_stats_step_;
  prometheus::Family<prometheus::Gauge>* fp8_amax_;
  prometheus::Family<prometheus::Gauge>* fp8_scale_;
  prometheus::Family<prometheus::Gauge>* fp8_underflow_;
  prometheus::Family<prometheus::Gauge>* fp8_saturation_;
  prometheus::Family<prometheus::Counter>* comm_bytes_;
  prometheus::Family<prometheus::Gauge>* checkpoint_step_;
  prometheus::Family<prometheus::Gauge>* checkpoint_time_;
  prometheus::Family<prometheus::Gauge>* recipe_version_;
  prometheus::Family<prometheus::Counter>* events_;
  prometheus::Family<prometheus::Gauge>* expert_tokens_;
  prometheus::Family<prometheus::Gauge>* moe_dropped_;
  prometheus::Family<prometheus::Gauge>* memory_peak_;

  // The four gauges of one FP8 site.
  struct SiteSeries {
    prometheus::Gauge* amax;
    prometheus::Gauge* scale;
    prometheus::Gauge* underflow;
    prometheus::Gauge* saturation;
  };
  absl::Mutex mu_;
  // run -> (site key -> its series), to remove the series of sites that disappear.
  std::map<std::string, std::map<std::string, SiteSeries>> sites_ ABSL_GUARDED_BY(mu_);
  // run -> (category -> its fp8rt_memory_peak_bytes series).
  std::map<std::string, std::map<std::string, prometheus::Gauge*>> memory_ ABSL_GUARDED_BY(mu_);
};

}  // namespace fp8rt::controller

#endif  // FP8RT_RUNTIME_CONTROLLER_METRICS_H_
