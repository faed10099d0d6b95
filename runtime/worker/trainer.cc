// The step loop (see trainer.h). Index: Create, PrepareRunDir, Step and the named steps it calls
// (ForwardBackward, PoisonGradShard, NonFiniteRanks, MeanLoss, MoeDropped, MemoryPeaksOverRanks),
// Run. Elsewhere: controller_link.cc (RegisterWithController, ShareDirectives,
// ReportToController), trainer_checkpoint.cc (SaveCheckpoint, Restore, LoadCheckpoint),
// run_records.cc (the run folder's files), step_faults.cc (FP8RT_FAULT), recipe.cc (spec and
// recipe conversions).
#include "runtime/worker/trainer.h"

#include <algorithm>
#include <array>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <limits>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "kernels/memory_stats.h"
#include "runtime/core/status.h"
#include "runtime/spec/run_spec.h"
#include "runtime/spec/spec_recipe.h"
#include "runtime/worker/recipe.h"
#include "runtime/worker/weights.h"

namespace fp8rt::worker {
using v1::RunSpec;

Trainer::Trainer(const RunSpec& spec, const TrainerOptions& options, const kernels::OpTable& ops)
    : spec_(spec), options_(options), ops_(ops), live_recipe_(SpecRecipe(spec)) {}

Trainer::~Trainer() = default;

absl::StatusOr<std::unique_ptr<Trainer>> Trainer::Create(const RunSpec& spec,
                                                         const TrainerOptions& options,
                                                         parallel::CommunicatorFactory& factory,
                                                         const kernels::OpTable& ops) {
  std::unique_ptr<Trainer> t(new Trainer(spec, options, ops));
  FP8RT_ASSIGN_OR_RETURN(const FaultSpec fault, FaultSpec::FromEnvironment());
  parallel::MeshConfig mesh_config{
      .dp = spec.parallel().dp(), .tp = spec.parallel().tp(), .ep = spec.parallel().ep()};
  FP8RT_ASSIGN_OR_RETURN(t->mesh_, parallel::Mesh::Create(mesh_config, factory));
  t->faults_ = StepFaults(fault, t->mesh_->layout().rank, options.resume);
  if (!options.controller.address.empty()) FP8RT_RETURN_IF_ERROR(t->RegisterWithController());
  const model::ModelShape shape = ShapeFromSpec(spec);
  FP8RT_ASSIGN_OR_RETURN(
      t->model_,
      model::Transformer::Create(shape, RecipeFromSpec(spec), spec.train().seed(), *t->mesh_, ops));
  FP8RT_RETURN_IF_ERROR(t->faults_.CheckModel(shape.layers, ModelLayerNames(spec)));
  if (!spec.init().from().empty() && !options.resume) {
    // init.from: Hugging Face weights (a file, or shards with their index) instead of the seeded
    // ones (a resume takes the checkpoint's).
    FP8RT_RETURN_IF_ERROR(
        LoadHuggingFace(spec.init().from(), shape, *t->model_, spec.init().ignore_config()));
  }
  FP8RT_RETURN_IF_ERROR(t->OpenData());
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

absl::Status Trainer::OpenData() {
  const RunSpec::Data& d = spec_.data();
  const RunSpec::Model& m = spec_.model();
  const parallel::MeshLayout& layout = mesh_->layout();
  FP8RT_ASSIGN_OR_RETURN(std::shared_ptr<const train::TokenDataset> dataset,
                         train::TokenDataset::Open(d.path(), FormatFromSpec(spec_), m.vocab()));
  // data.val_fraction: training reads the head, validation the tail (ValidationSplit).
  const uint64_t split = ValidationSplit(dataset->size(), d.val_fraction());
  const train::DataLoaderOptions options{
      .seq_len = m.seq_len(),
      .micro_batch = spec_.train().micro_batch(),
      .dp = layout.config.dp,
      .dp_rank = layout.dp_rank,
      .shuffle = !d.has_shuffle() || d.shuffle(),
      .seed = spec_.train().seed(),
      .grad_accum = static_cast<int32_t>(spec_.train().grad_accum()),
      .range = {.begin = 0, .end = split}};
  FP8RT_ASSIGN_OR_RETURN(train::DataLoader loader, train::DataLoader::Create(dataset, options));
  loader_ = std::make_unique<train::DataLoader>(std::move(loader));
  tokens_.resize(loader_->batch_tokens());
  if (spec_.eval().every() <= 0) return absl::OkStatus();

  // Validation: file order, the first eval.batches windows of micro_batch sequences per rank.
  std::shared_ptr<const train::TokenDataset> val = dataset;
  train::DataLoaderOptions val_options = options;
  val_options.shuffle = false;
  val_options.range = {.begin = split, .end = dataset->size()};
  const bool fraction = d.val_path().empty();
  if (!fraction) {
    FP8RT_ASSIGN_OR_RETURN(
        val, train::TokenDataset::Open(d.val_path(), FormatFromSpec(spec_), m.vocab()));
    val_options.range = {};
  }
  const uint64_t tokens = val_options.range.end == std::numeric_limits<uint64_t>::max()
                              ? val->size()
                              : val_options.range.end - val_options.range.begin;
  const uint64_t row = static_cast<uint64_t>(m.seq_len()) + 1;
  const uint64_t need = static_cast<uint64_t>(spec_.eval().batches()) *
                        static_cast<uint64_t>(spec_.train().micro_batch()) *
                        static_cast<uint64_t>(layout.config.dp);
  if (tokens / row < need) {  // ValidateRunSpec counts the same from the file's size
    return absl::InvalidArgumentError(absl::StrCat(
        fraction ? "data.val_fraction: the held-out tail of '" : "data.val_path: '", val->path(),
        "' holds ", tokens, " tokens, ", tokens / row, " windows of model.seq_len + 1 = ", row,
        " tokens; eval needs eval.batches * train.micro_batch * parallel.dp = ", need, " windows"));
  }
  FP8RT_ASSIGN_OR_RETURN(train::DataLoader val_loader,
                         train::DataLoader::Create(std::move(val), val_options));
  eval_loader_ = std::make_unique<train::DataLoader>(std::move(val_loader));
  return absl::OkStatus();
}

absl::Status Trainer::PrepareRunDir() {
  FP8RT_RETURN_IF_ERROR(PrepareRunFolder(mesh_->world(), options_.run_dir, options_.resume));
  if (options_.resume) FP8RT_RETURN_IF_ERROR(Restore());
  FP8RT_RETURN_IF_ERROR(model_->PrefetchShards());  // written by the host: initial or restored
  FP8RT_ASSIGN_OR_RETURN(records_, RunRecords::Open(options_.run_dir, mesh_->layout().rank,
                                                    spec_.metrics().per_rank_fp8_stats(),
                                                    spec_.metrics().every(), step_));
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
  const int64_t step = step_ + 1;
  faults_.BeforeStep(step);  // FP8RT_FAULT kill / hang
  const auto t0 = std::chrono::steady_clock::now();
  FP8RT_RETURN_IF_ERROR(ShareDirectives());    // controller: stop, save, a due recipe
  FP8RT_RETURN_IF_ERROR(model_->BeginStep());  // FSDP: scales and FP8 weight shards
  std::optional<double> val_loss;
  std::chrono::steady_clock::duration eval_time{};
  if (EvalDue(step)) {  // the weights the step starts from; before any of its forwards
    const auto e0 = std::chrono::steady_clock::now();
    FP8RT_ASSIGN_OR_RETURN(val_loss, ValidationLoss());
    eval_time = std::chrono::steady_clock::now() - e0;
  }
  // FP8RT_FAULT nan_act / inf_act
  faults_.BeforeForward(step, *model_);
  FP8RT_ASSIGN_OR_RETURN(const float loss_sum, ForwardBackward());  // every micro-batch
  FP8RT_RETURN_IF_ERROR(model_->ReduceGrads());  // the gradient shards are complete
  FP8RT_ASSIGN_OR_RETURN(const bool injected,
                         faults_.AfterReduceGrads(step, *model_, ops_));  // nan_grad / inf_grad
  // A NaN or Inf this rank saw outside its gradients (its loss, or an FP8 site's amax: an Inf
  // that FP8 saturated to a finite value shows only there) skips the step too.
  const bool saw_nonfinite = !std::isfinite(loss_sum) || AnySiteAmaxNonFinite();
  if (saw_nonfinite) FP8RT_RETURN_IF_ERROR(PoisonGradShard());
  std::vector<train::ParamShard> shards = Shards();
  // The global norm and the skip decision first, then the scaling states (so that the update
  // knows the next step's weight scales), then the update, which writes the FP8 weight shards.
  FP8RT_ASSIGN_OR_RETURN(const train::StepResult norm,
                         optimizer_->ComputeNorm(shards, step, &mesh_->world()));
  // A skipped step leaves the scaling states as they were: its amaxes come from a step that made
  // NaN or Inf (a NaN or Inf amax is refused by ScalingState anyway, but finite amaxes of such a
  // step, e.g. of values saturated from an Inf, would distort the scales for a whole history).
  using Update = model::Transformer::ScalingUpdate;
  FP8RT_ASSIGN_OR_RETURN(const std::vector<model::SiteReport> sites,
                         model_->SyncScaling(norm.skipped ? Update::kReportOnly : Update::kCommit));
  if (!norm.skipped) model_->AttachFp8Shards(shards);  // FSDP FP8 shards of the next step
  FP8RT_ASSIGN_OR_RETURN(const train::StepResult result, optimizer_->Apply(shards, norm));

  StepRecord r;
  r.step = step;
  r.grad_norm = result.grad_norm;
  r.lr = result.lr;
  r.skipped = result.skipped;
  FP8RT_ASSIGN_OR_RETURN(r.nonfinite_ranks,
                         NonFiniteRanks(result.skipped, saw_nonfinite || injected));
  FP8RT_ASSIGN_OR_RETURN(r.loss, MeanLoss(loss_sum));
  FP8RT_ASSIGN_OR_RETURN(r.moe_dropped, MoeDropped());
  FP8RT_ASSIGN_OR_RETURN(r.memory, MemoryPeaksOverRanks());
  r.recipe_version = recipe_version_;
  r.val_loss = val_loss;
  step_ = step;
  // The training's time: the evaluation is not throughput.
  r.step_time_s =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - t0 - eval_time).count();
  r.tokens_per_s = static_cast<double>(GlobalBatchTokens()) / r.step_time_s;

  FP8RT_RETURN_IF_ERROR(records_->Write(r, sites, model_->moe_stats()));
  progress_.store(step_);  // for the heartbeat thread
  FP8RT_RETURN_IF_ERROR(ReportToController(r, sites));
  return r;
}

absl::StatusOr<float> Trainer::ForwardBackward() {
  const RunSpec::Train& tr = spec_.train();
  // Each micro-batch's gradients += into the shards, scaled for the mean over the global batch.
  const float dloss = 1.0f / static_cast<float>(tr.grad_accum() * mesh_->layout().config.dp);
  float loss_sum = 0.0f;
  for (int64_t i = 0; i < tr.grad_accum(); ++i) {
    FP8RT_RETURN_IF_ERROR(loader_->Next(tokens_));
    FP8RT_ASSIGN_OR_RETURN(const float loss,
                           model_->ForwardBackward(tokens_, tr.micro_batch(), dloss));
    loss_sum += loss;
  }
  return loss_sum;
}

absl::Status Trainer::PoisonGradShard() {
  // A NaN in this rank's gradient shard makes the optimizer's global norm non-finite on every
  // rank, so every rank skips the step with no extra collective.
  return PutIntoGradShard(*model_, ops_, std::numeric_limits<float>::quiet_NaN());
}

bool Trainer::AnySiteAmaxNonFinite() const {
  for (const model::QuantSite* s : model_->sites()) {
    if (s->used_this_step() && !std::isfinite(s->step_stats().amax)) return true;
  }
  return false;
}

absl::StatusOr<bool> Trainer::GradShardNonFinite() const {
  FP8RT_RETURN_IF_ERROR(ops_.layer->synchronize({}));
  for (const model::Param& p : model_->params()) {
    for (const float g : p.grad) {
      if (!std::isfinite(g)) return true;
    }
  }
  return false;
}

absl::StatusOr<std::vector<int>> Trainer::NonFiniteRanks(bool skipped, bool saw_nonfinite) const {
  std::vector<int> ranks;
  if (!skipped) return ranks;
  // Every rank agrees the step is skipped: this collective is made by all of them, on skipped
  // steps only. Per rank: [it saw a NaN/Inf itself (loss, amaxes, an injected fault), its
  // gradient shard holds one]. The reduce-scatter spreads one rank's non-finite gradient into
  // the shards of every rank that owns an element of it, so a shard names a rank only when no
  // rank saw the cause itself (a NaN/Inf born in a backward, seen in no loss or amax).
  parallel::Communicator& world = mesh_->world();
  FP8RT_ASSIGN_OR_RETURN(const bool shard_nonfinite, GradShardNonFinite());
  const int64_t mine[2] = {saw_nonfinite ? 1 : 0, shard_nonfinite ? 1 : 0};
  std::vector<int64_t> all(2 * static_cast<size_t>(world.size()), 0);
  FP8RT_RETURN_IF_ERROR(world.AllGather(mine, 2, all.data(), parallel::DType::kI64));
  for (const int column : {0, 1}) {
    for (int r = 0; r < world.size(); ++r) {
      if (all[2 * static_cast<size_t>(r) + column] != 0) ranks.push_back(r);
    }
    if (!ranks.empty()) break;
  }
  return ranks;
}

absl::StatusOr<double> Trainer::MeanLoss(float local_sum) {
  FP8RT_RETURN_IF_ERROR(
      mesh_->dp().AllReduce(&local_sum, 1, parallel::DType::kF32, parallel::ReduceOp::kSum));
  const int64_t micro_batches = spec_.train().grad_accum() * mesh_->layout().config.dp;
  return static_cast<double>(local_sum) / static_cast<double>(micro_batches);
}

bool Trainer::EvalDue(int64_t step) const {
  const int64_t every = spec_.eval().every();
  return eval_loader_ != nullptr && every > 0 &&
         (step % every == 0 || step == spec_.train().steps());
}

absl::StatusOr<double> Trainer::ValidationLoss() {
  const int64_t batches = spec_.eval().batches();
  float sum = 0.0f;  // this rank's micro-batch losses, summed as MeanLoss sums the step's
  for (int64_t j = 0; j < batches; ++j) {
    FP8RT_RETURN_IF_ERROR(eval_loader_->BatchAt(static_cast<uint64_t>(j), tokens_));
    FP8RT_ASSIGN_OR_RETURN(const float loss,
                           model_->Evaluate(tokens_, spec_.train().micro_batch()));
    sum += loss;
  }
  FP8RT_RETURN_IF_ERROR(
      mesh_->dp().AllReduce(&sum, 1, parallel::DType::kF32, parallel::ReduceOp::kSum));
  return static_cast<double>(sum) / static_cast<double>(batches * mesh_->layout().config.dp);
}

absl::StatusOr<std::optional<int64_t>> Trainer::MoeDropped() {
  if (model_->moe_stats().empty()) return std::nullopt;
  int64_t dropped = 0;
  for (const model::MoeBlockStats& m : model_->moe_stats()) dropped += m.dropped;
  FP8RT_RETURN_IF_ERROR(
      mesh_->world().AllReduce(&dropped, 1, parallel::DType::kI64, parallel::ReduceOp::kSum));
  return dropped;
}

absl::StatusOr<MemoryPeaks> Trainer::MemoryPeaksOverRanks() {
  // [total, each category]: one MAX all-reduce of a few integers per step.
  const kernels::MemoryStats mine = kernels::GetMemoryStats();
  std::array<int64_t, 1 + kernels::kNumMemCategories> peaks{};
  peaks[0] = mine.total_peak;
  std::copy(mine.peak.begin(), mine.peak.end(), peaks.begin() + 1);
  FP8RT_RETURN_IF_ERROR(mesh_->world().AllReduce(peaks.data(), static_cast<int64_t>(peaks.size()),
                                                 parallel::DType::kI64, parallel::ReduceOp::kMax));
  MemoryPeaks out;
  out.total = peaks[0];
  std::copy(peaks.begin() + 1, peaks.end(), out.category.begin());
  return out;
}

int64_t Trainer::GlobalBatchTokens() const {
  const RunSpec::Train& tr = spec_.train();
  return tr.grad_accum() * mesh_->layout().config.dp * tr.micro_batch() * spec_.model().seq_len();
}

absl::Status Trainer::Run() {
  const int64_t steps = spec_.train().steps(), every = spec_.metrics().every();
  const int64_t ckpt_every = spec_.checkpoint().every();
  const bool rank0 = mesh_->layout().rank == 0;
  while (step_ < steps) {
    FP8RT_ASSIGN_OR_RETURN(const StepRecord r, Step());
    if (rank0 && options_.print_progress &&
        (r.step % every == 0 || r.step == 1 || r.step == steps || r.val_loss.has_value())) {
      std::printf(
          "step %lld/%lld loss %.4f%s grad_norm %.4f lr %.3g tokens/s %.0f%s%s\n",
          static_cast<long long>(r.step), static_cast<long long>(steps), r.loss,
          r.val_loss.has_value() ? absl::StrFormat(" val_loss %.4f", *r.val_loss).c_str() : "",
          r.grad_norm, r.lr, r.tokens_per_s,
          r.skipped ? " (skipped: non-finite values on ranks " : "",
          r.skipped ? absl::StrCat(absl::StrJoin(r.nonfinite_ranks, ", "), ")").c_str() : "");
      std::fflush(stdout);
    }
    if ((ckpt_every > 0 && (step_ % ckpt_every == 0 || step_ == steps)) || save_requested_ ||
        stop_requested_) {
      FP8RT_RETURN_IF_ERROR(SaveCheckpoint());
      FP8RT_RETURN_IF_ERROR(model_->PrefetchShards());  // the save read them on the host
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
  FlushControllerReports();
  return absl::OkStatus();
}

}  // namespace fp8rt::worker
