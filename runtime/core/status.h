// Status helpers used across fp8rt.
//
// Errors are values: functions return absl::Status or absl::StatusOr<T>. These macros keep the
// early-return boilerplate short. Kinds used across the project: InvalidArgument (bad input,
// naming the field or file), NotFound, DataLoss (corrupt checkpoint or data file), Unavailable
// (a dead peer), Unimplemented (code that is not written yet says so).
#ifndef FP8RT_RUNTIME_CORE_STATUS_H_
#define FP8RT_RUNTIME_CORE_STATUS_H_

#include "absl/status/status.h"
#include "absl/status/statusor.h"

#define FP8RT_CONCAT_INNER_(a, b) a##b
#define FP8RT_CONCAT_(a, b) FP8RT_CONCAT_INNER_(a, b)

// Returns from the enclosing function if `expr` (an absl::Status) is not OK.
#define FP8RT_RETURN_IF_ERROR(expr)                \
  do {                                             \
    ::absl::Status fp8rt_status_ = (expr);         \
    if (!fp8rt_status_.ok()) return fp8rt_status_; \
  } while (false)

// `lhs = value of statusor_expr`, or returns its error.
#define FP8RT_ASSIGN_OR_RETURN(lhs, statusor_expr) \
  FP8RT_ASSIGN_OR_RETURN_IMPL_(FP8RT_CONCAT_(fp8rt_statusor_, __LINE__), lhs, statusor_expr)
#define FP8RT_ASSIGN_OR_RETURN_IMPL_(tmp, lhs, statusor_expr) \
  auto tmp = (statusor_expr);                                 \
  if (!tmp.ok()) return std::move(tmp).status();              \
  lhs = std::move(tmp).value()

#endif  // FP8RT_RUNTIME_CORE_STATUS_H_
