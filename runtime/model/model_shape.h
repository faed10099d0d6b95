// The model's sizes and architecture, and its parameters by logical shape: what the run spec
// makes (runtime/spec/run_spec.h) and what a model is built from (transformer.h, moe.h), apart
// from the layers, so that code about the model's shape alone (hf_weights.h: Hugging Face
// names and config.json) needs neither the kernels nor the collectives.
//
// Index:
//   MoeConfig                  experts, top_k, capacity, auxiliary loss (moe.h's layer)
//   ModelShape                 sizes, norm, MLP, positions, biases, tied embeddings, MoE
//   TpSplit, LogicalShape      a parameter's logical [rows, cols] and how TP splits it
//   LogicalParams              logical parameters by name
#ifndef FP8RT_RUNTIME_MODEL_MODEL_SHAPE_H_
#define FP8RT_RUNTIME_MODEL_MODEL_SHAPE_H_

#include <cstdint>
#include <map>
#include <string>
#include <vector>

namespace fp8rt::model {

struct MoeConfig {
  int64_t experts = 0;
  int64_t top_k = 2;
  double capacity_factor = 1.25;
  double aux_loss_coef = 0.01;
  bool drop_tokens = true;
  // Each expert's GEMMs run on its token rows padded with zero rows to a multiple of this (0: the
  // backend's: on CUDA 16 for cuBLASLt, 128 when any of the expert's GEMMs is FP8 with block or
  // mx32 scaling; 1 on the CPU).
  // Padding changes no result; tests set it on the CPU to show that.
  int64_t gemm_row_unit = 0;
};

enum class NormKind : uint8_t { kRms, kLayer };   // RMSNorm gain; LayerNorm gain + bias
enum class MlpKind : uint8_t { kGelu, kSwiglu };  // fc1-GELU-fc2; silu(gate) * up, down
enum class PositionKind : uint8_t { kNone, kLearned, kRope };

struct ModelShape {
  int64_t layers = 0;
  int64_t d_model = 0;
  int64_t heads = 0;
  int64_t d_ff = 0;
  int64_t seq_len = 0;
  int64_t vocab = 0;
  MoeConfig moe;          // moe.experts 0: dense MLPs everywhere
  int64_t moe_every = 1;  // MoE MLP in blocks every-1, 2*every-1, ...
  // The architecture (the run spec's model.family with its overrides; runtime/spec/run_spec.h).
  int64_t kv_heads = 0;  // key/value heads, dividing heads; 0: heads
  NormKind norm = NormKind::kRms;
  float norm_eps = 1e-5f;
  MlpKind mlp = MlpKind::kGelu;
  PositionKind positions = PositionKind::kNone;
  int64_t max_positions = 0;  // rows of the learned position table (>= seq_len)
  float rope_theta = 10000.0f;
  bool bias = false;            // a bias on every linear layer but the LM head
  bool tie_embeddings = false;  // the LM head is the token embedding (no lm_head/weight)

  int64_t kv() const { return kv_heads > 0 ? kv_heads : heads; }
  int64_t head_dim() const { return d_model / heads; }
  // Whether block l has an MoE MLP (blocks every-1, 2*every-1, ... when moe.experts > 0).
  bool HasMoe(int64_t l) const { return moe.experts > 0 && (l + 1) % moe_every == 0; }
};

enum class TpSplit : uint8_t { kNone, kRows, kCols };

// A parameter's logical shape, and logical parameters by name ("blocks.0.attn.qkv/weight"), each
// rows * cols FP32 values of the whole model (before any TP split or FSDP shard), row-major.
struct LogicalShape {
  int64_t rows = 0, cols = 0;
  TpSplit split = TpSplit::kNone;
};
using LogicalParams = std::map<std::string, std::vector<float>>;

}  // namespace fp8rt::model

#endif  // FP8RT_RUNTIME_MODEL_MODEL_SHAPE_H_
