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
#include <functional>
#include <map>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <utility>
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

// One tensor of a file; `data` points into the file's bytes (a mapping or a buffer), which every
// copy of the SafetensorsFile shares and keeps alive.
struct SafetensorsTensor {
  std::string name;
  SafetensorsDtype dtype = SafetensorsDtype::kF32;
  std::vector<int64_t> shape;  // empty for a scalar
  std::span<const std::byte> data;
  int64_t NumElements() const;
};

class SafetensorsFile {
 public:
  // Checks a whole file, mapped read-only (MAP_PRIVATE; read into memory where the file system
  // cannot map it): its tensor bytes are paged in when read, and the ranks of a node that read
  // one file share its pages in the page cache. As with any mapped file, the file must not be
  // truncated or rewritten in place while the SafetensorsFile lives, and an I/O error while a
  // page is read in raises SIGBUS instead of returning an error.
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
  // ReadFloat32's checks alone (the tensor is there, of that shape and a dtype it reads), without
  // converting anything.
  absl::Status CheckFloat32(std::string_view name, std::span<const int64_t> shape) const;

 private:
  SafetensorsFile() = default;
  // Parse's checks over `bytes`, which `storage` keeps alive.
  static absl::StatusOr<SafetensorsFile> FromBytes(std::shared_ptr<const void> storage,
                                                   std::span<const std::byte> bytes,
                                                   std::string name);

  std::string name_;
  // The whole file: the bytes Parse was given, or Read's read-only mapping of the file (unmapped
  // with the last copy of this pointer); tensors_[i].data points into it.
  std::shared_ptr<const void> storage_;
  std::vector<SafetensorsTensor> tensors_;
  std::map<std::string, size_t, std::less<>> index_;  // name -> index into tensors_
  std::map<std::string, std::string> metadata_;
};

// A model's weights as Hugging Face stores them: one safetensors file, or several listed by an
// index (what transformers' save_pretrained writes for a large model:
// model.safetensors.index.json, {"metadata": {...}, "weight_map": {tensor name: file name}}, the
// files beside it).
//
// Open(path) takes a .safetensors file, an index (a name ending in .json), or a folder holding
// model.safetensors or model.safetensors.index.json (the single file first, as transformers
// looks). The index is checked before any tensor is used, and every error is InvalidArgument
// (NotFound for a missing file or folder entry) whose message starts with the index's or the
// shard's path and quotes at most 64 bytes of what it was given:
//   - at most 100 MB; a JSON object with no duplicate key; "weight_map" a non-empty object of
//     strings; "metadata", when there, an object (its contents are not used);
//   - each file name a plain name in the index's folder (no '/', '\\', "." or "..", at most 255
//     bytes), each file a valid safetensors file (SafetensorsFile::Read; its error also names
//     the index);
//   - every tensor the index lists is in the file it names, and every tensor of every file is
//     listed, with that file.
class SafetensorsSet {
 public:
  static absl::StatusOr<SafetensorsSet> Open(const std::string& path);
  // One file already read.
  static SafetensorsSet Of(SafetensorsFile file);

  SafetensorsSet(SafetensorsSet&&) = default;
  SafetensorsSet& operator=(SafetensorsSet&&) = default;

  // The path opened (the index's, or the single file's).
  const std::string& name() const { return name_; }
  // The files, in the order of their first tensor in the weight_map's sorted names.
  const std::vector<SafetensorsFile>& files() const { return files_; }
  // Null when no file has a tensor of that name.
  const SafetensorsTensor* Find(std::string_view name) const;
  // SafetensorsFile::ReadFloat32 of the file that holds `name` (its errors name that file);
  // InvalidArgument naming the set when no file does.
  absl::StatusOr<std::vector<float>> ReadFloat32(std::string_view name,
                                                 std::span<const int64_t> shape) const;
  // SafetensorsFile::CheckFloat32 of the file that holds `name` (as ReadFloat32).
  absl::Status CheckFloat32(std::string_view name, std::span<const int64_t> shape) const;

 private:
  SafetensorsSet() = default;

  std::string name_;
  std::vector<SafetensorsFile> files_;
  std::map<std::string, size_t, std::less<>> file_of_;  // tensor name -> index into files_
};

// The file Open(path) reads first: `path` itself, or for a folder its model.safetensors or
// model.safetensors.index.json. NotFound naming the folder when it holds neither.
absl::StatusOr<std::string> ResolveSafetensorsPath(const std::string& path);

// The weight_map of an index's text (`name` stands for its path in error messages): (tensor
// name, file name) pairs sorted by tensor name, checked as Open checks them.
absl::StatusOr<std::vector<std::pair<std::string, std::string>>> ParseSafetensorsIndex(
    std::string_view text, const std::string& name);

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
