// Child processes of the benchmarks: the programs a benchmark runs to completion (`fp8rt bench
// convergence` runs fp8rt-launch twice) and the peers it talks to in lines while it runs
// (`fp8rt bench step --peer torch` steps scripts/bench-torch between its own steps).
//
// Index:
//   RunToStderr  runs a program to its end, its stdout on our stderr
//   LineChild    a program started with pipes on its stdin and stdout: write a line, read a line
//
// Not thread-safe: one thread owns a LineChild. fork() from a multi-threaded process is fine
// here: the child only execs.
#ifndef FP8RT_LAUNCHER_BENCH_SUBPROCESS_H_
#define FP8RT_LAUNCHER_BENCH_SUBPROCESS_H_

#include <sys/types.h>

#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

namespace fp8rt::bench {

// Runs argv (argv[0] a path) with its stdout on our stderr (a launcher's progress lines), and
// waits. InternalError naming the command and its exit status or signal when it fails;
// `failure_hint` is appended to that message (where to look for its log).
[[nodiscard]] absl::Status RunToStderr(const std::vector<std::string>& argv,
                                       std::string_view failure_hint = "");

// A child that reads commands from its stdin and answers on its stdout, one line each; its stderr
// is ours. The child gets SIGTERM if this process dies. Destroying it closes the child's stdin and
// waits for it to exit (SIGKILL after 10 s).
class LineChild {
 public:
  // Starts argv (argv[0] a path, or a name looked up on PATH). Also ignores SIGPIPE in this
  // process, so that a write to a child that died is an error (EPIPE) and not our death.
  // Unavailable when fork fails; a failed exec shows as the child exiting 127 (its stderr says
  // why) at the first ReadLine.
  [[nodiscard]] static absl::StatusOr<std::unique_ptr<LineChild>> Start(
      const std::vector<std::string>& argv);
  ~LineChild();
  LineChild(const LineChild&) = delete;
  LineChild& operator=(const LineChild&) = delete;

  // Writes `line` and a newline to the child's stdin. Unavailable when the child has gone.
  [[nodiscard]] absl::Status WriteLine(std::string_view line);
  // The next line of the child's stdout, without its newline. DeadlineExceeded after
  // `timeout_s` seconds without one; Unavailable, with the child's exit status, at its end.
  [[nodiscard]] absl::StatusOr<std::string> ReadLine(double timeout_s);
  // Closes the child's stdin and waits for it: OK when it exits 0, else Unavailable naming its
  // exit status.
  [[nodiscard]] absl::Status Finish();

  pid_t pid() const { return pid_; }

 private:
  LineChild(std::string name, pid_t pid, int to_child, int from_child);
  // Reaps the child (SIGKILL after `grace_s`) and describes how it ended; "" when it exited 0.
  std::string Reap(double grace_s);

  const std::string name_;  // argv[0], for messages; fixed after construction
  pid_t pid_;               // -1 once reaped
  int to_child_;            // the child's stdin; -1 once closed
  int from_child_;          // the child's stdout; -1 once closed
  std::string buffer_;      // read from the child, not yet returned as a line
};

}  // namespace fp8rt::bench

#endif  // FP8RT_LAUNCHER_BENCH_SUBPROCESS_H_
