// The CUDA attention and cross-entropy entries of the layer-op table (CudaOps()->layer:
// attention_forward, attention_backward, cross_entropy_forward, cross_entropy_backward,
// kernels/cuda/attention_cuda.cu). Attention is checked against an FP64 evaluation of the
// contract (tests/support/attention_check.h), the CPU table's entries (CpuOps().layer) against the
// same values and bounds; cross-entropy against the CPU table's entries on the same inputs.
//
// Index:
//   (attention shapes include grouped-query ones: H query heads on Hkv kv heads, Hkv = 1 too)
//   AttentionForwardTest (TEST_P)   shapes; GPU and CPU out and lse within the FP64 bounds, a
//                                   second GPU run bit for bit the first
//   AttentionBackwardTest (TEST_P)  shapes; the CPU forward's out and lse fed to both backends,
//                                   onto pre-filled gradients (they must accumulate): GPU and CPU
//                                   dq, dk and dv within the FP64 bounds, a second GPU run bit
//                                   for bit the first
//   AttentionAccumulateTest.TwoCallsAddTwice   two backward calls add two contributions: each
//                                   call within the bounds of one call onto what it started from
//   AttentionBf16Test (TEST_P)      the BF16-operand entries (the fused tensor-core kernels for
//                                   Dh <= 128) over tile-edge shapes: out, lse and the
//                                   accumulated gradients within the BF16 bounds
//                                   (Precision::Bf16TensorCores), reruns bit for bit, and the
//                                   forward not the FP32 kernels' bits where the fused one runs
//   CudaLayerTest.Bf16EntriesRefuse...  bad arguments refused naming the BF16 entry
//   CrossEntropyForwardTest (TEST_P)   shapes; probs and losses within the bounds below, against
//                                   the CPU and against an FP64 evaluation; reruns bit for bit
//   CrossEntropyBackwardTest (TEST_P)  shapes x dloss; bit for bit, accumulating
//   CrossEntropyTest.HugeLogits     a logit of 3e38 in a row: exact one-hot probabilities, loss 0
//                                   or the finite exact value, no overflow
//   CrossEntropyTest.EveryLogitCounts  a half-probability logit at every column in turn: exact
//                                   values from the formula (an element a reduction drops shows)
//   ArgumentTest                    host and null pointers, negative sizes, dh = 0, an hkv that
//                                   does not divide h, overflowing sizes and v = 0 are
//                                   refused with InvalidArgument naming the argument, before
//                                   anything runs; empty sizes are fine
//
// Attention tolerances: tests/support/attention_check.h derives, per element and in FP64 from the
// inputs, a first-order bound on the error of ONE FP32 implementation of the contract against
// its exact (FP64) value; each backend is held to twice it plus 2^-120 separately, so neither is
// the yardstick of the other (their summation orders differ: tiles on the CPU, lanes on CUDA).
//
// Cross-entropy tolerances. u = 2^-24 (FP32 unit roundoff); the CPU reference is compiled without
// FMA contraction (GCC, -std=c++20); a sequential FP32 sum of n terms is within (n + 1) u
// sum|terms| of the exact one, and the GPU's sums (thread-strided then a block tree) have depth
// well under their length plus 8. CUDA's expf is within 2 ulp and logf within 1 ulp (CUDA C
// Programming Guide, mathematical functions appendix); glibc's within 1 ulp; 1 ulp <= 2u |value|
// for normal values. Every bound below is the sum of the GPU's and the CPU's first-order error
// bounds against exact arithmetic, computed per element in FP64 from the inputs, then doubled
// (kSafety) for the second-order terms; kTiny (2^-120) absolute slack covers results in or next
// to the subnormal range, where relative bounds do not hold.
//
// Cross-entropy forward, row of V logits, m = max (exact), x_j = l_j - m (the same FP32
// subtraction on both sides: identical), e_j = exp(x_j):
//   sum:    relative r_sum = 6u (expf) + (V + ceil(V / 256) + 16) u (CPU sequential, GPU strided)
//   p_j:    p_j (6u + r_sum + 4u)
//   loss:   r_sum + 4u |log sum| (logf) + 2u (|m| + |log sum|) + 2u |loss| (the two additions)
// and against FP64 (the GPU alone; r = 4u (expf) + (ceil(V / 256) + 8) u, the sum's relative
// bound; the FP64 value's rounding to FP32 adds u |value|):
//   p_j:    p_j (4u + r + 2u + u);  loss: r + 2u |log sum| (logf) + u (|m| + |log sum|) + 2u |loss|
// Cross-entropy backward: none. The host computes dloss / N as the CPU does, and the kernel
// rounds each of the three operations once, in the CPU's order: bit for bit.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <ostream>
#include <random>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "kernels/cuda/cuda_ops_internal.h"
#include "kernels/layer_ops.h"
#include "kernels/ops.h"
#include "tests/gpu/gpu_test_support.h"
#include "tests/support/attention_check.h"

namespace fp8rt::attention_check {
// gtest prints a shape parameter by its name (found by argument-dependent lookup).
void PrintTo(const AttnShape& s, std::ostream* os) { *os << ShapeName(s); }
}  // namespace fp8rt::attention_check

namespace fp8rt::kernels {
namespace {

constexpr double kU = 0x1p-24;
constexpr double kTiny = 0x1p-120;
constexpr double kSafety = 2.0;

using gpu_test::CudaStreamTest;
using gpu_test::DeviceBuffer;
using gpu_test::Download;
using gpu_test::Poison;
using gpu_test::Put;
using gpu_test::Upload;

uint32_t Bits(float x) { return std::bit_cast<uint32_t>(x); }

bool SameBits(const std::vector<float>& a, const std::vector<float>& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0;
}

std::vector<float> Normal(size_t n, float sigma, uint32_t seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> dist(0.0f, sigma);
  std::vector<float> x(n);
  for (auto& v : x) v = dist(rng);
  return x;
}

// --- fixture -----------------------------------------------------------------------------------

// Skips without a usable device, with the CUDA runtime's reason (fails instead under
// FP8RT_REQUIRE_GPU=1); runs the CUDA entries on a non-blocking stream of its own.
class CudaLayerTest : public CudaStreamTest {
 protected:
  CudaLayerTest() : CudaStreamTest(cudaStreamNonBlocking) {}
  void SetUp() override {
    CudaStreamTest::SetUp();
    if (Stopped()) return;
    gpu_ = cuda_ops_->layer;
    ASSERT_NE(gpu_, nullptr);
    ASSERT_NE(gpu_->attention_forward, nullptr);
    ASSERT_NE(gpu_->attention_backward, nullptr);
    ASSERT_NE(gpu_->cross_entropy_forward, nullptr);
    ASSERT_NE(gpu_->cross_entropy_backward, nullptr);
  }

  const LayerOps& cpu_ = *CpuOps().layer;
  const LayerOps* gpu_ = nullptr;
};

// --- attention ---------------------------------------------------------------------------------

using attention_check::AttnData;
using attention_check::AttnShape;
using attention_check::BackwardWant;
using attention_check::ExactBackward;
using attention_check::ExactForward;
using attention_check::ForwardWant;
using attention_check::ShapeName;

// The CPU forward on x's inputs, into out and lse (resized to fit).
absl::Status CpuAttentionForward(const LayerOps& cpu, const AttnData& x, std::vector<float>* out,
                                 std::vector<float>* lse) {
  out->resize(x.size);
  lse->resize(x.lse_size);
  return cpu.attention_forward(out->data(), lse->data(), x.q.data(), x.k.data(), x.v.data(), x.s.b,
                               x.s.t, x.s.h, x.s.hkv, x.s.dh, Stream{});
}

// The CPU backward on x's inputs with the forward's out and lse, onto dq, dk and dv (it adds to
// them).
absl::Status CpuAttentionBackward(const LayerOps& cpu, const AttnData& x,
                                  const std::vector<float>& out, const std::vector<float>& lse,
                                  std::vector<float>* dq, std::vector<float>* dk,
                                  std::vector<float>* dv) {
  return cpu.attention_backward(dq->data(), dk->data(), dv->data(), x.dout.data(), x.q.data(),
                                x.k.data(), x.v.data(), out.data(), lse.data(), x.s.b, x.s.t, x.s.h,
                                x.s.hkv, x.s.dh, Stream{});
}

// One shape's device buffers for both directions: the inputs q, k, v and dout copied from x; out
// and lse (the forward's outputs, the backward's inputs: PutSaved); the gradients dq, dk and dv
// (PutGrads pre-fills them). Everything not copied is poisoned (DeviceBuffer).
struct AttnBuffers {
  explicit AttnBuffers(const AttnData& x)
      : s(x.s),
        q(x.size * 4),
        k(x.kv_size * 4),
        v(x.kv_size * 4),
        dout(x.size * 4),
        out(x.size * 4),
        lse(x.lse_size * 4),
        dq(x.size * 4),
        dk(x.kv_size * 4),
        dv(x.kv_size * 4) {
    Put(q, x.q);
    Put(k, x.k);
    Put(v, x.v);
    Put(dout, x.dout);
  }
  void PutSaved(const std::vector<float>& o, const std::vector<float>& l) const {
    Put(out, o);
    Put(lse, l);
  }
  void PutGrads(const std::vector<float>& dq0, const std::vector<float>& dk0,
                const std::vector<float>& dv0) const {
    Put(dq, dq0);
    Put(dk, dk0);
    Put(dv, dv0);
  }
  // The CUDA entries on these buffers, on `stream`: the FP32 ones, or with `bf16` the
  // BF16-operand ones (attention_forward_bf16, attention_backward_bf16).
  absl::Status Forward(const LayerOps& gpu, Stream stream, bool bf16 = false) const {
    return (bf16 ? gpu.attention_forward_bf16 : gpu.attention_forward)(
        out.f(), lse.f(), q.f(), k.f(), v.f(), s.b, s.t, s.h, s.hkv, s.dh, stream);
  }
  absl::Status Backward(const LayerOps& gpu, Stream stream, bool bf16 = false) const {
    return (bf16 ? gpu.attention_backward_bf16 : gpu.attention_backward)(
        dq.f(), dk.f(), dv.f(), dout.f(), q.f(), k.f(), v.f(), out.f(), lse.f(), s.b, s.t, s.h,
        s.hkv, s.dh, stream);
  }
  // dq, dk and dv as they are now.
  struct Grads {
    std::vector<float> dq, dk, dv;
  };
  Grads DownloadGrads(const AttnData& x) const {
    return {Download<float>(dq, x.size), Download<float>(dk, x.kv_size),
            Download<float>(dv, x.kv_size)};
  }

  const AttnShape s;
  DeviceBuffer q, k, v, dout, out, lse, dq, dk, dv;
};

// Every gradient within the bounds of `want`, for the backend named `who`.
void ExpectGradsWithin(const char* who, const std::vector<float>& dq, const std::vector<float>& dk,
                       const std::vector<float>& dv, const BackwardWant& want) {
  std::string err = attention_check::OutOfBounds("dq", dq, want.dq, want.dq_bound);
  EXPECT_TRUE(err.empty()) << who << ": " << err;
  err = attention_check::OutOfBounds("dk", dk, want.dk, want.dk_bound);
  EXPECT_TRUE(err.empty()) << who << ": " << err;
  err = attention_check::OutOfBounds("dv", dv, want.dv, want.dv_bound);
  EXPECT_TRUE(err.empty()) << who << ": " << err;
}

const AttnShape kAttnShapes[] = {
    {1, 1, 1, 1, 1},      // T = 1, Dh = 1
    {2, 1, 3, 3, 64},     // T = 1
    {1, 45, 2, 2, 1},     // Dh = 1, T not a multiple of 32
    {2, 257, 2, 2, 64},   // T = 257
    {1, 100, 3, 3, 128},  // Dh = 128
    {3, 40, 64, 64, 8},   // B * H = 192, more heads than any current GPU has SMs
    {1, 70, 1, 1, 300},   // Dh > 256: two register passes per warp
    {1, 1100, 2, 2, 8},   // T > 1024: the dk/dv kernel's row terms in two chunks
    {8, 640, 4, 4, 8},    // 20480 query rows: more than the grid's warps (about 8,400 on an
                          // H100), so warp-stride loops take a second row
    // Grouped-query attention.
    {2, 257, 8, 2, 64},   // four query heads per kv head
    {1, 100, 6, 1, 128},  // multi-query: one kv head for all
    {3, 40, 64, 8, 8},    // eight groups of eight, B * Hkv = 24
    {1, 70, 4, 2, 300},   // Dh > 256
    {1, 1100, 4, 2, 8},   // T > 1024: row-term chunks within each query head of the group
};

class AttentionForwardTest : public CudaLayerTest,
                             public ::testing::WithParamInterface<AttnShape> {};

TEST_P(AttentionForwardTest, GpuAndCpuWithinFp64BoundsAndReruns) {
  const AttnData x(GetParam(), 1000);
  const ForwardWant want = ExactForward(x);

  const AttnBuffers d(x);
  ASSERT_TRUE(d.Forward(*gpu_, stream()).ok());
  Sync();
  const std::vector<float> g_out = Download<float>(d.out, x.size);
  const std::vector<float> g_lse = Download<float>(d.lse, x.lse_size);
  std::string err = attention_check::OutOfBounds("out", g_out, want.out, want.out_bound);
  EXPECT_TRUE(err.empty()) << "gpu: " << err;
  err = attention_check::OutOfBounds("lse", g_lse, want.lse, want.lse_bound);
  EXPECT_TRUE(err.empty()) << "gpu: " << err;

  // The CPU table's entry, held to the same bounds.
  std::vector<float> out, lse;
  ASSERT_TRUE(CpuAttentionForward(cpu_, x, &out, &lse).ok());
  err = attention_check::OutOfBounds("out", out, want.out, want.out_bound);
  EXPECT_TRUE(err.empty()) << "cpu: " << err;
  err = attention_check::OutOfBounds("lse", lse, want.lse, want.lse_bound);
  EXPECT_TRUE(err.empty()) << "cpu: " << err;

  // A second run over the same inputs (outputs poisoned again) gives the same bits.
  ASSERT_TRUE(Poison(d.out.f(), x.size * 4));
  ASSERT_TRUE(Poison(d.lse.f(), x.lse_size * 4));
  ASSERT_TRUE(d.Forward(*gpu_, stream()).ok());
  Sync();
  EXPECT_TRUE(SameBits(Download<float>(d.out, x.size), g_out)) << "out differs between runs";
  EXPECT_TRUE(SameBits(Download<float>(d.lse, x.lse_size), g_lse)) << "lse differs between runs";
}

INSTANTIATE_TEST_SUITE_P(Shapes, AttentionForwardTest, ::testing::ValuesIn(kAttnShapes),
                         [](const auto& info) { return ShapeName(info.param); });

// The CPU forward's out and lse for x: the backward's inputs on both backends.
struct Saved {
  std::vector<float> out, lse;
};
Saved CpuSaved(const LayerOps& cpu, const AttnData& x) {
  Saved saved;
  EXPECT_TRUE(CpuAttentionForward(cpu, x, &saved.out, &saved.lse).ok());
  return saved;
}

class AttentionBackwardTest : public CudaLayerTest,
                              public ::testing::WithParamInterface<AttnShape> {};

TEST_P(AttentionBackwardTest, AccumulatesWithinFp64BoundsAndReruns) {
  const AttnData x(GetParam(), 2000);
  const Saved saved = CpuSaved(cpu_, x);
  ASSERT_FALSE(HasFailure());
  const BackwardWant want = ExactBackward(x, saved.out, saved.lse);

  const AttnBuffers d(x);
  d.PutSaved(saved.out, saved.lse);
  AttnBuffers::Grads runs[2];
  for (auto& run : runs) {
    d.PutGrads(x.dq0, x.dk0, x.dv0);  // pre-filled: the backward must add to them
    ASSERT_TRUE(d.Backward(*gpu_, stream()).ok());
    Sync();
    run = d.DownloadGrads(x);
  }
  ExpectGradsWithin("gpu", runs[0].dq, runs[0].dk, runs[0].dv, want);
  EXPECT_TRUE(SameBits(runs[0].dq, runs[1].dq)) << "dq differs between runs";
  EXPECT_TRUE(SameBits(runs[0].dk, runs[1].dk)) << "dk differs between runs";
  EXPECT_TRUE(SameBits(runs[0].dv, runs[1].dv)) << "dv differs between runs";

  // The CPU table's entry on the same out and lse, held to the same bounds.
  std::vector<float> dq = x.dq0, dk = x.dk0, dv = x.dv0;
  ASSERT_TRUE(CpuAttentionBackward(cpu_, x, saved.out, saved.lse, &dq, &dk, &dv).ok());
  ExpectGradsWithin("cpu", dq, dk, dv, want);
}

INSTANTIATE_TEST_SUITE_P(Shapes, AttentionBackwardTest, ::testing::ValuesIn(kAttnShapes),
                         [](const auto& info) { return ShapeName(info.param); });

class AttentionAccumulateTest : public CudaLayerTest {};

TEST_F(AttentionAccumulateTest, TwoCallsAddTwice) {
  const AttnData x({2, 50, 6, 2, 24}, 3000);
  const Saved saved = CpuSaved(cpu_, x);
  ASSERT_FALSE(HasFailure());
  const std::vector<float> zeros(x.size, 0.0f), kv_zeros(x.kv_size, 0.0f);
  const AttnBuffers d(x);
  d.PutSaved(saved.out, saved.lse);
  d.PutGrads(zeros, kv_zeros, kv_zeros);
  ASSERT_TRUE(d.Backward(*gpu_, stream()).ok());
  Sync();
  const AttnBuffers::Grads first = d.DownloadGrads(x);
  ASSERT_TRUE(d.Backward(*gpu_, stream()).ok());
  Sync();
  const AttnBuffers::Grads second = d.DownloadGrads(x);
  // Each call is one accumulating call onto what it found: the first onto zeros, the second onto
  // the first's result (so the second adds the contribution once more; a call that overwrote
  // would leave one contribution, a whole contribution outside the bounds).
  AttnData onto_zeros = x;
  onto_zeros.dq0 = zeros;
  onto_zeros.dk0 = kv_zeros;
  onto_zeros.dv0 = kv_zeros;
  ExpectGradsWithin("first call", first.dq, first.dk, first.dv,
                    ExactBackward(onto_zeros, saved.out, saved.lse));
  AttnData onto_first = x;
  onto_first.dq0 = first.dq;
  onto_first.dk0 = first.dk;
  onto_first.dv0 = first.dv;
  ExpectGradsWithin("second call", second.dq, second.dk, second.dv,
                    ExactBackward(onto_first, saved.out, saved.lse));
}

// --- BF16 operands: the fused tensor-core kernels --------------------------------------------

using attention_check::Precision;

// Shapes for the BF16 entries: the fused kernels' tiles (64 rows, 64 keys, Dh padded to 16) at
// their edges, and Dh > 128, where the entries run the FP32 kernels.
const AttnShape kBf16Shapes[] = {
    {1, 1, 1, 1, 1},       // T = 1, Dh = 1: one row of one tile, 15 zero columns
    {1, 64, 2, 2, 64},     // exactly one tile
    {2, 65, 2, 2, 64},     // a second tile with one row and one key
    {1, 200, 3, 3, 24},    // four tiles, Dh padded from 24 to 32
    {1, 130, 2, 2, 100},   // Dh padded from 100 to 112
    {1, 257, 4, 4, 128},   // the largest fused head, five tiles
    {3, 40, 64, 64, 8},    // B * H = 192 items on fewer blocks
    {2, 257, 8, 2, 64},    // grouped-query: four query heads per kv head
    {1, 100, 6, 1, 128},   // multi-query
    {1, 1100, 2, 2, 16},   // 18 tiles
    {8, 512, 16, 16, 64},  // 1,024 work items over the blocks the occupancy allows per SM
                           // (far fewer than 1,024 on any GPU): blocks move on to further items,
                           // re-initialising their state
    {1, 70, 4, 2, 300},    // Dh > 128: the FP32 kernels
};

class AttentionBf16Test : public CudaLayerTest, public ::testing::WithParamInterface<AttnShape> {
 protected:
  void SetUp() override {
    CudaLayerTest::SetUp();
    if (Stopped()) return;
    ASSERT_NE(gpu_->attention_forward_bf16, nullptr);
    ASSERT_NE(gpu_->attention_backward_bf16, nullptr);
  }
};

TEST_P(AttentionBf16Test, ForwardWithinBf16BoundsAndReruns) {
  const AttnData x(GetParam(), 4000);
  const ForwardWant want = ExactForward(x, Precision::Bf16TensorCores());
  const AttnBuffers d(x);
  ASSERT_TRUE(d.Forward(*gpu_, stream(), /*bf16=*/true).ok());
  Sync();
  const std::vector<float> g_out = Download<float>(d.out, x.size);
  const std::vector<float> g_lse = Download<float>(d.lse, x.lse_size);
  std::string err = attention_check::OutOfBounds("out", g_out, want.out, want.out_bound);
  EXPECT_TRUE(err.empty()) << err;
  err = attention_check::OutOfBounds("lse", g_lse, want.lse, want.lse_bound);
  EXPECT_TRUE(err.empty()) << err;

  ASSERT_TRUE(Poison(d.out.f(), x.size * 4));
  ASSERT_TRUE(Poison(d.lse.f(), x.lse_size * 4));
  ASSERT_TRUE(d.Forward(*gpu_, stream(), /*bf16=*/true).ok());
  Sync();
  EXPECT_TRUE(SameBits(Download<float>(d.out, x.size), g_out)) << "out differs between runs";
  EXPECT_TRUE(SameBits(Download<float>(d.lse, x.lse_size), g_lse)) << "lse differs between runs";

  // Where the fused kernels run (FlashAttentionFits: Dh <= 128 on the H200; a device with less
  // shared memory fuses fewer head sizes), the operands really were BF16: the output is not the
  // FP32 kernels' (with Dh = 1 and T = 1 it can be: a single key gives p = 1 exactly).
  const absl::StatusOr<bool> fused = cuda_internal::FlashAttentionFits(x.s.dh);
  ASSERT_TRUE(fused.ok()) << fused.status();
  const absl::StatusOr<cuda_internal::DeviceFacts> facts = cuda_internal::CurrentDeviceFacts();
  ASSERT_TRUE(facts.ok()) << facts.status();
  if (facts->compute_capability >= 90 && x.s.dh <= 128) {
    EXPECT_TRUE(*fused) << "sm_90 (227 KiB of shared memory per block) fuses head sizes to 128";
  }
  if (*fused && x.s.t > 1) {
    ASSERT_TRUE(d.Forward(*gpu_, stream(), /*bf16=*/false).ok());
    Sync();
    EXPECT_FALSE(SameBits(Download<float>(d.out, x.size), g_out))
        << "attention_forward_bf16 gave the FP32 kernels' bits: the fused kernel did not run";
  }
}

TEST_P(AttentionBf16Test, BackwardAccumulatesWithinBf16BoundsAndReruns) {
  const AttnData x(GetParam(), 5000);
  const Saved saved = CpuSaved(cpu_, x);
  ASSERT_FALSE(HasFailure());
  const BackwardWant want = ExactBackward(x, saved.out, saved.lse, Precision::Bf16TensorCores());
  const AttnBuffers d(x);
  d.PutSaved(saved.out, saved.lse);
  AttnBuffers::Grads runs[2];
  for (auto& run : runs) {
    d.PutGrads(x.dq0, x.dk0, x.dv0);
    ASSERT_TRUE(d.Backward(*gpu_, stream(), /*bf16=*/true).ok());
    Sync();
    run = d.DownloadGrads(x);
  }
  ExpectGradsWithin("gpu bf16", runs[0].dq, runs[0].dk, runs[0].dv, want);
  EXPECT_TRUE(SameBits(runs[0].dq, runs[1].dq)) << "dq differs between runs";
  EXPECT_TRUE(SameBits(runs[0].dk, runs[1].dk)) << "dk differs between runs";
  EXPECT_TRUE(SameBits(runs[0].dv, runs[1].dv)) << "dv differs between runs";
}

INSTANTIATE_TEST_SUITE_P(Shapes, AttentionBf16Test, ::testing::ValuesIn(kBf16Shapes),
                         [](const auto& info) { return ShapeName(info.param); });

// Head sizes in an order that lowers and raises the fused kernels' shared memory: each size's
// launch needs its own dynamic shared memory, and the kernels' limit (one attribute per kernel,
// replaced by every set) must never be left below what a later launch asks for. The results stay
// within the BF16 bounds whatever ran before.
TEST_F(CudaLayerTest, Bf16HeadSizesInAnyOrderLaunchAndStayWithinBounds) {
  for (const int64_t dh : {64, 24, 8, 64, 128, 16, 128, 1, 100, 64}) {
    SCOPED_TRACE(::testing::Message() << "Dh " << dh);
    const AttnData x(AttnShape{1, 70, 2, 2, dh}, 6000 + static_cast<uint32_t>(dh));
    const ForwardWant want = ExactForward(x, Precision::Bf16TensorCores());
    const AttnBuffers d(x);
    ASSERT_TRUE(d.Forward(*gpu_, stream(), /*bf16=*/true).ok());
    d.PutGrads(x.dq0, x.dk0, x.dv0);
    ASSERT_TRUE(d.Backward(*gpu_, stream(), /*bf16=*/true).ok());
    Sync();
    const std::string err = attention_check::OutOfBounds("out", Download<float>(d.out, x.size),
                                                         want.out, want.out_bound);
    EXPECT_TRUE(err.empty()) << err;
  }
}

// The fused kernels load their tiles four floats at a time where every row starts 16-byte
// aligned, one at a time otherwise (flash_attention_cuda.cu, LoadTile): q, k, v, dout and out
// starting one float past an aligned address take the scalar loads and must give the aligned
// buffers' bits, forward and backward.
TEST_F(CudaLayerTest, Bf16UnalignedOperandsGiveTheAlignedBits) {
  const AttnData x(AttnShape{2, 130, 4, 2, 64}, 7000);
  const AttnBuffers d(x);
  ASSERT_TRUE(d.Forward(*gpu_, stream(), /*bf16=*/true).ok());
  d.PutGrads(x.dq0, x.dk0, x.dv0);
  ASSERT_TRUE(d.Backward(*gpu_, stream(), /*bf16=*/true).ok());
  Sync();
  const std::vector<float> out = Download<float>(d.out, x.size);
  const std::vector<float> lse = Download<float>(d.lse, x.lse_size);
  const AttnBuffers::Grads grads = d.DownloadGrads(x);

  auto shifted = [](const std::vector<float>& v) {  // v from the second float of the buffer
    std::vector<float> s(v.size() + 1, 0.0f);
    std::copy(v.begin(), v.end(), s.begin() + 1);
    return Upload(s);
  };
  const DeviceBuffer q = shifted(x.q), k = shifted(x.k), v = shifted(x.v), dout = shifted(x.dout),
                     saved_out = shifted(out);
  DeviceBuffer out1(x.size * 4), lse1(x.lse_size * 4);
  ASSERT_TRUE(gpu_->attention_forward_bf16(out1.f(), lse1.f(), q.f() + 1, k.f() + 1, v.f() + 1,
                                           x.s.b, x.s.t, x.s.h, x.s.hkv, x.s.dh, stream())
                  .ok());
  const DeviceBuffer dq = Upload(x.dq0), dk = Upload(x.dk0), dv = Upload(x.dv0);
  ASSERT_TRUE(gpu_->attention_backward_bf16(dq.f(), dk.f(), dv.f(), dout.f() + 1, q.f() + 1,
                                            k.f() + 1, v.f() + 1, saved_out.f() + 1, d.lse.f(),
                                            x.s.b, x.s.t, x.s.h, x.s.hkv, x.s.dh, stream())
                  .ok());
  Sync();
  EXPECT_TRUE(SameBits(Download<float>(out1, x.size), out)) << "out";
  EXPECT_TRUE(SameBits(Download<float>(lse1, x.lse_size), lse)) << "lse";
  EXPECT_TRUE(SameBits(Download<float>(dq, x.size), grads.dq)) << "dq";
  EXPECT_TRUE(SameBits(Download<float>(dk, x.kv_size), grads.dk)) << "dk";
  EXPECT_TRUE(SameBits(Download<float>(dv, x.kv_size), grads.dv)) << "dv";
}

// The BF16 entries check their arguments as the FP32 ones do, naming themselves.
TEST_F(CudaLayerTest, Bf16EntriesRefuseBadArgumentsNamingThemselves) {
  DeviceBuffer a(4096), c(4096), d(4096), e(4096), f(4096), g(4096), o(4096), ls(4096);
  std::vector<float> host(1024, 0.0f);
  absl::Status st =
      gpu_->attention_forward_bf16(a.f(), ls.f(), c.f(), d.f(), e.f(), 1, 2, 3, 2, 2, stream());
  EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(st.message().find("attention_forward_bf16: hkv is 2"), std::string::npos) << st;
  st = gpu_->attention_backward_bf16(a.f(), c.f(), d.f(), e.f(), f.f(), g.f(), a.f(), o.f(),
                                     nullptr, 1, 2, 2, 2, 2, stream());
  EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(st.message().find("attention_backward_bf16: lse is null"), std::string::npos) << st;
  st = gpu_->attention_forward_bf16(a.f(), ls.f(), host.data(), d.f(), e.f(), 1, 2, 2, 2, 2,
                                    stream());
  EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(st.message().find("q"), std::string::npos) << st;
  Sync();
}

// --- cross-entropy -----------------------------------------------------------------------------

// Elements of `got` farther from `want` than kSafety * bound + kTiny: one message with the count
// and the first few, empty if none (the cross-entropy checks).
std::string OutOfBounds(const char* what, const std::vector<float>& got,
                        const std::vector<float>& want, const std::vector<double>& bound) {
  int64_t bad = 0;
  std::string first;
  for (size_t n = 0; n < got.size(); ++n) {
    const double diff = std::fabs(double{got[n]} - double{want[n]});
    if (!(diff <= kSafety * bound[n] + kTiny)) {  // NaN fails too
      if (++bad <= 5) {
        absl::StrAppend(&first, "\n  ", what, "[", n, "]: gpu ", got[n], " cpu ", want[n],
                        " |diff| ", diff, " > ", kSafety * bound[n] + kTiny);
      }
    }
  }
  return bad == 0 ? std::string()
                  : absl::StrCat(bad, " elements of ", what, " out of bounds", first);
}

struct CeShape {
  int64_t n, v;
};
void PrintTo(const CeShape& s, std::ostream* os) { *os << "N" << s.n << " V" << s.v; }

const CeShape kCeShapes[] = {
    {1, 1},      // one class: probability 1, loss 0
    {3, 5},      // fewer classes than threads
    {7, 300},    // not a multiple of the block
    {2, 1000},   // several elements per thread
    {4, 50257},  // GPT-2's vocabulary
    {5000, 17},  // more rows than the grid has blocks (16 per SM): block-stride loop
};

struct CeData {
  CeData(const CeShape& shape, uint32_t seed) : s(shape) {
    logits = Normal(static_cast<size_t>(s.n * s.v), 3.0f, seed);
    std::mt19937 rng(seed + 1);
    targets.resize(static_cast<size_t>(s.n));
    for (auto& t : targets) t = static_cast<int32_t>(rng() % static_cast<uint32_t>(s.v));
  }
  CeShape s;
  std::vector<float> logits;
  std::vector<int32_t> targets;
};

// The CPU forward on x, into probs and losses (resized to fit).
absl::Status CpuCrossEntropyForward(const LayerOps& cpu, const CeData& x, std::vector<float>* probs,
                                    std::vector<float>* losses) {
  probs->resize(static_cast<size_t>(x.s.n * x.s.v));
  losses->resize(static_cast<size_t>(x.s.n));
  return cpu.cross_entropy_forward(probs->data(), losses->data(), x.logits.data(), x.targets.data(),
                                   x.s.n, x.s.v, Stream{});
}

// One cross-entropy forward's device buffers: n rows of v logits and n targets copied from the
// host; probs and losses poisoned (DeviceBuffer).
struct CeForwardBuffers {
  CeForwardBuffers(const std::vector<float>& host_logits, const std::vector<int32_t>& host_targets,
                   int64_t rows, int64_t classes)
      : n(rows),
        v(classes),
        logits(static_cast<size_t>(n * v) * 4),
        targets(static_cast<size_t>(n) * 4),
        probs(static_cast<size_t>(n * v) * 4),
        losses(static_cast<size_t>(n) * 4) {
    Put(logits, host_logits);
    Put(targets, host_targets);
  }
  // The CUDA entry on these buffers, on `stream`.
  absl::Status Forward(const LayerOps& gpu, Stream stream) const {
    return gpu.cross_entropy_forward(probs.f(), losses.f(), logits.f(), targets.as<int32_t>(), n, v,
                                     stream);
  }
  std::vector<float> Probs() const { return Download<float>(probs, static_cast<size_t>(n * v)); }
  std::vector<float> Losses() const { return Download<float>(losses, static_cast<size_t>(n)); }

  const int64_t n, v;
  DeviceBuffer logits, targets, probs, losses;
};

class CrossEntropyForwardTest : public CudaLayerTest,
                                public ::testing::WithParamInterface<CeShape> {};

TEST_P(CrossEntropyForwardTest, MatchesCpuAndFp64WithinBoundsAndReruns) {
  const CeData x(GetParam(), 4000);
  const int64_t n = x.s.n, v = x.s.v;
  const size_t nv = static_cast<size_t>(n * v);
  std::vector<float> probs, losses;
  ASSERT_TRUE(CpuCrossEntropyForward(cpu_, x, &probs, &losses).ok());
  const CeForwardBuffers d(x.logits, x.targets, n, v);
  std::vector<float> g_probs, g_losses;
  for (int run = 0; run < 2; ++run) {
    ASSERT_TRUE(Poison(d.probs.f(), nv * 4));
    ASSERT_TRUE(d.Forward(*gpu_, stream()).ok());
    Sync();
    std::vector<float> p = d.Probs(), l = d.Losses();
    if (run == 0) {
      g_probs = std::move(p);
      g_losses = std::move(l);
    } else {
      EXPECT_TRUE(SameBits(p, g_probs)) << "probs differ between runs";
      EXPECT_TRUE(SameBits(l, g_losses)) << "losses differ between runs";
    }
  }

  // Bounds (header), against the CPU and against FP64 from the same FP32 differences x_j.
  const double depth_gpu = std::ceil(static_cast<double>(v) / 256.0) + 8.0;
  const double r_sum_cpu = 6.0 * kU + (static_cast<double>(v) + depth_gpu + 8.0) * kU;
  const double r_sum_gpu = 4.0 * kU + depth_gpu * kU;
  std::vector<double> p_bound_cpu(nv), p_bound_exact(nv), loss_bound_cpu(static_cast<size_t>(n)),
      loss_bound_exact(static_cast<size_t>(n));
  std::vector<float> p_exact(nv), loss_exact(static_cast<size_t>(n));
  for (int64_t r = 0; r < n; ++r) {
    const float* l = x.logits.data() + r * v;
    const float m = *std::max_element(l, l + v);
    double sum = 0.0;
    for (int64_t j = 0; j < v; ++j) sum += std::exp(static_cast<double>(l[j] - m));
    for (int64_t j = 0; j < v; ++j) {
      const size_t at = static_cast<size_t>(r * v + j);
      const double p = std::exp(static_cast<double>(l[j] - m)) / sum;
      p_exact[at] = static_cast<float>(p);
      p_bound_cpu[at] = p * (6.0 * kU + r_sum_cpu + 4.0 * kU);
      // Against FP64: the GPU's error plus the rounding of the FP64 value to FP32 (u p).
      p_bound_exact[at] = p * (8.0 * kU + depth_gpu * kU + 2.0 * kU + kU);
    }
    const double log_sum = std::log(sum);
    const double loss = static_cast<double>(m) + log_sum - l[x.targets[static_cast<size_t>(r)]];
    loss_exact[static_cast<size_t>(r)] = static_cast<float>(loss);
    const double mag = std::fabs(m) + std::fabs(log_sum);
    loss_bound_cpu[static_cast<size_t>(r)] =
        r_sum_cpu + 4.0 * kU * std::fabs(log_sum) + 2.0 * kU * mag + 2.0 * kU * std::fabs(loss);
    loss_bound_exact[static_cast<size_t>(r)] =
        r_sum_gpu + 2.0 * kU * std::fabs(log_sum) + kU * mag + 2.0 * kU * std::fabs(loss);
  }
  std::string err = OutOfBounds("probs vs cpu", g_probs, probs, p_bound_cpu);
  EXPECT_TRUE(err.empty()) << err;
  err = OutOfBounds("losses vs cpu", g_losses, losses, loss_bound_cpu);
  EXPECT_TRUE(err.empty()) << err;
  err = OutOfBounds("probs vs fp64", g_probs, p_exact, p_bound_exact);
  EXPECT_TRUE(err.empty()) << err;
  err = OutOfBounds("losses vs fp64", g_losses, loss_exact, loss_bound_exact);
  EXPECT_TRUE(err.empty()) << err;
}

INSTANTIATE_TEST_SUITE_P(Shapes, CrossEntropyForwardTest, ::testing::ValuesIn(kCeShapes),
                         [](const auto& info) {
                           return absl::StrCat("N", info.param.n, "_V", info.param.v);
                         });

struct CeBackwardCase {
  CeShape shape;
  float dloss;
};
void PrintTo(const CeBackwardCase& c, std::ostream* os) {
  PrintTo(c.shape, os);
  *os << " dloss " << c.dloss;
}

class CrossEntropyBackwardTest : public CudaLayerTest,
                                 public ::testing::WithParamInterface<CeBackwardCase> {};

TEST_P(CrossEntropyBackwardTest, AccumulatesBitForBitLikeCpu) {
  const CeData x(GetParam().shape, 5000);
  const float dloss = GetParam().dloss;
  const int64_t n = x.s.n, v = x.s.v;
  const size_t nv = static_cast<size_t>(n * v);
  std::vector<float> probs, losses;
  ASSERT_TRUE(CpuCrossEntropyForward(cpu_, x, &probs, &losses).ok());
  const std::vector<float> dlogits0 = Normal(nv, 1e-3f, 5001);  // pre-filled: must accumulate
  std::vector<float> dlogits = dlogits0;
  ASSERT_TRUE(cpu_.cross_entropy_backward(dlogits.data(), probs.data(), x.targets.data(), n, v,
                                          dloss, Stream{})
                  .ok());
  DeviceBuffer d_probs(nv * 4), targets(static_cast<size_t>(n) * 4), d_dlogits(nv * 4);
  Put(d_probs, probs);
  Put(targets, x.targets);
  Put(d_dlogits, dlogits0);
  ASSERT_TRUE(gpu_->cross_entropy_backward(d_dlogits.f(), d_probs.f(), targets.as<int32_t>(), n, v,
                                           dloss, stream())
                  .ok());
  Sync();
  const std::vector<float> got = Download<float>(d_dlogits, nv);
  int64_t differ = 0;
  size_t first = nv;
  for (size_t at = 0; at < nv; ++at) {
    if (Bits(got[at]) != Bits(dlogits[at])) {
      ++differ;
      first = std::min(first, at);
    }
  }
  EXPECT_EQ(differ, 0) << "first at " << first << ": gpu " << got[first % nv] << " cpu "
                       << dlogits[first % nv];
}

std::vector<CeBackwardCase> CeBackwardCases() {
  std::vector<CeBackwardCase> cases;
  for (const CeShape& s : kCeShapes) {
    for (float dloss : {1.0f, 0.25f, 1.0f / 3.0f}) cases.push_back({s, dloss});
  }
  return cases;
}

INSTANTIATE_TEST_SUITE_P(Shapes, CrossEntropyBackwardTest, ::testing::ValuesIn(CeBackwardCases()),
                         [](const auto& info) {
                           return absl::StrCat("N", info.param.shape.n, "_V", info.param.shape.v,
                                               "_dloss", info.index % 3);
                         });

class CrossEntropyTest : public CudaLayerTest {};

TEST_F(CrossEntropyTest, HugeLogitsDoNotOverflow) {
  // Row r: N(0, 1) logits with 3e38 at column r; the target is that column in even rows and
  // column r + 1 in odd rows. exp(0) = 1 and exp(x - 3e38) = 0 exactly, so the probabilities are
  // exactly one-hot, and the loss is 3e38 + log(1) - 3e38 = 0, or 3e38 - logit[r + 1].
  constexpr int64_t n = 6, v = 700;
  constexpr float kHuge = 3e38f;
  std::vector<float> logits = Normal(n * v, 1.0f, 6000);
  std::vector<int32_t> targets(n);
  for (int64_t r = 0; r < n; ++r) {
    logits[r * v + r] = kHuge;
    targets[r] = static_cast<int32_t>(r % 2 == 0 ? r : r + 1);
  }
  const CeForwardBuffers d(logits, targets, n, v);
  ASSERT_TRUE(d.Forward(*gpu_, stream()).ok());
  Sync();
  const std::vector<float> probs = d.Probs();
  const std::vector<float> losses = d.Losses();
  for (int64_t r = 0; r < n; ++r) {
    for (int64_t j = 0; j < v; ++j) {
      EXPECT_EQ(probs[r * v + j], j == r ? 1.0f : 0.0f) << "row " << r << " column " << j;
    }
    const float want = r % 2 == 0 ? 0.0f : kHuge - logits[r * v + r + 1];
    EXPECT_EQ(losses[r], want) << "row " << r;
    EXPECT_TRUE(std::isfinite(losses[r]));
  }
}

TEST_F(CrossEntropyTest, EveryLogitCountsExactValues) {
  // V rows of V logits, all 0 but log(V - 1) at column r of row r: that column has probability
  // 1/2 and every other (V - 1) / 2 of the rest, so a reduction that drops or repeats any element
  // moves the results by far more than the GPU's bound. Expected values in FP64 from the FP32
  // logits; bound as "against FP64" in the header.
  for (const int64_t v : {int64_t{2}, int64_t{31}, int64_t{300}, int64_t{513}}) {
    const int64_t n = v;
    const float big = static_cast<float>(std::log(static_cast<double>(v - 1)));
    std::vector<float> logits(static_cast<size_t>(n * v), 0.0f);
    std::vector<int32_t> targets(static_cast<size_t>(n));
    for (int64_t r = 0; r < n; ++r) {
      logits[static_cast<size_t>(r * v + r)] = big;
      targets[static_cast<size_t>(r)] = static_cast<int32_t>((r * 7) % v);
    }
    const CeForwardBuffers d(logits, targets, n, v);
    ASSERT_TRUE(d.Forward(*gpu_, stream()).ok());
    Sync();
    const std::vector<float> probs = d.Probs();
    const std::vector<float> losses = d.Losses();
    // Row sums: exp(0 - big) (V - 1) + 1 (x_j = -big and 0, exact in FP32).
    const double e_small = std::exp(-static_cast<double>(big));
    const double sum = 1.0 + static_cast<double>(v - 1) * e_small;
    const double r_sum = (4.0 + std::ceil(static_cast<double>(v) / 256.0) + 8.0) * kU;
    for (int64_t r = 0; r < n; ++r) {
      for (int64_t j = 0; j < v; ++j) {
        const double want = (j == r ? 1.0 : e_small) / sum;
        const double bound = want * (4.0 * kU + r_sum + 3.0 * kU);
        const float got = probs[static_cast<size_t>(r * v + j)];
        EXPECT_LE(std::fabs(got - want), kSafety * bound)
            << "V " << v << " row " << r << " column " << j << ": " << got << " vs " << want;
      }
      const int64_t t = targets[static_cast<size_t>(r)];
      const double want = static_cast<double>(big) + std::log(sum) - (t == r ? big : 0.0f);
      const double bound = r_sum + 2.0 * kU * std::log(sum) + kU * (big + std::log(sum)) +
                           2.0 * kU * std::fabs(want);
      EXPECT_LE(std::fabs(losses[static_cast<size_t>(r)] - want), kSafety * bound + kTiny)
          << "V " << v << " row " << r << ": " << losses[static_cast<size_t>(r)] << " vs " << want;
    }
  }
}

// --- arguments ---------------------------------------------------------------------------------

class ArgumentTest : public CudaLayerTest {};

// InvalidArgument whose message names `what`.
void ExpectRefused(const absl::Status& s, const std::string& what) {
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
  EXPECT_NE(std::string(s.message()).find(what), std::string::npos)
      << "message does not name " << what << ": " << s;
}

TEST_F(ArgumentTest, HostPointersAreRefusedBeforeAnythingRuns) {
  constexpr int64_t b = 1, t = 4, h = 2, dh = 8, size = b * t * h * dh, lsize = b * h * t;
  std::vector<float> host(size, 1.0f);
  DeviceBuffer q(size * 4), k(size * 4), v(size * 4), out(size * 4), lse(lsize * 4), dq(size * 4),
      dk(size * 4), dv(size * 4), dout(size * 4);
  const std::vector<float> quarter(size, 0.25f), quarter_l(lsize, 0.25f);
  for (const DeviceBuffer* d : {&q, &k, &v, &dout, &dq, &dk, &dv}) Put(*d, quarter);
  Put(lse, quarter_l);
  ExpectRefused(gpu_->attention_forward(out.f(), lse.f(), host.data(), k.f(), v.f(), b, t, h, h, dh,
                                        stream()),
                "q");
  ExpectRefused(
      gpu_->attention_forward(out.f(), host.data(), q.f(), k.f(), v.f(), b, t, h, h, dh, stream()),
      "lse");
  ExpectRefused(gpu_->attention_backward(dq.f(), dk.f(), host.data(), dout.f(), q.f(), k.f(), v.f(),
                                         out.f(), lse.f(), b, t, h, h, dh, stream()),
                "dv");
  // (dout is device memory here, so a message naming "out" names out.)
  ExpectRefused(gpu_->attention_backward(dq.f(), dk.f(), dv.f(), dout.f(), q.f(), k.f(), v.f(),
                                         host.data(), lse.f(), b, t, h, h, dh, stream()),
                "out");
  ExpectRefused(gpu_->attention_backward(dq.f(), dk.f(), dv.f(), dout.f(), q.f(), k.f(), v.f(),
                                         out.f(), host.data(), b, t, h, h, dh, stream()),
                "lse");
  Sync();
  // Nothing ran: out is still poisoned, the gradients and lse unchanged.
  for (float x : Download<float>(out, size)) ASSERT_EQ(Bits(x), 0xA5A5A5A5u);
  for (float x : Download<float>(dv, size)) ASSERT_EQ(x, 0.25f);
  for (float x : Download<float>(lse, lsize)) ASSERT_EQ(x, 0.25f);

  constexpr int64_t n = 3, vocab = 10;
  std::vector<int32_t> host_targets(n, 1);
  DeviceBuffer logits(n * vocab * 4), targets(n * 4), ce_probs(n * vocab * 4), losses(n * 4),
      dlogits(n * vocab * 4);
  Put(targets, host_targets);
  Put(logits, std::vector<float>(n * vocab, 0.5f));
  ExpectRefused(gpu_->cross_entropy_forward(ce_probs.f(), losses.f(), logits.f(),
                                            host_targets.data(), n, vocab, stream()),
                "targets");
  ExpectRefused(gpu_->cross_entropy_forward(ce_probs.f(), host.data(), logits.f(),
                                            targets.as<int32_t>(), n, vocab, stream()),
                "losses");
  ExpectRefused(gpu_->cross_entropy_backward(host.data(), ce_probs.f(), targets.as<int32_t>(), n,
                                             vocab, 1.0f, stream()),
                "dlogits");
  Sync();
  for (float x : Download<float>(ce_probs, n * vocab)) ASSERT_EQ(Bits(x), 0xA5A5A5A5u);
  for (float x : Download<float>(dlogits, n * vocab)) ASSERT_EQ(Bits(x), 0xA5A5A5A5u);

  // The context is still healthy: valid calls run.
  EXPECT_TRUE(
      gpu_->attention_forward(out.f(), lse.f(), q.f(), k.f(), v.f(), b, t, h, h, dh, stream())
          .ok());
  EXPECT_TRUE(gpu_->attention_backward(dq.f(), dk.f(), dv.f(), dout.f(), q.f(), k.f(), v.f(),
                                       out.f(), lse.f(), b, t, h, h, dh, stream())
                  .ok());
  EXPECT_TRUE(gpu_->cross_entropy_forward(ce_probs.f(), losses.f(), logits.f(),
                                          targets.as<int32_t>(), n, vocab, stream())
                  .ok());
  Sync();
}

TEST_F(ArgumentTest, BadSizesAndNullPointersAreRefusedNamingTheArgument) {
  DeviceBuffer a(4096), c(4096), d(4096), e(4096), f(4096), g(4096), o(4096), ls(4096), tg(64);
  // Negative sizes, each named (nothing is dereferenced: the check comes first).
  ExpectRefused(
      gpu_->attention_forward(a.f(), ls.f(), c.f(), d.f(), e.f(), -1, 2, 2, 2, 2, stream()),
      "b is -1");
  ExpectRefused(
      gpu_->attention_forward(a.f(), ls.f(), c.f(), d.f(), e.f(), 1, -2, 2, 2, 2, stream()),
      "t is -2");
  ExpectRefused(
      gpu_->attention_forward(a.f(), ls.f(), c.f(), d.f(), e.f(), 1, 2, -3, 1, 2, stream()),
      "h is -3");
  ExpectRefused(
      gpu_->attention_forward(a.f(), ls.f(), c.f(), d.f(), e.f(), 1, 2, 2, -1, 2, stream()),
      "hkv is -1");
  ExpectRefused(
      gpu_->attention_forward(a.f(), ls.f(), c.f(), d.f(), e.f(), 1, 2, 2, 2, -4, stream()),
      "dh is -4");
  ExpectRefused(gpu_->attention_backward(a.f(), c.f(), d.f(), e.f(), f.f(), g.f(), a.f(), o.f(),
                                         ls.f(), 1, 2, 2, 2, -1, stream()),
                "dh is -1");
  ExpectRefused(gpu_->attention_backward(a.f(), c.f(), d.f(), e.f(), f.f(), g.f(), a.f(), o.f(),
                                         ls.f(), -5, 2, 2, 1, 2, stream()),
                "b is -5");
  // kv heads that do not divide the query heads (or none at all).
  ExpectRefused(
      gpu_->attention_forward(a.f(), ls.f(), c.f(), d.f(), e.f(), 1, 2, 3, 2, 2, stream()),
      "hkv is 2");
  ExpectRefused(gpu_->attention_backward(a.f(), c.f(), d.f(), e.f(), f.f(), g.f(), a.f(), o.f(),
                                         ls.f(), 1, 2, 2, 0, 2, stream()),
                "hkv is 0");
  ExpectRefused(gpu_->cross_entropy_forward(a.f(), c.f(), d.f(), tg.as<int32_t>(), -1, 4, stream()),
                "n is -1");
  ExpectRefused(gpu_->cross_entropy_forward(a.f(), c.f(), d.f(), tg.as<int32_t>(), 2, -4, stream()),
                "v is -4");
  ExpectRefused(gpu_->cross_entropy_backward(a.f(), c.f(), tg.as<int32_t>(), -2, 4, 1.0f, stream()),
                "n is -2");
  ExpectRefused(gpu_->cross_entropy_backward(a.f(), c.f(), tg.as<int32_t>(), 2, -3, 1.0f, stream()),
                "v is -3");
  // A head with no channels, a softmax over no classes, overflowing sizes, null buffers.
  ExpectRefused(
      gpu_->attention_forward(a.f(), ls.f(), c.f(), d.f(), e.f(), 1, 2, 2, 2, 0, stream()),
      "dh is 0");
  ExpectRefused(gpu_->cross_entropy_forward(a.f(), c.f(), d.f(), tg.as<int32_t>(), 2, 0, stream()),
                "v is 0");
  ExpectRefused(gpu_->cross_entropy_backward(a.f(), c.f(), tg.as<int32_t>(), 2, 0, 1.0f, stream()),
                "v is 0");
  constexpr int64_t kHuge = int64_t{1} << 32;  // T * H = 2^64
  ExpectRefused(
      gpu_->attention_forward(a.f(), ls.f(), c.f(), d.f(), e.f(), 1, kHuge, kHuge, 1, 1, stream()),
      "overflows");
  ExpectRefused(gpu_->attention_backward(a.f(), c.f(), d.f(), e.f(), f.f(), g.f(), a.f(), o.f(),
                                         ls.f(), 1, kHuge, kHuge, 1, 1, stream()),
                "overflows");
  ExpectRefused(
      gpu_->attention_forward(a.f(), ls.f(), nullptr, d.f(), e.f(), 1, 2, 2, 2, 2, stream()),
      "q is null");
  ExpectRefused(
      gpu_->attention_forward(a.f(), nullptr, c.f(), d.f(), e.f(), 1, 2, 2, 2, 2, stream()),
      "lse is null");
  ExpectRefused(gpu_->attention_backward(a.f(), nullptr, d.f(), e.f(), f.f(), g.f(), a.f(), o.f(),
                                         ls.f(), 1, 2, 2, 2, 2, stream()),
                "dk is null");
  ExpectRefused(gpu_->attention_backward(a.f(), c.f(), d.f(), e.f(), f.f(), g.f(), a.f(), nullptr,
                                         ls.f(), 1, 2, 2, 2, 2, stream()),
                ": out is null");
  ExpectRefused(gpu_->attention_backward(a.f(), c.f(), d.f(), e.f(), f.f(), g.f(), a.f(), o.f(),
                                         nullptr, 1, 2, 2, 2, 2, stream()),
                "lse is null");
  ExpectRefused(gpu_->cross_entropy_backward(a.f(), c.f(), nullptr, 2, 4, 1.0f, stream()),
                "targets is null");
  // Empty sizes are fine, with or without buffers.
  EXPECT_TRUE(
      gpu_->attention_forward(nullptr, nullptr, nullptr, nullptr, nullptr, 0, 5, 2, 1, 4, stream())
          .ok());
  EXPECT_TRUE(gpu_->attention_backward(nullptr, nullptr, nullptr, nullptr, nullptr, nullptr,
                                       nullptr, nullptr, nullptr, 2, 0, 2, 2, 4, stream())
                  .ok());
  EXPECT_TRUE(
      gpu_->cross_entropy_forward(nullptr, nullptr, nullptr, nullptr, 0, 50257, stream()).ok());
  EXPECT_TRUE(gpu_->cross_entropy_backward(nullptr, nullptr, nullptr, 0, 7, 1.0f, stream()).ok());
  Sync();
}

}  // namespace
}  // namespace fp8rt::kernels
