// The MoE routing entries' argument check (kernels/moe_routing.h).
#include "kernels/moe_routing.h"

#include "absl/strings/str_cat.h"
#include "runtime/core/status.h"

namespace fp8rt::kernels::moe {

absl::Status CheckSizes(const char* op, int64_t n, int64_t e, int64_t k, int64_t c) {
  for (const auto& [name, value] :
       {std::pair<const char*, int64_t>{"n", n}, {"e", e}, {"k", k}, {"c", c}}) {
    if (value < 0) {
      return absl::InvalidArgumentError(absl::StrCat(op, ": ", name, " is ", value, " (< 0)"));
    }
  }
  if (n > 0 && e > 0 && (k < 1 || k > e)) {
    return absl::InvalidArgumentError(
        absl::StrCat(op, ": k is ", k, " with e = ", e, " experts (must be in [1, e])"));
  }
  return absl::OkStatus();
}

absl::Status CheckRouteSizes(const char* op, int64_t n, int64_t e, int64_t k) {
  FP8RT_RETURN_IF_ERROR(CheckSizes(op, n, e, k, 0));
  if (n > 0 && e == 0) {
    return absl::InvalidArgumentError(
        absl::StrCat(op, ": e is 0 with n = ", n, " tokens (routing needs at least one expert)"));
  }
  return absl::OkStatus();
}

}  // namespace fp8rt::kernels::moe
