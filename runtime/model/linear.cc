// Linear layer: FP32 / BF16 / FP8 GEMMs with the three FP8 quantization sites (see linear.h).
#include "runtime/model/linear.h"

#include <algorithm>
#include <cmath>
#include <span>

#include "absl/strings/str_cat.h"
#include "runtime/core/status.h"

namespace fp8rt::model {

Linear::Linear(std::string name, int64_t in, int64_t out, GemmPrecision precision,
               const Fp8SiteConfigs& sites)
    : name_(std::move(name)),
      in_(in),
      out_(out),
      precision_(precision),
      input_site_(name_ + "/input", sites.input),
      weight_site_(name_ + "/weight", sites.weight),
      grad_site_(name_ + "/grad_output", sites.grad_output) {
  // The FP8 input is kept from the forward for the backward; the rest is scratch.
  x_codes_.set_category(kernels::MemCategory::kSavedActivations);
  x_scale_inv_.set_category(kernels::MemCategory::kSavedActivations);
  x_e8m0_.set_category(kernels::MemCategory::kSavedActivations);
  xt_codes_.set_category(kernels::MemCategory::kSavedActivations);
  xt_e8m0_.set_category(kernels::MemCategory::kSavedActivations);
  dy_codes_.set_category(kernels::MemCategory::kScratch);
  dy_scale_inv_.set_category(kernels::MemCategory::kScratch);
  dy_e8m0_.set_category(kernels::MemCategory::kScratch);
}

void Linear::Reconfigure(GemmPrecision precision, const Fp8SiteConfigs& sites) {
  precision_ = precision;
  input_site_.Reconfigure(sites.input);
  weight_site_.Reconfigure(sites.weight);
  grad_site_.Reconfigure(sites.grad_output);
}

bool Linear::block_scaling() const {
  return weight_site_.state().config().strategy == train::ScalingStrategy::kBlock;
}

bool Linear::mx32() const {
  return weight_site_.state().config().strategy == train::ScalingStrategy::kMx32;
}

absl::Status Linear::QuantizeActivation(const LinearContext& ctx, QuantSite& site,
                                        PendingStats& pending, const float* src, int64_t rows,
                                        int64_t cols, kernels::DeviceArray<uint8_t>* codes,
                                        kernels::DeviceArray<float>* scale_inv,
                                        kernels::DeviceArray<uint8_t>* e8m0) {
  const train::ScalingState& state = site.state();
  const train::ScalingConfig& cfg = state.config();
  const kernels::OpTable& ops = *ctx.ops;
  if (pending.pending) FP8RT_RETURN_IF_ERROR(FlushStats());  // the site's previous quantization
  // Grown, never shrunk: an MoE expert's rows change every micro-batch, and a buffer sized to
  // each would be freed and allocated again each time.
  codes->Grow(ops, static_cast<size_t>(rows * cols));
  // The statistics are written by the op in device memory and copied for the host (HostMirror);
  // FlushStats records them.
  pending.stats.Reset(ops, 1);
  pending.config = cfg;
  kernels::QuantizeArgs q;
  q.format = cfg.format;
  q.input = src;
  q.rows = rows;
  q.cols = cols;
  q.margin = cfg.margin;
  q.power_of_two_scales = cfg.power_of_two;
  q.codes = codes->data();
  q.stats = pending.stats.device();
  if (cfg.strategy == train::ScalingStrategy::kMx32) {
    q.granularity = kernels::Granularity::kMx32;
    e8m0->Grow(ops, static_cast<size_t>(kernels::GetScaleGrid(q.granularity, rows, cols).size()));
    q.e8m0_scales = e8m0->data();
    pending.from_amax = true;
  } else if (cfg.strategy == train::ScalingStrategy::kBlock) {
    q.granularity = kernels::Granularity::kTile1x128;
    scale_inv->Grow(ops,
                    static_cast<size_t>(kernels::GetScaleGrid(q.granularity, rows, cols).size()));
    q.scale_inv = scale_inv->data();
    pending.from_amax = true;
  } else {
    scale_inv->Reset(ops, 1);
    q.granularity = kernels::Granularity::kTensor;
    q.scale_inv = scale_inv->data();
    pending.from_amax = false;
    pending.from_synced_amax = state.UsesCurrentScaling();
    if (pending.from_synced_amax) {
      // The scale comes from this tensor's amax, max-reduced over TP, all on the device: the amax
      // op writes it into the backend's memory, the TP group max-reduces its bits (an amax is
      // >= 0 or a positive NaN, so int32 order is float order, NaN above Inf, as in
      // parallel::SyncAmaxes), and the quantize op derives the scale from it
      // (QuantizeArgs::scale_amax). The host reads the amax only when it flushes the statistics.
      pending.amax.Reset(ops, 1);
      kernels::AmaxArgs a{.input_type = kernels::InputType::kF32,
                          .input = src,
                          .count = rows * cols,
                          .amax = pending.amax.device()};
      FP8RT_RETURN_IF_ERROR(ops.amax(a, {}));
      if (ctx.tp != nullptr && ctx.tp->size() > 1) {
        // Stream-ordered: the quantize op below is the only reader; NCCL returns once the
        // reduction is on the device's queue, without a host wait.
        FP8RT_RETURN_IF_ERROR(ctx.tp->AllReduce(pending.amax.device(), 1, parallel::DType::kI32,
                                                parallel::ReduceOp::kMax,
                                                parallel::Completion::kStream));
      }
      q.scale_amax = pending.amax.device();
    } else {
      q.has_scale = true;
      q.scale = state.scale();
      pending.scale = q.scale;
    }
  }
  FP8RT_RETURN_IF_ERROR(ops.quantize(q, {}));
  // Their copies for the host, queued behind the quantization; FlushStats waits and reads them.
  FP8RT_RETURN_IF_ERROR(pending.stats.Download({}));
  if (pending.from_synced_amax) FP8RT_RETURN_IF_ERROR(pending.amax.Download({}));
  pending.pending = true;
  return absl::OkStatus();
}

void Linear::Flush(QuantSite& site, PendingStats& p) {
  if (!p.pending) return;
  const kernels::QuantStats stats = p.stats[0];
  const train::ScalingConfig& cfg = p.config;
  // The scale the op quantized with, as it computed it: from this tensor's amax (block and mx32
  // sites record the tensor's), from the TP-synced amax (current scaling), or given (delayed).
  const float scale =
      p.from_amax ? kernels::ComputeScale(stats.amax, cfg.format, cfg.margin, cfg.power_of_two)
      : p.from_synced_amax
          ? kernels::ComputeScale(p.amax[0], cfg.format, cfg.margin, cfg.power_of_two)
          : p.scale;
  site.Record(stats, scale);
  p.pending = false;
}

absl::Status Linear::FlushStats(bool backend_idle) {
  for (PendingStats* p : {&input_pending_, &grad_pending_}) {
    if (p->pending && !backend_idle) {
      FP8RT_RETURN_IF_ERROR(p->stats.ops().layer->synchronize({}));
      break;
    }
  }
  Flush(input_site_, input_pending_);
  Flush(grad_site_, grad_pending_);
  return absl::OkStatus();
}

absl::Status Linear::GemmHigh(const LinearContext& ctx, const float* a, const float* b, int64_t m,
                              int64_t nn, int64_t k, float* d, bool accumulate) {
  if (precision_ == GemmPrecision::kFp32) {
    kernels::F32GemmArgs g{
        .m = m, .n = nn, .k = k, .a = a, .b = b, .d = d, .accumulate = accumulate};
    return ctx.ops->gemm_f32(g, {});
  }
  kernels::Bf16GemmArgs g;
  g.m = m;
  g.n = nn;
  g.k = k;
  g.a = a;
  g.b = b;
  g.d = d;
  g.accumulate = accumulate;
  g.workspace_bytes = ctx.ops->bf16_gemm_workspace_bytes(g);
  FP8RT_ASSIGN_OR_RETURN(g.workspace, ctx.scratch->Get(Scratch::kGemm, g.workspace_bytes));
  return ctx.ops->gemm_bf16(g, {});
}

absl::Status Linear::Forward(const LinearContext& ctx, const float* x, int64_t n, float* y) {
  x_ = saves_fp8_input_only() ? nullptr : x;  // not read again: the FP8 codes are kept
  n_ = n;
  if (precision_ == GemmPrecision::kFp8) return ForwardFp8(ctx, x, n, y);
  if (w_f32_ == nullptr) return absl::FailedPreconditionError(name_ + ": no FP32 weight set");
  return GemmHigh(ctx, x, w_f32_, n, out_, in_, y, false);
}

absl::Status Linear::Backward(const LinearContext& ctx, const float* dy, int64_t n, float* dx,
                              float* dw, BackwardInto into) {
  if (n != n_ || (x_ == nullptr && !saves_fp8_input_only())) {
    return absl::FailedPreconditionError(
        absl::StrCat(name_, ": backward of ", n, " rows without a matching forward"));
  }
  if (precision_ == GemmPrecision::kFp8) return BackwardFp8(ctx, dy, n, dx, dw, into);
  if (dx != nullptr) {
    FP8RT_ASSIGN_OR_RETURN(
        float* wt, ctx.scratch->Get<float>(Scratch::kTransposeB, static_cast<size_t>(in_ * out_)));
    FP8RT_RETURN_IF_ERROR(ctx.ops->layer->transpose(wt, w_f32_, out_, in_, {}));
    FP8RT_RETURN_IF_ERROR(GemmHigh(ctx, dy, wt, n, in_, out_, dx, into.add_dx));
  }
  FP8RT_ASSIGN_OR_RETURN(
      float* dyt, ctx.scratch->Get<float>(Scratch::kTransposeA, static_cast<size_t>(out_ * n)));
  FP8RT_ASSIGN_OR_RETURN(
      float* xt, ctx.scratch->Get<float>(Scratch::kTransposeB, static_cast<size_t>(in_ * n)));
  FP8RT_RETURN_IF_ERROR(ctx.ops->layer->transpose(dyt, dy, n, out_, {}));
  FP8RT_RETURN_IF_ERROR(ctx.ops->layer->transpose(xt, x_, n, in_, {}));
  return GemmHigh(ctx, dyt, xt, out_, in_, n, dw, into.add_dw);
}

namespace {

absl::Status RunFp8Gemm(const LinearContext& ctx, kernels::Fp8GemmArgs g) {
  g.out_type = kernels::OutputType::kF32;
  g.workspace_bytes = ctx.ops->fp8_gemm_workspace_bytes(g);
  FP8RT_ASSIGN_OR_RETURN(g.workspace, ctx.scratch->Get(Scratch::kGemm, g.workspace_bytes));
  return ctx.ops->gemm_fp8(g, {});
}

}  // namespace

absl::StatusOr<const float*> Linear::WithInputOutlier(const LinearContext& ctx, const float* x,
                                                      int64_t n) {
  if (!outlier_armed_ || n * in_ == 0) return x;
  // The input is read and changed on the host: backend memory the host may touch only on the CPU.
  if (ctx.ops->backend != kernels::Backend::kCpu) {
    return absl::FailedPreconditionError(
        absl::StrCat(name_, ": the test fault outlier_act (FP8RT_FAULT) runs on CPU ranks only"));
  }
  const size_t count = static_cast<size_t>(n * in_);
  outlier_x_.assign(x, x + count);
  if (outlier_forwards_left_ > 0) {
    float ref = 0.0f;
    for (float v : outlier_x_) ref = std::max(ref, std::fabs(v));
    for (float h : input_site_.state().history()) ref = std::max(ref, h);
    outlier_value_ = outlier_growth_ * ref;
    --outlier_forwards_left_;
  }
  outlier_x_[0] = outlier_value_;
  return outlier_x_.data();
}

absl::Status Linear::ForwardFp8(const LinearContext& ctx, const float* x, int64_t n, float* y) {
  if (w_fp8_ == nullptr) return absl::FailedPreconditionError(name_ + ": no FP8 weight set");
  FP8RT_ASSIGN_OR_RETURN(x, WithInputOutlier(ctx, x, n));
  FP8RT_RETURN_IF_ERROR(QuantizeActivation(ctx, input_site_, input_pending_, x, n, in_, &x_codes_,
                                           &x_scale_inv_, &x_e8m0_));
  const kernels::Fp8Format input_format = input_site_.state().config().format;
  if (mx32()) {
    // x^T along the tokens for dW, now, from x (the backward never reads x).
    xt_codes_.Grow(*ctx.ops, static_cast<size_t>(n * in_));
    xt_e8m0_.Grow(*ctx.ops, static_cast<size_t>(
                                kernels::GetScaleGrid(kernels::Granularity::kMx32, in_, n).size()));
    FP8RT_RETURN_IF_ERROR(
        QuantizeMx32Transposed(ctx, input_format, x, n, in_, xt_codes_.data(), xt_e8m0_.data()));
  }
  kernels::Fp8GemmArgs g;
  g.m = n;
  g.n = out_;
  g.k = in_;
  g.a = x_codes_.data();
  g.a_format = input_format;
  g.b = w_fp8_->codes.data();
  g.b_format = weight_site_.state().config().format;
  if (mx32()) {
    g.scaling = kernels::GemmScaling::kMx32;
    g.a_e8m0 = x_e8m0_.data();
    g.b_e8m0 = w_fp8_->e8m0.data();
  } else {
    g.a_scale_inv = x_scale_inv_.data();
    g.b_scale_inv = w_fp8_->scale_inv.data();
    g.scaling = block_scaling() ? kernels::GemmScaling::kBlock : kernels::GemmScaling::kTensor;
  }
  g.fast_accum = fast_accum_forward_;  // the forward only (dgrad and wgrad promote)
  g.d = y;
  return RunFp8Gemm(ctx, g);
}

absl::Status Linear::QuantizeMx32Transposed(const LinearContext& ctx, kernels::Fp8Format format,
                                            const float* src, int64_t rows, int64_t cols,
                                            uint8_t* codes, uint8_t* e8m0) {
  FP8RT_ASSIGN_OR_RETURN(
      float* t, ctx.scratch->Get<float>(Scratch::kDequant, static_cast<size_t>(rows * cols)));
  return parallel::QuantizeMx32Transposed(*ctx.ops, format, src, rows, cols, t, codes, e8m0);
}

absl::Status Linear::BackwardMx32(const LinearContext& ctx, const float* dy, int64_t n, float* dx,
                                  float* dw, BackwardInto into) {
  const kernels::Fp8Format grad_format = grad_site_.state().config().format;
  kernels::Fp8GemmArgs g;
  g.scaling = kernels::GemmScaling::kMx32;
  // dx[n, in] += dy[n, out] (W^T)[in, out]^T, K = out: dy along out (the site's quantization),
  // W^T from the weight's column-wise copy (its 32x1 blocks run along out).
  if (dx != nullptr) {
    const kernels::ScaleGrid cg = kernels::GetScaleGrid(kernels::Granularity::kMx32, in_, out_);
    FP8RT_ASSIGN_OR_RETURN(
        uint8_t * wt, ctx.scratch->Get<uint8_t>(Scratch::kCodesB, static_cast<size_t>(in_ * out_)));
    FP8RT_ASSIGN_OR_RETURN(
        uint8_t * ws, ctx.scratch->Get<uint8_t>(Scratch::kScalesB, static_cast<size_t>(cg.size())));
    FP8RT_RETURN_IF_ERROR(
        ctx.ops->layer->transpose_bytes(wt, w_fp8_->col_codes.data(), out_, in_, {}));
    // col_e8m0 is ceil(out/32) x in: transposed, in x ceil(out/32), the grid of W^T.
    FP8RT_RETURN_IF_ERROR(
        ctx.ops->layer->transpose_bytes(ws, w_fp8_->col_e8m0.data(), cg.cols, in_, {}));
    g.m = n;
    g.n = in_;
    g.k = out_;
    g.a = dy_codes_.data();
    g.a_format = grad_format;
    g.a_e8m0 = dy_e8m0_.data();
    g.b = wt;
    g.b_format = weight_site_.state().config().format;
    g.b_e8m0 = ws;
    g.d = dx;
    g.accumulate = into.add_dx;
    FP8RT_RETURN_IF_ERROR(RunFp8Gemm(ctx, g));
  }
  // dw[out, in] += (dy^T)[out, n] (x^T)[in, n]^T, K = n: both along the tokens.
  const kernels::ScaleGrid ag = kernels::GetScaleGrid(kernels::Granularity::kMx32, out_, n);
  FP8RT_ASSIGN_OR_RETURN(
      uint8_t * dyt, ctx.scratch->Get<uint8_t>(Scratch::kCodesA, static_cast<size_t>(out_ * n)));
  FP8RT_ASSIGN_OR_RETURN(
      uint8_t * dyt_e8m0,
      ctx.scratch->Get<uint8_t>(Scratch::kScalesA, static_cast<size_t>(ag.size())));
  FP8RT_RETURN_IF_ERROR(QuantizeMx32Transposed(ctx, grad_format, dy, n, out_, dyt, dyt_e8m0));
  g.m = out_;
  g.n = in_;
  g.k = n;
  g.a = dyt;
  g.a_format = grad_format;
  g.a_e8m0 = dyt_e8m0;
  g.b = xt_codes_.data();
  g.b_format = input_site_.state().config().format;
  g.b_e8m0 = xt_e8m0_.data();
  g.d = dw;
  g.accumulate = into.add_dw;
  return RunFp8Gemm(ctx, g);
}

absl::Status Linear::BackwardFp8(const LinearContext& ctx, const float* dy, int64_t n, float* dx,
                                 float* dw, BackwardInto into) {
  FP8RT_RETURN_IF_ERROR(QuantizeActivation(ctx, grad_site_, grad_pending_, dy, n, out_, &dy_codes_,
                                           &dy_scale_inv_, &dy_e8m0_));
  if (mx32()) return BackwardMx32(ctx, dy, n, dx, dw, into);
  const bool block = block_scaling();
  const kernels::Fp8Format grad_format = grad_site_.state().config().format;
  const kernels::Fp8Format input_format = input_site_.state().config().format;
  const kernels::Fp8Format weight_format = weight_site_.state().config().format;
  kernels::Fp8GemmArgs g;
  g.scaling = block ? kernels::GemmScaling::kBlock : kernels::GemmScaling::kTensor;
  // With tensor scaling, a backend that takes B as K x N gets W (dgrad) and x (wgrad) as they
  // are, instead of transposed copies.
  const bool b_as_kxn = !block && ctx.ops->gemm_fp8_takes_b_transposed;

  // dx[n, in] += dy[n, out] (W^T)[in, out]^T: W^T is W's codes (and block grid) transposed, or W
  // itself given as B^T.
  if (dx != nullptr) {
    const uint8_t* wt = w_fp8_->codes.data();
    if (!b_as_kxn) {
      FP8RT_ASSIGN_OR_RETURN(uint8_t * t, ctx.scratch->Get<uint8_t>(
                                              Scratch::kCodesB, static_cast<size_t>(in_ * out_)));
      FP8RT_RETURN_IF_ERROR(ctx.ops->layer->transpose_bytes(t, wt, out_, in_, {}));
      wt = t;
    }
    const float* wt_scale = w_fp8_->scale_inv.data();
    if (block) {
      const kernels::ScaleGrid grid =
          kernels::GetScaleGrid(kernels::Granularity::kBlock128x128, out_, in_);
      FP8RT_ASSIGN_OR_RETURN(
          float* s, ctx.scratch->Get<float>(Scratch::kScalesB, static_cast<size_t>(grid.size())));
      FP8RT_RETURN_IF_ERROR(
          ctx.ops->layer->transpose(s, w_fp8_->scale_inv.data(), grid.rows, grid.cols, {}));
      wt_scale = s;
    }
    g.m = n;
    g.n = in_;
    g.k = out_;
    g.a = dy_codes_.data();
    g.a_format = grad_format;
    g.a_scale_inv = dy_scale_inv_.data();
    g.b = wt;
    g.b_transposed = b_as_kxn;
    g.b_format = weight_format;
    g.b_scale_inv = wt_scale;
    g.d = dx;
    g.accumulate = into.add_dx;
    FP8RT_RETURN_IF_ERROR(RunFp8Gemm(ctx, g));
  }

  // dw[out, in] += (dy^T)[out, n] (x^T)[in, n]^T.
  FP8RT_ASSIGN_OR_RETURN(
      uint8_t * dyt, ctx.scratch->Get<uint8_t>(Scratch::kCodesA, static_cast<size_t>(out_ * n)));
  FP8RT_ASSIGN_OR_RETURN(uint8_t * xt,
                         ctx.scratch->Get<uint8_t>(Scratch::kCodesB, static_cast<size_t>(in_ * n)));
  const float* dyt_scale = dy_scale_inv_.data();
  const float* xt_scale = x_scale_inv_.data();
  if (!block) {
    FP8RT_RETURN_IF_ERROR(ctx.ops->layer->transpose_bytes(dyt, dy_codes_.data(), n, out_, {}));
    if (b_as_kxn) {
      xt = x_codes_.data();  // x (n x in) is x^T given as K x N
    } else {
      FP8RT_RETURN_IF_ERROR(ctx.ops->layer->transpose_bytes(xt, x_codes_.data(), n, in_, {}));
    }
  } else {
    // New tiles along the token dimension, quantized from the FP32 transposes.
    const train::ScalingConfig& gcfg = grad_site_.state().config();
    const train::ScalingConfig& icfg = input_site_.state().config();
    FP8RT_ASSIGN_OR_RETURN(
        float* dyt32, ctx.scratch->Get<float>(Scratch::kTransposeA, static_cast<size_t>(out_ * n)));
    FP8RT_ASSIGN_OR_RETURN(
        float* xt32, ctx.scratch->Get<float>(Scratch::kTransposeB, static_cast<size_t>(in_ * n)));
    FP8RT_RETURN_IF_ERROR(ctx.ops->layer->transpose(dyt32, dy, n, out_, {}));
    const float* x = x_;
    if (x == nullptr) {
      // FP8-saved input: x as the forward's 1x128-tile codes decode it (x_q, not x).
      FP8RT_ASSIGN_OR_RETURN(
          float* xq, ctx.scratch->Get<float>(Scratch::kDequant, static_cast<size_t>(n * in_)));
      kernels::DequantizeArgs d;
      d.format = icfg.format;
      d.granularity = kernels::Granularity::kTile1x128;
      d.codes = x_codes_.data();
      d.rows = n;
      d.cols = in_;
      d.scale_inv = x_scale_inv_.data();
      d.output = xq;
      FP8RT_RETURN_IF_ERROR(ctx.ops->dequantize(d, {}));
      x = xq;
    }
    FP8RT_RETURN_IF_ERROR(ctx.ops->layer->transpose(xt32, x, n, in_, {}));
    const kernels::ScaleGrid agrid =
        kernels::GetScaleGrid(kernels::Granularity::kTile1x128, out_, n);
    const kernels::ScaleGrid bgrid =
        kernels::GetScaleGrid(kernels::Granularity::kBlock128x128, in_, n);
    FP8RT_ASSIGN_OR_RETURN(
        float* as, ctx.scratch->Get<float>(Scratch::kScalesA, static_cast<size_t>(agrid.size())));
    FP8RT_ASSIGN_OR_RETURN(
        float* bs, ctx.scratch->Get<float>(Scratch::kScalesB, static_cast<size_t>(bgrid.size())));
    kernels::QuantizeArgs q;
    q.format = gcfg.format;
    q.granularity = kernels::Granularity::kTile1x128;
    q.input = dyt32;
    q.rows = out_;
    q.cols = n;
    q.margin = gcfg.margin;
    q.power_of_two_scales = gcfg.power_of_two;
    q.codes = dyt;
    q.scale_inv = as;
    FP8RT_RETURN_IF_ERROR(ctx.ops->quantize(q, {}));
    q.format = icfg.format;
    q.granularity = kernels::Granularity::kBlock128x128;
    q.input = xt32;
    q.rows = in_;
    q.margin = icfg.margin;
    q.power_of_two_scales = icfg.power_of_two;
    q.codes = xt;
    q.scale_inv = bs;
    FP8RT_RETURN_IF_ERROR(ctx.ops->quantize(q, {}));
    dyt_scale = as;
    xt_scale = bs;
  }
  g.m = out_;
  g.n = in_;
  g.k = n;
  g.a = dyt;
  g.a_format = grad_format;
  g.a_scale_inv = dyt_scale;
  g.b = xt;
  g.b_transposed = b_as_kxn;
  g.b_format = input_format;
  g.b_scale_inv = xt_scale;
  g.d = dw;
  g.accumulate = into.add_dw;
  return RunFp8Gemm(ctx, g);
}

}  // namespace fp8rt::model
