// Quantization of FP32/BF16 matrices to FP8, with scales and FP8 health statistics.
//
// Index:
//   Granularity, GetScaleGrid   how scales tile a rows x cols matrix
//   QuantStats                  amax and counts gathered in the same pass as the quantization
//   ComputeScale                scale = fp8_max / amax / 2^margin (optionally a power of two)
//   QuantizeArgs, DequantizeArgs
//
// Semantics (DESIGN.md section 3): code = EncodeFp8(x * scale) with x * scale computed in FP32;
// the dequantized value is DecodeFp8(code) * scale_inv. Scales are kept as `scale_inv` (what a
// GEMM multiplies by), except mx32 whose scales are E8M0 codes (OCP MX v1.0).
//
// Scale per block when the kernel computes it ("current" scaling): from the amax of the finite
// values of the block; an all-zero (or all non-finite) block gets scale 1. Non-finite values are
// encoded as EncodeFp8 does (Inf -> +-max, NaN -> NaN) and counted. The reported
// QuantStats::amax, in contrast, is the plain max |x| over the input and is NaN when any input is
// NaN, so that an amax reduction across ranks sees the poison.
//
// The functions that run these live in the backend op tables (kernels/ops.h); they take
// caller-provided buffers and never allocate.
#ifndef FP8RT_KERNELS_QUANTIZE_H_
#define FP8RT_KERNELS_QUANTIZE_H_

#include <cstdint>
#include <string_view>

#include "absl/status/statusor.h"
#include "kernels/formats.h"

namespace fp8rt::kernels {

// How many values share one scale.
enum class Granularity : uint8_t {
  kTensor,        // one scale for the whole matrix
  kRow,           // one scale per row
  kTile1x128,     // one scale per 1x128 tile of a row (activations, gradients; DeepSeek-V3)
  kBlock128x128,  // one scale per 128x128 block (weights; DeepSeek-V3)
  kMx32,          // one E8M0 scale per 1x32 block (OCP MX v1.0)
};
inline constexpr int64_t kMx32BlockSize = 32;  // values per mx32 block

// "tensor", "row", "1x128", "128x128", "mx32".
std::string_view GranularityName(Granularity granularity);
absl::StatusOr<Granularity> ParseGranularity(std::string_view name);

// The grid of scales over a rows x cols matrix: scale (i, j) covers rows
// [i*block_rows, min((i+1)*block_rows, rows)) and the matching columns. Partial blocks at the
// right and bottom edges are allowed.
struct ScaleGrid {
  int64_t rows = 0;        // number of scale rows
  int64_t cols = 0;        // number of scale columns
  int64_t block_rows = 0;  // matrix rows covered by one scale
  int64_t block_cols = 0;  // matrix columns covered by one scale
  int64_t size() const { return rows * cols; }
};
ScaleGrid GetScaleGrid(Granularity granularity, int64_t rows, int64_t cols);

// What one quantization did to its input. Counts are over all rows * cols values.
struct QuantStats {
  float amax = 0.0f;      // max |x| of the input; NaN if any input is NaN
  int64_t count = 0;      // values quantized
  int64_t underflow = 0;  // finite nonzero inputs whose FP8 code is +-0
  int64_t subnormal = 0;  // outputs that are FP8 subnormals (exponent field 0, mantissa != 0)
  int64_t saturated = 0;  // finite inputs whose x * scale rounds past the largest finite
                          // FP8 value (|y| > 464 for E4M3, >= 61440 for E5M2, or an FP32
                          // product that overflowed): clamped to +-max
  int64_t nonfinite = 0;  // inputs that are +-Inf or NaN

  // Combines the statistics of two disjoint parts of one tensor (NaN amax wins).
  void Merge(const QuantStats& other);
};

// scale = fp8_max / amax / 2^margin in FP32 for a finite amax > 0. An overflowing quotient (tiny
// amax) gives FLT_MAX, an underflowing one FLT_MIN, so the scale is always finite and positive.
// With power_of_two the scale is rounded down to a power of two (never overflows max). Returns
// 1 for an amax that is zero or not finite; callers that keep a previous scale check first.
float ComputeScale(float amax, Fp8Format format, int margin, bool power_of_two);

// The E8M0 exponent of an mx32 block with the given finite amax: floor(log2(amax)) - emax of the
// element format, clamped to [-127, 127] (OCP MX v1.0 section 6.3); -127 for amax 0.
int Mx32ScaleExponent(float amax, Fp8Format format);

enum class InputType : uint8_t { kF32, kBF16 };

struct QuantizeArgs {
  Fp8Format format = Fp8Format::kE4M3;
  Granularity granularity = Granularity::kTensor;
  InputType input_type = InputType::kF32;
  const void* input = nullptr;  // rows x cols, row-major (float or BF16 bits)
  int64_t rows = 0;
  int64_t cols = 0;
  // kTensor only: quantize with this scale in one pass (delayed scaling, or a fixed scale)
  // instead of computing it from this tensor's amax (two passes).
  bool has_scale = false;
  float scale = 1.0f;
  // kTensor without has_scale: the scale is ComputeScale(*scale_amax) (one float in the backend's
  // memory, read by the op, never by the host) instead of ComputeScale of this tensor's finite
  // amax. For an amax agreed across ranks on the device (current scaling over TP): the amax op,
  // an i32 max all-reduce of its bits, then this quantization, with no host round trip. As
  // ComputeScale, a value that is zero, negative, infinite or NaN gives scale 1.
  const float* scale_amax = nullptr;
  int margin = 0;                    // for computed scales: fp8_max / amax / 2^margin
  bool power_of_two_scales = false;  // for computed scales (mx32 scales always are)

  uint8_t* codes = nullptr;        // out: rows x cols FP8 codes
  float* scale_inv = nullptr;      // out: GetScaleGrid().size() values; unused for mx32
  uint8_t* e8m0_scales = nullptr;  // out: GetScaleGrid().size() E8M0 codes; mx32 only
  QuantStats* stats = nullptr;     // out, optional
};

struct DequantizeArgs {
  Fp8Format format = Fp8Format::kE4M3;
  Granularity granularity = Granularity::kTensor;
  const uint8_t* codes = nullptr;  // rows x cols
  int64_t rows = 0;
  int64_t cols = 0;
  const float* scale_inv = nullptr;      // all granularities but mx32
  const uint8_t* e8m0_scales = nullptr;  // mx32
  float* output = nullptr;               // out: rows x cols
};

// Max |x| over a buffer, NaN if any value is NaN (the plain amax of QuantStats), and the max
// over the finite values. For the amax of a tensor that must be synchronised before it is
// quantized (current scaling across ranks).
struct AmaxArgs {
  InputType input_type = InputType::kF32;
  const void* input = nullptr;
  int64_t count = 0;
  float* amax = nullptr;         // out
  float* finite_amax = nullptr;  // out, optional
};

// Element-wise FP32 <-> BF16: FP32 -> BF16 rounds to nearest even (NaN stays NaN), BF16 -> FP32
// is exact; the same type copies. At memory speed, for the BF16 paths of the collectives and the
// bf16 precision mode.
struct ConvertArgs {
  InputType from = InputType::kF32;
  InputType to = InputType::kBF16;
  const void* input = nullptr;
  void* output = nullptr;
  int64_t count = 0;
};

// Checks shapes and pointers; the backends call it first. Errors name the field.
absl::Status ValidateAmaxArgs(const AmaxArgs& args);
absl::Status ValidateConvertArgs(const ConvertArgs& args);
absl::Status ValidateQuantizeArgs(const QuantizeArgs& args);
absl::Status ValidateDequantizeArgs(const DequantizeArgs& args);

}  // namespace fp8rt::kernels

#endif  // FP8RT_KERNELS_QUANTIZE_H_
