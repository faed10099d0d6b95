// The fused tensor-core attention kernels (kernels/cuda/flash_attention_cuda.cu) run on the CPU:
// their own source, compiled here as host code over the block emulator of host_cuda.h (each
// CUDA thread a fiber, shared memory, barriers, warp shuffles, WMMA tiles), and held to the
// same FP64 bounds as on a GPU (tests/support/attention_check.h, Precision::Bf16TensorCores;
// attention_cuda_test holds the GPU to them). Needs no GPU and no CUDA runtime, only CUDA's
// headers, so it runs in every CI pass (issue 23: the kernels had never run anywhere).
//
// What it shows that a GPU run shows too: the tiling, the causal masks, the online softmax and
// its rescaling, grouped-query heads, the zero padding of Dh to 16 and of T to 64, a grid with
// fewer blocks than work items (each block moves on to further items), the four-float and the
// scalar tile loads, and the launch code (shared memory per kernel, the grid, the stream-ordered
// scratch). And the barriers: a warp runs as far as CUDA lets it before the others, and a lane
// before its warp, so a missing barrier changes the results. Tried, one at a time: removing any
// of the kernels' nine __syncthreads fails this test, and so does removing seven of the eleven
// __syncwarp. The four others are not needed under the CUDA C++ Programming Guide's rules as the
// emulator applies them: three stand right before a WMMA load, which itself waits until every
// lane of the warp has arrived, and one before lane 0 writes the running maximum, whose old value
// every lane read before the shuffle ahead of it. A barrier some threads never reach is reported.
// What it cannot show: the tensor cores' own summation order (the emulation's is one a tensor
// core may use, inside the bounds), timing, and races that need real concurrency between blocks.
//
// Index:
//   FlashHostTest (TEST_P)   shapes: forward out and lse, backward dq, dk and dv (onto
//                            pre-filled gradients) within the BF16 bounds; the launches ran
//                            several items per block
//   FlashHostTest.UnalignedOperandsGiveTheAlignedBits   the scalar loads against the vector ones
//   FlashHostTest.TooMuchSharedMemoryIsRefused  a head size whose tiles do not fit is not fused
//   AttentionEntriesHostTest  the entries of attention_cuda.cu: the FP32 kernels within the FP64
//                            bounds, the BF16 entries' choice of the fused kernels, bad arguments
//   CrossEntropyHostTest     forward against FP64, backward bit for bit the CPU's
//   HostCudaTest.*           the emulator itself: shuffles and barriers, a missing barrier shows,
//                            static shared memory filled before each block, a divergent barrier
//                            is reported, WMMA against a plain product
#include <gtest/gtest.h>

#include <algorithm>
#include <bit>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <map>
#include <ostream>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "kernels/layer_ops.h"
#include "kernels/ops.h"
#include "runtime/core/checks.h"
#include "tests/gpu/host_cuda.h"  // first: it defines what the kernels' source needs
#include "tests/support/attention_check.h"

// The kernels' file, compiled here under another namespace name (host_cuda_backend.h).
// The stand-ins first (host_cuda_backend.h refuses to come after the file).
// clang-format off
#define cuda_internal host_cuda_internal
#include "tests/gpu/host_cuda_backend.h"
#include "kernels/cuda/flash_attention_cuda.cu"  // NOLINT(build/include): the kernels under test
#undef cuda_internal
// clang-format on

namespace fp8rt::attention_check {
void PrintTo(const AttnShape& s, std::ostream* os) { *os << ShapeName(s); }
}  // namespace fp8rt::attention_check

namespace fp8rt::kernels {
namespace {

namespace flash = host_cuda_internal;
using attention_check::AttnData;
using attention_check::AttnShape;
using attention_check::BackwardWant;
using attention_check::ExactBackward;
using attention_check::ExactForward;
using attention_check::ForwardWant;
using attention_check::OutOfBounds;
using attention_check::Precision;
using attention_check::ShapeName;

bool SameBits(const std::vector<float>& a, const std::vector<float>& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0;
}

struct Grads {
  std::vector<float> dq, dk, dv;
};

// A copy of v starting `shift` floats into a zeroed buffer one float longer than it needs.
std::vector<float> Padded(const std::vector<float>& v, size_t shift) {
  std::vector<float> p(v.size() + shift + 1, 0.0f);
  std::copy(v.begin(), v.end(), p.begin() + static_cast<std::ptrdiff_t>(shift));
  return p;
}

// The fused forward on x's inputs (q, k, v at the given offsets into padded copies: 0 keeps
// them 16-byte aligned), into out and lse.
absl::Status Forward(const AttnData& x, std::vector<float>* out, std::vector<float>* lse,
                     size_t shift = 0) {
  const std::vector<float> q = Padded(x.q, shift), k = Padded(x.k, shift), v = Padded(x.v, shift);
  out->assign(x.size, 0.0f);
  lse->assign(x.lse_size, 0.0f);
  return flash::LaunchFlashForward(out->data(), lse->data(), q.data() + shift, k.data() + shift,
                                   v.data() + shift, x.s.b, x.s.t, x.s.h, x.s.hkv, x.s.dh, x.scale,
                                   Stream{});
}

// The fused backward with the given out and lse, onto x's pre-filled gradients.
absl::StatusOr<Grads> Backward(const AttnData& x, const std::vector<float>& out,
                               const std::vector<float>& lse, size_t shift = 0) {
  const std::vector<float> q = Padded(x.q, shift), k = Padded(x.k, shift), v = Padded(x.v, shift),
                           dout = Padded(x.dout, shift), o = Padded(out, shift);
  Grads g{x.dq0, x.dk0, x.dv0};
  const absl::Status st = flash::LaunchFlashBackward(
      g.dq.data(), g.dk.data(), g.dv.data(), dout.data() + shift, q.data() + shift,
      k.data() + shift, v.data() + shift, o.data() + shift, lse.data(), x.s.b, x.s.t, x.s.h,
      x.s.hkv, x.s.dh, x.scale, Stream{});
  if (!st.ok()) return st;
  return g;
}

// The fused kernels' tile edges (64 rows and keys per tile, Dh padded to 16), grouped-query
// heads and more work items than blocks: attention_cuda_test's BF16 shapes that fuse, at sizes
// that keep the emulation to seconds.
const AttnShape kShapes[] = {
    {1, 1, 1, 1, 1},      // T = 1, Dh = 1: one row of one tile, 15 zero columns
    {1, 64, 2, 2, 64},    // exactly one tile
    {2, 65, 2, 2, 64},    // a second tile with one row and one key
    {1, 200, 3, 3, 24},   // four tiles, Dh padded from 24 to 32
    {1, 130, 2, 2, 100},  // Dh padded from 100 to 112
    {1, 129, 2, 2, 128},  // the largest fused head, three tiles
    {3, 40, 8, 8, 8},     // B * H = 24 items on four blocks
    {1, 100, 8, 2, 64},   // grouped-query: four query heads per kv head
    {1, 70, 6, 1, 128},   // multi-query
};

class FlashHostTest : public ::testing::TestWithParam<AttnShape> {};

TEST_P(FlashHostTest, ForwardAndBackwardWithinBf16Bounds) {
  const AttnData x(GetParam(), 4000);
  const absl::StatusOr<bool> fits = flash::FlashAttentionFits(x.s.dh);
  ASSERT_TRUE(fits.ok() && *fits) << "Dh " << x.s.dh << " should fuse on sm_90";

  const host_cuda::Stats before = host_cuda::stats();
  std::vector<float> out, lse;
  const absl::Status fwd = Forward(x, &out, &lse);
  ASSERT_TRUE(fwd.ok()) << fwd;
  // Race-free kernels give the same bits under another schedule of their threads.
  host_cuda::SetScheduleSeed(GetParam().t * 7919 + GetParam().dh);
  std::vector<float> out2, lse2;
  ASSERT_TRUE(Forward(x, &out2, &lse2).ok());
  EXPECT_TRUE(SameBits(out, out2)) << "out differs between two schedules";
  EXPECT_TRUE(SameBits(lse, lse2)) << "lse differs between two schedules";
  const ForwardWant fw = ExactForward(x, Precision::Bf16TensorCores());
  std::string err = OutOfBounds("out", out, fw.out, fw.out_bound);
  EXPECT_TRUE(err.empty()) << err;
  err = OutOfBounds("lse", lse, fw.lse, fw.lse_bound);
  EXPECT_TRUE(err.empty()) << err;

  // The backward on the CPU table's out and lse (as attention_cuda_test does), onto
  // pre-filled gradients: it must add to them.
  std::vector<float> cpu_out(x.size), cpu_lse(x.lse_size);
  ASSERT_TRUE(CpuOps()
                  .layer
                  ->attention_forward(cpu_out.data(), cpu_lse.data(), x.q.data(), x.k.data(),
                                      x.v.data(), x.s.b, x.s.t, x.s.h, x.s.hkv, x.s.dh, Stream{})
                  .ok());
  const absl::StatusOr<Grads> g = Backward(x, cpu_out, cpu_lse);
  ASSERT_TRUE(g.ok()) << g.status();
  host_cuda::SetScheduleSeed(GetParam().t * 104729 + GetParam().h);
  const absl::StatusOr<Grads> g2 = Backward(x, cpu_out, cpu_lse);
  ASSERT_TRUE(g2.ok()) << g2.status();
  EXPECT_TRUE(SameBits(g->dq, g2->dq)) << "dq differs between two schedules";
  EXPECT_TRUE(SameBits(g->dk, g2->dk)) << "dk differs between two schedules";
  EXPECT_TRUE(SameBits(g->dv, g2->dv)) << "dv differs between two schedules";
  const BackwardWant bw = ExactBackward(x, cpu_out, cpu_lse, Precision::Bf16TensorCores());
  err = OutOfBounds("dq", g->dq, bw.dq, bw.dq_bound);
  EXPECT_TRUE(err.empty()) << err;
  err = OutOfBounds("dk", g->dk, bw.dk, bw.dk_bound);
  EXPECT_TRUE(err.empty()) << err;
  err = OutOfBounds("dv", g->dv, bw.dv, bw.dv_bound);
  EXPECT_TRUE(err.empty()) << err;
  EXPECT_EQ(flash::ScratchLive(), 0) << "the backward's scratch was not freed";

  // Three launches, twice, each on the grid the launch code sizes: at most as many blocks as fit on
  // the two multiprocessors at once, each looping over the rest of the items.
  const host_cuda::Stats after = host_cuda::stats();
  EXPECT_EQ(after.launches - before.launches, 6);
  const int64_t tiles = (x.s.t + 63) / 64;
  const flash::Strides st = flash::StridesOf(x.s.dh);
  auto grid = [](int64_t items, size_t bytes) {
    return std::min<int64_t>(items, flash::kSms * *flash::KernelBlocksPerSm(nullptr, 128, bytes));
  };
  EXPECT_EQ(after.blocks - before.blocks,
            2 * (grid(x.s.b * x.s.h * tiles, flash::ForwardSmemBytes(st)) +
                 grid(x.s.b * x.s.h * tiles, flash::BackwardSmemBytes(st, false)) +
                 grid(x.s.b * x.s.hkv * tiles, flash::BackwardSmemBytes(st, true))));
}

INSTANTIATE_TEST_SUITE_P(Shapes, FlashHostTest, ::testing::ValuesIn(kShapes),
                         [](const auto& info) { return ShapeName(info.param); });

// The tiles load four floats at a time where every row starts 16-byte aligned, one at a time
// otherwise (LoadTile): operands one float past an aligned address must give the same bits.
TEST(FlashHostTest, UnalignedOperandsGiveTheAlignedBits) {
  const AttnData x(AttnShape{1, 70, 4, 2, 64}, 7000);
  std::vector<float> out, lse, out1, lse1;
  ASSERT_TRUE(Forward(x, &out, &lse).ok());
  ASSERT_TRUE(Forward(x, &out1, &lse1, /*shift=*/1).ok());
  EXPECT_TRUE(SameBits(out, out1)) << "out";
  EXPECT_TRUE(SameBits(lse, lse1)) << "lse";
  const absl::StatusOr<Grads> g = Backward(x, out, lse);
  const absl::StatusOr<Grads> g1 = Backward(x, out, lse, /*shift=*/1);
  ASSERT_TRUE(g.ok() && g1.ok());
  EXPECT_TRUE(SameBits(g->dq, g1->dq)) << "dq";
  EXPECT_TRUE(SameBits(g->dk, g1->dk)) << "dk";
  EXPECT_TRUE(SameBits(g->dv, g1->dv)) << "dv";
}

// --- the entries (attention_cuda.cu, compiled in attention_cuda_host.cc) ------------------------

// The FP32 entries (or with `bf16` the BF16-operand ones) on x's inputs, into out and lse.
absl::Status EntryForward(bool bf16, const AttnData& x, std::vector<float>* out,
                          std::vector<float>* lse) {
  out->assign(x.size, 0.0f);
  lse->assign(x.lse_size, 0.0f);
  return (bf16 ? flash::AttentionForwardBf16Cuda : flash::AttentionForwardCuda)(
      out->data(), lse->data(), x.q.data(), x.k.data(), x.v.data(), x.s.b, x.s.t, x.s.h, x.s.hkv,
      x.s.dh, Stream{});
}

// The same for the backward, onto x's pre-filled gradients.
absl::StatusOr<Grads> EntryBackward(bool bf16, const AttnData& x, const std::vector<float>& out,
                                    const std::vector<float>& lse) {
  Grads g{x.dq0, x.dk0, x.dv0};
  const absl::Status st = (bf16 ? flash::AttentionBackwardBf16Cuda : flash::AttentionBackwardCuda)(
      g.dq.data(), g.dk.data(), g.dv.data(), x.dout.data(), x.q.data(), x.k.data(), x.v.data(),
      out.data(), lse.data(), x.s.b, x.s.t, x.s.h, x.s.hkv, x.s.dh, Stream{});
  if (!st.ok()) return st;
  return g;
}

// The FP32 kernels (one warp per query row, the dk/dv kernel over key ranges) within the FP64
// bounds of one FP32 implementation (Precision::Fp32), as attention_cuda_test holds them on a
// GPU; the same bits under another schedule.
TEST(AttentionEntriesHostTest, Fp32KernelsWithinFp64Bounds) {
  for (const AttnShape shape : {AttnShape{1, 1, 1, 1, 1}, AttnShape{2, 50, 6, 2, 24},
                                AttnShape{1, 33, 3, 1, 7}, AttnShape{1, 40, 2, 2, 160}}) {
    SCOPED_TRACE(ShapeName(shape));
    const AttnData x(shape, 8000);
    std::vector<float> out, lse, out2, lse2;
    ASSERT_TRUE(EntryForward(false, x, &out, &lse).ok());
    const ForwardWant fw = ExactForward(x);
    std::string err = OutOfBounds("out", out, fw.out, fw.out_bound);
    EXPECT_TRUE(err.empty()) << err;
    err = OutOfBounds("lse", lse, fw.lse, fw.lse_bound);
    EXPECT_TRUE(err.empty()) << err;
    host_cuda::SetScheduleSeed(static_cast<uint64_t>(shape.t * 31 + shape.dh));
    ASSERT_TRUE(EntryForward(false, x, &out2, &lse2).ok());
    EXPECT_TRUE(SameBits(out, out2) && SameBits(lse, lse2)) << "another schedule, other bits";

    const absl::StatusOr<Grads> g = EntryBackward(false, x, out, lse);
    ASSERT_TRUE(g.ok()) << g.status();
    const BackwardWant bw = ExactBackward(x, out, lse);
    err = OutOfBounds("dq", g->dq, bw.dq, bw.dq_bound);
    EXPECT_TRUE(err.empty()) << err;
    err = OutOfBounds("dk", g->dk, bw.dk, bw.dk_bound);
    EXPECT_TRUE(err.empty()) << err;
    err = OutOfBounds("dv", g->dv, bw.dv, bw.dv_bound);
    EXPECT_TRUE(err.empty()) << err;
  }
}

// The BF16-operand entries launch the fused kernels for head sizes up to 128 (their bits are
// LaunchFlash*'s), and the FP32 kernels above (their bits are the FP32 entries').
TEST(AttentionEntriesHostTest, Bf16EntriesFuseHeadSizesUpTo128) {
  for (const int64_t dh : {int64_t{64}, int64_t{128}, int64_t{136}}) {
    SCOPED_TRACE(::testing::Message() << "Dh " << dh);
    const AttnData x(AttnShape{1, 70, 2, 1, dh}, 9000);
    const bool fused = dh <= 128;
    std::vector<float> out, lse, want_out, want_lse;
    ASSERT_TRUE(EntryForward(true, x, &out, &lse).ok());
    ASSERT_TRUE(
        (fused ? Forward(x, &want_out, &want_lse) : EntryForward(false, x, &want_out, &want_lse))
            .ok());
    EXPECT_TRUE(SameBits(out, want_out) && SameBits(lse, want_lse));
    const absl::StatusOr<Grads> g = EntryBackward(true, x, out, lse);
    const absl::StatusOr<Grads> want =
        fused ? Backward(x, out, lse) : EntryBackward(false, x, out, lse);
    ASSERT_TRUE(g.ok() && want.ok());
    EXPECT_TRUE(SameBits(g->dq, want->dq) && SameBits(g->dk, want->dk) &&
                SameBits(g->dv, want->dv));
  }
}

TEST(AttentionEntriesHostTest, BadArgumentsAreRefusedNamingTheEntry) {
  std::vector<float> a(64), b(64), c(64), d(64), e(64), lse(64);
  absl::Status st = flash::AttentionForwardBf16Cuda(a.data(), lse.data(), b.data(), c.data(),
                                                    d.data(), 1, 2, 3, 2, 2, Stream{});
  EXPECT_NE(st.message().find("attention_forward_bf16: hkv is 2"), std::string::npos) << st;
  st = flash::AttentionBackwardBf16Cuda(a.data(), b.data(), c.data(), d.data(), e.data(), a.data(),
                                        b.data(), c.data(), nullptr, 1, 2, 2, 2, 2, Stream{});
  EXPECT_NE(st.message().find("attention_backward_bf16: lse is null"), std::string::npos) << st;
  st = flash::AttentionForwardCuda(a.data(), lse.data(), b.data(), c.data(), d.data(), 1, 2, 2, 2,
                                   -1, Stream{});
  EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument) << st;
}

// Cross-entropy: the forward's probabilities and losses against an FP64 evaluation of the
// softmax (one block per row: a strided sum and a tree on the emulator as on a GPU; each FP32
// implementation within (v + 16) u of the exact sum, doubled, plus the exp, log and division),
// the backward bit for bit the CPU's (three operations rounded once each, in the CPU's order).
TEST(CrossEntropyHostTest, ForwardWithinBoundsAndBackwardBitForBit) {
  constexpr double kU = 0x1p-24;
  for (const int64_t v : {int64_t{1}, int64_t{257}, int64_t{3000}}) {
    SCOPED_TRACE(::testing::Message() << "v " << v);
    const int64_t n = 37;
    std::vector<float> logits = attention_check::NormalValues(n * v, 3.0f, 31);
    logits[5] = 40.0f;  // a dominant logit
    // A row whose maximum is far above anything before it, in column 200 (the seventh warp's
    // thread): a maximum taken from stale shared memory (a missing barrier) would overflow the
    // row's exponentials.
    logits[2 * v + std::min<int64_t>(v - 1, 200)] = 1000.0f;
    std::vector<int32_t> targets(n);
    for (int64_t r = 0; r < n; ++r) targets[r] = static_cast<int32_t>((r * 7919) % v);
    std::vector<float> probs(n * v, -1.0f), losses(n, -1.0f);
    ASSERT_TRUE(flash::CrossEntropyForwardCuda(probs.data(), losses.data(), logits.data(),
                                               targets.data(), n, v, Stream{})
                    .ok());
    for (int64_t r = 0; r < n; ++r) {
      const float* l = logits.data() + r * v;
      double m = -INFINITY, sum = 0.0;
      for (int64_t j = 0; j < v; ++j) m = std::max(m, double{l[j]});
      for (int64_t j = 0; j < v; ++j) sum += std::exp(double{l[j]} - m);
      const double rel = 2.0 * (static_cast<double>(v) + 16.0) * kU + 16.0 * kU;
      for (int64_t j = 0; j < v; ++j) {
        const double p = std::exp(double{l[j]} - m) / sum;
        EXPECT_NEAR(probs[r * v + j], p, rel * p + 0x1p-120) << "row " << r << " column " << j;
      }
      const double loss = std::log(sum) - (double{l[targets[r]]} - m);
      EXPECT_NEAR(losses[r], loss,
                  rel * (std::fabs(m) + std::log(sum) + std::fabs(loss)) + 0x1p-120)
          << "row " << r;
    }
    std::vector<float> cpu = attention_check::NormalValues(n * v, 1.0f, 32), got = cpu;
    ASSERT_TRUE(CpuOps()
                    .layer
                    ->cross_entropy_backward(cpu.data(), probs.data(), targets.data(), n, v, 0.75f,
                                             Stream{})
                    .ok());
    ASSERT_TRUE(flash::CrossEntropyBackwardCuda(got.data(), probs.data(), targets.data(), n, v,
                                                0.75f, Stream{})
                    .ok());
    EXPECT_TRUE(SameBits(got, cpu)) << "cross_entropy_backward";
  }
}

// --- the emulator ----------------------------------------------------------------------------

constexpr unsigned kFull = 0xFFFFFFFFu;

// Each block: thread i of 64 holds i + 1000 * block; a butterfly gives every lane its warp's
// sum, a down-shuffle the lane 3 above's value, and the two warps' sums meet in shared memory.
void ShuffleKernel(float* sums, float* down, float* block_sums) {
  FP8RT_STATIC_SHARED(float, warp_sums, [2]);
  const int i = static_cast<int>(threadIdx.x), lane = i & 31;
  const float mine = static_cast<float>(i + 1000 * static_cast<int>(blockIdx.x));
  float v = mine;
  for (int offset = 16; offset > 0; offset >>= 1) v += __shfl_xor_sync(kFull, v, offset);
  const int at = static_cast<int>(blockIdx.x) * 64 + i;
  sums[at] = v;
  down[at] = __shfl_down_sync(kFull, mine, 3);
  if (lane == 0) warp_sums[i / 32] = v;
  __syncthreads();
  if (i == 0) block_sums[blockIdx.x] = warp_sums[0] + warp_sums[1];
}

TEST(HostCudaTest, ShufflesAndBarriersGiveTheDeviceResults) {
  std::vector<float> sums(128), down(128), block_sums(2);
  const std::string err =
      host_cuda::RunGrid(reinterpret_cast<const void*>(&ShuffleKernel), dim3(2), dim3(64), 0,
                         [&] { ShuffleKernel(sums.data(), down.data(), block_sums.data()); });
  ASSERT_TRUE(err.empty()) << err;
  for (int b = 0; b < 2; ++b) {
    float block = 0.0f;
    for (int w = 0; w < 2; ++w) {
      float warp = 0.0f;
      for (int lane = 0; lane < 32; ++lane) warp += static_cast<float>(w * 32 + lane + 1000 * b);
      block += warp;
      for (int lane = 0; lane < 32; ++lane) {
        const int at = b * 64 + w * 32 + lane;
        EXPECT_EQ(sums[at], warp) << "block " << b << " thread " << w * 32 + lane;
        const int src = lane + 3 < 32 ? lane + 3 : lane;  // the top lanes keep their own
        EXPECT_EQ(down[at], static_cast<float>(w * 32 + src + 1000 * b)) << at;
      }
    }
    EXPECT_EQ(block_sums[b], block) << "block " << b;
  }
}

// Thread i writes x[i] of shared memory and reads x[i + 1]: with the barrier every thread
// reads its neighbour's value; without it thread 0 has read before thread 1 wrote.
template <bool kBarrier>
void NeighbourKernel(float* got) {
  FP8RT_DYNAMIC_SHARED(float, x);
  const int i = static_cast<int>(threadIdx.x);
  x[i] = static_cast<float>(i);
  if (kBarrier) __syncthreads();
  got[i] = x[(i + 1) % 64];
}

TEST(HostCudaTest, AMissingBarrierShowsInTheResults) {
  std::vector<float> with(64), without(64);
  ASSERT_TRUE(host_cuda::RunGrid(nullptr, dim3(1), dim3(64), 64 * sizeof(float), [&] {
                NeighbourKernel<true>(with.data());
              }).empty());
  ASSERT_TRUE(host_cuda::RunGrid(nullptr, dim3(1), dim3(64), 64 * sizeof(float), [&] {
                NeighbourKernel<false>(without.data());
              }).empty());
  int unwritten = 0;
  for (int i = 0; i < 64; ++i) {
    EXPECT_EQ(with[i], static_cast<float>((i + 1) % 64)) << i;
    // Without it each thread reads its neighbour's value or, where it ran first, the fill.
    if (std::isnan(without[i])) {
      ++unwritten;
    } else {
      EXPECT_EQ(without[i], static_cast<float>((i + 1) % 64)) << i;
    }
  }
  EXPECT_GT(unwritten, 0) << "every thread ran after its neighbour: no schedule shows the race";
}

// Block b: thread 0 reads both static shared cells before writing them (a kernel bug), then
// leaves its own values for the next block. A plain kernel, a template kernel and an inline
// helper (GCC would ignore a section attribute on the statics of the last two).
void StaleSharedKernel(float* seen_f, uint32_t* seen_u) {
  FP8RT_STATIC_SHARED(float, cell_f, );
  FP8RT_STATIC_SHARED(uint32_t, cell_u, [3]);
  if (threadIdx.x == 0) {
    seen_f[blockIdx.x] = cell_f;
    seen_u[blockIdx.x] = cell_u[2];
    cell_f = 1.0f;
    cell_u[2] = 7u;
  }
}

template <class T>
void StaleSharedTemplateKernel(T* seen) {
  FP8RT_STATIC_SHARED(T, tile, [4][5]);
  if (threadIdx.x == 0) {
    seen[blockIdx.x] = tile[3][4];
    tile[3][4] = T{7};
  }
}

inline void StaleSharedInline(uint64_t* seen) {
  FP8RT_STATIC_SHARED(uint64_t, cell, [2]);
  if (threadIdx.x == 0) {
    seen[blockIdx.x] = cell[1];
    cell[1] = 7u;
  }
}

// So a read before this block's write shows as NaN (or all ones), never as the previous block's
// values, in the first block (filled when the declaration is first reached) and every later one.
TEST(HostCudaTest, StaticSharedMemoryIsFilledBeforeEachBlock) {
  std::vector<float> seen_f(3, 0.0f), seen_t(3, 0.0f);
  std::vector<uint32_t> seen_u(3, 0u);
  std::vector<uint64_t> seen_i(3, 0u);
  ASSERT_TRUE(host_cuda::RunGrid(nullptr, dim3(3), dim3(32), 0, [&] {
                StaleSharedKernel(seen_f.data(), seen_u.data());
                StaleSharedTemplateKernel<float>(seen_t.data());
                StaleSharedInline(seen_i.data());
              }).empty());
  // A second launch starts from the filled state too, not from the last block's values.
  std::vector<float> again(3, 0.0f);
  ASSERT_TRUE(host_cuda::RunGrid(nullptr, dim3(3), dim3(32), 0, [&] {
                StaleSharedTemplateKernel<float>(again.data());
              }).empty());
  for (int b = 0; b < 3; ++b) {
    const auto i = static_cast<size_t>(b);
    EXPECT_EQ(std::bit_cast<uint32_t>(seen_f[i]), 0xFFFFFFFFu) << b;
    EXPECT_EQ(seen_u[i], 0xFFFFFFFFu) << b;
    EXPECT_EQ(std::bit_cast<uint32_t>(seen_t[i]), 0xFFFFFFFFu) << b;
    EXPECT_EQ(seen_i[i], ~uint64_t{0}) << b;
    EXPECT_EQ(std::bit_cast<uint32_t>(again[i]), 0xFFFFFFFFu) << b;
  }
}

void DivergentKernel(int* done) {
  if (threadIdx.x < 40)
    __syncthreads();  // threads 40 .. 63 wait at the shuffle
  else
    (void)__shfl_xor_sync(kFull, 1, 1);
  *done = 1;
}

TEST(HostCudaTest, ABarrierSomeThreadsNeverReachIsReported) {
  int done = 0;
  const std::string err =
      host_cuda::RunGrid(nullptr, dim3(1), dim3(64), 0, [&] { DivergentKernel(&done); });
  EXPECT_NE(err.find("can no longer progress"), std::string::npos) << err;
  EXPECT_NE(err.find("thread (0, 0, 0) waits at __syncthreads"), std::string::npos) << err;
  EXPECT_EQ(done, 0);
  EXPECT_FALSE(host_cuda::TakeLaunchError().empty());
  // The next launch runs normally.
  std::vector<float> got(64);
  EXPECT_TRUE(host_cuda::RunGrid(nullptr, dim3(1), dim3(64), 64 * sizeof(float), [&] {
                NeighbourKernel<true>(got.data());
              }).empty());
}

TEST(HostCudaTest, LaunchesOverTheLimitsAreRefused) {
  EXPECT_NE(host_cuda::RunGrid(nullptr, dim3(1), dim3(1025), 0, [] {}).find("1025 threads"),
            std::string::npos);
  static int kernel_tag;
  const void* kernel = &kernel_tag;
  EXPECT_NE(host_cuda::RunGrid(kernel, dim3(1), dim3(32), 64 << 10, [] {})
                .find("over the kernel's limit of 49152"),
            std::string::npos);
  host_cuda::SetMaxDynamicSharedMemory(kernel, 64 << 10);
  EXPECT_TRUE(host_cuda::RunGrid(kernel, dim3(1), dim3(32), 64 << 10, [] {}).empty());
  EXPECT_NE(host_cuda::RunGrid(kernel, dim3(1), dim3(32), 228 << 10, [] {}).find("over sm_90's"),
            std::string::npos);
  EXPECT_NE(host_cuda::RunGrid(nullptr, dim3(4097, 4097), dim3(32), 0, [] {})
                .find("a grid of 16785409 blocks, over the emulator's 16777216"),
            std::string::npos);
  (void)host_cuda::TakeLaunchError();
}

// Each block's thread 0 records when its block ran, on a 5 x 4 x 3 grid.
void BlockOrderKernel(int* ran_at, int* next) {
  if (threadIdx.x == 0) {
    ran_at[(blockIdx.z * gridDim.y + blockIdx.y) * gridDim.x + blockIdx.x] = (*next)++;
  }
}

std::vector<int> BlockOrder(uint64_t seed) {
  host_cuda::SetScheduleSeed(seed);
  std::vector<int> ran_at(60, -1);
  int next = 0;
  EXPECT_TRUE(host_cuda::RunGrid(nullptr, dim3(5, 4, 3), dim3(64), 0, [&] {
                BlockOrderKernel(ran_at.data(), &next);
              }).empty());
  EXPECT_EQ(next, 60);
  return ran_at;
}

// The blocks run in a random order that the schedule's seed picks: every block once, not in
// index order, another order under another seed. (A kernel whose blocks read each other's
// output without an atomic then gives other bits under another seed, as on a GPU.)
TEST(HostCudaTest, BlocksRunOnceEachInTheScheduleOrder) {
  std::vector<int> order = BlockOrder(7);
  std::vector<int> sorted = order;
  std::sort(sorted.begin(), sorted.end());
  for (int i = 0; i < 60; ++i) ASSERT_EQ(sorted[static_cast<size_t>(i)], i) << "once each";
  EXPECT_FALSE(std::is_sorted(order.begin(), order.end())) << "not in index order";
  EXPECT_NE(BlockOrder(8), order) << "another seed, another order";
}

// One warp: C = A B + C on a 16 x 16 x 16 tile through WMMA, A row-major and B column-major
// from shared memory, stored row-major; then (with kSync) lane 0 reads the whole stored tile.
template <bool kSync>
void WmmaKernel(float* c, float* lane0_copy, const float* a, const float* b) {
  FP8RT_DYNAMIC_SHARED(unsigned char, smem);
  auto* sa = reinterpret_cast<__nv_bfloat16*>(smem);
  auto* sb = sa + 256;
  auto* sc = reinterpret_cast<float*>(smem + 1024);
  const int lane = static_cast<int>(threadIdx.x);
  for (int e = lane; e < 256; e += 32) {
    sa[e] = __float2bfloat16_rn(a[e]);
    sb[(e % 16) * 16 + e / 16] = __float2bfloat16_rn(b[e]);  // B[k][n] at n * 16 + k
    sc[e] = c[e];
  }
  __syncwarp();
  nvcuda::wmma::fragment<nvcuda::wmma::matrix_a, 16, 16, 16, __nv_bfloat16, nvcuda::wmma::row_major>
      fa;
  nvcuda::wmma::fragment<nvcuda::wmma::matrix_b, 16, 16, 16, __nv_bfloat16, nvcuda::wmma::col_major>
      fb;
  nvcuda::wmma::fragment<nvcuda::wmma::accumulator, 16, 16, 16, float> acc;
  nvcuda::wmma::load_matrix_sync(fa, sa, 16);
  nvcuda::wmma::load_matrix_sync(fb, sb, 16);
  nvcuda::wmma::load_matrix_sync(acc, sc, 16, nvcuda::wmma::mem_row_major);
  nvcuda::wmma::mma_sync(acc, fa, fb, acc);
  nvcuda::wmma::store_matrix_sync(sc, acc, 16, nvcuda::wmma::mem_row_major);
  if (kSync) __syncwarp();
  if (lane == 0) {
    for (int e = 0; e < 256; ++e) lane0_copy[e] = sc[e];
  }
  __syncwarp();
  for (int e = lane; e < 256; e += 32) c[e] = sc[e];
}

TEST(HostCudaTest, WmmaGivesThePlainProductAndItsStoreNeedsASyncwarp) {
  std::vector<float> a(256), b(256), c0(256);
  for (int e = 0; e < 256; ++e) {  // BF16-exact values, so that the product is exact
    a[e] = static_cast<float>((e * 7) % 13) - 6.0f;
    b[e] = static_cast<float>((e * 5) % 11) * 0.5f - 2.5f;
    c0[e] = static_cast<float>(e % 9);
  }
  std::vector<float> want(256);
  int changed = 0;
  for (int r = 0; r < 16; ++r) {
    for (int col = 0; col < 16; ++col) {
      const int e = r * 16 + col;
      want[e] = c0[e];
      for (int k = 0; k < 16; ++k) want[e] += a[r * 16 + k] * b[k * 16 + col];
      changed += want[e] != c0[e];
    }
  }
  ASSERT_GT(changed, 200) << "the product should change most of C";
  // Eight launches of each, under eight schedules: with the __syncwarp lane 0 always reads the
  // whole product; without it, it reads its own elements (every 32nd) and, of the others, those
  // whose lanes ran before it: some old values under almost every schedule.
  int stale_launches = 0;
  for (int launch = 0; launch < 8; ++launch) {
    std::vector<float> c = c0, copy(256), c_nosync = c0, copy_nosync(256);
    ASSERT_TRUE(host_cuda::RunGrid(nullptr, dim3(1), dim3(32), 2048, [&] {
                  WmmaKernel<true>(c.data(), copy.data(), a.data(), b.data());
                }).empty());
    ASSERT_TRUE(host_cuda::RunGrid(nullptr, dim3(1), dim3(32), 2048, [&] {
                  WmmaKernel<false>(c_nosync.data(), copy_nosync.data(), a.data(), b.data());
                }).empty());
    EXPECT_EQ(c, want);
    EXPECT_EQ(copy, want);
    EXPECT_EQ(c_nosync, want);
    int stale = 0;
    for (int e = 0; e < 256; ++e) {
      if (copy_nosync[e] == want[e]) continue;
      ++stale;
      EXPECT_NE(e % 32, 0) << "lane 0's own element " << e;
      EXPECT_EQ(copy_nosync[e], c0[e]) << e;
    }
    stale_launches += stale > 0;
  }
  EXPECT_GE(stale_launches, 6);
}

}  // namespace
}  // namespace fp8rt::kernels
