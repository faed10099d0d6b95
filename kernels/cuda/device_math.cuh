// Internal: the device-side numerics of the CUDA backend, each a line-for-line mirror of the
// host definition it must equal bit for bit (tests/gpu/ops_cuda_test.cc checks that it does).
//
// Index:
//   EncodeFp8<F>          internal::EncodeFp8Bits (kernels/fp8_encode.h), same bit operations
//   ThreadStats, QuantizeOne<F>
//                         one value: code and the QuantStats counts (kernels/cpu/quantize_cpu.cc)
//   ComputeScale          kernels/quantize_common.cc ComputeScale on the finite amax bits
//   ComputeScaleOfValue   the same of any float (negative, NaN, Inf give 1)
//   Mx32Exponent          Mx32ScaleExponent, from the bits
//   Mx32ScaleTileOffset   where cuBLASLt's VEC32_UE8M0 mode reads an E8M0 scale
//   DecodeFp8, DecodeE8M0, FloatToBf16, PowerOfTwo
//   WarpMax, BlockMax, FlushStats   reductions; FlushStats ends in one atomic per field per block
//
// Every FP32 operation whose rounding matters is an explicit round-to-nearest intrinsic
// (__fmul_rn, __fadd_rn, __fdiv_rn): the compiler never contracts those into an FMA, and the
// results are the IEEE ones the host computes. Denormals are kept: the CUDA sources of fp8rt are
// compiled with -ftz=false (kernels/CMakeLists.txt), which the subnormal encoding needs.
//
// The per-value functions (everything above the reductions) also compile as host code when the
// includer defines the CUDA intrinsics they use (FP8RT_DEVICE_MATH_HOST_SHIM):
// tests/gpu/device_math_host_test.cc checks them against the host definitions that way, on any
// machine. The reductions need a GPU.
#ifndef FP8RT_KERNELS_CUDA_DEVICE_MATH_CUH_
#define FP8RT_KERNELS_CUDA_DEVICE_MATH_CUH_

#if !defined(FP8RT_DEVICE_MATH_HOST_SHIM)
#include <cuda_runtime.h>
#endif

#include <cfloat>
#include <cstdint>

#include "kernels/cuda/launch.cuh"
#include "kernels/fp8_encode.h"
#include "kernels/quantize.h"

namespace fp8rt::kernels::cuda_internal {

// The bits of std::numeric_limits<float>::quiet_NaN(), which the CPU backend writes for a NaN
// amax; arithmetic on the GPU would produce 0x7FFFFFFF instead.
inline constexpr uint32_t kQuietNaNBits = 0x7FC00000u;

// FP32 -> FP8 exactly as internal::EncodeFp8Bits: NaN -> 0x7F, overflow (Inf included) -> +-max,
// normal range by integer rounding of the FP32 bits (nearest even), subnormal range through the
// magic-number addition (the FPU's nearest-even rounding at the FP8 subnormal step).
template <Fp8Format F>
__device__ __forceinline__ uint32_t EncodeFp8(float y) {
  using B = internal::Fp8Bits<F>;
  const uint32_t bits = __float_as_uint(y);
  const uint32_t a = bits & 0x7FFFFFFFu;
  const uint32_t sign = (bits >> 24) & 0x80u;
  if (a > 0x7F800000u) return kFp8NaN;
  if (a > B::kOverflowAbove) return sign | B::kMaxCode;
  uint32_t code;
  if (a >= B::kMinNormalBits) {
    const uint32_t r = a + ((1u << (B::kShift - 1)) - 1u) + ((a >> B::kShift) & 1u);
    code = (r >> B::kShift) - B::kRebias;
  } else {
    code = __float_as_uint(__fadd_rn(__uint_as_float(a), __uint_as_float(B::kMagicBits))) -
           B::kMagicBits;
  }
  return sign | code;
}

// Per-thread QuantStats accumulators; amax as |x| bits, which order NaN > Inf > finite. 32-bit
// counts: the kernels' grids are sized so that no thread sees 2^32 values (persistent grids of
// at least a few hundred threads: that would take tensors of 2^40 values); the block reduction
// widens them to 64 bits.
struct ThreadStats {
  uint32_t amax_bits = 0;
  uint32_t underflow = 0;
  uint32_t subnormal = 0;
  uint32_t saturated = 0;
  uint32_t nonfinite = 0;
};

// One value: its code and its contribution to every statistic (the definitions of
// kernels/quantize.h; the same expressions as QuantizeOne in kernels/cpu/quantize_cpu.cc).
template <Fp8Format F>
__device__ __forceinline__ uint32_t QuantizeOne(float x, float scale, ThreadStats& s) {
  using B = internal::Fp8Bits<F>;
  const uint32_t ain = __float_as_uint(x) & 0x7FFFFFFFu;
  const float y = __fmul_rn(x, scale);
  const uint32_t code = EncodeFp8<F>(y);
  const bool finite = ain < 0x7F800000u;
  const uint32_t mag = code & 0x7Fu;
  s.amax_bits = max(s.amax_bits, ain);
  s.nonfinite += !finite;
  s.underflow += finite && ain != 0 && mag == 0;
  s.subnormal += mag != 0 && mag < (1u << B::kMantissaBits);
  s.saturated += finite && (__float_as_uint(y) & 0x7FFFFFFFu) > B::kOverflowAbove;
  return code;
}

// The fast path of the streaming kernels (the same split as the CPU's VectorEncoder): a y whose
// magnitude bits lie in [min normal, max] encodes by the normal-range rounding alone, and its x
// counts in no statistic but amax (finite, not zero in FP8, not subnormal, not saturated).
template <Fp8Format F>
__device__ __forceinline__ bool IsPlainNormal(uint32_t y_bits) {
  using B = internal::Fp8Bits<F>;
  constexpr uint32_t kMaxBits = F == Fp8Format::kE4M3 ? 0x43E00000u : 0x47600000u;  // 448, 57344
  return (y_bits & 0x7FFFFFFFu) - B::kMinNormalBits <= kMaxBits - B::kMinNormalBits;
}
template <Fp8Format F>
__device__ __forceinline__ uint32_t EncodePlainNormal(uint32_t y_bits) {
  using B = internal::Fp8Bits<F>;
  const uint32_t a = y_bits & 0x7FFFFFFFu;
  const uint32_t r = a + ((1u << (B::kShift - 1)) - 1u) + ((a >> B::kShift) & 1u);
  return ((r >> B::kShift) - B::kRebias) | ((y_bits >> 24) & 0x80u);
}

__device__ __forceinline__ float LoadAsFloat(const float* p, int64_t i) { return p[i]; }
__device__ __forceinline__ float LoadAsFloat(const uint16_t* p, int64_t i) {
  return __uint_as_float(static_cast<uint32_t>(p[i]) << 16);
}

// 2^k for k in [-149, 127], from the bits (exact, subnormals included).
__device__ __forceinline__ float PowerOfTwo(int k) {
  return k >= -126 ? __uint_as_float(static_cast<uint32_t>(k + 127) << 23)
                   : __uint_as_float(1u << (k + 149));
}

// ComputeScale (kernels/quantize_common.cc) of the amax whose bits are given (finite, >= 0):
// fp8_max / amax / 2^margin in FP32; FLT_MAX on overflow, FLT_MIN below the normal range; 1 for
// amax 0; with power_of_two rounded down to a power of two (frexp/ldexp on the host: clearing
// the mantissa of a normal number is the same thing).
__device__ __forceinline__ float ComputeScale(uint32_t amax_bits, float fp8_max, int margin,
                                              bool power_of_two) {
  const float amax = __uint_as_float(amax_bits);
  if (!(amax > 0.0f) || amax_bits >= 0x7F800000u) return 1.0f;
  float scale = __fdiv_rn(fp8_max, amax);
  scale = __fdiv_rn(scale, PowerOfTwo(margin));  // margin in [0, 64]: 2^margin is exact
  if (__float_as_uint(scale) >= 0x7F800000u) scale = FLT_MAX;
  if (scale < FLT_MIN) scale = FLT_MIN;
  if (power_of_two) scale = __uint_as_float(__float_as_uint(scale) & 0xFF800000u);
  return scale;
}

// ComputeScale (kernels/quantize_common.cc) of any float, as the host's: 1 for a value that is not
// > 0 (a negative one, a NaN of either sign, zero) or is infinite. For an amax the kernel reads
// from memory (QuantizeArgs::scale_amax) rather than one it reduced itself.
__device__ __forceinline__ float ComputeScaleOfValue(float amax, float fp8_max, int margin,
                                                     bool power_of_two) {
  const uint32_t bits = __float_as_uint(amax);
  return ComputeScale(bits >> 31 ? 0u : bits, fp8_max, margin, power_of_two);
}

// Mx32ScaleExponent: floor(log2(amax)) - emax, clamped to [-127, 127]; -127 for amax 0.
__device__ __forceinline__ int Mx32Exponent(uint32_t amax_bits, int emax) {
  if (amax_bits == 0) return -127;
  const int biased = static_cast<int>(amax_bits >> 23);
  const int floor_log2 =
      biased != 0 ? biased - 127 : -149 + (31 - __clz(static_cast<int>(amax_bits)));
  return min(127, max(-127, floor_log2 - emax));
}

// cuBLASLt's layout of VEC32_UE8M0 scales (cuBLAS documentation, "1D block scaling factors
// layout"): the grid of one operand, `rows` (its M or N) x `cols` = K / 32 E8M0 codes, is stored
// in tiles of 128 rows x 4 columns, 512 bytes each, the tiles of one 128-row band contiguous
// along K (band-major, `cols_pad` = cols rounded up to 4); inside a tile, row r and column c
// lie at byte (r % 32) * 16 + (r % 128) / 32 * 4 + c. Rows are padded to 128.
__device__ __forceinline__ int64_t Mx32ScaleTileOffset(int64_t row, int64_t col, int64_t cols_pad) {
  const int64_t tile = (row / 128) * (cols_pad / 4) + col / 4;
  return tile * 512 + (row % 32) * 16 + (row % 128) / 32 * 4 + col % 4;
}

// FP8 code -> FP32, exact (DecodeFp8 in kernels/formats.cc); NaN codes give the quiet NaN.
__device__ __forceinline__ float DecodeFp8(uint32_t code, bool e4m3) {
  const int m = e4m3 ? 3 : 2;
  const int bias = e4m3 ? 7 : 15;
  const uint32_t exp_field = (code & 0x7Fu) >> m;
  const uint32_t mantissa = code & ((1u << m) - 1u);
  const uint32_t sign = (code & 0x80u) << 24;
  if (e4m3 ? (code & 0x7Fu) == 0x7Fu : exp_field == 31u) {
    if (!e4m3 && mantissa == 0) return __uint_as_float(sign | 0x7F800000u);
    return __uint_as_float(kQuietNaNBits);
  }
  // value = significand * 2^(e - bias - m); the significand has at most m + 1 bits, so the
  // product with a power of two is exact.
  const float significand = static_cast<float>(exp_field == 0 ? mantissa : (mantissa | (1u << m)));
  const int e = exp_field == 0 ? 1 : static_cast<int>(exp_field);
  return __uint_as_float(__float_as_uint(__fmul_rn(significand, PowerOfTwo(e - bias - m))) | sign);
}

// E8M0 code -> 2^(code - 127); 0xFF is NaN.
__device__ __forceinline__ float DecodeE8M0(uint32_t code) {
  return code == 0xFFu ? __uint_as_float(kQuietNaNBits) : PowerOfTwo(static_cast<int>(code) - 127);
}

// FloatToBf16 (kernels/formats.h): nearest even; NaN stays a quiet NaN with its sign.
__device__ __forceinline__ uint16_t FloatToBf16(float x) {
  const uint32_t bits = __float_as_uint(x);
  const uint32_t rounded = (bits + 0x7FFFu + ((bits >> 16) & 1u)) >> 16;
  const uint32_t quiet_nan = (bits >> 16) | 0x40u;
  return static_cast<uint16_t>((bits & 0x7FFFFFFFu) > 0x7F800000u ? quiet_nan : rounded);
}

#if !defined(FP8RT_DEVICE_MATH_HOST_SHIM)
// --- reductions ----------------------------------------------------------------------------

__device__ __forceinline__ uint32_t WarpMax(uint32_t v) {
  for (int offset = 16; offset > 0; offset >>= 1) {
    v = max(v, __shfl_xor_sync(0xFFFFFFFFu, v, offset));
  }
  return v;
}

__device__ __forceinline__ unsigned long long WarpSum(unsigned long long v) {
  for (int offset = 16; offset > 0; offset >>= 1) v += __shfl_xor_sync(0xFFFFFFFFu, v, offset);
  return v;
}

// Linear thread index within the block (1-D or 2-D blocks).
__device__ __forceinline__ int LinearThread() { return threadIdx.y * blockDim.x + threadIdx.x; }
__device__ __forceinline__ int BlockThreads() { return blockDim.x * blockDim.y; }

// Max over the block, returned to every thread. The block size must be a multiple of 32 (at most
// 1024); every thread of the block must call it. Starts with a barrier so that back-to-back calls
// may reuse `scratch` (32 words of shared memory).
__device__ __forceinline__ uint32_t BlockMax(uint32_t v, uint32_t* scratch) {
  const int t = LinearThread();
  const int warps = BlockThreads() / 32;
  __syncthreads();
  v = WarpMax(v);
  if ((t & 31) == 0) scratch[t >> 5] = v;
  __syncthreads();
  if (t < 32) {
    uint32_t w = t < warps ? scratch[t] : 0u;
    w = WarpMax(w);
    if (t == 0) scratch[0] = w;
  }
  __syncthreads();
  return scratch[0];
}

// Adds this block's statistics into `out` (device memory, zeroed before the launch): warp
// reductions, then one atomic per field from thread 0. amax is accumulated as integer bits in
// the float field (atomicMax on non-negative float bits orders them like the values, NaN on top);
// the launcher's epilogue turns a NaN into the canonical quiet NaN. Every thread must call it.
__device__ __forceinline__ void FlushStats(const ThreadStats& s, QuantStats* out) {
  FP8RT_STATIC_SHARED(uint32_t, amax, [32]);
  FP8RT_STATIC_SHARED(unsigned long long, counts, [4][32]);
  const int t = LinearThread();
  const int warps = BlockThreads() / 32;
  const uint32_t a = WarpMax(s.amax_bits);
  const unsigned long long u = WarpSum(s.underflow), sub = WarpSum(s.subnormal),
                           sat = WarpSum(s.saturated), nf = WarpSum(s.nonfinite);  // widened
  if ((t & 31) == 0) {
    amax[t >> 5] = a;
    counts[0][t >> 5] = u;
    counts[1][t >> 5] = sub;
    counts[2][t >> 5] = sat;
    counts[3][t >> 5] = nf;
  }
  __syncthreads();
  if (t < 32) {
    const bool live = t < warps;
    const uint32_t ba = WarpMax(live ? amax[t] : 0u);
    unsigned long long c[4];
    for (int i = 0; i < 4; ++i) c[i] = WarpSum(live ? counts[i][t] : 0ull);
    if (t == 0) {
      if (ba != 0) atomicMax(reinterpret_cast<unsigned int*>(&out->amax), ba);
      auto add = [](int64_t* field, unsigned long long v) {
        if (v != 0) atomicAdd(reinterpret_cast<unsigned long long*>(field), v);
      };
      add(&out->underflow, c[0]);
      add(&out->subnormal, c[1]);
      add(&out->saturated, c[2]);
      add(&out->nonfinite, c[3]);
    }
  }
}

#endif  // !FP8RT_DEVICE_MATH_HOST_SHIM

}  // namespace fp8rt::kernels::cuda_internal

#endif  // FP8RT_KERNELS_CUDA_DEVICE_MATH_CUH_
