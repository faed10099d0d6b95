// The CUDA-core GEMM kernels (kernels/cuda/gemm_kernels.cu: the fallback GEMM for what cuBLASLt
// does not run, the block-scale and mx32-scale layouts cuBLASLt reads, the FP32 -> BF16 rounding
// of the BF16 GEMM's operands) run on the CPU: their own source, compiled here as host code over
// the block emulator of host_cuda.h. Needs no GPU and no CUDA runtime, so it runs in every CI
// pass; ops_cuda_test holds the same kernels to the CPU backend through the op table on a GPU.
//
// What the fallback GEMM must give (gemm_kernels.h): every output element is a sequential FP32
// FMA chain over k (each FP8 or BF16 product is exact in FP32, so each step rounds once), zero
// padding beyond K changing nothing; with tensor scaling then (sa * sb) * sum [+ D]; with block
// scaling one chain per 128-wide slice of K, added in slice order as D += (sa(m, kb) * sb(n/128,
// kb)) * sum_kb onto 0 or D; with mx32 each element times its block's E8M0 scale as it is loaded.
// That order is computed here on the host from the formats' decodings (kernels/formats.h), and
// the kernel must give exactly its bits: a tile, index or barrier error changes them. Each result
// is also held to the exact value (FP64) within the bound of that order (Higham, "Accuracy and
// Stability of Numerical Algorithms", section 3.1: gamma_n = n u / (1 - n u), u = 2^-24).
//
// Index:
//   FallbackGemmHostTest (TEST_P)  operand pairs (E4M3/E5M2 in every combination, BF16 x BF16)
//                                  x scaling (tensor; block and mx32 for FP8) x accumulate x
//                                  output (F32, BF16) over shapes with ragged tiles and K slices
//   FallbackGemmHostTest.TooManyRowTilesIsRefused   grid_m > 65535 is an error, nothing runs
//   BlockScaleLayoutHostTest, Mx32ScaleLayoutHostTest   the layouts cuBLASLt documents
//   RoundToBf16HostTest              every class of float, bit for bit FloatToBf16
#include <gtest/gtest.h>

#include <bit>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <random>
#include <string>
#include <tuple>
#include <vector>

#include "absl/strings/str_cat.h"
#include "kernels/formats.h"
#include "kernels/gemm.h"
#include "tests/gpu/host_cuda.h"  // before the kernels' file: it defines what their source needs

// The kernels' file, compiled here under another namespace name (host_cuda_backend.h).
// The stand-ins first (host_cuda_backend.h refuses to come after the file).
// clang-format off
#define cuda_internal host_cuda_internal
#include "tests/gpu/host_cuda_backend.h"
#include "kernels/cuda/gemm_kernels.cu"  // NOLINT(build/include): the kernels under test
#undef cuda_internal
// clang-format on

namespace fp8rt::kernels {
namespace {

namespace device = host_cuda_internal;
using device::FallbackGemmParams;
using device::OperandKind;

constexpr double kU = 0x1p-24;

// --- operands
// -------------------------------------------------------------------------------------

// An operand as the kernel reads it: one FP8 code per element, or BF16 bits.
struct Operand {
  OperandKind kind = OperandKind::kE4M3;
  std::vector<uint8_t> codes;
  std::vector<uint16_t> bf16;
  const void* data() const {
    return kind == OperandKind::kBF16 ? static_cast<const void*>(bf16.data())
                                      : static_cast<const void*>(codes.data());
  }
};

float Value(const Operand& o, int64_t i) {
  const size_t at = static_cast<size_t>(i);
  switch (o.kind) {
    case OperandKind::kE4M3:
      return DecodeFp8(o.codes[at], Fp8Format::kE4M3);
    case OperandKind::kE5M2:
      return DecodeFp8(o.codes[at], Fp8Format::kE5M2);
    case OperandKind::kBF16:
      return Bf16ToFloat(o.bf16[at]);
  }
  return NAN;
}

// Random finite values: FP8 codes over the whole finite range (subnormals and zeros included),
// BF16 roundings of normal values.
Operand RandomOperand(OperandKind kind, int64_t count, uint32_t seed) {
  std::mt19937 rng(seed);
  Operand o;
  o.kind = kind;
  if (kind == OperandKind::kBF16) {
    std::normal_distribution<float> normal(0.0f, 1.0f);
    for (int64_t i = 0; i < count; ++i) o.bf16.push_back(FloatToBf16(normal(rng)));
    return o;
  }
  const Fp8Format format = kind == OperandKind::kE4M3 ? Fp8Format::kE4M3 : Fp8Format::kE5M2;
  while (static_cast<int64_t>(o.codes.size()) < count) {
    const auto code = static_cast<uint8_t>(rng());
    if (std::isfinite(DecodeFp8(code, format))) o.codes.push_back(code);
  }
  return o;
}

std::string KindName(OperandKind k) {
  return k == OperandKind::kE4M3 ? "E4M3" : k == OperandKind::kE5M2 ? "E5M2" : "BF16";
}
std::string ScalingName(GemmScaling s) {
  return s == GemmScaling::kTensor ? "Tensor" : s == GemmScaling::kBlock ? "Block" : "Mx32";
}

// --- the case
// -------------------------------------------------------------------------------------

struct Shape {
  int64_t m, n, k;
};
// D's output type, and whether the GEMM adds onto D (FP32 output only, kernels/gemm.h).
struct Epilogue {
  bool accumulate;
  OutputType out;
};
using GemmCase = std::tuple<std::tuple<OperandKind, OperandKind>, GemmScaling, Epilogue>;

struct Problem {
  Shape s;
  Operand a, b;
  GemmScaling scaling = GemmScaling::kTensor;
  bool accumulate = false;
  OutputType out = OutputType::kF32;
  std::vector<float> a_scale_inv, b_scale_inv;  // tensor: 1 value each (empty: none, BF16)
  std::vector<uint8_t> a_e8m0, b_e8m0;          // mx32: rows x ceil(K / 32)
  std::vector<float> d0;                        // D before the GEMM (accumulate)

  int64_t SliceCount() const { return (s.k + 127) / 128; }
  // A(m, k) and B(n, k) as the kernel multiplies them (with mx32, times their blocks' scales):
  // decoded once, by Decode.
  std::vector<float> a_values, b_values;
  float A(int64_t m, int64_t k) const { return a_values[static_cast<size_t>(m * s.k + k)]; }
  float B(int64_t n, int64_t k) const { return b_values[static_cast<size_t>(n * s.k + k)]; }
  float Sa(int64_t m, int64_t kb) const {
    return a_scale_inv[static_cast<size_t>(m * SliceCount() + kb)];
  }
  float Sb(int64_t n, int64_t kb) const {
    return b_scale_inv[static_cast<size_t>((n / 128) * SliceCount() + kb)];
  }
};

Problem MakeProblem(const Shape& s, const GemmCase& c, uint32_t seed) {
  Problem p;
  p.s = s;
  const auto& [kinds, scaling, epilogue] = c;
  const bool accumulate = epilogue.accumulate;
  p.a = RandomOperand(std::get<0>(kinds), s.m * s.k, seed);
  p.b = RandomOperand(std::get<1>(kinds), s.n * s.k, seed + 1);
  p.scaling = scaling;
  p.accumulate = accumulate;
  p.out = epilogue.out;
  std::mt19937 rng(seed + 2);
  std::uniform_real_distribution<float> scale(0.01f, 4.0f);
  const bool bf16 = std::get<0>(kinds) == OperandKind::kBF16;
  if (scaling == GemmScaling::kTensor && !bf16) {
    p.a_scale_inv = {scale(rng)};
    p.b_scale_inv = {scale(rng)};
  } else if (scaling == GemmScaling::kBlock) {
    for (int64_t i = 0; i < s.m * p.SliceCount(); ++i) p.a_scale_inv.push_back(scale(rng));
    for (int64_t i = 0; i < (s.n + 127) / 128 * p.SliceCount(); ++i) {
      p.b_scale_inv.push_back(scale(rng));
    }
  } else if (scaling == GemmScaling::kMx32) {
    // 2^-10 ... 2^10: every scaled value stays a normal FP32 value, so the scaling is exact.
    std::uniform_int_distribution<int> e(117, 137);
    const int64_t kb32 = (s.k + 31) / 32;
    for (int64_t i = 0; i < s.m * kb32; ++i) p.a_e8m0.push_back(static_cast<uint8_t>(e(rng)));
    for (int64_t i = 0; i < s.n * kb32; ++i) p.b_e8m0.push_back(static_cast<uint8_t>(e(rng)));
  }
  std::normal_distribution<float> normal(0.0f, 3.0f);
  for (int64_t i = 0; i < s.m * s.n; ++i) p.d0.push_back(accumulate ? normal(rng) : NAN);
  // The operands' values, and with mx32 each times its 1x32 block's scale (exact here).
  const auto decode = [&](const Operand& o, int64_t rows, const std::vector<uint8_t>& e8m0) {
    std::vector<float> v(static_cast<size_t>(rows * s.k));
    const int64_t kb32 = (s.k + 31) / 32;
    for (int64_t r = 0; r < rows; ++r) {
      for (int64_t k = 0; k < s.k; ++k) {
        float x = Value(o, r * s.k + k);
        if (scaling == GemmScaling::kMx32) {
          x = __fmul_rn(x, DecodeE8M0(e8m0[static_cast<size_t>(r * kb32 + k / 32)]));
        }
        v[static_cast<size_t>(r * s.k + k)] = x;
      }
    }
    return v;
  };
  p.a_values = decode(p.a, s.m, p.a_e8m0);
  p.b_values = decode(p.b, s.n, p.b_e8m0);
  return p;
}

// The sequential FMA chain over k in [k0, k1) of row m of A and row n of B.
float Chain(const Problem& p, int64_t m, int64_t n, int64_t k0, int64_t k1) {
  float sum = 0.0f;
  for (int64_t k = k0; k < k1; ++k) sum = std::fma(p.A(m, k), p.B(n, k), sum);
  return sum;
}

// Element (m, n) in the documented order, before the output's rounding to BF16.
float DocumentedOrder(const Problem& p, int64_t m, int64_t n) {
  const float d0 = p.d0[static_cast<size_t>(m * p.s.n + n)];
  if (p.scaling == GemmScaling::kBlock) {
    float acc = p.accumulate ? d0 : 0.0f;
    for (int64_t kb = 0; kb < p.SliceCount(); ++kb) {
      const float sum = Chain(p, m, n, kb * 128, std::min(p.s.k, (kb + 1) * 128));
      acc = __fadd_rn(acc, __fmul_rn(__fmul_rn(p.Sa(m, kb), p.Sb(n, kb)), sum));
    }
    return acc;
  }
  const float alpha = p.a_scale_inv.empty() ? 1.0f : __fmul_rn(p.a_scale_inv[0], p.b_scale_inv[0]);
  const float v = __fmul_rn(alpha, Chain(p, m, n, 0, p.s.k));
  return p.accumulate ? __fadd_rn(d0, v) : v;
}

// The exact result (FP64: each product and scale product is exact there, the sums nearly so) and
// the bound on its distance from the documented order: every FP32 rounding of that order, at
// most gamma of its count times the magnitudes it rounds.
void ExactAndBound(const Problem& p, int64_t m, int64_t n, double* exact, double* bound) {
  const double d0 = p.accumulate ? p.d0[static_cast<size_t>(m * p.s.n + n)] : 0.0;
  double sum = d0, magnitude = std::abs(d0);
  int64_t roundings = 3;  // tensor: sa * sb, alpha * sum, + D
  if (p.scaling == GemmScaling::kBlock) {
    for (int64_t kb = 0; kb < p.SliceCount(); ++kb) {
      const double s = static_cast<double>(p.Sa(m, kb)) * p.Sb(n, kb);
      double slice = 0.0, slice_abs = 0.0;
      for (int64_t k = kb * 128; k < std::min(p.s.k, (kb + 1) * 128); ++k) {
        const double t = static_cast<double>(p.A(m, k)) * p.B(n, k);
        slice += t;
        slice_abs += std::abs(t);
      }
      sum += s * slice;
      magnitude += std::abs(s) * slice_abs;
    }
    roundings += 128 + p.SliceCount() - 1;  // a slice's chain, sa * sb, s * sum, the adds
  } else {
    const double alpha =
        p.a_scale_inv.empty() ? 1.0 : static_cast<double>(p.a_scale_inv[0]) * p.b_scale_inv[0];
    double dot = 0.0, dot_abs = 0.0;
    for (int64_t k = 0; k < p.s.k; ++k) {
      const double t = static_cast<double>(p.A(m, k)) * p.B(n, k);
      dot += t;
      dot_abs += std::abs(t);
    }
    sum += alpha * dot;
    magnitude += std::abs(alpha) * dot_abs;
    roundings += p.s.k;
  }
  *exact = sum;
  const double gamma = static_cast<double>(roundings) * kU / (1.0 - roundings * kU);
  *bound = gamma * magnitude;
}

// Runs the kernel on p; D as F32 values (BF16 outputs widened).
std::vector<float> RunKernel(const Problem& p) {
  const size_t count = static_cast<size_t>(p.s.m * p.s.n);
  std::vector<float> d_f32 = p.d0;
  std::vector<uint16_t> d_bf16(count, 0xFFFF);
  FallbackGemmParams f;
  f.m = p.s.m;
  f.n = p.s.n;
  f.k = p.s.k;
  f.a = p.a.data();
  f.a_kind = p.a.kind;
  f.b = p.b.data();
  f.b_kind = p.b.kind;
  f.scaling = p.scaling;
  f.a_scale_inv = p.a_scale_inv.empty() ? nullptr : p.a_scale_inv.data();
  f.b_scale_inv = p.b_scale_inv.empty() ? nullptr : p.b_scale_inv.data();
  f.a_e8m0 = p.a_e8m0.empty() ? nullptr : p.a_e8m0.data();
  f.b_e8m0 = p.b_e8m0.empty() ? nullptr : p.b_e8m0.data();
  f.out_type = p.out;
  f.d = p.out == OutputType::kF32 ? static_cast<void*>(d_f32.data())
                                  : static_cast<void*>(d_bf16.data());
  f.accumulate = p.accumulate;
  EXPECT_EQ(device::LaunchFallbackGemm(f, nullptr), cudaSuccess) << device::LastLaunchError();
  if (p.out == OutputType::kF32) return d_f32;
  std::vector<float> widened(count);
  for (size_t i = 0; i < count; ++i) widened[i] = Bf16ToFloat(d_bf16[i]);
  return widened;
}

class FallbackGemmHostTest : public ::testing::TestWithParam<GemmCase> {};

// One element, K below one step of 32, whole 64 x 64 tiles with K one slice, and ragged tiles
// both ways with K over several 32-steps and 128-slices (the last ones partial).
constexpr Shape kShapes[] = {{1, 1, 1}, {5, 7, 33}, {64, 64, 128}, {70, 130, 300}, {129, 65, 260}};

TEST_P(FallbackGemmHostTest, IsTheDocumentedOrderWithinTheBoundOfTheExactResult) {
  uint32_t seed = 1;
  for (const Shape& s : kShapes) {
    SCOPED_TRACE(absl::StrCat(s.m, " x ", s.n, " x ", s.k));
    const Problem p = MakeProblem(s, GetParam(), seed += 7);
    const std::vector<float> got = RunKernel(p);
    int64_t not_bits = 0, out_of_bound = 0;
    std::string first_bits, first_bound;
    for (int64_t m = 0; m < s.m; ++m) {
      for (int64_t n = 0; n < s.n; ++n) {
        float want = DocumentedOrder(p, m, n);
        if (p.out == OutputType::kBF16) want = Bf16ToFloat(FloatToBf16(want));
        const float g = got[static_cast<size_t>(m * s.n + n)];
        if (std::bit_cast<uint32_t>(g) != std::bit_cast<uint32_t>(want) && not_bits++ == 0) {
          first_bits = absl::StrCat("(", m, ", ", n, "): kernel ", g, ", documented order ", want);
        }
        double exact = 0.0, bound = 0.0;
        ExactAndBound(p, m, n, &exact, &bound);
        // The BF16 output rounds once more: half an ulp of 8 bits.
        if (p.out == OutputType::kBF16) bound += 0x1p-8 * std::abs(exact) + 0x1p-8 * bound;
        if (!(std::abs(g - exact) <= bound) && out_of_bound++ == 0) {
          first_bound =
              absl::StrCat("(", m, ", ", n, "): kernel ", g, ", exact ", exact, ", bound ", bound);
        }
      }
    }
    EXPECT_EQ(not_bits, 0) << "elements not the documented order's bits; first " << first_bits;
    EXPECT_EQ(out_of_bound, 0) << "elements outside the bound; first " << first_bound;
  }
}

TEST(FallbackGemmLimitsHostTest, TooManyRowTilesIsRefused) {
  FallbackGemmParams f;
  f.m = int64_t{65536} * 64;  // 65536 row tiles: one more than a grid's y extent
  f.n = 1;
  f.k = 1;
  EXPECT_EQ(device::LaunchFallbackGemm(f, nullptr), cudaErrorInvalidConfiguration);
}

using Kinds = std::tuple<OperandKind, OperandKind>;
const Kinds kFp8Pairs[] = {{OperandKind::kE4M3, OperandKind::kE4M3},
                           {OperandKind::kE4M3, OperandKind::kE5M2},
                           {OperandKind::kE5M2, OperandKind::kE4M3},
                           {OperandKind::kE5M2, OperandKind::kE5M2}};

std::string CaseName(const ::testing::TestParamInfo<GemmCase>& info) {
  const auto& [kinds, scaling, epilogue] = info.param;
  return absl::StrCat(KindName(std::get<0>(kinds)), "x", KindName(std::get<1>(kinds)), "_",
                      ScalingName(scaling), epilogue.accumulate ? "_Accumulate" : "",
                      epilogue.out == OutputType::kF32 ? "_F32" : "_BF16");
}

const Epilogue kEpilogues[] = {
    {false, OutputType::kF32}, {true, OutputType::kF32}, {false, OutputType::kBF16}};

INSTANTIATE_TEST_SUITE_P(Fp8, FallbackGemmHostTest,
                         ::testing::Combine(::testing::ValuesIn(kFp8Pairs),
                                            ::testing::Values(GemmScaling::kTensor,
                                                              GemmScaling::kBlock,
                                                              GemmScaling::kMx32),
                                            ::testing::ValuesIn(kEpilogues)),
                         CaseName);
INSTANTIATE_TEST_SUITE_P(
    Bf16, FallbackGemmHostTest,
    ::testing::Combine(::testing::Values(Kinds{OperandKind::kBF16, OperandKind::kBF16}),
                       ::testing::Values(GemmScaling::kTensor), ::testing::ValuesIn(kEpilogues)),
    CaseName);

// --- scale layouts
// --------------------------------------------------------------------------------

// VEC128_32F for A: a_out[kb * m_pad + m] = a_scale_inv[m * kb_count + kb]; BLK128x128_32F for B:
// b_out[nb * kb_pad + kb] = b_scale_inv[nb * kb_count + kb]; padding 0 (gemm_kernels.h).
TEST(BlockScaleLayoutHostTest, PutsEveryScaleWhereCublasLtReadsItAndPadsWithZero) {
  struct Case {
    int64_t m, kb_count, nb_count;
  };
  for (const Case& c : {Case{1, 1, 1}, Case{5, 3, 2}, Case{130, 7, 3}, Case{4, 4, 1}}) {
    SCOPED_TRACE(absl::StrCat("m ", c.m, " kb ", c.kb_count, " nb ", c.nb_count));
    const int64_t m_pad = (c.m + 3) / 4 * 4, kb_pad = (c.kb_count + 3) / 4 * 4;
    std::vector<float> a(static_cast<size_t>(c.m * c.kb_count));
    std::vector<float> b(static_cast<size_t>(c.nb_count * c.kb_count));
    for (size_t i = 0; i < a.size(); ++i) a[i] = 1.0f + static_cast<float>(i);
    for (size_t i = 0; i < b.size(); ++i) b[i] = -1.0f - static_cast<float>(i);
    std::vector<float> a_out(static_cast<size_t>(c.kb_count * m_pad), NAN);
    std::vector<float> b_out(static_cast<size_t>(c.nb_count * kb_pad), NAN);
    ASSERT_EQ(device::LaunchBlockScaleLayout(a.data(), c.m, c.kb_count, a_out.data(), m_pad,
                                             b.data(), c.nb_count, b_out.data(), kb_pad, nullptr),
              cudaSuccess);
    for (int64_t kb = 0; kb < c.kb_count; ++kb) {
      for (int64_t m = 0; m < m_pad; ++m) {
        const float want = m < c.m ? a[static_cast<size_t>(m * c.kb_count + kb)] : 0.0f;
        EXPECT_EQ(a_out[static_cast<size_t>(kb * m_pad + m)], want) << "A kb " << kb << " m " << m;
      }
    }
    for (int64_t nb = 0; nb < c.nb_count; ++nb) {
      for (int64_t kb = 0; kb < kb_pad; ++kb) {
        const float want = kb < c.kb_count ? b[static_cast<size_t>(nb * c.kb_count + kb)] : 0.0f;
        EXPECT_EQ(b_out[static_cast<size_t>(nb * kb_pad + kb)], want)
            << "B nb " << nb << " kb " << kb;
      }
    }
  }
}

// cuBLAS's "1D block scaling factors layout" for VEC32_UE8M0: tiles of 128 rows x 4 columns, 512
// bytes each, band-major along K; row r, column c of a tile at (r % 32) * 16 + (r % 128) / 32 * 4
// + c; rows padded to 128 and columns to 4 with 127 (2^0).
TEST(Mx32ScaleLayoutHostTest, PutsEveryCodeWhereCublasLtReadsItAndPadsWithOne) {
  struct Case {
    int64_t rows, cols;
  };
  for (const Case& c : {Case{1, 1}, Case{3, 5}, Case{130, 8}, Case{300, 3}}) {
    SCOPED_TRACE(absl::StrCat(c.rows, " x ", c.cols));
    std::mt19937 rng(static_cast<uint32_t>(c.rows * 1000 + c.cols));
    std::vector<uint8_t> src(static_cast<size_t>(c.rows * c.cols));
    for (uint8_t& v : src) v = static_cast<uint8_t>(rng() % 127);  // never the padding's 127
    const int64_t bytes = device::Mx32TiledBytes(c.rows, c.cols);
    const int64_t rows_pad = (c.rows + 127) / 128 * 128, cols_pad = (c.cols + 3) / 4 * 4;
    ASSERT_EQ(bytes, rows_pad * cols_pad);
    std::vector<uint8_t> dst(static_cast<size_t>(bytes), 0xEE);
    ASSERT_EQ(device::LaunchMx32ScaleLayout(src.data(), c.rows, c.cols, dst.data(), nullptr),
              cudaSuccess);
    for (int64_t r = 0; r < rows_pad; ++r) {
      for (int64_t col = 0; col < cols_pad; ++col) {
        const int64_t tile = (r / 128) * (cols_pad / 4) + col / 4;
        const int64_t at = tile * 512 + (r % 32) * 16 + (r % 128) / 32 * 4 + col % 4;
        const uint8_t want =
            r < c.rows && col < c.cols ? src[static_cast<size_t>(r * c.cols + col)] : 127;
        ASSERT_EQ(dst[static_cast<size_t>(at)], want) << "row " << r << " col " << col;
      }
    }
  }
}

// --- BF16 rounding
// --------------------------------------------------------------------------------

TEST(RoundToBf16HostTest, EveryClassOfFloatIsFloatToBf16BitForBit) {
  for (const int64_t n : {int64_t{1}, int64_t{1000}, int64_t{70001}}) {
    std::mt19937 rng(static_cast<uint32_t>(n));
    std::vector<float> in(static_cast<size_t>(n));
    for (float& v : in) v = std::bit_cast<float>(static_cast<uint32_t>(rng()));
    // Ties to even both ways, the largest finite value rounding to Inf, signed zeros, NaNs.
    const uint32_t specials[] = {0x3F808000u, 0x3F818000u, 0x7F7FFFFFu, 0x80000000u,
                                 0x7FC00001u, 0xFF800001u, 0x00000001u, 0x7F800000u};
    for (size_t i = 0; i < std::size(specials) && i < in.size(); ++i) {
      in[i] = std::bit_cast<float>(specials[i]);
    }
    std::vector<uint16_t> out(static_cast<size_t>(n), 0);
    ASSERT_EQ(device::LaunchRoundToBf16(in.data(), n, out.data(), nullptr), cudaSuccess);
    int64_t bad = 0;
    for (size_t i = 0; i < in.size(); ++i) {
      if (out[i] != FloatToBf16(in[i]) && bad++ == 0) {
        ADD_FAILURE() << "first at " << i << ": bits " << std::bit_cast<uint32_t>(in[i])
                      << " -> kernel " << out[i] << ", FloatToBf16 " << FloatToBf16(in[i]);
      }
    }
    EXPECT_EQ(bad, 0) << "n " << n;
  }
}

}  // namespace
}  // namespace fp8rt::kernels
