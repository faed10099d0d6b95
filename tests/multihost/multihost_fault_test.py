#!/usr/bin/env python3
"""Faults across hosts (issue 21 point 2), on the network of multihost_test.py.

`fp8rt launch --hostfile` runs tests/data/tiny-plain.yaml at dp=2 on the worker hosts w1 and w2
under the controller it starts on the head host, with FP8RT_COLLECTIVE_TIMEOUT_S=6, 200 steps, a
checkpoint every 10 steps, and --max-restarts 2; each fault comes as soon as metrics.jsonl holds its step:

  1. A partition: w2's link goes down after step 10 for 14 s, longer than the collective timeout.
     The ranks report DEADLINE_EXCEEDED naming the group of the collective in flight ('dp' for
     the gradient reduce-scatter, 'world' for the norm or amax all-reduce); once the link is back the
     launcher restarts from the newest committed checkpoint and the run ends at its last step.
     The loss of every step (the attempt that finished each) equals, to the bit, that of the same
     run on one host with no fault.
  2. The head cut off from the workers: the head's own link goes down after step 6 for 10 s. The
     ranks keep training (steps land in metrics.jsonl while the head is away: the controller is
     off the step's path, issue 19), and once it is back the controller's Prometheus exposition
     shows a step past the cut.
     With --max-restarts 0 the same partition ends the launch with exit 1 ("workers failed"),
     the ranks' DEADLINE_EXCEEDED in launch.log.
  3. A whole host lost: after step 10 every process in w2's namespace is killed. mpirun fails the
     job, the launcher restarts it from the newest checkpoint on both hosts, and the run ends
     with the losses of the run with no fault.

Usage: multihost_fault_test.py BIN_DIR SOURCE_DIR. Exit 77 (skipped) as multihost_test.py.
"""

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import multihost_test as mh  # noqa: E402  (the network and the skips)

# Long enough (a few seconds of training) that a fault at step 10 always lands mid-run.
STEPS = 200


def fail(msg):
    print("FAIL: " + msg, flush=True)
    sys.exit(1)


def final_losses(run_dir):
    """step -> loss of the last line for that step (a restarted attempt's replaces the first)."""
    out = {}
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        for line in f:
            if line.strip():
                j = json.loads(line)
                out[j["step"]] = j["loss"]
    return out


def steps_written(run_dir):
    try:
        with open(os.path.join(run_dir, "metrics.jsonl")) as f:
            return [json.loads(line)["step"] for line in f if line.strip()]
    except (OSError, ValueError):
        return []


class Launch:
    """`fp8rt launch` on the head host, its output collected line by line. triggers[n](launch)
    runs in a thread of its own as soon as metrics.jsonl holds step n (polled every 10 ms;
    launch.lines holds the output so far)."""

    def __init__(self, net, fp8rt, spec, hostfile, run_dir, env, mca, sets, triggers,
                 max_restarts=2):
        argv = net.exec("head", [fp8rt, "launch", spec, "--np", "2", "--hostfile", hostfile,
                                 "--controller-listen", net.address("head") + ":0",
                                 "--max-restarts", str(max_restarts), "--run-dir", run_dir] +
                        mca + sets)
        self.t0 = time.time()
        self.proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                     text=True, env=env)
        self.lines = []

        def watch():
            pending = dict(triggers)
            while pending and self.proc.poll() is None:
                written = steps_written(run_dir)
                for step in [n for n in pending if written and max(written) >= n]:
                    threading.Thread(target=pending.pop(step), args=(self,), daemon=True).start()
                time.sleep(0.01)

        threading.Thread(target=watch, daemon=True).start()
        for line in self.proc.stdout:
            self.lines.append(line)
        self.proc.wait(timeout=600)
        self.text = "".join(self.lines)
        self.seconds = time.time() - self.t0


def main():
    if len(sys.argv) != 3:
        fail("usage: multihost_fault_test.py BIN_DIR SOURCE_DIR")
    bin_dir, source = sys.argv[1], sys.argv[2]
    fp8rt = os.path.join(bin_dir, "fp8rt")
    reason = mh.skip_reason(("ip",))
    if reason:
        print("SKIP: " + reason)
        return mh.SKIP
    tmp, net, spec_path, mca = mh.setup("fp8rt_multihost_fault_", source)
    hostfile = os.path.join(tmp, "hosts")
    with open(hostfile, "w") as f:
        f.write("w1 slots=1\nw2 slots=1\n")
    sets = ["--set", "train.steps=%d" % STEPS, "--set", "train.warmup=2", "--set",
            "checkpoint.every=10", "--set", "metrics.every=1"]
    env = dict(os.environ, OMP_NUM_THREADS="1", FP8RT_COLLECTIVE_TIMEOUT_S="6")

    # The run with no fault, on one host.
    ref_dir = os.path.join(tmp, "reference")
    r = mh.run([fp8rt, "launch", spec_path, "--np", "2", "--no-controller", "--quiet",
                "--run-dir", ref_dir] + sets, check=False, env=env, timeout=400)
    if r.returncode != 0:
        fail("the reference run exited %d:\n%s" % (r.returncode, r.stdout[-3000:]))
    want = final_losses(ref_dir)

    def link(host_port, state):
        mh.run(net.exec("head", ["ip", "link", "set", host_port, state]))

    def check_losses(name, run_dir):
        got = final_losses(run_dir)
        if sorted(got) != list(range(1, STEPS + 1)):
            fail("%s: steps %s in metrics.jsonl" % (name, sorted(got)))
        for s in range(1, STEPS + 1):
            if got[s] != want[s]:
                fail("%s: step %d loss %.9g, %.9g in the run with no fault" %
                     (name, s, got[s], want[s]))

    # 1. A partition of w2 (its bridge port up2), longer than the collective timeout.
    def partition(_):
        link("up2", "down")
        time.sleep(14)
        link("up2", "up")

    run_dir = os.path.join(tmp, "partition")
    l = Launch(net, fp8rt, spec_path, hostfile, run_dir, env, mca, sets, {10: partition})
    log = open(os.path.join(run_dir, "logs", "launch.log")).read()
    if l.proc.returncode != 0:
        fail("partition: fp8rt launch exited %d:\n%s" % (l.proc.returncode, l.text[-4000:]))
    if not re.search(r"DEADLINE_EXCEEDED: \S+ on group '(dp|world)'", log):
        fail("partition: no rank reported DEADLINE_EXCEEDED naming its group:\n" + log[-3000:])
    if "restarting from the newest committed checkpoint" not in l.text:
        fail("partition: the launcher did not restart:\n" + l.text[-3000:])
    check_losses("partition", run_dir)
    print("partition: DEADLINE_EXCEEDED naming the group, restarted, %d steps bit-identical to the "
          "run with no fault (%.1f s)" % (STEPS, l.seconds), flush=True)

    # 1b. The same partition with no restart left: exit 1, the ranks' error in the output.
    run_dir1b = os.path.join(tmp, "partition_no_restart")
    l = Launch(net, fp8rt, spec_path, hostfile, run_dir1b, env, mca, sets, {10: partition},
               max_restarts=0)
    if l.proc.returncode != 1:
        fail("partition, no restarts: exit %d, expected 1:\n%s" % (l.proc.returncode,
                                                                   l.text[-3000:]))
    log = open(os.path.join(run_dir1b, "logs", "launch.log")).read()
    if not re.search(r"DEADLINE_EXCEEDED: \S+ on group '(dp|world)'", log):
        fail("partition, no restarts: no rank reported DEADLINE_EXCEEDED naming group 'dp':\n" +
             log[-3000:])
    if "workers failed" not in l.text:
        fail("partition, no restarts: the launcher did not say the workers failed:\n" +
             l.text[-3000:])
    print("partition, --max-restarts 0: exit 1, the ranks' DEADLINE_EXCEEDED naming the group "
          "(%.1f s)" % l.seconds, flush=True)

    # 2. The head cut off (its own port up0): the workers train on. A long run, stopped through
    # the controller once the head is back and the controller has been scraped.
    run_dir2 = os.path.join(tmp, "head_cut")
    seen = {}

    def cut_head(launch):
        link("up0", "down")
        seen["before"] = steps_written(run_dir2)
        time.sleep(10)
        seen["during"] = steps_written(run_dir2)
        link("up0", "up")
        text = "".join(launch.lines)
        m = re.search(r"Prometheus metrics on (http://\S+/metrics)", text)
        g = re.search(r"controller serving gRPC on (\S+) ", text)
        time.sleep(4)  # a few heartbeats and reports after the link is back
        if m:
            seen["scrape"] = mh.scrape(net, m.group(1))
        if g:
            mh.run(net.exec("head", [fp8rt, "runs", "stop", "head_cut", "--controller",
                                     g.group(1), "--token-file",
                                     os.path.join(run_dir2, "controller", "token")]),
                   check=False)

    long_sets = ["--set", "train.steps=100000", "--set", "train.warmup=2", "--set",
                 "checkpoint.every=100000", "--set", "metrics.every=1"]
    l2 = Launch(net, fp8rt, spec_path, hostfile, run_dir2, env, mca, long_sets, {6: cut_head})
    if l2.proc.returncode != 0:
        fail("head cut off: fp8rt launch exited %d:\n%s" % (l2.proc.returncode, l2.text[-4000:]))
    before, during = seen.get("before", []), seen.get("during", [])
    if not before or not during or max(during) <= max(before):
        fail("head cut off: no step landed while the head was away (%s then %s)" %
             (before[-1:], during[-1:]))
    print("head cut off: steps %d -> %d while the controller was unreachable" %
          (max(before), max(during)), flush=True)
    m = re.search(r'fp8rt_train_step\{[^}]*\} (\d+)', seen.get("scrape", ""))
    if not m or int(m.group(1)) <= max(during):
        fail("head cut off: the controller's exposition after the cut shows step %s, not past %d"
             % (m.group(1) if m else None, max(during)))
    print("head cut off: the controller shows step %s once it is back; stopped through it" %
          m.group(1), flush=True)

    # 3. A whole host lost: every process in w2's namespace killed after step 10.
    def lose_w2(_):
        pids = subprocess.run(["ip", "netns", "pids", net.ns("w2")], stdout=subprocess.PIPE,
                              text=True).stdout.split()
        for pid in pids:
            try:
                os.kill(int(pid), signal.SIGKILL)
            except (ProcessLookupError, ValueError):
                pass

    run_dir3 = os.path.join(tmp, "host_lost")
    l3 = Launch(net, fp8rt, spec_path, hostfile, run_dir3, env, mca, sets, {10: lose_w2})
    if l3.proc.returncode != 0:
        fail("host lost: fp8rt launch exited %d:\n%s" % (l3.proc.returncode, l3.text[-4000:]))
    if "restarting from the newest committed checkpoint" not in l3.text:
        fail("host lost: the launcher did not restart:\n" + l3.text[-3000:])
    check_losses("host lost", run_dir3)
    print("host lost: restarted on w1 and w2, %d steps bit-identical (%.1f s)" %
          (STEPS, l3.seconds), flush=True)

    net.destroy()
    shutil.rmtree(tmp, ignore_errors=True)
    print("PASS: multihost faults")
    return 0


if __name__ == "__main__":
    sys.exit(main())
