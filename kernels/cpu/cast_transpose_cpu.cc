// CPU cast-transpose: FP8 codes of a matrix and of its transpose in one pass over the input,
// with the statistics of a tensor-scaled quantize. Also the argument validation both backends
// share (ValidateCastTransposeArgs).
//
// Deliberately plain: 64 x 64 tiles of the input, each value encoded once with the scalar
// encoder (internal::EncodeFp8Bits, the same bit operations as every other fp8rt quantize) and
// written to both outputs; OpenMP over tiles. The tile keeps the transposed writes within a few
// cache lines. tests/unit/cast_transpose_test.cc checks it against the SIMD quantize followed by
// an explicit transpose.
#include <omp.h>

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdint>
#include <limits>

#include "absl/strings/str_cat.h"
#include "kernels/cpu/cpu_ops.h"
#include "kernels/fp8_encode.h"

namespace fp8rt::kernels {

absl::Status ValidateCastTransposeArgs(const CastTransposeArgs& args) {
  if (args.rows < 0) {
    return absl::InvalidArgumentError(absl::StrCat("rows must be >= 0, got ", args.rows));
  }
  if (args.cols < 0) {
    return absl::InvalidArgumentError(absl::StrCat("cols must be >= 0, got ", args.cols));
  }
  if (!(std::isfinite(args.scale) && args.scale > 0.0f)) {
    return absl::InvalidArgumentError(
        absl::StrCat("scale must be finite and > 0, got ", args.scale));
  }
  if (args.scale_inv == nullptr) return absl::InvalidArgumentError("scale_inv is null");
  if (args.rows == 0 || args.cols == 0) return absl::OkStatus();
  if (args.input == nullptr) return absl::InvalidArgumentError("input is null");
  if (args.codes == nullptr) return absl::InvalidArgumentError("codes is null");
  if (args.codes_t == nullptr) return absl::InvalidArgumentError("codes_t is null");
  return absl::OkStatus();
}

namespace cpu_internal {
namespace {

constexpr int64_t kTile = 64;

// Per-thread statistics; amax as |x| bits (NaN > Inf > finite), as in quantize_cpu.cc.
struct TileStats {
  uint32_t amax_bits = 0;
  int64_t underflow = 0;
  int64_t subnormal = 0;
  int64_t saturated = 0;
  int64_t nonfinite = 0;
};

template <Fp8Format F, class In>
void CastTransposeT(const CastTransposeArgs& args, TileStats* total) {
  using B = internal::Fp8Bits<F>;
  const In* in = static_cast<const In*>(args.input);
  const int64_t rows = args.rows, cols = args.cols;
  const int64_t tile_rows = (rows + kTile - 1) / kTile, tile_cols = (cols + kTile - 1) / kTile;
  const float scale = args.scale;
#pragma omp parallel
  {
    TileStats s;
#pragma omp for schedule(static) collapse(2)
    for (int64_t tr = 0; tr < tile_rows; ++tr) {
      for (int64_t tc = 0; tc < tile_cols; ++tc) {
        const int64_t r1 = std::min(rows, (tr + 1) * kTile), c1 = std::min(cols, (tc + 1) * kTile);
        for (int64_t r = tr * kTile; r < r1; ++r) {
          for (int64_t c = tc * kTile; c < c1; ++c) {
            float x;
            if constexpr (std::is_same_v<In, float>) {
              x = in[r * cols + c];
            } else {
              x = Bf16ToFloat(in[r * cols + c]);
            }
            const uint32_t ain = std::bit_cast<uint32_t>(x) & 0x7FFFFFFFu;
            const float y = x * scale;
            const uint8_t code = internal::EncodeFp8Bits<F>(y);
            const bool finite = ain < 0x7F800000u;
            const uint32_t mag = code & 0x7Fu;
            s.amax_bits = std::max(s.amax_bits, ain);
            s.nonfinite += !finite;
            s.underflow += finite && ain != 0 && mag == 0;
            s.subnormal += mag != 0 && mag < (1u << B::kMantissaBits);
            s.saturated += finite && (std::bit_cast<uint32_t>(y) & 0x7FFFFFFFu) > B::kOverflowAbove;
            args.codes[r * cols + c] = code;
            args.codes_t[c * rows + r] = code;
          }
        }
      }
    }
#pragma omp critical
    {
      total->amax_bits = std::max(total->amax_bits, s.amax_bits);
      total->underflow += s.underflow;
      total->subnormal += s.subnormal;
      total->saturated += s.saturated;
      total->nonfinite += s.nonfinite;
    }
  }
}

}  // namespace

absl::Status CastTransposeCpu(const CastTransposeArgs& args, Stream) {
  if (absl::Status s = ValidateCastTransposeArgs(args); !s.ok()) return s;
  TileStats total;
  if (args.rows > 0 && args.cols > 0) {
    const bool f32 = args.input_type == InputType::kF32;
    if (args.format == Fp8Format::kE4M3) {
      f32 ? CastTransposeT<Fp8Format::kE4M3, float>(args, &total)
          : CastTransposeT<Fp8Format::kE4M3, uint16_t>(args, &total);
    } else {
      f32 ? CastTransposeT<Fp8Format::kE5M2, float>(args, &total)
          : CastTransposeT<Fp8Format::kE5M2, uint16_t>(args, &total);
    }
  }
  args.scale_inv[0] = 1.0f / args.scale;
  if (args.stats != nullptr) {
    QuantStats q;
    q.amax = total.amax_bits > 0x7F800000u ? std::numeric_limits<float>::quiet_NaN()
                                           : std::bit_cast<float>(total.amax_bits);
    q.count = args.rows * args.cols;
    q.underflow = total.underflow;
    q.subnormal = total.subnormal;
    q.saturated = total.saturated;
    q.nonfinite = total.nonfinite;
    *args.stats = q;
  }
  return absl::OkStatus();
}

}  // namespace cpu_internal
}  // namespace fp8rt::kernels
