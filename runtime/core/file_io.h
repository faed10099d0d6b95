// Whole-file I/O that the on-disk formats share (.npy, safetensors).
//
//   FdCloser             closes a descriptor on scope exit; Close() reports close()'s errno
//   OpenRegularFile      a descriptor of a regular file and its size, or an error naming it
//   ReadTextFile         a whole (small) regular file as a string, refused past a size limit
//   ReadFileStart        the first bytes of an open file, or an error naming it
//   PreadFully           exactly `size` bytes at an offset (errno 0: the file ended early)
//   WriteFully           exactly `size` bytes, retrying short writes and EINTR
//   WriteFileAtomically  the concatenation of byte spans through a temporary file that is
//                        fsynced and renamed into place, so that after a crash the path holds
//                        the old file or the new one, never a part
#ifndef FP8RT_RUNTIME_CORE_FILE_IO_H_
#define FP8RT_RUNTIME_CORE_FILE_IO_H_

#include <cstddef>
#include <cstdint>
#include <span>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

namespace fp8rt {

class FdCloser {
 public:
  explicit FdCloser(int fd) : fd_(fd) {}
  ~FdCloser();
  FdCloser(const FdCloser&) = delete;
  FdCloser& operator=(const FdCloser&) = delete;
  // Closes now and reports close()'s errno (0 on success, or when already closed).
  int Close();
  // Gives the descriptor up without closing it.
  void Release() { fd_ = -1; }

 private:
  int fd_;
};

// `path` opened read-only (O_CLOEXEC; O_NONBLOCK, so that a FIFO is refused instead of blocking
// the open), checked to be a regular file. The caller closes fd (FdCloser). NotFound naming the
// path when it does not exist; InvalidArgument "PATH: why" when it cannot be opened or stat'ed or
// is not a regular file.
struct OpenedFile {
  int fd = -1;
  size_t size = 0;
};
absl::StatusOr<OpenedFile> OpenRegularFile(const std::string& path);

// The whole regular file `path` (OpenRegularFile's errors), InvalidArgument naming it when it is
// over `max_bytes`, cannot be read, or shrinks while being read.
absl::StatusOr<std::string> ReadTextFile(const std::string& path, uint64_t max_bytes);

// ReadFileStart: the first `size` bytes of the open file `fd` into dst, InvalidArgument naming
// `path` when a read fails or the file is shorter (it shrank while being read).
absl::Status ReadFileStart(int fd, void* dst, size_t size, const std::string& path);

// Reads exactly `size` bytes at `offset`. Returns false with errno set on an I/O error, or with
// errno == 0 when the file ended early (it shrank while being read).
bool PreadFully(int fd, uint64_t offset, void* dst, size_t size);

// Writes exactly `size` bytes. Returns false with errno set on an error.
bool WriteFully(int fd, const void* src, size_t size);

// Writes parts[0], parts[1], ... to `path` via `path`.tmp.PID (fsync, then rename). Errors name
// `what` (e.g. the path) and the step that failed; the temporary file is removed on any error.
absl::Status WriteFileAtomically(const std::string& path,
                                 std::span<const std::span<const std::byte>> parts,
                                 const std::string& what);

}  // namespace fp8rt

#endif  // FP8RT_RUNTIME_CORE_FILE_IO_H_
