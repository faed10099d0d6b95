// The scaling state of one FP8 quantization site (e.g. "blocks.3.mlp.fc1/weight").
//
// Strategies (DESIGN.md section 3):
//   kDelayed  quantize step t with the scale computed from the amax history of steps before t
//             (history of length H, reduced by max or most_recent, with a margin). A step with an
//             empty history uses current scaling instead of scale 1.
//   kCurrent  quantize with the scale from this tensor's own amax.
//   kBlock    per-block scales computed by the kernel (1x128 / 128x128); the state only records
//             amaxes for the metrics.
//   kMx32     MXFP8 (OCP MX v1.0): one E8M0 scale per 1x32 block along each GEMM's K, computed
//             by the kernel; like kBlock the state only records amaxes.
//
// Use per step:  if (state.UsesCurrentScaling()) quantize computing the scale from the tensor;
//                else quantize with state.scale();  then state.Update(amax), with the amax
//                synchronised across the ranks that share this tensor.
// An amax of zero or a non-finite amax is not recorded: the previous scale is kept, the event is
// counted and reported through the returned AmaxUpdate. The state round-trips bit for bit through
// its protobuf form (fp8rt.v1.ScalingState) for checkpoints.
// Not thread-safe: one owner (the layer that holds the site).
#ifndef FP8RT_RUNTIME_TRAIN_SCALING_H_
#define FP8RT_RUNTIME_TRAIN_SCALING_H_

#include <cstdint>
#include <deque>
#include <string_view>

#include "absl/status/statusor.h"
#include "kernels/formats.h"

namespace fp8rt::v1 {
class ScalingState;
}

namespace fp8rt::train {

enum class ScalingStrategy : uint8_t { kDelayed, kCurrent, kBlock, kMx32 };
enum class AmaxAlgo : uint8_t { kMax, kMostRecent };

std::string_view ScalingStrategyName(ScalingStrategy strategy);  // "delayed", "current", "block", "mx32"
// Block and mx32 scales come from each block of the tensor in hand (no history is used).
inline bool PerBlockScales(ScalingStrategy s) {
  return s == ScalingStrategy::kBlock || s == ScalingStrategy::kMx32;
}
absl::StatusOr<ScalingStrategy> ParseScalingStrategy(std::string_view name);
std::string_view AmaxAlgoName(AmaxAlgo algo);  // "max", "most_recent"
absl::StatusOr<AmaxAlgo> ParseAmaxAlgo(std::string_view name);

// Recipe of one site.
struct ScalingConfig {
  kernels::Fp8Format format = kernels::Fp8Format::kE4M3;
  ScalingStrategy strategy = ScalingStrategy::kDelayed;
  int history_len = 16;            // delayed: amaxes remembered, 1..4096
  AmaxAlgo algo = AmaxAlgo::kMax;  // delayed: how the history is reduced
  int margin = 0;                  // scale = fp8_max / amax / 2^margin, 0..32
  bool power_of_two = false;       // round scales down to powers of two
};

// InvalidArgument naming the field (history_len, margin) when out of range.
absl::Status ValidateScalingConfig(const ScalingConfig& config);

// What Update() did with an amax.
enum class AmaxUpdate : uint8_t {
  kRecorded,       // added to the history; the scale follows it
  kKeptZero,       // amax was 0: not recorded, scale kept
  kKeptNonFinite,  // amax was Inf or NaN: not recorded, scale kept
};

class ScalingState {
 public:
  // `config` must be valid (ValidateScalingConfig).
  explicit ScalingState(const ScalingConfig& config);

  const ScalingConfig& config() const { return config_; }

  // True when the next quantization must compute its scale from the tensor itself: current
  // and block strategies always, delayed scaling while its history is empty.
  bool UsesCurrentScaling() const;

  // Scale to quantize with (delayed scaling with a history); 1 before any amax was recorded.
  float scale() const { return scale_; }
  float scale_inv() const { return scale_inv_; }

  // Records the amax of the step just quantized and recomputes the scale for the next step.
  AmaxUpdate Update(float amax);

  // Amax history, oldest first (at most config().history_len values, all finite and > 0).
  const std::deque<float>& history() const { return history_; }
  int64_t updates() const { return updates_; }  // amaxes recorded
  int64_t zero_amax_count() const { return zero_amax_count_; }
  int64_t nonfinite_amax_count() const { return nonfinite_amax_count_; }

  // Checkpoint form. FromProto validates everything (DataLoss naming the field on a bad value)
  //.
  void ToProto(v1::ScalingState* proto) const;
  static absl::StatusOr<ScalingState> FromProto(const v1::ScalingState& proto);

 private:
  void Recompute();

  ScalingConfig config_;
  std::deque<float> history_;
  float scale_ = 1.0f;
  float scale_inv_ = 1.0f;
  int64_t updates_ = 0;
  int64_t zero_amax_count_ = 0;
  int64_t nonfinite_amax_count_ = 0;
};

}  // namespace fp8rt::train

#endif  // FP8RT_RUNTIME_TRAIN_SCALING_H_
