// FP8 -> BF16 conversions for the CPU GEMM: plain decoding of A, and packing of B straight into
// oneDNN's AMX weights layout (from FP8 codes, FP32 values or BF16 bits). Dispatched with Highway;
// on AVX-512 the decode is a 128-entry table lookup done with two-table word permutes (32 codes per
// instruction group), elsewhere a scalar table. Both are exact: every FP8 value is a BF16 value.
#undef HWY_TARGET_INCLUDE
#define HWY_TARGET_INCLUDE "kernels/cpu/convert_cpu.cc"
#include "hwy/foreach_target.h"  // IWYU pragma: keep
// Highway must come after foreach_target.
#include "hwy/highway.h"

#ifndef FP8RT_KERNELS_CPU_CONVERT_TABLE_
#define FP8RT_KERNELS_CPU_CONVERT_TABLE_
#include <array>
#include <cstdint>
#include <cstring>

#include "kernels/formats.h"

namespace fp8rt::kernels::cpu_internal {

// BF16 bits of every FP8 code of one format.
struct Bf16Table {
  alignas(64) std::array<uint16_t, 256> bits;
  explicit Bf16Table(Fp8Format format) {
    for (int c = 0; c < 256; ++c) bits[c] = FloatToBf16(DecodeFp8(static_cast<uint8_t>(c), format));
  }
};

inline const Bf16Table& TableFor(Fp8Format format) {
  static const Bf16Table e4m3(Fp8Format::kE4M3), e5m2(Fp8Format::kE5M2);
  return format == Fp8Format::kE4M3 ? e4m3 : e5m2;
}

}  // namespace fp8rt::kernels::cpu_internal
#endif  // FP8RT_KERNELS_CPU_CONVERT_TABLE_

HWY_BEFORE_NAMESPACE();
namespace fp8rt::kernels::cpu_internal {
namespace HWY_NAMESPACE {

#if HWY_ARCH_X86 && HWY_TARGET <= HWY_AVX3
// 32 codes -> 32 BF16: magnitudes through two 64-entry two-table permutes, sign re-attached.
struct Avx512Decoder {
  __m512i t0, t1, t2, t3;
  explicit Avx512Decoder(const Bf16Table& table) {
    t0 = _mm512_loadu_si512(table.bits.data());
    t1 = _mm512_loadu_si512(table.bits.data() + 32);
    t2 = _mm512_loadu_si512(table.bits.data() + 64);
    t3 = _mm512_loadu_si512(table.bits.data() + 96);
  }
  HWY_INLINE __m512i operator()(const uint8_t* codes) const {
    const __m512i c =
        _mm512_cvtepu8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(codes)));
    const __m512i low = _mm512_permutex2var_epi16(t0, c, t1);  // index bits 0..5
    const __m512i high = _mm512_permutex2var_epi16(t2, c, t3);
    const __mmask32 upper = _mm512_test_epi16_mask(c, _mm512_set1_epi16(0x40));
    const __m512i magnitude = _mm512_mask_blend_epi16(upper, low, high);
    const __m512i sign = _mm512_slli_epi16(_mm512_and_si512(c, _mm512_set1_epi16(0x80)), 8);
    return _mm512_or_si512(magnitude, sign);
  }
};
#endif

namespace hn = hwy::HWY_NAMESPACE;

// FP32 -> BF16 bits, nearest even, NaN kept quiet: the lanes do what FloatToBf16 does.
void F32ToBf16Span(const float* HWY_RESTRICT in, int64_t n, uint16_t* HWY_RESTRICT out) {
  const hn::ScalableTag<int32_t> di;
  const hn::Rebind<uint16_t, decltype(di)> d16;
  const int64_t lanes = static_cast<int64_t>(hn::Lanes(di));
  const auto abs_mask = hn::Set(di, 0x7FFFFFFF);
  const auto inf = hn::Set(di, 0x7F800000);
  const auto half = hn::Set(di, 0x7FFF);
  const auto one = hn::Set(di, 1);
  const auto quiet = hn::Set(di, 0x40);
  const auto low16 = hn::Set(di, 0xFFFF);
  int64_t i = 0;
  for (; i + lanes <= n; i += lanes) {
    const auto bits = hn::BitCast(di, hn::LoadU(hn::RebindToFloat<decltype(di)>(), in + i));
    // Logical shifts of the (possibly negative) bits: mask after the arithmetic shift.
    const auto hi = hn::And(hn::ShiftRight<16>(bits), low16);
    const auto rounded =
        hn::And(hn::ShiftRight<16>(hn::Add(hn::Add(bits, half), hn::And(hi, one))), low16);
    const auto is_nan = hn::And(bits, abs_mask) > inf;
    const auto result = hn::IfThenElse(is_nan, hn::Or(hi, quiet), rounded);
    hn::StoreU(hn::DemoteTo(d16, result), d16, out + i);
  }
  for (; i < n; ++i) out[i] = FloatToBf16(in[i]);
}

// BF16 bits -> FP32, exact.
void Bf16ToF32Span(const uint16_t* HWY_RESTRICT in, int64_t n, float* HWY_RESTRICT out) {
  const hn::ScalableTag<int32_t> di;
  const hn::RebindToFloat<decltype(di)> df;
  const hn::Rebind<uint16_t, decltype(di)> d16;
  const int64_t lanes = static_cast<int64_t>(hn::Lanes(di));
  int64_t i = 0;
  for (; i + lanes <= n; i += lanes) {
    const auto wide = hn::PromoteTo(di, hn::LoadU(d16, in + i));
    hn::StoreU(hn::BitCast(df, hn::ShiftLeft<16>(wide)), df, out + i);
  }
  for (; i < n; ++i) out[i] = Bf16ToFloat(in[i]);
}

void DecodeSpan(const uint8_t* codes, int64_t n, Fp8Format format, uint16_t* out) {
  const Bf16Table& table = TableFor(format);
  int64_t i = 0;
#if HWY_ARCH_X86 && HWY_TARGET <= HWY_AVX3
  const Avx512Decoder decode(table);
  for (; i + 32 <= n; i += 32) _mm512_storeu_si512(out + i, decode(codes + i));
#endif
  for (; i < n; ++i) out[i] = table.bits[codes[i]];
}

// The block of B at rows r0.., columns c0.. (element (r, c) at b[r * row_stride + c *
// col_stride]) decoded into `out` in the AMX layout one element at a time, zero past the matrix:
// the partial blocks, and every block without AVX-512.
void PackBlockScalar(const uint8_t* b, int64_t row_stride, int64_t col_stride, int64_t n, int64_t k,
                     int64_t r0, int64_t c0, const Bf16Table& table, uint16_t* out) {
  for (int64_t ni = 0; ni < 64; ++ni) {
    const int64_t r = r0 + ni;
    for (int64_t kk = 0; kk < 32; ++kk) {
      const int64_t c = c0 + kk;
      out[(kk / 2) * 128 + ni * 2 + (kk % 2)] =
          (r < n && c < k) ? table.bits[b[r * row_stride + c * col_stride]] : uint16_t{0};
    }
  }
}

// Packs the 64 (n) x 32 (k) block (nb, kb) of B (n x k FP8 codes, row-major) into `out`, the
// block's 2048 BF16 values in oneDNN's AMX layout: out[(kk / 2) * 128 + ni * 2 + kk % 2].
// Rows and columns past the matrix are zero.
void PackBlock(const uint8_t* b, int64_t n, int64_t k, int64_t nb, int64_t kb, Fp8Format format,
               uint16_t* out) {
  const Bf16Table& table = TableFor(format);
  const int64_t r0 = nb * 64, c0 = kb * 32;
#if HWY_ARCH_X86 && HWY_TARGET <= HWY_AVX3
  if (r0 + 64 <= n && c0 + 32 <= k) {
    // Decode each row's 32 codes as 16 (even, odd) k pairs, then transpose the 64 x 16 pairs.
    alignas(64) uint32_t pairs[64][16];
    const Avx512Decoder decode(table);
    for (int64_t ni = 0; ni < 64; ++ni) {
      _mm512_store_si512(pairs[ni], decode(b + (r0 + ni) * k + c0));
    }
    uint32_t* out32 = reinterpret_cast<uint32_t*>(out);
    for (int64_t j = 0; j < 16; ++j) {
      for (int64_t ni = 0; ni < 64; ++ni) out32[j * 64 + ni] = pairs[ni][j];
    }
    return;
  }
#endif
  PackBlockScalar(b, k, 1, n, k, r0, c0, table, out);
}

// PackBlock from B given transposed: bt is K x N FP8 codes, row-major (B^T), so B(r, c) is
// bt[c * n + r]. Each (even, odd) k pair is two rows of bt, 64 n values apiece, decoded and
// interleaved: no transpose inside the block.
void PackBlockKxN(const uint8_t* bt, int64_t n, int64_t k, int64_t nb, int64_t kb, Fp8Format format,
                  uint16_t* out) {
  const Bf16Table& table = TableFor(format);
  const int64_t r0 = nb * 64, c0 = kb * 32;
#if HWY_ARCH_X86 && HWY_TARGET <= HWY_AVX3
  if (r0 + 64 <= n && c0 + 32 <= k) {
    const Avx512Decoder decode(table);
    // Word i of the result: lane i / 2 of `even` (i even) or of `odd` (i odd), from the first
    // (lo) or second (hi) half of the 32 lanes.
    alignas(64) uint16_t lo_index[32], hi_index[32];
    for (int i = 0; i < 32; ++i) {
      lo_index[i] = static_cast<uint16_t>(i / 2 + (i % 2) * 32);
      hi_index[i] = static_cast<uint16_t>(16 + i / 2 + (i % 2) * 32);
    }
    const __m512i lo = _mm512_load_si512(lo_index), hi = _mm512_load_si512(hi_index);
    for (int64_t j = 0; j < 16; ++j) {
      const uint8_t* even = bt + (c0 + 2 * j) * n + r0;
      const uint8_t* odd = even + n;
      uint16_t* row = out + j * 128;
      for (int64_t half = 0; half < 2; ++half) {  // n 0..31, then 32..63
        const __m512i e = decode(even + half * 32), o = decode(odd + half * 32);
        _mm512_storeu_si512(row + half * 64, _mm512_permutex2var_epi16(e, lo, o));
        _mm512_storeu_si512(row + half * 64 + 32, _mm512_permutex2var_epi16(e, hi, o));
      }
    }
    return;
  }
#endif
  PackBlockScalar(bt, 1, n, n, k, r0, c0, table, out);
}

// Packs the 64 (n) x 32 (k) block (nb, kb) of B (n x k, row-major: FP32 values when `f32`, else
// BF16 bits) into `out` as BF16 in oneDNN's AMX layout, as PackBlock does for FP8 codes. FP32 is
// rounded to nearest even (F32ToBf16Span, FloatToBf16's rounding). Rows and columns past the
// matrix are zero.
void PackBlockBf16(const void* b, bool f32, int64_t n, int64_t k, int64_t nb, int64_t kb,
                   uint16_t* out) {
  const int64_t r0 = nb * 64, c0 = kb * 32;
  const auto* bf = static_cast<const float*>(b);
  const auto* bh = static_cast<const uint16_t*>(b);
  if (r0 + 64 <= n && c0 + 32 <= k) {
    // Each row's 32 values as BF16, then its 16 (even, odd) k pairs transposed into place (the
    // 4-byte pairs moved with memcpy: no type punning).
    alignas(64) uint16_t rows[64][32];
    for (int64_t ni = 0; ni < 64; ++ni) {
      const int64_t at = (r0 + ni) * k + c0;
      if (f32) {
        F32ToBf16Span(bf + at, 32, rows[ni]);
      } else {
        std::memcpy(rows[ni], bh + at, sizeof(rows[ni]));
      }
    }
    for (int64_t j = 0; j < 16; ++j) {
      for (int64_t ni = 0; ni < 64; ++ni) std::memcpy(out + j * 128 + ni * 2, &rows[ni][2 * j], 4);
    }
    return;
  }
  for (int64_t ni = 0; ni < 64; ++ni) {
    const int64_t r = r0 + ni;
    for (int64_t kk = 0; kk < 32; ++kk) {
      const int64_t c = c0 + kk;
      uint16_t v = 0;
      if (r < n && c < k) v = f32 ? FloatToBf16(bf[r * k + c]) : bh[r * k + c];
      out[(kk / 2) * 128 + ni * 2 + (kk % 2)] = v;
    }
  }
}

}  // namespace HWY_NAMESPACE
}  // namespace fp8rt::kernels::cpu_internal
HWY_AFTER_NAMESPACE();

#if HWY_ONCE
#include "kernels/cpu/cpu_ops.h"

namespace fp8rt::kernels::cpu_internal {

HWY_EXPORT(DecodeSpan);
HWY_EXPORT(PackBlock);
HWY_EXPORT(PackBlockKxN);
HWY_EXPORT(PackBlockBf16);
HWY_EXPORT(F32ToBf16Span);
HWY_EXPORT(Bf16ToF32Span);

const std::array<uint16_t, 256>& Fp8ToBf16Table(Fp8Format format) { return TableFor(format).bits; }

void RoundToBf16(const float* in, int64_t n, uint16_t* out) {
  ConvertArgs args;
  args.from = InputType::kF32;
  args.to = InputType::kBF16;
  args.input = in;
  args.output = out;
  args.count = n;
  (void)ConvertCpu(args, Stream{});  // valid by construction
}

absl::Status ConvertCpu(const ConvertArgs& args, Stream) {
  if (absl::Status s = ValidateConvertArgs(args); !s.ok()) return s;
  const int64_t n = args.count;
  constexpr int64_t kChunk = int64_t{1} << 16;
  const int64_t chunks = (n + kChunk - 1) / kChunk;
  const size_t in_size = args.from == InputType::kF32 ? 4 : 2;
  const size_t out_size = args.to == InputType::kF32 ? 4 : 2;
#pragma omp parallel for schedule(static)
  for (int64_t c = 0; c < chunks; ++c) {
    const int64_t begin = c * kChunk, len = std::min(kChunk, n - begin);
    const auto* in =
        static_cast<const uint8_t*>(args.input) + begin * static_cast<int64_t>(in_size);
    auto* out = static_cast<uint8_t*>(args.output) + begin * static_cast<int64_t>(out_size);
    if (args.from == args.to) {
      std::memcpy(out, in, static_cast<size_t>(len) * in_size);
    } else if (args.from == InputType::kF32) {
      HWY_DYNAMIC_DISPATCH(F32ToBf16Span)
      (reinterpret_cast<const float*>(in), len, reinterpret_cast<uint16_t*>(out));
    } else {
      HWY_DYNAMIC_DISPATCH(Bf16ToF32Span)
      (reinterpret_cast<const uint16_t*>(in), len, reinterpret_cast<float*>(out));
    }
  }
  return absl::OkStatus();
}

void DecodeFp8ToBf16(const uint8_t* codes, int64_t n, Fp8Format format, uint16_t* out) {
  constexpr int64_t kChunk = int64_t{1} << 16;
  const int64_t chunks = (n + kChunk - 1) / kChunk;
#pragma omp parallel for schedule(static)
  for (int64_t c = 0; c < chunks; ++c) {
    const int64_t begin = c * kChunk;
    HWY_DYNAMIC_DISPATCH(DecodeSpan)
    (codes + begin, std::min(kChunk, n - begin), format, out + begin);
  }
}

namespace {

// pack(nb, kb, out) for every 64 n x 32 k block of the AMX layout (padded dims kp x np, outer
// block strides given), across the team; `out` is the block's place in dst.
template <class PackOne>
void ForEachAmxBlock(int64_t kp, int64_t np, int64_t k_block_stride, int64_t n_block_stride,
                     uint16_t* dst, const PackOne& pack) {
  const int64_t nblocks = np / 64, kblocks = kp / 32;
#pragma omp parallel for collapse(2) schedule(static)
  for (int64_t nb = 0; nb < nblocks; ++nb) {
    for (int64_t kb = 0; kb < kblocks; ++kb) {
      pack(nb, kb, dst + kb * k_block_stride + nb * n_block_stride);
    }
  }
}

}  // namespace

void PackFp8AmxLayout(const uint8_t* b, bool b_transposed, int64_t n, int64_t k, Fp8Format format,
                      int64_t kp, int64_t np, int64_t k_block_stride, int64_t n_block_stride,
                      uint16_t* dst) {
  ForEachAmxBlock(kp, np, k_block_stride, n_block_stride, dst,
                  [&](int64_t nb, int64_t kb, uint16_t* out) {
                    if (b_transposed) {
                      HWY_DYNAMIC_DISPATCH(PackBlockKxN)(b, n, k, nb, kb, format, out);
                    } else {
                      HWY_DYNAMIC_DISPATCH(PackBlock)(b, n, k, nb, kb, format, out);
                    }
                  });
}

void PackBf16AmxLayout(const void* b, bool f32, int64_t n, int64_t k, int64_t kp, int64_t np,
                       int64_t k_block_stride, int64_t n_block_stride, uint16_t* dst) {
  ForEachAmxBlock(kp, np, k_block_stride, n_block_stride, dst,
                  [&](int64_t nb, int64_t kb, uint16_t* out) {
                    HWY_DYNAMIC_DISPATCH(PackBlockBf16)(b, f32, n, k, nb, kb, out);
                  });
}

}  // namespace fp8rt::kernels::cpu_internal
#endif  // HWY_ONCE
