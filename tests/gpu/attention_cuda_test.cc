// The CUDA attention and cross-entropy entries of the layer-op table (CudaOps()->layer:
// attention_forward, attention_backward, cross_entropy_forward, cross_entropy_backward,
// kernels/cuda/attention_cuda.cu) against the CPU table's entries (CpuOps().layer) on the same
// inputs.
//
// Index:
//   (attention shapes include grouped-query ones: H query heads on Hkv kv heads, Hkv = 1 too)
//   AttentionForwardTest (TEST_P)   shapes; probs and out within the bounds below, masked probs
//                                   exactly +0, a second run bit for bit the first
//   AttentionBackwardTest (TEST_P)  shapes; onto pre-filled gradients (they must accumulate): dq
//                                   and dk within the bounds below, dv bit for bit, a second run
//                                   bit for bit the first
//   AttentionAccumulateTest.TwoCallsAddTwice   two backward calls add two contributions
//   CrossEntropyForwardTest (TEST_P)   shapes; probs and losses within the bounds below, against
//                                   the CPU and against an FP64 evaluation; reruns bit for bit
//   CrossEntropyBackwardTest (TEST_P)  shapes x dloss; bit for bit, accumulating
//   CrossEntropyTest.HugeLogits     a logit of 3e38 in a row: exact one-hot probabilities, loss 0
//                                   or the finite exact value, no overflow
//   CrossEntropyTest.EveryLogitCounts  a half-probability logit at every column in turn: exact
//                                   values from the formula (an element a reduction drops shows)
//   ArgumentTest                    host and null pointers, negative sizes, dh = 0, an hkv that
//                                   does not divide h and v = 0 are
//                                   refused with InvalidArgument naming the argument, before
//                                   anything runs; empty sizes are fine
//
// Tolerances. u = 2^-24 (FP32 unit roundoff); the CPU reference is compiled without FMA
// contraction (GCC, -std=c++20); a sequential FP32 sum of n terms is within (n + 1) u sum|terms|
// of the exact one, and the GPU's sums (lane-strided then a butterfly, or thread-strided then a
// block tree) have depth well under their length plus 8. CUDA's expf is within 2 ulp and logf
// within 1 ulp (CUDA C Programming Guide, mathematical functions appendix); glibc's within 1 ulp;
// 1 ulp <= 2u |value| for normal values. Every bound below is the sum of the GPU's and the CPU's
// first-order error bounds against exact arithmetic, computed per element in FP64 from the
// inputs, then doubled (kSafety) for the second-order terms; kTiny (2^-120) absolute slack covers
// results in or next to the subnormal range, where relative bounds do not hold.
//
// Attention forward, row i (keys j <= i), scale = 1/sqrt(Dh), S_ij = scale sum_d |q_id k_jd|:
//   score:  e_s = 2 (Dh + 8) u S_ij + 2u |s_ij|;  E = max_j e_s  (the maxima then differ <= E)
//   exp:    relative r_j = 2E + 2u |s_ij - max| (the two subtractions) + 6u (expf, 2 + 1 ulp)
//   sum:    relative r_sum = max_j r_j + 2 (i + 8) u
//   p_ij:   p_ij (r_j + r_sum + 4u) (the reciprocal and the product, on each side)
//   out_id: sum_j bound(p_ij) |v_jd| + 2 (i + 2) u sum_j p_ij |v_jd| (same order on both sides,
//           different p)
// Attention backward (probs given, the same to both), A_ij = sum_d |dout_id v_jd|,
// A_i = sum_j p_ij A_ij, ds_ij = p_ij (dp_ij - D_i) scale:
//   dp_ij:  2 (Dh + 8) u A_ij;   D_i: 2 (i + Dh + 8) u A_i  (the GPU evaluates D_i as
//           dout_i . sum_j p_ij v_j, the CPU as sum_j p_ij dp_ij: the same terms, other order)
//   ds_ij:  p_ij scale (bound(dp_ij) + bound(D_i)) + 6u |ds_ij|
//   dq_id:  sum_j bound(ds_ij) |k_jd| + 2 (i + 2) u (|dq_id before| + sum_j |ds_ij k_jd|)
//   dk_jd:  the same over the group's query heads and i >= j with q_id (a chain of
//           group * (T - j) additions: 2 (group (T - j) + 2) u of the terms' magnitudes)
//   dv_jd:  none. Both sides add the same products p_ij dout_id in the same order (query heads of
//           the group ascending, then i ascending) onto the same value, each operation rounded
//           once: bit for bit.
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
#include <limits>
#include <ostream>
#include <random>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "kernels/layer_ops.h"
#include "kernels/ops.h"
#include "tests/gpu/gpu_test_support.h"

namespace fp8rt::kernels {
namespace {

constexpr double kU = 0x1p-24;
constexpr double kTiny = 0x1p-120;
constexpr double kSafety = 2.0;

using gpu_test::CudaStreamTest;
using gpu_test::DeviceBuffer;
using gpu_test::Download;
using gpu_test::Put;

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

struct AttnShape {
  int64_t b, t, h, hkv, dh;
};

std::string ShapeName(const AttnShape& s) {
  return absl::StrCat("B", s.b, "_T", s.t, "_H", s.h, "_Hkv", s.hkv, "_Dh", s.dh);
}
void PrintTo(const AttnShape& s, std::ostream* os) { *os << ShapeName(s); }

// Inputs of one shape: q and k with sigma 1.5, so that scores have a standard deviation of about
// 2.2 (peaked and flat rows both occur); v, dout and the pre-filled gradients N(0, 1).
struct AttnData {
  explicit AttnData(const AttnShape& shape, uint32_t seed)
      : s(shape),
        size(static_cast<size_t>(s.b * s.t * s.h * s.dh)),
        kv_size(static_cast<size_t>(s.b * s.t * s.hkv * s.dh)),
        probs_size(static_cast<size_t>(s.b * s.h * s.t * s.t)),
        group(s.h / s.hkv),
        q(Normal(size, 1.5f, seed)),
        k(Normal(kv_size, 1.5f, seed + 1)),
        v(Normal(kv_size, 1.0f, seed + 2)),
        dout(Normal(size, 1.0f, seed + 3)),
        dq0(Normal(size, 1.0f, seed + 4)),
        dk0(Normal(kv_size, 1.0f, seed + 5)),
        dv0(Normal(kv_size, 1.0f, seed + 6)),
        scale(1.0f / std::sqrt(static_cast<float>(s.dh))) {}
  // Index of channel d of position `pos` of query head hh in batch row bb, [B, T, H, Dh].
  size_t At(int64_t bb, int64_t pos, int64_t hh, int64_t d) const {
    return static_cast<size_t>(((bb * s.t + pos) * s.h + hh) * s.dh + d);
  }
  // The same channel of query head hh's kv head hh / (H / Hkv), [B, T, Hkv, Dh].
  size_t KvAt(int64_t bb, int64_t pos, int64_t hh, int64_t d) const {
    return static_cast<size_t>(((bb * s.t + pos) * s.hkv + hh / group) * s.dh + d);
  }
  size_t P(int64_t bb, int64_t hh, int64_t i, int64_t j) const {
    return static_cast<size_t>(((bb * s.h + hh) * s.t + i) * s.t + j);
  }
  // sum_d a_id b_jd and sum_d |a_id b_jd| over query head hh of batch row bb, in FP64; a is
  // [B, T, H, Dh] like q, b [B, T, Hkv, Dh] like k (read at hh's kv head).
  struct Dot {
    double value, abs;
  };
  Dot HeadDot(const std::vector<float>& a, const std::vector<float>& b, int64_t bb, int64_t hh,
              int64_t i, int64_t j) const {
    Dot dot{0.0, 0.0};
    for (int64_t d = 0; d < s.dh; ++d) {
      const double prod = double{a[At(bb, i, hh, d)]} * b[KvAt(bb, j, hh, d)];
      dot.value += prod;
      dot.abs += std::fabs(prod);
    }
    return dot;
  }

  AttnShape s;
  size_t size, kv_size, probs_size;
  int64_t group;  // query heads per kv head
  std::vector<float> q, k, v, dout, dq0, dk0, dv0;
  float scale;  // the 1/sqrt(Dh) both backends use
};

// The forward's bounds (header) for every probability and output element, from the inputs and
// the CPU's probabilities.
void ForwardBounds(const AttnData& x, const std::vector<float>& probs, std::vector<double>* p_bound,
                   std::vector<double>* out_bound) {
  const AttnShape& s = x.s;
  p_bound->assign(x.probs_size, 0.0);
  out_bound->assign(x.size, 0.0);
  std::vector<double> score(static_cast<size_t>(s.t)), rel(static_cast<size_t>(s.t));
  for (int64_t bb = 0; bb < s.b; ++bb) {
    for (int64_t hh = 0; hh < s.h; ++hh) {
      for (int64_t i = 0; i < s.t; ++i) {
        double e_max = 0.0, max_score = -std::numeric_limits<double>::infinity();
        for (int64_t j = 0; j <= i; ++j) {
          const AttnData::Dot qk = x.HeadDot(x.q, x.k, bb, hh, i, j);
          score[j] = qk.value * x.scale;
          e_max = std::max(
              e_max, 2.0 * (s.dh + 8) * kU * qk.abs * x.scale + 2.0 * kU * std::fabs(score[j]));
          max_score = std::max(max_score, score[j]);
        }
        double r_max = 0.0;
        for (int64_t j = 0; j <= i; ++j) {
          rel[j] = 2.0 * e_max + 2.0 * kU * std::fabs(score[j] - max_score) + 6.0 * kU;
          r_max = std::max(r_max, rel[j]);
        }
        const double r_sum = r_max + 2.0 * (i + 8) * kU;
        for (int64_t j = 0; j <= i; ++j) {
          const size_t at = x.P(bb, hh, i, j);
          (*p_bound)[at] = probs[at] * (rel[j] + r_sum + 4.0 * kU);
        }
        for (int64_t d = 0; d < s.dh; ++d) {
          double from_p = 0.0, pv = 0.0;
          for (int64_t j = 0; j <= i; ++j) {
            const double av = std::fabs(x.v[x.KvAt(bb, j, hh, d)]);
            from_p += (*p_bound)[x.P(bb, hh, i, j)] * av;
            pv += probs[x.P(bb, hh, i, j)] * av;
          }
          (*out_bound)[x.At(bb, i, hh, d)] = from_p + 2.0 * (i + 2) * kU * pv;
        }
      }
    }
  }
}

// The backward's bounds (header) for every element of dq and dk.
void BackwardBounds(const AttnData& x, const std::vector<float>& probs,
                    std::vector<double>* dq_bound, std::vector<double>* dk_bound) {
  const AttnShape& s = x.s;
  const size_t tt = static_cast<size_t>(s.t * s.t);
  dq_bound->assign(x.size, 0.0);
  // dk's two parts per kv element, summed over the group's query heads: the propagated ds
  // errors and the magnitudes of the terms (with dk0) for the rounding of the chain.
  std::vector<double> dk_from_ds(x.kv_size, 0.0), dk_terms(x.kv_size, 0.0);
  for (size_t n = 0; n < x.kv_size; ++n) dk_terms[n] = std::fabs(x.dk0[n]);
  std::vector<double> ds(tt), ds_bound(tt), dp(tt), a(tt);
  for (int64_t bb = 0; bb < s.b; ++bb) {
    for (int64_t hh = 0; hh < s.h; ++hh) {
      for (int64_t i = 0; i < s.t; ++i) {
        double d_row = 0.0, a_row = 0.0;
        for (int64_t j = 0; j <= i; ++j) {
          const AttnData::Dot dout_v = x.HeadDot(x.dout, x.v, bb, hh, i, j);
          const double p = probs[x.P(bb, hh, i, j)];
          dp[i * s.t + j] = dout_v.value;
          a[i * s.t + j] = dout_v.abs;
          d_row += p * dout_v.value;
          a_row += p * dout_v.abs;
        }
        for (int64_t j = 0; j <= i; ++j) {
          const double p = probs[x.P(bb, hh, i, j)];
          const size_t ij = static_cast<size_t>(i * s.t + j);
          ds[ij] = p * (dp[ij] - d_row) * x.scale;
          ds_bound[ij] =
              p * x.scale * (2.0 * (s.dh + 8) * kU * a[ij] + 2.0 * (i + s.dh + 8) * kU * a_row) +
              6.0 * kU * std::fabs(ds[ij]);
        }
      }
      for (int64_t d = 0; d < s.dh; ++d) {
        for (int64_t i = 0; i < s.t; ++i) {  // dq_i over keys j <= i
          double from_ds = 0.0, terms = std::fabs(x.dq0[x.At(bb, i, hh, d)]);
          for (int64_t j = 0; j <= i; ++j) {
            const double kd = std::fabs(x.k[x.KvAt(bb, j, hh, d)]);
            from_ds += ds_bound[i * s.t + j] * kd;
            terms += std::fabs(ds[i * s.t + j]) * kd;
          }
          (*dq_bound)[x.At(bb, i, hh, d)] = from_ds + 2.0 * (i + 2) * kU * terms;
        }
        for (int64_t j = 0; j < s.t; ++j) {  // dk_j over queries i >= j
          double from_ds = 0.0, terms = 0.0;
          for (int64_t i = j; i < s.t; ++i) {
            const double qd = std::fabs(x.q[x.At(bb, i, hh, d)]);
            from_ds += ds_bound[i * s.t + j] * qd;
            terms += std::fabs(ds[i * s.t + j]) * qd;
          }
          dk_from_ds[x.KvAt(bb, j, hh, d)] += from_ds;
          dk_terms[x.KvAt(bb, j, hh, d)] += terms;
        }
      }
    }
  }
  dk_bound->assign(x.kv_size, 0.0);
  for (int64_t bb = 0; bb < s.b; ++bb) {
    for (int64_t j = 0; j < s.t; ++j) {
      for (int64_t g = 0; g < s.hkv; ++g) {
        for (int64_t d = 0; d < s.dh; ++d) {
          const size_t at = x.KvAt(bb, j, g * x.group, d);
          (*dk_bound)[at] = dk_from_ds[at] + 2.0 * (x.group * (s.t - j) + 2) * kU * dk_terms[at];
        }
      }
    }
  }
}

// Elements of `got` farther from `want` than kSafety * bound + kTiny: one message with the count
// and the first few, empty if none.
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

// The CPU forward on x's inputs, into out and probs (resized to fit).
absl::Status CpuAttentionForward(const LayerOps& cpu, const AttnData& x, std::vector<float>* out,
                                 std::vector<float>* probs) {
  out->resize(x.size);
  probs->resize(x.probs_size);
  return cpu.attention_forward(out->data(), probs->data(), x.q.data(), x.k.data(), x.v.data(),
                               x.s.b, x.s.t, x.s.h, x.s.hkv, x.s.dh, Stream{});
}

// The CPU backward on x's inputs with `probs`, onto dq, dk and dv (it adds to them).
absl::Status CpuAttentionBackward(const LayerOps& cpu, const AttnData& x,
                                  const std::vector<float>& probs, std::vector<float>* dq,
                                  std::vector<float>* dk, std::vector<float>* dv) {
  return cpu.attention_backward(dq->data(), dk->data(), dv->data(), x.dout.data(), x.q.data(),
                                x.k.data(), x.v.data(), probs.data(), x.s.b, x.s.t, x.s.h, x.s.hkv,
                                x.s.dh, Stream{});
}

// One shape's device buffers for both directions: the inputs q, k, v and dout copied from x; the
// probabilities (the forward's output, the backward's input: PutProbs); the outputs out, dq, dk
// and dv (PutGrads pre-fills the gradients). Everything not copied is poisoned (DeviceBuffer).
struct AttnBuffers {
  explicit AttnBuffers(const AttnData& x)
      : s(x.s),
        q(x.size * 4),
        k(x.kv_size * 4),
        v(x.kv_size * 4),
        dout(x.size * 4),
        probs(x.probs_size * 4),
        out(x.size * 4),
        dq(x.size * 4),
        dk(x.kv_size * 4),
        dv(x.kv_size * 4) {
    Put(q, x.q);
    Put(k, x.k);
    Put(v, x.v);
    Put(dout, x.dout);
  }
  void PutProbs(const std::vector<float>& p) const { Put(probs, p); }
  void PutGrads(const std::vector<float>& dq0, const std::vector<float>& dk0,
                const std::vector<float>& dv0) const {
    Put(dq, dq0);
    Put(dk, dk0);
    Put(dv, dv0);
  }
  // The CUDA entries on these buffers, on `stream`.
  absl::Status Forward(const LayerOps& gpu, Stream stream) const {
    return gpu.attention_forward(out.f(), probs.f(), q.f(), k.f(), v.f(), s.b, s.t, s.h, s.hkv,
                                 s.dh, stream);
  }
  absl::Status Backward(const LayerOps& gpu, Stream stream) const {
    return gpu.attention_backward(dq.f(), dk.f(), dv.f(), dout.f(), q.f(), k.f(), v.f(), probs.f(),
                                  s.b, s.t, s.h, s.hkv, s.dh, stream);
  }

  const AttnShape s;
  DeviceBuffer q, k, v, dout, probs, out, dq, dk, dv;
};

const AttnShape kAttnShapes[] = {
    {1, 1, 1, 1, 1},      // T = 1, Dh = 1
    {2, 1, 3, 3, 64},     // T = 1
    {1, 45, 2, 2, 1},     // Dh = 1, T not a multiple of 32
    {2, 257, 2, 2, 64},   // T = 257
    {1, 100, 3, 3, 128},  // Dh = 128
    {3, 40, 64, 64, 8},   // B * H = 192, more heads than any current GPU has SMs
    {1, 70, 1, 1, 300},   // Dh > 256: two register passes per warp
    {1, 1100, 2, 2, 8},   // T > 1024: the dk/dv kernel's row terms in two chunks
    // Grouped-query attention.
    {2, 257, 8, 2, 64},   // four query heads per kv head
    {1, 100, 6, 1, 128},  // multi-query: one kv head for all
    {3, 40, 64, 8, 8},    // eight groups of eight, B * Hkv = 24
    {1, 70, 4, 2, 300},   // Dh > 256
    {1, 1100, 4, 2, 8},   // T > 1024: row-term chunks within each query head of the group
};

class AttentionForwardTest : public CudaLayerTest,
                             public ::testing::WithParamInterface<AttnShape> {};

TEST_P(AttentionForwardTest, MatchesCpuWithinBoundsMasksExactlyAndReruns) {
  const AttnData x(GetParam(), 1000);
  const AttnShape& s = x.s;
  std::vector<float> out, probs;
  ASSERT_TRUE(CpuAttentionForward(cpu_, x, &out, &probs).ok());

  const AttnBuffers d(x);
  ASSERT_TRUE(d.Forward(*gpu_, stream()).ok());
  Sync();
  const std::vector<float> g_out = Download<float>(d.out, x.size);
  const std::vector<float> g_probs = Download<float>(d.probs, x.probs_size);

  // Masked entries (j > i) are +0 exactly, as the CPU writes them.
  int64_t masked_wrong = 0;
  for (int64_t bh = 0; bh < s.b * s.h; ++bh) {
    for (int64_t i = 0; i < s.t; ++i) {
      for (int64_t j = i + 1; j < s.t; ++j) {
        masked_wrong += Bits(g_probs[static_cast<size_t>((bh * s.t + i) * s.t + j)]) != 0u;
      }
    }
  }
  EXPECT_EQ(masked_wrong, 0) << "masked probabilities that are not +0";

  std::vector<double> p_bound, out_bound;
  ForwardBounds(x, probs, &p_bound, &out_bound);
  std::string err = OutOfBounds("probs", g_probs, probs, p_bound);
  EXPECT_TRUE(err.empty()) << err;
  err = OutOfBounds("out", g_out, out, out_bound);
  EXPECT_TRUE(err.empty()) << err;

  // A second run over the same inputs (outputs poisoned again) gives the same bits.
  ASSERT_EQ(cudaMemset(d.out.f(), 0xA5, x.size * 4), cudaSuccess);
  ASSERT_EQ(cudaMemset(d.probs.f(), 0xA5, x.probs_size * 4), cudaSuccess);
  ASSERT_TRUE(d.Forward(*gpu_, stream()).ok());
  Sync();
  EXPECT_TRUE(SameBits(Download<float>(d.out, x.size), g_out)) << "out differs between runs";
  EXPECT_TRUE(SameBits(Download<float>(d.probs, x.probs_size), g_probs))
      << "probs differ between runs";
}

INSTANTIATE_TEST_SUITE_P(Shapes, AttentionForwardTest, ::testing::ValuesIn(kAttnShapes),
                         [](const auto& info) { return ShapeName(info.param); });

// The CPU forward's probabilities for x: the backward's input on both backends.
std::vector<float> CpuProbs(const LayerOps& cpu, const AttnData& x) {
  std::vector<float> out, probs;
  EXPECT_TRUE(CpuAttentionForward(cpu, x, &out, &probs).ok());
  return probs;
}

class AttentionBackwardTest : public CudaLayerTest,
                              public ::testing::WithParamInterface<AttnShape> {};

TEST_P(AttentionBackwardTest, AccumulatesLikeCpuWithinBoundsAndReruns) {
  const AttnData x(GetParam(), 2000);
  const std::vector<float> probs = CpuProbs(cpu_, x);
  std::vector<float> dq = x.dq0, dk = x.dk0, dv = x.dv0;
  ASSERT_TRUE(CpuAttentionBackward(cpu_, x, probs, &dq, &dk, &dv).ok());

  const AttnBuffers d(x);
  d.PutProbs(probs);
  std::vector<float> runs[2][3];
  for (auto& run : runs) {
    d.PutGrads(x.dq0, x.dk0, x.dv0);  // pre-filled: the backward must add to them
    ASSERT_TRUE(d.Backward(*gpu_, stream()).ok());
    Sync();
    run[0] = Download<float>(d.dq, x.size);
    run[1] = Download<float>(d.dk, x.kv_size);
    run[2] = Download<float>(d.dv, x.kv_size);
  }

  std::vector<double> dq_bound, dk_bound;
  BackwardBounds(x, probs, &dq_bound, &dk_bound);
  std::string err = OutOfBounds("dq", runs[0][0], dq, dq_bound);
  EXPECT_TRUE(err.empty()) << err;
  err = OutOfBounds("dk", runs[0][1], dk, dk_bound);
  EXPECT_TRUE(err.empty()) << err;
  EXPECT_TRUE(SameBits(runs[0][2], dv)) << "dv is not bit for bit the CPU's";
  for (int g = 0; g < 3; ++g) {
    EXPECT_TRUE(SameBits(runs[0][g], runs[1][g])) << "gradient " << g << " differs between runs";
  }
}

INSTANTIATE_TEST_SUITE_P(Shapes, AttentionBackwardTest, ::testing::ValuesIn(kAttnShapes),
                         [](const auto& info) { return ShapeName(info.param); });

class AttentionAccumulateTest : public CudaLayerTest {};

TEST_F(AttentionAccumulateTest, TwoCallsAddTwice) {
  const AttnData x({2, 50, 6, 2, 24}, 3000);
  const std::vector<float> probs = CpuProbs(cpu_, x);
  // CPU: zero gradients, two calls.
  const std::vector<float> zeros(x.size, 0.0f), kv_zeros(x.kv_size, 0.0f);
  std::vector<float> dq = zeros, dk = kv_zeros, dv = kv_zeros;
  for (int call = 0; call < 2; ++call) {
    ASSERT_TRUE(CpuAttentionBackward(cpu_, x, probs, &dq, &dk, &dv).ok());
  }
  const AttnBuffers d(x);
  d.PutProbs(probs);
  d.PutGrads(zeros, kv_zeros, kv_zeros);
  for (int call = 0; call < 2; ++call) {
    ASSERT_TRUE(d.Backward(*gpu_, stream()).ok());
  }
  Sync();
  // dv: the same additions on both sides. dq, dk: the first call's difference carries over (one
  // single-call bound), the second call adds its own (one more, and one for its rounding errors
  // relative to the first call's result, which is at most the sum of the terms' magnitudes).
  EXPECT_TRUE(SameBits(Download<float>(d.dv, x.kv_size), dv)) << "dv is not bit for bit the CPU's";
  AttnData once = x;
  std::fill(once.dq0.begin(), once.dq0.end(), 0.0f);
  std::fill(once.dk0.begin(), once.dk0.end(), 0.0f);
  std::vector<double> dq_bound, dk_bound;
  BackwardBounds(once, probs, &dq_bound, &dk_bound);
  for (double& bound : dq_bound) bound *= 3.0;
  for (double& bound : dk_bound) bound *= 3.0;
  std::string err = OutOfBounds("dq", Download<float>(d.dq, x.size), dq, dq_bound);
  EXPECT_TRUE(err.empty()) << err;
  err = OutOfBounds("dk", Download<float>(d.dk, x.kv_size), dk, dk_bound);
  EXPECT_TRUE(err.empty()) << err;
}

// --- cross-entropy -----------------------------------------------------------------------------

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
    ASSERT_EQ(cudaMemset(d.probs.f(), 0xA5, nv * 4), cudaSuccess);
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
  constexpr int64_t b = 1, t = 4, h = 2, dh = 8, size = b * t * h * dh, psize = b * h * t * t;
  std::vector<float> host(psize, 1.0f);
  DeviceBuffer q(size * 4), k(size * 4), v(size * 4), out(size * 4), probs(psize * 4), dq(size * 4),
      dk(size * 4), dv(size * 4), dout(size * 4);
  const std::vector<float> quarter(size, 0.25f), quarter_p(psize, 0.25f);
  for (const DeviceBuffer* d : {&q, &k, &v, &dout, &dq, &dk, &dv}) Put(*d, quarter);
  Put(probs, quarter_p);
  ExpectRefused(gpu_->attention_forward(out.f(), probs.f(), host.data(), k.f(), v.f(), b, t, h, h,
                                        dh, stream()),
                "q");
  ExpectRefused(
      gpu_->attention_forward(out.f(), host.data(), q.f(), k.f(), v.f(), b, t, h, h, dh, stream()),
      "probs");
  ExpectRefused(gpu_->attention_backward(dq.f(), dk.f(), host.data(), dout.f(), q.f(), k.f(), v.f(),
                                         probs.f(), b, t, h, h, dh, stream()),
                "dv");
  ExpectRefused(gpu_->attention_backward(dq.f(), dk.f(), dv.f(), dout.f(), q.f(), k.f(), v.f(),
                                         host.data(), b, t, h, h, dh, stream()),
                "probs");
  Sync();
  // Nothing ran: out is still poisoned, the gradients and probs unchanged.
  for (float x : Download<float>(out, size)) ASSERT_EQ(Bits(x), 0xA5A5A5A5u);
  for (float x : Download<float>(dv, size)) ASSERT_EQ(x, 0.25f);
  for (float x : Download<float>(probs, psize)) ASSERT_EQ(x, 0.25f);

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
      gpu_->attention_forward(out.f(), probs.f(), q.f(), k.f(), v.f(), b, t, h, h, dh, stream())
          .ok());
  EXPECT_TRUE(gpu_->cross_entropy_forward(ce_probs.f(), losses.f(), logits.f(),
                                          targets.as<int32_t>(), n, vocab, stream())
                  .ok());
  Sync();
}

TEST_F(ArgumentTest, BadSizesAndNullPointersAreRefusedNamingTheArgument) {
  DeviceBuffer a(4096), c(4096), d(4096), e(4096), f(4096), g(4096), pr(4096), tg(64);
  // Negative sizes, each named (nothing is dereferenced: the check comes first).
  ExpectRefused(
      gpu_->attention_forward(a.f(), pr.f(), c.f(), d.f(), e.f(), -1, 2, 2, 2, 2, stream()),
      "b is -1");
  ExpectRefused(
      gpu_->attention_forward(a.f(), pr.f(), c.f(), d.f(), e.f(), 1, -2, 2, 2, 2, stream()),
      "t is -2");
  ExpectRefused(
      gpu_->attention_forward(a.f(), pr.f(), c.f(), d.f(), e.f(), 1, 2, -3, 1, 2, stream()),
      "h is -3");
  ExpectRefused(
      gpu_->attention_forward(a.f(), pr.f(), c.f(), d.f(), e.f(), 1, 2, 2, -1, 2, stream()),
      "hkv is -1");
  ExpectRefused(
      gpu_->attention_forward(a.f(), pr.f(), c.f(), d.f(), e.f(), 1, 2, 2, 2, -4, stream()),
      "dh is -4");
  ExpectRefused(gpu_->attention_backward(a.f(), c.f(), d.f(), e.f(), f.f(), g.f(), a.f(), pr.f(), 1,
                                         2, 2, 2, -1, stream()),
                "dh is -1");
  ExpectRefused(gpu_->attention_backward(a.f(), c.f(), d.f(), e.f(), f.f(), g.f(), a.f(), pr.f(),
                                         -5, 2, 2, 1, 2, stream()),
                "b is -5");
  // kv heads that do not divide the query heads (or none at all).
  ExpectRefused(
      gpu_->attention_forward(a.f(), pr.f(), c.f(), d.f(), e.f(), 1, 2, 3, 2, 2, stream()),
      "hkv is 2");
  ExpectRefused(gpu_->attention_backward(a.f(), c.f(), d.f(), e.f(), f.f(), g.f(), a.f(), pr.f(), 1,
                                         2, 2, 0, 2, stream()),
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
      gpu_->attention_forward(a.f(), pr.f(), c.f(), d.f(), e.f(), 1, 2, 2, 2, 0, stream()),
      "dh is 0");
  ExpectRefused(gpu_->cross_entropy_forward(a.f(), c.f(), d.f(), tg.as<int32_t>(), 2, 0, stream()),
                "v is 0");
  ExpectRefused(gpu_->cross_entropy_backward(a.f(), c.f(), tg.as<int32_t>(), 2, 0, 1.0f, stream()),
                "v is 0");
  ExpectRefused(gpu_->attention_forward(a.f(), pr.f(), c.f(), d.f(), e.f(), 1, int64_t{1} << 32, 1,
                                        1, 1, stream()),
                "overflows");
  ExpectRefused(
      gpu_->attention_forward(a.f(), pr.f(), nullptr, d.f(), e.f(), 1, 2, 2, 2, 2, stream()),
      "q is null");
  ExpectRefused(gpu_->attention_backward(a.f(), nullptr, d.f(), e.f(), f.f(), g.f(), a.f(), pr.f(),
                                         1, 2, 2, 2, 2, stream()),
                "dk is null");
  ExpectRefused(gpu_->cross_entropy_backward(a.f(), c.f(), nullptr, 2, 4, 1.0f, stream()),
                "targets is null");
  // Empty sizes are fine, with or without buffers.
  EXPECT_TRUE(
      gpu_->attention_forward(nullptr, nullptr, nullptr, nullptr, nullptr, 0, 5, 2, 1, 4, stream())
          .ok());
  EXPECT_TRUE(gpu_->attention_backward(nullptr, nullptr, nullptr, nullptr, nullptr, nullptr,
                                       nullptr, nullptr, 2, 0, 2, 2, 4, stream())
                  .ok());
  EXPECT_TRUE(
      gpu_->cross_entropy_forward(nullptr, nullptr, nullptr, nullptr, 0, 50257, stream()).ok());
  EXPECT_TRUE(gpu_->cross_entropy_backward(nullptr, nullptr, nullptr, 0, 7, 1.0f, stream()).ok());
  Sync();
}

}  // namespace
}  // namespace fp8rt::kernels
