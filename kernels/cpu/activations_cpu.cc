// The elementwise activations of the CPU layer ops (issue 18): GELU (tanh form) and SwiGLU,
// forward and backward, vectorised with Highway (its contrib Tanh and Exp, a few ULP from the
// correctly rounded functions; special values handled as the scalar references do) and run on the OpenMP team in fixed chunks. Every element is
// computed by the same vector instructions, the tail through a padded vector, so the result of an
// element depends neither on the thread count nor on where it falls in a chunk.
#undef HWY_TARGET_INCLUDE
#define HWY_TARGET_INCLUDE "kernels/cpu/activations_cpu.cc"
#include "hwy/foreach_target.h"  // IWYU pragma: keep
// Highway must come after foreach_target.
#include "hwy/contrib/math/math-inl.h"
#include "hwy/highway.h"

#ifndef FP8RT_KERNELS_CPU_ACTIVATIONS_CONSTANTS_
#define FP8RT_KERNELS_CPU_ACTIVATIONS_CONSTANTS_
#include <algorithm>
#include <cstdint>
#include <numbers>

namespace fp8rt::kernels::cpu_internal {
constexpr float kGeluK = static_cast<float>(std::numbers::sqrt2 * std::numbers::inv_sqrtpi);
constexpr float kGeluC = 0.044715f;
}  // namespace fp8rt::kernels::cpu_internal
#endif  // FP8RT_KERNELS_CPU_ACTIVATIONS_CONSTANTS_

HWY_BEFORE_NAMESPACE();
namespace fp8rt::kernels::cpu_internal {
namespace HWY_NAMESPACE {

namespace hn = hwy::HWY_NAMESPACE;
using D = hn::ScalableTag<float>;
using V = hn::Vec<D>;

// Runs `op(offset, lanes_valid)` over [0, n) a vector at a time; the last, partial vector's
// inputs and outputs go through padded copies (the op sees whole vectors only).
template <typename Op>
HWY_INLINE void ForVectors(int64_t n, const Op& op) {
  const D d;
  const int64_t lanes = static_cast<int64_t>(hn::Lanes(d));
  int64_t i = 0;
  for (; i + lanes <= n; i += lanes) op(i, lanes);
  if (i < n) op(i, n - i);
}

// Loads `valid` lanes of p (the rest 0) / stores `valid` lanes.
HWY_INLINE V LoadPart(const float* p, int64_t valid) {
  const D d;
  if (valid == static_cast<int64_t>(hn::Lanes(d))) return hn::LoadU(d, p);
  HWY_ALIGN float buf[hn::MaxLanes(d)] = {};
  std::copy(p, p + valid, buf);
  return hn::Load(d, buf);
}
HWY_INLINE void StorePart(V v, float* p, int64_t valid) {
  const D d;
  if (valid == static_cast<int64_t>(hn::Lanes(d))) return hn::StoreU(v, d, p);
  HWY_ALIGN float buf[hn::MaxLanes(d)];
  hn::Store(v, d, buf);
  std::copy(buf, buf + valid, p);
}

// 1 / (1 + exp(-g)) as the scalar reference computes it in float: exactly 0 where exp(-g)
// overflows (taken as -g > 88, where Highway's Exp stops; the reference is below 7e-39 there) and
// exactly 1 where it underflows (-g clamped to -104, whose exp is 0 in float), so that g s stays
// -0 for a huge negative g and NaN for g = -Inf, as on the other backends. A NaN gate gives a NaN
// output either way: the callers multiply by g.
HWY_INLINE V Sigmoid(D d, V g) {
  const V one = hn::Set(d, 1.0f);
  const V neg = hn::Neg(g);
  const V s = hn::Div(one, hn::Add(one, hn::Exp(d, hn::Max(hn::Min(neg, hn::Set(d, 88.0f)),
                                                           hn::Set(d, -104.0f)))));
  return hn::IfThenZeroElse(hn::Gt(neg, hn::Set(d, 88.0f)), s);
}

// tanh(k (x + c x^3)), the GELU's inner function, the argument clamped to [-10, 10] (tanh is +-1
// in float beyond about 9.01; the clamp keeps an infinite argument, from x = +-Inf or a cube
// that overflows, inside the range Highway's Tanh is defined on). So non-finite and huge inputs
// take the same course through the tanh form as in the scalar reference (e.g. GELU(-Inf) = NaN,
// as 0.5 x (1 + tanh u) is there).
HWY_INLINE V GeluTanh(D d, V x) {
  const V u = hn::Mul(hn::Set(d, kGeluK), hn::MulAdd(hn::Mul(hn::Set(d, kGeluC), x),
                                                     hn::Mul(x, x), x));
  return hn::Tanh(d, hn::Max(hn::Min(u, hn::Set(d, 10.0f)), hn::Set(d, -10.0f)));
}

void GeluForwardSpan(float* out, const float* x, int64_t n) {
  const D d;
  ForVectors(n, [&](int64_t i, int64_t valid) {
    const V xi = LoadPart(x + i, valid);
    const V half_x = hn::Mul(hn::Set(d, 0.5f), xi);
    StorePart(hn::MulAdd(half_x, GeluTanh(d, xi), half_x), out + i, valid);
  });
}

// dx += dout * (0.5 (1 + th) + 0.5 x (1 - th^2) k (1 + 3 c x^2)).
void GeluBackwardSpan(float* dx, const float* dout, const float* x, int64_t n) {
  const D d;
  const V half = hn::Set(d, 0.5f), one = hn::Set(d, 1.0f);
  ForVectors(n, [&](int64_t i, int64_t valid) {
    const V xi = LoadPart(x + i, valid);
    const V th = GeluTanh(d, xi);
    const V du = hn::Mul(hn::Set(d, kGeluK),
                         hn::MulAdd(hn::Mul(hn::Set(d, 3.0f * kGeluC), xi), xi, one));
    const V sech2 = hn::NegMulAdd(th, th, one);
    const V grad = hn::MulAdd(hn::Mul(hn::Mul(half, xi), sech2), du, hn::MulAdd(half, th, half));
    StorePart(hn::MulAdd(LoadPart(dout + i, valid), grad, LoadPart(dx + i, valid)), dx + i, valid);
  });
}

// out = g sigmoid(g) up.
void SwigluForwardSpan(float* out, const float* gate, const float* up, int64_t n) {
  const D d;
  ForVectors(n, [&](int64_t i, int64_t valid) {
    const V g = LoadPart(gate + i, valid);
    StorePart(hn::Mul(hn::Mul(g, Sigmoid(d, g)), LoadPart(up + i, valid)), out + i, valid);
  });
}

// dgate += dout up s (1 + g (1 - s)); dup += dout g s.
void SwigluBackwardSpan(float* dgate, float* dup, const float* dout, const float* gate,
                        const float* up, int64_t n) {
  const D d;
  const V one = hn::Set(d, 1.0f);
  ForVectors(n, [&](int64_t i, int64_t valid) {
    const V g = LoadPart(gate + i, valid);
    const V s = Sigmoid(d, g);
    const V dsilu = hn::Mul(s, hn::MulAdd(g, hn::Sub(one, s), one));
    const V dy = LoadPart(dout + i, valid);
    StorePart(hn::MulAdd(hn::Mul(dy, LoadPart(up + i, valid)), dsilu, LoadPart(dgate + i, valid)),
              dgate + i, valid);
    StorePart(hn::MulAdd(dy, hn::Mul(g, s), LoadPart(dup + i, valid)), dup + i, valid);
  });
}

}  // namespace HWY_NAMESPACE
}  // namespace fp8rt::kernels::cpu_internal
HWY_AFTER_NAMESPACE();

#if HWY_ONCE
#include "kernels/cpu/activations_cpu.h"

namespace fp8rt::kernels::cpu_internal {

HWY_EXPORT(GeluForwardSpan);
HWY_EXPORT(GeluBackwardSpan);
HWY_EXPORT(SwigluForwardSpan);
HWY_EXPORT(SwigluBackwardSpan);

namespace {
// Fixed chunks (a multiple of every target's lane count) over the OpenMP team.
constexpr int64_t kChunk = int64_t{1} << 14;

template <typename Body>
void ForChunks(int64_t n, const Body& body) {
  const int64_t chunks = (n + kChunk - 1) / kChunk;
#pragma omp parallel for schedule(static) if (chunks > 1)
  for (int64_t c = 0; c < chunks; ++c) {
    const int64_t begin = c * kChunk;
    body(begin, std::min(kChunk, n - begin));
  }
}
}  // namespace

void GeluForwardVec(float* out, const float* x, int64_t n) {
  ForChunks(n, [&](int64_t b, int64_t len) {
    HWY_DYNAMIC_DISPATCH(GeluForwardSpan)(out + b, x + b, len);
  });
}
void GeluBackwardVec(float* dx, const float* dout, const float* x, int64_t n) {
  ForChunks(n, [&](int64_t b, int64_t len) {
    HWY_DYNAMIC_DISPATCH(GeluBackwardSpan)(dx + b, dout + b, x + b, len);
  });
}
void SwigluForwardVec(float* out, const float* gate, const float* up, int64_t n) {
  ForChunks(n, [&](int64_t b, int64_t len) {
    HWY_DYNAMIC_DISPATCH(SwigluForwardSpan)(out + b, gate + b, up + b, len);
  });
}
void SwigluBackwardVec(float* dgate, float* dup, const float* dout, const float* gate,
                       const float* up, int64_t n) {
  ForChunks(n, [&](int64_t b, int64_t len) {
    HWY_DYNAMIC_DISPATCH(SwigluBackwardSpan)(dgate + b, dup + b, dout + b, gate + b, up + b, len);
  });
}

}  // namespace fp8rt::kernels::cpu_internal
#endif  // HWY_ONCE
