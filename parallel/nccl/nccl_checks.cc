// NcclErrorStatus: the NCCL half of runtime/core/checks.h (NCCL_RETURN_IF_ERROR).
#include <nccl.h>

#include <string>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "runtime/core/checks.h"

namespace fp8rt::internal {
namespace {

// The absl kind a caller can act on: a dead peer or a broken network is Unavailable (restart
// from a checkpoint), a bad call is InvalidArgument / FailedPrecondition, the rest is Internal.
absl::StatusCode CodeFor(ncclResult_t rc) {
  switch (rc) {
    case ncclSystemError:  // sockets, shared memory, the network
    case ncclRemoteError:  // a peer exited or the network failed
      return absl::StatusCode::kUnavailable;
    case ncclInvalidArgument:
      return absl::StatusCode::kInvalidArgument;
    case ncclInvalidUsage:
      return absl::StatusCode::kFailedPrecondition;
    case ncclUnhandledCudaError:
    case ncclInternalError:
      return absl::StatusCode::kInternal;
    default:
      return absl::StatusCode::kUnknown;
  }
}

}  // namespace

absl::Status NcclErrorStatus(int code, const char* expr, const char* file, int line) {
  const auto rc = static_cast<ncclResult_t>(code);
  std::string message = absl::StrCat(expr, " failed at ", file, ":", line, ": NCCL error ", code,
                                     " (", ncclGetErrorString(rc), ")");
  // NCCL keeps a more precise description of its most recent failure (for example which
  // argument was wrong); it may describe an earlier call, so it is labelled as NCCL's.
  const char* last = ncclGetLastError(nullptr);
  if (last != nullptr && last[0] != '\0') absl::StrAppend(&message, "; NCCL's last error: ", last);
  return absl::Status(CodeFor(rc), message);
}

}  // namespace fp8rt::internal
