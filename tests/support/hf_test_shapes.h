// Small models of the three Hugging Face architectures (runtime/model/hf_weights.h) for the tests
// of weights in and out: 2 layers, d_model 16, 4 heads, d_ff 24, seq_len 8, vocab 32.
//   HfGpt2Shape     GPT-2: LayerNorm, GELU, learned positions (10), biases, tied embeddings
//   HfLlamaShape    Llama: RMSNorm, SwiGLU, RoPE, 2 kv heads, no biases; tied or not
//   HfMixtralShape  Llama (untied) with an MoE MLP of `experts` experts (top 2) in every block
#ifndef FP8RT_TESTS_SUPPORT_HF_TEST_SHAPES_H_
#define FP8RT_TESTS_SUPPORT_HF_TEST_SHAPES_H_

#include <cstdint>

#include "runtime/model/transformer.h"

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

}  // namespace fp8rt::test

#endif  // FP8RT_TESTS_SUPPORT_HF_TEST_SHAPES_H_
