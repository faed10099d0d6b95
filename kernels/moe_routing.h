// The per-token arithmetic of mixture-of-experts routing (runtime/model/moe.cc), written once for
// both backends: the CPU entries (kernels/cpu/moe_cpu.cc) and the CUDA kernels
// (kernels/cuda/moe_cuda.cu) call these functions, so the CPU tests of the ops
// (tests/unit/moe_routing_test.cc) check the code the GPU runs, with the host's exp in place of
// the device's expf. Plain C++ with no allocation; under nvcc each is __host__ __device__.
//
// Index:
//   RouteToken           softmax over the experts, top-k (ties to the lower index), gates
//                        renormalised over the top-k (Mixtral)
//   ProbSum              one expert's router probability summed over the tokens, in FP64
//   NextByExpert         a token's next kept assignment in increasing expert order
//   CombineValue         one element of sum_j gate_j * y[slot_j] in that order
//   DotRow               an FP32 dot product in column order
//   RouterBackwardToken  gradients of the gates and the aux loss through the renormalisation and
//                        the softmax
// A token's k assignments are a = t * k + j; slot[a] is the row of the expert's output that
// assignment a reads (its position in the dispatch order), negative when the assignment was
// dropped for capacity.
#ifndef FP8RT_KERNELS_MOE_ROUTING_H_
#define FP8RT_KERNELS_MOE_ROUTING_H_

#include <cmath>
#include <cstdint>

#include "absl/status/status.h"

#if defined(__CUDACC__)
#define FP8RT_MOE_HD __host__ __device__
#else
#define FP8RT_MOE_HD
#endif

namespace fp8rt::kernels::moe {

// The entries' argument check (host code, both backends): InvalidArgument naming the op and the
// size unless n, e, k and c are >= 0 and, when there are tokens and experts (e > 0), k is in
// [1, e]. The row moves pass e = k = 0.
absl::Status CheckSizes(const char* op, int64_t n, int64_t e, int64_t k, int64_t c);
// CheckSizes for the entries that route (moe_route, moe_router_backward), where e is the experts'
// count and not a placeholder: tokens without experts (n > 0, e = 0) are refused too.
absl::Status CheckRouteSizes(const char* op, int64_t n, int64_t e, int64_t k);

FP8RT_MOE_HD inline float Exp(float x) {
#if defined(__CUDA_ARCH__)
  return expf(x);
#else
  return std::exp(x);
#endif
}

// p[0, e) = softmax(l[0, e)) (the max subtracted first); expert[0, k) the k most probable, in
// decreasing probability, a tie going to the lower index; gate[j] = p[expert[j]] / the sum of
// those k probabilities (added in j order).
FP8RT_MOE_HD inline void RouteToken(const float* l, float* p, int32_t* expert, float* gate,
                                    int64_t e, int64_t k) {
  float mx = l[0];
  for (int64_t x = 1; x < e; ++x) {
    if (mx < l[x]) mx = l[x];
  }
  float sum = 0.0f;
  for (int64_t x = 0; x < e; ++x) sum += (p[x] = Exp(l[x] - mx));
  for (int64_t x = 0; x < e; ++x) p[x] /= sum;
  for (int64_t j = 0; j < k; ++j) {
    int64_t best = -1;
    for (int64_t x = 0; x < e; ++x) {
      bool taken = false;
      for (int64_t i = 0; i < j; ++i) taken = taken || expert[i] == x;
      // Ascending x with a strict >: the first of equal probabilities (the lower index) wins.
      if (!taken && (best < 0 || p[x] > p[best])) best = x;
    }
    expert[j] = static_cast<int32_t>(best);
  }
  float top = 0.0f;
  for (int64_t j = 0; j < k; ++j) top += p[expert[j]];
  for (int64_t j = 0; j < k; ++j) gate[j] = p[expert[j]] / top;
}

// sum over t < n of p[t * e + x], in token order, in FP64 (P_e of the aux loss, times n).
FP8RT_MOE_HD inline double ProbSum(const float* p, int64_t n, int64_t e, int64_t x) {
  double s = 0.0;
  for (int64_t t = 0; t < n; ++t) s += p[t * e + x];
  return s;
}

// Of a token's assignments j < k with slot[j] >= 0, the one with the smallest expert above
// `after` (-1 for the first); -1 when none is left. A token's experts are distinct.
FP8RT_MOE_HD inline int64_t NextByExpert(const int64_t* slot, const int32_t* expert, int64_t k,
                                         int32_t after) {
  int64_t best = -1;
  for (int64_t j = 0; j < k; ++j) {
    if (slot[j] >= 0 && expert[j] > after && (best < 0 || expert[j] < expert[best])) best = j;
  }
  return best;
}

// o + sum of w_j * y[slot[j] * c + col] over the token's kept assignments in increasing expert
// order (the order the dispatch sends them in), w_j = gate[j], or 1 when gate is null.
FP8RT_MOE_HD inline float CombineValue(float o, const float* y, const float* gate,
                                       const int64_t* slot, const int32_t* expert, int64_t k,
                                       int64_t c, int64_t col) {
  int32_t after = -1;
  for (int64_t j = NextByExpert(slot, expert, k, after); j >= 0;
       j = NextByExpert(slot, expert, k, after)) {
    after = expert[j];
    const float w = gate != nullptr ? gate[j] : 1.0f;
    o += w * y[slot[j] * c + col];
  }
  return o;
}

// sum over col < c of a[col] * b[col] in FP32, in column order.
FP8RT_MOE_HD inline float DotRow(const float* a, const float* b, int64_t c) {
  float dot = 0.0f;
  for (int64_t col = 0; col < c; ++col) dot += a[col] * b[col];
  return dot;
}

// dl[0, e) = dL/dlogits of one token: with gates g_j = p_j / S over its top-k and dgate[j] =
// dL/dg_j, dL/dp_x = aux_scale * frac[x] (the aux loss) + sum over j with expert[j] = x of
// (dgate[j] - sum_i g_i dgate[i]) / S; then the softmax's dl_x = p_x (dp_x - sum_y p_y dp_y).
FP8RT_MOE_HD inline void RouterBackwardToken(float* dl, const float* p, const int32_t* expert,
                                             const float* gate, const float* dgate,
                                             const float* frac, float aux_scale, int64_t e,
                                             int64_t k) {
  for (int64_t x = 0; x < e; ++x) dl[x] = aux_scale * frac[x];
  float top = 0.0f, gdg = 0.0f;
  for (int64_t j = 0; j < k; ++j) {
    top += p[expert[j]];
    gdg += gate[j] * dgate[j];
  }
  for (int64_t j = 0; j < k; ++j) dl[expert[j]] += (dgate[j] - gdg) / top;
  float pdp = 0.0f;
  for (int64_t x = 0; x < e; ++x) pdp += p[x] * dl[x];
  for (int64_t x = 0; x < e; ++x) dl[x] = p[x] * (dl[x] - pdp);
}

}  // namespace fp8rt::kernels::moe

#endif  // FP8RT_KERNELS_MOE_ROUTING_H_
