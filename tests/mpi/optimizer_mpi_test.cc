// AdamW (runtime/train/optimizer.h) under mpirun with 2 and 4 ranks: the global gradient norm
// covers every rank of the norm group, every rank takes the same clip and skip decisions, and a
// NaN on one rank makes all of them skip with their weights bitwise unchanged. Expected values
// are computed on each rank from every rank's gradients, which each rank regenerates from the
// owner's seed, never from the collective under test.
#include <bit>
#include <cmath>
#include <cstdint>
#include <limits>
#include <random>
#include <span>
#include <string>
#include <vector>

#include "gtest/gtest.h"
#include "parallel/communicator.h"
#include "runtime/train/optimizer.h"
#include "tests/mpi/mpi_test_env.h"

namespace fp8rt::train {
namespace {

using parallel::Communicator;
using parallel::DType;
using parallel::testing::AllRanksOk;
using parallel::testing::Factory;

// Rank r's gradient for shard s: sizes differ by rank and shard, values uniform in [-2, 2).
std::vector<float> RankGrad(int rank, int shard, uint32_t salt) {
  std::mt19937 gen(7919u * static_cast<uint32_t>(rank) + 31u * static_cast<uint32_t>(shard) + salt);
  std::uniform_real_distribution<float> dist(-2.0f, 2.0f);
  std::vector<float> g(static_cast<size_t>(5 + 3 * rank + shard));
  for (float& x : g) x = dist(gen);
  return g;
}

// Two shards owned by this rank, with the rank's gradients for `salt`.
struct RankShards {
  std::vector<std::vector<float>> master, grad, m, v;
  std::vector<ParamShard> shards;

  RankShards(int rank, uint32_t salt) {
    for (int s = 0; s < 2; ++s) {
      grad.push_back(RankGrad(rank, s, salt));
      const size_t n = grad.back().size();
      master.emplace_back(n, 1.0f + static_cast<float>(rank));
      m.emplace_back(n, 0.0f);
      v.emplace_back(n, 0.0f);
    }
    for (size_t s = 0; s < 2; ++s) {
      shards.push_back(ParamShard{"shard" + std::to_string(s), master[s].data(), grad[s].data(),
                                  m[s].data(), v[s].data(), static_cast<int64_t>(grad[s].size()),
                                  s == 0});
    }
  }
  std::vector<uint32_t> StateBits() const {
    std::vector<uint32_t> bits;
    for (const auto* vecs : {&master, &m, &v}) {
      for (const auto& vec : *vecs) {
        for (float x : vec) bits.push_back(std::bit_cast<uint32_t>(x));
      }
    }
    return bits;
  }
};

// Sum of squares of the gradients of `ranks`, in FP64.
double ExpectedSumSq(const std::vector<int>& ranks, uint32_t salt) {
  double sum = 0.0;
  for (int r : ranks) {
    for (int s = 0; s < 2; ++s) {
      for (float g : RankGrad(r, s, salt)) sum += double{g} * double{g};
    }
  }
  return sum;
}

// True iff `x` has the same bits on every rank of `group`.
bool SameOnAllRanks(Communicator& group, double x) {
  const int64_t mine = std::bit_cast<int64_t>(x);
  std::vector<int64_t> all(static_cast<size_t>(group.size()));
  if (!group.AllGather(&mine, 1, all.data(), DType::kI64).ok()) return false;
  for (int64_t b : all) {
    if (b != mine) return false;
  }
  return true;
}

AdamWConfig Config() {
  AdamWConfig c;
  c.lr = 1e-2;
  c.weight_decay = 0.1;
  c.clip = 1.0;  // far below the norms here: every step is clipped
  return c;
}

TEST(OptimizerMpiTest, GlobalNormCoversEveryRankAndClipsIdentically) {
  Communicator& world = Factory().World();
  std::vector<int> all;
  for (int r = 0; r < world.size(); ++r) all.push_back(r);
  const double expected_norm = std::sqrt(ExpectedSumSq(all, 1));

  RankShards mine(world.rank(), 1);
  AdamW opt(Config());
  absl::StatusOr<StepResult> r = opt.Step(mine.shards, 1, &world);
  // A failed step on one rank must not leave its peers alone in the collectives below.
  if (!AllRanksOk(r.ok())) {
    ADD_FAILURE() << r.status();
    return;
  }
  EXPECT_FALSE(r->skipped);
  // FP64 sums of a few hundred squares in a different association: within 1e-13 relative.
  EXPECT_NEAR(r->grad_norm, expected_norm, 1e-13 * expected_norm);
  const float expected_scale = static_cast<float>(1.0 / (expected_norm + 1e-6));
  EXPECT_NEAR(r->clip_scale, expected_scale, 1e-7 * expected_scale);
  EXPECT_TRUE(AllRanksOk(SameOnAllRanks(world, r->grad_norm)));
  EXPECT_TRUE(AllRanksOk(SameOnAllRanks(world, r->clip_scale)));
  // First moment after one step: (1 - b1) * g * clip_scale, with the global clip factor.
  for (size_t s = 0; s < 2; ++s) {
    for (size_t i = 0; i < mine.m[s].size(); ++i) {
      const double want = 0.1 * double{mine.grad[s][i]} * expected_scale;
      EXPECT_NEAR(mine.m[s][i], want, 1e-6 * std::abs(want) + 1e-12) << s << "/" << i;
    }
  }
}

TEST(OptimizerMpiTest, NormGroupIsTheGivenSubgroupOnly) {
  Communicator& world = Factory().World();
  // Groups of even and odd ranks (as a DP group would be a subset of the world).
  absl::StatusOr<std::unique_ptr<Communicator>> half =
      Factory().Split(world.rank() % 2, world.rank(), "half");
  EXPECT_TRUE(half.ok()) << half.status();
  if (!AllRanksOk(half.ok())) return;
  std::vector<int> members;
  for (int r = world.rank() % 2; r < world.size(); r += 2) members.push_back(r);

  RankShards mine(world.rank(), 2);
  AdamW opt(Config());
  absl::StatusOr<StepResult> r = opt.Step(mine.shards, 1, half->get());
  if (!AllRanksOk(r.ok())) {
    ADD_FAILURE() << r.status();
    return;
  }
  const double expected = std::sqrt(ExpectedSumSq(members, 2));
  EXPECT_NEAR(r->grad_norm, expected, 1e-13 * expected);
  EXPECT_TRUE(AllRanksOk(SameOnAllRanks(**half, r->grad_norm)));
}

TEST(OptimizerMpiTest, NanOnOneRankSkipsOnEveryRank) {
  Communicator& world = Factory().World();
  RankShards mine(world.rank(), 3);
  AdamW opt(Config());
  // One finite step first, so that the moments hold values.
  absl::StatusOr<StepResult> r = opt.Step(mine.shards, 1, &world);
  EXPECT_TRUE(AllRanksOk(r.ok() && !r->skipped));
  const std::vector<uint32_t> before = mine.StateBits();

  const int bad_rank = world.size() - 1;
  const std::vector<float> good = mine.grad[1];
  if (world.rank() == bad_rank) mine.grad[1][2] = std::numeric_limits<float>::quiet_NaN();
  r = opt.Step(mine.shards, 2, &world);
  EXPECT_TRUE(r.ok()) << r.status();
  const bool skipped = r.ok() && r->skipped && std::isnan(r->grad_norm);
  EXPECT_TRUE(skipped) << "rank " << world.rank();
  EXPECT_EQ(opt.applied_steps(), 1);
  EXPECT_EQ(mine.StateBits(), before) << "rank " << world.rank();
  EXPECT_TRUE(AllRanksOk(skipped && mine.StateBits() == before));

  // The next finite step proceeds everywhere, as the second applied step.
  mine.grad[1] = good;
  r = opt.Step(mine.shards, 3, &world);
  const bool applied = r.ok() && !r->skipped && r->applied_steps == 2;
  EXPECT_TRUE(applied) << "rank " << world.rank();
  EXPECT_NE(mine.StateBits(), before);
  EXPECT_TRUE(AllRanksOk(applied));
}

}  // namespace
}  // namespace fp8rt::train
