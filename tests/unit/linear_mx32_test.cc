// Tests of model::Linear's MXFP8 ("mx32") training path (runtime/model/linear.h) and of
// parallel::QuantizeMx32Both on the CPU op table, against a reference written here from OCP MX
// v1.0 (section 6.3, as Transformer Engine's MXFP8BlockScaling applies it) and OFP8 v1.0:
//   every block of 32 consecutive values along a GEMM's K shares the E8M0 scale
//   X = 2^(floor(log2(amax_block)) - emax), emax 8 (E4M3) or 15 (E5M2), the exponent clamped to
//   [-127, 127] and -127 for an all-zero block; each element is FP8(x / X), round to nearest
//   even, saturating to the largest finite value (448 E4M3, 57344 E5M2); the last block of a row
//   may be partial. The reference derives exponents from std::ilogb and encodes by searching the
//   FP8 values it decodes from the format's fields; it calls none of the library's quantization
//   helpers (EncodeFp8, Mx32ScaleExponent, E8M0FromExponent, GetScaleGrid).
//
// Index:
//   LinearMx32Test (TEST_P)  shape (partial 1x32 blocks along in, out and the tokens) x grad
//                            format (E4M3, hybrid E5M2):
//     ForwardAndBackwardMatchTheDoubleReferenceOfSpecQuantizedOperands
//         y = Q(x) Q(W)^T (both along in); dx += Q(dy) Q_col(W) (dy along out, W in 32x1 blocks
//         down its columns); dw += Q(dy^T) Q(x^T)^T (both along the tokens); the weight's four
//         arrays come from the reference, so the layer's own quantizations of x, x^T, dy, dy^T
//         are what is tested; dx and dw start nonzero (gradients accumulate); the input and
//         grad_output sites record amax, count and saturations after FlushStats
//     NullInputGradientSkipsDxAndDwAccumulatesOverBackwardCalls
//         Backward(dx = nullptr) twice after one forward: dw = init + 2 * reference
//   QuantizeMx32BothTest     codes, e8m0, col_codes, col_e8m0 and the statistics of the shapes
//                            above, both formats, bit for bit
//
// Data: every value is uniform in (-1, 1) times 2^k, k depending on the 32x32 tile and the row,
// so that neighbouring blocks (both ways) get different scales; one all-zero block in each
// operand both ways (E8M0 code 0); the random mantissas make some blocks saturate (a block amax
// with mantissa above 1.75 puts it above the largest finite FP8 value).
//
// Tolerance of the GEMMs: the reference sums, in double, the products of the reference-decoded
// operands. Decoded MX values have at most 4 significant bits (E4M3) times a power of two, so
// they are exact in BF16 (the CPU mx32 GEMM decodes to FP32 then runs the BF16 GEMM) and their
// products (<= 8 bits) are exact in FP32; nothing here comes near FP32's under- or overflow. The
// only errors are then the FP32 additions: K - 1 of them, in any order, each with a relative error
// <= u = 2^-24 of a partial sum bounded by S = sum |products|, plus the rounding of the
// accumulation into D (<= u (|D0| + S)). So |got - want| <= (K + 2) u (S + |D0|) is a rigorous
// bound (the K u S term bounds the first-order error, the rest covers the second-order terms);
// for K <= 96 that is about 6e-6 of S: a single FP8 code off by one step (2^-3 relative for
// E4M3) in any product that matters is far outside it.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <ostream>
#include <random>
#include <set>
#include <string>
#include <tuple>
#include <vector>

#include "absl/status/status.h"
#include "gtest/gtest.h"
#include "kernels/device_array.h"
#include "kernels/formats.h"
#include "kernels/ops.h"
#include "kernels/quantize.h"
#include "parallel/fp8_collectives.h"
#include "runtime/model/linear.h"
#include "runtime/train/scaling.h"

namespace fp8rt::model {
namespace {

using kernels::Fp8Format;

// ---------------------------------------------------------------------------------------------
// The reference, from OFP8 v1.0 and OCP MX v1.0.

struct RefFormat {
  int mbits;         // explicit mantissa bits
  int bias;          // exponent bias
  uint8_t max_code;  // code of the largest finite value (S.1111.110 E4M3, S.11110.11 E5M2)
  int emax;          // exponent of the largest power of two <= max
};
RefFormat Ref(Fp8Format f) {
  return f == Fp8Format::kE4M3 ? RefFormat{3, 7, 0x7E, 8} : RefFormat{2, 15, 0x7B, 15};
}

// The magnitude of a finite non-negative code (0 .. max_code), from its fields, in double.
double RefMagnitude(uint8_t code, Fp8Format f) {
  const RefFormat r = Ref(f);
  const int e = code >> r.mbits;
  const int m = code & ((1 << r.mbits) - 1);
  if (e == 0) return std::ldexp(m, 1 - r.bias - r.mbits);  // subnormal
  return std::ldexp((1 << r.mbits) + m, e - r.bias - r.mbits);
}
double RefDecode(uint8_t code, Fp8Format f) {
  const double v = RefMagnitude(code & 0x7F, f);
  return (code & 0x80) ? -v : v;
}

// y -> FP8, round to nearest even, saturating: the code of the nearest finite value (ties to the
// even code, i.e. the even mantissa), |y| >= max giving +-max; the sign is kept (also on zero).
uint8_t RefEncode(double y, Fp8Format f) {
  const RefFormat r = Ref(f);
  const uint8_t sign = std::signbit(y) ? 0x80 : 0x00;
  const double a = std::fabs(y);
  if (a >= RefMagnitude(r.max_code, f)) return sign | r.max_code;
  uint8_t lo = 0;  // the largest code whose value is <= a (values grow with the code)
  while (RefMagnitude(lo + 1, f) <= a) ++lo;
  const double below = a - RefMagnitude(lo, f);
  const double above = RefMagnitude(lo + 1, f) - a;
  uint8_t code = below < above ? lo : above < below ? lo + 1 : (lo % 2 == 0 ? lo : lo + 1);
  return sign | code;
}

// True when |y| rounds (nearest even) past the largest finite value, i.e. to max + ulp(max) had
// the format one more value: what QuantStats::saturated counts.
bool RefRoundsPastMax(double y, Fp8Format f) {
  const RefFormat r = Ref(f);
  const double max = RefMagnitude(r.max_code, f);
  const double mid = max + std::ldexp(1.0, r.emax - r.mbits - 1);  // max + ulp/2
  const double a = std::fabs(y);
  return a > mid || (a == mid && r.max_code % 2 == 1);  // a tie goes to the even neighbour
}

// OCP MX v1.0 section 6.3: floor(log2(amax)) - emax, clamped to the E8M0 range; -127 for 0.
int RefExponent(float amax, Fp8Format f) {
  if (amax == 0.0f) return -127;
  return std::clamp(std::ilogb(amax) - Ref(f).emax, -127, 127);
}

// A rows x cols FP32 matrix quantized in 1x32 blocks along its rows.
struct RefMx {
  int64_t rows = 0, cols = 0, blocks = 0;  // blocks per row: ceil(cols / 32)
  std::vector<uint8_t> codes;              // rows x cols
  std::vector<uint8_t> e8m0;               // rows x blocks
  std::vector<double> value;               // decoded: code value * 2^exponent
  int64_t saturated = 0;
};
RefMx RefQuantize(const std::vector<float>& x, int64_t rows, int64_t cols, Fp8Format f) {
  RefMx q;
  q.rows = rows;
  q.cols = cols;
  q.blocks = (cols + 31) / 32;
  q.codes.resize(static_cast<size_t>(rows * cols));
  q.value.resize(q.codes.size());
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t b = 0; b < q.blocks; ++b) {
      const int64_t c0 = b * 32, c1 = std::min(cols, c0 + 32);
      float amax = 0.0f;
      for (int64_t c = c0; c < c1; ++c) amax = std::max(amax, std::fabs(x[r * cols + c]));
      const int e = RefExponent(amax, f);
      q.e8m0.push_back(static_cast<uint8_t>(e + 127));
      for (int64_t c = c0; c < c1; ++c) {
        const double y = std::ldexp(static_cast<double>(x[r * cols + c]), -e);  // exact
        const uint8_t code = RefEncode(y, f);
        q.codes[r * cols + c] = code;
        q.value[r * cols + c] = std::ldexp(RefDecode(code, f), e);
        if (RefRoundsPastMax(y, f)) ++q.saturated;
      }
    }
  }
  return q;
}

std::vector<float> Transposed(const std::vector<float>& x, int64_t rows, int64_t cols) {
  std::vector<float> t(x.size());
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t c = 0; c < cols; ++c) t[c * rows + r] = x[r * cols + c];
  }
  return t;
}

// W (rows x cols) in 32x1 blocks down its columns, in W's layout: quantize W^T along its rows,
// then transpose the codes (rows x cols) and the grid (ceil(rows/32) x cols) back.
RefMx RefQuantizeColumns(const std::vector<float>& w, int64_t rows, int64_t cols, Fp8Format f) {
  const RefMx t = RefQuantize(Transposed(w, rows, cols), cols, rows, f);
  RefMx q;
  q.rows = rows;
  q.cols = cols;
  q.blocks = t.blocks;  // block rows
  q.codes.resize(t.codes.size());
  q.value.resize(t.value.size());
  q.e8m0.resize(t.e8m0.size());
  q.saturated = t.saturated;
  for (int64_t c = 0; c < cols; ++c) {
    for (int64_t r = 0; r < rows; ++r) {
      q.codes[r * cols + c] = t.codes[c * rows + r];
      q.value[r * cols + c] = t.value[c * rows + r];
    }
    for (int64_t b = 0; b < t.blocks; ++b) q.e8m0[b * cols + c] = t.e8m0[c * t.blocks + b];
  }
  return q;
}

// D0 + A B^T in double (A m x k, B n x k, both decoded values), with sum |a_i b_i| per element.
struct RefProduct {
  std::vector<double> d, abs_sum;
};
RefProduct RefGemm(const std::vector<double>& a, const std::vector<double>& b, int64_t m, int64_t n,
                   int64_t k, const std::vector<float>& d0, double times = 1.0) {
  RefProduct p;
  p.d.resize(static_cast<size_t>(m * n));
  p.abs_sum.resize(p.d.size());
  for (int64_t i = 0; i < m; ++i) {
    for (int64_t j = 0; j < n; ++j) {
      double s = 0.0, abs_s = 0.0;
      for (int64_t t = 0; t < k; ++t) {
        const double prod = a[i * k + t] * b[j * k + t];
        s += prod;
        abs_s += std::fabs(prod);
      }
      p.d[i * n + j] = (d0.empty() ? 0.0 : d0[i * n + j]) + times * s;
      p.abs_sum[i * n + j] = times * abs_s;
    }
  }
  return p;
}

// got vs want within (k + 2) u (S + |D0|) per element (file comment), `calls` GEMMs accumulated.
::testing::AssertionResult WithinFp32AccumulationBound(const std::vector<float>& got,
                                                       const RefProduct& want,
                                                       const std::vector<float>& d0, int64_t k,
                                                       int calls) {
  if (got.size() != want.d.size()) {
    return ::testing::AssertionFailure() << "size " << got.size() << " != " << want.d.size();
  }
  int64_t bad = 0, first = -1;
  double first_err = 0.0, first_tol = 0.0;
  for (size_t i = 0; i < got.size(); ++i) {
    const double init = d0.empty() ? 0.0 : std::fabs(d0[i]);
    const double tol =
        static_cast<double>(k + 2 * calls) * 0x1p-24 * (want.abs_sum[i] + calls * init);
    const double err = std::fabs(static_cast<double>(got[i]) - want.d[i]);
    if (!(err <= tol)) {
      if (bad++ == 0) {
        first = static_cast<int64_t>(i);
        first_err = err;
        first_tol = tol;
      }
    }
  }
  if (bad == 0) return ::testing::AssertionSuccess();
  return ::testing::AssertionFailure()
         << bad << " of " << got.size() << " elements outside the bound; first at " << first
         << ": got " << got[first] << ", want " << want.d[first] << " (error " << first_err << " > "
         << first_tol << ")";
}

::testing::AssertionResult SameBytes(const kernels::DeviceArray<uint8_t>& got,
                                     const std::vector<uint8_t>& want) {
  if (got.size() != want.size()) {
    return ::testing::AssertionFailure() << "size " << got.size() << " != " << want.size();
  }
  int64_t bad = 0, first = -1;
  for (size_t i = 0; i < want.size(); ++i) {
    if (got[i] != want[i] && bad++ == 0) first = static_cast<int64_t>(i);
  }
  if (bad == 0) return ::testing::AssertionSuccess();
  return ::testing::AssertionFailure()
         << bad << " of " << want.size() << " bytes differ; first at " << first << ": got "
         << int{got[first]} << ", want " << int{want[first]};
}

// ---------------------------------------------------------------------------------------------
// Data.

// rows x cols values uniform in (-1, 1) times 2^k, k from the 32x32 tile (-5..5) plus 2 on every
// third row; exact zeros in the 1x32 block at (zero_row, 0..31) and the 32x1 block at
// (0..31, zero_col), so that one block is all zero whichever way the matrix is blocked.
std::vector<float> MakeData(uint32_t seed, int64_t rows, int64_t cols, int64_t zero_row,
                            int64_t zero_col) {
  std::mt19937 gen(seed);
  std::uniform_real_distribution<float> unit(-1.0f, 1.0f);
  std::vector<float> x(static_cast<size_t>(rows * cols));
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t c = 0; c < cols; ++c) {
      const int k = static_cast<int>((r / 32 * 5 + c / 32 * 3) % 11) - 5 + (r % 3 == 0 ? 2 : 0);
      x[r * cols + c] = std::ldexp(unit(gen), k);
    }
  }
  for (int64_t c = 0; c < std::min<int64_t>(cols, 32); ++c) x[zero_row * cols + c] = 0.0f;
  for (int64_t r = 0; r < std::min<int64_t>(rows, 32); ++r) x[r * cols + zero_col] = 0.0f;
  return x;
}

float Amax(const std::vector<float>& x) {
  float m = 0.0f;
  for (float v : x) m = std::max(m, std::fabs(v));
  return m;
}

train::ScalingConfig Mx32(Fp8Format format) {
  train::ScalingConfig c;
  c.format = format;
  c.strategy = train::ScalingStrategy::kMx32;
  return c;
}

// An Fp8Weight filled from the reference (not from the library's quantizer).
void FillWeight(const kernels::OpTable& ops, const RefMx& rows, const RefMx& cols,
                parallel::Fp8Weight* w) {
  w->rows = rows.rows;
  w->cols = rows.cols;
  auto fill = [&](kernels::DeviceArray<uint8_t>& dst, const std::vector<uint8_t>& src) {
    dst.Reset(ops, src.size());
    std::copy(src.begin(), src.end(), dst.begin());
  };
  fill(w->codes, rows.codes);
  fill(w->e8m0, rows.e8m0);
  fill(w->col_codes, cols.codes);
  fill(w->col_e8m0, cols.e8m0);
  w->scale_inv.clear();
}

struct Case {
  int64_t n, in, out;
  Fp8Format grad_format;
};
std::string CaseName(const ::testing::TestParamInfo<Case>& info) {
  const Case& c = info.param;
  return "n" + std::to_string(c.n) + "_in" + std::to_string(c.in) + "_out" + std::to_string(c.out) +
         (c.grad_format == Fp8Format::kE4M3 ? "_E4M3" : "_Hybrid");
}
void PrintTo(const Case& c, std::ostream* os) {
  *os << CaseName(::testing::TestParamInfo<Case>(c, 0));
}

// Everything a case needs: data, reference quantizations and the layer.
struct Fixture {
  explicit Fixture(const Case& c)
      : ops(kernels::CpuOps()),
        scratch(ops),
        ctx{.ops = &ops, .tp = nullptr, .scratch = &scratch},
        layer("test.fc", c.in, c.out, GemmPrecision::kFp8,
              Fp8SiteConfigs{.input = Mx32(Fp8Format::kE4M3),
                             .weight = Mx32(Fp8Format::kE4M3),
                             .grad_output = Mx32(c.grad_format)}) {
    x = MakeData(11, c.n, c.in, /*zero_row=*/0, /*zero_col=*/c.in - 1);
    w = MakeData(22, c.out, c.in, /*zero_row=*/c.out - 1, /*zero_col=*/0);
    dy = MakeData(33, c.n, c.out, /*zero_row=*/c.n - 1, /*zero_col=*/c.out / 2);
    w_rows = RefQuantize(w, c.out, c.in, Fp8Format::kE4M3);
    w_cols = RefQuantizeColumns(w, c.out, c.in, Fp8Format::kE4M3);
    FillWeight(ops, w_rows, w_cols, &weight);
    layer.SetWeight(&weight);
    layer.input_site().BeginStep();
    layer.grad_site().BeginStep();
  }
  const kernels::OpTable& ops;
  Scratch scratch;
  LinearContext ctx;
  Linear layer;
  std::vector<float> x, w, dy;
  RefMx w_rows, w_cols;
  parallel::Fp8Weight weight;
};

class LinearMx32Test : public ::testing::TestWithParam<Case> {};

TEST_P(LinearMx32Test, ForwardAndBackwardMatchTheDoubleReferenceOfSpecQuantizedOperands) {
  const Case& c = GetParam();
  Fixture f(c);
  ASSERT_TRUE(f.layer.mx32());

  // The data is what the file comment says: several scales per operand, a zero block each way.
  const std::set<uint8_t> w_scales(f.w_rows.e8m0.begin(), f.w_rows.e8m0.end());
  const std::set<uint8_t> w_col_scales(f.w_cols.e8m0.begin(), f.w_cols.e8m0.end());
  EXPECT_GE(w_scales.size(), 4u);
  EXPECT_GE(w_col_scales.size(), 4u);
  EXPECT_TRUE(w_scales.count(0) == 1 && w_col_scales.count(0) == 1) << "an all-zero block";

  // Forward: y[n, out] = Q(x) Q(W)^T, K = in.
  const RefMx xq = RefQuantize(f.x, c.n, c.in, Fp8Format::kE4M3);
  std::vector<float> y(static_cast<size_t>(c.n * c.out), -1.0f);
  ASSERT_TRUE(f.layer.Forward(f.ctx, f.x.data(), c.n, y.data()).ok());
  ASSERT_TRUE(f.ops.layer->synchronize({}).ok());
  EXPECT_TRUE(WithinFp32AccumulationBound(
      y, RefGemm(xq.value, f.w_rows.value, c.n, c.out, c.in, {}), {}, c.in, 1))
      << "y";

  // Backward into nonzero gradients, which it must add to.
  std::mt19937 gen(44);
  std::uniform_real_distribution<float> unit(-1.0f, 1.0f);
  std::vector<float> dx0(static_cast<size_t>(c.n * c.in)), dw0(static_cast<size_t>(c.out * c.in));
  for (float& v : dx0) v = unit(gen);
  for (float& v : dw0) v = unit(gen);
  std::vector<float> dx = dx0, dw = dw0;
  ASSERT_TRUE(f.layer.Backward(f.ctx, f.dy.data(), c.n, dx.data(), dw.data()).ok());
  ASSERT_TRUE(f.layer.FlushStats().ok());

  // dx[n, in] += Q(dy)[n, out] Q_col(W)[out, in]: dy along out, W in 32x1 blocks along out.
  const RefMx dyq = RefQuantize(f.dy, c.n, c.out, c.grad_format);
  const std::vector<double> wt_col = [&] {  // Q_col(W)^T: in x out, the GEMM's B operand
    std::vector<double> t(static_cast<size_t>(c.in * c.out));
    for (int64_t o = 0; o < c.out; ++o) {
      for (int64_t i = 0; i < c.in; ++i) t[i * c.out + o] = f.w_cols.value[o * c.in + i];
    }
    return t;
  }();
  EXPECT_TRUE(WithinFp32AccumulationBound(dx, RefGemm(dyq.value, wt_col, c.n, c.in, c.out, dx0),
                                          dx0, c.out, 1))
      << "dx";

  // dw[out, in] += Q(dy^T)[out, n] Q(x^T)[in, n]^T: both along the tokens.
  const RefMx dytq = RefQuantize(Transposed(f.dy, c.n, c.out), c.out, c.n, c.grad_format);
  const RefMx xtq = RefQuantize(Transposed(f.x, c.n, c.in), c.in, c.n, Fp8Format::kE4M3);
  EXPECT_TRUE(WithinFp32AccumulationBound(dw, RefGemm(dytq.value, xtq.value, c.out, c.in, c.n, dw0),
                                          dw0, c.n, 1))
      << "dw";

  // The sites' statistics: one quantization each (x along in, dy along out).
  const kernels::QuantStats& in_stats = f.layer.input_site().step_stats();
  EXPECT_TRUE(f.layer.input_site().used_this_step());
  EXPECT_EQ(in_stats.amax, Amax(f.x));
  EXPECT_EQ(in_stats.count, c.n * c.in);
  EXPECT_EQ(in_stats.saturated, xq.saturated);
  EXPECT_EQ(in_stats.nonfinite, 0);
  const kernels::QuantStats& grad_stats = f.layer.grad_site().step_stats();
  EXPECT_TRUE(f.layer.grad_site().used_this_step());
  EXPECT_EQ(grad_stats.amax, Amax(f.dy));
  EXPECT_EQ(grad_stats.count, c.n * c.out);
  EXPECT_EQ(grad_stats.saturated, dyq.saturated);
  EXPECT_EQ(grad_stats.nonfinite, 0);
  // Saturation happens in this data (a block amax with mantissa > 1.75 E4M3), so the count
  // comparisons above are not of zeros only.
  EXPECT_GT(xq.saturated + dyq.saturated + xtq.saturated + dytq.saturated, 0);
}

TEST_P(LinearMx32Test, NullInputGradientSkipsDxAndDwAccumulatesOverBackwardCalls) {
  const Case& c = GetParam();
  Fixture f(c);
  std::vector<float> y(static_cast<size_t>(c.n * c.out));
  ASSERT_TRUE(f.layer.Forward(f.ctx, f.x.data(), c.n, y.data()).ok());

  std::vector<float> dw0(static_cast<size_t>(c.out * c.in));
  for (size_t i = 0; i < dw0.size(); ++i) dw0[i] = 0.25f * static_cast<float>(i % 7) - 0.75f;
  std::vector<float> dw = dw0;
  ASSERT_TRUE(f.layer.Backward(f.ctx, f.dy.data(), c.n, nullptr, dw.data()).ok());
  ASSERT_TRUE(f.layer.Backward(f.ctx, f.dy.data(), c.n, nullptr, dw.data()).ok());
  ASSERT_TRUE(f.layer.FlushStats().ok());

  const RefMx dytq = RefQuantize(Transposed(f.dy, c.n, c.out), c.out, c.n, c.grad_format);
  const RefMx xtq = RefQuantize(Transposed(f.x, c.n, c.in), c.in, c.n, Fp8Format::kE4M3);
  EXPECT_TRUE(WithinFp32AccumulationBound(
      dw, RefGemm(dytq.value, xtq.value, c.out, c.in, c.n, dw0, /*times=*/2.0), dw0, c.n, 2))
      << "dw after two backward calls";
  // Both calls quantized dy for the site (the second flushed the first's statistics).
  EXPECT_EQ(f.layer.grad_site().step_stats().count, 2 * c.n * c.out);
  EXPECT_EQ(f.layer.grad_site().step_stats().amax, Amax(f.dy));
}

TEST(QuantizeMx32BothTest, MatchesTheReferenceBitForBit) {
  const kernels::OpTable& ops = kernels::CpuOps();
  // The weights (out x in) of the Linear cases, and their dy shapes (n x out): partial blocks
  // both ways (31, 33, 70, 72 columns or rows), and exact multiples of 32.
  for (const auto& [rows, cols, seed] : {std::tuple<int64_t, int64_t, uint32_t>{48, 72, 22},
                                         {96, 64, 23},
                                         {70, 31, 24},
                                         {40, 48, 33},
                                         {64, 96, 34},
                                         {33, 70, 35}}) {
    const std::vector<float> w = MakeData(seed, rows, cols, rows - 1, 0);
    for (const Fp8Format format : {Fp8Format::kE4M3, Fp8Format::kE5M2}) {
      SCOPED_TRACE(::testing::Message() << rows << " x " << cols << " "
                                        << (format == Fp8Format::kE4M3 ? "E4M3" : "E5M2"));
      const RefMx ref_rows = RefQuantize(w, rows, cols, format);
      const RefMx ref_cols = RefQuantizeColumns(w, rows, cols, format);
      kernels::DeviceArray<uint8_t> codes(ops, static_cast<size_t>(rows * cols));
      kernels::DeviceArray<uint8_t> e8m0(ops, ref_rows.e8m0.size());
      kernels::DeviceArray<uint8_t> col_codes(ops, static_cast<size_t>(rows * cols));
      kernels::DeviceArray<uint8_t> col_e8m0(ops, ref_cols.e8m0.size());
      kernels::DeviceArray<kernels::QuantStats> stats(ops, 1);
      kernels::DeviceArray<std::byte> scratch(ops, kernels::MemCategory::kScratch);
      ASSERT_TRUE(parallel::QuantizeMx32Both(ops, w.data(), rows, cols, format, codes.data(),
                                             e8m0.data(), col_codes.data(), col_e8m0.data(),
                                             stats.data(), &scratch)
                      .ok());
      ASSERT_TRUE(ops.layer->synchronize({}).ok());
      EXPECT_TRUE(SameBytes(codes, ref_rows.codes)) << "codes";
      EXPECT_TRUE(SameBytes(e8m0, ref_rows.e8m0)) << "e8m0";
      EXPECT_TRUE(SameBytes(col_codes, ref_cols.codes)) << "col_codes";
      EXPECT_TRUE(SameBytes(col_e8m0, ref_cols.e8m0)) << "col_e8m0";
      EXPECT_EQ(stats[0].amax, Amax(w));
      EXPECT_EQ(stats[0].count, rows * cols);
      EXPECT_EQ(stats[0].saturated, ref_rows.saturated);
    }
  }
}

INSTANTIATE_TEST_SUITE_P(
    All, LinearMx32Test,
    ::testing::Values(Case{40, 72, 48, Fp8Format::kE4M3}, Case{40, 72, 48, Fp8Format::kE5M2},
                      Case{64, 64, 96, Fp8Format::kE4M3}, Case{64, 64, 96, Fp8Format::kE5M2},
                      Case{33, 31, 70, Fp8Format::kE4M3}, Case{33, 31, 70, Fp8Format::kE5M2}),
    CaseName);

}  // namespace
}  // namespace fp8rt::model
