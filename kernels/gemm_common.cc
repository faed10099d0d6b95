// Backend-independent GEMM argument validation.
#include "absl/strings/str_cat.h"
#include "kernels/gemm.h"

namespace fp8rt::kernels {
namespace {

constexpr size_t kAlign = 64;

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
    return absl::InvalidArgumentError(
        absl::StrCat("workspace_bytes is ", workspace_bytes, ", this GEMM needs ", required));
  }
  if (required > 0 && workspace == nullptr) return absl::InvalidArgumentError("workspace is null");
  if (reinterpret_cast<uintptr_t>(workspace) % kAlign != 0) {
    return absl::InvalidArgumentError("workspace must be 64-byte aligned");
  }
  return absl::OkStatus();
}

}  // namespace

absl::Status ValidateGemmArgs(const Fp8GemmArgs& args, size_t required_workspace) {
  if (args.scaling == GemmScaling::kMx32) {
    if (args.a_e8m0 == nullptr) return absl::InvalidArgumentError("a_e8m0 is null (kMx32)");
    if (args.b_e8m0 == nullptr) return absl::InvalidArgumentError("b_e8m0 is null (kMx32)");
  } else {
    if (args.a_scale_inv == nullptr) return absl::InvalidArgumentError("a_scale_inv is null");
    if (args.b_scale_inv == nullptr) return absl::InvalidArgumentError("b_scale_inv is null");
  }
  if (args.b_transposed && args.scaling != GemmScaling::kTensor) {
    return absl::InvalidArgumentError(
        "b_transposed (B given as K x N) takes tensor scaling only, not block or mx32 scales");
  }
  return ValidateCommon(args.m, args.n, args.k, args.a, args.b, args.d, args.out_type,
                        args.accumulate, args.workspace_bytes, args.workspace, required_workspace);
}

absl::Status ValidateGemmArgs(const Bf16GemmArgs& args, size_t required_workspace) {
  return ValidateCommon(args.m, args.n, args.k, args.a, args.b, args.d, args.out_type,
                        args.accumulate, args.workspace_bytes, args.workspace, required_workspace);
}

absl::Status ValidateGemmArgs(const F32GemmArgs& args) {
  return ValidateCommon(args.m, args.n, args.k, args.a, args.b, args.d, OutputType::kF32,
                        args.accumulate, 0, nullptr, 0);
}

}  // namespace fp8rt::kernels
