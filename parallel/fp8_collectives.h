// FP8-aware collectives: the operations that let ranks agree on every FP8 scale and move half
// the bytes of BF16 (DESIGN.md section 4).
//
// Index:
//   SyncAmaxes            all amaxes of one step in one MAX all-reduce; NaN reaches every rank
//   GatherFp8Weight       FSDP all-gather of a weight in FP8 (shared tensor scale or 128x128
//                         block scales) straight from FP32 master shards
//   Fp8Shard, QuantizeFp8Shard, StartGatherFp8Shard
//                         FSDP with persistent FP8 shards: each rank quantizes its rows once
//                         per step, and every gather of the step moves those bytes only
//   GatherBf16, StartGatherBf16
//                         FSDP all-gather in BF16 (the baseline FP8 weight gathers are
//                         measured against), blocking or started
//   ReduceScatterGrad     gradient reduce-scatter in BF16 or FP32 into FP32 shards
//   StartReduceScatterGrad, PendingGradReduce
//                         the same, started: it overlaps the backward of the layers below
//   ExchangeTokenCounts, AllToAllFp8Tokens, AllToAllBf16Tokens
//                         MoE dispatch (FP8 with one scale per 1x128 tile of each token) and
//                         combine (BF16); the backward pass uses the same calls reversed
//
// All calls are collective over the given communicator and must be made in the same order on
// every rank of it. They run kernels (quantization, FP32 <-> BF16 conversion) through the given
// op table on its default stream (kernels::Stream{}).
//
// Memory: every tensor these calls hand to the communicator or to an op is memory of the op
// table's backend (kernels::DeviceArray: host memory on the CPU, CUDA managed memory on CUDA),
// and so are the FP8 codes and scales they return (in the placement of the caller's arrays
// where it passes them: the MoE layer's are device-only, stream-ordered device memory); values
// the host reads back from an op (statistics, an amax) are read after ops.layer->synchronize. The
// few host values that travel (the amaxes of SyncAmaxes, token counts) go as host buffers, which
// every communicator takes (NCCL stages them through device memory). The same calls therefore work
// with the CPU ops and the MPI communicator and with the CUDA ops and the NCCL communicator. The
// caller's pointers (shards, gradients, tokens, outputs) must be memory of that backend which the
// communicator can use; spans of counts and the amaxes of SyncAmaxes are host memory. Outputs that
// an op writes last (the BF16 -> FP32 conversions, the accumulation of ReduceScatterGrad) may still
// be in flight on the op table's default stream when a call returns: later ops on that stream see
// them, the host reads them after ops.layer->synchronize. Returned host values (amaxes, statistics,
// counts) are final.
#ifndef FP8RT_PARALLEL_FP8_COLLECTIVES_H_
#define FP8RT_PARALLEL_FP8_COLLECTIVES_H_

#include <cstdint>
#include <memory>
#include <span>
#include <vector>

#include "absl/status/statusor.h"
#include "kernels/device_array.h"
#include "kernels/host_mirror.h"
#include "kernels/ops.h"
#include "parallel/communicator.h"

namespace fp8rt::parallel {

// Replaces each amax with its MAX over the group, in one collective. The reduction runs on the
// integer bits of |amax|, which order NaN above Inf above every finite value, so one NaN on one
// rank makes that site NaN on every rank, whatever the backend's float MAX does with NaN.
// Returns the indices of sites whose reduced amax is not finite (the step must be reported and
// skipped by the caller).
// `amaxes` is host memory, and so is the buffer that travels: every communicator takes host
// buffers (NCCL stages them through device memory).
absl::StatusOr<std::vector<int>> SyncAmaxes(Communicator& group, std::span<float> amaxes);

enum class WeightScaling : uint8_t {
  kTensorGiven,    // one scale given by the caller (delayed scaling, already agreed)
  kTensorCurrent,  // one scale from the amax of the whole weight: amax sync, then quantize
  kBlock128,       // 128x128 block scales: no sync needed; shard rows must be a multiple of 128
};

struct Fp8GatherOptions {
  kernels::Fp8Format format = kernels::Fp8Format::kE4M3;
  WeightScaling scaling = WeightScaling::kTensorCurrent;
  float scale = 1.0f;  // kTensorGiven
  int margin = 0;      // kTensorCurrent and kBlock128
};

// The full weight in FP8 after a gather, ready for the GEMM (as its B operand: rows = N, cols = K).
// codes and scale_inv are memory of the op table of the call that filled them, which must
// outlive them (a default-constructed weight holds empty CPU arrays); shard_stats and amax are
// host values.
//
// MXFP8 (mx32) weights hold two quantizations of the same values, both from the FP32 master
// (OCP MX v1.0 quantizes along the GEMM's K, which is the column index for the forward's W and
// the row index for the input gradient's W^T; requantizing one copy from the other would round
// twice): `codes` with `e8m0` (one E8M0 scale per 1x32 block along a row) and `col_codes` with
// `col_e8m0` (one per 32x1 block down a column), both in W's row-major layout, so that a shard of
// whole 32-row blocks gathers like the codes (the grids in rank order are the full grids).
// scale_inv is empty for mx32.
struct Fp8Weight {
  int64_t rows = 0;
  int64_t cols = 0;
  kernels::DeviceArray<uint8_t> codes;      // rows x cols
  kernels::DeviceArray<float> scale_inv;    // 1 value (tensor) or ceil(rows/128) x ceil(cols/128)
  kernels::DeviceArray<uint8_t> e8m0;       // mx32: rows x ceil(cols/32)
  kernels::DeviceArray<uint8_t> col_codes;  // mx32: rows x cols, 32x1 blocks
  kernels::DeviceArray<uint8_t> col_e8m0;   // mx32: ceil(rows/32) x cols
  kernels::QuantStats shard_stats;          // statistics of this rank's shard
  float amax = 0.0f;  // kTensorCurrent: the synced amax; otherwise this shard's amax

  // Where the ops of a gather write the shard's statistics and amax (device memory), and their
  // copies for the host (kernels::HostMirror): kept with the weight so that a gather every step
  // allocates nothing.
  kernels::HostMirror<kernels::QuantStats> stats_out;
  kernels::HostMirror<float> amax_out;
};

// Sizes `weight`'s codes and scale_inv to `code_count` and `scale_count` elements of `ops`'s
// memory, of unspecified value (kernels::DeviceArray::Reset: the memory is kept when the backend
// and the size are unchanged). For callers that quantize into a weight themselves;
// GatherFp8WeightInto does this.
void ResizeFp8Weight(const kernels::OpTable& ops, size_t code_count, size_t scale_count,
                     Fp8Weight* weight);

// Each rank holds rows [rank * shard_rows, (rank + 1) * shard_rows) of a
// (size * shard_rows) x cols FP32 master weight. Each rank quantizes its own shard and the group
// all-gathers the FP8 bytes (and the block scales): the weight is never materialised in BF16.
// Every rank ends with identical codes and scales, equal to quantizing the unsharded weight
// with the same scale(s).
absl::StatusOr<Fp8Weight> GatherFp8Weight(Communicator& group, const kernels::OpTable& ops,
                                          const float* shard, int64_t shard_rows, int64_t cols,
                                          const Fp8GatherOptions& options);
// The same into a caller-owned weight whose buffers are reused (no reallocation when the shape
// is unchanged, as in a training loop). This rank quantizes straight into its rows of the full
// buffers, which the all-gather then fills in place. The buffers move to `ops`'s memory when they
// belonged to another op table (ResizeFp8Weight).
absl::Status GatherFp8WeightInto(Communicator& group, const kernels::OpTable& ops,
                                 const float* shard, int64_t shard_rows, int64_t cols,
                                 const Fp8GatherOptions& options, Fp8Weight* out);

// This rank's FP8 shard of an FSDP-sharded FP8 weight: its rows x cols FP32 master rows quantized
// (tensor scale, or 128x128 blocks: rows a multiple of 128). Kept across the step, so that the
// weight's gathers for the forward and the backward of every micro-batch move FP8 bytes and
// quantize nothing. codes and scale_inv are memory of the op table that filled them.
//
// mx32: rows a multiple of 32, both quantizations of Fp8Weight (codes/e8m0, col_codes/col_e8m0).
struct Fp8Shard {
  int64_t rows = 0;
  int64_t cols = 0;
  bool block = false;
  bool mx32 = false;
  float scale = 1.0f;                     // tensor scaling: the scale of the codes
  kernels::DeviceArray<uint8_t> codes;    // rows x cols
  kernels::DeviceArray<float> scale_inv;  // 1 value (tensor) or the shard's 128x128 grid
  kernels::DeviceArray<uint8_t> e8m0, col_codes, col_e8m0;  // mx32 (see Fp8Weight)
  kernels::QuantStats stats;  // of the quantization (host copy, ReadShardStats)
  // Where the op writes them (device()) and their copy for the host, queued by whoever queued the
  // op (QuantizeFp8Shard and QuantizeMx32Shard themselves; the owner of an optimizer update that
  // wrote the shard, before its wait).
  kernels::HostMirror<kernels::QuantStats> stats_out;
};

// Quantizes `rows` x `cols` FP32 `shard` into `out` with tensor scale `scale` (block false) or
// with 128x128 block scales (block true: rows % 128 == 0; scale unused). With `wait` it waits for
// the backend and out->stats is final on return; without, the work is only queued on the default
// stream and the caller, after its own synchronize, reads the statistics (ReadShardStats): one
// wait for many shards. InvalidArgument for bad shapes, format, scale or margin.
absl::Status QuantizeFp8Shard(const kernels::OpTable& ops, const float* shard, int64_t rows,
                              int64_t cols, kernels::Fp8Format format, bool block, float scale,
                              int margin, Fp8Shard* out, bool wait = true);
// QuantizeFp8Shard with tensor scaling whose scale the op computes from `scale_amax` (one float
// of the backend's memory, never read here: an amax agreed across ranks by a stream-ordered
// max-reduce) as kernels::ComputeScale(amax, format, margin, power_of_two), with no host round
// trip. Only queued (no wait); out->scale is 1 until the caller, having read that amax, sets it.
absl::Status QuantizeFp8ShardFromAmax(const kernels::OpTable& ops, const float* shard, int64_t rows,
                                      int64_t cols, kernels::Fp8Format format,
                                      const float* scale_amax, int margin, bool power_of_two,
                                      Fp8Shard* out);
// out->stats = what the quantization wrote (its copy for the host, after the backend has been
// synchronised).
void ReadShardStats(Fp8Shard* out);

// MXFP8 of the transpose: `rows` x `cols` FP32 `src` transposed into `t32` (backend memory of
// rows x cols floats), then quantized with 1x32 blocks along the transpose's rows (src's
// columns): `codes` (cols x rows) and `e8m0` (its scale grid). The operand an mx32 GEMM wants
// along what was src's row dimension (x^T and dy^T along the tokens, W^T along out). Queued on
// the default stream.
absl::Status QuantizeMx32Transposed(const kernels::OpTable& ops, kernels::Fp8Format format,
                                    const float* src, int64_t rows, int64_t cols, float* t32,
                                    uint8_t* codes, uint8_t* e8m0);

// MXFP8 both ways (see Fp8Weight): `rows` x `cols` FP32 `src` into codes and e8m0 (1x32 blocks
// along each row) and into col_codes and col_e8m0 (32x1 blocks down each column; quantized as the
// transpose, whose rows are W's columns, then transposed back: bit for bit the codes and scales
// of quantizing W^T). Every output is memory of `ops` of the sizes Fp8Weight gives. `stats`
// (optional, backend memory) receives the statistics of the row-wise quantization (the values are
// the same either way). Queued on the default stream; `scratch` grows to hold the transposes.
absl::Status QuantizeMx32Both(const kernels::OpTable& ops, const float* src, int64_t rows,
                              int64_t cols, kernels::Fp8Format format, uint8_t* codes,
                              uint8_t* e8m0, uint8_t* col_codes, uint8_t* col_e8m0,
                              kernels::QuantStats* stats, kernels::DeviceArray<std::byte>* scratch);

// QuantizeFp8Shard for mx32: `rows` (a multiple of 32) x `cols` FP32 `shard` into `out` both ways.
// `wait` as for QuantizeFp8Shard. The transposes go through `scratch` (grown as needed; it must
// live until the work is done) or, when null, an array of the call's own, whose release waits for
// the backend on CUDA.
absl::Status QuantizeMx32Shard(const kernels::OpTable& ops, const float* shard, int64_t rows,
                               int64_t cols, kernels::Fp8Format format, Fp8Shard* out,
                               bool wait = true,
                               kernels::DeviceArray<std::byte>* scratch = nullptr);

// Starts the all-gather of every rank's `shard` (the same shape everywhere) into `out`: the FP8
// codes and, with block scaling, the block scales (the shards are whole block rows, so the grids
// in rank order are the full grid); mx32 gathers both quantizations and their E8M0 grids; tensor
// scaling copies the one scale_inv, which every rank has alike. Appends the collectives to
// `pending`: `out` may be used once each has been waited for. `shard` must stay unchanged until
// then. `out`'s buffers keep their memory category.
absl::Status StartGatherFp8Shard(Communicator& group, const kernels::OpTable& ops,
                                 const Fp8Shard& shard, Fp8Weight* out,
                                 std::vector<std::unique_ptr<PendingCollective>>* pending);

// All-gathers `shard_count` FP32 values per rank as BF16 (rounded to nearest even) into
// `full_bf16` (size * shard_count BF16 bits).
absl::Status GatherBf16(Communicator& group, const kernels::OpTable& ops, const float* shard,
                        int64_t shard_count, uint16_t* full_bf16);
// The same gather, started (FSDP's BF16 gathers, which overlap the compute before them): this
// rank's shard is converted into its block of `full_bf16` on the op table's default stream, then
// the gather starts in place (Communicator::StartAllGather). `full_bf16` may be read once the
// returned collective has been waited for. `shard` may be changed by work queued after this on
// the default stream (on the CPU, by anything, at once: the conversion has run).
absl::StatusOr<std::unique_ptr<PendingCollective>> StartGatherBf16(Communicator& group,
                                                                   const kernels::OpTable& ops,
                                                                   const float* shard,
                                                                   int64_t shard_count,
                                                                   uint16_t* full_bf16);

enum class GradReduceDType : uint8_t { kBF16, kFP32 };

// The backend buffers ReduceScatterGrad needs besides its input and output, kept by a caller
// that reduces gradients every step so that nothing is allocated per call. They only grow: one
// set serves gradients of different sizes (the model shares one set among all parameters).
struct GradReduceBuffers {
  kernels::DeviceArray<uint16_t> send_bf16;     // kBF16: the gradient rounded to BF16
  kernels::DeviceArray<uint16_t> reduced_bf16;  // kBF16: the reduced shard
  kernels::DeviceArray<float> reduced_f32;      // accumulate: the reduced shard in FP32
};

// Sums `full_grad` (size * shard_count FP32 values, this rank's contribution to every shard)
// over the group and leaves shard `rank` in `shard_grad`, in FP32: `shard_grad` = the reduced
// values, or += them with `accumulate` (micro-batch accumulation in FP32). With kBF16 the
// gradient travels and is summed as BF16 (FP32 additions rounded once per step).
// `buffers` (optional) holds the temporaries; without it they are allocated for the call.
// The reduce-scatter is stream-ordered (Completion::kStream): with NCCL the call returns once it
// is queued, so the shard is for later ops, for the host after ops.layer->synchronize, and
// trusted only once group.CheckStreamOrdered() is OK.
absl::Status ReduceScatterGrad(Communicator& group, const kernels::OpTable& ops,
                               const float* full_grad, int64_t shard_count, GradReduceDType dtype,
                               bool accumulate, float* shard_grad,
                               GradReduceBuffers* buffers = nullptr);

// A gradient reduction started by StartReduceScatterGrad. Until Finish() returns, neither the
// full gradient, nor the shard gradient, nor the buffers may be touched or freed by the host
// or by work on the default stream; after it, work on the default stream may, and the host once
// it has synchronised the default stream (with NCCL, Finish only orders the stream). Movable,
// not assignable (an assignment could free the buffers of a reduction still running);
// destroying one that was not finished waits for its reduce-scatter (Wait) and skips what
// follows it, which leaves the shard gradient unspecified.
class PendingGradReduce {
 public:
  PendingGradReduce(PendingGradReduce&&) = default;
  PendingGradReduce& operator=(PendingGradReduce&&) = delete;
  ~PendingGradReduce() = default;

  // Whether the reduce-scatter may still be running (PendingCollective::InFlight): false where
  // the backend ran it to completion at the start.
  bool InFlight() const { return !finished_ && pending_ != nullptr && pending_->InFlight(); }
  // Completes it, stream-ordered (PendingCollective::WaitStreamOrdered: with NCCL the default
  // stream waits for the reduce-scatter, the host does not), then queues what follows it (the
  // BF16 -> FP32 conversion, the accumulation into the shard). Returns the first error; later
  // calls return the same.
  absl::Status Finish();

 private:
  friend absl::StatusOr<PendingGradReduce> StartReduceScatterGrad(Communicator&,
                                                                  const kernels::OpTable&,
                                                                  const float*, int64_t,
                                                                  GradReduceDType, bool, float*,
                                                                  GradReduceBuffers*);
  PendingGradReduce() = default;

  const kernels::OpTable* ops_ = nullptr;
  int64_t shard_count_ = 0;
  GradReduceDType dtype_ = GradReduceDType::kFP32;
  bool accumulate_ = false;
  float* shard_grad_ = nullptr;
  std::unique_ptr<GradReduceBuffers> own_;  // without the caller's buffers (before pending_:
  GradReduceBuffers* buffers_ = nullptr;    // destroyed after it, once it has waited)
  std::unique_ptr<PendingCollective> pending_;
  bool finished_ = false;
  absl::Status status_;
};

// ReduceScatterGrad, started with Communicator::StartReduceScatter (same arguments, same
// results once finished): the gradient is converted to BF16 first (kBF16), the reduce-scatter
// started, and the rest happens in PendingGradReduce::Finish. `buffers` (optional) must outlive
// the handle and may not serve another reduction until it is finished.
absl::StatusOr<PendingGradReduce> StartReduceScatterGrad(Communicator& group,
                                                         const kernels::OpTable& ops,
                                                         const float* full_grad,
                                                         int64_t shard_count, GradReduceDType dtype,
                                                         bool accumulate, float* shard_grad,
                                                         GradReduceBuffers* buffers = nullptr);

// MoE: every rank tells every other how many tokens it sends it. Returns recv_counts
// (tokens this rank receives from each rank). Both are host memory, and so are the buffers that
// travel (every communicator takes host buffers; NCCL stages them).
absl::StatusOr<std::vector<int64_t>> ExchangeTokenCounts(Communicator& group,
                                                         std::span<const int64_t> send_counts);

// Tokens received by an all-to-all: `tokens` rows of `hidden` values, grouped by source rank.
// codes and scale_inv are memory of the op table of the call (which must outlive them); the
// rest are host values.
struct Fp8Tokens {
  std::vector<int64_t> recv_counts;       // tokens from each rank
  kernels::DeviceArray<uint8_t> codes;    // tokens x hidden
  kernels::DeviceArray<float> scale_inv;  // tokens x ceil(hidden / 128): one per 1x128 tile
  int64_t tokens = 0;
  kernels::QuantStats send_stats;  // statistics of the quantization of what this rank sent
};

// The token all-to-alls' temporaries, for a caller that moves tokens every micro-batch (the MoE
// layer): kept across calls and grown, never shrunk (kernels::DeviceArray::Grow), so that a
// steady run allocates and frees nothing (on CUDA a free waits for the whole device).
struct TokenScratch {
  kernels::DeviceArray<uint8_t> send_codes;
  kernels::DeviceArray<float> send_scale_inv;
  kernels::HostMirror<kernels::QuantStats> send_stats;  // written by the quantize op
  kernels::DeviceArray<uint16_t> send_bf16, recv_bf16;
};

// Sends tokens (rows of `hidden` FP32 values, grouped by destination rank with send_counts
// tokens for each) in FP8 with one scale per 1x128 tile of each token. Counts go first. Waits for
// the backend to read send_stats.
absl::StatusOr<Fp8Tokens> AllToAllFp8Tokens(Communicator& group, const kernels::OpTable& ops,
                                            const float* tokens, int64_t hidden,
                                            std::span<const int64_t> send_counts,
                                            kernels::Fp8Format format);
// The same into `out`, whose codes and scale_inv are grown (they may hold more than `tokens`
// rows), with the temporaries in `scratch`; leaves out->send_stats alone (the statistics stay in
// scratch->send_stats, in the backend's memory). The token all-to-alls are stream-ordered
// (Completion::kStream): with NCCL and device buffers the call returns once they are on the
// device's queue, so the rows are for the device's later work; the host reads them after a
// synchronisation and group.CheckStreamOrdered(). Waits on the host only for the count exchange.
// `recv_counts`, when given (one entry per rank), is the rows each peer sends, which the caller
// already knows (MoE's per-expert count exchange): the count exchange is then skipped, one
// collective and one host wait fewer. They must be what the peers send.
absl::Status AllToAllFp8TokensInto(Communicator& group, const kernels::OpTable& ops,
                                   const float* tokens, int64_t hidden,
                                   std::span<const int64_t> send_counts, kernels::Fp8Format format,
                                   TokenScratch* scratch, Fp8Tokens* out,
                                   std::span<const int64_t> recv_counts = {});

// Sends tokens (rows of `hidden` FP32 values, grouped by destination) as BF16; `recv_counts`
// must be what the peers send (e.g. the send_counts of the matching dispatch, reversed). The
// received rows are written to `out` as FP32 (exact BF16 values), stream-ordered as above.
// Without `scratch` the call's own temporaries are freed at its end; on CUDA that free waits for
// the device (managed memory), so the call then completes before it returns: a caller that moves
// tokens every micro-batch passes `scratch`.
absl::Status AllToAllBf16Tokens(Communicator& group, const kernels::OpTable& ops,
                                const float* tokens, int64_t hidden,
                                std::span<const int64_t> send_counts,
                                std::span<const int64_t> recv_counts, float* out,
                                TokenScratch* scratch = nullptr);

}  // namespace fp8rt::parallel

#endif  // FP8RT_PARALLEL_FP8_COLLECTIVES_H_
