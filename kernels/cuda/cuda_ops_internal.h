// Internal: the CUDA backend's op entry points (collected into the table in ops_cuda.cc) and the
// host helpers they share. Host code only; no CUDA header is needed to include it.
#ifndef FP8RT_KERNELS_CUDA_CUDA_OPS_INTERNAL_H_
#define FP8RT_KERNELS_CUDA_CUDA_OPS_INTERNAL_H_

#include <cstddef>
#include <cstdint>
#include <initializer_list>
#include <string>
#include <utility>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "kernels/ops.h"

namespace fp8rt::kernels::cuda_internal {

// kernels/cuda/quantize_cuda.cu
absl::Status QuantizeCuda(const QuantizeArgs& args, Stream stream);
absl::Status DequantizeCuda(const DequantizeArgs& args, Stream stream);
absl::Status AmaxCuda(const AmaxArgs& args, Stream stream);
absl::Status ConvertCuda(const ConvertArgs& args, Stream stream);
absl::Status CastTransposeCuda(const CastTransposeArgs& args, Stream stream);

// kernels/cuda/gemm_cuda.cc
absl::Status GemmFp8Cuda(const Fp8GemmArgs& args, Stream stream);
absl::Status GemmBf16Cuda(const Bf16GemmArgs& args, Stream stream);
absl::Status GemmF32Cuda(const F32GemmArgs& args, Stream stream);

// The layer ops (kernels/layer_ops.h): the table is defined in kernels/cuda/layer_ops_cuda.cu,
// which holds every entry but the MoE routing ones (kernels/cuda/moe_cuda.cu, below), the memory
// and stream ones (kernels/cuda/memory_cuda.cc, below) and the attention and cross-entropy ones
// (kernels/cuda/attention_cuda.cu; the fused BF16 kernels it launches are in
// kernels/cuda/flash_attention_cuda.cu).
extern const LayerOps kLayerOps;
// kernels/cuda/memory_cuda.cc: the table's memory and stream entries (LayerOps::synchronize,
// allocate ... copy_bytes), and stream-ordered scratch for `op`: `bytes` on `stream` from the
// device's array pool, given back with cudaFreeAsync on the same stream once the work using it
// is enqueued (no wait either way); ResourceExhausted naming op and the size when the device is
// full.
absl::StatusOr<void*> AllocateOnStream(const char* op, size_t bytes, Stream stream);
absl::Status SynchronizeCuda(Stream stream);
absl::StatusOr<void*> AllocateCuda(size_t bytes);
void DeallocateCuda(void* p);
absl::StatusOr<void*> AllocateDeviceCuda(size_t bytes);
absl::StatusOr<void*> AllocateHostCuda(size_t bytes);
absl::Status ZeroBytesCuda(void* p, size_t bytes, Stream stream);
absl::Status PrefetchCuda(const void* p, size_t bytes, Stream stream);
absl::Status CopyBytesCuda(void* dst, const void* src, size_t bytes, Stream stream);
// kernels/cuda/sort_cuda.cu: a stable sort of n (key, row) pairs by the keys' bits [0, end_bit)
// on `stream` (CUB's radix sort), keys_in and rows_in into keys_out and rows_out. With scratch
// null it only sets *scratch_bytes to the scratch the sort needs and enqueues nothing; otherwise
// *scratch_bytes is the size of `scratch`.
absl::Status SortKeyRowPairsCuda(void* scratch, size_t* scratch_bytes, const uint32_t* keys_in,
                                 uint32_t* keys_out, const int64_t* rows_in, int64_t* rows_out,
                                 int64_t n, int end_bit, Stream stream);
absl::Status AttentionForwardCuda(float* out, float* lse, const float* q, const float* k,
                                  const float* v, int64_t b, int64_t t, int64_t h, int64_t hkv,
                                  int64_t dh, Stream stream);
absl::Status AttentionBackwardCuda(float* dq, float* dk, float* dv, const float* dout,
                                   const float* q, const float* k, const float* v, const float* out,
                                   const float* lse, int64_t b, int64_t t, int64_t h, int64_t hkv,
                                   int64_t dh, Stream stream);
// The BF16-operand entries (attention_forward_bf16, attention_backward_bf16): the fused
// tensor-core kernels where FlashAttentionFits, the FP32 kernels above otherwise.
absl::Status AttentionForwardBf16Cuda(float* out, float* lse, const float* q, const float* k,
                                      const float* v, int64_t b, int64_t t, int64_t h, int64_t hkv,
                                      int64_t dh, Stream stream);
absl::Status AttentionBackwardBf16Cuda(float* dq, float* dk, float* dv, const float* dout,
                                       const float* q, const float* k, const float* v,
                                       const float* out, const float* lse, int64_t b, int64_t t,
                                       int64_t h, int64_t hkv, int64_t dh, Stream stream);
// kernels/cuda/flash_attention_cuda.cu: the fused kernels, launched on validated arguments.
// FlashAttentionFits: whether they run for head size dh on the current device (compute
// capability 8.0 or later, dh <= kFlashMaxDh, enough shared memory per block).
inline constexpr int64_t kFlashMaxDh = 128;
absl::StatusOr<bool> FlashAttentionFits(int64_t dh);
absl::Status LaunchFlashForward(float* out, float* lse, const float* q, const float* k,
                                const float* v, int64_t b, int64_t t, int64_t h, int64_t hkv,
                                int64_t dh, float scale, Stream stream);
absl::Status LaunchFlashBackward(float* dq, float* dk, float* dv, const float* dout, const float* q,
                                 const float* k, const float* v, const float* out, const float* lse,
                                 int64_t b, int64_t t, int64_t h, int64_t hkv, int64_t dh,
                                 float scale, Stream stream);
// kernels/cuda/moe_cuda.cu: the MoE routing entries (LayerOps::moe_route ... moe_router_backward).
absl::Status MoeRouteCuda(float* probs, int32_t* expert, float* gate, double* prob_sums,
                          const float* logits, int64_t n, int64_t e, int64_t k, Stream stream);
absl::Status GatherRowsCuda(float* dst, const float* src, const int64_t* index, int64_t rows,
                            int64_t cols, Stream stream);
absl::Status ScatterRowsCuda(float* dst, const float* src, const int64_t* index, int64_t rows,
                             int64_t cols, Stream stream);
absl::Status MoeCombineCuda(float* out, const float* y, const float* gate, const int64_t* slot,
                            const int32_t* expert, int64_t n, int64_t k, int64_t c, bool accumulate,
                            Stream stream);
absl::Status MoeCombineBackwardCuda(float* dy, float* dgate, const float* dout, const float* y,
                                    const float* gate, const int64_t* slot, int64_t n, int64_t k,
                                    int64_t c, Stream stream);
absl::Status MoeRouterBackwardCuda(float* dlogits, const float* probs, const int32_t* expert,
                                   const float* gate, const float* dgate, const float* frac,
                                   float aux_scale, int64_t n, int64_t e, int64_t k, Stream stream);
absl::Status CrossEntropyForwardCuda(float* probs, float* losses, const float* logits,
                                     const int32_t* targets, int64_t n, int64_t v, Stream stream);
absl::Status CrossEntropyBackwardCuda(float* dlogits, const float* probs, const int32_t* targets,
                                      int64_t n, int64_t v, float dloss, Stream stream);

// kernels/cuda/device.cu
int DeviceCount(std::string* why);
// Multiprocessors of the current device (cached per device), for sizing persistent grids.
absl::StatusOr<int> CurrentDeviceSmCount();
// Compute capability of the current device as major * 10 + minor (cached per device).
absl::StatusOr<int> CurrentDeviceComputeCapability();
// Bytes of shared memory one block may opt in to on the current device (cached per device).
absl::StatusOr<int> CurrentDeviceSharedMemoryOptin();
// All three of the above in one lookup, for a caller that needs more than one per call.
struct DeviceFacts {
  int sm_count = 0;
  int compute_capability = 0;  // major * 10 + minor
  int shared_optin = 0;        // bytes of shared memory one block may opt in to
};
absl::StatusOr<DeviceFacts> CurrentDeviceFacts();
// InvalidArgument naming the field unless every non-null pointer is memory the device can
// address (cudaMalloc, managed, or mapped pinned host memory). A plain host pointer handed to a
// kernel would fault and poison the whole CUDA context; this turns it into an error value.
// Pointers inside the backend's own allocations (BackendAllocations) pass without a runtime call.
absl::Status CheckDevicePointers(std::initializer_list<std::pair<const char*, const void*>> ptrs);
// The allocations of LayerOps::allocate, registered there and removed by deallocate.
class AllocationRegistry;
AllocationRegistry& BackendAllocations();
// Blocks of `kernel` (a __global__ function) at `threads` threads and `dynamic_bytes` of dynamic
// shared memory that fit on one multiprocessor of the current device, asked of the runtime once
// per (kernel, threads, bytes, device) and remembered. A kernel over 48 KiB of dynamic shared
// memory must have been allowed it first (AllowDynamicSharedMemory).
absl::StatusOr<int> KernelBlocksPerSm(const void* kernel, int threads, size_t dynamic_bytes = 0);
// Lets `kernel` launch with `bytes` of dynamic shared memory (over the default 48 KiB) on the
// current device: the kernel's limit is only ever raised (cudaFuncSetAttribute when `bytes` is
// more than any earlier call asked for on that device), so launches of any sizes, in any order
// and from any thread, each run under a limit at least their own.
absl::Status AllowDynamicSharedMemory(const void* kernel, int bytes);

// Launch configuration helper: enough blocks of `threads` for `work` items, at most `per_sm`
// blocks per multiprocessor (the kernels loop over the rest).
int64_t GridFor(int64_t work, int threads, int sm_count, int per_sm = 8);

}  // namespace fp8rt::kernels::cuda_internal

#endif  // FP8RT_KERNELS_CUDA_CUDA_OPS_INTERNAL_H_
