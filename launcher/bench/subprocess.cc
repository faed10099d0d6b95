#include "launcher/bench/subprocess.h"

#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <thread>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"

namespace fp8rt::bench {
namespace {

std::vector<char*> Argv(const std::vector<std::string>& argv) {
  std::vector<char*> args;
  for (const std::string& a : argv) args.push_back(const_cast<char*>(a.c_str()));
  args.push_back(nullptr);
  return args;
}

std::string DescribeExit(int status) {
  return WIFEXITED(status) ? absl::StrCat("exit ", WEXITSTATUS(status))
                           : absl::StrCat("signal ", WTERMSIG(status));
}

}  // namespace

absl::Status RunToStderr(const std::vector<std::string>& argv, std::string_view failure_hint) {
  std::vector<char*> args = Argv(argv);
  const pid_t pid = fork();
  if (pid < 0) return absl::InternalError(absl::StrCat("fork: ", std::strerror(errno)));
  if (pid == 0) {
    dup2(STDERR_FILENO, STDOUT_FILENO);
    execv(args[0], args.data());
    std::fprintf(stderr, "fp8rt bench: cannot run %s: %s\n", args[0], std::strerror(errno));
    _exit(127);
  }
  int status = 0;
  while (waitpid(pid, &status, 0) < 0) {
    if (errno != EINTR) return absl::InternalError(absl::StrCat("waitpid: ", std::strerror(errno)));
  }
  if (WIFEXITED(status) && WEXITSTATUS(status) == 0) return absl::OkStatus();
  return absl::InternalError(absl::StrCat("`", absl::StrJoin(argv, " "), "` failed (",
                                          DescribeExit(status), ")", std::string(failure_hint)));
}

absl::StatusOr<std::unique_ptr<LineChild>> LineChild::Start(const std::vector<std::string>& argv) {
  if (argv.empty()) return absl::InvalidArgumentError("LineChild::Start: no program");
  signal(SIGPIPE, SIG_IGN);
  int in[2], out[2];  // [0] read end, [1] write end
  if (pipe2(in, O_CLOEXEC) != 0) {
    return absl::UnavailableError(absl::StrCat("pipe: ", std::strerror(errno)));
  }
  if (pipe2(out, O_CLOEXEC) != 0) {
    const int err = errno;
    close(in[0]);
    close(in[1]);
    return absl::UnavailableError(absl::StrCat("pipe: ", std::strerror(err)));
  }
  std::vector<char*> args = Argv(argv);
  const pid_t parent = getpid();
  const pid_t pid = fork();
  if (pid < 0) {
    const int err = errno;
    for (int fd : {in[0], in[1], out[0], out[1]}) close(fd);
    return absl::UnavailableError(absl::StrCat("fork: ", std::strerror(err)));
  }
  if (pid == 0) {
    // Child: async-signal-safe calls only until exec (dup2 clears O_CLOEXEC on the copies).
    prctl(PR_SET_PDEATHSIG, SIGTERM);
    if (getppid() != parent) _exit(127);  // the parent died before prctl took effect
    dup2(in[0], STDIN_FILENO);
    dup2(out[1], STDOUT_FILENO);
    signal(SIGPIPE, SIG_DFL);
    execvp(args[0], args.data());
    const char* err = std::strerror(errno);
    const char prefix[] = "fp8rt bench: cannot exec ";
    [[maybe_unused]] ssize_t n = write(STDERR_FILENO, prefix, sizeof(prefix) - 1);
    n = write(STDERR_FILENO, args[0], std::strlen(args[0]));
    n = write(STDERR_FILENO, ": ", 2);
    n = write(STDERR_FILENO, err, std::strlen(err));
    n = write(STDERR_FILENO, "\n", 1);
    _exit(127);
  }
  close(in[0]);
  close(out[1]);
  return std::unique_ptr<LineChild>(new LineChild(argv[0], pid, in[1], out[0]));
}

LineChild::LineChild(std::string name, pid_t pid, int to_child, int from_child)
    : name_(std::move(name)), pid_(pid), to_child_(to_child), from_child_(from_child) {}

LineChild::~LineChild() {
  if (to_child_ >= 0) close(to_child_);
  to_child_ = -1;
  Reap(10.0);
  if (from_child_ >= 0) close(from_child_);
}

absl::Status LineChild::WriteLine(std::string_view line) {
  if (to_child_ < 0) return absl::FailedPreconditionError(name_ + ": its stdin is closed");
  std::string text(line);
  text += '\n';
  size_t done = 0;
  while (done < text.size()) {
    const ssize_t n = write(to_child_, text.data() + done, text.size() - done);
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) {
      return absl::UnavailableError(
          absl::StrCat(name_, ": cannot write to it: ", std::strerror(errno)));
    }
    done += static_cast<size_t>(n);
  }
  return absl::OkStatus();
}

absl::StatusOr<std::string> LineChild::ReadLine(double timeout_s) {
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::duration<double>(timeout_s);
  for (;;) {
    if (const size_t nl = buffer_.find('\n'); nl != std::string::npos) {
      std::string line = buffer_.substr(0, nl);
      buffer_.erase(0, nl + 1);
      return line;
    }
    if (from_child_ < 0) return absl::UnavailableError(name_ + ": its stdout is closed");
    const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(
        deadline - std::chrono::steady_clock::now());
    if (left.count() <= 0) {
      return absl::DeadlineExceededError(
          absl::StrCat(name_, ": no answer within ", timeout_s, " s"));
    }
    pollfd p{.fd = from_child_, .events = POLLIN, .revents = 0};
    const int ready = poll(&p, 1, static_cast<int>(std::min<int64_t>(left.count(), 1 << 30)));
    if (ready < 0 && errno == EINTR) continue;
    if (ready < 0) return absl::InternalError(absl::StrCat("poll: ", std::strerror(errno)));
    if (ready == 0) continue;  // the deadline check above ends it
    char buf[4096];
    const ssize_t n = read(from_child_, buf, sizeof(buf));
    if (n < 0 && errno == EINTR) continue;
    if (n > 0) {
      buffer_.append(buf, static_cast<size_t>(n));
      continue;
    }
    // End of its stdout: it exited (or closed it); say how.
    close(from_child_);
    from_child_ = -1;
    const std::string how = Reap(10.0);
    return absl::UnavailableError(
        absl::StrCat(name_, " ended (", how.empty() ? "exit 0" : how, ") without answering"));
  }
}

absl::Status LineChild::Finish() {
  if (to_child_ >= 0) close(to_child_);
  to_child_ = -1;
  const std::string how = Reap(10.0);
  if (how.empty()) return absl::OkStatus();
  return absl::UnavailableError(absl::StrCat(name_, " failed (", how, ")"));
}

std::string LineChild::Reap(double grace_s) {
  if (pid_ < 0) return "";
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::duration<double>(grace_s);
  int status = 0;
  for (;;) {
    const pid_t r = waitpid(pid_, &status, WNOHANG);
    if (r == pid_) break;
    if (r < 0 && errno != EINTR) {
      pid_ = -1;
      return absl::StrCat("waitpid: ", std::strerror(errno));
    }
    if (std::chrono::steady_clock::now() > deadline) {
      kill(pid_, SIGKILL);
      while (waitpid(pid_, &status, 0) < 0 && errno == EINTR) {
      }
      break;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  pid_ = -1;
  return WIFEXITED(status) && WEXITSTATUS(status) == 0 ? "" : DescribeExit(status);
}

}  // namespace fp8rt::bench
