// Mixture-of-experts layer (see moe.h). Index: construction, routing (router, top-k, capacity,
// aux loss), Forward (dispatch, experts, combine), Backward (the same, reversed, then the router).
#include "runtime/model/moe.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <numeric>

#include "absl/strings/str_cat.h"
#include "parallel/fp8_collectives.h"
#include "runtime/core/status.h"

namespace fp8rt::model {
namespace {

// The rows an expert's GEMMs run on: its token count rounded up to the backend's GEMM row unit.
// cuBLASLt takes FP8 GEMMs only when M, N and K are multiples of 16, and with block or mx32
// scaling K a multiple of 128 (kernels/cuda/gemm_route.h); an expert's token count is whatever
// the router gave it, and it is the weight gradient's K. So on CUDA each expert's rows are padded
// with zero rows to a multiple of 16, or of 128 when any of its GEMMs is FP8 with per-block
// scales (`per_block`; its forward M, dgrad M and wgrad K). Zero rows change no real row, no amax
// and no gradient: the pad rows of the activation are zeroed again before fc2 (a bias would make
// them nonzero), and their output gradients are zero. The CPU GEMMs take any shape: no padding
// there, so the CPU path is unchanged. MoeConfig::gemm_row_unit, when set, replaces the backend's
// unit.
int64_t ExpertRows(const MoeConfig& config, const kernels::OpTable& ops, bool per_block,
                   int64_t tokens) {
  constexpr int64_t kCudaGemmRowUnit = 16;
  constexpr int64_t kCudaBlockScaledRowUnit = 128;
  const int64_t unit = config.gemm_row_unit > 0                 ? config.gemm_row_unit
                       : ops.backend != kernels::Backend::kCuda ? 1
                       : per_block                              ? kCudaBlockScaledRowUnit
                                                                : kCudaGemmRowUnit;
  return (tokens + unit - 1) / unit * unit;
}

// An FP8 linear with block or mx32 scales (its cuBLASLt GEMMs need K a multiple of 128).
bool PerBlockFp8(const Linear& l) {
  return l.precision() == GemmPrecision::kFp8 && (l.block_scaling() || l.mx32());
}

std::vector<int64_t> Displacements(const std::vector<int64_t>& counts) {
  std::vector<int64_t> d(counts.size(), 0);
  for (size_t i = 1; i < counts.size(); ++i) d[i] = d[i - 1] + counts[i - 1];
  return d;
}

// `a` holds at least max(1, count) elements of the backend (DeviceArray::Grow: kept when large
// enough, so that token counts that vary from micro-batch to micro-batch settle without
// reallocating), of unspecified value.
template <typename T>
T* AtLeast(const LinearContext& ctx, kernels::DeviceArray<T>& a, int64_t count) {
  a.Grow(*ctx.ops, static_cast<size_t>(std::max<int64_t>(0, count)));
  return a.data();
}

// `a` as AtLeast, its first `count` elements zeroed by an op (no host access).
absl::StatusOr<float*> Zeroed(const LinearContext& ctx, kernels::DeviceArray<float>& a,
                              int64_t count) {
  float* p = AtLeast(ctx, a, count);
  FP8RT_RETURN_IF_ERROR(ctx.ops->layer->fill(p, 0.0f, count, {}));
  return p;
}

// `a`'s device side (grown as AtLeast) holds at least max(1, count) elements; returns it.
template <typename T>
T* AtLeast(const LinearContext& ctx, kernels::HostMirror<T>& a, int64_t count) {
  a.Grow(*ctx.ops, static_cast<size_t>(std::max<int64_t>(0, count)));
  return a.device();
}

// `values` into `a`'s host side (grown as AtLeast), then uploaded to its device side: only while
// the backend is idle (it may still be reading the host side of the last upload otherwise).
absl::Status Put(const LinearContext& ctx, kernels::HostMirror<int64_t>& a,
                 const std::vector<int64_t>& values) {
  AtLeast(ctx, a, static_cast<int64_t>(values.size()));
  std::copy(values.begin(), values.end(), a.host());
  return a.Upload({}, values.size());
}

}  // namespace

MoeLayer::MoeLayer(std::string name, const MoeConfig& config, int64_t d_model, int64_t d_ff,
                   bool swiglu, GemmPrecision expert_precision, const Fp8SiteConfigs& sites,
                   parallel::Communicator* ep)
    : name_(std::move(name)), config_(config), c_(d_model), f_(d_ff), swiglu_(swiglu), ep_(ep) {
  local_ = config_.experts / ep_->size();
  first_local_ = ep_->rank() * local_;
  router_ =
      std::make_unique<Linear>(name_ + ".router", c_, config_.experts, GemmPrecision::kFp32, sites);
  for (int64_t e = 0; e < config_.experts; ++e) {
    const std::string expert = absl::StrCat(name_, ".experts.", e);
    fc1_.push_back(std::make_unique<Linear>(expert + (swiglu_ ? ".gate" : ".fc1"), c_, f_,
                                            expert_precision, sites));
    if (swiglu_) {
      up_.push_back(std::make_unique<Linear>(expert + ".up", c_, f_, expert_precision, sites));
    }
    fc2_.push_back(std::make_unique<Linear>(expert + (swiglu_ ? ".down" : ".fc2"), f_, c_,
                                            expert_precision, sites));
  }
  for (std::vector<Array>* v : {&xe_, &he_, &ge_, &ue_}) {
    for (int64_t le = 0; le < local_; ++le) v->emplace_back(kernels::CpuOps(), kSaved, kDevice);
  }
  // The token all-to-alls' buffers: only the quantize and convert ops and the collectives touch
  // them (the backend's memory, the first use picks the backend).
  using kernels::DeviceArray;
  constexpr kernels::MemCategory kComm = kernels::MemCategory::kCommBuffers;
  for (DeviceArray<uint8_t>* a : {&recv_tokens_.codes, &token_scratch_.send_codes}) {
    *a = DeviceArray<uint8_t>(kernels::CpuOps(), kComm, kDevice);
  }
  for (DeviceArray<float>* a : {&recv_tokens_.scale_inv, &token_scratch_.send_scale_inv}) {
    *a = DeviceArray<float>(kernels::CpuOps(), kComm, kDevice);
  }
  for (DeviceArray<uint16_t>* a : {&token_scratch_.send_bf16, &token_scratch_.recv_bf16}) {
    *a = DeviceArray<uint16_t>(kernels::CpuOps(), kComm, kDevice);
  }
}

std::vector<Linear*> MoeLayer::expert_linears(int64_t e) {
  const size_t i = static_cast<size_t>(e);
  if (swiglu_) return {fc1_[i].get(), up_[i].get(), fc2_[i].get()};
  return {fc1_[i].get(), fc2_[i].get()};
}

void MoeLayer::SetGrads(float* router, std::vector<float*> fc1, std::vector<float*> up,
                        std::vector<float*> fc2) {
  router_grad_ = router;
  fc1_grad_ = std::move(fc1);
  up_grad_ = std::move(up);
  fc2_grad_ = std::move(fc2);
}

absl::StatusOr<MoeStats> MoeLayer::Forward(const LinearContext& ctx, const float* x, int64_t n,
                                           float* out) {
  const int64_t E = config_.experts, K = config_.top_k, C = c_, F = f_;
  const int ep = ep_->size();
  const kernels::LayerOps& L = *ctx.ops->layer;
  x_ = x;
  n_ = n;
  MoeStats stats;
  stats.tokens_per_expert.assign(static_cast<size_t>(E), 0);

  // ---- Router: FP32 logits, softmax, top-k, renormalised gates (an op) ----
  float* logits = AtLeast(ctx, logits_, n * E);
  FP8RT_RETURN_IF_ERROR(router_->Forward(ctx, x, n, logits));
  float* probs = AtLeast(ctx, probs_, n * E);
  int32_t* expert = AtLeast(ctx, expert_, n * K);
  float* gate = AtLeast(ctx, gate_, n * K);
  double* prob_sums = AtLeast(ctx, prob_sums_, E);
  FP8RT_RETURN_IF_ERROR(L.moe_route(probs, expert, gate, prob_sums, logits, n, E, K, {}));
  // The one wait of the layer: the plan below needs the expert ids (and the aux loss the
  // probability sums) on the host: their copies, queued behind the routing.
  FP8RT_RETURN_IF_ERROR(expert_.Download({}, static_cast<size_t>(n * K)));
  FP8RT_RETURN_IF_ERROR(prob_sums_.Download({}, static_cast<size_t>(E)));
  FP8RT_RETURN_IF_ERROR(L.synchronize({}));

  // ---- Capacity (per source rank and expert, in token order) and the aux loss ----
  const int64_t capacity = static_cast<int64_t>(
      std::ceil(config_.capacity_factor * static_cast<double>(n * K) / static_cast<double>(E)));
  std::vector<int64_t> routed(static_cast<size_t>(E), 0);
  std::vector<uint8_t> kept(static_cast<size_t>(n * K), 1);
  for (int64_t a = 0; a < n * K; ++a) {
    const auto e = static_cast<size_t>(expert_[static_cast<size_t>(a)]);
    if (config_.drop_tokens && routed[e] >= capacity) {
      kept[static_cast<size_t>(a)] = 0;
      ++stats.dropped;
    } else {
      ++stats.tokens_per_expert[e];
    }
    ++routed[e];
  }
  AtLeast(ctx, frac_, E);
  double aux = 0.0;
  for (size_t e = 0; e < static_cast<size_t>(E); ++e) {
    frac_[e] = static_cast<float>(routed[e]) / static_cast<float>(n * K);
    aux += frac_[e] * prob_sums_[e] / static_cast<double>(n);
  }
  stats.aux_loss = static_cast<float>(config_.aux_loss_coef * static_cast<double>(E) * aux);

  // ---- The dispatch plan: rows grouped by destination rank, then expert, then token ----
  // A counting sort of the kept assignments by expert (experts are numbered owner by owner), in
  // assignment order within an expert: expert e's rows start after the kept rows of experts < e.
  // The rows sent to each owner are its experts' counts summed, by construction: the token
  // all-to-all below takes each peer's row count from the per-expert counts exchanged next,
  // instead of exchanging them again.
  std::vector<int64_t> slot(static_cast<size_t>(n * K), -1), next(static_cast<size_t>(E), 0);
  send_counts_.assign(static_cast<size_t>(ep), 0);
  sent_ = 0;
  for (int64_t e = 0; e < E; ++e) {
    next[static_cast<size_t>(e)] = sent_;
    sent_ += stats.tokens_per_expert[static_cast<size_t>(e)];
    send_counts_[static_cast<size_t>(OwnerOf(e))] +=
        stats.tokens_per_expert[static_cast<size_t>(e)];
  }
  std::vector<int64_t> send_token(static_cast<size_t>(sent_));
  for (int64_t a = 0; a < n * K; ++a) {
    if (!kept[static_cast<size_t>(a)]) continue;
    int64_t& row = next[static_cast<size_t>(expert_[static_cast<size_t>(a)])];
    slot[static_cast<size_t>(a)] = row;
    send_token[static_cast<size_t>(row++)] = a / K;
  }
  // Each owner learns how many rows of each of its experts every rank sends (what it needs to
  // find each expert's rows among those it receives, without receiving the expert ids).
  std::vector<int64_t> recv_expert_counts(static_cast<size_t>(ep * local_));
  const std::vector<int64_t> per_rank(static_cast<size_t>(ep), local_);
  FP8RT_RETURN_IF_ERROR(ep_->AllToAllV(stats.tokens_per_expert.data(), per_rank,
                                       Displacements(per_rank), recv_expert_counts.data(), per_rank,
                                       Displacements(per_rank), parallel::DType::kI64));
  // Received rows come by source rank; within a source, by expert, then token (the plan above):
  // (source r, local expert le)'s rows start at first_row[r * local + le].
  recv_counts_.assign(static_cast<size_t>(ep), 0);
  std::vector<int64_t> first_row(recv_expert_counts.size());
  received_ = 0;
  for (size_t i = 0; i < recv_expert_counts.size(); ++i) {
    first_row[i] = received_;
    received_ += recv_expert_counts[i];
    recv_counts_[i / static_cast<size_t>(local_)] += recv_expert_counts[i];
  }
  std::vector<int64_t> rows;
  expert_base_.assign(static_cast<size_t>(local_), 0);
  expert_tokens_.assign(static_cast<size_t>(local_), 0);
  expert_padded_.assign(static_cast<size_t>(local_), 0);
  for (int64_t le = 0; le < local_; ++le) {
    expert_base_[static_cast<size_t>(le)] = static_cast<int64_t>(rows.size());
    for (int r = 0; r < ep; ++r) {
      const auto i = static_cast<size_t>(r * local_ + le);
      for (int64_t j = 0; j < recv_expert_counts[i]; ++j) rows.push_back(first_row[i] + j);
    }
    const int64_t ne = static_cast<int64_t>(rows.size()) - expert_base_[static_cast<size_t>(le)];
    expert_tokens_[static_cast<size_t>(le)] = ne;
    // Expert e's layers may have recipes of their own (per-layer precision and scaling).
    bool per_block = false;
    for (const Linear* l : expert_linears(first_local_ + le)) per_block |= PerBlockFp8(*l);
    const int64_t np = ExpertRows(config_, *ctx.ops, per_block, ne);
    expert_padded_[static_cast<size_t>(le)] = np;
    rows.resize(static_cast<size_t>(expert_base_[static_cast<size_t>(le)] + np),
                -1);  // zero rows up to the GEMM row unit
  }
  // The backend has been idle since the wait above: the host writes the plan now, and it goes to
  // the device ahead of the ops that read it.
  FP8RT_RETURN_IF_ERROR(frac_.Upload({}, static_cast<size_t>(E)));
  FP8RT_RETURN_IF_ERROR(Put(ctx, slot_, slot));
  FP8RT_RETURN_IF_ERROR(Put(ctx, send_token_, send_token));
  FP8RT_RETURN_IF_ERROR(Put(ctx, expert_rows_, rows));

  // ---- Dispatch in FP8: the kept assignments' rows to the experts' owners ----
  float* send_rows = AtLeast(ctx, send_rows_, sent_ * C);
  FP8RT_RETURN_IF_ERROR(L.gather_rows(send_rows, x, send_token_.device(), sent_, C, {}));
  parallel::Fp8Tokens& recv = recv_tokens_;
  // The rows each peer sends are known from the per-expert counts: no second count exchange.
  FP8RT_RETURN_IF_ERROR(parallel::AllToAllFp8TokensInto(*ep_, *ctx.ops, send_rows, C, send_counts_,
                                                        kernels::Fp8Format::kE4M3, &token_scratch_,
                                                        &recv, recv_counts_));
  float* recv_x = AtLeast(ctx, recv_x_, received_ * C);
  if (received_ > 0) {
    kernels::DequantizeArgs dq;
    dq.format = kernels::Fp8Format::kE4M3;
    dq.granularity = kernels::Granularity::kTile1x128;
    dq.codes = recv.codes.data();
    dq.rows = received_;
    dq.cols = C;
    dq.scale_inv = recv.scale_inv.data();
    dq.output = recv_x;
    FP8RT_RETURN_IF_ERROR(ctx.ops->dequantize(dq, {}));
  }

  // ---- Local experts: fc1, GELU, fc2 (or gate, up, SwiGLU, down) on the rows each received ----
  // Every received row belongs to exactly one local expert, so the scatters write all of recv_y.
  float* recv_y = AtLeast(ctx, recv_y_, received_ * C);
  for (int64_t le = 0; le < local_; ++le) {
    const int64_t e = first_local_ + le;
    const int64_t ne = expert_tokens_[static_cast<size_t>(le)];
    if (ne == 0) continue;  // an expert without tokens: its sites stay unused this micro-batch
    const int64_t np = expert_padded_[static_cast<size_t>(le)];  // ne real rows, then zero rows
    const int64_t* expert_rows = expert_rows_.device() + expert_base_[static_cast<size_t>(le)];
    float* xe = AtLeast(ctx, xe_[static_cast<size_t>(le)], np * C);
    float* he = AtLeast(ctx, he_[static_cast<size_t>(le)], np * F);
    float* ge = AtLeast(ctx, ge_[static_cast<size_t>(le)], np * F);
    FP8RT_RETURN_IF_ERROR(L.gather_rows(xe, recv_x, expert_rows, np, C, {}));
    float* ye = AtLeast(ctx, ye_, np * C);
    FP8RT_RETURN_IF_ERROR(fc1_[static_cast<size_t>(e)]->Forward(ctx, xe, np, he));
    if (swiglu_) {
      float* ue = AtLeast(ctx, ue_[static_cast<size_t>(le)], np * F);
      FP8RT_RETURN_IF_ERROR(up_[static_cast<size_t>(e)]->Forward(ctx, xe, np, ue));
      FP8RT_RETURN_IF_ERROR(L.swiglu_forward(ge, he, ue, np * F, {}));
    } else {
      FP8RT_RETURN_IF_ERROR(L.gelu_forward(ge, he, np * F, {}));
    }
    if (np > ne) FP8RT_RETURN_IF_ERROR(L.fill(ge + ne * F, 0.0f, (np - ne) * F, {}));
    FP8RT_RETURN_IF_ERROR(fc2_[static_cast<size_t>(e)]->Forward(ctx, ge, np, ye));
    FP8RT_RETURN_IF_ERROR(L.scatter_rows(recv_y, ye, expert_rows, np, C, {}));
  }

  // ---- Combine in BF16: outputs back to the source ranks, weighted by the gates ----
  float* y_back = AtLeast(ctx, y_back_, sent_ * C);
  FP8RT_RETURN_IF_ERROR(parallel::AllToAllBf16Tokens(*ep_, *ctx.ops, recv_y, C, recv_counts_,
                                                     send_counts_, y_back, &token_scratch_));
  FP8RT_RETURN_IF_ERROR(
      L.moe_combine(out, y_back, gate, slot_.device(), expert, n, K, C, /*accumulate=*/false, {}));
  return stats;
}

absl::Status MoeLayer::Backward(const LinearContext& ctx, const float* dout, int64_t n, float dloss,
                                float* dx) {
  if (n != n_ || x_ == nullptr) {
    return absl::FailedPreconditionError(name_ + ": backward without a matching forward");
  }
  const int64_t E = config_.experts, K = config_.top_k, C = c_, F = f_;
  const kernels::LayerOps& L = *ctx.ops->layer;

  // Gate gradients, and the output gradients (times the gates) for the experts.
  float* dgate = AtLeast(ctx, dgate_, n * K);
  float* dy_send = AtLeast(ctx, dy_send_, sent_ * C);
  FP8RT_RETURN_IF_ERROR(L.moe_combine_backward(dy_send, dgate, dout, y_back_.data(), gate_.data(),
                                               slot_.device(), n, K, C, {}));
  float* dy_recv = AtLeast(ctx, dy_recv_, received_ * C);
  FP8RT_RETURN_IF_ERROR(parallel::AllToAllBf16Tokens(*ep_, *ctx.ops, dy_send, C, send_counts_,
                                                     recv_counts_, dy_recv, &token_scratch_));
  // Local experts, reversed.
  float* dx_recv = AtLeast(ctx, dx_recv_, received_ * C);
  for (int64_t le = 0; le < local_; ++le) {
    const int64_t e = first_local_ + le;
    const int64_t ne = expert_tokens_[static_cast<size_t>(le)];
    if (ne == 0) continue;
    const int64_t np = expert_padded_[static_cast<size_t>(le)];  // as the forward's plan
    const int64_t* expert_rows = expert_rows_.device() + expert_base_[static_cast<size_t>(le)];
    float* dye = AtLeast(ctx, dye_, np * C);
    FP8RT_RETURN_IF_ERROR(L.gather_rows(dye, dy_recv, expert_rows, np, C, {}));
    FP8RT_ASSIGN_OR_RETURN(float* const dge, Zeroed(ctx, dge_, np * F));
    FP8RT_ASSIGN_OR_RETURN(float* const dhe, Zeroed(ctx, dhe_, np * F));
    FP8RT_ASSIGN_OR_RETURN(float* const dxe, Zeroed(ctx, dxe_, np * C));
    FP8RT_RETURN_IF_ERROR(fc2_[static_cast<size_t>(e)]->Backward(
        ctx, dye, np, dge, fc2_grad_[static_cast<size_t>(le)]));
    if (swiglu_) {
      FP8RT_ASSIGN_OR_RETURN(float* const due, Zeroed(ctx, due_, np * F));
      FP8RT_RETURN_IF_ERROR(L.swiglu_backward(dhe, due, dge, he_[static_cast<size_t>(le)].data(),
                                              ue_[static_cast<size_t>(le)].data(), np * F, {}));
      FP8RT_RETURN_IF_ERROR(up_[static_cast<size_t>(e)]->Backward(
          ctx, due, np, dxe, up_grad_[static_cast<size_t>(le)]));
    } else {
      FP8RT_RETURN_IF_ERROR(
          L.gelu_backward(dhe, dge, he_[static_cast<size_t>(le)].data(), np * F, {}));
    }
    FP8RT_RETURN_IF_ERROR(fc1_[static_cast<size_t>(e)]->Backward(
        ctx, dhe, np, dxe, fc1_grad_[static_cast<size_t>(le)]));
    FP8RT_RETURN_IF_ERROR(L.scatter_rows(dx_recv, dxe, expert_rows, np, C, {}));
  }
  float* dx_send = AtLeast(ctx, dx_send_, sent_ * C);
  FP8RT_RETURN_IF_ERROR(parallel::AllToAllBf16Tokens(*ep_, *ctx.ops, dx_recv, C, recv_counts_,
                                                     send_counts_, dx_send, &token_scratch_));
  FP8RT_RETURN_IF_ERROR(L.moe_combine(dx, dx_send, /*gate=*/nullptr, slot_.device(),
                                      expert_.device(), n, K, C, /*accumulate=*/true, {}));

  // Router: gates g_j = p_j / S over the token's top-k; the aux loss adds
  // dloss * coef * E * f_e / N to dL/dp_e. Then softmax backward and the FP32 GEMM's.
  float* dlogits = AtLeast(ctx, dlogits_, n * E);
  const float aux_scale = dloss * static_cast<float>(config_.aux_loss_coef) *
                          static_cast<float>(E) / static_cast<float>(n);
  FP8RT_RETURN_IF_ERROR(L.moe_router_backward(dlogits, probs_.data(), expert_.device(),
                                              gate_.data(), dgate, frac_.device(), aux_scale, n, E,
                                              K, {}));
  return router_->Backward(ctx, dlogits, n, dx, router_grad_);
}

}  // namespace fp8rt::model
