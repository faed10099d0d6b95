#include "launcher/quantize/inspect.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "kernels/ops.h"
#include "runtime/core/npy.h"
#include "runtime/core/status.h"

namespace fp8rt::inspect {
namespace {

using kernels::Granularity;

// min / max / geometric mean of the multiplicative scales (fp8 = x * scale).
nlohmann::ordered_json ScaleSummary(const std::vector<float>& scales) {
  double log_sum = 0.0;
  float lo = scales.empty() ? 0.0f : scales[0], hi = lo;
  for (float s : scales) {
    lo = std::min(lo, s);
    hi = std::max(hi, s);
    log_sum += std::log2(static_cast<double>(s));
  }
  nlohmann::ordered_json j;
  j["count"] = scales.size();
  j["min"] = lo;
  j["max"] = hi;
  j["geomean"] = scales.empty() ? 0.0 : std::exp2(log_sum / static_cast<double>(scales.size()));
  return j;
}

double Ratio(int64_t part, int64_t whole) {
  return whole == 0 ? 0.0 : static_cast<double>(part) / static_cast<double>(whole);
}

}  // namespace

absl::StatusOr<nlohmann::ordered_json> Inspect(const InspectOptions& options) {
  if (options.scale.has_value()) {
    const float s = *options.scale;
    if (!(std::isfinite(s) && s > 0.0f)) {
      return absl::InvalidArgumentError(absl::StrCat("--scale must be finite and > 0, got ", s));
    }
    if (options.granularity != Granularity::kTensor) {
      return absl::InvalidArgumentError(
          absl::StrCat("--scale is a single tensor scale: it needs --granularity tensor, not ",
                       std::string(kernels::GranularityName(options.granularity))));
    }
  }
  if (options.margin < 0 || options.margin > 64) {
    return absl::InvalidArgumentError(
        absl::StrCat("--margin must be in [0, 64], got ", options.margin));
  }
  FP8RT_ASSIGN_OR_RETURN(FloatMatrix m, ReadNpyAsFloatMatrix(options.input));
  const int64_t n = m.rows * m.cols;
  const kernels::ScaleGrid grid = kernels::GetScaleGrid(options.granularity, m.rows, m.cols);
  std::vector<uint8_t> codes(static_cast<size_t>(n));
  std::vector<float> scale_inv(static_cast<size_t>(grid.size()));
  std::vector<uint8_t> e8m0(static_cast<size_t>(grid.size()));
  kernels::QuantStats stats;

  kernels::QuantizeArgs q;
  q.format = options.format;
  q.granularity = options.granularity;
  q.input = m.values.data();
  q.rows = m.rows;
  q.cols = m.cols;
  q.has_scale = options.scale.has_value();
  q.scale = options.scale.value_or(1.0f);
  q.margin = options.margin;
  q.codes = codes.data();
  q.scale_inv = scale_inv.data();
  q.e8m0_scales = e8m0.data();
  q.stats = &stats;
  const kernels::OpTable& ops = kernels::CpuOps();
  FP8RT_RETURN_IF_ERROR(ops.quantize(q, {}));

  std::vector<float> deq(static_cast<size_t>(n));
  kernels::DequantizeArgs d;
  d.format = options.format;
  d.granularity = options.granularity;
  d.codes = codes.data();
  d.rows = m.rows;
  d.cols = m.cols;
  d.scale_inv = scale_inv.data();
  d.e8m0_scales = e8m0.data();
  d.output = deq.data();
  FP8RT_RETURN_IF_ERROR(ops.dequantize(d, {}));

  // Error over finite inputs (non-finite ones are counted separately).
  double err2 = 0.0, ref2 = 0.0, max_abs_err = 0.0;
  for (int64_t i = 0; i < n; ++i) {
    const double x = m.values[static_cast<size_t>(i)];
    if (!std::isfinite(x)) continue;
    const double e = static_cast<double>(deq[static_cast<size_t>(i)]) - x;
    err2 += e * e;
    ref2 += x * x;
    max_abs_err = std::max(max_abs_err, std::fabs(e));
  }

  std::vector<float> scales(static_cast<size_t>(grid.size()));
  for (size_t i = 0; i < scales.size(); ++i) {
    scales[i] = options.granularity == Granularity::kMx32 ? 1.0f / kernels::DecodeE8M0(e8m0[i])
                                                          : 1.0f / scale_inv[i];
  }

  nlohmann::ordered_json r;
  r["input"] = options.input;
  r["shape"] = m.rank == 1 ? nlohmann::ordered_json::array({m.cols})
                           : nlohmann::ordered_json::array({m.rows, m.cols});
  r["format"] = std::string(kernels::Fp8FormatName(options.format));
  r["granularity"] = std::string(kernels::GranularityName(options.granularity));
  r["count"] = n;
  r["amax"] = std::isnan(stats.amax)   ? nlohmann::ordered_json("nan")
              : std::isinf(stats.amax) ? nlohmann::ordered_json("inf")
                                       : nlohmann::ordered_json(stats.amax);
  if (options.granularity == Granularity::kTensor) {
    r["scale"] = scales[0];
    r["scale_inv"] = scale_inv[0];
  } else {
    r["scale"] = ScaleSummary(scales);
  }
  r["rel_rms_error"] = ref2 > 0.0 ? std::sqrt(err2 / ref2) : 0.0;
  r["max_abs_error"] = max_abs_err;
  r["underflow"] = stats.underflow;
  r["underflow_ratio"] = Ratio(stats.underflow, n);
  r["subnormal"] = stats.subnormal;
  r["subnormal_ratio"] = Ratio(stats.subnormal, n);
  r["saturated"] = stats.saturated;
  r["saturated_ratio"] = Ratio(stats.saturated, n);
  r["nonfinite"] = stats.nonfinite;

  const std::vector<int64_t> shape =
      m.rank == 1 ? std::vector<int64_t>{m.cols} : std::vector<int64_t>{m.rows, m.cols};
  if (!options.out_path.empty()) {
    FP8RT_RETURN_IF_ERROR(WriteNpy(options.out_path, NpyDtype::kF32, shape, deq.data()));
    r["out"] = options.out_path;
  }
  if (!options.codes_path.empty()) {
    FP8RT_RETURN_IF_ERROR(WriteNpy(options.codes_path, NpyDtype::kU8, shape, codes.data()));
    r["codes"] = options.codes_path;
  }
  return r;
}

std::string FormatReport(const nlohmann::ordered_json& r) {
  auto num = [](const nlohmann::ordered_json& v) {
    return v.is_number() ? absl::StrFormat("%.6g", v.get<double>()) : v.get<std::string>();
  };
  auto pct = [](const nlohmann::ordered_json& v) {
    return absl::StrFormat("%.4g%%", 100.0 * v.get<double>());
  };
  std::string shape;
  for (const auto& d : r["shape"])
    shape += (shape.empty() ? "" : " x ") + std::to_string(d.get<int64_t>());
  std::string out = absl::StrFormat(
      "%s: %s values (%s) -> %s, granularity %s\n", r["input"].get<std::string>(), num(r["count"]),
      shape, r["format"].get<std::string>(), r["granularity"].get<std::string>());
  absl::StrAppendFormat(&out, "  amax               %s\n", num(r["amax"]));
  if (r["scale"].is_object()) {
    const auto& s = r["scale"];
    absl::StrAppendFormat(&out, "  scales             %s blocks: min %s, geomean %s, max %s\n",
                          num(s["count"]), num(s["min"]), num(s["geomean"]), num(s["max"]));
  } else {
    absl::StrAppendFormat(&out, "  scale              %s (dequantize with scale_inv %s)\n",
                          num(r["scale"]), num(r["scale_inv"]));
  }
  absl::StrAppendFormat(&out, "  rel. RMS error     %s\n", pct(r["rel_rms_error"]));
  absl::StrAppendFormat(&out, "  max abs. error     %s\n", num(r["max_abs_error"]));
  absl::StrAppendFormat(&out, "  underflow          %s values became zero (%s of all)\n",
                        num(r["underflow"]), pct(r["underflow_ratio"]));
  absl::StrAppendFormat(&out, "  subnormal outputs  %s (%s)\n", num(r["subnormal"]),
                        pct(r["subnormal_ratio"]));
  absl::StrAppendFormat(&out, "  saturated          %s values clipped to +-max (%s)\n",
                        num(r["saturated"]), pct(r["saturated_ratio"]));
  absl::StrAppendFormat(&out, "  non-finite inputs  %s\n", num(r["nonfinite"]));
  if (r.contains("out"))
    absl::StrAppendFormat(&out, "  wrote dequantized  %s\n", r["out"].get<std::string>());
  if (r.contains("codes"))
    absl::StrAppendFormat(&out, "  wrote FP8 codes    %s\n", r["codes"].get<std::string>());
  return out;
}

}  // namespace fp8rt::inspect
