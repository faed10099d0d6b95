// Vectorised, threaded elementwise activations of the CPU layer ops (activations_cpu.cc):
// GELU (tanh form) and SwiGLU. The backwards accumulate (+=) as the scalar references in
// layer_ops_cpu.cc did. Results do not depend on the OpenMP thread count.
#ifndef FP8RT_KERNELS_CPU_ACTIVATIONS_CPU_H_
#define FP8RT_KERNELS_CPU_ACTIVATIONS_CPU_H_

#include <cstdint>

namespace fp8rt::kernels::cpu_internal {

// out = 0.5 x (1 + tanh(k (x + 0.044715 x^3))), k = sqrt(2 / pi).
void GeluForwardVec(float* out, const float* x, int64_t n);
// dx += dout * GELU'(x).
void GeluBackwardVec(float* dx, const float* dout, const float* x, int64_t n);
// out = silu(gate) * up.
void SwigluForwardVec(float* out, const float* gate, const float* up, int64_t n);
// dgate += dout * up * silu'(gate); dup += dout * silu(gate).
void SwigluBackwardVec(float* dgate, float* dup, const float* dout, const float* gate,
                       const float* up, int64_t n);

}  // namespace fp8rt::kernels::cpu_internal

#endif  // FP8RT_KERNELS_CPU_ACTIVATIONS_CPU_H_
