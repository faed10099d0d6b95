// The CUDA kernels' own source run on the CPU: a block emulator for the tests that check whole
// kernels without a GPU (flash_attention_host_test, quantize_host_test, moe_host_test,
// layer_ops_host_test, gemm_host_test; issue 23).
// host_shim.h runs the kernels' per-value functions on the host; this runs the kernels themselves:
// their indexing, shared memory, barriers, warp shuffles and tensor-core (WMMA) tiles.
//
// Include it first in a test file, before the .cu it compiles as host code (that file spells
// its launches and shared memory through kernels/cuda/launch.cuh's macros, which this
// header defines first). It includes cuda_runtime.h and cuda_bf16.h (their host parts: dim3,
// float4, __nv_bfloat16 and its round-to-nearest conversions) and defines:
//   - threadIdx, blockIdx, blockDim, gridDim: the running CUDA thread's;
//   - __global__ and __device__ functions are plain functions; FP8RT_STATIC_SHARED variables are
//     static (one block runs at a time), and a bare __shared__ does not compile (the emulator
//     could not fill it); __launch_bounds__ is dropped;
//   - __syncthreads, __syncwarp, __shfl_sync, __shfl_xor_sync, __shfl_down_sync (width 32);
//   - the FP32 intrinsics (__fadd_rn ... __fmaf_rn: IEEE operations rounded to nearest even,
//     each a separate non-inlined call so that nothing is contracted), __float_as_uint,
//     __uint_as_float, __float_as_int, __int_as_float, __clz, the integer min and max, and the
//     integer atomicMax and atomicAdd (one CUDA thread runs at a time: plain read-modify-writes);
//   - nvcuda::wmma for 16 x 16 x 16 tiles (below);
//   - FP8RT_LAUNCH and FP8RT_DYNAMIC_SHARED (kernels/cuda/launch.cuh).
//
// How a launch runs: synchronously, when it is made (the stream is not used). The blocks run one
// after another, in a random order (a GPU runs them at once, in none); each block's threads are
// fibers on the calling thread. The warps run one at a
// time, in a random order (a new one after every __syncthreads), each as far as it can go: its
// lanes, in a random order (a new one after every warp operation), each until it reaches a
// barrier or a warp-collective operation. A warp operation is released once every lane of its
// mask waits at the same operation with the same mask, and the warp goes on at once; __syncthreads
// once every thread of the block that has not returned waits there. So a warp runs as far ahead
// of the others as CUDA allows, and a lane as far ahead of its warp, which is what makes a
// missing barrier show: a thread that reads shared memory another thread writes, with no barrier
// between, may read it before that thread has run; and a block that reads what another block of
// the launch writes (no atomic) reads it before or after, as the order falls. And a kernel without
// such a race gives the same bits under every schedule: SetScheduleSeed picks another (the schedule
// of the n-th launch is fixed by the seed and n, so reruns repeat it). Shared memory is filled with
// 0xFF bytes (NaN in FP32 and BF16, -1 in integers) before each block: the dynamic shared memory,
// which is exactly as long as the launch asked (AddressSanitizer sees a read past its end), and
// every static shared variable (FP8RT_STATIC_SHARED) the program has declared so far, in template
// kernels too; one the running block declares for the first time is filled when its first thread
// reaches the declaration. So a read before this block wrote the element, or before the barrier
// after the write, sees NaN, not what the previous block or thread left there. A misuse that CUDA
// leaves undefined (a shuffle by a lane its mask leaves out, a width other than 32, a WMMA pointer
// or leading dimension CUDA refuses, a barrier outside a kernel) aborts the test with a message. A
// launch fails (TakeLaunchError, like cudaGetLastError) instead of running when it asks for more
// than 1,024 threads per block, more than 2^24 blocks (the emulator's own limit: it would take
// days), or more dynamic shared memory than 227 KiB (sm_90's opt-in) or
// than the kernel was allowed (over 48 KiB needs SetMaxDynamicSharedMemory first, as
// cudaFuncSetAttribute on a GPU); it stops, naming what each thread waits for, when its threads
// can no longer progress: a barrier that some threads never reach (a divergent __syncthreads, a
// warp operation whose mask names a lane that returned or waits elsewhere).
//
// nvcuda::wmma: fragments hold the whole 16 x 16 tile in every lane (as floats: BF16 converts
// exactly). load_matrix_sync, mma_sync and store_matrix_sync are warp-collective operations: as
// the CUDA C++ Programming Guide says of each, it waits until all lanes of the warp have arrived,
// then loads, multiplies or stores. They check their pointers (32-byte aligned) and leading
// dimensions (a multiple of 16 bytes), as the Guide requires. Each lane loads an operand tile
// (matrix_a, matrix_b) whole; of an accumulator tile it loads, computes and stores only its own
// elements (element r * 16 + c belongs to lane (r * 16 + c) % 32), so that a lane that reads a
// stored tile without a __syncwarp after the store reads the elements of lanes that have not
// stored yet as they were. mma_sync adds the 16 products of an element in order, each with one
// FP32 rounding (fmaf; BF16 products are exact in FP32), onto the accumulator: an order a tensor
// core may use.
#ifndef FP8RT_TESTS_GPU_HOST_CUDA_H_
#define FP8RT_TESTS_GPU_HOST_CUDA_H_

#ifdef FP8RT_KERNELS_CUDA_LAUNCH_CUH_
#error "include tests/gpu/host_cuda.h before the kernels' file"
#endif

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <bit>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <functional>
#include <string>
#include <type_traits>

namespace fp8rt::host_cuda {

struct Builtins {
  uint3 thread_idx{0, 0, 0};
  uint3 block_idx{0, 0, 0};
  dim3 block_dim{1, 1, 1};
  dim3 grid_dim{1, 1, 1};
};
// The running CUDA thread's builtins (outside a kernel: all zero, dimensions 1).
const Builtins& Current();
// The running CUDA thread's lane: its linear index in the block, modulo 32.
int Lane();

void SyncThreads();
// A warp-collective operation named `what` (a string literal) over the lanes of `mask`: waits
// until all of them reach one. Each lane passes `bits` and the lane whose bits it reads back.
uint64_t WarpCollective(const char* what, unsigned mask, uint64_t bits = 0, int src_lane = 0);

// The running block's dynamic shared memory.
unsigned char* DynamicShared();
// Called by every thread that reaches an FP8RT_STATIC_SHARED declaration (`p`, `bytes`: the
// variable): the first call fills it with 0xFF bytes, and every block after fills it again.
void StaticShared(void* p, size_t bytes);

// cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, bytes).
void SetMaxDynamicSharedMemory(const void* kernel, int bytes);

// Runs `body` as every thread of the grid (see above); returns the failure (empty: none).
std::string RunGrid(const void* kernel, dim3 grid, dim3 block, size_t dynamic_bytes,
                    const std::function<void()>& body);
// The random schedules of the following launches (see above).
void SetScheduleSeed(uint64_t seed);
// The first failed launch's failure since the last call, cleared (empty: none).
std::string TakeLaunchError();

struct Stats {
  int64_t launches = 0;
  int64_t blocks = 0;
  int64_t block_barriers = 0;    // __syncthreads released
  int64_t warp_collectives = 0;  // warp operations released
};
Stats stats();

template <class Kernel>
struct Launcher {
  Kernel kernel;
  dim3 grid, block;
  size_t bytes;
  template <class... Args>
  void operator()(Args... args) const {
    RunGrid(reinterpret_cast<const void*>(kernel), grid, block, bytes, [&] { kernel(args...); });
  }
};
template <class Kernel>
Launcher<Kernel> Launch(Kernel kernel, dim3 grid, dim3 block, size_t bytes, cudaStream_t) {
  return {kernel, grid, block, bytes};
}

template <class T>
uint64_t ToBits(T v) {
  static_assert(std::is_trivially_copyable_v<T> && sizeof(T) <= 8, "shuffles move 8 bytes at most");
  uint64_t bits = 0;
  std::memcpy(&bits, &v, sizeof(T));
  return bits;
}
template <class T>
T FromBits(uint64_t bits) {
  T v;
  std::memcpy(&v, &bits, sizeof(T));
  return v;
}
void CheckWidth(int width);

}  // namespace fp8rt::host_cuda

#define FP8RT_LAUNCH(kernel, grid, block, bytes, stream) \
  ::fp8rt::host_cuda::Launch(kernel, grid, block, bytes, stream)
#define FP8RT_DYNAMIC_SHARED(type, name) \
  type* const name = reinterpret_cast<type*>(::fp8rt::host_cuda::DynamicShared())

#define threadIdx (::fp8rt::host_cuda::Current().thread_idx)
#define blockIdx (::fp8rt::host_cuda::Current().block_idx)
#define blockDim (::fp8rt::host_cuda::Current().block_dim)
#define gridDim (::fp8rt::host_cuda::Current().grid_dim)

// A static shared variable is a static, registered with the emulator by each thread that reaches
// it (StaticShared). A bare __shared__ is refused: GCC ignores a section attribute on the statics
// of templates and inline functions, so there is no other way to find them all.
#define FP8RT_STATIC_SHARED(type, name, dims) \
  static type name dims;                      \
  ::fp8rt::host_cuda::StaticShared(&name, sizeof(name))
#undef __shared__
#define __shared__ \
  static_assert(false, "host_cuda.h: declare static shared memory with FP8RT_STATIC_SHARED");
#undef __launch_bounds__
#define __launch_bounds__(...)

inline void __syncthreads() { ::fp8rt::host_cuda::SyncThreads(); }
inline void __syncwarp(unsigned mask = 0xFFFFFFFFu) {
  ::fp8rt::host_cuda::WarpCollective("__syncwarp", mask);
}
template <class T>
T __shfl_sync(unsigned mask, T v, int src_lane, int width = 32) {
  ::fp8rt::host_cuda::CheckWidth(width);
  return ::fp8rt::host_cuda::FromBits<T>(::fp8rt::host_cuda::WarpCollective(
      "__shfl_sync", mask, ::fp8rt::host_cuda::ToBits(v), src_lane & 31));
}
template <class T>
T __shfl_xor_sync(unsigned mask, T v, int lane_mask, int width = 32) {
  ::fp8rt::host_cuda::CheckWidth(width);
  return ::fp8rt::host_cuda::FromBits<T>(
      ::fp8rt::host_cuda::WarpCollective("__shfl_xor_sync", mask, ::fp8rt::host_cuda::ToBits(v),
                                         (::fp8rt::host_cuda::Lane() ^ lane_mask) & 31));
}
template <class T>
T __shfl_down_sync(unsigned mask, T v, unsigned delta, int width = 32) {
  ::fp8rt::host_cuda::CheckWidth(width);
  const int lane = ::fp8rt::host_cuda::Lane();
  const int src = lane + static_cast<int>(delta) < 32 ? lane + static_cast<int>(delta) : lane;
  return ::fp8rt::host_cuda::FromBits<T>(::fp8rt::host_cuda::WarpCollective(
      "__shfl_down_sync", mask, ::fp8rt::host_cuda::ToBits(v), src));
}

[[gnu::noinline]] inline float __fadd_rn(float a, float b) { return a + b; }
[[gnu::noinline]] inline float __fsub_rn(float a, float b) { return a - b; }
[[gnu::noinline]] inline float __fmul_rn(float a, float b) { return a * b; }
[[gnu::noinline]] inline float __fdiv_rn(float a, float b) { return a / b; }
[[gnu::noinline]] inline float __fsqrt_rn(float a) { return std::sqrt(a); }
inline float __fmaf_rn(float a, float b, float c) { return std::fma(a, b, c); }
inline uint32_t __float_as_uint(float x) { return std::bit_cast<uint32_t>(x); }
inline float __uint_as_float(uint32_t x) { return std::bit_cast<float>(x); }
inline float __int_as_float(int x) { return std::bit_cast<float>(x); }
inline int __float_as_int(float x) { return std::bit_cast<int>(x); }
inline int __clz(int x) { return std::countl_zero(static_cast<uint32_t>(x)); }
// Atomics: one CUDA thread runs at a time, so plain read-modify-writes; each returns the old value.
inline unsigned atomicMax(unsigned* p, unsigned v) {
  const unsigned old = *p;
  *p = old > v ? old : v;
  return old;
}
inline int atomicMax(int* p, int v) {
  const int old = *p;
  *p = old > v ? old : v;
  return old;
}
inline unsigned atomicAdd(unsigned* p, unsigned v) {
  const unsigned old = *p;
  *p = old + v;
  return old;
}
inline unsigned long long atomicAdd(unsigned long long* p, unsigned long long v) {
  const unsigned long long old = *p;
  *p = old + v;
  return old;
}
inline int min(int a, int b) { return a < b ? a : b; }
inline int max(int a, int b) { return a > b ? a : b; }
inline int64_t min(int64_t a, int64_t b) { return a < b ? a : b; }
inline int64_t max(int64_t a, int64_t b) { return a > b ? a : b; }
inline uint32_t max(uint32_t a, uint32_t b) { return a > b ? a : b; }

namespace nvcuda::wmma {

struct matrix_a {};
struct matrix_b {};
struct accumulator {};
struct row_major {};
struct col_major {};
enum layout_t { mem_row_major, mem_col_major };

template <class Use, int M, int N, int K, class T, class Layout = void>
struct fragment {
  static_assert(M == 16 && N == 16 && K == 16, "the host WMMA emulation has 16 x 16 x 16 only");
  float v[256];  // element (r, c) at r * 16 + c: A [m][k], B [k][n], the accumulator [m][n]
};

namespace internal {
void CheckTile(const char* what, const void* p, unsigned ldm, size_t element_bytes);
// The running lane: it owns accumulator elements Lane(), Lane() + 32, ... (and no others).
int OwnLane();
inline float ToFloat(float x) { return x; }
inline float ToFloat(__nv_bfloat16 x) { return __bfloat162float(x); }
}  // namespace internal

template <class Use, class T, class Layout>
void fill_fragment(fragment<Use, 16, 16, 16, T, Layout>& f, const T& x) {
  for (float& e : f.v) e = internal::ToFloat(x);
}

// An operand tile (matrix_a, matrix_b), each lane all of it.
template <class Use, class T, class Layout>
void load_matrix_sync(fragment<Use, 16, 16, 16, T, Layout>& f, const T* p, unsigned ldm) {
  static_assert(!std::is_same_v<Use, accumulator>, "an accumulator load names its layout");
  internal::CheckTile("wmma::load_matrix_sync", p, ldm, sizeof(T));
  ::fp8rt::host_cuda::WarpCollective("wmma::load_matrix_sync", 0xFFFFFFFFu);
  for (int r = 0; r < 16; ++r) {
    for (int c = 0; c < 16; ++c) {
      const size_t at = std::is_same_v<Layout, row_major> ? static_cast<size_t>(r) * ldm + c
                                                          : static_cast<size_t>(c) * ldm + r;
      f.v[r * 16 + c] = internal::ToFloat(p[at]);
    }
  }
}

// An accumulator tile: the lane's own elements (the others are NaN).
inline void load_matrix_sync(fragment<accumulator, 16, 16, 16, float>& f, const float* p,
                             unsigned ldm, layout_t layout) {
  internal::CheckTile("wmma::load_matrix_sync", p, ldm, sizeof(float));
  ::fp8rt::host_cuda::WarpCollective("wmma::load_matrix_sync", 0xFFFFFFFFu);
  for (float& e : f.v) e = NAN;
  for (int e = internal::OwnLane(); e < 256; e += 32) {
    const int r = e / 16, c = e % 16;
    f.v[e] = p[layout == mem_row_major ? static_cast<size_t>(r) * ldm + c
                                       : static_cast<size_t>(c) * ldm + r];
  }
}

template <class T, class LayoutA, class LayoutB>
void mma_sync(fragment<accumulator, 16, 16, 16, float>& d,
              const fragment<matrix_a, 16, 16, 16, T, LayoutA>& a,
              const fragment<matrix_b, 16, 16, 16, T, LayoutB>& b,
              const fragment<accumulator, 16, 16, 16, float>& c) {
  ::fp8rt::host_cuda::WarpCollective("wmma::mma_sync", 0xFFFFFFFFu);
  float out[256];
  for (float& e : out) e = NAN;
  for (int e = internal::OwnLane(); e < 256; e += 32) {
    const int r = e / 16, col = e % 16;
    float s = c.v[e];
    for (int k = 0; k < 16; ++k) s = std::fma(a.v[r * 16 + k], b.v[k * 16 + col], s);
    out[e] = s;
  }
  std::memcpy(d.v, out, sizeof(out));
}

inline void store_matrix_sync(float* p, const fragment<accumulator, 16, 16, 16, float>& f,
                              unsigned ldm, layout_t layout) {
  internal::CheckTile("wmma::store_matrix_sync", p, ldm, sizeof(float));
  ::fp8rt::host_cuda::WarpCollective("wmma::store_matrix_sync", 0xFFFFFFFFu);
  for (int e = internal::OwnLane(); e < 256; e += 32) {
    const int r = e / 16, c = e % 16;
    p[layout == mem_row_major ? static_cast<size_t>(r) * ldm + c
                              : static_cast<size_t>(c) * ldm + r] = f.v[e];
  }
}

}  // namespace nvcuda::wmma

#endif  // FP8RT_TESTS_GPU_HOST_CUDA_H_
