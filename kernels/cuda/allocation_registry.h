// AllocationRegistry: the address ranges of the allocations the CUDA backend made itself
// (LayerOps::allocate, that is every DeviceArray), so that the ops' pointer check
// (CheckDevicePointers, kernels/cuda/device.cu) answers from a map lookup for the model's own
// buffers instead of asking the runtime (cudaPointerGetAttributes) for every pointer of every op.
// A pointer anywhere inside a registered range is known: ops take offsets into arrays. Each
// allocation also records its kind, so that a free knows cudaFreeHost from cudaFree without
// asking the runtime.
// Header-only and CUDA-free, so that tests/gpu/device_math_host_test.cc checks it on any machine.
// Thread-safe: ranks may allocate on one thread while ops check on another.
#pragma once

#include <cstddef>
#include <cstdint>
#include <iterator>
#include <map>
#include <mutex>
#include <shared_mutex>

namespace fp8rt::kernels::cuda_internal {

class AllocationRegistry {
 public:
  // What an allocation is, for its free: managed memory (cudaFree), device memory from the
  // stream-ordered pool (cudaFreeAsync), pinned host memory (cudaFreeHost); kUnknown is what
  // Remove says of a pointer never added.
  enum class Kind : uint8_t { kUnknown, kDevice, kPinnedHost, kStreamOrdered };

  // [p, p + bytes) was allocated; bytes 0 counts as 1 (allocate hands out at least one byte).
  void Add(const void* p, size_t bytes, Kind kind = Kind::kDevice) {
    if (p == nullptr) return;
    const uintptr_t b = reinterpret_cast<uintptr_t>(p);
    std::unique_lock lock(mu_);
    ranges_[b] = Range{b + (bytes == 0 ? 1 : bytes), kind};
  }
  // The allocation that starts at p was freed: its kind, or kUnknown (and nothing changes) for a
  // p never added.
  Kind Remove(const void* p) {
    std::unique_lock lock(mu_);
    const auto it = ranges_.find(reinterpret_cast<uintptr_t>(p));
    if (it == ranges_.end()) return Kind::kUnknown;
    const Kind kind = it->second.kind;
    ranges_.erase(it);
    return kind;
  }
  // Whether p lies inside a registered allocation.
  bool Contains(const void* p) const {
    const uintptr_t a = reinterpret_cast<uintptr_t>(p);
    std::shared_lock lock(mu_);
    auto it = ranges_.upper_bound(a);  // the first range starting after a
    if (it == ranges_.begin()) return false;
    --it;
    return a >= it->first && a < it->second.end;
  }
  size_t size() const {
    std::shared_lock lock(mu_);
    return ranges_.size();
  }

 private:
  mutable std::shared_mutex mu_;
  struct Range {
    uintptr_t end;
    Kind kind;
  };
  std::map<uintptr_t, Range> ranges_;  // begin -> (end, kind); Guarded by mu_
};

}  // namespace fp8rt::kernels::cuda_internal
