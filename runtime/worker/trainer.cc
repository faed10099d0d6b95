// The step loop (see trainer.h). Index: spec -> recipe, FaultSpec, Create, run folder and
// metrics files, Step, Run, SaveCheckpoint, Restore.
#include "runtime/worker/trainer.h"

#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <csignal>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <limits>
#include <sstream>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "fp8rt/v1/checkpoint.pb.h"
#include "fp8rt/v1/control.pb.h"
#include "fp8rt/v1/scaling.pb.h"
#include "nlohmann/json.hpp"
#include "runtime/core/checkpoint_dir.h"
#include "runtime/core/checkpoint_io.h"
#include "runtime/core/fault_point.h"
#include "runtime/core/status.h"

namespace fp8rt::worker {
namespace fs = std::filesystem;
using v1::RunSpec;

namespace {

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
  return recipe;
}

train::TokenFormat FormatFromSpec(const RunSpec& spec) {
  switch (spec.data().format()) {
    case RunSpec::Data::FORMAT_U16:
      return train::TokenFormat::kU16;
    case RunSpec::Data::FORMAT_U32:
      return train::TokenFormat::kU32;
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

std::string RankFileName(int rank) {
  char buf[32];
  std::snprintf(buf, sizeof(buf), "rank-%05d.jsonl", rank);
  return buf;
}

// Keeps the lines of a JSONL file whose "step" is <= max_step (a resumed run rewrites the steps
// after its checkpoint). A missing file is fine.
absl::Status TruncateJsonlAfter(const std::string& path, int64_t max_step) {
  std::ifstream in(path);
  if (!in) return absl::OkStatus();
  std::ostringstream kept;
  std::string line;
  while (std::getline(in, line)) {
    if (line.empty()) continue;
    nlohmann::json j = nlohmann::json::parse(line, nullptr, /*allow_exceptions=*/false);
    if (j.is_discarded() || !j.contains("step")) continue;  // a torn last line
    if (j["step"].get<int64_t>() <= max_step) kept << line << '\n';
  }
  in.close();
  std::ofstream out(path, std::ios::trunc);
  out << kept.str();
  if (!out) return absl::InternalError(absl::StrCat("cannot rewrite ", path));
  return absl::OkStatus();
}

template <typename T>
std::span<const std::byte> Bytes(const T* data, size_t count) {
  return std::as_bytes(std::span<const T>(data, count));
}

// Copies a section into `count` values of T, or DataLoss naming the section and file.
template <typename T>
absl::Status ReadSection(const ShardReader& reader, const std::string& name, T* out, size_t count) {
  FP8RT_ASSIGN_OR_RETURN(std::span<const std::byte> bytes, reader.Section(name));
  if (bytes.size() != count * sizeof(T)) {
    return absl::DataLossError(absl::StrCat(reader.path(), ": section '", name, "' holds ",
                                            bytes.size(), " bytes, this run expects ",
                                            count * sizeof(T)));
  }
  std::memcpy(out, bytes.data(), bytes.size());
  return absl::OkStatus();
}

}  // namespace

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

Trainer::Trainer(const RunSpec& spec, const TrainerOptions& options, const kernels::OpTable& ops)
    : spec_(spec), options_(options), ops_(ops), resumed_(options.resume) {}

Trainer::~Trainer() {
  if (metrics_ != nullptr) std::fclose(metrics_);
  if (fp8_stats_ != nullptr) std::fclose(fp8_stats_);
}

absl::StatusOr<std::unique_ptr<Trainer>> Trainer::Create(const RunSpec& spec,
                                                         const TrainerOptions& options,
                                                         parallel::CommunicatorFactory& factory,
                                                         const kernels::OpTable& ops) {
  std::unique_ptr<Trainer> t(new Trainer(spec, options, ops));
  const char* fault = std::getenv("FP8RT_FAULT");
  FP8RT_ASSIGN_OR_RETURN(t->fault_, FaultSpec::Parse(fault == nullptr ? "" : fault));
  parallel::MeshConfig mesh_config{
      .dp = spec.parallel().dp(), .tp = spec.parallel().tp(), .ep = spec.parallel().ep()};
  FP8RT_ASSIGN_OR_RETURN(t->mesh_, parallel::Mesh::Create(mesh_config, factory));
  if (!options.controller.address.empty()) FP8RT_RETURN_IF_ERROR(t->RegisterWithController());
  const RunSpec::Model& m = spec.model();
  model::ModelShape shape{.layers = m.layers(),
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
                          .moe_every = std::max(1, spec.moe().every())};
  FP8RT_ASSIGN_OR_RETURN(
      t->model_,
      model::Transformer::Create(shape, RecipeFromSpec(spec), spec.train().seed(), *t->mesh_, ops));
  if (t->fault_.act() && t->fault_.block >= shape.layers) {
    return absl::InvalidArgumentError(absl::StrCat("FP8RT_FAULT: block=", t->fault_.block,
                                                   " but the model has ", shape.layers,
                                                   " blocks (model.layers)"));
  }
  FP8RT_ASSIGN_OR_RETURN(
      std::unique_ptr<train::TokenDataset> dataset,
      train::TokenDataset::Open(spec.data().path(), FormatFromSpec(spec), m.vocab()));
  const parallel::MeshLayout& layout = t->mesh_->layout();
  FP8RT_ASSIGN_OR_RETURN(
      train::DataLoader loader,
      train::DataLoader::Create(std::move(dataset), {.seq_len = m.seq_len(),
                                                     .micro_batch = spec.train().micro_batch(),
                                                     .dp = layout.config.dp,
                                                     .dp_rank = layout.dp_rank}));
  t->loader_ = std::make_unique<train::DataLoader>(std::move(loader));
  t->tokens_.resize(t->loader_->batch_tokens());
  const RunSpec::Train& tr = spec.train();
  train::AdamWConfig adam{.lr = tr.lr(),
                          .weight_decay = tr.weight_decay(),
                          .clip = tr.clip(),
                          .warmup = tr.warmup(),
                          .steps = tr.steps(),
                          .min_lr = tr.min_lr()};
  FP8RT_RETURN_IF_ERROR(train::ValidateAdamWConfig(adam));
  t->optimizer_ = std::make_unique<train::AdamW>(adam, ops);
  FP8RT_RETURN_IF_ERROR(t->PrepareRunDir());
  return t;
}

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
  // Rank 0 first: its call creates the run (with the spec); then every other rank.
  absl::StatusOr<v1::RegisterResponse> response = absl::UnknownError("not registered");
  if (world.rank() == 0) {
    *request.mutable_spec() = spec_;
    response = controller_->Register(request);
  }
  int64_t failed = world.rank() == 0 && !response.ok() ? 1 : 0;
  FP8RT_RETURN_IF_ERROR(world.Broadcast(&failed, 1, parallel::DType::kI64, 0));
  if (failed != 0) {
    if (world.rank() == 0) return response.status();
    return absl::FailedPreconditionError("rank 0 could not register with the controller");
  }
  if (world.rank() != 0) response = controller_->Register(request);
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
  const int interval_ms = std::max(100, response->heartbeat_interval_ms());
  controller_->StartHeartbeats(world.rank(), std::chrono::milliseconds(interval_ms),
                               [this] { return progress_.load(); });
  if (world.rank() == 0) {
    std::fprintf(stderr, "fp8rt-worker: registered run '%s' with controller %s (%d ranks)\n",
                 options_.controller.run_id.c_str(), options_.controller.address.c_str(),
                 world.size());
  }
  return absl::OkStatus();
}

absl::Status Trainer::PrepareRunDir() {
  parallel::Communicator& world = mesh_->world();
  const std::string metrics_path = options_.run_dir + "/metrics.jsonl";
  CheckpointDir checkpoints(options_.run_dir);
  // Rank 0 checks the folder and tells the others, so every rank takes the same path.
  int64_t verdict = 0;
  std::string error;
  if (world.rank() == 0) {
    std::error_code ec;
    fs::create_directories(options_.run_dir + "/fp8_stats", ec);
    if (ec) {
      error = absl::StrCat("cannot create run folder ", options_.run_dir, ": ", ec.message());
      verdict = 1;
    } else if (!options_.resume) {
      FP8RT_ASSIGN_OR_RETURN(std::vector<int64_t> committed, checkpoints.ListCommitted());
      if (!committed.empty() ||
          (fs::exists(metrics_path, ec) && fs::file_size(metrics_path, ec) > 0)) {
        error = absl::StrCat("run folder ", options_.run_dir,
                             " already holds a run (metrics.jsonl or committed checkpoints): pass "
                             "--resume to continue it, or choose another --run-dir");
        verdict = 2;
      }
    }
  }
  FP8RT_RETURN_IF_ERROR(world.Broadcast(&verdict, 1, parallel::DType::kI64, 0));
  if (verdict == 1) return absl::InternalError(world.rank() == 0 ? error : "run folder not usable");
  if (verdict == 2) {
    return absl::FailedPreconditionError(world.rank() == 0 ? error
                                                           : "run folder already holds a run");
  }
  if (options_.resume) FP8RT_RETURN_IF_ERROR(Restore());
  const std::string stats_path =
      options_.run_dir + "/fp8_stats/" + RankFileName(mesh_->layout().rank);
  if (world.rank() == 0) {
    FP8RT_RETURN_IF_ERROR(TruncateJsonlAfter(metrics_path, step_));
    metrics_ = std::fopen(metrics_path.c_str(), "a");
    if (metrics_ == nullptr) return absl::InternalError("cannot open " + metrics_path);
  }
  if (spec_.metrics().per_rank_fp8_stats()) {
    FP8RT_RETURN_IF_ERROR(TruncateJsonlAfter(stats_path, step_));
    fp8_stats_ = std::fopen(stats_path.c_str(), "a");
    if (fp8_stats_ == nullptr) return absl::InternalError("cannot open " + stats_path);
  }
  return absl::OkStatus();
}

std::vector<train::ParamShard> Trainer::Shards() {
  std::vector<train::ParamShard> shards;
  const bool tp_rank0 = mesh_->layout().tp_rank == 0;
  for (model::Param& p : model_->params()) {
    shards.push_back(train::ParamShard{.name = p.name,
                                       .master = p.master.data(),
                                       .grad = p.grad.data(),
                                       .m = p.m.data(),
                                       .v = p.v.data(),
                                       .count = p.shard_count,
                                       .decay = p.decay,
                                       .in_norm = p.split != model::TpSplit::kNone || tp_rank0});
  }
  return shards;
}

absl::StatusOr<StepRecord> Trainer::Step() {
  const parallel::MeshLayout& layout = mesh_->layout();
  const int64_t step = step_ + 1;
  if ((fault_.kind == FaultSpec::Kind::kKill || fault_.kind == FaultSpec::Kind::kHang) &&
      fault_.rank == layout.rank && fault_.step == step && !resumed_) {
    const bool kill = fault_.kind == FaultSpec::Kind::kKill;
    std::fprintf(stderr, "fp8rt-worker: rank %d: FP8RT_FAULT %s this rank at step %lld\n",
                 layout.rank, kill ? "kills" : "stops (SIGSTOP)", static_cast<long long>(step));
    std::fflush(nullptr);
    std::raise(kill ? SIGKILL : SIGSTOP);
  }
  const auto t0 = std::chrono::steady_clock::now();
  if (controller_ != nullptr) FP8RT_RETURN_IF_ERROR(ShareDirectives());
  const RunSpec::Train& tr = spec_.train();
  const int64_t ga = tr.grad_accum(), dp = layout.config.dp;
  const float dloss = 1.0f / static_cast<float>(ga * dp);

  FP8RT_RETURN_IF_ERROR(model_->BeginStep());
  const bool fault_here = fault_.rank == layout.rank && fault_.step == step;
  if (fault_here && fault_.act()) model_->ArmActivationFault(fault_.block, fault_.value());
  float loss_sum = 0.0f;
  for (int64_t i = 0; i < ga; ++i) {
    FP8RT_RETURN_IF_ERROR(loader_->Next(tokens_));
    FP8RT_ASSIGN_OR_RETURN(const float loss,
                           model_->ForwardBackward(tokens_, tr.micro_batch(), dloss));
    loss_sum += loss;
  }
  if (fault_here && fault_.grad()) model_->params().front().full_grad[0] = fault_.value();
  // A NaN or Inf this rank saw outside its gradients (its loss, or an FP8 site's amax: an Inf that
  // FP8 saturated to a finite value shows only there) skips the step too: a NaN put into the local
  // gradient makes the optimizer's global norm non-finite on every rank, with no extra collective.
  const bool saw_nonfinite = !std::isfinite(loss_sum) || AnySiteAmaxNonFinite();
  if (saw_nonfinite) {
    model_->params().front().full_grad[0] = std::numeric_limits<float>::quiet_NaN();
  }
  FP8RT_RETURN_IF_ERROR(model_->ReduceGrads());
  std::vector<train::ParamShard> shards = Shards();
  FP8RT_ASSIGN_OR_RETURN(const train::StepResult result,
                         optimizer_->Step(shards, step, &mesh_->world()));
  // A skipped step leaves the scaling states as they were: its amaxes come from a step that made
  // NaN or Inf (a NaN or Inf amax is refused by ScalingState anyway, but finite amaxes of such a
  // step, e.g. of values saturated from an Inf, would distort the scales for a whole history).
  using Update = model::Transformer::ScalingUpdate;
  FP8RT_ASSIGN_OR_RETURN(
      const std::vector<model::SiteReport> sites,
      model_->SyncScaling(result.skipped ? Update::kReportOnly : Update::kCommit));
  std::vector<int> nonfinite_ranks;
  if (result.skipped) {
    // Which ranks saw the NaN/Inf (every rank agrees the step is skipped: this collective is
    // made by all of them, on skipped steps only).
    parallel::Communicator& world = mesh_->world();
    const int64_t mine = saw_nonfinite || LocalGradNonFinite() ? 1 : 0;
    std::vector<int64_t> all(static_cast<size_t>(world.size()), 0);
    FP8RT_RETURN_IF_ERROR(world.AllGather(&mine, 1, all.data(), parallel::DType::kI64));
    for (int r = 0; r < world.size(); ++r) {
      if (all[static_cast<size_t>(r)] != 0) nonfinite_ranks.push_back(r);
    }
  }
  FP8RT_RETURN_IF_ERROR(
      mesh_->dp().AllReduce(&loss_sum, 1, parallel::DType::kF32, parallel::ReduceOp::kSum));
  if (!model_->moe_stats().empty()) {
    moe_dropped_ = 0;
    for (const model::MoeBlockStats& m : model_->moe_stats()) moe_dropped_ += m.dropped;
    FP8RT_RETURN_IF_ERROR(mesh_->world().AllReduce(&moe_dropped_, 1, parallel::DType::kI64,
                                                   parallel::ReduceOp::kSum));
  }
  step_ = step;

  StepRecord r;
  r.step = step;
  r.loss = static_cast<double>(loss_sum) / static_cast<double>(ga * dp);
  r.grad_norm = result.grad_norm;
  r.lr = result.lr;
  r.skipped = result.skipped;
  r.nonfinite_ranks = std::move(nonfinite_ranks);
  r.step_time_s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  const double tokens = static_cast<double>(ga * dp * tr.micro_batch() * spec_.model().seq_len());
  r.tokens_per_s = tokens / r.step_time_s;
  FP8RT_RETURN_IF_ERROR(WriteRecords(r, sites));
  progress_.store(step_);
  if (controller_ != nullptr) FP8RT_RETURN_IF_ERROR(ReportToController(r, sites));
  return r;
}

bool Trainer::AnySiteAmaxNonFinite() const {
  for (const model::QuantSite* s : model_->sites()) {
    if (s->used_this_step() && !std::isfinite(s->step_stats().amax)) return true;
  }
  return false;
}

bool Trainer::LocalGradNonFinite() const {
  for (const model::Param& p : model_->params()) {
    for (const float g : p.full_grad) {
      if (!std::isfinite(g)) return true;
    }
  }
  return false;
}

absl::Status Trainer::ShareDirectives() {
  parallel::Communicator& world = mesh_->world();
  // [newest version, its effective step, stop, save, recipe bytes]
  int64_t head[5] = {0, 0, 0, 0, 0};
  std::string bytes;
  if (world.rank() == 0) {
    // One synchronous heartbeat per step: a recipe update made while step s runs is known at the
    // start of step s + 1 at the latest, before its effective step (the controller schedules it
    // a few steps after the newest reported one). A miss falls back on the last known answer.
    (void)controller_->HeartbeatOnce(0, step_);
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
  const int64_t step = step_ + 1;
  if (head[0] <= recipe_version_ || step < head[1]) return absl::OkStatus();
  v1::Recipe recipe;
  if (!recipe.ParseFromString(bytes)) return absl::DataLossError("unreadable recipe broadcast");
  const absl::Status applied = model_->ApplyRecipe(MergeRecipe(model_->recipe(), recipe));
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
  if (applied.ok()) recipe_applied_step_ = step;
  return absl::OkStatus();
}

absl::Status Trainer::ReportToController(const StepRecord& r,
                                         const std::vector<model::SiteReport>& sites) {
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
  if (recipe_applied_step_ == r.step) request.set_recipe_applied_step(r.step);
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
  // Training goes on when the controller is briefly unreachable; the report is lost, said once.
  absl::Status s = controller_->ReportStep(request);
  if (!s.ok())
    std::fprintf(stderr, "fp8rt-worker: step %lld not reported: %s\n",
                 static_cast<long long>(r.step), s.ToString().c_str());
  return absl::OkStatus();
}

absl::Status Trainer::WriteRecords(const StepRecord& r,
                                   const std::vector<model::SiteReport>& sites) {
  if (metrics_ != nullptr) {
    nlohmann::ordered_json j;
    j["step"] = r.step;
    j["loss"] = r.loss;
    j["grad_norm"] = r.skipped ? nlohmann::ordered_json() : nlohmann::ordered_json(r.grad_norm);
    j["lr"] = r.lr;
    j["tokens_per_s"] = r.tokens_per_s;
    j["skipped"] = r.skipped;
    if (r.skipped) j["nonfinite_ranks"] = r.nonfinite_ranks;
    j["step_time_s"] = r.step_time_s;
    j["recipe_version"] = recipe_version_;
    if (!model_->moe_stats().empty()) j["moe_dropped"] = moe_dropped_;
    const std::string line = j.dump() + "\n";
    if (std::fputs(line.c_str(), metrics_) < 0 || std::fflush(metrics_) != 0) {
      return absl::InternalError(absl::StrCat("cannot write ", options_.run_dir,
                                              "/metrics.jsonl: ", std::strerror(errno)));
    }
  }
  const int64_t every = spec_.metrics().every();
  if (fp8_stats_ != nullptr && r.step % every == 0) {
    std::string out;
    for (const model::MoeBlockStats& m : model_->moe_stats()) {
      nlohmann::ordered_json j;
      j["step"] = r.step;
      j["moe"] = m.layer;
      j["expert_tokens"] = m.tokens_per_expert;  // this rank's kept assignments per expert
      j["dropped"] = m.dropped;
      out += j.dump() + "\n";
    }
    for (const model::SiteReport& s : sites) {
      if (!s.used) continue;  // e.g. the experts of other ranks, or an expert without tokens
      nlohmann::ordered_json j;
      j["step"] = r.step;
      j["site"] = s.site;
      j["amax"] = s.amax;
      j["scale"] = s.scale;
      j["underflow_ratio"] = s.underflow_ratio;
      j["saturation_ratio"] = s.saturation_ratio;
      out += j.dump() + "\n";
    }
    if (std::fputs(out.c_str(), fp8_stats_) < 0 || std::fflush(fp8_stats_) != 0) {
      return absl::InternalError("cannot write the per-rank FP8 stats file");
    }
  }
  return absl::OkStatus();
}

absl::Status Trainer::Run() {
  const int64_t steps = spec_.train().steps(), every = spec_.metrics().every();
  const int64_t ckpt_every = spec_.checkpoint().every();
  const bool rank0 = mesh_->layout().rank == 0;
  while (step_ < steps) {
    FP8RT_ASSIGN_OR_RETURN(const StepRecord r, Step());
    if (rank0 && options_.print_progress &&
        (r.step % every == 0 || r.step == 1 || r.step == steps)) {
      std::printf(
          "step %lld/%lld loss %.4f grad_norm %.4f lr %.3g tokens/s %.0f%s%s\n",
          static_cast<long long>(r.step), static_cast<long long>(steps), r.loss, r.grad_norm, r.lr,
          r.tokens_per_s, r.skipped ? " (skipped: non-finite values on ranks " : "",
          r.skipped ? absl::StrCat(absl::StrJoin(r.nonfinite_ranks, ", "), ")").c_str() : "");
      std::fflush(stdout);
    }
    if ((ckpt_every > 0 && (step_ % ckpt_every == 0 || step_ == steps)) || save_requested_ ||
        stop_requested_) {
      FP8RT_RETURN_IF_ERROR(SaveCheckpoint());
      save_requested_ = false;
    }
    if (stop_requested_) {
      if (rank0) {
        std::fprintf(stderr, "fp8rt-worker: stopped by the controller after step %lld\n",
                     static_cast<long long>(step_));
      }
      break;
    }
  }
  return absl::OkStatus();
}

namespace {

// Every rank's outcome of a save stage (OK, or the error's code and first 1022 bytes), in rank
// order: one AllGather of a fixed-size record per rank.
absl::StatusOr<std::vector<absl::Status>> GatherOutcomes(parallel::Communicator& world,
                                                         const absl::Status& mine) {
  constexpr size_t kRecord = 1024;  // byte 0: the absl code; then the message, NUL-padded
  std::vector<uint8_t> send(kRecord, 0);
  send[0] = static_cast<uint8_t>(mine.code());
  const std::string message(mine.message());
  std::memcpy(send.data() + 1, message.data(), std::min(message.size(), kRecord - 2));
  std::vector<uint8_t> all(kRecord * static_cast<size_t>(world.size()));
  FP8RT_RETURN_IF_ERROR(world.AllGather(send.data(), static_cast<int64_t>(kRecord), all.data(),
                                        parallel::DType::kU8));
  std::vector<absl::Status> outcomes;
  for (int r = 0; r < world.size(); ++r) {
    const uint8_t* rec = all.data() + kRecord * static_cast<size_t>(r);
    const auto code = static_cast<absl::StatusCode>(rec[0]);
    const std::string message(reinterpret_cast<const char*>(rec + 1));
    outcomes.push_back(code == absl::StatusCode::kOk ? absl::OkStatus()
                                                     : absl::Status(code, message));
  }
  return outcomes;
}

// The failures among `outcomes` as "rank 1 (RESOURCE_EXHAUSTED: ...); ...", and the first one's
// code; {kOk, ""} when every rank succeeded.
std::pair<absl::StatusCode, std::string> DescribeFailures(
    const std::vector<absl::Status>& outcomes) {
  absl::StatusCode code = absl::StatusCode::kOk;
  std::string text;
  for (size_t r = 0; r < outcomes.size(); ++r) {
    if (outcomes[r].ok()) continue;
    if (code == absl::StatusCode::kOk) code = outcomes[r].code();
    absl::StrAppend(&text, text.empty() ? "" : "; ", "rank ", r, " (", outcomes[r].ToString(), ")");
  }
  return {code, text};
}

}  // namespace

absl::Status Trainer::SaveCheckpoint() {
  parallel::Communicator& world = mesh_->world();
  const parallel::MeshLayout& layout = mesh_->layout();
  CheckpointDir dir(options_.run_dir);
  SetFaultStep(step_);  // FP8RT_FAULT_POINT's step=S (runtime/core/fault_point.h)
  int64_t ok = 1;
  std::string error;
  if (world.rank() == 0) {
    absl::StatusOr<std::string> prepared =
        controller_ != nullptr ? controller_->BeginCheckpoint(step_) : dir.PrepareTemp(step_);
    if (!prepared.ok()) {
      ok = 0;
      error = prepared.status().ToString();
    }
  }
  FP8RT_RETURN_IF_ERROR(world.Broadcast(&ok, 1, parallel::DType::kI64, 0));
  if (ok == 0) {
    return absl::InternalError(
        world.rank() == 0 ? error : "rank 0 could not prepare the checkpoint folder");
  }

  // This rank's shard: its FSDP shards, Adam moments, every scaling state, the data position.
  ShardWriter w;
  const int64_t applied = optimizer_->applied_steps();
  const uint64_t position = loader_->position();
  const int32_t layout_ints[4] = {layout.world_size, layout.config.dp, layout.config.tp,
                                  layout.rank};
  const uint64_t rng[2] = {spec_.train().seed(), 0};  // no stochastic ops draw numbers yet
  absl::Status st = w.Add("meta/step", Bytes(&step_, 1));
  if (st.ok()) st = w.Add("meta/applied_steps", Bytes(&applied, 1));
  if (st.ok()) st = w.Add("meta/data_position", Bytes(&position, 1));
  if (st.ok()) st = w.Add("meta/layout", Bytes(layout_ints, 4));
  if (st.ok()) st = w.Add("rng", Bytes(rng, 2));
  if (st.ok()) st = w.Add("meta/recipe_version", Bytes(&recipe_version_, 1));
  if (st.ok()) st = w.AddProto("recipe", RecipeToProto(model_->recipe()));
  for (const model::Param& p : model_->params()) {
    const size_t n = p.master.size();
    if (st.ok()) st = w.Add("master/" + p.name, Bytes(p.master.data(), n));
    if (st.ok()) st = w.Add("adam_m/" + p.name, Bytes(p.m.data(), n));
    if (st.ok()) st = w.Add("adam_v/" + p.name, Bytes(p.v.data(), n));
  }
  for (const model::QuantSite* s : model_->sites()) {
    v1::ScalingState proto;
    s->state().ToProto(&proto);
    if (st.ok()) st = w.AddProto("scaling/" + s->name(), proto);
  }
  absl::StatusOr<ShardWriteResult> written =
      st.ok() ? w.Write(dir.TempDir(step_) + "/" + ShardFileName(layout.rank))
              : absl::StatusOr<ShardWriteResult>(st);

  // Every rank learns which ranks could not write their shard and why, so that each rank's error
  // names the step and the failing ranks, and nobody acknowledges a save that cannot commit.
  FP8RT_ASSIGN_OR_RETURN(const std::vector<absl::Status> outcomes,
                         GatherOutcomes(world, written.status()));
  const auto [failed_code, failed] = DescribeFailures(outcomes);
  if (!failed.empty()) {
    // The save is abandoned: rank 0 (or the controller) removes the temp folder before any rank
    // returns, since mpirun stops the job as soon as one rank exits with an error. The run then
    // fails; the previous committed checkpoint is untouched (fp8rt launch --max-restarts resumes
    // from it).
    const std::string why = absl::StrCat("checkpoint step ", step_,
                                         " not saved, the save is abandoned (the previous "
                                         "checkpoint is kept): could not write the shard of ",
                                         failed);
    if (world.rank() == 0) {
      if (controller_ != nullptr) {
        v1::AckShardRequest abandon;
        abandon.set_run_id(options_.controller.run_id);
        abandon.set_step(step_);
        abandon.set_rank(layout.rank);
        abandon.set_file(ShardFileName(layout.rank));
        abandon.set_error(why);
        absl::StatusOr<bool> told = controller_->AckShard(abandon);
        if (!told.ok()) {
          std::fprintf(stderr,
                       "fp8rt-worker: cannot tell the controller to abandon step %lld: %s\n",
                       static_cast<long long>(step_), told.status().ToString().c_str());
        }
      } else {
        std::error_code ec;
        fs::remove_all(dir.TempDir(step_), ec);  // nothing partial is left behind
      }
    }
    int64_t done = 1;
    FP8RT_RETURN_IF_ERROR(world.Broadcast(&done, 1, parallel::DType::kI64, 0));
    return absl::Status(failed_code, why);
  }

  if (controller_ != nullptr) {
    // Every rank acknowledges its own shard; the controller commits after the last one.
    v1::AckShardRequest ack;
    ack.set_run_id(options_.controller.run_id);
    ack.set_step(step_);
    ack.set_rank(layout.rank);
    ack.set_file(ShardFileName(layout.rank));
    ack.set_size(written->size);
    ack.set_xxh64(written->xxh64);
    ack.set_data_position(position);
    const absl::StatusOr<bool> acked = controller_->AckShard(ack);
    if (acked.ok()) InjectKill(FaultPoint::kShardAcked, step_);
    // The last ack commits: its failure (the controller's commit, or the controller gone) is
    // every rank's error. The controller removes the temp folder of a failed commit.
    FP8RT_ASSIGN_OR_RETURN(const std::vector<absl::Status> ack_outcomes,
                           GatherOutcomes(world, acked.status()));
    if (const auto [code, text] = DescribeFailures(ack_outcomes); !text.empty()) {
      return absl::Status(code, absl::StrCat("checkpoint step ", step_,
                                             " not committed by the controller (the previous "
                                             "checkpoint is kept): the acknowledgement of ",
                                             text, " failed"));
    }
    int64_t committed = acked.ok() && *acked ? 1 : 0;
    FP8RT_RETURN_IF_ERROR(
        world.AllReduce(&committed, 1, parallel::DType::kI64, parallel::ReduceOp::kMax));
    if (world.rank() == 0 && committed != 0) {
      std::fprintf(stderr, "fp8rt-worker: checkpoint step %lld committed by the controller\n",
                   static_cast<long long>(step_));
    }
    return absl::OkStatus();
  }
  int64_t report[2] = {static_cast<int64_t>(written->size), static_cast<int64_t>(written->xxh64)};
  std::vector<int64_t> reports(2 * static_cast<size_t>(world.size()));
  FP8RT_RETURN_IF_ERROR(world.AllGather(report, 2, reports.data(), parallel::DType::kI64));
  absl::Status commit;  // rank 0's
  if (world.rank() == 0) {
    v1::CheckpointManifest manifest;
    manifest.set_step(step_);
    manifest.set_world_size(layout.world_size);
    manifest.set_dp(layout.config.dp);
    manifest.set_tp(layout.config.tp);
    manifest.set_ep(layout.config.ep);
    *manifest.mutable_spec() = spec_;
    manifest.set_created_unix_ms(std::chrono::duration_cast<std::chrono::milliseconds>(
                                     std::chrono::system_clock::now().time_since_epoch())
                                     .count());
    manifest.set_data_position(position);
    for (int r = 0; r < world.size(); ++r) {
      v1::CheckpointShard* shard = manifest.add_shards();
      shard->set_rank(r);
      shard->set_file(ShardFileName(r));
      shard->set_size(static_cast<uint64_t>(reports[2 * static_cast<size_t>(r)]));
      shard->set_xxh64(static_cast<uint64_t>(reports[2 * static_cast<size_t>(r) + 1]));
    }
    commit = dir.Commit(manifest);
    if (!commit.ok()) {
      std::error_code ec;
      fs::remove_all(dir.TempDir(step_), ec);  // nothing partial is left behind
    } else {
      // Retention never deletes the checkpoint just committed (keep >= 1, checkpoint_dir.h).
      absl::StatusOr<std::vector<int64_t>> pruned = dir.Prune(spec_.checkpoint().keep());
      if (!pruned.ok())
        std::fprintf(stderr, "fp8rt-worker: %s\n", pruned.status().ToString().c_str());
    }
  }
  // Every rank learns rank 0's commit outcome (after rank 0 cleaned up, see above).
  FP8RT_ASSIGN_OR_RETURN(const std::vector<absl::Status> commit_outcomes,
                         GatherOutcomes(world, commit));
  if (const auto [code, text] = DescribeFailures(commit_outcomes); !text.empty()) {
    return absl::Status(code, absl::StrCat("checkpoint step ", step_,
                                           " not committed, the save is abandoned (the previous "
                                           "checkpoint is kept): the commit of ",
                                           text, " failed"));
  }
  return absl::OkStatus();
}

absl::Status Trainer::Restore() {
  parallel::Communicator& world = mesh_->world();
  CheckpointDir dir(options_.run_dir);
  // Rank 0 picks the checkpoint (verifying every shard), sets aside refused newer ones, and tells
  // the others which step to load: -1 none (fresh start), -2 an error.
  int64_t chosen = -1;
  std::string error;
  if (controller_ != nullptr) {
    // The controller verified the checkpoints and set refused ones aside (its Register answer).
    chosen = resume_step_ > 0 ? resume_step_ : -1;
    FP8RT_RETURN_IF_ERROR(world.Broadcast(&chosen, 1, parallel::DType::kI64, 0));
    if (chosen < 0) {
      if (world.rank() == 0) {
        std::fprintf(stderr, "fp8rt-worker: no checkpoint to resume from; starting at step 1\n");
      }
      return absl::OkStatus();
    }
    return LoadCheckpoint(chosen, dir.CommittedDir(chosen));
  }
  if (world.rank() == 0) {
    std::vector<std::string> refused;
    absl::StatusOr<ResumePoint> point = dir.FindNewestValid(&refused);
    for (const std::string& why : refused) {
      std::fprintf(stderr, "fp8rt-worker: refusing checkpoint: %s\n", why.c_str());
    }
    absl::StatusOr<std::vector<int64_t>> committed = dir.ListCommitted();
    if (!committed.ok()) {
      chosen = -2;
      error = committed.status().ToString();
    } else if (point.ok()) {
      chosen = point->step;
      const v1::CheckpointManifest& m = point->manifest;
      const parallel::MeshLayout& layout = mesh_->layout();
      if (m.world_size() != layout.world_size || m.dp() != layout.config.dp ||
          m.tp() != layout.config.tp) {
        chosen = -2;
        error = absl::StrCat("parallel: checkpoint ", point->dir, " was written by dp=", m.dp(),
                             " tp=", m.tp(), " on ", m.world_size(),
                             " ranks; this run has dp=", layout.config.dp, " tp=", layout.config.tp,
                             " on ", layout.world_size, " (resharding is not supported yet)");
      } else if (m.spec().model().SerializeAsString() != spec_.model().SerializeAsString()) {
        chosen = -2;
        error = absl::StrCat(
            "model: checkpoint ", point->dir,
            " was written for a different model: ", m.spec().model().ShortDebugString());
      }
    } else if (!committed->empty()) {
      chosen = -2;
      error = absl::StrCat("no committed checkpoint in ", dir.root(),
                           " verifies (see the refusals above): ", point.status().ToString());
    }
    if (chosen >= -1 && committed.ok()) {
      for (int64_t s : *committed) {
        if (s <= chosen) continue;
        std::error_code ec;
        const std::string aside = dir.root() + "/refused-" + CheckpointName(s);
        fs::rename(dir.CommittedDir(s), aside, ec);
        std::fprintf(stderr, "fp8rt-worker: moved %s to %s%s\n", dir.CommittedDir(s).c_str(),
                     aside.c_str(), ec ? (" failed: " + ec.message()).c_str() : "");
      }
    }
    if (chosen == -1)
      std::fprintf(stderr, "fp8rt-worker: no checkpoint to resume from; starting at step 1\n");
  }
  FP8RT_RETURN_IF_ERROR(world.Broadcast(&chosen, 1, parallel::DType::kI64, 0));
  if (chosen == -2) {
    return absl::FailedPreconditionError(world.rank() == 0 ? error : "resume failed on rank 0");
  }
  if (chosen == -1) return absl::OkStatus();
  return LoadCheckpoint(chosen, dir.CommittedDir(chosen));
}

absl::Status Trainer::LoadCheckpoint(int64_t chosen, const std::string& folder) {
  parallel::Communicator& world = mesh_->world();
  const std::string path = folder + "/" + ShardFileName(world.rank());
  FP8RT_ASSIGN_OR_RETURN(std::unique_ptr<ShardReader> reader, ShardReader::Open(path));
  int64_t step = 0, applied = 0;
  uint64_t position = 0;
  FP8RT_RETURN_IF_ERROR(ReadSection(*reader, "meta/step", &step, 1));
  FP8RT_RETURN_IF_ERROR(ReadSection(*reader, "meta/applied_steps", &applied, 1));
  FP8RT_RETURN_IF_ERROR(ReadSection(*reader, "meta/data_position", &position, 1));
  // The recipe in force when the checkpoint was written (its sites are the saved ones).
  if (reader->HasSection("recipe")) {
    int64_t version = 1;
    FP8RT_RETURN_IF_ERROR(ReadSection(*reader, "meta/recipe_version", &version, 1));
    v1::Recipe recipe;
    FP8RT_RETURN_IF_ERROR(reader->ParseProto("recipe", &recipe));
    if (version > 1) {
      absl::Status applied = model_->ApplyRecipe(MergeRecipe(model_->recipe(), recipe));
      if (!applied.ok()) {
        return absl::DataLossError(absl::StrCat(path, ": recipe: ", applied.message()));
      }
    }
    recipe_version_ = version;
  }
  if (step != chosen || applied < 0 || applied > step) {
    return absl::DataLossError(absl::StrCat(path, ": meta/step ", step, " applied_steps ", applied,
                                            " do not match checkpoint step ", chosen));
  }
  for (model::Param& p : model_->params()) {
    const size_t n = p.master.size();
    FP8RT_RETURN_IF_ERROR(ReadSection(*reader, "master/" + p.name, p.master.data(), n));
    FP8RT_RETURN_IF_ERROR(ReadSection(*reader, "adam_m/" + p.name, p.m.data(), n));
    FP8RT_RETURN_IF_ERROR(ReadSection(*reader, "adam_v/" + p.name, p.v.data(), n));
  }
  for (model::QuantSite* s : model_->sites()) {
    v1::ScalingState proto;
    FP8RT_RETURN_IF_ERROR(reader->ParseProto("scaling/" + s->name(), &proto));
    absl::StatusOr<train::ScalingState> state = train::ScalingState::FromProto(proto);
    if (!state.ok()) {
      return absl::DataLossError(
          absl::StrCat(path, ": scaling/", s->name(), ": ", state.status().message()));
    }
    const train::ScalingConfig& want = s->state().config();
    const train::ScalingConfig& got = state->config();
    if (want.format == got.format && want.strategy == got.strategy &&
        want.history_len == got.history_len && want.algo == got.algo && want.margin == got.margin &&
        want.power_of_two == got.power_of_two) {
      s->state() = *state;
    } else if (world.rank() == 0) {
      std::fprintf(stderr,
                   "fp8rt-worker: %s: recipe changed since the checkpoint; its scaling "
                   "state starts afresh\n",
                   s->name().c_str());
    }
  }
  optimizer_->set_applied_steps(applied);
  FP8RT_RETURN_IF_ERROR(loader_->Seek(position));
  step_ = step;
  if (world.rank() == 0) {
    std::fprintf(stderr, "fp8rt-worker: resuming after step %lld from %s\n",
                 static_cast<long long>(step), folder.c_str());
  }
  return absl::OkStatus();
}

}  // namespace fp8rt::worker
