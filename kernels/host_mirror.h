// HostMirror<T>: a small array that crosses between the host and a backend's entries, kept as
// two: a device side (a Placement::kDeviceOnly array: stream-ordered device memory on CUDA) that
// the entries use, and a host side (Placement::kHostRead: pinned host memory on CUDA) that the host
// uses, joined by explicit copies queued on a stream (LayerOps::copy_bytes).
//
// Device to host (Download): results the entries write and the host reads after a wait, such as
// the FP8 statistics of a quantization (combined with device atomics), an amax max-reduced by a
// collective, the MoE expert ids. The atomics stay device atomics on device memory (the CUDA
// programming guide does not promise them atomic on host memory across the link), and the host
// reads its copy without page faults.
//
// Host to device (Upload): what the host writes for the entries to read, such as a micro-batch's
// tokens or the MoE dispatch plan. The kernels read device memory, not the host's across the
// link element by element.
//
// Reading the host side before Download and a synchronise gives the previous copy (or unspecified
// values), and the device side keeps its old values until an Upload: the CPU backend's tests see
// either as wrong results, and a host access to the device side aborts on every backend
// (DeviceArray). The host may write its side again only once the backend has finished the last
// Upload (after a synchronize). Movable, not copyable, not thread-safe.
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

  // What the backend's entries use (device memory: the host must not touch it).
  T* device() { return device_.data(); }
  const T* device() const { return device_.data(); }
  size_t size() const { return device_.size(); }
  const OpTable& ops() const { return device_.ops(); }

  // Queues the copy of the first `count` elements (all when count is size()) from the device
  // side to the host side on `stream`, after the writes queued there before it.
  absl::Status Download(Stream stream, size_t count) {
    return device_.ops().layer->copy_bytes(host_.data(), device_.data(), count * sizeof(T), stream);
  }
  absl::Status Download(Stream stream) { return Download(stream, size()); }
  // Queues the copy of the first `count` elements from the host side to the device side on
  // `stream`: entries queued after it see them.
  absl::Status Upload(Stream stream, size_t count) {
    return device_.ops().layer->copy_bytes(device_.data(), host_.data(), count * sizeof(T), stream);
  }

  // The host side: as of the last Download the backend has finished (after synchronize), or what
  // the host wrote for the next Upload.
  const T& operator[](size_t i) const { return host_[i]; }
  T& operator[](size_t i) { return host_[i]; }
  T* host() { return host_.begin(); }

 private:
  DeviceArray<T> device_{CpuOps(), MemCategory::kOther, Placement::kDeviceOnly};
  DeviceArray<T> host_{CpuOps(), MemCategory::kOther, Placement::kHostRead};
};

}  // namespace fp8rt::kernels

#endif  // FP8RT_KERNELS_HOST_MIRROR_H_
