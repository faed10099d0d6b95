// The MoE routing ops of the CPU op table (kernels/layer_ops.h LayerOps::moe_route ...; their
// per-token code, kernels/moe_routing.h, is also what the CUDA kernels run) against references
// written here from the definitions, and the MoE layer's waits for the backend.
//
// Index:
//   RouteTest           softmax (in double), top-k by sorting (-p, index), gates p / sum of the
//                       top-k; ties go to the lower index; probability sums in double
//   RowsTest            gather (negative index: zero row) and scatter (negative: skipped), exact
//   CombineTest         sum of gate * row in increasing expert order, in FP32, exact; dropped
//                       assignments add nothing; accumulate and gate-less forms
//   CombineBackwardTest rows times the gate and FP32 dot products, exact; dropped: gate grad 0
//   RouterBackwardTest  dlogits against central differences in double of
//                       L(l) = sum_j dgate_j g_j(l) + aux_scale sum_x frac_x p_x(l)
//   ArgumentTest        negative sizes and k outside [1, e] are refused, naming them
//   MoeLayerWaitTest    a steady forward + backward of an MoE layer waits for the backend once
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "gtest/gtest.h"
#include "kernels/layer_ops.h"
#include "kernels/ops.h"
#include "parallel/solo_communicator.h"
#include "runtime/model/moe.h"

namespace fp8rt::kernels {
namespace {

const LayerOps& Cpu() { return *CpuOps().layer; }

std::vector<float> Random(size_t n, uint32_t seed, float scale = 1.0f) {
  std::mt19937 gen(seed);
  std::uniform_real_distribution<float> u(-1.0f, 1.0f);
  std::vector<float> v(n);
  for (float& x : v) x = scale * u(gen);
  return v;
}

// Routing of one token from its logits, in double.
struct RefRoute {
  std::vector<double> p;
  std::vector<int32_t> expert;
  std::vector<double> gate;
};
RefRoute Route(const float* l, int64_t e, int64_t k) {
  RefRoute r;
  double mx = l[0], sum = 0.0;
  for (int64_t x = 1; x < e; ++x) mx = std::max(mx, double{l[x]});
  for (int64_t x = 0; x < e; ++x) r.p.push_back(std::exp(double{l[x]} - mx));
  for (double v : r.p) sum += v;
  for (double& v : r.p) v /= sum;
  std::vector<int32_t> order(static_cast<size_t>(e));
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(),
                   [&](int32_t a, int32_t b) { return r.p[a] > r.p[b]; });
  double top = 0.0;
  for (int64_t j = 0; j < k; ++j) {
    r.expert.push_back(order[j]);
    top += r.p[order[j]];
  }
  for (int64_t j = 0; j < k; ++j) r.gate.push_back(r.p[r.expert[j]] / top);
  return r;
}

// What the CPU's moe_route writes for n tokens of e logits.
struct Routed {
  std::vector<float> probs, gate;
  std::vector<int32_t> expert;
  std::vector<double> sums;
};
Routed RouteAll(const std::vector<float>& logits, int64_t n, int64_t e, int64_t k) {
  Routed r{std::vector<float>(n * e), std::vector<float>(n * k), std::vector<int32_t>(n * k),
           std::vector<double>(e)};
  const absl::Status s = Cpu().moe_route(r.probs.data(), r.expert.data(), r.gate.data(),
                                         r.sums.data(), logits.data(), n, e, k, {});
  EXPECT_TRUE(s.ok()) << s;
  return r;
}

TEST(RouteTest, SoftmaxTopKAndGatesFollowTheDefinition) {
  for (const auto& [n, e, k] :
       {std::tuple<int64_t, int64_t, int64_t>{37, 8, 2}, {5, 16, 4}, {9, 3, 3}, {4, 1, 1}}) {
    const std::vector<float> logits = Random(static_cast<size_t>(n * e), 7, 4.0f);
    const auto [probs, gate, expert, sums] = RouteAll(logits, n, e, k);
    std::vector<double> want_sums(e, 0.0);
    for (int64_t t = 0; t < n; ++t) {
      const RefRoute r = Route(logits.data() + t * e, e, k);
      for (int64_t x = 0; x < e; ++x) {
        EXPECT_NEAR(probs[t * e + x], r.p[x], 1e-6 * r.p[x] + 1e-12) << t << " " << x;
        want_sums[x] += probs[t * e + x];
      }
      for (int64_t j = 0; j < k; ++j) {
        EXPECT_EQ(expert[t * k + j], r.expert[j]) << "token " << t << " rank " << j;
        EXPECT_NEAR(gate[t * k + j], r.gate[j], 1e-6) << t << " " << j;
      }
    }
    for (int64_t x = 0; x < e; ++x) EXPECT_EQ(sums[x], want_sums[x]) << "token-order FP64 sum";
  }
}

TEST(RouteTest, TiesGoToTheLowerIndex) {
  const std::vector<float> logits = {1.0f, 3.0f, 3.0f, 0.5f, 3.0f};  // experts 1, 2, 4 tie
  const Routed r = RouteAll(logits, 1, 5, 3);
  EXPECT_EQ(r.expert, (std::vector<int32_t>{1, 2, 4}));
  for (float g : r.gate) EXPECT_FLOAT_EQ(g, 1.0f / 3.0f);
}

TEST(RowsTest, GatherAndScatterMoveWholeRows) {
  const int64_t cols = 5;
  const std::vector<float> src = Random(4 * cols, 3);
  const std::vector<int64_t> index = {2, -1, 0, 3, 2};
  std::vector<float> dst(index.size() * cols, 99.0f);
  ASSERT_TRUE(Cpu().gather_rows(dst.data(), src.data(), index.data(), 5, cols, {}).ok());
  for (size_t i = 0; i < index.size(); ++i) {
    for (int64_t c = 0; c < cols; ++c) {
      EXPECT_EQ(dst[i * cols + c], index[i] < 0 ? 0.0f : src[index[i] * cols + c]);
    }
  }
  const std::vector<int64_t> to = {3, -1, 0, 1};
  std::vector<float> out(4 * cols, 7.0f);
  ASSERT_TRUE(Cpu().scatter_rows(out.data(), src.data(), to.data(), 4, cols, {}).ok());
  for (int64_t c = 0; c < cols; ++c) {
    EXPECT_EQ(out[3 * cols + c], src[0 * cols + c]);
    EXPECT_EQ(out[0 * cols + c], src[2 * cols + c]);
    EXPECT_EQ(out[1 * cols + c], src[3 * cols + c]);
    EXPECT_EQ(out[2 * cols + c], 7.0f) << "no row goes to 2";
  }
}

// Three tokens, k = 3: token 0 keeps all (experts out of order), token 1 drops one, token 2 drops
// all. y rows hold values whose FP32 sum depends on the order.
struct CombineCase {
  int64_t n = 3, k = 3, c = 4;
  std::vector<int32_t> expert = {5, 1, 3, 0, 2, 4, 1, 2, 3};
  std::vector<int64_t> slot = {4, 0, 2, 1, -1, 3, -1, -1, -1};
  std::vector<float> gate = {0.5f, 0.3f, 0.2f, 0.6f, 0.25f, 0.4f, 0.1f, 0.2f, 0.7f};
  std::vector<float> y = [] {
    std::vector<float> v = Random(5 * 4, 11);
    v[4 * 4] = 1e8f;   // token 0, expert 5: last in expert order
    v[0 * 4] = -1e8f;  // token 0, expert 1: first
    v[2 * 4] = 3.0f;
    return v;
  }();
};

// The definition: for each token, its kept assignments sorted by expert, added in FP32.
std::vector<float> RefCombine(const CombineCase& cc, const float* gate, std::vector<float> out,
                              bool accumulate) {
  for (int64_t t = 0; t < cc.n; ++t) {
    std::vector<int64_t> js;
    for (int64_t j = 0; j < cc.k; ++j) {
      if (cc.slot[t * cc.k + j] >= 0) js.push_back(j);
    }
    std::sort(js.begin(), js.end(), [&](int64_t a, int64_t b) {
      return cc.expert[t * cc.k + a] < cc.expert[t * cc.k + b];
    });
    for (int64_t col = 0; col < cc.c; ++col) {
      float o = accumulate ? out[t * cc.c + col] : 0.0f;
      for (int64_t j : js) {
        const float w = gate != nullptr ? gate[t * cc.k + j] : 1.0f;
        const float prod = w * cc.y[cc.slot[t * cc.k + j] * cc.c + col];
        o = o + prod;
      }
      out[t * cc.c + col] = o;
    }
  }
  return out;
}

TEST(CombineTest, AddsTheKeptRowsInExpertOrder) {
  const CombineCase cc;
  std::vector<float> out(cc.n * cc.c, 5.0f);
  ASSERT_TRUE(Cpu()
                  .moe_combine(out.data(), cc.y.data(), cc.gate.data(), cc.slot.data(),
                               cc.expert.data(), cc.n, cc.k, cc.c, false, {})
                  .ok());
  EXPECT_EQ(out, RefCombine(cc, cc.gate.data(), out, false));
  for (int64_t col = 0; col < cc.c; ++col) EXPECT_EQ(out[2 * cc.c + col], 0.0f) << "all dropped";
  // Column 0 of token 0: (0 + 0.3 * -1e8) + 0.2 * 3 + 0.5 * 1e8 in that order.
  EXPECT_EQ(out[0], (0.3f * -1e8f + 0.2f * 3.0f) + 0.5f * 1e8f);
  // Accumulating, without gates (the input gradients' combine).
  const std::vector<float> base = Random(cc.n * cc.c, 12);
  std::vector<float> acc = base;
  ASSERT_TRUE(Cpu()
                  .moe_combine(acc.data(), cc.y.data(), nullptr, cc.slot.data(), cc.expert.data(),
                               cc.n, cc.k, cc.c, true, {})
                  .ok());
  EXPECT_EQ(acc, RefCombine(cc, nullptr, base, true));
}

TEST(CombineBackwardTest, ScalesRowsAndTakesDotProducts) {
  const CombineCase cc;
  const std::vector<float> dout = Random(cc.n * cc.c, 13);
  std::vector<float> dy(5 * cc.c, -3.0f), dgate(cc.n * cc.k, -3.0f);
  ASSERT_TRUE(Cpu()
                  .moe_combine_backward(dy.data(), dgate.data(), dout.data(), cc.y.data(),
                                        cc.gate.data(), cc.slot.data(), cc.n, cc.k, cc.c, {})
                  .ok());
  for (int64_t a = 0; a < cc.n * cc.k; ++a) {
    const int64_t s = cc.slot[a], t = a / cc.k;
    if (s < 0) {
      EXPECT_EQ(dgate[a], 0.0f) << a;
      continue;
    }
    float dot = 0.0f;
    for (int64_t col = 0; col < cc.c; ++col) {
      EXPECT_EQ(dy[s * cc.c + col], cc.gate[a] * dout[t * cc.c + col]);
      const float prod = dout[t * cc.c + col] * cc.y[s * cc.c + col];
      dot = dot + prod;
    }
    EXPECT_EQ(dgate[a], dot) << a;
  }
}

// L(l) in double for fixed experts (the top-k set does not change under a small step).
double RouterLoss(const std::vector<double>& l, const std::vector<int32_t>& expert,
                  const std::vector<float>& dgate, const std::vector<float>& frac,
                  double aux_scale) {
  double mx = l[0], sum = 0.0;
  for (double v : l) mx = std::max(mx, v);
  std::vector<double> p;
  for (double v : l) p.push_back(std::exp(v - mx));
  for (double v : p) sum += v;
  for (double& v : p) v /= sum;
  double top = 0.0, loss = 0.0;
  for (int32_t x : expert) top += p[x];
  for (size_t j = 0; j < expert.size(); ++j) loss += dgate[j] * p[expert[j]] / top;
  for (size_t x = 0; x < p.size(); ++x) loss += aux_scale * frac[x] * p[x];
  return loss;
}

TEST(RouterBackwardTest, MatchesCentralDifferences) {
  const int64_t n = 6, e = 8, k = 3;
  const std::vector<float> logits = Random(n * e, 21, 2.0f);
  const auto [probs, gate, expert, sums] = RouteAll(logits, n, e, k);
  std::vector<float> dl(n * e);
  const std::vector<float> dgate = Random(n * k, 22), frac = Random(e, 23);
  const float aux_scale = 0.37f;
  ASSERT_TRUE(Cpu()
                  .moe_router_backward(dl.data(), probs.data(), expert.data(), gate.data(),
                                       dgate.data(), frac.data(), aux_scale, n, e, k, {})
                  .ok());
  for (int64_t t = 0; t < n; ++t) {
    const std::vector<int32_t> ex(expert.begin() + t * k, expert.begin() + (t + 1) * k);
    const std::vector<float> dg(dgate.begin() + t * k, dgate.begin() + (t + 1) * k);
    for (int64_t x = 0; x < e; ++x) {
      std::vector<double> lp(logits.begin() + t * e, logits.begin() + (t + 1) * e), lm = lp;
      const double h = 1e-5;
      lp[x] += h;
      lm[x] -= h;
      const double fd =
          (RouterLoss(lp, ex, dg, frac, aux_scale) - RouterLoss(lm, ex, dg, frac, aux_scale)) /
          (2 * h);
      EXPECT_NEAR(dl[t * e + x], fd, 2e-5 + 1e-4 * std::fabs(fd))
          << "token " << t << " expert " << x;
    }
  }
}

TEST(ArgumentTest, BadSizesAreRefusedNamingThem) {
  auto message = [](absl::Status s) { return std::string(s.message()); };
  EXPECT_EQ(message(Cpu().moe_route(nullptr, nullptr, nullptr, nullptr, nullptr, -1, 4, 2, {})),
            "moe_route: n is -1 (< 0)");
  EXPECT_NE(message(Cpu().moe_route(nullptr, nullptr, nullptr, nullptr, nullptr, 3, 4, 5, {}))
                .find("moe_route: k is 5 with e = 4"),
            std::string::npos);
  // Tokens without experts: refused by both routing entries (the combines take no e).
  EXPECT_EQ(message(Cpu().moe_route(nullptr, nullptr, nullptr, nullptr, nullptr, 4, 0, 1, {})),
            "moe_route: e is 0 with n = 4 tokens (routing needs at least one expert)");
  EXPECT_EQ(message(Cpu().moe_router_backward(nullptr, nullptr, nullptr, nullptr, nullptr, nullptr,
                                              1.0f, 4, 0, 1, {})),
            "moe_router_backward: e is 0 with n = 4 tokens (routing needs at least one expert)");
  EXPECT_EQ(message(Cpu().gather_rows(nullptr, nullptr, nullptr, 2, -3, {})),
            "gather_rows: c is -3 (< 0)");
  EXPECT_EQ(
      message(Cpu().moe_combine(nullptr, nullptr, nullptr, nullptr, nullptr, 2, -1, 4, false, {})),
      "moe_combine: k is -1 (< 0)");
}

}  // namespace
}  // namespace fp8rt::kernels

namespace fp8rt::model {
namespace {

int waits = 0;
absl::Status CountedSynchronize(kernels::Stream s) {
  ++waits;
  return kernels::CpuOps().layer->synchronize(s);
}

// A steady forward and backward of an MoE layer (4 experts, top-2, tokens dropped for capacity)
// waits for the backend once: to plan the dispatch from the expert ids. The first step also
// sizes buffers; the second repeats it on the same data.
TEST(MoeLayerWaitTest, OneWaitPerForwardAndBackward) {
  kernels::LayerOps layer_ops = *kernels::CpuOps().layer;
  layer_ops.synchronize = &CountedSynchronize;
  kernels::OpTable ops = kernels::CpuOps();
  ops.layer = &layer_ops;
  Scratch scratch(ops);
  parallel::SoloCommunicator ep("ep");
  const int64_t n = 24, c = 16, f = 32, experts = 4;
  MoeConfig config{.experts = experts, .top_k = 2, .capacity_factor = 0.75};
  MoeLayer moe("blocks.0.mlp", config, c, f, /*swiglu=*/true, GemmPrecision::kFp32,
               Fp8SiteConfigs{}, &ep);
  const std::vector<float> router_w = kernels::Random(experts * c, 1);
  std::vector<std::vector<float>> w;
  moe.router().SetWeight(router_w.data());
  std::vector<float> router_g(experts * c, 0.0f);
  std::vector<std::vector<float>> g1, gu, g2;
  for (int64_t e = 0; e < experts; ++e) {
    for (Linear* l : moe.expert_linears(e)) {
      w.push_back(kernels::Random(l->in() * l->out(), static_cast<uint32_t>(10 + w.size())));
      l->SetWeight(w.back().data());
    }
    g1.emplace_back(f * c, 0.0f);
    gu.emplace_back(f * c, 0.0f);
    g2.emplace_back(c * f, 0.0f);
  }
  std::vector<float*> p1, pu, p2;
  for (int64_t e = 0; e < experts; ++e) {
    p1.push_back(g1[e].data());
    pu.push_back(gu[e].data());
    p2.push_back(g2[e].data());
  }
  moe.SetGrads(router_g.data(), p1, pu, p2);
  const std::vector<float> x = kernels::Random(n * c, 2), dout = kernels::Random(n * c, 3);
  LinearContext ctx{.ops = &ops, .tp = nullptr, .scratch = &scratch};
  std::vector<float> out[2], dx[2];
  for (int step = 0; step < 2; ++step) {
    waits = 0;
    out[step].assign(n * c, 0.0f);
    dx[step].assign(n * c, 0.0f);
    absl::StatusOr<MoeStats> stats = moe.Forward(ctx, x.data(), n, out[step].data());
    ASSERT_TRUE(stats.ok()) << stats.status();
    EXPECT_GT(stats->dropped, 0) << "capacity 0.75 drops assignments";
    ASSERT_TRUE(moe.Backward(ctx, dout.data(), n, 1.0f, dx[step].data()).ok());
  }
  EXPECT_EQ(waits, 1);
  EXPECT_EQ(out[0], out[1]);
  EXPECT_EQ(dx[0], dx[1]);
}

}  // namespace
}  // namespace fp8rt::model
