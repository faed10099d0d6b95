// fp8rt-model (run as `fp8rt export`, `fp8rt eval` and `fp8rt generate`): a trained model on one
// CPU process.
//   export RUN_DIR [--step N] --out DIR [--dtype f32|bf16]
//       DIR/model.safetensors and DIR/config.json in Hugging Face's GPT-2 / Llama layout, from a
//       checkpoint written at any layout (runtime/worker/weights.h)
//   eval (--run-dir DIR [--step N] | --weights W --spec S) [--spec S]
//        [--data F --format text|u16|u32|llmc] [--batches N] [--json]
//       the mean loss over non-overlapping windows of seq_len + 1 tokens, in file order
//   generate (--run-dir DIR [--step N] | --weights F --spec S) --prompt TEXT --tokens N
//            [--temperature T] [--top-k K] [--seed S]
//       samples a byte-level model (data.format text); the same seed gives the same text
// W: Hugging Face weights: a safetensors file, an index of shards (model.safetensors.index.json)
// or a folder holding either (SafetensorsSet::Open). A checkpoint is read at any layout, MoE
// included (every expert on this process); export writes MoE models as Mixtral (llama with MoE in
// every block) and refuses the others, naming the field.
// Exit codes: 0 done, 2 bad input or options (the message names the file, option or field).
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <iostream>
#include <optional>
#include <random>
#include <string>
#include <vector>

#include "CLI/CLI.hpp"
#include "absl/strings/str_cat.h"
#include "nlohmann/json.hpp"
#include "runtime/core/program.h"
#include "runtime/core/status.h"
#include "runtime/spec/run_spec.h"
#include "runtime/train/data_loader.h"
#include "runtime/worker/recipe.h"
#include "runtime/worker/weights.h"

namespace fp8rt {
namespace {

int Fail(const std::string& command, const absl::Status& status) {
  std::fprintf(stderr, "fp8rt %s: %s\n", command.c_str(), std::string(status.message()).c_str());
  return 2;
}

// Where the weights come from: a run's checkpoint, or Hugging Face weights with a spec.
struct Source {
  std::string run_dir, weights, spec;
  std::optional<int64_t> step;
};

struct Loaded {
  v1::RunSpec spec;
  std::unique_ptr<worker::SoloModel> solo;
};

absl::StatusOr<Loaded> Load(const Source& src) {
  Loaded l;
  if (src.run_dir.empty() == src.weights.empty()) {
    return absl::InvalidArgumentError("give exactly one of --run-dir and --weights");
  }
  std::optional<worker::CheckpointWeights> ckpt;
  if (!src.run_dir.empty()) {
    FP8RT_ASSIGN_OR_RETURN(ckpt, worker::ReadCheckpointWeights(src.run_dir, src.step));
    l.spec = ckpt->spec;
  }
  if (!src.spec.empty()) {
    FP8RT_ASSIGN_OR_RETURN(l.spec, LoadRunSpec(src.spec, {}));
  } else if (ckpt == std::nullopt) {
    return absl::InvalidArgumentError("--weights needs --spec (the model's shape)");
  }
  FP8RT_RETURN_IF_ERROR(ValidateRunSpec(l.spec, 0, DataFileCheck::kSkip));
  FP8RT_ASSIGN_OR_RETURN(l.solo, worker::MakeSoloModel(l.spec));
  if (ckpt.has_value()) {
    FP8RT_RETURN_IF_ERROR(l.solo->model->SetLogicalParams(ckpt->params));
  } else {
    FP8RT_RETURN_IF_ERROR(worker::LoadHuggingFace(src.weights, l.solo->shape, *l.solo->model,
                                                  l.spec.init().ignore_config()));
  }
  return l;
}

void AddSource(CLI::App* app, Source* src) {
  app->add_option("--run-dir", src->run_dir, "a run folder: the weights of its checkpoint");
  app->add_option("--step", src->step, "the checkpoint's step (default: the newest valid one)");
  app->add_option(
      "--weights", src->weights,
      "Hugging Face weights: a safetensors file, an index of shards, or a folder of either");
  app->add_option("--spec", src->spec, "the run spec (required with --weights)");
}

int Export(const Source& src, const std::string& out, const std::string& dtype) {
  if (dtype != "f32" && dtype != "bf16") {
    return Fail("export", absl::InvalidArgumentError("--dtype: f32 or bf16, got '" +
                                                     dtype.substr(0, 16) + "'"));
  }
  absl::StatusOr<worker::CheckpointWeights> w =
      worker::ReadCheckpointWeights(src.run_dir, src.step);
  if (!w.ok()) return Fail("export", w.status());
  // The shapes came with the weights: no second model to build.
  const absl::Status s = worker::ExportHuggingFace(worker::ShapeFromSpec(w->spec), w->shapes,
                                                   w->params, out, dtype == "bf16");
  if (!s.ok()) return Fail("export", s);
  std::printf("fp8rt export: step %lld of %s -> %s/model.safetensors, %s/config.json (%s)\n",
              static_cast<long long>(w->step), src.run_dir.c_str(), out.c_str(), out.c_str(),
              dtype.c_str());
  return 0;
}

int Eval(const Source& src, std::string data, std::string format, int64_t batches, bool json) {
  absl::StatusOr<Loaded> l = Load(src);
  if (!l.ok()) return Fail("eval", l.status());
  if (data.empty()) data = l->spec.data().path();
  if (format.empty()) {
    format = std::string(train::TokenFormatName(worker::FormatFromSpec(l->spec)));
  }
  absl::StatusOr<train::TokenFormat> fmt = train::ParseTokenFormat(format);
  if (!fmt.ok())
    return Fail("eval",
                absl::InvalidArgumentError("--format: " + std::string(fmt.status().message())));
  absl::StatusOr<std::unique_ptr<train::TokenDataset>> ds =
      train::TokenDataset::Open(data, *fmt, l->solo->shape.vocab);
  if (!ds.ok()) return Fail("eval", ds.status());
  const int64_t T = l->solo->shape.seq_len, mb = std::max(1, l->spec.train().micro_batch());
  const uint64_t windows = (*ds)->size() / static_cast<uint64_t>(T + 1);
  const uint64_t rows =
      batches > 0 ? std::min<uint64_t>(windows, static_cast<uint64_t>(batches * mb)) : windows;
  if (rows == 0) {
    return Fail("eval",
                absl::InvalidArgumentError(absl::StrCat(
                    data, ": ", (*ds)->size(), " tokens hold no window of seq_len + 1 = ", T + 1)));
  }
  model::Transformer& m = *l->solo->model;
  double sum = 0.0;
  uint64_t done = 0;
  std::vector<int32_t> tokens;
  while (done < rows) {
    const uint64_t n = std::min<uint64_t>(static_cast<uint64_t>(mb), rows - done);
    tokens.resize(n * static_cast<uint64_t>(T + 1));
    (*ds)->Read(done * static_cast<uint64_t>(T + 1), tokens);
    if (absl::Status s = m.BeginStep(); !s.ok()) return Fail("eval", s);
    absl::StatusOr<float> loss = m.Evaluate(tokens, static_cast<int64_t>(n));
    if (!loss.ok()) return Fail("eval", loss.status());
    sum += static_cast<double>(*loss) * static_cast<double>(n);
    done += n;
    if (!json && isatty(2))
      std::fprintf(stderr, "\reval: %llu / %llu windows", static_cast<unsigned long long>(done),
                   static_cast<unsigned long long>(rows));
  }
  if (!json && isatty(2)) std::fprintf(stderr, "\n");
  const double mean = sum / static_cast<double>(rows);
  if (json) {
    nlohmann::ordered_json j{{"loss", mean},
                             {"windows", rows},
                             {"tokens", rows * T},
                             {"data", data},
                             {"format", format}};
    std::cout << j.dump() << "\n";
  } else {
    std::printf("loss %.6f over %llu windows of %lld tokens (%s, %s)\n", mean,
                static_cast<unsigned long long>(rows), static_cast<long long>(T), data.c_str(),
                format.c_str());
  }
  return 0;
}

int Generate(const Source& src, const std::string& prompt, int64_t count, double temperature,
             int64_t top_k, uint64_t seed) {
  absl::StatusOr<Loaded> l = Load(src);
  if (!l.ok()) return Fail("generate", l.status());
  if (l->spec.data().format() != v1::RunSpec::Data::FORMAT_TEXT) {
    return Fail("generate", absl::InvalidArgumentError(
                                "data.format: generate samples byte-level models (text)"));
  }
  if (!(temperature >= 0.0) || top_k < 0 || count < 0) {
    return Fail("generate", absl::InvalidArgumentError(
                                "--temperature must be >= 0, --top-k and --tokens >= 0"));
  }
  model::Transformer& m = *l->solo->model;
  const int64_t T = l->solo->shape.seq_len, V = l->solo->shape.vocab;
  std::vector<int32_t> text(prompt.begin(), prompt.end());
  for (int32_t& t : text) t = static_cast<unsigned char>(t);
  if (text.empty()) text.push_back('\n');
  std::mt19937_64 rng(seed);
  std::string out;
  std::vector<int32_t> window(static_cast<size_t>(T + 1), 0);
  for (int64_t i = 0; i < count; ++i) {
    // The last seq_len tokens (positions from 0), padded after them: causal attention keeps the
    // padding out of the logits of the last real token.
    const size_t len = std::min(text.size(), static_cast<size_t>(T));
    std::fill(window.begin(), window.end(), 0);
    std::copy(text.end() - static_cast<std::ptrdiff_t>(len), text.end(), window.begin());
    if (absl::Status s = m.BeginStep(); !s.ok()) return Fail("generate", s);
    if (absl::StatusOr<float> loss = m.Evaluate(window, 1); !loss.ok()) {
      return Fail("generate", loss.status());
    }
    absl::StatusOr<std::vector<float>> row = m.CopyLogits(static_cast<int64_t>(len) - 1, 1);
    if (!row.ok()) return Fail("generate", row.status());
    const std::vector<float>& logits = *row;
    // Byte tokens only (a text model's ids past 255 never occur in its data).
    const int64_t vb = std::min<int64_t>(V, 256);
    std::vector<int32_t> order(static_cast<size_t>(vb));
    for (int32_t t = 0; t < vb; ++t) order[static_cast<size_t>(t)] = t;
    std::stable_sort(order.begin(), order.end(), [&](int32_t a, int32_t b) {
      return logits[static_cast<size_t>(a)] > logits[static_cast<size_t>(b)];
    });
    int32_t next = order[0];
    if (temperature > 0.0) {
      const size_t k =
          top_k > 0 ? std::min<size_t>(order.size(), static_cast<size_t>(top_k)) : order.size();
      std::vector<double> p(k);
      const double top = logits[static_cast<size_t>(order[0])];
      double z = 0.0;
      for (size_t j = 0; j < k; ++j) {
        p[j] = std::exp((logits[static_cast<size_t>(order[j])] - top) / temperature);
        z += p[j];
      }
      const double u = static_cast<double>(rng() >> 11) * 0x1.0p-53 * z;
      double acc = 0.0;
      next = order[k - 1];
      for (size_t j = 0; j < k; ++j) {
        acc += p[j];
        if (u < acc) {
          next = order[j];
          break;
        }
      }
    }
    text.push_back(next);
    out.push_back(static_cast<char>(next));
  }
  // Bytes as they are: a sampled 0 byte must not end the text (printf's %s would stop there).
  out = prompt + out + "\n";
  std::fwrite(out.data(), 1, out.size(), stdout);
  return 0;
}

}  // namespace
}  // namespace fp8rt

int main(int argc, char** argv) {
  using namespace fp8rt;
  CLI::App app{"A trained model on one CPU process: export, eval, generate", "fp8rt"};
  app.require_subcommand(1);
  Source src;
  std::string out, dtype = "f32";
  CLI::App* ex = app.add_subcommand("export", "Hugging Face safetensors and config.json");
  ex->add_option("run_dir", src.run_dir, "the run folder")->required();
  ex->add_option("--step", src.step, "the checkpoint's step (default: the newest valid one)");
  ex->add_option("--out", out, "output folder")->required();
  ex->add_option("--dtype", dtype, "f32 (default) or bf16");
  std::string data, format;
  int64_t batches = 0;
  bool json = false;
  CLI::App* ev = app.add_subcommand("eval", "mean loss over windows of a token file");
  AddSource(ev, &src);
  ev->add_option("--data", data, "token file (default: the spec's data.path)");
  ev->add_option("--format", format, "text, u16, u32 or llmc (default: the spec's data.format)");
  ev->add_option("--batches", batches, "at most N micro-batches of train.micro_batch windows");
  ev->add_flag("--json", json, "one JSON object");
  std::string prompt;
  int64_t count = 0, top_k = 0;
  double temperature = 1.0;
  uint64_t seed = 1;
  CLI::App* gen = app.add_subcommand("generate", "sample a byte-level model");
  AddSource(gen, &src);
  gen->add_option("--prompt", prompt, "the text to continue")->required();
  gen->add_option("--tokens", count, "tokens to sample")->required();
  gen->add_option("--temperature", temperature, "softmax temperature (0: greedy; default 1)");
  gen->add_option("--top-k", top_k, "sample among the k likeliest tokens (0: all)");
  gen->add_option("--seed", seed, "sampling seed (default 1)");
  if (std::optional<int> exit_code = fp8rt::ParseCommandLine(app, argc, argv)) return *exit_code;
  if (ex->parsed()) return Export(src, out, dtype);
  if (ev->parsed()) return Eval(src, data, format, batches, json);
  return Generate(src, prompt, count, temperature, top_k, seed);
}
