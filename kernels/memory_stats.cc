// The process-wide byte counters behind kernels/memory_stats.h.
#include "kernels/memory_stats.h"

#include <atomic>

namespace fp8rt::kernels {
namespace {

constexpr int kAct = static_cast<int>(MemCategory::kSavedActivations);

struct Counters {
  std::array<std::atomic<int64_t>, kNumMemCategories> live{};
  std::array<std::atomic<int64_t>, kNumMemCategories> peak{};
  std::atomic<int64_t> total_live{0}, total_peak{0};
  std::atomic<int64_t> other_live{0}, other_peak{0};  // total minus saved activations
};

Counters& C() {
  static Counters counters;
  return counters;
}

void RaiseTo(std::atomic<int64_t>& peak, int64_t value) {
  int64_t seen = peak.load(std::memory_order_relaxed);
  while (value > seen && !peak.compare_exchange_weak(seen, value, std::memory_order_relaxed)) {
  }
}

}  // namespace

std::string_view MemCategoryName(MemCategory category) {
  switch (category) {
    case MemCategory::kOther: return "other";
    case MemCategory::kParamShards: return "param_shards";
    case MemCategory::kGradients: return "gradients";
    case MemCategory::kOptimizerState: return "optimizer_state";
    case MemCategory::kGatheredWeights: return "gathered_weights";
    case MemCategory::kSavedActivations: return "saved_activations";
    case MemCategory::kCommBuffers: return "comm_buffers";
    case MemCategory::kScratch: return "scratch";
  }
  return "other";
}

void TrackAlloc(MemCategory category, int64_t bytes) {
  Counters& c = C();
  const int i = static_cast<int>(category);
  RaiseTo(c.peak[i], c.live[i].fetch_add(bytes, std::memory_order_relaxed) + bytes);
  RaiseTo(c.total_peak, c.total_live.fetch_add(bytes, std::memory_order_relaxed) + bytes);
  if (i != kAct) {
    RaiseTo(c.other_peak, c.other_live.fetch_add(bytes, std::memory_order_relaxed) + bytes);
  }
}

void TrackFree(MemCategory category, int64_t bytes) {
  Counters& c = C();
  const int i = static_cast<int>(category);
  c.live[i].fetch_sub(bytes, std::memory_order_relaxed);
  c.total_live.fetch_sub(bytes, std::memory_order_relaxed);
  if (i != kAct) c.other_live.fetch_sub(bytes, std::memory_order_relaxed);
}

MemoryStats GetMemoryStats() {
  Counters& c = C();
  MemoryStats s;
  for (int i = 0; i < kNumMemCategories; ++i) {
    s.live[i] = c.live[i].load(std::memory_order_relaxed);
    s.peak[i] = c.peak[i].load(std::memory_order_relaxed);
  }
  s.total_live = c.total_live.load(std::memory_order_relaxed);
  s.total_peak = c.total_peak.load(std::memory_order_relaxed);
  s.peak_without_activations = c.other_peak.load(std::memory_order_relaxed);
  return s;
}

void ResetMemoryPeaks() {
  Counters& c = C();
  for (int i = 0; i < kNumMemCategories; ++i) {
    c.peak[i].store(c.live[i].load(std::memory_order_relaxed), std::memory_order_relaxed);
  }
  c.total_peak.store(c.total_live.load(std::memory_order_relaxed), std::memory_order_relaxed);
  c.other_peak.store(c.other_live.load(std::memory_order_relaxed), std::memory_order_relaxed);
}

}  // namespace fp8rt::kernels
