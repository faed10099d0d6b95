// The step loop's link to fp8rt-controller (see trainer.h): registration and heartbeats, the
// directives rank 0 receives and shares at the start of each step (stop, save, recipe updates),
// and the step report (metrics, FP8 site statistics, MoE load, communication bytes and memory
// peaks, reduced over all ranks). Standalone runs (no --controller) make none of these calls or
// collectives.
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <filesystem>
#include <limits>
#include <string>
#include <vector>

#include "absl/strings/numbers.h"
#include "fp8rt/v1/control.pb.h"
#include "kernels/memory_stats.h"
#include "runtime/core/status.h"
#include "runtime/worker/recipe.h"
#include "runtime/worker/trainer.h"  // the Trainer members defined here

namespace fp8rt::worker {
namespace fs = std::filesystem;

namespace {

// "blocks.0.mlp.fc1/grad_output" -> layer and tensor role.
void SplitSiteName(const std::string& site, v1::SiteStats* out) {
  const size_t slash = site.rfind('/');
  out->set_layer(site.substr(0, slash));
  const std::string role = slash == std::string::npos ? "" : site.substr(slash + 1);
  out->set_tensor(role == "input"    ? v1::TENSOR_ROLE_INPUT
                  : role == "weight" ? v1::TENSOR_ROLE_WEIGHT
                                     : v1::TENSOR_ROLE_GRAD_OUTPUT);
  // MoE expert layers (blocks.1.mlp.experts.3.fc1) carry the expert index for the `expert` label.
  int64_t expert = -1;
  if (const size_t at = site.find(".experts."); at != std::string::npos && at < slash) {
    const size_t begin = at + 9, end = site.find('.', begin);
    if (!absl::SimpleAtoi(site.substr(begin, end - begin), &expert)) expert = -1;
  }
  out->set_expert(expert);
}

}  // namespace

absl::Status Trainer::RegisterWithController() {
  parallel::Communicator& world = mesh_->world();
  FP8RT_ASSIGN_OR_RETURN(controller_, ControllerClient::Connect(options_.controller));
  v1::RegisterRequest request;
  request.set_run_id(options_.controller.run_id);
  request.set_rank(world.rank());
  request.set_world_size(world.size());
  std::error_code ec;
  request.set_run_dir(fs::absolute(options_.run_dir, ec).string());
  char host[256] = {};
  gethostname(host, sizeof(host) - 1);
  request.set_hostname(host);
  request.set_pid(getpid());
  request.set_resume(options_.resume);
  faults_.BeforeRegister();  // FP8RT_FAULT slow_register
  // A rank heartbeats from its own registration on: the controller times it out from then, and
  // the other ranks may take long to register (rank 0 waits for all of them below; with
  // heartbeats only after that, a rank slow to start got rank 0 declared lost). A rank that does
  // not register at all is the controller's to catch (RankState::registering).
  auto start_heartbeats = [&](const v1::RegisterResponse& r) {
    // Until the first step, the step a resumed run starts after (the controller's answer).
    progress_.store(std::max<int64_t>(0, r.resume_step()));
    const int interval_ms = std::max(100, r.heartbeat_interval_ms());
    controller_->StartHeartbeats(world.rank(), std::chrono::milliseconds(interval_ms),
                                 [this] { return progress_.load(); });
  };
  // Rank 0 first: its call creates the run (with the spec); then every other rank.
  absl::StatusOr<v1::RegisterResponse> response = absl::UnknownError("not registered");
  if (world.rank() == 0) {
    *request.mutable_spec() = spec_;
    response = controller_->Register(request);
    if (response.ok()) start_heartbeats(*response);
  }
  int64_t failed = world.rank() == 0 && !response.ok() ? 1 : 0;
  FP8RT_RETURN_IF_ERROR(world.Broadcast(&failed, 1, parallel::DType::kI64, 0));
  if (failed != 0) {
    if (world.rank() == 0) return response.status();
    return absl::FailedPreconditionError("rank 0 could not register with the controller");
  }
  if (world.rank() != 0) {
    response = controller_->Register(request);
    if (response.ok()) start_heartbeats(*response);
  }
  failed = response.ok() ? 0 : 1;
  FP8RT_RETURN_IF_ERROR(
      world.AllReduce(&failed, 1, parallel::DType::kI64, parallel::ReduceOp::kMax));
  if (failed != 0) {
    if (!response.ok()) return response.status();
    return absl::UnavailableError("another rank could not register with the controller");
  }
  // The worker's own --spec stays in force (a resume may extend train.steps); the controller
  // holds the copy rank 0 registered.
  resume_step_ = response->resume_step();
  if (world.rank() == 0) {
    std::fprintf(stderr, "fp8rt-worker: registered run '%s' with controller %s (%d ranks)\n",
                 options_.controller.run_id.c_str(), options_.controller.address.c_str(),
                 world.size());
  }
  return absl::OkStatus();
}

absl::Status Trainer::ShareDirectives() {
  if (controller_ == nullptr) return absl::OkStatus();
  parallel::Communicator& world = mesh_->world();
  // [newest version, its effective step, stop, save, recipe bytes]
  int64_t head[5] = {0, 0, 0, 0, 0};
  std::string bytes;
  if (world.rank() == 0) {
    // Only what is already known: the heartbeat thread brings the directives, and is woken once
    // per step so that a recipe update made while step s runs is normally known at the start of
    // step s + 1, before its effective step (the controller schedules it recipe_lead_steps after
    // the newest step it knows). A controller that does not answer never holds this step.
    controller_->KickHeartbeat();
    const Directives d = controller_->Latest();
    head[0] = d.recipe.version();
    head[1] = d.recipe.effective_step();
    head[2] = d.stop ? 1 : 0;
    head[3] = d.save_checkpoint ? 1 : 0;
    if (head[0] > recipe_version_) bytes = d.recipe.recipe().SerializeAsString();
    head[4] = static_cast<int64_t>(bytes.size());
  }
  FP8RT_RETURN_IF_ERROR(world.Broadcast(head, 5, parallel::DType::kI64, 0));
  stop_requested_ = stop_requested_ || head[2] != 0;
  save_requested_ = save_requested_ || head[3] != 0;
  if (head[4] == 0) return absl::OkStatus();
  bytes.resize(static_cast<size_t>(head[4]));
  FP8RT_RETURN_IF_ERROR(world.Broadcast(bytes.data(), head[4], parallel::DType::kU8, 0));
  // A version known only after its effective step is applied now, at the same step on every
  // rank (they all act on rank 0's broadcast), and the step it was applied at is reported.
  const int64_t step = step_ + 1;
  if (head[0] <= recipe_version_ || step < head[1]) return absl::OkStatus();
  v1::Recipe recipe;
  if (!recipe.ParseFromString(bytes)) return absl::DataLossError("unreadable recipe broadcast");
  const absl::Status applied = model_->ApplyRecipe(MergeRecipe(spec_, recipe));
  if (world.rank() == 0) {
    if (applied.ok()) {
      std::fprintf(stderr, "fp8rt-worker: recipe version %lld applied at step %lld: %s\n",
                   static_cast<long long>(head[0]), static_cast<long long>(step),
                   recipe.ShortDebugString().c_str());
    } else {
      std::fprintf(stderr, "fp8rt-worker: recipe version %lld refused, keeping version %lld: %s\n",
                   static_cast<long long>(head[0]), static_cast<long long>(recipe_version_),
                   applied.ToString().c_str());
    }
  }
  recipe_version_ = head[0];  // a refused version is not retried
  if (applied.ok()) {
    recipe_applied_step_ = step;
    live_recipe_ = recipe;
  }
  return absl::OkStatus();
}

absl::Status Trainer::ReportToController(const StepRecord& r,
                                         const std::vector<model::SiteReport>& sites) {
  if (controller_ == nullptr) return absl::OkStatus();
  parallel::Communicator& world = mesh_->world();
  const bool stats_step = r.step % spec_.metrics().every() == 0;
  // Site counts and communication bytes summed over all ranks (collective, metric steps only).
  std::vector<int64_t> counts;
  std::vector<int64_t> comm(parallel::kNumCollectiveOps * parallel::kNumDTypes, 0);
  std::vector<int64_t> moe;  // per MoE block: tokens per expert, then dropped; summed over ranks
  if (stats_step) {
    for (const model::MoeBlockStats& m : model_->moe_stats()) {
      moe.insert(moe.end(), m.tokens_per_expert.begin(), m.tokens_per_expert.end());
      moe.push_back(m.dropped);
    }
    if (!moe.empty()) {
      FP8RT_RETURN_IF_ERROR(world.AllReduce(moe.data(), static_cast<int64_t>(moe.size()),
                                            parallel::DType::kI64, parallel::ReduceOp::kSum));
    }
    for (const model::SiteReport& s : sites) {
      counts.insert(counts.end(), {s.count, s.underflow, s.saturated});
    }
    if (!counts.empty()) {
      FP8RT_RETURN_IF_ERROR(world.AllReduce(counts.data(), static_cast<int64_t>(counts.size()),
                                            parallel::DType::kI64, parallel::ReduceOp::kSum));
    }
    for (parallel::Communicator* c :
         {&mesh_->world(), &mesh_->tp(), &mesh_->dp(), &mesh_->ep(), &mesh_->edp()}) {
      for (int op = 0; op < parallel::kNumCollectiveOps; ++op) {
        for (int dt = 0; dt < parallel::kNumDTypes; ++dt) {
          comm[static_cast<size_t>(op * parallel::kNumDTypes + dt)] += c->stats().bytes[op][dt];
        }
      }
    }
    FP8RT_RETURN_IF_ERROR(world.AllReduce(comm.data(), static_cast<int64_t>(comm.size()),
                                          parallel::DType::kI64, parallel::ReduceOp::kSum));
  }
  if (world.rank() != 0) return absl::OkStatus();
  v1::ReportStepRequest request;
  request.set_run_id(options_.controller.run_id);
  v1::StepMetrics* m = request.mutable_metrics();
  m->set_step(r.step);
  m->set_loss(r.loss);
  m->set_grad_norm(r.skipped ? std::numeric_limits<double>::quiet_NaN() : r.grad_norm);
  m->set_lr(r.lr);
  m->set_tokens_per_s(r.tokens_per_s);
  m->set_skipped(r.skipped);
  for (const int rank : r.nonfinite_ranks) m->add_nonfinite_ranks(rank);
  m->set_step_time_s(r.step_time_s);
  m->set_recipe_version(recipe_version_);
  if (r.val_loss.has_value()) m->set_val_loss(*r.val_loss);
  if (recipe_applied_step_ == r.step) request.set_recipe_applied_step(r.step);
  for (int c = 0; c < kernels::kNumMemCategories; ++c) {
    v1::MemoryPeak* peak = request.add_memory();
    peak->set_category(std::string(kernels::MemCategoryName(static_cast<kernels::MemCategory>(c))));
    peak->set_peak_bytes(r.memory.category[static_cast<size_t>(c)]);
  }
  if (stats_step) {
    for (size_t i = 0; i < sites.size(); ++i) {
      v1::SiteStats* out = request.add_sites();
      SplitSiteName(sites[i].site, out);
      out->set_amax(sites[i].amax);
      out->set_scale(sites[i].scale);
      const double n = static_cast<double>(counts[3 * i]);
      out->set_underflow_ratio(n > 0 ? static_cast<double>(counts[3 * i + 1]) / n : 0.0);
      out->set_saturation_ratio(n > 0 ? static_cast<double>(counts[3 * i + 2]) / n : 0.0);
    }
    size_t at = 0;
    for (const model::MoeBlockStats& mb : model_->moe_stats()) {
      const size_t experts = mb.tokens_per_expert.size();
      for (size_t e = 0; e < experts; ++e) {
        v1::ExpertLoad* load = request.add_experts();
        load->set_layer(mb.layer);
        load->set_expert(static_cast<int64_t>(e));
        load->set_tokens(moe[at + e]);
        load->set_dropped(moe[at + experts]);
      }
      at += experts + 1;
    }
    for (int op = 0; op < parallel::kNumCollectiveOps; ++op) {
      for (int dt = 0; dt < parallel::kNumDTypes; ++dt) {
        const int64_t bytes = comm[static_cast<size_t>(op * parallel::kNumDTypes + dt)];
        if (bytes == 0) continue;
        v1::CommBytes* c = request.add_comm();
        c->set_op(std::string(parallel::CollectiveOpName(static_cast<parallel::CollectiveOp>(op))));
        c->set_dtype(std::string(parallel::DTypeName(static_cast<parallel::DType>(dt))));
        c->set_bytes(bytes);
      }
    }
  }
  // Sent by the client's report thread: the step never waits for the controller.
  controller_->QueueReport(std::move(request));
  return absl::OkStatus();
}

void Trainer::FlushControllerReports() {
  if (controller_ == nullptr || mesh_->world().rank() != 0) return;
  // The final steps reach the controller (run_finished) unless it stays unreachable this long.
  const bool drained = controller_->FlushReports(std::chrono::seconds(15));
  const int64_t dropped = controller_->reports_dropped();
  if (!drained || dropped > 0) {
    std::fprintf(stderr, "fp8rt-worker: %lld step reports did not reach the controller%s\n",
                 static_cast<long long>(dropped),
                 drained ? "" : " (and the newest were still queued after 15 s)");
  }
}

}  // namespace fp8rt::worker
