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
  DeviceArray(const OpTable& ops, MemCategory category) : ops_(&ops), category_(category) {}
  DeviceArray(const DeviceArray&) = delete;
  DeviceArray& operator=(const DeviceArray&) = delete;
  DeviceArray(DeviceArray&& o) noexcept
      : ops_(o.ops_),
        category_(o.category_),
        data_(std::exchange(o.data_, nullptr)),
        size_(std::exchange(o.size_, 0)) {}
  DeviceArray& operator=(DeviceArray&& o) noexcept {
    if (this != &o) {
      Release();
      ops_ = o.ops_;
      category_ = o.category_;
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
  T* begin() { return data_; }
  T* end() { return data_ + size_; }
  const T* begin() const { return data_; }
  const T* end() const { return data_ + size_; }
  T& operator[](size_t i) { return data_[i]; }
  const T& operator[](size_t i) const { return data_[i]; }

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
  // unspecified value, for a
  // buffer whose size varies from use to use (token counts): the memory is kept when it is of
  // that backend and large enough; otherwise replaced, by exactly `count` elements when the array
  // was empty and by a quarter more when it grows, so that varying sizes settle without
  // reallocating (on CUDA a free waits for the whole device). size() may exceed `count`.
  void Grow(const OpTable& ops, size_t count) {
    if (ops_ == &ops && size_ >= count && data_ != nullptr) return;
    const bool first = data_ == nullptr || ops_ != &ops;
    Reset(ops, first ? count : count + count / 4);
  }
  // `count` elements, each `value` (written by the host).
  void assign(size_t count, T value) {
    resize_uninitialized(count);
    std::fill_n(data_, count, value);
  }
  // `count` elements; the first min(size(), count) keep their values, the rest are T{}.
  void resize(size_t count) {
    if (count == size_) return;
    DeviceArray next(*ops_, category_);
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
    absl::StatusOr<void*> p = ops_->layer->allocate(std::max<size_t>(count, 1) * sizeof(T));
    FP8RT_CHECK(p.ok()) << "DeviceArray of " << count << " elements on the " << ops_->name
                        << " backend: " << p.status();
    data_ = static_cast<T*>(*p);
    size_ = count;
    TrackAlloc(category_, bytes());
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
  T* data_ = nullptr;
  size_t size_ = 0;
};

}  // namespace fp8rt::kernels

#endif  // FP8RT_KERNELS_DEVICE_ARRAY_H_
