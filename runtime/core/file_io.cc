// Whole-file I/O helpers; see file_io.h.
#include "runtime/core/file_io.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstring>

#include "absl/strings/str_cat.h"

namespace fp8rt {

FdCloser::~FdCloser() {
  if (fd_ >= 0) ::close(fd_);
}

int FdCloser::Close() {
  if (fd_ < 0) return 0;
  const int rc = ::close(fd_);
  fd_ = -1;
  return rc == 0 ? 0 : errno;
}

namespace {

absl::Status Invalid(const std::string& path, const std::string& why) {
  return absl::InvalidArgumentError(absl::StrCat(path, ": ", why));
}

}  // namespace

absl::StatusOr<OpenedFile> OpenRegularFile(const std::string& path) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC | O_NONBLOCK);
  if (fd < 0) {
    const int err = errno;
    if (err == ENOENT) return absl::NotFoundError(absl::StrCat(path, ": no such file"));
    return Invalid(path, absl::StrCat("cannot open: ", std::strerror(err)));
  }
  FdCloser closer(fd);
  struct stat st {};
  if (::fstat(fd, &st) != 0) {
    return Invalid(path, absl::StrCat("cannot stat: ", std::strerror(errno)));
  }
  if (!S_ISREG(st.st_mode)) return Invalid(path, "not a regular file");
  closer.Release();
  return OpenedFile{fd, static_cast<size_t>(st.st_size)};
}

absl::StatusOr<std::string> ReadTextFile(const std::string& path, uint64_t max_bytes) {
  absl::StatusOr<OpenedFile> f = OpenRegularFile(path);
  if (!f.ok()) return f.status();
  FdCloser closer(f->fd);
  if (f->size > max_bytes) {
    return Invalid(
        path, absl::StrCat("the file is ", f->size, " bytes, over the ", max_bytes, "-byte limit"));
  }
  std::string text(f->size, '\0');
  if (absl::Status s = ReadFileStart(f->fd, text.data(), text.size(), path); !s.ok()) return s;
  return text;
}

absl::Status ReadFileStart(int fd, void* dst, size_t size, const std::string& path) {
  if (PreadFully(fd, 0, dst, size)) return absl::OkStatus();
  return Invalid(path, errno == 0 ? std::string("the file shrank while being read")
                                  : absl::StrCat("read failed: ", std::strerror(errno)));
}

bool PreadFully(int fd, uint64_t offset, void* dst, size_t size) {
  auto* out = static_cast<char*>(dst);
  while (size > 0) {
    const ssize_t n = ::pread(fd, out, size, static_cast<off_t>(offset));
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) {
      if (n == 0) errno = 0;
      return false;
    }
    out += n;
    offset += static_cast<uint64_t>(n);
    size -= static_cast<size_t>(n);
  }
  return true;
}

bool WriteFully(int fd, const void* src, size_t size) {
  const auto* in = static_cast<const char*>(src);
  while (size > 0) {
    const ssize_t n = ::write(fd, in, size);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) {
      if (n == 0) errno = EIO;
      return false;
    }
    in += n;
    size -= static_cast<size_t>(n);
  }
  return true;
}

absl::Status WriteFileAtomically(const std::string& path,
                                 std::span<const std::span<const std::byte>> parts,
                                 const std::string& what) {
  const std::string tmp = absl::StrCat(path, ".tmp.", ::getpid());
  const int fd = ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (fd < 0) {
    return absl::ErrnoToStatus(errno, absl::StrCat(what, ": cannot create ", tmp));
  }
  FdCloser closer(fd);
  // Removes the temporary file and reports the errno of the step that failed.
  const auto fail = [&](const std::string& step) {
    const int error = errno;
    closer.Close();
    ::unlink(tmp.c_str());
    return absl::ErrnoToStatus(error, absl::StrCat(what, ": ", step, " failed"));
  };
  for (size_t i = 0; i < parts.size(); ++i) {
    if (!parts[i].empty() && !WriteFully(fd, parts[i].data(), parts[i].size())) {
      return fail(absl::StrCat("writing part ", i + 1, " of ", parts.size()));
    }
  }
  // fsync before rename, so that after a crash the path holds either the old or the new file.
  if (::fsync(fd) != 0) return fail("fsync");
  if (const int error = closer.Close(); error != 0) {
    ::unlink(tmp.c_str());
    return absl::ErrnoToStatus(error, absl::StrCat(what, ": close failed"));
  }
  if (std::rename(tmp.c_str(), path.c_str()) != 0) {
    const int error = errno;
    ::unlink(tmp.c_str());
    return absl::ErrnoToStatus(error, absl::StrCat(what, ": renaming ", tmp, " into place failed"));
  }
  return absl::OkStatus();
}

}  // namespace fp8rt
