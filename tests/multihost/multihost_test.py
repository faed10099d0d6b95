#!/usr/bin/env python3
"""Several hosts for real (issue 21 point 1): fp8rt across network namespaces over TCP.

The test builds a small network of its own, as root, and removes it on every exit:
  - three network namespaces, a head host and two worker hosts, joined to a bridge that lives in
    the head's namespace by veth pairs; addresses from 10.213.7.0/24 exist only inside them
    (nothing is added to the machine's own namespace);
  - each namespace resolves the host names head, w1, w2 through its own hosts file
    (/etc/netns/NAME/hosts, which `ip netns exec` mounts over /etc/hosts for that namespace only);
  - each host has its own hostname (a UTS namespace: Open MPI names its session folders in the
    shared /tmp after it);
  - Open MPI reaches the worker hosts through an rsh agent (plm_rsh_agent) that runs the daemon's
    command in the host's namespaces with `ip netns exec` and `unshare --uts`; `btl tcp,self`
    and the interface filters keep every byte between ranks on the bridge.

Then, from the head host, `fp8rt launch --hostfile` trains tests/data/tiny-plain.yaml:
  1. dp=2, one rank per worker host;
  2. dp=2 x tp=2, two ranks per worker host;
each under the controller the launcher starts on the head's address, with TLS (a CA and a
certificate for the head's address made here with openssl) and the run's bearer token. Checked:
exit 0, every step in metrics.jsonl, checkpoints committed through the controller, the agent
started daemons on both worker hosts (and on no other), the controller's Prometheus endpoint
(scraped from the head) counts the run's steps, and the losses equal those of the same run on
one host (shared memory): the same reductions in the same order, so equal to 1e-6 relative.
  3. Each rank's place among its host's ranks, from MPI, and the GPU it picks (device: cuda):
     communicator_test's HostRanksTest and device_pick_test (fake devices, the same PCI bus ids
     on both hosts) with two ranks on each worker host.
  4. Bad input: --hostfile with a controller on loopback, and a missing hostfile, exit 2 naming
     the option.

Usage: multihost_test.py BIN_DIR SOURCE_DIR. Exit 77 (ctest: skipped) naming the reason when not
root or when network namespaces are not permitted here.
"""

import atexit
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time

SKIP = 77
SUBNET = "10.213.7"
HOSTS = ["head", "w1", "w2"]  # head: .1, w1: .2, w2: .3


def fail(msg):
    print("FAIL: " + msg, flush=True)
    sys.exit(1)


def run(argv, check=True, **kw):
    r = subprocess.run(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, **kw)
    if check and r.returncode != 0:
        fail("%s exited %d:\n%s" % (" ".join(argv), r.returncode, r.stdout[-4000:]))
    return r


class Network:
    """Namespaces PREFIX-head, PREFIX-w1, PREFIX-w2 on a bridge in the head's namespace."""

    def __init__(self, tmp):
        self.prefix = "fp8mh%d" % (os.getpid() % 100000)
        self.tmp = tmp
        self.made = []  # namespaces created, for cleanup
        self.agent = os.path.join(tmp, "agent.sh")
        self.agent_log = os.path.join(tmp, "agent.log")

    def ns(self, host):
        return "%s-%s" % (self.prefix, host)

    def address(self, host):
        return "%s.%d" % (SUBNET, HOSTS.index(host) + 1)

    def create(self):
        for host in HOSTS:
            run(["ip", "netns", "add", self.ns(host)])
            self.made.append(self.ns(host))
            run(["ip", "netns", "exec", self.ns(host), "ip", "link", "set", "lo", "up"])
            etc = "/etc/netns/" + self.ns(host)
            os.makedirs(etc, exist_ok=True)
            with open(os.path.join(etc, "hosts"), "w") as f:
                f.write("127.0.0.1 localhost\n")
                for h in HOSTS:
                    f.write("%s %s\n" % (self.address(h), h))
        head = self.ns("head")
        run(["ip", "netns", "exec", head, "ip", "link", "add", "br0", "type", "bridge"])
        run(["ip", "netns", "exec", head, "ip", "link", "set", "br0", "up"])
        for i, host in enumerate(HOSTS):
            # Made in the head's namespace (its names are free there), one end moved out.
            outer, inner = "up%d" % i, "eth%d" % i
            run(["ip", "netns", "exec", head, "ip", "link", "add", outer, "type", "veth", "peer",
                 "name", inner])
            run(["ip", "netns", "exec", head, "ip", "link", "set", outer, "master", "br0"])
            run(["ip", "netns", "exec", head, "ip", "link", "set", outer, "up"])
            if host != "head":
                run(["ip", "netns", "exec", head, "ip", "link", "set", inner, "netns",
                     self.ns(host)])
            ns = self.ns(host)
            run(["ip", "netns", "exec", ns, "ip", "addr", "add", self.address(host) + "/24",
                 "dev", inner])
            run(["ip", "netns", "exec", ns, "ip", "link", "set", inner, "up"])
        with open(self.agent, "w") as f:
            f.write("#!/bin/sh\n"
                    "# Open MPI's rsh agent: [options] HOST COMMAND -> COMMAND in HOST's namespace.\n"
                    "while [ $# -gt 0 ]; do case \"$1\" in -*) shift;; *) break;; esac; done\n"
                    "host=$1; shift\n"
                    "echo \"$host\" >> %s\n"
                    "exec ip netns exec %s-\"$host\" unshare --uts sh -c "
                    "'hostname \"$0\"; exec sh -c \"$1\"' \"$host\" \"$*\"\n"
                    % (self.agent_log, self.prefix))
        os.chmod(self.agent, 0o755)

    def destroy(self):
        for ns in self.made:
            # Whatever still runs in it (a rank left by a failure) goes first.
            pids = subprocess.run(["ip", "netns", "pids", ns], stdout=subprocess.PIPE,
                                  stderr=subprocess.DEVNULL, text=True).stdout.split()
            for pid in pids:
                try:
                    os.kill(int(pid), signal.SIGKILL)
                except (ProcessLookupError, ValueError):
                    pass
            subprocess.run(["ip", "netns", "del", ns], stderr=subprocess.DEVNULL)
            shutil.rmtree("/etc/netns/" + ns, ignore_errors=True)
        self.made = []

    def exec(self, host, argv):
        """`argv` on `host`: in its network namespace, with a UTS namespace of its own whose
        hostname is the host's name (every host shares this machine's /tmp, where Open MPI keeps
        a session folder named after the hostname: one name for all would make the daemons of
        two hosts write the same files)."""
        return ["ip", "netns", "exec", self.ns(host), "unshare", "--uts", "sh", "-c",
                'hostname "$0"; exec "$@"', host] + argv


def make_tls(tmp, address):
    """A CA and a certificate for the head (its address and name), made with openssl."""
    d = os.path.join(tmp, "tls")
    os.makedirs(d)
    p = lambda name: os.path.join(d, name)
    run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", p("ca.key"),
         "-out", p("ca.pem"), "-days", "1", "-subj", "/CN=fp8rt multihost test CA"])
    run(["openssl", "req", "-newkey", "rsa:2048", "-nodes", "-keyout", p("head.key"), "-out",
         p("head.csr"), "-subj", "/CN=head"])
    with open(p("ext.cnf"), "w") as f:
        f.write("subjectAltName=IP:%s,DNS:head\n" % address)
    run(["openssl", "x509", "-req", "-in", p("head.csr"), "-CA", p("ca.pem"), "-CAkey",
         p("ca.key"), "-CAcreateserial", "-out", p("head.pem"), "-days", "1", "-extfile",
         p("ext.cnf")])
    return p("head.pem"), p("head.key"), p("ca.pem")


def url_of(lines):
    """The controller's Prometheus URL from the launcher's output so far, or None."""
    for line in lines:
        m = re.search(r"Prometheus metrics on (http://\S+/metrics)", line)
        if m:
            return m.group(1)
    return None


def losses(run_dir):
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        lines = [json.loads(line) for line in f if line.strip()]
    return [j["step"] for j in lines], [j["loss"] for j in lines]


def skip_reason(tools):
    """Why this machine cannot run the test (None: it can): not root, a missing tool, or
    namespaces not permitted (probed by making and removing one)."""
    if os.geteuid() != 0:
        return "network namespaces need root (CI and the developers' machines run as root)"
    for tool in tools:
        if shutil.which(tool) is None:
            return "%s is not installed (scripts/bootstrap installs it)" % tool
    probe = "fp8mhprobe%d" % os.getpid()
    r = subprocess.run(["ip", "netns", "add", probe], stdout=subprocess.PIPE,
                       stderr=subprocess.STDOUT, text=True)
    if r.returncode != 0:
        return "`ip netns add` is not permitted here: " + r.stdout.strip()
    subprocess.run(["ip", "netns", "del", probe])
    return None


def setup(prefix, source):
    """A temp folder, the network (removed at exit, also on ctest's SIGTERM), tiny.yaml with an
    absolute data path, and the MCA parameters of a launch across the hosts."""
    tmp = tempfile.mkdtemp(prefix=prefix)
    net = Network(tmp)
    atexit.register(net.destroy)
    for sig in (signal.SIGTERM, signal.SIGINT):  # clean up, then go
        signal.signal(sig, lambda *_: sys.exit(1))
    net.create()
    with open(os.path.join(source, "tests/data/tiny-plain.yaml")) as f:
        spec = f.read().replace("path: examples/data/kjv.txt",
                                "path: " + os.path.join(source, "examples/data/kjv.txt"))
    spec_path = os.path.join(tmp, "tiny.yaml")
    with open(spec_path, "w") as f:
        f.write(spec)
    mca = ["--mca", "plm_rsh_agent=" + net.agent, "--mca", "btl=tcp,self",
           "--mca", "btl_tcp_if_include=%s.0/24" % SUBNET,
           "--mca", "oob_tcp_if_include=%s.0/24" % SUBNET]
    return tmp, net, spec_path, mca


def scrape(net, url):
    """The Prometheus exposition at `url`, fetched from the head host ("" when unreachable)."""
    r = run(net.exec("head", [sys.executable, "-c",
                              "import urllib.request,sys; sys.stdout.write(urllib.request."
                              "urlopen(%r, timeout=10).read().decode())" % url]), check=False)
    return r.stdout if r.returncode == 0 else ""


def main():
    if len(sys.argv) != 3:
        fail("usage: multihost_test.py BIN_DIR SOURCE_DIR")
    bin_dir, source = sys.argv[1], sys.argv[2]
    fp8rt = os.path.join(bin_dir, "fp8rt")
    reason = skip_reason(("ip", "openssl"))
    if reason:
        print("SKIP: " + reason)
        return SKIP
    tmp, net, spec_path, mca = setup("fp8rt_multihost_", source)
    print("network: %s on a bridge in %s, %s.0/24" % (", ".join(net.ns(h) for h in HOSTS),
                                                    net.ns("head"), SUBNET), flush=True)
    cert, key, ca = make_tls(tmp, net.address("head"))

    sets = ["--set", "train.steps=8", "--set", "train.warmup=2", "--set", "checkpoint.every=4",
            "--set", "metrics.every=1"]
    env = dict(os.environ, OMP_NUM_THREADS="1")

    cases = [("dp2", 2, 1, ["--set", "parallel.dp=2", "--set", "parallel.tp=1"]),
             ("dp2xtp2", 4, 2, ["--set", "parallel.dp=2", "--set", "parallel.tp=2"])]
    for name, np, slots, layout in cases:
        hostfile = os.path.join(tmp, name + ".hosts")
        with open(hostfile, "w") as f:
            f.write("w1 slots=%d\nw2 slots=%d\n" % (slots, slots))
        open(net.agent_log, "w").close()
        run_dir = os.path.join(tmp, name)
        t0 = time.time()
        argv = net.exec("head", [fp8rt, "launch", spec_path, "--np", str(np), "--hostfile",
                                 hostfile, "--controller-listen", net.address("head") + ":0",
                                 "--tls-cert", cert, "--tls-key", key, "--tls-ca", ca,
                                 "--run-dir", run_dir] + mca + sets + layout)
        proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                text=True, env=env)
        out, scraped = [], ""
        for line in proc.stdout:
            out.append(line)
            if re.match(r"step [4-7]/8", line) and url_of(out) and not scraped:
                # The controller's Prometheus endpoint, scraped from the head host mid-run.
                scraped = scrape(net, url_of(out))
        proc.wait(timeout=400)
        text = "".join(out)
        print("%s: fp8rt launch across w1 and w2 exited %d in %.1f s" %
              (name, proc.returncode, time.time() - t0), flush=True)
        if proc.returncode != 0:
            fail("%s: fp8rt launch exited %d:\n%s" % (name, proc.returncode, text[-4000:]))
        steps, got = losses(run_dir)
        if steps != list(range(1, 9)):
            fail("%s: metrics.jsonl steps %s" % (name, steps))
        for needle in ("run finished", "checkpoint committed", "controller serving gRPC on " +
                       net.address("head")):
            if needle not in text:
                fail("%s: the launcher's output lacks %r:\n%s" % (name, needle, text[-3000:]))
        with open(net.agent_log) as f:
            launched = sorted(set(f.read().split()))
        if launched != ["w1", "w2"]:
            fail("%s: Open MPI started daemons on %s, expected w1 and w2" % (name, launched))
        m = re.search(r'fp8rt_world_size\{[^}]*\} (\d+)', scraped)
        if not m or int(m.group(1)) != np:
            fail("%s: the controller's Prometheus exposition, scraped from the head mid-run, "
                 "has no fp8rt_world_size %d:\n%s" % (name, np, scraped[:2000]))
        m = re.search(r'fp8rt_train_step\{[^}]*\} (\d+)', scraped)
        if not m or not 1 <= int(m.group(1)) <= 8:
            fail("%s: no fp8rt_train_step in 1..8 in the scrape:\n%s" % (name, scraped[:2000]))
        print("%s: Prometheus on the head: world size %d, step %s mid-run" %
              (name, np, m.group(1)), flush=True)

        # The same run on one host (shared memory, no controller): the same losses.
        ref_dir = os.path.join(tmp, name + "-onehost")
        r = run([fp8rt, "launch", spec_path, "--np", str(np), "--no-controller", "--quiet",
                 "--run-dir", ref_dir] + sets + layout, check=False, env=env, timeout=400)
        if r.returncode != 0:
            fail("%s: the one-host run exited %d:\n%s" % (name, r.returncode, r.stdout[-3000:]))
        _, want = losses(ref_dir)
        for s, (a, b) in enumerate(zip(got, want)):
            if abs(a - b) > 1e-6 * abs(b):
                fail("%s: step %d loss %.9g across hosts, %.9g on one host" % (name, s + 1, a, b))
        print("%s: 8 steps on w1 and w2 over TCP, losses equal to one host's (last %.6f)" %
              (name, got[-1]), flush=True)

    # Each rank's place among its host's ranks, as MPI groups them (how a device: cuda rank picks
    # its GPU, whatever launched it): communicator_test's HostRanksTest with two ranks on each of
    # w1 and w2, where the local ranks (0, 1 on each host) are not the world ranks.
    # Then how each picks its GPU (device_pick_test, fake devices: no GPU here): the two hosts have
    # the same PCI bus ids, which must not count as one GPU shared across hosts.
    mpirun_mca = []
    for i in range(0, len(mca), 2):
        key, value = mca[i + 1].split("=", 1)
        mpirun_mca += ["--mca", key, value]
    for exe, tests, gtest_filter in (("communicator_test", 1, "HostRanksTest.*"),
                                     ("device_pick_test", 6, "*")):
        check = os.path.join(os.path.dirname(bin_dir), "tests", "mpi", exe)
        if not os.path.exists(check):
            fail("%s is not built" % check)
        r = run(net.exec("head", ["mpirun", "--allow-run-as-root", "-np", "4", "--hostfile",
                                  os.path.join(tmp, "dp2xtp2.hosts")] + mpirun_mca +
                         ["-x", "OMP_NUM_THREADS=1", check, "--gtest_filter=" + gtest_filter]),
                check=False, env=env, timeout=300)
        if r.returncode != 0 or "[  PASSED  ] %d test" % tests not in r.stdout:
            fail("%s across w1 and w2 exited %d:\n%s" % (exe, r.returncode, r.stdout[-3000:]))
        print("ranks on their hosts: %s (%s) passed with two ranks on each of w1 and w2" %
              (exe, gtest_filter), flush=True)

    # Bad input: exit 2 naming the option, before anything starts.
    hostfile = os.path.join(tmp, "dp2.hosts")
    r = run([fp8rt, "launch", spec_path, "--np", "2", "--hostfile", hostfile, "--run-dir",
             os.path.join(tmp, "bad1")], check=False)
    if r.returncode != 2 or "--controller-listen" not in r.stdout:
        fail("a controller on loopback with --hostfile: exit %d, %r" % (r.returncode, r.stdout))
    r = run([fp8rt, "launch", spec_path, "--np", "2", "--hostfile", os.path.join(tmp, "nope"),
             "--controller-listen", "10.213.7.1:0", "--run-dir", os.path.join(tmp, "bad2")],
            check=False)
    if r.returncode != 2 or "nope" not in r.stdout:
        fail("a missing hostfile: exit %d, %r" % (r.returncode, r.stdout))
    print("bad input: exit 2 naming the option")

    net.destroy()
    shutil.rmtree(tmp, ignore_errors=True)
    print("PASS: multihost")
    return 0


if __name__ == "__main__":
    sys.exit(main())
