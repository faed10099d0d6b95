// Fuzz target: Hugging Face weights and config.json (runtime/model/hf_weights.h), what `init.from`,
// `eval --weights` and `generate --weights` read from files fp8rt did not write: FromHuggingFace
// (tensor names with layer and expert numbers, shapes, dtypes, buffers, the base classes' names)
// over a safetensors file, and CheckHfConfig over a config.json.
//
// Input: a selector byte, then the file. Selector bits 0-1 pick the model: a GPT-2, a Llama, the
// Llama with tied embeddings, a Mixtral of 2 experts (tiny: 1 block, d_model 4, 2 heads, d_ff 4,
// vocab 4, so that a whole checkpoint fits libFuzzer's 4096-byte inputs); bit 2 picks the file:
// 0 the weights (model.safetensors), 1 config.json.
//
// Checks besides "no crash, no exception": a refused file is InvalidArgument with a bounded
// message naming the file (config.json: starting with its path); accepted weights give every
// parameter of the model with rows x cols values.
#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "absl/strings/match.h"
#include "runtime/core/safetensors.h"
#include "runtime/model/hf_weights.h"
#include "tests/fuzz/fuzz_support.h"
#include "tests/support/hf_test_shapes.h"  // HfParamShapes

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace fp8rt;
  if (size == 0) return 0;
  const model::ModelShape shape = fuzz::HfFuzzShape(data[0] & 3);
  const bool config = (data[0] & 4) != 0;
  const std::string_view text(reinterpret_cast<const char*>(data + 1), size - 1);
  if (config) {
    static const std::string kPath = "fuzz/config.json";
    const absl::Status s = model::CheckHfConfig(shape, text, kPath);
    if (s.ok()) return 0;
    FUZZ_CHECK(absl::IsInvalidArgument(s), "config: not InvalidArgument: %s", s.ToString().c_str());
    FUZZ_CHECK(absl::StartsWith(s.message(), kPath + ": "),
               "config: error does not start with the path: %s", s.ToString().c_str());
    FUZZ_CHECK(s.message().size() < 1024, "config: unbounded error of %zu bytes",
               s.message().size());
    return 0;
  }
  static const std::string kName = "fuzz.safetensors";
  absl::StatusOr<SafetensorsFile> file =
      SafetensorsFile::Parse(fuzz::ToBytes(data + 1, size - 1), kName);
  if (!file.ok()) return 0;  // safetensors_fuzzer's part
  const auto shapes = test::HfParamShapes(shape);
  const absl::StatusOr<model::LogicalParams> params =
      model::FromHuggingFace(shape, shapes, SafetensorsSet::Of(*std::move(file)));
  if (!params.ok()) {
    const absl::Status& s = params.status();
    FUZZ_CHECK(absl::IsInvalidArgument(s), "weights: not InvalidArgument: %s",
               s.ToString().c_str());
    FUZZ_CHECK(absl::StrContains(s.message(), kName), "weights: error does not name the file: %s",
               s.ToString().c_str());
    FUZZ_CHECK(s.message().size() < 1024, "weights: unbounded error of %zu bytes",
               s.message().size());
    return 0;
  }
  FUZZ_CHECK(params->size() == shapes.size(), "%zu parameters for a model of %zu", params->size(),
             shapes.size());
  for (const auto& [name, s] : shapes) {
    const auto p = params->find(name);
    FUZZ_CHECK(p != params->end(), "parameter %s missing", name.c_str());
    FUZZ_CHECK(p->second.size() == static_cast<size_t>(s.rows * s.cols),
               "%s: %zu values for [%lld, %lld]", name.c_str(), p->second.size(),
               static_cast<long long>(s.rows), static_cast<long long>(s.cols));
  }
  return 0;
}
