// fp8rt-bench-comm: the MPI side of `fp8rt bench comm --np N`. Every rank runs the same
// collectives; rank 0 prints one JSON object. Measured in one run, per DESIGN.md section 8:
//   FSDP gather of a 64M-parameter model (16 weights of 2048 x 2048): FP8 (tensor and 128x128
//     block scales, quantization of the shard included) vs BF16 (rounding included); and the
//     training step's gather (fsdp_gather_step): persistent FP8 shards quantized once per step
//     outside the gather, FP8 bytes only on the gather path, nonblocking gathers of one unit,
//     against the BF16 gathers of one unit started the same way (fsdp_gather: bf16);
//   MoE dispatch of 8192 tokens x 1024 per rank: FP8 with 1x128 scales vs BF16;
//   gradient reduce-scatter of the same 64M parameters: BF16 vs FP32.
// Bytes are what this rank sent into the collectives (Communicator::stats()); times are the
// slowest rank's, best of --repeats.
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <functional>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "CLI/CLI.hpp"
#include "kernels/ops.h"
#include "nlohmann/json.hpp"
#include "parallel/fp8_collectives.h"
#include "parallel/mpi/mpi_communicator.h"

namespace fp8rt::bench {
namespace {

using parallel::Communicator;
using parallel::DType;

struct Measured {
  double seconds = 0.0;  // slowest rank, fastest repeat
  int64_t bytes = 0;     // bytes this rank sent per repeat
};

// Runs `body` `repeats` times between barriers; returns the best of the per-repeat maxima over
// ranks, and the bytes one repeat sent through `counted`.
absl::StatusOr<Measured> Measure(Communicator& world, Communicator& counted, int repeats,
                                 const std::function<absl::Status()>& body) {
  Measured m;
  m.seconds = 1e30;
  for (int r = 0; r < repeats; ++r) {
    if (absl::Status s = world.Barrier(); !s.ok()) return s;
    const int64_t before = counted.stats().TotalBytes();
    const auto t0 = std::chrono::steady_clock::now();
    if (absl::Status s = body(); !s.ok()) return s;
    float elapsed = std::chrono::duration<float>(std::chrono::steady_clock::now() - t0).count();
    m.bytes = counted.stats().TotalBytes() - before;
    if (absl::Status s = world.AllReduce(&elapsed, 1, DType::kF32, parallel::ReduceOp::kMax);
        !s.ok()) {
      return s;
    }
    m.seconds = std::min(m.seconds, static_cast<double>(elapsed));
  }
  return m;
}

std::vector<float> Normal(int64_t n, uint32_t seed) {
  std::mt19937 gen(seed);
  std::normal_distribution<float> dist(0.0f, 0.02f);
  std::vector<float> v(static_cast<size_t>(n));
  for (float& x : v) x = dist(gen);
  return v;
}

nlohmann::ordered_json Pair(const char* a_name, const Measured& a, const char* b_name,
                            const Measured& b) {
  nlohmann::ordered_json j;
  j[std::string(a_name) + "_bytes"] = a.bytes;
  j[std::string(b_name) + "_bytes"] = b.bytes;
  j["byte_ratio"] = static_cast<double>(a.bytes) / static_cast<double>(b.bytes);
  j[std::string(a_name) + "_s"] = a.seconds;
  j[std::string(b_name) + "_s"] = b.seconds;
  j["time_ratio"] = a.seconds / b.seconds;
  return j;
}

absl::StatusOr<nlohmann::ordered_json> Run(Communicator& world, int repeats) {
  const kernels::OpTable& ops = kernels::CpuOps();
  const int p = world.size();
  constexpr int kWeights = 16;
  constexpr int64_t kRows = 2048, kCols = 2048;
  if (kRows % (128 * p) != 0) {
    return absl::InvalidArgumentError("--np must divide 16 (2048 rows in 128-row shards)");
  }
  const int64_t shard_rows = kRows / p;
  std::vector<std::vector<float>> shards;
  for (int w = 0; w < kWeights; ++w) {
    shards.push_back(Normal(shard_rows * kCols, 7919u * static_cast<uint32_t>(w) +
                                                    static_cast<uint32_t>(world.rank())));
  }
  nlohmann::ordered_json out;
  out["benchmark"] = "comm";
  out["np"] = p;
  out["params"] = kWeights * kRows * kCols;

  // FSDP gather.
  parallel::Fp8GatherOptions tensor{.scaling = parallel::WeightScaling::kTensorGiven,
                                    .scale = 448.0f / 0.1f};
  parallel::Fp8GatherOptions block{.scaling = parallel::WeightScaling::kBlock128};
  // Gathered weights live in buffers reused from step to step, as in training.
  std::vector<uint16_t> full_bf16(static_cast<size_t>(kRows * kCols));
  parallel::Fp8Weight gathered;
  auto gather_all = [&](const parallel::Fp8GatherOptions& options) {
    return Measure(world, world, repeats, [&]() -> absl::Status {
      for (const auto& s : shards) {
        if (absl::Status st = parallel::GatherFp8WeightInto(world, ops, s.data(), shard_rows, kCols,
                                                            options, &gathered);
            !st.ok()) {
          return st;
        }
      }
      return absl::OkStatus();
    });
  };
  auto fp8 = gather_all(tensor);
  if (!fp8.ok()) return fp8.status();
  auto fp8_block = gather_all(block);
  if (!fp8_block.ok()) return fp8_block.status();
  auto bf16 = Measure(world, world, repeats, [&]() -> absl::Status {
    for (const auto& s : shards) {
      if (absl::Status st =
              parallel::GatherBf16(world, ops, s.data(), shard_rows * kCols, full_bf16.data());
          !st.ok()) {
        return st;
      }
    }
    return absl::OkStatus();
  });
  if (!bf16.ok()) return bf16.status();
  out["fsdp_gather"] = Pair("fp8", *fp8, "bf16", *bf16);
  out["fsdp_gather"]["fp8_block_bytes"] = fp8_block->bytes;
  out["fsdp_gather"]["fp8_block_byte_ratio"] =
      static_cast<double>(fp8_block->bytes) / static_cast<double>(bf16->bytes);
  out["fsdp_gather"]["fp8_block_s"] = fp8_block->seconds;
  out["fsdp_gather"]["fp8_block_time_ratio"] = fp8_block->seconds / bf16->seconds;

  // The training step's gather (ZeRO-3 with persistent FP8 shards): each shard is quantized once
  // per step outside the gather (by the optimizer's update pass or BeginStep), and each of the
  // step's gathers moves FP8 bytes only; the 16 weights' gathers are started together and then
  // waited for, as one FSDP unit's are. Against the same BF16 gather (rounding included).
  std::vector<parallel::Fp8Shard> fp8_shards(kWeights);
  std::vector<parallel::Fp8Weight> unit(kWeights);
  for (int w = 0; w < kWeights; ++w) {
    if (absl::Status st = parallel::QuantizeFp8Shard(ops, shards[static_cast<size_t>(w)].data(),
                                                     shard_rows, kCols, kernels::Fp8Format::kE4M3,
                                                     /*block=*/false, 448.0f / 0.1f, 0,
                                                     &fp8_shards[static_cast<size_t>(w)]);
        !st.ok()) {
      return st;
    }
  }
  auto fp8_shard = Measure(world, world, repeats, [&]() -> absl::Status {
    std::vector<std::unique_ptr<parallel::PendingCollective>> pending;
    for (int w = 0; w < kWeights; ++w) {
      if (absl::Status st = parallel::StartGatherFp8Shard(
              world, ops, fp8_shards[static_cast<size_t>(w)], &unit[static_cast<size_t>(w)],
              &pending);
          !st.ok()) {
        return st;
      }
    }
    for (auto& g : pending) {
      if (absl::Status st = g->Wait(); !st.ok()) return st;
    }
    return absl::OkStatus();
  });
  if (!fp8_shard.ok()) return fp8_shard.status();
  // The baseline's step gather (fsdp_gather: bf16) as the model runs it: the 16 BF16 gathers
  // started together, then waited for (each into its own buffer, all in flight at once).
  std::vector<std::vector<uint16_t>> unit_bf16(kWeights, std::vector<uint16_t>(full_bf16.size()));
  auto bf16_started = Measure(world, world, repeats, [&]() -> absl::Status {
    std::vector<std::unique_ptr<parallel::PendingCollective>> pending;
    for (int w = 0; w < kWeights; ++w) {
      const size_t i = static_cast<size_t>(w);
      absl::StatusOr<std::unique_ptr<parallel::PendingCollective>> g = parallel::StartGatherBf16(
          world, ops, shards[i].data(), shard_rows * kCols, unit_bf16[i].data());
      if (!g.ok()) return g.status();
      pending.push_back(*std::move(g));
    }
    for (auto& g : pending) {
      if (absl::Status st = g->Wait(); !st.ok()) return st;
    }
    return absl::OkStatus();
  });
  if (!bf16_started.ok()) return bf16_started.status();
  // Against the faster BF16 form: over MPI the 16 gathers in flight at once are slower than one
  // at a time (measured), on NCCL the started ones overlap the compute.
  out["fsdp_gather_step"] = Pair("fp8_shard", *fp8_shard, "bf16_started", *bf16_started);
  out["fsdp_gather_step"]["bf16_blocking_s"] = bf16->seconds;
  out["fsdp_gather_step"]["time_ratio"] =
      fp8_shard->seconds / std::min(bf16_started->seconds, bf16->seconds);
  out["fsdp_gather_step"]["ratio_definition"] =
      "fp8_shard_s / min(bf16_started_s, bf16_blocking_s)";

  // MoE dispatch: tokens spread evenly over the ranks.
  constexpr int64_t kTokens = 8192, kHidden = 1024;
  const std::vector<float> tokens =
      Normal(kTokens * kHidden, 99u + static_cast<uint32_t>(world.rank()));
  std::vector<int64_t> send_counts(static_cast<size_t>(p), kTokens / p);
  send_counts[0] += kTokens % p;
  std::vector<int64_t> recv_counts;
  std::vector<float> received;
  auto moe_fp8 = Measure(world, world, repeats, [&]() -> absl::Status {
    auto r = parallel::AllToAllFp8Tokens(world, ops, tokens.data(), kHidden, send_counts,
                                         kernels::Fp8Format::kE4M3);
    if (!r.ok()) return r.status();
    recv_counts = r->recv_counts;
    return absl::OkStatus();
  });
  if (!moe_fp8.ok()) return moe_fp8.status();
  int64_t recv_tokens = 0;
  for (int64_t c : recv_counts) recv_tokens += c;
  received.resize(static_cast<size_t>(recv_tokens * kHidden));
  auto moe_bf16 = Measure(world, world, repeats, [&]() -> absl::Status {
    return parallel::AllToAllBf16Tokens(world, ops, tokens.data(), kHidden, send_counts,
                                        recv_counts, received.data());
  });
  if (!moe_bf16.ok()) return moe_bf16.status();
  out["moe_dispatch"] = Pair("fp8", *moe_fp8, "bf16", *moe_bf16);
  out["moe_dispatch"]["tokens_per_rank"] = kTokens;
  out["moe_dispatch"]["hidden"] = kHidden;

  // Gradient reduce-scatter of one 2048 x 2048 weight's full gradient, 16 times.
  const std::vector<float> grad = Normal(kRows * kCols, 5u + static_cast<uint32_t>(world.rank()));
  std::vector<float> shard_grad(static_cast<size_t>(shard_rows * kCols));
  auto reduce = [&](parallel::GradReduceDType dtype) {
    return Measure(world, world, repeats, [&]() -> absl::Status {
      for (int w = 0; w < kWeights; ++w) {
        if (absl::Status s = parallel::ReduceScatterGrad(
                world, ops, grad.data(), shard_rows * kCols, dtype, false, shard_grad.data());
            !s.ok()) {
          return s;
        }
      }
      return absl::OkStatus();
    });
  };
  auto rs_bf16 = reduce(parallel::GradReduceDType::kBF16);
  if (!rs_bf16.ok()) return rs_bf16.status();
  auto rs_fp32 = reduce(parallel::GradReduceDType::kFP32);
  if (!rs_fp32.ok()) return rs_fp32.status();
  out["grad_reduce_scatter"] = Pair("bf16", *rs_bf16, "fp32", *rs_fp32);

  out["ratio"] = out["fsdp_gather"]["byte_ratio"];
  out["ratio_definition"] =
      "FSDP gather bytes in FP8 (codes; tensor scales need no gather) over BF16 bytes";
  out["time_ratio"] = out["fsdp_gather"]["time_ratio"];
  return out;
}

}  // namespace
}  // namespace fp8rt::bench

int main(int argc, char** argv) {
  using namespace fp8rt;
  auto size = parallel::InitMpi(&argc, &argv);
  if (!size.ok()) {
    std::fprintf(stderr, "fp8rt-bench-comm: %s\n", std::string(size.status().message()).c_str());
    return 2;
  }
  int repeats = 3;
  CLI::App app{"MPI worker of `fp8rt bench comm` (run it through that command)"};
  app.add_option("--repeats", repeats, "repeats of each measurement (best is kept)");
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    parallel::FinalizeMpi();
    return app.exit(e);
  }
  int rc = 0;
  {
    auto factory = parallel::MpiCommunicatorFactory::Create();
    if (!factory.ok()) {
      std::fprintf(stderr, "fp8rt-bench-comm: %s\n",
                   std::string(factory.status().message()).c_str());
      return 2;
    }
    auto result = bench::Run((*factory)->World(), repeats);
    if (!result.ok()) {
      std::fprintf(stderr, "fp8rt-bench-comm: %s\n",
                   std::string(result.status().message()).c_str());
      rc = 2;
    } else if ((*factory)->World().rank() == 0) {
      std::printf("%s\n", result->dump().c_str());
    }
  }
  parallel::FinalizeMpi();
  return rc;
}
