// LoadHuggingFace (runtime/worker/weights.h: init.from, --weights) into a model split over
// several ranks: each rank's FP32 master shards after loading a Hugging Face file are bit for bit
// the shards that Transformer::SetLogicalParams gives the same logical tensors, at every dp x tp
// layout of the world (2 ranks: dp2, tp2; 4 ranks: dp4, dp2 x tp2), for GPT-2 (Conv1D transposes,
// c_attn's q|k|v split, tied embeddings), Llama (grouped kv heads regrouped per TP rank, untied
// head) and Mixtral (experts over ep 1, 2 and 4 ranks: each rank loads its own experts, cut over
// its expert-data-parallel group), with the element-wise FSDP cut and with whole-row cuts whose
// last shards are padding.
//
// The file is written from logical tensors whose every element is a distinct function of its
// parameter and index (ToHuggingFace, then WriteSafetensors): a value set in the wrong place, a
// transpose missed or a TP piece taken from the wrong rows shows as a mismatch. Each shard is also
// checked element by element against the cut's definition, worked out here. The loaded model
// must also differ from its seeded start everywhere a seeded weight is non-zero, so the
// comparison cannot pass by both models keeping their initial values.
#include <stdlib.h>

#include <cstdint>
#include <filesystem>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"
#include "kernels/ops.h"
#include "parallel/mesh.h"
#include "runtime/core/safetensors.h"
#include "runtime/model/hf_weights.h"
#include "runtime/model/transformer.h"
#include "runtime/worker/weights.h"
#include "tests/mpi/mpi_test_env.h"
#include "tests/support/hf_test_shapes.h"

namespace fp8rt::worker {
namespace {

namespace fs = std::filesystem;
using model::LogicalParams;
using model::ModelShape;
using parallel::testing::AllRanksOk;
using parallel::testing::Factory;

ModelShape Gpt2() { return test::HfGpt2Shape(); }
ModelShape Llama() { return test::HfLlamaShape(/*tie=*/false); }
// 4 experts: ep 1, 2 and 4 divide them.
ModelShape Mixtral() { return test::HfMixtralShape(4); }

// Element i of parameter number p (in name order): distinct across the whole model, exact in FP32.
LogicalParams Distinct(const std::map<std::string, model::LogicalShape>& shapes) {
  LogicalParams params;
  int64_t p = 0;
  for (const auto& [name, shape] : shapes) {
    std::vector<float>& v = params[name];
    v.resize(static_cast<size_t>(shape.rows * shape.cols));
    for (size_t i = 0; i < v.size(); ++i) {
      v[i] = static_cast<float>((p + 1) * 4096 + static_cast<int64_t>(i)) / 1024.0f;
    }
    ++p;
  }
  return params;
}

// A private folder for this rank (every rank writes and reads its own copy of the file).
std::string RankDir() {
  std::string pattern = (fs::temp_directory_path() / "hf_load_test-XXXXXX").string();
  EXPECT_NE(mkdtemp(pattern.data()), nullptr) << pattern;
  return pattern;
}

std::unique_ptr<model::Transformer> Build(const ModelShape& shape, const model::ModelRecipe& recipe,
                                          parallel::Mesh& mesh) {
  auto m = model::Transformer::Create(shape, recipe, /*seed=*/11, mesh, kernels::CpuOps());
  EXPECT_TRUE(m.ok()) << m.status();
  return m.ok() ? std::move(*m) : nullptr;
}

// Element j of rank's FSDP shard of p, from the definition in transformer.h (Param, ShardCut):
// the shard holds elements [fsdp_rank * shard_count, +shard_count) of the row-major TP piece
// (local_rows x local_cols, rows tp_rank * local_rows on for a row split, columns likewise for a
// column split); past the piece it is padding, zero. This holds for both cuts: whole-row shards
// are shard_count = shard_rows * local_cols elements long.
float ShardValue(const model::Param& p, int tp_rank, const std::vector<float>& logical, int64_t j) {
  const int64_t flat = p.group->rank() * p.shard_count + j;
  if (flat >= p.local_rows * p.local_cols) return 0.0f;
  const int64_t r = flat / p.local_cols, c = flat % p.local_cols;
  const int64_t row0 = p.split == model::TpSplit::kRows ? tp_rank * p.local_rows : 0;
  const int64_t col0 = p.split == model::TpSplit::kCols ? tp_rank * p.local_cols : 0;
  return logical[static_cast<size_t>((row0 + r) * p.cols + col0 + c)];
}

struct Case {
  const char* name;
  ModelShape shape;
  int64_t row_unit;  // recipe.fsdp_row_unit: 0 element-wise, 8 whole rows (padding at dp 4)
};

class HfLoadTest : public ::testing::TestWithParam<Case> {};

TEST_P(HfLoadTest, ShardsEqualSetLogicalParamsAtEveryLayout) {
  const Case& c = GetParam();
  const int world = Factory().World().size();
  const std::string dir = RankDir();
  // Dense: tp 1 and 2. MoE (tp 1): experts over ep 1, 2 and every rank, each FSDP-cut over its
  // expert-data-parallel group; a rank holds its ep rank's experts only.
  std::vector<parallel::MeshConfig> layouts;
  if (c.shape.moe.experts == 0) {
    for (int tp = 1; tp <= 2 && tp <= world; ++tp) layouts.push_back({world / tp, tp, 1});
  } else {
    for (int ep : {1, 2, 4}) {
      if (ep <= world) layouts.push_back({world, 1, ep});
    }
  }
  std::map<std::string, model::LogicalShape> shapes;
  for (const parallel::MeshConfig& layout : layouts) {
    SCOPED_TRACE(absl::StrCat(c.name, " dp", layout.dp, " tp", layout.tp, " ep", layout.ep));
    auto mesh = parallel::Mesh::Create(layout, Factory());
    ASSERT_TRUE(AllRanksOk(mesh.ok())) << mesh.status();
    model::ModelRecipe recipe;  // FP8, tensor scaling: the GEMM weights cut in rows
    recipe.fsdp_row_unit = c.row_unit;
    std::unique_ptr<model::Transformer> loaded = Build(c.shape, recipe, **mesh);
    std::unique_ptr<model::Transformer> set = Build(c.shape, recipe, **mesh);
    ASSERT_TRUE(AllRanksOk(loaded != nullptr && set != nullptr));

    // Every parameter's shape, from the first layout (tp 1, ep 1: every expert on every rank).
    if (shapes.empty()) shapes = loaded->ParamShapes();
    const LogicalParams logical = Distinct(shapes);
    absl::StatusOr<std::vector<model::HfTensor>> hf =
        model::ToHuggingFace(c.shape, shapes, logical);
    ASSERT_TRUE(AllRanksOk(hf.ok())) << hf.status();
    std::vector<SafetensorsWriteTensor> tensors;
    for (const model::HfTensor& t : *hf) {
      tensors.push_back({.name = t.name,
                         .dtype = SafetensorsDtype::kF32,
                         .shape = t.shape,
                         .data = t.values.data()});
    }
    const std::string file = dir + "/model.safetensors";
    ASSERT_TRUE(AllRanksOk(WriteSafetensors(file, tensors, {{"format", "pt"}}).ok()));

    std::vector<std::vector<float>> seeded;
    for (model::Param& p : loaded->params()) seeded.emplace_back(p.master.begin(), p.master.end());
    const absl::Status load = LoadHuggingFace(file, c.shape, *loaded);
    EXPECT_TRUE(load.ok()) << load;
    const absl::Status direct = set->SetLogicalParams(logical);
    EXPECT_TRUE(direct.ok()) << direct;
    ASSERT_TRUE(AllRanksOk(load.ok() && direct.ok()));

    ASSERT_EQ(loaded->params().size(), set->params().size());
    const int tp_rank = (*mesh)->layout().tp_rank;
    int64_t compared = 0, moved = 0;
    for (size_t i = 0; i < loaded->params().size(); ++i) {
      const model::Param& a = loaded->params()[i];
      const model::Param& b = set->params()[i];
      ASSERT_EQ(a.name, b.name);
      ASSERT_EQ(a.master.size(), b.master.size()) << a.name;
      const std::vector<float>& want = logical.at(a.name);
      for (size_t j = 0; j < a.master.size(); ++j) {
        // Bit for bit: the values are exact, so == is the comparison (no NaNs here).
        EXPECT_EQ(a.master[j], b.master[j]) << a.name << " shard element " << j;
        EXPECT_EQ(a.master[j], ShardValue(a, tp_rank, want, static_cast<int64_t>(j)))
            << a.name << " shard element " << j;
        if (seeded[i][j] != 0.0f) moved += a.master[j] != seeded[i][j] ? 1 : 0;
        if (seeded[i][j] != 0.0f) ++compared;
      }
    }
    // Every seeded non-zero element was replaced by the file's value (the file's values are never
    // the seeded ones): the loader set every parameter this rank holds.
    EXPECT_GT(compared, 0);
    EXPECT_EQ(moved, compared);
    EXPECT_TRUE(AllRanksOk(!HasFailure()));
  }
  std::error_code ec;
  fs::remove_all(dir, ec);
}

INSTANTIATE_TEST_SUITE_P(
    Families, HfLoadTest,
    ::testing::Values(Case{"gpt2", Gpt2(), 0}, Case{"gpt2_rows", Gpt2(), 8},
                      Case{"llama", Llama(), 0}, Case{"llama_rows", Llama(), 8},
                      Case{"mixtral", Mixtral(), 0}, Case{"mixtral_rows", Mixtral(), 8}),
    [](const ::testing::TestParamInfo<Case>& info) { return std::string(info.param.name); });

}  // namespace
}  // namespace fp8rt::worker
