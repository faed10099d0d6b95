// model::Linear's current scaling without host round trips (issue 23 point 4): the amax of the
// tensor, its max over TP and the scale stay in the backend's memory, and the quantize op takes
// the scale from there (kernels::QuantizeArgs::scale_amax). The op table here is the CPU one with
// its synchronize, amax and quantize entries counted, so the test sees every wait and what each
// quantization was given; the TP group is a fake two-rank communicator whose peer contributes a
// fixed amax to the i32 max all-reduce.
//
// Expected values are from the definition of current scaling (DESIGN.md section 3; Transformer
// Engine's Float8CurrentScaling): scale = fp8_max / amax over the tensor and its TP peers
// (448 for E4M3, 57344 for E5M2; margin 0), scale_inv = 1 / scale, and scale 1 when that amax is
// zero, infinite or NaN. Reading the result does not go through kernels::ComputeScale.
#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdint>
#include <limits>
#include <optional>
#include <vector>

#include "absl/status/status.h"
#include "gtest/gtest.h"
#include "kernels/device_array.h"
#include "kernels/layer_ops.h"
#include "kernels/ops.h"
#include "kernels/quantize.h"
#include "parallel/communicator.h"
#include "parallel/fp8_collectives.h"
#include "runtime/model/linear.h"
#include "runtime/train/scaling.h"

namespace fp8rt::model {
namespace {

using kernels::Fp8Format;

// What the counted entries saw.
struct Calls {
  int synchronize = 0;
  int amax = 0;
  std::vector<float> scale_amax;  // *QuantizeArgs::scale_amax of each quantization given one
  std::vector<float> scale_inv;   // scale_inv[0] each tensor-granularity quantization wrote
};
Calls calls;

absl::Status CountedSynchronize(kernels::Stream s) {
  ++calls.synchronize;
  return kernels::CpuOps().layer->synchronize(s);
}
absl::Status CountedAmax(const kernels::AmaxArgs& a, kernels::Stream s) {
  ++calls.amax;
  return kernels::CpuOps().amax(a, s);
}
absl::Status CountedQuantize(const kernels::QuantizeArgs& a, kernels::Stream s) {
  if (a.scale_amax != nullptr) calls.scale_amax.push_back(*a.scale_amax);
  absl::Status st = kernels::CpuOps().quantize(a, s);
  if (st.ok() && a.granularity == kernels::Granularity::kTensor) {
    calls.scale_inv.push_back(a.scale_inv[0]);
  }
  return st;
}

// A TP group of two whose other rank's amax is `peer`: a stream-ordered i32 max all-reduce
// (Completion::kStream: the host does not wait for it, issue 23 point 4) takes the max of this
// rank's value and peer's bits. Nothing else is expected of it: a host-completed all-reduce fails.
class PeerAmaxGroup : public parallel::Communicator {
 public:
  explicit PeerAmaxGroup(float peer) : Communicator("tp", 0, 2), peer_(peer) {}
  int all_reduces = 0;

 protected:
  absl::Status DoAllReduce(void*, int64_t, parallel::DType, parallel::ReduceOp) override {
    return absl::UnimplementedError(
        "PeerAmaxGroup: the amax max-reduce must be stream-ordered (Completion::kStream)");
  }
  absl::Status DoAllReduceQueued(void* buf, int64_t count, parallel::DType dtype,
                                 parallel::ReduceOp op) override {
    if (dtype != parallel::DType::kI32 || op != parallel::ReduceOp::kMax) {
      return absl::UnimplementedError("PeerAmaxGroup: i32 max only");
    }
    ++all_reduces;
    auto* v = static_cast<int32_t*>(buf);
    const auto peer = static_cast<int32_t>(std::bit_cast<uint32_t>(peer_) & 0x7FFFFFFFu);
    for (int64_t i = 0; i < count; ++i) v[i] = std::max(v[i], peer);
    return absl::OkStatus();
  }
  absl::Status DoAllGather(const void*, int64_t, void*, parallel::DType) override {
    return absl::UnimplementedError("PeerAmaxGroup");
  }
  absl::Status DoReduceScatter(const void*, void*, int64_t, parallel::DType,
                               parallel::ReduceOp) override {
    return absl::UnimplementedError("PeerAmaxGroup");
  }
  absl::Status DoAllToAllV(const void*, std::span<const int64_t>, std::span<const int64_t>, void*,
                           std::span<const int64_t>, std::span<const int64_t>,
                           parallel::DType) override {
    return absl::UnimplementedError("PeerAmaxGroup");
  }
  absl::Status DoBroadcast(void*, int64_t, parallel::DType, int) override {
    return absl::UnimplementedError("PeerAmaxGroup");
  }
  absl::Status DoBarrier() override { return absl::UnimplementedError("PeerAmaxGroup"); }

 private:
  float peer_;
};

train::ScalingConfig Current(Fp8Format format) {
  train::ScalingConfig c;
  c.format = format;
  c.strategy = train::ScalingStrategy::kCurrent;
  return c;
}

float MaxAbs(const std::vector<float>& v) {
  float m = 0.0f;
  for (float x : v) m = std::max(m, std::fabs(x));
  return m;
}

constexpr int64_t kN = 6, kIn = 32, kOut = 16;

class LinearCurrentScalingTest : public ::testing::Test {
 protected:
  LinearCurrentScalingTest()
      : layer_ops_(*kernels::CpuOps().layer),
        ops_(MakeOps()),
        scratch_(ops_),
        layer_("test.fc", kIn, kOut, GemmPrecision::kFp8,
               Fp8SiteConfigs{.input = Current(Fp8Format::kE4M3),
                              .weight = Current(Fp8Format::kE4M3),
                              .grad_output = Current(Fp8Format::kE5M2)}) {
    calls = Calls{};
    // The weight: every code 1.0 in E4M3 (0x38), scale_inv 1.
    weight_.rows = kOut;
    weight_.cols = kIn;
    weight_.codes.Reset(ops_, kOut * kIn);
    std::fill(weight_.codes.begin(), weight_.codes.end(), uint8_t{0x38});
    weight_.scale_inv.Reset(ops_, 1);
    weight_.scale_inv[0] = 1.0f;
    layer_.SetWeight(&weight_);
    layer_.input_site().BeginStep();
    layer_.grad_site().BeginStep();
    for (int64_t i = 0; i < kN * kIn; ++i) x_.push_back(std::sin(0.37f * i) * 2.0f);
    for (int64_t i = 0; i < kN * kOut; ++i) dy_.push_back(std::cos(0.21f * i) * 0.01f);
  }
  kernels::OpTable MakeOps() {
    layer_ops_.synchronize = &CountedSynchronize;
    kernels::OpTable t = kernels::CpuOps();
    t.amax = &CountedAmax;
    t.quantize = &CountedQuantize;
    t.layer = &layer_ops_;
    return t;
  }
  // Two steps of Forward and Backward (the first sizes the scratch arena, which waits for the
  // backend once per slot); returns the synchronisations the second made before FlushStats, with
  // `calls` and the sites holding that step only.
  int Step(PeerAmaxGroup* tp) {
    LinearContext ctx{.ops = &ops_, .tp = tp, .scratch = &scratch_};
    std::vector<float> y(kN * kOut), dx(kN * kIn, 0.0f), dw(kOut * kIn, 0.0f);
    for (int step = 0; step < 2; ++step) {
      calls = Calls{};
      if (tp != nullptr) tp->all_reduces = 0;
      layer_.input_site().BeginStep();
      layer_.grad_site().BeginStep();
      EXPECT_TRUE(layer_.Forward(ctx, x_.data(), kN, y.data()).ok());
      EXPECT_TRUE(layer_.Backward(ctx, dy_.data(), kN, dx.data(), dw.data()).ok());
      if (step == 1) break;
      EXPECT_TRUE(layer_.FlushStats().ok());
    }
    const int waits = calls.synchronize;
    EXPECT_TRUE(layer_.FlushStats().ok());
    EXPECT_EQ(calls.synchronize, waits + 1) << "FlushStats waits once";
    return waits;
  }

  kernels::LayerOps layer_ops_;
  kernels::OpTable ops_;
  Scratch scratch_;
  Linear layer_;
  parallel::Fp8Weight weight_;
  std::vector<float> x_, dy_;
};

TEST_F(LinearCurrentScalingTest, ScalesFromTheTensorsAmaxWithoutWaitingForTheBackend) {
  EXPECT_EQ(Step(nullptr), 0) << "a forward and backward of current-scaled sites wait for nothing";
  const float ax = MaxAbs(x_), ady = MaxAbs(dy_);
  EXPECT_EQ(calls.amax, 2);  // x and dy
  ASSERT_EQ(calls.scale_amax.size(), 2u);
  EXPECT_EQ(calls.scale_amax[0], ax);
  EXPECT_EQ(calls.scale_amax[1], ady);
  ASSERT_EQ(calls.scale_inv.size(), 2u);
  EXPECT_EQ(calls.scale_inv[0], 1.0f / (448.0f / ax));
  EXPECT_EQ(calls.scale_inv[1], 1.0f / (57344.0f / ady));
  // The sites record the scale the op used once the statistics are flushed.
  EXPECT_EQ(layer_.input_site().step_scale(), 448.0f / ax);
  EXPECT_EQ(layer_.grad_site().step_scale(), 57344.0f / ady);
  EXPECT_EQ(layer_.input_site().step_stats().amax, ax);
  EXPECT_EQ(layer_.input_site().step_stats().count, kN * kIn);
}

// The outlier test fault reads and changes the input on the host: a CPU table (this wrapped one
// too) takes it; on any other backend (here the same table saying it is CUDA's) the armed forward
// is refused, naming the layer and the fault, instead of reading backend memory on the host.
TEST_F(LinearCurrentScalingTest, TheOutlierFaultIsRefusedOffTheCpuBackend) {
  LinearContext ctx{.ops = &ops_, .tp = nullptr, .scratch = &scratch_};
  std::vector<float> y(kN * kOut);
  layer_.ArmInputOutlier(/*growth=*/4.0f, /*grow_forwards=*/2);
  ASSERT_TRUE(layer_.Forward(ctx, x_.data(), kN, y.data()).ok());
  kernels::OpTable gpu_like = ops_;
  gpu_like.backend = kernels::Backend::kCuda;
  ctx.ops = &gpu_like;
  const absl::Status s = layer_.Forward(ctx, x_.data(), kN, y.data());
  EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition) << s;
  EXPECT_NE(s.message().find("test.fc: the test fault outlier_act (FP8RT_FAULT) runs on CPU ranks"),
            std::string::npos)
      << s;
}

TEST_F(LinearCurrentScalingTest, TakesTheTpMaxOnTheDevice) {
  PeerAmaxGroup tp(/*peer=*/8.0f);  // above both tensors' own amax
  ASSERT_LT(MaxAbs(x_), 8.0f);
  EXPECT_EQ(Step(&tp), 0);
  EXPECT_EQ(tp.all_reduces, 2);
  ASSERT_EQ(calls.scale_amax.size(), 2u);
  EXPECT_EQ(calls.scale_amax[0], 8.0f);
  EXPECT_EQ(calls.scale_amax[1], 8.0f);
  EXPECT_EQ(calls.scale_inv[0], 1.0f / (448.0f / 8.0f));
  EXPECT_EQ(calls.scale_inv[1], 1.0f / (57344.0f / 8.0f));
  EXPECT_EQ(layer_.input_site().step_scale(), 56.0f);
  EXPECT_EQ(layer_.grad_site().step_scale(), 7168.0f);
  // The statistics stay this rank's own.
  EXPECT_EQ(layer_.input_site().step_stats().amax, MaxAbs(x_));
}

TEST_F(LinearCurrentScalingTest, APeersNonFiniteAmaxGivesScaleOne) {
  for (float peer :
       {std::numeric_limits<float>::infinity(), std::numeric_limits<float>::quiet_NaN()}) {
    PeerAmaxGroup tp(peer);
    EXPECT_EQ(Step(&tp), 0);
    ASSERT_EQ(calls.scale_inv.size(), 2u) << peer;
    EXPECT_EQ(calls.scale_inv[0], 1.0f) << peer;
    EXPECT_EQ(calls.scale_inv[1], 1.0f) << peer;
    EXPECT_EQ(layer_.input_site().step_scale(), 1.0f) << peer;
  }
}

}  // namespace
}  // namespace fp8rt::model
