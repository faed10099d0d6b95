#!/usr/bin/env bash
# Runs one libFuzzer target for a fixed time over a fresh copy of its checked-in corpus (ctest's
# fuzz and fuzz-long tests; tests/fuzz/README.md).
#   run_fuzzer.sh FUZZER CORPUS_DIR WORK_DIR ARTIFACT_DIR SECONDS [libFuzzer flags...]
# WORK_DIR is emptied and receives the copy, which the fuzzer grows; CORPUS_DIR is only read.
# Exit status: the fuzzer's (0 when it ran out its time; non-zero after a crash, a sanitizer report,
# a timeout of one input or running out of memory, with the input kept in ARTIFACT_DIR).
set -euo pipefail
if [ $# -lt 5 ]; then
  echo "usage: $0 FUZZER CORPUS_DIR WORK_DIR ARTIFACT_DIR SECONDS [libFuzzer flags...]" >&2
  exit 2
fi
fuzzer=$1 corpus=$2 work=$3 artifacts=$4 seconds=$5
shift 5
rm -rf "$work"
mkdir -p "$work" "$artifacts"
cp -R "$corpus/." "$work/"
# -malloc_limit_mb: inputs are a few KB, so any single allocation over 128 MiB is an amplification
# bug (a length or count trusted before it was checked), reported as out-of-memory.
# UBSan findings abort (the code is built with -fno-sanitize-recover=undefined); the stack trace
# goes with the report.
export UBSAN_OPTIONS=${UBSAN_OPTIONS:-print_stacktrace=1:halt_on_error=1}
export ASAN_OPTIONS=${ASAN_OPTIONS:-detect_leaks=1}
exec "$fuzzer" -max_total_time="$seconds" -rss_limit_mb=2048 -malloc_limit_mb=128 -max_len=4096 -timeout=10 \
  -print_final_stats=1 -artifact_prefix="$artifacts/" "$@" "$work"
