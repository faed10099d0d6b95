// Internal: the CPU backend's op entry points, collected into the table in ops_cpu.cc.
#ifndef FP8RT_KERNELS_CPU_CPU_OPS_H_
#define FP8RT_KERNELS_CPU_CPU_OPS_H_

#include <array>

#include "kernels/ops.h"

namespace fp8rt::kernels::cpu_internal {

absl::Status QuantizeCpu(const QuantizeArgs& args, Stream stream);
absl::Status DequantizeCpu(const DequantizeArgs& args, Stream stream);
absl::Status AmaxCpu(const AmaxArgs& args, Stream stream);
absl::Status ConvertCpu(const ConvertArgs& args, Stream stream);
absl::Status GemmFp8Cpu(const Fp8GemmArgs& args, Stream stream);
absl::Status GemmBf16Cpu(const Bf16GemmArgs& args, Stream stream);
absl::Status GemmF32Cpu(const F32GemmArgs& args, Stream stream);
absl::Status CastTransposeCpu(const CastTransposeArgs& args, Stream stream);
// The layer ops (kernels/cpu/layer_ops_cpu.cc).
extern const LayerOps kLayerOps;
// Its MoE routing entries (kernels/cpu/moe_cpu.cc; LayerOps::moe_route ...).
absl::Status MoeRouteCpu(float* probs, int32_t* expert, float* gate, double* prob_sums,
                         const float* logits, int64_t n, int64_t e, int64_t k, Stream stream);
absl::Status GatherRowsCpu(float* dst, const float* src, const int64_t* index, int64_t rows,
                           int64_t cols, Stream stream);
absl::Status ScatterRowsCpu(float* dst, const float* src, const int64_t* index, int64_t rows,
                            int64_t cols, Stream stream);
absl::Status MoeCombineCpu(float* out, const float* y, const float* gate, const int64_t* slot,
                           const int32_t* expert, int64_t n, int64_t k, int64_t c, bool accumulate,
                           Stream stream);
absl::Status MoeCombineBackwardCpu(float* dy, float* dgate, const float* dout, const float* y,
                                   const float* gate, const int64_t* slot, int64_t n, int64_t k,
                                   int64_t c, Stream stream);
absl::Status MoeRouterBackwardCpu(float* dlogits, const float* probs, const int32_t* expert,
                                  const float* gate, const float* dgate, const float* frac,
                                  float aux_scale, int64_t n, int64_t e, int64_t k, Stream stream);

// Workspace helpers shared with GemmWorkspaceBytes: 64-byte rounding, and the bytes reserved for
// B packed into oneDNN's weights layout.
size_t Padded(size_t bytes);
size_t PackedBBytes(int64_t n, int64_t k);

// BF16 bits of every FP8 code of a format (exact), built once (kernels/cpu/convert_cpu.cc).
const std::array<uint16_t, 256>& Fp8ToBf16Table(Fp8Format format);
// FP32 -> BF16 (nearest even) on the OpenMP team, vectorised (kernels/cpu/convert_cpu.cc).
void RoundToBf16(const float* in, int64_t n, uint16_t* out);

struct SpanStats;  // kernels/cpu/quantize_one.h
// One span of FP32 quantized to FP8 codes with its statistics added to `stats`, vectorised, on
// the calling thread: the same codes and counts as QuantizeOne per element
// (kernels/cpu/quantize_cpu.cc).
void QuantizeF32Span(const float* x, size_t n, float scale, Fp8Format format, uint8_t* out,
                     SpanStats* stats);

// FP8 codes -> BF16 bits, exact, on the OpenMP team (kernels/cpu/convert_cpu.cc).
void DecodeFp8ToBf16(const uint8_t* codes, int64_t n, Fp8Format format, uint16_t* out);
// B (n x k FP8 codes, row-major; with `b_transposed` B^T, k x n row-major) packed as BF16 into
// oneDNN's AMX weights layout (blocks of 32 k x 64 n, k pairs adjacent), whose padded dims are
// kp x np and outer block strides are given.
void PackFp8AmxLayout(const uint8_t* b, bool b_transposed, int64_t n, int64_t k, Fp8Format format,
                      int64_t kp, int64_t np, int64_t k_block_stride, int64_t n_block_stride,
                      uint16_t* dst);
// The same layout from B as FP32 values (`f32`; rounded to nearest even as FloatToBf16 does) or
// as BF16 bits (kernels/cpu/convert_cpu.cc).
void PackBf16AmxLayout(const void* b, bool f32, int64_t n, int64_t k, int64_t kp, int64_t np,
                       int64_t k_block_stride, int64_t n_block_stride, uint16_t* dst);

// Tests only: pack B through the generic blocked-layout path even where the AMX layout has a
// direct loop, so that both paths are checked on this machine.
void ForceGenericPackingForTesting(bool force);
// Tests only: how many times, in this process, a GEMM's B went through a direct AMX-layout loop
// (PackFp8AmxLayout, PackBf16AmxLayout) rather than the generic path, so that a test comparing
// the two can tell whether oneDNN picked the AMX layout at all.
int64_t AmxLayoutPacksForTesting();
// Tests only: run every BF16/FP8 GEMM on the FP32-matmul path (gemm_cpu.cc), as on a CPU without
// oneDNN BF16 matmul kernels. Set it before sizing a workspace (GemmWorkspaceBytes follows it).
void ForceF32MatmulForTesting(bool force);
// True when the GEMMs run on the FP32-matmul path (no BF16 kernels here, or forced).
bool UsesF32Matmul();

}  // namespace fp8rt::kernels::cpu_internal

#endif  // FP8RT_KERNELS_CPU_CPU_OPS_H_
