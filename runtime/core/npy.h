// NumPy .npy files: the exchange format of `fp8rt quantize` (and of test fixtures).
//
// Reads format versions 1.0, 2.0 and 3.0 (little-endian, C order; the header dict is parsed,
// not pattern-matched). Every error is InvalidArgument (or NotFound for a missing file) and its
// message starts with the path, then names the problem ("truncated data: expected 4096 bytes,
// found 100", "unsupported dtype '<c8'", "Fortran order is not supported", ...). Writes version 1.0
// through a temporary file renamed into place, so a failed write never leaves a partial file.
// Stateless and thread-compatible.
#ifndef FP8RT_RUNTIME_CORE_NPY_H_
#define FP8RT_RUNTIME_CORE_NPY_H_

#include <cstddef>
#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

namespace fp8rt {

// Element types fp8rt reads or writes. `descr` strings: <f4 <f8 |u1 <u2 <u4 <i4 <i8.
enum class NpyDtype { kF32, kF64, kU8, kU16, kU32, kI32, kI64 };

// Size of one element in bytes.
size_t NpyDtypeSize(NpyDtype dtype);

// A whole array in memory: raw little-endian element bytes in C order.
struct NpyArray {
  NpyDtype dtype = NpyDtype::kF32;
  std::vector<int64_t> shape;  // empty for a 0-d array
  std::vector<std::byte> data;
  int64_t NumElements() const;  // product of shape (1 for 0-d)
};

// Reads a whole .npy file.
absl::StatusOr<NpyArray> ReadNpy(const std::string& path);

// Parses .npy bytes already in memory; `name` is used in error messages in place of a path.
absl::StatusOr<NpyArray> ParseNpy(std::span<const std::byte> bytes, const std::string& name);

// A dense row-major float32 matrix. A 1-D array of n values reads as 1 x n.
struct FloatMatrix {
  int64_t rows = 0;
  int64_t cols = 0;
  int rank = 2;               // rank of the array read: 1 (then rows == 1) or 2
  std::vector<float> values;  // rows * cols
};

// Reads a float32 or float64 array of rank 1 or 2 as a float32 matrix (float64 is rounded to
// nearest float32). Any other dtype or rank is an InvalidArgument naming the file.
absl::StatusOr<FloatMatrix> ReadNpyAsFloatMatrix(const std::string& path);

// Writes `data` (NumElements(shape) elements of `dtype`) as a version 1.0 .npy file.
absl::Status WriteNpy(const std::string& path, NpyDtype dtype, std::span<const int64_t> shape,
                      const void* data);

}  // namespace fp8rt

#endif  // FP8RT_RUNTIME_CORE_NPY_H_
