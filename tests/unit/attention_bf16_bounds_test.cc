// The BF16-operand attention bounds (tests/support/attention_check.h,
// Precision::Bf16TensorCores), on the CPU: the bounds the CUDA tensor-core kernels are held to in
// tests/gpu/attention_cuda_test.cc, checked here against an implementation that rounds at the
// same points (so that the GPU test's bounds are known to admit BF16 operands and to be tight
// enough to see them), and the CPU table's BF16 entries held to them.
//
//   EmulationWithinBf16Bounds    a direct evaluation of the contract with q, k, v, dout, p and ds
//                                rounded to BF16 (kernels/formats.h FloatToBf16: round to
//                                nearest even), FP32 elsewhere: out, lse, dq, dk and dv within the
//                                BF16 bounds
//   EmulationOutsideFp32Bounds   the same values are NOT within the FP32 bounds (somewhere): the
//                                BF16 rounding is visible to the FP32 check, so the BF16 bounds
//                                are not the FP32 ones with nothing to tell them apart
//   CpuBf16EntriesWithinBounds   CpuOps().layer->attention_forward_bf16 / _backward_bf16 (the
//                                CPU computes them in FP32) within the BF16 bounds
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <limits>
#include <string>
#include <vector>

#include "kernels/formats.h"
#include "kernels/layer_ops.h"
#include "kernels/ops.h"
#include "tests/support/attention_check.h"

namespace fp8rt::attention_check {
namespace {

float Bf(float x) { return kernels::Bf16ToFloat(kernels::FloatToBf16(x)); }

// sum_d Bf(a_d) Bf(b_d) in FP32, d ascending.
float DotBf(const float* a, const float* b, int64_t n) {
  float s = 0.0f;
  for (int64_t d = 0; d < n; ++d) s += Bf(a[d]) * Bf(b[d]);
  return s;
}

struct Emulated {
  std::vector<float> out, lse, dq, dk, dv;
};

// The contract with the tensor-core kernels' rounding points, evaluated row by row.
Emulated Emulate(const AttnData& x) {
  const AttnShape& s = x.s;
  Emulated e;
  e.out.assign(x.size, 0.0f);
  e.lse.assign(x.lse_size, 0.0f);
  e.dq = x.dq0;
  e.dk = x.dk0;
  e.dv = x.dv0;
  std::vector<float> score(static_cast<size_t>(s.t)), p(static_cast<size_t>(s.t));
  for (int64_t bb = 0; bb < s.b; ++bb) {
    for (int64_t hh = 0; hh < s.h; ++hh) {
      for (int64_t i = 0; i < s.t; ++i) {
        const float* qi = &x.q[x.At(bb, i, hh, 0)];
        float m = -std::numeric_limits<float>::infinity();
        for (int64_t j = 0; j <= i; ++j) {
          score[j] = DotBf(qi, &x.k[x.KvAt(bb, j, hh, 0)], s.dh) * x.scale;
          m = std::max(m, score[j]);
        }
        float l = 0.0f;
        for (int64_t j = 0; j <= i; ++j) l += std::exp(score[j] - m);
        const float lse = m + std::log(l);
        e.lse[x.Row(bb, hh, i)] = lse;
        for (int64_t d = 0; d < s.dh; ++d) {
          float o = 0.0f;
          for (int64_t j = 0; j <= i; ++j) {
            o += Bf(std::exp(score[j] - m)) * Bf(x.v[x.KvAt(bb, j, hh, d)]);
          }
          e.out[x.At(bb, i, hh, d)] = o / l;
        }
      }
    }
  }
  // The backward on the emulated forward's out and lse.
  for (int64_t bb = 0; bb < s.b; ++bb) {
    for (int64_t hh = 0; hh < s.h; ++hh) {
      for (int64_t i = 0; i < s.t; ++i) {
        const float* qi = &x.q[x.At(bb, i, hh, 0)];
        const float* doi = &x.dout[x.At(bb, i, hh, 0)];
        const float lse = e.lse[x.Row(bb, hh, i)];
        float row_term = 0.0f;
        for (int64_t d = 0; d < s.dh; ++d) row_term += doi[d] * e.out[x.At(bb, i, hh, d)];
        for (int64_t j = 0; j <= i; ++j) {
          p[j] = std::exp(DotBf(qi, &x.k[x.KvAt(bb, j, hh, 0)], s.dh) * x.scale - lse);
          const float dp = DotBf(doi, &x.v[x.KvAt(bb, j, hh, 0)], s.dh);
          score[j] = p[j] * (dp - row_term) * x.scale;  // ds_ij
        }
        for (int64_t d = 0; d < s.dh; ++d) {
          float dq = 0.0f;
          for (int64_t j = 0; j <= i; ++j) {
            const size_t kd = x.KvAt(bb, j, hh, d);
            dq += Bf(score[j]) * Bf(x.k[kd]);
            e.dk[kd] += Bf(score[j]) * Bf(qi[d]);
            e.dv[kd] += Bf(p[j]) * Bf(doi[d]);
          }
          e.dq[x.At(bb, i, hh, d)] += dq;
        }
      }
    }
  }
  return e;
}

// The failures of e against the bounds of `prec` (empty if none).
std::string Failures(const AttnData& x, const Emulated& e, Precision prec) {
  const ForwardWant f = ExactForward(x, prec);
  const BackwardWant b = ExactBackward(x, e.out, e.lse, prec);
  return OutOfBounds("out", e.out, f.out, f.out_bound) +
         OutOfBounds("lse", e.lse, f.lse, f.lse_bound) + OutOfBounds("dq", e.dq, b.dq, b.dq_bound) +
         OutOfBounds("dk", e.dk, b.dk, b.dk_bound) + OutOfBounds("dv", e.dv, b.dv, b.dv_bound);
}

const AttnShape kShapes[] = {
    {1, 9, 1, 1, 1}, {1, 70, 2, 2, 64}, {2, 33, 4, 2, 24}, {1, 40, 3, 1, 128}};

class Bf16BoundsTest : public ::testing::TestWithParam<AttnShape> {};

TEST_P(Bf16BoundsTest, EmulationWithinBf16Bounds) {
  const AttnData x(GetParam(), 77);
  const std::string err = Failures(x, Emulate(x), Precision::Bf16TensorCores());
  EXPECT_TRUE(err.empty()) << err;
}

TEST_P(Bf16BoundsTest, EmulationOutsideFp32Bounds) {
  const AttnData x(GetParam(), 78);
  EXPECT_FALSE(Failures(x, Emulate(x), Precision::Fp32()).empty())
      << "BF16 operands stayed within the FP32 bounds: those cannot tell the two apart";
}

TEST_P(Bf16BoundsTest, CpuBf16EntriesWithinBounds) {
  const AttnData x(GetParam(), 79);
  const kernels::LayerOps& cpu = *kernels::CpuOps().layer;
  Emulated e;
  e.out.resize(x.size);
  e.lse.resize(x.lse_size);
  ASSERT_TRUE(cpu.attention_forward_bf16(e.out.data(), e.lse.data(), x.q.data(), x.k.data(),
                                         x.v.data(), x.s.b, x.s.t, x.s.h, x.s.hkv, x.s.dh,
                                         kernels::Stream{})
                  .ok());
  e.dq = x.dq0;
  e.dk = x.dk0;
  e.dv = x.dv0;
  ASSERT_TRUE(cpu.attention_backward_bf16(e.dq.data(), e.dk.data(), e.dv.data(), x.dout.data(),
                                          x.q.data(), x.k.data(), x.v.data(), e.out.data(),
                                          e.lse.data(), x.s.b, x.s.t, x.s.h, x.s.hkv, x.s.dh,
                                          kernels::Stream{})
                  .ok());
  const std::string err = Failures(x, e, Precision::Bf16TensorCores());
  EXPECT_TRUE(err.empty()) << err;
}

INSTANTIATE_TEST_SUITE_P(Shapes, Bf16BoundsTest, ::testing::ValuesIn(kShapes),
                         [](const auto& info) { return ShapeName(info.param); });

}  // namespace
}  // namespace fp8rt::attention_check
