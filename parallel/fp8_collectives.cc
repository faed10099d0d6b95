// FP8-aware collectives (parallel/fp8_collectives.h): amax sync, FSDP gathers in FP8 and BF16,
// gradient reduce-scatter, MoE all-to-all of tokens.
//
// Index:
//   AmaxBits, AmaxFromBits    |amax| <-> ordered int32 bits (NaN > Inf > finite)
//   Synchronize, Accumulate   host reads of op results; `+=` through an op
//   SyncAmaxes, ResizeFp8Weight
//   GatherFp8Weight           validation, then tensor (given / current) or 128x128 block scaling
//   StartGatherBf16, GatherBf16, ReduceScatterGrad
//   ExchangeTokenCounts, AllToAllFp8Tokens, AllToAllBf16Tokens
//
// Argument checks are local and happen before the first collective. They must fail on every rank
// alike (callers pass the same shapes everywhere); a rank that fails alone leaves its peers to
// the communicator's timeout.
//
// Every buffer handed to the communicator or to an op is a kernels::DeviceArray of the op table's
// backend (host memory on the CPU, managed memory on CUDA), so that NCCL and the CUDA ops get
// memory they can use; the host reads what ops or collectives wrote only after
// ops.layer->synchronize. Temporaries are freed on return: on CUDA deallocate (cudaFree) waits for
// the device, so an op still reading one is not cut short. Callers that move tokens every
// micro-batch pass a TokenScratch instead, kept across calls, and nothing is allocated or freed.
#include "parallel/fp8_collectives.h"

#include <algorithm>
#include <bit>
#include <cmath>
#include <limits>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "kernels/formats.h"
#include "kernels/quantize.h"
#include "runtime/core/status.h"

namespace fp8rt::parallel {
namespace {

using kernels::Fp8Format;
using kernels::Granularity;

constexpr uint32_t kFloatInfBits = 0x7F800000u;
constexpr int64_t kTileCols = 128;  // columns per 1x128 tile and per 128x128 block

// The bits of |amax| as a non-negative int32: for non-negative IEEE floats the integer order
// is the float order, and every NaN (0x7F800001..0x7FFFFFFF) sits above +Inf.
int32_t AmaxBits(float amax) {
  return static_cast<int32_t>(std::bit_cast<uint32_t>(amax) & 0x7FFFFFFFu);
}

float AmaxFromBits(int32_t bits) {
  const auto u = static_cast<uint32_t>(bits);
  if (u > kFloatInfBits) return std::numeric_limits<float>::quiet_NaN();
  return std::bit_cast<float>(u);
}

absl::Status CheckFormat(Fp8Format format, const char* fn) {
  if (format != Fp8Format::kE4M3 && format != Fp8Format::kE5M2) {
    return absl::InvalidArgumentError(
        absl::StrCat(fn, ": format must be e4m3 or e5m2, got ", static_cast<int>(format)));
  }
  return absl::OkStatus();
}

// One count per rank of the group, none negative; returns their sum in *total.
absl::Status CheckCounts(const Communicator& group, std::span<const int64_t> counts,
                         const char* field, const char* fn, int64_t* total) {
  if (counts.size() != static_cast<size_t>(group.size())) {
    return absl::InvalidArgumentError(absl::StrCat(fn, ": ", field, " has ", counts.size(),
                                                   " entries, the group '", group.name(), "' has ",
                                                   group.size(), " ranks"));
  }
  *total = 0;
  for (size_t r = 0; r < counts.size(); ++r) {
    if (counts[r] < 0) {
      return absl::InvalidArgumentError(
          absl::StrCat(fn, ": ", field, "[", r, "] must be >= 0, got ", counts[r]));
    }
    *total += counts[r];
  }
  return absl::OkStatus();
}

// Element counts and displacements of an all-to-all of rows of `row_elems` elements.
struct AllToAllLayout {
  std::vector<int64_t> counts;
  std::vector<int64_t> displs;
};

AllToAllLayout RowsLayout(std::span<const int64_t> rows, int64_t row_elems) {
  AllToAllLayout layout;
  layout.counts.resize(rows.size());
  layout.displs.resize(rows.size());
  int64_t at = 0;
  for (size_t r = 0; r < rows.size(); ++r) {
    layout.counts[r] = rows[r] * row_elems;
    layout.displs[r] = at;
    at += layout.counts[r];
  }
  return layout;
}

absl::Status CheckOp(const void* fn_ptr, const kernels::OpTable& ops, const char* op,
                     const char* fn) {
  if (fn_ptr == nullptr) {
    return absl::UnimplementedError(
        absl::StrCat(fn, ": the ", ops.name, " op table has no ", op, " op"));
  }
  return absl::OkStatus();
}

// FP32 <-> BF16 through the op table (at memory speed; rounding to nearest even).
absl::Status Convert(const kernels::OpTable& ops, kernels::InputType from, const void* in,
                     kernels::InputType to, void* out, int64_t count) {
  if (ops.convert == nullptr) {
    return absl::UnimplementedError(absl::StrCat("the ", ops.name, " op table has no convert op"));
  }
  kernels::ConvertArgs args;
  args.from = from;
  args.to = to;
  args.input = in;
  args.output = out;
  args.count = count;
  return ops.convert(args, kernels::Stream{});
}

// Waits for the ops enqueued on the default stream, before the host reads what they wrote.
absl::Status Synchronize(const kernels::OpTable& ops) {
  return ops.layer->synchronize(kernels::Stream{});
}

// sum[i] += add[i] for i < count, through the op table (residual_forward may write over its
// first input): the same FP32 additions as a host loop, on memory of either backend.
absl::Status Accumulate(const kernels::OpTable& ops, float* sum, const float* add, int64_t count) {
  if (ops.layer->residual_forward == nullptr) {
    return absl::UnimplementedError(
        absl::StrCat("the ", ops.name, " op table has no residual_forward op"));
  }
  return ops.layer->residual_forward(sum, sum, add, count, kernels::Stream{});
}

}  // namespace

absl::StatusOr<std::vector<int>> SyncAmaxes(Communicator& group, std::span<float> amaxes) {
  std::vector<int> nonfinite;
  if (amaxes.empty()) return nonfinite;
  std::vector<int32_t> bits(amaxes.size());
  for (size_t i = 0; i < amaxes.size(); ++i) bits[i] = AmaxBits(amaxes[i]);
  FP8RT_RETURN_IF_ERROR(
      group.AllReduce(bits.data(), static_cast<int64_t>(bits.size()), DType::kI32, ReduceOp::kMax));
  for (size_t i = 0; i < amaxes.size(); ++i) {
    amaxes[i] = AmaxFromBits(bits[i]);
    if (static_cast<uint32_t>(bits[i]) >= kFloatInfBits) nonfinite.push_back(static_cast<int>(i));
  }
  return nonfinite;
}

void ResizeFp8Weight(const kernels::OpTable& ops, size_t code_count, size_t scale_count,
                     Fp8Weight* weight) {
  weight->codes.Reset(ops, code_count);
  weight->scale_inv.Reset(ops, scale_count);
}

absl::StatusOr<Fp8Weight> GatherFp8Weight(Communicator& group, const kernels::OpTable& ops,
                                          const float* shard, int64_t shard_rows, int64_t cols,
                                          const Fp8GatherOptions& options) {
  Fp8Weight weight;
  if (absl::Status s = GatherFp8WeightInto(group, ops, shard, shard_rows, cols, options, &weight);
      !s.ok()) {
    return s;
  }
  return weight;
}

absl::Status GatherFp8WeightInto(Communicator& group, const kernels::OpTable& ops,
                                 const float* shard, int64_t shard_rows, int64_t cols,
                                 const Fp8GatherOptions& options, Fp8Weight* out) {
  constexpr const char* kFn = "GatherFp8Weight";
  if (out == nullptr) return absl::InvalidArgumentError(absl::StrCat(kFn, ": out is null"));
  if (shard_rows <= 0) {
    return absl::InvalidArgumentError(
        absl::StrCat(kFn, ": shard_rows must be > 0, got ", shard_rows));
  }
  if (cols <= 0) {
    return absl::InvalidArgumentError(absl::StrCat(kFn, ": cols must be > 0, got ", cols));
  }
  if (shard == nullptr) return absl::InvalidArgumentError(absl::StrCat(kFn, ": shard is null"));
  if (absl::Status s = CheckFormat(options.format, kFn); !s.ok()) return s;
  if (options.margin < 0 || options.margin > 64) {
    return absl::InvalidArgumentError(
        absl::StrCat(kFn, ": margin must be in [0, 64], got ", options.margin));
  }
  switch (options.scaling) {
    case WeightScaling::kTensorGiven:
      if (!(std::isfinite(options.scale) && options.scale > 0.0f)) {
        return absl::InvalidArgumentError(absl::StrCat(
            kFn, ": scale must be finite and > 0 with tensor-given scaling, got ", options.scale));
      }
      break;
    case WeightScaling::kTensorCurrent:
      break;
    case WeightScaling::kBlock128:
      if (shard_rows % kTileCols != 0) {
        return absl::InvalidArgumentError(absl::StrCat(
            kFn,
            ": shard_rows must be a multiple of 128 with 128x128 block scaling (shards are "
            "whole block rows), got ",
            shard_rows));
      }
      break;
    default:
      return absl::InvalidArgumentError(
          absl::StrCat(kFn, ": scaling must be tensor-given, tensor-current or block128, got ",
                       static_cast<int>(options.scaling)));
  }
  if (absl::Status s = CheckOp(reinterpret_cast<const void*>(ops.quantize), ops, "quantize", kFn);
      !s.ok()) {
    return s;
  }

  // Each rank quantizes straight into its own rows of the full buffers, which the all-gathers
  // then fill in place: no staging copy, and buffers reused across steps are not reallocated.
  const int64_t shard_elems = shard_rows * cols;
  const int64_t rank = group.rank();
  Fp8Weight& weight = *out;
  weight.rows = shard_rows * group.size();
  weight.cols = cols;
  weight.codes.Reset(ops, static_cast<size_t>(shard_elems * group.size()));
  uint8_t* my_codes = weight.codes.data() + rank * shard_elems;
  weight.shard_stats = kernels::QuantStats{};
  weight.stats_out.Reset(ops, 1);  // the quantize op writes every field

  kernels::QuantizeArgs q;
  q.format = options.format;
  q.input_type = kernels::InputType::kF32;
  q.input = shard;
  q.rows = shard_rows;
  q.cols = cols;
  q.margin = options.margin;
  q.codes = my_codes;
  q.stats = weight.stats_out.device();

  // Tensor scaling: every rank must quantize with the same scale, agreed before quantizing.
  // Block scaling: each 128x128 block lies inside one shard, so its scale is local.
  int64_t shard_grid = 1;
  if (options.scaling == WeightScaling::kBlock128) {
    shard_grid = kernels::GetScaleGrid(Granularity::kBlock128x128, shard_rows, cols).size();
    weight.scale_inv.Reset(ops, static_cast<size_t>(shard_grid * group.size()));
    q.granularity = Granularity::kBlock128x128;
    q.scale_inv = weight.scale_inv.data() + rank * shard_grid;
  } else {
    weight.scale_inv.Reset(ops, 1);  // the same on every rank: nothing to send
    q.granularity = Granularity::kTensor;
    q.scale_inv = weight.scale_inv.data();
    if (options.scaling == WeightScaling::kTensorCurrent) {
      if (absl::Status s = CheckOp(reinterpret_cast<const void*>(ops.amax), ops, "amax", kFn);
          !s.ok()) {
        return s;
      }
      // The amax, its max over the group and the scale stay in the backend's memory: the group
      // max-reduces the amax's bits (>= 0 or a positive NaN, so int32 order is float order, as
      // in SyncAmaxes) and the quantize op derives the scale from them (a non-finite synced amax
      // gives scale 1, as ComputeScale, and stays visible in weight.amax).
      weight.amax_out.Reset(ops, 1);
      kernels::AmaxArgs a;
      a.input_type = kernels::InputType::kF32;
      a.input = shard;
      a.count = shard_elems;
      a.amax = weight.amax_out.device();
      FP8RT_RETURN_IF_ERROR(ops.amax(a, kernels::Stream{}));
      FP8RT_RETURN_IF_ERROR(group.AllReduce(weight.amax_out.device(), 1, DType::kI32,
                                            ReduceOp::kMax, Completion::kStream));
      q.scale_amax = weight.amax_out.device();
    } else {
      q.has_scale = true;
      q.scale = options.scale;
    }
  }
  FP8RT_RETURN_IF_ERROR(ops.quantize(q, kernels::Stream{}));
  FP8RT_RETURN_IF_ERROR(weight.stats_out.Download(kernels::Stream{}));
  if (options.scaling == WeightScaling::kTensorCurrent) {
    FP8RT_RETURN_IF_ERROR(weight.amax_out.Download(kernels::Stream{}));
  }

  // Stream-ordered (with the amax reduction above): the one host wait is the Synchronize below.
  if (absl::Status s = group.AllGather(my_codes, shard_elems, weight.codes.data(), DType::kU8,
                                       Completion::kStream);
      !s.ok()) {
    return s;
  }
  if (options.scaling == WeightScaling::kBlock128) {
    // Shards are whole block rows, so the grids in rank order are the full grid.
    FP8RT_RETURN_IF_ERROR(group.AllGather(weight.scale_inv.data() + rank * shard_grid, shard_grid,
                                          weight.scale_inv.data(), DType::kF32,
                                          Completion::kStream));
  }
  // The host values, read once the gathers (which ran after the quantization, in stream order)
  // are done: this wait finds the backend idle, where one before the gather stalled it.
  FP8RT_RETURN_IF_ERROR(Synchronize(ops));
  FP8RT_RETURN_IF_ERROR(group.CheckStreamOrdered());
  weight.shard_stats = weight.stats_out[0];
  weight.amax = options.scaling == WeightScaling::kTensorCurrent
                    ? AmaxFromBits(AmaxBits(weight.amax_out[0]))
                    : weight.shard_stats.amax;
  return absl::OkStatus();
}

namespace {

// QuantizeFp8Shard and QuantizeFp8ShardFromAmax: the checks, then the op and the statistics' copy
// queued on the default stream. `scale_amax` non-null: tensor scaling with the scale computed by
// the op from that amax (`scale` unused).
absl::Status QueueShardQuantization(const kernels::OpTable& ops, const float* shard, int64_t rows,
                                    int64_t cols, kernels::Fp8Format format, bool block,
                                    float scale, const float* scale_amax, int margin,
                                    bool power_of_two, Fp8Shard* out, const char* fn) {
  if (out == nullptr) return absl::InvalidArgumentError(absl::StrCat(fn, ": out is null"));
  if (rows <= 0 || cols <= 0) {
    return absl::InvalidArgumentError(
        absl::StrCat(fn, ": rows and cols must be > 0, got ", rows, " x ", cols));
  }
  if (shard == nullptr) return absl::InvalidArgumentError(absl::StrCat(fn, ": shard is null"));
  if (absl::Status s = CheckFormat(format, fn); !s.ok()) return s;
  if (margin < 0 || margin > 64) {
    return absl::InvalidArgumentError(
        absl::StrCat(fn, ": margin must be in [0, 64], got ", margin));
  }
  if (block && rows % kTileCols != 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        fn, ": rows must be a multiple of 128 with 128x128 block scaling, got ", rows));
  }
  if (!block && scale_amax == nullptr && !(std::isfinite(scale) && scale > 0.0f)) {
    return absl::InvalidArgumentError(
        absl::StrCat(fn, ": scale must be finite and > 0, got ", scale));
  }
  if (absl::Status s = CheckOp(reinterpret_cast<const void*>(ops.quantize), ops, "quantize", fn);
      !s.ok()) {
    return s;
  }
  const Granularity g = block ? Granularity::kBlock128x128 : Granularity::kTensor;
  out->rows = rows;
  out->cols = cols;
  out->block = block;
  out->mx32 = false;
  out->scale = block || scale_amax != nullptr ? 1.0f : scale;
  out->codes.Reset(ops, static_cast<size_t>(rows * cols));
  out->scale_inv.Reset(ops, static_cast<size_t>(kernels::GetScaleGrid(g, rows, cols).size()));
  out->stats_out.Reset(ops, 1);
  kernels::QuantizeArgs q;
  q.format = format;
  q.input_type = kernels::InputType::kF32;
  q.granularity = g;
  q.input = shard;
  q.rows = rows;
  q.cols = cols;
  q.has_scale = !block && scale_amax == nullptr;
  q.scale = scale;
  q.scale_amax = scale_amax;
  q.margin = margin;
  q.power_of_two_scales = power_of_two;
  q.codes = out->codes.data();
  q.scale_inv = out->scale_inv.data();
  q.stats = out->stats_out.device();
  FP8RT_RETURN_IF_ERROR(ops.quantize(q, kernels::Stream{}));
  return out->stats_out.Download(kernels::Stream{});
}

}  // namespace

absl::Status QuantizeFp8Shard(const kernels::OpTable& ops, const float* shard, int64_t rows,
                              int64_t cols, kernels::Fp8Format format, bool block, float scale,
                              int margin, Fp8Shard* out, bool wait) {
  FP8RT_RETURN_IF_ERROR(QueueShardQuantization(ops, shard, rows, cols, format, block, scale,
                                               /*scale_amax=*/nullptr, margin,
                                               /*power_of_two=*/false, out, "QuantizeFp8Shard"));
  if (!wait) return absl::OkStatus();
  FP8RT_RETURN_IF_ERROR(Synchronize(ops));
  ReadShardStats(out);
  return absl::OkStatus();
}

absl::Status QuantizeFp8ShardFromAmax(const kernels::OpTable& ops, const float* shard, int64_t rows,
                                      int64_t cols, kernels::Fp8Format format,
                                      const float* scale_amax, int margin, bool power_of_two,
                                      Fp8Shard* out) {
  constexpr const char* kFn = "QuantizeFp8ShardFromAmax";
  if (scale_amax == nullptr) {
    return absl::InvalidArgumentError(absl::StrCat(kFn, ": scale_amax is null"));
  }
  return QueueShardQuantization(ops, shard, rows, cols, format, /*block=*/false, /*scale=*/1.0f,
                                scale_amax, margin, power_of_two, out, kFn);
}

void ReadShardStats(Fp8Shard* out) { out->stats = out->stats_out[0]; }

namespace {

// MXFP8 of `rows` x `cols` FP32 `src`: 1x32 blocks along each row, on the default stream.
absl::Status QuantizeMx32Rows(const kernels::OpTable& ops, kernels::Fp8Format format,
                              const float* src, int64_t rows, int64_t cols, uint8_t* codes,
                              uint8_t* e8m0, kernels::QuantStats* stats) {
  kernels::QuantizeArgs q;
  q.format = format;
  q.input_type = kernels::InputType::kF32;
  q.granularity = Granularity::kMx32;
  q.input = src;
  q.rows = rows;
  q.cols = cols;
  q.codes = codes;
  q.e8m0_scales = e8m0;
  q.stats = stats;
  return ops.quantize(q, kernels::Stream{});
}

}  // namespace

absl::Status QuantizeMx32Transposed(const kernels::OpTable& ops, kernels::Fp8Format format,
                                    const float* src, int64_t rows, int64_t cols, float* t32,
                                    uint8_t* codes, uint8_t* e8m0) {
  FP8RT_RETURN_IF_ERROR(ops.layer->transpose(t32, src, rows, cols, kernels::Stream{}));
  return QuantizeMx32Rows(ops, format, t32, cols, rows, codes, e8m0, nullptr);
}

absl::Status QuantizeMx32Both(const kernels::OpTable& ops, const float* src, int64_t rows,
                              int64_t cols, kernels::Fp8Format format, uint8_t* codes,
                              uint8_t* e8m0, uint8_t* col_codes, uint8_t* col_e8m0,
                              kernels::QuantStats* stats,
                              kernels::DeviceArray<std::byte>* scratch) {
  constexpr const char* kFn = "QuantizeMx32Both";
  if (rows <= 0 || cols <= 0) {
    return absl::InvalidArgumentError(
        absl::StrCat(kFn, ": rows and cols must be > 0, got ", rows, " x ", cols));
  }
  if (src == nullptr || codes == nullptr || e8m0 == nullptr || col_codes == nullptr ||
      col_e8m0 == nullptr || scratch == nullptr) {
    return absl::InvalidArgumentError(absl::StrCat(kFn, ": null input or output"));
  }
  if (absl::Status s = CheckFormat(format, kFn); !s.ok()) return s;
  if (absl::Status s = CheckOp(reinterpret_cast<const void*>(ops.quantize), ops, "quantize", kFn);
      !s.ok()) {
    return s;
  }
  const int64_t count = rows * cols;
  const int64_t col_grid = kernels::GetScaleGrid(Granularity::kMx32, cols, rows).size();
  // [W^T in FP32][W^T codes][their E8M0 grid]
  const size_t bytes =
      static_cast<size_t>(count) * (sizeof(float) + 1) + static_cast<size_t>(col_grid);
  if (&scratch->ops() != &ops || scratch->size() < bytes) {
    // Earlier work may still use the old buffer (an empty one has none).
    if (!scratch->empty()) FP8RT_RETURN_IF_ERROR(Synchronize(ops));
    scratch->Reset(ops, bytes);
  }
  float* t32 = reinterpret_cast<float*>(scratch->data());
  uint8_t* t_codes = reinterpret_cast<uint8_t*>(t32 + count);
  uint8_t* t_e8m0 = t_codes + count;

  FP8RT_RETURN_IF_ERROR(QuantizeMx32Rows(ops, format, src, rows, cols, codes, e8m0, stats));
  FP8RT_RETURN_IF_ERROR(QuantizeMx32Transposed(ops, format, src, rows, cols, t32, t_codes, t_e8m0));
  FP8RT_RETURN_IF_ERROR(
      ops.layer->transpose_bytes(col_codes, t_codes, cols, rows, kernels::Stream{}));
  const kernels::ScaleGrid tg = kernels::GetScaleGrid(Granularity::kMx32, cols, rows);
  return ops.layer->transpose_bytes(col_e8m0, t_e8m0, tg.rows, tg.cols, kernels::Stream{});
}

absl::Status QuantizeMx32Shard(const kernels::OpTable& ops, const float* shard, int64_t rows,
                               int64_t cols, kernels::Fp8Format format, Fp8Shard* out,
                               bool wait, kernels::DeviceArray<std::byte>* scratch) {
  constexpr const char* kFn = "QuantizeMx32Shard";
  if (out == nullptr) return absl::InvalidArgumentError(absl::StrCat(kFn, ": out is null"));
  if (rows <= 0 || rows % kernels::kMx32BlockSize != 0) {
    return absl::InvalidArgumentError(
        absl::StrCat(kFn,
                     ": rows must be a positive multiple of 32 with mx32 scaling (shards are whole "
                     "32-row blocks of the column-wise copy), got ",
                     rows));
  }
  out->rows = rows;
  out->cols = cols;
  out->block = false;
  out->mx32 = true;
  out->scale = 1.0f;
  out->codes.Reset(ops, static_cast<size_t>(rows * cols));
  out->col_codes.Reset(ops, static_cast<size_t>(rows * cols));
  out->e8m0.Reset(
      ops, static_cast<size_t>(kernels::GetScaleGrid(Granularity::kMx32, rows, cols).size()));
  out->col_e8m0.Reset(ops, static_cast<size_t>(rows / kernels::kMx32BlockSize * cols));
  out->scale_inv.clear();
  out->stats_out.Reset(ops, 1);
  kernels::DeviceArray<std::byte> own(ops, kernels::MemCategory::kScratch);
  FP8RT_RETURN_IF_ERROR(QuantizeMx32Both(
      ops, shard, rows, cols, format, out->codes.data(), out->e8m0.data(), out->col_codes.data(),
      out->col_e8m0.data(), out->stats_out.device(), scratch != nullptr ? scratch : &own));
  FP8RT_RETURN_IF_ERROR(out->stats_out.Download(kernels::Stream{}));
  if (!wait) return absl::OkStatus();
  FP8RT_RETURN_IF_ERROR(Synchronize(ops));
  ReadShardStats(out);
  return absl::OkStatus();
}

absl::Status StartGatherFp8Shard(Communicator& group, const kernels::OpTable& ops,
                                 const Fp8Shard& shard, Fp8Weight* out,
                                 std::vector<std::unique_ptr<PendingCollective>>* pending) {
  if (out == nullptr || pending == nullptr) {
    return absl::InvalidArgumentError("StartGatherFp8Shard: out and pending must not be null");
  }
  if (shard.codes.size() != static_cast<size_t>(shard.rows * shard.cols) || shard.rows <= 0) {
    return absl::InvalidArgumentError(absl::StrCat("StartGatherFp8Shard: the shard holds ",
                                                   shard.codes.size(), " codes for ", shard.rows,
                                                   " x ", shard.cols, " (quantize it first)"));
  }
  const int64_t n = group.size();
  out->rows = shard.rows * n;
  out->cols = shard.cols;
  out->shard_stats = shard.stats;
  out->amax = shard.stats.amax;
  out->codes.Reset(ops, shard.codes.size() * static_cast<size_t>(n));
  out->scale_inv.Reset(ops, shard.scale_inv.size() * static_cast<size_t>(shard.block ? n : 1));
  if (shard.mx32) {
    // Both quantizations and their grids: each is whole rows (32-row blocks) of the full one.
    const kernels::DeviceArray<uint8_t>* from[] = {&shard.e8m0, &shard.col_codes, &shard.col_e8m0};
    kernels::DeviceArray<uint8_t>* to[] = {&out->e8m0, &out->col_codes, &out->col_e8m0};
    for (int i = 0; i < 3; ++i) to[i]->Reset(ops, from[i]->size() * static_cast<size_t>(n));
    for (int i = 0; i < 4; ++i) {
      const kernels::DeviceArray<uint8_t>& src = i == 0 ? shard.codes : *from[i - 1];
      kernels::DeviceArray<uint8_t>& dst = i == 0 ? out->codes : *to[i - 1];
      FP8RT_ASSIGN_OR_RETURN(std::unique_ptr<PendingCollective> g,
                             group.StartAllGather(src.data(), static_cast<int64_t>(src.size()),
                                                  dst.data(), DType::kU8));
      pending->push_back(std::move(g));
    }
    return absl::OkStatus();
  }
  if (!shard.block) {
    FP8RT_RETURN_IF_ERROR(
        ops.layer->copy(out->scale_inv.data(), shard.scale_inv.data(), 1, kernels::Stream{}));
  }
  // No wait for the backend: the CPU ops have run by now (MPI sends what they wrote), and NCCL's
  // gather starts after the work queued on the default stream (StartAllGather records an event
  // there for its side stream).
  FP8RT_ASSIGN_OR_RETURN(
      std::unique_ptr<PendingCollective> codes,
      group.StartAllGather(shard.codes.data(), static_cast<int64_t>(shard.codes.size()),
                           out->codes.data(), DType::kU8));
  pending->push_back(std::move(codes));
  if (shard.block) {
    FP8RT_ASSIGN_OR_RETURN(
        std::unique_ptr<PendingCollective> scales,
        group.StartAllGather(shard.scale_inv.data(), static_cast<int64_t>(shard.scale_inv.size()),
                             out->scale_inv.data(), DType::kF32));
    pending->push_back(std::move(scales));
  }
  return absl::OkStatus();
}

namespace {

// GatherBf16's first half: the arguments checked, then this rank's shard converted straight into
// its block of the output, which the all-gather then fills in place. Returns that block.
absl::StatusOr<uint16_t*> ConvertIntoOwnBlock(const char* fn, const Communicator& group,
                                              const kernels::OpTable& ops, const float* shard,
                                              int64_t shard_count, uint16_t* full_bf16) {
  if (shard_count < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat(fn, ": shard_count must be >= 0, got ", shard_count));
  }
  if (shard_count > 0 && (shard == nullptr || full_bf16 == nullptr)) {
    return absl::InvalidArgumentError(
        absl::StrCat(fn, shard == nullptr ? ": shard is null" : ": full_bf16 is null"));
  }
  uint16_t* mine = full_bf16 + group.rank() * shard_count;
  FP8RT_RETURN_IF_ERROR(
      Convert(ops, kernels::InputType::kF32, shard, kernels::InputType::kBF16, mine, shard_count));
  return mine;
}

}  // namespace

absl::Status GatherBf16(Communicator& group, const kernels::OpTable& ops, const float* shard,
                        int64_t shard_count, uint16_t* full_bf16) {
  FP8RT_ASSIGN_OR_RETURN(uint16_t * mine, ConvertIntoOwnBlock("GatherBf16", group, ops, shard,
                                                              shard_count, full_bf16));
  return group.AllGather(mine, shard_count, full_bf16, DType::kBF16);
}

absl::StatusOr<std::unique_ptr<PendingCollective>> StartGatherBf16(Communicator& group,
                                                                   const kernels::OpTable& ops,
                                                                   const float* shard,
                                                                   int64_t shard_count,
                                                                   uint16_t* full_bf16) {
  // No wait for the backend: the CPU ops have run by now, and NCCL's gather starts after the work
  // queued on the default stream.
  FP8RT_ASSIGN_OR_RETURN(uint16_t * mine, ConvertIntoOwnBlock("StartGatherBf16", group, ops, shard,
                                                              shard_count, full_bf16));
  return group.StartAllGather(mine, shard_count, full_bf16, DType::kBF16);
}

namespace {

// At least `count` elements of `ops`'s memory in `a`: kept when already that large (buffers
// shared by parameters of different sizes are sized by the largest), replaced otherwise.
template <typename T>
void Grow(const kernels::OpTable& ops, size_t count, kernels::DeviceArray<T>* a) {
  if (&a->ops() == &ops && a->size() >= count) return;
  a->Reset(ops, count);
}

}  // namespace

absl::StatusOr<PendingGradReduce> StartReduceScatterGrad(
    Communicator& group, const kernels::OpTable& ops, const float* full_grad, int64_t shard_count,
    GradReduceDType dtype, bool accumulate, float* shard_grad, GradReduceBuffers* buffers) {
  constexpr const char* kFn = "ReduceScatterGrad";
  if (shard_count < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat(kFn, ": shard_count must be >= 0, got ", shard_count));
  }
  if (shard_count > 0 && full_grad == nullptr) {
    return absl::InvalidArgumentError(absl::StrCat(kFn, ": full_grad is null"));
  }
  if (shard_count > 0 && shard_grad == nullptr) {
    return absl::InvalidArgumentError(absl::StrCat(kFn, ": shard_grad is null"));
  }
  if (dtype != GradReduceDType::kFP32 && dtype != GradReduceDType::kBF16) {
    return absl::InvalidArgumentError(
        absl::StrCat(kFn, ": dtype must be bf16 or fp32, got ", static_cast<int>(dtype)));
  }
  PendingGradReduce r;
  r.ops_ = &ops;
  r.shard_count_ = shard_count;
  r.dtype_ = dtype;
  r.accumulate_ = accumulate;
  r.shard_grad_ = shard_grad;
  if (buffers == nullptr) r.own_ = std::make_unique<GradReduceBuffers>();
  r.buffers_ = buffers != nullptr ? buffers : r.own_.get();
  GradReduceBuffers& b = *r.buffers_;
  const int64_t full_count = shard_count * group.size();
  absl::StatusOr<std::unique_ptr<PendingCollective>> started;
  if (dtype == GradReduceDType::kFP32) {
    // The first reduction writes the shard directly; an accumulating one reduces beside it.
    float* out = shard_grad;
    if (accumulate) {
      Grow(ops, static_cast<size_t>(shard_count), &b.reduced_f32);
      out = b.reduced_f32.data();
    }
    started = group.StartReduceScatter(full_grad, out, shard_count, DType::kF32, ReduceOp::kSum);
  } else {
    Grow(ops, static_cast<size_t>(full_count), &b.send_bf16);
    FP8RT_RETURN_IF_ERROR(Convert(ops, kernels::InputType::kF32, full_grad,
                                  kernels::InputType::kBF16, b.send_bf16.data(), full_count));
    Grow(ops, static_cast<size_t>(shard_count), &b.reduced_bf16);
    if (accumulate) Grow(ops, static_cast<size_t>(shard_count), &b.reduced_f32);
    started = group.StartReduceScatter(b.send_bf16.data(), b.reduced_bf16.data(), shard_count,
                                       DType::kBF16, ReduceOp::kSum);
  }
  if (!started.ok()) return started.status();
  r.pending_ = *std::move(started);
  return r;
}

absl::Status PendingGradReduce::Finish() {
  if (finished_) return status_;
  finished_ = true;
  if (pending_ == nullptr) {
    status_ = absl::FailedPreconditionError("PendingGradReduce::Finish on a moved-from handle");
    return status_;
  }
  status_ = pending_->WaitStreamOrdered();
  if (!status_.ok()) return status_;
  const kernels::OpTable& ops = *ops_;
  GradReduceBuffers& b = *buffers_;
  if (dtype_ == GradReduceDType::kBF16) {
    float* out = accumulate_ ? b.reduced_f32.data() : shard_grad_;
    status_ = Convert(ops, kernels::InputType::kBF16, b.reduced_bf16.data(),
                      kernels::InputType::kF32, out, shard_count_);
  }
  if (status_.ok() && accumulate_) {
    status_ = Accumulate(ops, shard_grad_, b.reduced_f32.data(), shard_count_);
  }
  return status_;
}

absl::Status ReduceScatterGrad(Communicator& group, const kernels::OpTable& ops,
                               const float* full_grad, int64_t shard_count, GradReduceDType dtype,
                               bool accumulate, float* shard_grad, GradReduceBuffers* buffers) {
  absl::StatusOr<PendingGradReduce> started = StartReduceScatterGrad(
      group, ops, full_grad, shard_count, dtype, accumulate, shard_grad, buffers);
  if (!started.ok()) return started.status();
  return started->Finish();
}

absl::StatusOr<std::vector<int64_t>> ExchangeTokenCounts(Communicator& group,
                                                         std::span<const int64_t> send_counts) {
  int64_t total = 0;
  if (absl::Status s =
          CheckCounts(group, send_counts, "send_counts", "ExchangeTokenCounts", &total);
      !s.ok()) {
    return s;
  }
  const auto n = static_cast<size_t>(group.size());
  std::vector<int64_t> ones(n, 1), displs(n);
  for (size_t r = 0; r < n; ++r) displs[r] = static_cast<int64_t>(r);
  std::vector<int64_t> recv_counts(n);
  FP8RT_RETURN_IF_ERROR(group.AllToAllV(send_counts.data(), ones, displs, recv_counts.data(), ones,
                                        displs, DType::kI64));
  for (size_t r = 0; r < n; ++r) {
    if (recv_counts[r] < 0) {
      return absl::DataLossError(absl::StrCat("ExchangeTokenCounts: rank ", r, " of group '",
                                              group.name(), "' sent a negative token count ",
                                              recv_counts[r]));
    }
  }
  return recv_counts;
}

absl::StatusOr<Fp8Tokens> AllToAllFp8Tokens(Communicator& group, const kernels::OpTable& ops,
                                            const float* tokens, int64_t hidden,
                                            std::span<const int64_t> send_counts,
                                            Fp8Format format) {
  Fp8Tokens out;
  TokenScratch scratch;
  FP8RT_RETURN_IF_ERROR(
      AllToAllFp8TokensInto(group, ops, tokens, hidden, send_counts, format, &scratch, &out));
  int64_t send_tokens = 0;
  for (int64_t c : send_counts) send_tokens += c;
  // The host reads what came in and the statistics: after the device is done (the all-to-alls
  // are stream-ordered) and the group says they succeeded.
  FP8RT_RETURN_IF_ERROR(Synchronize(ops));
  FP8RT_RETURN_IF_ERROR(group.CheckStreamOrdered());
  if (send_tokens > 0) out.send_stats = scratch.send_stats[0];
  return out;
}

absl::Status AllToAllFp8TokensInto(Communicator& group, const kernels::OpTable& ops,
                                   const float* tokens, int64_t hidden,
                                   std::span<const int64_t> send_counts, Fp8Format format,
                                   TokenScratch* scratch, Fp8Tokens* out,
                                   std::span<const int64_t> recv_counts) {
  constexpr const char* kFn = "AllToAllFp8Tokens";
  if (scratch == nullptr || out == nullptr) {
    return absl::InvalidArgumentError(absl::StrCat(kFn, ": scratch and out must not be null"));
  }
  if (hidden <= 0) {
    return absl::InvalidArgumentError(absl::StrCat(kFn, ": hidden must be > 0, got ", hidden));
  }
  if (absl::Status s = CheckFormat(format, kFn); !s.ok()) return s;
  int64_t send_tokens = 0;
  if (absl::Status s = CheckCounts(group, send_counts, "send_counts", kFn, &send_tokens); !s.ok()) {
    return s;
  }
  if (send_tokens > 0 && tokens == nullptr) {
    return absl::InvalidArgumentError(absl::StrCat(kFn, ": tokens is null"));
  }
  if (absl::Status s = CheckOp(reinterpret_cast<const void*>(ops.quantize), ops, "quantize", kFn);
      !s.ok()) {
    return s;
  }

  if (recv_counts.empty()) {
    absl::StatusOr<std::vector<int64_t>> exchanged = ExchangeTokenCounts(group, send_counts);
    if (!exchanged.ok()) return exchanged.status();
    out->recv_counts = *std::move(exchanged);
  } else {
    int64_t recv_tokens = 0;
    if (absl::Status s = CheckCounts(group, recv_counts, "recv_counts", kFn, &recv_tokens);
        !s.ok()) {
      return s;
    }
    out->recv_counts.assign(recv_counts.begin(), recv_counts.end());
  }
  out->tokens = 0;
  for (int64_t c : out->recv_counts) out->tokens += c;

  // All outgoing tokens as one (send_tokens x hidden) matrix: 1x128 tiles never straddle rows,
  // so each token's scales are its own whichever rank it goes to.
  const int64_t tiles = kernels::GetScaleGrid(Granularity::kTile1x128, 1, hidden).cols;
  scratch->send_codes.Grow(ops, static_cast<size_t>(send_tokens * hidden));
  scratch->send_scale_inv.Grow(ops, static_cast<size_t>(send_tokens * tiles));
  if (send_tokens > 0) {
    scratch->send_stats.Grow(ops, 1);
    kernels::QuantizeArgs q;
    q.format = format;
    q.granularity = Granularity::kTile1x128;
    q.input_type = kernels::InputType::kF32;
    q.input = tokens;
    q.rows = send_tokens;
    q.cols = hidden;
    q.codes = scratch->send_codes.data();
    q.scale_inv = scratch->send_scale_inv.data();
    q.stats = scratch->send_stats.device();
    FP8RT_RETURN_IF_ERROR(ops.quantize(q, kernels::Stream{}));
    FP8RT_RETURN_IF_ERROR(scratch->send_stats.Download(kernels::Stream{}, 1));
  }

  out->codes.Grow(ops, static_cast<size_t>(out->tokens * hidden));
  out->scale_inv.Grow(ops, static_cast<size_t>(out->tokens * tiles));
  const AllToAllLayout send_c = RowsLayout(send_counts, hidden);
  const AllToAllLayout recv_c = RowsLayout(out->recv_counts, hidden);
  // Stream-ordered: only the device's later work (the experts' GEMMs) reads the rows.
  if (absl::Status s = group.AllToAllV(scratch->send_codes.data(), send_c.counts, send_c.displs,
                                       out->codes.data(), recv_c.counts, recv_c.displs, DType::kU8,
                                       Completion::kStream);
      !s.ok()) {
    return s;
  }
  const AllToAllLayout send_s = RowsLayout(send_counts, tiles);
  const AllToAllLayout recv_s = RowsLayout(out->recv_counts, tiles);
  return group.AllToAllV(scratch->send_scale_inv.data(), send_s.counts, send_s.displs,
                         out->scale_inv.data(), recv_s.counts, recv_s.displs, DType::kF32,
                         Completion::kStream);
}

absl::Status AllToAllBf16Tokens(Communicator& group, const kernels::OpTable& ops,
                                const float* tokens, int64_t hidden,
                                std::span<const int64_t> send_counts,
                                std::span<const int64_t> recv_counts, float* out,
                                TokenScratch* scratch) {
  constexpr const char* kFn = "AllToAllBf16Tokens";
  if (hidden <= 0) {
    return absl::InvalidArgumentError(absl::StrCat(kFn, ": hidden must be > 0, got ", hidden));
  }
  int64_t send_tokens = 0, recv_tokens = 0;
  if (absl::Status s = CheckCounts(group, send_counts, "send_counts", kFn, &send_tokens); !s.ok()) {
    return s;
  }
  if (absl::Status s = CheckCounts(group, recv_counts, "recv_counts", kFn, &recv_tokens); !s.ok()) {
    return s;
  }
  if (send_tokens > 0 && tokens == nullptr) {
    return absl::InvalidArgumentError(absl::StrCat(kFn, ": tokens is null"));
  }
  if (recv_tokens > 0 && out == nullptr) {
    return absl::InvalidArgumentError(absl::StrCat(kFn, ": out is null"));
  }

  TokenScratch local;
  if (scratch == nullptr) scratch = &local;
  const int64_t send_elems = send_tokens * hidden;
  kernels::DeviceArray<uint16_t>& send = scratch->send_bf16;
  send.Grow(ops, static_cast<size_t>(send_elems));
  FP8RT_RETURN_IF_ERROR(Convert(ops, kernels::InputType::kF32, tokens, kernels::InputType::kBF16,
                                send.data(), send_elems));
  const int64_t recv_elems = recv_tokens * hidden;
  kernels::DeviceArray<uint16_t>& recv = scratch->recv_bf16;
  recv.Grow(ops, static_cast<size_t>(recv_elems));
  const AllToAllLayout send_l = RowsLayout(send_counts, hidden);
  const AllToAllLayout recv_l = RowsLayout(recv_counts, hidden);
  // Stream-ordered: the conversion below, on the device, is what reads the rows.
  if (absl::Status s =
          group.AllToAllV(send.data(), send_l.counts, send_l.displs, recv.data(), recv_l.counts,
                          recv_l.displs, DType::kBF16, Completion::kStream);
      !s.ok()) {
    return s;
  }
  return Convert(ops, kernels::InputType::kBF16, recv.data(), kernels::InputType::kF32, out,
                 recv_elems);
}

}  // namespace fp8rt::parallel
