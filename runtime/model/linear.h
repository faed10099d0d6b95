// A linear layer y = x W^T whose GEMMs run in FP32, BF16 or FP8, with its quantization sites.
//
// Index:
//   GemmPrecision   fp32 | bf16 | fp8, per layer (a layer excluded from FP8 runs in BF16)
//   QuantSite       one FP8 quantization site ("blocks.0.mlp.fc1/input"): its ScalingState and
//                   the statistics of the step in progress (merged over micro-batches)
//   LinearContext   what a call needs from outside: op table, TP group, scratch space
//   Linear          forward and backward side by side (llm.c style)
//
// FP8 (DESIGN.md section 3). Every FP8 GEMM has three sites, each with its own scaling state:
//   input        x, E4M3          forward A operand; x^T is the dW GEMM's B operand
//   weight       W, E4M3          forward B operand; W^T is the dX GEMM's B operand
//   grad_output  dy, E5M2 (HYBRID) or E4M3   dX GEMM's A operand; dy^T is the dW GEMM's A operand
// Tensor scaling (delayed, current): one scale per tensor, so the transposed operands are the
// same FP8 codes transposed (a cast-transpose): no second rounding. Block scaling: x and dy get
// one scale per 1x128 tile and W one per 128x128 block (DeepSeek-V3); W^T keeps W's blocks
// (transposed), while x^T and dy^T are quantized again from FP32 in the tile shape their GEMM
// needs (x^T in 128x128 blocks as a B operand, dy^T in 1x128 tiles along the tokens).
// MXFP8 (mx32, OCP MX v1.0): every operand gets one E8M0 scale per 1x32 block along its GEMM's
// K, so no operand is a transpose of another's codes: x is quantized along `in` for the forward
// and x^T along the tokens for dW (both from x, in the forward, so that the backward reads
// neither x nor a double rounding); dy along `out` for dX and dy^T along the tokens for dW; W
// along `in` for the forward and down its columns for dX (the two copies of parallel::Fp8Weight,
// both from the FP32 master).
// A site that quantizes with the scale of the tensor in hand (current scaling, or delayed scaling
// before its history has an amax) takes the max of the amax over the tensor-parallel group
// first, because a TP-split tensor (the input of a row-parallel layer, the output gradient of a
// column-parallel one) is one logical tensor and must have one scale. Delayed scaling uses the
// state's scale; the caller records the step's amaxes (synchronised) after the step.
//
// Gradients accumulate (+=) into dx and dw like every backward of layer_ops.h.
// Not thread-safe; one owner (the model).
#ifndef FP8RT_RUNTIME_MODEL_LINEAR_H_
#define FP8RT_RUNTIME_MODEL_LINEAR_H_

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "kernels/device_array.h"
#include "kernels/host_mirror.h"
#include "kernels/ops.h"
#include "parallel/communicator.h"
#include "parallel/fp8_collectives.h"
#include "runtime/train/scaling.h"

namespace fp8rt::model {

enum class GemmPrecision : uint8_t { kFp32, kBf16, kFp8 };

// One FP8 quantization site.
class QuantSite {
 public:
  QuantSite(std::string name, const train::ScalingConfig& config)
      : name_(std::move(name)), state_(config) {}

  const std::string& name() const { return name_; }
  train::ScalingState& state() { return state_; }
  const train::ScalingState& state() const { return state_; }

  // Statistics of the current step: merged over every quantization of the site in the step.
  const kernels::QuantStats& step_stats() const { return step_stats_; }
  // The (tensor-level) scale the site last quantized with in this step.
  float step_scale() const { return step_scale_; }
  bool used_this_step() const { return used_; }

  void BeginStep() {
    step_stats_ = kernels::QuantStats{};
    step_scale_ = 1.0f;
    used_ = false;
  }
  void Record(const kernels::QuantStats& stats, float scale) {
    step_stats_.Merge(stats);
    step_scale_ = scale;
    used_ = true;
  }
  // A new recipe for the site (a live recipe update): a fresh state with `config` that has seen
  // the old state's amax history, so that delayed scaling does not start from nothing.
  void Reconfigure(const train::ScalingConfig& config) {
    train::ScalingState next(config);
    for (float amax : state_.history()) next.Update(amax);
    state_ = next;
  }

 private:
  const std::string name_;  // fixed after construction
  train::ScalingState state_;
  kernels::QuantStats step_stats_;
  float step_scale_ = 1.0f;
  bool used_ = false;
};

// A growing scratch arena for GEMM workspaces and temporary operands, in memory of the model's
// backend. Slots are distinct buffers; Get may move a slot's storage, so pointers are valid until
// the next Get of that slot. Work queued on a slot may still run when Get hands it out again:
// ops on the one stream run in order, and a slot grows only after the backend has finished.
class Scratch {
 public:
  enum Slot : int {
    kGemm,
    kTransposeA,
    kTransposeB,
    kCodesA,
    kCodesB,
    kScalesA,
    kScalesB,
    kDequant,
    kCount
  };
  explicit Scratch(const kernels::OpTable& ops) : ops_(ops) {
    for (auto& b : buffers_)
      b = kernels::DeviceArray<std::byte>(ops, kernels::MemCategory::kScratch,
                                          kernels::Placement::kDeviceOnly);
  }
  // `count` elements of T in `slot`, of unspecified value (the allocation is 64-byte aligned).
  // Growing a slot (to 5/4 of the request) does not wait for the backend: the slots are
  // device-only memory, used by the ops of the default stream only, and the old buffer is freed
  // in that stream's order (on CUDA cudaFreeAsync on the legacy stream, after the work that
  // reads it), so an MoE expert with more rows than ever before costs no host wait.
  template <typename T = std::byte>
  absl::StatusOr<T*> Get(Slot slot, size_t count) {
    kernels::DeviceArray<std::byte>& buf = buffers_[slot];
    const size_t bytes = count * sizeof(T);
    if (buf.size() < bytes) buf.Reset(ops_, bytes + bytes / 4);
    return reinterpret_cast<T*>(buf.data());
  }

 private:
  const kernels::OpTable& ops_;
  kernels::DeviceArray<std::byte> buffers_[kCount];
};

struct LinearContext {
  const kernels::OpTable* ops = nullptr;
  parallel::Communicator* tp = nullptr;  // amax sync of current-scaled sites; null: no TP
  Scratch* scratch = nullptr;
};

// The FP8 recipe of a layer's sites.
struct Fp8SiteConfigs {
  train::ScalingConfig input;
  train::ScalingConfig weight;
  train::ScalingConfig grad_output;
};

// How Linear::Backward writes its gradients: added to what the buffer holds, or written over it
// (the caller then need not zero it first).
struct BackwardInto {
  bool add_dx = true;
  bool add_dw = true;
};

class Linear {
 public:
  // A layer named `name` ("blocks.0.mlp.fc1") mapping `in` features to `out` (this rank's
  // shapes under tensor parallelism). Sites are named name + "/input" etc.
  Linear(std::string name, int64_t in, int64_t out, GemmPrecision precision,
         const Fp8SiteConfigs& sites);

  const std::string& name() const { return name_; }
  int64_t in() const { return in_; }
  int64_t out() const { return out_; }
  GemmPrecision precision() const { return precision_; }
  bool block_scaling() const;
  bool mx32() const;  // MXFP8 (the weight site's strategy is kMx32)
  // A live recipe change: the GEMM precision (e.g. a layer excluded from FP8 runs in BF16) and
  // the sites' scaling configs (histories carried over). Takes effect at the next Forward.
  void Reconfigure(GemmPrecision precision, const Fp8SiteConfigs& sites);

  // precision.save_fp8_activations: in FP8, Backward reads only the FP8 codes and scales the
  // forward made of x, never x itself, so the caller need not keep x (Forward's `x` may be
  // overwritten after it returns). With tensor scaling the backward is unchanged (it uses the
  // codes transposed either way); with block scaling x^T is requantized in 128x128 blocks from
  // the dequantized 1x128-tile codes instead of from x. No effect outside FP8.
  void set_save_fp8_input(bool on) { save_fp8_input_ = on; }
  // precision.fp8_fast_accum_forward: the forward FP8 GEMM may accumulate without FP32 promotion
  // on a GPU (kernels::Fp8GemmArgs::fast_accum); dgrad and wgrad always promote.
  void set_fast_accum_forward(bool on) { fast_accum_forward_ = on; }
  bool fast_accum_forward() const { return fast_accum_forward_; }
  // True when Backward will not read Forward's FP32 input.
  bool saves_fp8_input_only() const { return save_fp8_input_ && precision_ == GemmPrecision::kFp8; }

  // The weight for this step: FP32 [out, in] (fp32 and bf16 precision) or FP8 (fp8 precision,
  // codes [out, in] with one scale_inv or 128x128 block scales, or mx32's two quantizations).
  // The caller keeps it alive.
  void SetWeight(const float* w) { w_f32_ = w; }
  void SetWeight(const parallel::Fp8Weight* w) { w_fp8_ = w; }

  // The scale a tensor-scaled weight site quantizes with this step (delayed scaling with a
  // history); for current scaling the caller passes the scale from the synchronised amax.
  QuantSite& input_site() { return input_site_; }
  QuantSite& weight_site() { return weight_site_; }
  const QuantSite& weight_site() const { return weight_site_; }
  QuantSite& grad_site() { return grad_site_; }

  // y[n, out] = x[n, in] W^T. `x` must stay valid and unchanged until Backward unless
  // saves_fp8_input_only().
  absl::Status Forward(const LinearContext& ctx, const float* x, int64_t n, float* y);
  // dx[n, in] (+)= dy W;  dw[out, in] (+)= dy^T x  (added unless `into` says otherwise). dx may
  // be null (no input gradient).
  absl::Status Backward(const LinearContext& ctx, const float* dy, int64_t n, float* dx, float* dw,
                        BackwardInto into = {});

  // The statistics of the FP8 quantizations of Forward and Backward stay in the backend's memory
  // (the host does not wait for each quantization) until this records them into the sites,
  // after waiting for the backend, unless the caller says it has (`backend_idle`: the model,
  // once its pass has synchronised); a site quantized twice before it is flushed flushes itself
  // first.
  absl::Status FlushStats(bool backend_idle = false);
  // Test fault (FP8RT_FAULT outlier_act, CPU backend): from the next FP8 forward on, element 0 of
  // the input this layer quantizes becomes `growth` x the larger of its input site's amax
  // history maximum and the input's own amax, for `grow_forwards` forwards, then holds its last
  // value. With delayed scaling the value then lies beyond the range the scale covers whenever
  // growth > 2^margin: the site saturates every step while it grows. The layer's output and
  // gradients see the outlier too. Only the quantized copy is changed; `x` is not written.
  void ArmInputOutlier(float growth, int64_t grow_forwards) {
    outlier_growth_ = growth;
    outlier_forwards_left_ = grow_forwards;
    outlier_armed_ = true;
  }

  // Forgets statistics not yet recorded (a step that failed part-way, before a new one).
  void DropPendingStats() {
    input_pending_.pending = false;
    grad_pending_.pending = false;
  }

 private:
  // ArmInputOutlier's state and its copy of the input.
  bool outlier_armed_ = false;
  float outlier_growth_ = 1.0f, outlier_value_ = 0.0f;
  int64_t outlier_forwards_left_ = 0;
  std::vector<float> outlier_x_;
  // The input with the outlier in element 0 (ArmInputOutlier), or `x` when unarmed;
  // FailedPrecondition, naming the layer, when armed on a backend other than the CPU.
  absl::StatusOr<const float*> WithInputOutlier(const LinearContext& ctx, const float* x,
                                                int64_t n);

  // The statistics of a site's last quantization, not yet recorded into the site.
  struct PendingStats {
    kernels::HostMirror<kernels::QuantStats> stats;   // written by the op, copied for the host
    train::ScalingConfig config;                      // the site's config when it quantized
    float scale = 1.0f;                               // tensor scaling: the scale it quantized with
    bool from_amax = false;  // block scaling: the site's scale is ComputeScale(stats.amax)
    // Current scaling: the scale is ComputeScale(amax[0]), the amax the op quantized with (this
    // tensor's, max-reduced over TP on the device), read by the host only in Flush.
    bool from_synced_amax = false;
    kernels::HostMirror<float> amax;
    bool pending = false;
  };
  static void Flush(QuantSite& site, PendingStats& p);

  // Quantizes a rows x cols FP32 tensor for `site` (tensor, 1x128 or mx32 granularity) into codes
  // and scale_inv (mx32: E8M0 codes into e8m0), recording the statistics. Synchronises the amax
  // over TP when the scale comes from the tensor.
  absl::Status QuantizeActivation(const LinearContext& ctx, QuantSite& site, PendingStats& pending,
                                  const float* src, int64_t rows, int64_t cols,
                                  kernels::DeviceArray<uint8_t>* codes,
                                  kernels::DeviceArray<float>* scale_inv,
                                  kernels::DeviceArray<uint8_t>* e8m0);
  // mx32: rows x cols FP32 `src` transposed and quantized along its new rows (`rows` becomes K)
  // into codes and e8m0 (no statistics: the values are a site's already counted).
  absl::Status QuantizeMx32Transposed(const LinearContext& ctx, kernels::Fp8Format format,
                                      const float* src, int64_t rows, int64_t cols, uint8_t* codes,
                                      uint8_t* e8m0);
  absl::Status BackwardMx32(const LinearContext& ctx, const float* dy, int64_t n, float* dx,
                            float* dw, BackwardInto into);
  absl::Status ForwardFp8(const LinearContext& ctx, const float* x, int64_t n, float* y);
  absl::Status BackwardFp8(const LinearContext& ctx, const float* dy, int64_t n, float* dx,
                           float* dw, BackwardInto into);
  absl::Status GemmHigh(const LinearContext& ctx, const float* a, const float* b, int64_t m,
                        int64_t nn, int64_t k, float* d, bool accumulate);

  // Fixed after construction.
  const std::string name_;
  const int64_t in_, out_;
  GemmPrecision precision_;
  bool save_fp8_input_ = false;
  bool fast_accum_forward_ = false;

  QuantSite input_site_, weight_site_, grad_site_;
  const float* w_f32_ = nullptr;
  const parallel::Fp8Weight* w_fp8_ = nullptr;

  // Saved by Forward for Backward.
  const float* x_ = nullptr;
  int64_t n_ = 0;
  // Device-only memory (kernels/device_array.h): only the backend's entries touch these.
  template <typename T>
  using DeviceOnly = kernels::DeviceArray<T>;
  static constexpr kernels::Placement kDevice = kernels::Placement::kDeviceOnly;
  static constexpr kernels::MemCategory kSaved = kernels::MemCategory::kSavedActivations;
  static constexpr kernels::MemCategory kTemp = kernels::MemCategory::kScratch;
  // FP8: x quantized (tensor scaling: reused transposed)
  DeviceOnly<uint8_t> x_codes_{kernels::CpuOps(), kSaved, kDevice};
  DeviceOnly<float> x_scale_inv_{kernels::CpuOps(), kSaved, kDevice};
  DeviceOnly<uint8_t> x_e8m0_{kernels::CpuOps(), kSaved, kDevice};  // mx32: x's block scales
  // mx32: x^T along the tokens, for dW
  DeviceOnly<uint8_t> xt_codes_{kernels::CpuOps(), kSaved, kDevice},
      xt_e8m0_{kernels::CpuOps(), kSaved, kDevice};
  // Backward temporaries kept to avoid reallocation.
  DeviceOnly<uint8_t> dy_codes_{kernels::CpuOps(), kTemp, kDevice};
  DeviceOnly<float> dy_scale_inv_{kernels::CpuOps(), kTemp, kDevice};
  DeviceOnly<uint8_t> dy_e8m0_{kernels::CpuOps(), kTemp, kDevice};
  PendingStats input_pending_, grad_pending_;
};

}  // namespace fp8rt::model

#endif  // FP8RT_RUNTIME_MODEL_LINEAR_H_
