// The transformer's backward, checked against the loss itself: central finite differences of
// the FP32 model (1 rank, and tensor-parallel over 2 ranks, where a weight piece lives on one rank
// and replicated parameters on all), and the FP8 gradients (tensor and block scaling, both
// formats) against the FP32 gradients of the same weights and tokens.
#include "runtime/model/transformer.h"

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdint>
#include <functional>
#include <iostream>
#include <map>
#include <memory>
#include <random>
#include <set>
#include <span>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"
#include "kernels/memory_stats.h"
#include "kernels/ops.h"
#include "parallel/fp8_collectives.h"
#include "parallel/mesh.h"
#include "runtime/spec/run_spec.h"
#include "runtime/train/optimizer.h"
#include "runtime/worker/recipe.h"
#include "tests/mpi/mpi_test_env.h"

namespace fp8rt::model {
namespace {

using parallel::testing::AllRanksOk;
using parallel::testing::Factory;

// The tests' models: 4 heads, bytes as tokens, and an MoE MLP in every block when moe.experts > 0.
ModelShape Shape(int64_t layers, int64_t d_model, int64_t d_ff, int64_t seq_len,
                 const MoeConfig& moe = {}) {
  return {.layers = layers,
          .d_model = d_model,
          .heads = 4,
          .d_ff = d_ff,
          .seq_len = seq_len,
          .vocab = 256,
          .moe = moe,
          .moe_every = 1};
}

struct ModelUnderTest {
  std::unique_ptr<parallel::Mesh> mesh;
  std::unique_ptr<Transformer> model;
  std::vector<int32_t> tokens;
  int64_t micro_batch = 2;
};

// A model of `shape` on a mesh of `layout` over all ranks (CPU ops, weights from `seed`), fed
// micro_batch sequences of tokens drawn from `token_seed`.
ModelUnderTest Build(const parallel::MeshConfig& layout, const ModelShape& shape,
                     const ModelRecipe& recipe, uint64_t seed, uint32_t token_seed) {
  ModelUnderTest s;
  auto mesh = parallel::Mesh::Create(layout, Factory());
  EXPECT_TRUE(mesh.ok()) << mesh.status();
  s.mesh = std::move(*mesh);
  auto model = Transformer::Create(shape, recipe, seed, *s.mesh, kernels::CpuOps());
  EXPECT_TRUE(model.ok()) << model.status();
  s.model = std::move(*model);
  std::mt19937 rng(token_seed);
  s.tokens.resize(static_cast<size_t>(s.micro_batch * (shape.seq_len + 1)));
  for (int32_t& t : s.tokens) t = static_cast<int32_t>(rng() % static_cast<uint32_t>(shape.vocab));
  return s;
}

// Tensor-parallel over all ranks, the same tokens on every rank.
ModelUnderTest Make(const ModelShape& shape, const ModelRecipe& recipe) {
  const int world = Factory().World().size();
  return Build({.dp = 1, .tp = world, .ep = 1}, shape, recipe, /*seed=*/7, /*token_seed=*/3);
}

double Loss(ModelUnderTest& s) {
  absl::StatusOr<float> loss = s.model->ForwardBackward(s.tokens, s.micro_batch, 1.0f);
  EXPECT_TRUE(loss.ok()) << loss.status();
  return loss.ok() ? *loss : NAN;
}

ModelRecipe Fp32Recipe() {
  ModelRecipe recipe;
  recipe.precision = GemmPrecision::kFp32;
  return recipe;
}

// Each parameter's gradient (its TP piece, with the FSDP padding) after the backwards run since
// BeginStep, reduced over the parameter's FSDP group: the shards of every rank gathered.
std::vector<std::vector<float>> Grads(Transformer& model) {
  std::vector<std::vector<float>> grads;
  for (Param& p : model.params()) {
    std::vector<float> full(static_cast<size_t>(p.shard_count * p.group->size()));
    EXPECT_TRUE(
        p.group->AllGather(p.grad.data(), p.shard_count, full.data(), parallel::DType::kF32).ok());
    grads.push_back(std::move(full));
  }
  return grads;
}

// The central finite difference of `loss` in element j of p's TP piece, with h = 1e-2 max(1, |w|).
// The weight lives in the FP32 master shard of one rank of p's FSDP group (every gather reads
// it); it moves there, and only where `mine`. Every rank evaluates the loss twice (it may run
// collectives); the result means something only where `mine`.
double FiniteDifference(Param& p, size_t j, bool mine, const std::function<double()>& loss) {
  const int64_t owner = static_cast<int64_t>(j) / p.shard_count;
  const size_t local = static_cast<size_t>(static_cast<int64_t>(j) % p.shard_count);
  const bool held = owner == p.group->rank();
  float w0 = held ? p.master[local] : 0.0f;
  // Every rank of the group takes the owner's value for h.
  EXPECT_TRUE(p.group->Broadcast(&w0, 1, parallel::DType::kF32, static_cast<int>(owner)).ok());
  const float h = 1e-2f * std::max(1.0f, std::fabs(w0));
  const bool move = mine && held;
  if (move) p.master[local] = w0 + h;
  const double up = loss();
  if (move) p.master[local] = w0 - h;
  const double down = loss();
  if (move) p.master[local] = w0;
  return (up - down) / (2.0 * static_cast<double>(h));
}

// Whether the analytic gradient g of element j agrees with the finite difference fd; a failure of
// the test, naming the weight and rank, if not. FP32 loss differences over 2h: ~1e-7 * |L| / h of
// rounding, plus O(h^2) curvature.
bool MatchesFiniteDifference(const Param& p, size_t j, int rank, double g, double fd,
                             double abs_tol = 2e-3) {
  const double tol = abs_tol + 2e-2 * std::fabs(g);
  if (std::fabs(fd - g) > tol) {
    ADD_FAILURE() << p.name << "[" << j << "] on rank " << rank << ": analytic " << g
                  << ", finite difference " << fd;
    return false;
  }
  return true;
}

TEST(TransformerTest, Fp32GradientsMatchFiniteDifferences) {
  ModelUnderTest s =
      Make(Shape(/*layers=*/2, /*d_model=*/32, /*d_ff=*/64, /*seq_len=*/8), Fp32Recipe());
  ASSERT_TRUE(s.model->BeginStep().ok());
  Loss(s);  // accumulates dL/dw (dloss 1) into the gradient shards
  const std::vector<std::vector<float>> grads = Grads(*s.model);

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
        const double fd = FiniteDifference(p, j, mine, [&] { return Loss(s); });
        if (!mine) continue;
        if (!MatchesFiniteDifference(p, j, rank, grads[i][j], fd)) ok = false;
        ++checked;
      }
    }
  }
  EXPECT_GT(checked, 3 * 6);
  EXPECT_TRUE(AllRanksOk(ok));
}

// The GPT-2 and Llama families (and a tied, grouped-query variant) checked the same way: every
// parameter, LayerNorm gains and biases, learned positions, RoPE, SwiGLU, grouped-query attention
// and a tied embedding (whose gradient sums the head's and the embedding's) included, on 1 and 2
// ranks, tensor-parallel and FSDP over all ranks.
struct FamilyCase {
  const char* name;
  bool fsdp;  // dp = world (else tp = world)
  ModelShape shape;
};

ModelShape FamilyShape(const char* family, bool tie, int64_t kv_heads) {
  ModelShape s = Shape(/*layers=*/2, /*d_model=*/32, /*d_ff=*/48, /*seq_len=*/8);
  s.kv_heads = kv_heads;
  s.tie_embeddings = tie;
  if (std::string(family) == "gpt2") {
    s.norm = NormKind::kLayer;
    s.bias = true;
    s.positions = PositionKind::kLearned;
    s.max_positions = 12;
  } else {
    s.mlp = MlpKind::kSwiglu;
    s.positions = PositionKind::kRope;
    s.rope_theta = 100.0f;  // angles that turn over 8 positions
    s.norm_eps = 1e-6f;
  }
  return s;
}

class FamilyGradientTest : public ::testing::TestWithParam<FamilyCase> {};

TEST_P(FamilyGradientTest, Fp32GradientsMatchFiniteDifferences) {
  const int world = Factory().World().size();
  const FamilyCase& c = GetParam();
  ModelUnderTest s = Build(c.fsdp ? parallel::MeshConfig{.dp = world, .tp = 1, .ep = 1}
                                  : parallel::MeshConfig{.dp = 1, .tp = world, .ep = 1},
                           c.shape, Fp32Recipe(), /*seed=*/7, /*token_seed=*/3);
  ASSERT_NE(s.model, nullptr);
  // Sharper attention than the initialisation's (q.k of N(0, 0.02) weights is ~0), so that the
  // gradients through softmax, RoPE and the kv heads are large enough to check.
  for (Param& p : s.model->params()) {
    if (!p.name.ends_with("attn.qkv/weight")) continue;
    for (float& w : p.master) w *= 10.0f;
  }
  // With FSDP every rank runs the same tokens and the reduction sums them: dloss 1 / dp makes
  // the reduced gradient the gradient of one rank's loss.
  const float dloss = c.fsdp ? 1.0f / static_cast<float>(world) : 1.0f;
  auto loss = [&] {
    absl::StatusOr<float> l = s.model->ForwardBackward(s.tokens, s.micro_batch, dloss);
    EXPECT_TRUE(l.ok()) << l.status();
    return l.ok() ? static_cast<double>(*l) : NAN;
  };
  ASSERT_TRUE(s.model->BeginStep().ok());
  loss();
  const std::vector<std::vector<float>> grads = Grads(*s.model);
  // Evaluate is the forward alone: the same loss, and no gradient changes.
  absl::StatusOr<float> eval = s.model->Evaluate(s.tokens, s.micro_batch);
  ASSERT_TRUE(eval.ok()) << eval.status();
  ASSERT_TRUE(s.model->BeginStep().ok());
  EXPECT_EQ(*eval, static_cast<float>(loss()));

  const int rank = s.mesh->world().rank();
  // Directional derivatives: each parameter moved along a random +-1 direction r over all its
  // elements (on every rank at once; a replicated parameter the same way on every TP rank), the
  // central difference of the loss against sum_i g_i r_i. Summing over every element makes the
  // derivative large next to the FP32 noise of the loss, so the check is tight (a wrong gradient
  // of any part of a tensor shows) without being flaky.
  const int tp_rank = s.mesh->layout().tp_rank;
  bool ok = true;
  int checked = 0;
  std::vector<std::string> names;
  for (size_t i = 0; i < s.model->params().size(); ++i) {
    Param& p = s.model->params()[i];
    names.push_back(p.name);
    const uint64_t salt = p.split == TpSplit::kNone ? 0 : static_cast<uint64_t>(tp_rank) + 1;
    auto dir = [&](int64_t li) {
      return (std::hash<uint64_t>{}((static_cast<uint64_t>(li) * 1000003ULL + salt) ^ (i << 40)) &
              1) != 0
                 ? 1.0f
                 : -1.0f;
    };
    // The analytic side: this rank's TP piece (the gathered FSDP gradient), summed over the
    // TP ranks for split parameters.
    float g_dot_r = 0.0f;
    for (int64_t li = 0; li < p.local_count(); ++li) {
      g_dot_r += grads[i][static_cast<size_t>(li)] * dir(li);
    }
    if (p.split != TpSplit::kNone && s.mesh->tp().size() > 1) {
      ASSERT_TRUE(s.mesh->tp()
                      .AllReduce(&g_dot_r, 1, parallel::DType::kF32, parallel::ReduceOp::kSum)
                      .ok());
    }
    // A move along r moves every element at once, so the difference quotient's h^2 term is
    // large (6% at h = 2e-3 on an output projection): Richardson's extrapolation of the central
    // differences at h and h / 2, (4 D(h/2) - D(h)) / 3, cancels it.
    const std::vector<float> w0(p.master.begin(), p.master.end());
    auto move = [&](float step) {
      for (int64_t k = 0; k < p.shard_count; ++k) {
        const int64_t li = p.group->rank() * p.shard_count + k;
        if (li < p.local_count()) {
          p.master[static_cast<size_t>(k)] = w0[static_cast<size_t>(k)] + step * dir(li);
        }
      }
    };
    auto central = [&](float h) {
      move(h);
      const double up = loss();
      move(-h);
      const double down = loss();
      move(0.0f);
      return (up - down) / (2.0 * h);
    };
    const double fd = (4.0 * central(5e-4f) - central(1e-3f)) / 3.0;
    const double tol = 2e-3 + 2e-2 * std::fabs(g_dot_r);
    if (std::fabs(fd - g_dot_r) > tol) {
      ADD_FAILURE() << p.name << " on rank " << rank << ": analytic g.r " << g_dot_r
                    << ", finite difference " << fd;
      ok = false;
    }
    ++checked;
  }
  EXPECT_GT(checked, 10);
  EXPECT_TRUE(AllRanksOk(ok));
  // The architecture's parameters are there (and only they).
  auto has = [&](const std::string& n) {
    return std::find(names.begin(), names.end(), n) != names.end();
  };
  const bool gpt2 = c.shape.norm == NormKind::kLayer;
  EXPECT_EQ(has("positions/weight"), gpt2);
  EXPECT_EQ(has("blocks.0.attn_norm/bias"), gpt2);
  EXPECT_EQ(has("blocks.1.attn.qkv/bias"), gpt2);
  EXPECT_EQ(has("blocks.1.mlp.fc2/bias"), gpt2);
  EXPECT_EQ(has("blocks.0.mlp.gate/weight"), !gpt2);
  EXPECT_EQ(has("blocks.0.mlp.up/weight"), !gpt2);
  EXPECT_EQ(has("blocks.0.mlp.down/weight"), !gpt2);
  EXPECT_EQ(has("lm_head/weight"), !c.shape.tie_embeddings);
  const Param& qkv = s.model->params()[static_cast<size_t>(
      std::find(names.begin(), names.end(), "blocks.0.attn.qkv/weight") - names.begin())];
  EXPECT_EQ(qkv.rows, (4 + 2 * c.shape.kv()) * 8);
}

INSTANTIATE_TEST_SUITE_P(
    Families, FamilyGradientTest,
    ::testing::Values(FamilyCase{"gpt2_tp", false, FamilyShape("gpt2", true, 0)},
                      FamilyCase{"gpt2_fsdp", true, FamilyShape("gpt2", true, 0)},
                      FamilyCase{"llama_gqa_tp", false, FamilyShape("llama", false, 2)},
                      FamilyCase{"llama_mqa_tied_fsdp", true, FamilyShape("llama", true, 1)}),
    [](const ::testing::TestParamInfo<FamilyCase>& info) { return std::string(info.param.name); });

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
  const ModelShape shape = Shape(/*layers=*/2, /*d_model=*/256, /*d_ff=*/512, /*seq_len=*/16);
  ModelRecipe fp8;
  fp8.precision = GemmPrecision::kFp8;
  for (train::ScalingConfig* c : {&fp8.sites.input, &fp8.sites.weight, &fp8.sites.grad_output}) {
    c->strategy = GetParam().strategy;
  }
  fp8.sites.grad_output.format = GetParam().grad_format;
  ModelUnderTest a = Make(shape, Fp32Recipe());
  ModelUnderTest b = Make(shape, fp8);
  ASSERT_TRUE(a.model->BeginStep().ok());
  ASSERT_TRUE(b.model->BeginStep().ok());
  const double la = Loss(a), lb = Loss(b);
  EXPECT_NEAR(lb, la, 0.01 * la);
  const std::vector<std::vector<float>> ga = Grads(*a.model), gb = Grads(*b.model);
  bool ok = true;
  for (size_t i = 0; i < a.model->params().size(); ++i) {
    const Param& pa = a.model->params()[i];
    const double cos = Cosine(ga[i], gb[i]);
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
        Fp8Case{"block_hybrid", train::ScalingStrategy::kBlock, kernels::Fp8Format::kE5M2},
        Fp8Case{"mx32_hybrid", train::ScalingStrategy::kMx32, kernels::Fp8Format::kE5M2},
        Fp8Case{"mx32_e4m3", train::ScalingStrategy::kMx32, kernels::Fp8Format::kE4M3}),
    [](const ::testing::TestParamInfo<Fp8Case>& info) { return std::string(info.param.name); });

// precision.save_fp8_activations keeps an FP8 GEMM's input for the backward only as its FP8
// codes. With tensor scaling the backward reads the codes (transposed) either way, so every
// gradient must be bit-identical to the FP32-saving path, and so must the loss. With block
// scaling x^T is requantized in 128x128 blocks from the dequantized 1x128-tile codes instead of
// from x: the weight gradients' B operand is rounded twice (x -> tile FP8 -> block FP8), so
// they differ by at most that second rounding (they must still point the same way: cosine >
// 0.999), while the input gradients and the loss, which never read x^T, stay bit-identical.
// With mx32 the forward quantizes x^T from x itself (MXFP8 needs it along the tokens), so the
// backward is bit-identical again.
// The saved-activation bytes must fall by at least the FP32 copies it no longer keeps.
// BeginStep queues the quantization of every FP8 weight's shard and waits for the backend once to
// read all of their statistics (issue 23 point 4: no wait per weight). Where a tensor scale comes
// from the weight itself (current scaling, and delayed scaling before its history has a value:
// always here, where no step ends) the weights' amaxes are max-reduced over the ranks on the
// device and their scales taken there: no wait of their own. The count does not grow with the
// layers. The first step may wait more (mx32's scratch grows); from the second on the count is
// exact. The op table is the CPU's with synchronize counted.
int begin_step_waits = 0;
absl::Status CountedSynchronize(kernels::Stream s) {
  ++begin_step_waits;
  return kernels::CpuOps().layer->synchronize(s);
}

class BeginStepWaitTest : public ::testing::TestWithParam<train::ScalingStrategy> {};

TEST_P(BeginStepWaitTest, OneWaitForEveryShardsStatistics) {
  kernels::LayerOps layer = *kernels::CpuOps().layer;
  layer.synchronize = &CountedSynchronize;
  kernels::OpTable ops = kernels::CpuOps();
  ops.layer = &layer;
  ModelRecipe recipe;  // fp8
  for (train::ScalingConfig* c :
       {&recipe.sites.input, &recipe.sites.weight, &recipe.sites.grad_output}) {
    c->strategy = GetParam();
  }
  const int world = Factory().World().size();
  auto mesh = parallel::Mesh::Create({.dp = world, .tp = 1, .ep = 1}, Factory());
  ASSERT_TRUE(mesh.ok()) << mesh.status();
  const ModelShape shape = Shape(/*layers=*/3, /*d_model=*/128, /*d_ff=*/256, /*seq_len=*/16);
  auto model = Transformer::Create(shape, recipe, /*seed=*/7, **mesh, ops);
  ASSERT_TRUE(model.ok()) << model.status();
  std::vector<int32_t> tokens(static_cast<size_t>(2 * (shape.seq_len + 1)));
  for (size_t i = 0; i < tokens.size(); ++i) tokens[i] = static_cast<int32_t>((i * 37) % 256);
  const int want = 1;
  for (int step = 0; step < 3; ++step) {
    begin_step_waits = 0;
    ASSERT_TRUE((*model)->BeginStep().ok());
    if (step == 0) {
      EXPECT_LT(begin_step_waits, 12) << "a wait per FP8 weight (12 of them)";
    } else {
      EXPECT_EQ(begin_step_waits, want) << "step " << step << ": 12 FP8 weights";
    }
    ASSERT_TRUE((*model)->ForwardBackward(tokens, 2, 1.0f).ok());
  }
}

// PrefetchShards hands the backend every parameter's master, gradient and Adam shards, whole
// (the arrays the host writes at start-up and at a resume and reads at a checkpoint).
std::vector<std::pair<const void*, size_t>> prefetched;
absl::Status CountedPrefetch(const void* p, size_t bytes, kernels::Stream s) {
  prefetched.emplace_back(p, bytes);
  return kernels::CpuOps().layer->prefetch(p, bytes, s);
}

TEST(PrefetchShardsTest, EveryShardArrayWhole) {
  kernels::LayerOps layer = *kernels::CpuOps().layer;
  layer.prefetch = &CountedPrefetch;
  kernels::OpTable ops = kernels::CpuOps();
  ops.layer = &layer;
  auto mesh = parallel::Mesh::Create({.dp = Factory().World().size(), .tp = 1, .ep = 1}, Factory());
  ASSERT_TRUE(mesh.ok()) << mesh.status();
  auto model = Transformer::Create(Shape(2, 64, 128, 8), ModelRecipe{}, /*seed=*/7, **mesh, ops);
  ASSERT_TRUE(model.ok()) << model.status();
  prefetched.clear();
  ASSERT_TRUE((*model)->PrefetchShards().ok());
  std::vector<std::pair<const void*, size_t>> want;
  for (const Param& p : (*model)->params()) {
    for (const kernels::DeviceArray<float>* a : {&p.master, &p.grad, &p.m, &p.v}) {
      ASSERT_EQ(a->size(), static_cast<size_t>(p.shard_count)) << p.name;
      want.emplace_back(a->data(), a->size() * sizeof(float));
    }
  }
  EXPECT_EQ(prefetched, want);
}

// A training pass (ForwardBackward) waits for the backend once, at the end of its backward,
// whatever the number of layers: the forward's loss is read then (not by a wait of its own), the
// FP8 sites record their statistics after that wait without waiting again, and the first pass's
// scratch buffers grow without a wait (issue 23 point 4).
TEST(PassWaitTest, OneWaitPerTrainingPassWhateverTheLayers) {
  kernels::LayerOps layer = *kernels::CpuOps().layer;
  layer.synchronize = &CountedSynchronize;
  kernels::OpTable ops = kernels::CpuOps();
  ops.layer = &layer;
  const int world = Factory().World().size();
  for (const int64_t layers : {1, 3}) {
    SCOPED_TRACE(std::to_string(layers) + " layers");
    auto mesh = parallel::Mesh::Create({.dp = world, .tp = 1, .ep = 1}, Factory());
    ASSERT_TRUE(mesh.ok()) << mesh.status();
    const ModelShape shape = Shape(layers, /*d_model=*/128, /*d_ff=*/256, /*seq_len=*/16);
    auto model = Transformer::Create(shape, ModelRecipe{}, /*seed=*/7, **mesh, ops);
    ASSERT_TRUE(model.ok()) << model.status();
    std::vector<int32_t> tokens(static_cast<size_t>(2 * (shape.seq_len + 1)));
    for (size_t i = 0; i < tokens.size(); ++i) tokens[i] = static_cast<int32_t>((i * 37) % 256);
    ASSERT_TRUE((*model)->BeginStep().ok());
    for (int pass = 0; pass < 3; ++pass) {
      begin_step_waits = 0;
      absl::StatusOr<float> loss = (*model)->ForwardBackward(tokens, 2, 1.0f);
      ASSERT_TRUE(loss.ok()) << loss.status();
      EXPECT_TRUE(std::isfinite(*loss) && *loss > 0.0f) << *loss;
      EXPECT_EQ(begin_step_waits, 1) << "pass " << pass;
    }
    // The loss a training pass returns is the forward's: an evaluation of the same tokens with
    // the same weights (no step in between) gives the same bits.
    absl::StatusOr<float> trained = (*model)->ForwardBackward(tokens, 2, 1.0f);
    absl::StatusOr<float> evaluated = (*model)->Evaluate(tokens, 2);
    ASSERT_TRUE(trained.ok() && evaluated.ok());
    EXPECT_EQ(std::bit_cast<uint32_t>(*trained), std::bit_cast<uint32_t>(*evaluated))
        << *trained << " " << *evaluated;
  }
}

INSTANTIATE_TEST_SUITE_P(Strategies, BeginStepWaitTest,
                         ::testing::Values(train::ScalingStrategy::kDelayed,
                                           train::ScalingStrategy::kCurrent,
                                           train::ScalingStrategy::kBlock,
                                           train::ScalingStrategy::kMx32));

class SaveFp8Test : public ::testing::TestWithParam<train::ScalingStrategy> {};

TEST_P(SaveFp8Test, GradientsMatchTheFp32SavingPath) {
  const ModelShape shape = Shape(/*layers=*/2, /*d_model=*/256, /*d_ff=*/512, /*seq_len=*/16);
  ModelRecipe recipe;  // fp8
  for (train::ScalingConfig* c :
       {&recipe.sites.input, &recipe.sites.weight, &recipe.sites.grad_output}) {
    c->strategy = GetParam();
  }
  recipe.save_fp8_activations = false;
  ModelUnderTest a = Make(shape, recipe);
  recipe.save_fp8_activations = true;
  ModelUnderTest b = Make(shape, recipe);
  ASSERT_TRUE(a.model->BeginStep().ok());
  ASSERT_TRUE(b.model->BeginStep().ok());
  const int64_t a_saved = kernels::GetMemoryStats().Live(kernels::MemCategory::kSavedActivations);
  const double la = Loss(a);
  const int64_t ab_saved = kernels::GetMemoryStats().Live(kernels::MemCategory::kSavedActivations);
  const double lb = Loss(b);
  const int64_t b_saved =
      kernels::GetMemoryStats().Live(kernels::MemCategory::kSavedActivations) - ab_saved;
  EXPECT_EQ(la, lb);
  const std::vector<std::vector<float>> ga = Grads(*a.model), gb = Grads(*b.model);
  const bool block = GetParam() == train::ScalingStrategy::kBlock;
  bool ok = true;
  for (size_t i = 0; i < ga.size(); ++i) {
    const Param& p = a.model->params()[i];
    const bool gemm_weight = p.linear != nullptr && p.name.find("lm_head") == std::string::npos;
    if (block && gemm_weight) {
      const double cos = Cosine(ga[i], gb[i]);
      if (!(cos > 0.999)) {
        ok = false;
        ADD_FAILURE() << p.name << ": cosine " << cos;
      }
    } else if (ga[i] != gb[i]) {
      ok = false;
      ADD_FAILURE() << p.name << ": gradients differ with FP8-saved inputs";
    }
  }
  EXPECT_TRUE(AllRanksOk(ok));
  // a's activations (allocated by its first pass) hold per layer the FP32 ln1, ln2 and g
  // (n x (2 d_model + d_ff / tp)) that b does not keep (att, the attention's output, is kept by
  // both: the attention backward reads it).
  const int64_t tp = a.mesh->world().size(), n = a.micro_batch * shape.seq_len;
  const int64_t fp32_inputs = shape.layers * n * (2 * shape.d_model + shape.d_ff / tp) * 4;
  const int64_t a_acts = ab_saved - a_saved;
  EXPECT_GE(a_acts - b_saved, fp32_inputs) << "saved bytes: " << a_acts << " vs " << b_saved;
}

INSTANTIATE_TEST_SUITE_P(Strategies, SaveFp8Test,
                         ::testing::Values(train::ScalingStrategy::kDelayed,
                                           train::ScalingStrategy::kCurrent,
                                           train::ScalingStrategy::kBlock,
                                           train::ScalingStrategy::kMx32));

// FSDP's FP8 weight shards come from the optimizer's update pass (AttachFp8Shards): with delayed
// tensor scaling once the weight site has a history (step 2 on), with 128x128 block scaling from
// the first step. Each shard written there must be, bit for bit, what quantizing the updated
// master shard with the same scale (or the same blocks) gives: the codes, the scales and the
// statistics. The next BeginStep uses those bytes (no second quantization) and the gathered
// weights feed a pass with a finite loss. Current scaling is never written there (it needs the
// updated weight's amax over every rank first).
class OptimizerWrittenShardTest : public ::testing::TestWithParam<train::ScalingStrategy> {};

TEST_P(OptimizerWrittenShardTest, EqualQuantizingTheUpdatedMaster) {
  // d_model 256, d_ff 512: every FP8 weight's shard is whole 128-row blocks at dp 1 and 2.
  const ModelShape shape = Shape(/*layers=*/2, /*d_model=*/256, /*d_ff=*/512, /*seq_len=*/16);
  ModelRecipe recipe;  // fp8, fsdp_gather fp8
  for (train::ScalingConfig* c :
       {&recipe.sites.input, &recipe.sites.weight, &recipe.sites.grad_output}) {
    c->strategy = GetParam();
  }
  const int world = Factory().World().size();
  ModelUnderTest s = Build({.dp = world, .tp = 1, .ep = 1}, shape, recipe, /*seed=*/7,
                           /*token_seed=*/3);
  train::AdamW opt(train::AdamWConfig{.lr = 1e-2, .warmup = 0, .steps = 10});
  const bool block = GetParam() == train::ScalingStrategy::kBlock;
  bool ok = true;
  for (int64_t step = 1; step <= 3; ++step) {
    SCOPED_TRACE(::testing::Message() << "step " << step);
    ASSERT_TRUE(s.model->BeginStep().ok());
    const double loss = Loss(s);
    EXPECT_TRUE(std::isfinite(loss));
    ASSERT_TRUE(s.model->ReduceGrads().ok());
    std::vector<train::ParamShard> shards;
    for (Param& p : s.model->params()) {
      shards.push_back(train::ParamShard{.name = p.name,
                                         .master = p.master.data(),
                                         .grad = p.grad.data(),
                                         .m = p.m.data(),
                                         .v = p.v.data(),
                                         .count = p.shard_count,
                                         .decay = p.decay});
    }
    absl::StatusOr<train::StepResult> norm = opt.ComputeNorm(shards, step, &s.mesh->world());
    ASSERT_TRUE(norm.ok()) << norm.status();
    ASSERT_FALSE(norm->skipped);
    ASSERT_TRUE(s.model->SyncScaling(Transformer::ScalingUpdate::kCommit).ok());
    s.model->AttachFp8Shards(shards);
    ASSERT_TRUE(opt.Apply(shards, *norm).ok());
    int64_t written = 0, fp8_weights = 0;
    for (size_t i = 0; i < shards.size(); ++i) {
      Param& p = s.model->params()[i];
      if (p.linear == nullptr || p.linear->precision() != GemmPrecision::kFp8) continue;
      ++fp8_weights;
      if (shards[i].fp8.codes == nullptr) continue;
      ++written;
      const train::ScalingConfig& cfg = p.linear->weight_site().state().config();
      const parallel::Fp8Shard& got = p.fp8_shard;
      parallel::Fp8Shard want;
      ASSERT_TRUE(parallel::QuantizeFp8Shard(kernels::CpuOps(), p.master.data(), got.rows, got.cols,
                                             cfg.format, block, got.scale, cfg.margin, &want)
                      .ok());
      // The shard is device-only memory: the CPU backend's, read through data().
      const std::span<const uint8_t> codes(got.codes.data(), got.codes.size());
      const std::span<const float> scale_inv(got.scale_inv.data(), got.scale_inv.size());
      const bool same =
          std::equal(codes.begin(), codes.end(), want.codes.begin(), want.codes.end()) &&
          std::equal(scale_inv.begin(), scale_inv.end(), want.scale_inv.begin(),
                     want.scale_inv.end(), [](float a, float b) {
                       return std::bit_cast<uint32_t>(a) == std::bit_cast<uint32_t>(b);
                     });
      // The update pass's statistics, copied for the host as BeginStep does.
      ASSERT_TRUE(p.fp8_shard.stats_out.Download({}).ok());
      ASSERT_TRUE(kernels::CpuOps().layer->synchronize({}).ok());
      const kernels::QuantStats& gs = got.stats_out[0];
      const kernels::QuantStats& ws = want.stats;
      const bool same_stats =
          std::bit_cast<uint32_t>(gs.amax) == std::bit_cast<uint32_t>(ws.amax) &&
          gs.count == ws.count && gs.underflow == ws.underflow && gs.subnormal == ws.subnormal &&
          gs.saturated == ws.saturated && gs.nonfinite == ws.nonfinite;
      if (!same || !same_stats) {
        ok = false;
        ADD_FAILURE() << p.name << ": the optimizer's FP8 shard differs from quantizing the "
                      << "updated master (codes/scales " << same << ", stats " << same_stats << ")";
      }
      if (block) {
        EXPECT_EQ(got.scale_inv.size(),
                  static_cast<size_t>((got.rows / 128) * ((got.cols + 127) / 128)));
      }
    }
    ASSERT_GT(fp8_weights, 0);
    // Block scaling: every FP8 weight from step 1. Delayed: from step 2 (step 1's scales came
    // from the weights themselves, with no history yet) -- or at least once a history exists.
    if (block) {
      EXPECT_EQ(written, fp8_weights);
    } else if (GetParam() == train::ScalingStrategy::kCurrent) {
      EXPECT_EQ(written, 0);
    } else if (step >= 2) {
      EXPECT_EQ(written, fp8_weights);
    }
  }
  // The next step runs on the written shards.
  ASSERT_TRUE(s.model->BeginStep().ok());
  EXPECT_TRUE(std::isfinite(Loss(s)));
  EXPECT_TRUE(AllRanksOk(ok));
}

INSTANTIATE_TEST_SUITE_P(Strategies, OptimizerWrittenShardTest,
                         ::testing::Values(train::ScalingStrategy::kDelayed,
                                           train::ScalingStrategy::kCurrent,
                                           train::ScalingStrategy::kBlock));

// fsdp_gather bf16, the baseline the FP8 gathers are measured against: each rank's shard goes on
// the wire rounded to BF16 (to nearest even), and every rank quantizes the gathered piece. So each
// layer's FP8 weight is the quantization of the whole weight rounded to BF16, and a model that
// gathers in BF16 runs, bit for bit, as a model that gathers in FP8 whose FP8 weights' masters
// were rounded to BF16 beforehand: the same loss and the same reduced gradients. FSDP over every
// rank, so the BF16 gathers are started (the next unit's while the current one runs, the block
// below's in the backward) and quantized once they have landed. 128x128 blocks and mx32 derive
// their scales from the gathered values. A tensor scale without a history comes from the
// master shards' amax: there, in both models, every value of a shard that rounds to the same
// BF16 magnitude R as the shard's largest |value| is rounded first. Each other value rounds to a
// smaller BF16 magnitude, so it lies below the midpoint under R, hence below R: both models'
// amax is R.
float RoundToBf16(float x) {
  uint32_t bits = std::bit_cast<uint32_t>(x);
  bits += 0x7FFFu + ((bits >> 16) & 1u);  // round half to even on the 16 dropped bits
  return std::bit_cast<float>(bits & 0xFFFF0000u);
}

class Bf16GatherTest : public ::testing::TestWithParam<train::ScalingStrategy> {};

TEST_P(Bf16GatherTest, RunsAsFp8GathersOfBf16RoundedMasters) {
  // d_model 256, d_ff 512: every FP8 weight's shard is whole 128-row blocks at dp 1 and 2.
  const ModelShape shape = Shape(/*layers=*/2, /*d_model=*/256, /*d_ff=*/512, /*seq_len=*/16);
  ModelRecipe recipe;
  for (train::ScalingConfig* c :
       {&recipe.sites.input, &recipe.sites.weight, &recipe.sites.grad_output}) {
    c->strategy = GetParam();
  }
  recipe.fsdp_gather = FsdpGatherDType::kBf16;
  const int world = Factory().World().size();
  const parallel::MeshConfig fsdp{.dp = world, .tp = 1, .ep = 1};
  ModelUnderTest bf16 = Build(fsdp, shape, recipe, /*seed=*/7, /*token_seed=*/3);
  recipe.fsdp_gather = FsdpGatherDType::kFp8;
  ModelUnderTest fp8 = Build(fsdp, shape, recipe, /*seed=*/7, /*token_seed=*/3);
  const auto fp8_weight = [](const Param& p) {
    return p.linear != nullptr && p.linear->precision() == GemmPrecision::kFp8;
  };
  for (ModelUnderTest* m : {&bf16, &fp8}) {
    for (Param& p : m->model->params()) {
      if (!fp8_weight(p)) continue;
      float top = 0.0f;
      for (const float w : p.master) top = std::max(top, std::fabs(w));
      const float r = RoundToBf16(top);
      for (float& w : p.master) {
        if (RoundToBf16(std::fabs(w)) == r) w = RoundToBf16(w);
      }
    }
  }
  int64_t rounded = 0;
  for (Param& p : fp8.model->params()) {
    if (!fp8_weight(p)) continue;
    for (float& w : p.master) {
      const float r = RoundToBf16(w);
      rounded += r != w;
      w = r;
    }
  }
  EXPECT_GT(rounded, 1000) << "the masters must change when rounded, or the test shows nothing";
  ASSERT_TRUE(bf16.model->BeginStep().ok());
  ASSERT_TRUE(fp8.model->BeginStep().ok());
  const double bf16_loss = Loss(bf16), fp8_loss = Loss(fp8);
  ASSERT_TRUE(std::isfinite(bf16_loss));
  EXPECT_EQ(std::bit_cast<uint64_t>(bf16_loss), std::bit_cast<uint64_t>(fp8_loss))
      << "loss " << bf16_loss << " with BF16 gathers, " << fp8_loss
      << " with FP8 gathers of the rounded masters";
  ASSERT_TRUE(bf16.model->ReduceGrads().ok());
  ASSERT_TRUE(fp8.model->ReduceGrads().ok());
  const std::vector<std::vector<float>> bf16_grads = Grads(*bf16.model);
  const std::vector<std::vector<float>> fp8_grads = Grads(*fp8.model);
  ASSERT_EQ(bf16_grads.size(), fp8_grads.size());
  bool ok = true;
  for (size_t i = 0; i < bf16_grads.size(); ++i) {
    const std::vector<float>& a = bf16_grads[i];
    const std::vector<float>& b = fp8_grads[i];
    const auto bits = [](float x) { return std::bit_cast<uint32_t>(x); };
    for (size_t j = 0; j < a.size() && ok; ++j) {
      if (bits(a[j]) != bits(b[j])) {
        ADD_FAILURE() << bf16.model->params()[i].name << "[" << j << "]: gradient " << a[j]
                      << " with BF16 gathers, " << b[j]
                      << " with FP8 gathers of the rounded masters";
        ok = false;
      }
    }
  }
  EXPECT_TRUE(AllRanksOk(ok && !::testing::Test::HasFailure()));
}

INSTANTIATE_TEST_SUITE_P(Strategies, Bf16GatherTest,
                         ::testing::Values(train::ScalingStrategy::kDelayed,
                                           train::ScalingStrategy::kBlock,
                                           train::ScalingStrategy::kMx32));

// precision.fp8_fast_accum_forward reaches the GEMMs as Fp8GemmArgs::fast_accum on the forward
// GEMM of every FP8 layer and never on dgrad or wgrad (the CPU ignores it; on a GPU it turns on
// cuBLASLt's FAST_ACCUM). The op table records the flag of each FP8 GEMM in call order.
std::vector<bool>& Fp8GemmFastAccumCalls() {
  static auto* calls = new std::vector<bool>();
  return *calls;
}
absl::Status RecordingGemmFp8(const kernels::Fp8GemmArgs& args, kernels::Stream stream) {
  Fp8GemmFastAccumCalls().push_back(args.fast_accum);
  return kernels::CpuOps().gemm_fp8(args, stream);
}

TEST(TransformerTest, FastAccumulationIsForTheForwardGemmsOnly) {
  static const kernels::OpTable ops = [] {
    kernels::OpTable t = kernels::CpuOps();
    t.gemm_fp8 = &RecordingGemmFp8;
    return t;
  }();
  // The spec's field: on unless set false (also when absent, as in a spec built by hand).
  v1::RunSpec spec = RunSpecDefaults();
  EXPECT_TRUE(worker::RecipeFromSpec(spec).fp8_fast_accum_forward);
  spec.mutable_precision()->clear_fp8_fast_accum_forward();
  EXPECT_TRUE(worker::RecipeFromSpec(spec).fp8_fast_accum_forward);
  spec.mutable_precision()->set_fp8_fast_accum_forward(false);
  EXPECT_FALSE(worker::RecipeFromSpec(spec).fp8_fast_accum_forward);

  // A dense model over tensor parallelism, and an MoE one whose experts are spread over the
  // ranks (the experts' layers are made by the MoE layer, not the model: they must get the flag
  // too, at creation and from ApplyRecipe).
  const int world = Factory().World().size();
  for (const bool moe : {false, true}) {
    SCOPED_TRACE(moe ? "moe" : "dense");
    const ModelShape shape =
        moe ? Shape(/*layers=*/2, /*d_model=*/64, /*d_ff=*/128, /*seq_len=*/8,
                    {.experts = 4, .top_k = 2, .capacity_factor = 2.0, .drop_tokens = false})
            : Shape(/*layers=*/2, /*d_model=*/128, /*d_ff=*/256, /*seq_len=*/8);
    const parallel::MeshConfig layout =
        moe ? parallel::MeshConfig{.dp = world, .tp = 1, .ep = world}
            : parallel::MeshConfig{.dp = 1, .tp = world, .ep = 1};
    for (bool on : {true, false}) {
      ModelRecipe recipe;  // fp8
      ASSERT_TRUE(recipe.fp8_fast_accum_forward) << "the default";
      recipe.fp8_fast_accum_forward = on;
      auto mesh = parallel::Mesh::Create(layout, Factory());
      ASSERT_TRUE(mesh.ok()) << mesh.status();
      auto model = Transformer::Create(shape, recipe, /*seed=*/7, **mesh, ops);
      ASSERT_TRUE(model.ok()) << model.status();
      std::set<const Linear*> fp8_layers;
      int experts = 0;
      for (const Param& p : (*model)->params()) {
        if (p.linear != nullptr && p.linear->precision() == GemmPrecision::kFp8) {
          fp8_layers.insert(p.linear);
          experts += p.linear->name().find(".experts.") != std::string::npos ? 1 : 0;
          EXPECT_EQ(p.linear->fast_accum_forward(), on) << p.linear->name();
        }
      }
      ASSERT_FALSE(fp8_layers.empty());
      EXPECT_EQ(experts > 0, moe);
      std::vector<int32_t> tokens(static_cast<size_t>(2 * (shape.seq_len + 1)));
      for (size_t i = 0; i < tokens.size(); ++i) {
        tokens[i] =
            static_cast<int32_t>((i * 7 + 3 * static_cast<size_t>(Factory().World().rank())) % 64);
      }
      ASSERT_TRUE((*model)->BeginStep().ok());
      Fp8GemmFastAccumCalls().clear();
      ASSERT_TRUE((*model)->ForwardBackward(tokens, 2, 1.0f).ok());
      const std::vector<bool> calls = Fp8GemmFastAccumCalls();
      const auto fast = std::count(calls.begin(), calls.end(), true);
      // One forward GEMM per FP8 layer (an expert's: per micro-batch it was routed rows), then
      // two backward GEMMs (dgrad, wgrad) per forward GEMM.
      if (moe) {
        EXPECT_GT(calls.size(), 3 * (fp8_layers.size() - static_cast<size_t>(experts)))
            << "the experts' GEMMs ran too";
        EXPECT_EQ(calls.size() % 3, 0u);
        EXPECT_EQ(fast, on ? static_cast<std::ptrdiff_t>(calls.size() / 3) : 0);
      } else {
        EXPECT_EQ(fast, on ? static_cast<std::ptrdiff_t>(fp8_layers.size()) : 0);
        EXPECT_EQ(static_cast<std::ptrdiff_t>(calls.size()) - fast,
                  static_cast<std::ptrdiff_t>((on ? 2 : 3) * fp8_layers.size()));
      }
      if (on) {
        // The forward's GEMMs all come before the backward's.
        EXPECT_TRUE(std::is_partitioned(calls.begin(), calls.end(), [](bool f) { return f; }));
      }
      // A live recipe change turns it the other way on every FP8 layer, experts too.
      recipe.fp8_fast_accum_forward = !on;
      ASSERT_TRUE((*model)->ApplyRecipe(recipe).ok());
      for (const Linear* lin : fp8_layers) EXPECT_EQ(lin->fast_accum_forward(), !on) << lin->name();
    }
  }
}

TEST(TransformerTest, UnknownExcludedLayerIsNamed) {
  const ModelShape shape = Shape(/*layers=*/1, /*d_model=*/32, /*d_ff=*/64, /*seq_len=*/8);
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

// ---- Mixture of experts (every rank is one DP rank and one EP rank: dp = ep = world) ----

// Each rank its own tokens.
ModelUnderTest MakeMoe(const ModelShape& shape, const ModelRecipe& recipe) {
  parallel::Communicator& world = Factory().World();
  return Build({.dp = world.size(), .tp = 1, .ep = world.size()}, shape, recipe, /*seed=*/5,
               /*token_seed=*/17 + static_cast<uint32_t>(world.rank()));
}

// The loss of all ranks' tokens (each rank's backward adds its tokens' share to the experts it
// holds, so gradients are of this sum).
double GlobalLoss(ModelUnderTest& s) {
  float loss = static_cast<float>(Loss(s));
  EXPECT_TRUE(
      s.mesh->world().AllReduce(&loss, 1, parallel::DType::kF32, parallel::ReduceOp::kSum).ok());
  return loss;
}

// On CUDA each expert's GEMMs run on its rows padded with zero rows to a multiple of 16
// (cuBLASLt's FP8 shapes), or of 128 with block or mx32 scaling (K of the weight gradient;
// MoeConfig::gemm_row_unit). Zero rows add exact zeros to every sum and change no amax (a zero
// tile or block adds zeros whatever its scale), so in exact arithmetic padding leaves the loss and
// every gradient as they were: shown here on the CPU, where the unit can be forced, in FP8 with
// both MLP kinds, tensor scaling at 16 and per-block scaling at 128. 8 tokens a rank and top-2 of
// 4 experts give each expert a count that neither unit divides.
// Not bit for bit, though: oneDNN picks its kernel by the call's shape, and its kernels round
// differently. Without BF16 matmul (no AVX512-BF16 or AMX) its FP32 sgemm blocks rows and depth by
// the call (docs/perf.md, "CPUs without BF16 matmul"); with it, a weight gradient over an expert's
// few rows (K = 6 or 7 here) runs on the AVX512-BF16 brgemm and the padded one (K = 128) on AMX
// or the jit gemm (seen on a Xeon with AMX, 2026-12-07: up to 9e-8 of the tensor's largest
// value). So the comparison allows 1e-6 of the loss and 1e-5 of each tensor's largest magnitude:
// a padding row that were not zero, or a row lost, moves values by far more (a planted pad row of
// 3.0 moved them by 1e-3 to 3e-2 of it).
TEST(MoeTest, PaddingExpertRowsChangesNothing) {
  struct Padding {
    train::ScalingStrategy strategy;
    int64_t unit;
  };
  for (const Padding pad :
       {Padding{train::ScalingStrategy::kDelayed, 16}, Padding{train::ScalingStrategy::kBlock, 128},
        Padding{train::ScalingStrategy::kMx32, 128}}) {
    for (MlpKind mlp : {MlpKind::kGelu, MlpKind::kSwiglu}) {
      SCOPED_TRACE(std::string(train::ScalingStrategyName(pad.strategy)) + " scaling, unit " +
                   std::to_string(pad.unit) + (mlp == MlpKind::kGelu ? ", gelu" : ", swiglu"));
      // Per-block scaling cuts the FSDP shards of the FP8 weights in whole 128-row blocks at dp 1
      // and 2: 256-wide layers.
      const bool per_block = pad.strategy != train::ScalingStrategy::kDelayed;
      ModelShape shape = Shape(
          /*layers=*/1, /*d_model=*/per_block ? 256 : 64, /*d_ff=*/per_block ? 256 : 128,
          /*seq_len=*/8, {.experts = 4, .top_k = 2, .capacity_factor = 2.0, .drop_tokens = false});
      shape.mlp = mlp;
      shape.bias = true;
      ModelRecipe recipe;
      for (train::ScalingConfig* c :
           {&recipe.sites.input, &recipe.sites.weight, &recipe.sites.grad_output}) {
        c->strategy = pad.strategy;
      }
      ModelUnderTest plain = MakeMoe(shape, recipe);
      shape.moe.gemm_row_unit = pad.unit;
      ModelUnderTest padded = MakeMoe(shape, recipe);
      ASSERT_TRUE(plain.model->BeginStep().ok());
      ASSERT_TRUE(padded.model->BeginStep().ok());
      const double a = GlobalLoss(plain), b = GlobalLoss(padded);
      EXPECT_LE(std::abs(a - b), 1e-6 * std::abs(a)) << a << " vs " << b;
      const std::vector<std::vector<float>> ga = Grads(*plain.model), gb = Grads(*padded.model);
      ASSERT_EQ(ga.size(), gb.size());
      bool same = true;
      for (size_t i = 0; i < ga.size(); ++i) {
        ASSERT_EQ(ga[i].size(), gb[i].size());
        float largest = 0.0f, worst = 0.0f;
        for (size_t j = 0; j < ga[i].size(); ++j) {
          largest = std::max(largest, std::abs(ga[i][j]));
          worst = std::max(worst, std::abs(ga[i][j] - gb[i][j]));
        }
        if (!(worst <= 1e-5f * largest)) {
          same = false;
          ADD_FAILURE() << plain.model->params()[i].name
                        << ": gradients differ when padded, by up to " << worst << " (largest "
                        << largest << ")";
        }
      }
      EXPECT_TRUE(AllRanksOk(same));
    }
  }
}

// Router, gates, dispatch, experts, combine and the aux loss, backward against finite
// differences of the FP32 model, with GELU experts (fc1, fc2) and with the llama family's SwiGLU
// experts (gate, up, down: each named, each checked). top_k = experts and no capacity keep the
// loss smooth in the weights (no routing decision flips under a perturbation).
class MoeGradientTest : public ::testing::TestWithParam<MlpKind> {};

TEST_P(MoeGradientTest, Fp32GradientsMatchFiniteDifferences) {
  ModelShape shape = Shape(/*layers=*/1, /*d_model=*/32, /*d_ff=*/48, /*seq_len=*/8,
                           {.experts = 4,
                            .top_k = 4,
                            .capacity_factor = 1.0,
                            .aux_loss_coef = 0.1,
                            .drop_tokens = false});
  shape.mlp = GetParam();
  ModelUnderTest s = MakeMoe(shape, Fp32Recipe());
  // This rank's experts' weights, by kind: GELU fc1 / fc2, SwiGLU gate / up / down.
  std::map<std::string, int> kinds;
  for (const Param& p : s.model->params()) {
    const size_t at = p.name.find(".experts.");
    if (at == std::string::npos) continue;
    const std::string rest = p.name.substr(p.name.find('.', at + 9) + 1);  // "gate/weight"
    ++kinds[rest];
  }
  const int local = 4 / s.mesh->world().size();
  if (GetParam() == MlpKind::kSwiglu) {
    EXPECT_EQ(kinds, (std::map<std::string, int>{
                         {"down/weight", local}, {"gate/weight", local}, {"up/weight", local}}));
  } else {
    EXPECT_EQ(kinds, (std::map<std::string, int>{{"fc1/weight", local}, {"fc2/weight", local}}));
  }
  ASSERT_TRUE(s.model->BeginStep().ok());
  GlobalLoss(s);
  // Gradients of that one backward (the finite differences below run more of them).
  const std::vector<std::vector<float>> grads = Grads(*s.model);
  const int rank = s.mesh->world().rank();
  std::mt19937 pick(23);
  size_t index = 0;
  bool ok = true;
  int checked = 0;
  for (Param& p : s.model->params()) {
    const std::vector<float>& reduced = grads[index++];
    const bool expert = p.name.find(".experts.") != std::string::npos;
    // Only the router and the experts: what lies below the layer sees its input gradient, which
    // finite differences cannot check, since the dispatch rounds the layer's input to E4M3 (the
    // loss is a step function of it there; the backward passes the gradient straight through).
    const bool router = p.name.find(".router") != std::string::npos;
    if (!expert && !router) continue;
    // A router is replicated over DP (its master sharded): perturbed through its owner's shard;
    // its reduced gradient is the sum of the ranks'. An expert lives on one rank, whose gradient
    // already holds every rank's tokens.
    std::vector<float> grad(reduced.begin(), reduced.begin() + p.local_count());
    // Every rank holds its own experts at the same positions of its parameter list: perturb one
    // rank's at a time, so that the global loss sees one change.
    const int owners = router ? 1 : s.mesh->world().size();
    for (int trial = 0; trial < 4 * owners; ++trial) {
      const size_t j = pick() % static_cast<size_t>(p.local_count());
      const bool mine = router || trial % owners == rank;
      const double fd = FiniteDifference(p, j, mine, [&] { return GlobalLoss(s); });
      if (!mine) continue;
      if (!MatchesFiniteDifference(p, j, rank, grad[j], fd)) ok = false;
      ++checked;
    }
  }
  EXPECT_GE(checked, 4);
  EXPECT_TRUE(AllRanksOk(ok));
}

INSTANTIATE_TEST_SUITE_P(Mlp, MoeGradientTest, ::testing::Values(MlpKind::kGelu, MlpKind::kSwiglu),
                         [](const ::testing::TestParamInfo<MlpKind>& info) {
                           return std::string(info.param == MlpKind::kSwiglu ? "Swiglu" : "Gelu");
                         });

// The MoE layer's input gradient, which finite differences cannot reach (the dispatch rounds the
// layer's input to E4M3), against the expert's MLP written out here in double: one expert, top_k
// 1, no aux loss, so the layer is gate(=1) x MLP(x) with x rounded on the way. The rounding moves
// the result by a few percent (measured, GELU / SwiGLU: 2.5% / 4.1% forward, 1.6% / 2.7% dx,
// relative L2; E4M3 keeps 3 mantissa bits, BF16 carries outputs and gradients back), under the
// 8% bound; dropping a term of the backward (SwiGLU's up path: 64%, GELU's derivative: 100%)
// moves dx by far more, which the test shows against the same reference before it asserts.
class MoeInputGradientTest : public ::testing::TestWithParam<MlpKind> {};

TEST_P(MoeInputGradientTest, FollowsTheExpertsMlp) {
  const bool swiglu = GetParam() == MlpKind::kSwiglu;
  constexpr int64_t C = 32, F = 48, N = 6;
  auto mesh = parallel::Mesh::Create({.dp = Factory().World().size(), .tp = 1, .ep = 1}, Factory());
  ASSERT_TRUE(mesh.ok()) << mesh.status();
  MoeLayer moe("blocks.0.mlp",
               {.experts = 1,
                .top_k = 1,
                .capacity_factor = 2.0,
                .aux_loss_coef = 0.0,
                .drop_tokens = false},
               C, F, swiglu, GemmPrecision::kFp32, {}, &(*mesh)->ep());
  std::mt19937 rng(29);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  auto random = [&](int64_t count, float std_dev) {
    std::vector<float> v(static_cast<size_t>(count));
    for (float& x : v) x = std_dev * normal(rng);
    return v;
  };
  const std::vector<float> x = random(N * C, 1.0f), dout = random(N * C, 1.0f);
  const std::vector<float> wr = random(C, 0.2f), w1 = random(F * C, 0.2f), wu = random(F * C, 0.2f),
                           w2 = random(C * F, 0.2f);
  moe.router().SetWeight(wr.data());
  moe.fc1(0).SetWeight(w1.data());
  if (swiglu) moe.up(0).SetWeight(wu.data());
  moe.fc2(0).SetWeight(w2.data());
  std::vector<float> g_r(C, 0.0f), g1(F * C, 0.0f), gu(F * C, 0.0f), g2(C * F, 0.0f);
  moe.SetGrads(g_r.data(), {g1.data()},
               swiglu ? std::vector<float*>{gu.data()} : std::vector<float*>{}, {g2.data()});
  Scratch scratch(kernels::CpuOps());
  const LinearContext ctx{.ops = &kernels::CpuOps(), .tp = nullptr, .scratch = &scratch};
  std::vector<float> out(N * C, 0.0f), dx(N * C, 0.0f);
  ASSERT_TRUE(moe.Forward(ctx, x.data(), N, out.data()).ok());
  ASSERT_TRUE(moe.Backward(ctx, dout.data(), N, 1.0f, dx.data()).ok());

  // The reference in double: h = W1 x, (u = Wu x), a = gelu_tanh(h) or silu(h) u, y = W2 a.
  std::vector<double> y_ref(N * C, 0.0), dx_ref(N * C, 0.0), dx_dropped(N * C, 0.0);
  for (int64_t t = 0; t < N; ++t) {
    std::vector<double> h(F), u(F, 1.0), a(F), da(F, 0.0);
    for (int64_t f = 0; f < F; ++f) {
      h[f] = 0.0;
      if (swiglu) u[f] = 0.0;
      for (int64_t c = 0; c < C; ++c) {
        h[f] += double{w1[f * C + c]} * x[t * C + c];
        if (swiglu) u[f] += double{wu[f * C + c]} * x[t * C + c];
      }
    }
    for (int64_t f = 0; f < F; ++f) {
      const double z = h[f];
      if (swiglu) {
        a[f] = z / (1.0 + std::exp(-z)) * u[f];
      } else {
        a[f] = 0.5 * z * (1.0 + std::tanh(0.7978845608028654 * (z + 0.044715 * z * z * z)));
      }
    }
    for (int64_t c = 0; c < C; ++c) {
      for (int64_t f = 0; f < F; ++f) {
        y_ref[t * C + c] += double{w2[c * F + f]} * a[f];
        da[f] += double{w2[c * F + f]} * dout[t * C + c];
      }
    }
    for (int64_t f = 0; f < F; ++f) {
      const double z = h[f], sig = 1.0 / (1.0 + std::exp(-z));
      double dh, du = 0.0, dh_dropped, du_dropped = 0.0;
      if (swiglu) {
        dh = da[f] * u[f] * sig * (1.0 + z * (1.0 - sig));
        du = da[f] * z * sig;
        dh_dropped = dh;  // the up path left out
      } else {
        const double k = 0.7978845608028654, th = std::tanh(k * (z + 0.044715 * z * z * z));
        dh = da[f] *
             (0.5 * (1.0 + th) + 0.5 * z * (1.0 - th * th) * k * (1.0 + 3.0 * 0.044715 * z * z));
        dh_dropped = da[f];  // GELU's derivative left out
      }
      for (int64_t c = 0; c < C; ++c) {
        dx_ref[t * C + c] += double{w1[f * C + c]} * dh + (swiglu ? double{wu[f * C + c]} * du : 0);
        dx_dropped[t * C + c] += double{w1[f * C + c]} * dh_dropped +
                                 (swiglu ? double{wu[f * C + c]} * du_dropped : 0.0);
      }
    }
  }
  auto rel = [](const auto& got, const std::vector<double>& want) {
    double diff = 0.0, norm = 0.0;
    for (size_t i = 0; i < want.size(); ++i) {
      diff += (double{got[i]} - want[i]) * (double{got[i]} - want[i]);
      norm += want[i] * want[i];
    }
    return std::sqrt(diff / norm);
  };
  const double dropped = rel(dx_dropped, dx_ref);
  std::cout << (swiglu ? "swiglu" : "gelu") << " experts: forward off by " << rel(out, y_ref)
            << ", input gradient by " << rel(dx, dx_ref) << ", a dropped term by " << dropped
            << " (relative L2)\n";
  EXPECT_GT(dropped, 0.3) << "a dropped backward term must stand out from the rounding";
  EXPECT_LT(rel(out, y_ref), 0.08) << "forward";
  EXPECT_LT(rel(dx, dx_ref), 0.08) << "input gradient (a dropped term is off by " << dropped << ")";
  EXPECT_TRUE(AllRanksOk(!HasFailure()));
}

INSTANTIATE_TEST_SUITE_P(Mlp, MoeInputGradientTest,
                         ::testing::Values(MlpKind::kGelu, MlpKind::kSwiglu),
                         [](const ::testing::TestParamInfo<MlpKind>& info) {
                           return std::string(info.param == MlpKind::kSwiglu ? "Swiglu" : "Gelu");
                         });

// The layers a recipe may name, as the controller lists them from a spec (ModelLayerNames), are
// the model's own (Transformer::LayerNames, which the worker checks a recipe against), for every
// family, with and without MoE blocks.
// CopyLogits: the logits live in device-only memory; the rows it copies out are the ones the pass
// took its loss from (the mean cross-entropy of the copied rows, in double, against the next
// tokens, is the loss Evaluate returned), and a range outside the pass is refused naming it.
TEST(TransformerTest, CopiedLogitsGiveThePassesLoss) {
  const ModelShape shape = Shape(/*layers=*/2, /*d_model=*/32, /*d_ff=*/64, /*seq_len=*/8);
  ModelUnderTest s = Make(shape, Fp32Recipe());
  ASSERT_NE(s.model, nullptr);
  ASSERT_TRUE(s.model->BeginStep().ok());
  absl::StatusOr<float> loss = s.model->Evaluate(s.tokens, s.micro_batch);
  ASSERT_TRUE(loss.ok()) << loss.status();
  const int64_t T = shape.seq_len, V = shape.vocab, rows = s.micro_batch * T;
  absl::StatusOr<std::vector<float>> logits = s.model->CopyLogits(0, rows);
  ASSERT_TRUE(logits.ok()) << logits.status();
  ASSERT_EQ(logits->size(), static_cast<size_t>(rows * V));
  double sum = 0.0;
  for (int64_t r = 0; r < rows; ++r) {
    const float* row = logits->data() + r * V;
    const int32_t target = s.tokens[static_cast<size_t>((r / T) * (T + 1) + r % T + 1)];
    double top = row[0];
    for (int64_t v = 1; v < V; ++v) top = std::max(top, static_cast<double>(row[v]));
    double z = 0.0;
    for (int64_t v = 0; v < V; ++v) z += std::exp(static_cast<double>(row[v]) - top);
    sum += top + std::log(z) - static_cast<double>(row[target]);
  }
  EXPECT_NEAR(sum / static_cast<double>(rows), *loss,
              1e-5 * std::max(1.0, std::fabs(static_cast<double>(*loss))));
  // One row from the middle: the same values as in the whole copy.
  absl::StatusOr<std::vector<float>> one = s.model->CopyLogits(rows / 2, 1);
  ASSERT_TRUE(one.ok()) << one.status();
  EXPECT_TRUE(std::equal(one->begin(), one->end(), logits->begin() + (rows / 2) * V));
  for (const auto& [first, count] :
       {std::pair<int64_t, int64_t>{rows, 1}, {-1, 1}, {0, rows + 1}}) {
    absl::StatusOr<std::vector<float>> bad = s.model->CopyLogits(first, count);
    EXPECT_EQ(bad.status().code(), absl::StatusCode::kInvalidArgument) << first << " " << count;
    EXPECT_NE(bad.status().message().find("outside the " + std::to_string(rows) + " rows"),
              std::string::npos)
        << bad.status();
  }
}

// The shard gradients stay host-visible step after step (the host reads them at a skipped step),
// also where the FSDP group has one rank and the FP32 gradient is not reduce-scattered (the full
// gradient, a device-only array, used to be swapped in, and the arrays traded placements).
// Their values: the FP32 gradients each pass left, summed over the group, as Grads() gathers them.
TEST(TransformerTest, ShardGradientsStayHostVisibleStepAfterStep) {
  const ModelShape shape = Shape(/*layers=*/2, /*d_model=*/32, /*d_ff=*/64, /*seq_len=*/8);
  ModelRecipe recipe = Fp32Recipe();
  recipe.grad_reduce = parallel::GradReduceDType::kFP32;
  const int world = Factory().World().size();
  ModelUnderTest s =
      Build({.dp = world, .tp = 1, .ep = 1}, shape, recipe, /*seed=*/7, /*token_seed=*/5);
  ASSERT_NE(s.model, nullptr);
  for (int step = 0; step < 3; ++step) {
    SCOPED_TRACE(::testing::Message() << "step " << step);
    ASSERT_TRUE(s.model->BeginStep().ok());
    ASSERT_FALSE(std::isnan(Loss(s)));
    for (const Param& p : s.model->params()) {
      EXPECT_EQ(p.grad.placement(), kernels::Placement::kHostVisible) << p.name;
      EXPECT_EQ(p.full_grad.placement(), kernels::Placement::kDeviceOnly) << p.name;
      ASSERT_EQ(p.grad.size(), static_cast<size_t>(p.shard_count)) << p.name;
      double sum_sq = 0.0;  // a host read of every element: aborts on a device-only array
      for (const float g : p.grad) sum_sq += static_cast<double>(g) * g;
      EXPECT_TRUE(std::isfinite(sum_sq)) << p.name;
    }
  }
}

TEST(TransformerTest, LayerNamesAgreeWithTheSpecs) {
  const int world = Factory().World().size();
  for (const char* family : {"plain", "gpt2", "llama"}) {
    for (const bool moe : {false, true}) {
      const std::string yaml = absl::StrCat(
          "model: {family: ", family, ", layers: 3, d_model: 32, heads: 4, d_ff: 64, ",
          "seq_len: 8, vocab: 256}\n", "parallel: {dp: ", world, ", tp: 1, ep: ", moe ? world : 1,
          "}\n", moe ? "moe: {experts: 2, every: 2}\n" : "",
          "train: {steps: 1, micro_batch: 1}\ndata: {path: x}\n");
      absl::StatusOr<v1::RunSpec> spec = ParseRunSpec(yaml, "test.yaml", {});
      ASSERT_TRUE(spec.ok()) << spec.status();
      auto mesh = parallel::Mesh::Create({.dp = world, .tp = 1, .ep = moe ? world : 1}, Factory());
      ASSERT_TRUE(mesh.ok()) << mesh.status();
      auto model = Transformer::Create(worker::ShapeFromSpec(*spec), Fp32Recipe(), 1, **mesh,
                                       kernels::CpuOps());
      ASSERT_TRUE(model.ok()) << model.status();
      const std::vector<std::string> names = (*model)->LayerNames();
      EXPECT_EQ(names, ModelLayerNames(*spec)) << family << (moe ? " moe" : "");
      // Spot checks of what the list must hold.
      const std::string mlp = std::string(family) == "llama" ? "gate" : "fc1";
      EXPECT_NE(std::find(names.begin(), names.end(), "blocks.0.mlp." + mlp), names.end());
      if (moe) {
        EXPECT_NE(std::find(names.begin(), names.end(), "blocks.1.mlp.experts.1." + mlp),
                  names.end());
      }
    }
  }
}

// Experts that receive no tokens keep a valid scaling state: their sites are unused, report an
// amax of 0 after the MAX over ranks, and their state records no zero (a known failure of
// delayed scaling elsewhere: a zero amax turns into an infinite scale).
TEST(MoeTest, ExpertsWithoutTokensKeepValidScalingState) {
  const ModelShape shape = Shape(/*layers=*/1, /*d_model=*/32, /*d_ff=*/48, /*seq_len=*/2,
                                 {.experts = 8,
                                  .top_k = 1,
                                  .capacity_factor = 8.0,
                                  .aux_loss_coef = 0.01,
                                  .drop_tokens = true});
  ModelRecipe recipe;  // fp8, delayed scaling
  ModelUnderTest s = MakeMoe(shape, recipe);
  s.micro_batch = 1;
  s.tokens.resize(3);
  const int world = s.mesh->world().size();
  for (int step = 0; step < 3; ++step) {
    ASSERT_TRUE(s.model->BeginStep().ok());
    Loss(s);
    absl::StatusOr<std::vector<SiteReport>> reports = s.model->SyncScaling();
    ASSERT_TRUE(reports.ok()) << reports.status();
    // At most 2 tokens per rank x 1 expert each: at least 8 - 2 * world experts got nothing.
    int64_t idle_expert_sites = 0;
    for (const SiteReport& r : *reports) {
      if (r.site.find(".experts.") != std::string::npos &&
          r.site.find("/weight") == std::string::npos && r.amax == 0.0f) {
        ++idle_expert_sites;
      }
    }
    EXPECT_GE(idle_expert_sites, 2 * (8 - 2 * world)) << "step " << step;
    for (const QuantSite* site : s.model->sites()) {
      const train::ScalingState& st = site->state();
      EXPECT_TRUE(std::isfinite(st.scale()) && st.scale() > 0.0f) << site->name();
      for (float amax : st.history()) EXPECT_GT(amax, 0.0f) << site->name();
    }
    const std::vector<MoeBlockStats>& moe = s.model->moe_stats();
    ASSERT_EQ(moe.size(), 1u);
    int64_t routed = moe[0].dropped;
    for (int64_t t : moe[0].tokens_per_expert) routed += t;
    EXPECT_EQ(routed, 2) << "each of this rank's 2 tokens goes to its top-1 expert";
  }
  // An idle expert's input site has never recorded an amax; a busy one has.
  int64_t with_history = 0, without = 0;
  for (const QuantSite* site : s.model->sites()) {
    if (site->name().find(".experts.") == std::string::npos ||
        site->name().find("/input") == std::string::npos) {
      continue;
    }
    (site->state().history().empty() ? without : with_history) += 1;
  }
  EXPECT_GT(with_history, 0);
  EXPECT_GT(without, 0);
}

}  // namespace
}  // namespace fp8rt::model
