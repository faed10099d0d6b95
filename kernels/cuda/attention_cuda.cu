// CUDA attention core and cross-entropy: the attention_forward, attention_backward,
// attention_forward_bf16, attention_backward_bf16 (argument checks here; the fused tensor-core
// kernels they launch for Dh <= 128 are in kernels/cuda/flash_attention_cuda.cu, the FP32
// kernels below otherwise), cross_entropy_forward and cross_entropy_backward entries of the CUDA
// LayerOps table
// (kernels/layer_ops.h is the contract; tests/gpu/attention_cuda_test.cc tests attention against
// an FP64 evaluation of it, cross-entropy against the CPU's kernels/cpu/layer_ops_cpu.cc).
//
// Index (helpers, kernels, then the entries that launch them):
//   (kernels/cuda/attention_common.cuh, shared with the fused kernels:)
//   WarpAllSum, WarpAllMax     float reductions in a fixed butterfly order
//   WarpDot, Score, Prob       a . b by one warp; s_ij = (q_i . k_j) * scale;
//                              p_ij = exp(s_ij - lse_i)
//   RowTerm                    D_i = dout_i . out_i of one query row, by one warp
//   (here:)
//   BlockAllSum, BlockAllMax   block reductions in a fixed tree order
//   AttentionForwardKernel     one warp per query row (b, h, i), three passes over keys j <= i,
//                              each recomputing s_ij: the max m_i; the sum of exp(s_ij - m_i),
//                              giving lse_i = m_i + log(sum); out_i = sum_j exp(s_ij - lse_i) v_j
//   AttentionDqKernel          one warp per query row: dq_i += sum_{j<=i} ds_ij k_j
//   AttentionDkDvKernel        one block per (b, kv head, range of keys), one warp per key j:
//                              for each query head of the group, ascending,
//                              dk_j += sum_{i>=j} ds_ij q_i,  dv_j += sum_{i>=j} p_ij dout_i
// No [T, T] matrix exists anywhere: the forward saves lse [B, H, T] only, and both backward
// kernels recompute p_ij = exp(s_ij - lse_i) from q, k and lse (flash attention's split).
// Grouped-query attention: query head hh reads kv head hh / (H / Hkv) (ViewOf / KvViewOf); the
// kv gradients add their group's query heads in ascending order, as the CPU does.
//   CrossEntropyForwardKernel  one block per row: softmax and the row's loss
//   CrossEntropyBackwardKernel element-wise, bit for bit the CPU's
//
// Determinism: every sum is computed by one thread in a fixed order or by a fixed butterfly of
// shuffles and a fixed shared-memory tree; there are no atomics, and which block or warp
// handles a row changes nothing in how the row is computed. A result therefore depends on the
// inputs only (not on the grid, which depends on the SM count): reruns are bit for bit equal.
// The forward's softmax sum is lane-strided (lane j % 32 adds term j to its own partial, j
// ascending) and then one butterfly; there is no online rescaling. The backward needs
// D_i = dout_i . out_i both for dq (per query row) and for dk (per key, every row i >= j); with
// no workspace to keep it in, the dk/dv kernel recomputes it per block for the query rows its
// keys see, and both kernels recompute p_ij, with the same functions, so with the same bits.
// Gradient rows are each owned by one warp, so accumulating into dq, dk and dv needs no atomics
// either.
//
// Numerics: FP32 throughout with IEEE expf and logf (the CUDA sources are built with
// -prec-div=true -prec-sqrt=true -ftz=false; no fast-math intrinsics). Outside the dot products
// every operation is an explicit round-to-nearest intrinsic (no FMA contraction), in the order
// the contract (kernels/layer_ops.h) writes it: the scale, the exponent arguments, lse, the p v,
// ds q, ds k and p dout accumulations (key or query ascending). Dot products are split across
// lanes (FMA, tree order). The CPU sums in tiles, so the two backends differ in the last bits;
// tests/gpu/attention_cuda_test.cc holds both to the first-order error bounds of
// tests/support/attention_check.h against an FP64 evaluation of the contract.
//
// Buffers: every pointer is device memory (checked); all work is enqueued on the caller's stream.
// Nothing is allocated but the fused BF16 backward's D_i, B * H * T floats of stream-ordered
// scratch (AllocateOnStream; ResourceExhausted naming attention_backward_bf16 when the device is
// full).
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <initializer_list>
#include <limits>
#include <utility>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "kernels/cuda/attention_common.cuh"
#include "kernels/cuda/cuda_ops_internal.h"
#include "kernels/cuda/launch.cuh"
#include "runtime/core/checks.h"
#include "runtime/core/status.h"

namespace fp8rt::kernels::cuda_internal {
namespace {

using namespace attention;  // NOLINT(build/namespaces): the shared device helpers

constexpr int kThreads = 256;  // every kernel's block size
constexpr int kWarps = kThreads / 32;
// Head-dimension values each lane keeps in registers: a warp covers 32 * kRegs = 256 channels per
// pass; larger heads take more passes (recomputing the dot products they need).
constexpr int kRegs = 8;
constexpr int64_t kDhPerPass = 32 * kRegs;
// Row terms D_i the dk/dv kernel holds in shared memory at a time; longer sequences go in chunks.
constexpr int64_t kRowTermChunk = 1024;
// Upper bound on the key ranges per (b, h) in the dk/dv kernel: each range recomputes the row
// terms (one dot product each) of the query rows it sees, so more ranges buy parallelism with
// redundant work.
constexpr int64_t kMaxKeyRanges = 8;

cudaStream_t ToCuda(Stream stream) { return static_cast<cudaStream_t>(stream.handle); }

// Sum / max over the block (kThreads threads), returned to every thread; every thread must call.
// Starts with a barrier so back-to-back calls may share `scratch` (32 floats of shared memory).
__device__ __forceinline__ float BlockAllSum(float v, float* scratch) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  __syncthreads();
  v = WarpAllSum(v);
  if (lane == 0) scratch[warp] = v;
  __syncthreads();
  if (warp == 0) {
    const float w = WarpAllSum(lane < kWarps ? scratch[lane] : 0.0f);
    if (lane == 0) scratch[0] = w;
  }
  __syncthreads();
  return scratch[0];
}

__device__ __forceinline__ float BlockAllMax(float v, float* scratch) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  __syncthreads();
  v = WarpAllMax(v);
  if (lane == 0) scratch[warp] = v;
  __syncthreads();
  if (warp == 0) {
    const float w = WarpAllMax(lane < kWarps ? scratch[lane] : -INFINITY);
    if (lane == 0) scratch[0] = w;
  }
  __syncthreads();
  return scratch[0];
}

// --- attention ---------------------------------------------------------------------------------

// One warp per query row r = (b * H + h) * T + i (warp-stride loop over the rows). Three passes
// over the keys j <= i, each recomputing s_ij (all lanes hold the same s): the max, the sum of
// exp(s - max) (lane j % 32 adds term j, then one butterfly), and out_i with p_ij from lse_i.
__global__ void __launch_bounds__(kThreads)
    AttentionForwardKernel(float* __restrict__ out, float* __restrict__ lse,
                           const float* __restrict__ q, const float* __restrict__ k,
                           const float* __restrict__ v, int64_t rows, int64_t t, int64_t h,
                           int64_t hkv, int64_t dh, float scale) {
  const int lane = threadIdx.x & 31;
  const int64_t first = (static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x) >> 5;
  const int64_t warps = (static_cast<int64_t>(gridDim.x) * blockDim.x) >> 5;
  for (int64_t row = first; row < rows; row += warps) {  // uniform across the warp
    const int64_t bh = row / t, i = row - bh * t;
    const HeadView hv = ViewOf(bh, t, h, dh);
    const HeadView kv = KvViewOf(bh, t, h, hkv, dh);
    const float* qi = q + hv.offset + i * hv.stride;
    const float* k0 = k + kv.offset;
    const float* v0 = v + kv.offset;
    float max_score = -INFINITY;
    for (int64_t j = 0; j <= i; ++j) {
      max_score = fmaxf(max_score, Score(qi, k0 + j * kv.stride, dh, lane, scale));
    }
    float partial = 0.0f;
    for (int64_t j = 0; j <= i; ++j) {
      const float s = Score(qi, k0 + j * kv.stride, dh, lane, scale);
      if (lane == (j & 31)) partial = __fadd_rn(partial, expf(__fsub_rn(s, max_score)));
    }
    const float lse_i = __fadd_rn(max_score, logf(WarpAllSum(partial)));
    if (lane == 0) lse[row] = lse_i;
    float* oi = out + hv.offset + i * hv.stride;
    for (int64_t d0 = 0; d0 < dh; d0 += kDhPerPass) {
      float o[kRegs] = {};
      for (int64_t j = 0; j <= i; ++j) {
        const float pj = Prob(Score(qi, k0 + j * kv.stride, dh, lane, scale), lse_i);
        const float* vj = v0 + j * kv.stride;
#pragma unroll
        for (int r = 0; r < kRegs; ++r) {
          const int64_t d = d0 + lane + 32 * r;
          if (d < dh) o[r] = __fadd_rn(o[r], __fmul_rn(pj, vj[d]));
        }
      }
#pragma unroll
      for (int r = 0; r < kRegs; ++r) {
        const int64_t d = d0 + lane + 32 * r;
        if (d < dh) oi[d] = o[r];
      }
    }
  }
}

// One warp per query row: dq_i += sum_{j<=i} ds_ij k_j, keys in ascending order, p_ij
// recomputed from q, k and lse.
__global__ void __launch_bounds__(kThreads)
    AttentionDqKernel(float* __restrict__ dq, const float* __restrict__ dout,
                      const float* __restrict__ q, const float* __restrict__ k,
                      const float* __restrict__ v, const float* __restrict__ out,
                      const float* __restrict__ lse, int64_t rows, int64_t t, int64_t h,
                      int64_t hkv, int64_t dh, float scale) {
  const int lane = threadIdx.x & 31;
  const int64_t first = (static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x) >> 5;
  const int64_t warps = (static_cast<int64_t>(gridDim.x) * blockDim.x) >> 5;
  for (int64_t row = first; row < rows; row += warps) {
    const int64_t bh = row / t, i = row - bh * t;
    const HeadView hv = ViewOf(bh, t, h, dh);
    const HeadView kv = KvViewOf(bh, t, h, hkv, dh);
    const float* qi = q + hv.offset + i * hv.stride;
    const float* doi = dout + hv.offset + i * hv.stride;
    const float* k0 = k + kv.offset;
    const float* v0 = v + kv.offset;
    const float row_term = RowTerm(doi, out + hv.offset + i * hv.stride, dh, lane);
    const float lse_i = lse[row];
    float* dqi = dq + hv.offset + i * hv.stride;
    for (int64_t d0 = 0; d0 < dh; d0 += kDhPerPass) {
      float acc[kRegs];
#pragma unroll
      for (int r = 0; r < kRegs; ++r) {
        const int64_t d = d0 + lane + 32 * r;
        acc[r] = d < dh ? dqi[d] : 0.0f;
      }
      for (int64_t j = 0; j <= i; ++j) {
        const float* kj = k0 + j * kv.stride;
        const float p = Prob(Score(qi, kj, dh, lane, scale), lse_i);
        const float ds = ScoreGrad(p, WarpDot(doi, v0 + j * kv.stride, dh, lane), row_term, scale);
#pragma unroll
        for (int r = 0; r < kRegs; ++r) {
          const int64_t d = d0 + lane + 32 * r;
          if (d < dh) acc[r] = __fadd_rn(acc[r], __fmul_rn(ds, kj[d]));
        }
      }
#pragma unroll
      for (int r = 0; r < kRegs; ++r) {
        const int64_t d = d0 + lane + 32 * r;
        if (d < dh) dqi[d] = acc[r];
      }
    }
  }
}

// One block per (b, kv head g, range of key_range keys), block-stride over them; within a block
// one warp per key j (warp w takes keys j0 + w, j0 + w + kWarps, ...). For each query head of
// g's group in ascending order, the query rows i >= j0 go in chunks of kRowTermChunk: the block
// computes their row terms D_i = dout_i . out_i into shared memory, then each warp adds the
// chunk's rows, i ascending, to its keys' dk and dv, recomputing p_ij from q_i, k_j and lse_i
// (dk and dv are kept in global memory between chunks and heads: the same sequence of roundings
// as one pass over (query head, i) ascending, the CPU's order).
__global__ void __launch_bounds__(kThreads)
    AttentionDkDvKernel(float* __restrict__ dk, float* __restrict__ dv,
                        const float* __restrict__ dout, const float* __restrict__ q,
                        const float* __restrict__ k, const float* __restrict__ v,
                        const float* __restrict__ out, const float* __restrict__ lse,
                        int64_t kv_heads, int64_t ranges, int64_t key_range, int64_t t, int64_t h,
                        int64_t hkv, int64_t dh, float scale) {
  FP8RT_STATIC_SHARED(float, row_terms, [kRowTermChunk]);
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int64_t group = h / hkv;
  for (int64_t item = blockIdx.x; item < kv_heads * ranges; item += gridDim.x) {
    const int64_t bg = item / ranges;  // b * Hkv + g
    const int64_t j0 = (item - bg * ranges) * key_range;
    if (j0 >= t) continue;  // uniform across the block
    const int64_t j1 = min(t, j0 + key_range);
    const int64_t b = bg / hkv, g = bg - b * hkv;
    for (int64_t hh = g * group; hh < (g + 1) * group; ++hh) {
      const int64_t bh = b * h + hh;
      const HeadView hv = ViewOf(bh, t, h, dh);
      const HeadView kv = KvViewOf(bh, t, h, hkv, dh);
      const float* lse0 = lse + bh * t;  // lse_i of this head: lse0[i]
      for (int64_t i0 = j0; i0 < t; i0 += kRowTermChunk) {
        const int64_t i1 = min(t, i0 + kRowTermChunk);
        __syncthreads();  // the previous chunk's row terms are no longer read
        for (int64_t i = i0 + warp; i < i1; i += kWarps) {
          const int64_t at = hv.offset + i * hv.stride;
          const float d = RowTerm(dout + at, out + at, dh, lane);
          if (lane == 0) row_terms[i - i0] = d;
        }
        __syncthreads();
        for (int64_t j = j0 + warp; j < j1 && j < i1; j += kWarps) {
          const float* kj = k + kv.offset + j * kv.stride;
          const float* vj = v + kv.offset + j * kv.stride;
          float* dkj = dk + kv.offset + j * kv.stride;
          float* dvj = dv + kv.offset + j * kv.stride;
          for (int64_t d0 = 0; d0 < dh; d0 += kDhPerPass) {
            float acc_k[kRegs], acc_v[kRegs];
#pragma unroll
            for (int r = 0; r < kRegs; ++r) {
              const int64_t d = d0 + lane + 32 * r;
              acc_k[r] = d < dh ? dkj[d] : 0.0f;
              acc_v[r] = d < dh ? dvj[d] : 0.0f;
            }
            for (int64_t i = max(i0, j); i < i1; ++i) {
              const float* doi = dout + hv.offset + i * hv.stride;
              const float* qi = q + hv.offset + i * hv.stride;
              const float pij = Prob(Score(qi, kj, dh, lane, scale), lse0[i]);
              const float ds = ScoreGrad(pij, WarpDot(doi, vj, dh, lane), row_terms[i - i0], scale);
#pragma unroll
              for (int r = 0; r < kRegs; ++r) {
                const int64_t d = d0 + lane + 32 * r;
                if (d < dh) {
                  acc_k[r] = __fadd_rn(acc_k[r], __fmul_rn(ds, qi[d]));
                  acc_v[r] = __fadd_rn(acc_v[r], __fmul_rn(pij, doi[d]));
                }
              }
            }
#pragma unroll
            for (int r = 0; r < kRegs; ++r) {
              const int64_t d = d0 + lane + 32 * r;
              if (d < dh) {
                dkj[d] = acc_k[r];
                dvj[d] = acc_v[r];
              }
            }
          }
        }
      }
    }
  }
}

// --- cross-entropy -----------------------------------------------------------------------------

// One block per row (block-stride): max, exp and sum, normalise, and thread 0 writes the loss
// max + log(sum) - logit[target] (NaN for a target outside [0, V), which the caller must prevent).
__global__ void __launch_bounds__(kThreads)
    CrossEntropyForwardKernel(float* __restrict__ probs, float* __restrict__ losses,
                              const float* __restrict__ logits, const int32_t* __restrict__ targets,
                              int64_t n, int64_t v) {
  FP8RT_STATIC_SHARED(float, scratch, [32]);
  for (int64_t row = blockIdx.x; row < n; row += gridDim.x) {
    const float* l = logits + row * v;
    float* p = probs + row * v;
    float max_logit = -INFINITY;
    for (int64_t j = threadIdx.x; j < v; j += kThreads) max_logit = fmaxf(max_logit, l[j]);
    max_logit = BlockAllMax(max_logit, scratch);
    // Each thread rereads only what it wrote itself.
    float sum = 0.0f;
    for (int64_t j = threadIdx.x; j < v; j += kThreads) {
      const float e = expf(__fsub_rn(l[j], max_logit));
      p[j] = e;
      sum = __fadd_rn(sum, e);
    }
    sum = BlockAllSum(sum, scratch);
    const float inv_sum = __fdiv_rn(1.0f, sum);
    for (int64_t j = threadIdx.x; j < v; j += kThreads) p[j] = __fmul_rn(p[j], inv_sum);
    if (threadIdx.x == 0) {
      const int64_t target = targets[row];
      losses[row] = target >= 0 && target < v
                        ? __fsub_rn(__fadd_rn(max_logit, logf(sum)), l[target])
                        : __int_as_float(0x7FC00000);
    }
  }
}

// dlogits[r, j] += row_scale * (probs[r, j] - (j == target_r)), each operation rounded as on the
// CPU. Rows along y, columns along x, both grid-stride.
__global__ void __launch_bounds__(kThreads)
    CrossEntropyBackwardKernel(float* __restrict__ dlogits, const float* __restrict__ probs,
                               const int32_t* __restrict__ targets, int64_t n, int64_t v,
                               float row_scale) {
  const int64_t first = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t row = blockIdx.y; row < n; row += gridDim.y) {
    const int64_t target = targets[row];
    for (int64_t j = first; j < v; j += stride) {
      const int64_t at = row * v + j;
      const float indicator = j == target ? 1.0f : 0.0f;
      dlogits[at] = __fadd_rn(dlogits[at], __fmul_rn(row_scale, __fsub_rn(probs[at], indicator)));
    }
  }
}

// --- host side ---------------------------------------------------------------------------------

// InvalidArgument naming the first negative size (the CPU entries' message).
absl::Status CheckSizes(const char* op,
                        std::initializer_list<std::pair<const char*, int64_t>> sizes) {
  for (const auto& [name, value] : sizes) {
    if (value < 0) {
      return absl::InvalidArgumentError(absl::StrCat(op, ": ", name, " is ", value, " (< 0)"));
    }
  }
  return absl::OkStatus();
}

// The product of non-negative factors, or InvalidArgument if it does not fit in int64_t.
absl::StatusOr<int64_t> Product(const char* op, const char* what,
                                std::initializer_list<int64_t> factors) {
  int64_t product = 1;
  for (const int64_t f : factors) {
    if (__builtin_mul_overflow(product, f, &product)) {
      return absl::InvalidArgumentError(absl::StrCat(op, ": ", what, " overflows int64"));
    }
  }
  return product;
}

// An entry's buffers, each with its argument name.
using Buffers = std::initializer_list<std::pair<const char*, const void*>>;

// InvalidArgument naming the first null pointer (for ops with work to do: a null buffer would
// fault in the kernel and poison the context), then the device-memory check.
absl::Status CheckBuffers(const char* op, Buffers ptrs) {
  for (const auto& [name, ptr] : ptrs) {
    if (ptr == nullptr) return absl::InvalidArgumentError(absl::StrCat(op, ": ", name, " is null"));
  }
  return CheckDevicePointers(ptrs);
}

template <class Kernel, class... Args>
absl::Status Launch(Kernel kernel, dim3 grid, cudaStream_t stream, Args... args) {
  FP8RT_LAUNCH(kernel, grid, dim3(kThreads), 0, stream)(args...);
  CUDA_RETURN_IF_ERROR(cudaGetLastError());
  return absl::OkStatus();
}

// Sizes of one attention call: rows = B * H * T query rows (0: nothing to do), after the checks
// shared by the forward and the backward (hkv must divide h when there are rows).
absl::StatusOr<int64_t> AttentionRows(const char* op, int64_t b, int64_t t, int64_t h, int64_t hkv,
                                      int64_t dh) {
  FP8RT_RETURN_IF_ERROR(CheckSizes(op, {{"b", b}, {"t", t}, {"h", h}, {"hkv", hkv}, {"dh", dh}}));
  if (dh == 0) return absl::InvalidArgumentError(absl::StrCat(op, ": dh is 0 (must be > 0)"));
  FP8RT_RETURN_IF_ERROR(Product(op, "b * t * h * dh", {b, t, h, dh}).status());
  FP8RT_RETURN_IF_ERROR(Product(op, "b * h * t (lse)", {b, h, t}).status());
  const int64_t rows = b * h * t;
  if (rows > 0 && (hkv == 0 || h % hkv != 0)) {
    return absl::InvalidArgumentError(
        absl::StrCat(op, ": hkv is ", hkv, ", which does not divide h = ", h));
  }
  return rows;
}

// The CPU reference's 1 / sqrt(Dh), computed the same way on the host.
float AttentionScale(int64_t dh) { return 1.0f / std::sqrt(static_cast<float>(dh)); }

// Blocks for a kernel that gives one warp to each of `rows` rows.
unsigned WarpPerRowGrid(int64_t rows, int sms) {
  return static_cast<unsigned>(GridFor(rows * 32, kThreads, sms));
}

}  // namespace

namespace {

// The forward of both entry pairs: the checks, then with `bf16` the fused tensor-core kernel where
// it fits, the FP32 kernel otherwise.
absl::Status AttentionForwardOf(const char* op, bool bf16, float* out, float* lse, const float* q,
                                const float* k, const float* v, int64_t b, int64_t t, int64_t h,
                                int64_t hkv, int64_t dh, Stream stream) {
  FP8RT_ASSIGN_OR_RETURN(const int64_t rows, AttentionRows(op, b, t, h, hkv, dh));
  const Buffers buffers = {{"out", out}, {"lse", lse}, {"q", q}, {"k", k}, {"v", v}};
  if (rows == 0) return CheckDevicePointers(buffers);
  FP8RT_RETURN_IF_ERROR(CheckBuffers(op, buffers));
  const float scale = AttentionScale(dh);
  if (bf16) {
    FP8RT_ASSIGN_OR_RETURN(const bool fused, FlashAttentionFits(dh));
    if (fused) return LaunchFlashForward(out, lse, q, k, v, b, t, h, hkv, dh, scale, stream);
  }
  FP8RT_ASSIGN_OR_RETURN(const int sms, CurrentDeviceSmCount());
  return Launch(AttentionForwardKernel, dim3(WarpPerRowGrid(rows, sms)), ToCuda(stream), out, lse,
                q, k, v, rows, t, h, hkv, dh, scale);
}

// The backward of both entry pairs, as AttentionForwardOf.
absl::Status AttentionBackwardOf(const char* op, bool bf16, float* dq, float* dk, float* dv,
                                 const float* dout, const float* q, const float* k, const float* v,
                                 const float* out, const float* lse, int64_t b, int64_t t,
                                 int64_t h, int64_t hkv, int64_t dh, Stream stream) {
  FP8RT_ASSIGN_OR_RETURN(const int64_t rows, AttentionRows(op, b, t, h, hkv, dh));
  const Buffers buffers = {{"dq", dq}, {"dk", dk}, {"dv", dv},   {"dout", dout}, {"q", q},
                           {"k", k},   {"v", v},   {"out", out}, {"lse", lse}};
  if (rows == 0) return CheckDevicePointers(buffers);
  FP8RT_RETURN_IF_ERROR(CheckBuffers(op, buffers));
  const float scale = AttentionScale(dh);
  if (bf16) {
    FP8RT_ASSIGN_OR_RETURN(const bool fused, FlashAttentionFits(dh));
    if (fused) {
      return LaunchFlashBackward(dq, dk, dv, dout, q, k, v, out, lse, b, t, h, hkv, dh, scale,
                                 stream);
    }
  }
  FP8RT_ASSIGN_OR_RETURN(const int sms, CurrentDeviceSmCount());
  const cudaStream_t s = ToCuda(stream);
  FP8RT_RETURN_IF_ERROR(Launch(AttentionDqKernel, dim3(WarpPerRowGrid(rows, sms)), s, dq, dout, q,
                               k, v, out, lse, rows, t, h, hkv, dh, scale));
  // Split each kv head's keys into enough ranges for about four blocks per SM, at most
  // kMaxKeyRanges and at least one key per warp. The split changes only who computes a key.
  const int64_t heads = b * hkv;
  const int64_t wanted = (4 * static_cast<int64_t>(sms) + heads - 1) / heads;
  const int64_t most = std::clamp<int64_t>((t + kWarps - 1) / kWarps, 1, kMaxKeyRanges);
  const int64_t split = std::clamp<int64_t>(wanted, 1, most);
  const int64_t key_range = (t + split - 1) / split;
  const int64_t ranges = (t + key_range - 1) / key_range;
  const unsigned grid = static_cast<unsigned>(GridFor(heads * ranges, 1, sms, 16));
  return Launch(AttentionDkDvKernel, dim3(grid), s, dk, dv, dout, q, k, v, out, lse, heads, ranges,
                key_range, t, h, hkv, dh, scale);
}

}  // namespace

absl::Status AttentionForwardCuda(float* out, float* lse, const float* q, const float* k,
                                  const float* v, int64_t b, int64_t t, int64_t h, int64_t hkv,
                                  int64_t dh, Stream stream) {
  return AttentionForwardOf("attention_forward", false, out, lse, q, k, v, b, t, h, hkv, dh,
                            stream);
}

absl::Status AttentionBackwardCuda(float* dq, float* dk, float* dv, const float* dout,
                                   const float* q, const float* k, const float* v, const float* out,
                                   const float* lse, int64_t b, int64_t t, int64_t h, int64_t hkv,
                                   int64_t dh, Stream stream) {
  return AttentionBackwardOf("attention_backward", false, dq, dk, dv, dout, q, k, v, out, lse, b, t,
                             h, hkv, dh, stream);
}

absl::Status AttentionForwardBf16Cuda(float* out, float* lse, const float* q, const float* k,
                                      const float* v, int64_t b, int64_t t, int64_t h, int64_t hkv,
                                      int64_t dh, Stream stream) {
  return AttentionForwardOf("attention_forward_bf16", true, out, lse, q, k, v, b, t, h, hkv, dh,
                            stream);
}

absl::Status AttentionBackwardBf16Cuda(float* dq, float* dk, float* dv, const float* dout,
                                       const float* q, const float* k, const float* v,
                                       const float* out, const float* lse, int64_t b, int64_t t,
                                       int64_t h, int64_t hkv, int64_t dh, Stream stream) {
  return AttentionBackwardOf("attention_backward_bf16", true, dq, dk, dv, dout, q, k, v, out, lse,
                             b, t, h, hkv, dh, stream);
}

absl::Status CrossEntropyForwardCuda(float* probs, float* losses, const float* logits,
                                     const int32_t* targets, int64_t n, int64_t v, Stream stream) {
  constexpr const char* kOp = "cross_entropy_forward";
  FP8RT_RETURN_IF_ERROR(CheckSizes(kOp, {{"n", n}, {"v", v}}));
  FP8RT_RETURN_IF_ERROR(Product(kOp, "n * v", {n, v}).status());
  const Buffers buffers = {
      {"probs", probs}, {"losses", losses}, {"logits", logits}, {"targets", targets}};
  if (n == 0) return CheckDevicePointers(buffers);
  if (v == 0) return absl::InvalidArgumentError(absl::StrCat(kOp, ": v is 0 (must be > 0)"));
  FP8RT_RETURN_IF_ERROR(CheckBuffers(kOp, buffers));
  FP8RT_ASSIGN_OR_RETURN(const int sms, CurrentDeviceSmCount());
  const unsigned grid = static_cast<unsigned>(GridFor(n, 1, sms, 16));
  return Launch(CrossEntropyForwardKernel, dim3(grid), ToCuda(stream), probs, losses, logits,
                targets, n, v);
}

absl::Status CrossEntropyBackwardCuda(float* dlogits, const float* probs, const int32_t* targets,
                                      int64_t n, int64_t v, float dloss, Stream stream) {
  constexpr const char* kOp = "cross_entropy_backward";
  FP8RT_RETURN_IF_ERROR(CheckSizes(kOp, {{"n", n}, {"v", v}}));
  FP8RT_RETURN_IF_ERROR(Product(kOp, "n * v", {n, v}).status());
  const Buffers buffers = {{"dlogits", dlogits}, {"probs", probs}, {"targets", targets}};
  if (n == 0) return CheckDevicePointers(buffers);
  if (v == 0) return absl::InvalidArgumentError(absl::StrCat(kOp, ": v is 0 (must be > 0)"));
  FP8RT_RETURN_IF_ERROR(CheckBuffers(kOp, buffers));
  // The CPU reference's scale, rounded once on the host.
  const float row_scale = dloss / static_cast<float>(n);
  const dim3 grid(static_cast<unsigned>(std::min<int64_t>((v + kThreads - 1) / kThreads, 1024)),
                  static_cast<unsigned>(std::min<int64_t>(n, 65535)));
  return Launch(CrossEntropyBackwardKernel, grid, ToCuda(stream), dlogits, probs, targets, n, v,
                row_scale);
}

}  // namespace fp8rt::kernels::cuda_internal
