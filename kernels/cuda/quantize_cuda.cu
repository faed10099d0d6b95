// CUDA quantize, dequantize, amax, convert and cast-transpose: the element-wise half of the CUDA
// op table. Results are bit for bit those of the CPU backend (tests/gpu/ops_cuda_test.cc): the
// per-value arithmetic is kernels/cuda/device_math.cuh, a mirror of the host definitions, and
// everything else is a max or an integer count, which no reduction order changes.
//
// Index (kernels, then the op entries that launch them):
//   TensorQuantizeKernel   one read: codes + statistics, tensor scale given, computed from the
//                          finite amax that TensorAmaxKernel left in scale_inv[0], or from an
//                          amax in device memory (QuantizeArgs::scale_amax)
//   TensorAmaxKernel       plain and finite amax as bits, atomics into the output words
//   SegmentQuantizeKernel  row / 1x128 / mx32: one warp per contiguous run of a row sharing a
//                          scale (finite amax by warp shuffles, then encode)
//   Block128QuantizeKernel 128x128: one block of threads per scale block
//   TensorEpilogueKernel   scale_inv[0], canonical NaN amax, count
//   DequantizeKernel, ConvertKernel, CastTransposeKernel (32x32 tiles through shared memory)
//
// Buffers: every pointer in the arguments is device memory (checked), including `stats` and the
// amax outputs, which are written asynchronously on the stream. Statistics are accumulated with
// one atomic per field per thread block into the caller's QuantStats, zeroed first with
// cudaMemsetAsync; the computed tensor scale passes its amax through scale_inv[0]. Nothing is
// allocated.
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>

#include "absl/strings/str_cat.h"
#include "kernels/cuda/cuda_ops_internal.h"
#include "kernels/cuda/device_math.cuh"
#include "kernels/cuda/launch.cuh"
#include "runtime/core/checks.h"
#include "runtime/core/status.h"

namespace fp8rt::kernels::cuda_internal {
namespace {

constexpr int kThreads = 256;

cudaStream_t ToCuda(Stream stream) { return static_cast<cudaStream_t>(stream.handle); }

bool Aligned(const void* p, uintptr_t bytes) { return reinterpret_cast<uintptr_t>(p) % bytes == 0; }

// Eight consecutive inputs from a 16-byte aligned address (two float4 or one uint4 of BF16).
__device__ __forceinline__ void Load8(const float* __restrict__ x, int64_t v, float (&f)[8]) {
  const float4 lo = reinterpret_cast<const float4*>(x)[2 * v];
  const float4 hi = reinterpret_cast<const float4*>(x)[2 * v + 1];
  f[0] = lo.x, f[1] = lo.y, f[2] = lo.z, f[3] = lo.w;
  f[4] = hi.x, f[5] = hi.y, f[6] = hi.z, f[7] = hi.w;
}
__device__ __forceinline__ void Load8(const uint16_t* __restrict__ x, int64_t v, float (&f)[8]) {
  const uint4 w = reinterpret_cast<const uint4*>(x)[v];
  const uint32_t words[4] = {w.x, w.y, w.z, w.w};
  for (int i = 0; i < 4; ++i) {
    f[2 * i] = __uint_as_float(words[i] << 16);
    f[2 * i + 1] = __uint_as_float(words[i] & 0xFFFF0000u);
  }
}

// --- tensor granularity ----------------------------------------------------------------------

// Where the tensor scale comes from: given by the caller, or computed in every block from the
// finite amax bits at `amax_bits` (ComputeScale is deterministic, so all blocks agree).
struct TensorScale {
  float given = 1.0f;
  const uint32_t* amax_bits = nullptr;
  const float* amax_value = nullptr;  // QuantizeArgs::scale_amax: wins over both above
  float fp8_max = 448.0f;
  int margin = 0;
  bool power_of_two = false;
};

__device__ __forceinline__ float ResolveScale(const TensorScale& ts) {
  if (ts.amax_value != nullptr) {
    return ComputeScaleOfValue(*ts.amax_value, ts.fp8_max, ts.margin, ts.power_of_two);
  }
  return ts.amax_bits == nullptr
             ? ts.given
             : ComputeScale(*ts.amax_bits, ts.fp8_max, ts.margin, ts.power_of_two);
}

template <Fp8Format F, class In>
__global__ void __launch_bounds__(kThreads)
    TensorQuantizeKernel(const In* __restrict__ x, int64_t n, TensorScale ts, bool vectorized,
                         uint8_t* __restrict__ codes, QuantStats* stats) {
  const float scale = ResolveScale(ts);
  ThreadStats s;
  const int64_t tid = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  int64_t head = 0;
  if (vectorized) {
    const int64_t vecs = n / 8;
    for (int64_t v = tid; v < vecs; v += stride) {
      float f[8];
      Load8(x, v, f);
      uint32_t y[8];
      bool plain = true;
#pragma unroll
      for (int j = 0; j < 8; ++j) {
        s.amax_bits = max(s.amax_bits, __float_as_uint(f[j]) & 0x7FFFFFFFu);
        y[j] = __float_as_uint(__fmul_rn(f[j], scale));
        plain &= IsPlainNormal<F>(y[j]);
      }
      uint32_t lo = 0, hi = 0;
      if (plain) {  // the common case: no statistic to count
#pragma unroll
        for (int j = 0; j < 4; ++j) {
          lo |= EncodePlainNormal<F>(y[j]) << (8 * j);
          hi |= EncodePlainNormal<F>(y[j + 4]) << (8 * j);
        }
      } else {
#pragma unroll
        for (int j = 0; j < 4; ++j) {
          lo |= QuantizeOne<F>(f[j], scale, s) << (8 * j);
          hi |= QuantizeOne<F>(f[j + 4], scale, s) << (8 * j);
        }
      }
      reinterpret_cast<uint2*>(codes)[v] = make_uint2(lo, hi);
    }
    head = vecs * 8;
  }
  for (int64_t i = head + tid; i < n; i += stride) {
    codes[i] = static_cast<uint8_t>(QuantizeOne<F>(LoadAsFloat(x, i), scale, s));
  }
  if (stats != nullptr) FlushStats(s, stats);
}

// Plain amax bits (NaN > Inf > finite) into *amax_bits if not null, finite amax bits into
// *finite_bits. Both words zeroed before the launch.
template <class In>
__global__ void __launch_bounds__(kThreads)
    TensorAmaxKernel(const In* __restrict__ x, int64_t n, bool vectorized, uint32_t* amax_bits,
                     uint32_t* finite_bits) {
  uint32_t amax = 0, finite = 0;
  auto take = [&](float v) {
    const uint32_t a = __float_as_uint(v) & 0x7FFFFFFFu;
    amax = max(amax, a);
    if (a < 0x7F800000u) finite = max(finite, a);
  };
  const int64_t tid = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  int64_t head = 0;
  if (vectorized) {
    const int64_t vecs = n / 8;
    for (int64_t v = tid; v < vecs; v += stride) {
      float f[8];
      Load8(x, v, f);
#pragma unroll
      for (int j = 0; j < 8; ++j) take(f[j]);
    }
    head = vecs * 8;
  }
  for (int64_t i = head + tid; i < n; i += stride) take(LoadAsFloat(x, i));
  FP8RT_STATIC_SHARED(uint32_t, scratch, [32]);
  amax = BlockMax(amax, scratch);
  finite = BlockMax(finite, scratch);
  if (threadIdx.x == 0) {
    if (amax_bits != nullptr && amax != 0) atomicMax(amax_bits, amax);
    if (finite_bits != nullptr && finite != 0) atomicMax(finite_bits, finite);
  }
}

// scale_inv[0] (the inverse of the scale ts resolves to: when it is computed from this tensor's
// amax, ts.amax_bits points at scale_inv[0], read here before it is overwritten), the canonical
// NaN for a NaN amax, and the value count.
__global__ void TensorEpilogueKernel(TensorScale ts, float* scale_inv, QuantStats* stats,
                                     int64_t count) {
  if (scale_inv != nullptr) scale_inv[0] = __fdiv_rn(1.0f, ResolveScale(ts));
  if (stats != nullptr) {
    if (__float_as_uint(stats->amax) > 0x7F800000u) stats->amax = __uint_as_float(kQuietNaNBits);
    stats->count = count;
  }
}

// --- row, 1x128, mx32: one warp per run of a row that shares a scale --------------------------

template <Fp8Format F, class In, bool kMx>
__global__ void __launch_bounds__(kThreads)
    SegmentQuantizeKernel(const In* __restrict__ x, int64_t rows, int64_t cols, int64_t seg_len,
                          int64_t segs_per_row, int margin, bool power_of_two,
                          uint8_t* __restrict__ codes, float* __restrict__ scale_inv,
                          uint8_t* __restrict__ e8m0, QuantStats* stats) {
  using B = internal::Fp8Bits<F>;
  const int lane = threadIdx.x & 31;
  const int64_t warp = (static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x) >> 5;
  const int64_t warps = (static_cast<int64_t>(gridDim.x) * blockDim.x) >> 5;
  const int64_t segments = rows * segs_per_row;
  ThreadStats s;
  for (int64_t seg = warp; seg < segments; seg += warps) {  // uniform across the warp
    const int64_t r = seg / segs_per_row;
    const int64_t c0 = (seg - r * segs_per_row) * seg_len;
    const int64_t len = min(seg_len, cols - c0);
    const In* p = x + r * cols + c0;
    uint32_t finite = 0;
    for (int64_t c = lane; c < len; c += 32) {
      const uint32_t a = __float_as_uint(LoadAsFloat(p, c)) & 0x7FFFFFFFu;
      if (a < 0x7F800000u) finite = max(finite, a);
    }
    finite = WarpMax(finite);
    float scale;
    if constexpr (kMx) {
      const int e = Mx32Exponent(finite, F == Fp8Format::kE4M3 ? 8 : 15);
      scale = PowerOfTwo(-e);
      if (lane == 0) e8m0[seg] = static_cast<uint8_t>(e + 127);
    } else {
      scale = ComputeScale(finite, B::kMax, margin, power_of_two);
      if (lane == 0) scale_inv[seg] = __fdiv_rn(1.0f, scale);
    }
    uint8_t* out = codes + r * cols + c0;
    for (int64_t c = lane; c < len; c += 32) {
      out[c] = static_cast<uint8_t>(QuantizeOne<F>(LoadAsFloat(p, c), scale, s));
    }
  }
  if (stats != nullptr) FlushStats(s, stats);
}

// --- 128x128 blocks: one thread block per scale block ------------------------------------------

template <Fp8Format F, class In>
__global__ void __launch_bounds__(kThreads)
    Block128QuantizeKernel(const In* __restrict__ x, int64_t rows, int64_t cols, int64_t grid_cols,
                           int margin, bool power_of_two, uint8_t* __restrict__ codes,
                           float* __restrict__ scale_inv, QuantStats* stats) {
  using B = internal::Fp8Bits<F>;
  FP8RT_STATIC_SHARED(uint32_t, scratch, [32]);
  const int64_t blocks = ((rows + 127) / 128) * grid_cols;
  ThreadStats s;
  for (int64_t b = blockIdx.x; b < blocks; b += gridDim.x) {
    const int64_t r0 = (b / grid_cols) * 128, c0 = (b % grid_cols) * 128;
    const int rlen = static_cast<int>(min(int64_t{128}, rows - r0));
    const int clen = static_cast<int>(min(int64_t{128}, cols - c0));
    uint32_t finite = 0;
    // Consecutive threads take consecutive columns of a row: coalesced.
    for (int i = threadIdx.x; i < 128 * 128; i += blockDim.x) {
      const int rr = i >> 7, cc = i & 127;
      if (rr < rlen && cc < clen) {
        const uint32_t a =
            __float_as_uint(LoadAsFloat(x, (r0 + rr) * cols + c0 + cc)) & 0x7FFFFFFFu;
        if (a < 0x7F800000u) finite = max(finite, a);
      }
    }
    finite = BlockMax(finite, scratch);
    const float scale = ComputeScale(finite, B::kMax, margin, power_of_two);
    if (threadIdx.x == 0) scale_inv[b] = __fdiv_rn(1.0f, scale);
    for (int i = threadIdx.x; i < 128 * 128; i += blockDim.x) {
      const int rr = i >> 7, cc = i & 127;
      if (rr < rlen && cc < clen) {
        const int64_t at = (r0 + rr) * cols + c0 + cc;
        codes[at] = static_cast<uint8_t>(QuantizeOne<F>(LoadAsFloat(x, at), scale, s));
      }
    }
  }
  if (stats != nullptr) FlushStats(s, stats);
}

__global__ void FillKernel(float* p, int64_t n, float value) {
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n;
       i += stride) {
    p[i] = value;
  }
}

// A NaN amax (any payload) becomes the quiet NaN the CPU backend writes.
__global__ void CanonicalNaNKernel(float* amax) {
  if (__float_as_uint(*amax) > 0x7F800000u) *amax = __uint_as_float(kQuietNaNBits);
}

// --- dequantize, convert -----------------------------------------------------------------------

// out = DecodeFp8(code) * scale of its block, one FP32 product; a NaN result is written as the
// quiet NaN the CPU backend produces.
__global__ void __launch_bounds__(kThreads)
    DequantizeKernel(const uint8_t* __restrict__ codes, int64_t rows, int64_t cols, bool e4m3,
                     ScaleGrid grid, const float* __restrict__ scale_inv,
                     const uint8_t* __restrict__ e8m0, float* __restrict__ out) {
  for (int64_t r = blockIdx.y; r < rows; r += gridDim.y) {
    const int64_t sr = r / grid.block_rows;
    for (int64_t c = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; c < cols;
         c += static_cast<int64_t>(gridDim.x) * blockDim.x) {
      const int64_t si = sr * grid.cols + c / grid.block_cols;
      const float s = e8m0 != nullptr ? DecodeE8M0(e8m0[si]) : scale_inv[si];
      const float v = __fmul_rn(DecodeFp8(codes[r * cols + c], e4m3), s);
      out[r * cols + c] = v != v ? __uint_as_float(kQuietNaNBits) : v;
    }
  }
}

__global__ void __launch_bounds__(kThreads)
    F32ToBf16Kernel(const float* __restrict__ in, int64_t n, uint16_t* __restrict__ out) {
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n;
       i += stride) {
    out[i] = FloatToBf16(in[i]);
  }
}

__global__ void __launch_bounds__(kThreads)
    Bf16ToF32Kernel(const uint16_t* __restrict__ in, int64_t n, float* __restrict__ out) {
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n;
       i += stride) {
    out[i] = __uint_as_float(static_cast<uint32_t>(in[i]) << 16);
  }
}

// --- cast-transpose ----------------------------------------------------------------------------

// 32 x 32 tiles, 32 x 8 threads: each thread encodes four values of a tile column, writes them to
// `codes` (consecutive threads, consecutive columns) and to a shared tile, from which the
// transposed tile is written with consecutive threads on consecutive rows of `codes_t`.
template <Fp8Format F, class In>
__global__ void __launch_bounds__(kThreads)
    CastTransposeKernel(const In* __restrict__ x, int64_t rows, int64_t cols, float scale,
                        uint8_t* __restrict__ codes, uint8_t* __restrict__ codes_t,
                        QuantStats* stats) {
  FP8RT_STATIC_SHARED(uint8_t, tile, [32][33]);
  const int tx = threadIdx.x, ty = threadIdx.y;
  const int64_t tiles_c = (cols + 31) / 32;
  const int64_t tiles = ((rows + 31) / 32) * tiles_c;
  ThreadStats s;
  for (int64_t t = blockIdx.x; t < tiles; t += gridDim.x) {
    const int64_t r0 = (t / tiles_c) * 32, c0 = (t % tiles_c) * 32;
    for (int k = 0; k < 4; ++k) {
      const int64_t r = r0 + ty + 8 * k, c = c0 + tx;
      if (r < rows && c < cols) {
        const uint8_t code =
            static_cast<uint8_t>(QuantizeOne<F>(LoadAsFloat(x, r * cols + c), scale, s));
        codes[r * cols + c] = code;
        tile[ty + 8 * k][tx] = code;
      }
    }
    __syncthreads();
    for (int k = 0; k < 4; ++k) {
      const int64_t tr = c0 + ty + 8 * k;  // row of codes_t = column of the input
      const int64_t tc = r0 + tx;          // column of codes_t = row of the input
      if (tr < cols && tc < rows) codes_t[tr * rows + tc] = tile[tx][ty + 8 * k];
    }
    __syncthreads();
  }
  if (stats != nullptr) FlushStats(s, stats);
}

// --- launchers -----------------------------------------------------------------------------------

template <class Kernel, class... Args>
absl::Status Launch(Kernel kernel, dim3 grid, dim3 block, cudaStream_t stream, Args... args) {
  FP8RT_LAUNCH(kernel, grid, block, 0, stream)(args...);
  CUDA_RETURN_IF_ERROR(cudaGetLastError());
  return absl::OkStatus();
}

// A persistent grid for `kernel`: as many blocks as fit on the device at once (by the kernel's
// register and shared-memory use), fewer when there is less work. The kernels loop over the rest;
// a grid larger than what fits would leave a partial second wave. The occupancy is asked of the
// runtime once per (kernel, block size, device) and remembered (KernelBlocksPerSm), not on every
// launch.
template <class Kernel>
absl::StatusOr<dim3> PersistentGrid(Kernel kernel, int64_t work_items, int threads, int sms) {
  FP8RT_ASSIGN_OR_RETURN(const int per_sm,
                         KernelBlocksPerSm(reinterpret_cast<const void*>(kernel), threads));
  return dim3(static_cast<unsigned>(GridFor(work_items, threads, sms, std::max(per_sm, 1))));
}

// Dispatches a kernel template over (format, input type) at run time.
#define FP8RT_DISPATCH_FORMAT_INPUT(format, input_type, KERNEL, ...)                         \
  ((format) == Fp8Format::kE4M3                                                              \
       ? ((input_type) == InputType::kF32 ? KERNEL<Fp8Format::kE4M3, float>(__VA_ARGS__)     \
                                          : KERNEL<Fp8Format::kE4M3, uint16_t>(__VA_ARGS__)) \
       : ((input_type) == InputType::kF32 ? KERNEL<Fp8Format::kE5M2, float>(__VA_ARGS__)     \
                                          : KERNEL<Fp8Format::kE5M2, uint16_t>(__VA_ARGS__)))

template <Fp8Format F, class In>
absl::Status LaunchTensorQuantize(const QuantizeArgs& a, TensorScale ts, int sms,
                                  cudaStream_t stream) {
  const int64_t n = a.rows * a.cols;
  const bool vectorized = Aligned(a.input, 16) && Aligned(a.codes, 8);
  FP8RT_ASSIGN_OR_RETURN(
      const dim3 grid,
      PersistentGrid(TensorQuantizeKernel<F, In>, std::max<int64_t>(n / 8, 1), kThreads, sms));
  return Launch(TensorQuantizeKernel<F, In>, grid, dim3(kThreads), stream,
                static_cast<const In*>(a.input), n, ts, vectorized, a.codes, a.stats);
}

template <Fp8Format F, class In>
absl::Status LaunchSegmentQuantize(const QuantizeArgs& a, const ScaleGrid& g, int sms,
                                   cudaStream_t stream) {
  const int64_t segments = a.rows * g.cols;
  const bool mx = a.granularity == Granularity::kMx32;
  auto kernel = mx ? SegmentQuantizeKernel<F, In, true> : SegmentQuantizeKernel<F, In, false>;
  FP8RT_ASSIGN_OR_RETURN(const dim3 grid, PersistentGrid(kernel, segments * 32, kThreads, sms));
  return Launch(kernel, grid, dim3(kThreads), stream, static_cast<const In*>(a.input), a.rows,
                a.cols, g.block_cols, g.cols, a.margin, a.power_of_two_scales, a.codes, a.scale_inv,
                a.e8m0_scales, a.stats);
}

template <Fp8Format F, class In>
absl::Status LaunchBlock128Quantize(const QuantizeArgs& a, const ScaleGrid& g, int sms,
                                    cudaStream_t stream) {
  // One block of threads per scale block: the work items are the blocks' threads.
  FP8RT_ASSIGN_OR_RETURN(const dim3 grid, PersistentGrid(Block128QuantizeKernel<F, In>,
                                                         g.size() * kThreads, kThreads, sms));
  return Launch(Block128QuantizeKernel<F, In>, grid, dim3(kThreads), stream,
                static_cast<const In*>(a.input), a.rows, a.cols, g.cols, a.margin,
                a.power_of_two_scales, a.codes, a.scale_inv, a.stats);
}

template <class In>
absl::Status LaunchAmax(const void* input, int64_t n, uint32_t* amax_bits, uint32_t* finite_bits,
                        int sms, cudaStream_t stream) {
  const bool vectorized = Aligned(input, 16);
  FP8RT_ASSIGN_OR_RETURN(
      const dim3 grid,
      PersistentGrid(TensorAmaxKernel<In>, std::max<int64_t>(n / 8, 1), kThreads, sms));
  return Launch(TensorAmaxKernel<In>, grid, dim3(kThreads), stream, static_cast<const In*>(input),
                n, vectorized, amax_bits, finite_bits);
}

template <Fp8Format F, class In>
absl::Status LaunchCastTranspose(const CastTransposeArgs& a, int sms, cudaStream_t stream) {
  const int64_t tiles = ((a.rows + 31) / 32) * ((a.cols + 31) / 32);
  FP8RT_ASSIGN_OR_RETURN(
      const dim3 grid, PersistentGrid(CastTransposeKernel<F, In>, tiles * kThreads, kThreads, sms));
  return Launch(CastTransposeKernel<F, In>, grid, dim3(32, 8), stream,
                static_cast<const In*>(a.input), a.rows, a.cols, a.scale, a.codes, a.codes_t,
                a.stats);
}

}  // namespace

absl::Status QuantizeCuda(const QuantizeArgs& args, Stream stream_arg) {
  FP8RT_RETURN_IF_ERROR(ValidateQuantizeArgs(args));
  FP8RT_RETURN_IF_ERROR(CheckDevicePointers({{"input", args.input},
                                             {"codes", args.codes},
                                             {"scale_inv", args.scale_inv},
                                             {"e8m0_scales", args.e8m0_scales},
                                             {"stats", args.stats},
                                             {"scale_amax", args.scale_amax}}));
  const cudaStream_t stream = ToCuda(stream_arg);
  const int64_t total = args.rows * args.cols;
  const ScaleGrid grid = GetScaleGrid(args.granularity, args.rows, args.cols);
  const bool mx = args.granularity == Granularity::kMx32;
  if (args.stats != nullptr) {
    CUDA_RETURN_IF_ERROR(cudaMemsetAsync(args.stats, 0, sizeof(QuantStats), stream));
  }
  TensorScale ts;
  ts.given = args.scale;
  ts.fp8_max = GetFp8Info(args.format).max;
  ts.margin = args.margin;
  ts.power_of_two = args.power_of_two_scales;
  if (total == 0) {
    // As the CPU backend: scales of 1 (no block has a value), zero statistics.
    if (!mx && grid.size() > 0) {
      FP8RT_ASSIGN_OR_RETURN(const int sms, CurrentDeviceSmCount());
      FP8RT_RETURN_IF_ERROR(Launch(FillKernel,
                                   dim3(static_cast<unsigned>(GridFor(grid.size(), kThreads, sms))),
                                   dim3(kThreads), stream, args.scale_inv, grid.size(), 1.0f));
    }
    return absl::OkStatus();
  }
  FP8RT_ASSIGN_OR_RETURN(const int sms, CurrentDeviceSmCount());
  switch (args.granularity) {
    case Granularity::kTensor: {
      if (args.scale_amax != nullptr) {
        ts.amax_value = args.scale_amax;
      } else if (!args.has_scale) {
        // Pass 1: finite amax bits into scale_inv[0]; pass 2 reads them and derives the scale.
        CUDA_RETURN_IF_ERROR(cudaMemsetAsync(args.scale_inv, 0, sizeof(float), stream));
        auto* amax_word = reinterpret_cast<uint32_t*>(args.scale_inv);
        FP8RT_RETURN_IF_ERROR(
            args.input_type == InputType::kF32
                ? LaunchAmax<float>(args.input, total, nullptr, amax_word, sms, stream)
                : LaunchAmax<uint16_t>(args.input, total, nullptr, amax_word, sms, stream));
        ts.amax_bits = amax_word;
      }
      FP8RT_RETURN_IF_ERROR(FP8RT_DISPATCH_FORMAT_INPUT(
          args.format, args.input_type, LaunchTensorQuantize, args, ts, sms, stream));
      return Launch(TensorEpilogueKernel, dim3(1), dim3(1), stream, ts, args.scale_inv, args.stats,
                    total);
    }
    case Granularity::kRow:
    case Granularity::kTile1x128:
    case Granularity::kMx32:
      FP8RT_RETURN_IF_ERROR(FP8RT_DISPATCH_FORMAT_INPUT(
          args.format, args.input_type, LaunchSegmentQuantize, args, grid, sms, stream));
      break;
    case Granularity::kBlock128x128:
      FP8RT_RETURN_IF_ERROR(FP8RT_DISPATCH_FORMAT_INPUT(
          args.format, args.input_type, LaunchBlock128Quantize, args, grid, sms, stream));
      break;
  }
  if (args.stats == nullptr) return absl::OkStatus();
  return Launch(TensorEpilogueKernel, dim3(1), dim3(1), stream, ts, static_cast<float*>(nullptr),
                args.stats, total);
}

absl::Status DequantizeCuda(const DequantizeArgs& args, Stream stream) {
  FP8RT_RETURN_IF_ERROR(ValidateDequantizeArgs(args));
  if (args.rows == 0 || args.cols == 0) return absl::OkStatus();
  FP8RT_RETURN_IF_ERROR(CheckDevicePointers({{"codes", args.codes},
                                             {"scale_inv", args.scale_inv},
                                             {"e8m0_scales", args.e8m0_scales},
                                             {"output", args.output}}));
  const ScaleGrid grid = GetScaleGrid(args.granularity, args.rows, args.cols);
  const bool mx = args.granularity == Granularity::kMx32;
  const int64_t bx = std::min<int64_t>((args.cols + kThreads - 1) / kThreads, 1024);
  const int64_t by = std::min<int64_t>(args.rows, 65535);
  return Launch(DequantizeKernel, dim3(static_cast<unsigned>(bx), static_cast<unsigned>(by)),
                dim3(kThreads), ToCuda(stream), args.codes, args.rows, args.cols,
                args.format == Fp8Format::kE4M3, grid, mx ? nullptr : args.scale_inv,
                mx ? args.e8m0_scales : nullptr, args.output);
}

absl::Status AmaxCuda(const AmaxArgs& args, Stream stream_arg) {
  FP8RT_RETURN_IF_ERROR(ValidateAmaxArgs(args));
  FP8RT_RETURN_IF_ERROR(CheckDevicePointers(
      {{"input", args.input}, {"amax", args.amax}, {"finite_amax", args.finite_amax}}));
  const cudaStream_t stream = ToCuda(stream_arg);
  CUDA_RETURN_IF_ERROR(cudaMemsetAsync(args.amax, 0, sizeof(float), stream));
  if (args.finite_amax != nullptr) {
    CUDA_RETURN_IF_ERROR(cudaMemsetAsync(args.finite_amax, 0, sizeof(float), stream));
  }
  if (args.count > 0) {
    FP8RT_ASSIGN_OR_RETURN(const int sms, CurrentDeviceSmCount());
    auto* amax = reinterpret_cast<uint32_t*>(args.amax);
    auto* finite = reinterpret_cast<uint32_t*>(args.finite_amax);
    FP8RT_RETURN_IF_ERROR(
        args.input_type == InputType::kF32
            ? LaunchAmax<float>(args.input, args.count, amax, finite, sms, stream)
            : LaunchAmax<uint16_t>(args.input, args.count, amax, finite, sms, stream));
  }
  // A NaN amax is written as the quiet NaN the CPU backend writes.
  return Launch(CanonicalNaNKernel, dim3(1), dim3(1), stream, args.amax);
}

absl::Status ConvertCuda(const ConvertArgs& args, Stream stream_arg) {
  FP8RT_RETURN_IF_ERROR(ValidateConvertArgs(args));
  if (args.count == 0) return absl::OkStatus();
  FP8RT_RETURN_IF_ERROR(CheckDevicePointers({{"input", args.input}, {"output", args.output}}));
  const cudaStream_t stream = ToCuda(stream_arg);
  if (args.from == args.to) {
    const size_t elem = args.from == InputType::kF32 ? 4 : 2;
    CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(args.output, args.input,
                                         static_cast<size_t>(args.count) * elem,
                                         cudaMemcpyDeviceToDevice, stream));
    return absl::OkStatus();
  }
  FP8RT_ASSIGN_OR_RETURN(const int sms, CurrentDeviceSmCount());
  const dim3 grid(static_cast<unsigned>(GridFor(args.count, kThreads, sms)));
  if (args.from == InputType::kF32) {
    return Launch(F32ToBf16Kernel, grid, dim3(kThreads), stream,
                  static_cast<const float*>(args.input), args.count,
                  static_cast<uint16_t*>(args.output));
  }
  return Launch(Bf16ToF32Kernel, grid, dim3(kThreads), stream,
                static_cast<const uint16_t*>(args.input), args.count,
                static_cast<float*>(args.output));
}

absl::Status CastTransposeCuda(const CastTransposeArgs& args, Stream stream_arg) {
  FP8RT_RETURN_IF_ERROR(ValidateCastTransposeArgs(args));
  FP8RT_RETURN_IF_ERROR(CheckDevicePointers({{"input", args.input},
                                             {"codes", args.codes},
                                             {"codes_t", args.codes_t},
                                             {"scale_inv", args.scale_inv},
                                             {"stats", args.stats}}));
  const cudaStream_t stream = ToCuda(stream_arg);
  if (args.stats != nullptr) {
    CUDA_RETURN_IF_ERROR(cudaMemsetAsync(args.stats, 0, sizeof(QuantStats), stream));
  }
  const int64_t total = args.rows * args.cols;
  if (total > 0) {
    FP8RT_ASSIGN_OR_RETURN(const int sms, CurrentDeviceSmCount());
    FP8RT_RETURN_IF_ERROR(FP8RT_DISPATCH_FORMAT_INPUT(args.format, args.input_type,
                                                      LaunchCastTranspose, args, sms, stream));
  }
  TensorScale ts;
  ts.given = args.scale;
  return Launch(TensorEpilogueKernel, dim3(1), dim3(1), stream, ts, args.scale_inv, args.stats,
                total);
}

}  // namespace fp8rt::kernels::cuda_internal
