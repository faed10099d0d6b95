// Tests of the CPU backend's LayerOps entries (CpuOps().layer, kernels/layer_ops.h), in
// particular the entries that are new code rather than wrappers of the span functions: the head
// split and join, transpose, fill, copy, the per-row cross-entropy, the FP64 sum of squares, the
// AdamW update, the argument checks, allocate / deallocate (and DeviceArray on top of them) and
// synchronize. References are written here from the contract's formulas (index formulas, double
// evaluations); where the contract names the span function as the entry's bit-for-bit reference
// (AdamWUpdate, CrossEntropyForward and the wrapped layer ops) the entry is compared with it too.
//
// Index:
//   Bits, RandomBits, Guarded      bit patterns; buffers with a sentinel guard past their end
//   TableTest                      every entry is present
//   SplitJoinHeadsTest (TEST_P)    kv-head-grouped index formula (q_per_kv = 1 the multi-head
//                                  layout), join(split(x)) == x, split(join(q, k, v))
//   TransposeTest (TEST_P)         dst[c * rows + r] == src[r * cols + c]
//   FillCopyTest                   -0.0f, NaN payloads, Inf, denormals; n = 0
//   CrossEntropyEntryTest          per-row loss vs double logsumexp; mean == CrossEntropyForward
//   SumSquaresTest                 FP64 in-order sum bit for bit; non-finite exactly on NaN / Inf
//   AdamWEntryTest                 AdamWUpdate bit for bit; the formula in double
//   WrapperEntryTest               wrapped layer ops == their span functions, bit for bit
//   ArgumentErrorTest              negative sizes, zero dh / c / v with rows, odd RoPE dh, t = 0,
//                                  hkv not dividing h, bad eps / theta, zero rows
//   AllocateTest, DeviceArrayTest  alignment, 0 bytes, failure, assign / resize / move
//   SynchronizeTest
#include <algorithm>
#include <atomic>
#include <bit>
#include <cctype>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <functional>
#include <limits>
#include <random>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "kernels/device_array.h"
#include "kernels/host_mirror.h"
#include "kernels/layer_ops.h"
#include "kernels/ops.h"

namespace fp8rt::kernels {
namespace {

using ::testing::HasSubstr;

const LayerOps& Ops() { return *CpuOps().layer; }

// One FP32 rounding: 2^-24 relative (round to nearest).
constexpr double kU = 0x1p-24;

uint32_t Bits(float x) { return std::bit_cast<uint32_t>(x); }
float FromBits(uint32_t b) { return std::bit_cast<float>(b); }

// A finite value no test writes on purpose; guards and untouched buffers hold it.
constexpr uint32_t kSentinelBits = 0xDEADBEEFu;
constexpr size_t kGuard = 16;

// n random bit patterns (NaNs with payloads, denormals, -0 included), never the sentinel.
std::vector<float> RandomBits(size_t n, uint32_t seed) {
  std::mt19937 rng(seed);
  std::vector<float> out(n);
  for (float& x : out) {
    uint32_t b = static_cast<uint32_t>(rng());
    if (b == kSentinelBits) b ^= 1u;
    x = FromBits(b);
  }
  return out;
}

std::vector<float> RandomFloats(size_t n, uint32_t seed, float lo, float hi) {
  std::mt19937 rng(seed);
  std::uniform_real_distribution<float> dist(lo, hi);
  std::vector<float> out(n);
  for (float& x : out) x = dist(rng);
  return out;
}

// n floats followed by kGuard more, all the sentinel: an entry that writes past n, or that
// should write nothing, leaves a non-sentinel value behind.
std::vector<float> Guarded(size_t n) {
  return std::vector<float>(n + kGuard, FromBits(kSentinelBits));
}

::testing::AssertionResult AllSentinel(const float* p, size_t n) {
  for (size_t i = 0; i < n; ++i) {
    if (Bits(p[i]) != kSentinelBits) {
      return ::testing::AssertionFailure()
             << "element " << i << " of " << n << " was written (bits 0x" << std::hex << Bits(p[i])
             << ")";
    }
  }
  return ::testing::AssertionSuccess();
}
::testing::AssertionResult AllSentinel(const std::vector<float>& v) {
  return AllSentinel(v.data(), v.size());
}
// The guard past the first n elements is intact.
::testing::AssertionResult GuardIntact(const std::vector<float>& v, size_t n) {
  return AllSentinel(v.data() + n, v.size() - n);
}

// The vectorised activations (GELU, SwiGLU; Highway's Tanh and Exp) against the scalar references
// of kernels/layer_ops.h (glibc's tanhf and expf): within 8 float ulps of the larger magnitude, or
// 4e-7 absolute near zero (the float tanh form cancels in 1 + tanh u for x below about -4, where
// the two tanh approximations may round the last step below 1 differently: up to ~1.5e-7).
// Non-finite references must be matched exactly (NaN by NaN).
// `extra`, when given, adds a per-element allowance (the backwards' propagated function error).
::testing::AssertionResult CloseToReference(const float* got, const float* want, size_t n,
                                            const std::vector<double>* extra = nullptr) {
  for (size_t i = 0; i < n; ++i) {
    if (!std::isfinite(want[i]) || !std::isfinite(got[i])) {
      if ((std::isnan(want[i]) && std::isnan(got[i])) || got[i] == want[i]) continue;
      return ::testing::AssertionFailure()
             << "at " << i << ": " << got[i] << " vs reference " << want[i];
    }
    const float scale = std::max(std::fabs(got[i]), std::fabs(want[i]));
    const double tol = std::max(4e-7f, 8.0f * std::numeric_limits<float>::epsilon() * scale) +
                       (extra != nullptr ? (*extra)[i] : 0.0);
    if (!(std::fabs(double{got[i]} - double{want[i]}) <= tol)) {
      return ::testing::AssertionFailure() << "at " << i << ": " << got[i] << " vs reference "
                                           << want[i] << " (tolerance " << tol << ")";
    }
  }
  return ::testing::AssertionSuccess();
}

// The entries whose row sums run lane-wise (the norms, the softmax: kernels/cpu/rows_cpu.cc) are
// checked here only for their arguments' places: within 1e-5 relative (plus 1e-7 absolute) of
// the span function. Their numerics are tests/unit/rows_cpu_test.cc's, against the summation
// bound.
// Every element within 1e-5 of the largest |want| (for results whose summation order differs).
::testing::AssertionResult NearScaled(const std::vector<float>& got,
                                      const std::vector<float>& want) {
  if (got.size() != want.size()) return ::testing::AssertionFailure() << "sizes differ";
  double largest = 0.0;
  for (float w : want) largest = std::max(largest, std::fabs(double{w}));
  for (size_t i = 0; i < got.size(); ++i) {
    if (!(std::fabs(double{got[i]} - double{want[i]}) <= 1e-5 * largest)) {
      return ::testing::AssertionFailure() << "at " << i << ": " << got[i] << " vs " << want[i];
    }
  }
  return ::testing::AssertionSuccess();
}

::testing::AssertionResult NearRelative(const float* got, const float* want, size_t n) {
  for (size_t i = 0; i < n; ++i) {
    if (!(std::fabs(double{got[i]} - double{want[i]}) <=
          1e-5 * std::fabs(double{want[i]}) + 1e-7)) {
      return ::testing::AssertionFailure() << "at " << i << ": " << got[i] << " vs " << want[i];
    }
  }
  return ::testing::AssertionSuccess();
}

::testing::AssertionResult SameBits(const float* got, const float* want, size_t n) {
  for (size_t i = 0; i < n; ++i) {
    if (Bits(got[i]) != Bits(want[i])) {
      return ::testing::AssertionFailure()
             << "first difference at " << i << ": 0x" << std::hex << Bits(got[i]) << " != 0x"
             << Bits(want[i]) << " (" << got[i] << " vs " << want[i] << ")";
    }
  }
  return ::testing::AssertionSuccess();
}

// ---------------------------------------------------------------------------------------------

TEST(TableTest, EveryEntryIsPresent) {
  ASSERT_EQ(CpuOps().backend, Backend::kCpu);
  ASSERT_NE(CpuOps().layer, nullptr);
  const LayerOps& o = Ops();
  EXPECT_NE(o.embedding_forward, nullptr);
  EXPECT_NE(o.embedding_backward, nullptr);
  EXPECT_NE(o.rmsnorm_forward, nullptr);
  EXPECT_NE(o.rmsnorm_backward, nullptr);
  EXPECT_NE(o.attention_forward, nullptr);
  EXPECT_NE(o.attention_backward, nullptr);
  EXPECT_NE(o.attention_forward_bf16, nullptr);
  EXPECT_NE(o.attention_backward_bf16, nullptr);
  EXPECT_NE(o.gelu_forward, nullptr);
  EXPECT_NE(o.gelu_backward, nullptr);
  EXPECT_NE(o.layernorm_forward, nullptr);
  EXPECT_NE(o.layernorm_backward, nullptr);
  EXPECT_NE(o.bias_forward, nullptr);
  EXPECT_NE(o.bias_backward, nullptr);
  EXPECT_NE(o.rope_forward, nullptr);
  EXPECT_NE(o.rope_backward, nullptr);
  EXPECT_NE(o.swiglu_forward, nullptr);
  EXPECT_NE(o.swiglu_backward, nullptr);
  EXPECT_NE(o.residual_forward, nullptr);
  EXPECT_NE(o.residual_backward, nullptr);
  EXPECT_NE(o.cross_entropy_forward, nullptr);
  EXPECT_NE(o.cross_entropy_backward, nullptr);
  EXPECT_NE(o.fill, nullptr);
  EXPECT_NE(o.copy, nullptr);
  EXPECT_NE(o.transpose, nullptr);
  EXPECT_NE(o.transpose_bytes, nullptr);
  EXPECT_NE(o.split_heads, nullptr);
  EXPECT_NE(o.join_heads, nullptr);
  EXPECT_NE(o.sum_squares, nullptr);
  EXPECT_NE(o.adamw, nullptr);
  EXPECT_NE(o.synchronize, nullptr);
  EXPECT_NE(o.allocate, nullptr);
  EXPECT_NE(o.deallocate, nullptr);
}

// ---------------------------------------------------------------------------------------------
// split_heads / join_heads: row r of qkv [n, kv_heads * (q_per_kv + 2) * dh] holds, for kv head
// g, the query heads g * q_per_kv + j (j < q_per_kv), then k_g, then v_g (dh values each); q is
// [n, kv_heads * q_per_kv * dh] with query head j at columns [j * dh, +dh), k and v
// [n, kv_heads * dh] with kv head g at [g * dh, +dh). q_per_kv = 1 is the multi-head layout
// (q, k, v of each head).

struct HeadShape {
  int64_t n, kv_heads, q_per_kv, dh;
};

class SplitJoinHeadsTest : public ::testing::TestWithParam<HeadShape> {
 protected:
  const HeadShape s = GetParam();
  size_t QSize() const { return static_cast<size_t>(s.n * s.kv_heads * s.q_per_kv * s.dh); }
  size_t KvSize() const { return static_cast<size_t>(s.n * s.kv_heads * s.dh); }
  size_t FusedSize() const { return QSize() + 2 * KvSize(); }
  // Offsets of the contract's index formula: part `which` < q_per_kv is query head
  // g * q_per_kv + which, q_per_kv is k, q_per_kv + 1 is v.
  int64_t Fused(int64_t r, int64_t g, int64_t which, int64_t d) const {
    const int64_t row = s.kv_heads * (s.q_per_kv + 2) * s.dh;
    return r * row + g * (s.q_per_kv + 2) * s.dh + which * s.dh + d;
  }
  int64_t QPiece(int64_t r, int64_t j, int64_t d) const {
    return r * s.kv_heads * s.q_per_kv * s.dh + j * s.dh + d;
  }
  int64_t KvPiece(int64_t r, int64_t g, int64_t d) const {
    return r * s.kv_heads * s.dh + g * s.dh + d;
  }
  // Calls f(fused offset, part buffer index 0/1/2, offset in that part) for every element.
  template <class F>
  void ForEach(F f) const {
    for (int64_t r = 0; r < s.n; ++r) {
      for (int64_t g = 0; g < s.kv_heads; ++g) {
        for (int64_t which = 0; which < s.q_per_kv + 2; ++which) {
          for (int64_t d = 0; d < s.dh; ++d) {
            if (which < s.q_per_kv) {
              f(Fused(r, g, which, d), 0, QPiece(r, g * s.q_per_kv + which, d));
            } else {
              f(Fused(r, g, which, d), 1 + static_cast<int>(which - s.q_per_kv), KvPiece(r, g, d));
            }
          }
        }
      }
    }
  }
  absl::Status Split(std::vector<float>& q, std::vector<float>& k, std::vector<float>& v,
                     const std::vector<float>& qkv) const {
    return Ops().split_heads(q.data(), k.data(), v.data(), qkv.data(), s.n, s.kv_heads, s.q_per_kv,
                             s.dh, Stream{});
  }
  absl::Status Join(std::vector<float>& qkv, const std::vector<float>& q,
                    const std::vector<float>& k, const std::vector<float>& v) const {
    return Ops().join_heads(qkv.data(), q.data(), k.data(), v.data(), s.n, s.kv_heads, s.q_per_kv,
                            s.dh, Stream{});
  }
};

TEST_P(SplitJoinHeadsTest, SplitFollowsTheIndexFormula) {
  const std::vector<float> qkv = RandomBits(FusedSize(), 11);
  std::vector<float> q = Guarded(QSize()), k = Guarded(KvSize()), v = Guarded(KvSize());
  const absl::Status st = Split(q, k, v, qkv);
  ASSERT_TRUE(st.ok()) << st;
  const float* parts[3] = {q.data(), k.data(), v.data()};
  int mismatches = 0;
  ForEach([&](int64_t fused, int part, int64_t at) {
    const float got = parts[part][at];
    const float want = qkv[fused];
    if (Bits(got) != Bits(want) && ++mismatches <= 5) {
      ADD_FAILURE() << "qkv"[part] << "[" << at << "] from qkv[" << fused << "]: 0x" << std::hex
                    << Bits(got) << " != 0x" << Bits(want);
    }
  });
  EXPECT_EQ(mismatches, 0);
  EXPECT_TRUE(GuardIntact(q, QSize()));
  EXPECT_TRUE(GuardIntact(k, KvSize()));
  EXPECT_TRUE(GuardIntact(v, KvSize()));
}

TEST_P(SplitJoinHeadsTest, JoinFollowsTheIndexFormula) {
  const std::vector<float> q = RandomBits(QSize(), 21), k = RandomBits(KvSize(), 22),
                           v = RandomBits(KvSize(), 23);
  std::vector<float> qkv = Guarded(FusedSize());
  const absl::Status st = Join(qkv, q, k, v);
  ASSERT_TRUE(st.ok()) << st;
  const float* parts[3] = {q.data(), k.data(), v.data()};
  int mismatches = 0;
  ForEach([&](int64_t fused, int part, int64_t at) {
    const float got = qkv[fused];
    const float want = parts[part][at];
    if (Bits(got) != Bits(want) && ++mismatches <= 5) {
      ADD_FAILURE() << "qkv[" << fused << "] from "
                    << "qkv"[part] << "[" << at << "]: 0x" << std::hex << Bits(got) << " != 0x"
                    << Bits(want);
    }
  });
  EXPECT_EQ(mismatches, 0);
  EXPECT_TRUE(GuardIntact(qkv, FusedSize()));
}

TEST_P(SplitJoinHeadsTest, JoinOfSplitIsTheIdentityBitForBit) {
  const std::vector<float> x = RandomBits(FusedSize(), 31);
  std::vector<float> q = Guarded(QSize()), k = Guarded(KvSize()), v = Guarded(KvSize());
  ASSERT_TRUE(Split(q, k, v, x).ok());
  std::vector<float> y = Guarded(FusedSize());
  ASSERT_TRUE(Join(y, q, k, v).ok());
  EXPECT_TRUE(SameBits(y.data(), x.data(), x.size()));
  EXPECT_TRUE(GuardIntact(y, FusedSize()));

  // And the other way round: split(join(q, k, v)) == (q, k, v).
  const std::vector<float> q0 = RandomBits(QSize(), 32), k0 = RandomBits(KvSize(), 33),
                           v0 = RandomBits(KvSize(), 34);
  std::vector<float> fused = Guarded(FusedSize());
  ASSERT_TRUE(Join(fused, q0, k0, v0).ok());
  std::vector<float> q1 = Guarded(QSize()), k1 = Guarded(KvSize()), v1 = Guarded(KvSize());
  ASSERT_TRUE(Split(q1, k1, v1, fused).ok());
  EXPECT_TRUE(SameBits(q1.data(), q0.data(), QSize()));
  EXPECT_TRUE(SameBits(k1.data(), k0.data(), KvSize()));
  EXPECT_TRUE(SameBits(v1.data(), v0.data(), KvSize()));
}

// q_per_kv = 1 is the multi-head layout of heads = kv_heads: per row and head, q, k, v.
TEST(SplitJoinHeadsLayoutTest, OneQueryHeadPerKvHeadIsTheMultiHeadLayout) {
  constexpr int64_t kN = 2, kHeads = 3, kDh = 4;
  std::vector<float> qkv(kN * kHeads * 3 * kDh);
  for (size_t i = 0; i < qkv.size(); ++i) qkv[i] = static_cast<float>(i);
  std::vector<float> q(kN * kHeads * kDh), k(q.size()), v(q.size());
  ASSERT_TRUE(
      Ops()
          .split_heads(q.data(), k.data(), v.data(), qkv.data(), kN, kHeads, 1, kDh, Stream{})
          .ok());
  for (int64_t r = 0; r < kN; ++r) {
    for (int64_t j = 0; j < kHeads; ++j) {
      for (int64_t d = 0; d < kDh; ++d) {
        const int64_t piece = (r * kHeads + j) * kDh + d, fused = (r * kHeads + j) * 3 * kDh + d;
        EXPECT_EQ(q[piece], qkv[fused]);
        EXPECT_EQ(k[piece], qkv[fused + kDh]);
        EXPECT_EQ(v[piece], qkv[fused + 2 * kDh]);
      }
    }
  }
}

INSTANTIATE_TEST_SUITE_P(
    Shapes, SplitJoinHeadsTest,
    ::testing::Values(HeadShape{3, 4, 1, 5}, HeadShape{1, 1, 1, 1}, HeadShape{4, 1, 1, 6},
                      HeadShape{2, 3, 1, 1}, HeadShape{1, 8, 1, 2}, HeadShape{5, 2, 1, 33},
                      HeadShape{0, 3, 1, 4}, HeadShape{3, 2, 4, 5}, HeadShape{2, 1, 8, 3},
                      HeadShape{4, 3, 2, 1}, HeadShape{1, 2, 3, 64}, HeadShape{3, 2, 0, 4}),
    [](const auto& info) {
      return "n" + std::to_string(info.param.n) + "_kv" + std::to_string(info.param.kv_heads) +
             "_qpkv" + std::to_string(info.param.q_per_kv) + "_dh" + std::to_string(info.param.dh);
    });

// ---------------------------------------------------------------------------------------------
// transpose: dst[c * rows + r] == src[r * cols + c] (the CPU entry works in 32 x 32 blocks, so
// shapes straddle block edges).

struct MatShape {
  int64_t rows, cols;
};

class TransposeTest : public ::testing::TestWithParam<MatShape> {};

TEST_P(TransposeTest, MatchesTheIndexFormulaBitForBit) {
  const MatShape s = GetParam();
  const size_t size = static_cast<size_t>(s.rows * s.cols);
  const std::vector<float> src = RandomBits(size, 41);
  std::vector<float> dst = Guarded(size);
  const absl::Status st = Ops().transpose(dst.data(), src.data(), s.rows, s.cols, Stream{});
  ASSERT_TRUE(st.ok()) << st;
  int mismatches = 0;
  for (int64_t r = 0; r < s.rows; ++r) {
    for (int64_t c = 0; c < s.cols; ++c) {
      const float got = dst[c * s.rows + r];
      const float want = src[r * s.cols + c];
      if (Bits(got) != Bits(want) && ++mismatches <= 5) {
        ADD_FAILURE() << "dst[" << c << ", " << r << "]: 0x" << std::hex << Bits(got) << " != src["
                      << std::dec << r << ", " << c << "] 0x" << std::hex << Bits(want);
      }
    }
  }
  EXPECT_EQ(mismatches, 0);
  EXPECT_TRUE(GuardIntact(dst, size));  // for 0 x N and N x 0: nothing written at all
}

TEST_P(TransposeTest, TwiceIsTheIdentity) {
  const MatShape s = GetParam();
  const size_t size = static_cast<size_t>(s.rows * s.cols);
  const std::vector<float> src = RandomBits(size, 42);
  std::vector<float> t = Guarded(size), back = Guarded(size);
  ASSERT_TRUE(Ops().transpose(t.data(), src.data(), s.rows, s.cols, Stream{}).ok());
  ASSERT_TRUE(Ops().transpose(back.data(), t.data(), s.cols, s.rows, Stream{}).ok());
  EXPECT_TRUE(SameBits(back.data(), src.data(), size));
}

TEST_P(TransposeTest, BytesMatchTheIndexFormula) {
  const MatShape s = GetParam();
  const size_t size = static_cast<size_t>(s.rows * s.cols);
  std::vector<uint8_t> src(size);
  for (size_t i = 0; i < size; ++i) src[i] = static_cast<uint8_t>(i * 37 + 11);
  std::vector<uint8_t> dst(size + 16, 0xEE);  // 16 guard bytes
  const absl::Status st = Ops().transpose_bytes(dst.data(), src.data(), s.rows, s.cols, Stream{});
  ASSERT_TRUE(st.ok()) << st;
  for (int64_t r = 0; r < s.rows; ++r) {
    for (int64_t c = 0; c < s.cols; ++c) {
      ASSERT_EQ(dst[static_cast<size_t>(c * s.rows + r)], src[static_cast<size_t>(r * s.cols + c)])
          << "dst[" << c << ", " << r << "]";
    }
  }
  for (size_t i = size; i < dst.size(); ++i) EXPECT_EQ(dst[i], 0xEE) << "guard byte " << i - size;
}

INSTANTIATE_TEST_SUITE_P(Shapes, TransposeTest,
                         ::testing::Values(MatShape{96, 80}, MatShape{130, 67}, MatShape{33, 47},
                                           MatShape{1, 50}, MatShape{50, 1}, MatShape{1, 1}, MatShape{31, 65}, MatShape{64, 32},
                                           MatShape{97, 3}, MatShape{0, 7}, MatShape{7, 0},
                                           MatShape{0, 0}),
                         [](const auto& info) {
                           return std::to_string(info.param.rows) + "x" +
                                  std::to_string(info.param.cols);
                         });

// ---------------------------------------------------------------------------------------------
// fill and copy

// The vectorised activations run in fixed chunks on the OpenMP team, a vector at a time with a
// padded last vector: an element's result must not depend on where it falls (in a vector's body
// or the tail, in which chunk, so on which thread). The same values, shifted by one element over
// three chunks and a partial one, give the same bits; large and non-finite inputs behave as the
// scalar references do (forward and backward: saturation, -0, Inf and NaN where they give them).
TEST(ActivationsTest, ResultsDoNotDependOnPositionAndMatchTheReferences) {
  constexpr int64_t kN = 3 * 16384 + 37;
  std::vector<float> x = RandomFloats(kN + 1, 131, -6.0f, 6.0f);
  std::vector<float> up = RandomFloats(kN + 1, 132, -2.0f, 2.0f);
  const float inf = std::numeric_limits<float>::infinity();
  const std::vector<float> specials = {100.0f, -100.0f, std::numeric_limits<float>::quiet_NaN(),
                                       inf, -inf, 1e30f, -1e30f, -88.5f, 88.5f, -1e-40f};
  std::copy(specials.begin(), specials.end(), x.begin() + 5);
  x[kN - 1] = -95.0f;
  const std::vector<float> dout = RandomFloats(kN, 133, -1.0f, 1.0f);
  const Stream s{};
  for (const char* op : {"gelu", "swiglu"}) {
    SCOPED_TRACE(op);
    std::vector<float> a(kN + 1, 0.0f), b(kN + 1, 0.0f), want(kN, 0.0f);
    const bool gelu = std::string(op) == "gelu";
    auto run = [&](float* out, const float* in, const float* u, int64_t n) {
      return gelu ? Ops().gelu_forward(out, in, n, s) : Ops().swiglu_forward(out, in, u, n, s);
    };
    ASSERT_TRUE(run(a.data(), x.data(), up.data(), kN).ok());
    // x[i] lands at index i + 1: other lanes, other chunk boundaries, another tail.
    std::vector<float> xs(kN + 1), us(kN + 1);
    xs[0] = 0.5f;
    us[0] = 0.5f;
    std::copy(x.begin(), x.begin() + kN, xs.begin() + 1);
    std::copy(up.begin(), up.begin() + kN, us.begin() + 1);
    ASSERT_TRUE(run(b.data(), xs.data(), us.data(), kN + 1).ok());
    EXPECT_TRUE(SameBits(b.data() + 1, a.data(), kN));
    if (gelu) {
      GeluForward(want, std::span<const float>(x.data(), kN), kN);
    } else {
      SwigluForward(want, std::span<const float>(x.data(), kN),
                    std::span<const float>(up.data(), kN), kN);
    }
    EXPECT_TRUE(std::isnan(a[7])) << a[7];
    EXPECT_TRUE(CloseToReference(a.data(), want.data(), kN));
    // The backwards, accumulating onto the same pre-filled gradients.
    std::vector<float> g1(kN, 0.25f), g2(kN, -0.5f), w1 = g1, w2 = g2;
    const std::span<const float> xs_span(x.data(), kN), up_span(up.data(), kN);
    if (gelu) {
      ASSERT_TRUE(Ops().gelu_backward(g1.data(), dout.data(), x.data(), kN, s).ok());
      GeluBackward(w1, dout, xs_span, kN);
    } else {
      ASSERT_TRUE(
          Ops().swiglu_backward(g1.data(), g2.data(), dout.data(), x.data(), up.data(), kN, s)
              .ok());
      SwigluBackward(w1, w2, dout, xs_span, up_span, kN);
    }
    // The two tanh (exp) approximations part by up to 8 ulps, dth <= 2^-20, which the gradient
    // carries through 1 - tanh^2 (its cancellation near saturation) times 0.5 |x du|, and
    // 0.5 dth directly (as tests/gpu/layer_ops_cuda_test.cc bounds it); for SwiGLU the sigmoid
    // moves by <= 10u relatively, the gradients by that through s (1 + g (1 - s)) and g s.
    constexpr double kU = 0x1p-24;
    std::vector<double> extra(kN, 0.0);
    for (int64_t i = 0; i < kN; ++i) {
      const double xi = x[i], d = std::fabs(double{dout[i]});
      if (!std::isfinite(xi)) continue;
      if (gelu) {
        const double k = std::sqrt(2.0 / 3.14159265358979323846);
        const double th = std::tanh(k * (xi + 0.044715 * xi * xi * xi));
        const double du = k * (1.0 + 3.0 * 0.044715 * xi * xi);
        extra[i] = d * 0x1p-20 * (0.5 + std::fabs(xi * th * du));
      } else {
        extra[i] = d * 32.0 * kU * (1.0 + std::fabs(xi)) * (1.0 + std::fabs(double{up[i]}));
      }
    }
    EXPECT_TRUE(CloseToReference(g1.data(), w1.data(), kN, &extra));
    EXPECT_TRUE(CloseToReference(g2.data(), w2.data(), kN, &extra));
  }
}

TEST(FillCopyTest, FillWritesTheExactBitPattern) {
  // -0.0f must stay negative (not a memset to 0); NaNs keep sign and payload on the host.
  const uint32_t patterns[] = {
      0x00000000u,  // +0
      0x80000000u,  // -0
      0x3fc00000u,  // 1.5
      0x7f800000u,  // +Inf
      0xff800000u,  // -Inf
      0x00000001u,  // smallest denormal
      0x7fc00000u,  // the canonical quiet NaN
      0x7fc12345u,  // quiet NaN with a payload
      0xffc00001u,  // negative quiet NaN with a payload
  };
  for (const uint32_t bits : patterns) {
    for (const int64_t n : {int64_t{0}, int64_t{1}, int64_t{37}}) {
      SCOPED_TRACE(::testing::Message()
                   << "value 0x" << std::hex << bits << std::dec << " n " << n);
      std::vector<float> x = Guarded(static_cast<size_t>(n));
      const absl::Status st = Ops().fill(x.data(), FromBits(bits), n, Stream{});
      ASSERT_TRUE(st.ok()) << st;
      for (int64_t i = 0; i < n; ++i) {
        ASSERT_EQ(Bits(x[i]), bits) << "element " << i;
      }
      EXPECT_TRUE(GuardIntact(x, static_cast<size_t>(n)));
    }
  }
}

TEST(FillCopyTest, CopyIsBitForBitAndStopsAtN) {
  for (const int64_t n : {int64_t{0}, int64_t{1}, int64_t{7}, int64_t{1000}}) {
    SCOPED_TRACE(::testing::Message() << "n " << n);
    // Source longer than n: elements past n must not be copied.
    const std::vector<float> src = RandomBits(static_cast<size_t>(n) + kGuard, 51);
    const std::vector<float> src_before = src;
    std::vector<float> dst = Guarded(static_cast<size_t>(n));
    const absl::Status st = Ops().copy(dst.data(), src.data(), n, Stream{});
    ASSERT_TRUE(st.ok()) << st;
    EXPECT_TRUE(SameBits(dst.data(), src.data(), static_cast<size_t>(n)));
    EXPECT_TRUE(GuardIntact(dst, static_cast<size_t>(n)));
    EXPECT_TRUE(SameBits(src.data(), src_before.data(), src.size())) << "copy wrote its source";
  }
}

// ---------------------------------------------------------------------------------------------
// cross_entropy_forward: losses[i] = logsumexp(logits[i, :]) - logits[i, target[i]] (FP32),
// probs = softmax per row.

struct CeCase {
  int64_t n, v;
  std::vector<float> logits;
  std::vector<int32_t> targets;
};

CeCase MakeCeCase() {
  CeCase c{9, 37, RandomFloats(9 * 37, 61, -4.0f, 4.0f), {}};
  c.targets = {0, 36, 5, 17, 1, 35, 20, 8, 12};  // both ends of [0, V) included
  for (int64_t j = 0; j < c.v; ++j) {
    c.logits[2 * c.v + j] += 60.0f;  // large logits: exp without the max would overflow
    c.logits[5 * c.v + j] -= 60.0f;  // very negative ones: exp would underflow
  }
  c.logits[7 * c.v + 3] = 25.0f;  // one dominant logit, the target (8) elsewhere: a large loss
  return c;
}

TEST(CrossEntropyEntryTest, RowLossesMatchDoubleLogSumExp) {
  const CeCase c = MakeCeCase();
  std::vector<float> probs = Guarded(static_cast<size_t>(c.n * c.v));
  std::vector<float> losses = Guarded(static_cast<size_t>(c.n));
  const absl::Status st = Ops().cross_entropy_forward(probs.data(), losses.data(), c.logits.data(),
                                                      c.targets.data(), c.n, c.v, Stream{});
  ASSERT_TRUE(st.ok()) << st;
  EXPECT_TRUE(GuardIntact(losses, static_cast<size_t>(c.n)));
  EXPECT_TRUE(GuardIntact(probs, static_cast<size_t>(c.n * c.v)));
  for (int64_t i = 0; i < c.n; ++i) {
    const float* li = c.logits.data() + i * c.v;
    double m = li[0];
    for (int64_t j = 1; j < c.v; ++j) m = std::max(m, static_cast<double>(li[j]));
    double s = 0.0;
    for (int64_t j = 0; j < c.v; ++j) s += std::exp(li[j] - m);
    const double lse = m + std::log(s);
    const double want = lse - li[c.targets[i]];
    // FP32 error budget, in units of kU: li - max (1 rounding, which exp turns into a relative
    // error weighted by p_j |d_j| <= 1/e), expf (<= 2), the sum of V positive terms (V - 1), so
    // log(sum) is off by <= (V + 4) kU absolutely; then max + log(sum) and - logit[target] round
    // once each, relative to |max| + |lse| and |loss|. 4x that leaves a 2x margin at least.
    const double tol = 4.0 * kU *
                       (static_cast<double>(c.v) + 4.0 + std::abs(m) + std::abs(lse) +
                        std::abs(static_cast<double>(li[c.targets[i]])) + std::abs(want));
    EXPECT_NEAR(losses[i], want, tol) << "row " << i;
    ASSERT_TRUE(std::isfinite(losses[i])) << "row " << i;
    // probs: exp(d_j) / sum with relative error <= (V + 4 + |d_j|) kU; 2x that.
    for (int64_t j = 0; j < c.v; ++j) {
      const double d = li[j] - m;
      const double p = std::exp(d) / s;
      EXPECT_NEAR(probs[i * c.v + j], p,
                  2.0 * kU * (static_cast<double>(c.v) + 4.0 + std::abs(d)) * p)
          << "probs[" << i << ", " << j << "]";
    }
  }
  // A sanity check on the reference itself: the dominant-logit row has a loss of about 25 - l_8.
  EXPECT_GT(losses[7], 20.0f);
}

TEST(CrossEntropyEntryTest, MeanOfRowLossesIsCrossEntropyForward) {
  const CeCase c = MakeCeCase();
  std::vector<float> probs(static_cast<size_t>(c.n * c.v));
  std::vector<float> losses(static_cast<size_t>(c.n));
  ASSERT_TRUE(Ops()
                  .cross_entropy_forward(probs.data(), losses.data(), c.logits.data(),
                                         c.targets.data(), c.n, c.v, Stream{})
                  .ok());
  // The caller's mean: FP32, rows in order, then / N.
  float sum = 0.0f;
  for (const float l : losses) sum += l;
  const float mean = sum / static_cast<float>(c.n);

  // The entry's softmax sums lane-wise (rows_cpu_test.cc bounds that): the reference's mean
  // within 1e-6 relative here.
  std::vector<float> ref_probs(probs.size());
  const float ref = CrossEntropyForward(ref_probs, c.logits, c.targets, c.n, c.v);
  EXPECT_NEAR(mean, ref, 1e-6 * std::fabs(ref)) << mean << " vs " << ref;
  EXPECT_TRUE(NearRelative(probs.data(), ref_probs.data(), probs.size()));
}

TEST(CrossEntropyEntryTest, OneClassGivesZeroLossAndProbabilityOne) {
  const std::vector<float> logits = {3.25f, -100.0f, 0.0f};
  const std::vector<int32_t> targets = {0, 0, 0};
  std::vector<float> probs(3, 0.5f), losses(3, 0.5f);
  ASSERT_TRUE(Ops()
                  .cross_entropy_forward(probs.data(), losses.data(), logits.data(), targets.data(),
                                         3, 1, Stream{})
                  .ok());
  for (int i = 0; i < 3; ++i) {
    EXPECT_EQ(losses[i], 0.0f) << i;  // max + log(1) - max, exact
    EXPECT_EQ(probs[i], 1.0f) << i;
  }
}

// ---------------------------------------------------------------------------------------------
// sum_squares: sum of x[i]^2 in FP64 in index order; non-finite exactly when some x is NaN/Inf.

std::vector<float> WideRangeFloats(size_t n, uint32_t seed) {
  std::mt19937 rng(seed);
  std::uniform_real_distribution<float> mant(1.0f, 2.0f);
  std::uniform_int_distribution<int> expo(-30, 30);
  std::vector<float> out(n);
  for (float& x : out) x = std::ldexp(mant(rng), expo(rng)) * (rng() % 2 ? -1.0f : 1.0f);
  return out;
}

TEST(SumSquaresTest, EqualsTheInOrderFp64SumBitForBit) {
  for (const size_t count : {size_t{1}, size_t{2}, size_t{17}, size_t{1001}}) {
    SCOPED_TRACE(::testing::Message() << "count " << count);
    const std::vector<float> x = WideRangeFloats(count, 71 + static_cast<uint32_t>(count));
    double want = 0.0;
    for (const float xi : x) want += static_cast<double>(xi) * static_cast<double>(xi);
    double got = std::numeric_limits<double>::quiet_NaN();
    const absl::Status st =
        Ops().sum_squares(x.data(), static_cast<int64_t>(count), &got, Stream{});
    ASSERT_TRUE(st.ok()) << st;
    EXPECT_EQ(std::bit_cast<uint64_t>(got), std::bit_cast<uint64_t>(want)) << got << " vs " << want;
    // And within the contract's bound of the exact sum (long double, 64-bit significand, as the
    // near-exact value): (count - 1) 2^-53 relative.
    long double exact = 0.0L;
    for (const float xi : x) exact += static_cast<long double>(xi) * xi;
    EXPECT_LE(std::abs(static_cast<long double>(got) - exact),
              static_cast<long double>(count - 1) * 0x1p-53L * exact + 0x1p-60L * exact);
  }
}

TEST(SumSquaresTest, ZeroCountGivesZero) {
  const float x = 3.0f;
  double got = std::numeric_limits<double>::quiet_NaN();
  ASSERT_TRUE(Ops().sum_squares(&x, 0, &got, Stream{}).ok());
  EXPECT_EQ(std::bit_cast<uint64_t>(got), 0u) << got;
}

TEST(SumSquaresTest, NonFiniteExactlyWhenAnInputIs) {
  const float inf = std::numeric_limits<float>::infinity();
  const float nan = std::numeric_limits<float>::quiet_NaN();
  const float big = std::numeric_limits<float>::max();
  struct Case {
    std::vector<float> x;
    bool finite;
  } cases[] = {
      {{1.0f, nan, 2.0f}, false},
      {{1.0f, 2.0f, inf}, false},
      {{-inf, 1.0f}, false},
      {{nan, inf}, false},
      // FLT_MAX^2 ~ 1.2e77 overflows FP32 but not FP64: a float accumulator would report Inf.
      {std::vector<float>(1000, big), true},
      {std::vector<float>(3, -big), true},
  };
  for (const Case& c : cases) {
    double got = 0.0;
    ASSERT_TRUE(
        Ops().sum_squares(c.x.data(), static_cast<int64_t>(c.x.size()), &got, Stream{}).ok());
    EXPECT_EQ(std::isfinite(got), c.finite) << "first value " << c.x[0] << ", got " << got;
  }
}

// ---------------------------------------------------------------------------------------------
// adamw

struct AdamWHyper {
  double lr, weight_decay, clip_scale, beta1, beta2, eps;
  int step;
};

// The per-step scalars as the optimizer makes them: FP64 on the host, rounded once to FP32.
AdamWArgs MakeAdamWArgs(const AdamWHyper& h, int64_t count) {
  AdamWArgs a;
  a.count = count;
  a.lr = static_cast<float>(h.lr);
  a.decay = static_cast<float>(h.lr * h.weight_decay);
  a.clip_scale = static_cast<float>(h.clip_scale);
  a.beta1 = static_cast<float>(h.beta1);
  a.one_minus_beta1 = static_cast<float>(1.0 - h.beta1);
  a.beta2 = static_cast<float>(h.beta2);
  a.one_minus_beta2 = static_cast<float>(1.0 - h.beta2);
  a.bias1 = static_cast<float>(1.0 - std::pow(h.beta1, h.step));
  a.bias2 = static_cast<float>(1.0 - std::pow(h.beta2, h.step));
  a.eps = static_cast<float>(h.eps);
  return a;
}

struct AdamWState {
  std::vector<float> master, grad, m, v;
};

AdamWState MakeAdamWState(size_t count, uint32_t seed) {
  AdamWState s{RandomFloats(count, seed, -2.0f, 2.0f), RandomFloats(count, seed + 1, -1.0f, 1.0f),
               RandomFloats(count, seed + 2, -0.1f, 0.1f),
               RandomFloats(count, seed + 3, 0.0f, 0.01f)};
  for (size_t i = 0; i < count; i += 7) s.grad[i] *= 1e-3f;  // small gradients too
  s.grad[1] = 0.0f;                                          // a zero gradient
  s.m[2] = 0.0f;                                             // fresh moments
  s.v[2] = 0.0f;
  return s;
}

AdamWArgs Bind(AdamWArgs a, AdamWState& s) {
  a.master = s.master.data();
  a.grad = s.grad.data();
  a.m = s.m.data();
  a.v = s.v.data();
  return a;
}

const AdamWHyper kAdamWCases[] = {
    // typical: decay on, clipping, tiny eps
    {1e-3, 0.1, 0.8, 0.9, 0.95, 1e-8, 5},
    // no decay (a shard without it), a large eps (sqrt(v_hat) + eps vs sqrt(v_hat + eps) differ)
    {3e-3, 0.0, 0.5, 0.8, 0.999, 1e-3, 2},
    // first step: bias corrections 1 - beta
    {1e-2, 0.01, 1.0, 0.9, 0.999, 1e-8, 1},
};

TEST(AdamWEntryTest, EqualsAdamWUpdateBitForBit) {
  constexpr size_t kCount = 257;
  for (const AdamWHyper& h : kAdamWCases) {
    SCOPED_TRACE(::testing::Message() << "lr " << h.lr << " eps " << h.eps << " step " << h.step);
    AdamWState got = MakeAdamWState(kCount, 81);
    AdamWState want = got;
    const absl::Status st = Ops().adamw(Bind(MakeAdamWArgs(h, kCount), got), Stream{});
    ASSERT_TRUE(st.ok()) << st;
    ASSERT_TRUE(AdamWUpdate(Bind(MakeAdamWArgs(h, kCount), want)).ok());
    EXPECT_TRUE(SameBits(got.master.data(), want.master.data(), kCount)) << "master";
    EXPECT_TRUE(SameBits(got.m.data(), want.m.data(), kCount)) << "m";
    EXPECT_TRUE(SameBits(got.v.data(), want.v.data(), kCount)) << "v";
    EXPECT_TRUE(SameBits(got.grad.data(), want.grad.data(), kCount)) << "grad was written";
  }
}

TEST(AdamWEntryTest, MatchesTheFormulaInDouble) {
  constexpr size_t kCount = 257;
  for (const AdamWHyper& h : kAdamWCases) {
    SCOPED_TRACE(::testing::Message() << "lr " << h.lr << " eps " << h.eps << " step " << h.step);
    const AdamWState before = MakeAdamWState(kCount, 91);
    AdamWState s = before;
    const AdamWArgs a = MakeAdamWArgs(h, kCount);
    ASSERT_TRUE(Ops().adamw(Bind(a, s), Stream{}).ok());
    // The formula of kernels/layer_ops.h with the FP32 scalars the entry got, in double.
    const double lr = a.lr, decay = a.decay, clip = a.clip_scale, b1 = a.beta1,
                 omb1 = a.one_minus_beta1, b2 = a.beta2, omb2 = a.one_minus_beta2, bias1 = a.bias1,
                 bias2 = a.bias2, eps = a.eps;
    double largest_step = 0.0, largest_tol = 0.0;
    for (size_t i = 0; i < kCount; ++i) {
      const double g = before.grad[i] * clip;
      const double p = before.master[i] - decay * before.master[i];
      const double m = b1 * before.m[i] + omb1 * g;
      const double v = b2 * before.v[i] + omb2 * (g * g);
      const double step = lr * (m / bias1) / (std::sqrt(v / bias2) + eps);
      const double master = p - step;
      // FP32 error budget, in kU: m is 4 roundings (g, two products, the sum) of terms of size
      // m_mag = |b1 m| + |omb1 g| (the sum may cancel); v likewise, no cancellation (>= 0);
      // the step adds /bias1, /bias2, sqrt, + eps, lr *, / (about 10 kU of step_mag); p is 2
      // roundings of |master|, the final subtraction 1 of the result. Tolerances are 2x that.
      const double m_mag = std::abs(b1 * before.m[i]) + std::abs(omb1 * g);
      const double step_mag = lr * (m_mag / bias1) / (std::sqrt(v / bias2) + eps);
      EXPECT_NEAR(s.m[i], m, 8.0 * kU * m_mag) << "m[" << i << "]";
      EXPECT_NEAR(s.v[i], v, 8.0 * kU * v) << "v[" << i << "]";
      const double tol = 32.0 * kU * (std::abs(before.master[i]) + step_mag + std::abs(master));
      EXPECT_NEAR(s.master[i], master, tol) << "master[" << i << "]";
      largest_step = std::max(largest_step, std::abs(step));
      largest_tol = std::max(largest_tol, tol);
    }
    // The comparison shows something only if the update is far above the tolerance (a missing
    // bias correction or decay term changes it by a sizeable fraction).
    EXPECT_GT(largest_step, 50.0 * largest_tol);
  }
}

TEST(AdamWEntryTest, ZeroCountTouchesNothing) {
  std::vector<float> master = Guarded(0), grad = Guarded(0), m = Guarded(0), v = Guarded(0);
  AdamWArgs a = MakeAdamWArgs(kAdamWCases[0], 0);
  a.master = master.data();
  a.grad = grad.data();
  a.m = m.data();
  a.v = v.data();
  ASSERT_TRUE(Ops().adamw(a, Stream{}).ok());
  EXPECT_TRUE(AllSentinel(master));
  EXPECT_TRUE(AllSentinel(m));
  EXPECT_TRUE(AllSentinel(v));
}

// ---------------------------------------------------------------------------------------------
// The wrapped layer ops: each entry is its span function, bit for bit (arguments in the right
// places). The span functions themselves are tested against double references in
// layer_ops_test.cc.

TEST(WrapperEntryTest, EntriesEqualTheirSpanFunctionsBitForBit) {
  constexpr int64_t kN = 5, kV = 7, kC = 12, kB = 2, kT = 4, kH = 4, kHkv = 2, kDh = 5;
  const std::vector<int32_t> tokens = {3, 0, 6, 3, 1};
  const std::vector<float> table = RandomFloats(kV * kC, 101, -1.0f, 1.0f);
  const std::vector<float> x = RandomFloats(kN * kC, 102, -2.0f, 2.0f);
  const std::vector<float> w = RandomFloats(kC, 103, 0.5f, 1.5f);
  const std::vector<float> dout = RandomFloats(kN * kC, 104, -1.0f, 1.0f);
  const std::vector<float> y = RandomFloats(kN * kC, 105, -1.0f, 1.0f);
  const size_t kAtt = kB * kT * kH * kDh, kKv = kB * kT * kHkv * kDh, kLse = kB * kH * kT;
  const std::vector<float> q = RandomFloats(kAtt, 106, -1.0f, 1.0f),
                           k = RandomFloats(kKv, 107, -1.0f, 1.0f),
                           v = RandomFloats(kKv, 108, -1.0f, 1.0f),
                           datt = RandomFloats(kAtt, 109, -1.0f, 1.0f);
  const Stream s{};
  {
    SCOPED_TRACE("embedding");
    std::vector<float> got(kN * kC), want(kN * kC);
    ASSERT_TRUE(
        Ops().embedding_forward(got.data(), tokens.data(), table.data(), kN, kV, kC, s).ok());
    EmbeddingForward(want, tokens, table, kN, kV, kC);
    EXPECT_TRUE(SameBits(got.data(), want.data(), got.size()));
    std::vector<float> dgot = RandomFloats(kV * kC, 110, -1.0f, 1.0f), dwant = dgot;
    ASSERT_TRUE(
        Ops().embedding_backward(dgot.data(), dout.data(), tokens.data(), kN, kV, kC, s).ok());
    EmbeddingBackward(dwant, dout, tokens, kN, kV, kC);
    EXPECT_TRUE(SameBits(dgot.data(), dwant.data(), dgot.size()));
  }
  {
    SCOPED_TRACE("rmsnorm");
    std::vector<float> got(kN * kC), want(kN * kC), rgot(kN), rwant(kN);
    ASSERT_TRUE(
        Ops().rmsnorm_forward(got.data(), rgot.data(), x.data(), w.data(), kN, kC, 1e-5f, s).ok());
    RmsNormForward(want, rwant, x, w, kN, kC, 1e-5f);
    EXPECT_TRUE(NearRelative(got.data(), want.data(), got.size()));
    EXPECT_TRUE(NearRelative(rgot.data(), rwant.data(), rgot.size()));
    std::vector<float> dxg = RandomFloats(kN * kC, 111, -1.0f, 1.0f), dxw = dxg;
    std::vector<float> dwg = RandomFloats(kC, 112, -1.0f, 1.0f), dww = dwg;
    ASSERT_TRUE(Ops()
                    .rmsnorm_backward(dxg.data(), dwg.data(), dout.data(), x.data(), w.data(),
                                      rwant.data(), kN, kC, s)
                    .ok());
    RmsNormBackward(dxw, dww, dout, x, w, rwant, kN, kC);
    EXPECT_TRUE(NearRelative(dxg.data(), dxw.data(), dxg.size()));
    EXPECT_TRUE(SameBits(dwg.data(), dww.data(), dwg.size()));
  }
  {
    SCOPED_TRACE("attention (grouped-query)");
    // The entry tiles the sums (flash attention), the reference runs them in key order: within a
    // few FP32 roundings of each tensor's largest magnitude (rows_cpu_test bounds both against
    // exact values per element).
    std::vector<float> got(kAtt), want(kAtt), lgot(kLse), lwant(kLse);
    ASSERT_TRUE(Ops()
                    .attention_forward(got.data(), lgot.data(), q.data(), k.data(), v.data(), kB,
                                       kT, kH, kHkv, kDh, s)
                    .ok());
    AttentionForward(want, lwant, q, k, v, kB, kT, kH, kHkv, kDh);
    EXPECT_TRUE(NearScaled(got, want)) << "out";
    EXPECT_TRUE(NearScaled(lgot, lwant)) << "lse";
    std::vector<float> dqg = RandomFloats(kAtt, 113, -1.0f, 1.0f), dqw = dqg;
    std::vector<float> dkg = RandomFloats(kKv, 114, -1.0f, 1.0f), dkw = dkg;
    std::vector<float> dvg = RandomFloats(kKv, 115, -1.0f, 1.0f), dvw = dvg;
    ASSERT_TRUE(Ops()
                    .attention_backward(dqg.data(), dkg.data(), dvg.data(), datt.data(), q.data(),
                                        k.data(), v.data(), want.data(), lwant.data(), kB, kT, kH,
                                        kHkv, kDh, s)
                    .ok());
    AttentionBackward(dqw, dkw, dvw, datt, q, k, v, want, lwant, kB, kT, kH, kHkv, kDh);
    EXPECT_TRUE(NearScaled(dqg, dqw)) << "dq";
    EXPECT_TRUE(NearScaled(dkg, dkw)) << "dk";
    EXPECT_TRUE(NearScaled(dvg, dvw)) << "dv";
  }
  {
    SCOPED_TRACE("layernorm");
    const std::vector<float> b = RandomFloats(kC, 120, -0.5f, 0.5f);
    std::vector<float> got(kN * kC), want(kN * kC), mgot(kN), mwant(kN), rgot(kN), rwant(kN);
    ASSERT_TRUE(Ops()
                    .layernorm_forward(got.data(), mgot.data(), rgot.data(), x.data(), w.data(),
                                       b.data(), kN, kC, 1e-5f, s)
                    .ok());
    LayerNormForward(want, mwant, rwant, x, w, b, kN, kC, 1e-5f);
    EXPECT_TRUE(NearRelative(got.data(), want.data(), got.size()));
    EXPECT_TRUE(NearRelative(mgot.data(), mwant.data(), mgot.size()));
    EXPECT_TRUE(NearRelative(rgot.data(), rwant.data(), rgot.size()));
    std::vector<float> dxg = RandomFloats(kN * kC, 121, -1.0f, 1.0f), dxw = dxg;
    std::vector<float> dwg = RandomFloats(kC, 122, -1.0f, 1.0f), dww = dwg;
    std::vector<float> dbg = RandomFloats(kC, 123, -1.0f, 1.0f), dbw = dbg;
    ASSERT_TRUE(Ops()
                    .layernorm_backward(dxg.data(), dwg.data(), dbg.data(), dout.data(), x.data(),
                                        w.data(), mwant.data(), rwant.data(), kN, kC, s)
                    .ok());
    LayerNormBackward(dxw, dww, dbw, dout, x, w, mwant, rwant, kN, kC);
    EXPECT_TRUE(NearRelative(dxg.data(), dxw.data(), dxg.size()));
    EXPECT_TRUE(SameBits(dwg.data(), dww.data(), dwg.size()));
    EXPECT_TRUE(SameBits(dbg.data(), dbw.data(), dbg.size()));
  }
  {
    SCOPED_TRACE("bias");
    std::vector<float> got = x, want = x;
    ASSERT_TRUE(Ops().bias_forward(got.data(), w.data(), kN, kC, s).ok());
    BiasForward(want, w, kN, kC);
    EXPECT_TRUE(SameBits(got.data(), want.data(), got.size()));
    std::vector<float> dg = RandomFloats(kC, 124, -1.0f, 1.0f), dw = dg;
    ASSERT_TRUE(Ops().bias_backward(dg.data(), dout.data(), kN, kC, s).ok());
    BiasBackward(dw, dout, kN, kC);
    EXPECT_TRUE(SameBits(dg.data(), dw.data(), dg.size()));
  }
  {
    SCOPED_TRACE("rope");
    // x as [kN, 3, 4]: rows at positions 0, 1, 0, 1, 0 (t = 2).
    constexpr int64_t kRh = 3, kRdh = 4, kRt = 2;
    std::vector<float> got(kN * kC), want(kN * kC);
    ASSERT_TRUE(Ops().rope_forward(got.data(), x.data(), kN, kRt, kRh, kRdh, 10000.0f, s).ok());
    RopeForward(want, x, kN, kRt, kRh, kRdh, 10000.0f);
    EXPECT_TRUE(SameBits(got.data(), want.data(), got.size()));
    std::vector<float> dg = RandomFloats(kN * kC, 125, -1.0f, 1.0f), dw = dg;
    ASSERT_TRUE(Ops().rope_backward(dg.data(), dout.data(), kN, kRt, kRh, kRdh, 10000.0f, s).ok());
    RopeBackward(dw, dout, kN, kRt, kRh, kRdh, 10000.0f);
    EXPECT_TRUE(SameBits(dg.data(), dw.data(), dg.size()));
  }
  {
    SCOPED_TRACE("swiglu");
    const int64_t n = kN * kC;
    std::vector<float> got(n), want(n);
    ASSERT_TRUE(Ops().swiglu_forward(got.data(), x.data(), y.data(), n, s).ok());
    SwigluForward(want, x, y, n);
    EXPECT_TRUE(CloseToReference(got.data(), want.data(), got.size()));
    std::vector<float> dgg = RandomFloats(n, 126, -1.0f, 1.0f), dgw = dgg;
    std::vector<float> dug = RandomFloats(n, 127, -1.0f, 1.0f), duw = dug;
    ASSERT_TRUE(
        Ops().swiglu_backward(dgg.data(), dug.data(), dout.data(), x.data(), y.data(), n, s).ok());
    SwigluBackward(dgw, duw, dout, x, y, n);
    EXPECT_TRUE(CloseToReference(dgg.data(), dgw.data(), dgg.size()));
    EXPECT_TRUE(CloseToReference(dug.data(), duw.data(), dug.size()));
  }
  {
    SCOPED_TRACE("gelu and residual");
    const int64_t n = kN * kC;
    std::vector<float> got(n), want(n);
    ASSERT_TRUE(Ops().gelu_forward(got.data(), x.data(), n, s).ok());
    GeluForward(want, x, n);
    EXPECT_TRUE(CloseToReference(got.data(), want.data(), got.size()));
    std::vector<float> dg = RandomFloats(n, 116, -1.0f, 1.0f), dw = dg;
    ASSERT_TRUE(Ops().gelu_backward(dg.data(), dout.data(), x.data(), n, s).ok());
    GeluBackward(dw, dout, x, n);
    EXPECT_TRUE(CloseToReference(dg.data(), dw.data(), dg.size()));
    ASSERT_TRUE(Ops().residual_forward(got.data(), x.data(), y.data(), n, s).ok());
    ResidualForward(want, x, y, n);
    EXPECT_TRUE(SameBits(got.data(), want.data(), got.size()));
    std::vector<float> dag = RandomFloats(n, 117, -1.0f, 1.0f), daw = dag;
    std::vector<float> dbg = RandomFloats(n, 118, -1.0f, 1.0f), dbw = dbg;
    ASSERT_TRUE(Ops().residual_backward(dag.data(), dbg.data(), dout.data(), n, s).ok());
    ResidualBackward(daw, dbw, dout, n);
    EXPECT_TRUE(SameBits(dag.data(), daw.data(), dag.size()));
    EXPECT_TRUE(SameBits(dbg.data(), dbw.data(), dbg.size()));
  }
  {
    SCOPED_TRACE("cross_entropy_backward");
    const CeCase c = MakeCeCase();
    std::vector<float> probs(c.n * c.v);
    CrossEntropyForward(probs, c.logits, c.targets, c.n, c.v);
    std::vector<float> dg = RandomFloats(c.n * c.v, 119, -1.0f, 1.0f), dw = dg;
    ASSERT_TRUE(
        Ops()
            .cross_entropy_backward(dg.data(), probs.data(), c.targets.data(), c.n, c.v, 0.25f, s)
            .ok());
    CrossEntropyBackward(dw, probs, c.targets, c.n, c.v, 0.25f);
    EXPECT_TRUE(SameBits(dg.data(), dw.data(), dg.size()));
  }
}

// ---------------------------------------------------------------------------------------------
// Argument errors. Every entry checks its sizes before anything runs: a negative size is
// InvalidArgument naming the entry and the argument, and no buffer is touched.

// The words of a message (letters, digits and '_'), so "n" matches the argument n and not the
// n of "embedding_forward".
std::vector<std::string> Words(const std::string& s) {
  std::vector<std::string> out;
  std::string cur;
  for (const char ch : s) {
    if (std::isalnum(static_cast<unsigned char>(ch)) || ch == '_') {
      cur += ch;
    } else if (!cur.empty()) {
      out.push_back(std::move(cur));
      cur.clear();
    }
  }
  if (!cur.empty()) out.push_back(cur);
  return out;
}

::testing::AssertionResult IsInvalidArgumentNaming(const absl::Status& st, const std::string& entry,
                                                   const std::string& arg) {
  if (st.code() != absl::StatusCode::kInvalidArgument) {
    return ::testing::AssertionFailure() << "status " << st << ", want InvalidArgument";
  }
  const std::vector<std::string> words = Words(std::string(st.message()));
  const bool has_entry = std::find(words.begin(), words.end(), entry) != words.end();
  const bool has_arg = std::find(words.begin(), words.end(), arg) != words.end();
  if (!has_entry || !has_arg) {
    return ::testing::AssertionFailure() << "message \"" << st.message() << "\" does not name "
                                         << (has_entry ? "" : "the entry " + entry + " ")
                                         << (has_arg ? "" : "the argument " + arg);
  }
  return ::testing::AssertionSuccess();
}

// Buffers for calls with sizes of at most 2 (largest need: n * kv_heads * (q_per_kv + 2) * dh =
// 32 floats),
// all sentinel, so a call that should touch nothing can be checked.
class ArgumentErrorTest : public ::testing::Test {
 protected:
  static constexpr size_t kBuf = 256;
  static constexpr int kBuffers = 9;
  void SetUp() override { Reset(); }
  void Reset() {
    for (auto& b : f_) b.assign(kBuf, FromBits(kSentinelBits));
    ids_.assign(kBuf, 0);  // token / target 0: valid for any v >= 1
    d_ = -1.0;
  }
  ::testing::AssertionResult Untouched() const {
    for (int i = 0; i < kBuffers; ++i) {
      ::testing::AssertionResult r = AllSentinel(f_[i]);
      if (!r) return r << " in buffer " << i;
    }
    if (d_ != -1.0) return ::testing::AssertionFailure() << "the double output was written";
    return ::testing::AssertionSuccess();
  }
  float* F(int i) { return f_[i].data(); }
  const int32_t* Ids() const { return ids_.data(); }

  // One entry: its name, its size arguments, and a call with given sizes.
  struct Entry {
    std::string name;
    std::vector<std::string> args;
    std::function<absl::Status(const std::vector<int64_t>&)> call;
  };
  std::vector<Entry> Entries() {
    const Stream s{};
    return {
        {"embedding_forward",
         {"n", "v", "c"},
         [&, s](const auto& z) {
           return Ops().embedding_forward(F(0), Ids(), F(1), z[0], z[1], z[2], s);
         }},
        {"embedding_backward",
         {"n", "v", "c"},
         [&, s](const auto& z) {
           return Ops().embedding_backward(F(0), F(1), Ids(), z[0], z[1], z[2], s);
         }},
        {"rmsnorm_forward",
         {"n", "c"},
         [&, s](const auto& z) {
           return Ops().rmsnorm_forward(F(0), F(1), F(2), F(3), z[0], z[1], 1e-5f, s);
         }},
        {"rmsnorm_backward",
         {"n", "c"},
         [&, s](const auto& z) {
           return Ops().rmsnorm_backward(F(0), F(1), F(2), F(3), F(4), F(5), z[0], z[1], s);
         }},
        {"attention_forward",
         {"b", "t", "h", "hkv", "dh"},
         [&, s](const auto& z) {
           return Ops().attention_forward(F(0), F(1), F(2), F(3), F(4), z[0], z[1], z[2], z[3],
                                          z[4], s);
         }},
        {"attention_backward",
         {"b", "t", "h", "hkv", "dh"},
         [&, s](const auto& z) {
           return Ops().attention_backward(F(0), F(1), F(2), F(3), F(4), F(5), F(6), F(7), F(8), z[0],
                                           z[1], z[2], z[3], z[4], s);
         }},
        {"layernorm_forward",
         {"n", "c"},
         [&, s](const auto& z) {
           return Ops().layernorm_forward(F(0), F(1), F(2), F(3), F(4), F(5), z[0], z[1], 1e-5f, s);
         }},
        {"layernorm_backward",
         {"n", "c"},
         [&, s](const auto& z) {
           return Ops().layernorm_backward(F(0), F(1), F(2), F(3), F(4), F(5), F(6), F(7), z[0],
                                           z[1], s);
         }},
        {"bias_forward",
         {"n", "c"},
         [&, s](const auto& z) { return Ops().bias_forward(F(0), F(1), z[0], z[1], s); }},
        {"bias_backward",
         {"n", "c"},
         [&, s](const auto& z) { return Ops().bias_backward(F(0), F(1), z[0], z[1], s); }},
        {"rope_forward",
         {"n", "t", "h", "dh"},
         [&, s](const auto& z) {
           return Ops().rope_forward(F(0), F(1), z[0], z[1], z[2], z[3], 10000.0f, s);
         }},
        {"rope_backward",
         {"n", "t", "h", "dh"},
         [&, s](const auto& z) {
           return Ops().rope_backward(F(0), F(1), z[0], z[1], z[2], z[3], 10000.0f, s);
         }},
        {"swiglu_forward",
         {"n"},
         [&, s](const auto& z) { return Ops().swiglu_forward(F(0), F(1), F(2), z[0], s); }},
        {"swiglu_backward",
         {"n"},
         [&, s](const auto& z) {
           return Ops().swiglu_backward(F(0), F(1), F(2), F(3), F(4), z[0], s);
         }},
        {"gelu_forward",
         {"n"},
         [&, s](const auto& z) { return Ops().gelu_forward(F(0), F(1), z[0], s); }},
        {"gelu_backward",
         {"n"},
         [&, s](const auto& z) { return Ops().gelu_backward(F(0), F(1), F(2), z[0], s); }},
        {"residual_forward",
         {"n"},
         [&, s](const auto& z) { return Ops().residual_forward(F(0), F(1), F(2), z[0], s); }},
        {"residual_backward",
         {"n"},
         [&, s](const auto& z) { return Ops().residual_backward(F(0), F(1), F(2), z[0], s); }},
        {"cross_entropy_forward",
         {"n", "v"},
         [&, s](const auto& z) {
           return Ops().cross_entropy_forward(F(0), F(1), F(2), Ids(), z[0], z[1], s);
         }},
        {"cross_entropy_backward",
         {"n", "v"},
         [&, s](const auto& z) {
           return Ops().cross_entropy_backward(F(0), F(1), Ids(), z[0], z[1], 1.0f, s);
         }},
        {"fill", {"n"}, [&, s](const auto& z) { return Ops().fill(F(0), 1.0f, z[0], s); }},
        {"copy", {"n"}, [&, s](const auto& z) { return Ops().copy(F(0), F(1), z[0], s); }},
        {"transpose",
         {"rows", "cols"},
         [&, s](const auto& z) { return Ops().transpose(F(0), F(1), z[0], z[1], s); }},
        {"transpose_bytes",
         {"rows", "cols"},
         [&, s](const auto& z) {
           return Ops().transpose_bytes(reinterpret_cast<uint8_t*>(F(0)),
                                        reinterpret_cast<const uint8_t*>(F(1)), z[0], z[1], s);
         }},
        {"split_heads",
         {"n", "kv_heads", "q_per_kv", "dh"},
         [&, s](const auto& z) {
           return Ops().split_heads(F(0), F(1), F(2), F(3), z[0], z[1], z[2], z[3], s);
         }},
        {"join_heads",
         {"n", "kv_heads", "q_per_kv", "dh"},
         [&, s](const auto& z) {
           return Ops().join_heads(F(0), F(1), F(2), F(3), z[0], z[1], z[2], z[3], s);
         }},
        {"sum_squares",
         {"count"},
         [&, s](const auto& z) { return Ops().sum_squares(F(0), z[0], &d_, s); }},
        {"adamw",
         {"count"},
         [&, s](const auto& z) {
           AdamWArgs a = MakeAdamWArgs(kAdamWCases[0], z[0]);
           a.master = F(0);
           a.grad = F(1);
           a.m = F(2);
           a.v = F(3);
           return Ops().adamw(a, s);
         }},
    };
  }

  std::vector<float> f_[kBuffers];
  std::vector<int32_t> ids_;
  double d_ = -1.0;
};

TEST_F(ArgumentErrorTest, EveryEntryRefusesEveryNegativeSize) {
  for (const Entry& e : Entries()) {
    for (size_t a = 0; a < e.args.size(); ++a) {
      for (const int64_t bad : {int64_t{-1}, int64_t{-7}, std::numeric_limits<int64_t>::min()}) {
        SCOPED_TRACE(::testing::Message() << e.name << " " << e.args[a] << " = " << bad);
        Reset();
        std::vector<int64_t> sizes(e.args.size(), 2);
        sizes[a] = bad;
        EXPECT_TRUE(IsInvalidArgumentNaming(e.call(sizes), e.name, e.args[a]));
        EXPECT_TRUE(Untouched());
      }
    }
    // The same call with every size 2 is valid, so the negative size alone made it fail.
    SCOPED_TRACE(e.name + " with valid sizes");
    Reset();
    const absl::Status st = e.call(std::vector<int64_t>(e.args.size(), 2));
    EXPECT_TRUE(st.ok()) << st;
  }
}

TEST_F(ArgumentErrorTest, ZeroHeadDimChannelsOrVocabularyWithRowsIsInvalid) {
  const Stream s{};
  const LayerOps& o = Ops();
  EXPECT_TRUE(
      IsInvalidArgumentNaming(o.attention_forward(F(0), F(1), F(2), F(3), F(4), 2, 2, 2, 2, 0, s),
                              "attention_forward", "dh"));
  EXPECT_TRUE(IsInvalidArgumentNaming(
      o.attention_backward(F(0), F(1), F(2), F(3), F(4), F(5), F(6), F(7), F(8), 1, 3, 1, 1, 0, s),
      "attention_backward", "dh"));
  EXPECT_TRUE(IsInvalidArgumentNaming(
      o.layernorm_forward(F(0), F(1), F(2), F(3), F(4), F(5), 2, 0, 1e-5f, s), "layernorm_forward",
      "c"));
  EXPECT_TRUE(IsInvalidArgumentNaming(
      o.layernorm_backward(F(0), F(1), F(2), F(3), F(4), F(5), F(6), F(7), 1, 0, s),
      "layernorm_backward", "c"));
  for (const int64_t dh : {int64_t{0}, int64_t{3}, int64_t{1}}) {
    SCOPED_TRACE(::testing::Message() << "rope dh " << dh);
    EXPECT_TRUE(IsInvalidArgumentNaming(o.rope_forward(F(0), F(1), 2, 2, 1, dh, 1e4f, s),
                                        "rope_forward", "dh"));
    EXPECT_TRUE(IsInvalidArgumentNaming(o.rope_backward(F(0), F(1), 2, 2, 1, dh, 1e4f, s),
                                        "rope_backward", "dh"));
  }
  EXPECT_TRUE(IsInvalidArgumentNaming(o.rope_forward(F(0), F(1), 2, 0, 1, 4, 1e4f, s),
                                      "rope_forward", "t"));
  EXPECT_TRUE(IsInvalidArgumentNaming(o.rope_backward(F(0), F(1), 3, 0, 2, 2, 1e4f, s),
                                      "rope_backward", "t"));
  EXPECT_TRUE(IsInvalidArgumentNaming(o.rope_backward(F(0), F(0), 2, 2, 1, 4, 1e4f, s),
                                      "rope_backward", "dout"));  // dx aliases dout
  EXPECT_TRUE(IsInvalidArgumentNaming(o.rmsnorm_forward(F(0), F(1), F(2), F(3), 2, 0, 1e-5f, s),
                                      "rmsnorm_forward", "c"));
  EXPECT_TRUE(IsInvalidArgumentNaming(
      o.rmsnorm_backward(F(0), F(1), F(2), F(3), F(4), F(5), 1, 0, s), "rmsnorm_backward", "c"));
  EXPECT_TRUE(IsInvalidArgumentNaming(o.cross_entropy_forward(F(0), F(1), F(2), Ids(), 2, 0, s),
                                      "cross_entropy_forward", "v"));
  EXPECT_TRUE(IsInvalidArgumentNaming(o.cross_entropy_backward(F(0), F(1), Ids(), 1, 0, 1.0f, s),
                                      "cross_entropy_backward", "v"));
  EXPECT_TRUE(Untouched());
}

TEST_F(ArgumentErrorTest, KvHeadsThatDoNotDivideTheHeadsAreInvalid) {
  const Stream s{};
  const LayerOps& o = Ops();
  // (h, hkv): not a divisor, more kv heads than heads, no kv heads.
  for (const auto& [h, hkv] : {std::pair<int64_t, int64_t>{3, 2}, {2, 4}, {4, 3}, {2, 0}}) {
    SCOPED_TRACE(::testing::Message() << "h " << h << " hkv " << hkv);
    Reset();
    EXPECT_TRUE(IsInvalidArgumentNaming(
        o.attention_forward(F(0), F(1), F(2), F(3), F(4), 1, 2, h, hkv, 2, s), "attention_forward",
        "hkv"));
    EXPECT_TRUE(IsInvalidArgumentNaming(
        o.attention_backward(F(0), F(1), F(2), F(3), F(4), F(5), F(6), F(7), F(8), 1, 2, h, hkv, 2, s),
        "attention_backward", "hkv"));
    EXPECT_TRUE(Untouched());
  }
}

TEST_F(ArgumentErrorTest, BadEpsOrThetaIsInvalid) {
  const Stream s{};
  const LayerOps& o = Ops();
  const float inf = std::numeric_limits<float>::infinity();
  const float nan = std::numeric_limits<float>::quiet_NaN();
  for (const float eps : {-1e-5f, inf, -inf, nan}) {
    SCOPED_TRACE(::testing::Message() << "eps " << eps);
    EXPECT_TRUE(IsInvalidArgumentNaming(
        o.layernorm_forward(F(0), F(1), F(2), F(3), F(4), F(5), 2, 2, eps, s), "layernorm_forward",
        "eps"));
  }
  for (const float theta : {0.0f, -0.0f, -10000.0f, inf, nan}) {
    SCOPED_TRACE(::testing::Message() << "theta " << theta);
    EXPECT_TRUE(IsInvalidArgumentNaming(o.rope_forward(F(0), F(1), 2, 2, 1, 2, theta, s),
                                        "rope_forward", "theta"));
    EXPECT_TRUE(IsInvalidArgumentNaming(o.rope_backward(F(0), F(1), 2, 2, 1, 2, theta, s),
                                        "rope_backward", "theta"));
  }
  EXPECT_TRUE(Untouched());
  // eps = 0 is allowed (a row that is not constant still normalises).
  EXPECT_TRUE(o.layernorm_forward(F(0), F(1), F(2), F(3), F(4), F(5), 0, 2, 0.0f, s).ok());
}

TEST_F(ArgumentErrorTest, ZeroRowsAreValidAndTouchNothing) {
  const Stream s{};
  const LayerOps& o = Ops();
  struct Call {
    const char* what;
    std::function<absl::Status()> call;
  };
  const std::vector<Call> calls = {
      {"embedding_forward n=0", [&] { return o.embedding_forward(F(0), Ids(), F(1), 0, 3, 4, s); }},
      {"embedding_backward n=0",
       [&] { return o.embedding_backward(F(0), F(1), Ids(), 0, 3, 4, s); }},
      {"rmsnorm_forward n=0",
       [&] { return o.rmsnorm_forward(F(0), F(1), F(2), F(3), 0, 4, 1e-5f, s); }},
      {"rmsnorm_forward n=0 c=0",
       [&] { return o.rmsnorm_forward(F(0), F(1), F(2), F(3), 0, 0, 1e-5f, s); }},
      {"rmsnorm_backward n=0",
       [&] { return o.rmsnorm_backward(F(0), F(1), F(2), F(3), F(4), F(5), 0, 4, s); }},
      {"rmsnorm_backward n=0 c=0",
       [&] { return o.rmsnorm_backward(F(0), F(1), F(2), F(3), F(4), F(5), 0, 0, s); }},
      {"attention_forward b=0",
       [&] { return o.attention_forward(F(0), F(1), F(2), F(3), F(4), 0, 2, 2, 1, 4, s); }},
      {"attention_forward t=0",
       [&] { return o.attention_forward(F(0), F(1), F(2), F(3), F(4), 2, 0, 2, 2, 4, s); }},
      {"attention_forward h=0",
       [&] { return o.attention_forward(F(0), F(1), F(2), F(3), F(4), 2, 2, 0, 1, 4, s); }},
      {"attention_forward b=0 dh=0",
       [&] { return o.attention_forward(F(0), F(1), F(2), F(3), F(4), 0, 2, 2, 2, 0, s); }},
      {"attention_backward b=0",
       [&] {
         return o.attention_backward(F(0), F(1), F(2), F(3), F(4), F(5), F(6), F(7), F(8), 0, 2, 2, 1, 4,
                                     s);
       }},
      {"attention_backward t=0 dh=0",
       [&] {
         return o.attention_backward(F(0), F(1), F(2), F(3), F(4), F(5), F(6), F(7), F(8), 2, 0, 2, 2, 0,
                                     s);
       }},
      {"layernorm_forward n=0 c=0",
       [&] { return o.layernorm_forward(F(0), F(1), F(2), F(3), F(4), F(5), 0, 0, 1e-5f, s); }},
      {"layernorm_backward n=0",
       [&] {
         return o.layernorm_backward(F(0), F(1), F(2), F(3), F(4), F(5), F(6), F(7), 0, 4, s);
       }},
      {"bias_forward n=0", [&] { return o.bias_forward(F(0), F(1), 0, 4, s); }},
      {"bias_forward c=0", [&] { return o.bias_forward(F(0), F(1), 3, 0, s); }},
      {"bias_backward n=0", [&] { return o.bias_backward(F(0), F(1), 0, 4, s); }},
      {"bias_backward c=0", [&] { return o.bias_backward(F(0), F(1), 3, 0, s); }},
      {"rope_forward n=0 t=0 dh=3",
       [&] { return o.rope_forward(F(0), F(1), 0, 0, 2, 3, 1e4f, s); }},
      {"rope_forward h=0", [&] { return o.rope_forward(F(0), F(1), 2, 2, 0, 4, 1e4f, s); }},
      {"rope_backward n=0", [&] { return o.rope_backward(F(0), F(1), 0, 2, 2, 4, 1e4f, s); }},
      {"swiglu_forward n=0", [&] { return o.swiglu_forward(F(0), F(1), F(2), 0, s); }},
      {"swiglu_backward n=0",
       [&] { return o.swiglu_backward(F(0), F(1), F(2), F(3), F(4), 0, s); }},
      {"gelu_forward n=0", [&] { return o.gelu_forward(F(0), F(1), 0, s); }},
      {"gelu_backward n=0", [&] { return o.gelu_backward(F(0), F(1), F(2), 0, s); }},
      {"residual_forward n=0", [&] { return o.residual_forward(F(0), F(1), F(2), 0, s); }},
      {"residual_backward n=0", [&] { return o.residual_backward(F(0), F(1), F(2), 0, s); }},
      {"cross_entropy_forward n=0",
       [&] { return o.cross_entropy_forward(F(0), F(1), F(2), Ids(), 0, 5, s); }},
      {"cross_entropy_forward n=0 v=0",
       [&] { return o.cross_entropy_forward(F(0), F(1), F(2), Ids(), 0, 0, s); }},
      {"cross_entropy_backward n=0",
       [&] { return o.cross_entropy_backward(F(0), F(1), Ids(), 0, 5, 1.0f, s); }},
      {"cross_entropy_backward n=0 v=0",
       [&] { return o.cross_entropy_backward(F(0), F(1), Ids(), 0, 0, 1.0f, s); }},
      {"fill n=0", [&] { return o.fill(F(0), 2.0f, 0, s); }},
      {"copy n=0", [&] { return o.copy(F(0), F(1), 0, s); }},
      {"transpose rows=0", [&] { return o.transpose(F(0), F(1), 0, 5, s); }},
      {"split_heads n=0", [&] { return o.split_heads(F(0), F(1), F(2), F(3), 0, 2, 2, 3, s); }},
      {"split_heads kv_heads=0",
       [&] { return o.split_heads(F(0), F(1), F(2), F(3), 2, 0, 2, 3, s); }},
      {"join_heads n=0", [&] { return o.join_heads(F(0), F(1), F(2), F(3), 0, 2, 2, 3, s); }},
      {"join_heads kv_heads=0",
       [&] { return o.join_heads(F(0), F(1), F(2), F(3), 2, 0, 1, 3, s); }},
      {"adamw count=0",
       [&] {
         AdamWArgs a = MakeAdamWArgs(kAdamWCases[0], 0);
         a.master = F(0);
         a.grad = F(1);
         a.m = F(2);
         a.v = F(3);
         return o.adamw(a, s);
       }},
  };
  for (const Call& c : calls) {
    SCOPED_TRACE(c.what);
    Reset();
    const absl::Status st = c.call();
    EXPECT_TRUE(st.ok()) << st;
    EXPECT_TRUE(Untouched());
  }
}

// ---------------------------------------------------------------------------------------------
// allocate / deallocate and DeviceArray

bool Aligned64(const void* p) { return reinterpret_cast<uintptr_t>(p) % 64 == 0; }

TEST(AllocateTest, GivesWritable64ByteAlignedMemoryForEverySize) {
  for (const size_t bytes : {size_t{0}, size_t{1}, size_t{7}, size_t{63}, size_t{64}, size_t{65},
                             size_t{4096}, size_t{(1 << 20) + 3}}) {
    SCOPED_TRACE(::testing::Message() << bytes << " bytes");
    absl::StatusOr<void*> p = Ops().allocate(bytes);
    ASSERT_TRUE(p.ok()) << p.status();
    ASSERT_NE(*p, nullptr);
    EXPECT_TRUE(Aligned64(*p)) << *p;
    if (bytes > 0) {  // every byte is usable
      std::memset(*p, 0xA5, bytes);
      EXPECT_EQ(static_cast<unsigned char*>(*p)[bytes - 1], 0xA5);
    }
    Ops().deallocate(*p);
  }
  Ops().deallocate(nullptr);  // allowed: does nothing
}

TEST(AllocateTest, ZeroByteAllocationsAreDistinctLivePointers) {
  absl::StatusOr<void*> a = Ops().allocate(0);
  absl::StatusOr<void*> b = Ops().allocate(0);
  ASSERT_TRUE(a.ok() && b.ok());
  EXPECT_NE(*a, nullptr);
  EXPECT_NE(*b, nullptr);
  EXPECT_NE(*a, *b) << "two live allocations share an address";
  Ops().deallocate(*a);
  Ops().deallocate(*b);
}

TEST(AllocateTest, FailureIsResourceExhaustedNamingTheSize) {
  // 2^62 bytes: more than any x86-64 address space, so the allocation fails.
  const size_t bytes = size_t{1} << 62;
  absl::StatusOr<void*> p = Ops().allocate(bytes);
  if (p.ok()) Ops().deallocate(*p);
  ASSERT_EQ(p.status().code(), absl::StatusCode::kResourceExhausted) << p.status();
  EXPECT_THAT(std::string(p.status().message()), HasSubstr(std::to_string(bytes)));
}

// The size is rounded up to a multiple of 64; for bytes > SIZE_MAX - 63 that rounding would wrap
// to a small block, so those sizes must fail instead (a bug this test found).
TEST(AllocateTest, SizesNearSizeMaxFailInsteadOfWrapping) {
  for (const size_t bytes :
       {std::numeric_limits<size_t>::max(), std::numeric_limits<size_t>::max() - 62}) {
    absl::StatusOr<void*> p = Ops().allocate(bytes);
    if (p.ok()) Ops().deallocate(*p);
    EXPECT_EQ(p.status().code(), absl::StatusCode::kResourceExhausted)
        << bytes << " bytes: " << p.status();
  }
}

TEST(DeviceArrayTest, DefaultIsAnEmptyCpuArray) {
  DeviceArray<float> a;
  EXPECT_TRUE(a.empty());
  EXPECT_EQ(a.size(), 0u);
  EXPECT_EQ(a.begin(), a.end());
  EXPECT_EQ(&a.ops(), &CpuOps());
}

TEST(DeviceArrayTest, ConstructAndAssignFillEveryElement) {
  DeviceArray<float> a(CpuOps(), 5, 2.5f);
  ASSERT_EQ(a.size(), 5u);
  EXPECT_FALSE(a.empty());
  EXPECT_TRUE(Aligned64(a.data()));
  EXPECT_EQ(a.end() - a.begin(), 5);
  for (size_t i = 0; i < a.size(); ++i) EXPECT_EQ(a[i], 2.5f) << i;

  for (const size_t count : {size_t{5}, size_t{3}, size_t{100}, size_t{0}}) {
    SCOPED_TRACE(::testing::Message() << "assign " << count);
    a.assign(count, -0.0f);
    ASSERT_EQ(a.size(), count);
    EXPECT_EQ(a.empty(), count == 0);
    for (const float x : a) EXPECT_EQ(Bits(x), 0x80000000u);
  }
}

// Allocates and frees an array of n NaNs right before a resize to n elements. The sizes used are
// above glibc's per-thread cache (1 KiB), so the freed block goes back to the heap and the next
// allocation of that size usually reuses it: a resize that forgot to zero the new elements then
// shows NaNs instead of reading fresh (already zero) pages by luck.
void LeaveDirtyMemory(size_t n) {
  DeviceArray<float> dirty(CpuOps(), n, std::numeric_limits<float>::quiet_NaN());
}

TEST(DeviceArrayTest, ResizeKeepsThePrefixAndZeroesTheRest) {
  constexpr size_t kSmall = 512, kBig = 2048, kBigger = 4000;
  DeviceArray<float> a(CpuOps(), kSmall, 0.0f);
  for (size_t i = 0; i < kSmall; ++i) a[i] = 1.0f + static_cast<float>(i);

  LeaveDirtyMemory(kBig);
  a.resize(kBig);  // grow
  ASSERT_EQ(a.size(), kBig);
  for (size_t i = 0; i < kSmall; ++i) ASSERT_EQ(a[i], 1.0f + static_cast<float>(i)) << i;
  for (size_t i = kSmall; i < kBig; ++i) ASSERT_EQ(Bits(a[i]), 0u) << i;  // T{} is +0.0f
  EXPECT_TRUE(Aligned64(a.data()));

  a.resize(kBig);  // same size: nothing changes
  ASSERT_EQ(a.size(), kBig);
  for (size_t i = 0; i < kSmall; ++i) ASSERT_EQ(a[i], 1.0f + static_cast<float>(i)) << i;

  a.resize(3);  // shrink
  ASSERT_EQ(a.size(), 3u);
  for (size_t i = 0; i < 3; ++i) EXPECT_EQ(a[i], 1.0f + static_cast<float>(i)) << i;

  LeaveDirtyMemory(kBigger);
  a.resize(kBigger);  // grow again: the dropped elements 3.. do not come back
  ASSERT_EQ(a.size(), kBigger);
  for (size_t i = 0; i < 3; ++i) EXPECT_EQ(a[i], 1.0f + static_cast<float>(i)) << i;
  for (size_t i = 3; i < kBigger; ++i) ASSERT_EQ(Bits(a[i]), 0u) << i;

  a.resize(0);
  EXPECT_TRUE(a.empty());
  DeviceArray<float> b;  // from empty
  LeaveDirtyMemory(kBig);
  b.resize(kBig);
  ASSERT_EQ(b.size(), kBig);
  for (const float x : b) ASSERT_EQ(Bits(x), 0u);
}

// A copy of the CPU table whose allocate_device, allocate_host and zero_bytes count their calls
// (the CPU's own entries do the work); the counters start at 0 with each CountingTable.
std::atomic<int> device_allocations{0}, host_allocations{0}, zero_calls{0};
absl::StatusOr<void*> CountingAllocateDevice(size_t bytes) {
  ++device_allocations;
  return CpuOps().layer->allocate_device(bytes);
}
absl::StatusOr<void*> CountingAllocateHost(size_t bytes) {
  ++host_allocations;
  return CpuOps().layer->allocate_host(bytes);
}
absl::Status CountingZeroBytes(void* p, size_t bytes, Stream stream) {
  ++zero_calls;
  return CpuOps().layer->zero_bytes(p, bytes, stream);
}
struct CountingTable {
  CountingTable() : layer(*CpuOps().layer), table(CpuOps()) {
    layer.allocate_device = &CountingAllocateDevice;
    layer.allocate_host = &CountingAllocateHost;
    layer.zero_bytes = &CountingZeroBytes;
    table.layer = &layer;
    device_allocations = 0;
    host_allocations = 0;
    zero_calls = 0;
  }
  CountingTable(const CountingTable&) = delete;
  CountingTable& operator=(const CountingTable&) = delete;
  LayerOps layer;
  OpTable table;
};

// A device-only array (Placement::kDeviceOnly) comes from allocate_device and is cleared by
// zero_bytes. Its host accessors abort, naming the category, on the CPU too.
TEST(DeviceArrayTest, DeviceOnlyArraysAllocateOnTheDeviceAndRefuseHostAccess) {
  CountingTable counting;
  const OpTable& table = counting.table;
  {
    DeviceArray<float> a(table, MemCategory::kScratch, Placement::kDeviceOnly);
    LeaveDirtyMemory(1000);
    a.assign(1000, 0.0f);
    EXPECT_EQ(device_allocations.load(), 1);
    EXPECT_EQ(zero_calls.load(), 1);
    ASSERT_EQ(a.size(), 1000u);
    // The backend's entries use it through data(): the CPU's memory is the host's.
    for (size_t i = 0; i < 1000; ++i) ASSERT_EQ(Bits(a.data()[i]), 0u) << i;
    a.Grow(table, 10);  // large enough: kept, no allocation
    EXPECT_EQ(device_allocations.load(), 1);
    DeviceArray<float> b(std::move(a));  // the placement moves with the memory
    EXPECT_EQ(b.placement(), Placement::kDeviceOnly);
    EXPECT_DEATH(b[0] = 1.0f, "host access to a device-only scratch array");
    EXPECT_DEATH((void)b.begin(), "host access to a device-only");
    EXPECT_DEATH(b.resize(5), "host access to a device-only");
    EXPECT_DEATH(b.assign(3, 1.0f), "non-zero value to a device-only");
  }
  // A host-visible array of the same table never asks for device memory.
  DeviceArray<float> c(table, 8, 1.0f);
  EXPECT_EQ(device_allocations.load(), 1);
  EXPECT_EQ(c[7], 1.0f);
}

// copy_bytes: the bytes, at once on the CPU; null ends refused naming which.
TEST(CopyBytesTest, CopiesTheBytesAndRefusesANullEndNamingIt) {
  const LayerOps& L = *CpuOps().layer;
  const std::vector<uint8_t> src = {1, 2, 3, 4, 5, 6, 7, 8, 9};
  std::vector<uint8_t> dst(9, 0xee);
  ASSERT_TRUE(L.copy_bytes(dst.data(), src.data(), 5, Stream{}).ok());
  EXPECT_EQ(dst, (std::vector<uint8_t>{1, 2, 3, 4, 5, 0xee, 0xee, 0xee, 0xee}));
  EXPECT_TRUE(L.copy_bytes(nullptr, nullptr, 0, Stream{}).ok());  // nothing to copy
  const absl::Status no_dst = L.copy_bytes(nullptr, src.data(), 1, Stream{});
  EXPECT_EQ(no_dst.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(no_dst.message().find("copy_bytes: dst is null"), std::string::npos) << no_dst;
  const absl::Status no_src = L.copy_bytes(dst.data(), nullptr, 1, Stream{});
  EXPECT_NE(no_src.message().find("copy_bytes: src is null"), std::string::npos) << no_src;
}

// HostMirror (kernels/host_mirror.h): the ops use the device side (device-only memory), the host
// the host side (host-read memory), and only Download and Upload bring one to the other.
TEST(HostMirrorTest, EachSideSeesTheOthersWritesOnlyAfterACopy) {
  CountingTable counting;
  const OpTable& table = counting.table;
  const LayerOps& layer = counting.layer;
  HostMirror<float> m;
  m.Reset(table, 3);
  EXPECT_EQ(device_allocations.load(), 1);
  EXPECT_EQ(host_allocations.load(), 1);
  ASSERT_EQ(m.size(), 3u);
  ASSERT_TRUE(layer.fill(m.device(), 2.5f, 3, Stream{}).ok());
  ASSERT_TRUE(m.Download(Stream{}).ok());
  for (size_t i = 0; i < 3; ++i) EXPECT_EQ(m[i], 2.5f) << i;
  // Written again by an op: the host keeps the last copy until the next Download.
  ASSERT_TRUE(layer.fill(m.device(), -7.0f, 3, Stream{}).ok());
  EXPECT_EQ(m[0], 2.5f);
  ASSERT_TRUE(m.Download(Stream{}, 1).ok());  // only the first element
  EXPECT_EQ(m[0], -7.0f);
  EXPECT_EQ(m[1], 2.5f);
  // Host to device: what the host writes reaches the ops only through Upload.
  m[0] = 11.0f;
  m[1] = 12.0f;
  m[2] = 13.0f;
  DeviceArray<float> seen(table, 3, 0.0f);
  ASSERT_TRUE(layer.copy(seen.data(), m.device(), 3, Stream{}).ok());
  EXPECT_EQ(seen[0], -7.0f) << "the device side changed without an Upload";
  ASSERT_TRUE(m.Upload(Stream{}, 2).ok());  // the first two
  ASSERT_TRUE(layer.copy(seen.data(), m.device(), 3, Stream{}).ok());
  EXPECT_EQ(seen[0], 11.0f);
  EXPECT_EQ(seen[1], 12.0f);
  EXPECT_EQ(seen[2], -7.0f);
  // The same backend and size keep both sides; a larger Grow replaces them.
  m.Reset(table, 3);
  EXPECT_EQ(device_allocations.load(), 1);
  m.Grow(table, 4);
  EXPECT_EQ(device_allocations.load(), 2);
  EXPECT_EQ(host_allocations.load(), 2);
  EXPECT_GE(m.size(), 4u);
}

TEST(DeviceArrayTest, MoveTransfersOwnership) {
  DeviceArray<float> a(CpuOps(), 6, 7.0f);
  float* const data = a.data();

  DeviceArray<float> b(std::move(a));
  EXPECT_EQ(b.data(), data);  // the memory moves, nothing is copied
  ASSERT_EQ(b.size(), 6u);
  for (const float x : b) EXPECT_EQ(x, 7.0f);
  EXPECT_TRUE(a.empty());  // NOLINT(bugprone-use-after-move): moved-from state is specified here
  EXPECT_EQ(a.data(), nullptr);

  DeviceArray<float> c(CpuOps(), 2, 1.0f);
  c = std::move(b);
  EXPECT_EQ(c.data(), data);
  ASSERT_EQ(c.size(), 6u);
  for (const float x : c) EXPECT_EQ(x, 7.0f);
  EXPECT_TRUE(b.empty());  // NOLINT(bugprone-use-after-move)
  EXPECT_EQ(b.data(), nullptr);

  DeviceArray<float>& alias = c;
  c = std::move(alias);  // self-move keeps the contents
  EXPECT_EQ(c.data(), data);
  ASSERT_EQ(c.size(), 6u);
  EXPECT_EQ(c[5], 7.0f);

  // A moved-from array is usable again.
  a.assign(3, 4.0f);
  ASSERT_EQ(a.size(), 3u);
  EXPECT_EQ(a[2], 4.0f);
}

// ---------------------------------------------------------------------------------------------

TEST(SynchronizeTest, ReturnsOk) {
  const absl::Status st = Ops().synchronize(Stream{});
  EXPECT_TRUE(st.ok()) << st;
  int dummy = 0;
  const absl::Status st2 = Ops().synchronize(Stream{&dummy});  // the CPU ignores the handle
  EXPECT_TRUE(st2.ok()) << st2;
}

}  // namespace
}  // namespace fp8rt::kernels
