// The CUDA backend's layer-op table (LayerOps, kernels/layer_ops.h): every entry but attention and
// cross-entropy, whose kernels live in kernels/cuda/attention_cuda.cu, the MoE routing
// (kernels/cuda/moe_cuda.cu) and the memory and stream entries (kernels/cuda/memory_cuda.cc).
// Per-element arithmetic is kernels/cuda/layer_math.cuh, a mirror of the CPU reference; what
// differs from the CPU is only the order of the sums inside RMSNorm and LayerNorm and of the column
// sums of their weight and bias gradients and of bias_backward (fixed here, so reruns are bit for
// bit), the order of sum_squares (fixed by the count alone, layer_math.cuh, so its bits are the
// same on every GPU), the device tanhf in GELU and expf in SwiGLU, and the device's FP64 pow, cos
// and sin in RoPE. tests/gpu/layer_ops_cuda_test.cc compares every entry with the CPU.
//
// Index (kernels, then the entries that launch them):
//   EmbeddingForwardKernel   flat copy of table rows
//   EmbeddingSortKeysKernel  embedding_backward, step 1: (token, row) pairs to sort, tokens
//                            outside [0, V) mapped to one key past every valid one
//   (SortKeyRowPairsCuda)    step 2: a stable sort by token, so equal tokens keep ascending rows
//                            (CUB's radix sort, kernels/cuda/sort_cuda.cu)
//   EmbeddingRunsKernel      step 3: one work item per run of equal tokens and 256-column tile:
//                            it owns those columns of the table row and adds the run's rows in
//                            ascending n (the CPU order: bit for bit, no atomics)
//   RmsNormForwardKernel, RmsNormBackwardDxKernel   one block per row, block sum of the row
//   RmsNormDweightKernel     32-column tiles, 32 row lanes each summing every 32nd row, lanes
//                            combined in lane order: fixed, atomic-free
//   LayerNormForwardKernel, LayerNormBackwardDxKernel   one block per row, block sums of the row
//                            (the mean, then the squared deviations; the backward's two sums)
//   ColumnSumsKernel<ln>     LayerNorm's dweight and dbias (ln) or the bias gradient: the
//                            RmsNormDweightKernel's tiles and lanes, a fixed, atomic-free order
//   BiasForwardKernel        element-wise, bit for bit
//   RopeKernel<forward>      one thread per (row, frequency i): cos and sin in FP64, then the
//                            pair (i, i + Dh/2) of every head of the row
//   GeluForwardKernel, GeluBackwardKernel, SwigluForwardKernel, SwigluBackwardKernel,
//   ResidualForwardKernel, ResidualBackwardKernel, FillKernel, AdamWKernel
//                            element-wise, grid-stride
//   TransposeKernel          32 x 32 tiles through shared memory
//   MoveHeadsKernel<split>   split_heads / join_heads (grouped by kv head), one thread per
//                            element of qkv
//   SumSquaresKernel         pass 1 of sum_squares: SumSquaresBlocks(count) blocks (at most 512,
//                            fewer for small counts; the grid depends on the count alone) of 256
//                            threads, FP64 grid-strided sums, a pairwise tree per block -> one
//                            partial per block (or the result, with one block)
//   SumPartialsKernel        pass 2: one block adds the partials in a fixed strided order and the
//                            same tree. No atomics: the order is fixed (layer_math.cuh)
//   the table (kLayerOps)    these entries, attention_cuda.cu's, moe_cuda.cu's and
//                            memory_cuda.cc's (allocate ... copy_bytes, synchronize)
//
// No CUDA runtime call here but the launches, cudaGetLastError, cudaFreeAsync, cudaMemsetAsync
// and cudaMemcpyAsync, so that tests/gpu/layer_ops_host_test runs this file's own source on the
// CPU over the block emulator (tests/gpu/host_cuda.h).
//
// Buffers: every pointer is device memory, checked before anything is launched (a null pointer
// is refused when the op has work). Nothing is allocated but by allocate, except sum_squares'
// block partials (at most 4 KB), embedding_backward's sort buffers (24 bytes per token plus
// CUB's scratch) and the fused attention backward's D_i (4 bytes per query row and head,
// kernels/cuda/flash_attention_cuda.cu): stream-ordered scratch, cudaMallocFromPoolAsync /
// cudaFreeAsync on the given stream from the array pool (which gives its unused memory back when
// the device is full), which neither waits nor races with the same op on other streams. Every
// launch goes on the given stream, and no entry waits for it but synchronize (and deallocate of
// managed or pinned memory: cudaFree and cudaFreeHost wait; device-only arrays are stream-ordered
// and do not). Token ids outside [0, V) are the caller's to prevent: here they never make a kernel
// touch memory outside the buffers (embedding_forward writes NaN rows for them, embedding_backward
// skips them), so they cannot poison the context.
#include <cuda_runtime.h>

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <initializer_list>
#include <utility>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "kernels/cuda/cuda_ops_internal.h"
#include "kernels/cuda/layer_launch.cuh"
#include "kernels/cuda/layer_math.cuh"
#include "kernels/layer_ops.h"
#include "kernels/ops.h"
#include "runtime/core/checks.h"
#include "runtime/core/status.h"

namespace fp8rt::kernels::cuda_internal {
namespace {

using layer_launch::CheckPointers;
using layer_launch::CheckSizes;
using layer_launch::GridOf;
using layer_launch::GridOfRows;
using layer_launch::kThreads;
using layer_launch::Launch;
using layer_launch::ToCuda;
// RmsNormDweightKernel: 32 columns x kDweightLanes row lanes per block.
constexpr int kDweightLanes = 32;

__device__ __forceinline__ int64_t GlobalThread() {
  return static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
}
__device__ __forceinline__ int64_t GridThreads() {
  return static_cast<int64_t>(gridDim.x) * blockDim.x;
}

// Sum over a 1-D block of kThreads threads, returned to every thread: butterfly within each warp
// (every lane ends with the same bits, FP32 addition being commutative), then warp 0 adds the
// eight warp sums in warp order. A fixed order for a fixed block size. Every thread must call it;
// it starts with a barrier so that back-to-back calls may reuse `scratch` (kThreads / 32 floats).
__device__ __forceinline__ float BlockSum(float v, float* scratch) {
  __syncthreads();
  for (int offset = 16; offset > 0; offset >>= 1) {
    v = AddF32(v, __shfl_xor_sync(0xFFFFFFFFu, v, offset));
  }
  if ((threadIdx.x & 31) == 0) scratch[threadIdx.x >> 5] = v;
  __syncthreads();
  if (threadIdx.x == 0) {
    float total = scratch[0];
    for (int w = 1; w < kThreads / 32; ++w) total = AddF32(total, scratch[w]);
    scratch[0] = total;
  }
  __syncthreads();
  return scratch[0];
}

// --- embedding ---------------------------------------------------------------------------------

__global__ void __launch_bounds__(kThreads)
    EmbeddingForwardKernel(float* __restrict__ out, const int32_t* __restrict__ tokens,
                           const float* __restrict__ table, int64_t n, int64_t v, int64_t c) {
  for (int64_t i = GlobalThread(); i < n * c; i += GridThreads()) {
    const int64_t row = i / c;
    const int64_t col = i - row * c;
    const int64_t tok = tokens[row];
    out[i] = tok >= 0 && tok < v ? table[tok * c + col] : __uint_as_float(0x7FC00000u);
  }
}

// keys[i] = tokens[i] where it is in [0, v), else `invalid` (> every valid token); rows[i] = i.
__global__ void __launch_bounds__(kThreads)
    EmbeddingSortKeysKernel(uint32_t* __restrict__ keys, int64_t* __restrict__ rows,
                            const int32_t* __restrict__ tokens, int64_t n, int64_t v,
                            uint32_t invalid) {
  for (int64_t i = GlobalThread(); i < n; i += GridThreads()) {
    const int64_t tok = tokens[i];
    keys[i] = tok >= 0 && tok < v ? static_cast<uint32_t>(tok) : invalid;
    rows[i] = i;
  }
}

// keys, rows: the pairs sorted by key, stably, so a run of equal keys lists its rows of dout in
// ascending order. Work item (i, tile), for i the first position of a run of a valid key tok,
// owns columns [tile * kThreads, +kThreads) of dtable[tok, :]: each thread adds the run's rows to
// its column in ascending n, exactly the CPU's order of additions, and no other item writes those
// elements. Items at other positions return at once.
__global__ void __launch_bounds__(kThreads)
    EmbeddingRunsKernel(float* __restrict__ dtable, const float* __restrict__ dout,
                        const uint32_t* __restrict__ keys, const int64_t* __restrict__ rows,
                        int64_t n, int64_t c, uint32_t invalid) {
  const int64_t tiles = (c + kThreads - 1) / kThreads;
  for (int64_t item = blockIdx.x; item < n * tiles; item += gridDim.x) {
    const int64_t i = item / tiles;
    const uint32_t tok = keys[i];
    if (tok == invalid || (i > 0 && keys[i - 1] == tok)) continue;
    const int64_t col = (item - i * tiles) * kThreads + threadIdx.x;
    if (col >= c) continue;
    int64_t end = i + 1;
    while (end < n && keys[end] == tok) ++end;
    float* cell = dtable + static_cast<int64_t>(tok) * c + col;
    float acc = *cell;
    for (int64_t j = i; j < end; ++j) acc = AddF32(acc, dout[rows[j] * c + col]);
    *cell = acc;
  }
}

// --- RMSNorm -----------------------------------------------------------------------------------

__global__ void __launch_bounds__(kThreads)
    RmsNormForwardKernel(float* __restrict__ out, float* __restrict__ rstd,
                         const float* __restrict__ x, const float* __restrict__ weight, int64_t n,
                         int64_t c, float eps) {
  FP8RT_STATIC_SHARED(float, scratch, [kThreads / 32]);
  for (int64_t r = blockIdx.x; r < n; r += gridDim.x) {
    const float* xr = x + r * c;
    float sum_sq = 0.0f;
    for (int64_t j = threadIdx.x; j < c; j += blockDim.x)
      sum_sq = AddF32(sum_sq, RmsNormSquare(xr[j]));
    const float rs = RmsNormRstd(BlockSum(sum_sq, scratch), c, eps);
    if (threadIdx.x == 0) rstd[r] = rs;
    float* outr = out + r * c;
    for (int64_t j = threadIdx.x; j < c; j += blockDim.x)
      outr[j] = RmsNormOut(xr[j], rs, weight[j]);
  }
}

// dx of each row (accumulated): one block per row.
__global__ void __launch_bounds__(kThreads)
    RmsNormBackwardDxKernel(float* __restrict__ dx, const float* __restrict__ dout,
                            const float* __restrict__ x, const float* __restrict__ weight,
                            const float* __restrict__ rstd, int64_t n, int64_t c) {
  FP8RT_STATIC_SHARED(float, scratch, [kThreads / 32]);
  for (int64_t r = blockIdx.x; r < n; r += gridDim.x) {
    const float* xr = x + r * c;
    const float* dyr = dout + r * c;
    float gx = 0.0f;
    for (int64_t j = threadIdx.x; j < c; j += blockDim.x) {
      gx = AddF32(gx, RmsNormGxTerm(dyr[j], weight[j], xr[j]));
    }
    gx = BlockSum(gx, scratch);
    const float rs = rstd[r];
    const float coef = RmsNormCoef(rs, gx, c);
    float* dxr = dx + r * c;
    for (int64_t j = threadIdx.x; j < c; j += blockDim.x) {
      dxr[j] = RmsNormDx(dxr[j], rs, dyr[j], weight[j], coef, xr[j]);
    }
  }
}

// dweight (accumulated): blocks of 32 x kDweightLanes threads, one 32-column tile at a time;
// lane y sums rows y, y + kDweightLanes, ... in ascending order, then lane 0 adds the lanes'
// partial sums in lane order and adds the total to dweight.
__global__ void __launch_bounds__(32 * kDweightLanes)
    RmsNormDweightKernel(float* __restrict__ dweight, const float* __restrict__ dout,
                         const float* __restrict__ x, const float* __restrict__ rstd, int64_t n,
                         int64_t c) {
  FP8RT_STATIC_SHARED(float, partial, [kDweightLanes][33]);
  const int tx = threadIdx.x, ty = threadIdx.y;
  const int64_t tiles = (c + 31) / 32;
  for (int64_t tile = blockIdx.x; tile < tiles; tile += gridDim.x) {
    const int64_t col = tile * 32 + tx;
    float sum = 0.0f;
    if (col < c) {
      for (int64_t r = ty; r < n; r += kDweightLanes) {
        sum = AddF32(sum, RmsNormDweightTerm(dout[r * c + col], x[r * c + col], rstd[r]));
      }
    }
    partial[ty][tx] = sum;
    __syncthreads();
    if (ty == 0 && col < c) {
      float total = partial[0][tx];
      for (int y = 1; y < kDweightLanes; ++y) total = AddF32(total, partial[y][tx]);
      dweight[col] = AddF32(dweight[col], total);
    }
    __syncthreads();
  }
}

// --- LayerNorm ---------------------------------------------------------------------------------

// One block per row: the mean (block sum of x), then rstd (block sum of the squared deviations
// from that mean), then the row's outputs.
__global__ void __launch_bounds__(kThreads)
    LayerNormForwardKernel(float* __restrict__ out, float* __restrict__ mean,
                           float* __restrict__ rstd, const float* __restrict__ x,
                           const float* __restrict__ weight, const float* __restrict__ bias,
                           int64_t n, int64_t c, float eps) {
  FP8RT_STATIC_SHARED(float, scratch, [kThreads / 32]);
  for (int64_t r = blockIdx.x; r < n; r += gridDim.x) {
    const float* xr = x + r * c;
    float sum = 0.0f;
    for (int64_t j = threadIdx.x; j < c; j += blockDim.x) sum = AddF32(sum, xr[j]);
    const float m = LayerNormMean(BlockSum(sum, scratch), c);
    float sum_sq = 0.0f;
    for (int64_t j = threadIdx.x; j < c; j += blockDim.x) {
      sum_sq = AddF32(sum_sq, LayerNormSquare(LayerNormCentered(xr[j], m)));
    }
    const float rs = LayerNormRstd(BlockSum(sum_sq, scratch), c, eps);
    if (threadIdx.x == 0) {
      mean[r] = m;
      rstd[r] = rs;
    }
    float* outr = out + r * c;
    for (int64_t j = threadIdx.x; j < c; j += blockDim.x) {
      outr[j] = LayerNormOut(xr[j], m, rs, weight[j], bias[j]);
    }
  }
}

// dx of each row (accumulated): one block per row, two block sums (g and g * xhat).
__global__ void __launch_bounds__(kThreads)
    LayerNormBackwardDxKernel(float* __restrict__ dx, const float* __restrict__ dout,
                              const float* __restrict__ x, const float* __restrict__ weight,
                              const float* __restrict__ mean, const float* __restrict__ rstd,
                              int64_t n, int64_t c) {
  FP8RT_STATIC_SHARED(float, scratch, [kThreads / 32]);
  for (int64_t r = blockIdx.x; r < n; r += gridDim.x) {
    const float* xr = x + r * c;
    const float* dyr = dout + r * c;
    const float m = mean[r], rs = rstd[r];
    float g_sum = 0.0f, gx_sum = 0.0f;
    for (int64_t j = threadIdx.x; j < c; j += blockDim.x) {
      const float g = LayerNormG(dyr[j], weight[j]);
      g_sum = AddF32(g_sum, g);
      gx_sum = AddF32(gx_sum, LayerNormGxTerm(g, LayerNormXhat(xr[j], m, rs)));
    }
    const float g_mean = LayerNormMean(BlockSum(g_sum, scratch), c);
    const float gx_mean = LayerNormMean(BlockSum(gx_sum, scratch), c);
    float* dxr = dx + r * c;
    for (int64_t j = threadIdx.x; j < c; j += blockDim.x) {
      dxr[j] = LayerNormDx(dxr[j], LayerNormG(dyr[j], weight[j]), g_mean,
                           LayerNormXhat(xr[j], m, rs), gx_mean, rs);
    }
  }
}

// Column sums of dout (into dbias) and, with kLayerNorm, of dout * xhat (into dweight), both
// accumulated: RmsNormDweightKernel's order (32-column tiles, lane y sums rows y,
// y + kDweightLanes, ... ascending, then lane 0 adds the lanes in lane order onto the gradient).
template <bool kLayerNorm>
__global__ void __launch_bounds__(32 * kDweightLanes)
    ColumnSumsKernel(float* __restrict__ dweight, float* __restrict__ dbias,
                     const float* __restrict__ dout, const float* __restrict__ x,
                     const float* __restrict__ mean, const float* __restrict__ rstd, int64_t n,
                     int64_t c) {
  FP8RT_STATIC_SHARED(float, partial_b, [kDweightLanes][33]);
  // partial_w is written, and unused, without kLayerNorm.
  FP8RT_STATIC_SHARED(float, partial_w, [kDweightLanes][33]);
  const int tx = threadIdx.x, ty = threadIdx.y;
  const int64_t tiles = (c + 31) / 32;
  for (int64_t tile = blockIdx.x; tile < tiles; tile += gridDim.x) {
    const int64_t col = tile * 32 + tx;
    float sum_b = 0.0f, sum_w = 0.0f;
    if (col < c) {
      for (int64_t r = ty; r < n; r += kDweightLanes) {
        const float dy = dout[r * c + col];
        sum_b = AddF32(sum_b, dy);
        if constexpr (kLayerNorm) {
          sum_w = AddF32(sum_w,
                         LayerNormDweightTerm(dy, LayerNormXhat(x[r * c + col], mean[r], rstd[r])));
        }
      }
    }
    partial_b[ty][tx] = sum_b;
    partial_w[ty][tx] = sum_w;
    __syncthreads();
    if (ty == 0 && col < c) {
      float total_b = partial_b[0][tx];
      for (int y = 1; y < kDweightLanes; ++y) total_b = AddF32(total_b, partial_b[y][tx]);
      dbias[col] = AddF32(dbias[col], total_b);
      if constexpr (kLayerNorm) {
        float total_w = partial_w[0][tx];
        for (int y = 1; y < kDweightLanes; ++y) total_w = AddF32(total_w, partial_w[y][tx]);
        dweight[col] = AddF32(dweight[col], total_w);
      }
    }
    __syncthreads();
  }
}

// --- bias and RoPE -------------------------------------------------------------------------------

__global__ void __launch_bounds__(kThreads)
    BiasForwardKernel(float* __restrict__ out, const float* __restrict__ bias, int64_t n,
                      int64_t c) {
  for (int64_t i = GlobalThread(); i < n * c; i += GridThreads()) {
    out[i] = AddF32(out[i], bias[i % c]);
  }
}

// Work item (row r, frequency i < Dh/2): cos and sin of position r % t, then channel pair
// (i, i + Dh/2) of each of the row's h heads. Forward: out = rotation of in (out may be in: each
// pair is read, then written, by one thread; no __restrict__). Backward: out += transpose
// rotation of in.
template <bool kForward>
__global__ void __launch_bounds__(kThreads)
    RopeKernel(float* out, const float* in, int64_t n, int64_t t, int64_t h, int64_t dh,
               float theta) {
  const int64_t half = dh / 2;
  for (int64_t item = GlobalThread(); item < n * half; item += GridThreads()) {
    const int64_t r = item / half;
    const int64_t i = item - r * half;
    float c, s;
    RopeCosSin(r % t, i, dh, theta, c, s);
    for (int64_t hh = 0; hh < h; ++hh) {
      const int64_t at = (r * h + hh) * dh + i;
      const float a = in[at], b = in[at + half];
      if constexpr (kForward) {
        float oa, ob;
        RopeForwardPair(a, b, c, s, oa, ob);
        out[at] = oa;
        out[at + half] = ob;
      } else {
        float da = out[at], db = out[at + half];
        RopeBackwardPair(a, b, c, s, da, db);
        out[at] = da;
        out[at + half] = db;
      }
    }
  }
}

// --- element-wise ------------------------------------------------------------------------------

__global__ void __launch_bounds__(kThreads)
    SwigluForwardKernel(float* __restrict__ out, const float* __restrict__ gate,
                        const float* __restrict__ up, int64_t n) {
  for (int64_t i = GlobalThread(); i < n; i += GridThreads()) {
    out[i] = SwigluForwardOne(gate[i], up[i]);
  }
}

__global__ void __launch_bounds__(kThreads)
    SwigluBackwardKernel(float* __restrict__ dgate, float* __restrict__ dup,
                         const float* __restrict__ dout, const float* __restrict__ gate,
                         const float* __restrict__ up, int64_t n) {
  for (int64_t i = GlobalThread(); i < n; i += GridThreads()) {
    float dg = dgate[i], du = dup[i];
    SwigluBackwardOne(dout[i], gate[i], up[i], dg, du);
    dgate[i] = dg;
    dup[i] = du;
  }
}

__global__ void __launch_bounds__(kThreads)
    GeluForwardKernel(float* __restrict__ out, const float* __restrict__ x, int64_t n) {
  for (int64_t i = GlobalThread(); i < n; i += GridThreads()) out[i] = GeluForwardOne(x[i]);
}

__global__ void __launch_bounds__(kThreads)
    GeluBackwardKernel(float* __restrict__ dx, const float* __restrict__ dout,
                       const float* __restrict__ x, int64_t n) {
  for (int64_t i = GlobalThread(); i < n; i += GridThreads()) {
    dx[i] = GeluBackwardOne(dx[i], dout[i], x[i]);
  }
}

// out may be a or b (no __restrict__): each element is read before it is written, by one thread.
__global__ void __launch_bounds__(kThreads)
    ResidualForwardKernel(float* out, const float* a, const float* b, int64_t n) {
  for (int64_t i = GlobalThread(); i < n; i += GridThreads()) out[i] = AddF32(a[i], b[i]);
}

__global__ void __launch_bounds__(kThreads)
    ResidualBackwardKernel(float* __restrict__ da, float* __restrict__ db,
                           const float* __restrict__ dout, int64_t n) {
  for (int64_t i = GlobalThread(); i < n; i += GridThreads()) {
    const float g = dout[i];
    da[i] = AddF32(da[i], g);
    db[i] = AddF32(db[i], g);
  }
}

__global__ void __launch_bounds__(kThreads)
    FillKernel(float* __restrict__ x, float value, int64_t n) {
  for (int64_t i = GlobalThread(); i < n; i += GridThreads()) x[i] = value;
}

// The scalars travel in `k` by value; its pointers are the buffers.
__global__ void __launch_bounds__(kThreads) AdamWKernel(AdamWArgs k) {
  for (int64_t i = GlobalThread(); i < k.count; i += GridThreads()) {
    float master = k.master[i], m = k.m[i], v = k.v[i];
    AdamWOne(k, k.grad[i], master, m, v);
    k.master[i] = master;
    k.m[i] = m;
    k.v[i] = v;
  }
}

// --- layout ------------------------------------------------------------------------------------

// dst[c, r] = src[r, c]: 32 x 32 tiles, 32 x 8 threads; reads and writes both coalesced, through
// a padded shared tile. T is float (activations) or uint8_t (FP8 codes).
template <typename T>
__global__ void __launch_bounds__(kThreads)
    TransposeKernel(T* __restrict__ dst, const T* __restrict__ src, int64_t rows, int64_t cols) {
  FP8RT_STATIC_SHARED(T, tile, [32][33]);
  const int tx = threadIdx.x, ty = threadIdx.y;
  const int64_t tiles_c = (cols + 31) / 32;
  const int64_t tiles = ((rows + 31) / 32) * tiles_c;
  for (int64_t t = blockIdx.x; t < tiles; t += gridDim.x) {
    const int64_t r0 = (t / tiles_c) * 32, c0 = (t % tiles_c) * 32;
    for (int k = 0; k < 32; k += 8) {
      const int64_t r = r0 + ty + k, c = c0 + tx;
      if (r < rows && c < cols) tile[ty + k][tx] = src[r * cols + c];
    }
    __syncthreads();
    for (int k = 0; k < 32; k += 8) {
      const int64_t dr = c0 + ty + k;  // row of dst = column of src
      const int64_t dc = r0 + tx;      // column of dst = row of src
      if (dr < cols && dc < rows) dst[dr * rows + dc] = tile[tx][ty + k];
    }
    __syncthreads();
  }
}

// Element i of qkv [n, kv_heads, q_per_kv + 2, dh] is part (i / dh) % (q_per_kv + 2) of (row,
// kv head) pair i / ((q_per_kv + 2) dh): query head `part` of the pair's group (part < q_per_kv),
// then k, then v. kSplit copies qkv -> parts, otherwise parts -> qkv.
template <bool kSplit>
__global__ void __launch_bounds__(kThreads)
    MoveHeadsKernel(float* q, float* k, float* v, float* qkv, int64_t total, int64_t q_per_kv,
                    int64_t dh) {
  const int64_t pair_size = (q_per_kv + 2) * dh;
  for (int64_t i = GlobalThread(); i < total; i += GridThreads()) {
    const int64_t pair = i / pair_size;
    const int64_t within = i - pair * pair_size;
    const int64_t part = within / dh;
    const int64_t d = within - part * dh;
    float* p = part < q_per_kv ? q + (pair * q_per_kv + part) * dh + d
                               : (part == q_per_kv ? k : v) + pair * dh + d;
    if constexpr (kSplit) {
      *p = qkv[i];
    } else {
      qkv[i] = *p;
    }
  }
}

// --- sum of squares ------------------------------------------------------------------------------

// The pairwise tree of both passes over tree[0..kSumSquaresThreads), one value per thread written
// before the call: for w = T/2, ..., 1, thread t < w adds tree[t + w] into tree[t]; returns with
// the sum in tree[0]. Every thread must call it.
__device__ __forceinline__ void PairwiseTreeF64(double* tree) {
  __syncthreads();
  for (int w = kSumSquaresThreads / 2; w > 0; w >>= 1) {
    if (static_cast<int>(threadIdx.x) < w) tree[threadIdx.x] += tree[threadIdx.x + w];
    __syncthreads();
  }
}

// Pass 1 (layer_math.cuh): each thread its grid-strided elements, then the block's tree;
// partial[blockIdx.x] = the block's sum (the result itself when the grid is one block).
__global__ void __launch_bounds__(kSumSquaresThreads)
    SumSquaresKernel(const float* __restrict__ x, int64_t count, double* __restrict__ partial) {
  FP8RT_STATIC_SHARED(double, tree, [kSumSquaresThreads]);
  tree[threadIdx.x] = SumSquaresStrided(x, count, GlobalThread(), GridThreads());
  PairwiseTreeF64(tree);
  if (threadIdx.x == 0) partial[blockIdx.x] = tree[0];
}

// Pass 2, one block: thread t adds partial[t], partial[t + T], ... in ascending order, then the
// tree; *out = the sum.
__global__ void __launch_bounds__(kSumSquaresThreads)
    SumPartialsKernel(const double* __restrict__ partial, int blocks, double* __restrict__ out) {
  FP8RT_STATIC_SHARED(double, tree, [kSumSquaresThreads]);
  double s = 0.0;
  for (int i = static_cast<int>(threadIdx.x); i < blocks; i += kSumSquaresThreads) s += partial[i];
  tree[threadIdx.x] = s;
  PairwiseTreeF64(tree);
  if (threadIdx.x == 0) *out = tree[0];
}

// --- entries -------------------------------------------------------------------------------------

absl::Status EmbeddingForwardEntry(float* out, const int32_t* tokens, const float* table, int64_t n,
                                   int64_t v, int64_t c, Stream stream) {
  constexpr const char* kOp = "embedding_forward";
  FP8RT_RETURN_IF_ERROR(CheckSizes(kOp, {{"n", n}, {"v", v}, {"c", c}}));
  if (n == 0 || c == 0) return absl::OkStatus();
  FP8RT_RETURN_IF_ERROR(CheckPointers(kOp, {{"out", out}, {"tokens", tokens}, {"table", table}}));
  FP8RT_ASSIGN_OR_RETURN(const dim3 grid, GridOf(n * c));
  return Launch(EmbeddingForwardKernel, grid, dim3(kThreads), stream, out, tokens, table, n, v, c);
}

absl::Status EmbeddingBackwardEntry(float* dtable, const float* dout, const int32_t* tokens,
                                    int64_t n, int64_t v, int64_t c, Stream stream) {
  constexpr const char* kOp = "embedding_backward";
  FP8RT_RETURN_IF_ERROR(CheckSizes(kOp, {{"n", n}, {"v", v}, {"c", c}}));
  if (n == 0 || c == 0) return absl::OkStatus();
  FP8RT_RETURN_IF_ERROR(
      CheckPointers(kOp, {{"dtable", dtable}, {"dout", dout}, {"tokens", tokens}}));
  if (v == 0) return absl::OkStatus();  // no token is in [0, 0): nothing to add
  // Valid tokens are int32 values below v, so below invalid = min(v, 2^31): that key sorts after
  // every valid one and the sort needs only its bit width.
  const auto invalid = static_cast<uint32_t>(std::min<int64_t>(v, int64_t{1} << 31));
  const int end_bit = std::bit_width(invalid);
  const cudaStream_t s = ToCuda(stream);
  size_t sort_bytes = 0;  // a size query: no work is enqueued
  FP8RT_RETURN_IF_ERROR(SortKeyRowPairsCuda(nullptr, &sort_bytes, nullptr, nullptr, nullptr,
                                            nullptr, n, end_bit, stream));
  // One allocation, each part at a 256-byte boundary: keys and rows, before and after the sort,
  // then CUB's scratch.
  const auto aligned = [](size_t b) -> size_t { return (b + 255) / 256 * 256; };
  const size_t key_bytes = aligned(static_cast<size_t>(n) * sizeof(uint32_t));
  const size_t row_bytes = aligned(static_cast<size_t>(n) * sizeof(int64_t));
  FP8RT_ASSIGN_OR_RETURN(
      void* const scratch,
      AllocateOnStream(kOp, 2 * key_bytes + 2 * row_bytes + aligned(sort_bytes), stream));
  std::byte* const base = static_cast<std::byte*>(scratch);
  auto* const keys_in = reinterpret_cast<uint32_t*>(base);
  auto* const keys_out = reinterpret_cast<uint32_t*>(base + key_bytes);
  auto* const rows_in = reinterpret_cast<int64_t*>(base + 2 * key_bytes);
  auto* const rows_out = reinterpret_cast<int64_t*>(base + 2 * key_bytes + row_bytes);
  void* const sort_scratch = base + 2 * key_bytes + 2 * row_bytes;
  const absl::Status launched = [&]() -> absl::Status {
    FP8RT_ASSIGN_OR_RETURN(const dim3 grid, GridOf(n));
    FP8RT_RETURN_IF_ERROR(Launch(EmbeddingSortKeysKernel, grid, dim3(kThreads), stream, keys_in,
                                 rows_in, tokens, n, v, invalid));
    size_t bytes = sort_bytes;
    FP8RT_RETURN_IF_ERROR(SortKeyRowPairsCuda(sort_scratch, &bytes, keys_in, keys_out, rows_in,
                                              rows_out, n, end_bit, stream));
    FP8RT_ASSIGN_OR_RETURN(const dim3 runs_grid, GridOfRows(n * ((c + kThreads - 1) / kThreads)));
    return Launch(EmbeddingRunsKernel, runs_grid, dim3(kThreads), stream, dtable, dout,
                  static_cast<const uint32_t*>(keys_out), static_cast<const int64_t*>(rows_out), n,
                  c, invalid);
  }();
  // Freed in stream order after whatever was enqueued, whether or not every step went through.
  const cudaError_t freed = cudaFreeAsync(scratch, s);
  FP8RT_RETURN_IF_ERROR(launched);
  CUDA_RETURN_IF_ERROR(freed);
  return absl::OkStatus();
}

absl::Status RmsNormForwardEntry(float* out, float* rstd, const float* x, const float* weight,
                                 int64_t n, int64_t c, float eps, Stream stream) {
  constexpr const char* kOp = "rmsnorm_forward";
  FP8RT_RETURN_IF_ERROR(CheckSizes(kOp, {{"n", n}, {"c", c}}));
  if (n == 0) return absl::OkStatus();
  if (c == 0) {
    // The CPU reference aborts here: the mean over no channels is 0 / 0.
    return absl::InvalidArgumentError(absl::StrCat(kOp, ": c is 0 with n = ", n, " rows"));
  }
  FP8RT_RETURN_IF_ERROR(
      CheckPointers(kOp, {{"out", out}, {"rstd", rstd}, {"x", x}, {"weight", weight}}));
  FP8RT_ASSIGN_OR_RETURN(const dim3 grid, GridOfRows(n));
  return Launch(RmsNormForwardKernel, grid, dim3(kThreads), stream, out, rstd, x, weight, n, c,
                eps);
}

absl::Status RmsNormBackwardEntry(float* dx, float* dweight, const float* dout, const float* x,
                                  const float* weight, const float* rstd, int64_t n, int64_t c,
                                  Stream stream) {
  constexpr const char* kOp = "rmsnorm_backward";
  FP8RT_RETURN_IF_ERROR(CheckSizes(kOp, {{"n", n}, {"c", c}}));
  if (n == 0 || c == 0) return absl::OkStatus();
  FP8RT_RETURN_IF_ERROR(CheckPointers(kOp, {{"dx", dx},
                                            {"dweight", dweight},
                                            {"dout", dout},
                                            {"x", x},
                                            {"weight", weight},
                                            {"rstd", rstd}}));
  FP8RT_ASSIGN_OR_RETURN(const dim3 rows_grid, GridOfRows(n));
  FP8RT_RETURN_IF_ERROR(Launch(RmsNormBackwardDxKernel, rows_grid, dim3(kThreads), stream, dx, dout,
                               x, weight, rstd, n, c));
  FP8RT_ASSIGN_OR_RETURN(const dim3 tiles_grid,
                         GridOf(((c + 31) / 32) * 32 * kDweightLanes, 32 * kDweightLanes));
  return Launch(RmsNormDweightKernel, tiles_grid, dim3(32, kDweightLanes), stream, dweight, dout, x,
                rstd, n, c);
}

// InvalidArgument naming `eps` unless it is finite and >= 0 (the CPU entry's message).
absl::Status CheckEps(const char* op, float eps) {
  if (!(std::isfinite(eps) && eps >= 0.0f)) {
    return absl::InvalidArgumentError(
        absl::StrCat(op, ": eps is ", eps, " (must be finite, >= 0)"));
  }
  return absl::OkStatus();
}

absl::Status LayerNormForwardEntry(float* out, float* mean, float* rstd, const float* x,
                                   const float* weight, const float* bias, int64_t n, int64_t c,
                                   float eps, Stream stream) {
  constexpr const char* kOp = "layernorm_forward";
  FP8RT_RETURN_IF_ERROR(CheckSizes(kOp, {{"n", n}, {"c", c}}));
  FP8RT_RETURN_IF_ERROR(CheckEps(kOp, eps));
  if (n == 0) return absl::OkStatus();
  if (c == 0)
    return absl::InvalidArgumentError(absl::StrCat(kOp, ": c is 0 with n = ", n, " rows"));
  FP8RT_RETURN_IF_ERROR(CheckPointers(kOp, {{"out", out},
                                            {"mean", mean},
                                            {"rstd", rstd},
                                            {"x", x},
                                            {"weight", weight},
                                            {"bias", bias}}));
  FP8RT_ASSIGN_OR_RETURN(const dim3 grid, GridOfRows(n));
  return Launch(LayerNormForwardKernel, grid, dim3(kThreads), stream, out, mean, rstd, x, weight,
                bias, n, c, eps);
}

absl::Status LayerNormBackwardEntry(float* dx, float* dweight, float* dbias, const float* dout,
                                    const float* x, const float* weight, const float* mean,
                                    const float* rstd, int64_t n, int64_t c, Stream stream) {
  constexpr const char* kOp = "layernorm_backward";
  FP8RT_RETURN_IF_ERROR(CheckSizes(kOp, {{"n", n}, {"c", c}}));
  if (n == 0) return absl::OkStatus();
  if (c == 0)
    return absl::InvalidArgumentError(absl::StrCat(kOp, ": c is 0 with n = ", n, " rows"));
  FP8RT_RETURN_IF_ERROR(CheckPointers(kOp, {{"dx", dx},
                                            {"dweight", dweight},
                                            {"dbias", dbias},
                                            {"dout", dout},
                                            {"x", x},
                                            {"weight", weight},
                                            {"mean", mean},
                                            {"rstd", rstd}}));
  FP8RT_ASSIGN_OR_RETURN(const dim3 rows_grid, GridOfRows(n));
  FP8RT_RETURN_IF_ERROR(Launch(LayerNormBackwardDxKernel, rows_grid, dim3(kThreads), stream, dx,
                               dout, x, weight, mean, rstd, n, c));
  FP8RT_ASSIGN_OR_RETURN(const dim3 tiles_grid,
                         GridOf(((c + 31) / 32) * 32 * kDweightLanes, 32 * kDweightLanes));
  return Launch(ColumnSumsKernel<true>, tiles_grid, dim3(32, kDweightLanes), stream, dweight, dbias,
                dout, x, mean, rstd, n, c);
}

absl::Status BiasForwardEntry(float* out, const float* bias, int64_t n, int64_t c, Stream stream) {
  constexpr const char* kOp = "bias_forward";
  FP8RT_RETURN_IF_ERROR(CheckSizes(kOp, {{"n", n}, {"c", c}}));
  if (n == 0 || c == 0) return absl::OkStatus();
  FP8RT_RETURN_IF_ERROR(CheckPointers(kOp, {{"out", out}, {"bias", bias}}));
  FP8RT_ASSIGN_OR_RETURN(const dim3 grid, GridOf(n * c));
  return Launch(BiasForwardKernel, grid, dim3(kThreads), stream, out, bias, n, c);
}

absl::Status BiasBackwardEntry(float* dbias, const float* dout, int64_t n, int64_t c,
                               Stream stream) {
  constexpr const char* kOp = "bias_backward";
  FP8RT_RETURN_IF_ERROR(CheckSizes(kOp, {{"n", n}, {"c", c}}));
  if (n == 0 || c == 0) return absl::OkStatus();
  FP8RT_RETURN_IF_ERROR(CheckPointers(kOp, {{"dbias", dbias}, {"dout", dout}}));
  FP8RT_ASSIGN_OR_RETURN(const dim3 tiles_grid,
                         GridOf(((c + 31) / 32) * 32 * kDweightLanes, 32 * kDweightLanes));
  return Launch(ColumnSumsKernel<false>, tiles_grid, dim3(32, kDweightLanes), stream,
                static_cast<float*>(nullptr), dbias, dout, static_cast<const float*>(nullptr),
                static_cast<const float*>(nullptr), static_cast<const float*>(nullptr), n, c);
}

// The checks shared by rope_forward and rope_backward (the CPU entries' messages); *work is false
// when there is nothing to do.
absl::Status CheckRope(const char* op, int64_t n, int64_t t, int64_t h, int64_t dh, float theta,
                       bool* work) {
  FP8RT_RETURN_IF_ERROR(CheckSizes(op, {{"n", n}, {"t", t}, {"h", h}, {"dh", dh}}));
  if (!(std::isfinite(theta) && theta > 0.0f)) {
    return absl::InvalidArgumentError(
        absl::StrCat(op, ": theta is ", theta, " (must be finite, > 0)"));
  }
  *work = n > 0 && h > 0;
  if (!*work) return absl::OkStatus();
  if (dh == 0 || dh % 2 != 0) {
    return absl::InvalidArgumentError(absl::StrCat(op, ": dh is ", dh, " (must be even, > 0)"));
  }
  if (t == 0) return absl::InvalidArgumentError(absl::StrCat(op, ": t is 0 with rows to rotate"));
  return absl::OkStatus();
}

absl::Status RopeForwardEntry(float* out, const float* x, int64_t n, int64_t t, int64_t h,
                              int64_t dh, float theta, Stream stream) {
  constexpr const char* kOp = "rope_forward";
  bool work = false;
  FP8RT_RETURN_IF_ERROR(CheckRope(kOp, n, t, h, dh, theta, &work));
  if (!work) return absl::OkStatus();
  FP8RT_RETURN_IF_ERROR(CheckPointers(kOp, {{"out", out}, {"x", x}}));
  FP8RT_ASSIGN_OR_RETURN(const dim3 grid, GridOf(n * (dh / 2)));
  return Launch(RopeKernel<true>, grid, dim3(kThreads), stream, out, x, n, t, h, dh, theta);
}

absl::Status RopeBackwardEntry(float* dx, const float* dout, int64_t n, int64_t t, int64_t h,
                               int64_t dh, float theta, Stream stream) {
  constexpr const char* kOp = "rope_backward";
  bool work = false;
  FP8RT_RETURN_IF_ERROR(CheckRope(kOp, n, t, h, dh, theta, &work));
  if (!work) return absl::OkStatus();
  if (dx == dout) return absl::InvalidArgumentError(absl::StrCat(kOp, ": dx aliases dout"));
  FP8RT_RETURN_IF_ERROR(CheckPointers(kOp, {{"dx", dx}, {"dout", dout}}));
  FP8RT_ASSIGN_OR_RETURN(const dim3 grid, GridOf(n * (dh / 2)));
  return Launch(RopeKernel<false>, grid, dim3(kThreads), stream, dx, dout, n, t, h, dh, theta);
}

absl::Status SwigluForwardEntry(float* out, const float* gate, const float* up, int64_t n,
                                Stream stream) {
  constexpr const char* kOp = "swiglu_forward";
  FP8RT_RETURN_IF_ERROR(CheckSizes(kOp, {{"n", n}}));
  if (n == 0) return absl::OkStatus();
  FP8RT_RETURN_IF_ERROR(CheckPointers(kOp, {{"out", out}, {"gate", gate}, {"up", up}}));
  FP8RT_ASSIGN_OR_RETURN(const dim3 grid, GridOf(n));
  return Launch(SwigluForwardKernel, grid, dim3(kThreads), stream, out, gate, up, n);
}

absl::Status SwigluBackwardEntry(float* dgate, float* dup, const float* dout, const float* gate,
                                 const float* up, int64_t n, Stream stream) {
  constexpr const char* kOp = "swiglu_backward";
  FP8RT_RETURN_IF_ERROR(CheckSizes(kOp, {{"n", n}}));
  if (n == 0) return absl::OkStatus();
  FP8RT_RETURN_IF_ERROR(CheckPointers(
      kOp, {{"dgate", dgate}, {"dup", dup}, {"dout", dout}, {"gate", gate}, {"up", up}}));
  FP8RT_ASSIGN_OR_RETURN(const dim3 grid, GridOf(n));
  return Launch(SwigluBackwardKernel, grid, dim3(kThreads), stream, dgate, dup, dout, gate, up, n);
}

absl::Status GeluForwardEntry(float* out, const float* x, int64_t n, Stream stream) {
  constexpr const char* kOp = "gelu_forward";
  FP8RT_RETURN_IF_ERROR(CheckSizes(kOp, {{"n", n}}));
  if (n == 0) return absl::OkStatus();
  FP8RT_RETURN_IF_ERROR(CheckPointers(kOp, {{"out", out}, {"x", x}}));
  FP8RT_ASSIGN_OR_RETURN(const dim3 grid, GridOf(n));
  return Launch(GeluForwardKernel, grid, dim3(kThreads), stream, out, x, n);
}

absl::Status GeluBackwardEntry(float* dx, const float* dout, const float* x, int64_t n,
                               Stream stream) {
  constexpr const char* kOp = "gelu_backward";
  FP8RT_RETURN_IF_ERROR(CheckSizes(kOp, {{"n", n}}));
  if (n == 0) return absl::OkStatus();
  FP8RT_RETURN_IF_ERROR(CheckPointers(kOp, {{"dx", dx}, {"dout", dout}, {"x", x}}));
  FP8RT_ASSIGN_OR_RETURN(const dim3 grid, GridOf(n));
  return Launch(GeluBackwardKernel, grid, dim3(kThreads), stream, dx, dout, x, n);
}

absl::Status ResidualForwardEntry(float* out, const float* a, const float* b, int64_t n,
                                  Stream stream) {
  constexpr const char* kOp = "residual_forward";
  FP8RT_RETURN_IF_ERROR(CheckSizes(kOp, {{"n", n}}));
  if (n == 0) return absl::OkStatus();
  FP8RT_RETURN_IF_ERROR(CheckPointers(kOp, {{"out", out}, {"a", a}, {"b", b}}));
  FP8RT_ASSIGN_OR_RETURN(const dim3 grid, GridOf(n));
  return Launch(ResidualForwardKernel, grid, dim3(kThreads), stream, out, a, b, n);
}

absl::Status ResidualBackwardEntry(float* da, float* db, const float* dout, int64_t n,
                                   Stream stream) {
  constexpr const char* kOp = "residual_backward";
  FP8RT_RETURN_IF_ERROR(CheckSizes(kOp, {{"n", n}}));
  if (n == 0) return absl::OkStatus();
  FP8RT_RETURN_IF_ERROR(CheckPointers(kOp, {{"da", da}, {"db", db}, {"dout", dout}}));
  FP8RT_ASSIGN_OR_RETURN(const dim3 grid, GridOf(n));
  return Launch(ResidualBackwardKernel, grid, dim3(kThreads), stream, da, db, dout, n);
}

absl::Status FillEntry(float* x, float value, int64_t n, Stream stream) {
  constexpr const char* kOp = "fill";
  FP8RT_RETURN_IF_ERROR(CheckSizes(kOp, {{"n", n}}));
  if (n == 0) return absl::OkStatus();
  FP8RT_RETURN_IF_ERROR(CheckPointers(kOp, {{"x", x}}));
  FP8RT_ASSIGN_OR_RETURN(const dim3 grid, GridOf(n));
  return Launch(FillKernel, grid, dim3(kThreads), stream, x, value, n);
}

absl::Status CopyEntry(float* dst, const float* src, int64_t n, Stream stream) {
  constexpr const char* kOp = "copy";
  FP8RT_RETURN_IF_ERROR(CheckSizes(kOp, {{"n", n}}));
  if (n == 0) return absl::OkStatus();
  FP8RT_RETURN_IF_ERROR(CheckPointers(kOp, {{"dst", dst}, {"src", src}}));
  CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(dst, src, static_cast<size_t>(n) * sizeof(float),
                                       cudaMemcpyDeviceToDevice, ToCuda(stream)));
  return absl::OkStatus();
}

template <typename T>
absl::Status TransposeOf(const char* op, T* dst, const T* src, int64_t rows, int64_t cols,
                         Stream stream) {
  FP8RT_RETURN_IF_ERROR(CheckSizes(op, {{"rows", rows}, {"cols", cols}}));
  if (rows == 0 || cols == 0) return absl::OkStatus();
  FP8RT_RETURN_IF_ERROR(CheckPointers(op, {{"dst", dst}, {"src", src}}));
  const int64_t tiles = ((rows + 31) / 32) * ((cols + 31) / 32);
  FP8RT_ASSIGN_OR_RETURN(const dim3 grid, GridOfRows(tiles));
  return Launch(TransposeKernel<T>, grid, dim3(32, 8), stream, dst, src, rows, cols);
}

absl::Status TransposeEntry(float* dst, const float* src, int64_t rows, int64_t cols,
                            Stream stream) {
  return TransposeOf("transpose", dst, src, rows, cols, stream);
}

absl::Status TransposeBytesEntry(uint8_t* dst, const uint8_t* src, int64_t rows, int64_t cols,
                                 Stream stream) {
  return TransposeOf("transpose_bytes", dst, src, rows, cols, stream);
}

absl::Status SplitHeadsEntry(float* q, float* k, float* v, const float* qkv, int64_t n,
                             int64_t kv_heads, int64_t q_per_kv, int64_t dh, Stream stream) {
  constexpr const char* kOp = "split_heads";
  FP8RT_RETURN_IF_ERROR(
      CheckSizes(kOp, {{"n", n}, {"kv_heads", kv_heads}, {"q_per_kv", q_per_kv}, {"dh", dh}}));
  const int64_t total = n * kv_heads * (q_per_kv + 2) * dh;
  if (total == 0) return absl::OkStatus();
  FP8RT_RETURN_IF_ERROR(CheckPointers(kOp, {{"q", q}, {"k", k}, {"v", v}, {"qkv", qkv}}));
  FP8RT_ASSIGN_OR_RETURN(const dim3 grid, GridOf(total));
  // Only read when splitting.
  return Launch(MoveHeadsKernel<true>, grid, dim3(kThreads), stream, q, k, v,
                const_cast<float*>(qkv), total, q_per_kv, dh);
}

absl::Status JoinHeadsEntry(float* qkv, const float* q, const float* k, const float* v, int64_t n,
                            int64_t kv_heads, int64_t q_per_kv, int64_t dh, Stream stream) {
  constexpr const char* kOp = "join_heads";
  FP8RT_RETURN_IF_ERROR(
      CheckSizes(kOp, {{"n", n}, {"kv_heads", kv_heads}, {"q_per_kv", q_per_kv}, {"dh", dh}}));
  const int64_t total = n * kv_heads * (q_per_kv + 2) * dh;
  if (total == 0) return absl::OkStatus();
  FP8RT_RETURN_IF_ERROR(CheckPointers(kOp, {{"qkv", qkv}, {"q", q}, {"k", k}, {"v", v}}));
  FP8RT_ASSIGN_OR_RETURN(const dim3 grid, GridOf(total));
  // Only read when joining.
  return Launch(MoveHeadsKernel<false>, grid, dim3(kThreads), stream, const_cast<float*>(q),
                const_cast<float*>(k), const_cast<float*>(v), qkv, total, q_per_kv, dh);
}

absl::Status SumSquaresEntry(const float* x, int64_t count, double* out, Stream stream) {
  constexpr const char* kOp = "sum_squares";
  FP8RT_RETURN_IF_ERROR(CheckSizes(kOp, {{"count", count}}));
  // *out is written even for count 0 (the empty sum), so out is always checked.
  if (count == 0) {
    FP8RT_RETURN_IF_ERROR(CheckPointers(kOp, {{"out", out}}));
    CUDA_RETURN_IF_ERROR(cudaMemsetAsync(out, 0, sizeof(double), ToCuda(stream)));
    return absl::OkStatus();
  }
  FP8RT_RETURN_IF_ERROR(CheckPointers(kOp, {{"x", x}, {"out", out}}));
  const int blocks = SumSquaresBlocks(count);
  if (blocks == 1) {
    return Launch(SumSquaresKernel, dim3(1), dim3(kSumSquaresThreads), stream, x, count, out);
  }
  // The partials live on the stream: allocated before pass 1, freed after pass 2 in stream order.
  FP8RT_ASSIGN_OR_RETURN(
      void* const scratch,
      AllocateOnStream(kOp, static_cast<size_t>(blocks) * sizeof(double), stream));
  auto* partial = static_cast<double*>(scratch);
  const absl::Status launched = [&]() -> absl::Status {
    FP8RT_RETURN_IF_ERROR(Launch(SumSquaresKernel, dim3(static_cast<unsigned>(blocks)),
                                 dim3(kSumSquaresThreads), stream, x, count, partial));
    return Launch(SumPartialsKernel, dim3(1), dim3(kSumSquaresThreads), stream,
                  static_cast<const double*>(partial), blocks, out);
  }();
  // Freed in stream order after whatever was enqueued, whether or not both launches went through.
  const cudaError_t freed = cudaFreeAsync(scratch, ToCuda(stream));
  FP8RT_RETURN_IF_ERROR(launched);
  CUDA_RETURN_IF_ERROR(freed);
  return absl::OkStatus();
}

absl::Status AdamWEntry(const AdamWArgs& args, Stream stream) {
  constexpr const char* kOp = "adamw";
  FP8RT_RETURN_IF_ERROR(CheckSizes(kOp, {{"count", args.count}}));
  if (args.count == 0) return absl::OkStatus();
  FP8RT_RETURN_IF_ERROR(CheckPointers(
      kOp, {{"master", args.master}, {"grad", args.grad}, {"m", args.m}, {"v", args.v}}));
  FP8RT_RETURN_IF_ERROR(ValidateAdamWFp8Output(args.fp8, args.count, kOp));
  FP8RT_ASSIGN_OR_RETURN(const dim3 grid, GridOf(args.count));
  FP8RT_RETURN_IF_ERROR(Launch(AdamWKernel, grid, dim3(kThreads), stream, args));
  const AdamWFp8Output& o = args.fp8;
  if (o.codes == nullptr) return absl::OkStatus();
  // The FP8 shard: on the GPU a second kernel (the tensor or 128x128 block quantize) over the
  // updated master, queued on the same stream; not yet one fused pass as on the CPU. Same codes,
  // scales and statistics.
  QuantizeArgs q;
  q.format = o.format;
  q.input_type = InputType::kF32;
  q.granularity = o.block ? Granularity::kBlock128x128 : Granularity::kTensor;
  q.input = args.master;
  q.rows = o.block ? o.rows : 1;
  q.cols = o.block ? o.cols : args.count;
  q.has_scale = !o.block;
  q.scale = o.scale;
  q.margin = o.margin;
  q.codes = o.codes;
  q.scale_inv = o.scale_inv;
  q.stats = o.stats;
  return QuantizeCuda(q, stream);
}

}  // namespace

const LayerOps kLayerOps = {
    .embedding_forward = &EmbeddingForwardEntry,
    .embedding_backward = &EmbeddingBackwardEntry,
    .rmsnorm_forward = &RmsNormForwardEntry,
    .rmsnorm_backward = &RmsNormBackwardEntry,
    .attention_forward = &AttentionForwardCuda,
    .attention_backward = &AttentionBackwardCuda,
    .attention_forward_bf16 = &AttentionForwardBf16Cuda,
    .attention_backward_bf16 = &AttentionBackwardBf16Cuda,
    .gelu_forward = &GeluForwardEntry,
    .gelu_backward = &GeluBackwardEntry,
    .layernorm_forward = &LayerNormForwardEntry,
    .layernorm_backward = &LayerNormBackwardEntry,
    .bias_forward = &BiasForwardEntry,
    .bias_backward = &BiasBackwardEntry,
    .rope_forward = &RopeForwardEntry,
    .rope_backward = &RopeBackwardEntry,
    .swiglu_forward = &SwigluForwardEntry,
    .swiglu_backward = &SwigluBackwardEntry,
    .residual_forward = &ResidualForwardEntry,
    .residual_backward = &ResidualBackwardEntry,
    .cross_entropy_forward = &CrossEntropyForwardCuda,
    .cross_entropy_backward = &CrossEntropyBackwardCuda,
    .moe_route = &MoeRouteCuda,
    .gather_rows = &GatherRowsCuda,
    .scatter_rows = &ScatterRowsCuda,
    .moe_combine = &MoeCombineCuda,
    .moe_combine_backward = &MoeCombineBackwardCuda,
    .moe_router_backward = &MoeRouterBackwardCuda,
    .fill = &FillEntry,
    .copy = &CopyEntry,
    .transpose = &TransposeEntry,
    .transpose_bytes = &TransposeBytesEntry,
    .split_heads = &SplitHeadsEntry,
    .join_heads = &JoinHeadsEntry,
    .sum_squares = &SumSquaresEntry,
    .adamw = &AdamWEntry,
    .synchronize = &SynchronizeCuda,
    .allocate = &AllocateCuda,
    .deallocate = &DeallocateCuda,
    .allocate_device = &AllocateDeviceCuda,
    .allocate_host = &AllocateHostCuda,
    .zero_bytes = &ZeroBytesCuda,
    .prefetch = &PrefetchCuda,
    .copy_bytes = &CopyBytesCuda,
};

}  // namespace fp8rt::kernels::cuda_internal
