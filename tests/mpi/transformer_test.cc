// The transformer's backward, checked against the loss itself: central finite differences of
// the FP32 model (1 rank, and tensor-parallel over 2 ranks, where a weight piece lives on one rank
// and replicated parameters on all), and the FP8 gradients (tensor and block scaling, both
// formats) against the FP32 gradients of the same weights and tokens.
#include "runtime/model/transformer.h"

#include <cmath>
#include <cstdint>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "gtest/gtest.h"
#include "kernels/ops.h"
#include "parallel/mesh.h"
#include "tests/mpi/mpi_test_env.h"

namespace fp8rt::model {
namespace {

using parallel::testing::AllRanksOk;
using parallel::testing::Factory;

struct ModelUnderTest {
  std::unique_ptr<parallel::Mesh> mesh;
  std::unique_ptr<Transformer> model;
  std::vector<int32_t> tokens;
  int64_t micro_batch = 2;
};

ModelUnderTest Make(const ModelShape& shape, const ModelRecipe& recipe) {
  ModelUnderTest s;
  const int world = Factory().World().size();
  auto mesh = parallel::Mesh::Create({.dp = 1, .tp = world, .ep = 1}, Factory());
  EXPECT_TRUE(mesh.ok()) << mesh.status();
  s.mesh = std::move(*mesh);
  auto model = Transformer::Create(shape, recipe, /*seed=*/7, *s.mesh, kernels::CpuOps());
  EXPECT_TRUE(model.ok()) << model.status();
  s.model = std::move(*model);
  std::mt19937 rng(3);  // the same tokens on every rank
  s.tokens.resize(static_cast<size_t>(s.micro_batch * (shape.seq_len + 1)));
  for (int32_t& t : s.tokens) t = static_cast<int32_t>(rng() % static_cast<uint32_t>(shape.vocab));
  return s;
}

double Loss(ModelUnderTest& s) {
  absl::StatusOr<float> loss = s.model->ForwardBackward(s.tokens, s.micro_batch, 1.0f);
  EXPECT_TRUE(loss.ok()) << loss.status();
  return loss.ok() ? *loss : NAN;
}

TEST(TransformerTest, Fp32GradientsMatchFiniteDifferences) {
  const ModelShape shape{
      .layers = 2, .d_model = 32, .heads = 4, .d_ff = 64, .seq_len = 8, .vocab = 256};
  ModelRecipe recipe;
  recipe.precision = GemmPrecision::kFp32;
  ModelUnderTest s = Make(shape, recipe);
  ASSERT_TRUE(s.model->BeginStep().ok());
  Loss(s);  // fills full_grad with dL/dw (dloss 1)
  std::vector<std::vector<float>> grads;
  for (Param& p : s.model->params()) grads.push_back(p.full_grad);

  const int rank = s.mesh->world().rank(), world = s.mesh->world().size();
  std::mt19937 pick(11);
  int checked = 0;
  bool ok = true;
  for (size_t i = 0; i < s.model->params().size(); ++i) {
    Param& p = s.model->params()[i];
    // A replicated parameter is perturbed on every rank at once; a TP piece on one rank at a time.
    const int owners = p.split == TpSplit::kNone ? 1 : world;
    for (int owner = 0; owner < owners; ++owner) {
      for (int trial = 0; trial < 3; ++trial) {
        const size_t j = pick() % static_cast<size_t>(p.local_count());
        const bool mine = p.split == TpSplit::kNone || owner == rank;
        const float w0 = p.full[j];
        const float h = 1e-2f * std::max(1.0f, std::fabs(w0));
        if (mine) p.full[j] = w0 + h;
        const double up = Loss(s);
        if (mine) p.full[j] = w0 - h;
        const double down = Loss(s);
        if (mine) p.full[j] = w0;
        if (!mine) continue;
        const double fd = (up - down) / (2.0 * static_cast<double>(h));
        const double g = grads[i][j];
        // FP32 loss differences over 2h: ~1e-7 * |L| / h of rounding, plus O(h^2) curvature.
        const double tol = 2e-3 + 2e-2 * std::fabs(g);
        if (std::fabs(fd - g) > tol) {
          ok = false;
          ADD_FAILURE() << p.name << "[" << j << "] on rank " << rank << ": analytic " << g
                        << ", finite difference " << fd;
        }
        ++checked;
      }
    }
  }
  EXPECT_GT(checked, 3 * 6);
  EXPECT_TRUE(AllRanksOk(ok));
}

double Cosine(const std::vector<float>& a, const std::vector<float>& b) {
  double ab = 0, aa = 0, bb = 0;
  for (size_t i = 0; i < a.size(); ++i) {
    ab += static_cast<double>(a[i]) * b[i];
    aa += static_cast<double>(a[i]) * a[i];
    bb += static_cast<double>(b[i]) * b[i];
  }
  return ab / std::sqrt(aa * bb);
}

struct Fp8Case {
  const char* name;
  train::ScalingStrategy strategy;
  kernels::Fp8Format grad_format;
};

class Fp8GradientTest : public ::testing::TestWithParam<Fp8Case> {};

// FP8 operands carry ~2^-4 (E4M3) / 2^-3 (E5M2) relative rounding per value; summed over K
// products the errors average out, so each weight gradient must point the same way as the FP32
// one (cosine > 0.98) and the loss must agree to 1%.
TEST_P(Fp8GradientTest, GradientsFollowFp32) {
  const ModelShape shape{
      .layers = 2, .d_model = 256, .heads = 4, .d_ff = 512, .seq_len = 16, .vocab = 256};
  ModelRecipe fp32;
  fp32.precision = GemmPrecision::kFp32;
  ModelRecipe fp8;
  fp8.precision = GemmPrecision::kFp8;
  for (train::ScalingConfig* c : {&fp8.sites.input, &fp8.sites.weight, &fp8.sites.grad_output}) {
    c->strategy = GetParam().strategy;
  }
  fp8.sites.grad_output.format = GetParam().grad_format;
  ModelUnderTest a = Make(shape, fp32);
  ModelUnderTest b = Make(shape, fp8);
  ASSERT_TRUE(a.model->BeginStep().ok());
  ASSERT_TRUE(b.model->BeginStep().ok());
  const double la = Loss(a), lb = Loss(b);
  EXPECT_NEAR(lb, la, 0.01 * la);
  bool ok = true;
  for (size_t i = 0; i < a.model->params().size(); ++i) {
    const Param& pa = a.model->params()[i];
    const Param& pb = b.model->params()[i];
    const double cos = Cosine(pa.full_grad, pb.full_grad);
    if (!(cos > 0.98)) {
      ok = false;
      ADD_FAILURE() << pa.name << ": cosine of FP8 and FP32 gradients " << cos;
    }
  }
  // Every FP8 site quantized something and has a finite, positive scale.
  for (const QuantSite* site : b.model->sites()) {
    EXPECT_TRUE(site->used_this_step()) << site->name();
    EXPECT_TRUE(std::isfinite(site->step_scale()) && site->step_scale() > 0) << site->name();
  }
  EXPECT_EQ(b.model->sites().size(), 2u * 4u * 3u);
  EXPECT_TRUE(AllRanksOk(ok));
}

INSTANTIATE_TEST_SUITE_P(
    Recipes, Fp8GradientTest,
    ::testing::Values(
        Fp8Case{"delayed_hybrid", train::ScalingStrategy::kDelayed, kernels::Fp8Format::kE5M2},
        Fp8Case{"current_e4m3", train::ScalingStrategy::kCurrent, kernels::Fp8Format::kE4M3},
        Fp8Case{"block_hybrid", train::ScalingStrategy::kBlock, kernels::Fp8Format::kE5M2}),
    [](const ::testing::TestParamInfo<Fp8Case>& info) { return std::string(info.param.name); });

TEST(TransformerTest, UnknownExcludedLayerIsNamed) {
  const ModelShape shape{
      .layers = 1, .d_model = 32, .heads = 4, .d_ff = 64, .seq_len = 8, .vocab = 256};
  ModelRecipe recipe;
  recipe.exclude = {"blocks.0.mlp.fc1", "blocks.3.mlp.fc1"};
  auto mesh = parallel::Mesh::Create({.dp = 1, .tp = Factory().World().size(), .ep = 1}, Factory());
  ASSERT_TRUE(mesh.ok());
  auto model = Transformer::Create(shape, recipe, 1, **mesh, kernels::CpuOps());
  ASSERT_FALSE(model.ok());
  EXPECT_EQ(model.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(model.status().message().find("precision.exclude"), std::string::npos);
  EXPECT_NE(model.status().message().find("blocks.3.mlp.fc1"), std::string::npos);
  // An excluded layer runs in BF16 and has no FP8 sites.
  recipe.exclude = {"blocks.0.mlp.fc1"};
  auto ok = Transformer::Create(shape, recipe, 1, **mesh, kernels::CpuOps());
  ASSERT_TRUE(ok.ok()) << ok.status();
  EXPECT_EQ((*ok)->sites().size(), 3u * 3u);
  for (const QuantSite* site : (*ok)->sites()) {
    EXPECT_EQ(site->name().find("blocks.0.mlp.fc1"), std::string::npos) << site->name();
  }
}

}  // namespace
}  // namespace fp8rt::model
