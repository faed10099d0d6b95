// AllocationRegistry: the address ranges of the allocations the CUDA backend made itself
// (LayerOps::allocate, that is every DeviceArray), so that the ops' pointer check
// (CheckDevicePointers, kernels/cuda/device.cu) answers from a map lookup for the model's own
// buffers instead of asking the runtime (cudaPointerGetAttributes) for every pointer of every op.
// A pointer anywhere inside a registered range is known: ops take offsets into arrays.
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
  // [p, p + bytes) was allocated; bytes 0 counts as 1 (allocate hands out at least one byte).
  void Add(const void* p, size_t bytes) {
    if (p == nullptr) return;
    const uintptr_t b = reinterpret_cast<uintptr_t>(p);
    std::unique_lock lock(mu_);
    ranges_[b] = b + (bytes == 0 ? 1 : bytes);
  }
  // The allocation that starts at p was freed (an unknown p is ignored).
  void Remove(const void* p) {
    std::unique_lock lock(mu_);
    ranges_.erase(reinterpret_cast<uintptr_t>(p));
  }
  // Whether p lies inside a registered allocation.
  bool Contains(const void* p) const {
    const uintptr_t a = reinterpret_cast<uintptr_t>(p);
    std::shared_lock lock(mu_);
    auto it = ranges_.upper_bound(a);  // the first range starting after a
    if (it == ranges_.begin()) return false;
    --it;
    return a >= it->first && a < it->second;
  }
  size_t size() const {
    std::shared_lock lock(mu_);
    return ranges_.size();
  }

 private:
  mutable std::shared_mutex mu_;
  std::map<uintptr_t, uintptr_t> ranges_;  // begin -> end; Guarded by mu_
};

}  // namespace fp8rt::kernels::cuda_internal
