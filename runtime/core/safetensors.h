// Hugging Face safetensors files: how fp8rt's weights leave for (and come from) the Hugging Face
// ecosystem (`fp8rt export`, `init.from`; issue 17).
//
// The format (huggingface/safetensors, README "Format"): an 8-byte little-endian unsigned
// header size N, then N bytes of a UTF-8 JSON object, then the byte buffer. The object maps each
// tensor's name to {"dtype": "F32" | "BF16" | ..., "shape": [d0, d1, ...], "data_offsets":
// [begin, end]}, offsets in bytes relative to the start of the byte buffer, end exclusive; the key
// "__metadata__" may hold an object of string values. Tensors are little-endian and row-major.
//
// Reading checks everything the format's reference implementation checks, before any tensor is
// used: N at most 100 MB and inside the file; the header a JSON object (trailing spaces allowed)
// with no duplicate key; each entry exactly dtype, shape and data_offsets, of known dtype and
// non-negative dimensions; end - begin equal to the element count times the element size; the
// tensors covering the byte buffer exactly, with no gap and no overlap. Every error is
// InvalidArgument (NotFound for a missing file) whose message starts with the file name, names
// the tensor and field where there is one, and quotes at most 64 bytes of what it was given.
//
// Writing puts "__metadata__" first, then the tensors in the order given, packed with no gaps;
// the header is padded with spaces to a multiple of 8 bytes (as the reference writer does), and
// the file goes through a temporary name renamed into place (runtime/core/file_io.h). The same
// tensors and metadata always give the same bytes.
#ifndef FP8RT_RUNTIME_CORE_SAFETENSORS_H_
#define FP8RT_RUNTIME_CORE_SAFETENSORS_H_

#include <cstddef>
#include <cstdint>
#include <map>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

namespace fp8rt {

// The format's dtypes that fp8rt names. Others (U16, U32, U64, F8_E8M0, ...) are refused on read
// with their name.
enum class SafetensorsDtype { kBool, kU8, kI8, kF8E5M2, kF8E4M3, kI16, kF16, kBF16, kI32, kF32,
                              kF64, kI64 };

std::string_view SafetensorsDtypeName(SafetensorsDtype dtype);  // "F32", "BF16", ...
size_t SafetensorsDtypeSize(SafetensorsDtype dtype);            // bytes per element

// One tensor of a file read into memory; `data` points into the SafetensorsFile that owns it.
struct SafetensorsTensor {
  std::string name;
  SafetensorsDtype dtype = SafetensorsDtype::kF32;
  std::vector<int64_t> shape;  // empty for a scalar
  std::span<const std::byte> data;
  int64_t NumElements() const;
};

class SafetensorsFile {
 public:
  // Reads and checks a whole file.
  static absl::StatusOr<SafetensorsFile> Read(const std::string& path);
  // Checks bytes already in memory; `name` stands for the path in error messages.
  static absl::StatusOr<SafetensorsFile> Parse(std::vector<std::byte> bytes, std::string name);

  SafetensorsFile(SafetensorsFile&&) = default;
  SafetensorsFile& operator=(SafetensorsFile&&) = default;

  const std::string& name() const { return name_; }
  // In the order of their data in the file.
  const std::vector<SafetensorsTensor>& tensors() const { return tensors_; }
  // Null when the file has no tensor of that name.
  const SafetensorsTensor* Find(std::string_view name) const;
  const std::map<std::string, std::string>& metadata() const { return metadata_; }

  // The tensor `name` as FP32 values, checked against `shape`: F32 as it is, BF16 and F16
  // widened exactly. InvalidArgument naming the file and the tensor when it is missing, has
  // another shape or another dtype.
  absl::StatusOr<std::vector<float>> ReadFloat32(std::string_view name,
                                                 std::span<const int64_t> shape) const;

 private:
  SafetensorsFile() = default;

  std::string name_;
  std::vector<std::byte> bytes_;  // the whole file; tensors_[i].data points into it
  std::vector<SafetensorsTensor> tensors_;
  std::map<std::string, std::string> metadata_;
};

// A tensor to write: `data` holds NumElements(shape) elements of `dtype`, little-endian.
struct SafetensorsWriteTensor {
  std::string name;
  SafetensorsDtype dtype = SafetensorsDtype::kF32;
  std::vector<int64_t> shape;
  const void* data = nullptr;
};

// Writes a safetensors file. InvalidArgument naming the tensor for an empty or duplicate name,
// the reserved name "__metadata__", a negative dimension or null data with elements.
absl::Status WriteSafetensors(const std::string& path,
                              std::span<const SafetensorsWriteTensor> tensors,
                              const std::map<std::string, std::string>& metadata);

}  // namespace fp8rt

#endif  // FP8RT_RUNTIME_CORE_SAFETENSORS_H_
