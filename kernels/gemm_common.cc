// Backend-independent GEMM helpers: workspace sizes and argument validation.
#include "absl/strings/str_cat.h"
#include "kernels/gemm.h"

namespace fp8rt::kernels {
namespace {

constexpr size_t kAlign = 64;
size_t Padded(size_t bytes) { return (bytes + kAlign - 1) / kAlign * kAlign; }

absl::Status ValidateCommon(int64_t m, int64_t n, int64_t k, const void* a, const void* b,
                            const void* d, OutputType out_type, bool accumulate,
                            size_t workspace_bytes, const void* workspace, size_t required) {
  if (m <= 0) return absl::InvalidArgumentError(absl::StrCat("m must be > 0, got ", m));
  if (n <= 0) return absl::InvalidArgumentError(absl::StrCat("n must be > 0, got ", n));
  if (k <= 0) return absl::InvalidArgumentError(absl::StrCat("k must be > 0, got ", k));
  if (a == nullptr) return absl::InvalidArgumentError("a is null");
  if (b == nullptr) return absl::InvalidArgumentError("b is null");
  if (d == nullptr) return absl::InvalidArgumentError("d is null");
  if (accumulate && out_type != OutputType::kF32) {
    return absl::InvalidArgumentError("accumulate requires out_type F32");
  }
  if (workspace_bytes < required) {
    return absl::InvalidArgumentError(absl::StrCat("workspace_bytes is ", workspace_bytes,
                                                   ", this GEMM needs ", required));
  }
  if (required > 0 && workspace == nullptr) return absl::InvalidArgumentError("workspace is null");
  if (reinterpret_cast<uintptr_t>(workspace) % kAlign != 0) {
    return absl::InvalidArgumentError("workspace must be 64-byte aligned");
  }
  return absl::OkStatus();
}

}  // namespace

// Layout shared with kernels/cpu/gemm_cpu.cc: [A as BF16][B as BF16][block partial][accumulator].
size_t GemmWorkspaceBytes(const Fp8GemmArgs& args) {
  const size_t m = static_cast<size_t>(args.m), n = static_cast<size_t>(args.n),
               k = static_cast<size_t>(args.k);
  size_t bytes = Padded(m * k * 2) + Padded(n * k * 2);
  if (args.scaling == GemmScaling::kBlock) {
    const size_t tile_rows = m < 256 ? m : 256;
    bytes += Padded(tile_rows * n * 4);
    if (args.out_type == OutputType::kBF16) bytes += Padded(m * n * 4);
  }
  return bytes;
}

size_t GemmWorkspaceBytes(const Bf16GemmArgs& args) {
  const size_t m = static_cast<size_t>(args.m), n = static_cast<size_t>(args.n),
               k = static_cast<size_t>(args.k);
  return (args.a_type == InputType::kF32 ? Padded(m * k * 2) : 0) +
         (args.b_type == InputType::kF32 ? Padded(n * k * 2) : 0);
}

absl::Status ValidateGemmArgs(const Fp8GemmArgs& args, size_t required_workspace) {
  if (args.a_scale_inv == nullptr) return absl::InvalidArgumentError("a_scale_inv is null");
  if (args.b_scale_inv == nullptr) return absl::InvalidArgumentError("b_scale_inv is null");
  return ValidateCommon(args.m, args.n, args.k, args.a, args.b, args.d, args.out_type,
                        args.accumulate, args.workspace_bytes, args.workspace, required_workspace);
}

absl::Status ValidateGemmArgs(const Bf16GemmArgs& args, size_t required_workspace) {
  return ValidateCommon(args.m, args.n, args.k, args.a, args.b, args.d, args.out_type,
                        args.accumulate, args.workspace_bytes, args.workspace, required_workspace);
}

}  // namespace fp8rt::kernels
