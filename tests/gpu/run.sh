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
#      ops_cuda_test (every CUDA op against the CPU backend), layer_ops_cuda_test and
#      attention_cuda_test (the CUDA layer ops, attention and cross-entropy against the CPU ones),
#      nccl_communicator_test (NCCL on one GPU), nccl_deferred_test (the same with every
#      collective completing late, as with several ranks) and train_cuda_test (8 training steps on
#      the GPU against the CPU run, every precision mode; three modes again with NCCL late), through
#      `ctest -L gpu` in build mode and directly in bundle mode; and the host-only device_math_host_test and layer_math_host_test.
#      gtest/JUnit XML for each, packed into one tarball.
#   4. Runs the GPU benchmarks: `fp8rt bench quantize --device cuda`,
#      `fp8rt bench gemm --device cuda --size 8192`, `fp8rt bench step --device cuda` (one
#      training step in fp8, bf16 and fp32 on one GPU) and `fp8rt bench attention --device cuda`
#      (the fused BF16 tensor-core attention over the FP32 kernels), JSON to OUT_DIR.
#   5. Writes OUT_DIR/summary.txt (tests passed or not: each XML's test and failure counts, in
#      build mode also ctest's line for each GPU test; each ratio against its target) and exits
#      non-zero if a step failed. A benchmark below its target is reported, not a failure.
# Budget: under 8 minutes on 16 cores (the build is most of it; bundle mode takes 1-2 minutes).
#
# Output files (at most 8: what the device tool brings back): run.log, summary.txt,
# nvidia-smi.txt, bench_quantize.json, bench_gemm.json, bench_step.json, bench_attention.json
# and test_xml.tar.gz,
# which holds xml/NAME.xml for device_math_host_test and layer_math_host_test, and for
# ops_cuda_test, layer_ops_cuda_test, attention_cuda_test, nccl_communicator_test,
# nccl_deferred_test and train_cuda_test (bundle mode) or ctest_gpu.xml (build mode). Until the
# tests end the XML files lie loose in OUT_DIR/xml/ (at most 8: a run cut short mid-test brings
# back the first 8 files only); if neither tar nor Python can pack them they stay there, and some may not come back.
set -uo pipefail
cd "$(dirname "$0")/../.." || exit 1
ROOT=$(pwd)
OUT_DIR=${1:-${OUT:-./gpu-results}}
mkdir -p "$OUT_DIR"
OUT_DIR=$(cd "$OUT_DIR" && pwd)
LOG="$OUT_DIR/run.log"
: > "$LOG"
# This run's XML files, loose in XML_DIR until step 3 packs them into XML_TAR; an earlier run's
# are removed, so the summary reports this run's alone.
XML_DIR="$OUT_DIR/xml"
XML_TAR="$OUT_DIR/test_xml.tar.gz"
rm -rf "$XML_DIR" "$XML_TAR"
mkdir -p "$XML_DIR"
START=$(date +%s)
FAILED=()

log() { echo "[run.sh +$(($(date +%s) - START))s] $*" | tee -a "$LOG"; }
die() {
  log "FATAL: $*"
  rmdir "${XML_DIR:-/nonexistent}" 2> /dev/null
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
# Each test and benchmark program's limit, in seconds (bundle mode; ctest has its own).
TEST_TIMEOUT=${FP8RT_GPU_TEST_TIMEOUT:-240}
BENCH_TIMEOUT=${FP8RT_GPU_BENCH_TIMEOUT:-150}

# --- 2. binaries ----------------------------------------------------------------------------------
MODE=${FP8RT_GPU_MODE:-auto}
BUILD=${FP8RT_GPU_BUILD_DIR:-build-gpu}
BUNDLE_TAR=${FP8RT_GPU_BUNDLE:-build-gpu-bundle/fp8rt-gpu-bundle.tar.xz}
BIN=""
GEN=()
# The tests: the GPU ones (ctest label gpu; tests/gpu/CMakeLists.txt) and the host-only ones.
GPU_TESTS=(ops_cuda_test layer_ops_cuda_test attention_cuda_test nccl_communicator_test nccl_deferred_test
  train_cuda_test)
HOST_TESTS=(device_math_host_test layer_math_host_test)
command -v ninja > /dev/null 2>&1 && GEN=(-G Ninja)

try_build() {
  log "build mode: configuring $BUILD (Release, FP8RT_CUDA=ON)"
  run cmake -S . -B "$BUILD" "${GEN[@]}" -DCMAKE_BUILD_TYPE=Release -DFP8RT_CUDA=ON \
    -DFP8RT_WERROR=OFF -DFP8RT_TESTS=ON || return 1
  # Every test labeled gpu must be built here: `ctest -L gpu` runs them all.
  log "building ${GPU_TESTS[*]} ${HOST_TESTS[*]} fp8rt-bench fp8rt-bench-step"
  run cmake --build "$BUILD" -j"$NPROC" --target "${GPU_TESTS[@]}" "${HOST_TESTS[@]}" \
    fp8rt-bench fp8rt-bench-step || return 2
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
  missing=$(for b in "$dest"/bin/*; do ldd "$b" 2>&1 | grep 'not found'; done | sort -u)
  # The bundle's C++ runtime only where this machine's is missing or older ("version
  # `GLIBCXX_3.4.30' not found"): the machine's own cuBLAS and NCCL may need a newer one.
  if [ -n "$missing" ] && [ -d "$dest/lib-compat" ]; then
    log "the machine's C++ runtime does not serve the binaries ($(echo "$missing" | head -1 | tr -s ' \t' ' ')); using the bundle's lib-compat"
    export LD_LIBRARY_PATH="$LD_LIBRARY_PATH:$dest/lib-compat"
    missing=$(for b in "$dest"/bin/*; do ldd "$b" 2>&1 | grep 'not found'; done | sort -u)
  fi
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
# The test binaries lie in bin/ in the bundle and in tests/gpu/ in a build.
if [ -x "$BIN/bin/ops_cuda_test" ]; then TEST_BIN="$BIN/bin"; else TEST_BIN="$BIN/tests/gpu"; fi
BENCH="$BIN/bin/fp8rt-bench"
log "binaries ready after $(($(date +%s) - START))s"

# --- 3. tests -------------------------------------------------------------------------------------
# A GPU test that skipped for want of a device hides a problem here: ops_cuda_test,
# layer_ops_cuda_test and attention_cuda_test fail instead under FP8RT_REQUIRE_GPU=1; the NCCL
# test skips, so every test's output is searched.
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
  if [ ! -x "$binary" ]; then
    FAILED+=("$name (no binary)")
    log "FAILED: $name: no binary at $binary"
    rm -f "$output"
    return
  fi
  # A hung test (a collective that never completes, say) must not take the whole lease.
  timeout -k 10 "$TEST_TIMEOUT" "$binary" --gtest_output="xml:$XML_DIR/$name.xml" > "$output" 2>&1
  local status=$?
  [ $status -eq 124 ] && log "$name ran past ${TEST_TIMEOUT}s and was stopped"
  cat "$output" >> "$LOG"
  grep -E '^\[  (PASSED|FAILED|SKIPPED) +\]|tests? from .* ran' "$output" | tail -5 | tee -a "$LOG"
  if [ $status -ne 0 ]; then
    FAILED+=("$name")
    log "FAILED: $name (exit status $status)"
  fi
  check_no_device_skips "$name" "$output"
  rm -f "$output"
}
for t in "${HOST_TESTS[@]}"; do run_gtest "$t" "$TEST_BIN/$t"; done
CTEST_LINES=""
if [ -f "$BIN/CTestTestfile.cmake" ]; then
  # Build mode: the GPU suite through its ctest label (GPU_TESTS).
  output=$(mktemp)
  log "ctest -L gpu"
  (cd "$BIN" && ctest -L gpu -V --timeout 600 --output-junit "$XML_DIR/ctest_gpu.xml") > "$output" 2>&1
  status=$?
  cat "$output" >> "$LOG"
  grep -E 'tests passed|Test +#' "$output" | tee -a "$LOG"
  # One line per test for the summary ("1/4 Test #2: ops_cuda_test ....   Passed  12.3 sec").
  CTEST_LINES=$(grep -E '^ *[0-9]+/[0-9]+ Test +#' "$output")
  [ $status -eq 0 ] || { FAILED+=("ctest -L gpu"); log "FAILED: ctest -L gpu"; }
  check_no_device_skips "ctest -L gpu" "$output"
  rm -f "$output"
else
  for t in "${GPU_TESTS[@]}"; do run_gtest "$t" "$TEST_BIN/$t"; done
fi

# The summary's test lines, read now: the XML files are packed next.
xml_summary() {
  local t f
  for t in "$@"; do
    f="$XML_DIR/$t.xml"
    if [ ! -f "$f" ]; then
      echo "$t: no XML (it did not run, or crashed before writing it)"
      continue
    fi
    # The first tests= and failures= attributes (gtest puts them on one line, ctest on several).
    echo "$t: $(head -c 2000 "$f" | tr '\n\t' '  ' | grep -o 'tests="[0-9]*"' | head -1)" \
      "$(head -c 2000 "$f" | tr '\n\t' '  ' | grep -o 'failures="[0-9]*"' | head -1)"
  done
}
if [ -f "$BIN/CTestTestfile.cmake" ]; then
  TEST_LINES=$(xml_summary "${HOST_TESTS[@]}" ctest_gpu)
  [ -n "$CTEST_LINES" ] && TEST_LINES+=$'\n'"$CTEST_LINES"
else
  TEST_LINES=$(xml_summary "${HOST_TESTS[@]}" "${GPU_TESTS[@]}")
fi
# One file for all the XML (the device tool brings back at most 8 files).
log "packing $(cd "$XML_DIR" && echo *.xml) into $XML_TAR"
if tar -C "$OUT_DIR" -czf "$XML_TAR" xml >> "$LOG" 2>&1 ||
  python3 -c 'import sys, tarfile
with tarfile.open(sys.argv[1], "w:gz") as t: t.add(sys.argv[2], "xml")' "$XML_TAR" "$XML_DIR" \
    >> "$LOG" 2>&1; then
  rm -rf "$XML_DIR"
else
  rm -f "$XML_TAR"
  log "could not pack the XML files; they stay loose in $XML_DIR"
fi

# --- 4. benchmarks --------------------------------------------------------------------------------
bench() {
  local name=$1
  shift
  log "bench $name: fp8rt bench $*"
  timeout -k 10 "$BENCH_TIMEOUT" "$BENCH" "$@" --json > "$OUT_DIR/bench_$name.json" 2>> "$LOG"
  local status=$?
  [ $status -eq 124 ] && log "bench $name ran past ${BENCH_TIMEOUT}s and was stopped"
  if [ $status -eq 0 ]; then
    log "bench $name: $(head -c 400 "$OUT_DIR/bench_$name.json")"
  else
    FAILED+=("bench $name")
    log "FAILED: bench $name (exit status $status; 2 means no usable GPU)"
  fi
}
bench quantize quantize --device cuda
bench gemm gemm --device cuda --size 8192
bench step step --device cuda --rounds 3
bench attention attention --device cuda

# --- 5. summary -----------------------------------------------------------------------------------
{
  echo "fp8rt GPU run, $(date -u +%Y-%m-%dT%H:%M:%SZ), $(nvidia-smi -L | head -1)"
  echo "mode: $([ -f "$BIN/CTestTestfile.cmake" ] && echo build || echo bundle), $(($(date +%s) - START)) s"
  echo "$TEST_LINES"
  for b in quantize gemm step attention; do
    f="$OUT_DIR/bench_$b.json"
    if [ -s "$f" ]; then
      python3 - "$f" <<'PY' 2>/dev/null || echo "bench: $(head -c 300 "$f")"
import json, sys
j = json.load(open(sys.argv[1]))
verdict = "MET" if j["ratio"] >= j["target"] else "MISSED"
extra = ""
if j["benchmark"] == "gemm":
    t = j["tflops"]
    extra = " (fp8 %.0f, bf16 %.0f, fp8 block %.0f, fp8 fast accum %.0f TFLOP/s; paths %s)" % (
        t["fp8"], t["bf16"], t["fp8_block"], t.get("fp8_fast_accum", 0), j["paths"])
elif j["benchmark"] == "step":
    m = j["modes"]
    extra = " (fp8 %.1f ms, bf16 %.1f ms, fp32 %.1f ms per step of %d tokens)" % (
        1e3 * m["fp8"]["best_s"], 1e3 * m["bf16"]["best_s"], 1e3 * m["fp32"]["best_s"],
        j["tokens_per_step"])
elif j["benchmark"] == "attention":
    extra = " (fused %.1f, fp32 %.2f TFLOP/s; max |out diff| %.2g of %.2g)" % (
        j["fused_tflop_per_s"], j["fp32_tflop_per_s"], j["max_abs_out_difference"],
        j["max_abs_out"])
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
