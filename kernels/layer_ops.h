// The transformer's non-GEMM layer ops (DESIGN.md section 5): the FP32 CPU reference (span
// functions, below) and LayerOps, the op-table entries through which the model runs them on
// either backend (kernels/ops.h: OpTable::layer). In the llm.c style: each op's forward and
// backward side by side, caller-provided row-major buffers with explicit sizes, no hidden state,
// and no allocation but a few entries' short-lived scratch on CUDA (stream-ordered, listed in
// kernels/cuda/layer_ops_cuda.cu; such an entry may return ResourceExhausted).
//
// Index (CPU reference):
//   EmbeddingForward / EmbeddingBackward        token ids -> table rows; scatter-add of gradients
//   RmsNormForward / RmsNormBackward            y = x * rstd * w; forward saves rstd per row
//   LayerNormForward / LayerNormBackward        y = (x - mean) * rstd * w + b; forward saves mean
//                                               and rstd per row
//   BiasForward / BiasBackward                  out[n, :] += bias; column sums of the gradient
//   RopeForward / RopeBackward                  rotary position embedding (Hugging Face rotate-half
//                                               pairing), in place allowed; backward = transpose
//   AttentionForward / AttentionBackward        causal grouped-query softmax(q k^T / sqrt(Dh)) v
//                                               (Hkv kv heads shared by groups of query heads);
//                                               forward saves the row log-sum-exp [B, H, T];
//                                               backward recomputes the probabilities
//   GeluForward / GeluBackward                  tanh approximation
//   SwigluForward / SwigluBackward              out = silu(gate) * up
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
// Outputs must not alias inputs, except ResidualForward's out, which may be a or b, and
// RopeForward's out, which may be x. Positions: row n of an [N, ...] activation is at position
// n % T (each micro-batch row is a sequence of T tokens starting at position 0).
//
// LayerOps (end of file) are the same ops as table entries taking raw pointers and a stream,
// plus what the model and the optimizer need besides: fill, copy, transpose, the head split of
// the fused QKV projection, the FP64 sum of squares of the gradient norm and the AdamW update.
// Their CPU entries are the functions below (bit for bit); the CUDA entries
// (kernels/cuda/layer_ops_cuda.cu) are tested against them in tests/gpu/layer_ops_cuda_test.cc.
#ifndef FP8RT_KERNELS_LAYER_OPS_H_
#define FP8RT_KERNELS_LAYER_OPS_H_

#include <cstddef>
#include <cstdint>
#include <span>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "kernels/formats.h"
#include "kernels/quantize.h"

namespace fp8rt::kernels {

struct Stream;

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

// ---- LayerNorm with bias: x, out [N, C], weight, bias [C], mean, rstd [N] ----

// mean[n] = mean_c x[n, c];  rstd[n] = 1 / sqrt(mean_c (x[n, c] - mean[n])^2 + eps);
// out[n, c] = (x[n, c] - mean[n]) * rstd[n] * weight[c] + bias[c]. mean and rstd are saved for
// the backward. Both row sums run in c ascending.
void LayerNormForward(std::span<float> out, std::span<float> mean, std::span<float> rstd,
                      std::span<const float> x, std::span<const float> weight,
                      std::span<const float> bias, int64_t n, int64_t c, float eps);
// With xhat = (x - mean) * rstd and g = dout * weight:
// dx += (g - mean_c(g) - xhat * mean_c(g * xhat)) * rstd;
// dweight[c] += sum_n dout[n, c] * xhat[n, c];  dbias[c] += sum_n dout[n, c]  (n ascending;
// accumulates into dx, dweight and dbias)
void LayerNormBackward(std::span<float> dx, std::span<float> dweight, std::span<float> dbias,
                       std::span<const float> dout, std::span<const float> x,
                       std::span<const float> weight, std::span<const float> mean,
                       std::span<const float> rstd, int64_t n, int64_t c);

// ---- Bias: out, dout [N, C], bias [C] ----

// out[n, c] += bias[c]  (in place: the bias of a GEMM's output)
void BiasForward(std::span<float> out, std::span<const float> bias, int64_t n, int64_t c);
// dbias[c] += dout[n, c] for n ascending  (accumulates into dbias)
void BiasBackward(std::span<float> dbias, std::span<const float> dout, int64_t n, int64_t c);

// ---- Rotary position embedding (RoPE): x, out [N, H, Dh], Dh even ----

// Hugging Face's rotate-half pairing: channel i of a head is rotated with channel i + Dh/2. Row n
// is at position p = n % t. For i in [0, Dh/2): inv_freq_i = theta^(-2i/Dh) and angle = p *
// inv_freq_i are computed in double, cos(angle) and sin(angle) in double and then rounded to FP32;
//   out[i] = x[i] * cos - x[i + Dh/2] * sin;  out[i + Dh/2] = x[i + Dh/2] * cos + x[i] * sin
// in FP32 arithmetic. out may be x (in place). Position 0 is the identity.
void RopeForward(std::span<float> out, std::span<const float> x, int64_t n, int64_t t, int64_t h,
                 int64_t dh, float theta);
// The transpose rotation of dout (the same cos and sin), accumulated:
//   dx[i] += dout[i] * cos + dout[i + Dh/2] * sin;  dx[i + Dh/2] += dout[i + Dh/2] * cos -
//   dout[i] * sin  (accumulates into dx, which must not alias dout)
void RopeBackward(std::span<float> dx, std::span<const float> dout, int64_t n, int64_t t, int64_t h,
                  int64_t dh, float theta);

// ---- Causal grouped-query attention core: q, out [B, T, H, Dh], k, v [B, T, Hkv, Dh],
//      lse [B, H, T] ----
// Query head j attends with kv head j / (H / Hkv) (H % Hkv == 0): Hkv == H is multi-head
// attention, Hkv == 1 multi-query attention. No [T, T] matrix is part of the contract: the
// forward saves one float per query row (lse) and the backward recomputes the probabilities
// (flash attention's split), so saved state is O(T) per head.

// For each (b, h) and query i, with scale = 1 / sqrt(Dh) in FP32 and keys j <= i:
//   s_ij = (q_i . k_j) * scale;  m_i = max_j s_ij;  lse_i = m_i + log(sum_j exp(s_ij - m_i));
//   p_ij = exp(s_ij - lse_i) (0 for j > i);  out_i = sum_{j <= i} p_ij v_j.
// lse is saved for the backward.
void AttentionForward(std::span<float> out, std::span<float> lse, std::span<const float> q,
                      std::span<const float> k, std::span<const float> v, int64_t b, int64_t t,
                      int64_t h, int64_t hkv, int64_t dh);
// With p_ij recomputed from q, k and lse as above, and out the forward's output:
// dp_ij = dout_i . v_j;  D_i = dout_i . out_i (= sum_j p_ij dp_ij);
// ds_ij = p_ij * (dp_ij - D_i) * scale;  dq_i += sum_j ds_ij k_j;  dk_j += sum_i ds_ij q_i;
// dv_j += sum_i p_ij dout_i  (accumulates into dq, dk and dv). A kv head's dk and dv add the
// contributions of its query heads in ascending order of the query head, each over i ascending.
void AttentionBackward(std::span<float> dq, std::span<float> dk, std::span<float> dv,
                       std::span<const float> dout, std::span<const float> q,
                       std::span<const float> k, std::span<const float> v,
                       std::span<const float> out, std::span<const float> lse, int64_t b, int64_t t,
                       int64_t h, int64_t hkv, int64_t dh);

// ---- GELU, tanh approximation: x, out [N] ----

// out = 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3)))
void GeluForward(std::span<float> out, std::span<const float> x, int64_t n);
// With u = sqrt(2/pi) (x + 0.044715 x^3):
// dx += dout * (0.5 (1 + tanh u) + 0.5 x (1 - tanh^2 u) sqrt(2/pi) (1 + 3 * 0.044715 x^2))
// (accumulates into dx)
void GeluBackward(std::span<float> dx, std::span<const float> dout, std::span<const float> x,
                  int64_t n);

// ---- SwiGLU: gate, up, out [N] ----

// With s = sigmoid(gate) = 1 / (1 + exp(-gate)):  out = (gate * s) * up = silu(gate) * up
void SwigluForward(std::span<float> out, std::span<const float> gate, std::span<const float> up,
                   int64_t n);
// dgate += (dout * up) * (s * (1 + gate * (1 - s)));  dup += dout * (gate * s)
// (accumulates into dgate and dup)
void SwigluBackward(std::span<float> dgate, std::span<float> dup, std::span<const float> dout,
                    std::span<const float> gate, std::span<const float> up, int64_t n);

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

// ---- The op-table entries (OpTable::layer) ----

// The FP32 AdamW update of one shard, element by element (runtime/train/optimizer.h has the
// formula); the per-step scalars are computed on the host, in FP64, and rounded once to FP32.
// FSDP's FP8 weight shard, written by the AdamW op in the same pass as the update (codes null:
// none). The codes and statistics are bit for bit what the quantize op (kernels/quantize.h) gives
// for the updated master:
//   - tensor scaling (block false): a tensor quantize with the given `scale`; scale_inv
//     receives 1 / scale (one value);
//   - 128x128 block scaling (block true; `scale` unused): a kBlock128x128 quantize of the
//     updated master as a rows x cols matrix (rows * cols == count) with `margin`; scale_inv
//     receives GetScaleGrid(kBlock128x128, rows, cols).size() values. Each block's scale needs
//     the block's updated amax, so the CPU updates 128 rows at a time and quantizes them while
//     they are in cache.
struct AdamWFp8Output {
  uint8_t* codes = nullptr;     // count FP8 codes
  float* scale_inv = nullptr;   // required with codes
  QuantStats* stats = nullptr;  // required with codes (backend memory, like the codes)
  Fp8Format format = Fp8Format::kE4M3;
  bool block = false;
  float scale = 1.0f;          // tensor scaling: finite and > 0
  int64_t rows = 0, cols = 0;  // block scaling: the shard's shape
  int margin = 0;              // block scaling: scale = fp8_max / amax / 2^margin, in [0, 64]
};

struct AdamWArgs {
  float* master = nullptr;      // count values, updated in place
  const float* grad = nullptr;  // count values, read only
  float* m = nullptr;           // first moment, updated in place
  float* v = nullptr;           // second moment, updated in place
  int64_t count = 0;
  float lr = 0.0f;          // learning rate of this step
  float decay = 0.0f;       // lr * weight_decay; 0 for shards without decay
  float clip_scale = 1.0f;  // multiplies each gradient element
  float beta1 = 0.0f, one_minus_beta1 = 1.0f;
  float beta2 = 0.0f, one_minus_beta2 = 1.0f;
  float bias1 = 1.0f, bias2 = 1.0f;  // 1 - beta^t
  float eps = 0.0f;
  AdamWFp8Output fp8{};  // optional: the FP8 shard of the updated master
};

// Checks an AdamWFp8Output against `count` elements (InvalidArgument naming the field and the op
// `op`); OK when codes is null.
absl::Status ValidateAdamWFp8Output(const AdamWFp8Output& out, int64_t count, const char* op);

// The FP32 AdamW update of AdamWArgs on the CPU (the reference): per element, in this order,
//   g = grad * clip_scale;  p = master - decay * master;
//   m = beta1 * m + one_minus_beta1 * g;  v = beta2 * v + one_minus_beta2 * (g * g);
//   master = p - lr * (m / bias1) / (sqrt(v / bias2) + eps)
// with every operation rounded to FP32 (no fused multiply-add); then, with args.fp8.codes, the
// FP8 shard of the new master values (AdamWFp8Output). Returns the quantize op's error, if any,
// of a block-scaled shard (the arguments are checked by the adamw entry, not here).
absl::Status AdamWUpdate(const AdamWArgs& args);

// Sum of x[i]^2 over count FP32 values, accumulated in FP64 in index order (the CPU reference).
double SumOfSquares(const float* x, int64_t count);

// Every entry checks its sizes (InvalidArgument naming the argument: negative sizes; a zero
// channel count c, head size dh or vocabulary v with rows to process; an odd RoPE dh, t <= 0 for
// RoPE, a kv head count hkv that does not divide h) and its scalars (eps finite and >= 0, theta
// finite and > 0) and, on CUDA, that every pointer is device memory, before anything runs. Zero
// rows (n, or b * t * h) is a valid call that does nothing. Then it enqueues its work on `stream`
// (CPU: runs it). Token ids and targets out of [0, V) are the caller's to prevent (the data loader
// checks them against the vocabulary): the CPU entries abort on them, the CUDA entries' results
// are unspecified. Reductions on CUDA use a fixed order (no floating-point atomics), so a result
// depends only on the inputs and the device type: reruns and resumed runs are bit for bit the
// same. Where an entry is bit for bit the CPU reference on CUDA too, it says so (NaN outputs
// excepted: CUDA writes the canonical NaN where the host may keep an input's payload; the CPU is
// compiled without FMA contraction, -std=c++20, which the bit-for-bit claims rely on); the others
// are within the tolerances tests/gpu/layer_ops_cuda_test.cc writes out (exp, tanh, log and sums in
// another order).
struct LayerOps {
  // EmbeddingForward (bit for bit); EmbeddingBackward: dtable accumulates the rows of dout in
  // token order, n ascending, for every table entry (bit for bit: no atomics).
  absl::Status (*embedding_forward)(float* out, const int32_t* tokens, const float* table,
                                    int64_t n, int64_t v, int64_t c, Stream stream);
  absl::Status (*embedding_backward)(float* dtable, const float* dout, const int32_t* tokens,
                                     int64_t n, int64_t v, int64_t c, Stream stream);
  absl::Status (*rmsnorm_forward)(float* out, float* rstd, const float* x, const float* weight,
                                  int64_t n, int64_t c, float eps, Stream stream);
  // dweight accumulates over the rows in a fixed order.
  absl::Status (*rmsnorm_backward)(float* dx, float* dweight, const float* dout, const float* x,
                                   const float* weight, const float* rstd, int64_t n, int64_t c,
                                   Stream stream);
  // q, out, dq [B, T, H, Dh]; k, v, dk, dv [B, T, Hkv, Dh]; lse [B, H, T]. The backward takes
  // the forward's out and lse. dk and dv accumulate a group's query heads in ascending order on
  // both backends. Equal to the reference within the bounds of tests/support/attention_check.h
  // (the summation orders differ: tiles on the CPU, lanes on CUDA).
  absl::Status (*attention_forward)(float* out, float* lse, const float* q, const float* k,
                                    const float* v, int64_t b, int64_t t, int64_t h, int64_t hkv,
                                    int64_t dh, Stream stream);
  absl::Status (*attention_backward)(float* dq, float* dk, float* dv, const float* dout,
                                     const float* q, const float* k, const float* v,
                                     const float* out, const float* lse, int64_t b, int64_t t,
                                     int64_t h, int64_t hkv, int64_t dh, Stream stream);
  // The same contract with BF16 operands in the matrix products (q, k, v, dout, p and ds rounded
  // to BF16, FP32 accumulation, the softmax in FP32), for models whose GEMMs run in BF16 or FP8:
  // on CUDA the fused tensor-core kernels (kernels/cuda/flash_attention_cuda.cu; Dh <= 128 on
  // compute capability 8.0 and later, the FP32 kernels otherwise), within the bounds of
  // attention_check::Precision::Bf16TensorCores. The CPU computes them in FP32 (the entries
  // above: tighter than those bounds).
  absl::Status (*attention_forward_bf16)(float* out, float* lse, const float* q, const float* k,
                                         const float* v, int64_t b, int64_t t, int64_t h,
                                         int64_t hkv, int64_t dh, Stream stream);
  absl::Status (*attention_backward_bf16)(float* dq, float* dk, float* dv, const float* dout,
                                          const float* q, const float* k, const float* v,
                                          const float* out, const float* lse, int64_t b, int64_t t,
                                          int64_t h, int64_t hkv, int64_t dh, Stream stream);
  absl::Status (*gelu_forward)(float* out, const float* x, int64_t n, Stream stream);
  absl::Status (*gelu_backward)(float* dx, const float* dout, const float* x, int64_t n,
                                Stream stream);
  // LayerNormForward (mean and rstd saved per row). LayerNormBackward: dweight and dbias
  // accumulate over the rows in a fixed order.
  absl::Status (*layernorm_forward)(float* out, float* mean, float* rstd, const float* x,
                                    const float* weight, const float* bias, int64_t n, int64_t c,
                                    float eps, Stream stream);
  absl::Status (*layernorm_backward)(float* dx, float* dweight, float* dbias, const float* dout,
                                     const float* x, const float* weight, const float* mean,
                                     const float* rstd, int64_t n, int64_t c, Stream stream);
  // BiasForward (bit for bit on CUDA); BiasBackward: dbias accumulates over the rows in a fixed
  // order. c == 0 is a valid empty call.
  absl::Status (*bias_forward)(float* out, const float* bias, int64_t n, int64_t c, Stream stream);
  absl::Status (*bias_backward)(float* dbias, const float* dout, int64_t n, int64_t c,
                                Stream stream);
  // RopeForward (out may be x) / RopeBackward on x, dx [n, h, dh], row r at position r % t. On
  // CUDA cos and sin are computed in double on the device (the CPU's within an FP32 ulp).
  absl::Status (*rope_forward)(float* out, const float* x, int64_t n, int64_t t, int64_t h,
                               int64_t dh, float theta, Stream stream);
  absl::Status (*rope_backward)(float* dx, const float* dout, int64_t n, int64_t t, int64_t h,
                                int64_t dh, float theta, Stream stream);
  // SwigluForward / SwigluBackward over n values (CUDA: the device expf).
  absl::Status (*swiglu_forward)(float* out, const float* gate, const float* up, int64_t n,
                                 Stream stream);
  absl::Status (*swiglu_backward)(float* dgate, float* dup, const float* dout, const float* gate,
                                  const float* up, int64_t n, Stream stream);
  // Bit for bit on CUDA.
  absl::Status (*residual_forward)(float* out, const float* a, const float* b, int64_t n,
                                   Stream stream);
  absl::Status (*residual_backward)(float* da, float* db, const float* dout, int64_t n,
                                    Stream stream);
  // CrossEntropyForward with the loss of each row written to losses[n] (logsumexp - logit of the
  // target, FP32) instead of their mean: the caller averages them (the model, in row order).
  absl::Status (*cross_entropy_forward)(float* probs, float* losses, const float* logits,
                                        const int32_t* targets, int64_t n, int64_t v,
                                        Stream stream);
  absl::Status (*cross_entropy_backward)(float* dlogits, const float* probs, const int32_t* targets,
                                         int64_t n, int64_t v, float dloss, Stream stream);

  // ---- Mixture-of-experts routing (runtime/model/moe.cc; the per-token arithmetic is
  // kernels/moe_routing.h, shared by both backends). A token t's assignments are a = t * k + j;
  // slot[a] is the row assignment a occupies in the dispatch order, negative when it was
  // dropped. Row indices are int64, negative meaning "no row". ----
  // Per token t < n: probs[t, :] = softmax(logits[t, :]) over e experts, expert[t, :] its k most
  // probable (ties to the lower index), gate[t, :] their probabilities renormalised (RouteToken);
  // prob_sums[x] = sum over t of probs[t, x] in FP64, in token order. k in [1, e]. CUDA: the
  // device expf, otherwise the same operations, but for prob_sums: 32 interleaved partial sums
  // (one warp per expert) added by a fixed tree, the same bits on every run.
  absl::Status (*moe_route)(float* probs, int32_t* expert, float* gate, double* prob_sums,
                            const float* logits, int64_t n, int64_t e, int64_t k, Stream stream);
  // dst[i, :] = src[index[i], :] for i < rows, zeros where index[i] < 0 (the padding rows of an
  // expert's GEMMs). Bit for bit on CUDA.
  absl::Status (*gather_rows)(float* dst, const float* src, const int64_t* index, int64_t rows,
                              int64_t cols, Stream stream);
  // dst[index[i], :] = src[i, :] for i < rows with index[i] >= 0 (distinct). Bit for bit on CUDA.
  absl::Status (*scatter_rows)(float* dst, const float* src, const int64_t* index, int64_t rows,
                               int64_t cols, Stream stream);
  // out[t, :] = (accumulate ? out[t, :] : 0) + sum of w_j * y[slot[t, j], :] over the token's
  // kept assignments in increasing expert order, w_j = gate[t, j] (1 when gate is null: the
  // combine of the experts' input gradients). out [n, c], y [rows, c].
  absl::Status (*moe_combine)(float* out, const float* y, const float* gate, const int64_t* slot,
                              const int32_t* expert, int64_t n, int64_t k, int64_t c,
                              bool accumulate, Stream stream);
  // The combine's backward to the experts' outputs and the gates: for each kept assignment a of
  // token t, dy[slot[a], :] = gate[a] * dout[t, :] and dgate[a] = dout[t, :] . y[slot[a], :]
  // (FP32, column order); dgate[a] = 0 for a dropped one.
  absl::Status (*moe_combine_backward)(float* dy, float* dgate, const float* dout, const float* y,
                                       const float* gate, const int64_t* slot, int64_t n, int64_t k,
                                       int64_t c, Stream stream);
  // dlogits[t, :] (overwritten) through the gates' renormalisation and the softmax, with the aux
  // loss's dL/dp_x = aux_scale * frac[x] (RouterBackwardToken). frac [e].
  absl::Status (*moe_router_backward)(float* dlogits, const float* probs, const int32_t* expert,
                                      const float* gate, const float* dgate, const float* frac,
                                      float aux_scale, int64_t n, int64_t e, int64_t k,
                                      Stream stream);

  // x[0, n) = value; dst[0, n) = src[0, n) (no overlap); dst[c, r] = src[r, c] for a rows x cols
  // matrix. Bit for bit on CUDA.
  absl::Status (*fill)(float* x, float value, int64_t n, Stream stream);
  absl::Status (*copy)(float* dst, const float* src, int64_t n, Stream stream);
  absl::Status (*transpose)(float* dst, const float* src, int64_t rows, int64_t cols,
                            Stream stream);
  // The same for bytes (FP8 codes: the transposed GEMM operands of the backward). Bit for bit.
  absl::Status (*transpose_bytes)(uint8_t* dst, const uint8_t* src, int64_t rows, int64_t cols,
                                  Stream stream);
  // The fused QKV projection's columns are grouped by kv head: row r of qkv
  // [n, kv_heads * (q_per_kv + 2) * dh] holds, for kv head g, the q_per_kv query heads
  // g * q_per_kv, ... (dh values each), then k_g (dh), then v_g (dh). split_heads copies them into
  // q [n, kv_heads * q_per_kv * dh] (query head j at columns [j * dh, +dh)) and k, v
  // [n, kv_heads * dh] (kv head g at [g * dh, +dh)); join_heads is its inverse. q_per_kv = 1 is
  // the multi-head layout (q, k, v of each head). Bit for bit on CUDA.
  absl::Status (*split_heads)(float* q, float* k, float* v, const float* qkv, int64_t n,
                              int64_t kv_heads, int64_t q_per_kv, int64_t dh, Stream stream);
  absl::Status (*join_heads)(float* qkv, const float* q, const float* k, const float* v, int64_t n,
                             int64_t kv_heads, int64_t q_per_kv, int64_t dh, Stream stream);

  // *out = sum of x[i]^2 in FP64 (one double; device memory on CUDA). Non-finite exactly when
  // some x[i] is NaN or Inf. CUDA sums in a fixed tree order: both are within (count - 1) 2^-53
  // of the exact sum, relative to it (all terms are >= 0).
  absl::Status (*sum_squares)(const float* x, int64_t count, double* out, Stream stream);
  // AdamWUpdate. Bit for bit on CUDA.
  absl::Status (*adamw)(const AdamWArgs& args, Stream stream);
  // Waits for the work enqueued on `stream` (CPU: returns at once). Host code reading results
  // of CUDA entries calls it first.
  absl::Status (*synchronize)(Stream stream);

  // Memory the backend's entries can use (DeviceArray, kernels/device_array.h, owns it): CPU,
  // 64-byte aligned host memory; CUDA, managed memory (cudaMallocManaged on the current device),
  // which the host may also read and write once synchronize has returned. Contents are
  // unspecified. ResourceExhausted naming the size when the allocation fails; 0 bytes gives a
  // valid pointer. deallocate takes what allocate gave (or null).
  absl::StatusOr<void*> (*allocate)(size_t bytes);
  void (*deallocate)(void* p);
  // Memory only the backend's entries touch (DeviceArray's Placement::kDeviceOnly): CUDA,
  // device memory from the stream-ordered pool (cudaMallocAsync on the default stream; the host
  // must not read or write it: no page migration, no faults), which deallocate frees in stream
  // order, after the work already queued, without waiting; CPU, as allocate. Same errors as
  // allocate.
  absl::StatusOr<void*> (*allocate_device)(size_t bytes);
  // Memory the host reads once synchronize has returned, which the backend's entries write with
  // plain stores (no atomics: across PCIe those are not guaranteed on host memory)
  // (Placement::kHostRead): CUDA, pinned host memory mapped into the device's address space
  // (cudaHostAlloc, mapped and portable), which kernels write across the bus and the host reads
  // without page faults or migration; CPU, as allocate. Freed by deallocate.
  absl::StatusOr<void*> (*allocate_host)(size_t bytes);
  // p[0, bytes) = 0, enqueued on `stream` (CUDA cudaMemsetAsync; CPU memset at once): how a
  // device-only array is cleared.
  absl::Status (*zero_bytes)(void* p, size_t bytes, Stream stream);
  // Moves allocate's memory [p, p + bytes) to where the entries run, ahead of their first touch,
  // enqueued on `stream`: CUDA, cudaMemPrefetchAsync to the current device (what the host wrote
  // or read, e.g. initial weights or a checkpoint, would otherwise come back page fault by page
  // fault); CPU, nothing.
  absl::Status (*prefetch)(const void* p, size_t bytes, Stream stream);
  // dst[0, bytes) = src[0, bytes), enqueued on `stream` after the work already queued there
  // (CUDA cudaMemcpyAsync; CPU memcpy at once), between any two of the backend's memories: how a
  // small result written on the device (with atomics, or by a collective) reaches a host-read
  // array (kernels/host_mirror.h), and how the host gets rows of a device-only array. The ranges
  // must not overlap. InvalidArgument naming dst or src when one is null (bytes > 0) or, on CUDA,
  // not memory the device can address.
  absl::Status (*copy_bytes)(void* dst, const void* src, size_t bytes, Stream stream);
};

}  // namespace fp8rt::kernels

#endif  // FP8RT_KERNELS_LAYER_OPS_H_
