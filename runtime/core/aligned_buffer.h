// AlignedBuffer: an owned, uninitialised byte buffer aligned to 64 bytes (a cache line and an
// AVX-512 vector), for kernel workspaces and tensors. Movable, not copyable, not thread-safe.
#ifndef FP8RT_RUNTIME_CORE_ALIGNED_BUFFER_H_
#define FP8RT_RUNTIME_CORE_ALIGNED_BUFFER_H_

#include <cstddef>
#include <cstdlib>
#include <memory>

namespace fp8rt {

class AlignedBuffer {
 public:
  static constexpr size_t kAlignment = 64;

  AlignedBuffer() = default;
  explicit AlignedBuffer(size_t bytes)
      : size_(bytes),
        data_(static_cast<std::byte*>(std::aligned_alloc(
            kAlignment,
            (bytes + kAlignment - 1) / kAlignment * kAlignment + (bytes == 0 ? kAlignment : 0)))) {}

  std::byte* data() { return data_.get(); }
  const std::byte* data() const { return data_.get(); }
  size_t size() const { return size_; }

  template <typename T>
  T* as() {
    return reinterpret_cast<T*>(data_.get());
  }

 private:
  struct Free {
    void operator()(std::byte* p) const { std::free(p); }
  };
  size_t size_ = 0;
  std::unique_ptr<std::byte, Free> data_;
};

}  // namespace fp8rt

#endif  // FP8RT_RUNTIME_CORE_ALIGNED_BUFFER_H_
