// model::Linear::Backward's BackwardInto: a gradient written over (add_dx / add_dw false) must be
// what the default, adding backward gives into a zeroed buffer, for every GEMM path of the
// layer (FP32, BF16, and FP8 with delayed, block and mx32 scaling) on the CPU op table. The
// transformer relies on it to skip zeroing the buffers a linear layer writes first (its weight
// gradients and the input gradients of lm_head, fc2, fc1, proj and qkv).
//
// Also: the backward on an op table without Fp8GemmArgs::b_transposed (the transposes CUDA needs)
// against the CPU's K x N path.
//
// Reference: the same layer's adding backward into zeros, run first. Adding a product to 0.0f
// gives the product exactly, so the two must agree value for value (an exact zero may differ in
// sign). The written-over buffers start as NaN, so any element the backward failed to write, or
// added to instead of writing, shows.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <random>
#include <string>
#include <tuple>
#include <vector>

#include "gtest/gtest.h"
#include "kernels/cpu/cpu_ops.h"
#include "kernels/device_array.h"
#include "kernels/formats.h"
#include "kernels/ops.h"
#include "parallel/fp8_collectives.h"
#include "runtime/model/linear.h"
#include "runtime/train/scaling.h"

namespace fp8rt::model {
namespace {

using kernels::Fp8Format;
using train::ScalingStrategy;

struct Case {
  std::string name;
  GemmPrecision precision;
  ScalingStrategy strategy;  // FP8 only
};

// n, in and out leave partial 32- and 128-blocks and odd GEMM shapes.
constexpr int64_t kN = 37, kIn = 72, kOut = 40;

kernels::OpTable WithoutBTransposed(kernels::OpTable ops) {
  ops.gemm_fp8_takes_b_transposed = false;
  return ops;
}

class LinearBackwardIntoTest : public ::testing::TestWithParam<Case> {
 protected:
  LinearBackwardIntoTest()
      : ops_(kernels::CpuOps()),
        scratch_(ops_),
        layer_("test.fc", kIn, kOut, GetParam().precision, Sites(GetParam().strategy)) {
    std::mt19937 gen(3);
    std::uniform_real_distribution<float> unit(-1.0f, 1.0f);
    w_.resize(kOut * kIn);
    for (float& v : w_) v = unit(gen);
    x_.resize(kN * kIn);
    for (float& v : x_) v = 4.0f * unit(gen);
    dy_.resize(kN * kOut);
    for (float& v : dy_) v = 0.01f * unit(gen);
    if (GetParam().precision != GemmPrecision::kFp8) {
      layer_.SetWeight(w_.data());
    } else {
      MakeFp8Weight();
      layer_.SetWeight(&weight_);
    }
    layer_.input_site().BeginStep();
    layer_.grad_site().BeginStep();
  }

  static Fp8SiteConfigs Sites(ScalingStrategy strategy) {
    train::ScalingConfig in, grad;
    in.strategy = grad.strategy = strategy;
    grad.format = Fp8Format::kE5M2;
    return Fp8SiteConfigs{.input = in, .weight = in, .grad_output = grad};
  }

  // W in E4M3 at scale 1 (|w| < 1 is in range): tensor scale 1, or every block's scale 1
  // (128x128 blocks: scale_inv 1.0; mx32: E8M0 code 127 = 2^0, for the row-wise and the
  // column-wise copies alike).
  void MakeFp8Weight() {
    weight_.rows = kOut;
    weight_.cols = kIn;
    weight_.codes.Reset(ops_, w_.size());
    for (size_t i = 0; i < w_.size(); ++i)
      weight_.codes[i] = kernels::EncodeFp8(w_[i], Fp8Format::kE4M3);
    const ScalingStrategy s = GetParam().strategy;
    if (s == ScalingStrategy::kMx32) {
      weight_.e8m0.Reset(ops_, kOut * ((kIn + 31) / 32));
      weight_.col_codes.Reset(ops_, w_.size());
      weight_.col_e8m0.Reset(ops_, ((kOut + 31) / 32) * kIn);
      for (size_t i = 0; i < w_.size(); ++i) weight_.col_codes[i] = weight_.codes[i];
      for (uint8_t& e : weight_.e8m0) e = 127;
      for (uint8_t& e : weight_.col_e8m0) e = 127;
    } else {
      const size_t scales =
          s == ScalingStrategy::kBlock ? ((kOut + 127) / 128) * ((kIn + 127) / 128) : 1;
      weight_.scale_inv.Reset(ops_, scales);
      for (float& v : weight_.scale_inv) v = 1.0f;
    }
  }

  const kernels::OpTable& ops_;
  Scratch scratch_;
  // The CPU's table without B as K x N (CUDA's transposes), and its scratch. Members declared
  // before the layer, so that they outlive it: the layer's arrays (its pending statistics) are
  // memory of the last call's table and are freed through it.
  kernels::OpTable transposing_ = WithoutBTransposed(kernels::CpuOps());
  Scratch transposing_scratch_{transposing_};
  Linear layer_;
  parallel::Fp8Weight weight_;
  std::vector<float> w_, x_, dy_;
};

void ExpectSameValues(const std::vector<float>& got, const std::vector<float>& want,
                      const char* what) {
  ASSERT_EQ(got.size(), want.size());
  int64_t nonzero = 0;
  for (size_t i = 0; i < got.size(); ++i) {
    ASSERT_FALSE(std::isnan(want[i])) << what << " reference at " << i;
    ASSERT_EQ(got[i], want[i]) << what << " at " << i;
    nonzero += want[i] != 0.0f;
  }
  EXPECT_GT(nonzero, static_cast<int64_t>(got.size()) / 2) << what << ": a reference of zeros";
}

TEST_P(LinearBackwardIntoTest, WrittenOverGradientsEqualTheAddingBackwardIntoZeros) {
  const LinearContext ctx{.ops = &ops_, .scratch = &scratch_};
  std::vector<float> y(kN * kOut);
  ASSERT_TRUE(layer_.Forward(ctx, x_.data(), kN, y.data()).ok());

  std::vector<float> dx_ref(kN * kIn, 0.0f), dw_ref(kOut * kIn, 0.0f);
  ASSERT_TRUE(layer_.Backward(ctx, dy_.data(), kN, dx_ref.data(), dw_ref.data()).ok());

  const float nan = std::numeric_limits<float>::quiet_NaN();
  std::vector<float> dx(kN * kIn, nan), dw(kOut * kIn, nan);
  ASSERT_TRUE(layer_
                  .Backward(ctx, dy_.data(), kN, dx.data(), dw.data(),
                            BackwardInto{.add_dx = false, .add_dw = false})
                  .ok());
  ExpectSameValues(dx, dx_ref, "dx written over");
  ExpectSameValues(dw, dw_ref, "dw written over");

  // Each flag on its own: the other gradient still adds.
  std::vector<float> dx2(kN * kIn, nan), dw2 = dw_ref;
  ASSERT_TRUE(layer_
                  .Backward(ctx, dy_.data(), kN, dx2.data(), dw2.data(),
                            BackwardInto{.add_dx = false, .add_dw = true})
                  .ok());
  ExpectSameValues(dx2, dx_ref, "dx written over, dw added");
  for (size_t i = 0; i < dw2.size(); ++i) {
    ASSERT_NEAR(dw2[i], 2.0f * dw_ref[i], 1e-5f * std::fabs(dw_ref[i]) + 1e-30f)
        << "dw added to a previous backward's at " << i;
  }
  std::vector<float> dw3(kOut * kIn, nan);
  ASSERT_TRUE(layer_
                  .Backward(ctx, dy_.data(), kN, nullptr, dw3.data(),
                            BackwardInto{.add_dx = true, .add_dw = false})
                  .ok());
  ExpectSameValues(dw3, dw_ref, "dw written over without dx");

  // The backward on a table without B as K x N (CUDA's: W and x transposed first, then B as N x K)
  // packs the same BF16 values into the same layout, so with the BF16 matmul it gives the same
  // bits as the CPU's K x N path above; on the FP32-matmul path oneDNN reads the two B layouts
  // with different kernels, so there the sums may differ in the last bits.
  if (GetParam().precision == GemmPrecision::kFp8) {
    const LinearContext tctx{.ops = &transposing_, .scratch = &transposing_scratch_};
    std::vector<float> dx4(kN * kIn, nan), dw4(kOut * kIn, nan);
    ASSERT_TRUE(layer_
                    .Backward(tctx, dy_.data(), kN, dx4.data(), dw4.data(),
                              BackwardInto{.add_dx = false, .add_dw = false})
                    .ok());
    if (!kernels::cpu_internal::UsesF32Matmul()) {
      ExpectSameValues(dx4, dx_ref, "dx through transposes");
      ExpectSameValues(dw4, dw_ref, "dw through transposes");
    } else {
      // FP32 sums of at most 72 terms in two orders: well within 1e-5 of the largest value.
      for (auto [got, want, what] : {std::tuple{&dx4, &dx_ref, "dx"}, {&dw4, &dw_ref, "dw"}}) {
        float largest = 0.0f;
        for (float v : *want) largest = std::max(largest, std::fabs(v));
        for (size_t i = 0; i < got->size(); ++i) {
          ASSERT_NEAR((*got)[i], (*want)[i], 1e-5f * largest) << what << " at " << i;
        }
      }
    }
  }
  ASSERT_TRUE(layer_.FlushStats().ok());
}

INSTANTIATE_TEST_SUITE_P(
    Paths, LinearBackwardIntoTest,
    ::testing::Values(Case{"fp32", GemmPrecision::kFp32, ScalingStrategy::kDelayed},
                      Case{"bf16", GemmPrecision::kBf16, ScalingStrategy::kDelayed},
                      Case{"fp8_delayed", GemmPrecision::kFp8, ScalingStrategy::kDelayed},
                      Case{"fp8_block", GemmPrecision::kFp8, ScalingStrategy::kBlock},
                      Case{"fp8_mx32", GemmPrecision::kFp8, ScalingStrategy::kMx32}),
    [](const ::testing::TestParamInfo<Case>& info) { return info.param.name; });

}  // namespace
}  // namespace fp8rt::model
