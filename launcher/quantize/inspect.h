// The FP8 inspector behind `fp8rt quantize`: quantizes a tensor read from a .npy file with a
// chosen format and granularity and reports what FP8 did to it (error, underflow, saturation).
// Stateless; each call reads its input and writes only the outputs it is asked for.
#ifndef FP8RT_LAUNCHER_QUANTIZE_INSPECT_H_
#define FP8RT_LAUNCHER_QUANTIZE_INSPECT_H_

#include <optional>
#include <string>

#include "absl/status/statusor.h"
#include "kernels/quantize.h"
#include "nlohmann/json.hpp"

namespace fp8rt::inspect {

struct InspectOptions {
  std::string input;  // .npy, float32/float64, 1-D or 2-D
  kernels::Fp8Format format = kernels::Fp8Format::kE4M3;
  kernels::Granularity granularity = kernels::Granularity::kTensor;
  std::optional<float> scale;  // fixed scale (tensor granularity only)
  int margin = 0;              // computed scales: fp8_max / amax / 2^margin
  std::string out_path;        // optional: dequantized float32 .npy, same shape
  std::string codes_path;      // optional: FP8 codes as uint8 .npy, same shape
};

// Runs the inspection; the report is the JSON object that --json prints. Errors name the file
// or the option that is wrong.
absl::StatusOr<nlohmann::ordered_json> Inspect(const InspectOptions& options);

// The human-readable form of a report.
std::string FormatReport(const nlohmann::ordered_json& report);

}  // namespace fp8rt::inspect

#endif  // FP8RT_LAUNCHER_QUANTIZE_INSPECT_H_
