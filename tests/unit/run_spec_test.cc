// Tests of runtime/spec/run_spec.h: the documented contract of the YAML run spec.
//   - A full spec and examples/tiny.yaml read with the written values; absent keys take the
//     defaults listed in run_spec.h.
//   - Schema errors (unknown keys, wrong types, bad enum values, invalid YAML, missing required
//     keys) name the file, the YAML position and the field path.
//   - Overrides set nested values with the same typing; bad ones name the override.
//   - Cross-field checks each name the field they reject.
#include "runtime/spec/run_spec.h"

#include <sys/stat.h>
#include <unistd.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "runtime/core/glob.h"

namespace fp8rt {
namespace {

using ::testing::ElementsAre;
using ::testing::HasSubstr;
using ::testing::IsEmpty;
using ::testing::StartsWith;

namespace fs = std::filesystem;
using Precision = v1::RunSpec::Precision;

// A fresh directory with one readable data file, removed at the end of the test.
class TempDir {
 public:
  TempDir() {
    const char* base = std::getenv("TEST_TMPDIR");
    std::string tmpl =
        (fs::path(base != nullptr ? base : fs::temp_directory_path().string()) / "runspec.XXXXXX")
            .string();
    path_ = mkdtemp(tmpl.data());
    std::ofstream(path_ / "corpus.txt") << "In the beginning God created the heaven and the earth.";
  }
  ~TempDir() {
    std::error_code ec;
    fs::remove_all(path_, ec);
  }
  std::string DataFile() const { return (path_ / "corpus.txt").string(); }
  std::string Path(const std::string& name) const { return (path_ / name).string(); }

 private:
  fs::path path_;
};

// Every key written, none at its default.
std::string FullSpec(const std::string& data_path) {
  return absl::StrCat(R"(model:
  layers: 4
  d_model: 256
  heads: 8
  d_ff: 1024
  seq_len: 128
  vocab: 512
parallel:
  dp: 4
  tp: 2
  ep: 2
precision:
  mode: bf16
  format: e4m3
  scaling: block
  amax_history_len: 32
  amax_compute_algo: most_recent
  margin: 2
  exclude: [lm_head, blocks.0.attn.qkv]
  fsdp_gather: bf16
  grad_reduce: bf16
train:
  steps: 500
  micro_batch: 4
  grad_accum: 2
  seed: 1234
  lr: 6.0e-4
  warmup: 50
  min_lr: 6e-5
  weight_decay: 0.05
  clip: 0.5
data:
  path: )",
                      data_path, R"(
  format: u16
checkpoint:
  every: 100
  keep: 5
metrics:
  every: 10
  per_rank_fp8_stats: true
device: cuda
)");
}

// Only the required keys.
std::string MinimalSpec(const std::string& data_path) {
  return absl::StrCat(
      "model: {layers: 2, d_model: 128, heads: 4, d_ff: 512, seq_len: 64, vocab: 256}\n"
      "train:\n  steps: 10\n"
      "data:\n  path: ",
      data_path, "\n");
}

absl::StatusOr<v1::RunSpec> Parse(const std::string& text,
                                  const std::vector<std::string>& overrides = {}) {
  return ParseRunSpec(text, "run.yaml", overrides);
}

std::string Message(const absl::Status& s) { return std::string(s.message()); }

// Asserts InvalidArgument whose message contains every fragment.
void ExpectInvalid(const absl::Status& status, const std::vector<std::string>& fragments) {
  EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument) << status;
  for (const std::string& f : fragments) EXPECT_THAT(Message(status), HasSubstr(f));
}

TEST(RunSpecTest, FullSpecReadsEveryValue) {
  const absl::StatusOr<v1::RunSpec> spec = Parse(FullSpec("/data/tokens.bin"));
  ASSERT_TRUE(spec.ok()) << spec.status();
  EXPECT_EQ(spec->model().layers(), 4);
  EXPECT_EQ(spec->model().d_model(), 256);
  EXPECT_EQ(spec->model().heads(), 8);
  EXPECT_EQ(spec->model().d_ff(), 1024);
  EXPECT_EQ(spec->model().seq_len(), 128);
  EXPECT_EQ(spec->model().vocab(), 512);
  EXPECT_EQ(spec->parallel().dp(), 4);
  EXPECT_EQ(spec->parallel().tp(), 2);
  EXPECT_EQ(spec->parallel().ep(), 2);
  const Precision& p = spec->precision();
  EXPECT_EQ(p.mode(), Precision::MODE_BF16);
  EXPECT_EQ(p.format(), Precision::FORMAT_E4M3);
  EXPECT_EQ(p.scaling(), Precision::SCALING_BLOCK);
  EXPECT_EQ(p.amax_history_len(), 32);
  EXPECT_EQ(p.amax_compute_algo(), Precision::AMAX_COMPUTE_ALGO_MOST_RECENT);
  EXPECT_EQ(p.margin(), 2);
  EXPECT_THAT(p.exclude(), ElementsAre("lm_head", "blocks.0.attn.qkv"));
  EXPECT_EQ(p.fsdp_gather(), Precision::FSDP_GATHER_BF16);
  EXPECT_EQ(p.grad_reduce(), Precision::GRAD_REDUCE_BF16);
  EXPECT_EQ(spec->train().steps(), 500);
  EXPECT_EQ(spec->train().micro_batch(), 4);
  EXPECT_EQ(spec->train().grad_accum(), 2);
  EXPECT_EQ(spec->train().seed(), 1234u);
  EXPECT_DOUBLE_EQ(spec->train().lr(), 6.0e-4);
  EXPECT_EQ(spec->train().warmup(), 50);
  EXPECT_DOUBLE_EQ(spec->train().min_lr(), 6e-5);
  EXPECT_DOUBLE_EQ(spec->train().weight_decay(), 0.05);
  EXPECT_DOUBLE_EQ(spec->train().clip(), 0.5);
  EXPECT_EQ(spec->data().path(), "/data/tokens.bin");
  EXPECT_EQ(spec->data().format(), v1::RunSpec::Data::FORMAT_U16);
  EXPECT_EQ(spec->checkpoint().every(), 100);
  EXPECT_EQ(spec->checkpoint().keep(), 5);
  EXPECT_EQ(spec->metrics().every(), 10);
  EXPECT_TRUE(spec->metrics().per_rank_fp8_stats());
  EXPECT_EQ(spec->device(), v1::RunSpec::DEVICE_CUDA);
}

TEST(RunSpecTest, FullSpecValidates) {
  TempDir dir;
  // Expert parallelism (ep 2 in the full spec) needs MoE blocks, and those need tp 1: the full
  // spec's dense model validates with ep 1.
  const absl::StatusOr<v1::RunSpec> spec = Parse(FullSpec(dir.DataFile()), {"parallel.ep=1"});
  ASSERT_TRUE(spec.ok()) << spec.status();
  EXPECT_TRUE(ValidateRunSpec(*spec, 8).ok()) << ValidateRunSpec(*spec, 8);
  EXPECT_TRUE(ValidateRunSpec(*spec, 0).ok());
}

TEST(RunSpecTest, AbsentKeysTakeTheDocumentedDefaults) {
  TempDir dir;
  const absl::StatusOr<v1::RunSpec> spec = Parse(MinimalSpec(dir.DataFile()));
  ASSERT_TRUE(spec.ok()) << spec.status();
  EXPECT_EQ(spec->parallel().dp(), 1);
  EXPECT_EQ(spec->parallel().tp(), 1);
  EXPECT_EQ(spec->parallel().ep(), 1);
  const Precision& p = spec->precision();
  EXPECT_EQ(p.mode(), Precision::MODE_FP8);
  EXPECT_EQ(p.format(), Precision::FORMAT_HYBRID);
  EXPECT_EQ(p.scaling(), Precision::SCALING_DELAYED);
  EXPECT_EQ(p.amax_history_len(), 16);
  EXPECT_EQ(p.amax_compute_algo(), Precision::AMAX_COMPUTE_ALGO_MAX);
  EXPECT_EQ(p.margin(), 0);
  EXPECT_THAT(p.exclude(), IsEmpty());
  EXPECT_EQ(p.fsdp_gather(), Precision::FSDP_GATHER_FP8);
  EXPECT_EQ(p.grad_reduce(), Precision::GRAD_REDUCE_FP32);
  EXPECT_EQ(spec->train().micro_batch(), 1);
  EXPECT_EQ(spec->train().grad_accum(), 1);
  EXPECT_EQ(spec->train().seed(), 1u);
  EXPECT_DOUBLE_EQ(spec->train().lr(), 3e-4);
  EXPECT_EQ(spec->train().warmup(), 0);
  EXPECT_DOUBLE_EQ(spec->train().min_lr(), 0.0);
  EXPECT_DOUBLE_EQ(spec->train().weight_decay(), 0.1);
  EXPECT_DOUBLE_EQ(spec->train().clip(), 1.0);
  EXPECT_EQ(spec->data().format(), v1::RunSpec::Data::FORMAT_TEXT);
  EXPECT_EQ(spec->checkpoint().every(), 0);
  EXPECT_EQ(spec->checkpoint().keep(), 3);
  EXPECT_EQ(spec->metrics().every(), 1);
  EXPECT_FALSE(spec->metrics().per_rank_fp8_stats());
  EXPECT_EQ(spec->device(), v1::RunSpec::DEVICE_CPU);
  EXPECT_TRUE(ValidateRunSpec(*spec, 1).ok()) << ValidateRunSpec(*spec, 1);
}

TEST(RunSpecTest, TinyExampleLoadsAndValidatesOnTwoRanks) {
  const std::string tiny =
      (fs::path(__FILE__).parent_path() / "../../examples/tiny.yaml").lexically_normal().string();
  TempDir dir;
  // The test's small data file has no room for the example's validation tail: eval off.
  const std::vector<std::string> overrides = {"data.path=" + dir.DataFile(), "eval.every=0"};
  const absl::StatusOr<v1::RunSpec> spec = LoadRunSpec(tiny, overrides);
  ASSERT_TRUE(spec.ok()) << spec.status();
  EXPECT_EQ(spec->model().family(), v1::RunSpec::Model::FAMILY_LLAMA);
  EXPECT_EQ(spec->model().layers(), 2);
  EXPECT_EQ(spec->model().d_model(), 128);
  EXPECT_EQ(spec->model().heads(), 4);
  EXPECT_EQ(spec->model().kv_heads(), 2);
  EXPECT_EQ(spec->model().d_ff(), 384);
  EXPECT_EQ(ResolveModel(spec->model()).mlp(), v1::RunSpec::Model::MLP_SWIGLU);
  EXPECT_EQ(spec->model().seq_len(), 64);
  EXPECT_EQ(spec->model().vocab(), 256);
  EXPECT_EQ(spec->parallel().dp(), 2);
  EXPECT_EQ(spec->parallel().tp(), 1);
  EXPECT_EQ(spec->precision().mode(), Precision::MODE_FP8);
  EXPECT_EQ(spec->precision().scaling(), Precision::SCALING_DELAYED);
  EXPECT_EQ(spec->train().steps(), 100);
  EXPECT_EQ(spec->data().path(), dir.DataFile());
  EXPECT_EQ(spec->data().format(), v1::RunSpec::Data::FORMAT_TEXT);
  EXPECT_EQ(spec->checkpoint().every(), 50);
  EXPECT_EQ(spec->checkpoint().keep(), 2);
  EXPECT_EQ(spec->metrics().every(), 10);
  EXPECT_TRUE(ValidateRunSpec(*spec, 2).ok()) << ValidateRunSpec(*spec, 2);
  // Written for 2 ranks: refused on 1 with the field named.
  ExpectInvalid(ValidateRunSpec(*spec, 1), {"parallel.dp", "world size is 1"});
  // Without the override it names the corpus bootstrap writes.
  const absl::StatusOr<v1::RunSpec> plain = LoadRunSpec(tiny, {});
  ASSERT_TRUE(plain.ok()) << plain.status();
  EXPECT_EQ(plain->data().path(), "examples/data/kjv.txt");
}

// The family examples load, validate (with a data file the test writes) and resolve to the
// architecture the issue names.
TEST(RunSpecTest, FamilyExamplesLoadResolveAndValidate) {
  TempDir dir;
  const std::vector<std::string> overrides = {"data.path=" + dir.DataFile()};
  auto example = [](const char* name) {
    return (fs::path(__FILE__).parent_path() / "../../examples" / name).lexically_normal().string();
  };
  using M = v1::RunSpec::Model;
  // The test's small data file has no room for the example's validation tail: eval off.
  std::vector<std::string> llama_overrides = overrides;
  llama_overrides.push_back("eval.every=0");
  const absl::StatusOr<v1::RunSpec> llama =
      LoadRunSpec(example("llama-tiny.yaml"), llama_overrides);
  ASSERT_TRUE(llama.ok()) << llama.status();
  EXPECT_TRUE(ValidateRunSpec(*llama, 2).ok()) << ValidateRunSpec(*llama, 2);
  const M l = ResolveModel(llama->model());
  EXPECT_EQ(l.family(), M::FAMILY_LLAMA);
  EXPECT_EQ(l.layers(), 4);
  EXPECT_EQ(l.d_model(), 256);
  EXPECT_EQ(l.heads(), 8);
  EXPECT_EQ(l.kv_heads(), 2);
  EXPECT_EQ(l.norm(), M::NORM_RMSNORM);
  EXPECT_EQ(l.mlp(), M::MLP_SWIGLU);
  EXPECT_EQ(l.positions(), M::POSITIONS_ROPE);
  EXPECT_EQ(l.rope_theta(), 10000.0);
  EXPECT_FALSE(l.bias());
  EXPECT_FALSE(l.tie_embeddings());

  std::vector<std::string> gpt2_overrides = overrides;
  gpt2_overrides.push_back("data.format=text");  // the test's data file is bytes
  const absl::StatusOr<v1::RunSpec> gpt2 = LoadRunSpec(example("gpt2-small.yaml"), gpt2_overrides);
  ASSERT_TRUE(gpt2.ok()) << gpt2.status();
  EXPECT_TRUE(ValidateRunSpec(*gpt2, 1).ok()) << ValidateRunSpec(*gpt2, 1);
  const M g = ResolveModel(gpt2->model());
  EXPECT_EQ(g.family(), M::FAMILY_GPT2);
  EXPECT_EQ(g.layers(), 12);
  EXPECT_EQ(g.d_model(), 768);
  EXPECT_EQ(g.heads(), 12);
  EXPECT_EQ(g.kv_heads(), 12);
  EXPECT_EQ(g.max_positions(), 1024);
  EXPECT_EQ(g.vocab(), 50257);
  EXPECT_EQ(g.norm(), M::NORM_LAYERNORM);
  EXPECT_EQ(g.mlp(), M::MLP_GELU);
  EXPECT_EQ(g.positions(), M::POSITIONS_LEARNED);
  EXPECT_EQ(g.norm_eps(), 1e-5);
  EXPECT_TRUE(g.bias());
  EXPECT_TRUE(g.tie_embeddings());
}

// A family sets defaults; a written field overrides its family's value; no family is plain.
TEST(RunSpecTest, FamilyDefaultsYieldToWrittenFields) {
  using M = v1::RunSpec::Model;
  const M plain = ResolveModel(Parse(MinimalSpec("x")).value().model());
  EXPECT_EQ(plain.family(), M::FAMILY_PLAIN);
  EXPECT_EQ(plain.norm(), M::NORM_RMSNORM);
  EXPECT_EQ(plain.mlp(), M::MLP_GELU);
  EXPECT_EQ(plain.positions(), M::POSITIONS_NONE);
  EXPECT_EQ(plain.kv_heads(), plain.heads());
  EXPECT_FALSE(plain.bias());
  EXPECT_FALSE(plain.tie_embeddings());
  const std::vector<std::string> overrides = {"model.family=llama", "model.tie_embeddings=true",
                                              "model.norm=layernorm", "model.rope_theta=500000",
                                              "model.bias=true"};
  const absl::StatusOr<v1::RunSpec> spec = ParseRunSpec(MinimalSpec("x"), "run.yaml", overrides);
  ASSERT_TRUE(spec.ok()) << spec.status();
  const M m = ResolveModel(spec->model());
  EXPECT_EQ(m.mlp(), M::MLP_SWIGLU);  // the family's
  EXPECT_EQ(m.positions(), M::POSITIONS_ROPE);
  EXPECT_EQ(m.norm(), M::NORM_LAYERNORM);  // written
  EXPECT_EQ(m.rope_theta(), 500000.0);
  EXPECT_TRUE(m.tie_embeddings());
  EXPECT_TRUE(m.bias());
}

TEST(RunSpecTest, MissingSpecFileIsNotFound) {
  TempDir dir;
  const absl::StatusOr<v1::RunSpec> spec = LoadRunSpec(dir.Path("nope.yaml"), {});
  EXPECT_EQ(spec.status().code(), absl::StatusCode::kNotFound);
  EXPECT_THAT(Message(spec.status()), HasSubstr(dir.Path("nope.yaml")));
}

TEST(RunSpecTest, UnknownNestedKeyNamesPathPositionAndSuggestion) {
  const std::string text = MinimalSpec("x") + "precision:\n  scalng: block\n";
  const absl::Status s = Parse(text).status();
  ExpectInvalid(s, {"precision.scalng: unknown key (did you mean scaling?)"});
  // The key is on line 7 (1-based), column 3.
  EXPECT_THAT(Message(s), StartsWith("run.yaml:7:3: "));
}

TEST(RunSpecTest, UnknownTopLevelKey) {
  ExpectInvalid(Parse(MinimalSpec("x") + "trian:\n  lr: 1\n").status(),
                {"run.yaml:6:1: ", "trian: unknown key (did you mean train?)"});
  // Nothing close: the valid keys are listed.
  ExpectInvalid(Parse(MinimalSpec("x") + "optimizer: adam\n").status(),
                {"optimizer: unknown key (expected one of model, parallel, precision"});
}

TEST(RunSpecTest, DuplicateKeyIsRejected) {
  ExpectInvalid(Parse(MinimalSpec("x") + "train:\n  lr: 1\n").status(),
                {"run.yaml:6:1: ", "train: duplicate key"});
}

TEST(RunSpecTest, WrongTypesNamePathAndExpectedType) {
  struct Case {
    std::string yaml;
    std::string want;
  } cases[] = {
      {"train:\n  steps: ten\n", "run.yaml:2:10: train.steps: expected an integer, got 'ten'"},
      {"train:\n  steps: 1.5\n", "train.steps: expected an integer, got '1.5'"},
      {"train:\n  steps: [1, 2]\n", "train.steps: expected an integer, got a list"},
      {"train:\n  steps: {a: 1}\n", "train.steps: expected an integer, got a map"},
      {"train:\n  steps: \"10\"\n", "train.steps: expected an integer, got the quoted string"},
      {"train:\n  steps:\n", "run.yaml:2:3: train.steps: expected an integer, got an empty value"},
      {"train:\n  lr: fast\n", "train.lr: expected a number, got 'fast'"},
      {"train:\n  seed: -1\n", "train.seed: expected a non-negative integer, got '-1'"},
      {"metrics:\n  per_rank_fp8_stats: 1\n",
       "metrics.per_rank_fp8_stats: expected true or false, got '1'"},
      {"data:\n  path: [a, b]\n", "data.path: expected a string, got a list"},
      {"precision:\n  exclude: lm_head\n",
       "precision.exclude: expected a list of strings, got 'lm_head'"},
      {"precision:\n  exclude: [[a]]\n", "precision.exclude[0]: expected a string, got a list"},
      {"model: 3\n", "model: expected a map of keys (layers, d_model"},
      {"model:\n  layers: 99999999999\n", "model.layers: value 99999999999 is out of the"},
  };
  for (const Case& c : cases) {
    // Type errors come before the required-key check, so each case is a whole document.
    SCOPED_TRACE(c.yaml);
    ExpectInvalid(Parse(c.yaml).status(), {c.want});
  }
}

TEST(RunSpecTest, BadEnumListsTheChoices) {
  ExpectInvalid(Parse("precision:\n  mode: fp16\n").status(),
                {"run.yaml:2:9: precision.mode: expected one of fp32, bf16, fp8, got 'fp16'"});
  ExpectInvalid(Parse("precision:\n  amax_compute_algo: mean\n").status(),
                {"precision.amax_compute_algo: expected one of max, most_recent, got 'mean'"});
  ExpectInvalid(Parse("data:\n  format: u8\n").status(),
                {"data.format: expected one of text, u16, u32, llmc, got 'u8'"});
  // The proto's zero value is not a choice.
  ExpectInvalid(Parse("precision:\n  scaling: unspecified\n").status(),
                {"precision.scaling: expected one of delayed, current, block"});
}

TEST(RunSpecTest, OverridesApplyAfterTheFileWithTheSameTyping) {
  TempDir dir;
  const std::vector<std::string> overrides = {
      "train.steps=20",  "precision.mode=bf16",        "train.lr=1e-3",
      "parallel.dp=2",   "precision.exclude=[a, b.c]", "metrics.per_rank_fp8_stats=true",
      "data.format=u32", "checkpoint={every: 7}",
  };
  const absl::StatusOr<v1::RunSpec> spec = Parse(FullSpec(dir.DataFile()), overrides);
  ASSERT_TRUE(spec.ok()) << spec.status();
  EXPECT_EQ(spec->train().steps(), 20);
  EXPECT_EQ(spec->precision().mode(), Precision::MODE_BF16);
  EXPECT_DOUBLE_EQ(spec->train().lr(), 1e-3);
  EXPECT_EQ(spec->parallel().dp(), 2);
  EXPECT_EQ(spec->parallel().tp(), 2);  // the rest of the section is kept
  EXPECT_THAT(spec->precision().exclude(), ElementsAre("a", "b.c"));
  EXPECT_EQ(spec->data().format(), v1::RunSpec::Data::FORMAT_U32);
  EXPECT_EQ(spec->checkpoint().every(), 7);
  EXPECT_EQ(spec->checkpoint().keep(), 5);
}

TEST(RunSpecTest, ListOverrideTakesCommaSeparatedValuesAndReplaces) {
  const absl::StatusOr<v1::RunSpec> spec =
      Parse(FullSpec("x"), {"precision.exclude=lm_head,blocks.1.mlp.fc2"});
  ASSERT_TRUE(spec.ok()) << spec.status();
  EXPECT_THAT(spec->precision().exclude(), ElementsAre("lm_head", "blocks.1.mlp.fc2"));
  const absl::StatusOr<v1::RunSpec> cleared = Parse(FullSpec("x"), {"precision.exclude="});
  ASSERT_TRUE(cleared.ok()) << cleared.status();
  EXPECT_THAT(cleared->precision().exclude(), IsEmpty());
}

TEST(RunSpecTest, OverridesMayProvideRequiredKeys) {
  const absl::StatusOr<v1::RunSpec> spec =
      Parse("model: {layers: 1, d_model: 128, heads: 1, d_ff: 128, seq_len: 8}\n",
            {"model.vocab=256", "train.steps=3", "data.path=/tmp/x"});
  ASSERT_TRUE(spec.ok()) << spec.status();
  EXPECT_EQ(spec->model().vocab(), 256);
}

TEST(RunSpecTest, BadOverridesNameTheOverride) {
  const std::string spec = FullSpec("x");
  ExpectInvalid(Parse(spec, {"train.steps"}).status(),
                {"override 'train.steps': expected KEY=VALUE"});
  ExpectInvalid(Parse(spec, {"=5"}).status(), {"override '=5': expected KEY=VALUE"});
  ExpectInvalid(Parse(spec, {"train.stepz=3"}).status(),
                {"override 'train.stepz=3': train.stepz: unknown key (did you mean steps?)"});
  ExpectInvalid(Parse(spec, {"training.steps=3"}).status(),
                {"override 'training.steps=3': training: unknown key (did you mean train?)"});
  ExpectInvalid(Parse(spec, {"train.steps.max=3"}).status(),
                {"override 'train.steps.max=3': train.steps.max: unknown key (train.steps is not "
                 "a section)"});
  ExpectInvalid(Parse(spec, {"train.steps=ten"}).status(),
                {"override 'train.steps=ten': train.steps: expected an integer, got 'ten'"});
  ExpectInvalid(Parse(spec, {"precision.mode=fp16"}).status(),
                {"override 'precision.mode=fp16': precision.mode: expected one of fp32, bf16, "
                 "fp8, got 'fp16'"});
  ExpectInvalid(Parse(spec, {"train.steps=[1"}).status(),
                {"override 'train.steps=[1': train.steps: invalid YAML value"});
}

// A valid spec (parsed from MinimalSpec) with `overrides`, validated on `world` ranks.
absl::Status ValidateWith(const TempDir& dir, const std::vector<std::string>& overrides,
                          int world) {
  const absl::StatusOr<v1::RunSpec> spec = Parse(MinimalSpec(dir.DataFile()), overrides);
  if (!spec.ok()) return spec.status();
  return ValidateRunSpec(*spec, world);
}

TEST(RunSpecTest, CrossFieldChecksNameTheField) {
  TempDir dir;
  struct Case {
    std::vector<std::string> overrides;
    int world;
    std::vector<std::string> want;
  } cases[] = {
      {{"parallel.dp=2", "parallel.tp=2"}, 2, {"parallel.dp", "2 * 2 = 4", "world size is 2"}},
      {{"parallel.dp=4", "parallel.ep=3"}, 4, {"parallel.ep", "does not divide parallel.dp 4"}},
      {{"parallel.dp=2", "parallel.ep=2"}, 2, {"parallel.ep", "needs MoE blocks"}},
      {{"parallel.dp=2", "parallel.ep=2", "moe.experts=3"}, 2, {"moe.experts", "parallel.ep 2"}},
      {{"moe.experts=4", "moe.top_k=5"}, 1, {"moe.top_k", "[1, moe.experts = 4]"}},
      {{"moe.experts=4", "moe.capacity_factor=0"}, 1, {"moe.capacity_factor"}},
      {{"moe.experts=4", "parallel.tp=2"}, 2, {"parallel.tp", "MoE"}},
      {{"model.d_model=96", "model.heads=2", "parallel.tp=4"}, 4, {"model.heads"}},
      {{"model.kv_heads=3"}, 1, {"model.kv_heads", "do not divide model.heads 4"}},
      {{"model.kv_heads=2", "parallel.tp=4"}, 4, {"model.kv_heads", "parallel.tp 4"}},
      {{"model.family=gpt2", "model.max_positions=32"}, 1, {"model.max_positions", "seq_len 64"}},
      {{"model.family=llama", "model.d_model=132", "model.heads=4"},
       1,
       {"model.positions", "even head size"}},
      {{"model.rope_theta=0"}, 1, {"model.rope_theta"}},
      {{"model.norm_eps=-1"}, 1, {"model.norm_eps"}},
      {{"model.d_model=132", "model.heads=1", "parallel.tp=8"}, 8, {"model.d_model", "132"}},
      {{"model.d_ff=500", "parallel.tp=8", "model.heads=8"}, 8, {"model.d_ff", "500"}},
      {{"model.d_model=100", "model.heads=4", "precision.scaling=block"},
       1,
       {"model.d_model", "multiple of 128"}},
      {{"model.d_model=256", "model.d_ff=384", "precision.scaling=block", "parallel.tp=2"},
       2,
       {"model.d_ff", "384 / parallel.tp 2 = 192"}},
      // mx32: 32-wide blocks along K in every TP piece, 32-row blocks in every FSDP shard.
      {{"model.d_model=80", "model.heads=4", "precision.scaling=mx32"},
       1,
       {"model.d_model", "precision.scaling mx32", "multiple of 32"}},
      {{"model.d_model=130", "model.heads=4"}, 1, {"model.d_model", "multiple of model.heads 4"}},
      {{"model.layers=0"}, 1, {"model.layers: must be positive, got 0"}},
      {{"parallel.tp=0"}, 0, {"parallel.tp: must be positive"}},
      {{"train.warmup=11"}, 1, {"train.warmup", "more than train.steps 10"}},
      {{"train.min_lr=1e-3"}, 1, {"train.min_lr", "more than train.lr"}},
      {{"train.lr=0"}, 1, {"train.lr: must be positive"}},
      {{"precision.margin=33"}, 1, {"precision.margin: must be in [0, 32], got 33"}},
      {{"precision.margin=-1"}, 1, {"precision.margin"}},
      {{"precision.amax_history_len=0"}, 1, {"precision.amax_history_len: must be in [1, 4096]"}},
      {{"precision.amax_history_len=4097"}, 1, {"precision.amax_history_len"}},
      {{"model.vocab=100"}, 1, {"model.vocab", "vocab >= 256"}},
      {{"data.format=u16", "model.vocab=65537"}, 1, {"model.vocab", "u16 holds token ids"}},
      {{"data.format=llmc", "model.vocab=65537"}, 1, {"model.vocab", "llmc holds token ids"}},
      {{"metrics.every=0"}, 1, {"metrics.every: must be positive"}},
      {{"data.path=" + dir.Path("missing.txt")}, 1, {"data.path", dir.Path("missing.txt")}},
      {{"data.path=" + dir.Path("")}, 1, {"data.path", "is a directory"}},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(::testing::PrintToString(c.overrides));
    ExpectInvalid(ValidateWith(dir, c.overrides, c.world), c.want);
  }
  // A FIFO (or a device) as data.path would block the reader or never end: refused up front.
  const std::string fifo = dir.Path("data.fifo");
  ASSERT_EQ(mkfifo(fifo.c_str(), 0600), 0);
  ExpectInvalid(ValidateWith(dir, {"data.path=" + fifo}, 1), {"data.path", "not a regular file"});
  // The same layouts made consistent pass.
  EXPECT_TRUE(ValidateWith(dir, {"parallel.dp=2", "parallel.tp=2"}, 4).ok());
  EXPECT_TRUE(ValidateWith(dir, {"parallel.dp=4", "parallel.ep=2", "moe.experts=4"}, 4).ok());
  EXPECT_TRUE(
      ValidateWith(dir, {"model.d_model=256", "precision.scaling=block", "parallel.tp=2"}, 2).ok());
  EXPECT_TRUE(ValidateWith(dir, {"precision.scaling=mx32", "parallel.dp=2"}, 2).ok());
  // FP8 weights whose rows FSDP cannot split evenly are cut in whole rows (128-row blocks with
  // block scaling, 32-row blocks with mx32) with the last shards padded (model::ShardCut): 99
  // rows of attn.qkv over 4 ranks, 384 rows over 2 x 128-row blocks, 192 rows over 4 x 32.
  EXPECT_TRUE(ValidateWith(dir,
                           {"model.d_model=66", "model.heads=2", "model.d_ff=64", "parallel.dp=4",
                            "parallel.tp=2"},
                           8)
                  .ok());
  EXPECT_TRUE(ValidateWith(dir,
                           {"model.d_model=128", "model.d_ff=256", "precision.scaling=block",
                            "parallel.dp=2"},
                           2)
                  .ok());
  EXPECT_TRUE(ValidateWith(dir,
                           {"model.d_model=64", "model.heads=2", "model.d_ff=128",
                            "precision.scaling=mx32", "parallel.dp=4"},
                           4)
                  .ok());
  EXPECT_TRUE(ValidateWith(dir, {"train.warmup=10", "train.min_lr=3e-4"}, 1).ok());
  EXPECT_TRUE(ValidateWith(dir, {"data.format=llmc", "model.vocab=50257"}, 1).ok());
  // Outside fp8 mode nothing is gathered in FP8.
  EXPECT_TRUE(ValidateWith(dir,
                           {"model.d_model=66", "model.heads=2", "model.d_ff=64", "parallel.dp=4",
                            "parallel.tp=2", "precision.mode=bf16"},
                           8)
                  .ok());
}

// A run's FSDP shards are cut when it starts (FsdpRowUnit): a recipe given live with larger
// blocks than they were cut for is refused naming the field, one they fit is taken. The tiny
// model at dp=2: attn.qkv has 384 rows, cut into 2 x 192 for tensor scaling (192 = 6 x 32, not
// a multiple of 128), into 256 + 128 (padded) for block scaling.
TEST(RunSpecTest, LiveRecipesMustFitTheShardsTheRunWasCutIn) {
  auto spec = [](const std::vector<std::string>& sets) {
    std::vector<std::string> all = {"parallel.dp=2", "precision.mode=fp8"};
    all.insert(all.end(), sets.begin(), sets.end());
    absl::StatusOr<v1::RunSpec> s = Parse(MinimalSpec("x"), all);
    EXPECT_TRUE(s.ok()) << s.status();
    return s.ok() ? *s : v1::RunSpec();
  };
  const v1::RunSpec delayed = spec({"precision.scaling=delayed"});
  EXPECT_EQ(FsdpRowUnit(delayed), 1);
  EXPECT_EQ(FsdpRowUnit(spec({"precision.scaling=block"})), 128);
  EXPECT_EQ(FsdpRowUnit(spec({"precision.scaling=mx32"})), 32);
  EXPECT_EQ(FsdpRowUnit(spec({"health.action=block_scaling"})), 128);
  EXPECT_EQ(FsdpRowUnit(spec({"precision.mode=bf16"})), 0);

  ExpectInvalid(CheckLiveRecipeShards(delayed, spec({"precision.scaling=block"})),
                {"model.d_model", "192 rows", "128-row blocks", "start the run with"});
  EXPECT_TRUE(CheckLiveRecipeShards(delayed, spec({"precision.scaling=mx32"})).ok());
  EXPECT_TRUE(CheckLiveRecipeShards(delayed, spec({"precision.scaling=current"})).ok());
  // Cut for block scaling from the start (the health policy may switch to it): it fits.
  EXPECT_TRUE(CheckLiveRecipeShards(spec({"health.action=block_scaling"}),
                                    spec({"precision.scaling=block"}))
                  .ok());
  // One rank: no shard boundary to straddle.
  const v1::RunSpec one = *Parse(MinimalSpec("x"), {"parallel.dp=1", "precision.mode=fp8"});
  v1::RunSpec one_block = one;
  one_block.mutable_precision()->set_scaling(v1::RunSpec::Precision::SCALING_BLOCK);
  EXPECT_TRUE(CheckLiveRecipeShards(one, one_block).ok());
}

TEST(RunSpecTest, ShuffleValidationDataAndEvalTakeTheirDefaults) {
  TempDir dir;
  const absl::StatusOr<v1::RunSpec> spec = Parse(MinimalSpec(dir.DataFile()));
  ASSERT_TRUE(spec.ok()) << spec.status();
  EXPECT_TRUE(spec->data().has_shuffle());
  EXPECT_TRUE(spec->data().shuffle());
  EXPECT_EQ(spec->data().val_path(), "");
  EXPECT_EQ(spec->data().val_fraction(), 0.0);
  EXPECT_EQ(spec->eval().every(), 0);
  EXPECT_EQ(spec->eval().batches(), 8);
  EXPECT_TRUE(ValidateRunSpec(*spec, 1).ok());
}

TEST(RunSpecTest, ShuffleValidationDataAndEvalKeysReadTheirValues) {
  TempDir dir;
  const absl::StatusOr<v1::RunSpec> spec =
      Parse(absl::StrCat(MinimalSpec(dir.DataFile()), "eval:\n  every: 50\n  batches: 4\n"),
            {"data.shuffle=false", "data.val_path=" + dir.DataFile()});
  ASSERT_TRUE(spec.ok()) << spec.status();
  EXPECT_TRUE(spec->data().has_shuffle());
  EXPECT_FALSE(spec->data().shuffle());
  EXPECT_EQ(spec->data().val_path(), dir.DataFile());
  EXPECT_EQ(spec->eval().every(), 50);
  EXPECT_EQ(spec->eval().batches(), 4);
  const absl::StatusOr<v1::RunSpec> fraction =
      Parse(MinimalSpec(dir.DataFile()), {"data.val_fraction=0.05"});
  ASSERT_TRUE(fraction.ok()) << fraction.status();
  EXPECT_DOUBLE_EQ(fraction->data().val_fraction(), 0.05);
  ExpectInvalid(Parse(MinimalSpec(dir.DataFile()), {"data.shuffle=yes please"}).status(),
                {"data.shuffle"});
  ExpectInvalid(Parse(MinimalSpec(dir.DataFile()), {"eval.evry=5"}).status(),
                {"eval.evry", "did you mean every?"});
}

TEST(RunSpecTest, ValidationDataAndEvalErrorsNameTheField) {
  TempDir dir;
  // 6500 bytes: with val_fraction 0.1 the tail is tokens [5850, 6500), 650 tokens = 10 windows of
  // seq_len + 1 = 65 (MinimalSpec's seq_len is 64).
  const std::string corpus = dir.Path("kjv-like.txt");
  std::ofstream(corpus) << std::string(6500, 'a');
  // A separate validation file of 130 bytes: 2 windows.
  const std::string small = dir.Path("val.txt");
  std::ofstream(small) << std::string(130, 'b');
  // An llm.c file of 650 tokens: a 1024-byte header and 1300 bytes of uint16 (the header's
  // contents are the data loader's business; the spec counts from the size).
  const std::string llmc = dir.Path("val.bin");
  std::ofstream(llmc) << std::string(1024 + 2 * 650, '\0');
  const std::string data = "data.path=" + corpus;
  struct Case {
    std::vector<std::string> overrides;
    int world;
    std::vector<std::string> want;
  } cases[] = {
      {{data, "data.val_fraction=1.5"}, 1, {"data.val_fraction", "(0, 1)", "1.5"}},
      {{data, "data.val_fraction=1"}, 1, {"data.val_fraction", "(0, 1)"}},
      {{data, "data.val_fraction=-0.1"}, 1, {"data.val_fraction", "-0.1"}},
      {{data, "data.val_fraction=0.1", "data.val_path=" + small},
       1,
       {"data.val_path", "data.val_fraction", "not both"}},
      {{data, "data.val_path=" + dir.Path("missing.bin")},
       1,
       {"data.val_path", dir.Path("missing.bin"), "does not exist"}},
      {{data, "data.val_path=" + dir.Path(""), "eval.every=5"},
       1,
       {"data.val_path", "is a directory"}},
      {{data, "eval.every=5"}, 1, {"eval.every", "no validation data", "data.val_path or "}},
      {{data, "eval.every=-1"}, 1, {"eval.every: must be >= 0"}},
      {{data, "eval.every=5", "eval.batches=0", "data.val_fraction=0.1"},
       1,
       {"eval.batches: must be positive"}},
      // Too few windows: the message says how many there are and how many eval needs.
      {{data, "eval.every=5", "eval.batches=11", "data.val_fraction=0.1"},
       1,
       {"data.val_fraction", corpus, "650 tokens, 10 windows", "65 tokens",
        "11 * 1 * 1 = 11 windows"}},
      {{data, "eval.every=5", "data.val_fraction=0.1", "parallel.dp=2"},
       2,
       {"data.val_fraction", "10 windows", "8 * 1 * 2 = 16 windows"}},
      {{data, "eval.every=5", "eval.batches=3", "data.val_path=" + small},
       1,
       {"data.val_path", small, "130 tokens, 2 windows", "3 * 1 * 1 = 3 windows"}},
      {{data, "eval.every=5", "eval.batches=2", "train.micro_batch=3", "data.val_path=" + small},
       1,
       {"data.val_path", "2 windows", "2 * 3 * 1 = 6 windows"}},
      {{data, "eval.every=5", "eval.batches=11", "data.format=llmc", "data.val_path=" + llmc},
       1,
       {"data.val_path", "650 tokens, 10 windows"}},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(::testing::PrintToString(c.overrides));
    ExpectInvalid(ValidateWith(dir, c.overrides, c.world), c.want);
  }
  // Exactly enough is enough; no eval needs no windows.
  EXPECT_TRUE(
      ValidateWith(dir, {data, "eval.every=5", "eval.batches=10", "data.val_fraction=0.1"}, 1)
          .ok());
  EXPECT_TRUE(
      ValidateWith(
          dir, {data, "eval.every=5", "eval.batches=5", "data.val_fraction=0.1", "parallel.dp=2"},
          2)
          .ok());
  EXPECT_TRUE(
      ValidateWith(dir, {data, "eval.every=1", "eval.batches=2", "data.val_path=" + small}, 1)
          .ok());
  EXPECT_TRUE(
      ValidateWith(
          dir,
          {data, "eval.every=5", "eval.batches=10", "data.format=llmc", "data.val_path=" + llmc}, 1)
          .ok());
  EXPECT_TRUE(ValidateWith(dir, {data, "data.val_fraction=0.5"}, 1).ok());
  // A process that never reads the data (the controller) still refuses what is wrong in the
  // spec itself, but not what depends on the files.
  absl::StatusOr<v1::RunSpec> spec = Parse(MinimalSpec(dir.DataFile()), {"data.val_fraction=2"});
  ASSERT_TRUE(spec.ok());
  ExpectInvalid(ValidateRunSpec(*spec, 1, DataFileCheck::kSkip), {"data.val_fraction"});
  spec = Parse(MinimalSpec(dir.DataFile()),
               {"eval.every=5", "eval.batches=1000", "data.val_path=/no/such/file"});
  ASSERT_TRUE(spec.ok());
  EXPECT_TRUE(ValidateRunSpec(*spec, 1, DataFileCheck::kSkip).ok());
}

// init.from names Hugging Face weights: a file (a safetensors file or an index), or a folder
// holding model.safetensors or model.safetensors.index.json. What is not there is refused before
// training, naming the field and the path.
TEST(RunSpecTest, InitFromTakesAFileOrAFolderOfWeights) {
  TempDir dir;
  const std::string data = "data.path=" + dir.DataFile();
  const std::string empty = dir.Path("empty"), index = dir.Path("sharded");
  std::filesystem::create_directories(empty);
  std::filesystem::create_directories(index);
  std::ofstream(index + "/model.safetensors.index.json") << "{}";
  std::ofstream(dir.Path("m.safetensors")) << "x";
  // Only existence is checked here; the contents when the weights are read (SafetensorsSet).
  EXPECT_TRUE(ValidateWith(dir, {data, "init.from=" + dir.Path("m.safetensors")}, 1).ok());
  EXPECT_TRUE(ValidateWith(dir, {data, "init.from=" + index}, 1).ok());
  ExpectInvalid(ValidateWith(dir, {data, "init.from=" + empty}, 1),
                {"init.from", empty, "neither model.safetensors nor model.safetensors.index.json"});
  ExpectInvalid(ValidateWith(dir, {data, "init.from=" + dir.Path("none.safetensors")}, 1),
                {"init.from", dir.Path("none.safetensors"), "does not exist"});
}

TEST(RunSpecTest, UnspecifiedEnumFromAnotherSourceIsRefused) {
  TempDir dir;
  absl::StatusOr<v1::RunSpec> spec = Parse(MinimalSpec(dir.DataFile()));
  ASSERT_TRUE(spec.ok()) << spec.status();
  spec->mutable_precision()->set_grad_reduce(Precision::GRAD_REDUCE_UNSPECIFIED);
  ExpectInvalid(ValidateRunSpec(*spec, 1), {"precision.grad_reduce: not set"});
}

// `device` is a top-level key: cpu (the default) or cuda, from the file or an override.
TEST(RunSpecTest, DeviceIsCpuOrCuda) {
  TempDir dir;
  const std::string minimal = MinimalSpec(dir.DataFile());
  const absl::StatusOr<v1::RunSpec> cuda = Parse(minimal + "device: cuda\n");
  ASSERT_TRUE(cuda.ok()) << cuda.status();
  EXPECT_EQ(cuda->device(), v1::RunSpec::DEVICE_CUDA);
  EXPECT_TRUE(ValidateRunSpec(*cuda, 1).ok()) << ValidateRunSpec(*cuda, 1);
  const absl::StatusOr<v1::RunSpec> cpu = Parse(minimal + "device: cpu\n");
  ASSERT_TRUE(cpu.ok()) << cpu.status();
  EXPECT_EQ(cpu->device(), v1::RunSpec::DEVICE_CPU);
  EXPECT_TRUE(ValidateRunSpec(*cpu, 1).ok()) << ValidateRunSpec(*cpu, 1);
  // Absent: cpu.
  const absl::StatusOr<v1::RunSpec> absent = Parse(minimal);
  ASSERT_TRUE(absent.ok()) << absent.status();
  EXPECT_EQ(absent->device(), v1::RunSpec::DEVICE_CPU);
  // Overrides, both ways.
  const absl::StatusOr<v1::RunSpec> set = Parse(minimal + "device: cpu\n", {"device=cuda"});
  ASSERT_TRUE(set.ok()) << set.status();
  EXPECT_EQ(set->device(), v1::RunSpec::DEVICE_CUDA);
  const absl::StatusOr<v1::RunSpec> back = Parse(minimal + "device: cuda\n", {"device=cpu"});
  ASSERT_TRUE(back.ok()) << back.status();
  EXPECT_EQ(back->device(), v1::RunSpec::DEVICE_CPU);
  // A RunSpec whose device was never set (one stored before the field existed) means cpu: the
  // one enum whose zero value is not refused as "not set".
  v1::RunSpec unset = *absent;
  unset.clear_device();
  EXPECT_TRUE(ValidateRunSpec(unset, 1).ok()) << ValidateRunSpec(unset, 1);
  unset.mutable_moe()->set_experts(4);
  EXPECT_TRUE(ValidateRunSpec(unset, 1).ok()) << ValidateRunSpec(unset, 1);
}

TEST(RunSpecTest, BadDeviceIsRefusedNamingDevice) {
  TempDir dir;
  const std::string minimal = MinimalSpec(dir.DataFile());
  ExpectInvalid(Parse("device: gpu\n").status(),
                {"run.yaml:1:9: device: expected one of cpu, cuda, got 'gpu'"});
  ExpectInvalid(Parse(minimal + "device: unspecified\n").status(),
                {"device: expected one of cpu, cuda, got 'unspecified'"});
  ExpectInvalid(Parse(minimal + "device: [cuda]\n").status(), {"device: ", "a list"});
  ExpectInvalid(Parse(minimal, {"device=tpu"}).status(),
                {"override 'device=tpu': device: expected one of cpu, cuda, got 'tpu'"});
  // A value from the wire that the schema does not know.
  absl::StatusOr<v1::RunSpec> spec = Parse(minimal);
  ASSERT_TRUE(spec.ok()) << spec.status();
  spec->set_device(static_cast<v1::RunSpec::Device>(7));
  ExpectInvalid(ValidateRunSpec(*spec, 1), {"device: unknown value 7 (expected cpu or cuda)"});
}

// Both devices take the same specs, MoE blocks included (MoE routing runs on the host with
// either; the GPU's buffers are managed memory).
TEST(RunSpecTest, CudaTakesTheSameSpecsAsCpu) {
  TempDir dir;
  for (const char* device : {"device=cpu", "device=cuda"}) {
    EXPECT_TRUE(ValidateWith(dir, {device, "moe.experts=4"}, 1).ok()) << device;
    EXPECT_TRUE(
        ValidateWith(dir, {device, "parallel.dp=2", "parallel.ep=2", "moe.experts=4"}, 2).ok())
        << device;
    EXPECT_TRUE(ValidateWith(dir, {device, "moe.experts=0"}, 1).ok()) << device;
  }
}

TEST(RunSpecTest, MissingRequiredKeyIsNamed) {
  const absl::Status s = Parse(
                             "model: {d_model: 128, heads: 4, d_ff: 512, seq_len: 64, vocab: 256}\n"
                             "train: {steps: 10}\ndata: {path: x}\n")
                             .status();
  ExpectInvalid(s, {"run.yaml: model.layers: required key missing"});
  ExpectInvalid(Parse("model: {layers: 1, d_model: 128, heads: 4, d_ff: 512, seq_len: 64, "
                      "vocab: 256}\ntrain: {steps: 10}\n")
                    .status(),
                {"data.path: required key missing"});
}

TEST(RunSpecTest, InvalidYamlNamesFileAndLine) {
  TempDir dir;
  const std::string path = dir.Path("broken.yaml");
  std::ofstream(path) << "model:\n  layers: 2\n  d_model: [128, 256\ntrain:\n  steps: 5\n";
  const absl::Status s = LoadRunSpec(path, {}).status();
  ExpectInvalid(s, {path + ":", "invalid YAML"});
  EXPECT_THAT(Message(s), testing::MatchesRegex(".*broken\\.yaml:[45]:[0-9]+: invalid YAML.*"));
  // A document that is not a map.
  ExpectInvalid(Parse("just words\n").status(), {"run.yaml:1:1: expected a map of keys (model"});
}

TEST(RunSpecTest, EmptyFileReportsTheFirstMissingRequiredKey) {
  TempDir dir;
  const std::string path = dir.Path("empty.yaml");
  std::ofstream(path) << "";
  ExpectInvalid(LoadRunSpec(path, {}).status(), {path + ": model.layers: required key missing"});
  ExpectInvalid(Parse("# nothing but a comment\n").status(),
                {"run.yaml: model.layers: required key missing"});
}

// precision.overrides (issue 20 point 1): a list of per-layer recipes, the first match wins.

std::string OverrideSpec(const std::string& data_path, const std::string& overrides) {
  return absl::StrCat(MinimalSpec(data_path), "precision:\n  mode: fp8\n  margin: 1\n",
                      "  amax_history_len: 16\n  exclude: [blocks.1.attn.proj]\n", overrides);
}

TEST(PrecisionOverridesTest, GlobMatchesWholeNames) {
  EXPECT_TRUE(GlobMatch("blocks.*.mlp.fc2", "blocks.0.mlp.fc2"));
  EXPECT_TRUE(GlobMatch("blocks.*.mlp.fc2", "blocks.11.mlp.fc2"));
  EXPECT_FALSE(GlobMatch("blocks.*.mlp.fc2", "blocks.0.mlp.fc1"));
  EXPECT_FALSE(GlobMatch("blocks.0", "blocks.0.mlp.fc1")) << "the whole name, not a prefix";
  EXPECT_TRUE(GlobMatch("blocks.?.attn.*", "blocks.3.attn.qkv"));
  EXPECT_FALSE(GlobMatch("blocks.?.attn.*", "blocks.13.attn.qkv")) << "? is one character";
  EXPECT_TRUE(GlobMatch("*", ""));
  EXPECT_TRUE(GlobMatch("**a*", "bab"));
  EXPECT_FALSE(GlobMatch("", "a"));
  EXPECT_TRUE(GlobMatch("a*b*c", "aXbYbZc"));
  EXPECT_FALSE(GlobMatch("a*b*c", "aXbYbZ"));
}

TEST(PrecisionOverridesTest, ReadFromYamlAndResolvedPerLayerFirstMatchWins) {
  TempDir dir;
  const absl::StatusOr<v1::RunSpec> spec = Parse(OverrideSpec(dir.DataFile(), R"(  overrides:
    - {layers: "blocks.0.mlp.*", mode: bf16}
    - layers: "blocks.*.mlp.*"
      scaling: current
      margin: 3
    - {layers: "blocks.*", format: e4m3, amax_history_len: 4, amax_compute_algo: most_recent}
)"));
  ASSERT_TRUE(spec.ok()) << spec.status();
  ASSERT_TRUE(ValidateRunSpec(*spec, 1).ok()) << ValidateRunSpec(*spec, 1);
  const Precision& p = spec->precision();
  ASSERT_EQ(p.overrides_size(), 3);
  EXPECT_EQ(p.overrides(0).layers(), "blocks.0.mlp.*");
  EXPECT_EQ(p.overrides(0).mode(), Precision::MODE_BF16);
  EXPECT_FALSE(p.overrides(0).has_margin());
  EXPECT_EQ(p.overrides(1).scaling(), Precision::SCALING_CURRENT);
  EXPECT_EQ(p.overrides(1).margin(), 3);

  int matched = 99;
  // The first override wins over the second, which also matches.
  Precision fc1 = LayerPrecision(p, "blocks.0.mlp.fc1", &matched);
  EXPECT_EQ(matched, 0);
  EXPECT_EQ(fc1.mode(), Precision::MODE_BF16);
  EXPECT_EQ(fc1.margin(), 1) << "unset fields are the section's";
  EXPECT_EQ(fc1.overrides_size(), 0);
  EXPECT_EQ(fc1.exclude_size(), 0);
  // The second: scaling and margin set, the rest the section's (not the third override's).
  Precision fc2 = LayerPrecision(p, "blocks.1.mlp.fc2", &matched);
  EXPECT_EQ(matched, 1);
  EXPECT_EQ(fc2.mode(), Precision::MODE_FP8);
  EXPECT_EQ(fc2.scaling(), Precision::SCALING_CURRENT);
  EXPECT_EQ(fc2.margin(), 3);
  EXPECT_EQ(fc2.amax_history_len(), 16);
  EXPECT_EQ(fc2.format(), p.format());
  // The third.
  Precision qkv = LayerPrecision(p, "blocks.1.attn.qkv", &matched);
  EXPECT_EQ(matched, 2);
  EXPECT_EQ(qkv.format(), Precision::FORMAT_E4M3);
  EXPECT_EQ(qkv.amax_history_len(), 4);
  EXPECT_EQ(qkv.amax_compute_algo(), Precision::AMAX_COMPUTE_ALGO_MOST_RECENT);
  EXPECT_EQ(qkv.scaling(), p.scaling());
  // precision.exclude comes before every override.
  Precision proj = LayerPrecision(p, "blocks.1.attn.proj", &matched);
  EXPECT_EQ(proj.mode(), Precision::MODE_BF16);
  EXPECT_EQ(matched, -1);
  // No match: the section's values.
  Precision head = LayerPrecision(p, "lm_head", &matched);
  EXPECT_EQ(matched, -1);
  EXPECT_EQ(head.mode(), Precision::MODE_FP8);
  EXPECT_EQ(head.margin(), 1);

  EXPECT_EQ(DescribeOverride(p.overrides(1)), "'blocks.*.mlp.*': scaling current, margin 3");
}

TEST(PrecisionOverridesTest, ErrorsNameTheEntryAndField) {
  TempDir dir;
  auto validate = [&](const std::string& overrides, const std::string& mode = "fp8") {
    std::string text = OverrideSpec(dir.DataFile(), overrides);
    text.replace(text.find("mode: fp8"), 9, "mode: " + mode);
    const absl::StatusOr<v1::RunSpec> spec = Parse(text);
    if (!spec.ok()) return spec.status();
    return ValidateRunSpec(*spec, 1);
  };
  // A pattern that matches no layer names the entry and quotes the pattern.
  ExpectInvalid(validate("  overrides:\n    - {layers: 'blocks.0.mlp.*', mode: bf16}\n"
                         "    - {layers: 'blocks.7.*', mode: bf16}\n"),
                {"precision.overrides[1].layers", "'blocks.7.*' matches no layer of the model",
                 "blocks.0.attn.qkv"});
  ExpectInvalid(validate("  overrides:\n    - {layers: 'blocks.0.mlp.fc3'}\n"),
                {"precision.overrides[0].layers", "matches no layer"});
  ExpectInvalid(validate("  overrides:\n    - {layers: '', mode: bf16}\n"),
                {"precision.overrides[0].layers", "empty pattern"});
  ExpectInvalid(validate("  overrides:\n    - {layers: 'blocks.*', mode: fp32}\n"),
                {"precision.overrides[0].mode", "fp8 or bf16"});
  ExpectInvalid(validate("  overrides:\n    - {layers: 'blocks.*', margin: 33}\n"),
                {"precision.overrides[0].margin", "[0, 32]"});
  ExpectInvalid(validate("  overrides:\n    - {layers: 'blocks.*', amax_history_len: 5000}\n"),
                {"precision.overrides[0].amax_history_len"});
  // Words outside the enum are refused by the parser, naming the list item.
  ExpectInvalid(validate("  overrides:\n    - {layers: 'blocks.*', scaling: wavy}\n"),
                {"precision.overrides[0].scaling", "expected one of", "'wavy'"});
  ExpectInvalid(validate("  overrides:\n    - {layers: 'blocks.*', colour: red}\n"),
                {"precision.overrides[0].colour", "unknown key"});
  ExpectInvalid(validate("  overrides: {layers: 'blocks.*'}\n"),
                {"precision.overrides", "expected a list of maps"});
  ExpectInvalid(validate("  overrides: ['blocks.*']\n"),
                {"precision.overrides[0]", "expected a map"});
  // Per-layer recipes are FP8 recipes.
  ExpectInvalid(validate("  overrides:\n    - {layers: 'blocks.*', margin: 2}\n", "bf16"),
                {"precision.overrides", "need precision.mode fp8"});
  // A long pattern is refused by its length, quoted by a bounded prefix only.
  const std::string huge(100000, 'x');
  const absl::Status s = validate("  overrides:\n    - {layers: '" + huge + "'}\n");
  ExpectInvalid(s, {"precision.overrides[0].layers", "at most 256 bytes, got 100000"});
  EXPECT_LT(s.message().size(), 400u);
  // Out-of-range enum numbers (from a proto, not YAML) name the field.
  absl::StatusOr<v1::RunSpec> spec =
      Parse(OverrideSpec(dir.DataFile(), "  overrides:\n    - {layers: 'blocks.*'}\n"));
  ASSERT_TRUE(spec.ok()) << spec.status();
  spec->mutable_precision()->mutable_overrides(0)->set_scaling(
      static_cast<Precision::Scaling>(99));
  ExpectInvalid(ValidateRunSpec(*spec, 1), {"precision.overrides[0].scaling", "99"});
}


// health.action (issue 20 point 3): the words, and the checks of margin_step and promote_after.
TEST(HealthPolicySpecTest, ActionMarginStepAndPromoteAfter) {
  TempDir dir;
  const absl::StatusOr<v1::RunSpec> spec = Parse(absl::StrCat(
      MinimalSpec(dir.DataFile()),
      "health: {saturation_threshold: 0.001, action: raise_margin, margin_step: 3, "
      "promote_after: 5}\n"));
  ASSERT_TRUE(spec.ok()) << spec.status();
  EXPECT_EQ(spec->health().action(), v1::RunSpec::Health::ACTION_RAISE_MARGIN);
  EXPECT_EQ(spec->health().margin_step(), 3);
  EXPECT_EQ(spec->health().promote_after(), 5);
  EXPECT_TRUE(ValidateRunSpec(*spec, 1).ok()) << ValidateRunSpec(*spec, 1);
  // Unset: the older `demote` flag decides (the spec stays valid).
  const absl::StatusOr<v1::RunSpec> plain = Parse(MinimalSpec(dir.DataFile()));
  ASSERT_TRUE(plain.ok());
  EXPECT_EQ(plain->health().action(), v1::RunSpec::Health::ACTION_UNSPECIFIED);
  EXPECT_TRUE(ValidateRunSpec(*plain, 1).ok()) << ValidateRunSpec(*plain, 1);
  ExpectInvalid(Parse(MinimalSpec(dir.DataFile()) + "health: {action: panic}\n").status(),
                {"health.action: expected one of demote, raise_margin, block_scaling, report",
                 "'panic'"});
  ExpectInvalid(ValidateWith(dir, {"health.margin_step=40"}, 1), {"health.margin_step"});
  ExpectInvalid(ValidateWith(dir, {"health.promote_after=-1"}, 1), {"health.promote_after"});
  // block_scaling needs shapes block scaling can split, checked up front (d_model 128 split
  // over 2 tensor-parallel ranks leaves 64 columns, not a whole 128-wide block). FSDP shards are
  // no obstacle: the run is cut in 128-row blocks from the start (FsdpRowUnit).
  ExpectInvalid(ValidateWith(dir, {"health.action=block_scaling", "parallel.tp=2"}, 2),
                {"health.action", "block_scaling needs shapes block scaling can split"});
  EXPECT_TRUE(ValidateWith(dir, {"health.action=block_scaling", "parallel.dp=2"}, 2).ok());
}

}  // namespace
}  // namespace fp8rt
