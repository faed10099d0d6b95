// `fp8rt launch` as a user runs it.
//
// Bad input (spec errors, bad overrides, missing options) must exit 2 with a message naming the
// field or file, before anything starts: no run folder, no launch.log, no worker. The real
// worker is not needed for that, nor for the rest: FP8RT_WORKER points the launcher at a shell
// script written here that logs its arguments and appends metrics lines as rank 0 of
// fp8rt-worker would; mpirun really runs it. stderr is a file here, so progress comes as plain
// lines.
//
// Index: SpecText/SpecYaml (the spec files), LaunchCliTest (temp folder, run helpers), the bad
// input tests, then the fake-worker runs (success, resume, failure, SIGTERM).
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdlib>
#include <filesystem>
#include <string>
#include <thread>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/support/test_support.h"

namespace fp8rt {
namespace {

namespace fs = std::filesystem;
using test::ReadFile;
using test::WriteFile;
using ::testing::HasSubstr;
using ::testing::Not;

// The parts of a spec the tests vary; the rest follows tests/data/tiny-plain.yaml.
struct SpecText {
  std::string data_path;        // data.path
  std::string steps = "100";    // train.steps, as written in the YAML
  int dp = 2;                   // parallel.dp (tp is 1)
  std::string extra_precision;  // extra lines in the precision section
};

std::string SpecYaml(const SpecText& s) {
  return "model:\n  layers: 2\n  d_model: 128\n  heads: 4\n  d_ff: 512\n  seq_len: 64\n"
         "  vocab: 256\n"
         "parallel:\n  dp: " +
         std::to_string(s.dp) +
         "\n  tp: 1\n  ep: 1\n"
         "precision:\n  mode: fp8\n  format: hybrid\n  scaling: delayed\n" +
         s.extra_precision + "train:\n  steps: " + s.steps +
         "\n  micro_batch: 8\n  lr: 1.0e-3\n  warmup: 2\n"
         "data:\n  path: " +
         s.data_path + "\n  format: text\n";
}

struct Result {
  int exit_code = -1;  // -1: killed by a signal or timed out
  std::string err;     // the launcher's stderr
};

class LaunchCliTest : public ::testing::Test {
 protected:
  void SetUp() override {
    std::string tmpl = (fs::temp_directory_path() / "fp8rt_launch_test_XXXXXX").string();
    ASSERT_NE(mkdtemp(tmpl.data()), nullptr);
    dir_ = tmpl;
    data_path_ = dir_ / "data.txt";
    std::string text;
    while (text.size() < 100 * 1024)
      text += "In the beginning God created the heaven and the earth.\n";
    WriteFile(data_path_, text);
    run_dir_ = dir_ / "run";
    // A worker that must never run in the bad-input tests: it leaves a marker if it does.
    marker_ = dir_ / "worker_ran";
    WriteWorker("touch '" + marker_.string() + "'\n");
  }

  void TearDown() override {
    std::error_code ec;
    fs::remove_all(dir_, ec);
  }

  fs::path WriteSpec(const SpecText& s, const std::string& name = "spec.yaml") {
    const fs::path path = dir_ / name;
    WriteFile(path, SpecYaml(s));
    return path;
  }

  SpecText ValidSpec() const {
    SpecText s;
    s.data_path = data_path_.string();
    return s;
  }

  // The fake fp8rt-worker: a shell script with `body` run after $run_dir is parsed from the
  // arguments and $rank is set.
  void WriteWorker(const std::string& body) {
    worker_ = dir_ / "fake-worker.sh";
    WriteFile(worker_,
              "#!/bin/sh\n"
              "rank=\"$OMPI_COMM_WORLD_RANK\"\n"
              "echo \"fake worker rank=$rank omp_num_threads=$OMP_NUM_THREADS args: $*\"\n"
              "run_dir=''; prev=''\n"
              "for arg in \"$@\"; do\n"
              "  if [ \"$prev\" = --run-dir ]; then run_dir=\"$arg\"; fi\n"
              "  prev=\"$arg\"\n"
              "done\n" +
                  body);
    fs::permissions(worker_, fs::perms::owner_all);
  }

  // Starts `fp8rt launch ARGS --no-controller` in dir_ with FP8RT_WORKER set and stderr into a
  // file. (Launches with a controller are tested with the real worker in train_test and
  // control_plane_test.)
  pid_t Start(const std::vector<std::string>& args) {
    const std::string fp8rt = std::string(FP8RT_BIN_DIR) + "/fp8rt";
    std::vector<std::string> argv = {fp8rt, "launch"};
    argv.insert(argv.end(), args.begin(), args.end());
    argv.push_back("--no-controller");  // the fake worker has no control plane to talk to
    std::vector<char*> cargs;
    for (std::string& a : argv) cargs.push_back(a.data());
    cargs.push_back(nullptr);
    const std::string err_path = (dir_ / "stderr.txt").string();
    const pid_t pid = fork();
    if (pid == 0) {
      if (chdir(dir_.c_str()) != 0) _exit(126);
      if (!freopen(err_path.c_str(), "w", stderr) || !freopen("/dev/null", "w", stdout)) {
        _exit(126);
      }
      setenv("FP8RT_WORKER", worker_.c_str(), 1);
      execv(cargs[0], cargs.data());
      _exit(127);
    }
    return pid;
  }

  Result Wait(pid_t pid, std::chrono::seconds timeout = std::chrono::seconds(120)) {
    Result result;
    const auto deadline = std::chrono::steady_clock::now() + timeout;
    int status = 0;
    while (waitpid(pid, &status, WNOHANG) == 0) {
      if (std::chrono::steady_clock::now() > deadline) {
        ADD_FAILURE() << "fp8rt launch did not exit within " << timeout.count() << " s";
        kill(pid, SIGKILL);
        waitpid(pid, &status, 0);
        break;
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(50));
    }
    if (WIFEXITED(status)) result.exit_code = WEXITSTATUS(status);
    result.err = ReadFile(dir_ / "stderr.txt");
    return result;
  }

  Result Launch(const std::vector<std::string>& args) { return Wait(Start(args)); }

  // Bad input: exit 2, and nothing was started or created.
  void ExpectRejected(const Result& r) {
    EXPECT_EQ(r.exit_code, 2) << r.err;
    EXPECT_FALSE(fs::exists(run_dir_ / "logs" / "launch.log"));
    EXPECT_FALSE(fs::exists(run_dir_)) << "the run folder is created only for a valid launch";
    EXPECT_FALSE(fs::exists(marker_)) << "a worker ran";
    EXPECT_THAT(r.err, Not(HasSubstr("--bind-to"))) << "no mpirun command line for bad input";
  }

  fs::path dir_;        // the test's temp folder (the launcher's working directory)
  fs::path data_path_;  // ~100 KB of text for data.path
  fs::path run_dir_;    // dir_/run, passed as --run-dir
  fs::path marker_;     // created by the default fake worker if it ever runs
  fs::path worker_;     // the fake worker script (FP8RT_WORKER)
};

// ---------------------------------------------------------------------------------------------
// Bad input

TEST_F(LaunchCliTest, UnknownSpecKeyIsNamed) {
  SpecText s = ValidSpec();
  s.extra_precision = "  scalng: delayed\n";
  const fs::path spec = WriteSpec(s);
  const Result r = Launch({spec.string(), "--np", "2", "--run-dir", run_dir_.string()});
  ExpectRejected(r);
  EXPECT_THAT(r.err, HasSubstr("fp8rt launch: "));
  EXPECT_THAT(r.err, HasSubstr(spec.string()));
  EXPECT_THAT(r.err, HasSubstr("precision.scalng: unknown key"));
}

TEST_F(LaunchCliTest, WrongTypeIsNamed) {
  SpecText s = ValidSpec();
  s.steps = "ten";
  const Result r = Launch({WriteSpec(s).string(), "--np", "2", "--run-dir", run_dir_.string()});
  ExpectRejected(r);
  EXPECT_THAT(r.err, HasSubstr("train.steps: expected an integer"));
}

TEST_F(LaunchCliTest, WorldSizeMustMatchDpTimesTp) {
  const Result r =
      Launch({WriteSpec(ValidSpec()).string(), "--np", "3", "--run-dir", run_dir_.string()});
  ExpectRejected(r);
  EXPECT_THAT(r.err, HasSubstr("parallel.dp"));
  EXPECT_THAT(r.err, HasSubstr("world size is 3"));
}

TEST_F(LaunchCliTest, MissingDataFileIsNamed) {
  SpecText s = ValidSpec();
  s.data_path = (dir_ / "no-such-corpus.txt").string();
  const Result r = Launch({WriteSpec(s).string(), "--np", "2", "--run-dir", run_dir_.string()});
  ExpectRejected(r);
  EXPECT_THAT(r.err, HasSubstr("data.path"));
  EXPECT_THAT(r.err, HasSubstr(s.data_path));
}

TEST_F(LaunchCliTest, MissingSpecFileIsNamed) {
  const std::string spec = (dir_ / "missing.yaml").string();
  const Result r = Launch({spec, "--np", "2", "--run-dir", run_dir_.string()});
  ExpectRejected(r);
  EXPECT_THAT(r.err, HasSubstr(spec));
}

TEST_F(LaunchCliTest, BadOverridesAreNamed) {
  const std::string spec = WriteSpec(ValidSpec()).string();
  const std::vector<std::pair<std::string, std::string>> cases = {
      {"train.stepz=5", "train.stepz: unknown key"},
      {"train.steps=ten", "train.steps: expected an integer"},
      {"train.steps", "expected KEY=VALUE"},
      {"parallel.dp=4", "parallel.dp"},  // valid key, but dp * tp no longer matches --np 2
  };
  for (const auto& [set, message] : cases) {
    SCOPED_TRACE(set);
    const Result r = Launch({spec, "--np", "2", "--set", set, "--run-dir", run_dir_.string()});
    ExpectRejected(r);
    EXPECT_THAT(r.err, HasSubstr(message));
  }
}

TEST_F(LaunchCliTest, MissingOrInvalidOptionsAreNamed) {
  const std::string spec = WriteSpec(ValidSpec()).string();
  const std::vector<std::pair<std::vector<std::string>, std::string>> cases = {
      {{spec, "--np", "2"}, "--run-dir"},
      {{spec, "--run-dir", run_dir_.string()}, "--np"},
      {{spec, "--np", "0", "--run-dir", run_dir_.string()}, "--np"},
      {{spec, "--np", "2", "--run-dir", run_dir_.string(), "--threads-per-rank", "0"},
       "--threads-per-rank"},
      {{"--np", "2", "--run-dir", run_dir_.string()}, "spec"},
  };
  for (const auto& [args, message] : cases) {
    SCOPED_TRACE(testing::PrintToString(args));
    const Result r = Launch(args);
    ExpectRejected(r);
    EXPECT_THAT(r.err, HasSubstr(message));
  }
}

TEST_F(LaunchCliTest, HelpListsLaunch) {
  const std::string cmd = std::string(FP8RT_BIN_DIR) + "/fp8rt help";
  FILE* pipe = popen(cmd.c_str(), "r");
  ASSERT_NE(pipe, nullptr);
  std::string out;
  char buf[4096];
  for (size_t n; (n = fread(buf, 1, sizeof(buf), pipe)) > 0;) out.append(buf, n);
  EXPECT_EQ(pclose(pipe), 0);
  EXPECT_THAT(out, HasSubstr("launch RUN.yaml --np N --run-dir DIR"));
}

// ---------------------------------------------------------------------------------------------
// Runs with a fake worker under mpirun

// Rank 0 appends three metrics lines after those already in the file: loss (40 - 5 * step) / 10,
// 1000 * step tokens/s; the second line is written in two halves 0.5 s apart (the launcher
// polls every 200 ms and must wait for the '\n'), and that step was skipped by the optimizer.
constexpr char kMetricsWorker[] =
    "[ \"$rank\" = 0 ] || exit 0\n"
    "m=\"$run_dir/metrics.jsonl\"\n"
    "first=$(( $(cat \"$m\" 2>/dev/null | wc -l) + 1 ))\n"
    "for step in $first $((first + 1)) $((first + 2)); do\n"
    "  loss=\"$((40 - 5 * step))e-1\"\n"
    "  if [ $step = $((first + 1)) ]; then\n"
    "    printf '{\"step\":%d,\"loss\":%s,' $step $loss >> \"$m\"\n"
    "    sleep 0.5\n"
    "    printf '\"grad_norm\":1.5,\"lr\":0.001,\"tokens_per_s\":%d,\"skipped\":true}\\n' "
    "$((1000 * step)) >> \"$m\"\n"
    "  else\n"
    "    printf '{\"step\":%d,\"loss\":%s,\"grad_norm\":1.5,\"lr\":0.001,\"tokens_per_s\":%d,"
    "\"skipped\":false}\\n' $step $loss $((1000 * step)) >> \"$m\"\n"
    "  fi\n"
    "  sleep 0.3\n"
    "done\n";

TEST_F(LaunchCliTest, RunsTheWorkersAndShowsProgress) {
  WriteWorker(kMetricsWorker);
  WriteSpec(ValidSpec());
  // Relative paths, as a user types them: the workers get absolute ones.
  const Result r = Launch({"spec.yaml", "--np", "2", "--set", "train.steps=3", "--set",
                           "train.lr=0.002", "--run-dir", "run", "--threads-per-rank", "3"});
  ASSERT_EQ(r.exit_code, 0) << r.err;
  // train.steps comes from the --set override: 3 steps, each shown (every max(1, 3/20) = 1).
  EXPECT_THAT(r.err, HasSubstr("step 1/3 loss 3.5000 tokens/s 1000 eta "));
  EXPECT_THAT(r.err, HasSubstr("step 2/3 loss 3.0000 tokens/s 2000 eta "));
  EXPECT_THAT(r.err, HasSubstr("(skipped)\n"));
  EXPECT_THAT(r.err, HasSubstr("step 3/3 loss 2.5000 tokens/s 3000 eta 0s\n"));
  EXPECT_THAT(r.err, HasSubstr("fp8rt launch: done, 3 steps, final loss 2.5000, run folder " +
                               run_dir_.string() + "\n"));
  // The command line is printed once, with the options the machine calls for.
  const std::string mpirun_line = r.err.substr(0, r.err.find('\n'));
  EXPECT_THAT(mpirun_line, HasSubstr(" -np 2 "));
  EXPECT_THAT(mpirun_line, HasSubstr(" --bind-to none -x OMP_NUM_THREADS=3 " + worker_.string()));
  EXPECT_EQ(mpirun_line.find("--allow-run-as-root") != std::string::npos, geteuid() == 0);
  EXPECT_EQ(mpirun_line.find("--oversubscribe") != std::string::npos,
            sysconf(_SC_NPROCESSORS_ONLN) < 2);

  const std::string log = ReadFile(run_dir_ / "logs" / "launch.log");
  const std::string worker_args = "args: --spec " + (dir_ / "spec.yaml").string() + " --run-dir " +
                                  run_dir_.string() + " --set train.steps=3 --set train.lr=0.002\n";
  EXPECT_THAT(log, HasSubstr("fake worker rank=0 omp_num_threads=3 " + worker_args));
  EXPECT_THAT(log, HasSubstr("fake worker rank=1 omp_num_threads=3 " + worker_args));
}

TEST_F(LaunchCliTest, ResumeSkipsEarlierMetricsAndPassesResume) {
  WriteWorker(kMetricsWorker);
  const fs::path spec = WriteSpec(ValidSpec());
  // Two steps from an earlier run, which the fake worker continues from.
  fs::create_directories(run_dir_);
  WriteFile(run_dir_ / "metrics.jsonl",
            "{\"step\":1,\"loss\":3.5,\"grad_norm\":1,\"lr\":0.001,\"tokens_per_s\":1000,"
            "\"skipped\":false}\n"
            "{\"step\":2,\"loss\":3.0,\"grad_norm\":1,\"lr\":0.001,\"tokens_per_s\":2000,"
            "\"skipped\":false}\n");
  const Result r = Launch({spec.string(), "--np", "2", "--set", "train.steps=5", "--run-dir",
                           run_dir_.string(), "--resume"});
  ASSERT_EQ(r.exit_code, 0) << r.err;
  EXPECT_THAT(r.err, Not(HasSubstr("step 1/5"))) << "lines from before the launch are not shown";
  EXPECT_THAT(r.err, Not(HasSubstr("step 2/5")));
  EXPECT_THAT(r.err, HasSubstr("step 3/5 loss 2.5000"));
  EXPECT_THAT(r.err, HasSubstr("step 5/5 loss 1.5000 tokens/s 5000 eta 0s\n"));
  EXPECT_THAT(r.err, HasSubstr("fp8rt launch: done, 5 steps, final loss 1.5000"));
  EXPECT_THAT(ReadFile(run_dir_ / "logs" / "launch.log"),
              HasSubstr(" --run-dir " + run_dir_.string() + " --set train.steps=5 --resume\n"));
}

TEST_F(LaunchCliTest, QuietPrintsNothingOnSuccess) {
  WriteWorker(kMetricsWorker);
  const Result r = Launch({WriteSpec(ValidSpec()).string(), "--np", "2", "--set", "train.steps=3",
                           "--run-dir", run_dir_.string(), "--quiet"});
  ASSERT_EQ(r.exit_code, 0) << r.err;
  EXPECT_EQ(r.err, "");
}

TEST_F(LaunchCliTest, FailedWorkersExit1WithTheLogTail) {
  WriteWorker("echo \"rank $rank: simulated out-of-memory\"\nexit 3\n");
  const Result r =
      Launch({WriteSpec(ValidSpec()).string(), "--np", "2", "--run-dir", run_dir_.string()});
  EXPECT_EQ(r.exit_code, 1) << r.err;
  // mpirun reports the exit code of the first rank that failed.
  EXPECT_THAT(r.err, HasSubstr("fp8rt launch: workers failed (exit code 3)\n"));
  EXPECT_THAT(r.err, HasSubstr("lines of the workers' output in " +
                               (run_dir_ / "logs" / "launch.log").string()));
  EXPECT_THAT(r.err, HasSubstr("simulated out-of-memory"));
  EXPECT_THAT(r.err, Not(HasSubstr("done,")));
}

// After restarts, the tail shows the last attempt's output only: not the earlier attempts', not
// the launcher's header lines in launch.log, not mpirun's job-ending boxes.
TEST_F(LaunchCliTest, LogTailShowsTheLastAttemptOnly) {
  WriteWorker(
      "case \"$*\" in *--resume*) echo \"rank $rank: out of memory in the retry\";;\n"
      "  *) echo \"rank $rank: out of memory in the first attempt\";; esac\nexit 3\n");
  const Result r = Launch({WriteSpec(ValidSpec()).string(), "--np", "2", "--run-dir",
                           run_dir_.string(), "--max-restarts", "1"});
  EXPECT_EQ(r.exit_code, 1) << r.err;
  const size_t tail = r.err.find("--- last ");
  ASSERT_NE(tail, std::string::npos) << r.err;
  const std::string shown = r.err.substr(tail);
  EXPECT_THAT(shown, HasSubstr("rank 0: out of memory in the retry"));
  EXPECT_THAT(shown, HasSubstr("rank 1: out of memory in the retry"));
  EXPECT_THAT(shown, Not(HasSubstr("first attempt"))) << shown;
  EXPECT_THAT(shown, Not(HasSubstr("=== "))) << shown;            // launch.log's header lines
  EXPECT_THAT(shown, Not(HasSubstr("Primary job"))) << shown;     // mpirun's box
  EXPECT_THAT(shown, Not(HasSubstr("--------------"))) << shown;  // its frame
  // The log itself keeps everything.
  const std::string log = ReadFile(run_dir_ / "logs" / "launch.log");
  EXPECT_THAT(log, HasSubstr("first attempt"));
  EXPECT_THAT(log, HasSubstr("=== "));
  EXPECT_THAT(log, HasSubstr("Primary job"));  // Open MPI's box, left out of the tail above
}

TEST_F(LaunchCliTest, SigtermStopsTheWorkers) {
  // Each rank records its pid, then sleeps far longer than the test waits.
  WriteWorker("echo $$ > \"$run_dir/worker.$rank.pid\"\nexec sleep 300\n");
  const pid_t launcher =
      Start({WriteSpec(ValidSpec()).string(), "--np", "2", "--run-dir", run_dir_.string()});
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(60);
  while (!(fs::exists(run_dir_ / "worker.0.pid") && fs::exists(run_dir_ / "worker.1.pid")) &&
         std::chrono::steady_clock::now() < deadline) {
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
  std::this_thread::sleep_for(std::chrono::milliseconds(200));  // the pid files are written
  std::vector<pid_t> workers;
  for (const char* name : {"worker.0.pid", "worker.1.pid"}) {
    workers.push_back(std::atoi(ReadFile(run_dir_ / name).c_str()));
    ASSERT_GT(workers.back(), 0) << name << " was not written";
  }
  ASSERT_EQ(kill(launcher, SIGTERM), 0);
  const Result r = Wait(launcher, std::chrono::seconds(60));
  EXPECT_EQ(r.exit_code, 1) << r.err;
  EXPECT_THAT(r.err, HasSubstr("fp8rt launch: SIGTERM received, stopping the workers"));
  EXPECT_THAT(r.err, HasSubstr("fp8rt launch: workers failed (exit code "));
  // mpirun stops its ranks before it exits; allow a moment for them to be reaped.
  for (const pid_t pid : workers) {
    for (int i = 0; i < 50 && kill(pid, 0) == 0; ++i) {
      std::this_thread::sleep_for(std::chrono::milliseconds(100));
    }
    EXPECT_NE(kill(pid, 0), 0) << "worker " << pid << " still runs after the launcher exited";
    if (kill(pid, 0) == 0) kill(pid, SIGKILL);
  }
}

}  // namespace
}  // namespace fp8rt
