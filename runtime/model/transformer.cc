// The transformer: parameters, FSDP units, and the forward and backward of every layer (see
// transformer.h). Index: initialisation (Normal), Create/Build, the FSDP unit steps
// (QuantizeWeightShard, StartUnshard, FinishUnshard, Reshard, BeginUnitGrads, ReduceUnitGrads),
// BeginStep, ForwardBackward (forward top to bottom, then backward bottom to top), ReduceGrads,
// SyncScaling.
#include "runtime/model/transformer.h"

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <functional>
#include <map>
#include <numbers>
#include <tuple>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "runtime/core/check.h"
#include "runtime/core/status.h"

namespace fp8rt::model {
namespace {

uint64_t SplitMix64(uint64_t x) {
  x += 0x9e3779b97f4a7c15ULL;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ULL;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebULL;
  return x ^ (x >> 31);
}

uint64_t Fnv1a(const std::string& s) {
  uint64_t h = 0xcbf29ce484222325ULL;
  for (unsigned char c : s) h = (h ^ c) * 0x100000001b3ULL;
  return h;
}

// A standard normal sample that depends only on (key, index): Box-Muller on two hashed uniforms.
float Normal(uint64_t key, uint64_t index) {
  const uint64_t a = SplitMix64(key ^ SplitMix64(2 * index));
  const uint64_t b = SplitMix64(key ^ SplitMix64(2 * index + 1));
  const double u1 = (static_cast<double>(a >> 11) + 1.0) * 0x1.0p-53;  // (0, 1]
  const double u2 = static_cast<double>(b >> 11) * 0x1.0p-53;          // [0, 1)
  return static_cast<float>(std::sqrt(-2.0 * std::log(u1)) * std::cos(2.0 * std::numbers::pi * u2));
}

}  // namespace

// The parameters and layers of one block (indices into params_; -1: absent).
struct Transformer::Block {
  int attn_norm = -1, attn_norm_b = -1, qkv_w = -1, qkv_b = -1, proj_w = -1, proj_b = -1;
  int mlp_norm = -1, mlp_norm_b = -1, fc1_w = -1, fc1_b = -1, up_w = -1, fc2_w = -1, fc2_b = -1;
  // fc1: mlp.fc1 (GELU) or mlp.gate (SwiGLU); up: mlp.up (SwiGLU only); fc2: mlp.fc2 or mlp.down.
  Linear *qkv = nullptr, *proj = nullptr, *fc1 = nullptr, *up = nullptr, *fc2 = nullptr;
  std::unique_ptr<MoeLayer> moe;  // instead of fc1 / fc2 in MoE blocks
  int router_w = -1;
  int moe_stats = -1;  // index into moe_stats_
};

// Activations of one micro-batch (saved by the forward for the backward) and the backward's
// temporaries. n = micro_batch * seq_len tokens; cl, kvl, fl: this rank's query, key/value and
// d_ff columns.
struct Transformer::Acts {
  using Array = kernels::DeviceArray<float>;
  explicit Acts(const kernels::OpTable& ops) : ops(ops) {}
  const kernels::OpTable& ops;
  int64_t b = 0, n = 0;
  struct Layer {
    // Empty ln1/ln2/g: shared (Keep). att is the attention's output, which its backward reads
    // (D_i = dout_i . out_i), so it is always kept; lse [B, H/tp, T] is all the attention saves.
    // mean1/mean2 only with LayerNorm, u only with SwiGLU.
    Array x, ln1, mean1, rstd1, q, k, v, lse, att, x2, ln2, mean2, rstd2, h, u, g;
  };
  std::vector<Layer> layers;
  Array x_final, lnf, meanf, rstdf, logits, ce_probs, losses, pos;
  // Written by the host, read by the ops (kernels/host_mirror.h: uploaded by LoadTokens).
  kernels::HostMirror<int32_t> inputs, targets, positions;
  // Backward temporaries.
  Array dx, dx2, dln, dg, dh, du, datt, dq, dk, dv, dqr, dkr, dqkv, dlogits, dlnf;

  // Which FP32 GEMM inputs block l keeps for its backward (ln1, ln2, g): not those whose FP8
  // layer keeps only its FP8 codes (precision.save_fp8_activations); those are written into one
  // shared buffer per kind instead. att, the attention output, is always kept (the attention
  // backward reads it). The GEMM outputs qkv, proj and fc2 are never read by a backward and are
  // always shared.
  struct Keep {
    bool ln1 = true, ln2 = true, g = true;
    auto operator<=>(const Keep&) const = default;
  };
  // Everything but the losses (pinned host memory on CUDA: the host sums them every pass) and the
  // token arrays (written by the host and uploaded, kernels/host_mirror.h) is device-only memory
  // (kernels/device_array.h); Transformer::CopyLogits copies rows of the logits out.
  static constexpr kernels::Placement kDevice = kernels::Placement::kDeviceOnly;
  static constexpr kernels::MemCategory kScratch = kernels::MemCategory::kScratch;
  static constexpr kernels::MemCategory kSaved = kernels::MemCategory::kSavedActivations;
  Array t_ln1{ops, kScratch, kDevice}, t_ln2{ops, kScratch, kDevice}, t_g{ops, kScratch, kDevice},
      t_qkv{ops, kScratch, kDevice}, t_proj{ops, kScratch, kDevice}, t_fc2{ops, kScratch, kDevice};
  std::vector<Keep> kept;
  static float* In(Array& own, Array& shared) { return own.empty() ? shared.data() : own.data(); }

  void Resize(const ModelShape& s, int64_t tp, int64_t micro_batch, const std::vector<Keep>& keep) {
    if (micro_batch == b && keep == kept) return;
    b = micro_batch;
    kept = keep;
    n = micro_batch * s.seq_len;
    const bool layer_norm = s.norm == NormKind::kLayer, swiglu = s.mlp == MlpKind::kSwiglu;
    const size_t c = static_cast<size_t>(n * s.d_model);
    const size_t cl = c / static_cast<size_t>(tp);
    const size_t kvl = static_cast<size_t>(n * s.kv() * s.head_dim() / tp);
    const size_t fl = static_cast<size_t>(n * s.d_ff / tp);
    const size_t lse = static_cast<size_t>(micro_batch * (s.heads / tp) * s.seq_len);
    const size_t rows = static_cast<size_t>(n);
    layers.clear();
    layers.resize(static_cast<size_t>(s.layers));
    for (size_t i = 0; i < layers.size(); ++i) {
      Layer& l = layers[i];
      for (Array* v : {&l.x, &l.ln1, &l.mean1, &l.rstd1, &l.q, &l.k, &l.v, &l.lse, &l.att, &l.x2,
                       &l.ln2, &l.mean2, &l.rstd2, &l.h, &l.u, &l.g}) {
        *v = Array(ops, kSaved, kDevice);
      }
      for (auto* v : {&l.x, &l.x2}) v->assign(c, 0.0f);
      if (keep[i].ln1) l.ln1.assign(c, 0.0f);
      if (keep[i].ln2) l.ln2.assign(c, 0.0f);
      l.att.assign(cl, 0.0f);
      if (keep[i].g) l.g.assign(fl, 0.0f);
      l.q.assign(cl, 0.0f);
      for (auto* v : {&l.k, &l.v}) v->assign(kvl, 0.0f);
      l.h.assign(fl, 0.0f);
      if (swiglu) l.u.assign(fl, 0.0f);
      l.lse.assign(lse, 0.0f);
      for (auto* v : {&l.rstd1, &l.rstd2}) v->assign(rows, 0.0f);
      if (layer_norm) {
        for (auto* v : {&l.mean1, &l.mean2}) v->assign(rows, 0.0f);
      }
    }
    for (auto* v : {&t_ln1, &t_ln2, &t_proj, &t_fc2}) v->assign(c, 0.0f);
    t_g.assign(fl, 0.0f);
    t_qkv.assign(cl + 2 * kvl, 0.0f);
    const size_t logits_size = static_cast<size_t>(n * s.vocab);
    for (Array* v : {&x_final, &lnf, &meanf, &rstdf, &ce_probs, &pos}) {
      *v = Array(ops, kSaved, kDevice);
    }
    logits = Array(ops, kSaved, kDevice);
    losses = Array(ops, kSaved, kernels::Placement::kHostRead);  // summed by the host every pass
    for (Array* v : {&dx, &dx2, &dln, &dg, &dh, &du, &datt, &dq, &dk, &dv, &dqr, &dkr, &dqkv,
                     &dlogits, &dlnf}) {
      *v = Array(ops, kScratch, kDevice);
    }
    for (auto* v : {&x_final, &lnf, &dx, &dx2, &dln, &dlnf}) v->assign(c, 0.0f);
    if (s.positions == PositionKind::kLearned) pos.assign(c, 0.0f);
    rstdf.assign(rows, 0.0f);
    if (layer_norm) meanf.assign(rows, 0.0f);
    losses.assign(rows, 0.0f);
    for (auto* v : {&logits, &ce_probs, &dlogits}) v->assign(logits_size, 0.0f);
    for (auto* v : {&dg, &dh}) v->assign(fl, 0.0f);
    if (swiglu) du.assign(fl, 0.0f);
    for (auto* v : {&datt, &dq}) v->assign(cl, 0.0f);
    for (auto* v : {&dk, &dv}) v->assign(kvl, 0.0f);
    if (s.positions == PositionKind::kRope) {
      dqr.assign(cl, 0.0f);
      dkr.assign(kvl, 0.0f);
    }
    dqkv.assign(cl + 2 * kvl, 0.0f);
    // The token arrays: the host writes them (LoadTokens uploads them every pass).
    for (auto* v : {&inputs, &targets, &positions}) v->Reset(ops, rows);
    for (size_t r = 0; r < rows; ++r) {
      positions[r] = static_cast<int32_t>(static_cast<int64_t>(r) % s.seq_len);
    }
  }
};

Transformer::Transformer(const ModelShape& shape, const ModelRecipe& recipe, parallel::Mesh& mesh,
                         const kernels::OpTable& ops)
    : shape_(shape),
      recipe_(recipe),
      mesh_(mesh),
      ops_(ops),
      tp_(mesh.layout().config.tp),
      dp_(mesh.layout().config.dp),
      tp_rank_(mesh.layout().tp_rank),
      dp_rank_(mesh.layout().dp_rank),
      row_unit_(RowUnitOf(recipe)),
      acts_(std::make_unique<Acts>(ops)),
      scratch_(ops) {}

Transformer::~Transformer() = default;


std::vector<std::string> Transformer::LayerNames() const {
  std::vector<std::string> names;
  const bool swiglu = shape_.mlp == MlpKind::kSwiglu;
  for (int64_t l = 0; l < shape_.layers; ++l) {
    const bool moe = shape_.HasMoe(l);
    for (const char* s : {"attn.qkv", "attn.proj"})
      names.push_back(absl::StrCat("blocks.", l, ".", s));
    if (!moe) {
      if (swiglu) {
        for (const char* s : {"mlp.gate", "mlp.up", "mlp.down"})
          names.push_back(absl::StrCat("blocks.", l, ".", s));
      } else {
        for (const char* s : {"mlp.fc1", "mlp.fc2"})
          names.push_back(absl::StrCat("blocks.", l, ".", s));
      }
      continue;
    }
    for (int64_t e = 0; e < shape_.moe.experts; ++e) {
      for (const char* s : swiglu ? std::vector<const char*>{"gate", "up", "down"}
                                  : std::vector<const char*>{"fc1", "fc2"}) {
        names.push_back(absl::StrCat("blocks.", l, ".mlp.experts.", e, ".", s));
      }
    }
  }
  names.push_back("lm_head");
  return names;
}

namespace {

// The rows a layer's FP8 weight blocks span (128 block, 32 mx32, 1 tensor scaling; 0: not FP8).
int64_t RowsPerBlock(GemmPrecision precision, const Fp8SiteConfigs& sites) {
  if (precision != GemmPrecision::kFp8) return 0;
  switch (sites.weight.strategy) {
    case train::ScalingStrategy::kBlock:
      return 128;
    case train::ScalingStrategy::kMx32:
      return 32;
    default:
      return 1;
  }
}

}  // namespace

int64_t Transformer::RowUnitOf(const ModelRecipe& recipe) {
  if (recipe.precision != GemmPrecision::kFp8) return 0;
  int64_t unit = std::max<int64_t>(1, recipe.fsdp_row_unit);
  unit = std::max(unit, RowsPerBlock(recipe.precision, recipe.sites));
  for (const auto& [layer, lr] : recipe.layers) {
    unit = std::max(unit, RowsPerBlock(lr.precision, lr.sites));
  }
  return unit;
}

absl::Status Transformer::CheckRecipe(const ModelShape& shape, const ModelRecipe& recipe,
                                      int64_t tp, int64_t dp, int64_t row_unit,
                                      const std::vector<std::string>& layers) {
  auto bad = [](const std::string& field, const std::string& why) {
    return absl::InvalidArgumentError(absl::StrCat(field, ": ", why));
  };
  if (recipe.precision == GemmPrecision::kFp8) {
    // FP8 weights are gathered as whole rows of FP8 codes, and a block's scale must come from
    // one rank's rows: each FSDP shard (the model's cut, ShardCut::row_unit) must be whole
    // 128-row blocks with block scaling, whole 32-row blocks with mx32, whole rows otherwise.
    // A model cut for the recipe it was created with always is; a later recipe needing larger
    // blocks may not be.
    int64_t need = RowsPerBlock(recipe.precision, recipe.sites);
    for (const auto& [layer, lr] : recipe.layers) {
      need = std::max(need, RowsPerBlock(lr.precision, lr.sites));
    }
    const struct {
      const char* field;
      int64_t rows;
    } weights[] = {{"model.d_model", (shape.heads + 2 * shape.kv()) * shape.head_dim() / tp},
                   {"model.d_model", shape.d_model},
                   {"model.d_ff", shape.d_ff / tp}};
    for (const auto& w : weights) {
      const ShardCut cut{.shape = {w.rows, 1, TpSplit::kNone}, .fsdp = dp, .row_unit = row_unit};
      const int64_t rows = dp == 1 ? w.rows : cut.shard_rows();
      if (need > 0 && (rows < 0 || rows % need != 0)) {
        return bad(w.field,
                   absl::StrCat("FP8 weights with ", w.rows,
                                " rows per tensor-parallel rank are cut into parallel.dp=", dp,
                                " FSDP shards of ", rows < 0 ? "elements, not whole rows" :
                                absl::StrCat(rows, " rows"), ", which ",
                                need == 128  ? "128-row blocks (precision.scaling block)"
                                : need == 32 ? "32-row blocks (precision.scaling mx32)"
                                             : "whole rows",
                                " would straddle: the run's shards were cut for its starting "
                                "recipe (start it with this scaling, or with health.action "
                                "block_scaling, to cut them in 128-row blocks)"));
      }
    }
  }
  for (const std::string& name : recipe.exclude) {
    if (std::find(layers.begin(), layers.end(), name) == layers.end()) {
      return bad(
          "precision.exclude",
          absl::StrCat("no layer named '", name, "' (layers: ", absl::StrJoin(layers, ", "), ")"));
    }
  }
  return absl::OkStatus();
}

absl::StatusOr<std::unique_ptr<Transformer>> Transformer::Create(const ModelShape& shape,
                                                                 const ModelRecipe& recipe,
                                                                 uint64_t seed,
                                                                 parallel::Mesh& mesh,
                                                                 const kernels::OpTable& ops) {
  const int64_t tp = mesh.layout().config.tp, dp = mesh.layout().config.dp;
  auto bad = [](const std::string& field, const std::string& why) {
    return absl::InvalidArgumentError(absl::StrCat(field, ": ", why));
  };
  if (shape.layers < 1 || shape.d_model < 1 || shape.heads < 1 || shape.d_ff < 1 ||
      shape.seq_len < 1 || shape.vocab < 1 || shape.kv_heads < 0) {
    return bad("model", "every size must be positive");
  }
  if (shape.d_model % shape.heads != 0) {
    return bad("model.d_model",
               absl::StrCat(shape.d_model, " is not a multiple of model.heads ", shape.heads));
  }
  if (shape.heads % shape.kv() != 0) {
    return bad("model.kv_heads", absl::StrCat(shape.kv(), " key/value heads do not divide "
                                              "model.heads ",
                                              shape.heads));
  }
  if (shape.heads % tp != 0) {
    return bad("model.heads",
               absl::StrCat(shape.heads, " heads cannot be split over parallel.tp ", tp));
  }
  if (shape.kv() % tp != 0) {
    return bad("model.kv_heads",
               absl::StrCat(shape.kv(), " key/value heads cannot be split over parallel.tp ", tp));
  }
  if (shape.d_ff % tp != 0) {
    return bad("model.d_ff", absl::StrCat(shape.d_ff, " cannot be split over parallel.tp ", tp));
  }
  if (shape.positions == PositionKind::kRope && shape.head_dim() % 2 != 0) {
    return bad("model.positions",
               absl::StrCat("rope needs an even head size, got ", shape.head_dim()));
  }
  if (shape.positions == PositionKind::kLearned && shape.max_positions < shape.seq_len) {
    return bad("model.max_positions", absl::StrCat(shape.max_positions, " positions cannot hold "
                                                   "model.seq_len ",
                                                   shape.seq_len));
  }
  std::unique_ptr<Transformer> model(new Transformer(shape, recipe, mesh, ops));
  FP8RT_RETURN_IF_ERROR(CheckRecipe(shape, recipe, tp, dp, RowUnitOf(recipe), model->LayerNames()));
  FP8RT_RETURN_IF_ERROR(model->Build(seed));
  return model;
}

Param& Transformer::AddParam(const std::string& name, int64_t rows, int64_t cols, TpSplit split,
                             bool decay, float std_dev, uint64_t seed, Linear* linear,
                             bool expert) {
  Param& p = params_.emplace_back();
  p.group = expert ? &mesh_.edp() : &mesh_.dp();
  p.name = name;
  p.rows = rows;
  p.cols = cols;
  p.split = split;
  p.local_rows = split == TpSplit::kRows ? rows / tp_ : rows;
  p.local_cols = split == TpSplit::kCols ? cols / tp_ : cols;
  // GEMM weights that may run in FP8 (lm_head and the MoE router never do) are cut in rows.
  p.row_unit = linear != nullptr && linear->precision() != GemmPrecision::kFp32 ? row_unit_ : 0;
  p.shard_count = CutOf(p).count();
  p.decay = decay;
  p.linear = linear;
  const size_t shard = static_cast<size_t>(p.shard_count);
  using kernels::MemCategory;
  p.master = kernels::DeviceArray<float>(ops_, MemCategory::kParamShards);
  p.grad = kernels::DeviceArray<float>(ops_, MemCategory::kGradients);
  p.m = kernels::DeviceArray<float>(ops_, MemCategory::kOptimizerState);
  p.v = kernels::DeviceArray<float>(ops_, MemCategory::kOptimizerState);
  // What the ops and the collectives alone touch (the whole weights, the FP8 shards and gathered
  // codes, the whole gradients) is device-only memory; the FP32 shards, which the host reads and
  // writes at checkpoints, stay host-visible.
  constexpr kernels::Placement kDevice = kernels::Placement::kDeviceOnly;
  p.full = kernels::DeviceArray<float>(ops_, MemCategory::kGatheredWeights, kDevice);
  p.full_grad = kernels::DeviceArray<float>(ops_, MemCategory::kGradients, kDevice);
  p.fp8_shard.codes = kernels::DeviceArray<uint8_t>(ops_, MemCategory::kParamShards, kDevice);
  p.fp8_shard.scale_inv = kernels::DeviceArray<float>(ops_, MemCategory::kParamShards, kDevice);
  p.fp8.codes = kernels::DeviceArray<uint8_t>(ops_, MemCategory::kGatheredWeights, kDevice);
  p.fp8.scale_inv = kernels::DeviceArray<float>(ops_, MemCategory::kGatheredWeights, kDevice);
  for (kernels::DeviceArray<uint8_t>* a : {&p.fp8_shard.e8m0, &p.fp8_shard.col_codes,
                                           &p.fp8_shard.col_e8m0}) {
    *a = kernels::DeviceArray<uint8_t>(ops_, MemCategory::kParamShards, kDevice);
  }
  for (kernels::DeviceArray<uint8_t>* a : {&p.fp8.e8m0, &p.fp8.col_codes, &p.fp8.col_e8m0}) {
    *a = kernels::DeviceArray<uint8_t>(ops_, MemCategory::kGatheredWeights, kDevice);
  }
  p.gather_bf16 = kernels::DeviceArray<uint16_t>(ops_, MemCategory::kCommBuffers, kDevice);
  p.master.assign(shard, 0.0f);
  p.grad.assign(shard, 0.0f);
  p.m.assign(shard, 0.0f);
  p.v.assign(shard, 0.0f);
  const uint64_t key = SplitMix64(seed) ^ Fnv1a(name);
  ForEachShardElement(p, [&](size_t i, int64_t logical) {
    p.master[i] = std_dev == kOnes    ? 1.0f
                  : std_dev == kZeros ? 0.0f
                                      : std_dev * Normal(key, static_cast<uint64_t>(logical));
  });
  return p;
}

void ShardCut::ForEach(const std::function<void(size_t, int64_t)>& fn) const {
  const int64_t cols = local_cols(), r0 = row0(), c0 = col0(), begin = flat_begin();
  for (int64_t i = 0, n = flat_count(); i < n; ++i) {
    const int64_t li = begin + i;
    fn(static_cast<size_t>(i), (r0 + li / cols) * shape.cols + c0 + li % cols);
  }
}

ShardCut Transformer::CutOf(const Param& p) const {
  return ShardCut{.shape = {p.rows, p.cols, p.split},
                  .tp = tp_,
                  .tp_rank = tp_rank_,
                  .fsdp = p.group->size(),
                  .fsdp_rank = p.group->rank(),
                  .row_unit = p.row_unit};
}

void Transformer::ForEachShardElement(const Param& p,
                                      const std::function<void(size_t, int64_t)>& fn) const {
  CutOf(p).ForEach(fn);
}

std::map<std::string, LogicalShape> Transformer::ParamShapes() const {
  std::map<std::string, LogicalShape> shapes;
  for (const Param& p : params_) shapes[p.name] = {p.rows, p.cols, p.split};
  return shapes;
}

absl::Status Transformer::SetLogicalParams(const LogicalParams& params) {
  return SetLogicalShards(params, ShardArray::kMaster);
}

namespace {

// InvalidArgument naming `p` unless `count` is its logical size.
absl::Status CheckLogicalSize(const Param& p, size_t count) {
  if (static_cast<int64_t>(count) == p.rows * p.cols) return absl::OkStatus();
  return absl::InvalidArgumentError(
      absl::StrCat("parameter ", p.name, ": ", count, " values, expected ", p.rows, " x ", p.cols));
}

}  // namespace

absl::Status Transformer::SetLogicalShards(const LogicalParams& params, ShardArray which) {
  for (const Param& p : params_) {
    const auto it = params.find(p.name);
    if (it == params.end()) {
      return absl::InvalidArgumentError(absl::StrCat("no values for parameter ", p.name));
    }
    FP8RT_RETURN_IF_ERROR(CheckLogicalSize(p, it->second.size()));
  }
  for (Param& p : params_) SetShard(p, params.at(p.name), which);
  return absl::OkStatus();
}

absl::Status Transformer::SetLogicalParam(const std::string& name, std::span<const float> values) {
  for (Param& p : params_) {
    if (p.name != name) continue;
    FP8RT_RETURN_IF_ERROR(CheckLogicalSize(p, values.size()));
    SetShard(p, values, ShardArray::kMaster);
    return absl::OkStatus();
  }
  return absl::InvalidArgumentError(absl::StrCat("the model has no parameter ", name));
}

void Transformer::SetShard(Param& p, std::span<const float> v, ShardArray which) {
  kernels::DeviceArray<float>& dst = which == ShardArray::kMaster  ? p.master
                                     : which == ShardArray::kAdamM ? p.m
                                                                   : p.v;
  ForEachShardElement(p,
                      [&](size_t i, int64_t logical) { dst[i] = v[static_cast<size_t>(logical)]; });
  if (which == ShardArray::kMaster) p.fp8_shard_fresh = false;
}

absl::Status Transformer::Build(uint64_t seed) {
  const int64_t c = shape_.d_model, f = shape_.d_ff, v = shape_.vocab, L = shape_.layers;
  const int64_t qkv_rows = (shape_.heads + 2 * shape_.kv()) * shape_.head_dim();
  const bool layer_norm = shape_.norm == NormKind::kLayer, swiglu = shape_.mlp == MlpKind::kSwiglu;
  const bool bias = shape_.bias;
  params_.reserve(static_cast<size_t>(L * (14 + 2 * shape_.moe.experts) + 5));
  const float std_dev = 0.02f;
  const float resid_std = std_dev / std::sqrt(2.0f * static_cast<float>(L));
  auto make_linear = [&](const std::string& name, int64_t in, int64_t out) {
    linears_.push_back(
        std::make_unique<Linear>(name, in, out, LayerPrecision(name), LayerSites(name)));
    linears_.back()->set_save_fp8_input(recipe_.save_fp8_activations);
    linears_.back()->set_fast_accum_forward(recipe_.fp8_fast_accum_forward);
    all_linears_.push_back(linears_.back().get());
    return linears_.back().get();
  };
  auto add = [&](const std::string& name, int64_t rows, int64_t cols, TpSplit split, bool decay,
                 float init, Linear* linear = nullptr) {
    const int index = static_cast<int>(params_.size());
    AddParam(name, rows, cols, split, decay, init, seed, linear);
    return index;
  };
  // A norm's gain (and LayerNorm's bias); a GEMM's weight and (shape.bias) bias: a
  // column-parallel layer's bias is split like its output rows, a row-parallel layer's is
  // replicated (added after the TP sum).
  auto add_norm = [&](const std::string& name, int* w, int* b) {
    *w = add(name + "/weight", 1, c, TpSplit::kNone, false, kOnes);
    if (layer_norm) *b = add(name + "/bias", 1, c, TpSplit::kNone, false, kZeros);
  };
  auto add_gemm = [&](Linear* lin, int64_t out, int64_t in, TpSplit split, float init, int* w,
                      int* b) {
    *w = add(lin->name() + "/weight", out, in, split, true, init, lin);
    if (!bias) return;
    *b = split == TpSplit::kRows ? add(lin->name() + "/bias", out, 1, TpSplit::kRows, false, kZeros)
                                 : add(lin->name() + "/bias", 1, out, TpSplit::kNone, false, kZeros);
  };
  embedding_ = add("embedding/weight", v, c, TpSplit::kNone, true, std_dev);
  if (shape_.positions == PositionKind::kLearned) {
    positions_ = add("positions/weight", shape_.max_positions, c, TpSplit::kNone, true, std_dev);
  }
  for (int64_t l = 0; l < L; ++l) {
    const std::string p = absl::StrCat("blocks.", l, ".");
    auto block = std::make_unique<Block>();
    Block& k = *block;
    k.qkv = make_linear(p + "attn.qkv", c, qkv_rows / tp_);
    k.proj = make_linear(p + "attn.proj", c / tp_, c);
    const bool moe = shape_.HasMoe(l);
    if (!moe) {
      k.fc1 = make_linear(p + (swiglu ? "mlp.gate" : "mlp.fc1"), c, f / tp_);
      if (swiglu) k.up = make_linear(p + "mlp.up", c, f / tp_);
      k.fc2 = make_linear(p + (swiglu ? "mlp.down" : "mlp.fc2"), f / tp_, c);
    }
    add_norm(p + "attn_norm", &k.attn_norm, &k.attn_norm_b);
    add_gemm(k.qkv, qkv_rows, c, TpSplit::kRows, std_dev, &k.qkv_w, &k.qkv_b);
    add_gemm(k.proj, c, c, TpSplit::kCols, resid_std, &k.proj_w, &k.proj_b);
    add_norm(p + "mlp_norm", &k.mlp_norm, &k.mlp_norm_b);
    if (!moe) {
      add_gemm(k.fc1, f, c, TpSplit::kRows, std_dev, &k.fc1_w, &k.fc1_b);
      if (swiglu) {
        k.up_w = add(k.up->name() + "/weight", f, c, TpSplit::kRows, true, std_dev, k.up);
      }
      add_gemm(k.fc2, c, f, TpSplit::kCols, resid_std, &k.fc2_w, &k.fc2_b);
    } else {
      // Router (FP32, replicated like a dense weight) and this rank's experts (FSDP over the
      // expert-data-parallel group). Every rank has every expert's layers (and sites).
      k.moe = std::make_unique<MoeLayer>(p + "mlp", shape_.moe, c, f, swiglu, recipe_.precision,
                                         recipe_.sites, &mesh_.ep());
      MoeLayer& m = *k.moe;
      all_linears_.push_back(&m.router());
      k.router_w = add(p + "mlp.router/weight", shape_.moe.experts, c, TpSplit::kNone, true,
                       std_dev, &m.router());
      for (int64_t e = 0; e < shape_.moe.experts; ++e) {
        for (Linear* lin : m.expert_linears(e)) {
          lin->Reconfigure(LayerPrecision(lin->name()), LayerSites(lin->name()));
          // The experts' inputs stay in FP32 whatever precision.save_fp8_activations says: the
          // MoE layer keeps every local expert's gathered rows itself, so codes alone would
          // save no memory.
          lin->set_fast_accum_forward(recipe_.fp8_fast_accum_forward);
          all_linears_.push_back(lin);
        }
        if (!m.IsLocal(e)) continue;
        // fc1 (gate) and up [F, C], fc2 (down) [C, F]; the gradient buffers are handed over
        // with each backward's gather (GatherUnit).
        for (Linear* lin : m.expert_linears(e)) {
          const bool out_proj = lin == &m.fc2(e);
          AddParam(lin->name() + "/weight", out_proj ? c : f, out_proj ? f : c, TpSplit::kNone,
                   true, out_proj ? resid_std : std_dev, seed, lin, /*expert=*/true);
        }
      }
      k.moe_stats = static_cast<int>(moe_stats_.size());
      moe_stats_.push_back(
          {p + "mlp", std::vector<int64_t>(static_cast<size_t>(shape_.moe.experts), 0), 0});
    }
    blocks_.push_back(std::move(block));
  }
  const int head_first = static_cast<int>(params_.size());
  add_norm("final_norm", &final_norm_, &final_norm_bias_);
  linears_.push_back(std::make_unique<Linear>(
      "lm_head", c, v,
      recipe_.precision == GemmPrecision::kFp32 ? GemmPrecision::kFp32 : GemmPrecision::kBf16,
      recipe_.sites));
  lm_head_ = linears_.back().get();
  all_linears_.push_back(lm_head_);
  if (shape_.tie_embeddings) {
    // The token embedding is the LM head's weight: gathered again for the head, its gradient
    // the sum of the head's and the embedding's (two reductions into one shard, see
    // ReduceUnitGrads).
    lm_head_param_ = embedding_;
    params_[static_cast<size_t>(embedding_)].linear = lm_head_;
  } else {
    lm_head_param_ = add("lm_head/weight", v, c, TpSplit::kNone, true, std_dev, lm_head_);
  }
  // FSDP units: the embedding (and positions), each block (its parameters were added in a
  // row), the head.
  auto add_unit = [&](std::string name, std::vector<int> params) {
    Unit& u = units_.emplace_back();
    u.name = std::move(name);
    u.params = std::move(params);
  };
  std::vector<int> first_unit = {embedding_};
  if (positions_ >= 0) first_unit.push_back(positions_);
  add_unit("embedding", first_unit);
  for (size_t l = 0; l < blocks_.size(); ++l) {
    const int first = blocks_[l]->attn_norm;
    const int end = l + 1 < blocks_.size() ? blocks_[l + 1]->attn_norm : head_first;
    std::vector<int> params;
    for (int i = first; i < end; ++i) params.push_back(i);
    add_unit(absl::StrCat("blocks.", l), std::move(params));
  }
  std::vector<int> head_params;
  for (int i = head_first; i < static_cast<int>(params_.size()); ++i) head_params.push_back(i);
  if (shape_.tie_embeddings) head_params.push_back(embedding_);
  add_unit("head", std::move(head_params));
  CollectSites();
  return absl::OkStatus();
}

// An FP32 model keeps FP32 attention; a BF16 or FP8 one takes BF16 operands in attention's matrix
// products (the tensor-core kernels on CUDA), as Transformer Engine and torch's SDPA do.
decltype(kernels::LayerOps::attention_forward) Transformer::AttentionForwardOp(
    const kernels::LayerOps& ops) const {
  return recipe_.precision == GemmPrecision::kFp32 ? ops.attention_forward
                                                   : ops.attention_forward_bf16;
}
decltype(kernels::LayerOps::attention_backward) Transformer::AttentionBackwardOp(
    const kernels::LayerOps& ops) const {
  return recipe_.precision == GemmPrecision::kFp32 ? ops.attention_backward
                                                   : ops.attention_backward_bf16;
}

GemmPrecision Transformer::LayerPrecision(const std::string& name) const {
  if (recipe_.precision == GemmPrecision::kFp8 &&
      std::find(recipe_.exclude.begin(), recipe_.exclude.end(), name) != recipe_.exclude.end()) {
    return GemmPrecision::kBf16;
  }
  if (recipe_.precision == GemmPrecision::kFp8) {
    const auto it = recipe_.layers.find(name);
    if (it != recipe_.layers.end()) return it->second.precision;
  }
  return recipe_.precision;
}

const Fp8SiteConfigs& Transformer::LayerSites(const std::string& name) const {
  const auto it = recipe_.layers.find(name);
  return it != recipe_.layers.end() ? it->second.sites : recipe_.sites;
}

void Transformer::CollectSites() {
  sites_.clear();
  for (Linear* lin : all_linears_) {
    if (lin->precision() != GemmPrecision::kFp8) continue;
    sites_.push_back(&lin->input_site());
    sites_.push_back(&lin->weight_site());
    sites_.push_back(&lin->grad_site());
  }
}

absl::Status Transformer::ApplyRecipe(const ModelRecipe& recipe) {
  if (recipe.precision != recipe_.precision) {
    return absl::InvalidArgumentError("precision.mode cannot change while a run trains");
  }
  FP8RT_RETURN_IF_ERROR(CheckRecipe(shape_, recipe, tp_, dp_, row_unit_, LayerNames()));
  recipe_ = recipe;
  for (Param& p : params_) p.fp8_shard_fresh = false;  // made with the old recipe's format
  for (Linear* lin : all_linears_) {
    if (lin == lm_head_ || lin->precision() == GemmPrecision::kFp32) continue;  // never FP8
    if (lin->name().ends_with(".router")) continue;                             // FP32 always
    lin->Reconfigure(LayerPrecision(lin->name()), LayerSites(lin->name()));
  }
  for (const std::unique_ptr<Linear>& lin : linears_) {
    if (lin.get() == lm_head_) continue;
    lin->set_save_fp8_input(recipe_.save_fp8_activations);
  }
  for (Linear* lin : all_linears_) {  // the MoE experts' too
    if (lin != lm_head_) lin->set_fast_accum_forward(recipe_.fp8_fast_accum_forward);
  }
  CollectSites();
  return absl::OkStatus();
}

LinearContext Transformer::Ctx() {
  return LinearContext{.ops = &ops_, .tp = tp_ > 1 ? &mesh_.tp() : nullptr, .scratch = &scratch_};
}

absl::Status Transformer::CheckStreamOrdered() {
  for (parallel::Communicator* g : {&mesh_.tp(), &mesh_.dp(), &mesh_.ep(), &mesh_.edp()}) {
    FP8RT_RETURN_IF_ERROR(g->CheckStreamOrdered());
  }
  return absl::OkStatus();
}

absl::Status Transformer::AllReduceTp(float* buf, int64_t count) {
  if (tp_ == 1) return absl::OkStatus();
  // Stream-ordered: only the ops that follow read the sum (NCCL: no host wait at the call).
  return mesh_.tp().AllReduce(buf, count, parallel::DType::kF32, parallel::ReduceOp::kSum,
                              parallel::Completion::kStream);
}

absl::Status Transformer::QuantizeWeightShard(Param& p, float weight_scale,
                                              kernels::DeviceArray<std::byte>* scratch) {
  const train::ScalingConfig& cfg = p.linear->weight_site().state().config();
  const bool block = cfg.strategy == train::ScalingStrategy::kBlock;
  const int64_t shard_rows = p.shard_count / p.local_cols;  // whole rows (ShardCut::row_unit)
  if (cfg.strategy == train::ScalingStrategy::kMx32) {
    return parallel::QuantizeMx32Shard(ops_, p.master.data(), shard_rows, p.local_cols,
                                       cfg.format, &p.fp8_shard, /*wait=*/false, scratch);
  }
  return parallel::QuantizeFp8Shard(ops_, p.master.data(), shard_rows, p.local_cols, cfg.format,
                                    block, weight_scale, cfg.margin, &p.fp8_shard,
                                    /*wait=*/false);
}

// The weight site's statistics of the step: this rank's shard, once per step (the amax is
// MAX-reduced over the ranks in SyncScaling). A block- or mx32-scaled site records the scale its
// amax gives.
void Transformer::RecordWeightShard(Param& p, float weight_scale) {
  const train::ScalingConfig& cfg = p.linear->weight_site().state().config();
  p.linear->weight_site().Record(
      p.fp8_shard.stats, p.fp8_shard.block || p.fp8_shard.mx32 ? kernels::ComputeScale(p.fp8_shard.stats.amax,
                                                                    cfg.format, cfg.margin,
                                                                    cfg.power_of_two)
                                            : weight_scale);
}

absl::Status Transformer::StartUnshard(size_t unit) {
  Unit& u = units_[unit];
  if (u.gathered || u.started) return absl::OkStatus();
  u.started = true;
  for (const int i : u.params) {
    Param& p = params_[static_cast<size_t>(i)];
    const bool fp8 = p.linear != nullptr && p.linear->precision() == GemmPrecision::kFp8;
    if (fp8 && recipe_.fsdp_gather == FsdpGatherDType::kFp8) {
      // FP8 bytes of the shard quantized in BeginStep: nothing to compute on the gather path.
      FP8RT_RETURN_IF_ERROR(
          parallel::StartGatherFp8Shard(*p.group, ops_, p.fp8_shard, &p.fp8, &u.pending));
      continue;
    }
    if (!fp8) {
      p.full.Reset(ops_, static_cast<size_t>(p.shard_count * p.group->size()));
      FP8RT_ASSIGN_OR_RETURN(std::unique_ptr<parallel::PendingCollective> g,
                             p.group->StartAllGather(p.master.data(), p.shard_count,
                                                     p.full.data(), parallel::DType::kF32));
      u.pending.push_back(std::move(g));
      continue;
    }
    // fsdp_gather bf16 (the baseline FP8 gathers are measured against): BF16 on the wire,
    // started like the FP8 gathers; FinishUnshard quantizes the gathered piece
    // (QuantizeGatheredBf16).
    p.gather_bf16.Reset(ops_, static_cast<size_t>(p.shard_count * p.group->size()));
    FP8RT_ASSIGN_OR_RETURN(std::unique_ptr<parallel::PendingCollective> g,
                           parallel::StartGatherBf16(*p.group, ops_, p.master.data(), p.shard_count,
                                                     p.gather_bf16.data()));
    u.pending.push_back(std::move(g));
  }
  return absl::OkStatus();
}

// fsdp_gather bf16, once the gather has landed: every rank quantizes the whole piece with the same
// scale(s) (the shard's tensor scale, or the scales of the piece's own blocks), so that all ranks
// hold the same FP8 weight. Tensor and block scaling quantize the BF16 values as they are; mx32
// (whose op takes FP32) converts them first. No host wait: the temporaries are device-only
// memory, freed in stream order after the quantization.
absl::Status Transformer::QuantizeGatheredBf16(Param& p) {
  const size_t piece = static_cast<size_t>(p.shard_count * p.group->size());
  if (p.gather_bf16.size() != piece) {  // its StartUnshard failed before starting its gather
    return absl::FailedPreconditionError(absl::StrCat(p.name, ": no BF16 gather of ", piece,
                                                      " values to quantize (", p.gather_bf16.size(),
                                                      " there)"));
  }
  const train::ScalingConfig& cfg = p.linear->weight_site().state().config();
  const bool block = cfg.strategy == train::ScalingStrategy::kBlock;
  p.fp8.rows = p.local_rows;
  p.fp8.cols = p.local_cols;
  if (cfg.strategy == train::ScalingStrategy::kMx32) {
    p.full.Reset(ops_, piece);
    kernels::ConvertArgs conv{.from = kernels::InputType::kBF16,
                              .to = kernels::InputType::kF32,
                              .input = p.gather_bf16.data(),
                              .output = p.full.data(),
                              .count = static_cast<int64_t>(piece)};
    FP8RT_RETURN_IF_ERROR(ops_.convert(conv, {}));
    const size_t grid = static_cast<size_t>(
        kernels::GetScaleGrid(kernels::Granularity::kMx32, p.local_rows, p.local_cols).size());
    const size_t col_grid = static_cast<size_t>(
        kernels::GetScaleGrid(kernels::Granularity::kMx32, p.local_cols, p.local_rows).size());
    parallel::ResizeFp8Weight(ops_, static_cast<size_t>(p.local_count()), 0, &p.fp8);
    p.fp8.e8m0.Reset(ops_, grid);
    p.fp8.col_codes.Reset(ops_, static_cast<size_t>(p.local_count()));
    p.fp8.col_e8m0.Reset(ops_, col_grid);
    FP8RT_RETURN_IF_ERROR(parallel::QuantizeMx32Both(
        ops_, p.full.data(), p.local_rows, p.local_cols, cfg.format, p.fp8.codes.data(),
        p.fp8.e8m0.data(), p.fp8.col_codes.data(), p.fp8.col_e8m0.data(), nullptr, &mx32_scratch_));
    p.full.clear();  // only the FP8 weight is used from here
  } else {
    kernels::QuantizeArgs q;
    q.format = cfg.format;
    q.granularity = block ? kernels::Granularity::kBlock128x128 : kernels::Granularity::kTensor;
    q.input_type = kernels::InputType::kBF16;
    q.input = p.gather_bf16.data();
    q.rows = p.local_rows;
    q.cols = p.local_cols;
    q.has_scale = !block;
    q.scale = p.fp8_shard.scale;
    q.margin = cfg.margin;
    parallel::ResizeFp8Weight(
        ops_, static_cast<size_t>(p.local_count()),
        static_cast<size_t>(kernels::GetScaleGrid(q.granularity, q.rows, q.cols).size()), &p.fp8);
    q.codes = p.fp8.codes.data();
    q.scale_inv = p.fp8.scale_inv.data();
    p.fp8.stats_out.Reset(ops_, 1);
    q.stats = p.fp8.stats_out.device();
    FP8RT_RETURN_IF_ERROR(ops_.quantize(q, {}));
  }
  p.gather_bf16.clear();
  return absl::OkStatus();
}

absl::Status Transformer::FinishUnshard(size_t unit) {
  Unit& u = units_[unit];
  if (u.gathered) return absl::OkStatus();
  FP8RT_RETURN_IF_ERROR(StartUnshard(unit));
  absl::Status status;
  for (std::unique_ptr<parallel::PendingCollective>& g : u.pending) {
    // Only the device's ops read the gathered weights: with NCCL the host does not wait here (the
    // pass checks the groups after its last synchronisation).
    if (absl::Status s = g->WaitStreamOrdered(); status.ok()) status = s;
  }
  u.pending.clear();
  u.started = false;
  FP8RT_RETURN_IF_ERROR(status);
  for (const int i : u.params) {
    Param& p = params_[static_cast<size_t>(i)];
    if (p.linear == nullptr) continue;
    if (p.linear->precision() == GemmPrecision::kFp8) {
      if (recipe_.fsdp_gather == FsdpGatherDType::kBf16) {
        FP8RT_RETURN_IF_ERROR(QuantizeGatheredBf16(p));
      }
      p.linear->SetWeight(&p.fp8);
    } else {
      p.linear->SetWeight(p.full.data());
    }
  }
  u.gathered = true;
  return absl::OkStatus();
}

void Transformer::Reshard(size_t unit) {
  Unit& u = units_[unit];
  for (std::unique_ptr<parallel::PendingCollective>& g : u.pending) (void)g->Wait();
  u.pending.clear();
  u.started = false;
  u.gathered = false;
  for (const int i : u.params) {
    Param& p = params_[static_cast<size_t>(i)];
    p.full.clear();
    p.fp8.codes.clear();
    p.fp8.scale_inv.clear();
    p.fp8.e8m0.clear();
    p.fp8.col_codes.clear();
    p.fp8.col_e8m0.clear();
    p.gather_bf16.clear();
  }
}

absl::Status Transformer::BeginUnitGrads(size_t unit, std::initializer_list<int> overwritten) {
  // A tied embedding's full gradient, reused by the embedding's unit: its reduction by the head
  // must have finished reading it.
  for (const Reducing& r : reducing_) {
    const std::vector<int>& mine = units_[unit].params;
    if (std::find(mine.begin(), mine.end(), r.param) != mine.end()) {
      FP8RT_RETURN_IF_ERROR(FinishReductions());
      break;
    }
  }
  for (const int i : units_[unit].params) {
    Param& p = params_[static_cast<size_t>(i)];
    p.full_grad.Reset(ops_, static_cast<size_t>(p.shard_count * p.group->size()));
    p.grad_unwritten = std::find(overwritten.begin(), overwritten.end(), i) != overwritten.end();
    const int64_t from = p.grad_unwritten ? p.local_count() : 0;
    FP8RT_RETURN_IF_ERROR(ops_.layer->fill(p.full_grad.data() + from, 0.0f,
                                           static_cast<int64_t>(p.full_grad.size()) - from, {}));
  }
  // An MoE block's layer writes its gradients itself: hand it this backward's buffers.
  if (unit >= 1 && unit <= blocks_.size()) {
    const Block& blk = *blocks_[unit - 1];
    if (blk.moe != nullptr) {
      std::vector<float*> g1, gu, g2;
      for (const int i : units_[unit].params) {
        Param& p = params_[static_cast<size_t>(i)];
        if (p.name.find(".experts.") == std::string::npos) continue;
        const bool first = p.name.ends_with(".fc1/weight") || p.name.ends_with(".gate/weight");
        (first ? g1 : p.name.ends_with(".up/weight") ? gu : g2).push_back(p.full_grad.data());
      }
      blk.moe->SetGrads(params_[static_cast<size_t>(blk.router_w)].full_grad.data(), g1, gu, g2);
    }
  }
  return absl::OkStatus();
}

absl::Status Transformer::ReduceUnitGrads(size_t unit) {
  // One unit's reductions in flight at most: its full gradients stay alive until then.
  FP8RT_RETURN_IF_ERROR(FinishReductions());
  // The step's first reduction of a parameter writes its shard gradient, later ones (later
  // micro-batches, the second use of a tied embedding) add to it.
  // Checked for the whole unit before its first reduction, so that a refusal reduces none.
  for (const int i : units_[unit].params) {
    const Param& p = params_[static_cast<size_t>(i)];
    if (p.grad_unwritten) {
      return absl::InternalError(absl::StrCat(
          "the full gradient of ", p.name,
          " was left unzeroed for its layer to write over, and the backward did not write it"));
    }
  }
  for (const int i : units_[unit].params) {
    Param& p = params_[static_cast<size_t>(i)];
    const bool first = p.reductions++ == 0;
    if (first && p.group->size() == 1 && recipe_.grad_reduce == parallel::GradReduceDType::kFP32) {
      // A one-rank FSDP group: the full gradient is the shard's (same size, no padding), copied
      // by the backend. Not swapped: the arrays would trade placements, and the shard gradient
      // must stay host-visible (the host reads it at a skipped step; it is prefetched as managed
      // memory on CUDA).
      FP8RT_RETURN_IF_ERROR(ops_.layer->copy(p.grad.data(), p.full_grad.data(), p.shard_count, {}));
      p.full_grad.clear();
      continue;
    }
    if (reduce_buffers_.size() <= reducing_.size()) {
      // Wire buffers: only the backend's entries and the collectives touch them.
      parallel::GradReduceBuffers& b = reduce_buffers_.emplace_back();
      for (auto* a : {&b.send_bf16, &b.reduced_bf16}) {
        *a = kernels::DeviceArray<uint16_t>(ops_, kernels::MemCategory::kCommBuffers,
                                            kernels::Placement::kDeviceOnly);
      }
      b.reduced_f32 = kernels::DeviceArray<float>(ops_, kernels::MemCategory::kCommBuffers,
                                                  kernels::Placement::kDeviceOnly);
    }
    FP8RT_ASSIGN_OR_RETURN(
        parallel::PendingGradReduce reduce,
        parallel::StartReduceScatterGrad(*p.group, ops_, p.full_grad.data(), p.shard_count,
                                         recipe_.grad_reduce, /*accumulate=*/!first, p.grad.data(),
                                         &reduce_buffers_[reducing_.size()]));
    if (reduce.InFlight()) {
      reducing_.push_back(Reducing{.param = i, .reduce = std::move(reduce)});
      continue;
    }
    FP8RT_RETURN_IF_ERROR(reduce.Finish());
    p.full_grad.clear();
  }
  ++units_[unit].reduced;
  return absl::OkStatus();
}

absl::Status Transformer::FinishReductions() {
  absl::Status status;
  for (Reducing& r : reducing_) {
    // After a failure too: Finish orders the default stream (the free below) after the
    // reduce-scatter whatever its status.
    absl::Status s = r.reduce.Finish();
    if (status.ok()) status = std::move(s);
    params_[static_cast<size_t>(r.param)].full_grad.clear();
  }
  reducing_.clear();
  return status;
}

void Transformer::AttachFp8Shards(std::span<train::ParamShard> shards) {
  FP8RT_CHECK(shards.size() == params_.size())
      << shards.size() << " shards for " << params_.size() << " parameters";
  if (recipe_.fsdp_gather != FsdpGatherDType::kFp8) return;
  for (size_t i = 0; i < params_.size(); ++i) {
    Param& p = params_[i];
    p.fp8_shard_fresh = false;
    if (p.linear == nullptr || p.linear->precision() != GemmPrecision::kFp8) continue;
    const train::ScalingState& st = p.linear->weight_site().state();
    const bool block = st.config().strategy == train::ScalingStrategy::kBlock;
    if (st.config().strategy == train::ScalingStrategy::kMx32) continue;  // BeginStep quantizes it
    if (!block && st.UsesCurrentScaling()) continue;                       // so does it this
    parallel::Fp8Shard& f = p.fp8_shard;
    f.rows = p.shard_count / p.local_cols;
    f.cols = p.local_cols;
    f.block = block;
    f.mx32 = false;
    f.scale = block ? 1.0f : st.scale();
    f.codes.Reset(ops_, static_cast<size_t>(p.shard_count));
    f.scale_inv.Reset(ops_, static_cast<size_t>(
                                block ? kernels::GetScaleGrid(kernels::Granularity::kBlock128x128,
                                                              f.rows, f.cols)
                                            .size()
                                      : 1));
    f.stats_out.Reset(ops_, 1);
    kernels::AdamWFp8Output& o = shards[i].fp8;
    o.codes = f.codes.data();
    o.scale_inv = f.scale_inv.data();
    o.stats = f.stats_out.device();
    o.format = st.config().format;
    o.block = block;
    o.scale = f.scale;
    o.rows = f.rows;
    o.cols = f.cols;
    o.margin = st.config().margin;
    p.fp8_shard_fresh = true;
  }
}

absl::Status Transformer::BeginStep() {
  for (Linear* lin : all_linears_) lin->DropPendingStats();  // left by a pass that failed
  for (QuantSite* s : sites_) s->BeginStep();
  for (MoeBlockStats& m : moe_stats_) {
    std::fill(m.tokens_per_expert.begin(), m.tokens_per_expert.end(), 0);
    m.dropped = 0;
  }
  for (size_t u = 0; u < units_.size(); ++u) {
    Reshard(u);  // whatever a failed pass left
    units_[u].reduced = 0;
  }
  passes_ = 0;
  // The shard gradients are written by each unit's first reduction of the step (ReduceGrads
  // checks that every unit had one); nothing to zero here.
  for (Param& p : params_) {
    p.full_grad.clear();
    p.reductions = 0;
  }
  // Tensor-scaled FP8 weights whose scale comes from the weight itself (current scaling, or
  // delayed scaling without a history yet): one MAX over all ranks of every such weight's shard
  // amax, so every rank (and every layout) quantizes a weight with the same scale. All on the
  // device (issue 23 point 4): each shard's amax op writes its element of weight_amaxes_, one
  // stream-ordered i32 max all-reduce over the world takes their maxima (an amax is >= 0 or a
  // positive NaN, so int32 order is float order, NaN above Inf, as in parallel::SyncAmaxes), and
  // each shard's quantization computes its scale from its element. The list runs over every
  // layer (every rank has the same), with 0 for expert weights this rank does not hold.
  std::map<const Linear*, Param*> param_of;
  for (Param& p : params_) {
    if (p.linear != nullptr) param_of[p.linear] = &p;
  }
  std::vector<const Linear*> current;
  for (const Linear* lin : all_linears_) {
    if (lin->precision() != GemmPrecision::kFp8) continue;
    const train::ScalingState& st = lin->weight_site().state();
    if (train::PerBlockScales(st.config().strategy) || !st.UsesCurrentScaling()) continue;
    current.push_back(lin);
  }
  if (!current.empty()) {
    weight_amaxes_.Grow(ops_, all_linears_.size());  // at most one per layer
    FP8RT_RETURN_IF_ERROR(
        ops_.layer->zero_bytes(weight_amaxes_.device(), current.size() * sizeof(float), {}));
    for (size_t i = 0; i < current.size(); ++i) {
      const auto it = param_of.find(current[i]);
      if (it == param_of.end()) continue;
      kernels::AmaxArgs a{.input_type = kernels::InputType::kF32,
                          .input = it->second->master.data(),
                          .count = it->second->shard_count,
                          .amax = weight_amaxes_.device() + i};
      FP8RT_RETURN_IF_ERROR(ops_.amax(a, {}));
    }
    FP8RT_RETURN_IF_ERROR(mesh_.world().AllReduce(
        weight_amaxes_.device(), static_cast<int64_t>(current.size()), parallel::DType::kI32,
        parallel::ReduceOp::kMax, parallel::Completion::kStream));
  }
  // Each FP8 weight's shard, quantized once for the whole step (every gather of the step moves
  // these bytes). With fsdp_gather bf16 every rank quantizes the gathered piece instead, with
  // the same scale; its statistics are this rank's shard's all the same. Every quantization is
  // queued first; one wait, then every shard's statistics (and the agreed amaxes) are read.
  // Per FP8 weight: its index in `current`, or -1 with the scale its site gives.
  std::vector<std::tuple<Param*, ptrdiff_t, float>> fp8_params;
  for (Param& p : params_) {
    if (p.linear == nullptr || p.linear->precision() != GemmPrecision::kFp8) continue;
    const auto it = std::find(current.begin(), current.end(), p.linear);
    const train::ScalingConfig& cfg = p.linear->weight_site().state().config();
    if (it != current.end()) {  // never written by the update pass (AttachFp8Shards)
      const ptrdiff_t i = it - current.begin();
      FP8RT_RETURN_IF_ERROR(parallel::QuantizeFp8ShardFromAmax(
          ops_, p.master.data(), p.shard_count / p.local_cols, p.local_cols, cfg.format,
          weight_amaxes_.device() + i, cfg.margin, cfg.power_of_two, &p.fp8_shard));
      fp8_params.emplace_back(&p, i, 0.0f);
      p.fp8_shard_fresh = false;
      continue;
    }
    const float scale = p.linear->weight_site().state().scale();
    // A shard written by the optimizer's update pass (AttachFp8Shards) with its own block scales,
    // or with this very tensor scale, is used as it is.
    if (!p.fp8_shard_fresh || !(p.fp8_shard.block || p.fp8_shard.scale == scale)) {
      FP8RT_RETURN_IF_ERROR(QuantizeWeightShard(p, scale, &mx32_scratch_));
    } else {
      // The update pass wrote its statistics on the device; their copy for the host.
      FP8RT_RETURN_IF_ERROR(p.fp8_shard.stats_out.Download({}));
    }
    p.fp8_shard_fresh = false;
    fp8_params.emplace_back(&p, -1, scale);
  }
  if (!current.empty()) FP8RT_RETURN_IF_ERROR(weight_amaxes_.Download({}, current.size()));
  if (!fp8_params.empty()) FP8RT_RETURN_IF_ERROR(ops_.layer->synchronize({}));
  // Only if the max-reduce completed (its error is the step's).
  if (!current.empty()) FP8RT_RETURN_IF_ERROR(mesh_.world().CheckStreamOrdered());
  for (auto& [param, index, given] : fp8_params) {
    Param& p = *param;
    float scale = given;
    if (index >= 0) {
      // The scale the quantization computed from the agreed amax, as it computed it.
      const train::ScalingConfig& cfg = p.linear->weight_site().state().config();
      scale = kernels::ComputeScale(weight_amaxes_[static_cast<size_t>(index)], cfg.format,
                                    cfg.margin, cfg.power_of_two);
      p.fp8_shard.scale = scale;
    }
    parallel::ReadShardStats(&p.fp8_shard);
    RecordWeightShard(p, scale);
    if (recipe_.fsdp_gather == FsdpGatherDType::kBf16) {
      p.fp8_shard.codes.clear();  // only the scale and the statistics are used
      p.fp8_shard.scale_inv.clear();
      p.fp8_shard.e8m0.clear();
      p.fp8_shard.col_codes.clear();
      p.fp8_shard.col_e8m0.clear();
    }
  }
  return absl::OkStatus();
}

absl::Status Transformer::PrefetchShards() {
  for (const Param& p : params_) {
    for (const kernels::DeviceArray<float>* a : {&p.master, &p.grad, &p.m, &p.v}) {
      FP8RT_RETURN_IF_ERROR(ops_.layer->prefetch(a->data(), a->size() * sizeof(float), {}));
    }
  }
  return absl::OkStatus();
}

absl::Status Transformer::LoadTokens(std::span<const int32_t> tokens, int64_t micro_batch) {
  const int64_t T = shape_.seq_len;
  if (static_cast<int64_t>(tokens.size()) != micro_batch * (T + 1)) {
    return absl::InvalidArgumentError(absl::StrCat("micro-batch of ", tokens.size(),
                                                   " tokens, expected ", micro_batch * (T + 1)));
  }
  Acts& a = *acts_;
  std::vector<Acts::Keep> keep(blocks_.size());
  for (size_t l = 0; l < blocks_.size(); ++l) {
    const Block& blk = *blocks_[l];
    keep[l].ln1 = !blk.qkv->saves_fp8_input_only();
    // MoE keeps its input; SwiGLU's gate and up share theirs.
    keep[l].ln2 = blk.moe != nullptr || !blk.fc1->saves_fp8_input_only() ||
                  (blk.up != nullptr && !blk.up->saves_fp8_input_only());
    keep[l].g = blk.moe != nullptr || !blk.fc2->saves_fp8_input_only();
  }
  a.Resize(shape_, tp_, micro_batch, keep);
  for (int64_t b = 0; b < micro_batch; ++b) {
    for (int64_t t = 0; t < T; ++t) {
      a.inputs[static_cast<size_t>(b * T + t)] = tokens[static_cast<size_t>(b * (T + 1) + t)];
      a.targets[static_cast<size_t>(b * T + t)] = tokens[static_cast<size_t>(b * (T + 1) + t + 1)];
    }
  }
  // To the device, in stream order after the last pass's ops that read them (the host side is
  // free: the last pass's upload finished before its loss was read).
  const size_t rows = static_cast<size_t>(micro_batch * T);
  for (kernels::HostMirror<int32_t>* v : {&a.inputs, &a.targets, &a.positions}) {
    FP8RT_RETURN_IF_ERROR(v->Upload({}, rows));
  }
  return absl::OkStatus();
}

absl::StatusOr<float> Transformer::ForwardBackward(std::span<const int32_t> tokens,
                                                   int64_t micro_batch, float dloss) {
  FP8RT_RETURN_IF_ERROR(LoadTokens(tokens, micro_batch));
  FP8RT_ASSIGN_OR_RETURN(const float aux_loss, Forward(/*train=*/true));
  if (absl::Status s = Backward(dloss); !s.ok()) {
    // A failed pass leaves no reduction in flight: each is waited for and dropped, its full
    // gradient kept until the next BeginUnitGrads (the pass does not count, so the step fails in
    // ReduceGrads).
    reducing_.clear();
    return s;
  }
  ++passes_;
  return MeanLoss(aux_loss, /*backend_idle=*/true);  // Backward ends with the backend idle
}

absl::StatusOr<float> Transformer::Evaluate(std::span<const int32_t> tokens, int64_t micro_batch) {
  FP8RT_RETURN_IF_ERROR(LoadTokens(tokens, micro_batch));
  absl::StatusOr<float> loss = Forward(/*train=*/false);
  if (loss.ok()) loss = MeanLoss(*loss, /*backend_idle=*/false);
  // Nothing of the pass stays: no gathered weight, no FP8 statistics (the step's sites record
  // only the training passes).
  for (size_t u = 0; u < units_.size(); ++u) Reshard(u);
  for (Linear* lin : all_linears_) lin->DropPendingStats();
  return loss;
}

absl::StatusOr<std::vector<float>> Transformer::CopyLogits(int64_t first_row, int64_t rows) const {
  const int64_t V = shape_.vocab;
  const int64_t have = V > 0 ? static_cast<int64_t>(acts_->logits.size()) / V : 0;
  if (first_row < 0 || rows < 0 || first_row + rows > have) {
    return absl::InvalidArgumentError(absl::StrCat("CopyLogits: rows [", first_row, ", ",
                                                   first_row + rows, ") outside the ", have,
                                                   " rows of the last pass"));
  }
  // The logits are device-only: copied into pinned memory behind the pass, then read.
  const size_t count = static_cast<size_t>(rows * V);
  logits_host_.Grow(ops_, count);
  FP8RT_RETURN_IF_ERROR(ops_.layer->copy_bytes(logits_host_.data(),
                                               acts_->logits.data() + first_row * V,
                                               count * sizeof(float), {}));
  FP8RT_RETURN_IF_ERROR(ops_.layer->synchronize({}));
  return std::vector<float>(logits_host_.begin(), logits_host_.begin() + count);
}

absl::StatusOr<float> Transformer::Forward(bool train) {
  const int64_t T = shape_.seq_len, C = shape_.d_model, V = shape_.vocab;
  const int64_t Hl = shape_.heads / tp_, KVl = shape_.kv() / tp_, Dh = shape_.head_dim();
  const int64_t Q = shape_.heads / shape_.kv(), Fl = shape_.d_ff / tp_;
  const int64_t qkv_cols = (Hl + 2 * KVl) * Dh;
  const float eps = shape_.norm_eps, theta = shape_.rope_theta;
  const bool layer_norm = shape_.norm == NormKind::kLayer;
  Acts& a = *acts_;
  const int64_t B = a.b, N = a.n;
  const LinearContext ctx = Ctx();
  const kernels::LayerOps& L = *ops_.layer;
  const kernels::Stream st{};
  auto W = [&](int i) -> const float* { return params_[static_cast<size_t>(i)].full.data(); };
  auto norm = [&](float* out, Acts::Array& mean, Acts::Array& rstd, const float* x, int w, int b) {
    return layer_norm ? L.layernorm_forward(out, mean.data(), rstd.data(), x, W(w), W(b), N, C,
                                            eps, st)
                      : L.rmsnorm_forward(out, rstd.data(), x, W(w), N, C, eps, st);
  };
  auto bias = [&](float* y, int b, int64_t cols) {
    return b < 0 ? absl::OkStatus() : L.bias_forward(y, W(b), N, cols, st);
  };
  // FSDP units (see the file comment): 0 the embedding, 1 + l block l, head after the blocks.
  const size_t head = blocks_.size() + 1;

  float aux_loss = 0.0f;  // MoE load-balancing losses
  FP8RT_RETURN_IF_ERROR(FinishUnshard(0));
  FP8RT_RETURN_IF_ERROR(StartUnshard(1));  // prefetch: the next unit's gathers run meanwhile
  float* x0 = a.layers[0].x.data();
  FP8RT_RETURN_IF_ERROR(L.embedding_forward(x0, a.inputs.device(), W(embedding_), N, V, C, st));
  if (positions_ >= 0) {
    FP8RT_RETURN_IF_ERROR(L.embedding_forward(a.pos.data(), a.positions.device(), W(positions_), N,
                                              shape_.max_positions, C, st));
    FP8RT_RETURN_IF_ERROR(L.residual_forward(x0, x0, a.pos.data(), N * C, st));
  }
  // No wait before a reshard: the gathered buffers are device-only memory, freed in the default
  // stream's order after the ops that read them (on the CPU the ops have run already).
  Reshard(0);  // the embedding's backward needs no weight
  for (size_t l = 0; l < blocks_.size(); ++l) {
    const Block& blk = *blocks_[l];
    Acts::Layer& x = a.layers[l];
    FP8RT_RETURN_IF_ERROR(FinishUnshard(l + 1));
    FP8RT_RETURN_IF_ERROR(StartUnshard(l + 2));
    if (train && static_cast<int64_t>(l) == fault_block_) [[unlikely]] {
      // A test fault (ArmActivationFault), once.
      FP8RT_RETURN_IF_ERROR(L.fill(x.x.data(), fault_value_, 1, st));
      fault_block_ = -1;
    }
    float* ln1 = Acts::In(x.ln1, a.t_ln1);
    float* att = x.att.data();
    float* ln2 = Acts::In(x.ln2, a.t_ln2);
    float* g = Acts::In(x.g, a.t_g);
    float* qkv = a.t_qkv.data();
    float* proj = a.t_proj.data();
    float* fc2 = a.t_fc2.data();
    FP8RT_RETURN_IF_ERROR(norm(ln1, x.mean1, x.rstd1, x.x.data(), blk.attn_norm, blk.attn_norm_b));
    FP8RT_RETURN_IF_ERROR(blk.qkv->Forward(ctx, ln1, N, qkv));
    FP8RT_RETURN_IF_ERROR(bias(qkv, blk.qkv_b, qkv_cols));
    // This rank's QKV columns, grouped by key/value head: the group's Q query heads, then its
    // k and v, Dh each.
    FP8RT_RETURN_IF_ERROR(
        L.split_heads(x.q.data(), x.k.data(), x.v.data(), qkv, N, KVl, Q, Dh, st));
    if (shape_.positions == PositionKind::kRope) {
      FP8RT_RETURN_IF_ERROR(L.rope_forward(x.q.data(), x.q.data(), N, T, Hl, Dh, theta, st));
      FP8RT_RETURN_IF_ERROR(L.rope_forward(x.k.data(), x.k.data(), N, T, KVl, Dh, theta, st));
    }
    FP8RT_RETURN_IF_ERROR(AttentionForwardOp(L)(att, x.lse.data(), x.q.data(), x.k.data(),
                                                x.v.data(), B, T, Hl, KVl, Dh, st));
    FP8RT_RETURN_IF_ERROR(blk.proj->Forward(ctx, att, N, proj));
    FP8RT_RETURN_IF_ERROR(AllReduceTp(proj, N * C));
    FP8RT_RETURN_IF_ERROR(bias(proj, blk.proj_b, C));
    FP8RT_RETURN_IF_ERROR(L.residual_forward(x.x2.data(), x.x.data(), proj, N * C, st));
    FP8RT_RETURN_IF_ERROR(norm(ln2, x.mean2, x.rstd2, x.x2.data(), blk.mlp_norm, blk.mlp_norm_b));
    if (blk.moe != nullptr) {
      FP8RT_ASSIGN_OR_RETURN(const MoeStats ms, blk.moe->Forward(ctx, ln2, N, fc2));
      if (train) {
        aux_loss += ms.aux_loss;
        MoeBlockStats& acc = moe_stats_[static_cast<size_t>(blk.moe_stats)];
        for (size_t e = 0; e < ms.tokens_per_expert.size(); ++e) {
          acc.tokens_per_expert[e] += ms.tokens_per_expert[e];
        }
        acc.dropped += ms.dropped;
      }
    } else {
      FP8RT_RETURN_IF_ERROR(blk.fc1->Forward(ctx, ln2, N, x.h.data()));
      FP8RT_RETURN_IF_ERROR(bias(x.h.data(), blk.fc1_b, Fl));
      if (blk.up != nullptr) {
        FP8RT_RETURN_IF_ERROR(blk.up->Forward(ctx, ln2, N, x.u.data()));
        FP8RT_RETURN_IF_ERROR(L.swiglu_forward(g, x.h.data(), x.u.data(), N * Fl, st));
      } else {
        FP8RT_RETURN_IF_ERROR(L.gelu_forward(g, x.h.data(), N * Fl, st));
      }
      FP8RT_RETURN_IF_ERROR(blk.fc2->Forward(ctx, g, N, fc2));
      FP8RT_RETURN_IF_ERROR(AllReduceTp(fc2, N * C));
      FP8RT_RETURN_IF_ERROR(bias(fc2, blk.fc2_b, C));
    }
    Acts::Array& next = l + 1 < blocks_.size() ? a.layers[l + 1].x : a.x_final;
    FP8RT_RETURN_IF_ERROR(L.residual_forward(next.data(), x.x2.data(), fc2, N * C, st));
    // The last block's backward comes right after the head: it stays gathered. A forward
    // without backward (Evaluate) keeps nothing.
    if (!train || (recipe_.reshard_after_forward && l + 1 < blocks_.size())) Reshard(l + 1);
  }
  FP8RT_RETURN_IF_ERROR(FinishUnshard(head));
  FP8RT_RETURN_IF_ERROR(
      norm(a.lnf.data(), a.meanf, a.rstdf, a.x_final.data(), final_norm_, final_norm_bias_));
  FP8RT_RETURN_IF_ERROR(lm_head_->Forward(ctx, a.lnf.data(), N, a.logits.data()));
  FP8RT_RETURN_IF_ERROR(L.cross_entropy_forward(a.ce_probs.data(), a.losses.data(), a.logits.data(),
                                                a.targets.device(), N, V, st));
  // The rows' losses are read by MeanLoss, once the backend has finished: a training pass goes
  // on to its backward without waiting.
  return aux_loss;
}

absl::StatusOr<float> Transformer::MeanLoss(float aux_loss, bool backend_idle) {
  if (!backend_idle) {  // else the caller (Backward) has waited and checked
    FP8RT_RETURN_IF_ERROR(ops_.layer->synchronize({}));
    // Only if the pass's stream-ordered collectives (TP sums, FSDP gathers) all completed.
    FP8RT_RETURN_IF_ERROR(CheckStreamOrdered());
  }
  float loss_sum = 0.0f;  // in row order
  for (const float row_loss : acts_->losses) loss_sum += row_loss;
  return loss_sum / static_cast<float>(acts_->n) + aux_loss;
}

absl::Status Transformer::Backward(float dloss) {
  const int64_t T = shape_.seq_len, C = shape_.d_model, V = shape_.vocab;
  const int64_t Hl = shape_.heads / tp_, KVl = shape_.kv() / tp_, Dh = shape_.head_dim();
  const int64_t Q = shape_.heads / shape_.kv(), Fl = shape_.d_ff / tp_;
  const int64_t qkv_cols = (Hl + 2 * KVl) * Dh;
  const float theta = shape_.rope_theta;
  const bool layer_norm = shape_.norm == NormKind::kLayer;
  Acts& a = *acts_;
  const int64_t B = a.b, N = a.n;
  const LinearContext ctx = Ctx();
  const kernels::LayerOps& L = *ops_.layer;
  const kernels::Stream st{};
  auto P = [&](int i) -> Param& { return params_[static_cast<size_t>(i)]; };
  auto W = [&](int i) -> const float* { return P(i).full.data(); };
  auto G = [&](int i) -> float* { return P(i).full_grad.data(); };
  auto zero = [&](Acts::Array& v) {
    return L.fill(v.data(), 0.0f, static_cast<int64_t>(v.size()), st);
  };
  // dx += d norm(x) / dx . dout, and the norm's parameter gradients.
  auto norm = [&](float* dx, int w, int b, const float* dout, const float* x, Acts::Array& mean,
                  Acts::Array& rstd) {
    return layer_norm ? L.layernorm_backward(dx, G(w), G(b), dout, x, W(w), mean.data(),
                                             rstd.data(), N, C, st)
                      : L.rmsnorm_backward(dx, G(w), dout, x, W(w), rstd.data(), N, C, st);
  };
  auto bias = [&](int b, const float* dy, int64_t cols) {
    return b < 0 ? absl::OkStatus() : L.bias_backward(G(b), dy, N, cols, st);
  };
  // A linear layer's backward into weight gradient w: written over where BeginUnitGrads left it
  // unzeroed, added otherwise; dx written over unless add_dx.
  auto linear = [&](Linear* lin, const float* dy, float* dx, bool add_dx, int w) {
    Param& p = P(w);
    const BackwardInto into{.add_dx = add_dx, .add_dw = !p.grad_unwritten};
    p.grad_unwritten = false;
    return lin->Backward(ctx, dy, N, dx, G(w), into);
  };
  const size_t head = blocks_.size() + 1;

  // The ops accumulate into zeroed buffers, except the linear layers' backwards where they are
  // the first to write a buffer: those write over it, and it is not zeroed.
  FP8RT_RETURN_IF_ERROR(zero(a.dlogits));
  FP8RT_RETURN_IF_ERROR(L.cross_entropy_backward(a.dlogits.data(), a.ce_probs.data(),
                                                 a.targets.device(), N, V, dloss, st));
  FP8RT_RETURN_IF_ERROR(BeginUnitGrads(head, {lm_head_param_}));
  FP8RT_RETURN_IF_ERROR(linear(lm_head_, a.dlogits.data(), a.dlnf.data(), false, lm_head_param_));
  FP8RT_RETURN_IF_ERROR(zero(a.dx));
  FP8RT_RETURN_IF_ERROR(
      norm(a.dx.data(), final_norm_, final_norm_bias_, a.dlnf.data(), a.x_final.data(), a.meanf,
           a.rstdf));
  // The gradients travel in stream order after the ops that wrote them (NCCL's stream follows
  // the default stream; on the CPU the ops have run already): no wait here.
  FP8RT_RETURN_IF_ERROR(ReduceUnitGrads(head));
  Reshard(head);
  for (size_t l = blocks_.size(); l-- > 0;) {
    const Block& blk = *blocks_[l];
    Acts::Layer& x = a.layers[l];
    FP8RT_RETURN_IF_ERROR(FinishUnshard(l + 1));
    if (l > 0) FP8RT_RETURN_IF_ERROR(StartUnshard(l));  // the block below, for its backward
    // An MoE block's layer writes its own weight gradients (an expert may get no tokens).
    if (blk.moe != nullptr) {
      FP8RT_RETURN_IF_ERROR(BeginUnitGrads(l + 1, {blk.qkv_w, blk.proj_w}));
    } else if (blk.up != nullptr) {
      FP8RT_RETURN_IF_ERROR(
          BeginUnitGrads(l + 1, {blk.qkv_w, blk.proj_w, blk.fc1_w, blk.up_w, blk.fc2_w}));
    } else {
      FP8RT_RETURN_IF_ERROR(BeginUnitGrads(l + 1, {blk.qkv_w, blk.proj_w, blk.fc1_w, blk.fc2_w}));
    }
    // out = x2 + mlp(norm(x2)): the residual passes dx straight to x2.
    if (blk.moe != nullptr) {
      FP8RT_RETURN_IF_ERROR(zero(a.dln));
      FP8RT_RETURN_IF_ERROR(blk.moe->Backward(ctx, a.dx.data(), N, dloss, a.dln.data()));
    } else {
      FP8RT_RETURN_IF_ERROR(bias(blk.fc2_b, a.dx.data(), C));
      FP8RT_RETURN_IF_ERROR(linear(blk.fc2, a.dx.data(), a.dg.data(), false, blk.fc2_w));
      FP8RT_RETURN_IF_ERROR(zero(a.dh));
      if (blk.up != nullptr) {
        FP8RT_RETURN_IF_ERROR(zero(a.du));
        FP8RT_RETURN_IF_ERROR(L.swiglu_backward(a.dh.data(), a.du.data(), a.dg.data(), x.h.data(),
                                                x.u.data(), N * Fl, st));
      } else {
        FP8RT_RETURN_IF_ERROR(L.gelu_backward(a.dh.data(), a.dg.data(), x.h.data(), N * Fl, st));
      }
      FP8RT_RETURN_IF_ERROR(bias(blk.fc1_b, a.dh.data(), Fl));
      FP8RT_RETURN_IF_ERROR(linear(blk.fc1, a.dh.data(), a.dln.data(), false, blk.fc1_w));
      if (blk.up != nullptr) {
        FP8RT_RETURN_IF_ERROR(linear(blk.up, a.du.data(), a.dln.data(), true, blk.up_w));
      }
      FP8RT_RETURN_IF_ERROR(AllReduceTp(a.dln.data(), N * C));
    }
    FP8RT_RETURN_IF_ERROR(L.copy(a.dx2.data(), a.dx.data(), N * C, st));
    FP8RT_RETURN_IF_ERROR(norm(a.dx2.data(), blk.mlp_norm, blk.mlp_norm_b, a.dln.data(),
                               x.x2.data(), x.mean2, x.rstd2));
    // x2 = x + proj(attention(qkv(norm(x)))).
    FP8RT_RETURN_IF_ERROR(bias(blk.proj_b, a.dx2.data(), C));
    FP8RT_RETURN_IF_ERROR(linear(blk.proj, a.dx2.data(), a.datt.data(), false, blk.proj_w));
    FP8RT_RETURN_IF_ERROR(zero(a.dq));
    FP8RT_RETURN_IF_ERROR(zero(a.dk));
    FP8RT_RETURN_IF_ERROR(zero(a.dv));
    FP8RT_RETURN_IF_ERROR(AttentionBackwardOp(L)(a.dq.data(), a.dk.data(), a.dv.data(),
                                                 a.datt.data(), x.q.data(), x.k.data(),
                                                 x.v.data(), x.att.data(), x.lse.data(), B, T, Hl,
                                                 KVl, Dh, st));
    float* dq = a.dq.data();
    float* dk = a.dk.data();
    if (shape_.positions == PositionKind::kRope) {
      // The gradients of the rotated q and k, rotated back.
      FP8RT_RETURN_IF_ERROR(zero(a.dqr));
      FP8RT_RETURN_IF_ERROR(zero(a.dkr));
      FP8RT_RETURN_IF_ERROR(L.rope_backward(a.dqr.data(), dq, N, T, Hl, Dh, theta, st));
      FP8RT_RETURN_IF_ERROR(L.rope_backward(a.dkr.data(), dk, N, T, KVl, Dh, theta, st));
      dq = a.dqr.data();
      dk = a.dkr.data();
    }
    FP8RT_RETURN_IF_ERROR(L.join_heads(a.dqkv.data(), dq, dk, a.dv.data(), N, KVl, Q, Dh, st));
    FP8RT_RETURN_IF_ERROR(bias(blk.qkv_b, a.dqkv.data(), qkv_cols));
    FP8RT_RETURN_IF_ERROR(linear(blk.qkv, a.dqkv.data(), a.dln.data(), false, blk.qkv_w));
    FP8RT_RETURN_IF_ERROR(AllReduceTp(a.dln.data(), N * C));
    FP8RT_RETURN_IF_ERROR(L.copy(a.dx.data(), a.dx2.data(), N * C, st));
    FP8RT_RETURN_IF_ERROR(norm(a.dx.data(), blk.attn_norm, blk.attn_norm_b, a.dln.data(),
                               x.x.data(), x.mean1, x.rstd1));
    FP8RT_RETURN_IF_ERROR(ReduceUnitGrads(l + 1));
    Reshard(l + 1);
  }
  FP8RT_RETURN_IF_ERROR(BeginUnitGrads(0));
  FP8RT_RETURN_IF_ERROR(
      L.embedding_backward(G(embedding_), a.dx.data(), a.inputs.device(), N, V, C, st));
  if (positions_ >= 0) {
    FP8RT_RETURN_IF_ERROR(L.embedding_backward(G(positions_), a.dx.data(), a.positions.device(), N,
                                               shape_.max_positions, C, st));
  }
  FP8RT_RETURN_IF_ERROR(ReduceUnitGrads(0));
  FP8RT_RETURN_IF_ERROR(FinishReductions());
  // The statistics of the pass's FP8 quantizations recorded into their sites, once the backend
  // has finished and the pass's stream-ordered collectives (TP sums, gradient reduce-scatters)
  // all completed.
  FP8RT_RETURN_IF_ERROR(L.synchronize(st));
  FP8RT_RETURN_IF_ERROR(CheckStreamOrdered());
  for (Linear* lin : all_linears_) FP8RT_RETURN_IF_ERROR(lin->FlushStats(/*backend_idle=*/true));
  return absl::OkStatus();
}

void Transformer::ArmActivationFault(int64_t block, float value) {
  FP8RT_CHECK(block >= 0 && block < shape_.layers)
      << "fault block " << block << " of " << shape_.layers;
  fault_block_ = block;
  fault_value_ = value;
}

bool Transformer::ArmInputOutlier(const std::string& layer, float growth,
                                  int64_t grow_forwards) {
  bool armed = false;
  for (Linear* lin : all_linears_) {
    if (lin->name() != layer) continue;
    lin->ArmInputOutlier(growth, grow_forwards);
    armed = true;
  }
  return armed;
}

absl::Status Transformer::ReduceGrads() {
  absl::Status status;
  for (size_t u = 0; u < units_.size(); ++u) {
    if (status.ok() && (passes_ == 0 || units_[u].reduced != passes_)) {
      status = absl::FailedPreconditionError(absl::StrCat(
          "unit '", units_[u].name, "' reduced its gradient ", units_[u].reduced, " times in ",
          passes_, " completed forward-backward passes of the step"));
    }
    Reshard(u);
  }
  return status;
}

absl::StatusOr<std::vector<SiteReport>> Transformer::SyncScaling(ScalingUpdate update) {
  std::vector<float> amaxes(sites_.size(), 0.0f);
  for (size_t i = 0; i < sites_.size(); ++i) {
    if (sites_[i]->used_this_step()) amaxes[i] = sites_[i]->step_stats().amax;
  }
  if (!amaxes.empty()) {
    FP8RT_RETURN_IF_ERROR(parallel::SyncAmaxes(mesh_.world(), amaxes).status());
  }
  std::vector<SiteReport> reports(sites_.size());
  for (size_t i = 0; i < sites_.size(); ++i) {
    QuantSite& s = *sites_[i];
    const kernels::QuantStats& st = s.step_stats();
    SiteReport& r = reports[i];
    r.site = s.name();
    r.amax = amaxes[i];
    r.scale = s.step_scale();
    r.used = s.used_this_step();
    r.count = st.count;
    r.underflow = st.underflow;
    r.saturated = st.saturated;
    if (st.count > 0) {
      r.underflow_ratio = static_cast<double>(st.underflow) / static_cast<double>(st.count);
      r.saturation_ratio = static_cast<double>(st.saturated) / static_cast<double>(st.count);
    }
    if (update == ScalingUpdate::kCommit) s.state().Update(amaxes[i]);
  }
  return reports;
}

}  // namespace fp8rt::model
