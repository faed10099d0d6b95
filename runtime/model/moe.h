// A mixture-of-experts MLP with expert parallelism over the ep group (DESIGN.md sections 4-5).
//
// Index:
//   MoeConfig   experts, top_k, capacity, auxiliary loss (model_shape.h)
//   MoeStats    what one micro-batch's routing did on this rank (token counts, drops, aux loss)
//   MoeLayer    Forward and Backward side by side
//
// Forward of this rank's N tokens x [N, C]:
//   router       logits = x Wr^T in FP32 (never FP8), probs = softmax, top_k experts per token,
//                gates = the top_k probabilities renormalised to sum to 1 (Mixtral)
//   capacity     with drop_tokens, each expert takes at most ceil(cf * N * top_k / E) of this
//                rank's assignments, in token order; the rest are dropped (the token keeps only
//                its residual path) and counted
//   dispatch     the kept assignments' rows travel to the rank owning the expert in FP8 (E4M3,
//                one scale per 1x128 tile of each row) with their expert ids; also to oneself,
//                so that every layout computes with the same rounded inputs
//   experts      each local expert runs its FP8 MLP on the rows it received, Linear layers with
//                their own sites: fc1, GELU, fc2 (blocks.L.mlp.experts.E.fc1/...), or with
//                `swiglu` (the llama family; Mixtral's w1, w3, w2) down(silu(gate x) * up x)
//                (blocks.L.mlp.experts.E.gate / .up / .down)
//   combine      expert outputs travel back in BF16; out[n] = sum of gate * expert output
//   aux loss     coef * E * sum_e f_e P_e (f_e: fraction of assignments routed to e, P_e: mean
//                router probability of e), added to the loss (Switch Transformer)
// Backward, reversed: output gradients (times the gates) travel to the experts in BF16, the
// experts' input gradients travel back in BF16 (gradients never travel in FP8), and the router
// gets the gradients of the gates and of the aux loss through the renormalisation and softmax.
//
// Every rank holds the Linear objects (and so the FP8 scaling sites) of all E experts, but
// weights only for its local experts: the sites of an expert that received no tokens stay
// unused and their scaling state keeps its scale (an unused site reports amax 0, which a
// ScalingState never records). Weight and gradient buffers are the caller's (Transformer's).
// Not thread-safe; collective over the ep group (every rank of it calls Forward and Backward).
#ifndef FP8RT_RUNTIME_MODEL_MOE_H_
#define FP8RT_RUNTIME_MODEL_MOE_H_

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "kernels/device_array.h"
#include "kernels/host_mirror.h"
#include "parallel/fp8_collectives.h"
#include "runtime/model/linear.h"
#include "runtime/model/model_shape.h"

namespace fp8rt::model {

struct MoeStats {
  std::vector<int64_t> tokens_per_expert;  // kept assignments of this rank's tokens, per expert
  int64_t dropped = 0;                     // assignments over capacity
  float aux_loss = 0.0f;
};

class MoeLayer {
 public:
  // `name` is the block's MLP ("blocks.1.mlp"); experts [first_local, first_local + local) live
  // on this rank (ep_rank * E / ep ...); `ep` is the expert-parallel group.
  MoeLayer(std::string name, const MoeConfig& config, int64_t d_model, int64_t d_ff, bool swiglu,
           GemmPrecision expert_precision, const Fp8SiteConfigs& sites, parallel::Communicator* ep);

  const std::string& name() const { return name_; }
  const MoeConfig& config() const { return config_; }
  Linear& router() { return *router_; }
  bool swiglu() const { return swiglu_; }
  // fc1 is the GELU MLP's fc1 or SwiGLU's gate; fc2 is fc2 or down; up exists with SwiGLU only.
  Linear& fc1(int64_t e) { return *fc1_[static_cast<size_t>(e)]; }
  Linear& up(int64_t e) { return *up_[static_cast<size_t>(e)]; }
  Linear& fc2(int64_t e) { return *fc2_[static_cast<size_t>(e)]; }
  // The expert's GEMMs in order (fc1, fc2 or gate, up, down).
  std::vector<Linear*> expert_linears(int64_t e);
  bool IsLocal(int64_t e) const { return e >= first_local_ && e < first_local_ + local_; }
  int64_t OwnerOf(int64_t e) const { return e / local_; }
  int64_t first_local() const { return first_local_; }
  int64_t local() const { return local_; }

  // Gradient buffers (caller-owned, accumulated into): the router's [E, C] and, for each local
  // expert in order, fc1 (gate) [F, C], up [F, C] (SwiGLU; `up` empty otherwise) and fc2 (down)
  // [C, F].
  void SetGrads(float* router, std::vector<float*> fc1, std::vector<float*> up,
                std::vector<float*> fc2);

  // out[n, :] = MoE(x)[n, :] (overwritten). x must stay valid until Backward.
  absl::StatusOr<MoeStats> Forward(const LinearContext& ctx, const float* x, int64_t n, float* out);
  // dx[n, :] += d(MoE)/dx, parameter gradients +=; `dloss` scales the aux loss's gradient like
  // the cross-entropy's (1 / (grad_accum * dp)).
  absl::Status Backward(const LinearContext& ctx, const float* dout, int64_t n, float dloss,
                        float* dx);

 private:
  const std::string name_;
  const MoeConfig config_;
  const int64_t c_, f_;
  const bool swiglu_;
  parallel::Communicator* ep_;
  int64_t first_local_ = 0, local_ = 0;
  std::unique_ptr<Linear> router_;
  std::vector<std::unique_ptr<Linear>> fc1_, up_, fc2_;  // all experts (up_: SwiGLU only)
  float* router_grad_ = nullptr;
  std::vector<float*> fc1_grad_, up_grad_, fc2_grad_;

  // Saved by Forward for Backward. Routing runs on the backend (LayerOps::moe_route ...), in its
  // memory (kernels::DeviceArray), kept across micro-batches and grown, never shrunk, so that a
  // steady run allocates nothing. The host waits for the backend once per forward, to read the
  // expert ids and plan the dispatch (counts, capacity, the order of the rows), and writes the
  // plan's index arrays then, while the backend is idle; with expert parallelism it waits once
  // more, for the exchange of the per-expert counts (host values); nothing else crosses. So the expert ids,
  // the probability sums and the plan are kernels::HostMirror pairs (device memory for the ops,
  // pinned memory for the host, joined by explicit copies), and everything else is device-only.
  using Array = kernels::DeviceArray<float>;
  using Index = kernels::HostMirror<int64_t>;
  static constexpr kernels::Placement kDevice = kernels::Placement::kDeviceOnly;
  static constexpr kernels::MemCategory kSaved = kernels::MemCategory::kSavedActivations;
  static constexpr kernels::MemCategory kScratch = kernels::MemCategory::kScratch;
  static Array DeviceScratch() { return Array(kernels::CpuOps(), kScratch, kDevice); }
  const float* x_ = nullptr;
  int64_t n_ = 0;
  Array probs_{kernels::CpuOps(), kSaved, kDevice};  // [N, E]
  kernels::HostMirror<int32_t> expert_;              // [N, k]
  Array gate_{kernels::CpuOps(), kSaved, kDevice};   // [N, k]
  kernels::HostMirror<double> prob_sums_;  // [E] router probability summed over the tokens
  kernels::HostMirror<float> frac_;        // [E] fraction of assignments (aux loss)
  Index slot_;                             // [N, k] dispatch row of each assignment; -1 dropped
  Index send_token_;                       // [sent] the token of each dispatched row
  // The received rows of each local expert (source rank, then token order), each expert's list
  // padded with -1 (zero rows) to its GEMM rows; expert le's list starts at expert_base_[le].
  Index expert_rows_;
  // Per local expert: offset, real rows, GEMM rows (real rows and the zero rows after them).
  std::vector<int64_t> expert_base_, expert_tokens_, expert_padded_;
  int64_t sent_ = 0, received_ = 0;
  std::vector<int64_t> send_counts_;      // rows to each ep rank
  std::vector<int64_t> recv_counts_;      // rows from each ep rank
  parallel::Fp8Tokens recv_tokens_;       // the FP8 rows received by the dispatch
  parallel::TokenScratch token_scratch_;  // the token all-to-alls' temporaries
  // Per local expert: inputs, fc1 (gate) out, GELU (SwiGLU) out, up out (SwiGLU), device-only.
  std::vector<Array> xe_, he_, ge_, ue_;
  Array y_back_{kernels::CpuOps(), kSaved, kDevice};  // [sent, C] expert outputs back at this rank

  // Reused temporaries (device-only backend memory).
  Array logits_ = DeviceScratch(), send_rows_ = DeviceScratch(), recv_x_ = DeviceScratch(),
        recv_y_ = DeviceScratch(), ye_ = DeviceScratch();  // forward
  // backward, to the experts, through
  Array dy_send_ = DeviceScratch(), dy_recv_ = DeviceScratch(), dye_ = DeviceScratch(),
        dge_ = DeviceScratch(), dhe_ = DeviceScratch(), due_ = DeviceScratch(),
        dxe_ = DeviceScratch();
  // backward, back and into the router
  Array dx_recv_ = DeviceScratch(), dx_send_ = DeviceScratch(), dgate_ = DeviceScratch(),
        dlogits_ = DeviceScratch();
};

}  // namespace fp8rt::model

#endif  // FP8RT_RUNTIME_MODEL_MOE_H_
