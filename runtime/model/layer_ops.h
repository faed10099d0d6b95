// FP32 CPU reference of the transformer's non-GEMM layer ops (DESIGN.md section 5), in the llm.c
// style: each op's forward and backward side by side, caller-provided row-major buffers with
// explicit sizes, no allocation, no hidden state.
//
// Index:
//   EmbeddingForward / EmbeddingBackward        token ids -> table rows; scatter-add of gradients
//   RmsNormForward / RmsNormBackward            y = x * rstd * w; forward saves rstd per row
//   AttentionForward / AttentionBackward        causal multi-head softmax(q k^T / sqrt(Dh)) v;
//                                               forward saves the probabilities [B, H, T, T]
//   GeluForward / GeluBackward                  tanh approximation
//   ResidualForward / ResidualBackward          out = a + b
//   CrossEntropyForward / CrossEntropyBackward  mean over rows of -log softmax(logits)[target];
//                                               forward saves the probabilities [N, V]
//
// Gradient convention: every backward ACCUMULATES (+=) into the gradient buffers of its inputs
// and parameters, never overwrites them, so gradient accumulation over micro-batches and a
// tensor feeding several consumers (the residual stream) need no extra code. The caller zeroes
// gradient buffers when a new accumulation starts.
//
// Numerics: all arithmetic in FP32 (DESIGN.md section 3 keeps embedding, norms, softmax and loss
// out of FP8); softmaxes subtract the row maximum before exp. Sizes that do not match the spans,
// and token ids or targets out of [0, V), are programming errors and abort (FP8RT_CHECK).
// Outputs must not alias inputs, except ResidualForward's out, which may be a or b.
#ifndef FP8RT_RUNTIME_MODEL_LAYER_OPS_H_
#define FP8RT_RUNTIME_MODEL_LAYER_OPS_H_

#include <cstdint>
#include <span>

namespace fp8rt::model {

// ---- Embedding: tokens [N], table [V, C], out [N, C] ----

// out[n, :] = table[tokens[n], :]
void EmbeddingForward(std::span<float> out, std::span<const int32_t> tokens,
                      std::span<const float> table, int64_t n, int64_t v, int64_t c);
// dtable[tokens[n], :] += dout[n, :]  (scatter-add; repeated tokens add up; accumulates)
void EmbeddingBackward(std::span<float> dtable, std::span<const float> dout,
                       std::span<const int32_t> tokens, int64_t n, int64_t v, int64_t c);

// ---- RMSNorm: x, out [N, C], weight [C], rstd [N] ----

// rstd[n] = 1 / sqrt(mean_c(x[n, c]^2) + eps);  out[n, c] = x[n, c] * rstd[n] * weight[c]
void RmsNormForward(std::span<float> out, std::span<float> rstd, std::span<const float> x,
                    std::span<const float> weight, int64_t n, int64_t c, float eps);
// With g = dout * weight:  dx += rstd * g - rstd^3 * x * mean_c(g * x);
// dweight[c] += sum_n dout[n, c] * x[n, c] * rstd[n]  (accumulates into dx and dweight)
void RmsNormBackward(std::span<float> dx, std::span<float> dweight, std::span<const float> dout,
                     std::span<const float> x, std::span<const float> weight,
                     std::span<const float> rstd, int64_t n, int64_t c);

// ---- Causal multi-head attention core: q, k, v, out [B, T, H, Dh], probs [B, H, T, T] ----

// For each (b, h) and query i:  p[i, j] = softmax_{j <= i}(q_i . k_j / sqrt(Dh)) (0 for j > i);
// out_i = sum_{j <= i} p[i, j] v_j.  probs is saved for the backward.
void AttentionForward(std::span<float> out, std::span<float> probs, std::span<const float> q,
                      std::span<const float> k, std::span<const float> v, int64_t b, int64_t t,
                      int64_t h, int64_t dh);
// dp[i, j] = dout_i . v_j;  ds[i, j] = p[i, j] * (dp[i, j] - sum_j' p[i, j'] dp[i, j']);
// dq_i += sum_j ds[i, j] k_j / sqrt(Dh);  dk_j += sum_i ds[i, j] q_i / sqrt(Dh);
// dv_j += sum_i p[i, j] dout_i  (accumulates into dq, dk and dv)
void AttentionBackward(std::span<float> dq, std::span<float> dk, std::span<float> dv,
                       std::span<const float> dout, std::span<const float> q,
                       std::span<const float> k, std::span<const float> v,
                       std::span<const float> probs, int64_t b, int64_t t, int64_t h, int64_t dh);

// ---- GELU, tanh approximation: x, out [N] ----

// out = 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3)))
void GeluForward(std::span<float> out, std::span<const float> x, int64_t n);
// With u = sqrt(2/pi) (x + 0.044715 x^3):
// dx += dout * (0.5 (1 + tanh u) + 0.5 x (1 - tanh^2 u) sqrt(2/pi) (1 + 3 * 0.044715 x^2))
// (accumulates into dx)
void GeluBackward(std::span<float> dx, std::span<const float> dout, std::span<const float> x,
                  int64_t n);

// ---- Residual add: a, b, out [N] ----

// out = a + b  (out may be a or b: elementwise, in place)
void ResidualForward(std::span<float> out, std::span<const float> a, std::span<const float> b,
                     int64_t n);
// da += dout;  db += dout  (accumulates into da and db)
void ResidualBackward(std::span<float> da, std::span<float> db, std::span<const float> dout,
                      int64_t n);

// ---- Cross-entropy: logits, probs [N, V], targets [N] ----

// probs[n, :] = softmax(logits[n, :]);  returns the mean over n of
// logsumexp(logits[n, :]) - logits[n, targets[n]]  (= -log probs[n, targets[n]]).
float CrossEntropyForward(std::span<float> probs, std::span<const float> logits,
                          std::span<const int32_t> targets, int64_t n, int64_t v);
// dlogits[n, :] += dloss * (probs[n, :] - onehot(targets[n])) / N, the gradient of dloss times
// the mean loss; dloss = 1 gives (softmax - onehot) / N (a step with grad_accum micro-batches
// passes 1 / grad_accum). Accumulates into dlogits like every other backward.
void CrossEntropyBackward(std::span<float> dlogits, std::span<const float> probs,
                          std::span<const int32_t> targets, int64_t n, int64_t v,
                          float dloss = 1.0f);

}  // namespace fp8rt::model

#endif  // FP8RT_RUNTIME_MODEL_LAYER_OPS_H_
