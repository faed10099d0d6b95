// Live and peak bytes of backend memory by category: what kernels::DeviceArray holds, counted
// when it allocates and frees (DESIGN.md section 4: per-rank memory falls as 1/dp; this is how
// that is measured).
//
// Index:
//   MemCategory        what a buffer is for (parameter shards, gradients, optimizer state,
//                      gathered weights, saved activations, communication buffers, scratch)
//   MemoryStats        a snapshot: live and peak bytes per category, and the peaks of the total
//                      with and without the saved activations
//   GetMemoryStats, ResetMemoryPeaks, TrackAlloc, TrackFree
//
// Process-wide (one rank is one process), thread-safe (atomics). The peaks are exact maxima of
// the live counts over time: each allocation updates them.
#ifndef FP8RT_KERNELS_MEMORY_STATS_H_
#define FP8RT_KERNELS_MEMORY_STATS_H_

#include <array>
#include <cstdint>
#include <string_view>

namespace fp8rt::kernels {

enum class MemCategory : uint8_t {
  kOther,             // not attributed by its owner
  kParamShards,       // FP32 master shards and the persistent FP8 weight shards
  kGradients,         // FP32 gradient shards, and a layer's full gradient while it exists
  kOptimizerState,    // Adam moments, norm partial sums
  kGatheredWeights,   // a layer's gathered weight (FP32 or FP8 codes + scales) while it runs
  kSavedActivations,  // what a forward keeps for its backward
  kCommBuffers,       // staging and wire buffers of collectives
  kScratch,           // GEMM workspaces, backward temporaries
};
inline constexpr int kNumMemCategories = 8;

// "other", "param_shards", "gradients", "optimizer_state", "gathered_weights",
// "saved_activations", "comm_buffers", "scratch" (the label values of the metrics).
std::string_view MemCategoryName(MemCategory category);

struct MemoryStats {
  std::array<int64_t, kNumMemCategories> live{};  // bytes held now, by category
  std::array<int64_t, kNumMemCategories> peak{};  // the most held at once, by category
  int64_t total_live = 0;
  int64_t total_peak = 0;                 // the most held at once over all categories
  int64_t peak_without_activations = 0;   // the same, kSavedActivations left out
  int64_t Live(MemCategory c) const { return live[static_cast<int>(c)]; }
  int64_t Peak(MemCategory c) const { return peak[static_cast<int>(c)]; }
};

MemoryStats GetMemoryStats();
// Every peak becomes the live value (to measure a phase, e.g. steps after start-up).
void ResetMemoryPeaks();

// Called by DeviceArray on every allocation and free.
void TrackAlloc(MemCategory category, int64_t bytes);
void TrackFree(MemCategory category, int64_t bytes);

}  // namespace fp8rt::kernels

#endif  // FP8RT_KERNELS_MEMORY_STATS_H_
