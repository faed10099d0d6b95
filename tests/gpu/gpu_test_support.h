// What the CUDA op tests (ops_cuda_test, layer_ops_cuda_test, attention_cuda_test) share: device
// memory, host<->device copies and the fixture that decides whether a test runs at all.
//
// Defines (namespace fp8rt::kernels::gpu_test):
//   DeviceBuffer    cudaMalloc'd bytes, poisoned with 0xA5 so an output a kernel forgot to write
//                   shows up; freed at destruction; movable, not copyable.
//   Upload          a new DeviceBuffer holding a host vector.
//   Put             a host vector into an existing DeviceBuffer.
//   Download        the first `count` elements of a DeviceBuffer, into a host vector.
//   GpuRequired     whether FP8RT_REQUIRE_GPU=1 (set by tests/gpu/run.sh).
//   CudaStreamTest  the base fixture: skips without a usable device, with the reason (fails
//                   instead under FP8RT_REQUIRE_GPU=1), else gives the CUDA op table and a stream
//                   of the test's own.
//
// Header-only, for tests: a failed allocation or copy fails the current test (ADD_FAILURE /
// EXPECT; Put's copy is an ASSERT), and nothing here is thread-safe.
//
// Host mode (FP8RT_GPU_TEST_HOST defined, with cuda_internal renamed host_cuda_internal: the
// *_host_test variants of a GPU test in tests/gpu/CMakeLists.txt): the same test file runs the
// CUDA kernels' own source on the CPU over the block emulator (host_cuda.h, host_cuda_backend.h).
// "Device" memory is host memory, CudaStreamTest hands out HostEmulatedOps() and never skips,
// and no CUDA runtime function is called (none is linked); LastError is cudaSuccess there (a
// failed emulated launch is the entry's error status instead).
#ifndef FP8RT_TESTS_GPU_GPU_TEST_SUPPORT_H_
#define FP8RT_TESTS_GPU_GPU_TEST_SUPPORT_H_

#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cstddef>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "kernels/ops.h"

namespace fp8rt::kernels::gpu_test {

#ifdef FP8RT_GPU_TEST_HOST
// The CUDA table's kernel entries compiled as host code (tests/gpu/layer_ops_cuda_host.cc).
const OpTable& HostEmulatedOps();
#endif

// --- the runtime calls made here (host memory in host mode) -------------------------------------

namespace rt {
#ifdef FP8RT_GPU_TEST_HOST
inline cudaError_t Malloc(void** p, size_t bytes) {  // cudaMalloc's alignment, 256 bytes
  *p = std::aligned_alloc(256, (bytes + 255) / 256 * 256);
  return *p != nullptr ? cudaSuccess : cudaErrorMemoryAllocation;
}
inline cudaError_t Free(void* p) {
  std::free(p);
  return cudaSuccess;
}
inline cudaError_t Memset(void* p, int value, size_t bytes) {
  std::memset(p, value, bytes);
  return cudaSuccess;
}
inline cudaError_t Memcpy(void* dst, const void* src, size_t bytes, cudaMemcpyKind) {
  std::memcpy(dst, src, bytes);
  return cudaSuccess;
}
inline cudaError_t DeviceSynchronize() { return cudaSuccess; }
#else
inline cudaError_t Malloc(void** p, size_t bytes) { return cudaMalloc(p, bytes); }
inline cudaError_t Free(void* p) { return cudaFree(p); }
inline cudaError_t Memset(void* p, int value, size_t bytes) { return cudaMemset(p, value, bytes); }
inline cudaError_t Memcpy(void* dst, const void* src, size_t bytes, cudaMemcpyKind kind) {
  return cudaMemcpy(dst, src, bytes, kind);
}
inline cudaError_t DeviceSynchronize() { return cudaDeviceSynchronize(); }
#endif
}  // namespace rt

// The thread's last CUDA error, cleared (cudaGetLastError); cudaSuccess in host mode.
inline cudaError_t LastError() {
#ifdef FP8RT_GPU_TEST_HOST
  return cudaSuccess;
#else
  return cudaGetLastError();
#endif
}

// --- device memory -------------------------------------------------------------------------------

// Fills `bytes` at `p` with 0xA5 (an output element a kernel forgot to write shows up:
// 0xA5A5A5A5 is -2.9e-16) and waits for the device, so that the fill is done before work on any
// stream, a non-blocking one included (plain cudaMemset goes on the legacy default stream, which
// such a stream is not ordered after).
inline ::testing::AssertionResult Poison(void* p, size_t bytes) {
  if (rt::Memset(p, 0xA5, bytes) != cudaSuccess || rt::DeviceSynchronize() != cudaSuccess) {
    return ::testing::AssertionFailure() << "poisoning " << bytes << " bytes of device memory";
  }
  return ::testing::AssertionSuccess();
}

// Waits for the device after a host-to-device cudaMemcpy: from pageable memory it may return
// before the data reaches the device, and a non-blocking stream's next kernel is not ordered
// after it.
inline cudaError_t CopyToDevice(void* dst, const void* src, size_t bytes) {
  const cudaError_t e = rt::Memcpy(dst, src, bytes, cudaMemcpyHostToDevice);
  return e != cudaSuccess ? e : rt::DeviceSynchronize();
}

// At least one byte is allocated (and poisoned), so even an empty buffer has a non-null address.
// A failed cudaMalloc is a test failure and leaves the buffer null; the copies below then do
// nothing.
class DeviceBuffer {
 public:
  explicit DeviceBuffer(size_t bytes) {
    if (rt::Malloc(&ptr_, std::max<size_t>(bytes, 1)) != cudaSuccess) {
      ADD_FAILURE() << "cudaMalloc of " << bytes << " bytes failed";
      ptr_ = nullptr;
    } else {
      EXPECT_TRUE(Poison(ptr_, std::max<size_t>(bytes, 1)));
    }
  }
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;
  DeviceBuffer(DeviceBuffer&& o) noexcept : ptr_(o.ptr_) { o.ptr_ = nullptr; }
  ~DeviceBuffer() {
    if (ptr_ != nullptr) (void)rt::Free(ptr_);
  }
  template <class T = void>
  T* as() const {
    return static_cast<T*>(ptr_);
  }
  float* f() const { return as<float>(); }

 private:
  void* ptr_ = nullptr;
};

// --- host <-> device -----------------------------------------------------------------------------

template <class T>
DeviceBuffer Upload(const std::vector<T>& host) {
  DeviceBuffer d(host.size() * sizeof(T));
  if (d.as() != nullptr && !host.empty()) {
    EXPECT_EQ(CopyToDevice(d.as(), host.data(), host.size() * sizeof(T)), cudaSuccess);
  }
  return d;
}

// `d` must hold at least host.size() elements.
template <class T>
void Put(const DeviceBuffer& d, const std::vector<T>& host) {
  if (!host.empty() && d.as() != nullptr) {
    ASSERT_EQ(CopyToDevice(d.as(), host.data(), host.size() * sizeof(T)), cudaSuccess);
  }
}

// `count` value-initialised elements when `d` is null (its allocation has already failed the test).
template <class T>
std::vector<T> Download(const DeviceBuffer& d, size_t count) {
  std::vector<T> host(count);
  if (count > 0 && d.as() != nullptr) {
    EXPECT_EQ(rt::Memcpy(host.data(), d.as(), count * sizeof(T), cudaMemcpyDeviceToHost),
              cudaSuccess);
  }
  return host;
}

// --- fixture -------------------------------------------------------------------------------------

// Set by tests/gpu/run.sh: on a machine that is supposed to have a GPU, a missing device is a
// failure, not a reason to skip.
inline bool GpuRequired() {
  const char* v = std::getenv("FP8RT_REQUIRE_GPU");
  return v != nullptr && std::string(v) == "1";
}

// SetUp skips the test without a usable device, with the CUDA runtime's reason (or CudaOps()'s
// status when the backend cannot start), and fails it instead under FP8RT_REQUIRE_GPU=1.
// Otherwise it sets cuda_ops_ and creates a stream of the test's own (never the default stream)
// with the flags given to the constructor; TearDown destroys it. A derived SetUp calls this one
// first and returns at once when Stopped().
class CudaStreamTest : public ::testing::Test {
 protected:
  explicit CudaStreamTest(unsigned int stream_flags = cudaStreamDefault)
      : stream_flags_(stream_flags) {}

  void SetUp() override {
#ifdef FP8RT_GPU_TEST_HOST
    cuda_ops_ = &HostEmulatedOps();
#else
    std::string why;
    if (CudaDeviceCount(&why) == 0) {
      if (GpuRequired()) FAIL() << "FP8RT_REQUIRE_GPU=1 but there is no CUDA device: " << why;
      GTEST_SKIP() << "no CUDA device: " << why;
    }
    absl::StatusOr<const OpTable*> ops = CudaOps();
    if (!ops.ok()) {
      if (GpuRequired()) FAIL() << ops.status();
      GTEST_SKIP() << ops.status();
    }
    cuda_ops_ = *ops;
    ASSERT_EQ(cudaStreamCreateWithFlags(&stream_, stream_flags_), cudaSuccess);
#endif
  }
  void TearDown() override {
#ifndef FP8RT_GPU_TEST_HOST
    if (stream_ != nullptr) (void)cudaStreamDestroy(stream_);
#endif
  }

  // Whether SetUp skipped or failed the test, so that a derived SetUp must stop.
  static bool Stopped() { return IsSkipped() || HasFatalFailure(); }
  Stream stream() const { return Stream{stream_}; }
  // Waits for the stream and fails the test on any CUDA error (sticky errors included).
  void Sync() {
#ifndef FP8RT_GPU_TEST_HOST
    ASSERT_EQ(cudaStreamSynchronize(stream_), cudaSuccess)
        << cudaGetErrorString(cudaGetLastError());
    ASSERT_EQ(cudaGetLastError(), cudaSuccess);
#endif
  }

  const OpTable* cuda_ops_ = nullptr;  // CudaOps(); set by SetUp when the test runs

 private:
  const unsigned int stream_flags_;  // fixed at construction
  cudaStream_t stream_ = nullptr;    // owned; created by SetUp
};

}  // namespace fp8rt::kernels::gpu_test

#endif  // FP8RT_TESTS_GPU_GPU_TEST_SUPPORT_H_
