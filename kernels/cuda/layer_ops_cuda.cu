// The CUDA backend's layer-op table (LayerOps, kernels/layer_ops.h): every entry but attention and
// cross-entropy, whose kernels live in kernels/cuda/attention_cuda.cu. Per-element arithmetic is
// kernels/cuda/layer_math.cuh, a mirror of the CPU reference; what differs from the CPU is only
// the order of the sums inside RMSNorm and sum_squares (fixed here, so reruns are bit for bit) and
// the device tanhf in GELU. tests/gpu/layer_ops_cuda_test.cc compares every entry with the CPU.
//
// Index (kernels, then the entries that launch them):
//   EmbeddingForwardKernel   flat copy of table rows
//   EmbeddingBackwardKernel  one block per row of dout whose token occurs there first: it owns
//                            that table row and adds every later row with the same token, in
//                            ascending n (the CPU order: bit for bit, no atomics)
//   RmsNormForwardKernel, RmsNormBackwardDxKernel   one block per row, block sum of the row
//   RmsNormDweightKernel     32-column tiles, 32 row lanes each summing every 32nd row, lanes
//                            combined in lane order: fixed, atomic-free
//   GeluForwardKernel, GeluBackwardKernel, ResidualForwardKernel, ResidualBackwardKernel,
//   FillKernel, AdamWKernel  element-wise, grid-stride
//   TransposeKernel          32 x 32 tiles through shared memory
//   MoveHeadsKernel<split>   split_heads / join_heads, one thread per element of qkv
//   SumSquaresKernel         one block of 1024 threads: FP64 strided partial sums, then a tree
//   allocate / deallocate    cudaMallocManaged / cudaFree (the table's memory, DeviceArray)
//
// Buffers: every pointer is device memory, checked before anything is launched (a null pointer
// is refused when the op has work); nothing is allocated but by allocate, every launch goes on the
// given stream, and no entry waits for it but synchronize (and deallocate: cudaFree waits). Token
// ids outside [0, V) are the caller's to prevent: here they never make a kernel touch memory
// outside the buffers (embedding_forward writes NaN rows for them, embedding_backward skips them),
// so they cannot poison the context.
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <initializer_list>
#include <utility>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "kernels/cuda/cuda_ops_internal.h"
#include "kernels/cuda/layer_math.cuh"
#include "kernels/layer_ops.h"
#include "kernels/ops.h"
#include "runtime/core/checks.h"
#include "runtime/core/status.h"

namespace fp8rt::kernels::cuda_internal {
namespace {

constexpr int kThreads = 256;
// sum_squares: one block of this many threads; its partial sums and their tree are the fixed
// order of the FP64 reduction.
constexpr int kSumThreads = 1024;
// RmsNormDweightKernel: 32 columns x kDweightLanes row lanes per block.
constexpr int kDweightLanes = 32;

cudaStream_t ToCuda(Stream stream) { return static_cast<cudaStream_t>(stream.handle); }

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

// Block b takes rows r = b, b + gridDim.x, ... of dout. Row r's token `tok` is owned by the block
// of its first occurrence; that block adds the rows n >= r holding tok to dtable[tok, :] in
// ascending n, each thread for its columns, with a read-modify-write of its own elements: exactly
// the CPU's order of additions, and no other block writes that table row. Every warp scans the
// tokens on its own, 32 at a time with a ballot, and reaches the same answers, so no barrier is
// needed. Cost: O(n / 32) ballots per warp per row, fine for the tens of thousands of tokens of a
// micro-batch.
__global__ void __launch_bounds__(kThreads)
    EmbeddingBackwardKernel(float* __restrict__ dtable, const float* __restrict__ dout,
                            const int32_t* __restrict__ tokens, int64_t n, int64_t v, int64_t c) {
  const int lane = threadIdx.x & 31;
  for (int64_t r = blockIdx.x; r < n; r += gridDim.x) {
    const int32_t tok = tokens[r];
    if (tok < 0 || tok >= v) continue;
    bool earlier = false;
    for (int64_t base = 0; base < r && !earlier; base += 32) {
      const int64_t i = base + lane;
      earlier = __any_sync(0xFFFFFFFFu, i < r && tokens[i] == tok);
    }
    if (earlier) continue;
    float* row = dtable + static_cast<int64_t>(tok) * c;
    for (int64_t base = r; base < n; base += 32) {
      const int64_t i = base + lane;
      uint32_t hits = __ballot_sync(0xFFFFFFFFu, i < n && tokens[i] == tok);
      while (hits != 0) {  // ascending n
        const int64_t src = base + (__ffs(static_cast<int>(hits)) - 1);
        hits &= hits - 1;
        const float* d = dout + src * c;
        for (int64_t col = threadIdx.x; col < c; col += blockDim.x) {
          row[col] = AddF32(row[col], d[col]);
        }
      }
    }
  }
}

// --- RMSNorm -----------------------------------------------------------------------------------

__global__ void __launch_bounds__(kThreads)
    RmsNormForwardKernel(float* __restrict__ out, float* __restrict__ rstd,
                         const float* __restrict__ x, const float* __restrict__ weight, int64_t n,
                         int64_t c, float eps) {
  __shared__ float scratch[kThreads / 32];
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
  __shared__ float scratch[kThreads / 32];
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
  __shared__ float partial[kDweightLanes][33];
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

// --- element-wise ------------------------------------------------------------------------------

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
  __shared__ T tile[32][33];
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

// Element i of qkv [n, heads, 3, dh] is part (i / dh) % 3 of (row, head) pair i / (3 dh), which
// sits at pair * dh + i % dh of q, k or v. kSplit copies qkv -> parts, otherwise parts -> qkv.
template <bool kSplit>
__global__ void __launch_bounds__(kThreads)
    MoveHeadsKernel(float* q, float* k, float* v, float* qkv, int64_t total, int64_t dh) {
  for (int64_t i = GlobalThread(); i < total; i += GridThreads()) {
    const int64_t pair = i / (3 * dh);
    const int64_t within = i - pair * 3 * dh;
    const int64_t part = within / dh;
    const int64_t at = pair * dh + (within - part * dh);
    float* p = part == 0 ? q : (part == 1 ? k : v);
    if constexpr (kSplit) {
      p[at] = qkv[i];
    } else {
      qkv[i] = p[at];
    }
  }
}

// --- sum of squares ------------------------------------------------------------------------------

// Thread t adds x[t], x[t + 1024], ... in ascending order (four loads in flight per step, the
// additions still in that order), then a pairwise tree over the 1024 partial sums. Each square of
// an FP32 value is exact in FP64 (48 significant bits), so whether the compiler fuses the
// multiply into the add changes nothing. NaN and Inf propagate through every addition.
__global__ void __launch_bounds__(kSumThreads)
    SumSquaresKernel(const float* __restrict__ x, int64_t count, double* __restrict__ out) {
  __shared__ double partial[kSumThreads];
  const int t = threadIdx.x;
  double s = 0.0;
  int64_t i = t;
  for (; i + 3 * kSumThreads < count; i += 4 * kSumThreads) {
    const double a = x[i], b = x[i + kSumThreads], c = x[i + 2 * kSumThreads],
                 d = x[i + 3 * kSumThreads];
    s += a * a;
    s += b * b;
    s += c * c;
    s += d * d;
  }
  for (; i < count; i += kSumThreads) {
    const double a = x[i];
    s += a * a;
  }
  partial[t] = s;
  __syncthreads();
  for (int width = kSumThreads / 2; width > 0; width >>= 1) {
    if (t < width) partial[t] += partial[t + width];
    __syncthreads();
  }
  if (t == 0) *out = partial[0];
}

// --- launch helpers ------------------------------------------------------------------------------

// InvalidArgument naming the first negative size (the CPU entries' message).
absl::Status CheckSizes(const char* op, std::initializer_list<std::pair<const char*, int64_t>> s) {
  for (const auto& [name, value] : s) {
    if (value < 0) {
      return absl::InvalidArgumentError(absl::StrCat(op, ": ", name, " is ", value, " (< 0)"));
    }
  }
  return absl::OkStatus();
}

// InvalidArgument naming the op and the pointer unless every pointer is non-null device memory.
// Called only when the op has work: a null pointer then would fault on the device.
absl::Status CheckPointers(const char* op,
                           std::initializer_list<std::pair<const char*, const void*>> ptrs) {
  for (const auto& [name, ptr] : ptrs) {
    if (ptr == nullptr) return absl::InvalidArgumentError(absl::StrCat(op, ": ", name, " is null"));
  }
  const absl::Status s = CheckDevicePointers(ptrs);
  if (!s.ok()) return absl::Status(s.code(), absl::StrCat(op, ": ", s.message()));
  return absl::OkStatus();
}

template <class Kernel, class... Args>
absl::Status Launch(Kernel kernel, dim3 grid, dim3 block, Stream stream, Args... args) {
  kernel<<<grid, block, 0, ToCuda(stream)>>>(args...);
  CUDA_RETURN_IF_ERROR(cudaGetLastError());
  return absl::OkStatus();
}

// Enough blocks of `threads` threads for `work_items`, at most 8 per multiprocessor (the kernels
// loop over the rest).
absl::StatusOr<dim3> GridOf(int64_t work_items, int threads = kThreads) {
  FP8RT_ASSIGN_OR_RETURN(const int sms, CurrentDeviceSmCount());
  return dim3(static_cast<unsigned>(cuda_internal::GridFor(work_items, threads, sms)));
}

// One block per row (or item), kThreads threads each.
absl::StatusOr<dim3> GridOfRows(int64_t rows) { return GridOf(rows * kThreads); }

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
  FP8RT_ASSIGN_OR_RETURN(const dim3 grid, GridOfRows(n));
  return Launch(EmbeddingBackwardKernel, grid, dim3(kThreads), stream, dtable, dout, tokens, n, v,
                c);
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
                             int64_t heads, int64_t dh, Stream stream) {
  constexpr const char* kOp = "split_heads";
  FP8RT_RETURN_IF_ERROR(CheckSizes(kOp, {{"n", n}, {"heads", heads}, {"dh", dh}}));
  const int64_t total = n * heads * 3 * dh;
  if (total == 0) return absl::OkStatus();
  FP8RT_RETURN_IF_ERROR(CheckPointers(kOp, {{"q", q}, {"k", k}, {"v", v}, {"qkv", qkv}}));
  FP8RT_ASSIGN_OR_RETURN(const dim3 grid, GridOf(total));
  // Only read when splitting.
  return Launch(MoveHeadsKernel<true>, grid, dim3(kThreads), stream, q, k, v,
                const_cast<float*>(qkv), total, dh);
}

absl::Status JoinHeadsEntry(float* qkv, const float* q, const float* k, const float* v, int64_t n,
                            int64_t heads, int64_t dh, Stream stream) {
  constexpr const char* kOp = "join_heads";
  FP8RT_RETURN_IF_ERROR(CheckSizes(kOp, {{"n", n}, {"heads", heads}, {"dh", dh}}));
  const int64_t total = n * heads * 3 * dh;
  if (total == 0) return absl::OkStatus();
  FP8RT_RETURN_IF_ERROR(CheckPointers(kOp, {{"qkv", qkv}, {"q", q}, {"k", k}, {"v", v}}));
  FP8RT_ASSIGN_OR_RETURN(const dim3 grid, GridOf(total));
  // Only read when joining.
  return Launch(MoveHeadsKernel<false>, grid, dim3(kThreads), stream, const_cast<float*>(q),
                const_cast<float*>(k), const_cast<float*>(v), qkv, total, dh);
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
  return Launch(SumSquaresKernel, dim3(1), dim3(kSumThreads), stream, x, count, out);
}

absl::Status AdamWEntry(const AdamWArgs& args, Stream stream) {
  constexpr const char* kOp = "adamw";
  FP8RT_RETURN_IF_ERROR(CheckSizes(kOp, {{"count", args.count}}));
  if (args.count == 0) return absl::OkStatus();
  FP8RT_RETURN_IF_ERROR(CheckPointers(
      kOp, {{"master", args.master}, {"grad", args.grad}, {"m", args.m}, {"v", args.v}}));
  FP8RT_ASSIGN_OR_RETURN(const dim3 grid, GridOf(args.count));
  return Launch(AdamWKernel, grid, dim3(kThreads), stream, args);
}

absl::Status SynchronizeEntry(Stream stream) {
  CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(ToCuda(stream)));
  return absl::OkStatus();
}

// Managed memory on the current device (at least one byte, so that 0 bytes gives a valid
// pointer). A failed allocation is not a sticky error, but it stays as the thread's last error;
// it is cleared here so that the next launch's cudaGetLastError does not report it.
absl::StatusOr<void*> AllocateEntry(size_t bytes) {
  void* p = nullptr;
  const cudaError_t err = cudaMallocManaged(&p, std::max<size_t>(bytes, 1));
  if (err != cudaSuccess) {
    (void)cudaGetLastError();
    return absl::ResourceExhaustedError(
        absl::StrCat("allocating ", bytes, " bytes of CUDA managed memory: ", cudaGetErrorName(err),
                     " (", cudaGetErrorString(err), ")"));
  }
  return p;
}

// cudaFree waits for the device; an error (a pointer allocate did not give) has nowhere to go
// from a void entry and is cleared rather than left for the next launch to report.
void DeallocateEntry(void* p) {
  if (p != nullptr && cudaFree(p) != cudaSuccess) (void)cudaGetLastError();
}

}  // namespace

const LayerOps kLayerOps = {
    .embedding_forward = &EmbeddingForwardEntry,
    .embedding_backward = &EmbeddingBackwardEntry,
    .rmsnorm_forward = &RmsNormForwardEntry,
    .rmsnorm_backward = &RmsNormBackwardEntry,
    .attention_forward = &AttentionForwardCuda,
    .attention_backward = &AttentionBackwardCuda,
    .gelu_forward = &GeluForwardEntry,
    .gelu_backward = &GeluBackwardEntry,
    .residual_forward = &ResidualForwardEntry,
    .residual_backward = &ResidualBackwardEntry,
    .cross_entropy_forward = &CrossEntropyForwardCuda,
    .cross_entropy_backward = &CrossEntropyBackwardCuda,
    .fill = &FillEntry,
    .copy = &CopyEntry,
    .transpose = &TransposeEntry,
    .transpose_bytes = &TransposeBytesEntry,
    .split_heads = &SplitHeadsEntry,
    .join_heads = &JoinHeadsEntry,
    .sum_squares = &SumSquaresEntry,
    .adamw = &AdamWEntry,
    .synchronize = &SynchronizeEntry,
    .allocate = &AllocateEntry,
    .deallocate = &DeallocateEntry,
};

}  // namespace fp8rt::kernels::cuda_internal
