// The CPU table's attention core (kernels/layer_ops.h: attention_forward, attention_backward):
// flash attention on GEMM tiles (oneDNN's sgemm per 64 x 64 tile, called on the task's thread),
// the softmax vectorised with Highway, tasks on the OpenMP team.
//
// Forward, one task per (batch row, query head): query tiles of kTileQ rows against key tiles of
// kTileK keys up to the diagonal. Per tile pair, S = scale Q K^T (a tile GEMM), the causal mask, an
// online softmax (running maximum and sum, the output accumulator rescaled when the maximum
// grows: at most one rescaling per key tile), then O += P V (a tile GEMM). At the end out =
// O / l and lse = m + log l. Only the [T] lse is saved; no [T, T] matrix exists at any time: the
// working set is a few tiles per thread, O(T) per head with the output.
//
// Backward, one task per (batch row, kv head) so that the task owns its dk and dv and its query
// heads' dq (no atomics, no reduction across threads): for each query head of the group
// ascending, each query tile, each key tile up to the diagonal, P is recomputed from S and lse,
// dP = dO V^T, dS = P (dP - D) scale with D_i = dout_i . out_i, and dQ += dS K, dK += dS^T Q,
// dV += P^T dO (tile GEMMs accumulating in place).
//
// Determinism: a task's arithmetic does not depend on the thread that runs it or on the team's
// size, so reruns and thread counts give the same bits. Accuracy: within the bounds of
// tests/support/attention_check.h (the summation orders are the tiles' and oneDNN's).
#ifndef FP8RT_KERNELS_CPU_ATTENTION_CPU_H_
#define FP8RT_KERNELS_CPU_ATTENTION_CPU_H_

#include <cstdint>

namespace fp8rt::kernels::cpu_internal {

inline constexpr int64_t kAttentionTileQ = 64;
inline constexpr int64_t kAttentionTileK = 64;

void AttentionForwardFast(float* out, float* lse, const float* q, const float* k, const float* v,
                          int64_t b, int64_t t, int64_t h, int64_t hkv, int64_t dh);
void AttentionBackwardFast(float* dq, float* dk, float* dv, const float* dout, const float* q,
                           const float* k, const float* v, const float* out, const float* lse,
                           int64_t b, int64_t t, int64_t h, int64_t hkv, int64_t dh);

}  // namespace fp8rt::kernels::cpu_internal

#endif  // FP8RT_KERNELS_CPU_ATTENTION_CPU_H_
