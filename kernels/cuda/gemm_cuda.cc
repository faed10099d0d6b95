// CUDA GEMMs: cuBLASLt where it takes the problem, the tiled fallback kernel elsewhere (the
// choice is written out in kernels/cuda/cuda_backend.h).
//
// Layout. fp8rt's GEMM is D (M x N, row-major) = A (M x K) x B (N x K)^T, both operands
// K-contiguous. cuBLASLt is column-major: a row-major R x C matrix is a column-major C x R one.
// So D is cuBLASLt's N x M output (ld N), our B is its A operand stored K x N (ld K) and
// transposed, our A its B operand stored K x M (ld K), not transposed: the "TN" layout that
// cuBLASLt's FP8 kernels require (cuBLAS documentation, cublasLtMatmul, FP8 requirements).
// Scales swap with the operands: cuBLASLt's A_SCALE is our b_scale_inv, B_SCALE our
// a_scale_inv. With SCALAR_32F modes cuBLASLt computes D = alpha * sA * sB * (A B) + beta * C,
// with alpha = 1 and beta = 1 (C = D) for accumulate.
//
// Descriptors live on the stack (the cublasLt*Init functions on the opaque structs); the
// heuristic's algorithm choice is cached per problem signature, since the query costs more than
// a small matmul.
//
// mx32 (MXFP8) goes to cuBLASLt's VEC32_UE8M0 scale mode on GPUs that have it (compute
// capability 10.0 and later: Blackwell's block-scaled tensor cores; Hopper has none) for shapes
// with K a multiple of 128, the scales first rearranged into cuBLASLt's tiled layout
// (LaunchMx32ScaleLayout); elsewhere, or when cuBLASLt offers no algorithm, the fallback kernel.
#include <cublasLt.h>
#include <cuda_runtime.h>

#include <atomic>
#include <cstdio>
#include <cstring>
#include <map>
#include <mutex>
#include <string>
#include <tuple>
#include <unordered_map>

#include "absl/strings/str_cat.h"
#include "kernels/cuda/cuda_backend.h"
#include "kernels/cuda/cuda_ops_internal.h"
#include "kernels/cuda/gemm_kernels.h"
#include "kernels/cuda/gemm_route.h"
#include "runtime/core/checks.h"
#include "runtime/core/status.h"

namespace fp8rt::kernels {
namespace {

constexpr size_t kAlign = 64;
size_t Padded(size_t bytes) { return (bytes + kAlign - 1) / kAlign * kAlign; }
int64_t RoundUp4(int64_t x) { return (x + 3) / 4 * 4; }
int64_t CeilDiv(int64_t a, int64_t b) { return (a + b - 1) / b; }

std::atomic<bool> g_force_fallback{false};
std::atomic<int64_t> g_cublaslt_calls{0};
std::atomic<int64_t> g_fallback_calls{0};

}  // namespace

size_t CudaGemmWorkspaceBytes(const Fp8GemmArgs& args) {
  if (args.scaling == GemmScaling::kMx32) {
    const int64_t kb = CeilDiv(args.k, 32);
    return Padded(static_cast<size_t>(cuda_internal::Mx32TiledBytes(args.m, kb))) +
           Padded(static_cast<size_t>(cuda_internal::Mx32TiledBytes(args.n, kb)));
  }
  if (args.scaling != GemmScaling::kBlock) return 0;
  const int64_t kb = CeilDiv(args.k, 128), nb = CeilDiv(args.n, 128);
  return Padded(static_cast<size_t>(kb * RoundUp4(args.m)) * sizeof(float)) +
         Padded(static_cast<size_t>(nb * RoundUp4(kb)) * sizeof(float));
}

size_t CudaGemmWorkspaceBytes(const Bf16GemmArgs& args) {
  size_t bytes = 0;
  if (args.a_type == InputType::kF32) bytes += Padded(static_cast<size_t>(args.m * args.k) * 2);
  if (args.b_type == InputType::kF32) bytes += Padded(static_cast<size_t>(args.n * args.k) * 2);
  return bytes;
}

namespace cuda_testing {
void ForceGemmFallback(bool force) { g_force_fallback.store(force); }
GemmPathCounts GetGemmPathCounts() {
  GemmPathCounts c;
  c.cublaslt = g_cublaslt_calls.load();
  c.fallback = g_fallback_calls.load();
  return c;
}
}  // namespace cuda_testing

namespace cuda_internal {
namespace {

absl::Status CublasErrorStatus(cublasStatus_t status, const char* expr, const char* file,
                               int line) {
  return absl::InternalError(absl::StrCat(expr, " failed at ", file, ":", line, ": cuBLAS status ",
                                          static_cast<int>(status), " ",
                                          cublasLtGetStatusString(status)));
}

#define CUBLAS_RETURN_IF_ERROR(expr)                                         \
  do {                                                                       \
    const cublasStatus_t fp8rt_cublas_rc_ = (expr);                          \
    if (fp8rt_cublas_rc_ != CUBLAS_STATUS_SUCCESS) {                         \
      return CublasErrorStatus(fp8rt_cublas_rc_, #expr, __FILE__, __LINE__); \
    }                                                                        \
  } while (false)

cudaStream_t ToCuda(Stream stream) { return static_cast<cudaStream_t>(stream.handle); }

// Largest power of two (at most 256) dividing the address: what cuBLASLt's alignment
// preferences ask for.
uint32_t AlignmentOf(const void* p) {
  const auto address = reinterpret_cast<uintptr_t>(p);
  uint32_t alignment = 256;
  while (alignment > 1 && address % alignment != 0) alignment /= 2;
  return alignment;
}

// One cuBLASLt handle per device, created on first use and kept for the life of the process.
absl::StatusOr<cublasLtHandle_t> Handle(int device) {
  static std::mutex mu;
  static auto* handles = new std::unordered_map<int, cublasLtHandle_t>();  // Guarded by mu
  std::lock_guard<std::mutex> lock(mu);
  auto it = handles->find(device);
  if (it != handles->end()) return it->second;
  cublasLtHandle_t handle = nullptr;
  CUBLAS_RETURN_IF_ERROR(cublasLtCreate(&handle));
  (*handles)[device] = handle;
  return handle;
}

// One matmul in cuBLASLt's terms (column-major; see the file comment for the mapping).
struct LtProblem {
  cudaDataType_t a_type = CUDA_R_32F, b_type = CUDA_R_32F, d_type = CUDA_R_32F;
  cublasComputeType_t compute = CUBLAS_COMPUTE_32F;
  int64_t m = 0, n = 0, k = 0;
  const void* a = nullptr;  // k x m, ld k, transposed
  const void* b = nullptr;  // k x n, ld k
  void* d = nullptr;        // m x n, ld m; also C
  bool fp8 = false;
  bool fast_accum = false;        // FP8: no FP32 promotion of the tensor cores' partial sums
  const void* a_scale = nullptr;  // device: FP32 scale(s), or tiled E8M0 codes (VEC32_UE8M0)
  const void* b_scale = nullptr;  // device
  int32_t a_scale_mode = CUBLASLT_MATMUL_MATRIX_SCALE_SCALAR_32F;
  int32_t b_scale_mode = CUBLASLT_MATMUL_MATRIX_SCALE_SCALAR_32F;
  float beta = 0.0f;
  void* workspace = nullptr;
  size_t workspace_bytes = 0;
};

using AlgoKey = std::tuple<int, int, int, int, int, int64_t, int64_t, int64_t, int32_t, int32_t,
                           bool, bool, size_t, uint32_t, uint32_t, uint32_t>;

class AlgoCache {
 public:
  bool Find(const AlgoKey& key, cublasLtMatmulAlgo_t* algo) {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = algos_.find(key);
    if (it == algos_.end()) return false;
    *algo = it->second;
    return true;
  }
  void Put(const AlgoKey& key, const cublasLtMatmulAlgo_t& algo) {
    std::lock_guard<std::mutex> lock(mu_);
    if (algos_.size() > 4096) algos_.clear();  // bounded; a model has few shapes
    algos_[key] = algo;
  }

 private:
  std::mutex mu_;
  std::map<AlgoKey, cublasLtMatmulAlgo_t> algos_;  // Guarded by mu_
};

AlgoCache& Algos() {
  static auto* cache = new AlgoCache();
  return *cache;
}

template <class T>
cublasStatus_t SetDesc(cublasLtMatmulDesc_t desc, cublasLtMatmulDescAttributes_t attr,
                       const T& value) {
  return cublasLtMatmulDescSetAttribute(desc, attr, &value, sizeof(value));
}
template <class T>
cublasStatus_t SetPref(cublasLtMatmulPreference_t pref, cublasLtMatmulPreferenceAttributes_t attr,
                       const T& value) {
  return cublasLtMatmulPreferenceSetAttribute(pref, attr, &value, sizeof(value));
}

// Runs the matmul; NotFound when cuBLASLt offers no algorithm for it (the caller falls back),
// Internal for any other cuBLAS error.
absl::Status RunLt(const LtProblem& p, cudaStream_t stream) {
  int device = 0;
  CUDA_RETURN_IF_ERROR(cudaGetDevice(&device));
  FP8RT_ASSIGN_OR_RETURN(cublasLtHandle_t handle, Handle(device));

  cublasLtMatmulDescOpaque_t op_storage;
  cublasLtMatmulDesc_t op = &op_storage;
  CUBLAS_RETURN_IF_ERROR(cublasLtMatmulDescInit(op, p.compute, CUDA_R_32F));
  CUBLAS_RETURN_IF_ERROR(SetDesc(op, CUBLASLT_MATMUL_DESC_TRANSA, CUBLAS_OP_T));
  CUBLAS_RETURN_IF_ERROR(SetDesc(op, CUBLASLT_MATMUL_DESC_TRANSB, CUBLAS_OP_N));
  if (p.fp8) {
    // Unless asked for fast accumulation (the training forward, precision.
    // fp8_fast_accum_forward), promote the tensor cores' partial sums to FP32 (DeepSeek-V3's
    // "split accumulator"): dgrad and wgrad must not run on the reduced-precision sums alone.
    CUBLAS_RETURN_IF_ERROR(
        SetDesc(op, CUBLASLT_MATMUL_DESC_FAST_ACCUM, static_cast<int8_t>(p.fast_accum ? 1 : 0)));
    const void* a_scale = p.a_scale;
    const void* b_scale = p.b_scale;
    CUBLAS_RETURN_IF_ERROR(SetDesc(op, CUBLASLT_MATMUL_DESC_A_SCALE_POINTER, a_scale));
    CUBLAS_RETURN_IF_ERROR(SetDesc(op, CUBLASLT_MATMUL_DESC_B_SCALE_POINTER, b_scale));
    if (p.a_scale_mode != CUBLASLT_MATMUL_MATRIX_SCALE_SCALAR_32F ||
        p.b_scale_mode != CUBLASLT_MATMUL_MATRIX_SCALE_SCALAR_32F) {
      CUBLAS_RETURN_IF_ERROR(SetDesc(op, CUBLASLT_MATMUL_DESC_A_SCALE_MODE, p.a_scale_mode));
      CUBLAS_RETURN_IF_ERROR(SetDesc(op, CUBLASLT_MATMUL_DESC_B_SCALE_MODE, p.b_scale_mode));
    }
  }
  cublasLtMatrixLayoutOpaque_t a_storage, b_storage, d_storage;
  cublasLtMatrixLayout_t a_layout = &a_storage, b_layout = &b_storage, d_layout = &d_storage;
  CUBLAS_RETURN_IF_ERROR(cublasLtMatrixLayoutInit(a_layout, p.a_type, static_cast<uint64_t>(p.k),
                                                  static_cast<uint64_t>(p.m), p.k));
  CUBLAS_RETURN_IF_ERROR(cublasLtMatrixLayoutInit(b_layout, p.b_type, static_cast<uint64_t>(p.k),
                                                  static_cast<uint64_t>(p.n), p.k));
  CUBLAS_RETURN_IF_ERROR(cublasLtMatrixLayoutInit(d_layout, p.d_type, static_cast<uint64_t>(p.m),
                                                  static_cast<uint64_t>(p.n), p.m));

  const uint32_t align_a = AlignmentOf(p.a), align_b = AlignmentOf(p.b), align_d = AlignmentOf(p.d);
  const AlgoKey key{device,
                    static_cast<int>(p.a_type),
                    static_cast<int>(p.b_type),
                    static_cast<int>(p.d_type),
                    static_cast<int>(p.compute),
                    p.m,
                    p.n,
                    p.k,
                    p.a_scale_mode,
                    p.b_scale_mode,
                    p.beta != 0.0f,
                    p.fast_accum,
                    p.workspace_bytes,
                    align_a,
                    align_b,
                    align_d};
  cublasLtMatmulAlgo_t algo;
  if (!Algos().Find(key, &algo)) {
    cublasLtMatmulPreferenceOpaque_t pref_storage;
    cublasLtMatmulPreference_t pref = &pref_storage;
    CUBLAS_RETURN_IF_ERROR(cublasLtMatmulPreferenceInit(pref));
    CUBLAS_RETURN_IF_ERROR(SetPref(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES,
                                   static_cast<uint64_t>(p.workspace_bytes)));
    CUBLAS_RETURN_IF_ERROR(SetPref(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, align_a));
    CUBLAS_RETURN_IF_ERROR(SetPref(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES, align_b));
    CUBLAS_RETURN_IF_ERROR(SetPref(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, align_d));
    CUBLAS_RETURN_IF_ERROR(SetPref(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES, align_d));
    // A split-K algorithm must add its partial sums in FP32, not in the output type: "in place"
    // reduction through a BF16 output rounds every partial sum to BF16 (on the H200, 130x257x300
    // with BF16 out came back 1-2 units off on exact integer data). Unsplit algorithms stay
    // allowed.
    CUBLAS_RETURN_IF_ERROR(SetPref(pref, CUBLASLT_MATMUL_PREF_REDUCTION_SCHEME_MASK,
                                   static_cast<uint32_t>(CUBLASLT_REDUCTION_SCHEME_COMPUTE_TYPE)));
    cublasLtMatmulHeuristicResult_t result{};
    int found = 0;
    const cublasStatus_t st = cublasLtMatmulAlgoGetHeuristic(
        handle, op, a_layout, b_layout, d_layout, d_layout, pref, 1, &result, &found);
    if (st != CUBLAS_STATUS_SUCCESS || found == 0) {
      return absl::NotFoundError(absl::StrCat("cuBLASLt offers no algorithm for this GEMM (",
                                              cublasLtGetStatusString(st), ")"));
    }
    algo = result.algo;
    Algos().Put(key, algo);
  }
  const float alpha = 1.0f;
  CUBLAS_RETURN_IF_ERROR(cublasLtMatmul(handle, op, &alpha, p.a, a_layout, p.b, b_layout, &p.beta,
                                        p.d, d_layout, p.d, d_layout, &algo, p.workspace,
                                        p.workspace_bytes, stream));
  return absl::OkStatus();
}

cudaDataType_t Fp8Type(Fp8Format format) {
  return format == Fp8Format::kE4M3 ? CUDA_R_8F_E4M3 : CUDA_R_8F_E5M2;
}
cudaDataType_t OutType(OutputType type) {
  return type == OutputType::kF32 ? CUDA_R_32F : CUDA_R_16BF;
}
OperandKind Fp8Kind(Fp8Format format) {
  return format == Fp8Format::kE4M3 ? OperandKind::kE4M3 : OperandKind::kE5M2;
}

bool Aligned16(const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; }

// Says `message` on stderr the first time a GEMM of this scaling falls back for the device's
// sake, so that a recipe the device has no fast kernel for is named once, not silently slow and
// not once per GEMM. One atomic flag per scaling: no lock on the GEMM path.
// Prints the GEMM's FallbackNotice the first time its kind comes up in this process (the text is
// built only then).
void WarnOnce(const Fp8GemmArgs& args, const Fp8GemmRoute& route, bool aligned) {
  static std::atomic<bool> said[FallbackNotice::kKinds];
  const int kind = NoticeKind(args, route, aligned);
  if (kind < 0 || kind >= FallbackNotice::kKinds) return;
  if (said[kind].load(std::memory_order_relaxed) || said[kind].exchange(true)) return;
  std::fprintf(stderr, "fp8rt: warning: %s\n", NoticeFor(args, route, aligned).text.c_str());
}

// Carves the caller's workspace: fixed parts first (64-byte aligned, in the order
// CudaGemmWorkspaceBytes sizes them), then the rest, from a 256-byte boundary, for cuBLASLt.
class Carver {
 public:
  Carver(void* base, size_t bytes) : next_(static_cast<uint8_t*>(base)), end_(next_ + bytes) {}
  template <class T>
  T* Take(size_t bytes) {
    T* p = reinterpret_cast<T*>(next_);
    next_ += Padded(bytes);
    return p;
  }
  std::pair<void*, size_t> Rest() const {
    if (next_ == nullptr) return {nullptr, 0};
    const uintptr_t at = (reinterpret_cast<uintptr_t>(next_) + 255) / 256 * 256;
    const uintptr_t end = reinterpret_cast<uintptr_t>(end_);
    if (at >= end) return {nullptr, 0};
    return {reinterpret_cast<void*>(at), static_cast<size_t>(end - at)};
  }

 private:
  uint8_t* next_;
  uint8_t* end_;
};

}  // namespace

absl::Status GemmFp8Cuda(const Fp8GemmArgs& args, Stream stream_arg) {
  FP8RT_RETURN_IF_ERROR(ValidateGemmArgs(args, CudaGemmWorkspaceBytes(args)));
  if (args.b_transposed) {
    return absl::UnimplementedError(
        "gemm_fp8: B given as K x N (b_transposed): cuBLASLt's FP8 GEMMs take B as N x K only "
        "(OpTable::gemm_fp8_takes_b_transposed is false on CUDA)");
  }
  const bool mx = args.scaling == GemmScaling::kMx32;
  FP8RT_RETURN_IF_ERROR(
      CheckDevicePointers({{"a", args.a},
                           {"b", args.b},
                           {mx ? "a_e8m0" : "a_scale_inv",
                            mx ? static_cast<const void*>(args.a_e8m0) : args.a_scale_inv},
                           {mx ? "b_e8m0" : "b_scale_inv",
                            mx ? static_cast<const void*>(args.b_e8m0) : args.b_scale_inv},
                           {"d", args.d},
                           {"workspace", args.workspace}}));
  const cudaStream_t stream = ToCuda(stream_arg);
  const bool block = args.scaling == GemmScaling::kBlock;
  const int64_t kb = CeilDiv(args.k, 128), nb = CeilDiv(args.n, 128);
  Carver ws(args.workspace, args.workspace_bytes);
  float* a_scales = nullptr;
  float* b_scales = nullptr;
  uint8_t* a_mx = nullptr;
  uint8_t* b_mx = nullptr;
  const int64_t kb32 = CeilDiv(args.k, 32);
  if (block) {
    a_scales = ws.Take<float>(static_cast<size_t>(kb * RoundUp4(args.m)) * sizeof(float));
    b_scales = ws.Take<float>(static_cast<size_t>(nb * RoundUp4(kb)) * sizeof(float));
  } else if (mx) {
    a_mx = ws.Take<uint8_t>(static_cast<size_t>(cuda_internal::Mx32TiledBytes(args.m, kb32)));
    b_mx = ws.Take<uint8_t>(static_cast<size_t>(cuda_internal::Mx32TiledBytes(args.n, kb32)));
  }
  // The device matters only to block and mx32 scaling (gemm_route.h).
  int cc = 90;
  if (block || mx) {
    FP8RT_ASSIGN_OR_RETURN(cc, CurrentDeviceComputeCapability());
  }
  const cuda_internal::Fp8GemmRoute route = cuda_internal::RouteFp8Gemm(args, cc);
  const bool aligned = Aligned16(args.a) && Aligned16(args.b) && Aligned16(args.d);
  if (!route.cublaslt || !aligned) WarnOnce(args, route, aligned);
  if (!g_force_fallback.load() && route.cublaslt && aligned) {
    LtProblem p;
    p.fp8 = true;
    p.fast_accum = args.fast_accum && args.scaling == GemmScaling::kTensor;
    p.a_type = Fp8Type(args.b_format);
    p.b_type = Fp8Type(args.a_format);
    p.d_type = OutType(args.out_type);
    p.m = args.n;
    p.n = args.m;
    p.k = args.k;
    p.a = args.b;
    p.b = args.a;
    p.d = args.d;
    p.beta = args.accumulate ? 1.0f : 0.0f;
    if (block) {
      CUDA_RETURN_IF_ERROR(LaunchBlockScaleLayout(args.a_scale_inv, args.m, kb, a_scales,
                                                  RoundUp4(args.m), args.b_scale_inv, nb, b_scales,
                                                  RoundUp4(kb), stream));
      p.a_scale = b_scales;
      p.b_scale = a_scales;
      p.a_scale_mode = CUBLASLT_MATMUL_MATRIX_SCALE_BLK128x128_32F;
      p.b_scale_mode = CUBLASLT_MATMUL_MATRIX_SCALE_VEC128_32F;
    } else if (mx) {
      // cuBLASLt's A is our B (see the file comment): its scales are b_e8m0, tiled.
      CUDA_RETURN_IF_ERROR(
          cuda_internal::LaunchMx32ScaleLayout(args.b_e8m0, args.n, kb32, b_mx, stream));
      CUDA_RETURN_IF_ERROR(
          cuda_internal::LaunchMx32ScaleLayout(args.a_e8m0, args.m, kb32, a_mx, stream));
      p.a_scale = b_mx;
      p.b_scale = a_mx;
      p.a_scale_mode = CUBLASLT_MATMUL_MATRIX_SCALE_VEC32_UE8M0;
      p.b_scale_mode = CUBLASLT_MATMUL_MATRIX_SCALE_VEC32_UE8M0;
    } else {
      p.a_scale = args.b_scale_inv;
      p.b_scale = args.a_scale_inv;
    }
    std::tie(p.workspace, p.workspace_bytes) = ws.Rest();
    const absl::Status s = RunLt(p, stream);
    if (s.ok()) ++g_cublaslt_calls;
    if (!absl::IsNotFound(s)) return s;
  }
  ++g_fallback_calls;
  FallbackGemmParams f;
  f.m = args.m;
  f.n = args.n;
  f.k = args.k;
  f.a = args.a;
  f.a_kind = Fp8Kind(args.a_format);
  f.b = args.b;
  f.b_kind = Fp8Kind(args.b_format);
  f.scaling = args.scaling;
  f.a_scale_inv = mx ? nullptr : args.a_scale_inv;
  f.b_scale_inv = mx ? nullptr : args.b_scale_inv;
  f.a_e8m0 = args.a_e8m0;
  f.b_e8m0 = args.b_e8m0;
  f.out_type = args.out_type;
  f.d = args.d;
  f.accumulate = args.accumulate;
  CUDA_RETURN_IF_ERROR(LaunchFallbackGemm(f, stream));
  return absl::OkStatus();
}

absl::Status GemmBf16Cuda(const Bf16GemmArgs& args, Stream stream_arg) {
  FP8RT_RETURN_IF_ERROR(ValidateGemmArgs(args, CudaGemmWorkspaceBytes(args)));
  FP8RT_RETURN_IF_ERROR(CheckDevicePointers(
      {{"a", args.a}, {"b", args.b}, {"d", args.d}, {"workspace", args.workspace}}));
  const cudaStream_t stream = ToCuda(stream_arg);
  Carver ws(args.workspace, args.workspace_bytes);
  const void* a16 = args.a;
  const void* b16 = args.b;
  if (args.a_type == InputType::kF32) {
    auto* dst = ws.Take<uint16_t>(static_cast<size_t>(args.m * args.k) * 2);
    CUDA_RETURN_IF_ERROR(
        LaunchRoundToBf16(static_cast<const float*>(args.a), args.m * args.k, dst, stream));
    a16 = dst;
  }
  if (args.b_type == InputType::kF32) {
    auto* dst = ws.Take<uint16_t>(static_cast<size_t>(args.n * args.k) * 2);
    CUDA_RETURN_IF_ERROR(
        LaunchRoundToBf16(static_cast<const float*>(args.b), args.n * args.k, dst, stream));
    b16 = dst;
  }
  if (!g_force_fallback.load()) {
    LtProblem p;
    p.a_type = CUDA_R_16BF;
    p.b_type = CUDA_R_16BF;
    p.d_type = OutType(args.out_type);
    p.m = args.n;
    p.n = args.m;
    p.k = args.k;
    p.a = b16;
    p.b = a16;
    p.d = args.d;
    p.beta = args.accumulate ? 1.0f : 0.0f;
    std::tie(p.workspace, p.workspace_bytes) = ws.Rest();
    const absl::Status s = RunLt(p, stream);
    if (s.ok()) ++g_cublaslt_calls;
    if (!absl::IsNotFound(s)) return s;
  }
  ++g_fallback_calls;
  FallbackGemmParams f;
  f.m = args.m;
  f.n = args.n;
  f.k = args.k;
  f.a = a16;
  f.a_kind = OperandKind::kBF16;
  f.b = b16;
  f.b_kind = OperandKind::kBF16;
  f.out_type = args.out_type;
  f.d = args.d;
  f.accumulate = args.accumulate;
  CUDA_RETURN_IF_ERROR(LaunchFallbackGemm(f, stream));
  return absl::OkStatus();
}

absl::Status GemmF32Cuda(const F32GemmArgs& args, Stream stream) {
  FP8RT_RETURN_IF_ERROR(ValidateGemmArgs(args));
  FP8RT_RETURN_IF_ERROR(CheckDevicePointers({{"a", args.a}, {"b", args.b}, {"d", args.d}}));
  LtProblem p;
  p.compute = CUBLAS_COMPUTE_32F;  // plain FP32: CUBLAS_COMPUTE_32F_FAST_TF32 would allow TF32
  p.m = args.n;
  p.n = args.m;
  p.k = args.k;
  p.a = args.b;
  p.b = args.a;
  p.d = args.d;
  p.beta = args.accumulate ? 1.0f : 0.0f;
  return RunLt(p, ToCuda(stream));
}

}  // namespace cuda_internal
}  // namespace fp8rt::kernels
