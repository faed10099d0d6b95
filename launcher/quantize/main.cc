// fp8rt-quantize (run as `fp8rt quantize`): what does FP8 do to my tensor?
// Exit codes: 0 done, 2 bad input or options (the message names the file or option).
#include <cstdio>
#include <iostream>
#include <optional>
#include <string>

#include "CLI/CLI.hpp"
#include "launcher/quantize/inspect.h"
#include "runtime/core/program.h"

int main(int argc, char** argv) {
  using namespace fp8rt;
  CLI::App app{"Quantize a tensor (.npy) to FP8 and report what FP8 did to it", "fp8rt quantize"};
  inspect::InspectOptions options;
  std::string format = "e4m3", granularity = "tensor";
  float scale = 0.0f;
  bool json = false;
  app.add_option("input", options.input, "input .npy (float32/float64, 1-D or 2-D, C order)")
      ->required();
  app.add_option("--format", format, "e4m3 (default) or e5m2");
  app.add_option("--granularity", granularity, "tensor (default), row, 1x128, 128x128 or mx32");
  auto* scale_opt = app.add_option("--scale", scale, "fixed scale (tensor granularity)");
  app.add_option("--margin", options.margin, "computed scales are fp8_max / amax / 2^margin");
  app.add_option("--out", options.out_path, "write the dequantized values (float32 .npy)");
  app.add_option("--codes", options.codes_path, "write the FP8 codes (uint8 .npy)");
  app.add_flag("--json", json, "print one JSON object instead of the report");
  if (std::optional<int> exit_code = fp8rt::ParseCommandLine(app, argc, argv)) return *exit_code;
  auto fail = [](const std::string& message) {
    std::fprintf(stderr, "fp8rt quantize: %s\n", message.c_str());
    return 2;
  };
  auto parsed_format = kernels::ParseFp8Format(format);
  if (!parsed_format.ok())
    return fail("--format: " + std::string(parsed_format.status().message()));
  auto parsed_granularity = kernels::ParseGranularity(granularity);
  if (!parsed_granularity.ok()) {
    return fail("--granularity: " + std::string(parsed_granularity.status().message()));
  }
  options.format = *parsed_format;
  options.granularity = *parsed_granularity;
  if (scale_opt->count() > 0) options.scale = scale;

  auto report = inspect::Inspect(options);
  if (!report.ok()) return fail(std::string(report.status().message()));
  if (json) {
    std::cout << report->dump() << "\n";
  } else {
    std::cout << inspect::FormatReport(*report);
  }
  return 0;
}
