// Vectorised, threaded CPU layer ops other than the activations (rows_cpu.cc; issue 18): the
// norms, bias, residual, embedding, RoPE, the cross-entropy and the fused AdamW. The formulas
// and argument conventions are kernels/layer_ops.h's; the callers (layer_ops_cpu.cc's entries)
// have checked the sizes. Backwards accumulate (+=) as the references do.
//
// Determinism: a row's result is computed by the same instructions whatever thread runs it, and
// column sums over rows (weight, bias and embedding gradients) run per column block in row order,
// so nothing depends on the OpenMP thread count. Where only elementwise IEEE operations are
// involved the results equal the scalar references (layer_ops_cpu.cc) bit for bit; where a row is
// reduced (a norm's sums, a softmax's denominator) the lane-wise order differs from the
// reference's serial one, within the summation bound the table test derives.
#ifndef FP8RT_KERNELS_CPU_ROWS_CPU_H_
#define FP8RT_KERNELS_CPU_ROWS_CPU_H_

#include <cstdint>
#include <functional>

#include "absl/status/status.h"
#include "kernels/cpu/quantize_one.h"
#include "kernels/layer_ops.h"

namespace fp8rt::kernels::cpu_internal {

// Row-reducing ops: the per-row sums run lane-wise (bounded difference from the reference).
void RmsNormForwardFast(float* out, float* rstd, const float* x, const float* weight, int64_t n,
                        int64_t c, float eps);
void RmsNormBackwardFast(float* dx, float* dweight, const float* dout, const float* x,
                         const float* weight, const float* rstd, int64_t n, int64_t c);
void LayerNormForwardFast(float* out, float* mean, float* rstd, const float* x,
                          const float* weight, const float* bias, int64_t n, int64_t c, float eps);
void LayerNormBackwardFast(float* dx, float* dweight, float* dbias, const float* dout,
                           const float* x, const float* weight, const float* mean,
                           const float* rstd, int64_t n, int64_t c);
// probs [n, v] and the per-row losses (logsumexp - logit[target]).
void CrossEntropyForwardFast(float* probs, float* losses, const float* logits,
                             const int32_t* targets, int64_t n, int64_t v);

// Elementwise or exactly ordered: bit for bit the references.
void CrossEntropyBackwardFast(float* dlogits, const float* probs, const int32_t* targets,
                              int64_t n, int64_t v, float dloss);
void BiasForwardFast(float* out, const float* bias, int64_t n, int64_t c);
void BiasBackwardFast(float* dbias, const float* dout, int64_t n, int64_t c);
void ResidualForwardFast(float* out, const float* a, const float* b, int64_t n);
void ResidualBackwardFast(float* da, float* db, const float* dout, int64_t n);
void EmbeddingForwardFast(float* out, const int32_t* tokens, const float* table, int64_t n,
                          int64_t v, int64_t c);
void EmbeddingBackwardFast(float* dtable, const float* dout, const int32_t* tokens, int64_t n,
                           int64_t v, int64_t c);
// cos and sin of position `pos` at frequency index i of a head of dh channels (kernels/layer_ops.h:
// in double, rounded once to FP32); kernels/cuda/layer_math.cuh's RopeCosSin is the same
// expression.
void RopeCosSin(int64_t pos, int64_t i, int64_t dh, float theta, float& cos_out, float& sin_out);
// forward: out = rotate(x); else dx += rotate^T(dout). The (cos, sin) of each (position,
// frequency) pair is computed once per call, by the reference's expression.
// Rows [r0, r1) of src [rows, cols] into dst [cols, rows] (the transpose entries' strips): 32-column
// blocks, 128-bit squares transposed in registers (4 x 4 floats, 16 x 16 bytes), bit for bit.
void TransposeRows(float* dst, const float* src, int64_t rows, int64_t cols, int64_t r0,
                   int64_t r1);
void TransposeRows(uint8_t* dst, const uint8_t* src, int64_t rows, int64_t cols, int64_t r0,
                   int64_t r1);
void RopeFast(bool forward, float* out, const float* in, int64_t n, int64_t t, int64_t h,
              int64_t dh, float theta);
// Shared by the reference AdamW (layer_ops_cpu.cc) and AdamWFast: the tensor-scaled shard's
// scale_inv and statistics from the merged span statistics; and the block-scaled shard, each
// strip of 128 rows updated by `update(begin, end)` and then quantized while in cache (a block's
// scale needs its updated amax), the strips' statistics merged.
void FinishAdamWTensorShard(const AdamWFp8Output& o, const SpanStats& s, int64_t count);
absl::Status AdamWFp8BlockStrips(const AdamWArgs& k,
                                 const std::function<void(int64_t, int64_t)>& update);
// AdamWUpdate's contract (kernels/layer_ops.h), with the optional FP8 shard of the updated master
// written in the same pass; the update is bit for bit AdamWUpdate's.
absl::Status AdamWFast(const AdamWArgs& args);

}  // namespace fp8rt::kernels::cpu_internal

#endif  // FP8RT_KERNELS_CPU_ROWS_CPU_H_
