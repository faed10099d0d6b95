// The CPU op table as work on the emulated device (stream_ops.h).
#include "tests/hostgpu/stream_ops.h"

#include <cuda_runtime.h>

#include <atomic>
#include <cstddef>
#include <mutex>
#include <string>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "kernels/cuda/allocation_registry.h"
#include "kernels/cuda/gemm_route.h"
#include "kernels/gemm.h"
#include "kernels/layer_ops.h"
#include "kernels/quantize.h"
#include "tests/hostgpu/host_gpu.h"

namespace fp8rt::hostgpu {
namespace {

std::mutex error_mu;
absl::Status first_error;  // guarded by error_mu
std::atomic<int64_t> ops_run{0};

void Record(const absl::Status& s) {
  ++ops_run;
  if (s.ok()) return;
  std::lock_guard<std::mutex> lock(error_mu);
  if (first_error.ok()) first_error = s;
}

// The CPU entry an op table member points to.
template <typename Table>
const Table& CpuTable() {
  if constexpr (std::is_same_v<Table, kernels::OpTable>) {
    return kernels::CpuOps();
  } else {
    return *kernels::CpuOps().layer;
  }
}

// A pointer an op is given, and whether the op may write through it (its type is not a pointer
// to const).
struct Pointer {
  const void* p;
  bool written;
};
template <typename T>
Pointer P(T* p) {
  return {p, !std::is_const_v<T>};
}

// The pointer fields of the argument structs, which the CUDA entries check as they check pointer
// arguments (null pointers are not refused here: whether the call has work that needs one is
// the entry's to know).
std::vector<Pointer> PointersOf(const kernels::QuantizeArgs& a) {
  return {P(a.input), P(a.scale_amax), P(a.codes), P(a.scale_inv), P(a.e8m0_scales), P(a.stats)};
}
std::vector<Pointer> PointersOf(const kernels::DequantizeArgs& a) {
  return {P(a.codes), P(a.scale_inv), P(a.e8m0_scales), P(a.output)};
}
std::vector<Pointer> PointersOf(const kernels::AmaxArgs& a) {
  return {P(a.input), P(a.amax), P(a.finite_amax)};
}
std::vector<Pointer> PointersOf(const kernels::ConvertArgs& a) { return {P(a.input), P(a.output)}; }
std::vector<Pointer> PointersOf(const kernels::Fp8GemmArgs& a) {
  return {P(a.a),      P(a.b),      P(a.a_scale_inv), P(a.b_scale_inv),
          P(a.a_e8m0), P(a.b_e8m0), P(a.d),           P(a.workspace)};
}
std::vector<Pointer> PointersOf(const kernels::Bf16GemmArgs& a) {
  return {P(a.a), P(a.b), P(a.d), P(a.workspace)};
}
std::vector<Pointer> PointersOf(const kernels::F32GemmArgs& a) { return {P(a.a), P(a.b), P(a.d)}; }
std::vector<Pointer> PointersOf(const kernels::CastTransposeArgs& a) {
  return {P(a.input), P(a.codes), P(a.codes_t), P(a.scale_inv), P(a.stats)};
}
std::vector<Pointer> PointersOf(const kernels::AdamWArgs& a) {
  return {P(a.master),    P(a.grad),          P(a.m),        P(a.v),
          P(a.fp8.codes), P(a.fp8.scale_inv), P(a.fp8.stats)};
}

// Whether a non-null pointer is device memory (registered by the emulated runtime). The end of an
// allocation passes too: most CUDA entries check no pointer of a call without work, and a call
// for the empty tail of a buffer (BeginUnitGrads' fill of a gradient without padding) points
// there. So a pointer exactly one past an allocation is not caught here even when its call has
// work.
bool Addressable(const void* p) {
  const auto* byte = static_cast<const std::byte*>(p);
  return p == nullptr || DeviceRange(byte, 1) || DeviceRange(byte - 1, 1);
}

// InvalidArgument naming the entry and the argument when a pointer argument, or a pointer field of
// an argument struct, is not device memory (the CUDA entries refuse such a pointer before
// launching anything).
// The pointers it checked are added to `uses` (the stream-order checks of host_gpu.h), as written
// unless they point to const.
template <typename T>
absl::Status CheckPointers(const char* entry, int index, const T& arg, Uses* uses) {
  std::vector<Pointer> pointers;
  if constexpr (std::is_pointer_v<T>) {
    pointers.push_back(P(arg));
  } else if constexpr (std::is_class_v<T> && !std::is_same_v<T, kernels::Stream>) {
    pointers = PointersOf(arg);
  }
  for (size_t i = 0; i < pointers.size(); ++i) {
    if (!Addressable(pointers[i].p)) {
      return absl::InvalidArgumentError(
          absl::StrCat(entry, ": argument ", index,
                       std::is_pointer_v<T> ? "" : absl::StrCat(" (pointer field ", i, ")"),
                       " is not device memory"));
    }
  }
  for (const Pointer& p : pointers) (p.written ? uses->writes : uses->reads).push_back(p.p);
  return absl::OkStatus();
}

template <auto Member, typename Name, typename Signature = decltype(Member)>
struct OnDevice;

// An entry `absl::Status (*)(A..., kernels::Stream)` of Table: checked now, run on the device.
template <auto Member, typename Name, typename Table, typename... A>
struct OnDevice<Member, Name, absl::Status (*Table::*)(A...)> {
  static_assert(
      std::is_same_v<std::tuple_element_t<sizeof...(A) - 1, std::tuple<A...>>, kernels::Stream>,
      "an op entry's last parameter is its stream");
  static absl::Status Call(A... a) {
    absl::Status checked;
    int index = 0;
    Uses uses;
    ((checked.ok() ? (checked = CheckPointers(Name::Value(), index++, a, &uses), 0) : 0), ...);
    if (!checked.ok()) return checked;
    const kernels::Stream stream = std::get<sizeof...(A) - 1>(std::tie(a...));
    absl::Status (*const entry)(A...) = CpuTable<Table>().*Member;
    std::tuple<std::decay_t<A>...> args(a...);  // the arguments as launched (pointers and values)
    const int rc = Launch(
        stream.handle, [entry, args] { Record(std::apply(entry, args)); }, Name::Value(),
        std::move(uses));
    if (rc != cudaSuccess) {
      return absl::InternalError(
          absl::StrCat(Name::Value(), ": launch failed (cuda error ", rc, ")"));
    }
    return absl::OkStatus();
  }
};

#define FP8RT_ON_DEVICE(table, Table, member)               \
  do {                                                      \
    struct Name {                                           \
      static const char* Value() { return #member; }        \
    };                                                      \
    (table).member = &OnDevice<&Table::member, Name>::Call; \
  } while (0)

// What each allocation is, for its free, kept as the CUDA backend keeps it (its own registry).
// Never destroyed (as the backend's own), so that a free during static destruction still finds it.
kernels::cuda_internal::AllocationRegistry& Allocations() {
  static auto* registry = new kernels::cuda_internal::AllocationRegistry;
  return *registry;
}

using Kind = kernels::cuda_internal::AllocationRegistry::Kind;

absl::StatusOr<void*> Malloc(size_t bytes, Kind kind) {
  void* p = nullptr;
  const cudaError_t e = kind == Kind::kPinnedHost ? cudaMallocHost(&p, bytes)
                        : kind == Kind::kStreamOrdered
                            ? cudaMallocAsync(&p, bytes, cudaStreamLegacy)
                            : cudaMalloc(&p, bytes);
  if (e != cudaSuccess) {
    return absl::ResourceExhaustedError(absl::StrCat("emulated allocation of ", bytes, " bytes"));
  }
  Allocations().Add(p, bytes, kind);
  return p;
}

// Freed by its kind: device-only arrays in stream order on the default stream (cudaFreeAsync), as
// the CUDA pool frees them; pinned memory with cudaFreeHost; the rest with cudaFree.
void Deallocate(void* p) {
  if (p == nullptr) return;
  switch (Allocations().Remove(p)) {
    case Kind::kStreamOrdered:
      (void)cudaFreeAsync(p, cudaStreamLegacy);
      return;
    case Kind::kPinnedHost:
      (void)cudaFreeHost(p);
      return;
    default:
      (void)cudaFree(p);
      return;
  }
}

absl::Status Synchronize(kernels::Stream stream) {
  const cudaError_t e = cudaStreamSynchronize(static_cast<cudaStream_t>(stream.handle));
  if (e != cudaSuccess) return absl::InternalError("emulated cudaStreamSynchronize failed");
  return DeviceOpError();
}

// The FP8 GEMMs given to the device, those whose shape or formats would take them off cuBLASLt on
// a Hopper GPU (RouteFp8Gemm at compute capability 9.0), and the first of those.
std::atomic<int64_t> gemms_checked{0};
std::atomic<int64_t> gemms_off_cublaslt{0};
std::mutex route_mu;
std::string first_off_cublaslt;

struct GemmFp8Name {
  static const char* Value() { return "gemm_fp8"; }
};

absl::Status GemmFp8OnDevice(const kernels::Fp8GemmArgs& args, kernels::Stream stream) {
  gemms_checked.fetch_add(1);
  const kernels::cuda_internal::Fp8GemmRoute route =
      kernels::cuda_internal::RouteFp8Gemm(args, /*cc=*/90);
  if (!route.cublaslt && gemms_off_cublaslt.fetch_add(1) == 0) {
    std::lock_guard<std::mutex> lock(route_mu);
    first_off_cublaslt =
        absl::StrCat("M ", args.m, ", N ", args.n, ", K ", args.k, ": ", route.why);
  }
  return OnDevice<&kernels::OpTable::gemm_fp8, GemmFp8Name>::Call(args, stream);
}

}  // namespace

// Every LayerOps member is a function pointer, and each is wrapped or replaced below: a member
// added to LayerOps must be added there too (this fails until it is).
static_assert(sizeof(kernels::LayerOps) == 44 * sizeof(void (*)()),
              "LayerOps changed: wrap its new entries in CpuOpsOnDevice");

const kernels::OpTable& CpuOpsOnDevice() {
  static const kernels::LayerOps layer = [] {
    using kernels::LayerOps;
    LayerOps l = *kernels::CpuOps().layer;
    FP8RT_ON_DEVICE(l, LayerOps, embedding_forward);
    FP8RT_ON_DEVICE(l, LayerOps, embedding_backward);
    FP8RT_ON_DEVICE(l, LayerOps, rmsnorm_forward);
    FP8RT_ON_DEVICE(l, LayerOps, rmsnorm_backward);
    FP8RT_ON_DEVICE(l, LayerOps, attention_forward);
    FP8RT_ON_DEVICE(l, LayerOps, attention_backward);
    FP8RT_ON_DEVICE(l, LayerOps, attention_forward_bf16);
    FP8RT_ON_DEVICE(l, LayerOps, attention_backward_bf16);
    FP8RT_ON_DEVICE(l, LayerOps, gelu_forward);
    FP8RT_ON_DEVICE(l, LayerOps, gelu_backward);
    FP8RT_ON_DEVICE(l, LayerOps, layernorm_forward);
    FP8RT_ON_DEVICE(l, LayerOps, layernorm_backward);
    FP8RT_ON_DEVICE(l, LayerOps, bias_forward);
    FP8RT_ON_DEVICE(l, LayerOps, bias_backward);
    FP8RT_ON_DEVICE(l, LayerOps, rope_forward);
    FP8RT_ON_DEVICE(l, LayerOps, rope_backward);
    FP8RT_ON_DEVICE(l, LayerOps, swiglu_forward);
    FP8RT_ON_DEVICE(l, LayerOps, swiglu_backward);
    FP8RT_ON_DEVICE(l, LayerOps, residual_forward);
    FP8RT_ON_DEVICE(l, LayerOps, residual_backward);
    FP8RT_ON_DEVICE(l, LayerOps, cross_entropy_forward);
    FP8RT_ON_DEVICE(l, LayerOps, cross_entropy_backward);
    FP8RT_ON_DEVICE(l, LayerOps, moe_route);
    FP8RT_ON_DEVICE(l, LayerOps, gather_rows);
    FP8RT_ON_DEVICE(l, LayerOps, scatter_rows);
    FP8RT_ON_DEVICE(l, LayerOps, moe_combine);
    FP8RT_ON_DEVICE(l, LayerOps, moe_combine_backward);
    FP8RT_ON_DEVICE(l, LayerOps, moe_router_backward);
    FP8RT_ON_DEVICE(l, LayerOps, fill);
    FP8RT_ON_DEVICE(l, LayerOps, copy);
    FP8RT_ON_DEVICE(l, LayerOps, transpose);
    FP8RT_ON_DEVICE(l, LayerOps, transpose_bytes);
    FP8RT_ON_DEVICE(l, LayerOps, split_heads);
    FP8RT_ON_DEVICE(l, LayerOps, join_heads);
    FP8RT_ON_DEVICE(l, LayerOps, sum_squares);
    FP8RT_ON_DEVICE(l, LayerOps, adamw);
    FP8RT_ON_DEVICE(l, LayerOps, zero_bytes);
    FP8RT_ON_DEVICE(l, LayerOps, prefetch);
    FP8RT_ON_DEVICE(l, LayerOps, copy_bytes);
    l.synchronize = &Synchronize;
    l.allocate = [](size_t bytes) { return Malloc(bytes, Kind::kDevice); };
    l.allocate_device = [](size_t bytes) { return Malloc(bytes, Kind::kStreamOrdered); };
    l.allocate_host = [](size_t bytes) { return Malloc(bytes, Kind::kPinnedHost); };
    l.deallocate = &Deallocate;
    return l;
  }();
  static const kernels::OpTable table = [] {
    using kernels::OpTable;
    OpTable t = kernels::CpuOps();
    // The model makes the CUDA backend's choices (MoE expert rows padded for cuBLASLt).
    t.backend = kernels::Backend::kCuda;
    FP8RT_ON_DEVICE(t, OpTable, quantize);
    FP8RT_ON_DEVICE(t, OpTable, dequantize);
    FP8RT_ON_DEVICE(t, OpTable, amax);
    FP8RT_ON_DEVICE(t, OpTable, convert);
    t.gemm_fp8 = &GemmFp8OnDevice;
    FP8RT_ON_DEVICE(t, OpTable, gemm_bf16);
    FP8RT_ON_DEVICE(t, OpTable, gemm_f32);
    FP8RT_ON_DEVICE(t, OpTable, cast_transpose);
    t.layer = &layer;
    return t;
  }();
  return table;
}

void ResetDeviceOpError() {
  std::lock_guard<std::mutex> lock(error_mu);
  first_error = absl::OkStatus();
}

absl::Status DeviceOpError() {
  std::lock_guard<std::mutex> lock(error_mu);
  return first_error;
}

int64_t DeviceOpsRun() { return ops_run.load(); }

int64_t Fp8GemmsChecked() { return gemms_checked.load(); }

int64_t Fp8GemmsOffCublasLt() { return gemms_off_cublaslt.load(); }

std::string FirstFp8GemmOffCublasLt() {
  std::lock_guard<std::mutex> lock(route_mu);
  return first_off_cublaslt;
}

void ResetFp8GemmRoutes() {
  std::lock_guard<std::mutex> lock(route_mu);
  gemms_checked = 0;
  gemms_off_cublaslt = 0;
  first_off_cublaslt.clear();
}

}  // namespace fp8rt::hostgpu
