// The CUDA MoE routing entries of the layer-op table (issue 23 point 3: routing on the device):
// moe_route, gather_rows, scatter_rows, moe_combine, moe_combine_backward, moe_router_backward.
// Each kernel runs the per-token functions of kernels/moe_routing.h, which the CPU entries run
// too, one thread per token, assignment or element (grid-stride loops); so the results are the
// CPU's but for the device's expf and the order of the FP64 probability sums.
// tests/gpu/layer_ops_cuda_test (MoeRoutingTest) holds them to the CPU entries on a GPU;
// tests/gpu/moe_host_test runs this file's own source on the CPU over the block emulator.
#include <cuda_runtime.h>

#include <cstdint>

#include "absl/status/status.h"
#include "kernels/cuda/cuda_ops_internal.h"
#include "kernels/cuda/layer_launch.cuh"
#include "kernels/moe_routing.h"
#include "kernels/ops.h"
#include "runtime/core/status.h"

namespace fp8rt::kernels::cuda_internal {
namespace {

using layer_launch::CheckPointers;
using layer_launch::GridOf;
using layer_launch::kThreads;
using layer_launch::Launch;

__global__ void MoeRouteKernel(float* probs, int32_t* expert, float* gate, const float* logits,
                               int64_t n, int64_t e, int64_t k) {
  for (int64_t t = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; t < n;
       t += int64_t{gridDim.x} * blockDim.x) {
    moe::RouteToken(logits + t * e, probs + t * e, expert + t * k, gate + t * k, e, k);
  }
}

// One warp per expert (blockDim a multiple of 32, so a warp's lanes share x and the loop): lane l
// sums tokens l, l + 32, ... in order, then a fixed shuffle tree adds the 32 partial sums. The
// order is fixed, so the sums repeat run to run; they differ from the CPU's token-order sums
// (moe::ProbSum) by a few FP64 roundings, far below the FP32 probabilities' own differences.
__global__ void MoeProbSumsKernel(double* prob_sums, const float* probs, int64_t n, int64_t e) {
  const int lane = static_cast<int>(threadIdx.x % 32);
  for (int64_t x = (blockIdx.x * int64_t{blockDim.x} + threadIdx.x) / 32; x < e;
       x += int64_t{gridDim.x} * blockDim.x / 32) {
    double s = 0.0;
    for (int64_t t = lane; t < n; t += 32) s += probs[t * e + x];
    for (int offset = 16; offset > 0; offset /= 2) s += __shfl_down_sync(0xffffffffu, s, offset);
    if (lane == 0) prob_sums[x] = s;
  }
}

template <bool kScatter>
__global__ void MoveRowsKernel(float* dst, const float* src, const int64_t* index, int64_t rows,
                               int64_t cols) {
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < rows * cols;
       i += int64_t{gridDim.x} * blockDim.x) {
    const int64_t r = i / cols, col = i % cols, at = index[r];
    if constexpr (kScatter) {
      if (at >= 0) dst[at * cols + col] = src[i];
    } else {
      dst[i] = at >= 0 ? src[at * cols + col] : 0.0f;
    }
  }
}

__global__ void MoeCombineKernel(float* out, const float* y, const float* gate, const int64_t* slot,
                                 const int32_t* expert, int64_t n, int64_t k, int64_t c,
                                 bool accumulate) {
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < n * c;
       i += int64_t{gridDim.x} * blockDim.x) {
    const int64_t t = i / c;
    out[i] =
        moe::CombineValue(accumulate ? out[i] : 0.0f, y, gate == nullptr ? nullptr : gate + t * k,
                          slot + t * k, expert + t * k, k, c, i % c);
  }
}

__global__ void MoeScaleRowsKernel(float* dy, const float* dout, const float* gate,
                                   const int64_t* slot, int64_t n, int64_t k, int64_t c) {
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < n * k * c;
       i += int64_t{gridDim.x} * blockDim.x) {
    const int64_t a = i / c, col = i % c, s = slot[a];
    if (s >= 0) dy[s * c + col] = gate[a] * dout[(a / k) * c + col];
  }
}

__global__ void MoeGateGradKernel(float* dgate, const float* dout, const float* y,
                                  const int64_t* slot, int64_t n, int64_t k, int64_t c) {
  for (int64_t a = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; a < n * k;
       a += int64_t{gridDim.x} * blockDim.x) {
    const int64_t s = slot[a];
    dgate[a] = s >= 0 ? moe::DotRow(dout + (a / k) * c, y + s * c, c) : 0.0f;
  }
}

__global__ void MoeRouterBackwardKernel(float* dlogits, const float* probs, const int32_t* expert,
                                        const float* gate, const float* dgate, const float* frac,
                                        float aux_scale, int64_t n, int64_t e, int64_t k) {
  for (int64_t t = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; t < n;
       t += int64_t{gridDim.x} * blockDim.x) {
    moe::RouterBackwardToken(dlogits + t * e, probs + t * e, expert + t * k, gate + t * k,
                             dgate + t * k, frac, aux_scale, e, k);
  }
}

template <bool kScatter>
absl::Status MoveRows(const char* op, float* dst, const float* src, const int64_t* index,
                      int64_t rows, int64_t cols, Stream stream) {
  FP8RT_RETURN_IF_ERROR(moe::CheckSizes(op, rows, 0, 0, cols));
  if (rows == 0 || cols == 0) return absl::OkStatus();
  FP8RT_RETURN_IF_ERROR(CheckPointers(op, {{"dst", dst}, {"src", src}, {"index", index}}));
  FP8RT_ASSIGN_OR_RETURN(const dim3 grid, GridOf(rows * cols));
  return Launch(MoveRowsKernel<kScatter>, grid, dim3(kThreads), stream, dst, src, index, rows,
                cols);
}
}  // namespace

absl::Status MoeRouteCuda(float* probs, int32_t* expert, float* gate, double* prob_sums,
                          const float* logits, int64_t n, int64_t e, int64_t k, Stream stream) {
  constexpr const char* kOp = "moe_route";
  FP8RT_RETURN_IF_ERROR(moe::CheckRouteSizes(kOp, n, e, k));
  if (e == 0) return absl::OkStatus();
  FP8RT_RETURN_IF_ERROR(CheckPointers(kOp, {{"prob_sums", prob_sums}}));
  if (n > 0) {
    FP8RT_RETURN_IF_ERROR(CheckPointers(
        kOp, {{"probs", probs}, {"expert", expert}, {"gate", gate}, {"logits", logits}}));
    FP8RT_ASSIGN_OR_RETURN(const dim3 grid, GridOf(n));
    FP8RT_RETURN_IF_ERROR(
        Launch(MoeRouteKernel, grid, dim3(kThreads), stream, probs, expert, gate, logits, n, e, k));
  }
  static_assert(kThreads % 32 == 0, "MoeProbSumsKernel gives each expert a whole warp");
  FP8RT_ASSIGN_OR_RETURN(const dim3 grid, GridOf(e * 32));
  return Launch(MoeProbSumsKernel, grid, dim3(kThreads), stream, prob_sums,
                static_cast<const float*>(probs), n, e);
}

absl::Status GatherRowsCuda(float* dst, const float* src, const int64_t* index, int64_t rows,
                            int64_t cols, Stream stream) {
  return MoveRows<false>("gather_rows", dst, src, index, rows, cols, stream);
}
absl::Status ScatterRowsCuda(float* dst, const float* src, const int64_t* index, int64_t rows,
                             int64_t cols, Stream stream) {
  return MoveRows<true>("scatter_rows", dst, src, index, rows, cols, stream);
}

absl::Status MoeCombineCuda(float* out, const float* y, const float* gate, const int64_t* slot,
                            const int32_t* expert, int64_t n, int64_t k, int64_t c, bool accumulate,
                            Stream stream) {
  constexpr const char* kOp = "moe_combine";
  FP8RT_RETURN_IF_ERROR(moe::CheckSizes(kOp, n, 0, k, c));
  if (n == 0 || c == 0) return absl::OkStatus();
  FP8RT_RETURN_IF_ERROR(
      CheckPointers(kOp, {{"out", out}, {"y", y}, {"slot", slot}, {"expert", expert}}));
  if (gate != nullptr) FP8RT_RETURN_IF_ERROR(CheckPointers(kOp, {{"gate", gate}}));
  FP8RT_ASSIGN_OR_RETURN(const dim3 grid, GridOf(n * c));
  return Launch(MoeCombineKernel, grid, dim3(kThreads), stream, out, y, gate, slot, expert, n, k, c,
                accumulate);
}

absl::Status MoeCombineBackwardCuda(float* dy, float* dgate, const float* dout, const float* y,
                                    const float* gate, const int64_t* slot, int64_t n, int64_t k,
                                    int64_t c, Stream stream) {
  constexpr const char* kOp = "moe_combine_backward";
  FP8RT_RETURN_IF_ERROR(moe::CheckSizes(kOp, n, 0, k, c));
  if (n == 0) return absl::OkStatus();
  FP8RT_RETURN_IF_ERROR(CheckPointers(kOp, {{"dgate", dgate}, {"slot", slot}}));
  if (c > 0) {
    FP8RT_RETURN_IF_ERROR(
        CheckPointers(kOp, {{"dy", dy}, {"dout", dout}, {"y", y}, {"gate", gate}}));
    FP8RT_ASSIGN_OR_RETURN(const dim3 rows_grid, GridOf(n * k * c));
    FP8RT_RETURN_IF_ERROR(Launch(MoeScaleRowsKernel, rows_grid, dim3(kThreads), stream, dy, dout,
                                 gate, slot, n, k, c));
  }
  FP8RT_ASSIGN_OR_RETURN(const dim3 grid, GridOf(n * k));
  return Launch(MoeGateGradKernel, grid, dim3(kThreads), stream, dgate, dout, y, slot, n, k, c);
}

absl::Status MoeRouterBackwardCuda(float* dlogits, const float* probs, const int32_t* expert,
                                   const float* gate, const float* dgate, const float* frac,
                                   float aux_scale, int64_t n, int64_t e, int64_t k,
                                   Stream stream) {
  constexpr const char* kOp = "moe_router_backward";
  FP8RT_RETURN_IF_ERROR(moe::CheckRouteSizes(kOp, n, e, k));
  if (n == 0 || e == 0) return absl::OkStatus();
  FP8RT_RETURN_IF_ERROR(CheckPointers(kOp, {{"dlogits", dlogits},
                                            {"probs", probs},
                                            {"expert", expert},
                                            {"gate", gate},
                                            {"dgate", dgate},
                                            {"frac", frac}}));
  FP8RT_ASSIGN_OR_RETURN(const dim3 grid, GridOf(n));
  return Launch(MoeRouterBackwardKernel, grid, dim3(kThreads), stream, dlogits, probs, expert, gate,
                dgate, frac, aux_scale, n, e, k);
}

}  // namespace fp8rt::kernels::cuda_internal
