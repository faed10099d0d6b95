// Tests of runtime/model/hf_weights.h against Hugging Face's layouts as their modeling code
// defines them (the expected element positions are written out here from those definitions, not
// taken from the converter):
//   - GPT-2: c_attn.weight[c, o] (Conv1D [in, out]) holds q for o < C, k for C <= o < 2C, v
//     after, head o % C / Dh; fp8rt's attn.qkv row for head h, part p, dim d is h*3Dh + p*Dh + d;
//     c_proj / c_fc are transposes;
//   - Llama: q_proj row h*Dh + d is fp8rt's row (h / Q)*(Q + 2)*Dh + (h % Q)*Dh + d; k_proj and
//     v_proj rows g*Dh + d are rows g*(Q + 2)*Dh + Q*Dh + d and + Dh;
//   - ToHuggingFace -> a safetensors file -> FromHuggingFace gives every parameter back bit for
//     bit (both families, tied and untied);
//   - a missing, unexpected or wrongly shaped tensor is refused naming the tensor; GPT-2's
//     attn.bias buffers are ignored; an architecture Hugging Face has no class for is refused
//     naming the field;
//   - weights in two shards with transformers' index load as the single file does; Llama's
//     rotary_emb.inv_freq buffers pass when they are rope_theta's and are refused naming it
//     otherwise;
//   - Mixtral: block_sparse_moe.gate is the router and experts.e.w1 / w3 / w2 are expert e's
//     gate / up / down, as they are; a rank's walk skips other ranks' experts but checks their
//     tensors; MoE outside llama, or not in every block, is refused naming the field;
//   - config.json carries the fields the classes read.
#include "runtime/model/hf_weights.h"

#include <bit>
#include <cmath>
#include <cstdint>
#include <fstream>
#include <functional>
#include <map>
#include <random>
#include <set>
#include <span>
#include <string>
#include <tuple>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "nlohmann/json.hpp"
#include "runtime/core/safetensors.h"
#include "tests/support/hf_test_shapes.h"
#include "tests/support/test_support.h"

namespace fp8rt::model {
namespace {

using test::TempDir;
using ::testing::AllOf;
using ::testing::HasSubstr;

ModelShape Base() { return test::HfBaseShape(); }
ModelShape Gpt2() { return test::HfGpt2Shape(); }
ModelShape Llama(bool tie) { return test::HfLlamaShape(tie); }
// Llama with an MoE MLP of 3 experts (top 2) in every block: Mixtral.
ModelShape Mixtral() { return test::HfMixtralShape(3); }

std::map<std::string, LogicalShape> Shapes(const ModelShape& s) { return test::HfParamShapes(s); }

LogicalParams Random(const std::map<std::string, LogicalShape>& shapes) {
  std::mt19937 rng(5);
  std::normal_distribution<float> normal;
  LogicalParams p;
  for (const auto& [name, s] : shapes) {
    std::vector<float>& v = p[name];
    v.resize(static_cast<size_t>(s.rows * s.cols));
    for (float& x : v) x = normal(rng);
  }
  return p;
}

const HfTensor& Find(const std::vector<HfTensor>& ts, const std::string& name) {
  for (const HfTensor& t : ts) {
    if (t.name == name) return t;
  }
  ADD_FAILURE() << "no tensor " << name;
  return ts.front();
}

std::string WriteFile(const TempDir& dir, const std::vector<HfTensor>& ts,
                      const std::string& name = "m.safetensors") {
  std::vector<SafetensorsWriteTensor> w;
  for (const HfTensor& t : ts) {
    w.push_back({.name = t.name,
                 .dtype = SafetensorsDtype::kF32,
                 .shape = t.shape,
                 .data = t.values.data()});
  }
  const std::string path = (dir / name).string();
  EXPECT_TRUE(WriteSafetensors(path, w, {}).ok());
  return path;
}

TEST(HfWeightsTest, Gpt2LayoutIsConv1DWithQkvAlongOut) {
  const ModelShape s = Gpt2();
  const auto shapes = Shapes(s);
  const LogicalParams p = Random(shapes);
  const absl::StatusOr<std::vector<HfTensor>> ts = ToHuggingFace(s, shapes, p);
  ASSERT_TRUE(ts.ok()) << ts.status();
  const int64_t c = 16, dh = 4, f = 24;
  const HfTensor& attn = Find(*ts, "transformer.h.1.attn.c_attn.weight");
  EXPECT_EQ(attn.shape, (std::vector<int64_t>{c, 3 * c}));
  const std::vector<float>& qkv = p.at("blocks.1.attn.qkv/weight");
  for (int64_t row = 0; row < c; ++row) {
    for (int64_t o = 0; o < 3 * c; ++o) {
      const int64_t part = o / c, head = o % c / dh, d = o % dh;
      const int64_t ours = head * 3 * dh + part * dh + d;
      ASSERT_EQ(attn.values[static_cast<size_t>(row * 3 * c + o)],
                qkv[static_cast<size_t>(ours * c + row)])
          << row << ", " << o;
    }
  }
  const HfTensor& bias = Find(*ts, "transformer.h.1.attn.c_attn.bias");
  EXPECT_EQ(bias.values[static_cast<size_t>(c + 5)],  // k of head 1, dim 1
            p.at("blocks.1.attn.qkv/bias")[static_cast<size_t>(1 * 3 * dh + dh + 1)]);
  const HfTensor& fc = Find(*ts, "transformer.h.0.mlp.c_fc.weight");
  EXPECT_EQ(fc.shape, (std::vector<int64_t>{c, f}));
  EXPECT_EQ(fc.values[static_cast<size_t>(3 * f + 7)],  // [in 3, out 7] = fc1[7, 3]
            p.at("blocks.0.mlp.fc1/weight")[static_cast<size_t>(7 * c + 3)]);
  EXPECT_EQ(Find(*ts, "transformer.wpe.weight").values, p.at("positions/weight"));
  EXPECT_EQ(Find(*ts, "transformer.ln_f.bias").values, p.at("final_norm/bias"));
  for (const HfTensor& t : *ts) EXPECT_NE(t.name, "lm_head.weight");  // tied to wte
}

TEST(HfWeightsTest, LlamaQkvRowsAreRegroupedFromKvGroups) {
  const ModelShape s = Llama(false);
  const auto shapes = Shapes(s);
  const LogicalParams p = Random(shapes);
  const absl::StatusOr<std::vector<HfTensor>> ts = ToHuggingFace(s, shapes, p);
  ASSERT_TRUE(ts.ok()) << ts.status();
  const int64_t c = 16, dh = 4, q_per_kv = 2, group = (q_per_kv + 2) * dh;
  const std::vector<float>& qkv = p.at("blocks.0.attn.qkv/weight");
  const HfTensor& q = Find(*ts, "model.layers.0.self_attn.q_proj.weight");
  const HfTensor& k = Find(*ts, "model.layers.0.self_attn.k_proj.weight");
  const HfTensor& v = Find(*ts, "model.layers.0.self_attn.v_proj.weight");
  EXPECT_EQ(q.shape, (std::vector<int64_t>{4 * dh, c}));
  EXPECT_EQ(k.shape, (std::vector<int64_t>{2 * dh, c}));
  for (int64_t r = 0; r < 4 * dh; ++r) {
    const int64_t h = r / dh, d = r % dh;
    const int64_t ours = h / q_per_kv * group + h % q_per_kv * dh + d;
    for (int64_t col = 0; col < c; ++col) {
      ASSERT_EQ(q.values[static_cast<size_t>(r * c + col)],
                qkv[static_cast<size_t>(ours * c + col)]);
    }
  }
  for (int64_t r = 0; r < 2 * dh; ++r) {
    const int64_t g = r / dh, d = r % dh;
    for (int64_t col = 0; col < c; ++col) {
      ASSERT_EQ(k.values[static_cast<size_t>(r * c + col)],
                qkv[static_cast<size_t>((g * group + q_per_kv * dh + d) * c + col)]);
      ASSERT_EQ(v.values[static_cast<size_t>(r * c + col)],
                qkv[static_cast<size_t>((g * group + (q_per_kv + 1) * dh + d) * c + col)]);
    }
  }
  EXPECT_EQ(Find(*ts, "model.layers.1.mlp.down_proj.weight").values,
            p.at("blocks.1.mlp.down/weight"));
  EXPECT_EQ(Find(*ts, "lm_head.weight").values, p.at("lm_head/weight"));
}

TEST(HfWeightsTest, FileRoundTripIsBitForBit) {
  TempDir dir;
  for (const ModelShape& s : {Gpt2(), Llama(false), Llama(true)}) {
    const auto shapes = Shapes(s);
    const LogicalParams p = Random(shapes);
    const absl::StatusOr<std::vector<HfTensor>> ts = ToHuggingFace(s, shapes, p);
    ASSERT_TRUE(ts.ok()) << ts.status();
    absl::StatusOr<SafetensorsFile> file = SafetensorsFile::Read(WriteFile(dir, *ts));
    ASSERT_TRUE(file.ok()) << file.status();
    const absl::StatusOr<LogicalParams> back =
        FromHuggingFace(s, shapes, SafetensorsSet::Of(*std::move(file)));
    ASSERT_TRUE(back.ok()) << back.status();
    EXPECT_EQ(*back, p);
  }
}

TEST(HfWeightsTest, MissingUnexpectedAndMisshapenTensorsAreNamed) {
  TempDir dir;
  const ModelShape s = Gpt2();
  const auto shapes = Shapes(s);
  const absl::StatusOr<std::vector<HfTensor>> good = ToHuggingFace(s, shapes, Random(shapes));
  ASSERT_TRUE(good.ok());
  auto load = [&](const std::vector<HfTensor>& ts) {
    absl::StatusOr<SafetensorsFile> file = SafetensorsFile::Read(WriteFile(dir, ts));
    EXPECT_TRUE(file.ok()) << file.status();
    return FromHuggingFace(s, shapes, SafetensorsSet::Of(*std::move(file))).status();
  };
  std::vector<HfTensor> missing = *good;
  missing.erase(missing.begin() + 3);
  const absl::Status m = load(missing);
  EXPECT_EQ(m.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(m.message(), HasSubstr((*good)[3].name));
  EXPECT_THAT(m.message(), HasSubstr("missing"));

  std::vector<HfTensor> extra = *good;
  extra.push_back({"transformer.h.9.mlp.c_fc.weight", {2}, {1.0f, 2.0f}});
  const absl::Status e = load(extra);
  EXPECT_EQ(e.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(e.message(), HasSubstr("transformer.h.9.mlp.c_fc.weight"));

  std::vector<HfTensor> buffers = *good;  // GPT-2's causal-mask buffers are not parameters
  buffers.push_back({"transformer.h.0.attn.bias", {1}, {1.0f}});
  buffers.push_back({"transformer.h.0.attn.masked_bias", {1}, {-1e4f}});
  EXPECT_TRUE(load(buffers).ok());

  std::vector<HfTensor> shape = *good;
  for (HfTensor& t : shape) {
    if (t.name == "transformer.wte.weight") {
      t.shape = {16, 32};  // transposed
    }
  }
  const absl::Status w = load(shape);
  EXPECT_EQ(w.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(w.message(), HasSubstr("transformer.wte.weight"));
}

// A model saved in shards (two files and transformers' index) loads the same parameters, bit for
// bit, as the single file.
TEST(HfWeightsTest, ShardedFilesLoadLikeOneFile) {
  TempDir dir;
  const ModelShape s = Llama(false);
  const auto shapes = Shapes(s);
  const LogicalParams p = Random(shapes);
  const absl::StatusOr<std::vector<HfTensor>> ts = ToHuggingFace(s, shapes, p);
  ASSERT_TRUE(ts.ok()) << ts.status();
  const size_t half = ts->size() / 2;
  const std::vector<HfTensor> first(ts->begin(), ts->begin() + static_cast<long>(half));
  const std::vector<HfTensor> second(ts->begin() + static_cast<long>(half), ts->end());
  WriteFile(dir, first, "model-00001-of-00002.safetensors");
  WriteFile(dir, second, "model-00002-of-00002.safetensors");
  nlohmann::json index;
  index["metadata"] = {{"total_size", 0}};
  for (const HfTensor& t : first) index["weight_map"][t.name] = "model-00001-of-00002.safetensors";
  for (const HfTensor& t : second) index["weight_map"][t.name] = "model-00002-of-00002.safetensors";
  {
    std::ofstream out(dir / "model.safetensors.index.json");
    out << index.dump(2);
  }
  absl::StatusOr<SafetensorsSet> set = SafetensorsSet::Open(dir.path().string());
  ASSERT_TRUE(set.ok()) << set.status();
  ASSERT_EQ(set->files().size(), 2u);
  const absl::StatusOr<LogicalParams> back = FromHuggingFace(s, shapes, *set);
  ASSERT_TRUE(back.ok()) << back.status();
  EXPECT_EQ(*back, p);
}

// The original gpt2 checkpoint (and any file saved from GPT2Model or LlamaModel) names its tensors
// without the LM class's prefix: "wte.weight", "h.0.attn.c_attn.weight", "h.0.attn.bias" (the
// mask buffer); "embed_tokens.weight", "layers.0.self_attn.rotary_emb.inv_freq". Such a file
// loads as the prefixed one does; a file mixing both ways is refused, naming a tensor.
TEST(HfWeightsTest, BaseModelNamesWithoutThePrefixRead) {
  for (const ModelShape& s : {Gpt2(), Llama(true)}) {
    const bool gpt2 = s.norm == NormKind::kLayer;
    const std::string prefix = gpt2 ? "transformer." : "model.";
    SCOPED_TRACE(prefix);
    const auto shapes = Shapes(s);
    const LogicalParams p = Random(shapes);
    absl::StatusOr<std::vector<HfTensor>> ts = ToHuggingFace(s, shapes, p);
    ASSERT_TRUE(ts.ok()) << ts.status();
    std::vector<HfTensor> bare;
    for (const HfTensor& t : *ts) {
      ASSERT_TRUE(t.name.starts_with(prefix)) << t.name;
      bare.push_back({t.name.substr(prefix.size()), t.shape, t.values});
    }
    if (gpt2) {
      bare.push_back({"h.0.attn.bias", {1, 1, 8, 8}, std::vector<float>(64, 1.0f)});
    } else {
      const int64_t half = s.head_dim() / 2;
      std::vector<float> inv(static_cast<size_t>(half));
      for (int64_t i = 0; i < half; ++i) {
        inv[static_cast<size_t>(i)] = 1.0f / std::pow(10000.0f, 2.0f * i / s.head_dim());
      }
      bare.push_back({"layers.1.self_attn.rotary_emb.inv_freq", {half}, inv});
    }
    TempDir dir;
    absl::StatusOr<SafetensorsSet> set = SafetensorsSet::Open(WriteFile(dir, bare));
    ASSERT_TRUE(set.ok()) << set.status();
    const absl::StatusOr<LogicalParams> back = FromHuggingFace(s, shapes, *set);
    ASSERT_TRUE(back.ok()) << back.status();
    EXPECT_EQ(*back, p);
    // One tensor with the prefix among bare ones: not a parameter of the bare layout.
    std::vector<HfTensor> mixed = bare;
    mixed[1].name = prefix + mixed[1].name;
    absl::StatusOr<SafetensorsSet> mixed_set =
        SafetensorsSet::Open(WriteFile(dir, mixed, "mixed.safetensors"));
    ASSERT_TRUE(mixed_set.ok()) << mixed_set.status();
    EXPECT_THAT(FromHuggingFace(s, shapes, *mixed_set).status().message(),
                AllOf(HasSubstr(mixed[1].name), HasSubstr("is not a parameter of this model")));
  }
}

// ForEachHfParam checks everything before it hands out the first parameter: a tensor of the
// wrong shape that comes late in name order (model.norm.weight sets final_norm/weight, after
// every blocks.* parameter) fails the walk with fn never called, so nothing of the model is set.
TEST(HfWeightsTest, AWalkThatWouldFailLateSetsNothing) {
  TempDir dir;
  const ModelShape s = Llama(false);
  const auto shapes = Shapes(s);
  absl::StatusOr<std::vector<HfTensor>> ts = ToHuggingFace(s, shapes, Random(shapes));
  ASSERT_TRUE(ts.ok());
  for (HfTensor& t : *ts) {
    if (t.name == "model.norm.weight") {
      t.shape = {2, 8};  // 16 values, the wrong shape
    }
  }
  absl::StatusOr<SafetensorsFile> file = SafetensorsFile::Read(WriteFile(dir, *ts));
  ASSERT_TRUE(file.ok()) << file.status();
  int calls = 0;
  const absl::Status st = ForEachHfParam(s, shapes, SafetensorsSet::Of(*std::move(file)),
                                         [&](const std::string&, std::span<const float>) {
                                           ++calls;
                                           return absl::OkStatus();
                                         });
  EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(st.message()), HasSubstr("'model.norm.weight' has shape [2, 8]"));
  EXPECT_EQ(calls, 0);
  // The same file with the right shape walks every parameter once, in name order.
  for (HfTensor& t : *ts) {
    if (t.name == "model.norm.weight") t.shape = {16};
  }
  absl::StatusOr<SafetensorsFile> fixed = SafetensorsFile::Read(WriteFile(dir, *ts));
  ASSERT_TRUE(fixed.ok()) << fixed.status();
  std::vector<std::string> seen;
  ASSERT_TRUE(ForEachHfParam(s, shapes, SafetensorsSet::Of(*std::move(fixed)),
                             [&](const std::string& name, std::span<const float> v) {
                               seen.push_back(name);
                               EXPECT_EQ(static_cast<int64_t>(v.size()),
                                         shapes.at(name).rows * shapes.at(name).cols);
                               return absl::OkStatus();
                             })
                  .ok());
  std::vector<std::string> names;
  for (const auto& [name, shape] : shapes) names.push_back(name);
  EXPECT_EQ(seen, names);
}

// Older transformers saved Llama's RoPE frequencies, model.layers.N.self_attn.rotary_emb.inv_freq
// = 1 / theta^(2i / head_dim) (torch, FP32; rounded to F16 or BF16 when the model was cast).
// They are no parameter: let through when they are the spec's rope_theta's to the precision of
// their dtype, refused naming model.rope_theta when they are another's (Llama 3 uses 500000), and
// a layer the model does not have is an unexpected tensor.
TEST(HfWeightsTest, LlamaRopeFrequencyBuffersMustMatchRopeTheta) {
  TempDir dir;
  const ModelShape s = Llama(true);
  const auto shapes = Shapes(s);
  const absl::StatusOr<std::vector<HfTensor>> good = ToHuggingFace(s, shapes, Random(shapes));
  ASSERT_TRUE(good.ok());
  auto with_inv_freq = [&](double theta, SafetensorsDtype dtype, int64_t layers) {
    const int64_t dh = s.head_dim();
    std::vector<SafetensorsWriteTensor> w;
    for (const HfTensor& t : *good) {
      w.push_back({.name = t.name,
                   .dtype = SafetensorsDtype::kF32,
                   .shape = t.shape,
                   .data = t.values.data()});
    }
    // Each buffer's values from the definition in double, rounded once to the dtype (F32, or F16
    // through the compiler's _Float16, or BF16 by round-to-nearest-even on the FP32 bits).
    std::vector<std::vector<float>> f32(static_cast<size_t>(layers));
    std::vector<std::vector<uint16_t>> h16(static_cast<size_t>(layers));
    for (int64_t l = 0; l < layers; ++l) {
      const size_t li = static_cast<size_t>(l);
      for (int64_t i = 0; i < dh / 2; ++i) {
        const double v =
            1.0 / std::pow(theta, 2.0 * static_cast<double>(i) / static_cast<double>(dh));
        f32[li].push_back(static_cast<float>(v));
        if (dtype == SafetensorsDtype::kF16) {
          h16[li].push_back(std::bit_cast<uint16_t>(static_cast<_Float16>(v)));
        } else {
          const uint32_t b = std::bit_cast<uint32_t>(static_cast<float>(v));
          h16[li].push_back(static_cast<uint16_t>((b + 0x7fffu + ((b >> 16) & 1u)) >> 16));
        }
      }
      const void* data = dtype == SafetensorsDtype::kF32 ? static_cast<const void*>(f32[li].data())
                                                         : static_cast<const void*>(h16[li].data());
      w.push_back({.name = "model.layers." + std::to_string(l) + ".self_attn.rotary_emb.inv_freq",
                   .dtype = dtype,
                   .shape = {dh / 2},
                   .data = data});
    }
    const std::string path = (dir / "inv_freq.safetensors").string();
    EXPECT_TRUE(WriteSafetensors(path, w, {}).ok());
    absl::StatusOr<SafetensorsFile> file = SafetensorsFile::Read(path);
    EXPECT_TRUE(file.ok()) << file.status();
    return FromHuggingFace(s, shapes, SafetensorsSet::Of(*std::move(file))).status();
  };
  ASSERT_EQ(s.rope_theta, 10000.0f);
  for (const SafetensorsDtype dtype :
       {SafetensorsDtype::kF32, SafetensorsDtype::kF16, SafetensorsDtype::kBF16}) {
    SCOPED_TRACE(std::string(SafetensorsDtypeName(dtype)));
    const absl::Status same = with_inv_freq(10000.0, dtype, s.layers);
    EXPECT_TRUE(same.ok()) << same;
    const absl::Status other = with_inv_freq(500000.0, dtype, s.layers);
    EXPECT_EQ(other.code(), absl::StatusCode::kInvalidArgument);
    EXPECT_THAT(std::string(other.message()),
                AllOf(HasSubstr("model.layers.0.self_attn.rotary_emb.inv_freq"),
                      HasSubstr("model.rope_theta 10000"), HasSubstr("another rope_theta")));
  }
  const absl::Status extra = with_inv_freq(10000.0, SafetensorsDtype::kF32, s.layers + 1);
  EXPECT_EQ(extra.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(extra.message()),
              AllOf(HasSubstr("model.layers.2.self_attn.rotary_emb.inv_freq"),
                    HasSubstr("is not a parameter of this model")));
}

// Mixtral (modeling_mixtral.py): block_sparse_moe.gate is a Linear(C, E) without bias, so its
// weight [E, C] is the router's as it is; expert e's w1, w3 (Linear(C, F)) and w2 (Linear(F, C))
// are its gate, up and down projections, [out, in] as fp8rt's. The dense parts are Llama's.
TEST(HfWeightsTest, MixtralRouterAndExpertsAreCopiedAsTheyAre) {
  const ModelShape s = Mixtral();
  const auto shapes = Shapes(s);
  const LogicalParams p = Random(shapes);
  const absl::StatusOr<std::vector<HfTensor>> ts = ToHuggingFace(s, shapes, p);
  ASSERT_TRUE(ts.ok()) << ts.status();
  // Per layer: 2 norms, q, k, v, o, the router and 3 per expert; then embed, norm, lm_head.
  EXPECT_EQ(ts->size(), static_cast<size_t>(2 * (7 + 3 * 3) + 3));
  for (const HfTensor& t : *ts) EXPECT_EQ(t.name.find("mlp."), std::string::npos) << t.name;
  const HfTensor& gate = Find(*ts, "model.layers.1.block_sparse_moe.gate.weight");
  EXPECT_EQ(gate.shape, (std::vector<int64_t>{3, 16}));
  EXPECT_EQ(gate.values, p.at("blocks.1.mlp.router/weight"));
  using Expert = std::tuple<const char*, const char*, std::vector<int64_t>>;
  for (const auto& [w, ours, shape] : {Expert{"w1", "gate", {24, 16}}, Expert{"w3", "up", {24, 16}},
                                       Expert{"w2", "down", {16, 24}}}) {
    const HfTensor& t =
        Find(*ts, std::string("model.layers.0.block_sparse_moe.experts.2.") + w + ".weight");
    EXPECT_EQ(t.shape, shape) << w;
    EXPECT_EQ(t.values, p.at(std::string("blocks.0.mlp.experts.2.") + ours + "/weight")) << w;
  }
  // The file reads back bit for bit.
  TempDir dir;
  const std::string path = WriteFile(dir, *ts);
  absl::StatusOr<SafetensorsSet> set = SafetensorsSet::Open(path);
  ASSERT_TRUE(set.ok()) << set.status();
  const absl::StatusOr<LogicalParams> back = FromHuggingFace(s, shapes, *set);
  ASSERT_TRUE(back.ok()) << back.status();
  EXPECT_EQ(*back, p);
}

// A rank of an expert-parallel run holds its own experts only: the walk converts every parameter
// the rank has, skips the other ranks' experts, and still checks their tensors (a file missing one
// is refused on every rank alike, naming it).
TEST(HfWeightsTest, MixtralExpertsOfOtherRanksAreCheckedNotConverted) {
  const ModelShape s = Mixtral();
  const auto all = Shapes(s);
  const LogicalParams p = Random(all);
  std::map<std::string, LogicalShape> mine = all;
  for (const auto& [name, shape] : all) {
    if (name.find(".experts.1.") != std::string::npos) mine.erase(name);
  }
  ASSERT_EQ(mine.size() + 2 * 3, all.size());
  absl::StatusOr<std::vector<HfTensor>> ts = ToHuggingFace(s, all, p);
  ASSERT_TRUE(ts.ok()) << ts.status();
  TempDir dir;
  absl::StatusOr<SafetensorsSet> set = SafetensorsSet::Open(WriteFile(dir, *ts));
  ASSERT_TRUE(set.ok()) << set.status();
  std::set<std::string> seen;
  const absl::Status walked =
      ForEachHfParam(s, mine, *set, [&](const std::string& name, std::span<const float> v) {
        seen.insert(name);
        EXPECT_EQ(std::vector<float>(v.begin(), v.end()), p.at(name)) << name;
        return absl::OkStatus();
      });
  ASSERT_TRUE(walked.ok()) << walked;
  std::set<std::string> want;
  for (const auto& [name, shape] : mine) want.insert(name);
  EXPECT_EQ(seen, want);

  std::vector<HfTensor> without;
  for (HfTensor& t : *ts) {
    if (t.name != "model.layers.1.block_sparse_moe.experts.1.w2.weight") without.push_back(t);
  }
  absl::StatusOr<SafetensorsSet> short_set =
      SafetensorsSet::Open(WriteFile(dir, without, "b.safetensors"));
  ASSERT_TRUE(short_set.ok()) << short_set.status();
  int calls = 0;
  const absl::Status refused = ForEachHfParam(s, mine, *short_set, [&](auto&&...) {
    ++calls;
    return absl::OkStatus();
  });
  EXPECT_THAT(refused.message(),
              AllOf(HasSubstr("model.layers.1.block_sparse_moe.experts.1.w2.weight"),
                    HasSubstr("is missing"), HasSubstr("blocks.1.mlp.experts.1.down/weight")));
  EXPECT_EQ(calls, 0);
}

TEST(HfWeightsTest, ArchitecturesWithoutAHuggingFaceClassAreRefusedNamingTheField) {
  const ModelShape plain = Base();
  EXPECT_THAT(CheckHfArchitecture(plain).message(), HasSubstr("model.family"));
  ModelShape g = Gpt2();
  g.tie_embeddings = false;
  EXPECT_THAT(CheckHfArchitecture(g).message(), HasSubstr("model.tie_embeddings"));
  ModelShape l = Llama(false);
  l.bias = true;
  EXPECT_THAT(CheckHfArchitecture(l).message(), HasSubstr("model.bias"));
  EXPECT_EQ(ToHuggingFace(l, Shapes(Llama(false)), {}).status().code(),
            absl::StatusCode::kInvalidArgument);
  // MoE: only as Mixtral, llama with MoE in every block.
  ModelShape gm = Gpt2();
  gm.moe.experts = 4;
  EXPECT_THAT(CheckHfArchitecture(gm).message(), HasSubstr("moe.experts"));
  ModelShape pm = Base();
  pm.moe.experts = 4;
  EXPECT_THAT(CheckHfArchitecture(pm).message(), HasSubstr("moe.experts"));
  ModelShape half = Mixtral();
  half.moe_every = 2;
  EXPECT_THAT(CheckHfArchitecture(half).message(),
              AllOf(HasSubstr("moe.every"), HasSubstr("one block of every 2"),
                    HasSubstr("MixtralForCausalLM")));
  ModelShape biased = Mixtral();  // llama with MoE, but with biases: the field that differs
  biased.bias = true;
  EXPECT_THAT(CheckHfArchitecture(biased).message(), HasSubstr("model.bias"));
  EXPECT_TRUE(CheckHfArchitecture(Mixtral()).ok());
  // A Mixtral file with more experts than the spec: the surplus expert is named, with the count.
  const ModelShape four = [] {
    ModelShape m = Mixtral();
    m.moe.experts = 4;
    return m;
  }();
  const auto four_shapes = Shapes(four);
  absl::StatusOr<std::vector<HfTensor>> ts = ToHuggingFace(four, four_shapes, Random(four_shapes));
  ASSERT_TRUE(ts.ok()) << ts.status();
  TempDir dir;
  absl::StatusOr<SafetensorsSet> set = SafetensorsSet::Open(WriteFile(dir, *ts));
  ASSERT_TRUE(set.ok()) << set.status();
  EXPECT_THAT(FromHuggingFace(Mixtral(), Shapes(Mixtral()), *set).status().message(),
              AllOf(HasSubstr("experts.3."), HasSubstr("is not a parameter of this model"),
                    HasSubstr("mixtral, 3 experts")));
}

// CheckHfConfig (init.from's check of config.json): what HfConfigJson writes passes for its own
// shape; every key that changes the forward, changed, is refused naming the key and the spec's
// field; a key left out takes transformers' default for the class (LlamaConfig: rope_theta 1e4,
// rms_norm_eps 1e-6; GPT2Config: n_inner null = 4 n_embd; MixtralConfig: 8 experts).
TEST(HfWeightsTest, ConfigJsonMustDescribeTheModel) {
  for (const ModelShape& s : {Gpt2(), Llama(true), Llama(false), Mixtral()}) {
    const absl::StatusOr<std::string> text = HfConfigJson(s, "float32");
    ASSERT_TRUE(text.ok()) << text.status();
    const absl::Status ok = CheckHfConfig(s, *text, "c/config.json");
    EXPECT_TRUE(ok.ok()) << ok;
  }
  // `edit` applied to shape's own config.json: refused with every one of `want`, or accepted.
  auto check = [](const ModelShape& s, const std::function<void(nlohmann::json&)>& edit) {
    nlohmann::json j = nlohmann::json::parse(*HfConfigJson(s, "float32"));
    edit(j);
    return CheckHfConfig(s, j.dump(), "c/config.json");
  };
  using J = nlohmann::json;
  struct Case {
    ModelShape shape;
    std::function<void(J&)> edit;
    std::vector<std::string> want;  // empty: accepted
  };
  const std::vector<Case> cases = {
      {Llama(false),
       [](J& j) { j["rope_theta"] = 500000.0; },
       {"c/config.json: rope_theta is 500000.0", "model.rope_theta is 10000.0",
        "init.ignore_config"}},
      {Llama(false), [](J& j) { j["rms_norm_eps"] = 1e-6; }, {"rms_norm_eps", "model.norm_eps"}},
      {Llama(false), [](J& j) { j["num_key_value_heads"] = 4; }, {"model.kv_heads is 2"}},
      {Llama(false), [](J& j) { j["hidden_act"] = "gelu"; }, {"hidden_act is 'gelu'", "model.mlp"}},
      {Llama(false), [](J& j) { j["tie_word_embeddings"] = true; }, {"model.tie_embeddings"}},
      {Llama(false), [](J& j) { j["intermediate_size"] = 48; }, {"intermediate_size is 48"}},
      {Llama(false), [](J& j) { j["head_dim"] = 8; }, {"head_dim is 8"}},
      {Llama(false), [](J& j) { j["attention_bias"] = true; }, {"attention_bias", "model.bias"}},
      {Llama(false),
       [](J& j) { j["model_type"] = "qwen2"; },
       {"model_type is 'qwen2'", "llama also reads mistral"}},
      {Llama(false),
       [](J& j) {
         j["rope_scaling"] = {{"type", "linear"}, {"factor", 2.0}};
       },
       {"rope_scaling has rope type 'linear'", "no scaling"}},
      {Llama(false),
       [](J& j) {
         j["rope_scaling"] = {{"rope_type", "default"}};
       },
       {}},
      {Llama(false), [](J& j) { j["head_dim"] = nullptr; }, {}},
      // Left out: transformers' defaults.
      {Llama(false),
       [](J& j) { j.erase("rms_norm_eps"); },
       {"rms_norm_eps is 1e-06 (transformers' default", "model.norm_eps is 1e-05"}},
      {Llama(false), [](J& j) { j.erase("num_key_value_heads"); }, {"num_key_value_heads is 4"}},
      {Llama(false), [](J& j) { j.erase("rope_theta"); }, {}},  // 10000, the spec's
      // transformers 5 keeps rope_theta in rope_parameters.
      {Llama(false),
       [](J& j) {
         j.erase("rope_theta");
         j["rope_parameters"] = {{"rope_type", "default"}, {"rope_theta", 10000.0}};
       },
       {}},
      {Llama(false),
       [](J& j) {
         j["rope_parameters"] = {{"rope_type", "yarn"}, {"factor", 4.0}};
       },
       {"rope_parameters has rope type 'yarn'"}},
      // transformers 5 takes "type" where "rope_type" is missing.
      {Llama(false),
       [](J& j) {
         j["rope_parameters"] = {{"type", "linear"}, {"factor", 4.0}};
       },
       {"rope_parameters has rope type 'linear'"}},
      // Both places give rope_theta: both must be the spec's.
      {Llama(false),
       [](J& j) {
         j["rope_parameters"] = {{"rope_type", "default"}, {"rope_theta", 500000.0}};
       },
       {"rope_parameters.rope_theta is 500000.0", "model.rope_theta is 10000.0"}},
      {Llama(false),
       [](J& j) {
         j.erase("rope_theta");
         j["rope_parameters"] = {{"rope_type", "default"}, {"rope_theta", 500000.0}};
       },
       {"rope_theta is 500000.0"}},
      // Null where the class reads its default; transformers' other names of the functions.
      {Llama(false),
       [](J& j) { j["num_key_value_heads"] = nullptr; },
       {"num_key_value_heads is 4"}},
      {Llama(true), [](J& j) { j["hidden_act"] = "swish"; }, {}},
      {Gpt2(), [](J& j) { j["activation_function"] = "gelu_fast"; }, {}},
      {Gpt2(), [](J& j) { j["n_inner"] = 48; }, {"n_inner is 48, but the spec's model.d_ff is 24"}},
      // GPT2Config's attribute_map: num_attention_heads is n_head.
      {Gpt2(),
       [](J& j) {
         j.erase("n_head");
         j["num_attention_heads"] = 2;
       },
       {"n_head is 2", "model.heads is 4"}},
      {Gpt2(),
       [](J& j) { j["num_attention_heads"] = 2; },
       {"n_head is 4, but its other name num_attention_heads is 2"}},
      {Mixtral(),
       [](J& j) {
         j.erase("num_local_experts");
         j["num_experts"] = 3;
       },
       {}},
      // The sizes and the rest, one each.
      {Llama(false), [](J& j) { j["vocab_size"] = 33; }, {"vocab_size is 33", "model.vocab is 32"}},
      {Llama(false), [](J& j) { j["hidden_size"] = 32; }, {"model.d_model is 16"}},
      {Llama(false), [](J& j) { j["num_hidden_layers"] = 3; }, {"model.layers is 2"}},
      {Llama(false), [](J& j) { j["num_attention_heads"] = 8; }, {"model.heads is 4"}},
      {Gpt2(), [](J& j) { j["layer_norm_epsilon"] = 1e-6; }, {"layer_norm_epsilon is 1e-06"}},
      {Gpt2(), [](J& j) { j["scale_attn_weights"] = false; }, {"scale_attn_weights is false"}},
      {Gpt2(), [](J& j) { j["tie_word_embeddings"] = false; }, {"model.tie_embeddings is true"}},
      {Gpt2(), [](J& j) { j.erase("model_type"); }, {"model_type is missing"}},
      {Gpt2(), [](J& j) { j["n_inner"] = nullptr; }, {"n_inner is 64", "model.d_ff is 24"}},
      {Gpt2(), [](J& j) { j["activation_function"] = "gelu_pytorch_tanh"; }, {}},
      {Gpt2(), [](J& j) { j["activation_function"] = "relu"; }, {"activation_function is 'relu'"}},
      {Gpt2(),
       [](J& j) { j["scale_attn_by_inverse_layer_idx"] = true; },
       {"scale_attn_by_inverse_layer_idx"}},
      {Gpt2(),
       [](J& j) { j["n_positions"] = 1024; },
       {"n_positions is 1024", "model.max_positions"}},
      {Mixtral(), [](J& j) { j["num_local_experts"] = 8; }, {"moe.experts is 3"}},
      {Mixtral(),
       [](J& j) {
         j.erase("num_experts_per_tok");
         j["num_experts_per_tok"] = 1;
       },
       {"moe.top_k is 2"}},
      {Mixtral(), [](J& j) { j.erase("num_local_experts"); }, {"num_local_experts is 8"}},
      {Mixtral(),
       [](J& j) { j["sliding_window"] = 4; },
       {"sliding_window is 4, shorter than the spec's model.seq_len 8"}},
      // Mistral: Llama with a window (4096 when left out), read where it masks nothing.
      {Llama(false), [](J& j) { j["model_type"] = "mistral"; }, {}},
      {Llama(false),
       [](J& j) {
         j["model_type"] = "mistral";
         j["sliding_window"] = 4;
       },
       {"sliding_window is 4"}},
      {Llama(false),
       [](J& j) {
         j["model_type"] = "mistral";
         j.erase("num_key_value_heads");
       },
       {"num_key_value_heads is 8"}},
      {Mixtral(), [](J& j) { j["model_type"] = "mistral"; }, {"model_type is 'mistral'"}},
      {Mixtral(), [](J& j) { j["sliding_window"] = 8; }, {}},
      {Mixtral(), [](J& j) { j["model_type"] = "llama"; }, {"model_type is 'llama'"}},
  };
  for (size_t i = 0; i < cases.size(); ++i) {
    SCOPED_TRACE(::testing::Message() << "case " << i);
    const absl::Status st = check(cases[i].shape, cases[i].edit);
    if (cases[i].want.empty()) {
      EXPECT_TRUE(st.ok()) << st;
      continue;
    }
    EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument) << st;
    for (const std::string& w : cases[i].want) EXPECT_THAT(st.message(), HasSubstr(w));
  }
  // Not an object, not JSON, a key twice, nesting past 64 levels (deeper input would take the
  // recursive code that prints a value past the stack): refused naming the file.
  EXPECT_THAT(CheckHfConfig(Llama(false), "[1, 2]", "c/config.json").message(),
              AllOf(HasSubstr("c/config.json: config.json does not start with '{'"),
                    HasSubstr("'[1, 2]'")));
  EXPECT_THAT(CheckHfConfig(Llama(false), R"({"model_type": NaN})", "c/config.json").message(),
              HasSubstr("c/config.json: config.json is not valid JSON (at byte"));
  EXPECT_THAT(CheckHfConfig(Llama(false), R"({"model_type": "llama", "model_type": "gpt2"})",
                            "c/config.json")
                  .message(),
              HasSubstr("has the key 'model_type' twice"));
  const std::string deep =
      R"({"model_type": )" + std::string(100000, '[') + std::string(100000, ']') + "}";
  EXPECT_THAT(CheckHfConfig(Llama(false), deep, "c/config.json").message(),
              HasSubstr("nests arrays and objects deeper than 64 levels"));
}

TEST(HfWeightsTest, ConfigJsonCarriesWhatTheClassesRead) {
  const absl::StatusOr<std::string> g = HfConfigJson(Gpt2(), "float32");
  ASSERT_TRUE(g.ok());
  const nlohmann::json gj = nlohmann::json::parse(*g);
  EXPECT_EQ(gj["model_type"], "gpt2");
  EXPECT_EQ(gj["architectures"][0], "GPT2LMHeadModel");
  EXPECT_EQ(gj["n_embd"], 16);
  EXPECT_EQ(gj["n_layer"], 2);
  EXPECT_EQ(gj["n_head"], 4);
  EXPECT_EQ(gj["n_positions"], 10);
  EXPECT_EQ(gj["n_inner"], 24);
  EXPECT_EQ(gj["activation_function"], "gelu_new");
  EXPECT_EQ(gj["layer_norm_epsilon"], 1e-5);
  EXPECT_EQ(gj["tie_word_embeddings"], true);
  const absl::StatusOr<std::string> l = HfConfigJson(Llama(false), "bfloat16");
  ASSERT_TRUE(l.ok());
  const nlohmann::json lj = nlohmann::json::parse(*l);
  EXPECT_EQ(lj["architectures"][0], "LlamaForCausalLM");
  EXPECT_EQ(lj["hidden_size"], 16);
  EXPECT_EQ(lj["intermediate_size"], 24);
  EXPECT_EQ(lj["num_attention_heads"], 4);
  EXPECT_EQ(lj["num_key_value_heads"], 2);
  EXPECT_EQ(lj["rms_norm_eps"], 1e-5);
  EXPECT_EQ(lj["rope_theta"], 10000.0);
  EXPECT_EQ(lj["tie_word_embeddings"], false);
  EXPECT_EQ(lj["torch_dtype"], "bfloat16");
  EXPECT_FALSE(lj.contains("num_local_experts"));
  const absl::StatusOr<std::string> m = HfConfigJson(Mixtral(), "float32");
  ASSERT_TRUE(m.ok()) << m.status();
  const nlohmann::json mj = nlohmann::json::parse(*m);
  EXPECT_EQ(mj["architectures"][0], "MixtralForCausalLM");
  EXPECT_EQ(mj["model_type"], "mixtral");
  EXPECT_EQ(mj["num_local_experts"], 3);
  EXPECT_EQ(mj["num_experts_per_tok"], 2);
  EXPECT_EQ(mj["router_aux_loss_coef"], 0.02);
  EXPECT_EQ(mj["output_router_logits"], false);
  EXPECT_TRUE(mj["sliding_window"].is_null());
  EXPECT_EQ(mj["num_key_value_heads"], 2);
  EXPECT_EQ(mj["intermediate_size"], 24);
  // No token is special: each class's default ids are overridden with null.
  for (const nlohmann::json* j : {&gj, &lj, &mj}) {
    for (const char* key : {"bos_token_id", "eos_token_id", "pad_token_id"}) {
      ASSERT_TRUE(j->contains(key)) << key << " in " << (*j)["model_type"];
      EXPECT_TRUE((*j)[key].is_null()) << key << " in " << (*j)["model_type"];
    }
  }
}

}  // namespace
}  // namespace fp8rt::model
