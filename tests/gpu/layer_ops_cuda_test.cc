// The CUDA layer-op table (CudaOps()->layer, kernels/cuda/layer_ops_cuda.cu) against the CPU
// table's entries (CpuOps().layer, the reference of kernels/layer_ops.h) on the same inputs. The
// attention and cross-entropy entries are not covered here (kernels/cuda/attention_cuda.cu).
//
// Built twice: layer_ops_cuda_test runs on a GPU (and skips without one, but NoDeviceArgumentTest);
// layer_ops_host_test is this file in host mode (FP8RT_GPU_TEST_HOST,
// tests/gpu/gpu_test_support.h): the table is layer_ops_cuda.cu's own source compiled as host code
// over the block emulator of tests/gpu/host_cuda.h (layer_ops_cuda_host.cc), held to the same
// bounds, in every CI pass, with no GPU. Host mode leaves out ArgumentTest, AllocateTest and
// SumSquaresStreamsTest, which test the CUDA runtime itself (HostModeTest says so when it runs).
//
// Index:
//   EmbeddingTest (TEST_P)   n x V x C incl. few distinct tokens (long runs of repeats), tens of
//                            thousands of tokens, rows wider than a 256-column tile: forward and
//                            backward onto a pre-filled dtable, bit for bit
//   EmbeddingTokensTest      token ids outside [0, V): forward writes NaN rows, backward skips
//                            them and adds the other rows bit for bit
//   RmsNormTest (TEST_P)     N x C: forward (out, rstd), backward onto pre-filled dx and dweight,
//                            within the bounds below; backward reruns are bit for bit
//   LayerNormTest (TEST_P)   N x C: forward (out, mean, rstd), backward onto pre-filled dx,
//                            dweight and dbias, within the bounds below; reruns bit for bit
//   BiasTest (TEST_P)        N x C: forward bit for bit, backward within the column-sum bound
//   RopeTest (TEST_P)        N x T x H x Dh incl. positions past 4000: forward (also in place) and
//                            backward onto pre-filled dx, within the cos/sin bound below
//   GeluTest (TEST_P)        sizes: forward, backward onto pre-filled dx, within the bounds below
//   SwigluTest (TEST_P)      sizes: forward, backward onto pre-filled dgate and dup, within the
//                            expf bounds below
//   ElementwiseTest (TEST_P) sizes: residual forward (also in place, out = a and out = b) and
//                            backward, fill, copy, adamw: bit for bit
//   SumSquaresTest (TEST_P)  counts incl. 0 and across every change of the grid (1 block up to
//                            8192 elements, one more per 8192, 512 from 4194304 on): the bits of
//                            the documented order (so the same on every GPU), reruns bit for bit,
//                            within the bounds below of the exact sum and of the CPU
//   SumSquaresStreamsTest    the same op on two streams at once: each gets its own bits
//   SumSquaresSpecialsTest   a NaN or an Inf anywhere gives a non-finite sum
//   TransposeTest, HeadsTest (TEST_P)  random bit patterns (NaN payloads included), bit for bit;
//                            HeadsTest over kv heads x query heads per kv head (GQA layouts)
//   ArgumentTest             host pointers refused with InvalidArgument naming the buffer, nothing
//                            launched (outputs keep their poison), the context still healthy
//   AllocateTest             allocate gives memory the ops accept and the host reads after
//                            synchronize (0 bytes too); allocate_device memory is allocated and
//                            freed in the default stream's order without waiting; a failure is
//                            ResourceExhausted naming the size and is not reported again by the
//                            next launch
//   NoDeviceArgumentTest     needs no GPU, runs everywhere: negative sizes and null pointers are
//                            refused naming the argument before any CUDA call; empty ops succeed;
//                            every entry of the table is set
//
// Element sizes go past the kernels' persistent grids (at most 8 blocks of 256 threads per SM,
// ~270k threads on an H200), and shapes are odd and not multiples of the 32-wide tiles or of the
// 256-thread blocks. Every op runs on a stream of the test's own.
//
// Tolerances (u = 2^-24, the FP32 unit roundoff; gamma_k <= 1.01 k u for the k used here, Higham,
// "Accuracy and Stability of Numerical Algorithms", section 3.1). "Bit for bit" treats two NaNs as
// equal where arithmetic makes them (the GPU writes the canonical NaN, the host keeps a payload);
// pure moves (embedding, copy, fill, transpose, heads) must keep every bit, payloads included.
//   rmsnorm_forward: the row sum of squares adds the same rounded squares in another order. The
//     CPU adds them in index order (error <= gamma_{C-1} S), the GPU in ceil(C/256) strided terms
//     per thread then an 8-level tree (gamma_{ceil(C/256)+8} S), so the two sums differ by at most
//     d = 1.01 (C + ceil(C/256) + 8) u relative. rstd = 1/sqrt(S/C + eps) halves a relative error
//     in S, and each of its four roundings may go another way: |rstd_gpu - rstd_cpu| <=
//     (d/2 + 6u) rstd. out = (x rstd) w adds two roundings: (d/2 + 8u) |x w rstd|.
//   rmsnorm_backward (both sides given the same rstd): gx = sum_c dout w x is signed, so with
//     G = sum_c |dout w x| its two sums differ by at most 1.01 (C + ceil(C/256) + 8) u G; that
//     moves coef = rstd^3 gx / C by rstd^3 of it / C, and dx by |x| times that, plus a rounding of
//     each of dx's three terms that may go another way (4u of their magnitudes). dweight: the CPU
//     adds the N terms dout x rstd onto dweight in row order (gamma_N), the GPU 32 lane sums of
//     ceil(N/32) terms, then the lanes in order and dweight (gamma_{ceil(N/32)+33}): at most
//     1.01 (N + ceil(N/32) + 33) u (|dweight_0| + sum_n |dout x rstd|).
//   gelu: the same operations but tanhf, whose CUDA version is within 2 ulp of tanh (CUDA Math API,
//     tanhf) and glibc's within 2-3 ulp: |dtanh| <= 8 ulp <= 2^-20 |tanh u| (+ 2^-146 near 0).
//     Forward: 0.5 |x| dtanh plus 2 roundings of the (possibly different) result, 2^-22
//     0.5 |x| (1 + |tanh|). Backward: the gradient moves by 0.5 dtanh + |x tanh du| dtanh
//     (through tanh^2) plus 4 roundings of its terms' magnitudes A = 0.5 (1 + |tanh|),
//     B = 0.5 |x| (1 + tanh^2) |du|; dx by |dout| times that plus 2 roundings of |dx_0| +
//     |dout| (A + B).
//   layernorm_forward: with d as for RMSNorm, S1 = sum_c |x|, the two means differ by
//     dm = d S1 / C + 2u |mean|; each deviation x - mean by dm + 2u |x - mean|, its square by
//     2 |x - mean| dm + 6u (x - mean)^2, the sum of squares Q by the sum of those plus d Q, var by
//     that / C + 2u var, var + eps by another 2u (var + eps); rstd relatively by half of that
//     over var + eps plus 4u (sqrt and division on each side); out = ((x - m) rstd) w + b by
//     |w| (|x - m| drstd + rstd d(x - m) + 2u |x - m| rstd) + 2u |(x - m) rstd w| + 2u (|(x - m)
//     rstd w| + |b|). Doubled for second-order terms.
//   layernorm_backward (both sides given the same mean and rstd, so xhat, g = dout w and g xhat
//     are the same bits): the two row sums differ by d sum|g| and d sum|g xhat|, their means by
//     that / C plus 2u of the mean; dx = dx0 + ((g - g_mean) - xhat gx_mean) rstd propagates them
//     with 2u per rounding of each intermediate's magnitude. dweight, dbias: the RMSNorm dweight
//     bound with the terms dout xhat and dout. Doubled. bias_backward: the same column-sum bound.
//   rope: cos and sin are FP64 values rounded to FP32 on both sides, the FP64 functions within a
//     few FP64 ulp of each other, so the FP32 values differ by at most an ulp (<= u, |cos|, |sin|
//     <= 1). A rotated pair a c -/+ b s then differs by at most (|a| + |b|) u plus a rounding of
//     each product and of the sum on each side, 4u (|a c| + |b s|) <= 4u (|a| + |b|): 5u (|a| +
//     |b|) in all, doubled; the backward adds 2u (|dx0| + |a| + |b|) for the accumulation.
//   swiglu: expf within 2 ulp on CUDA and 1 ulp in glibc, so e = exp(-g) differs by <= 6u e; 1 + e
//     by that plus 2u (1 + e); s = 1 / (1 + e) relatively by <= 10u in all. Forward (g s) up:
//     14u |out|. Backward: 1 - s, g (1 - s), 1 + g (1 - s) and s (...) each add the propagated
//     error and 2u of their magnitude; dgate and dup add the roundings of the products and of the
//     accumulation. Doubled; 2^-120 absolute slack where s or the products underflow.
//   sum_squares (FP64, U = 2^-53): the squares are exact in FP64 and all >= 0, so a sum whose terms
//     pass through at most h additions is within gamma_h S <= 1.01 h U S of the exact sum S (long
//     double, compensated; Higham, chapter 4). The GPU's documented order (kernels/cuda/
//     layer_math.cuh) gives h = ceil(count / G) + 8 (a term's chain in pass 1 over G = 256 B
//     threads, then the 8-level block tree), plus ceil(B / 256) + 8 for pass 2 when B > 1 blocks;
//     the CPU's index order h = count - 1. The GPU is checked against S with its own bound and
//     against the CPU with the sum of both: relative to S at most 1.01 (count + count / G + 17) U,
//     i.e. ~count 2^-53, as kernels/layer_ops.h states (typical errors are far smaller). Beyond
//     the bound, the GPU must give exactly the bits of the documented order computed on the host
//     (SumSquaresInTheDocumentedOrder): FP64 additions are correctly rounded on both, and the FP32
//     squares are exact in FP64, so a fused multiply-add changes nothing.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <bit>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <ostream>
#include <random>
#include <string>
#include <thread>
#include <tuple>
#include <vector>

#include "absl/cleanup/cleanup.h"
#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "kernels/cuda/cuda_ops_internal.h"
#include "kernels/cuda/device_pool.h"
#include "kernels/device_array.h"
#include "kernels/layer_ops.h"
#include "kernels/ops.h"
#include "tests/gpu/gpu_test_support.h"

namespace fp8rt::kernels {
namespace {

constexpr double kU = 0x1p-24;  // FP32 unit roundoff
constexpr double kU64 = 0x1p-53;

using gpu_test::CudaStreamTest;
using gpu_test::DeviceBuffer;
using gpu_test::Download;
using gpu_test::Upload;

// Host mode runs the kernels on the block emulator, whose persistent grids are 16 blocks of 256
// threads (two multiprocessors, host_cuda_backend.h): a few hundred rows or blocks already make
// every block loop. It takes the sizes only a GPU runs quickly down to such counts.
#ifdef FP8RT_GPU_TEST_HOST
constexpr int64_t kManyRows = 700;         // RMSNorm and LayerNorm: one block per row
constexpr int64_t kManyElements = 300007;  // element-wise ops and AdamW (its FP8 shard)
#else
constexpr int64_t kManyRows = 5000;
constexpr int64_t kManyElements = 3000001;
#endif

uint32_t Bits(float x) { return std::bit_cast<uint32_t>(x); }
float FromBits(uint32_t b) { return std::bit_cast<float>(b); }

// --- comparisons ---------------------------------------------------------------------------------

// Every bit, NaN payloads included (pure data movement).
void ExpectBitsEqual(const std::vector<float>& gpu, const std::vector<float>& cpu,
                     const std::string& what) {
  ASSERT_EQ(gpu.size(), cpu.size()) << what;
  int64_t bad = 0;
  std::string first;
  for (size_t i = 0; i < gpu.size(); ++i) {
    if (Bits(gpu[i]) != Bits(cpu[i]) && bad++ == 0) {
      first = absl::StrCat("first at ", i, ": gpu ", gpu[i], " (bits ", Bits(gpu[i]), "), cpu ",
                           cpu[i], " (bits ", Bits(cpu[i]), ")");
    }
  }
  EXPECT_EQ(bad, 0) << what << ": " << bad << " of " << gpu.size() << " differ; " << first;
}

// Every bit, except that any NaN equals any NaN (arithmetic results).
void ExpectSameValues(const std::vector<float>& gpu, const std::vector<float>& cpu,
                      const std::string& what) {
  ASSERT_EQ(gpu.size(), cpu.size()) << what;
  int64_t bad = 0;
  std::string first;
  for (size_t i = 0; i < gpu.size(); ++i) {
    const bool same = Bits(gpu[i]) == Bits(cpu[i]) || (std::isnan(gpu[i]) && std::isnan(cpu[i]));
    if (!same && bad++ == 0) {
      first = absl::StrCat("first at ", i, ": gpu ", gpu[i], " (bits ", Bits(gpu[i]), "), cpu ",
                           cpu[i], " (bits ", Bits(cpu[i]), ")");
    }
  }
  EXPECT_EQ(bad, 0) << what << ": " << bad << " of " << gpu.size() << " differ; " << first;
}

// |gpu - cpu| <= tol[i] for finite values; Inf and NaN must be the same on both sides.
void ExpectWithin(const std::vector<float>& gpu, const std::vector<float>& cpu,
                  const std::vector<double>& tol, const std::string& what) {
  ASSERT_EQ(gpu.size(), cpu.size()) << what;
  int64_t bad = 0;
  std::string first;
  for (size_t i = 0; i < gpu.size(); ++i) {
    // Non-finite values must match exactly (any NaN matching any NaN).
    const bool finite = std::isfinite(gpu[i]) && std::isfinite(cpu[i]);
    const bool ok = finite ? std::abs(static_cast<double>(gpu[i]) - cpu[i]) <= tol[i]
                           : gpu[i] == cpu[i] || (std::isnan(gpu[i]) && std::isnan(cpu[i]));
    if (!ok && bad++ == 0) {
      first = absl::StrCat("first at ", i, ": gpu ", gpu[i], ", cpu ", cpu[i], ", |diff| ",
                           std::abs(static_cast<double>(gpu[i]) - cpu[i]), " > tol ", tol[i]);
    }
  }
  EXPECT_EQ(bad, 0) << what << ": " << bad << " of " << gpu.size() << " out of bounds; " << first;
}

// --- data ----------------------------------------------------------------------------------------

std::vector<float> Normal(int64_t n, uint32_t seed, float scale) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> normal(0.0f, scale);
  std::vector<float> x(static_cast<size_t>(n));
  for (float& v : x) v = normal(rng);
  return x;
}

// Any 32-bit pattern: every class of float, NaNs with payloads.
std::vector<float> RandomBits(int64_t n, uint32_t seed) {
  std::mt19937 rng(seed);
  std::vector<float> x(static_cast<size_t>(n));
  for (float& v : x) v = FromBits(rng());
  return x;
}

// Mostly normal values, one in `special_every` a special (signed zero, denormal, huge, Inf, NaN).
std::vector<float> WithSpecials(std::vector<float> x, uint32_t seed, int special_every) {
  const float specials[] = {0.0f,
                            -0.0f,
                            std::numeric_limits<float>::denorm_min(),
                            -FromBits(0x00345678u),
                            3e38f,
                            -3e38f,
                            std::numeric_limits<float>::infinity(),
                            -std::numeric_limits<float>::infinity(),
                            std::numeric_limits<float>::quiet_NaN()};
  std::mt19937 rng(seed);
  for (float& v : x) {
    if (static_cast<int>(rng() % static_cast<uint32_t>(special_every)) == 0) {
      v = specials[rng() % std::size(specials)];
    }
  }
  return x;
}

std::vector<int32_t> Tokens(int64_t n, int64_t v, uint32_t seed) {
  std::mt19937 rng(seed);
  std::vector<int32_t> t(static_cast<size_t>(n));
  for (int32_t& x : t) x = static_cast<int32_t>(rng() % static_cast<uint32_t>(v));
  return t;
}

// --- fixture -------------------------------------------------------------------------------------

// Skips without a usable device, with the reason (fails instead under FP8RT_REQUIRE_GPU=1); runs
// the ops on a stream of its own.
class LayerOpsCudaTest : public CudaStreamTest {
 protected:
  void SetUp() override {
    CudaStreamTest::SetUp();
    if (Stopped()) return;
    gpu_ = cuda_ops_->layer;
  }
  // Waits through the table's synchronize entry (not CudaStreamTest's cudaStreamSynchronize: the
  // entry is under test too) and fails on any CUDA error (sticky included).
  void Sync() {
    const absl::Status s = gpu_->synchronize(stream());
    ASSERT_TRUE(s.ok()) << s;
    ASSERT_EQ(gpu_test::LastError(), cudaSuccess);
  }
  void ExpectOk(const absl::Status& s) { EXPECT_TRUE(s.ok()) << s; }

  const LayerOps& cpu_ = *CpuOps().layer;
  const LayerOps* gpu_ = nullptr;
};

// --- embedding -----------------------------------------------------------------------------------

struct EmbeddingShape {
  int64_t n, v, c;
};

class EmbeddingTest : public LayerOpsCudaTest,
                      public ::testing::WithParamInterface<EmbeddingShape> {};

TEST_P(EmbeddingTest, ForwardAndBackwardAreBitForBit) {
  const auto [n, v, c] = GetParam();
  const std::vector<int32_t> tokens = Tokens(n, v, 1);
  const std::vector<float> table = Normal(v * c, 2, 1.0f);
  const std::vector<float> dout = Normal(n * c, 3, 1.0f);
  const std::vector<float> dtable0 = Normal(v * c, 4, 0.1f);  // accumulated onto

  std::vector<float> out(static_cast<size_t>(n * c)), dtable = dtable0;
  ExpectOk(cpu_.embedding_forward(out.data(), tokens.data(), table.data(), n, v, c, {}));
  ExpectOk(cpu_.embedding_backward(dtable.data(), dout.data(), tokens.data(), n, v, c, {}));

  auto d_tokens = Upload(tokens);
  auto d_table = Upload(table);
  auto d_dout = Upload(dout);
  auto d_dtable = Upload(dtable0);
  DeviceBuffer d_out(out.size() * sizeof(float));
  ExpectOk(
      gpu_->embedding_forward(d_out.f(), d_tokens.as<int32_t>(), d_table.f(), n, v, c, stream()));
  ExpectOk(gpu_->embedding_backward(d_dtable.f(), d_dout.f(), d_tokens.as<int32_t>(), n, v, c,
                                    stream()));
  Sync();
  ExpectBitsEqual(Download<float>(d_out, out.size()), out, "forward out");
  // Same bits as the CPU's row-order scatter-add: the order of every element's additions is n.
  ExpectBitsEqual(Download<float>(d_dtable, dtable.size()), dtable, "backward dtable");
}

// Few distinct tokens make long runs of repeats (the order of additions matters); V > n leaves
// rows of the table untouched (they must keep the pre-filled values).
// A micro-batch of 70001 tokens over a GPT-2-sized vocabulary (mostly runs of one to a few), and
// 20000 tokens over 5 ids (runs of ~4000 rows, each row four column tiles, the last partial).
INSTANTIATE_TEST_SUITE_P(
    Shapes, EmbeddingTest,
    ::testing::Values(EmbeddingShape{1, 1, 1}, EmbeddingShape{5, 2, 3}, EmbeddingShape{37, 11, 257},
                      EmbeddingShape{300, 50, 768}, EmbeddingShape{2049, 7, 65},
                      EmbeddingShape{4000, 3001, 129}, EmbeddingShape{3000, 1, 300},
                      EmbeddingShape{70001, 50257, 33}, EmbeddingShape{20000, 5, 1000}));

// Token ids outside [0, V) are the caller's bug (the CPU reference aborts on them); the CUDA
// entries must still stay inside the buffers: forward writes a NaN row, backward leaves them out
// and adds every other row as the CPU does (compared with the CPU run on the valid rows alone).
class EmbeddingTokensTest : public LayerOpsCudaTest {};

TEST_F(EmbeddingTokensTest, OutOfRangeIdsGiveNanRowsAndAreLeftOutOfTheGradient) {
  constexpr int64_t kN = 5003, kV = 37, kC = 300;
  std::vector<int32_t> tokens = Tokens(kN, kV, 21);
  const int32_t bad_ids[] = {-1, static_cast<int32_t>(kV), -static_cast<int32_t>(kV),
                             std::numeric_limits<int32_t>::max(),
                             std::numeric_limits<int32_t>::min()};
  for (size_t i = 0; i < tokens.size(); i += 7) tokens[i] = bad_ids[(i / 7) % std::size(bad_ids)];
  const std::vector<float> table = Normal(kV * kC, 22, 1.0f);
  const std::vector<float> dout = Normal(kN * kC, 23, 1.0f);
  const std::vector<float> dtable0 = Normal(kV * kC, 24, 0.1f);

  std::vector<float> out(static_cast<size_t>(kN * kC));
  std::vector<int32_t> valid_tokens;
  std::vector<float> valid_dout;
  for (int64_t i = 0; i < kN; ++i) {
    const int32_t tok = tokens[static_cast<size_t>(i)];
    const auto row = dout.begin() + i * kC;
    if (tok >= 0 && tok < kV) {
      valid_tokens.push_back(tok);
      valid_dout.insert(valid_dout.end(), row, row + kC);
      std::copy_n(table.begin() + tok * kC, kC, out.begin() + i * kC);
    } else {
      std::fill_n(out.begin() + i * kC, kC, FromBits(0x7FC00000u));
    }
  }
  std::vector<float> dtable = dtable0;
  ExpectOk(cpu_.embedding_backward(dtable.data(), valid_dout.data(), valid_tokens.data(),
                                   static_cast<int64_t>(valid_tokens.size()), kV, kC, {}));

  auto d_tokens = Upload(tokens);
  auto d_table = Upload(table);
  auto d_dout = Upload(dout);
  auto d_dtable = Upload(dtable0);
  DeviceBuffer d_out(out.size() * sizeof(float));
  ExpectOk(gpu_->embedding_forward(d_out.f(), d_tokens.as<int32_t>(), d_table.f(), kN, kV, kC,
                                   stream()));
  ExpectOk(gpu_->embedding_backward(d_dtable.f(), d_dout.f(), d_tokens.as<int32_t>(), kN, kV, kC,
                                    stream()));
  Sync();
  ExpectBitsEqual(Download<float>(d_out, out.size()), out, "forward out");
  ExpectBitsEqual(Download<float>(d_dtable, dtable.size()), dtable, "backward dtable");
}

// --- RMSNorm -------------------------------------------------------------------------------------

struct RowShape {
  int64_t n, c;
};

class RmsNormTest : public LayerOpsCudaTest, public ::testing::WithParamInterface<RowShape> {};

TEST_P(RmsNormTest, WithinTheSumOrderBounds) {
  const auto [n, c] = GetParam();
  constexpr float kEps = 1e-5f;
  const size_t nc = static_cast<size_t>(n * c);
  const std::vector<float> x = Normal(n * c, 11, 2.0f);
  const std::vector<float> w = Normal(c, 12, 1.0f);
  const std::vector<float> dout = Normal(n * c, 13, 1.0f);
  const std::vector<float> dx0 = Normal(n * c, 14, 0.5f);
  const std::vector<float> dw0 = Normal(c, 15, 0.5f);

  std::vector<float> out(nc), rstd(static_cast<size_t>(n)), dx = dx0, dw = dw0;
  ExpectOk(cpu_.rmsnorm_forward(out.data(), rstd.data(), x.data(), w.data(), n, c, kEps, {}));
  ExpectOk(cpu_.rmsnorm_backward(dx.data(), dw.data(), dout.data(), x.data(), w.data(), rstd.data(),
                                 n, c, {}));

  auto d_x = Upload(x);
  auto d_w = Upload(w);
  auto d_dout = Upload(dout);
  auto d_rstd_cpu = Upload(rstd);  // the backward of both sides runs on the same rstd
  DeviceBuffer d_out(nc * sizeof(float)), d_rstd(rstd.size() * sizeof(float));
  ExpectOk(gpu_->rmsnorm_forward(d_out.f(), d_rstd.f(), d_x.f(), d_w.f(), n, c, kEps, stream()));
  std::vector<float> gpu_dx[2], gpu_dw[2];
  for (int run = 0; run < 2; ++run) {
    auto d_dx = Upload(dx0);
    auto d_dw = Upload(dw0);
    ExpectOk(gpu_->rmsnorm_backward(d_dx.f(), d_dw.f(), d_dout.f(), d_x.f(), d_w.f(),
                                    d_rstd_cpu.f(), n, c, stream()));
    Sync();
    gpu_dx[run] = Download<float>(d_dx, nc);
    gpu_dw[run] = Download<float>(d_dw, dw.size());
  }
  // A fixed order of additions: reruns are identical.
  ExpectBitsEqual(gpu_dx[1], gpu_dx[0], "dx rerun");
  ExpectBitsEqual(gpu_dw[1], gpu_dw[0], "dweight rerun");

  // Forward bounds (header).
  const double d = 1.01 * static_cast<double>(c + (c + 255) / 256 + 8) * kU;
  std::vector<double> tol_rstd(rstd.size()), tol_out(nc);
  for (int64_t r = 0; r < n; ++r) {
    tol_rstd[r] = (d / 2 + 6 * kU) * rstd[r];
    for (int64_t j = 0; j < c; ++j) {
      const double mag = std::abs(static_cast<double>(x[r * c + j]) * w[j] * rstd[r]);
      tol_out[r * c + j] = (d / 2 + 8 * kU) * mag + 0x1p-148;
    }
  }
  ExpectWithin(Download<float>(d_rstd, rstd.size()), rstd, tol_rstd, "forward rstd");
  ExpectWithin(Download<float>(d_out, nc), out, tol_out, "forward out");

  // Backward bounds (header).
  std::vector<double> tol_dx(nc), tol_dw(dw.size());
  std::vector<double> dw_mag(dw.size());
  for (size_t j = 0; j < dw.size(); ++j) dw_mag[j] = std::abs(static_cast<double>(dw0[j]));
  for (int64_t r = 0; r < n; ++r) {
    const double rs = rstd[r];
    double g_abs = 0.0, gx = 0.0;
    for (int64_t j = 0; j < c; ++j) {
      const double t = static_cast<double>(dout[r * c + j]) * w[j] * x[r * c + j];
      g_abs += std::abs(t);
      gx += t;
      dw_mag[j] += std::abs(static_cast<double>(dout[r * c + j]) * x[r * c + j] * rs);
    }
    const double dgx = d * g_abs;
    const double coef = rs * rs * rs * gx / static_cast<double>(c);
    for (int64_t j = 0; j < c; ++j) {
      const size_t i = static_cast<size_t>(r * c + j);
      const double terms = std::abs(static_cast<double>(dx0[i])) + std::abs(rs * dout[i] * w[j]) +
                           std::abs(coef * x[i]);
      tol_dx[i] =
          rs * rs * rs * std::abs(static_cast<double>(x[i])) * dgx / c + 4 * kU * terms + 0x1p-148;
    }
  }
  for (size_t j = 0; j < dw.size(); ++j) {
    tol_dw[j] = 1.01 * static_cast<double>(n + (n + 31) / 32 + 33) * kU * dw_mag[j] + 0x1p-148;
  }
  ExpectWithin(gpu_dx[0], dx, tol_dx, "backward dx");
  ExpectWithin(gpu_dw[0], dw, tol_dw, "backward dweight");
}

INSTANTIATE_TEST_SUITE_P(Shapes, RmsNormTest,
                         ::testing::Values(RowShape{1, 1}, RowShape{3, 7}, RowShape{37, 255},
                                           RowShape{64, 256}, RowShape{129, 257},
                                           RowShape{1000, 768}, RowShape{7, 4099},
                                           RowShape{kManyRows, 33}));

// --- LayerNorm -----------------------------------------------------------------------------------

class LayerNormTest : public LayerOpsCudaTest, public ::testing::WithParamInterface<RowShape> {};

TEST_P(LayerNormTest, WithinTheSumOrderBounds) {
  const auto [n, c] = GetParam();
  constexpr float kEps = 1e-5f;
  constexpr double kTinyAbs = 0x1p-120;
  const size_t nc = static_cast<size_t>(n * c);
  // An offset of 1.5: the mean matters.
  std::vector<float> x = Normal(n * c, 111, 2.0f);
  for (float& e : x) e += 1.5f;
  const std::vector<float> w = Normal(c, 112, 1.0f);
  const std::vector<float> b = Normal(c, 113, 0.5f);
  const std::vector<float> dout = Normal(n * c, 114, 1.0f);
  const std::vector<float> dx0 = Normal(n * c, 115, 0.5f);
  const std::vector<float> dw0 = Normal(c, 116, 0.5f);
  const std::vector<float> db0 = Normal(c, 117, 0.5f);

  std::vector<float> out(nc), mean(static_cast<size_t>(n)), rstd(static_cast<size_t>(n));
  std::vector<float> dx = dx0, dw = dw0, db = db0;
  ExpectOk(cpu_.layernorm_forward(out.data(), mean.data(), rstd.data(), x.data(), w.data(),
                                  b.data(), n, c, kEps, {}));
  ExpectOk(cpu_.layernorm_backward(dx.data(), dw.data(), db.data(), dout.data(), x.data(), w.data(),
                                   mean.data(), rstd.data(), n, c, {}));

  auto d_x = Upload(x);
  auto d_w = Upload(w);
  auto d_b = Upload(b);
  auto d_dout = Upload(dout);
  auto d_mean_cpu = Upload(mean);  // the backward of both sides runs on the same mean and rstd
  auto d_rstd_cpu = Upload(rstd);
  DeviceBuffer d_out(nc * sizeof(float)), d_mean(mean.size() * sizeof(float)),
      d_rstd(rstd.size() * sizeof(float));
  ExpectOk(gpu_->layernorm_forward(d_out.f(), d_mean.f(), d_rstd.f(), d_x.f(), d_w.f(), d_b.f(), n,
                                   c, kEps, stream()));
  std::vector<float> gpu_dx[2], gpu_dw[2], gpu_db[2];
  for (int run = 0; run < 2; ++run) {
    auto d_dx = Upload(dx0);
    auto d_dw = Upload(dw0);
    auto d_db = Upload(db0);
    ExpectOk(gpu_->layernorm_backward(d_dx.f(), d_dw.f(), d_db.f(), d_dout.f(), d_x.f(), d_w.f(),
                                      d_mean_cpu.f(), d_rstd_cpu.f(), n, c, stream()));
    Sync();
    gpu_dx[run] = Download<float>(d_dx, nc);
    gpu_dw[run] = Download<float>(d_dw, dw.size());
    gpu_db[run] = Download<float>(d_db, db.size());
  }
  ExpectBitsEqual(gpu_dx[1], gpu_dx[0], "dx rerun");
  ExpectBitsEqual(gpu_dw[1], gpu_dw[0], "dweight rerun");
  ExpectBitsEqual(gpu_db[1], gpu_db[0], "dbias rerun");

  // Forward bounds (header), from the CPU's mean and rstd, doubled.
  const double d = 1.01 * static_cast<double>(c + (c + 255) / 256 + 8) * kU;
  std::vector<double> tol_mean(mean.size()), tol_rstd(rstd.size()), tol_out(nc);
  std::vector<double> tol_dx(nc);
  std::vector<double> dw_mag(dw.size()), db_mag(db.size());
  for (size_t j = 0; j < dw.size(); ++j) {
    dw_mag[j] = std::abs(static_cast<double>(dw0[j]));
    db_mag[j] = std::abs(static_cast<double>(db0[j]));
  }
  for (int64_t r = 0; r < n; ++r) {
    const double m = mean[r], rs = rstd[r];
    double s1 = 0.0, q = 0.0, q_err = 0.0;
    for (int64_t j = 0; j < c; ++j) s1 += std::abs(static_cast<double>(x[r * c + j]));
    const double dm = d * s1 / c + 2 * kU * std::abs(m);
    for (int64_t j = 0; j < c; ++j) {
      const double dev = x[r * c + j] - m;
      q += dev * dev;
      q_err += 2 * std::abs(dev) * dm + 6 * kU * dev * dev;
    }
    const double var = q / c;
    const double dvar = (q_err + d * q) / c + 2 * kU * var + 2 * kU * (var + kEps);
    const double rel_r = 0.5 * dvar / (var + kEps) + 4 * kU;
    tol_mean[r] = 2 * dm + kTinyAbs;
    tol_rstd[r] = 2 * rel_r * rs + kTinyAbs;
    // Backward: the row sums of g = dout w and g xhat.
    double g_abs = 0.0, gx_abs = 0.0, g_sum = 0.0, gx_sum = 0.0;
    for (int64_t j = 0; j < c; ++j) {
      const size_t i = static_cast<size_t>(r * c + j);
      const double dev = x[i] - m;
      const double ddev = dm + 2 * kU * std::abs(dev);
      const double mag = std::abs(dev * rs * w[j]);
      tol_out[i] = 2 * (std::abs(static_cast<double>(w[j])) *
                            (std::abs(dev) * rel_r * rs + rs * ddev + 2 * kU * std::abs(dev) * rs) +
                        2 * kU * mag + 2 * kU * (mag + std::abs(static_cast<double>(b[j])))) +
                   kTinyAbs;
      const double xhat = dev * rs, g = static_cast<double>(dout[i]) * w[j];
      g_abs += std::abs(g);
      gx_abs += std::abs(g * xhat);
      g_sum += g;
      gx_sum += g * xhat;
      dw_mag[j] += std::abs(dout[i] * xhat);
      db_mag[j] += std::abs(static_cast<double>(dout[i]));
    }
    const double g_mean = g_sum / c, gx_mean = gx_sum / c;
    const double dg_mean = d * g_abs / c + 2 * kU * std::abs(g_mean);
    const double dgx_mean = d * gx_abs / c + 2 * kU * std::abs(gx_mean);
    for (int64_t j = 0; j < c; ++j) {
      const size_t i = static_cast<size_t>(r * c + j);
      const double xhat = (x[i] - m) * rs, g = static_cast<double>(dout[i]) * w[j];
      const double t1 = g - g_mean, t2 = xhat * gx_mean, t3 = t1 - t2, t4 = t3 * rs;
      const double dt1 = dg_mean + 2 * kU * std::abs(t1);
      const double dt2 = std::abs(xhat) * dgx_mean + 2 * kU * std::abs(t2);
      const double dt3 = dt1 + dt2 + 2 * kU * (std::abs(t1) + std::abs(t2));
      const double dt4 = rs * dt3 + 2 * kU * std::abs(t4);
      tol_dx[i] =
          2 * (dt4 + 2 * kU * (std::abs(static_cast<double>(dx0[i])) + std::abs(t4))) + kTinyAbs;
    }
  }
  ExpectWithin(Download<float>(d_mean, mean.size()), mean, tol_mean, "forward mean");
  ExpectWithin(Download<float>(d_rstd, rstd.size()), rstd, tol_rstd, "forward rstd");
  ExpectWithin(Download<float>(d_out, nc), out, tol_out, "forward out");
  std::vector<double> tol_dw(dw.size()), tol_db(db.size());
  const double col = 1.01 * static_cast<double>(n + (n + 31) / 32 + 33) * kU;
  for (size_t j = 0; j < dw.size(); ++j) {
    tol_dw[j] = col * dw_mag[j] + 0x1p-148;
    tol_db[j] = col * db_mag[j] + 0x1p-148;
  }
  ExpectWithin(gpu_dx[0], dx, tol_dx, "backward dx");
  ExpectWithin(gpu_dw[0], dw, tol_dw, "backward dweight");
  ExpectWithin(gpu_db[0], db, tol_db, "backward dbias");
}

INSTANTIATE_TEST_SUITE_P(Shapes, LayerNormTest,
                         ::testing::Values(RowShape{1, 1}, RowShape{3, 7}, RowShape{37, 255},
                                           RowShape{64, 256}, RowShape{129, 257},
                                           RowShape{1000, 768}, RowShape{7, 4099},
                                           RowShape{kManyRows, 33}));

// --- bias ----------------------------------------------------------------------------------------

class BiasTest : public LayerOpsCudaTest, public ::testing::WithParamInterface<RowShape> {};

TEST_P(BiasTest, ForwardIsBitForBitBackwardWithinTheColumnSumBound) {
  const auto [n, c] = GetParam();
  const size_t nc = static_cast<size_t>(n * c);
  const std::vector<float> x = WithSpecials(Normal(n * c, 121, 2.0f), 122, 997);
  const std::vector<float> bias = Normal(c, 123, 1.0f);
  const std::vector<float> dout = Normal(n * c, 124, 1.0f);
  const std::vector<float> db0 = Normal(c, 125, 0.5f);
  std::vector<float> out = x, db = db0;
  ExpectOk(cpu_.bias_forward(out.data(), bias.data(), n, c, {}));
  ExpectOk(cpu_.bias_backward(db.data(), dout.data(), n, c, {}));

  auto d_out = Upload(x);
  auto d_bias = Upload(bias);
  auto d_dout = Upload(dout);
  auto d_db = Upload(db0);
  ExpectOk(gpu_->bias_forward(d_out.f(), d_bias.f(), n, c, stream()));
  ExpectOk(gpu_->bias_backward(d_db.f(), d_dout.f(), n, c, stream()));
  Sync();
  ExpectSameValues(Download<float>(d_out, nc), out, "forward");
  std::vector<double> tol(db.size());
  for (int64_t j = 0; j < c; ++j) {
    double mag = std::abs(static_cast<double>(db0[j]));
    for (int64_t r = 0; r < n; ++r) mag += std::abs(static_cast<double>(dout[r * c + j]));
    tol[j] = 1.01 * static_cast<double>(n + (n + 31) / 32 + 33) * kU * mag + 0x1p-148;
  }
  ExpectWithin(Download<float>(d_db, db.size()), db, tol, "backward dbias");
}

INSTANTIATE_TEST_SUITE_P(Shapes, BiasTest,
                         ::testing::Values(RowShape{1, 1}, RowShape{3, 7}, RowShape{129, 257},
                                           RowShape{1000, 768}, RowShape{8192, 33},
                                           RowShape{2, 3073}));

// --- RoPE ----------------------------------------------------------------------------------------

struct RopeShape {
  int64_t n, t, h, dh;
};
void PrintTo(const RopeShape& s, std::ostream* os) {
  *os << s.n << "x" << s.h << "x" << s.dh << " t " << s.t;
}

class RopeTest : public LayerOpsCudaTest, public ::testing::WithParamInterface<RopeShape> {};

TEST_P(RopeTest, WithinTheCosSinBound) {
  const auto [n, t, h, dh] = GetParam();
  constexpr float kTheta = 10000.0f;
  const size_t sz = static_cast<size_t>(n * h * dh);
  const std::vector<float> x = Normal(n * h * dh, 131, 1.0f);
  const std::vector<float> dout = Normal(n * h * dh, 132, 1.0f);
  const std::vector<float> dx0 = Normal(n * h * dh, 133, 0.5f);
  std::vector<float> out(sz), dx = dx0;
  ExpectOk(cpu_.rope_forward(out.data(), x.data(), n, t, h, dh, kTheta, {}));
  ExpectOk(cpu_.rope_backward(dx.data(), dout.data(), n, t, h, dh, kTheta, {}));

  auto d_x = Upload(x);
  auto d_in_place = Upload(x);
  auto d_dout = Upload(dout);
  auto d_dx = Upload(dx0);
  DeviceBuffer d_out(sz * sizeof(float));
  ExpectOk(gpu_->rope_forward(d_out.f(), d_x.f(), n, t, h, dh, kTheta, stream()));
  ExpectOk(gpu_->rope_forward(d_in_place.f(), d_in_place.f(), n, t, h, dh, kTheta, stream()));
  ExpectOk(gpu_->rope_backward(d_dx.f(), d_dout.f(), n, t, h, dh, kTheta, stream()));
  Sync();
  const std::vector<float> g_out = Download<float>(d_out, sz);
  ExpectBitsEqual(Download<float>(d_in_place, sz), g_out, "in place vs out of place");

  std::vector<double> tol_out(sz), tol_dx(sz);
  const int64_t half = dh / 2;
  for (int64_t r = 0; r < n; ++r) {
    for (int64_t hh = 0; hh < h; ++hh) {
      for (int64_t i = 0; i < half; ++i) {
        const size_t a = static_cast<size_t>((r * h + hh) * dh + i), b = a + half;
        const double fx = std::abs(static_cast<double>(x[a])) + std::abs(x[b]);
        const double fd = std::abs(static_cast<double>(dout[a])) + std::abs(dout[b]);
        tol_out[a] = tol_out[b] = 10 * kU * fx + 0x1p-140;
        tol_dx[a] = 10 * kU * fd + 2 * kU * (std::abs(static_cast<double>(dx0[a])) + fd) + 0x1p-140;
        tol_dx[b] = 10 * kU * fd + 2 * kU * (std::abs(static_cast<double>(dx0[b])) + fd) + 0x1p-140;
      }
    }
  }
  ExpectWithin(g_out, out, tol_out, "forward");
  ExpectWithin(Download<float>(d_dx, sz), dx, tol_dx, "backward");
}

INSTANTIATE_TEST_SUITE_P(Shapes, RopeTest,
                         ::testing::Values(RopeShape{1, 1, 1, 2}, RopeShape{7, 3, 2, 8},
                                           RopeShape{1000, 250, 3, 6}, RopeShape{4096, 4096, 4, 64},
                                           RopeShape{8192, 2048, 8, 128},
                                           RopeShape{513, 513, 12, 130}));

// --- element-wise --------------------------------------------------------------------------------

class SizeTest : public LayerOpsCudaTest, public ::testing::WithParamInterface<int64_t> {};

using GeluTest = SizeTest;

TEST_P(GeluTest, WithinTheTanhBounds) {
  const int64_t n = GetParam();
  const size_t sz = static_cast<size_t>(n);
  // N(0, 3) covers both tails of tanh; a few specials (NaN, Inf, huge, denormals) ride along.
  const std::vector<float> x = WithSpecials(Normal(n, 21, 3.0f), 22, 997);
  const std::vector<float> dout = Normal(n, 23, 1.0f);
  const std::vector<float> dx0 = Normal(n, 24, 1.0f);
  std::vector<float> out(sz), dx = dx0;
  ExpectOk(cpu_.gelu_forward(out.data(), x.data(), n, {}));
  ExpectOk(cpu_.gelu_backward(dx.data(), dout.data(), x.data(), n, {}));

  auto d_x = Upload(x);
  auto d_dout = Upload(dout);
  auto d_dx = Upload(dx0);
  DeviceBuffer d_out(sz * sizeof(float));
  ExpectOk(gpu_->gelu_forward(d_out.f(), d_x.f(), n, stream()));
  ExpectOk(gpu_->gelu_backward(d_dx.f(), d_dout.f(), d_x.f(), n, stream()));
  Sync();

  const double scale = std::sqrt(2.0 / 3.14159265358979323846);
  std::vector<double> tol_out(sz), tol_dx(sz);
  for (size_t i = 0; i < sz; ++i) {
    const double xi = x[i];
    const double th = std::tanh(scale * (xi + 0.044715 * xi * xi * xi));
    const double du = scale * (1.0 + 3.0 * 0.044715 * xi * xi);
    const double dth = 0x1p-20 * std::abs(th) + 0x1p-146;
    tol_out[i] =
        0.5 * std::abs(xi) * dth + 0x1p-22 * 0.5 * std::abs(xi) * (1 + std::abs(th)) + 0x1p-148;
    const double a = 0.5 * (1 + std::abs(th));
    const double b = 0.5 * std::abs(xi) * (1 + th * th) * std::abs(du);
    const double dgrad = 0.5 * dth + std::abs(xi * th * du) * dth + 4 * kU * (a + b);
    tol_dx[i] = std::abs(static_cast<double>(dout[i])) * dgrad +
                2 * kU * (std::abs(static_cast<double>(dx0[i])) + std::abs(dout[i]) * (a + b)) +
                0x1p-148;
  }
  ExpectWithin(Download<float>(d_out, sz), out, tol_out, "gelu forward");
  ExpectWithin(Download<float>(d_dx, sz), dx, tol_dx, "gelu backward");
}

// --- SwiGLU --------------------------------------------------------------------------------------

using SwigluTest = SizeTest;

TEST_P(SwigluTest, WithinTheExpBounds) {
  const int64_t n = GetParam();
  const size_t sz = static_cast<size_t>(n);
  const std::vector<float> gate = WithSpecials(Normal(n, 141, 4.0f), 142, 997);
  const std::vector<float> up = Normal(n, 143, 1.0f);
  const std::vector<float> dout = Normal(n, 144, 1.0f);
  const std::vector<float> dg0 = Normal(n, 145, 0.5f);
  const std::vector<float> du0 = Normal(n, 146, 0.5f);
  std::vector<float> out(sz), dg = dg0, du = du0;
  ExpectOk(cpu_.swiglu_forward(out.data(), gate.data(), up.data(), n, {}));
  ExpectOk(cpu_.swiglu_backward(dg.data(), du.data(), dout.data(), gate.data(), up.data(), n, {}));

  auto d_gate = Upload(gate);
  auto d_up = Upload(up);
  auto d_dout = Upload(dout);
  auto d_dg = Upload(dg0);
  auto d_du = Upload(du0);
  DeviceBuffer d_out(sz * sizeof(float));
  ExpectOk(gpu_->swiglu_forward(d_out.f(), d_gate.f(), d_up.f(), n, stream()));
  ExpectOk(
      gpu_->swiglu_backward(d_dg.f(), d_du.f(), d_dout.f(), d_gate.f(), d_up.f(), n, stream()));
  Sync();

  constexpr double kTinyAbs = 0x1p-120;
  std::vector<double> tol_out(sz), tol_dg(sz), tol_du(sz);
  for (size_t i = 0; i < sz; ++i) {
    const double g = gate[i], u = up[i], dy = dout[i];
    const double s = 1.0 / (1.0 + std::exp(-g));
    const double ds = 10 * kU * s;
    const double gs = g * s;
    tol_out[i] = 2 * 14 * kU * std::abs(gs * u) + kTinyAbs;
    const double t1 = 1.0 - s, t2 = g * t1, t3 = 1.0 + t2, dsilu = s * t3;
    const double dt1 = ds + 2 * kU * std::abs(t1);
    const double dt2 = std::abs(g) * dt1 + 2 * kU * std::abs(t2);
    const double dt3 = dt2 + 2 * kU * std::abs(t3);
    const double ddsilu = ds * std::abs(t3) + s * dt3 + 2 * kU * std::abs(dsilu);
    const double a = std::abs(dy * u);
    const double term_g = a * std::abs(dsilu);
    tol_dg[i] = 2 * (a * ddsilu + 2 * kU * term_g +
                     2 * kU * (std::abs(static_cast<double>(dg0[i])) + term_g)) +
                kTinyAbs;
    const double dgs = std::abs(gs) * (10 * kU + 2 * kU);
    const double term_u = std::abs(dy * gs);
    tol_du[i] = 2 * (std::abs(dy) * dgs + 2 * kU * term_u +
                     2 * kU * (std::abs(static_cast<double>(du0[i])) + term_u)) +
                kTinyAbs;
  }
  ExpectWithin(Download<float>(d_out, sz), out, tol_out, "swiglu forward");
  ExpectWithin(Download<float>(d_dg, sz), dg, tol_dg, "swiglu backward dgate");
  ExpectWithin(Download<float>(d_du, sz), du, tol_du, "swiglu backward dup");
}

INSTANTIATE_TEST_SUITE_P(Sizes, SwigluTest,
                         ::testing::Values(1, 7, 255, 256, 257, 100003, kManyElements));

using ElementwiseTest = SizeTest;

TEST_P(ElementwiseTest, ResidualIsBitForBitAlsoInPlace) {
  const int64_t n = GetParam();
  const size_t sz = static_cast<size_t>(n);
  const std::vector<float> a = WithSpecials(Normal(n, 31, 2.0f), 32, 101);
  const std::vector<float> b = WithSpecials(Normal(n, 33, 2.0f), 34, 103);
  const std::vector<float> dout = WithSpecials(Normal(n, 35, 1.0f), 36, 107);
  std::vector<float> out(sz), da = a, db = b;  // the backward accumulates onto a and b's values
  ExpectOk(cpu_.residual_forward(out.data(), a.data(), b.data(), n, {}));
  ExpectOk(cpu_.residual_backward(da.data(), db.data(), dout.data(), n, {}));

  auto d_a = Upload(a);
  auto d_b = Upload(b);
  auto d_dout = Upload(dout);
  DeviceBuffer d_out(sz * sizeof(float));
  ExpectOk(gpu_->residual_forward(d_out.f(), d_a.f(), d_b.f(), n, stream()));
  Sync();
  ExpectSameValues(Download<float>(d_out, sz), out, "forward");
  // In place: out = a, then (on fresh copies) out = b.
  auto d_a2 = Upload(a);
  auto d_b2 = Upload(b);
  ExpectOk(gpu_->residual_forward(d_a2.f(), d_a2.f(), d_b.f(), n, stream()));
  ExpectOk(gpu_->residual_forward(d_b2.f(), d_a.f(), d_b2.f(), n, stream()));
  Sync();
  ExpectSameValues(Download<float>(d_a2, sz), out, "forward, out = a");
  ExpectSameValues(Download<float>(d_b2, sz), out, "forward, out = b");

  ExpectOk(gpu_->residual_backward(d_a.f(), d_b.f(), d_dout.f(), n, stream()));
  Sync();
  ExpectSameValues(Download<float>(d_a, sz), da, "backward da");
  ExpectSameValues(Download<float>(d_b, sz), db, "backward db");
}

TEST_P(ElementwiseTest, FillAndCopyKeepEveryBit) {
  const int64_t n = GetParam();
  const size_t sz = static_cast<size_t>(n);
  DeviceBuffer d_x(sz * sizeof(float));
  for (float value : {0.0f, -0.0f, 1.5f, std::numeric_limits<float>::denorm_min(),
                      -std::numeric_limits<float>::infinity(), FromBits(0x7FC12345u)}) {
    ExpectOk(gpu_->fill(d_x.f(), value, n, stream()));
    Sync();
    ExpectBitsEqual(Download<float>(d_x, sz), std::vector<float>(sz, value),
                    absl::StrCat("fill with bits ", Bits(value)));
  }
  const std::vector<float> src = RandomBits(n, 41);
  auto d_src = Upload(src);
  ExpectOk(gpu_->copy(d_x.f(), d_src.f(), n, stream()));
  Sync();
  std::vector<float> cpu_dst(sz);
  ExpectOk(cpu_.copy(cpu_dst.data(), src.data(), n, {}));
  ExpectBitsEqual(Download<float>(d_x, sz), cpu_dst, "copy");
}

TEST_P(ElementwiseTest, AdamWIsBitForBit) {
  const int64_t n = GetParam();
  const size_t sz = static_cast<size_t>(n);
  const std::vector<float> master = WithSpecials(Normal(n, 51, 0.05f), 52, 1009);
  const std::vector<float> grad = WithSpecials(Normal(n, 53, 1e-3f), 54, 211);
  const std::vector<float> m = Normal(n, 55, 1e-3f);
  std::vector<float> v = Normal(n, 56, 1e-3f);
  for (float& x : v) x = x * x;
  // Step 10 of lr 3e-4, weight decay 0.1, betas (0.9, 0.95), clipped by 0.7; the scalars as the
  // optimizer computes them (FP64 on the host, rounded once).
  AdamWArgs k;
  k.count = n;
  k.lr = 3e-4f;
  k.decay = static_cast<float>(3e-4 * 0.1);
  k.clip_scale = 0.7f;
  k.beta1 = 0.9f;
  k.one_minus_beta1 = static_cast<float>(1.0 - 0.9);
  k.beta2 = 0.95f;
  k.one_minus_beta2 = static_cast<float>(1.0 - 0.95);
  k.bias1 = static_cast<float>(1.0 - std::pow(0.9, 10));
  k.bias2 = static_cast<float>(1.0 - std::pow(0.95, 10));
  k.eps = 1e-8f;

  std::vector<float> c_master = master, c_m = m, c_v = v;
  AdamWArgs ck = k;
  ck.master = c_master.data();
  ck.grad = grad.data();
  ck.m = c_m.data();
  ck.v = c_v.data();
  ExpectOk(cpu_.adamw(ck, {}));

  auto d_master = Upload(master);
  auto d_grad = Upload(grad);
  auto d_m = Upload(m);
  auto d_v = Upload(v);
  AdamWArgs gk = k;
  gk.master = d_master.f();
  gk.grad = d_grad.f();
  gk.m = d_m.f();
  gk.v = d_v.f();
  ExpectOk(gpu_->adamw(gk, stream()));
  Sync();
  ExpectSameValues(Download<float>(d_master, sz), c_master, "master");
  ExpectSameValues(Download<float>(d_m, sz), c_m, "m");
  ExpectSameValues(Download<float>(d_v, sz), c_v, "v");
  ExpectBitsEqual(Download<float>(d_grad, sz), grad, "grad (read only)");

  // With the FP8 shard written in the same step: E4M3 at a tensor scale where the tails saturate
  // and underflow, and 128x128 block scaling (the shard as rows x cols, a partial last strip
  // where the size allows): the codes, the scale_inv values and the statistics match the CPU's
  // exactly.
  for (const bool block : {false, true}) {
    SCOPED_TRACE(block ? "block scaling" : "tensor scaling");
    kernels::AdamWFp8Output out{
        .format = kernels::Fp8Format::kE4M3, .block = block, .scale = 4096.0f};
    if (block) {
      out.rows = sz % 200 == 0 ? 200 : 1;
      out.cols = static_cast<int64_t>(sz) / out.rows;
      out.margin = 1;
    }
    const size_t n_scales =
        block ? static_cast<size_t>(
                    kernels::GetScaleGrid(kernels::Granularity::kBlock128x128, out.rows, out.cols)
                        .size())
              : 1;
    std::vector<float> f_master = master, f_m = m, f_v = v;
    std::vector<uint8_t> c_codes(sz, 0);
    std::vector<float> c_scale_inv(n_scales, 0.0f);
    kernels::QuantStats c_stats;
    AdamWArgs fk = ck;
    fk.master = f_master.data();
    fk.m = f_m.data();
    fk.v = f_v.data();
    fk.fp8 = out;
    fk.fp8.codes = c_codes.data();
    fk.fp8.scale_inv = c_scale_inv.data();
    fk.fp8.stats = &c_stats;
    ExpectOk(cpu_.adamw(fk, {}));
    auto e_master = Upload(master);
    auto e_m = Upload(m);
    auto e_v = Upload(v);
    auto e_codes = Upload(std::vector<uint8_t>(sz, 0));
    auto e_scale_inv = Upload(std::vector<float>(n_scales, 0.0f));
    auto e_stats = Upload(std::vector<kernels::QuantStats>(1));
    AdamWArgs ek = gk;
    ek.master = e_master.f();
    ek.m = e_m.f();
    ek.v = e_v.f();
    ek.fp8 = out;
    ek.fp8.codes = e_codes.as<uint8_t>();
    ek.fp8.scale_inv = e_scale_inv.f();
    ek.fp8.stats = e_stats.as<kernels::QuantStats>();
    ExpectOk(gpu_->adamw(ek, stream()));
    Sync();
    ExpectSameValues(Download<float>(e_master, sz), f_master, "master (with FP8 shard)");
    EXPECT_EQ(Download<uint8_t>(e_codes, sz), c_codes) << "FP8 shard codes";
    ExpectBitsEqual(Download<float>(e_scale_inv, n_scales), c_scale_inv, "scale_inv");
    const kernels::QuantStats g_stats = Download<kernels::QuantStats>(e_stats, 1)[0];
    EXPECT_EQ(std::bit_cast<uint32_t>(g_stats.amax), std::bit_cast<uint32_t>(c_stats.amax));
    EXPECT_EQ(g_stats.count, c_stats.count);
    EXPECT_EQ(g_stats.underflow, c_stats.underflow);
    EXPECT_EQ(g_stats.subnormal, c_stats.subnormal);
    EXPECT_EQ(g_stats.saturated, c_stats.saturated);
    EXPECT_EQ(g_stats.nonfinite, c_stats.nonfinite);
  }
}

// 1, a warp, a block and its neighbours, more than one wave of the persistent grid.
INSTANTIATE_TEST_SUITE_P(Sizes, GeluTest,
                         ::testing::Values(1, 7, 255, 256, 257, 100003, kManyElements));
INSTANTIATE_TEST_SUITE_P(Sizes, ElementwiseTest,
                         ::testing::Values(1, 7, 255, 256, 257, 100003, kManyElements));

// --- sum of squares ------------------------------------------------------------------------------

// The exact sum of squares (each square exact in double; compensated long double sum).
double ExactSumOfSquares(const std::vector<float>& x) {
  long double sum = 0.0L, comp = 0.0L;
  for (float f : x) {
    const long double t = static_cast<long double>(static_cast<double>(f) * f);
    const long double s = sum + t;
    comp += std::abs(sum) >= t ? (sum - s) + t : (t - s) + sum;
    sum = s;
  }
  return static_cast<double>(sum + comp);
}

// The order of the CUDA sum_squares, written out from its definition in kernels/cuda/
// layer_math.cuh (which this file, compiled against cuda_runtime.h, cannot include;
// layer_math_host_test pins the three constants): B = clamp(ceil(count / 8192), 1, 512) blocks of
// T = 256 threads. Pass 1: thread g = b T + t adds x[g]^2, x[g + BT]^2, ... in ascending order, and
// each block adds its T sums in a pairwise tree (for w = T/2, ..., 1: s[t] += s[t + w]). Pass 2
// (B > 1): thread t adds the block sums p[t], p[t + T], ... in order, then the same tree.
constexpr int64_t kSumThreads = 256, kSumMaxBlocks = 512, kSumPerBlock = 8192;

int64_t SumSquaresBlocks(int64_t count) {
  return std::clamp<int64_t>((count + kSumPerBlock - 1) / kSumPerBlock, 1, kSumMaxBlocks);
}

double PairwiseTree(std::vector<double> s) {
  for (size_t w = s.size() / 2; w > 0; w /= 2) {
    for (size_t t = 0; t < w; ++t) s[t] += s[t + w];
  }
  return s[0];
}

double SumSquaresInTheDocumentedOrder(const std::vector<float>& x) {
  const int64_t count = static_cast<int64_t>(x.size());
  const int64_t blocks = SumSquaresBlocks(count);
  const int64_t grid = blocks * kSumThreads;
  std::vector<double> partial;
  for (int64_t b = 0; b < blocks; ++b) {
    std::vector<double> s(kSumThreads, 0.0);
    for (int64_t t = 0; t < kSumThreads; ++t) {
      for (int64_t i = b * kSumThreads + t; i < count; i += grid) {
        const double a = x[static_cast<size_t>(i)];
        s[static_cast<size_t>(t)] += a * a;
      }
    }
    partial.push_back(PairwiseTree(s));
  }
  if (blocks == 1) return partial[0];
  std::vector<double> s(kSumThreads, 0.0);
  for (int64_t i = 0; i < blocks; ++i) {
    s[static_cast<size_t>(i % kSumThreads)] += partial[static_cast<size_t>(i)];
  }
  return PairwiseTree(s);
}

// Additions a term passes through in that order (the h of the bound above).
int64_t SumSquaresDepth(int64_t count) {
  const int64_t blocks = SumSquaresBlocks(count);
  const int64_t grid = blocks * kSumThreads;
  int64_t depth = (count + grid - 1) / grid + 8;
  if (blocks > 1) depth += (blocks + kSumThreads - 1) / kSumThreads + 8;
  return depth;
}

// Half N(0, 3), half log-uniform over 2^-30..2^30: squares across many binades.
std::vector<float> SumSquaresData(int64_t count, uint32_t seed) {
  std::vector<float> x = Normal(count, seed, 3.0f);
  std::mt19937 rng(seed + 1);
  std::uniform_real_distribution<float> unit(0.0f, 1.0f);
  for (size_t i = 1; i < x.size(); i += 2) x[i] = std::exp2(unit(rng) * 60.0f - 30.0f);
  return x;
}

using SumSquaresTest = SizeTest;

TEST_P(SumSquaresTest, IsTheDocumentedOrderWithinTheSumOrderBounds) {
  const int64_t count = GetParam();
  const std::vector<float> x = SumSquaresData(count, 61);
  double cpu = -1.0;
  ExpectOk(cpu_.sum_squares(x.data(), count, &cpu, {}));
  const double exact = ExactSumOfSquares(x);

  auto d_x = Upload(x);
  DeviceBuffer d_out(sizeof(double));  // poisoned: count 0 must still write 0
  double gpu[2];
  for (double& g : gpu) {
    ExpectOk(gpu_->sum_squares(d_x.f(), count, d_out.as<double>(), stream()));
    Sync();
    g = Download<double>(d_out, 1)[0];
  }
  EXPECT_EQ(std::bit_cast<uint64_t>(gpu[0]), std::bit_cast<uint64_t>(gpu[1])) << "rerun";
  if (count == 0) {
    EXPECT_EQ(std::bit_cast<uint64_t>(gpu[0]), 0u) << gpu[0];
    EXPECT_EQ(cpu, 0.0);
    return;
  }
  const double ordered = SumSquaresInTheDocumentedOrder(x);
  EXPECT_EQ(std::bit_cast<uint64_t>(gpu[0]), std::bit_cast<uint64_t>(ordered))
      << "gpu " << gpu[0] << ", documented order " << ordered << " (" << SumSquaresBlocks(count)
      << " blocks)";
  const double gpu_bound = 1.01 * static_cast<double>(SumSquaresDepth(count)) * kU64 * exact;
  const double cpu_bound = 1.01 * static_cast<double>(count - 1) * kU64 * exact;
  EXPECT_LE(std::abs(gpu[0] - exact), gpu_bound) << "gpu " << gpu[0] << " exact " << exact;
  EXPECT_LE(std::abs(gpu[0] - cpu), gpu_bound + cpu_bound) << "gpu " << gpu[0] << " cpu " << cpu;
}

// 0; below and at a block of 256 threads; one grid block (up to 8192) and two; 1024 * 256 + 7
// (33 blocks); below, at and past the 512-block cap (4194304); millions past it, where the
// chains grow.
INSTANTIATE_TEST_SUITE_P(Counts, SumSquaresTest,
                         ::testing::Values(0, 1, 255, 1023, 1024, 1025, 4097, 8192, 8193, 16385,
                                           262151, 3000001, 4194303, 4194304, 4194305, 9000001));

#ifndef FP8RT_GPU_TEST_HOST  // CUDA streams (host mode: HostModeTest below)
// Two streams summing different data at once, each call with its own stream-ordered partials
// (shared scratch would mix them up): every result has the bits of the documented order.
class SumSquaresStreamsTest : public LayerOpsCudaTest {};

TEST_F(SumSquaresStreamsTest, ConcurrentCallsOnTwoStreamsKeepTheirOwnBits) {
  constexpr int64_t kCount = 5000011;
  const std::vector<float> a = SumSquaresData(kCount, 63);
  const std::vector<float> b = SumSquaresData(kCount, 65);
  auto d_a = Upload(a);
  auto d_b = Upload(b);
  DeviceBuffer d_out(4 * sizeof(double));
  cudaStream_t other = nullptr;
  ASSERT_EQ(cudaStreamCreateWithFlags(&other, cudaStreamNonBlocking), cudaSuccess);
  double* out = d_out.as<double>();
  const uint64_t want_a = std::bit_cast<uint64_t>(SumSquaresInTheDocumentedOrder(a));
  const uint64_t want_b = std::bit_cast<uint64_t>(SumSquaresInTheDocumentedOrder(b));
  for (int round = 0; round < 3; ++round) {
    ExpectOk(gpu_->sum_squares(d_a.f(), kCount, out, stream()));
    ExpectOk(gpu_->sum_squares(d_b.f(), kCount, out + 1, Stream{other}));
    ExpectOk(gpu_->sum_squares(d_b.f(), kCount, out + 2, stream()));
    ExpectOk(gpu_->sum_squares(d_a.f(), kCount, out + 3, Stream{other}));
    ExpectOk(gpu_->synchronize(Stream{other}));
    Sync();
    const std::vector<double> got = Download<double>(d_out, 4);
    EXPECT_EQ(std::bit_cast<uint64_t>(got[0]), want_a) << "round " << round;
    EXPECT_EQ(std::bit_cast<uint64_t>(got[1]), want_b) << "round " << round;
    EXPECT_EQ(std::bit_cast<uint64_t>(got[2]), want_b) << "round " << round;
    EXPECT_EQ(std::bit_cast<uint64_t>(got[3]), want_a) << "round " << round;
  }
  EXPECT_EQ(cudaStreamDestroy(other), cudaSuccess);
}

#endif  // FP8RT_GPU_TEST_HOST

class SumSquaresSpecialsTest : public LayerOpsCudaTest {};

TEST_F(SumSquaresSpecialsTest, NanOrInfAnywhereGivesANonFiniteSum) {
  constexpr int64_t kCount = 100003;
  DeviceBuffer d_out(sizeof(double));
  for (float special :
       {std::numeric_limits<float>::quiet_NaN(), FromBits(0xFFC00123u),
        std::numeric_limits<float>::infinity(), -std::numeric_limits<float>::infinity()}) {
    for (int64_t at : {int64_t{0}, int64_t{1023}, int64_t{50000}, kCount - 1}) {
      std::vector<float> x = Normal(kCount, 71, 1.0f);
      x[static_cast<size_t>(at)] = special;
      auto d_x = Upload(x);
      ExpectOk(gpu_->sum_squares(d_x.f(), kCount, d_out.as<double>(), stream()));
      Sync();
      const double gpu = Download<double>(d_out, 1)[0];
      EXPECT_FALSE(std::isfinite(gpu)) << special << " at " << at << ": " << gpu;
      if (std::isnan(special)) {
        EXPECT_TRUE(std::isnan(gpu)) << "at " << at << ": " << gpu;
      }
    }
  }
  // And finite data well below the FP64 range stays finite: the largest floats square to 1e77.
  std::vector<float> big(kCount, std::numeric_limits<float>::max());
  auto d_big = Upload(big);
  ExpectOk(gpu_->sum_squares(d_big.f(), kCount, d_out.as<double>(), stream()));
  Sync();
  EXPECT_TRUE(std::isfinite(Download<double>(d_out, 1)[0]));
}

// --- layout --------------------------------------------------------------------------------------

class TransposeTest : public LayerOpsCudaTest, public ::testing::WithParamInterface<RowShape> {};

TEST_P(TransposeTest, KeepsEveryBit) {
  const auto [rows, cols] = GetParam();
  const size_t sz = static_cast<size_t>(rows * cols);
  const std::vector<float> src = RandomBits(rows * cols, 81);
  std::vector<float> dst(sz);
  ExpectOk(cpu_.transpose(dst.data(), src.data(), rows, cols, {}));
  auto d_src = Upload(src);
  DeviceBuffer d_dst(sz * sizeof(float));
  ExpectOk(gpu_->transpose(d_dst.f(), d_src.f(), rows, cols, stream()));
  Sync();
  ExpectBitsEqual(Download<float>(d_dst, sz), dst, "transpose");
}

TEST_P(TransposeTest, BytesKeepEveryBit) {
  const auto [rows, cols] = GetParam();
  const size_t sz = static_cast<size_t>(rows * cols);
  std::vector<uint8_t> src(sz);
  std::mt19937 rng(83);
  for (uint8_t& b : src) b = static_cast<uint8_t>(rng());
  std::vector<uint8_t> dst(sz);
  ExpectOk(cpu_.transpose_bytes(dst.data(), src.data(), rows, cols, {}));
  auto d_src = Upload(src);
  DeviceBuffer d_dst(sz);
  ExpectOk(gpu_->transpose_bytes(d_dst.as<uint8_t>(), d_src.as<uint8_t>(), rows, cols, stream()));
  Sync();
  EXPECT_EQ(Download<uint8_t>(d_dst, sz), dst) << "transpose_bytes " << rows << " x " << cols;
}

INSTANTIATE_TEST_SUITE_P(Shapes, TransposeTest,
                         ::testing::Values(RowShape{1, 1}, RowShape{1, 77}, RowShape{77, 1},
                                           RowShape{31, 33}, RowShape{32, 32}, RowShape{257, 1023},
                                           RowShape{2000, 3001}));

struct HeadsShape {
  int64_t n, kv_heads, q_per_kv, dh;
};

class HeadsTest : public LayerOpsCudaTest, public ::testing::WithParamInterface<HeadsShape> {};

TEST_P(HeadsTest, SplitAndJoinKeepEveryBit) {
  const auto [n, kv_heads, q_per_kv, dh] = GetParam();
  const size_t q_size = static_cast<size_t>(n * kv_heads * q_per_kv * dh);
  const size_t kv_size = static_cast<size_t>(n * kv_heads * dh);
  const size_t fused = q_size + 2 * kv_size;
  const std::vector<float> qkv = RandomBits(static_cast<int64_t>(fused), 91);
  std::vector<float> q(q_size), k(kv_size), v(kv_size);
  ExpectOk(
      cpu_.split_heads(q.data(), k.data(), v.data(), qkv.data(), n, kv_heads, q_per_kv, dh, {}));
  auto d_qkv = Upload(qkv);
  DeviceBuffer d_q(q_size * sizeof(float)), d_k(kv_size * sizeof(float)),
      d_v(kv_size * sizeof(float));
  ExpectOk(
      gpu_->split_heads(d_q.f(), d_k.f(), d_v.f(), d_qkv.f(), n, kv_heads, q_per_kv, dh, stream()));
  Sync();
  ExpectBitsEqual(Download<float>(d_q, q_size), q, "split q");
  ExpectBitsEqual(Download<float>(d_k, kv_size), k, "split k");
  ExpectBitsEqual(Download<float>(d_v, kv_size), v, "split v");

  // Join from independent parts (not the split's output, so that a swapped q/k/v shows).
  const std::vector<float> q2 = RandomBits(static_cast<int64_t>(q_size), 92);
  const std::vector<float> k2 = RandomBits(static_cast<int64_t>(kv_size), 93);
  const std::vector<float> v2 = RandomBits(static_cast<int64_t>(kv_size), 94);
  std::vector<float> joined(fused);
  ExpectOk(cpu_.join_heads(joined.data(), q2.data(), k2.data(), v2.data(), n, kv_heads, q_per_kv,
                           dh, {}));
  auto d_q2 = Upload(q2);
  auto d_k2 = Upload(k2);
  auto d_v2 = Upload(v2);
  DeviceBuffer d_joined(fused * sizeof(float));
  ExpectOk(gpu_->join_heads(d_joined.f(), d_q2.f(), d_k2.f(), d_v2.f(), n, kv_heads, q_per_kv, dh,
                            stream()));
  Sync();
  ExpectBitsEqual(Download<float>(d_joined, fused), joined, "join");
}

INSTANTIATE_TEST_SUITE_P(Shapes, HeadsTest,
                         ::testing::Values(HeadsShape{1, 1, 1, 1}, HeadsShape{3, 2, 1, 5},
                                           HeadsShape{17, 12, 1, 64}, HeadsShape{513, 3, 1, 33},
                                           HeadsShape{1000, 16, 1, 128}, HeadsShape{7, 2, 4, 3},
                                           HeadsShape{1000, 8, 4, 128}, HeadsShape{300, 1, 12, 64},
                                           HeadsShape{5, 3, 0, 8}));

// --- arguments -----------------------------------------------------------------------------------

// --- MoE routing ---------------------------------------------------------------------------------
// The CUDA entries run the CPU's per-token code (kernels/moe_routing.h) with the device's expf and
// nvcc's FMA contraction: the expert choice, the row moves and the gate-scaled rows are exact;
// probabilities, gates and sums are within a few FP32 roundings of the CPU's.

class MoeRoutingTest : public LayerOpsCudaTest {};

// The router probability sums (a warp per expert, interleaved partial sums, a fixed tree) on
// shapes that leave lanes idle (n < 32), no tokens at all, an expert count that is no multiple of
// anything, and more warps than one block holds: within FP64 roundings of the CPU's token-order
// sums (the probabilities themselves come from the device's expf), and the same bits again.
TEST_F(MoeRoutingTest, ProbabilitySumsOnEveryShape) {
  for (const auto& [n, e, k] : {std::tuple<int64_t, int64_t, int64_t>{5, 37, 3},
                                {0, 3, 1},
                                {31, 1, 1},
                                {1000, 19, 2},
                                {70, 300, 4}}) {
    const std::vector<float> logits = Normal(std::max<int64_t>(n * e, 1), 17, 2.0f);
    std::vector<float> probs(std::max<int64_t>(n * e, 1)), gate(std::max<int64_t>(n * k, 1));
    std::vector<int32_t> expert(std::max<int64_t>(n * k, 1));
    std::vector<double> sums(e, -1.0);
    ExpectOk(cpu_.moe_route(probs.data(), expert.data(), gate.data(), sums.data(), logits.data(), n,
                            e, k, {}));
    auto d_logits = Upload(logits);
    DeviceBuffer d_probs(probs.size() * 4), d_expert(expert.size() * 4), d_gate(gate.size() * 4),
        d_sums(sums.size() * 8);
    std::vector<double> first;
    for (int run = 0; run < 2; ++run) {
      ExpectOk(gpu_->moe_route(d_probs.f(), d_expert.as<int32_t>(), d_gate.f(), d_sums.as<double>(),
                               d_logits.f(), n, e, k, stream()));
      Sync();
      const std::vector<double> got = Download<double>(d_sums, sums.size());
      if (run == 0) {
        for (int64_t x = 0; x < e; ++x) {
          EXPECT_NEAR(got[x], sums[x], 1e-6 * static_cast<double>(n) + 1e-300)
              << "n " << n << " e " << e << " expert " << x;
        }
        first = got;
      } else {
        EXPECT_EQ(got, first) << "n " << n << " e " << e << ": prob_sums on a second run";
      }
    }
  }
}

TEST_F(MoeRoutingTest, MatchesTheCpuBackend) {
  const int64_t n = 300, e = 8, k = 2, c = 40;
  const std::vector<float> logits = Normal(n * e, 91, 2.0f);
  std::vector<float> probs(n * e), gate(n * k);
  std::vector<int32_t> expert(n * k);
  std::vector<double> sums(e);
  ExpectOk(cpu_.moe_route(probs.data(), expert.data(), gate.data(), sums.data(), logits.data(), n,
                          e, k, {}));
  auto d_logits = Upload(logits);
  DeviceBuffer d_probs(probs.size() * 4), d_expert(expert.size() * 4), d_gate(gate.size() * 4),
      d_sums(sums.size() * 8);
  ExpectOk(gpu_->moe_route(d_probs.f(), d_expert.as<int32_t>(), d_gate.f(), d_sums.as<double>(),
                           d_logits.f(), n, e, k, stream()));
  Sync();
  EXPECT_EQ(Download<int32_t>(d_expert, expert.size()), expert) << "the experts chosen";
  std::vector<double> tol_p(probs.size()), tol_g(gate.size());
  for (size_t i = 0; i < probs.size(); ++i) tol_p[i] = 1e-6 * probs[i] + 1e-30;
  for (size_t i = 0; i < gate.size(); ++i) tol_g[i] = 1e-6;
  ExpectWithin(Download<float>(d_probs, probs.size()), probs, tol_p, "probs");
  ExpectWithin(Download<float>(d_gate, gate.size()), gate, tol_g, "gate");
  const std::vector<double> got_sums = Download<double>(d_sums, sums.size());
  for (int64_t x = 0; x < e; ++x) EXPECT_NEAR(got_sums[x], sums[x], 1e-6 * n) << x;
  // The sums' order is fixed (a warp per expert, a fixed tree): the same bits again.
  ExpectOk(gpu_->moe_route(d_probs.f(), d_expert.as<int32_t>(), d_gate.f(), d_sums.as<double>(),
                           d_logits.f(), n, e, k, stream()));
  Sync();
  EXPECT_EQ(Download<double>(d_sums, sums.size()), got_sums) << "prob_sums on a second run";

  // The dispatch plan of a capacity of 60 per expert: slots in expert-major order.
  std::vector<int64_t> slot(n * k, -1), send_token;
  std::vector<int64_t> routed(e, 0);
  for (int64_t x = 0; x < e; ++x) {
    for (int64_t a = 0; a < n * k; ++a) {
      if (expert[a] == x && routed[x]++ < 60) {
        slot[a] = static_cast<int64_t>(send_token.size());
        send_token.push_back(a / k);
      }
    }
  }
  const int64_t sent = static_cast<int64_t>(send_token.size());
  ASSERT_LT(sent, n * k) << "some assignments are dropped";
  std::vector<int64_t> gather_index = send_token;
  gather_index.push_back(-1);  // a zero row, as an expert's GEMM padding
  const std::vector<float> x = Normal(n * c, 92, 1.0f);
  std::vector<float> rows((sent + 1) * c);
  ExpectOk(cpu_.gather_rows(rows.data(), x.data(), gather_index.data(), sent + 1, c, {}));
  auto d_x = Upload(x);
  auto d_index = Upload(gather_index);
  DeviceBuffer d_rows(rows.size() * 4);
  ExpectOk(gpu_->gather_rows(d_rows.f(), d_x.f(), d_index.as<int64_t>(), sent + 1, c, stream()));
  Sync();
  ExpectBitsEqual(Download<float>(d_rows, rows.size()), rows, "gather_rows");
  std::vector<float> back(n * c, 5.0f);
  ExpectOk(cpu_.scatter_rows(back.data(), rows.data(), gather_index.data(), sent + 1, c, {}));
  auto d_back = Upload(std::vector<float>(n * c, 5.0f));
  ExpectOk(
      gpu_->scatter_rows(d_back.f(), d_rows.f(), d_index.as<int64_t>(), sent + 1, c, stream()));
  Sync();
  ExpectBitsEqual(Download<float>(d_back, back.size()), back, "scatter_rows");

  // Combine, its backward and the router's backward on the plan's rows.
  const std::vector<float> y = Normal(sent * c, 93, 1.0f), dout = Normal(n * c, 94, 1.0f);
  std::vector<float> out(n * c), dy(sent * c), dgate(n * k), dl(n * e);
  std::vector<float> frac(e, 1.0f / static_cast<float>(e));
  ExpectOk(cpu_.moe_combine(out.data(), y.data(), gate.data(), slot.data(), expert.data(), n, k, c,
                            false, {}));
  ExpectOk(cpu_.moe_combine_backward(dy.data(), dgate.data(), dout.data(), y.data(), gate.data(),
                                     slot.data(), n, k, c, {}));
  ExpectOk(cpu_.moe_router_backward(dl.data(), probs.data(), expert.data(), gate.data(),
                                    dgate.data(), frac.data(), 0.01f, n, e, k, {}));
  // The GPU gets the CPU's routing, so that each stage is compared on the same inputs.
  auto d_y = Upload(y);
  auto d_dout = Upload(dout);
  auto d_slot = Upload(slot);
  auto d_cpu_gate = Upload(gate);
  auto d_cpu_expert = Upload(expert);
  auto d_cpu_probs = Upload(probs);
  auto d_frac = Upload(frac);
  DeviceBuffer d_out(out.size() * 4), d_dy(dy.size() * 4), d_dgate(dgate.size() * 4),
      d_dl(dl.size() * 4);
  ExpectOk(gpu_->moe_combine(d_out.f(), d_y.f(), d_cpu_gate.f(), d_slot.as<int64_t>(),
                             d_cpu_expert.as<int32_t>(), n, k, c, false, stream()));
  ExpectOk(gpu_->moe_combine_backward(d_dy.f(), d_dgate.f(), d_dout.f(), d_y.f(), d_cpu_gate.f(),
                                      d_slot.as<int64_t>(), n, k, c, stream()));
  Sync();
  const std::vector<float> got_dgate = Download<float>(d_dgate, dgate.size());
  auto d_got_dgate = Upload(dgate);  // the router backward from the CPU's gate gradients
  ExpectOk(gpu_->moe_router_backward(d_dl.f(), d_cpu_probs.f(), d_cpu_expert.as<int32_t>(),
                                     d_cpu_gate.f(), d_got_dgate.f(), d_frac.f(), 0.01f, n, e, k,
                                     stream()));
  Sync();
  // A sum of m products differs between FMA and separate roundings by at most m ulps of the sum
  // of their magnitudes: bounded here by 2^-22 * m * sum |terms|.
  std::vector<double> tol_out(out.size()), tol_dgate(dgate.size()), tol_dl(dl.size());
  for (int64_t t = 0; t < n; ++t) {
    for (int64_t col = 0; col < c; ++col) {
      double mag = 0.0;
      for (int64_t j = 0; j < k; ++j) {
        const int64_t sl = slot[t * k + j];
        if (sl >= 0) mag += std::abs(gate[t * k + j] * y[sl * c + col]);
      }
      tol_out[t * c + col] = 0x1p-22 * k * mag;
    }
  }
  for (int64_t a = 0; a < n * k; ++a) {
    double mag = 0.0;
    if (slot[a] >= 0) {
      for (int64_t col = 0; col < c; ++col) {
        mag += std::abs(dout[(a / k) * c + col] * y[slot[a] * c + col]);
      }
    }
    tol_dgate[a] = 0x1p-22 * c * mag;
  }
  for (size_t i = 0; i < dl.size(); ++i) tol_dl[i] = 1e-6 + 1e-5 * std::abs(dl[i]);
  ExpectWithin(Download<float>(d_out, out.size()), out, tol_out, "moe_combine");
  ExpectBitsEqual(Download<float>(d_dy, dy.size()), dy, "moe_combine_backward dy");
  ExpectWithin(got_dgate, dgate, tol_dgate, "moe_combine_backward dgate");
  ExpectWithin(Download<float>(d_dl, dl.size()), dl, tol_dl, "moe_router_backward");

  // The backward's combine (the experts' input gradients back into dx): no gate, added onto what
  // dx holds.
  const std::vector<float> dx0 = Normal(n * c, 95, 1.0f);
  std::vector<float> dx = dx0;
  ExpectOk(cpu_.moe_combine(dx.data(), y.data(), /*gate=*/nullptr, slot.data(), expert.data(), n, k,
                            c, /*accumulate=*/true, {}));
  auto d_dx = Upload(dx0);
  ExpectOk(gpu_->moe_combine(d_dx.f(), d_y.f(), /*gate=*/nullptr, d_slot.as<int64_t>(),
                             d_cpu_expert.as<int32_t>(), n, k, c, /*accumulate=*/true, stream()));
  Sync();
  std::vector<double> tol_dx(dx.size());
  for (int64_t t = 0; t < n; ++t) {
    for (int64_t col = 0; col < c; ++col) {
      double mag = std::abs(dx0[t * c + col]);
      for (int64_t j = 0; j < k; ++j) {
        const int64_t sl = slot[t * k + j];
        if (sl >= 0) mag += std::abs(y[sl * c + col]);
      }
      tol_dx[t * c + col] = 0x1p-22 * (k + 1) * mag;
    }
  }
  ExpectWithin(Download<float>(d_dx, dx.size()), dx, tol_dx, "moe_combine without gate, added");
}

// Expects InvalidArgument whose message names `field`.
void ExpectRefused(const absl::Status& s, const std::string& field) {
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
  EXPECT_NE(std::string(s.message()).find(field), std::string::npos) << s;
}

#ifndef FP8RT_GPU_TEST_HOST  // the CUDA runtime (host mode: HostModeTest below)
class ArgumentTest : public LayerOpsCudaTest {};

TEST_F(ArgumentTest, HostPointersAreRefusedBeforeAnyLaunch) {
  constexpr int64_t kN = 64;
  std::vector<float> host(kN, 1.0f);
  std::vector<int32_t> host_tokens(kN, 0);
  DeviceBuffer out(kN * sizeof(float)), a(kN * sizeof(float)), table(kN * sizeof(float));
  DeviceBuffer tokens(kN * sizeof(int32_t));
  ASSERT_EQ(cudaMemset(tokens.as(), 0, kN * sizeof(int32_t)), cudaSuccess);
  const std::vector<float> poison = Download<float>(out, kN);

  ExpectRefused(gpu_->embedding_forward(out.f(), host_tokens.data(), table.f(), kN, 1, 1, stream()),
                "tokens is not device memory");
  ExpectRefused(
      gpu_->embedding_backward(host.data(), out.f(), tokens.as<int32_t>(), kN, 1, 1, stream()),
      "dtable is not device memory");
  ExpectRefused(gpu_->residual_forward(out.f(), host.data(), a.f(), kN, stream()),
                "a is not device memory");
  ExpectRefused(gpu_->rmsnorm_forward(out.f(), a.f(), out.f(), host.data(), 1, kN, 1e-5f, stream()),
                "weight is not device memory");
  ExpectRefused(gpu_->layernorm_forward(out.f(), a.f(), table.f(), out.f(), host.data(), a.f(), 1,
                                        kN, 1e-5f, stream()),
                "weight is not device memory");
  ExpectRefused(gpu_->layernorm_backward(out.f(), a.f(), host.data(), out.f(), a.f(), a.f(), a.f(),
                                         a.f(), 1, kN, stream()),
                "dbias is not device memory");
  ExpectRefused(gpu_->bias_forward(out.f(), host.data(), 1, kN, stream()),
                "bias is not device memory");
  ExpectRefused(gpu_->bias_backward(host.data(), out.f(), 1, kN, stream()),
                "dbias is not device memory");
  ExpectRefused(gpu_->rope_forward(out.f(), host.data(), 2, 2, 2, 16, 1e4f, stream()),
                "x is not device memory");
  ExpectRefused(gpu_->rope_backward(out.f(), host.data(), 2, 2, 2, 16, 1e4f, stream()),
                "dout is not device memory");
  ExpectRefused(gpu_->swiglu_forward(out.f(), a.f(), host.data(), kN, stream()),
                "up is not device memory");
  ExpectRefused(gpu_->swiglu_backward(out.f(), a.f(), table.f(), host.data(), a.f(), kN, stream()),
                "gate is not device memory");
  ExpectRefused(gpu_->transpose(out.f(), host.data(), 8, 8, stream()), "src is not device memory");
  ExpectRefused(gpu_->copy(out.f(), host.data(), kN, stream()), "src is not device memory");
  double host_sum = 0.0;
  ExpectRefused(gpu_->sum_squares(a.f(), kN, &host_sum, stream()), "out is not device memory");
  AdamWArgs k;
  k.master = out.f();
  k.grad = a.f();
  k.m = host.data();
  k.v = table.f();
  k.count = kN;
  ExpectRefused(gpu_->adamw(k, stream()), "m is not device memory");
  Sync();
  // Nothing ran: the output still holds its poison, and the context still works.
  ExpectBitsEqual(Download<float>(out, kN), poison, "untouched output");
  ExpectOk(gpu_->fill(out.f(), 2.0f, kN, stream()));
  Sync();
  ExpectBitsEqual(Download<float>(out, kN), std::vector<float>(kN, 2.0f), "fill after refusals");
}

// --- memory --------------------------------------------------------------------------------------

class AllocateTest : public LayerOpsCudaTest {};

TEST_F(AllocateTest, GivesMemoryTheOpsAcceptAndTheHostReadsAfterSynchronize) {
  for (size_t count : {size_t{0}, size_t{1}, size_t{1000003}}) {
    absl::StatusOr<void*> p = gpu_->allocate(count * sizeof(float));
    ASSERT_TRUE(p.ok()) << p.status();
    ASSERT_NE(*p, nullptr) << count;
    auto* x = static_cast<float*>(*p);
    // Written by the host, moved to the device ahead of the op: the values survive the move.
    for (size_t i = 0; i < count; ++i) x[i] = static_cast<float>(i);
    ExpectOk(gpu_->prefetch(x, count * sizeof(float), stream()));
    Sync();
    for (size_t i = 0; i < count; ++i) ASSERT_EQ(x[i], static_cast<float>(i)) << i;
    ExpectOk(gpu_->fill(x, 3.5f, static_cast<int64_t>(count), stream()));  // passes the check
    Sync();
    int64_t bad = 0;
    for (size_t i = 0; i < count; ++i) bad += Bits(x[i]) != Bits(3.5f);  // host access
    EXPECT_EQ(bad, 0) << count;
    gpu_->deallocate(*p);
  }
  gpu_->deallocate(nullptr);
}

// allocate_device gives device memory from the stream-ordered pool (not managed: the host never
// faults pages of it in), which the ops accept, zero_bytes clears on the stream, and deallocate
// frees; a DeviceArray of Placement::kDeviceOnly lives in it.
TEST_F(AllocateTest, DeviceOnlyMemoryIsDeviceMemoryAndZeroBytesClearsIt) {
  for (size_t count : {size_t{0}, size_t{1}, size_t{1000003}}) {
    absl::StatusOr<void*> p = gpu_->allocate_device(count * sizeof(float));
    ASSERT_TRUE(p.ok()) << p.status();
    ASSERT_NE(*p, nullptr) << count;
    cudaPointerAttributes attr{};
    ASSERT_EQ(cudaPointerGetAttributes(&attr, *p), cudaSuccess);
    EXPECT_EQ(attr.type, cudaMemoryTypeDevice) << count;
    auto* x = static_cast<float*>(*p);
    ExpectOk(gpu_->fill(x, 3.5f, static_cast<int64_t>(count), stream()));
    ExpectOk(gpu_->zero_bytes(x, count * sizeof(float) / 2, stream()));  // the first half
    Sync();
    std::vector<float> got(count);
    if (count > 0) {
      ASSERT_EQ(cudaMemcpy(got.data(), x, count * sizeof(float), cudaMemcpyDeviceToHost),
                cudaSuccess);
    }
    int64_t bad = 0;
    for (size_t i = 0; i < count; ++i) {
      bad += Bits(got[i]) != (i < count / 2 ? 0u : Bits(3.5f));
    }
    EXPECT_EQ(bad, 0) << count;
    gpu_->deallocate(*p);
  }
  DeviceArray<float> a(*cuda_ops_, MemCategory::kScratch, Placement::kDeviceOnly);
  a.assign(4096, 0.0f);
  cudaPointerAttributes attr{};
  ASSERT_EQ(cudaPointerGetAttributes(&attr, a.data()), cudaSuccess);
  EXPECT_EQ(attr.type, cudaMemoryTypeDevice);
  ExpectRefused(gpu_->zero_bytes(nullptr, 4, stream()), "p is null");
}

void CUDART_CB SleepHalfASecond(void*) {
  std::this_thread::sleep_for(std::chrono::milliseconds(500));
}

// Device-only memory is allocated and freed in the default stream's order: with the stream busy
// for 500 ms, allocating, using, freeing and reallocating returns at once (cudaFree would have
// waited), and the work queued before a free still reads what was written, while the memory a
// second allocation reuses holds its own values.
TEST_F(AllocateTest, DeviceOnlyMemoryIsFreedInStreamOrderWithoutWaiting) {
  const size_t count = 1 << 20;
  const size_t bytes = count * sizeof(float);
  DeviceArray<float> out1(*cuda_ops_, MemCategory::kOther, Placement::kHostRead);
  DeviceArray<float> out2(*cuda_ops_, MemCategory::kOther, Placement::kHostRead);
  out1.assign(count, 0.0f);
  out2.assign(count, 0.0f);
  const Stream legacy{cudaStreamLegacy};
  // The fill kernel once first: loading a module lazily may synchronise.
  ExpectOk(gpu_->fill(out1.data(), 0.0f, static_cast<int64_t>(count), legacy));
  ASSERT_EQ(cudaStreamSynchronize(cudaStreamLegacy), cudaSuccess);
  ASSERT_EQ(cudaLaunchHostFunc(cudaStreamLegacy, SleepHalfASecond, nullptr), cudaSuccess);
  const auto t0 = std::chrono::steady_clock::now();
  for (int round = 0; round < 2; ++round) {
    absl::StatusOr<void*> p = gpu_->allocate_device(bytes);
    ASSERT_TRUE(p.ok()) << p.status();
    auto* x = static_cast<float*>(*p);
    ExpectOk(gpu_->fill(x, round == 0 ? 1.5f : -2.5f, static_cast<int64_t>(count), legacy));
    ExpectOk(gpu_->copy_bytes(round == 0 ? out1.data() : out2.data(), x, bytes, legacy));
    gpu_->deallocate(x);
  }
  const auto took = std::chrono::steady_clock::now() - t0;
  EXPECT_LT(took, std::chrono::milliseconds(250))
      << "an allocation or a free waited for the device";
  ASSERT_EQ(cudaStreamSynchronize(cudaStreamLegacy), cudaSuccess);
  int64_t bad = 0;
  for (size_t i = 0; i < count; ++i) {
    bad += Bits(out1[i]) != Bits(1.5f);
    bad += Bits(out2[i]) != Bits(-2.5f);
  }
  EXPECT_EQ(bad, 0);
  // The pool keeps what is freed for reuse instead of handing it back at every synchronisation:
  // 512 MiB (more than any earlier test of this file frees) stays taken from the device after its
  // free and a synchronisation, and an allocation of the same size then takes nothing new.
  const size_t big = size_t{512} << 20;
  size_t free0 = 0, free1 = 0, free2 = 0, total = 0;
  ASSERT_EQ(cudaMemGetInfo(&free0, &total), cudaSuccess);
  absl::StatusOr<void*> a = gpu_->allocate_device(big);
  ASSERT_TRUE(a.ok()) << a.status();
  gpu_->deallocate(*a);
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  ASSERT_EQ(cudaMemGetInfo(&free1, &total), cudaSuccess);
  EXPECT_LE(free1 + (big - (size_t{64} << 20)), free0) << "the pool gave the freed memory back";
  absl::StatusOr<void*> b = gpu_->allocate_device(big);
  ASSERT_TRUE(b.ok()) << b.status();
  ASSERT_EQ(cudaMemGetInfo(&free2, &total), cudaSuccess);
  EXPECT_GE(free2 + (size_t{64} << 20), free1) << "the second allocation took new memory";
  gpu_->deallocate(*b);
}

// What the array pool keeps after its arrays are freed is not lost to the backend's other
// allocations (review finding: the ops' scratch and NCCL's staging came from the device's default
// pool, which cannot take it back). With the device filled with device-only arrays and all of them
// freed, the default pool cannot give 1 GiB, but MallocFromDevicePool (the ops' scratch, NCCL's
// staging) can: it takes what fp8rt's pool keeps. Then what little the device has left outside the
// pools is taken too (cudaMalloc, down to its 2 MiB granularity) and the default pool trimmed, so
// that the default pool cannot give even one byte: sum_squares, whose scratch (its block
// partials) came from that pool before, must still run and give the right sum. (Managed memory is
// not tried on a full device: its pages would have nowhere to go, and a fault there could end the
// context for the rest of the file.)
TEST_F(AllocateTest, MemoryThePoolKeepsGoesToTheBackendsOtherAllocations) {
  // Everything the op needs besides its scratch exists before the device fills: its input and
  // output (pinned host memory) and its kernels (loaded lazily on a first launch).
  DeviceArray<float> x(*cuda_ops_, MemCategory::kOther, Placement::kHostRead);
  x.assign(size_t{1} << 20, 0.5f);
  DeviceArray<double> sum(*cuda_ops_, MemCategory::kOther, Placement::kHostRead);
  sum.assign(1, 0.0);
  ExpectOk(gpu_->sum_squares(x.data(), static_cast<int64_t>(x.size()), sum.data(), stream()));
  Sync();

  const size_t chunk = size_t{1} << 30;
  std::vector<void*> held;
  // What fp8rt's pool kept of the device goes back to the driver however the test ends, so that
  // the tests after it (cudaMalloc, which no pool serves) find the device as it was.
  const absl::Cleanup trim_pool = [] { EXPECT_EQ(cuda_internal::TrimDevicePool(), cudaSuccess); };
  const absl::Cleanup free_held = [&] {
    for (void* p : held) gpu_->deallocate(p);
    held.clear();
  };
  for (;;) {
    absl::StatusOr<void*> p = gpu_->allocate_device(chunk);
    if (!p.ok()) {
      EXPECT_EQ(p.status().code(), absl::StatusCode::kResourceExhausted) << p.status();
      break;
    }
    held.push_back(*p);
    ASSERT_LT(held.size(), 4096u) << "the device never filled";
  }
  ASSERT_GE(held.size(), 2u);
  for (void* p : held) gpu_->deallocate(p);
  held.clear();
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  // The default pool: the device has less than a chunk left outside fp8rt's pool.
  void* from_default = nullptr;
  const cudaError_t direct = cudaMallocAsync(&from_default, chunk, cudaStreamLegacy);
  if (direct == cudaSuccess) (void)cudaFreeAsync(from_default, cudaStreamLegacy);
  (void)cudaGetLastError();
  EXPECT_EQ(direct, cudaErrorMemoryAllocation) << "the device was not full: the test shows nothing";
  void* staged = nullptr;
  ASSERT_EQ(cuda_internal::MallocFromDevicePool(&staged, chunk, cudaStreamLegacy), cudaSuccess);
  ASSERT_EQ(cudaFreeAsync(staged, cudaStreamLegacy), cudaSuccess);
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);

  // The rest of the device outside the pools, taken by cudaMalloc (which no pool serves), and
  // given back however the test ends (an early ASSERT included): a full device would fail every
  // later test of the file.
  std::vector<void*> outside;
  const absl::Cleanup free_outside = [&outside] {
    for (void* p : outside) (void)cudaFree(p);
    outside.clear();
  };
  for (size_t size = size_t{256} << 20; size >= (size_t{2} << 20);) {
    void* p = nullptr;
    if (cudaMalloc(&p, size) == cudaSuccess) {
      outside.push_back(p);
      ASSERT_LT(outside.size(), 100000u);
    } else {
      (void)cudaGetLastError();
      size /= 2;
    }
  }
  int device = 0;
  ASSERT_EQ(cudaGetDevice(&device), cudaSuccess);
  cudaMemPool_t default_pool = nullptr;
  ASSERT_EQ(cudaDeviceGetDefaultMemPool(&default_pool, device), cudaSuccess);
  ASSERT_EQ(cudaMemPoolTrimTo(default_pool, 0), cudaSuccess);
  const cudaError_t one_byte = cudaMallocAsync(&from_default, 1, cudaStreamLegacy);
  if (one_byte == cudaSuccess) (void)cudaFreeAsync(from_default, cudaStreamLegacy);
  (void)cudaGetLastError();
  EXPECT_EQ(one_byte, cudaErrorMemoryAllocation)
      << "the default pool could still allocate: the op's scratch would be served either way";

  sum[0] = 0.0;
  const absl::Status st =
      gpu_->sum_squares(x.data(), static_cast<int64_t>(x.size()), sum.data(), stream());
  const cudaError_t synced = cudaDeviceSynchronize();
  ExpectOk(st);
  ASSERT_EQ(synced, cudaSuccess);
  EXPECT_EQ(sum[0], 0.25 * static_cast<double>(x.size()));
}

// allocate_host gives pinned host memory mapped for the device (what the host reads every step:
// Placement::kHostRead): the ops accept it and write it, the host reads it after synchronize, and
// deallocate frees it (cudaFreeHost).
TEST_F(AllocateTest, HostReadMemoryIsPinnedMappedAndWrittenByTheOps) {
  for (size_t count : {size_t{0}, size_t{1}, size_t{70001}}) {
    absl::StatusOr<void*> p = gpu_->allocate_host(count * sizeof(float));
    ASSERT_TRUE(p.ok()) << p.status();
    ASSERT_NE(*p, nullptr) << count;
    cudaPointerAttributes attr{};
    ASSERT_EQ(cudaPointerGetAttributes(&attr, *p), cudaSuccess);
    EXPECT_EQ(attr.type, cudaMemoryTypeHost) << count;
    EXPECT_EQ(attr.devicePointer, *p) << "unified addressing: one pointer for both";
    auto* x = static_cast<float*>(*p);
    ExpectOk(gpu_->fill(x, -1.25f, static_cast<int64_t>(count), stream()));
    Sync();
    int64_t bad = 0;
    for (size_t i = 0; i < count; ++i) bad += Bits(x[i]) != Bits(-1.25f);
    EXPECT_EQ(bad, 0) << count;
    gpu_->deallocate(*p);
  }
  // The loss rows of cross-entropy into a host-read array, as the model sums them.
  DeviceArray<float> losses(*cuda_ops_, MemCategory::kSavedActivations, Placement::kHostRead);
  losses.assign(3, 0.0f);
  DeviceBuffer logits(3 * 4 * 4), probs(3 * 4 * 4), targets(3 * 4);
  Put(logits, std::vector<float>(12, 0.0f));
  Put(targets, std::vector<int32_t>{0, 1, 3});
  ExpectOk(gpu_->cross_entropy_forward(probs.f(), losses.data(), logits.f(), targets.as<int32_t>(),
                                       3, 4, stream()));
  Sync();
  for (size_t r = 0; r < 3; ++r) EXPECT_NEAR(losses[r], std::log(4.0f), 1e-6f) << r;
}

// copy_bytes between the backend's memories, in stream order behind the op that wrote the source:
// device to pinned (how HostMirror brings statistics to the host), pinned to device, device to
// device; a plain host pointer is refused naming the end, before anything is queued.
TEST_F(AllocateTest, CopyBytesMovesBytesBetweenDeviceAndPinnedMemoryInStreamOrder) {
  const size_t count = 300007;
  DeviceArray<float> dev(*cuda_ops_, MemCategory::kScratch, Placement::kDeviceOnly);
  DeviceArray<float> dev2(*cuda_ops_, MemCategory::kScratch, Placement::kDeviceOnly);
  DeviceArray<float> host(*cuda_ops_, MemCategory::kOther, Placement::kHostRead);
  dev.Reset(*cuda_ops_, count);
  dev2.Reset(*cuda_ops_, count);
  host.Reset(*cuda_ops_, count);
  const size_t bytes = count * sizeof(float);
  // Device to pinned, queued straight behind the fill that writes the source.
  ExpectOk(gpu_->fill(dev.data(), 6.5f, static_cast<int64_t>(count), stream()));
  ExpectOk(gpu_->copy_bytes(host.data(), dev.data(), bytes, stream()));
  Sync();
  int64_t bad = 0;
  for (size_t i = 0; i < count; ++i) bad += Bits(host[i]) != Bits(6.5f);
  EXPECT_EQ(bad, 0) << "device to pinned";
  // Pinned to device, then device to device, then back to look.
  for (size_t i = 0; i < count; ++i) host[i] = static_cast<float>(i);
  ExpectOk(gpu_->copy_bytes(dev.data(), host.data(), bytes, stream()));
  ExpectOk(gpu_->copy_bytes(dev2.data(), dev.data(), bytes, stream()));
  ExpectOk(gpu_->fill(host.data(), 0.0f, static_cast<int64_t>(count), stream()));
  ExpectOk(gpu_->copy_bytes(host.data(), dev2.data(), bytes, stream()));
  Sync();
  bad = 0;
  for (size_t i = 0; i < count; ++i) bad += Bits(host[i]) != Bits(static_cast<float>(i));
  EXPECT_EQ(bad, 0) << "pinned to device to device to pinned";
  std::vector<float> plain(4);
  ExpectRefused(gpu_->copy_bytes(plain.data(), dev.data(), 16, stream()), "copy_bytes: dst");
  ExpectRefused(gpu_->copy_bytes(dev.data(), plain.data(), 16, stream()), "copy_bytes: src");
  ExpectRefused(gpu_->copy_bytes(nullptr, dev.data(), 16, stream()), "copy_bytes: dst is null");
  ExpectOk(gpu_->copy_bytes(nullptr, nullptr, 0, stream()));
}

TEST_F(AllocateTest, FailureIsResourceExhaustedNamingTheSizeAndBlamesNoLaterLaunch) {
  const size_t huge = size_t{1} << 52;  // beyond the 47-bit user address space of x86-64
  absl::StatusOr<void*> p = gpu_->allocate(huge);
  ASSERT_FALSE(p.ok());
  EXPECT_EQ(p.status().code(), absl::StatusCode::kResourceExhausted) << p.status();
  EXPECT_NE(std::string(p.status().message()).find(std::to_string(huge)), std::string::npos)
      << p.status();
  DeviceBuffer b(64 * sizeof(float));
  ExpectOk(gpu_->fill(b.f(), 1.0f, 64, stream()));
  Sync();
}

#else
// What host mode leaves to the GPU run of this file (layer_ops_cuda_test): the refusal of host
// pointers (the emulator takes host memory for device memory), two streams at once, and the
// memory entries (host_cuda_backend.h stands in for memory_cuda.cc).
TEST(HostModeTest, RuntimeTestsRunOnAGpuOnly) {
  GTEST_SKIP() << "ArgumentTest, AllocateTest and SumSquaresStreamsTest need the CUDA runtime and "
                  "a GPU: they run in layer_ops_cuda_test (tests/gpu/run.sh)";
}
#endif  // FP8RT_GPU_TEST_HOST

// These need no device: every check below runs before the first CUDA call. They go through the
// CUDA table itself (cuda_internal::kLayerOps), which CudaOps() only hands out with a device.
TEST(NoDeviceArgumentTest, EveryEntryIsSet) {
  const LayerOps& t = cuda_internal::kLayerOps;
  const void* entries[] = {
      reinterpret_cast<const void*>(t.embedding_forward),
      reinterpret_cast<const void*>(t.embedding_backward),
      reinterpret_cast<const void*>(t.rmsnorm_forward),
      reinterpret_cast<const void*>(t.rmsnorm_backward),
      reinterpret_cast<const void*>(t.attention_forward),
      reinterpret_cast<const void*>(t.attention_backward),
      reinterpret_cast<const void*>(t.attention_forward_bf16),
      reinterpret_cast<const void*>(t.attention_backward_bf16),
      reinterpret_cast<const void*>(t.gelu_forward),
      reinterpret_cast<const void*>(t.gelu_backward),
      reinterpret_cast<const void*>(t.layernorm_forward),
      reinterpret_cast<const void*>(t.layernorm_backward),
      reinterpret_cast<const void*>(t.bias_forward),
      reinterpret_cast<const void*>(t.bias_backward),
      reinterpret_cast<const void*>(t.rope_forward),
      reinterpret_cast<const void*>(t.rope_backward),
      reinterpret_cast<const void*>(t.swiglu_forward),
      reinterpret_cast<const void*>(t.swiglu_backward),
      reinterpret_cast<const void*>(t.residual_forward),
      reinterpret_cast<const void*>(t.residual_backward),
      reinterpret_cast<const void*>(t.cross_entropy_forward),
      reinterpret_cast<const void*>(t.cross_entropy_backward),
      reinterpret_cast<const void*>(t.moe_route),
      reinterpret_cast<const void*>(t.gather_rows),
      reinterpret_cast<const void*>(t.scatter_rows),
      reinterpret_cast<const void*>(t.moe_combine),
      reinterpret_cast<const void*>(t.moe_combine_backward),
      reinterpret_cast<const void*>(t.moe_router_backward),
      reinterpret_cast<const void*>(t.fill),
      reinterpret_cast<const void*>(t.copy),
      reinterpret_cast<const void*>(t.transpose),
      reinterpret_cast<const void*>(t.transpose_bytes),
      reinterpret_cast<const void*>(t.split_heads),
      reinterpret_cast<const void*>(t.join_heads),
      reinterpret_cast<const void*>(t.sum_squares),
      reinterpret_cast<const void*>(t.adamw),
      reinterpret_cast<const void*>(t.synchronize),
      reinterpret_cast<const void*>(t.allocate),
      reinterpret_cast<const void*>(t.deallocate),
      reinterpret_cast<const void*>(t.allocate_device),
      reinterpret_cast<const void*>(t.allocate_host),
      reinterpret_cast<const void*>(t.zero_bytes),
      reinterpret_cast<const void*>(t.prefetch),
      reinterpret_cast<const void*>(t.copy_bytes),
  };
  static_assert(sizeof(LayerOps) == sizeof(entries), "a LayerOps entry is missing here");
  for (size_t i = 0; i < std::size(entries); ++i) EXPECT_NE(entries[i], nullptr) << "entry " << i;
}

TEST(NoDeviceArgumentTest, NegativeSizesAreRefusedNamingTheArgument) {
  const LayerOps& t = cuda_internal::kLayerOps;
  const Stream s{};
  ExpectRefused(t.embedding_forward(nullptr, nullptr, nullptr, -1, 1, 1, s), "n is -1");
  ExpectRefused(t.embedding_forward(nullptr, nullptr, nullptr, 1, -2, 1, s), "v is -2");
  ExpectRefused(t.embedding_backward(nullptr, nullptr, nullptr, 1, 1, -3, s), "c is -3");
  ExpectRefused(t.rmsnorm_forward(nullptr, nullptr, nullptr, nullptr, -1, 4, 1e-5f, s), "n is -1");
  ExpectRefused(t.rmsnorm_backward(nullptr, nullptr, nullptr, nullptr, nullptr, nullptr, 4, -5, s),
                "c is -5");
  ExpectRefused(t.gelu_forward(nullptr, nullptr, -1, s), "n is -1");
  ExpectRefused(t.gelu_backward(nullptr, nullptr, nullptr, -1, s), "n is -1");
  ExpectRefused(t.residual_forward(nullptr, nullptr, nullptr, -1, s), "n is -1");
  ExpectRefused(t.residual_backward(nullptr, nullptr, nullptr, -1, s), "n is -1");
  ExpectRefused(t.fill(nullptr, 0.0f, -7, s), "n is -7");
  ExpectRefused(t.copy(nullptr, nullptr, -1, s), "n is -1");
  ExpectRefused(t.transpose(nullptr, nullptr, 3, -4, s), "cols is -4");
  ExpectRefused(t.split_heads(nullptr, nullptr, nullptr, nullptr, 2, -1, 1, 4, s),
                "kv_heads is -1");
  ExpectRefused(t.split_heads(nullptr, nullptr, nullptr, nullptr, 2, 1, -2, 4, s),
                "q_per_kv is -2");
  ExpectRefused(t.join_heads(nullptr, nullptr, nullptr, nullptr, 2, 1, 1, -4, s), "dh is -4");
  ExpectRefused(
      t.layernorm_forward(nullptr, nullptr, nullptr, nullptr, nullptr, nullptr, -1, 4, 1e-5f, s),
      "n is -1");
  ExpectRefused(t.layernorm_backward(nullptr, nullptr, nullptr, nullptr, nullptr, nullptr, nullptr,
                                     nullptr, 4, -5, s),
                "c is -5");
  ExpectRefused(t.bias_forward(nullptr, nullptr, -1, 4, s), "n is -1");
  ExpectRefused(t.bias_backward(nullptr, nullptr, 4, -2, s), "c is -2");
  ExpectRefused(t.rope_forward(nullptr, nullptr, 2, -3, 2, 4, 1e4f, s), "t is -3");
  ExpectRefused(t.rope_backward(nullptr, nullptr, 2, 2, -1, 4, 1e4f, s), "h is -1");
  ExpectRefused(t.swiglu_forward(nullptr, nullptr, nullptr, -1, s), "n is -1");
  ExpectRefused(t.swiglu_backward(nullptr, nullptr, nullptr, nullptr, nullptr, -6, s), "n is -6");
  // LayerNorm over no channels, RoPE over an odd or empty head or no sequence, bad eps / theta.
  ExpectRefused(
      t.layernorm_forward(nullptr, nullptr, nullptr, nullptr, nullptr, nullptr, 2, 0, 1e-5f, s),
      "c is 0");
  ExpectRefused(t.layernorm_backward(nullptr, nullptr, nullptr, nullptr, nullptr, nullptr, nullptr,
                                     nullptr, 2, 0, s),
                "c is 0");
  ExpectRefused(
      t.layernorm_forward(nullptr, nullptr, nullptr, nullptr, nullptr, nullptr, 2, 4, -1.0f, s),
      "eps is -1");
  ExpectRefused(t.rope_forward(nullptr, nullptr, 2, 2, 2, 5, 1e4f, s), "dh is 5");
  ExpectRefused(t.rope_forward(nullptr, nullptr, 2, 2, 2, 0, 1e4f, s), "dh is 0");
  ExpectRefused(t.rope_backward(nullptr, nullptr, 2, 0, 2, 4, 1e4f, s), "t is 0");
  ExpectRefused(t.rope_forward(nullptr, nullptr, 2, 2, 2, 4, 0.0f, s), "theta is 0");
  ExpectRefused(t.rope_backward(nullptr, nullptr, 2, 2, 2, 4, -5.0f, s), "theta is -5");
  ExpectRefused(
      t.rope_forward(nullptr, nullptr, 2, 2, 2, 4, std::numeric_limits<float>::infinity(), s),
      "theta is inf");
  ExpectRefused(t.sum_squares(nullptr, -1, nullptr, s), "count is -1");
  AdamWArgs k;
  k.count = -1;
  ExpectRefused(t.adamw(k, s), "count is -1");
  // rmsnorm_forward over no channels: the mean is 0 / 0 (the CPU aborts on it).
  ExpectRefused(t.rmsnorm_forward(nullptr, nullptr, nullptr, nullptr, 2, 0, 1e-5f, s), "c is 0");
}

TEST(NoDeviceArgumentTest, NullPointersWithWorkAreRefusedNamingThem) {
  const LayerOps& t = cuda_internal::kLayerOps;
  const Stream s{};
  float dummy = 0.0f;  // never dereferenced: the null check comes first
  float* p = &dummy;
  ExpectRefused(t.residual_forward(p, p, nullptr, 4, s), "b is null");
  ExpectRefused(t.layernorm_forward(p, p, p, p, p, nullptr, 2, 2, 1e-5f, s), "bias is null");
  ExpectRefused(t.layernorm_backward(p, nullptr, p, p, p, p, p, p, 2, 2, s), "dweight is null");
  ExpectRefused(t.bias_backward(p, nullptr, 2, 2, s), "dout is null");
  ExpectRefused(t.rope_forward(nullptr, p, 2, 2, 1, 2, 1e4f, s), "out is null");
  ExpectRefused(t.rope_backward(p, p, 2, 2, 1, 2, 1e4f, s), "dx aliases dout");
  ExpectRefused(t.swiglu_backward(p, p, p, p, nullptr, 2, s), "up is null");
  ExpectRefused(t.embedding_backward(p, p, nullptr, 4, 2, 2, s), "tokens is null");
  ExpectRefused(t.sum_squares(p, 0, nullptr, s), "out is null");  // count 0 still writes *out
  AdamWArgs k;
  k.count = 3;
  k.master = p;
  k.grad = p;
  k.m = p;
  ExpectRefused(t.adamw(k, s), "v is null");
}

TEST(NoDeviceArgumentTest, EmptyOpsSucceedWithoutTouchingAnything) {
  const LayerOps& t = cuda_internal::kLayerOps;
  const Stream s{};
  EXPECT_TRUE(t.embedding_forward(nullptr, nullptr, nullptr, 0, 5, 3, s).ok());
  EXPECT_TRUE(t.embedding_backward(nullptr, nullptr, nullptr, 4, 5, 0, s).ok());
  EXPECT_TRUE(t.rmsnorm_forward(nullptr, nullptr, nullptr, nullptr, 0, 8, 1e-5f, s).ok());
  EXPECT_TRUE(
      t.rmsnorm_backward(nullptr, nullptr, nullptr, nullptr, nullptr, nullptr, 0, 8, s).ok());
  EXPECT_TRUE(t.gelu_forward(nullptr, nullptr, 0, s).ok());
  EXPECT_TRUE(t.gelu_backward(nullptr, nullptr, nullptr, 0, s).ok());
  EXPECT_TRUE(t.residual_forward(nullptr, nullptr, nullptr, 0, s).ok());
  EXPECT_TRUE(t.residual_backward(nullptr, nullptr, nullptr, 0, s).ok());
  EXPECT_TRUE(t.fill(nullptr, 1.0f, 0, s).ok());
  EXPECT_TRUE(t.copy(nullptr, nullptr, 0, s).ok());
  EXPECT_TRUE(t.transpose(nullptr, nullptr, 0, 9, s).ok());
  EXPECT_TRUE(t.split_heads(nullptr, nullptr, nullptr, nullptr, 3, 0, 2, 4, s).ok());
  EXPECT_TRUE(t.join_heads(nullptr, nullptr, nullptr, nullptr, 0, 2, 2, 4, s).ok());
  EXPECT_TRUE(
      t.layernorm_forward(nullptr, nullptr, nullptr, nullptr, nullptr, nullptr, 0, 8, 1e-5f, s)
          .ok());
  EXPECT_TRUE(t.layernorm_backward(nullptr, nullptr, nullptr, nullptr, nullptr, nullptr, nullptr,
                                   nullptr, 0, 8, s)
                  .ok());
  EXPECT_TRUE(t.bias_forward(nullptr, nullptr, 4, 0, s).ok());
  EXPECT_TRUE(t.bias_backward(nullptr, nullptr, 0, 4, s).ok());
  EXPECT_TRUE(t.rope_forward(nullptr, nullptr, 0, 0, 2, 3, 1e4f, s).ok());
  EXPECT_TRUE(t.rope_backward(nullptr, nullptr, 4, 2, 0, 4, 1e4f, s).ok());
  EXPECT_TRUE(t.swiglu_forward(nullptr, nullptr, nullptr, 0, s).ok());
  EXPECT_TRUE(t.swiglu_backward(nullptr, nullptr, nullptr, nullptr, nullptr, 0, s).ok());
  EXPECT_TRUE(t.adamw(AdamWArgs{}, s).ok());
}

}  // namespace
}  // namespace fp8rt::kernels
