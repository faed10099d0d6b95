// Which FP8 GEMMs cuBLASLt takes (kernels/cuda/gemm_cuda.cc), as plain host code: the shape,
// format and device rules, without the pointer alignment and the tests' forced fallback, which
// the backend checks at the call. Header-only and CUDA-free, so that tests/gpu/
// device_math_host_test.cc checks it on any machine.
//
//   RouteFp8Gemm  cuBLASLt or the fallback kernel for these arguments on a device of compute
//                 capability cc, and why not cuBLASLt
//   NoticeKind, NoticeFor
//                 the warning the backend prints, once per kind and process, when a GEMM leaves
//                 cuBLASLt
#pragma once

#include <string>

#include "kernels/gemm.h"

namespace fp8rt::kernels::cuda_internal {

struct Fp8GemmRoute {
  bool cublaslt = true;
  // The device, not the shape, rules cuBLASLt out: block scaling off Hopper, mx32 before
  // Blackwell (a recipe choice makes it slow: NoticeFor tells it once per scaling).
  bool architecture = false;
  std::string why;  // empty when cublaslt
};

// A GEMM's way off cuBLASLt as the user is told it, once per kind and process (the backend keeps
// the "once"): the device's reasons once per scaling (kinds 0-2, the GemmScaling), a shape or
// format cuBLASLt has no kernel for once in all (kind 3), operands not 16-byte aligned once in all
// (kind 4); each of the last two names the first GEMM that met it. Several GEMMs a step would
// otherwise run far slower with nothing said (a model dimension not a multiple of 16).
struct FallbackNotice {
  static constexpr int kKinds = 5;
  int kind = -1;  // -1: nothing to say (the route is cuBLASLt's)
  std::string text;
};

// cc: 90 for 9.0. Rules: E5M2 x E5M2 has no cuBLASLt kernel; M, N and K multiples of 16; block
// scaling (1x128 x 128x128, FP32 scales) on compute capability 9.0 only and K a multiple of 128;
// mx32 (VEC32_UE8M0) on 10.0 and later and K a multiple of 128.
inline Fp8GemmRoute RouteFp8Gemm(const Fp8GemmArgs& args, int cc) {
  auto no = [](bool architecture, std::string why) {
    return Fp8GemmRoute{.cublaslt = false, .architecture = architecture, .why = std::move(why)};
  };
  if (args.a_format == Fp8Format::kE5M2 && args.b_format == Fp8Format::kE5M2) {
    return no(false, "E5M2 x E5M2 has no cuBLASLt kernel");
  }
  if (args.m % 16 != 0 || args.n % 16 != 0 || args.k % 16 != 0) {
    return no(false, "M, N and K must be multiples of 16 for cuBLASLt");
  }
  // Built only on the way to a refusal: the aligned GEMMs of every step take no string.
  auto device = [cc] { return std::to_string(cc / 10) + "." + std::to_string(cc % 10); };
  if (args.scaling == GemmScaling::kBlock) {
    if (cc != 90) {
      return no(true,
                "block scaling (1x128 x 128x128 FP32 scales) has a cuBLASLt kernel on compute "
                "capability 9.0 (Hopper) only, not " +
                    device() +
                    ": these GEMMs run on the fallback kernel, far slower (on Blackwell use "
                    "precision.scaling: mx32)");
    }
    if (args.k % 128 != 0) return no(false, "block scaling needs K a multiple of 128 for cuBLASLt");
  }
  if (args.scaling == GemmScaling::kMx32) {
    if (cc < 100) {
      return no(true,
                "mx32 scaling (VEC32_UE8M0) has a cuBLASLt kernel on compute capability 10.0 "
                "(Blackwell) and later only, not " +
                    device() +
                    ": these GEMMs run on the fallback kernel, far slower (on Hopper use "
                    "precision.scaling: block)");
    }
    if (args.k % 128 != 0) return no(false, "mx32 scaling needs K a multiple of 128 for cuBLASLt");
  }
  return {};
}

// The kind of notice (FallbackNotice::kind) for a GEMM routed `route` whose operand pointers are
// (`aligned`) or are not all 16-byte aligned; cheap, so that the backend builds the text only
// the first time a kind comes up.
inline int NoticeKind(const Fp8GemmArgs& args, const Fp8GemmRoute& route, bool aligned) {
  if (route.cublaslt && aligned) return -1;
  if (route.architecture) return static_cast<int>(args.scaling);
  return route.cublaslt ? 4 : 3;
}

// The notice itself, kind and text.
inline FallbackNotice NoticeFor(const Fp8GemmArgs& args, const Fp8GemmRoute& route, bool aligned) {
  const int kind = NoticeKind(args, route, aligned);
  if (kind < 0) return {};
  if (route.architecture) return {.kind = kind, .text = route.why};
  const std::string gemm = "an FP8 GEMM of M=" + std::to_string(args.m) +
                           " N=" + std::to_string(args.n) + " K=" + std::to_string(args.k);
  const std::string once = " (said once per process; later such GEMMs are not reported)";
  const std::string why =
      !route.cublaslt ? route.why : "its A, B or D pointer is not 16-byte aligned";
  return {.kind = kind,
          .text = gemm + " runs on the CUDA-core fallback kernel, far slower than cuBLASLt: " +
                  why + once};
}

}  // namespace fp8rt::kernels::cuda_internal
