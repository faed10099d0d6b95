#!/usr/bin/env bash
# tests/gpu/run.sh: the GPU check of fp8rt, in one command, on a fresh machine with an NVIDIA GPU.
#
#   tests/gpu/run.sh [OUT_DIR]      (OUT_DIR: $OUT if set, else ./gpu-results)
#
# Runs from the repository root (it cds there). Steps, each logged to OUT_DIR:
#   1. Fails loudly unless a GPU is visible (nvidia-smi, then the CUDA runtime itself).
#   2. Gets the binaries: builds them (CMake, Release, FP8RT_CUDA=ON, only the GPU targets) when
#      fp8rt's C++ dependencies are installed; otherwise unpacks the bundle that
#      tests/gpu/make_bundle.sh made on a machine that has them (build-gpu-bundle/, which the
#      caller carries along). The GPU machines lent in this workplace have CUDA, CMake and ninja
#      but not abseil, gRPC, Highway, oneDNN, Open MPI and the rest, and no network: there the
#      bundle is the way. FP8RT_GPU_MODE=build|bundle forces one.
#   3. Runs the GPU tests with FP8RT_REQUIRE_GPU=1 (a missing device fails instead of skipping):
#      ops_cuda_test (every CUDA op against the CPU backend) and nccl_communicator_test (NCCL on
#      one GPU), through `ctest -L gpu` in build mode and directly in bundle mode; and
#      device_math_host_test. gtest/JUnit XML for each.
#   4. Runs the GPU benchmarks: `fp8rt bench quantize --device cuda` and
#      `fp8rt bench gemm --device cuda --size 8192`, JSON to OUT_DIR.
#   5. Writes OUT_DIR/summary.txt (tests passed or not, each ratio against its target) and exits
#      non-zero if a step failed. A benchmark below its target is reported, not a failure.
# Budget: under 8 minutes on 16 cores (the build is most of it; bundle mode takes 1-2 minutes).
#
# Output files (at most 8: what the device tool brings back): run.log, summary.txt,
# nvidia-smi.txt, device_math_host_test.xml, bench_quantize.json, bench_gemm.json, and
# ops_cuda_test.xml + nccl_communicator_test.xml (bundle mode) or ctest_gpu.xml (build mode).
set -uo pipefail
cd "$(dirname "$0")/../.." || exit 1
ROOT=$(pwd)
OUT_DIR=${1:-${OUT:-./gpu-results}}
mkdir -p "$OUT_DIR"
OUT_DIR=$(cd "$OUT_DIR" && pwd)
LOG="$OUT_DIR/run.log"
: > "$LOG"
START=$(date +%s)
FAILED=()

log() { echo "[run.sh +$(($(date +%s) - START))s] $*" | tee -a "$LOG"; }
die() {
  log "FATAL: $*"
  echo "FATAL: $*" > "$OUT_DIR/summary.txt"
  exit 1
}
# Runs a command with its output appended to the log; returns its status.
run() {
  log "\$ $*"
  "$@" >> "$LOG" 2>&1
}

# --- 1. a GPU, or stop here -----------------------------------------------------------------------
if ! command -v nvidia-smi > /dev/null 2>&1; then
  die "nvidia-smi not found: no NVIDIA driver on this machine"
fi
if ! nvidia-smi > "$OUT_DIR/nvidia-smi.txt" 2>&1 || ! nvidia-smi -L 2>/dev/null | grep -q '^GPU '; then
  cat "$OUT_DIR/nvidia-smi.txt" >> "$LOG"
  die "nvidia-smi sees no GPU"
fi
log "GPUs: $(nvidia-smi -L | tr '\n' ';')"
export FP8RT_REQUIRE_GPU=1
NPROC=$(nproc)

# --- 2. binaries ----------------------------------------------------------------------------------
MODE=${FP8RT_GPU_MODE:-auto}
BUILD=${FP8RT_GPU_BUILD_DIR:-build-gpu}
BUNDLE_TAR=${FP8RT_GPU_BUNDLE:-build-gpu-bundle/fp8rt-gpu-bundle.tar.xz}
BIN=""
GEN=()
command -v ninja > /dev/null 2>&1 && GEN=(-G Ninja)

try_build() {
  log "build mode: configuring $BUILD (Release, FP8RT_CUDA=ON)"
  run cmake -S . -B "$BUILD" "${GEN[@]}" -DCMAKE_BUILD_TYPE=Release -DFP8RT_CUDA=ON \
    -DFP8RT_WERROR=OFF -DFP8RT_TESTS=ON || return 1
  log "building ops_cuda_test nccl_communicator_test device_math_host_test fp8rt-bench"
  run cmake --build "$BUILD" -j"$NPROC" --target ops_cuda_test nccl_communicator_test \
    device_math_host_test fp8rt-bench || return 2
  BIN="$ROOT/$BUILD"
  return 0
}

use_bundle() {
  [ -f "$BUNDLE_TAR" ] || return 1
  local dest=/tmp/fp8rt-gpu-bundle
  rm -rf "$dest"
  if ! run tar -C /tmp -xJf "$BUNDLE_TAR"; then
    log "tar could not unpack it (no xz?); trying Python's tarfile"
    run python3 -c 'import sys, tarfile; tarfile.open(sys.argv[1]).extractall("/tmp")' \
      "$BUNDLE_TAR" || return 1
  fi
  log "bundle mode: $(grep -E '^(commit|built)' "$dest/MANIFEST" | tr '\n' ' ')"
  # The NVIDIA libraries the bundle leaves out, from this machine: the CUDA toolkit's, else
  # pip's nvidia-* wheels (PyTorch's), else whatever the loader already knows.
  local dirs=() lib found
  for lib in libcublasLt.so.13 libcublas.so.13 libnccl.so.2; do
    found=$(find -H /usr/local/cuda/lib64 /usr/local/cuda/targets/x86_64-linux/lib /usr/lib \
      /usr/local/lib /opt -name "$lib" 2>/dev/null | head -1)
    if [ -z "$found" ]; then
      found=$(python3 - "$lib" 2>/dev/null <<'PY'
import glob, os, site, sys
roots = site.getsitepackages() + [site.getusersitepackages()]
for r in roots:
    hits = glob.glob(os.path.join(r, "nvidia", "**", sys.argv[1]), recursive=True)
    if hits:
        print(hits[0]); break
PY
)
    fi
    if [ -n "$found" ]; then
      dirs+=("$(dirname "$found")")
      log "found $lib: $found"
    else
      log "not found on this machine: $lib (the loader may still know it)"
    fi
  done
  local joined
  joined=$(printf '%s:' "${dirs[@]}" | sed 's/:$//')
  export LD_LIBRARY_PATH="$dest/lib${joined:+:$joined}${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
  log "LD_LIBRARY_PATH=$LD_LIBRARY_PATH"
  local missing
  missing=$(for b in "$dest"/bin/*; do ldd "$b" | grep 'not found'; done | sort -u)
  if [ -n "$missing" ]; then
    log "unresolved libraries:"
    echo "$missing" | tee -a "$LOG"
    return 2
  fi
  BIN="$dest"
  return 0
}

case "$MODE" in
  build) try_build || die "the build failed (see $LOG)" ;;
  bundle) use_bundle || die "no usable bundle at $BUNDLE_TAR (make it with tests/gpu/make_bundle.sh)" ;;
  auto)
    if ! try_build; then
      log "cannot build here (missing dependencies?); trying the bundle $BUNDLE_TAR"
      use_bundle || die "cannot build here and no usable bundle at $BUNDLE_TAR (make one with tests/gpu/make_bundle.sh on a machine with fp8rt's dependencies, and carry build-gpu-bundle)"
    fi
    ;;
  *) die "FP8RT_GPU_MODE must be build, bundle or auto, not $MODE" ;;
esac
# Paths of the binaries in either layout.
if [ -x "$BIN/bin/ops_cuda_test" ]; then
  T_OPS="$BIN/bin/ops_cuda_test"
  T_NCCL="$BIN/bin/nccl_communicator_test"
  T_HOST="$BIN/bin/device_math_host_test"
else
  T_OPS="$BIN/tests/gpu/ops_cuda_test"
  T_NCCL="$BIN/tests/gpu/nccl_communicator_test"
  T_HOST="$BIN/tests/gpu/device_math_host_test"
fi
BENCH="$BIN/bin/fp8rt-bench"
log "binaries ready after $(($(date +%s) - START))s"

# --- 3. tests -------------------------------------------------------------------------------------
# A GPU test that skipped for want of a device hides a problem here: ops_cuda_test fails instead
# under FP8RT_REQUIRE_GPU=1; the NCCL test skips, so its output is searched.
check_no_device_skips() {
  local name=$1 output=$2
  if grep -q 'no CUDA device' "$output"; then
    FAILED+=("$name (skipped for want of a device)")
    log "FAILED: $name did not see the GPU: $(grep -m1 'no CUDA device' "$output")"
  fi
}
run_gtest() {
  local name=$1 binary=$2 output
  output=$(mktemp)
  log "test $name"
  "$binary" --gtest_output="xml:$OUT_DIR/$name.xml" > "$output" 2>&1
  local status=$?
  cat "$output" >> "$LOG"
  grep -E '^\[  (PASSED|FAILED|SKIPPED) +\]|tests? from .* ran' "$output" | tail -5 | tee -a "$LOG"
  if [ $status -ne 0 ]; then
    FAILED+=("$name")
    log "FAILED: $name (exit status $status)"
  fi
  check_no_device_skips "$name" "$output"
  rm -f "$output"
}
run_gtest device_math_host_test "$T_HOST"
if [ -f "$BIN/CTestTestfile.cmake" ]; then
  # Build mode: the GPU suite through its ctest label (ops_cuda_test, nccl_communicator_test).
  output=$(mktemp)
  log "ctest -L gpu"
  (cd "$BIN" && ctest -L gpu -V --timeout 600 --output-junit "$OUT_DIR/ctest_gpu.xml") > "$output" 2>&1
  status=$?
  cat "$output" >> "$LOG"
  grep -E 'tests passed|Test +#' "$output" | tee -a "$LOG"
  [ $status -eq 0 ] || { FAILED+=("ctest -L gpu"); log "FAILED: ctest -L gpu"; }
  check_no_device_skips "ctest -L gpu" "$output"
  rm -f "$output"
else
  run_gtest ops_cuda_test "$T_OPS"
  run_gtest nccl_communicator_test "$T_NCCL"
fi

# --- 4. benchmarks --------------------------------------------------------------------------------
bench() {
  local name=$1
  shift
  log "bench $name: fp8rt bench $*"
  "$BENCH" "$@" --json > "$OUT_DIR/bench_$name.json" 2>> "$LOG"
  local status=$?
  if [ $status -eq 0 ]; then
    log "bench $name: $(head -c 400 "$OUT_DIR/bench_$name.json")"
  else
    FAILED+=("bench $name")
    log "FAILED: bench $name (exit status $status; 2 means no usable GPU)"
  fi
}
bench quantize quantize --device cuda
bench gemm gemm --device cuda --size 8192

# --- 5. summary -----------------------------------------------------------------------------------
{
  echo "fp8rt GPU run, $(date -u +%Y-%m-%dT%H:%M:%SZ), $(nvidia-smi -L | head -1)"
  echo "mode: $([ -f "$BIN/CTestTestfile.cmake" ] && echo build || echo bundle), $(($(date +%s) - START)) s"
  for t in device_math_host_test ops_cuda_test nccl_communicator_test ctest_gpu; do
    [ -f "$OUT_DIR/$t.xml" ] || continue
    # The first tests= and failures= attributes (gtest puts them on one line, ctest on several).
    echo "$t: $(head -c 2000 "$OUT_DIR/$t.xml" | tr '\n\t' '  ' | grep -o 'tests="[0-9]*"' | head -1)" \
      "$(head -c 2000 "$OUT_DIR/$t.xml" | tr '\n\t' '  ' | grep -o 'failures="[0-9]*"' | head -1)"
  done
  for b in quantize gemm; do
    f="$OUT_DIR/bench_$b.json"
    if [ -s "$f" ]; then
      python3 - "$f" <<'PY' 2>/dev/null || echo "bench: $(head -c 300 "$f")"
import json, sys
j = json.load(open(sys.argv[1]))
verdict = "MET" if j["ratio"] >= j["target"] else "MISSED"
extra = ""
if j["benchmark"] == "gemm":
    t = j["tflops"]
    extra = " (fp8 %.0f, bf16 %.0f, fp8 block %.0f TFLOP/s; paths %s)" % (
        t["fp8"], t["bf16"], t["fp8_block"], j["paths"])
else:
    extra = " (quantize %.0f GB/s, memcpy %.0f GB/s)" % (
        j["quantize_gb_per_s"], j["memcpy_gb_per_s"])
print("bench %s: ratio %.3f (median %.3f), target %.2f: %s%s" % (
    j["benchmark"], j["ratio"], j["ratio_median"], j["target"], verdict, extra))
PY
    else
      echo "bench $b: no result"
    fi
  done
  if [ ${#FAILED[@]} -eq 0 ]; then echo "RESULT: all steps passed"; else echo "RESULT: FAILED: ${FAILED[*]}"; fi
} > "$OUT_DIR/summary.txt"
tee -a "$LOG" < "$OUT_DIR/summary.txt"
[ ${#FAILED[@]} -eq 0 ]
