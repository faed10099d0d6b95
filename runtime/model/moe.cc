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
// cuBLASLt takes FP8 GEMMs only when M, N and K are multiples of 16 (kernels/cuda/gemm_cuda.cc),
// and an expert's token count is whatever the router gave it, so on CUDA each expert's rows are
// padded with zero rows to a multiple of 16 (its forward M, dgrad M and wgrad K). Zero rows change
// no real row, no amax and no gradient: the pad rows of the activation are zeroed again before
// fc2 (a bias would make them nonzero), and their output gradients are zero. The CPU GEMMs take
// any shape: no padding there, so the CPU path is unchanged.
// MoeConfig::gemm_row_unit, when set, replaces the backend's unit.
int64_t ExpertRows(const MoeConfig& config, const kernels::OpTable& ops, int64_t tokens) {
  constexpr int64_t kCudaGemmRowUnit = 16;
  const int64_t unit = config.gemm_row_unit > 0                 ? config.gemm_row_unit
                       : ops.backend == kernels::Backend::kCuda ? kCudaGemmRowUnit
                                                                : 1;
  return (tokens + unit - 1) / unit * unit;
}

std::vector<int64_t> Displacements(const std::vector<int64_t>& counts, int64_t unit) {
  std::vector<int64_t> d(counts.size(), 0);
  for (size_t i = 1; i < counts.size(); ++i) d[i] = d[i - 1] + counts[i - 1] * unit;
  return d;
}

// Waits for the ops queued on the default stream: before the host reads what they wrote, or
// writes what they may still read.
absl::Status Sync(const LinearContext& ctx) { return ctx.ops->layer->synchronize({}); }

// `a` holds max(1, count) elements of the backend (its memory kept when the size is unchanged),
// of unspecified value.
float* Sized(const LinearContext& ctx, kernels::DeviceArray<float>& a, int64_t count) {
  a.Reset(*ctx.ops, static_cast<size_t>(std::max<int64_t>(1, count)));
  return a.data();
}

// `a` as Sized, zero-filled by an op (no host access).
absl::StatusOr<float*> Zeroed(const LinearContext& ctx, kernels::DeviceArray<float>& a,
                              int64_t count) {
  float* p = Sized(ctx, a, count);
  FP8RT_RETURN_IF_ERROR(ctx.ops->layer->fill(p, 0.0f, count, {}));
  return p;
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
    for (int64_t le = 0; le < local_; ++le) v->emplace_back();
  }
  rows_of_.resize(static_cast<size_t>(local_));
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
  x_ = x;
  n_ = n;
  MoeStats stats;
  stats.tokens_per_expert.assign(static_cast<size_t>(E), 0);

  // ---- Router: FP32 logits, softmax, top-k, renormalised gates (on the host) ----
  float* logits = Sized(ctx, logits_, n * E);
  FP8RT_RETURN_IF_ERROR(router_->Forward(ctx, x, n, logits));
  FP8RT_RETURN_IF_ERROR(Sync(ctx));  // logits, and x (written by the model's ops), on the host
  probs_.assign(static_cast<size_t>(n * E), 0.0f);
  expert_.assign(static_cast<size_t>(n * K), 0);
  gate_.assign(static_cast<size_t>(n * K), 0.0f);
  kept_.assign(static_cast<size_t>(n * K), 1);
  std::vector<int64_t> order(static_cast<size_t>(E));
  for (int64_t t = 0; t < n; ++t) {
    const float* l = logits + t * E;
    float* p = probs_.data() + t * E;
    const float mx = *std::max_element(l, l + E);
    float sum = 0.0f;
    for (int64_t e = 0; e < E; ++e) sum += (p[e] = std::exp(l[e] - mx));
    for (int64_t e = 0; e < E; ++e) p[e] /= sum;
    std::iota(order.begin(), order.end(), 0);
    std::partial_sort(order.begin(), order.begin() + K, order.end(),
                      [&](int64_t a, int64_t b) { return p[a] > p[b] || (p[a] == p[b] && a < b); });
    float top = 0.0f;
    for (int64_t j = 0; j < K; ++j) top += p[order[static_cast<size_t>(j)]];
    for (int64_t j = 0; j < K; ++j) {
      const int64_t e = order[static_cast<size_t>(j)];
      expert_[static_cast<size_t>(t * K + j)] = static_cast<int32_t>(e);
      gate_[static_cast<size_t>(t * K + j)] = p[e] / top;
    }
  }
  // ---- Capacity (per source rank and expert, in token order) and the aux loss ----
  const int64_t capacity = static_cast<int64_t>(
      std::ceil(config_.capacity_factor * static_cast<double>(n * K) / static_cast<double>(E)));
  std::vector<int64_t> routed(static_cast<size_t>(E), 0);
  for (int64_t a = 0; a < n * K; ++a) {
    const int32_t e = expert_[static_cast<size_t>(a)];
    if (config_.drop_tokens && routed[static_cast<size_t>(e)] >= capacity) {
      kept_[static_cast<size_t>(a)] = 0;
      ++stats.dropped;
    } else {
      ++stats.tokens_per_expert[static_cast<size_t>(e)];
    }
    ++routed[static_cast<size_t>(e)];
  }
  frac_.assign(static_cast<size_t>(E), 0.0f);
  double aux = 0.0;
  for (int64_t e = 0; e < E; ++e) {
    frac_[static_cast<size_t>(e)] =
        static_cast<float>(routed[static_cast<size_t>(e)]) / static_cast<float>(n * K);
    double mean_p = 0.0;
    for (int64_t t = 0; t < n; ++t) mean_p += probs_[static_cast<size_t>(t * E + e)];
    aux += frac_[static_cast<size_t>(e)] * mean_p / static_cast<double>(n);
  }
  stats.aux_loss = static_cast<float>(config_.aux_loss_coef * static_cast<double>(E) * aux);

  // ---- Dispatch: rows grouped by destination rank, then expert, then token ----
  send_order_.clear();
  send_counts_.assign(static_cast<size_t>(ep), 0);
  for (int64_t e = 0; e < E; ++e) {
    for (int64_t a = 0; a < n * K; ++a) {
      if (kept_[static_cast<size_t>(a)] && expert_[static_cast<size_t>(a)] == e) {
        send_order_.push_back(a);
        ++send_counts_[static_cast<size_t>(OwnerOf(e))];
      }
    }
  }
  const int64_t sent = static_cast<int64_t>(send_order_.size());
  float* send_rows = Sized(ctx, send_rows_, sent * C);
  std::vector<int32_t> send_ids(static_cast<size_t>(std::max<int64_t>(1, sent)));
  for (int64_t i = 0; i < sent; ++i) {
    const int64_t a = send_order_[static_cast<size_t>(i)];
    std::memcpy(send_rows + i * C, x + (a / K) * C, static_cast<size_t>(C) * sizeof(float));
    send_ids[static_cast<size_t>(i)] = expert_[static_cast<size_t>(a)];
  }
  FP8RT_ASSIGN_OR_RETURN(parallel::Fp8Tokens recv,
                         parallel::AllToAllFp8Tokens(*ep_, *ctx.ops, send_rows, C, send_counts_,
                                                     kernels::Fp8Format::kE4M3));
  recv_counts_ = recv.recv_counts;
  const int64_t received = recv.tokens;
  recv_expert_.assign(static_cast<size_t>(std::max<int64_t>(1, received)), 0);
  FP8RT_RETURN_IF_ERROR(ep_->AllToAllV(
      send_ids.data(), send_counts_, Displacements(send_counts_, 1), recv_expert_.data(),
      recv_counts_, Displacements(recv_counts_, 1), parallel::DType::kI32));
  float* recv_x = Sized(ctx, recv_x_, received * C);
  if (received > 0) {
    kernels::DequantizeArgs dq;
    dq.format = kernels::Fp8Format::kE4M3;
    dq.granularity = kernels::Granularity::kTile1x128;
    dq.codes = recv.codes.data();
    dq.rows = received;
    dq.cols = C;
    dq.scale_inv = recv.scale_inv.data();
    dq.output = recv_x;
    FP8RT_RETURN_IF_ERROR(ctx.ops->dequantize(dq, {}));
    FP8RT_RETURN_IF_ERROR(Sync(ctx));
  }

  // ---- Local experts: fc1, GELU, fc2 (or gate, up, SwiGLU, down) on the rows each received ----
  // Every received row belongs to a local expert, so each row of recv_y is written below; the
  // zeros are for a rank that received none (the one-element buffer).
  float* recv_y = Sized(ctx, recv_y_, received * C);
  std::fill(recv_y, recv_y + std::max<int64_t>(1, received * C), 0.0f);
  for (int64_t le = 0; le < local_; ++le) {
    const int64_t e = first_local_ + le;
    std::vector<int64_t>& rows = rows_of_[static_cast<size_t>(le)];
    rows.clear();
    for (int64_t r = 0; r < received; ++r) {
      if (recv_expert_[static_cast<size_t>(r)] == e) rows.push_back(r);
    }
    const int64_t ne = static_cast<int64_t>(rows.size());
    if (ne == 0) continue;  // an expert without tokens: its sites stay unused this micro-batch
    const int64_t np = ExpertRows(config_, *ctx.ops, ne);  // ne real rows, then zero rows
    // The host is in step with the backend here (synchronised above or at the end of the
    // previous expert), so it may fill xe and read ye.
    float* xe = Sized(ctx, xe_[static_cast<size_t>(le)], np * C);
    float* he = Sized(ctx, he_[static_cast<size_t>(le)], np * F);
    float* ge = Sized(ctx, ge_[static_cast<size_t>(le)], np * F);
    for (int64_t i = 0; i < ne; ++i) {
      std::memcpy(xe + i * C, recv_x + rows[static_cast<size_t>(i)] * C,
                  static_cast<size_t>(C) * sizeof(float));
    }
    std::fill(xe + ne * C, xe + np * C, 0.0f);
    float* ye = Sized(ctx, ye_, np * C);
    FP8RT_RETURN_IF_ERROR(fc1_[static_cast<size_t>(e)]->Forward(ctx, xe, np, he));
    if (swiglu_) {
      float* ue = Sized(ctx, ue_[static_cast<size_t>(le)], np * F);
      FP8RT_RETURN_IF_ERROR(up_[static_cast<size_t>(e)]->Forward(ctx, xe, np, ue));
      FP8RT_RETURN_IF_ERROR(ctx.ops->layer->swiglu_forward(ge, he, ue, np * F, {}));
    } else {
      FP8RT_RETURN_IF_ERROR(ctx.ops->layer->gelu_forward(ge, he, np * F, {}));
    }
    if (np > ne) {
      FP8RT_RETURN_IF_ERROR(ctx.ops->layer->fill(ge + ne * F, 0.0f, (np - ne) * F, {}));
    }
    FP8RT_RETURN_IF_ERROR(fc2_[static_cast<size_t>(e)]->Forward(ctx, ge, np, ye));
    FP8RT_RETURN_IF_ERROR(Sync(ctx));
    for (int64_t i = 0; i < ne; ++i) {
      std::memcpy(recv_y + rows[static_cast<size_t>(i)] * C, ye + i * C,
                  static_cast<size_t>(C) * sizeof(float));
    }
  }

  // ---- Combine in BF16: outputs back to the source ranks, weighted by the gates ----
  Sized(ctx, y_back_, sent * C);
  FP8RT_RETURN_IF_ERROR(parallel::AllToAllBf16Tokens(*ep_, *ctx.ops, recv_y, C, recv_counts_,
                                                     send_counts_, y_back_.data()));
  FP8RT_RETURN_IF_ERROR(Sync(ctx));  // y_back_ (converted by an op) and `out` on the host
  std::fill(out, out + n * C, 0.0f);
  for (int64_t i = 0; i < sent; ++i) {
    const int64_t a = send_order_[static_cast<size_t>(i)];
    const float g = gate_[static_cast<size_t>(a)];
    float* o = out + (a / K) * C;
    const float* y = y_back_.data() + i * C;
    for (int64_t c = 0; c < C; ++c) o[c] += g * y[c];
  }
  return stats;
}

absl::Status MoeLayer::Backward(const LinearContext& ctx, const float* dout, int64_t n, float dloss,
                                float* dx) {
  if (n != n_ || x_ == nullptr) {
    return absl::FailedPreconditionError(name_ + ": backward without a matching forward");
  }
  const int64_t E = config_.experts, K = config_.top_k, C = c_, F = f_;
  const int64_t sent = static_cast<int64_t>(send_order_.size());
  int64_t received = 0;
  for (int64_t c : recv_counts_) received += c;

  // Gate gradients, and the output gradients (times the gates) for the experts, on the host:
  // dout and dx were written by the model's ops.
  FP8RT_RETURN_IF_ERROR(Sync(ctx));
  std::vector<float> dgate(static_cast<size_t>(n * K), 0.0f);
  float* dy_send = Sized(ctx, dy_send_, sent * C);
  for (int64_t i = 0; i < sent; ++i) {
    const int64_t a = send_order_[static_cast<size_t>(i)];
    const float* d = dout + (a / K) * C;
    const float* y = y_back_.data() + i * C;
    const float g = gate_[static_cast<size_t>(a)];
    float dot = 0.0f;
    for (int64_t c = 0; c < C; ++c) {
      dy_send[i * C + c] = g * d[c];
      dot += d[c] * y[c];
    }
    dgate[static_cast<size_t>(a)] = dot;
  }
  float* dy_recv = Sized(ctx, dy_recv_, received * C);
  FP8RT_RETURN_IF_ERROR(parallel::AllToAllBf16Tokens(*ep_, *ctx.ops, dy_send, C, send_counts_,
                                                     recv_counts_, dy_recv));
  FP8RT_RETURN_IF_ERROR(Sync(ctx));
  // Local experts, reversed; each ends in step with the host (it copies dxe out).
  float* dx_recv = Sized(ctx, dx_recv_, received * C);
  std::fill(dx_recv, dx_recv + std::max<int64_t>(1, received * C), 0.0f);
  for (int64_t le = 0; le < local_; ++le) {
    const int64_t e = first_local_ + le;
    const std::vector<int64_t>& rows = rows_of_[static_cast<size_t>(le)];
    const int64_t ne = static_cast<int64_t>(rows.size());
    if (ne == 0) continue;
    const int64_t np = ExpertRows(config_, *ctx.ops, ne);  // as in the forward: zero rows after ne
    float* dye = Sized(ctx, dye_, np * C);
    for (int64_t i = 0; i < ne; ++i) {
      std::memcpy(dye + i * C, dy_recv + rows[static_cast<size_t>(i)] * C,
                  static_cast<size_t>(C) * sizeof(float));
    }
    std::fill(dye + ne * C, dye + np * C, 0.0f);
    FP8RT_ASSIGN_OR_RETURN(float* const dge, Zeroed(ctx, dge_, np * F));
    FP8RT_ASSIGN_OR_RETURN(float* const dhe, Zeroed(ctx, dhe_, np * F));
    FP8RT_ASSIGN_OR_RETURN(float* const dxe, Zeroed(ctx, dxe_, np * C));
    FP8RT_RETURN_IF_ERROR(fc2_[static_cast<size_t>(e)]->Backward(
        ctx, dye, np, dge, fc2_grad_[static_cast<size_t>(le)]));
    if (swiglu_) {
      FP8RT_ASSIGN_OR_RETURN(float* const due, Zeroed(ctx, due_, np * F));
      FP8RT_RETURN_IF_ERROR(
          ctx.ops->layer->swiglu_backward(dhe, due, dge, he_[static_cast<size_t>(le)].data(),
                                          ue_[static_cast<size_t>(le)].data(), np * F, {}));
      FP8RT_RETURN_IF_ERROR(up_[static_cast<size_t>(e)]->Backward(
          ctx, due, np, dxe, up_grad_[static_cast<size_t>(le)]));
    } else {
      FP8RT_RETURN_IF_ERROR(
          ctx.ops->layer->gelu_backward(dhe, dge, he_[static_cast<size_t>(le)].data(), np * F, {}));
    }
    FP8RT_RETURN_IF_ERROR(fc1_[static_cast<size_t>(e)]->Backward(
        ctx, dhe, np, dxe, fc1_grad_[static_cast<size_t>(le)]));
    FP8RT_RETURN_IF_ERROR(Sync(ctx));
    for (int64_t i = 0; i < ne; ++i) {
      std::memcpy(dx_recv + rows[static_cast<size_t>(i)] * C, dxe + i * C,
                  static_cast<size_t>(C) * sizeof(float));
    }
  }
  float* dx_send = Sized(ctx, dx_send_, sent * C);
  FP8RT_RETURN_IF_ERROR(parallel::AllToAllBf16Tokens(*ep_, *ctx.ops, dx_recv, C, recv_counts_,
                                                     send_counts_, dx_send));
  FP8RT_RETURN_IF_ERROR(Sync(ctx));
  for (int64_t i = 0; i < sent; ++i) {
    const int64_t a = send_order_[static_cast<size_t>(i)];
    float* d = dx + (a / K) * C;
    const float* s = dx_send + i * C;
    for (int64_t c = 0; c < C; ++c) d[c] += s[c];
  }

  // Router: gates g_j = p_j / S over the token's top-k; the aux loss adds
  // dloss * coef * E * f_e / N to dL/dp_e. Then softmax backward and the FP32 GEMM's.
  float* dlogits = Sized(ctx, dlogits_, n * E);
  std::vector<float> dp(static_cast<size_t>(E));
  const float aux_scale = dloss * static_cast<float>(config_.aux_loss_coef) *
                          static_cast<float>(E) / static_cast<float>(n);
  for (int64_t t = 0; t < n; ++t) {
    const float* p = probs_.data() + t * E;
    for (int64_t e = 0; e < E; ++e)
      dp[static_cast<size_t>(e)] = aux_scale * frac_[static_cast<size_t>(e)];
    float top = 0.0f, gdg = 0.0f;
    for (int64_t j = 0; j < K; ++j) {
      top += p[expert_[static_cast<size_t>(t * K + j)]];
      gdg += gate_[static_cast<size_t>(t * K + j)] * dgate[static_cast<size_t>(t * K + j)];
    }
    for (int64_t j = 0; j < K; ++j) {
      const int32_t e = expert_[static_cast<size_t>(t * K + j)];
      dp[static_cast<size_t>(e)] += (dgate[static_cast<size_t>(t * K + j)] - gdg) / top;
    }
    float pdp = 0.0f;
    for (int64_t e = 0; e < E; ++e) pdp += p[e] * dp[static_cast<size_t>(e)];
    for (int64_t e = 0; e < E; ++e) {
      dlogits[t * E + e] = p[e] * (dp[static_cast<size_t>(e)] - pdp);
    }
  }
  return router_->Backward(ctx, dlogits, n, dx, router_grad_);
}

}  // namespace fp8rt::model
