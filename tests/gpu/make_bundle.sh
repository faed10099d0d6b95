#!/usr/bin/env bash
# tests/gpu/make_bundle.sh: builds the GPU test and benchmark binaries here (a machine with
# fp8rt's dependencies: Debian 12 as scripts/bootstrap sets it up, plus CUDA 13) and packs them,
# with the shared libraries they load that a bare CUDA machine lacks, into
# build-gpu-bundle/fp8rt-gpu-bundle.tar.xz for tests/gpu/run.sh's bundle mode.
#
# Why: the GPU machines this workplace lends (see the device notes) have CUDA, CMake and ninja
# but none of fp8rt's C++ dependencies (abseil, gRPC, protobuf, Highway, oneDNN, OpenBLAS,
# Open MPI, GoogleTest, ...) and no network to install them, so run.sh cannot build there. The
# bundle leaves out what the GPU machine has and must match its driver: libcuda (driver),
# cuBLAS/cuBLASLt and NCCL (hundreds of MB; run.sh finds the machine's own). It keeps libcudart
# (small, and the one the binaries were built against). glibc stays the machine's.
#
# Usage: tests/gpu/make_bundle.sh [BUILD_DIR]     (default build-gpu-release; about 10 minutes on
#        2 cores from scratch). Then, on the GPU machine: tests/gpu/run.sh, with
#        build-gpu-bundle carried (it is ignored by git through build*/).
set -euo pipefail
cd "$(dirname "$0")/../.."

BUILD=${1:-build-gpu-release}
BUNDLE_DIR=build-gpu-bundle
# The tests run.sh runs (its GPU_TESTS and HOST_TESTS) and the benchmark program.
TESTS=(ops_cuda_test layer_ops_cuda_test attention_cuda_test nccl_communicator_test
  nccl_deferred_test train_cuda_test device_math_host_test layer_math_host_test)
TARGETS=("${TESTS[@]}" fp8rt-bench fp8rt-bench-step)

mkdir -p "$BUILD"
# -Werror stays off here: GCC 12 at -O3 (Release) reports false -Wrestrict warnings inside
# std::string that CI's -O2 build (RelWithDebInfo, -Werror) does not.
cmake -S . -B "$BUILD" -G Ninja -DCMAKE_BUILD_TYPE=Release -DFP8RT_CUDA=ON -DFP8RT_WERROR=OFF \
  -DFP8RT_TESTS=ON > "$BUILD/configure.log" 2>&1 || { cat "$BUILD/configure.log"; exit 1; }
cmake --build "$BUILD" --target "${TARGETS[@]}" -j"$(nproc)"

stage=$(mktemp -d)
trap 'rm -rf "$stage"' EXIT
root="$stage/fp8rt-gpu-bundle"
mkdir -p "$root/bin" "$root/lib"
binaries=()
for t in "${TESTS[@]}"; do binaries+=("$BUILD/tests/gpu/$t"); done
binaries+=("$BUILD/bin/fp8rt-bench" "$BUILD/bin/fp8rt-bench-step")
for b in "${binaries[@]}"; do
  install -m 755 "$b" "$root/bin/"
  strip --strip-unneeded "$root/bin/$(basename "$b")"
done

# Shared libraries to carry: everything ldd resolves except glibc's own, the driver, and the
# NVIDIA libraries the GPU machine provides (cuBLAS, cuBLASLt, NCCL). The C++ runtime
# (libstdc++, libgcc_s) goes to lib-compat/: the GPU machine's own is usually newer, and the
# machine's cuBLAS and NCCL may need it, so run.sh puts lib-compat/ on the path only when the
# machine's runtime is older than the one the binaries were built against.
skip='^(linux-vdso|ld-linux|libc\.so|libm\.so|libdl\.so|libpthread\.so|librt\.so|libresolv\.so|libcuda\.so|libcublas|libcublasLt|libnccl)'
compat='^(libstdc\+\+|libgcc_s)'
mkdir -p "$root/lib-compat"
for b in "${binaries[@]}"; do
  ldd "$b" | awk '/=> \// {print $1, $3}'
done | sort -u | while read -r soname path; do
  if [[ "$soname" =~ $skip ]]; then continue; fi
  if [[ "$soname" =~ $compat ]]; then
    cp -L "$path" "$root/lib-compat/$soname"
  else
    cp -L "$path" "$root/lib/$soname"
  fi
done

{
  echo "fp8rt GPU bundle"
  echo "commit: $(git rev-parse HEAD 2>/dev/null || echo unknown)$(git diff --quiet 2>/dev/null || echo ' (+ uncommitted changes)')"
  echo "built: $(date -u +%Y-%m-%dT%H:%M:%SZ) on $(grep -m1 PRETTY_NAME /etc/os-release | cut -d= -f2)"
  echo "nvcc: $(/usr/local/cuda/bin/nvcc --version | tail -1)"
  echo "glibc needed: $(for b in "$root"/bin/*; do objdump -T "$b" | grep -o 'GLIBC_[0-9.]*'; done | sort -uV | tail -1)"
  echo "binaries: $(cd "$root/bin" && echo *)"
  echo "libraries: $(cd "$root/lib" && echo *)"
  echo "C++ runtime, used only where the machine's is older: $(cd "$root/lib-compat" && echo *)"
} > "$root/MANIFEST"

mkdir -p "$BUNDLE_DIR"
tar -C "$stage" -cJf "$BUNDLE_DIR/fp8rt-gpu-bundle.tar.xz" fp8rt-gpu-bundle
cp "$root/MANIFEST" "$BUNDLE_DIR/MANIFEST"
cat "$BUNDLE_DIR/MANIFEST"
du -h "$BUNDLE_DIR/fp8rt-gpu-bundle.tar.xz"
