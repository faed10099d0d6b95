// The transformer's non-GEMM layer ops (DESIGN.md section 5): the FP32 CPU reference (span
// functions, below) and LayerOps, the op-table entries through which the model runs them on
// either backend (kernels/ops.h: OpTable::layer). In the llm.c style: each op's forward and
// backward side by side, caller-provided row-major buffers with explicit sizes, no allocation, no
// hidden state.
//
// Index (CPU reference):
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
  uint8_t* codes = nullptr;      // count FP8 codes
  float* scale_inv = nullptr;    // required with codes
  QuantStats* stats = nullptr;   // required with codes (backend memory, like the codes)
  Fp8Format format = Fp8Format::kE4M3;
  bool block = false;
  float scale = 1.0f;            // tensor scaling: finite and > 0
  int64_t rows = 0, cols = 0;    // block scaling: the shard's shape
  int margin = 0;                // block scaling: scale = fp8_max / amax / 2^margin, in [0, 64]
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
// channel count c, head size dh or vocabulary v with rows to process) and, on CUDA, that every
// pointer is device memory, before anything runs. Zero rows (n, or b * t * h) is a valid call that
// does nothing. Then it enqueues its work on `stream` (CPU:
// runs it). Token ids and targets out of [0, V) are the caller's to prevent (the data loader
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
  absl::Status (*attention_forward)(float* out, float* probs, const float* q, const float* k,
                                    const float* v, int64_t b, int64_t t, int64_t h, int64_t dh,
                                    Stream stream);
  absl::Status (*attention_backward)(float* dq, float* dk, float* dv, const float* dout,
                                     const float* q, const float* k, const float* v,
                                     const float* probs, int64_t b, int64_t t, int64_t h,
                                     int64_t dh, Stream stream);
  absl::Status (*gelu_forward)(float* out, const float* x, int64_t n, Stream stream);
  absl::Status (*gelu_backward)(float* dx, const float* dout, const float* x, int64_t n,
                                Stream stream);
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

  // x[0, n) = value; dst[0, n) = src[0, n) (no overlap); dst[c, r] = src[r, c] for a rows x cols
  // matrix. Bit for bit on CUDA.
  absl::Status (*fill)(float* x, float value, int64_t n, Stream stream);
  absl::Status (*copy)(float* dst, const float* src, int64_t n, Stream stream);
  absl::Status (*transpose)(float* dst, const float* src, int64_t rows, int64_t cols,
                            Stream stream);
  // The same for bytes (FP8 codes: the transposed GEMM operands of the backward). Bit for bit.
  absl::Status (*transpose_bytes)(uint8_t* dst, const uint8_t* src, int64_t rows, int64_t cols,
                                  Stream stream);
  // The fused QKV projection's columns are grouped by head: row r of qkv [n, heads * 3 * dh]
  // holds, for head j, q (dh values), k, v. split_heads copies them into q, k, v [n, heads * dh]
  // (head j at columns [j * dh, +dh)); join_heads is its inverse. Bit for bit on CUDA.
  absl::Status (*split_heads)(float* q, float* k, float* v, const float* qkv, int64_t n,
                              int64_t heads, int64_t dh, Stream stream);
  absl::Status (*join_heads)(float* qkv, const float* q, const float* k, const float* v, int64_t n,
                             int64_t heads, int64_t dh, Stream stream);

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
};

}  // namespace fp8rt::kernels

#endif  // FP8RT_KERNELS_LAYER_OPS_H_
