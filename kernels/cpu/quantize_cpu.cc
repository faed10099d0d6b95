// CPU quantize and dequantize: Highway SIMD (dispatched at run time to the best target the CPU
// has, AVX-512 here) inside OpenMP threads.
//
// Index:
//   SpanStats, QuantizeSpan<F, In>   one pass over a contiguous span: encode + all statistics
//   SpanAmax<In>                     max |x| (NaN-aware) and max finite |x| of a span
//   QuantizeCpu, DequantizeCpu       the op-table entries: tiling by granularity, threads
//
// Every lane computes the same bit operations as internal::EncodeFp8Bits (kernels/fp8_encode.h);
// tails shorter than a vector use that scalar function directly.

#undef HWY_TARGET_INCLUDE
#define HWY_TARGET_INCLUDE "kernels/cpu/quantize_cpu.cc"
#include "hwy/foreach_target.h"  // IWYU pragma: keep
// Highway must come after foreach_target.
#include "hwy/cache_control.h"
#include "hwy/highway.h"
#include "kernels/cpu/quantize_one.h"

HWY_BEFORE_NAMESPACE();
namespace fp8rt::kernels::cpu_internal {
namespace HWY_NAMESPACE {
namespace hn = hwy::HWY_NAMESPACE;

using DF = hn::ScalableTag<float>;
using DI = hn::RebindToSigned<DF>;

// Loads one vector of inputs as float.
template <class In>
HWY_INLINE hn::Vec<DF> LoadF(DF df, const In* p) {
  if constexpr (std::is_same_v<In, float>) {
    return hn::LoadU(df, p);
  } else {
    const DI di;
    const hn::Rebind<uint16_t, DI> d16;
    const auto wide = hn::PromoteTo(di, hn::LoadU(d16, p));
    return hn::BitCast(df, hn::ShiftLeft<16>(wide));
  }
}

// Narrows 32-bit lanes holding codes (0..255) to bytes. Highway 1.0's DemoteTo needs six
// shuffles for this on AVX-512, where one vpmovdb does it.
template <class D8>
HWY_INLINE hn::Vec<D8> NarrowCodes(D8 d8, hn::Vec<DI> codes) {
#if HWY_ARCH_X86 && HWY_TARGET <= HWY_AVX3
  return hn::Vec<D8>{_mm512_cvtepi32_epi8(codes.raw)};
#else
  return hn::DemoteTo(d8, codes);
#endif
}

// Encodes |y| bits `a` (and the sign) exactly like internal::EncodeFp8Bits.
template <Fp8Format F>
HWY_INLINE hn::Vec<DI> EncodeLanes(hn::Vec<DI> y_bits, hn::Vec<DI> a) {
  using B = internal::Fp8Bits<F>;
  const DF df;
  const DI di;
  const auto sign = hn::And(hn::ShiftRight<24>(y_bits), hn::Set(di, 0x80));
  // Normal range: round the FP32 mantissa to the FP8 width, nearest even, then rebias.
  const auto odd = hn::And(hn::ShiftRight<B::kShift>(a), hn::Set(di, 1));
  const auto rounded = hn::Add(hn::Add(a, hn::Set(di, (1 << (B::kShift - 1)) - 1)), odd);
  const auto normal =
      hn::Sub(hn::ShiftRight<B::kShift>(rounded), hn::Set(di, static_cast<int32_t>(B::kRebias)));
  // Subnormal range: the FPU rounds |y| to a multiple of the FP8 subnormal step.
  const auto magic_bits = hn::Set(di, static_cast<int32_t>(B::kMagicBits));
  const auto sub = hn::Sub(
      hn::BitCast(di, hn::Add(hn::BitCast(df, a), hn::BitCast(df, magic_bits))), magic_bits);
  auto code = hn::IfThenElse(hn::Set(di, static_cast<int32_t>(B::kMinNormalBits)) > a, sub, normal);
  code = hn::IfThenElse(a > hn::Set(di, static_cast<int32_t>(B::kOverflowAbove)),
                        hn::Set(di, B::kMaxCode), code);
  code = hn::Or(code, sign);
  return hn::IfThenElse(a > hn::Set(di, 0x7F800000), hn::Set(di, kFp8NaN), code);
}

// Encodes one vector of inputs and keeps the running amax. Most vectors hold only values that
// land in FP8's normal range (neither underflowing, subnormal, saturating nor non-finite); those
// take a short path that encodes with the normal-range rounding alone. A vector with any other
// lane takes the full encoder and counts its special lanes; the result is the same either way.
// A struct with always-inlined members rather than a lambda: GCC did not inline the lambda,
// which cost a call and spills per vector.
template <Fp8Format F>
struct VectorEncoder {
  using B = internal::Fp8Bits<F>;
  DF df;
  DI di;
  hn::Rebind<uint8_t, DI> d8;
  hn::Vec<DF> vscale;
  hn::Vec<DI> abs_mask = hn::Set(di, 0x7FFFFFFF);
  hn::Vec<DI> inf_bits = hn::Set(di, 0x7F800000);
  hn::Vec<DI> max_bits = hn::Set(di, static_cast<int32_t>(std::bit_cast<uint32_t>(B::kMax)));
  hn::Vec<DI> overflow_bits = hn::Set(di, static_cast<int32_t>(B::kOverflowAbove));
  hn::Vec<DI> min_normal = hn::Set(di, static_cast<int32_t>(B::kMinNormalBits));
  hn::Vec<DI> round_half = hn::Set(di, (1 << (B::kShift - 1)) - 1);
  hn::Vec<DI> one = hn::Set(di, 1);
  hn::Vec<DI> rebias = hn::Set(di, static_cast<int32_t>(B::kRebias));
  hn::Vec<DI> sign_bit = hn::Set(di, 0x80);
  hn::Vec<DI> mag_mask = hn::Set(di, 0x7F);
  hn::Vec<DI> sub_limit = hn::Set(di, 1 << B::kMantissaBits);
  hn::Vec<DI> zero = hn::Zero(di);
  hn::RebindToUnsigned<DI> du;
  hn::Vec<decltype(du)> normal_span =
      hn::Set(du, std::bit_cast<uint32_t>(B::kMax) - B::kMinNormalBits);

  explicit VectorEncoder(float scale) : vscale(hn::Set(df, scale)) {}

  template <class In>
  HWY_INLINE hn::Vec<decltype(d8)> operator()(const In* HWY_RESTRICT p, hn::Vec<DI>& amax,
                                              SpanStats* stats) const {
    const auto vx = LoadF(df, p);
    const auto ain = hn::And(hn::BitCast(di, vx), abs_mask);
    amax = hn::Max(amax, ain);
    const auto y_bits = hn::BitCast(di, hn::Mul(vx, vscale));
    const auto a = hn::And(y_bits, abs_mask);
    // Outside [min normal, max] as one unsigned range check: a - min_normal wraps below it.
    const auto offset = hn::BitCast(du, hn::Sub(a, min_normal));
    const auto special = hn::RebindMask(di, offset > normal_span);
    if (HWY_LIKELY(hn::AllFalse(di, special))) {
      // Normal range: round the FP32 mantissa to the FP8 width (nearest even), rebias, sign.
      const auto odd = hn::And(hn::ShiftRight<B::kShift>(a), one);
      const auto rounded = hn::Add(hn::Add(a, round_half), odd);
      return NarrowCodes(d8, hn::Or(hn::Sub(hn::ShiftRight<B::kShift>(rounded), rebias),
                                    hn::And(hn::ShiftRight<24>(y_bits), sign_bit)));
    }
    const auto code = EncodeLanes<F>(y_bits, a);
    const auto finite = inf_bits > ain;
    const auto mag = hn::And(code, mag_mask);
    const auto mag_zero = mag == zero;
    stats->nonfinite += static_cast<int64_t>(hn::CountTrue(di, hn::Not(finite)));
    stats->underflow +=
        static_cast<int64_t>(hn::CountTrue(di, hn::And(hn::And(finite, ain > zero), mag_zero)));
    stats->subnormal +=
        static_cast<int64_t>(hn::CountTrue(di, hn::AndNot(mag_zero, sub_limit > mag)));
    stats->saturated += static_cast<int64_t>(hn::CountTrue(di, hn::And(finite, a > overflow_bits)));
    return NarrowCodes(d8, code);
  }
};

// One pass over a span: FP8 codes, amax and all counts.
template <Fp8Format F, class In>
HWY_INLINE void QuantizeSpanT(const In* HWY_RESTRICT x, size_t n, float scale,
                              uint8_t* HWY_RESTRICT out, SpanStats* stats) {
  const VectorEncoder<F> encoder(scale);
  const DI di;
  const hn::Rebind<uint8_t, DI> d8;
  const size_t lanes = hn::Lanes(di);
  auto amax = hn::Zero(di);

  size_t i = 0;
#if HWY_ARCH_X86 && HWY_TARGET <= HWY_AVX3
  // Large spans on AVX-512: four vectors of codes make one 64-byte line, written with a streaming
  // store (no read-for-ownership of the output) after a scalar prologue aligns the destination;
  // the input is prefetched ahead to hide DRAM latency.
  constexpr size_t kStreamMin = size_t{1} << 20;
  constexpr size_t kPrefetchElems = 2048;
  if (n >= kStreamMin) {
    const hn::Twice<decltype(d8)> d8x2;
    const hn::Twice<decltype(d8x2)> d8x4;
    const size_t misalign = reinterpret_cast<uintptr_t>(out) % 64;
    const size_t prologue = misalign == 0 ? 0 : 64 - misalign;
    for (; i < prologue && i < n; ++i) out[i] = QuantizeOne<F>(LoadAsFloat(x, i), scale, *stats);
    const size_t step = 4 * lanes;
    for (; i + step <= n; i += step) {
      // One prefetch per 64-byte line of input (each vector of 16 floats is one line).
      hwy::Prefetch(x + i + kPrefetchElems);
      hwy::Prefetch(x + i + kPrefetchElems + lanes);
      hwy::Prefetch(x + i + kPrefetchElems + 2 * lanes);
      hwy::Prefetch(x + i + kPrefetchElems + 3 * lanes);
      const auto c0 = encoder(x + i, amax, stats);
      const auto c1 = encoder(x + i + lanes, amax, stats);
      const auto c2 = encoder(x + i + 2 * lanes, amax, stats);
      const auto c3 = encoder(x + i + 3 * lanes, amax, stats);
      const auto line = hn::Combine(d8x4, hn::Combine(d8x2, c3, c2), hn::Combine(d8x2, c1, c0));
      hn::Stream(line, d8x4, out + i);
    }
    hwy::FlushStream();
  }
#endif
  for (; i + lanes <= n; i += lanes) hn::StoreU(encoder(x + i, amax, stats), d8, out + i);
  const uint32_t vmax = static_cast<uint32_t>(hn::GetLane(hn::MaxOfLanes(di, amax)));
  if (vmax > stats->amax_bits) stats->amax_bits = vmax;
  for (; i < n; ++i) out[i] = QuantizeOne<F>(LoadAsFloat(x, i), scale, *stats);
}

template <class In>
HWY_INLINE AmaxPair SpanAmaxT(const In* HWY_RESTRICT x, size_t n) {
  const DF df;
  const DI di;
  const size_t lanes = hn::Lanes(df);
  const auto abs_mask = hn::Set(di, 0x7FFFFFFF);
  const auto inf_bits = hn::Set(di, 0x7F800000);
  auto amax = hn::Zero(di);
  auto finite_amax = hn::Zero(di);
  size_t i = 0;
  for (; i + lanes <= n; i += lanes) {
    const auto ain = hn::And(hn::BitCast(di, LoadF(df, x + i)), abs_mask);
    amax = hn::Max(amax, ain);
    finite_amax = hn::Max(finite_amax, hn::IfThenElseZero(inf_bits > ain, ain));
  }
  AmaxPair r;
  r.amax_bits = static_cast<uint32_t>(hn::GetLane(hn::MaxOfLanes(di, amax)));
  r.finite_amax_bits = static_cast<uint32_t>(hn::GetLane(hn::MaxOfLanes(di, finite_amax)));
  for (; i < n; ++i) {
    const uint32_t ain = std::bit_cast<uint32_t>(LoadAsFloat(x, i)) & 0x7FFFFFFFu;
    if (ain > r.amax_bits) r.amax_bits = ain;
    if (ain < 0x7F800000u && ain > r.finite_amax_bits) r.finite_amax_bits = ain;
  }
  return r;
}

void QuantizeF32E4M3(const float* x, size_t n, float s, uint8_t* out, SpanStats* st) {
  QuantizeSpanT<Fp8Format::kE4M3>(x, n, s, out, st);
}
void QuantizeF32E5M2(const float* x, size_t n, float s, uint8_t* out, SpanStats* st) {
  QuantizeSpanT<Fp8Format::kE5M2>(x, n, s, out, st);
}
void QuantizeBf16E4M3(const uint16_t* x, size_t n, float s, uint8_t* out, SpanStats* st) {
  QuantizeSpanT<Fp8Format::kE4M3>(x, n, s, out, st);
}
void QuantizeBf16E5M2(const uint16_t* x, size_t n, float s, uint8_t* out, SpanStats* st) {
  QuantizeSpanT<Fp8Format::kE5M2>(x, n, s, out, st);
}
AmaxPair AmaxF32(const float* x, size_t n) { return SpanAmaxT(x, n); }
AmaxPair AmaxBf16(const uint16_t* x, size_t n) { return SpanAmaxT(x, n); }

}  // namespace HWY_NAMESPACE
}  // namespace fp8rt::kernels::cpu_internal
HWY_AFTER_NAMESPACE();

#if HWY_ONCE
#include <omp.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <mutex>

#include "kernels/cpu/cpu_ops.h"

namespace fp8rt::kernels::cpu_internal {

HWY_EXPORT(QuantizeF32E4M3);
HWY_EXPORT(QuantizeF32E5M2);
HWY_EXPORT(QuantizeBf16E4M3);
HWY_EXPORT(QuantizeBf16E5M2);
HWY_EXPORT(AmaxF32);
HWY_EXPORT(AmaxBf16);

void QuantizeF32Span(const float* x, size_t n, float scale, Fp8Format format, uint8_t* out,
                     SpanStats* stats) {
  if (format == Fp8Format::kE4M3) {
    HWY_DYNAMIC_DISPATCH(QuantizeF32E4M3)(x, n, scale, out, stats);
  } else {
    HWY_DYNAMIC_DISPATCH(QuantizeF32E5M2)(x, n, scale, out, stats);
  }
}

namespace {

// Type-erased span functions for one (input type, format) pair, resolved once per call.
struct SpanFns {
  void (*quantize)(const void* x, size_t n, float scale, uint8_t* out, SpanStats* stats);
  AmaxPair (*amax)(const void* x, size_t n);
  size_t elem_bytes;
};

SpanFns GetSpanFns(InputType input, Fp8Format format) {
  SpanFns fns{};
  if (input == InputType::kF32) {
    fns.elem_bytes = sizeof(float);
    fns.amax = [](const void* x, size_t n) {
      return HWY_DYNAMIC_DISPATCH(AmaxF32)(static_cast<const float*>(x), n);
    };
    fns.quantize = format == Fp8Format::kE4M3
                       ? +[](const void* x, size_t n, float s, uint8_t* o, SpanStats* st) {
                           HWY_DYNAMIC_DISPATCH(QuantizeF32E4M3)(static_cast<const float*>(x), n,
                                                                 s, o, st);
                         }
                       : +[](const void* x, size_t n, float s, uint8_t* o, SpanStats* st) {
                           HWY_DYNAMIC_DISPATCH(QuantizeF32E5M2)(static_cast<const float*>(x), n,
                                                                 s, o, st);
                         };
  } else {
    fns.elem_bytes = sizeof(uint16_t);
    fns.amax = [](const void* x, size_t n) {
      return HWY_DYNAMIC_DISPATCH(AmaxBf16)(static_cast<const uint16_t*>(x), n);
    };
    fns.quantize = format == Fp8Format::kE4M3
                       ? +[](const void* x, size_t n, float s, uint8_t* o, SpanStats* st) {
                           HWY_DYNAMIC_DISPATCH(QuantizeBf16E4M3)(
                               static_cast<const uint16_t*>(x), n, s, o, st);
                         }
                       : +[](const void* x, size_t n, float s, uint8_t* o, SpanStats* st) {
                           HWY_DYNAMIC_DISPATCH(QuantizeBf16E5M2)(
                               static_cast<const uint16_t*>(x), n, s, o, st);
                         };
  }
  return fns;
}

float BitsToFloat(uint32_t bits) { return std::bit_cast<float>(bits); }

// Accumulates per-thread statistics into the caller's QuantStats.
class StatsSink {
 public:
  void Add(const SpanStats& s) {
    std::lock_guard<std::mutex> lock(mu_);
    total_.amax_bits = std::max(total_.amax_bits, s.amax_bits);
    total_.underflow += s.underflow;
    total_.subnormal += s.subnormal;
    total_.saturated += s.saturated;
    total_.nonfinite += s.nonfinite;
  }
  QuantStats Result(int64_t count) const {
    QuantStats q;
    q.amax = total_.amax_bits > 0x7F800000u ? std::numeric_limits<float>::quiet_NaN()
                                            : BitsToFloat(total_.amax_bits);
    q.count = count;
    q.underflow = total_.underflow;
    q.subnormal = total_.subnormal;
    q.saturated = total_.saturated;
    q.nonfinite = total_.nonfinite;
    return q;
  }

 private:
  std::mutex mu_;
  SpanStats total_;  // Guarded by mu_
};

// Splits [0, n) into one contiguous range per thread of the team and runs `body(begin, end)`.
template <class Body>
void ParallelRanges(int64_t n, int64_t min_per_thread, Body body) {
  const int max_threads = omp_get_max_threads();
  const int threads = static_cast<int>(
      std::clamp<int64_t>(n / std::max<int64_t>(min_per_thread, 1), 1, max_threads));
#pragma omp parallel num_threads(threads)
  {
    const int t = omp_get_thread_num();
    const int nt = omp_get_num_threads();
    const int64_t begin = n * t / nt;
    const int64_t end = n * (t + 1) / nt;
    if (begin < end) body(begin, end);
  }
}

// The scale of a block with the given finite amax (1 for an all-zero block).
float BlockScale(uint32_t finite_amax_bits, const QuantizeArgs& args) {
  return ComputeScale(BitsToFloat(finite_amax_bits), args.format, args.margin,
                      args.power_of_two_scales);
}

}  // namespace

absl::Status QuantizeCpu(const QuantizeArgs& args, Stream) {
  if (absl::Status s = ValidateQuantizeArgs(args); !s.ok()) return s;
  const int64_t rows = args.rows;
  const int64_t cols = args.cols;
  const int64_t total = rows * cols;
  const SpanFns fns = GetSpanFns(args.input_type, args.format);
  const auto* in = static_cast<const uint8_t*>(args.input);
  auto in_at = [&](int64_t index) { return in + index * static_cast<int64_t>(fns.elem_bytes); };
  StatsSink sink;
  constexpr int64_t kMinSpan = int64_t{1} << 16;  // elements per thread worth a thread
  const ScaleGrid grid = GetScaleGrid(args.granularity, rows, cols);

  if (total == 0) {
    if (args.granularity != Granularity::kMx32) std::fill_n(args.scale_inv, grid.size(), 1.0f);
    if (args.stats != nullptr) *args.stats = QuantStats{};
    return absl::OkStatus();
  }

  switch (args.granularity) {
    case Granularity::kTensor: {
      float scale = args.scale;
      if (args.scale_amax != nullptr) {
        scale = ComputeScale(*args.scale_amax, args.format, args.margin, args.power_of_two_scales);
      } else if (!args.has_scale) {
        std::mutex mu;
        uint32_t finite_amax = 0;
        ParallelRanges(total, kMinSpan, [&](int64_t b, int64_t e) {
          const AmaxPair p = fns.amax(in_at(b), static_cast<size_t>(e - b));
          std::lock_guard<std::mutex> lock(mu);
          finite_amax = std::max(finite_amax, p.finite_amax_bits);
        });
        scale = BlockScale(finite_amax, args);
      }
      ParallelRanges(total, kMinSpan, [&](int64_t b, int64_t e) {
        SpanStats s;
        fns.quantize(in_at(b), static_cast<size_t>(e - b), scale, args.codes + b, &s);
        sink.Add(s);
      });
      args.scale_inv[0] = 1.0f / scale;
      break;
    }
    case Granularity::kRow:
    case Granularity::kTile1x128:
    case Granularity::kMx32: {
      // One scale per (row, column block): each thread takes whole rows.
      const int64_t bc = grid.block_cols;
      ParallelRanges(rows, std::max<int64_t>(1, kMinSpan / std::max<int64_t>(cols, 1)),
                     [&](int64_t r0, int64_t r1) {
                       SpanStats s;
                       for (int64_t r = r0; r < r1; ++r) {
                         for (int64_t j = 0; j < grid.cols; ++j) {
                           const int64_t c0 = j * bc;
                           const size_t len = static_cast<size_t>(std::min(bc, cols - c0));
                           const int64_t at = r * cols + c0;
                           const AmaxPair p = fns.amax(in_at(at), len);
                           float scale;
                           if (args.granularity == Granularity::kMx32) {
                             const int e =
                                 Mx32ScaleExponent(BitsToFloat(p.finite_amax_bits), args.format);
                             args.e8m0_scales[r * grid.cols + j] = E8M0FromExponent(e);
                             scale = std::ldexp(1.0f, -e);
                           } else {
                             scale = BlockScale(p.finite_amax_bits, args);
                             args.scale_inv[r * grid.cols + j] = 1.0f / scale;
                           }
                           fns.quantize(in_at(at), len, scale, args.codes + at, &s);
                         }
                       }
                       sink.Add(s);
                     });
      break;
    }
    case Granularity::kBlock128x128: {
      const int64_t blocks = grid.size();
      ParallelRanges(blocks, 1, [&](int64_t b0, int64_t b1) {
        SpanStats s;
        for (int64_t b = b0; b < b1; ++b) {
          const int64_t r_begin = (b / grid.cols) * 128;
          const int64_t r_end = std::min(r_begin + 128, rows);
          const int64_t c0 = (b % grid.cols) * 128;
          const size_t len = static_cast<size_t>(std::min<int64_t>(128, cols - c0));
          uint32_t finite_amax = 0;
          for (int64_t r = r_begin; r < r_end; ++r) {
            finite_amax =
                std::max(finite_amax, fns.amax(in_at(r * cols + c0), len).finite_amax_bits);
          }
          const float scale = BlockScale(finite_amax, args);
          args.scale_inv[b] = 1.0f / scale;
          for (int64_t r = r_begin; r < r_end; ++r) {
            fns.quantize(in_at(r * cols + c0), len, scale, args.codes + r * cols + c0, &s);
          }
        }
        sink.Add(s);
      });
      break;
    }
  }
  if (args.stats != nullptr) *args.stats = sink.Result(total);
  return absl::OkStatus();
}

absl::Status AmaxCpu(const AmaxArgs& args, Stream) {
  if (absl::Status s = ValidateAmaxArgs(args); !s.ok()) return s;
  const SpanFns fns = GetSpanFns(args.input_type, Fp8Format::kE4M3);
  const auto* in = static_cast<const uint8_t*>(args.input);
  std::mutex mu;
  AmaxPair total;
  ParallelRanges(args.count, int64_t{1} << 16, [&](int64_t b, int64_t e) {
    const AmaxPair p =
        fns.amax(in + b * static_cast<int64_t>(fns.elem_bytes), static_cast<size_t>(e - b));
    std::lock_guard<std::mutex> lock(mu);
    total.amax_bits = std::max(total.amax_bits, p.amax_bits);
    total.finite_amax_bits = std::max(total.finite_amax_bits, p.finite_amax_bits);
  });
  *args.amax = total.amax_bits > 0x7F800000u ? std::numeric_limits<float>::quiet_NaN()
                                             : BitsToFloat(total.amax_bits);
  if (args.finite_amax != nullptr) *args.finite_amax = BitsToFloat(total.finite_amax_bits);
  return absl::OkStatus();
}

absl::Status DequantizeCpu(const DequantizeArgs& args, Stream) {
  if (absl::Status s = ValidateDequantizeArgs(args); !s.ok()) return s;
  if (args.rows == 0 || args.cols == 0) return absl::OkStatus();
  std::array<float, 256> lut;
  for (int c = 0; c < 256; ++c) lut[c] = DecodeFp8(static_cast<uint8_t>(c), args.format);
  const ScaleGrid grid = GetScaleGrid(args.granularity, args.rows, args.cols);
  const int64_t cols = args.cols;
#pragma omp parallel for schedule(static)
  for (int64_t r = 0; r < args.rows; ++r) {
    const int64_t sr = r / grid.block_rows;
    for (int64_t j = 0; j < grid.cols; ++j) {
      const int64_t c0 = j * grid.block_cols;
      const int64_t c1 = std::min(c0 + grid.block_cols, cols);
      const float s = args.granularity == Granularity::kMx32
                          ? DecodeE8M0(args.e8m0_scales[sr * grid.cols + j])
                          : args.scale_inv[sr * grid.cols + j];
      const uint8_t* code = args.codes + r * cols;
      float* out = args.output + r * cols;
      for (int64_t c = c0; c < c1; ++c) out[c] = lut[code[c]] * s;
    }
  }
  return absl::OkStatus();
}

}  // namespace fp8rt::kernels::cpu_internal
#endif  // HWY_ONCE
