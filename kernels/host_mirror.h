// HostMirror<T>: a small result that a backend's entries write on the device and the host reads
// after a wait: the FP8 statistics of a quantization (combined with device atomics), an amax
// max-reduced by a collective. The entries write device() (a Placement::kDeviceOnly array:
// cudaMalloc on CUDA, so atomics are device atomics on device memory); Download queues an
// explicit copy of it into a pinned, host-read array (Placement::kHostRead) on the stream, after
// the writes; once the backend has been synchronised the host reads that copy (operator[]),
// without page faults and without reading memory a kernel wrote across the host link with atomics
// (which the CUDA programming guide does not promise to be atomic there).
//
// Reading before Download and a synchronise gives the previous copy (or unspecified values): the
// CPU backend's tests see that as wrong statistics, and a host access to the device side aborts
// on every backend (DeviceArray). Movable, not copyable, not thread-safe.
#ifndef FP8RT_KERNELS_HOST_MIRROR_H_
#define FP8RT_KERNELS_HOST_MIRROR_H_

#include <cstddef>

#include "absl/status/status.h"
#include "kernels/device_array.h"
#include "kernels/layer_ops.h"
#include "kernels/ops.h"

namespace fp8rt::kernels {

template <typename T>
class HostMirror {
 public:
  HostMirror() = default;

  // `count` elements of `ops`'s backend on each side, of unspecified value (kept when backend and
  // size are unchanged, as DeviceArray::Reset).
  void Reset(const OpTable& ops, size_t count) {
    device_.Reset(ops, count);
    host_.Reset(ops, count);
  }
  // At least `count` elements on each side (DeviceArray::Grow).
  void Grow(const OpTable& ops, size_t count) {
    device_.Grow(ops, count);
    host_.Grow(ops, count);
  }

  // Where the backend's entries write (device memory: the host must not touch it).
  T* device() { return device_.data(); }
  size_t size() const { return device_.size(); }
  const OpTable& ops() const { return device_.ops(); }

  // Queues the copy of the first `count` elements (all when count is size()) from the device
  // side to the host side on `stream`, after the writes queued there before it.
  absl::Status Download(Stream stream, size_t count) {
    return device_.ops().layer->copy_bytes(host_.data(), device_.data(), count * sizeof(T), stream);
  }
  absl::Status Download(Stream stream) { return Download(stream, size()); }

  // The host copy, as of the last Download the backend has finished (after synchronize).
  const T& operator[](size_t i) const { return host_[i]; }

 private:
  DeviceArray<T> device_{CpuOps(), MemCategory::kOther, Placement::kDeviceOnly};
  DeviceArray<T> host_{CpuOps(), MemCategory::kOther, Placement::kHostRead};
};

}  // namespace fp8rt::kernels

#endif  // FP8RT_KERNELS_HOST_MIRROR_H_
