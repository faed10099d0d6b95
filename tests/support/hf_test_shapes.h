// Small models of the three Hugging Face architectures (runtime/model/hf_weights.h) for the tests
// of weights in and out: 2 layers, d_model 16, 4 heads, d_ff 24, seq_len 8, vocab 32.
//   HfGpt2Shape     GPT-2: LayerNorm, GELU, learned positions (10), biases, tied embeddings
//   HfLlamaShape    Llama: RMSNorm, SwiGLU, RoPE, 2 kv heads, no biases; tied or not
//   HfMixtralShape  Llama (untied) with an MoE MLP of `experts` experts (top 2) in every block
//   HfParamShapes   the logical parameter shapes of one of them, by fp8rt name
#ifndef FP8RT_TESTS_SUPPORT_HF_TEST_SHAPES_H_
#define FP8RT_TESTS_SUPPORT_HF_TEST_SHAPES_H_

#include <cstdint>
#include <map>
#include <string>

#include "runtime/model/model_shape.h"

namespace fp8rt::test {

inline model::ModelShape HfBaseShape() {
  model::ModelShape s;
  s.layers = 2;
  s.d_model = 16;
  s.heads = 4;
  s.d_ff = 24;
  s.seq_len = 8;
  s.vocab = 32;
  return s;
}

inline model::ModelShape HfGpt2Shape() {
  model::ModelShape s = HfBaseShape();
  s.norm = model::NormKind::kLayer;
  s.bias = true;
  s.positions = model::PositionKind::kLearned;
  s.max_positions = 10;
  s.tie_embeddings = true;
  return s;
}

inline model::ModelShape HfLlamaShape(bool tie) {
  model::ModelShape s = HfBaseShape();
  s.kv_heads = 2;
  s.mlp = model::MlpKind::kSwiglu;
  s.positions = model::PositionKind::kRope;
  s.tie_embeddings = tie;
  return s;
}

inline model::ModelShape HfMixtralShape(int64_t experts) {
  model::ModelShape s = HfLlamaShape(false);
  s.moe.experts = experts;
  s.moe.top_k = 2;
  s.moe.aux_loss_coef = 0.02;
  s.moe_every = 1;
  return s;
}

// The logical parameter shapes Transformer::Build gives a shape of the three architectures
// (written out from transformer.h's layer list, not asked of it; TP split left kNone).
inline std::map<std::string, model::LogicalShape> HfParamShapes(const model::ModelShape& s) {
  const int64_t c = s.d_model, f = s.d_ff, dh = s.head_dim(), qkv = (s.heads + 2 * s.kv()) * dh;
  std::map<std::string, model::LogicalShape> m;
  const bool gpt2 = s.norm == model::NormKind::kLayer;
  m["embedding/weight"] = {s.vocab, c};
  if (gpt2) m["positions/weight"] = {s.max_positions, c};
  for (int64_t l = 0; l < s.layers; ++l) {
    const std::string p = "blocks." + std::to_string(l) + ".";
    for (const char* n : {"attn_norm", "mlp_norm"}) {
      m[p + n + "/weight"] = {1, c};
      if (gpt2) m[p + n + "/bias"] = {1, c};
    }
    m[p + "attn.qkv/weight"] = {qkv, c};
    m[p + "attn.proj/weight"] = {c, c};
    if (gpt2) {
      m[p + "attn.qkv/bias"] = {qkv, 1};
      m[p + "attn.proj/bias"] = {1, c};
      m[p + "mlp.fc1/weight"] = {f, c};
      m[p + "mlp.fc1/bias"] = {f, 1};
      m[p + "mlp.fc2/weight"] = {c, f};
      m[p + "mlp.fc2/bias"] = {1, c};
    } else if (s.HasMoe(l)) {
      m[p + "mlp.router/weight"] = {s.moe.experts, c};
      for (int64_t e = 0; e < s.moe.experts; ++e) {
        const std::string x = p + "mlp.experts." + std::to_string(e) + ".";
        m[x + "gate/weight"] = {f, c};
        m[x + "up/weight"] = {f, c};
        m[x + "down/weight"] = {c, f};
      }
    } else {
      m[p + "mlp.gate/weight"] = {f, c};
      m[p + "mlp.up/weight"] = {f, c};
      m[p + "mlp.down/weight"] = {c, f};
    }
  }
  m["final_norm/weight"] = {1, c};
  if (gpt2) m["final_norm/bias"] = {1, c};
  if (!s.tie_embeddings) m["lm_head/weight"] = {s.vocab, c};
  return m;
}

}  // namespace fp8rt::test

#endif  // FP8RT_TESTS_SUPPORT_HF_TEST_SHAPES_H_
