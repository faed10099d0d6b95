#!/usr/bin/env python3
"""The layering of DESIGN.md section 1, checked on the include lines (ctest: layering_test).

Index:
  FOLDERS          each layered folder and the folders its files may include ("..." lines)
  VENDOR_HEADERS   CUDA / NCCL / MPI headers (<...> lines), and the backend files allowed them
  EXCEPTIONS       named (file, include) pairs that break a rule on purpose, each with its reason
  check_tree       walks a source tree and returns the violations, one line each
  self_test        a fake tree with known violations: proves the check can fail

Dependencies flow one way: runtime/core <- kernels <- parallel <- runtime/train <- runtime/model
<- runtime/worker. runtime/checkpoint (the checkpoint formats, issue 19) sits on runtime/core.
The controller sees the proto, runtime/core, runtime/checkpoint and runtime/spec (the run spec);
the fp8rt CLI the same without runtime/checkpoint;
the commands that need numerics are sibling programs (launcher/bench, launcher/quantize,
launcher/model). tests/ may include anything. A source file in a folder this table does not
know fails too, so that a new folder gets its rule when it is added, not after a reviewer
notices.

Usage: layering_test.py [--root DIR] [--exclude DIR ...]   check the tree (exit 1 on a violation)
       layering_test.py --self-test                         check the checker
"""

import argparse
import os
import re
import sys
import tempfile

# Pseudo-folders for the generated proto headers, included as "fp8rt/v1/<name>.pb.h": the
# messages, and the gRPC service stubs (which pull gRPC into whoever includes them).
PROTO = "proto"
PROTO_GRPC = "proto(grpc)"

_CLI = ["launcher", "launcher/client", "launcher/launch", "launcher/k8s", "launcher/report"]
_NUMERICS_BELOW_WORKER = ["runtime/model", "runtime/train", "parallel", "kernels", "runtime/core"]
CHECKPOINT = "runtime/checkpoint"
SPEC = "runtime/spec"

# folder -> (folders it may include, why). Its own folder is always allowed. A file belongs to the
# longest folder that prefixes its path.
FOLDERS = {
    "runtime/core": (
        [PROTO],
        "the ground floor: nothing of the project but proto messages (checkpoint manifest, run "
        "spec)"),
    "runtime/checkpoint": (
        ["runtime/core", PROTO],
        "the checkpoint formats (shard files, committed folders, the resume check): runtime/core "
        "and the proto messages, shared by the worker and the controller"),
    "runtime/spec": (
        ["runtime/core", PROTO],
        "the run spec: runtime/core and the proto messages"),
    "kernels": (
        ["runtime/core"],
        "numerics: runtime/core only"),
    "parallel": (
        ["kernels", "runtime/core"],
        "communicators and collectives: kernels and runtime/core, never train, model, worker or "
        "controller"),
    "runtime/train": (
        ["parallel", "kernels", "runtime/core", PROTO],
        "scaling state, optimizer, data: parallel, kernels, runtime/core"),
    "runtime/model": (
        ["runtime/train", "parallel", "kernels", "runtime/core", PROTO],
        "layers: train, parallel, kernels, runtime/core"),
    "runtime/worker": (
        _NUMERICS_BELOW_WORKER + [CHECKPOINT, SPEC, PROTO, PROTO_GRPC],
        "the step loop: every layer below it, and the controller only through the proto (its "
        "own gRPC client, runtime/worker/controller_client.h), never runtime/controller or the "
        "CLI"),
    "runtime/controller": (
        ["runtime/core", CHECKPOINT, SPEC, PROTO, PROTO_GRPC],
        "fp8rt-controller: proto, runtime/core and runtime/checkpoint only, never kernels, "
        "parallel, train, model or worker"),
    # The fp8rt CLI itself (launcher/main.cc and the folders linked into it or exec'd without
    # numerics) sees what the controller sees, plus its own folders.
    **{f: (_CLI + ["runtime/core", SPEC, PROTO, PROTO_GRPC],
           "the fp8rt CLI: proto, runtime/core and its own folders, never the numerics (those "
           "commands are sibling programs) nor the controller's internals")
       for f in _CLI},
    "launcher/quantize": (
        ["kernels", "runtime/core", PROTO],
        "fp8rt-quantize, a sibling program: kernels and runtime/core"),
    "launcher/bench": (
        ["runtime/worker"] + _NUMERICS_BELOW_WORKER + [CHECKPOINT, SPEC, PROTO, PROTO_GRPC],
        "fp8rt-bench*, sibling programs: the worker and everything below it (the step bench "
        "runs the Trainer), the controller only over gRPC, never runtime/controller or the "
        "CLI"),
    "launcher/model": (
        ["runtime/worker"] + _NUMERICS_BELOW_WORKER + [CHECKPOINT, SPEC, PROTO],
        "fp8rt-model (export, eval, generate), a sibling program: the worker's weights and "
        "everything below it, never runtime/controller or the CLI"),
    # Not layered: tests may include anything.
    "tests": (None, "tests may include anything"),
}

# Angle-bracket includes of the vendor libraries that sit behind an interface: only the backend
# files that implement it may name them (DESIGN.md section 1, last paragraph).
VENDOR_HEADERS = re.compile(r"^(mpi\.h|mpi-ext\.h|nccl\.h|nccl_net\.h|cuda[A-Za-z0-9_]*\.h|"
                            r"cublas[A-Za-z0-9_]*\.h|cublasLt\.h|cuda/.*|cub/.*|thrust/.*)$")
VENDOR_BACKENDS = [
    "kernels/cuda/",            # the CUDA op table and device memory
    "parallel/mpi/",            # MpiCommunicator
    "parallel/nccl/",           # NcclCommunicator
    "launcher/bench/bench_cuda.cc",  # fp8rt-bench --device cuda (bench_cuda_stub.cc otherwise)
]

# (file, included path) -> reason. Each must still match a real include line: a stale entry
# fails, so the list only ever names what is true.
EXCEPTIONS = {}

SOURCE_SUFFIXES = (".h", ".cc", ".cu", ".cuh", ".hpp", ".cpp")
# Never walked: generated or third-party trees inside a checkout.
SKIP_DIRS = {"node_modules", "out", "runs", "__pycache__"}

_QUOTED = re.compile(r'^\s*#\s*include\s*"([^"]+)"')
_ANGLED = re.compile(r"^\s*#\s*include\s*<([^>]+)>")
_PROTO_HEADER = re.compile(r"^fp8rt/v1/[A-Za-z0-9_]+\.(grpc\.)?pb\.h$")
_PROJECT_TOPS = ("runtime/", "kernels/", "parallel/", "launcher/", "proto/", "tests/")


def folder_of(path):
    """The layered folder holding the repository-relative `path`, or None."""
    best = None
    for folder in FOLDERS:
        if (os.path.dirname(path) + "/").startswith(folder + "/"):
            if best is None or len(folder) > len(best):
                best = folder
    return best


def included_folder(root, including, target):
    """The folder an include of `target` from `including` reaches, or None for a third-party
    header. Raises ValueError for a project header that no folder of FOLDERS holds."""
    m = _PROTO_HEADER.match(target)
    if m:
        return PROTO_GRPC if m.group(1) else PROTO
    if target.startswith("fp8rt/"):
        raise ValueError(f'"{target}" looks like a proto header but is not fp8rt/v1/<name>.pb.h')
    if target.startswith(_PROJECT_TOPS):
        folder = folder_of(target)
        if folder is None:
            raise ValueError(f'"{target}" is in no layered folder')
        return folder
    # A path relative to the including file ("cpu_ops.h"): its folder is the file's own.
    relative = os.path.normpath(os.path.join(os.path.dirname(including), target))
    if os.path.isfile(os.path.join(root, relative)):
        folder = folder_of(relative)
        if folder is None:
            raise ValueError(f'"{target}" resolves to {relative}, in no layered folder')
        return folder
    return None


def source_files(root, excludes):
    excludes = {os.path.realpath(e) for e in excludes}
    for dirpath, dirnames, filenames in os.walk(root):
        rel_dir = os.path.relpath(dirpath, root)
        keep = []
        for d in sorted(dirnames):
            full = os.path.join(dirpath, d)
            if d.startswith(".") or d in SKIP_DIRS or os.path.realpath(full) in excludes:
                continue
            if rel_dir == "." and d.startswith("build"):  # build/, build-cpu/, build-asan/, ...
                continue
            keep.append(d)
        dirnames[:] = keep
        for name in sorted(filenames):
            if name.endswith(SOURCE_SUFFIXES):
                yield os.path.normpath(os.path.join(rel_dir, name))


def check_tree(root, excludes=(), exceptions=None):
    """Returns the violations under `root`, one 'file:line: message' string each."""
    exceptions = EXCEPTIONS if exceptions is None else exceptions
    violations = []
    used = set()
    for path in source_files(root, excludes):
        folder = folder_of(path)
        if folder is None:
            violations.append(f"{path}:1: a source file in a folder with no layering rule: add "
                              f"its folder to FOLDERS in tests/unit/layering_test.py")
            continue
        allowed, rule = FOLDERS[folder]
        if allowed is None:
            continue
        vendor_ok = any(path == b or path.startswith(b) for b in VENDOR_BACKENDS)
        with open(os.path.join(root, path), encoding="utf-8", errors="replace") as f:
            lines = f.read().splitlines()
        for lineno, line in enumerate(lines, 1):
            m = _ANGLED.match(line)
            if m:
                if VENDOR_HEADERS.match(m.group(1)) and not vendor_ok:
                    key = (path, m.group(1))
                    if key in exceptions:
                        used.add(key)
                        continue
                    violations.append(
                        f"{path}:{lineno}: includes <{m.group(1)}>: CUDA, NCCL and MPI headers "
                        f"belong to the backend files that implement an interface "
                        f"({', '.join(VENDOR_BACKENDS)}); the rest of the code sees the interface")
                continue
            m = _QUOTED.match(line)
            if not m:
                continue
            target = m.group(1)
            try:
                reached = included_folder(root, path, target)
            except ValueError as e:
                violations.append(f"{path}:{lineno}: {e}")
                continue
            if reached is None or reached == folder or reached in allowed:
                continue
            key = (path, target)
            if key in exceptions:
                used.add(key)
                continue
            violations.append(f'{path}:{lineno}: includes "{target}" ({reached}): {folder} may '
                              f"include only {', '.join(allowed) or 'itself'} ({rule})")
    for key in sorted(set(exceptions) - used):
        violations.append(f"{key[0]}:1: stale layering exception for \"{key[1]}\" (no such "
                          f"include any more, or it is allowed now): remove it from EXCEPTIONS")
    return violations


def self_test():
    """Builds a small tree with one allowed and several forbidden includes and checks that each
    forbidden one, and only those, is reported. Returns the number of failed expectations."""
    files = {
        # Allowed.
        "runtime/core/a.h": '#include "fp8rt/v1/run_spec.pb.h"\n#include "absl/status/status.h"\n',
        "kernels/k.cc": '#include "kernels/k.h"\n#include "runtime/core/a.h"\n#include <vector>\n',
        "kernels/k.h": "",
        "kernels/cpu/rel.cc": '#include "rel.h"\n',
        "kernels/cpu/rel.h": "",
        "kernels/cuda/dev.cu": "#include <cuda_runtime.h>\n",
        "runtime/worker/w.cc": '#include "runtime/model/m.h"\n#include "fp8rt/v1/control.grpc.pb.h"\n',
        "runtime/model/m.h": '#include "runtime/train/t.h"\n',
        "runtime/train/t.h": "",
        "tests/unit/any_test.cc": '#include "runtime/controller/c.h"\n#include <mpi.h>\n',
        "launcher/bench/step.cc": '#include "runtime/worker/w.h"\n',
        "runtime/worker/w.h": "",
        # Forbidden, each caught on the line given in `expected`.
        "kernels/bad.cc": '#include "kernels/k.h"\n#include "runtime/model/m.h"\n',
        "parallel/bad.cc": '#include "runtime/train/t.h"\n',
        "runtime/controller/c.h": '#include "runtime/core/a.h"\n#  include "kernels/k.h"\n',
        "runtime/core/up.h": '#include "runtime/core/a.h"\n#include "fp8rt/v1/control.grpc.pb.h"\n',
        "runtime/train/mpi_user.cc": "#include <mpi.h>\n",
        "launcher/main.cc": '#include "runtime/worker/w.h"\n',
        "newfolder/x.cc": "",
        "runtime/worker/ghost.cc": '#include "runtime/ghost/g.h"\n',
        # Excepted: not reported while the exception matches.
        "runtime/model/excepted.cc": '#include "runtime/worker/w.h"\n',
        # A build folder is never read.
        "build-cpu/gen.cc": '#include "runtime/worker/w.h"\n',
    }
    expected = [
        "kernels/bad.cc:2:",
        "parallel/bad.cc:1:",
        "runtime/controller/c.h:2:",
        "runtime/core/up.h:2:",
        "runtime/train/mpi_user.cc:1:",
        "launcher/main.cc:1:",
        "newfolder/x.cc:1:",
        "runtime/worker/ghost.cc:1:",
        "runtime/worker/stale.cc:1: stale",
    ]
    exceptions = {
        ("runtime/model/excepted.cc", "runtime/worker/w.h"): "self-test",
        ("runtime/worker/stale.cc", "runtime/model/m.h"): "self-test: names no real include",
    }
    failures = 0
    with tempfile.TemporaryDirectory() as root:
        for path, text in files.items():
            os.makedirs(os.path.join(root, os.path.dirname(path)), exist_ok=True)
            with open(os.path.join(root, path), "w", encoding="utf-8") as f:
                f.write(text)
        got = check_tree(root, exceptions=exceptions)
    for want in expected:
        hits = [v for v in got if v.startswith(want)]
        if len(hits) != 1:
            print(f"self-test: expected one violation starting {want!r}, got {hits}")
            failures += 1
    for v in got:
        if not any(v.startswith(w) for w in expected):
            print(f"self-test: unexpected violation: {v}")
            failures += 1
    print(f"self-test: {len(expected)} planted violations, {len(got)} reported, "
          f"{failures} wrong")
    return failures


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--root", default=os.path.join(os.path.dirname(__file__), "..", ".."),
                        help="the source tree (default: this checkout)")
    parser.add_argument("--exclude", action="append", default=[],
                        help="a folder not to read (e.g. the CMake binary dir); repeatable")
    parser.add_argument("--self-test", action="store_true",
                        help="check the checker on a fake tree with planted violations")
    args = parser.parse_args()
    if args.self_test:
        return 1 if self_test() else 0
    root = os.path.realpath(args.root)
    violations = check_tree(root, args.exclude)
    for v in violations:
        print(v)
    layered = [p for p in source_files(root, args.exclude)
               if FOLDERS.get(folder_of(p), (None,))[0] is not None]
    print(f"layering: {len(layered)} source files checked (tests/ not), {len(violations)} "
          f"violations")
    return 1 if violations else 0


if __name__ == "__main__":
    sys.exit(main())
