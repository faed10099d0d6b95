// The CPU entries of the MoE routing ops (kernels/layer_ops.h, LayerOps::moe_route ...): loops
// over tokens, assignments and rows around the per-token functions of kernels/moe_routing.h.
// Single-threaded: the work is O(tokens x (experts + k x hidden)), small beside the experts'
// GEMMs.
#include <algorithm>
#include <cstring>

#include "kernels/cpu/cpu_ops.h"
#include "kernels/moe_routing.h"
#include "runtime/core/status.h"

namespace fp8rt::kernels::cpu_internal {

absl::Status MoeRouteCpu(float* probs, int32_t* expert, float* gate, double* prob_sums,
                         const float* logits, int64_t n, int64_t e, int64_t k, Stream) {
  FP8RT_RETURN_IF_ERROR(moe::CheckRouteSizes("moe_route", n, e, k));
  for (int64_t t = 0; t < n; ++t) {
    moe::RouteToken(logits + t * e, probs + t * e, expert + t * k, gate + t * k, e, k);
  }
  for (int64_t x = 0; x < e; ++x) prob_sums[x] = moe::ProbSum(probs, n, e, x);
  return absl::OkStatus();
}

namespace {

// gather_rows (dst[i] = src[index[i]], zeros for a negative index) or scatter_rows
// (dst[index[i]] = src[i], skipped for a negative index).
template <bool kScatter>
absl::Status MoveRows(const char* op, float* dst, const float* src, const int64_t* index,
                      int64_t rows, int64_t cols) {
  FP8RT_RETURN_IF_ERROR(moe::CheckSizes(op, rows, 0, 0, cols));
  const auto bytes = static_cast<size_t>(cols) * sizeof(float);
  for (int64_t i = 0; i < rows; ++i) {
    if (index[i] < 0) {
      if constexpr (!kScatter) std::fill_n(dst + i * cols, cols, 0.0f);
    } else if constexpr (kScatter) {
      std::memcpy(dst + index[i] * cols, src + i * cols, bytes);
    } else {
      std::memcpy(dst + i * cols, src + index[i] * cols, bytes);
    }
  }
  return absl::OkStatus();
}

}  // namespace

absl::Status GatherRowsCpu(float* dst, const float* src, const int64_t* index, int64_t rows,
                           int64_t cols, Stream) {
  return MoveRows<false>("gather_rows", dst, src, index, rows, cols);
}

absl::Status ScatterRowsCpu(float* dst, const float* src, const int64_t* index, int64_t rows,
                            int64_t cols, Stream) {
  return MoveRows<true>("scatter_rows", dst, src, index, rows, cols);
}

absl::Status MoeCombineCpu(float* out, const float* y, const float* gate, const int64_t* slot,
                           const int32_t* expert, int64_t n, int64_t k, int64_t c, bool accumulate,
                           Stream) {
  FP8RT_RETURN_IF_ERROR(moe::CheckSizes("moe_combine", n, 0, k, c));
  for (int64_t t = 0; t < n; ++t) {
    for (int64_t col = 0; col < c; ++col) {
      float& o = out[t * c + col];
      o = moe::CombineValue(accumulate ? o : 0.0f, y, gate == nullptr ? nullptr : gate + t * k,
                            slot + t * k, expert + t * k, k, c, col);
    }
  }
  return absl::OkStatus();
}

absl::Status MoeCombineBackwardCpu(float* dy, float* dgate, const float* dout, const float* y,
                                   const float* gate, const int64_t* slot, int64_t n, int64_t k,
                                   int64_t c, Stream) {
  FP8RT_RETURN_IF_ERROR(moe::CheckSizes("moe_combine_backward", n, 0, k, c));
  for (int64_t a = 0; a < n * k; ++a) {
    const int64_t s = slot[a];
    if (s < 0) {
      dgate[a] = 0.0f;
      continue;
    }
    const float* d = dout + (a / k) * c;
    for (int64_t col = 0; col < c; ++col) dy[s * c + col] = gate[a] * d[col];
    dgate[a] = moe::DotRow(d, y + s * c, c);
  }
  return absl::OkStatus();
}

absl::Status MoeRouterBackwardCpu(float* dlogits, const float* probs, const int32_t* expert,
                                  const float* gate, const float* dgate, const float* frac,
                                  float aux_scale, int64_t n, int64_t e, int64_t k, Stream) {
  FP8RT_RETURN_IF_ERROR(moe::CheckRouteSizes("moe_router_backward", n, e, k));
  for (int64_t t = 0; t < n; ++t) {
    moe::RouterBackwardToken(dlogits + t * e, probs + t * e, expert + t * k, gate + t * k,
                             dgate + t * k, frac, aux_scale, e, k);
  }
  return absl::OkStatus();
}

}  // namespace fp8rt::kernels::cpu_internal
