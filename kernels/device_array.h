// DeviceArray<T>: an owned array of trivially copyable T in memory a backend's ops can use
// (LayerOps::allocate: host memory for the CPU, managed memory for CUDA), with the parts of the
// std::vector interface the model and the optimizer need. Element access from the host
// (operator[], begin/end, assign) is plain memory access: on CUDA it is valid only after the
// stream that last wrote the array has been synchronised (LayerOps::synchronize). Movable, not
// copyable (copies go through LayerOps::copy or an explicit loop), not thread-safe.
//
// Every allocation is counted by category (kernels/memory_stats.h): an array is kOther until
// its owner says what it is for (set_category, or the constructor), and a moved-from array's
// bytes move with it.
//
// Placement: kHostVisible arrays (the default) come from LayerOps::allocate (CUDA managed memory)
// and the host may read and write them as above. kDeviceOnly arrays come from
// LayerOps::allocate_device (CUDA stream-ordered device memory): only the backend's entries touch
// them, through data(); the host-side accessors (operator[], begin/end, a non-zero assign, resize)
// abort, naming the array's category, on every backend, so that the CPU tests find a host access
// the GPU would fault on. assign(count) of zeros on such an array clears it with zero_bytes on the
// default stream. kHostRead arrays come from LayerOps::allocate_host (CUDA pinned, mapped host
// memory) for the small results the host reads every step, written by entries with plain stores
// (a loss per row, a sum of squares per shard); the host accesses them as kHostVisible ones.
// Results written with device atomics or by a collective go through kernels/host_mirror.h
// instead: a device-only array the entries write and a host-read copy made by an explicit copy.
//
// Allocation failures abort with the size and backend named (FP8RT_CHECK): the model sizes its
// arrays once, at start-up or when the micro-batch changes, and cannot continue without them.
#ifndef FP8RT_KERNELS_DEVICE_ARRAY_H_
#define FP8RT_KERNELS_DEVICE_ARRAY_H_

#include <algorithm>
#include <cstddef>
#include <cstring>
#include <limits>
#include <type_traits>
#include <utility>

#include "kernels/memory_stats.h"
#include "kernels/ops.h"
#include "runtime/core/check.h"

namespace fp8rt::kernels {

enum class Placement : uint8_t { kHostVisible, kDeviceOnly, kHostRead };

template <typename T>
class DeviceArray {
  static_assert(std::is_trivially_copyable_v<T>);

 public:
  // An empty array of the CPU backend; assign a backend's array to it to change that.
  DeviceArray() : ops_(&CpuOps()) {}
  explicit DeviceArray(const OpTable& ops, size_t count = 0, T value = T{}) : ops_(&ops) {
    assign(count, value);
  }
  // An empty array of `ops` whose allocations count as `category`.
  DeviceArray(const OpTable& ops, MemCategory category,
              Placement placement = Placement::kHostVisible)
      : ops_(&ops), category_(category), placement_(placement) {}
  DeviceArray(const DeviceArray&) = delete;
  DeviceArray& operator=(const DeviceArray&) = delete;
  DeviceArray(DeviceArray&& o) noexcept
      : ops_(o.ops_),
        category_(o.category_),
        placement_(o.placement_),
        data_(std::exchange(o.data_, nullptr)),
        size_(std::exchange(o.size_, 0)) {}
  DeviceArray& operator=(DeviceArray&& o) noexcept {
    if (this != &o) {
      Release();
      ops_ = o.ops_;
      category_ = o.category_;
      placement_ = o.placement_;
      data_ = std::exchange(o.data_, nullptr);
      size_ = std::exchange(o.size_, 0);
    }
    return *this;
  }
  ~DeviceArray() { Release(); }

  const OpTable& ops() const { return *ops_; }
  MemCategory category() const { return category_; }
  // What the array's memory counts as from now on (its current bytes move to `category`).
  void set_category(MemCategory category) {
    if (data_ != nullptr) {
      TrackFree(category_, bytes());
      TrackAlloc(category, bytes());
    }
    category_ = category;
  }
  // Frees the memory (size 0); the backend and category stay.
  void clear() { Release(); }
  T* data() { return data_; }
  const T* data() const { return data_; }
  size_t size() const { return size_; }
  bool empty() const { return size_ == 0; }
  Placement placement() const { return placement_; }
  T* begin() { return HostData(); }
  T* end() { return HostData() + size_; }
  const T* begin() const { return HostData(); }
  const T* end() const { return HostData() + size_; }
  T& operator[](size_t i) { return HostData()[i]; }
  const T& operator[](size_t i) const { return HostData()[i]; }

  // `count` elements of `ops`'s backend, of unspecified value: the memory is kept when backend
  // and size are unchanged (a buffer reused every step), otherwise replaced.
  void Reset(const OpTable& ops, size_t count) {
    if (ops_ != &ops) {
      Release();
      ops_ = &ops;
    }
    resize_uninitialized(count);
  }
  // At least `count` elements of `ops`'s backend (the memory non-null even for 0), of
  // unspecified value, for a buffer whose size varies from use to use (token counts): the memory
  // is kept when it is of that backend and large enough; otherwise replaced, by exactly `count`
  // elements when the array was empty and by a quarter more when it grows, so that varying sizes
  // settle without reallocating (on CUDA a host-visible array's free, cudaFree, waits for the
  // whole device; a device-only one's is stream-ordered). size() may exceed `count`.
  void Grow(const OpTable& ops, size_t count) {
    if (ops_ == &ops && size_ >= count && data_ != nullptr) return;
    const bool first = data_ == nullptr || ops_ != &ops;
    Reset(ops, first ? count : count + count / 4);
  }
  // `count` elements, each `value` (written by the host; a device-only array takes zeros only,
  // cleared by the backend).
  void assign(size_t count, T value) {
    resize_uninitialized(count);
    if (placement_ == Placement::kDeviceOnly) {
      const T zero{};
      FP8RT_CHECK(std::memcmp(&value, &zero, sizeof(T)) == 0)
          << "assign of a non-zero value to a device-only " << MemCategoryName(category_)
          << " array (the host cannot write it)";
      const absl::Status st =
          ops_->layer->zero_bytes(data_, static_cast<size_t>(bytes()), Stream{});
      FP8RT_CHECK(st.ok()) << "clearing a device-only " << MemCategoryName(category_)
                           << " array: " << st;
      return;
    }
    std::fill_n(data_, count, value);
  }
  // `count` elements; the first min(size(), count) keep their values, the rest are T{}.
  void resize(size_t count) {
    if (count == size_) return;
    HostData();  // copies on the host
    DeviceArray next(*ops_, category_, placement_);
    next.resize_uninitialized(count);
    const size_t kept = std::min(size_, count);
    if (kept > 0) std::memcpy(next.data_, data_, kept * sizeof(T));
    std::fill(next.data_ + kept, next.data_ + count, T{});
    *this = std::move(next);
  }

 private:
  // `count` elements of unspecified value (keeps the memory when the size is unchanged).
  void resize_uninitialized(size_t count) {
    if (count == size_ && data_ != nullptr) return;
    Release();
    FP8RT_CHECK(count <= std::numeric_limits<size_t>::max() / sizeof(T))
        << "DeviceArray of " << count << " elements of " << sizeof(T) << " bytes overflows";
    const size_t want = std::max<size_t>(count, 1) * sizeof(T);
    absl::StatusOr<void*> p =
        placement_ == Placement::kDeviceOnly ? ops_->layer->allocate_device(want)
        : placement_ == Placement::kHostRead ? ops_->layer->allocate_host(want)
                                             : ops_->layer->allocate(want);
    FP8RT_CHECK(p.ok()) << "DeviceArray of " << count << " elements on the " << ops_->name
                        << " backend: " << p.status();
    data_ = static_cast<T*>(*p);
    size_ = count;
    TrackAlloc(category_, bytes());
  }
  // data_ for the host's own reads and writes: refused for a device-only array.
  T* HostData() const {
    FP8RT_CHECK(placement_ != Placement::kDeviceOnly)
        << "host access to a device-only " << MemCategoryName(category_)
        << " array (only the backend's entries may touch it)";
    return data_;
  }
  int64_t bytes() const { return static_cast<int64_t>(std::max<size_t>(size_, 1) * sizeof(T)); }
  void Release() {
    if (data_ != nullptr) {
      TrackFree(category_, bytes());
      ops_->layer->deallocate(data_);
    }
    data_ = nullptr;
    size_ = 0;
  }

  const OpTable* ops_;
  MemCategory category_ = MemCategory::kOther;
  Placement placement_ = Placement::kHostVisible;
  T* data_ = nullptr;
  size_t size_ = 0;
};

}  // namespace fp8rt::kernels

#endif  // FP8RT_KERNELS_DEVICE_ARRAY_H_
