// The CUDA MoE routing kernels (kernels/cuda/moe_cuda.cu: issue 23 point 3, routing on the device)
// run on the CPU: their own source, compiled here as host code over the block emulator of
// host_cuda.h. They run the per-token functions of kernels/moe_routing.h, as the CPU entries do,
// so on the host (the host's expf, no contraction) every result is the CPU entries' bit for bit,
// but the FP64 probability sums, which a warp per expert adds in a fixed tree instead of in token
// order. layer_ops_cuda_test (MoeRoutingTest) holds the same kernels to the CPU on a GPU, where
// the device's expf differs. Needs no GPU and no CUDA runtime, only CUDA's headers.
//
// What it shows: the grid-stride loops over tokens, assignments and elements on grids smaller
// than the work (two emulated multiprocessors), the warp-per-expert sums and their shuffles, the
// zero rows of negative indices, dropped assignments, and the entries' argument checks.
//
// Index:
//   MoeHostTest.RouteMatchesTheCpu          shapes, ties among the logits; probability sums
//                                           within FP64 reordering bounds, the same bits again
//   MoeHostTest.DispatchAndCombineMatchTheCpu   gather, scatter, combine (with and without
//                                           gates, accumulating), its backward, the router's
//   MoeHostTest.BadArgumentsAreRefusedAsOnTheCpu
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "kernels/layer_ops.h"
#include "kernels/ops.h"
#include "tests/gpu/host_cuda.h"  // first: it defines what the kernels' source needs

// The stand-ins first (host_cuda_backend.h refuses to come after the file).
// clang-format off
#define cuda_internal host_cuda_internal
#include "tests/gpu/host_cuda_backend.h"
#include "kernels/cuda/moe_cuda.cu"  // NOLINT(build/include): the kernels under test
#undef cuda_internal
// clang-format on

namespace fp8rt::kernels {
namespace {

namespace device = host_cuda_internal;

const LayerOps& Cpu() { return *CpuOps().layer; }

std::vector<float> Normal(size_t n, uint32_t seed, float sigma) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> dist(0.0f, sigma);
  std::vector<float> x(n);
  for (float& v : x) v = dist(rng);
  return x;
}

template <class T>
void ExpectSameBits(const std::vector<T>& got, const std::vector<T>& want,
                    const std::string& what) {
  ASSERT_EQ(got.size(), want.size()) << what;
  size_t bad = 0, first = 0;
  for (size_t i = 0; i < got.size(); ++i) {
    if (std::memcmp(&got[i], &want[i], sizeof(T)) != 0 && bad++ == 0) first = i;
  }
  EXPECT_EQ(bad, 0u) << what << ": " << bad << " of " << got.size() << " differ, the first at "
                     << first;
}

struct Route {
  std::vector<float> probs, gate;
  std::vector<int32_t> expert;
  std::vector<double> sums;
};
Route RouteWith(bool kernels, const std::vector<float>& logits, int64_t n, int64_t e, int64_t k) {
  Route r{std::vector<float>(n * e, -1.0f), std::vector<float>(n * k, -1.0f),
          std::vector<int32_t>(n * k, -1), std::vector<double>(e, -1.0)};
  const absl::Status st = (kernels ? device::MoeRouteCuda : Cpu().moe_route)(
      r.probs.data(), r.expert.data(), r.gate.data(), r.sums.data(), logits.data(), n, e, k,
      Stream{});
  EXPECT_TRUE(st.ok()) << st;
  return r;
}

TEST(MoeHostTest, RouteMatchesTheCpu) {
  struct Case {
    int64_t n, e, k;
  };
  for (const Case c :
       {Case{1, 1, 1}, Case{37, 8, 2}, Case{300, 16, 4}, Case{513, 64, 6}, Case{1000, 3, 3}}) {
    SCOPED_TRACE(::testing::Message() << "n " << c.n << " e " << c.e << " k " << c.k);
    std::vector<float> logits = Normal(c.n * c.e, static_cast<uint32_t>(c.n + c.e), 2.0f);
    for (int64_t t = 0; t < c.n; t += 5) {  // ties: the lower expert wins on both
      for (int64_t x = 0; x < c.e; ++x) logits[t * c.e + x] = 0.5f;
    }
    const Route cpu = RouteWith(false, logits, c.n, c.e, c.k);
    const Route got = RouteWith(true, logits, c.n, c.e, c.k);
    ExpectSameBits(got.probs, cpu.probs, "probs");
    ExpectSameBits(got.expert, cpu.expert, "expert");
    ExpectSameBits(got.gate, cpu.gate, "gate");
    // FP64 sums of n probabilities in [0, 1] in two orders: each within n roundings of the
    // exact sum, so within 2 n 2^-53 sum of each other.
    for (int64_t x = 0; x < c.e; ++x) {
      EXPECT_NEAR(got.sums[x], cpu.sums[x], 2.0 * c.n * 0x1p-53 * cpu.sums[x] + 1e-300)
          << "expert " << x;
    }
    EXPECT_EQ(RouteWith(true, logits, c.n, c.e, c.k).sums, got.sums) << "sums on a second run";
  }
}

TEST(MoeHostTest, DispatchAndCombineMatchTheCpu) {
  const int64_t n = 300, e = 8, k = 2, c = 40, capacity = 60;
  const Route route = RouteWith(false, Normal(n * e, 91, 2.0f), n, e, k);
  // The dispatch plan at a capacity of 60 per expert: slots in expert-major order, the rest
  // dropped.
  std::vector<int64_t> slot(n * k, -1), send_token;
  std::vector<int64_t> routed(e, 0);
  for (int64_t x = 0; x < e; ++x) {
    for (int64_t a = 0; a < n * k; ++a) {
      if (route.expert[a] == x && routed[x]++ < capacity) {
        slot[a] = static_cast<int64_t>(send_token.size());
        send_token.push_back(a / k);
      }
    }
  }
  const int64_t sent = static_cast<int64_t>(send_token.size());
  ASSERT_LT(sent, n * k) << "some assignments are dropped";
  std::vector<int64_t> index = send_token;
  index.push_back(-1);  // a zero row, as an expert's GEMM padding
  const int64_t rows = sent + 1;
  const std::vector<float> x = Normal(n * c, 92, 1.0f), y = Normal(rows * c, 93, 1.0f),
                           dout = Normal(n * c, 94, 1.0f), frac = Normal(e, 95, 0.1f);

  // Distinct destinations for the scatter (rows in reverse), every tenth row not written.
  std::vector<int64_t> scatter_index(rows);
  for (int64_t r = 0; r < rows; ++r) scatter_index[r] = r % 10 == 3 ? -1 : rows - 1 - r;
  auto both = [&](auto&& run) {  // run(kernels) on the CPU and on the kernels
    run(false);
    run(true);
  };
  std::vector<float> gathered[2], scattered[2], out[2], dx[2], dy[2], dgate[2], dl[2];
  both([&](bool kern) {
    gathered[kern].assign(rows * c, -1.0f);
    ASSERT_TRUE((kern ? device::GatherRowsCuda : Cpu().gather_rows)(gathered[kern].data(), x.data(),
                                                                    index.data(), rows, c, Stream{})
                    .ok());
    scattered[kern].assign(rows * c, -2.0f);
    ASSERT_TRUE((kern ? device::ScatterRowsCuda : Cpu().scatter_rows)(
                    scattered[kern].data(), y.data(), scatter_index.data(), rows, c, Stream{})
                    .ok());
    out[kern].assign(n * c, -3.0f);
    ASSERT_TRUE((kern ? device::MoeCombineCuda : Cpu().moe_combine)(
                    out[kern].data(), y.data(), route.gate.data(), slot.data(), route.expert.data(),
                    n, k, c, /*accumulate=*/false, Stream{})
                    .ok());
    dx[kern] = dout;  // accumulated onto, without gates (the input gradients' combine)
    ASSERT_TRUE((kern ? device::MoeCombineCuda : Cpu().moe_combine)(
                    dx[kern].data(), y.data(), nullptr, slot.data(), route.expert.data(), n, k, c,
                    /*accumulate=*/true, Stream{})
                    .ok());
    dy[kern].assign(rows * c, 0.0f);
    dgate[kern].assign(n * k, -4.0f);
    ASSERT_TRUE((kern ? device::MoeCombineBackwardCuda : Cpu().moe_combine_backward)(
                    dy[kern].data(), dgate[kern].data(), dout.data(), y.data(), route.gate.data(),
                    slot.data(), n, k, c, Stream{})
                    .ok());
    dl[kern].assign(n * e, -5.0f);
    ASSERT_TRUE((kern ? device::MoeRouterBackwardCuda : Cpu().moe_router_backward)(
                    dl[kern].data(), route.probs.data(), route.expert.data(), route.gate.data(),
                    dgate[0].data(), frac.data(), 0.01f, n, e, k, Stream{})
                    .ok());
  });
  ExpectSameBits(gathered[1], gathered[0], "gather_rows");
  ExpectSameBits(scattered[1], scattered[0], "scatter_rows");
  ExpectSameBits(out[1], out[0], "moe_combine");
  ExpectSameBits(dx[1], dx[0], "moe_combine without gates, accumulated");
  ExpectSameBits(dy[1], dy[0], "moe_combine_backward dy");
  ExpectSameBits(dgate[1], dgate[0], "moe_combine_backward dgate");
  ExpectSameBits(dl[1], dl[0], "moe_router_backward");
  // The padding row is zeros; dropped assignments have a zero gate gradient.
  for (int64_t col = 0; col < c; ++col) EXPECT_EQ(gathered[1][sent * c + col], 0.0f);
  for (int64_t a = 0; a < n * k; ++a) {
    if (slot[a] < 0) {
      EXPECT_EQ(dgate[1][a], 0.0f) << a;
    }
  }
}

TEST(MoeHostTest, BadArgumentsAreRefusedAsOnTheCpu) {
  std::vector<float> f(64);
  std::vector<int32_t> i32(64);
  std::vector<double> d(8);
  // k > e, tokens without experts, a negative size.
  const absl::Status k_over_e =
      device::MoeRouteCuda(f.data(), i32.data(), f.data(), d.data(), f.data(), 4, 2, 3, Stream{});
  const absl::Status cpu_k_over_e =
      Cpu().moe_route(f.data(), i32.data(), f.data(), d.data(), f.data(), 4, 2, 3, Stream{});
  EXPECT_EQ(k_over_e, cpu_k_over_e);
  EXPECT_FALSE(k_over_e.ok());
  const absl::Status no_experts =
      device::MoeRouteCuda(f.data(), i32.data(), f.data(), d.data(), f.data(), 4, 0, 0, Stream{});
  EXPECT_EQ(no_experts,
            Cpu().moe_route(f.data(), i32.data(), f.data(), d.data(), f.data(), 4, 0, 0, Stream{}));
  EXPECT_FALSE(no_experts.ok());
  const std::vector<int64_t> index(4, 0);
  const absl::Status negative =
      device::GatherRowsCuda(f.data(), f.data(), index.data(), -1, 4, Stream{});
  EXPECT_EQ(negative, Cpu().gather_rows(f.data(), f.data(), index.data(), -1, 4, Stream{}));
  EXPECT_FALSE(negative.ok());
  // A null pointer with work is refused naming the op and the argument.
  const absl::Status null_src = device::GatherRowsCuda(f.data(), nullptr, index.data(), 4, 4, {});
  EXPECT_EQ(null_src.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(null_src.message().find("gather_rows: src is null"), std::string::npos) << null_src;
}

}  // namespace
}  // namespace fp8rt::kernels
