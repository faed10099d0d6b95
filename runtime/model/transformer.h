// The decoder-only transformer of DESIGN.md section 5, with tensor parallelism over the TP group
// and FSDP over the DP group, its forward and backward written out layer by layer.
//
// Index:
//   ModelShape, ModelRecipe   the model's sizes (model_shape.h) and its precision recipe (from the
//                             run spec)
//   Param                     one parameter: its logical shape, this rank's TP piece, the FSDP
//                             shard this rank owns (master, gradient, Adam moments) and the
//                             gathered weight of the step
//   SiteReport                one FP8 site's statistics of a step (per-rank fp8_stats lines)
//   Transformer               Create, GatherWeights, ForwardBackward, ReduceGrads,
//                             SyncScaling; parameters and sites by stable name
//
// Layers (names are the keys of scaling states, checkpoints and metrics; parameters are
// "LAYER/weight" and "LAYER/bias"):
//   embedding                  token embedding [vocab, d_model], FP32
//   positions                  learned absolute positions [max_positions, d_model] (positions
//                              learned), added to the token embedding
//   blocks.L.attn_norm         RMSNorm gain, or LayerNorm gain and bias [d_model], FP32
//   blocks.L.attn.qkv          column-parallel [(heads + 2 kv_heads) Dh, d_model]: rows grouped by
//                              key/value head g (the heads/kv_heads query heads of group g, then
//                              k_g, then v_g, Dh rows each), so a TP rank's groups are one range;
//                              with kv_heads = heads, head h holds its q, k and v rows. RoPE
//                              (positions rope) rotates q and k after it.
//   blocks.L.attn.proj         row-parallel [d_model, d_model]
//   blocks.L.mlp_norm          like attn_norm
//   blocks.L.mlp.fc1           column-parallel [d_ff, d_model], GELU after it   (mlp gelu)
//   blocks.L.mlp.fc2           row-parallel [d_model, d_ff]
//   blocks.L.mlp.gate, .up     column-parallel [d_ff, d_model]; silu(gate) * up  (mlp swiglu)
//   blocks.L.mlp.down          row-parallel [d_model, d_ff]
//   final_norm, lm_head        like attn_norm; LM head [vocab, d_model] (BF16 GEMM in bf16 and fp8
//                              runs, FP32 in fp32 runs; never FP8), or the token embedding itself
//                              (tie_embeddings: its gradient is the sum of both uses)
// With shape.bias every block GEMM has a bias ([out], split like the output: column-parallel
// biases by TP rank, row-parallel ones replicated and added after the TP sum); the LM head never
// has one. The block GEMMs run in the run's precision; in an fp8 run a layer listed in
// precision.exclude runs in BF16.
//
// Tensor parallelism: column-parallel outputs stay split by heads / d_ff; row-parallel outputs
// are summed over the TP group (all-reduce, FP32) and so are the input gradients of the
// column-parallel layers. Embedding, norms and LM head are replicated on the TP ranks (their
// gradients are identical there, and only TP rank 0's copy counts in the gradient norm).
// FSDP (ZeRO-3, DESIGN.md section 4): each parameter's TP piece, flattened, is cut into dp shards
// (the last one zero-padded). A rank keeps only its shards: FP32 master, FP32 gradient, Adam
// moments and, for FP8 GEMM weights with fsdp_gather fp8, the FP8 shard (its rows quantized once
// per step in BeginStep). Parameters are gathered and freed by FSDP unit: the embedding, each
// block (its norms, GEMM weights, router and local experts), and the head (final norm and LM
// head). A unit's full weights exist only while it runs: gathered just before its forward (the
// next unit's gather started, nonblocking, while the current one computes), freed after it
// (recipe.reshard_after_forward; the last block stays gathered, its backward comes next),
// gathered again for its backward; its full gradient is allocated for its backward and
// reduce-scattered (grad_reduce dtype) into the FP32 shard gradients (+= across micro-batches) as
// soon as that backward is done, then freed. FP8 weights travel as FP8 codes plus scales
// (fsdp_gather fp8) or as BF16 quantized by every rank after the gather (fsdp_gather bf16); every
// other parameter travels in FP32.
//
// Initialisation is a pure function of (seed, parameter name, logical index), so every layout
// starts from the same logical weights: N(0, 0.02), the residual-output layers (attn.proj,
// mlp.fc2, mlp.down) scaled by 1/sqrt(2 layers), norm gains 1, biases 0.
//
// Not thread-safe: one owner (the rank's step loop). Collective calls (GatherWeights, the TP
// reductions inside ForwardBackward, ReduceGrads, SyncScaling) must be made in the same order on
// every rank.
#ifndef FP8RT_RUNTIME_MODEL_TRANSFORMER_H_
#define FP8RT_RUNTIME_MODEL_TRANSFORMER_H_

#include <algorithm>
#include <cstdint>
#include <deque>
#include <functional>
#include <initializer_list>
#include <map>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "kernels/device_array.h"
#include "kernels/host_mirror.h"
#include "kernels/ops.h"
#include "parallel/fp8_collectives.h"
#include "parallel/mesh.h"
#include "runtime/model/linear.h"
#include "runtime/model/model_shape.h"
#include "runtime/model/moe.h"
#include "runtime/train/optimizer.h"
#include "runtime/train/scaling.h"

namespace fp8rt::model {

// Token routing of one MoE block over a step, this rank's tokens (summed over micro-batches).
struct MoeBlockStats {
  std::string layer;                       // blocks.1.mlp
  std::vector<int64_t> tokens_per_expert;  // kept assignments per expert
  int64_t dropped = 0;                     // assignments over capacity
};

enum class FsdpGatherDType : uint8_t { kFp8, kBf16 };

// One layer's own recipe (precision.overrides, resolved per layer by the worker).
struct LayerRecipe {
  GemmPrecision precision = GemmPrecision::kFp8;  // kFp8 or kBf16
  Fp8SiteConfigs sites;
};

struct ModelRecipe {
  GemmPrecision precision = GemmPrecision::kFp8;  // of the block GEMMs
  Fp8SiteConfigs sites;                           // formats and scaling of the FP8 sites
  std::vector<std::string> exclude;               // layers kept out of FP8 (run in BF16)
  // Layers with a recipe of their own, by name (fp8 runs only; exclude comes first).
  std::map<std::string, LayerRecipe> layers;
  FsdpGatherDType fsdp_gather = FsdpGatherDType::kFp8;
  parallel::GradReduceDType grad_reduce = parallel::GradReduceDType::kFP32;
  // parallel.reshard_after_forward: free a unit's gathered weights after its forward and gather
  // them again for its backward (ZeRO-3); false keeps them from forward to backward (more
  // memory, half the gathers).
  bool reshard_after_forward = true;
  // precision.save_fp8_activations: an FP8 GEMM keeps its input for the backward only as the FP8
  // codes and scales its forward made (DESIGN.md section 3), not also in FP32. Not the MoE
  // experts: their layer keeps each local expert's gathered FP32 rows anyway.
  bool save_fp8_activations = true;
  // precision.fp8_fast_accum_forward: the forward FP8 GEMMs (tensor scaling) let the GPU's tensor
  // cores accumulate without FP32 promotion (Fp8GemmArgs::fast_accum); the backward ones never.
  bool fp8_fast_accum_forward = true;
  // The least number of rows the FSDP shards of the GEMM weights are cut in (ShardCut::row_unit),
  // beyond what the recipe itself needs (128 with block scaling, 32 with mx32, 1 otherwise in an
  // FP8 run): a run whose recipe may turn to block scaling later (health.action block_scaling)
  // asks for 128 here. Used by Create only: a model's cut never changes (ApplyRecipe refuses a
  // recipe whose blocks would straddle its shards).
  int64_t fsdp_row_unit = 0;
};

struct Param {
  std::string name;  // "blocks.0.mlp.fc1/weight"
  int64_t rows = 0;  // logical shape
  int64_t cols = 0;
  TpSplit split = TpSplit::kNone;
  int64_t local_rows = 0;  // this rank's TP piece
  int64_t local_cols = 0;
  int64_t shard_count = 0;   // ShardCut::count(): ceil(local_rows * local_cols / dp), or rows
  int64_t row_unit = 0;      // ShardCut::row_unit of its cut
  bool decay = true;         // weight decay (not for norm gains)
  Linear* linear = nullptr;  // the GEMM layer it is the weight of, or null
  // FSDP group: the DP group, or the expert-data-parallel group for MoE expert weights.
  parallel::Communicator* group = nullptr;

  // This rank's FSDP shard: flattened TP-piece elements [dp_rank * shard_count, +shard_count),
  // kept for the whole run. Every array is memory of the model's backend
  // (kernels/device_array.h), counted by memory category (kernels/memory_stats.h). `grad` holds
  // the step's reduced gradient: written by the step's first micro-batch (its reduce-scatter, or
  // in a one-rank group the full gradient buffer itself), += by the later ones.
  kernels::DeviceArray<float> master, grad, m, v;
  // FP8 GEMM weights with fsdp_gather fp8: this rank's rows in FP8, quantized once per step
  // (by the optimizer's update pass when fp8_shard_fresh, see AttachFp8Shards).
  parallel::Fp8Shard fp8_shard;
  bool fp8_shard_fresh = false;
  // Only while the parameter's unit runs (empty otherwise): the gathered TP piece (FP32,
  // dp * shard_count with the padding) or FP8 weight, and the full gradient of a backward.
  kernels::DeviceArray<float> full, full_grad;
  parallel::Fp8Weight fp8;
  // The BF16 wire buffer of a BF16 FSDP gather of an FP8 weight (fsdp_gather bf16), only while
  // its unit is being gathered.
  kernels::DeviceArray<uint16_t> gather_bf16;

  // Gradient reductions into `grad` this step: the first writes, later ones add (a tied
  // embedding is reduced by the head's backward and by the embedding's).
  int64_t reductions = 0;
  // full_grad was left unzeroed by BeginUnitGrads: its layer's backward writes it over (and
  // clears this) before anything reads it.
  bool grad_unwritten = false;

  int64_t local_count() const { return local_rows * local_cols; }
};

// How one rank's FSDP shard of a parameter is cut from its logical tensor: the rank's TP piece
// (rows or columns tp_rank of tp, or the whole tensor), flattened, then elements
// [fsdp_rank * count, +count) of it with count = ceil(piece / fsdp), the tail past the piece
// being padding. What Transformer::AddParam allocates, and what a checkpoint written at any
// layout is read back with (worker::AssembleLogical).
//
// The GEMM weights of an FP8 run are cut in whole rows instead (row_unit > 0, FSDP over more
// than one rank): each shard holds ceil(local_rows / (row_unit * fsdp)) * row_unit rows, so that
// a shard's FP8 codes are whole rows and, with row_unit 128 (block scaling) or 32 (mx32), whole
// blocks of rows whose scales never need a neighbour's values; the rows past the piece are
// padding (zero), which falls to the last shards. Where row_unit * fsdp divides the piece's rows
// the cut is the element-wise one.
struct ShardCut {
  LogicalShape shape;
  int64_t tp = 1, tp_rank = 0;      // the tensor-parallel split
  int64_t fsdp = 1, fsdp_rank = 0;  // the FSDP group: dp, or dp / ep for MoE experts
  int64_t row_unit = 0;             // 0: element-wise; else whole groups of row_unit rows
  int64_t local_rows() const {
    return shape.split == TpSplit::kRows ? shape.rows / tp : shape.rows;
  }
  int64_t local_cols() const {
    return shape.split == TpSplit::kCols ? shape.cols / tp : shape.cols;
  }
  int64_t count() const {
    if (row_unit > 0 && fsdp > 1) {
      const int64_t per = row_unit * fsdp;
      return (local_rows() + per - 1) / per * row_unit * local_cols();
    }
    return (local_rows() * local_cols() + fsdp - 1) / fsdp;
  }
  // The rows of one shard when it is whole rows (count() a multiple of local_cols()), else -1.
  int64_t shard_rows() const {
    const int64_t cols = local_cols();
    return cols > 0 && count() % cols == 0 ? count() / cols : -1;
  }
  // fn(i, logical): shard element i is element `logical` of the row-major logical tensor; the
  // padding is skipped.
  void ForEach(const std::function<void(size_t, int64_t)>& fn) const;
  // The piece's first row and column in the logical tensor, and the first element of the piece
  // this shard holds and how many (no padding).
  int64_t row0() const { return shape.split == TpSplit::kRows ? tp_rank * local_rows() : 0; }
  int64_t col0() const { return shape.split == TpSplit::kCols ? tp_rank * local_cols() : 0; }
  int64_t flat_begin() const { return fsdp_rank * count(); }
  int64_t flat_count() const {
    return std::clamp<int64_t>(local_rows() * local_cols() - flat_begin(), 0, count());
  }
};

struct SiteReport {
  std::string site;              // "blocks.0.mlp.fc1/input"
  float amax = 0.0f;             // synchronised over all ranks
  float scale = 1.0f;            // the scale the site quantized with in this step
  double underflow_ratio = 0.0;  // of this rank's quantizations in the step
  double saturation_ratio = 0.0;
  bool used = false;      // quantized anything this step
  int64_t count = 0;      // values this rank quantized in the step, and how many of
  int64_t underflow = 0;  // them underflowed / saturated (summed over ranks for the
  int64_t saturated = 0;  // controller)
};

class Transformer {
 public:
  // InvalidArgument naming the run-spec field for shapes the layout cannot split (heads, d_model,
  // d_ff by tp; GEMM weight rows by dp; whole 128x128 blocks per shard with block scaling) and
  // for an unknown layer in `recipe.exclude` (field precision.exclude).
  ~Transformer();
  // The ShardCut::row_unit of the GEMM weights of a model created with `recipe`: 0 unless FP8;
  // else the most any layer's scaling needs (128 block, 32 mx32, 1) and recipe.fsdp_row_unit.
  static int64_t RowUnitOf(const ModelRecipe& recipe);
  static absl::StatusOr<std::unique_ptr<Transformer>> Create(const ModelShape& shape,
                                                             const ModelRecipe& recipe,
                                                             uint64_t seed, parallel::Mesh& mesh,
                                                             const kernels::OpTable& ops);

  const ModelShape& shape() const { return shape_; }
  std::vector<Param>& params() { return params_; }
  // Every parameter's logical shape and TP split, by name.
  std::map<std::string, LogicalShape> ParamShapes() const;
  // How this rank's shard of `p` is cut from its logical tensor.
  ShardCut CutOf(const Param& p) const;
  // Sets this rank's FP32 master shard of every parameter from its logical tensor (the elements
  // AddParam's initialisation would have written): init.from and weights files. InvalidArgument
  // naming the parameter for a missing one or a wrong size, before anything is changed. Adam
  // moments are left as they are (zero in a new model).
  absl::Status SetLogicalParams(const LogicalParams& params);
  // The same for any of a parameter's per-element arrays: the FP32 master shard or an Adam
  // moment (a resume at another layout, resharding a checkpoint).
  enum class ShardArray : uint8_t { kMaster, kAdamM, kAdamV };
  absl::Status SetLogicalShards(const LogicalParams& params, ShardArray which);
  // One parameter's FP32 master shard from its logical tensor (`values`, rows x cols): weights
  // loaded one parameter at a time. InvalidArgument naming it for an unknown name or a wrong size,
  // with nothing changed.
  absl::Status SetLogicalParam(const std::string& name, std::span<const float> values);
  // Every FP8 site in a stable order (empty unless some GEMM runs in FP8).
  const std::vector<QuantSite*>& sites() const { return sites_; }
  // Names of the GEMM layers, for the error of an unknown exclude entry.
  std::vector<std::string> LayerNames() const;

  const ModelRecipe& recipe() const { return recipe_; }
  // Switches to a new recipe between steps (a live recipe update; the precision mode itself
  // cannot change): layers entering or leaving precision.exclude, scaling strategy, history
  // length, margin, formats, FSDP gather and gradient-reduce dtypes. Scaling histories carry
  // over. InvalidArgument naming the field (nothing changed) for an unknown layer or a shape the
  // new scaling cannot split. Every rank must apply the same recipe at the same step.
  absl::Status ApplyRecipe(const ModelRecipe& recipe);

  // MoE routing of the current step, one entry per MoE block (empty for a dense model).
  const std::vector<MoeBlockStats>& moe_stats() const { return moe_stats_; }

  // Starts an optimizer step: resets the sites' step statistics, agrees on the scale of every
  // tensor-scaled FP8 weight (one MAX over all ranks for the current-scaled ones), quantizes each
  // FP8 weight's shard once for the step (recording its weight-site statistics). Must precede
  // ForwardBackward, whose first pass writes the gradient shards (later passes add to them).
  absl::Status BeginStep();
  // Moves every parameter's shard arrays (master, grad, Adam's m and v: memory the host writes at
  // start-up and at a resume and reads at a checkpoint) to where the ops run, in bulk, instead of
  // page fault by page fault in the next step (LayerOps::prefetch; nothing on the CPU).
  absl::Status PrefetchShards();

  // One micro-batch: `tokens` holds micro_batch rows of seq_len + 1 token ids (inputs and
  // next-token targets). Runs forward and backward unit by unit (gathering and freeing weights,
  // reduce-scattering each unit's gradient into the shards as its backward ends), accumulating
  // parameter gradients scaled by `dloss` (1 / (grad_accum * dp) for the mean over the global
  // batch). Returns the micro-batch's mean loss.
  absl::StatusOr<float> ForwardBackward(std::span<const int32_t> tokens, int64_t micro_batch,
                                        float dloss);

  // Forward only: the mean loss of one micro-batch (`tokens` as in ForwardBackward) with the
  // step's weights, for validation. No gradient is computed or reduced and nothing is recorded in
  // the FP8 sites (their scaling is the step's). Call it after BeginStep and before the step's
  // first ForwardBackward, on every rank (it runs the same gathers and TP reductions).
  absl::StatusOr<float> Evaluate(std::span<const int32_t> tokens, int64_t micro_batch);

  // Rows [first_row, first_row + rows) of the logits [micro_batch * seq_len, vocab] of the last
  // Evaluate or ForwardBackward, copied to the host (the logits are device memory; this waits for
  // the backend). InvalidArgument naming the range when it lies outside the last pass's rows.
  absl::StatusOr<std::vector<float>> CopyLogits(int64_t first_row, int64_t rows) const;

  // Between the optimizer's skip decision and its update (after SyncScaling has set the next
  // step's scales): points the FP8 fields of shards[i] (params()[i]'s shard) at the FP8 shard of
  // every FP8 weight whose scales the update pass can know: tensor scaling whose next scale is
  // already known (delayed scaling with a history), and 128x128 block scaling (each block's
  // scale comes from its own updated amax, inside the pass). The optimizer writes those shards
  // in its update pass; BeginStep then uses the bytes as they are instead of quantizing again.
  // Current tensor scaling needs the amax of the whole updated weight over every rank first:
  // BeginStep quantizes those (one MAX over the world, then one pass over each shard, no
  // gather).
  // Call it only for a step the optimizer will apply.
  void AttachFp8Shards(std::span<train::ParamShard> shards);

  // Ends the step's gradient reduction. Each unit's gradient was reduce-scattered into its
  // Param::grad shards inside ForwardBackward; this checks that every micro-batch of the step
  // reduced every unit (FailedPrecondition naming the unit otherwise, e.g. a pass that failed
  // part-way) and frees whatever a failed pass left gathered.
  absl::Status ReduceGrads();

  // Fault injection for tests (FP8RT_FAULT nan_act / inf_act): the next ForwardBackward writes
  // `value` into the first element of the activation entering block `block` (the residual stream
  // before its attention norm), once. Unarmed, the forward pays one integer compare per block.
  // `block` must be in [0, shape().layers).
  void ArmActivationFault(int64_t block, float value);
  // Test fault (FP8RT_FAULT outlier_act): Linear::ArmInputOutlier on the layer named `layer`
  // (every rank's copy of an expert layer). False when the model has no such layer.
  bool ArmInputOutlier(const std::string& layer, float growth, int64_t grow_forwards);

  // Ends the step's scaling: every site's amax of the step, MAX-reduced over all ranks in one
  // collective, is recorded in its scaling state (kCommit), or the states stay as they were
  // (kReportOnly: a skipped step, whose amaxes come from NaN or Inf values). Returns what each
  // site did (before any update).
  enum class ScalingUpdate : uint8_t { kCommit, kReportOnly };
  absl::StatusOr<std::vector<SiteReport>> SyncScaling(
      ScalingUpdate update = ScalingUpdate::kCommit);

 private:
  struct Block;
  struct Acts;
  Transformer(const ModelShape& shape, const ModelRecipe& recipe, parallel::Mesh& mesh,
              const kernels::OpTable& ops);
  absl::Status Build(uint64_t seed);
  // std_dev > 0: N(0, std_dev); kOnes / kZeros: constant.
  static constexpr float kOnes = 0.0f, kZeros = -1.0f;
  Param& AddParam(const std::string& name, int64_t rows, int64_t cols, TpSplit split, bool decay,
                  float std_dev, uint64_t seed, Linear* linear, bool expert = false);
  // fn(shard index, logical index row * cols + col) for each element of p's shard on this rank
  // (the FSDP padding left out).
  void ForEachShardElement(const Param& p, const std::function<void(size_t, int64_t)>& fn) const;
  // `p`'s shard of array `which` from its logical tensor `v` (size checked by the caller).
  void SetShard(Param& p, std::span<const float> v, ShardArray which);
  absl::Status LoadTokens(std::span<const int32_t> tokens, int64_t micro_batch);
  // The forward of a micro-batch already in acts_ (inputs, targets); `train` keeps what the
  // backward needs and counts MoE routing. Queues the rows' losses without waiting for them and
  // returns the MoE load-balancing losses' sum (host values): MeanLoss reads the loss.
  absl::StatusOr<float> Forward(bool train);
  // The mean of the last forward's row losses, plus `aux_loss`, once the backend has finished
  // and the pass's stream-ordered collectives completed: it waits and checks unless
  // `backend_idle` (Backward did both).
  absl::StatusOr<float> MeanLoss(float aux_loss, bool backend_idle);
  absl::Status Backward(float dloss);
  // FSDP units (see the file comment): unit 0 the embedding, 1..layers the blocks, layers + 1
  // the head.
  struct Unit {
    std::string name;         // "embedding", "blocks.3", "head": for errors
    std::vector<int> params;  // indices into params_ (a tied embedding is in two units)
    bool gathered = false;    // full weights present (Finish done, not yet resharded)
    bool started = false;     // gathers started (StartUnshard)
    std::vector<std::unique_ptr<parallel::PendingCollective>> pending;
    int64_t reduced = 0;  // backward reductions this step (one per micro-batch)
  };
  absl::Status StartUnshard(size_t unit);   // starts the unit's gathers (nonblocking where it can)
  absl::Status FinishUnshard(size_t unit);  // waits for them, hands the weights to the layers
  // fsdp_gather bf16: the FP8 weight of a BF16-gathered piece (FinishUnshard, after the gather).
  absl::Status QuantizeGatheredBf16(Param& p);
  void Reshard(size_t unit);  // frees the gathered weights
  // Full gradients for the unit's backward, zeroed except those in `overwritten` (their layers
  // write them over; only their padding past local_count() is zeroed).
  absl::Status BeginUnitGrads(size_t unit, std::initializer_list<int> overwritten = {});
  // Starts the reduce-scatters of the unit's gradients into the shards, after finishing those
  // of the unit before (FinishReductions): a unit's reductions run while the backward of the
  // next unit down computes, where the group's backend has a nonblocking form (NCCL on device
  // memory); elsewhere each completes, and its full gradient is freed, at once.
  absl::Status ReduceUnitGrads(size_t unit);
  // Finishes the reductions in flight (their shard conversions and accumulations queued, the
  // default stream ordered after them) and frees their full gradients. The first error.
  absl::Status FinishReductions();
  // Queues the quantization of p's shard (no wait: BeginStep reads the statistics of all of them
  // after one synchronize); mx32's transposes go through `scratch`.
  absl::Status QuantizeWeightShard(Param& p, float weight_scale,
                                   kernels::DeviceArray<std::byte>* scratch);
  void RecordWeightShard(Param& p, float weight_scale);  // the weight site's statistics
  // The TP sum of buf, stream-ordered (parallel::Completion::kStream); a no-op without TP.
  absl::Status AllReduceTp(float* buf, int64_t count);
  // After a synchronisation: the error of any of the pass's stream-ordered collectives (TP sums
  // and amaxes, FSDP gathers and gradient reduce-scatters, MoE token all-to-alls), on every
  // group.
  absl::Status CheckStreamOrdered();
  LinearContext Ctx();

  // `row_unit`: the model's cut (RowUnitOf of the recipe it was created with).
  static absl::Status CheckRecipe(const ModelShape& shape, const ModelRecipe& recipe, int64_t tp,
                                  int64_t dp, int64_t row_unit,
                                  const std::vector<std::string>& layers);
  GemmPrecision LayerPrecision(const std::string& name) const;
  // The attention entries of `ops` this model uses: FP32 for an FP32 model, the BF16-operand
  // ones (kernels/layer_ops.h) otherwise.
  decltype(kernels::LayerOps::attention_forward) AttentionForwardOp(
      const kernels::LayerOps& ops) const;
  decltype(kernels::LayerOps::attention_backward) AttentionBackwardOp(
      const kernels::LayerOps& ops) const;
  // The FP8 site configs of layer `name`: its own recipe's (ModelRecipe::layers), else the run's.
  const Fp8SiteConfigs& LayerSites(const std::string& name) const;
  void CollectSites();

  const ModelShape shape_;
  ModelRecipe recipe_;
  parallel::Mesh& mesh_;
  const kernels::OpTable& ops_;
  const int64_t tp_, dp_, tp_rank_, dp_rank_;
  int64_t row_unit_ = 0;  // RowUnitOf the creating recipe: the GEMM weights' cut, fixed

  std::vector<std::unique_ptr<Linear>> linears_;  // the dense GEMM layers (owned)
  std::vector<Linear*> all_linears_;  // every GEMM layer, MoE routers and experts included
  std::vector<MoeBlockStats> moe_stats_;
  std::vector<Param> params_;  // stable order; reserved up front (Linear points into it)
  std::vector<QuantSite*> sites_;
  std::vector<std::unique_ptr<Block>> blocks_;
  std::vector<Unit> units_;
  int64_t passes_ = 0;  // ForwardBackward calls that completed this step
  std::unique_ptr<Acts> acts_;
  Scratch scratch_;
  // The temporaries of the gradient reduce-scatters: [k] serves the k-th reduction in flight,
  // so one set serves every parameter where reductions complete when started (sized by the
  // largest), one per parameter of a unit where they overlap. A deque: handles point into it.
  std::deque<parallel::GradReduceBuffers> reduce_buffers_;
  // The gradient reductions in flight (ReduceUnitGrads of one unit, until FinishReductions):
  // the parameter, whose full gradient they read, and the handle.
  struct Reducing {
    int param = -1;
    parallel::PendingGradReduce reduce;
  };
  std::vector<Reducing> reducing_;
  // The transposes of QuantizeMx32Both: mx32 weight shards in BeginStep and mx32 weights
  // quantized after a BF16 gather. Kept across steps, so it grows (and waits for the backend to do
  // so) in the first step only.
  kernels::DeviceArray<std::byte> mx32_scratch_{kernels::CpuOps(), kernels::MemCategory::kScratch,
                                                kernels::Placement::kDeviceOnly};
  // BeginStep: the shard amax of each current-scaled FP8 weight, written by the amax op on the
  // device and copied for the host.
  kernels::HostMirror<float> weight_amaxes_;
  // CopyLogits' pinned staging, kept and grown across calls (generation copies a row per token;
  // a pinned allocation and its free, which waits for the device, per call would cost more).
  mutable kernels::DeviceArray<float> logits_host_{kernels::CpuOps(), kernels::MemCategory::kOther,
                                                   kernels::Placement::kHostRead};
  // Indices of the non-block parameters and layers.
  int embedding_ = -1, positions_ = -1, final_norm_ = -1, final_norm_bias_ = -1,
      lm_head_param_ = -1;
  Linear* lm_head_ = nullptr;
  // ArmActivationFault: the block whose input the next forward poisons (-1: none), and the value.
  int64_t fault_block_ = -1;
  float fault_value_ = 0.0f;
};

}  // namespace fp8rt::model

#endif  // FP8RT_RUNTIME_MODEL_TRANSFORMER_H_
