// Backend-independent parts of quantization: names, scale grids, scale formulas, validation.
#include <cfloat>
#include <cmath>

#include "absl/strings/str_cat.h"
#include "kernels/quantize.h"

namespace fp8rt::kernels {

std::string_view GranularityName(Granularity granularity) {
  switch (granularity) {
    case Granularity::kTensor:
      return "tensor";
    case Granularity::kRow:
      return "row";
    case Granularity::kTile1x128:
      return "1x128";
    case Granularity::kBlock128x128:
      return "128x128";
    case Granularity::kMx32:
      return "mx32";
  }
  return "?";
}

absl::StatusOr<Granularity> ParseGranularity(std::string_view name) {
  for (Granularity g : {Granularity::kTensor, Granularity::kRow, Granularity::kTile1x128,
                        Granularity::kBlock128x128, Granularity::kMx32}) {
    if (name == GranularityName(g)) return g;
  }
  return absl::InvalidArgumentError(
      absl::StrCat("unknown granularity '", std::string(name),
                   "' (expected tensor, row, 1x128, 128x128 or mx32)"));
}

ScaleGrid GetScaleGrid(Granularity granularity, int64_t rows, int64_t cols) {
  auto ceil_div = [](int64_t a, int64_t b) { return (a + b - 1) / b; };
  ScaleGrid grid;
  switch (granularity) {
    case Granularity::kTensor:
      grid.block_rows = rows;
      grid.block_cols = cols;
      grid.rows = 1;
      grid.cols = 1;
      return grid;
    case Granularity::kRow:
      grid.block_rows = 1;
      grid.block_cols = cols;
      grid.rows = rows;
      grid.cols = 1;
      return grid;
    case Granularity::kTile1x128:
      grid.block_rows = 1;
      grid.block_cols = 128;
      break;
    case Granularity::kBlock128x128:
      grid.block_rows = 128;
      grid.block_cols = 128;
      break;
    case Granularity::kMx32:
      grid.block_rows = 1;
      grid.block_cols = 32;
      break;
  }
  grid.rows = ceil_div(rows, grid.block_rows);
  grid.cols = ceil_div(cols, grid.block_cols);
  return grid;
}

void QuantStats::Merge(const QuantStats& other) {
  if (std::isnan(other.amax) || other.amax > amax) amax = other.amax;
  count += other.count;
  underflow += other.underflow;
  subnormal += other.subnormal;
  saturated += other.saturated;
  nonfinite += other.nonfinite;
}

float ComputeScale(float amax, Fp8Format format, int margin, bool power_of_two) {
  if (!(amax > 0.0f) || !std::isfinite(amax)) return 1.0f;
  float scale = GetFp8Info(format).max / amax;
  scale = scale / std::exp2(static_cast<float>(margin));
  if (!std::isfinite(scale)) scale = FLT_MAX;
  if (scale < FLT_MIN) scale = FLT_MIN;
  if (power_of_two) {
    int exponent = 0;
    std::frexp(scale, &exponent);  // scale = f * 2^exponent with f in [0.5, 1)
    scale = std::ldexp(1.0f, exponent - 1);
  }
  return scale;
}

int Mx32ScaleExponent(float amax, Fp8Format format) {
  if (!(amax > 0.0f) || !std::isfinite(amax)) return -127;
  int exponent = 0;
  std::frexp(amax, &exponent);  // floor(log2(amax)) == exponent - 1, exact for subnormals too
  int shared = exponent - 1 - GetFp8Info(format).emax;
  if (shared < -127) shared = -127;
  if (shared > 127) shared = 127;
  return shared;
}

namespace {

absl::Status ValidateShape(int64_t rows, int64_t cols) {
  if (rows < 0) return absl::InvalidArgumentError(absl::StrCat("rows must be >= 0, got ", rows));
  if (cols < 0) return absl::InvalidArgumentError(absl::StrCat("cols must be >= 0, got ", cols));
  return absl::OkStatus();
}

}  // namespace

absl::Status ValidateQuantizeArgs(const QuantizeArgs& args) {
  if (absl::Status s = ValidateShape(args.rows, args.cols); !s.ok()) return s;
  const bool empty = args.rows == 0 || args.cols == 0;
  if (!empty && args.input == nullptr) return absl::InvalidArgumentError("input is null");
  if (!empty && args.codes == nullptr) return absl::InvalidArgumentError("codes is null");
  if (args.granularity == Granularity::kMx32) {
    if (args.e8m0_scales == nullptr && !empty) {
      return absl::InvalidArgumentError("e8m0_scales is null (mx32 needs one E8M0 per 1x32 block)");
    }
    if (args.has_scale) {
      return absl::InvalidArgumentError(
          "scale: a fixed scale is only valid with granularity tensor");
    }
  } else {
    if (args.scale_inv == nullptr) return absl::InvalidArgumentError("scale_inv is null");
    if (args.has_scale && args.granularity != Granularity::kTensor) {
      return absl::InvalidArgumentError(
          absl::StrCat("scale: a fixed scale is only valid with granularity tensor, not ",
                       std::string(GranularityName(args.granularity))));
    }
  }
  if (args.scale_amax != nullptr && (args.has_scale || args.granularity != Granularity::kTensor)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "scale_amax: a scale from a given amax is only valid with granularity tensor and no "
        "fixed scale (granularity ",
        std::string(GranularityName(args.granularity)), ", has_scale ", args.has_scale, ")"));
  }
  if (args.has_scale && !(std::isfinite(args.scale) && args.scale > 0.0f)) {
    return absl::InvalidArgumentError(
        absl::StrCat("scale must be finite and > 0, got ", args.scale));
  }
  if (args.margin < 0 || args.margin > 64) {
    return absl::InvalidArgumentError(absl::StrCat("margin must be in [0, 64], got ", args.margin));
  }
  return absl::OkStatus();
}

absl::Status ValidateAmaxArgs(const AmaxArgs& args) {
  if (args.count < 0)
    return absl::InvalidArgumentError(absl::StrCat("count must be >= 0, got ", args.count));
  if (args.count > 0 && args.input == nullptr) return absl::InvalidArgumentError("input is null");
  if (args.amax == nullptr) return absl::InvalidArgumentError("amax is null");
  return absl::OkStatus();
}

absl::Status ValidateConvertArgs(const ConvertArgs& args) {
  if (args.count < 0) {
    return absl::InvalidArgumentError(absl::StrCat("count must be >= 0, got ", args.count));
  }
  if (args.count > 0 && args.input == nullptr) return absl::InvalidArgumentError("input is null");
  if (args.count > 0 && args.output == nullptr) return absl::InvalidArgumentError("output is null");
  return absl::OkStatus();
}

absl::Status ValidateDequantizeArgs(const DequantizeArgs& args) {
  if (absl::Status s = ValidateShape(args.rows, args.cols); !s.ok()) return s;
  if (args.rows == 0 || args.cols == 0) return absl::OkStatus();
  if (args.codes == nullptr) return absl::InvalidArgumentError("codes is null");
  if (args.output == nullptr) return absl::InvalidArgumentError("output is null");
  if (args.granularity == Granularity::kMx32) {
    if (args.e8m0_scales == nullptr) return absl::InvalidArgumentError("e8m0_scales is null");
  } else if (args.scale_inv == nullptr) {
    return absl::InvalidArgumentError("scale_inv is null");
  }
  return absl::OkStatus();
}

}  // namespace fp8rt::kernels
