// Tests of the CPU GEMMs, CpuOps().gemm_fp8 and CpuOps().gemm_bf16 (kernels/gemm.h), against a
// double-precision reference computed in this file.
//
// Index:
//   Reference numerics   FP8 decoding and FP32 -> BF16 rounding written here from the format
//                        definitions; a double GEMM on the exactly decoded, scaled operands.
//   Tolerance            the FP32-accumulation bound every inexact comparison uses (justified at
//                        WithinBound).
//   Fp8GemmTest          TEST_P over format mix x shape x tensor/block scaling x F32/BF16 output:
//                        exact results on data whose every partial sum is exact in FP32, random
//                        data within the bound; accumulate (FP32 output).
//   Bf16GemmTest         TEST_P over input types x shape x output type; accumulate; rounding
//                        of FP32 inputs on and near ties.
//   GemmValidationTest   bad arguments give InvalidArgument naming the field.
//   GemmLargeTest        a 2048^3 FP8 GEMM checked on a random sample of outputs.
#include "kernels/gemm.h"

#include <algorithm>
#include <array>
#include <bit>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <limits>
#include <ostream>
#include <random>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"
#include "kernels/formats.h"
#include "kernels/ops.h"
#include "kernels/quantize.h"

namespace fp8rt::kernels {
namespace {

// ---------------------------------------------------------------------------------------------
// Reference numerics, written from the definitions (OCP OFP8 v1.0; BF16 = upper half of binary32).

// FP8 code -> value from the bit layout: sign, exponent field (4 bits bias 7 for E4M3, 5 bits
// bias 15 for E5M2), mantissa (3 or 2 bits); an exponent field of 0 is subnormal. E4M3 has no
// infinities and S.1111.111 is NaN; E5M2 S.11111.00 is +-inf, S.11111.{01,10,11} NaN.
double RefDecodeFp8(uint8_t code, Fp8Format format) {
  const bool e4m3 = format == Fp8Format::kE4M3;
  const int mant_bits = e4m3 ? 3 : 2;
  const int bias = e4m3 ? 7 : 15;
  const int exp_all_ones = e4m3 ? 15 : 31;
  const double sign = (code & 0x80) != 0 ? -1.0 : 1.0;
  const int exp_field = (code & 0x7F) >> mant_bits;
  const int mant = code & ((1 << mant_bits) - 1);
  if (e4m3 && exp_field == exp_all_ones && mant == 7) {
    return std::numeric_limits<double>::quiet_NaN();
  }
  if (!e4m3 && exp_field == exp_all_ones) {
    return mant == 0 ? sign * std::numeric_limits<double>::infinity()
                     : std::numeric_limits<double>::quiet_NaN();
  }
  if (exp_field == 0) return sign * std::ldexp(mant, 1 - bias - mant_bits);
  return sign * std::ldexp((1 << mant_bits) + mant, exp_field - bias - mant_bits);
}

double RefBf16ToDouble(uint16_t bits) {
  return std::bit_cast<float>(static_cast<uint32_t>(bits) << 16);
}

// FP32 -> BF16 bits, round to nearest with ties to even, from the definition: the two BF16
// neighbours of x are its truncation toward zero and the next BF16 away from zero; take the
// nearer one, and on a tie the one whose last mantissa bit is 0. Finite inputs only.
uint16_t RefFloatToBf16(float x) {
  const uint16_t toward_zero = static_cast<uint16_t>(std::bit_cast<uint32_t>(x) >> 16);
  const uint16_t away = static_cast<uint16_t>(toward_zero + 1);
  const double dist_toward = std::fabs(static_cast<double>(x) - RefBf16ToDouble(toward_zero));
  const double dist_away = std::fabs(RefBf16ToDouble(away) - static_cast<double>(x));
  if (dist_toward < dist_away) return toward_zero;
  if (dist_away < dist_toward) return away;
  return (toward_zero & 1) == 0 ? toward_zero : away;
}

int64_t CeilDiv(int64_t x, int64_t y) { return (x + y - 1) / y; }

struct Shape {
  int64_t m;
  int64_t n;
  int64_t k;
};
constexpr Shape kShapes[] = {
    {1, 1, 1}, {17, 33, 65}, {128, 128, 128}, {130, 257, 300}, {256, 512, 384}};

std::string ShapeName(const Shape& s) { return absl::StrCat(s.m, "x", s.n, "x", s.k); }

// The exact result of a GEMM (up to double rounding, 2^-53 relative, negligible against the
// tolerances below and absent from the exactness tests, whose values need < 30 bits), and
// sum_k |scaled product| per output, the scale of the FP32 rounding error.
struct Reference {
  std::vector<double> value;
  std::vector<double> abs_sum;
};

// out[m][n] = sum_k a[m][k] * b[n][k] (+ c[m][n]) in double, a and b already decoded and scaled.
Reference RefGemm(const std::vector<double>& a, const std::vector<double>& b, int64_t m, int64_t n,
                  int64_t k, const std::vector<float>* c) {
  Reference ref{std::vector<double>(m * n), std::vector<double>(m * n)};
  for (int64_t i = 0; i < m; ++i) {
    const double* a_row = &a[i * k];
    for (int64_t j = 0; j < n; ++j) {
      const double* b_row = &b[j * k];
      double sum = 0.0;
      double abs_sum = 0.0;
      for (int64_t l = 0; l < k; ++l) {
        const double p = a_row[l] * b_row[l];
        sum += p;
        abs_sum += std::fabs(p);
      }
      if (c != nullptr) {
        // The existing D is one more term of the FP32 sum.
        sum += (*c)[i * n + j];
        abs_sum += std::fabs((*c)[i * n + j]);
      }
      ref.value[i * n + j] = sum;
      ref.abs_sum[i * n + j] = abs_sum;
    }
  }
  return ref;
}

// ---------------------------------------------------------------------------------------------
// Tolerance.
//
// Every product of two decoded FP8 (or BF16) values is exact in FP32: 4 x 4 (FP8) or 8 x 8 (BF16)
// significant bits need at most 16 of FP32's 24, and the exponents stay in FP32's normal range.
// What remains is the FP32 summation, in an order the kernel chooses (oneDNN blocks K and may add
// partial sums as a tree). Whatever the order, n - 1 FP32 additions of terms p_k err by at most
// (n - 1) u / (1 - (n - 1) u) * sum_k |p_k|, u = 2^-24 (Higham, "Accuracy and Stability of
// Numerical Algorithms", 2nd ed., eq. 4.4). The scales add a few roundings on top, each at most u
// times a quantity bounded by sum_k |p_k|: sa * sb and its product with the sum (tensor scaling);
// for block scaling two multiplications per 128-slice and ceil(K/128) more additions; with
// accumulate one more addition (the old D is counted as a term of abs_sum); and the final FP32
// value. We allow 2 (K + 8) u sum_k |p_k|: the factor 2 covers the denominator and those extra
// roundings with room to spare, and the bound is still ~2^-9 relative at K = 2048 against errors
// of 2^-8..1 relative that real bugs make (a scale from the wrong block, a dropped K-slice,
// operands rounded wrongly, an FP8/BF16 accumulator). kTiny absorbs a flushed denormal, which the
// data here never produces.
//
// BF16 output adds one FP32 -> BF16 rounding of the FP32 result x: 8 significant bits, so
// |bf16(x) - x| <= 2^-8 |x| <= 2^-8 (|ref| + acc_bound).
constexpr double kU = 0x1p-24;
constexpr double kTiny = std::numeric_limits<float>::min();

double WithinBound(int64_t k, double abs_sum, double ref, OutputType out) {
  const double acc = 2.0 * static_cast<double>(k + 8) * kU * abs_sum + kTiny;
  if (out == OutputType::kF32) return acc;
  return acc * (1.0 + 0x1p-8) + 0x1p-8 * std::fabs(ref);
}

// Compares D with the reference within WithinBound, reporting the first few offenders.
void ExpectWithinBound(const std::vector<float>& d, const Reference& ref, int64_t n, int64_t k,
                       OutputType out) {
  ASSERT_EQ(d.size(), ref.value.size());
  int64_t bad = 0;
  for (size_t i = 0; i < d.size(); ++i) {
    const double bound = WithinBound(k, ref.abs_sum[i], ref.value[i], out);
    const double err = std::fabs(static_cast<double>(d[i]) - ref.value[i]);
    if (!(err <= bound)) {  // also catches NaN
      if (++bad <= 5) {
        ADD_FAILURE() << "D[" << i / n << "][" << i % n << "] = " << d[i] << ", reference "
                      << ref.value[i] << ", error " << err << " > bound " << bound
                      << " (sum|p| = " << ref.abs_sum[i] << ")";
      }
    }
  }
  EXPECT_EQ(bad, 0) << "elements outside the bound, of " << d.size();
}

// Expects D to be exactly the reference (FP32 output) or its correctly rounded BF16 value.
void ExpectExact(const std::vector<float>& d, const Reference& ref, int64_t n, OutputType out) {
  ASSERT_EQ(d.size(), ref.value.size());
  int64_t bad = 0;
  for (size_t i = 0; i < d.size(); ++i) {
    const float ref_f32 = static_cast<float>(ref.value[i]);
    // The premise of the exactness tests: the exact result is an FP32 value.
    ASSERT_EQ(static_cast<double>(ref_f32), ref.value[i]) << "test data not exact at " << i;
    const float expected = out == OutputType::kF32
                               ? ref_f32
                               : static_cast<float>(RefBf16ToDouble(RefFloatToBf16(ref_f32)));
    if (d[i] != expected && ++bad <= 5) {
      ADD_FAILURE() << "D[" << i / n << "][" << i % n << "] = " << d[i] << ", expected exactly "
                    << expected << " (exact sum " << ref.value[i] << ")";
    }
  }
  EXPECT_EQ(bad, 0) << "inexact elements, of " << d.size();
}

// ---------------------------------------------------------------------------------------------
// Caller-provided buffers.

// The first 64-byte aligned address in a buffer over-allocated by 64 bytes.
inline void* AlignTo64(uint8_t* p) { return p + (64 - reinterpret_cast<uintptr_t>(p) % 64) % 64; }

// `bytes` bytes aligned to 64, followed by guard bytes that a kernel must not touch.
class GuardedBuffer {
 public:
  explicit GuardedBuffer(size_t bytes) : bytes_(bytes), storage_(bytes + kAlign + kGuard) {
    const auto address = reinterpret_cast<uintptr_t>(storage_.data());
    offset_ = (kAlign - address % kAlign) % kAlign;
    std::fill(storage_.begin(), storage_.end(), kGuardByte);
  }
  void* data() { return storage_.data() + offset_; }
  size_t bytes() const { return bytes_; }
  bool GuardIntact() const {
    return std::all_of(storage_.begin() + offset_ + bytes_,
                       storage_.begin() + offset_ + bytes_ + kGuard,
                       [](uint8_t b) { return b == kGuardByte; });
  }

 private:
  static constexpr size_t kAlign = 64;
  static constexpr size_t kGuard = 256;
  static constexpr uint8_t kGuardByte = 0xA5;
  size_t bytes_;
  size_t offset_ = 0;
  std::vector<uint8_t> storage_;
};

// An M x N output buffer preset to `init` (or to NaN when empty, so that a kernel that reads D
// when it should overwrite it shows up), read back as floats.
class OutputBuffer {
 public:
  OutputBuffer(int64_t m, int64_t n, OutputType out, const std::vector<float>& init)
      : count_(m * n), out_(out), buffer_(count_ * (out == OutputType::kF32 ? 4 : 2)) {
    for (int64_t i = 0; i < count_; ++i) {
      if (out_ == OutputType::kF32) {
        const float v = init.empty() ? std::numeric_limits<float>::quiet_NaN() : init[i];
        std::memcpy(static_cast<uint8_t*>(buffer_.data()) + 4 * i, &v, 4);
      } else {
        const uint16_t v = init.empty() ? uint16_t{0x7FC0} : RefFloatToBf16(init[i]);
        std::memcpy(static_cast<uint8_t*>(buffer_.data()) + 2 * i, &v, 2);
      }
    }
  }
  void* data() { return buffer_.data(); }
  bool GuardIntact() const { return buffer_.GuardIntact(); }
  std::vector<float> Values() {
    std::vector<float> values(count_);
    for (int64_t i = 0; i < count_; ++i) {
      if (out_ == OutputType::kF32) {
        std::memcpy(&values[i], static_cast<uint8_t*>(buffer_.data()) + 4 * i, 4);
      } else {
        uint16_t bits;
        std::memcpy(&bits, static_cast<uint8_t*>(buffer_.data()) + 2 * i, 2);
        values[i] = static_cast<float>(RefBf16ToDouble(bits));
      }
    }
    return values;
  }

 private:
  int64_t count_;
  OutputType out_;
  GuardedBuffer buffer_;
};

// ---------------------------------------------------------------------------------------------
// FP8 GEMM problems.

struct Fp8Problem {
  Shape shape;
  Fp8Format a_format = Fp8Format::kE4M3;
  Fp8Format b_format = Fp8Format::kE4M3;
  GemmScaling scaling = GemmScaling::kTensor;
  std::vector<uint8_t> a;          // M x K codes
  std::vector<uint8_t> b;          // N x K codes
  std::vector<float> a_scale_inv;  // 1, or M x ceil(K/128), or M x ceil(K/32) (kMx32)
  std::vector<float> b_scale_inv;  // 1, or ceil(N/128) x ceil(K/128), or N x ceil(K/32) (kMx32)
  // kMx32: the E8M0 codes of those scales (powers of two), code = log2(scale) + 127 as OCP MX
  // v1.0 defines it; the kernel gets the codes, the reference the scales.
  std::vector<uint8_t> a_e8m0, b_e8m0;
  // b holds B^T (K x N) instead (Fp8GemmArgs::b_transposed); the reference then does not apply.
  bool b_transposed = false;
};

int64_t AScaleCount(const Shape& s, GemmScaling scaling) {
  if (scaling == GemmScaling::kMx32) return s.m * CeilDiv(s.k, 32);
  return scaling == GemmScaling::kTensor ? 1 : s.m * CeilDiv(s.k, 128);
}
int64_t BScaleCount(const Shape& s, GemmScaling scaling) {
  if (scaling == GemmScaling::kMx32) return s.n * CeilDiv(s.k, 32);
  return scaling == GemmScaling::kTensor ? 1 : CeilDiv(s.n, 128) * CeilDiv(s.k, 128);
}

// Operand element (row, col) decoded and multiplied by the scale of its own block.
std::vector<double> DecodeScaled(const std::vector<uint8_t>& codes, Fp8Format format,
                                 const std::vector<float>& scale_inv, int64_t rows, int64_t k,
                                 GemmScaling scaling, int64_t block_rows) {
  std::vector<double> out(rows * k);
  const bool mx = scaling == GemmScaling::kMx32;  // 1 x 32 blocks, one row each
  const int64_t width = mx ? 32 : 128, kb = CeilDiv(k, width);
  if (mx) block_rows = 1;
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t c = 0; c < k; ++c) {
      const double s = scaling == GemmScaling::kTensor
                           ? scale_inv[0]
                           : scale_inv[(r / block_rows) * kb + c / width];
      out[r * k + c] = RefDecodeFp8(codes[r * k + c], format) * s;
    }
  }
  return out;
}

// D[m][n] = sum_k a[m][k] sa(m, k/128) b[n][k] sb(n/128, k/128) (+ c), in double.
Reference RefFp8Gemm(const Fp8Problem& p, const std::vector<float>* c = nullptr) {
  const Shape& s = p.shape;
  // A's blocks are 1 x 128 (one row each), B's 128 x 128.
  const std::vector<double> a =
      DecodeScaled(p.a, p.a_format, p.a_scale_inv, s.m, s.k, p.scaling, /*block_rows=*/1);
  const std::vector<double> b =
      DecodeScaled(p.b, p.b_format, p.b_scale_inv, s.n, s.k, p.scaling, /*block_rows=*/128);
  return RefGemm(a, b, s.m, s.n, s.k, c);
}

Fp8GemmArgs MakeArgs(const Fp8Problem& p, OutputType out, bool accumulate) {
  Fp8GemmArgs args;
  args.m = p.shape.m;
  args.n = p.shape.n;
  args.k = p.shape.k;
  args.a = p.a.data();
  args.a_format = p.a_format;
  args.b = p.b.data();
  args.b_format = p.b_format;
  args.b_transposed = p.b_transposed;
  args.scaling = p.scaling;
  args.a_scale_inv = p.a_scale_inv.data();
  args.b_scale_inv = p.b_scale_inv.data();
  args.a_e8m0 = p.a_e8m0.empty() ? nullptr : p.a_e8m0.data();
  args.b_e8m0 = p.b_e8m0.empty() ? nullptr : p.b_e8m0.data();
  args.out_type = out;
  args.accumulate = accumulate;
  return args;
}

// Runs CpuOps().gemm_fp8 with exactly GemmWorkspaceBytes of workspace and D preset to `d_init`
// (NaN when empty); returns D as floats. Fails the test if a guard byte after D or after the
// workspace was written.
absl::StatusOr<std::vector<float>> RunFp8Gemm(const Fp8Problem& p, OutputType out, bool accumulate,
                                              const std::vector<float>& d_init = {}) {
  Fp8GemmArgs args = MakeArgs(p, out, accumulate);
  GuardedBuffer workspace(GemmWorkspaceBytes(args));
  OutputBuffer d(p.shape.m, p.shape.n, out, d_init);
  args.workspace = workspace.data();
  args.workspace_bytes = workspace.bytes();
  args.d = d.data();
  const absl::Status status = CpuOps().gemm_fp8(args, Stream{});
  if (!status.ok()) return status;
  EXPECT_TRUE(d.GuardIntact()) << "gemm_fp8 wrote past the end of D";
  EXPECT_TRUE(workspace.GuardIntact()) << "gemm_fp8 wrote past GemmWorkspaceBytes of workspace";
  return d.Values();
}

// Codes of the values {0, +-0.5, +-1, +-1.5, +-2, +-3, +-4}, found by decoding every code.
std::vector<uint8_t> SmallValueCodes(Fp8Format format) {
  const double wanted[] = {0, 0.5, -0.5, 1, -1, 1.5, -1.5, 2, -2, 3, -3, 4, -4};
  std::vector<uint8_t> codes;
  for (double w : wanted) {
    for (int c = 0; c < 256; ++c) {
      // Skip -0 so that each value is listed once.
      if (RefDecodeFp8(static_cast<uint8_t>(c), format) == w && !(w == 0 && c == 0x80)) {
        codes.push_back(static_cast<uint8_t>(c));
        break;
      }
    }
  }
  return codes;
}

// kMx32: each scale rounded to the nearest power of two (MX scales are), and its E8M0 code.
void MxScales(Fp8Problem& p) {
  if (p.scaling != GemmScaling::kMx32) return;
  for (auto [scales, codes] : {std::pair{&p.a_scale_inv, &p.a_e8m0},
                               std::pair{&p.b_scale_inv, &p.b_e8m0}}) {
    codes->resize(scales->size());
    for (size_t i = 0; i < scales->size(); ++i) {
      const int e = static_cast<int>(std::lround(std::log2((*scales)[i])));
      (*scales)[i] = std::ldexp(1.0f, e);
      (*codes)[i] = static_cast<uint8_t>(e + 127);
    }
  }
}

// Data on which the exact sum is an FP32 value whatever the summation order: operand values are
// multiples of 1/2 with |v| <= 4 and scales are 2^j, |j| <= 2. Every scaled product is then a
// multiple of 2^-6 with magnitude <= 16 * 16, so any partial sum over K <= 384 terms, with or
// without an existing D of integers in [-8, 8] (accumulate), is a multiple of 2^-6 below 2^17:
// 23 significant bits, exact in FP32 (and in the double reference).
Fp8Problem ExactProblem(const Shape& s, Fp8Format a_format, Fp8Format b_format, GemmScaling scaling,
                        std::mt19937_64& rng) {
  Fp8Problem p;
  p.shape = s;
  p.a_format = a_format;
  p.b_format = b_format;
  p.scaling = scaling;
  const std::vector<uint8_t> a_codes = SmallValueCodes(a_format);
  const std::vector<uint8_t> b_codes = SmallValueCodes(b_format);
  std::uniform_int_distribution<size_t> a_pick(0, a_codes.size() - 1);
  std::uniform_int_distribution<size_t> b_pick(0, b_codes.size() - 1);
  p.a.resize(s.m * s.k);
  p.b.resize(s.n * s.k);
  for (auto& c : p.a) c = a_codes[a_pick(rng)];
  for (auto& c : p.b) c = b_codes[b_pick(rng)];
  std::uniform_int_distribution<int> exp_pick(-2, 2);
  p.a_scale_inv.resize(AScaleCount(s, scaling));
  p.b_scale_inv.resize(BScaleCount(s, scaling));
  for (auto& v : p.a_scale_inv) v = std::ldexp(1.0f, exp_pick(rng));
  for (auto& v : p.b_scale_inv) v = std::ldexp(1.0f, exp_pick(rng));
  MxScales(p);
  return p;
}

// Codes of normal samples spread over magnitudes 2^-10..2^8, so that the data mixes zeros,
// subnormals, normals and saturated values of both formats. EncodeFp8 never returns a NaN code
// for a finite input; the reference decodes whatever code it returns.
std::vector<uint8_t> RandomCodes(int64_t count, Fp8Format format, std::mt19937_64& rng) {
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::uniform_int_distribution<int> exp_pick(-10, 8);
  std::vector<uint8_t> codes(count);
  for (auto& c : codes) c = EncodeFp8(std::ldexp(normal(rng), exp_pick(rng)), format);
  return codes;
}

// Scales log-uniform in [2^-4, 2^4): not powers of two, and different enough from block to block
// that a scale applied to the wrong block is far outside the tolerance.
float RandomScale(std::mt19937_64& rng) {
  std::uniform_real_distribution<float> e(-4.0f, 4.0f);
  return std::exp2(e(rng));
}

Fp8Problem RandomProblem(const Shape& s, Fp8Format a_format, Fp8Format b_format,
                         GemmScaling scaling, std::mt19937_64& rng) {
  Fp8Problem p;
  p.shape = s;
  p.a_format = a_format;
  p.b_format = b_format;
  p.scaling = scaling;
  p.a = RandomCodes(s.m * s.k, a_format, rng);
  p.b = RandomCodes(s.n * s.k, b_format, rng);
  p.a_scale_inv.resize(AScaleCount(s, scaling));
  p.b_scale_inv.resize(BScaleCount(s, scaling));
  for (auto& v : p.a_scale_inv) v = RandomScale(rng);
  for (auto& v : p.b_scale_inv) v = RandomScale(rng);
  MxScales(p);
  return p;
}

const char* FormatName(Fp8Format f) { return f == Fp8Format::kE4M3 ? "e4m3" : "e5m2"; }
const char* ScalingName(GemmScaling s) {
  return s == GemmScaling::kTensor ? "tensor" : s == GemmScaling::kBlock ? "block" : "mx32";
}
const char* OutName(OutputType o) { return o == OutputType::kF32 ? "f32" : "bf16"; }

// ---------------------------------------------------------------------------------------------
// The reference helpers themselves, against values from the format definitions.

TEST(GemmReferenceTest, DecodeMatchesFormatConstants) {
  EXPECT_EQ(RefDecodeFp8(0x7E, Fp8Format::kE4M3), 448.0);
  EXPECT_EQ(RefDecodeFp8(0x08, Fp8Format::kE4M3), 0x1p-6);
  EXPECT_EQ(RefDecodeFp8(0x01, Fp8Format::kE4M3), 0x1p-9);
  EXPECT_EQ(RefDecodeFp8(0xB8, Fp8Format::kE4M3), -1.0);
  EXPECT_TRUE(std::isnan(RefDecodeFp8(0x7F, Fp8Format::kE4M3)));
  EXPECT_EQ(RefDecodeFp8(0x7B, Fp8Format::kE5M2), 57344.0);
  EXPECT_EQ(RefDecodeFp8(0x04, Fp8Format::kE5M2), 0x1p-14);
  EXPECT_EQ(RefDecodeFp8(0x01, Fp8Format::kE5M2), 0x1p-16);
  EXPECT_EQ(RefDecodeFp8(0xBC, Fp8Format::kE5M2), -1.0);
  EXPECT_EQ(RefDecodeFp8(0x7C, Fp8Format::kE5M2), std::numeric_limits<double>::infinity());
  EXPECT_TRUE(std::isnan(RefDecodeFp8(0x7D, Fp8Format::kE5M2)));
  EXPECT_EQ(SmallValueCodes(Fp8Format::kE4M3).size(), 13u);
  EXPECT_EQ(SmallValueCodes(Fp8Format::kE5M2).size(), 13u);
}

TEST(GemmReferenceTest, Bf16RoundingIsNearestEven) {
  EXPECT_EQ(RefFloatToBf16(1.0f), 0x3F80);
  EXPECT_EQ(RefFloatToBf16(1.0f + 0x1p-8f), 0x3F80);                // tie, even below
  EXPECT_EQ(RefFloatToBf16(1.0f + 0x1p-7f + 0x1p-8f), 0x3F82);      // tie, even above
  EXPECT_EQ(RefFloatToBf16(1.0f + 0x1p-8f + 0x1p-20f), 0x3F81);     // above the tie
  EXPECT_EQ(RefFloatToBf16(-(1.0f + 0x1p-8f - 0x1p-20f)), 0xBF80);  // below the tie
  EXPECT_EQ(RefFloatToBf16(255.5f), 0x4380);                        // tie -> 256
}

// ---------------------------------------------------------------------------------------------
// FP8 GEMM, parameterised over format mix x shape x scaling x output type.

struct Fp8Case {
  Fp8Format a_format;
  Fp8Format b_format;
  Shape shape;
  GemmScaling scaling;
  OutputType out;
  std::string Name() const {
    return absl::StrCat(FormatName(a_format), "_", FormatName(b_format), "_", ShapeName(shape), "_",
                        ScalingName(scaling), "_", OutName(out));
  }
  uint64_t Seed() const {
    return static_cast<uint64_t>(shape.m * 1000003 + shape.n * 1009 + shape.k) * 16 +
           static_cast<uint64_t>(a_format) * 8 + static_cast<uint64_t>(b_format) * 4 +
           static_cast<uint64_t>(scaling) * 2 + static_cast<uint64_t>(out);
  }
};
void PrintTo(const Fp8Case& c, std::ostream* os) { *os << c.Name(); }

std::vector<Fp8Case> Fp8Cases(bool with_bf16_output) {
  std::vector<Fp8Case> cases;
  for (Fp8Format a : {Fp8Format::kE4M3, Fp8Format::kE5M2}) {
    for (Fp8Format b : {Fp8Format::kE4M3, Fp8Format::kE5M2}) {
      for (const Shape& s : kShapes) {
        for (GemmScaling sc : {GemmScaling::kTensor, GemmScaling::kBlock, GemmScaling::kMx32}) {
          cases.push_back({a, b, s, sc, OutputType::kF32});
          if (with_bf16_output) cases.push_back({a, b, s, sc, OutputType::kBF16});
        }
      }
    }
  }
  return cases;
}

class Fp8GemmTest : public ::testing::TestWithParam<Fp8Case> {};

// Powers of two and small multiples of 1/2: every partial sum is exact, so D must be the exact
// result (or, for BF16 output, the exact result rounded to nearest even), whatever order the
// kernel adds in. This pins down the scales (which block's scale goes where) bit for bit.
TEST_P(Fp8GemmTest, ExactOnExactlyRepresentableData) {
  const Fp8Case& c = GetParam();
  std::mt19937_64 rng(c.Seed());
  const Fp8Problem p = ExactProblem(c.shape, c.a_format, c.b_format, c.scaling, rng);
  absl::StatusOr<std::vector<float>> d = RunFp8Gemm(p, c.out, /*accumulate=*/false);
  ASSERT_TRUE(d.ok()) << d.status();
  ExpectExact(*d, RefFp8Gemm(p), c.shape.n, c.out);
}

// Random codes (zeros, subnormals, saturated values) and scales that are not powers of two: within
// the FP32-accumulation bound of the exact result. With kBlock each element's own 1x128 tile and
// 128x128 block scale apply, including the partial blocks at the edges.
TEST_P(Fp8GemmTest, RandomWithinAccumulationBound) {
  const Fp8Case& c = GetParam();
  std::mt19937_64 rng(c.Seed() + 1);
  const Fp8Problem p = RandomProblem(c.shape, c.a_format, c.b_format, c.scaling, rng);
  absl::StatusOr<std::vector<float>> d = RunFp8Gemm(p, c.out, /*accumulate=*/false);
  ASSERT_TRUE(d.ok()) << d.status();
  ExpectWithinBound(*d, RefFp8Gemm(p), c.shape.n, c.shape.k, c.out);
}

INSTANTIATE_TEST_SUITE_P(AllCases, Fp8GemmTest, ::testing::ValuesIn(Fp8Cases(true)),
                         [](const auto& info) { return info.param.Name(); });

// accumulate = true: D += result (FP32 output only).
class Fp8GemmAccumulateTest : public ::testing::TestWithParam<Fp8Case> {};

TEST_P(Fp8GemmAccumulateTest, ExactSumAddsToExistingD) {
  const Fp8Case& c = GetParam();
  std::mt19937_64 rng(c.Seed() + 2);
  const Fp8Problem p = ExactProblem(c.shape, c.a_format, c.b_format, c.scaling, rng);
  std::uniform_int_distribution<int> small(-8, 8);
  std::vector<float> d_init(c.shape.m * c.shape.n);
  for (auto& v : d_init) v = static_cast<float>(small(rng));
  absl::StatusOr<std::vector<float>> d = RunFp8Gemm(p, OutputType::kF32, true, d_init);
  ASSERT_TRUE(d.ok()) << d.status();
  ExpectExact(*d, RefFp8Gemm(p, &d_init), c.shape.n, OutputType::kF32);
}

TEST_P(Fp8GemmAccumulateTest, RandomAddsToExistingD) {
  const Fp8Case& c = GetParam();
  std::mt19937_64 rng(c.Seed() + 3);
  const Fp8Problem p = RandomProblem(c.shape, c.a_format, c.b_format, c.scaling, rng);
  std::normal_distribution<float> normal(0.0f, 100.0f);
  std::vector<float> d_init(c.shape.m * c.shape.n);
  for (auto& v : d_init) v = normal(rng);
  absl::StatusOr<std::vector<float>> d = RunFp8Gemm(p, OutputType::kF32, true, d_init);
  ASSERT_TRUE(d.ok()) << d.status();
  ExpectWithinBound(*d, RefFp8Gemm(p, &d_init), c.shape.n, c.shape.k, OutputType::kF32);
}

INSTANTIATE_TEST_SUITE_P(AllCases, Fp8GemmAccumulateTest, ::testing::ValuesIn(Fp8Cases(false)),
                         [](const auto& info) { return info.param.Name(); });

// ---------------------------------------------------------------------------------------------
// BF16 GEMM (the `bf16` precision mode): FP32 operands are rounded to BF16, nearest even.

struct Bf16Problem {
  Shape shape;
  InputType a_type = InputType::kF32;
  InputType b_type = InputType::kF32;
  std::vector<float> a_f32, b_f32;       // used when the type is kF32
  std::vector<uint16_t> a_bf16, b_bf16;  // used when the type is kBF16
};

// Operand values as the GEMM must see them: FP32 inputs rounded to BF16 by the reference RNE.
std::vector<double> Bf16Operand(InputType type, const std::vector<float>& f32,
                                const std::vector<uint16_t>& bf16) {
  std::vector<double> out;
  if (type == InputType::kF32) {
    for (float x : f32) out.push_back(RefBf16ToDouble(RefFloatToBf16(x)));
  } else {
    for (uint16_t bits : bf16) out.push_back(RefBf16ToDouble(bits));
  }
  return out;
}

Reference RefBf16Gemm(const Bf16Problem& p, const std::vector<float>* c = nullptr) {
  return RefGemm(Bf16Operand(p.a_type, p.a_f32, p.a_bf16), Bf16Operand(p.b_type, p.b_f32, p.b_bf16),
                 p.shape.m, p.shape.n, p.shape.k, c);
}

absl::StatusOr<std::vector<float>> RunBf16Gemm(const Bf16Problem& p, OutputType out,
                                               bool accumulate,
                                               const std::vector<float>& d_init = {}) {
  Bf16GemmArgs args;
  args.m = p.shape.m;
  args.n = p.shape.n;
  args.k = p.shape.k;
  args.a_type = p.a_type;
  args.a = p.a_type == InputType::kF32 ? static_cast<const void*>(p.a_f32.data())
                                       : static_cast<const void*>(p.a_bf16.data());
  args.b_type = p.b_type;
  args.b = p.b_type == InputType::kF32 ? static_cast<const void*>(p.b_f32.data())
                                       : static_cast<const void*>(p.b_bf16.data());
  args.out_type = out;
  args.accumulate = accumulate;
  GuardedBuffer workspace(GemmWorkspaceBytes(args));
  OutputBuffer d(p.shape.m, p.shape.n, out, d_init);
  args.workspace = workspace.data();
  args.workspace_bytes = workspace.bytes();
  args.d = d.data();
  const absl::Status status = CpuOps().gemm_bf16(args, Stream{});
  if (!status.ok()) return status;
  EXPECT_TRUE(d.GuardIntact()) << "gemm_bf16 wrote past the end of D";
  EXPECT_TRUE(workspace.GuardIntact()) << "gemm_bf16 wrote past GemmWorkspaceBytes of workspace";
  return d.Values();
}

struct Bf16Case {
  InputType a_type;
  InputType b_type;
  Shape shape;
  OutputType out;
  std::string Name() const {
    auto type = [](InputType t) { return t == InputType::kF32 ? "f32" : "bf16"; };
    return absl::StrCat(type(a_type), "_", type(b_type), "_", ShapeName(shape), "_to_",
                        OutName(out));
  }
};
void PrintTo(const Bf16Case& c, std::ostream* os) { *os << c.Name(); }

std::vector<Bf16Case> Bf16Cases(bool with_bf16_output) {
  std::vector<Bf16Case> cases;
  for (InputType a : {InputType::kF32, InputType::kBF16}) {
    for (InputType b : {InputType::kF32, InputType::kBF16}) {
      for (const Shape& s : kShapes) {
        cases.push_back({a, b, s, OutputType::kF32});
        if (with_bf16_output) cases.push_back({a, b, s, OutputType::kBF16});
      }
    }
  }
  return cases;
}

Bf16Problem RandomBf16Problem(const Bf16Case& c, std::mt19937_64& rng) {
  std::normal_distribution<float> normal(0.0f, 1.0f);
  Bf16Problem p;
  p.shape = c.shape;
  p.a_type = c.a_type;
  p.b_type = c.b_type;
  const int64_t a_count = c.shape.m * c.shape.k;
  const int64_t b_count = c.shape.n * c.shape.k;
  if (c.a_type == InputType::kF32) {
    p.a_f32.resize(a_count);
    for (auto& v : p.a_f32) v = normal(rng);
  } else {
    p.a_bf16.resize(a_count);
    for (auto& v : p.a_bf16) v = RefFloatToBf16(normal(rng));
  }
  if (c.b_type == InputType::kF32) {
    p.b_f32.resize(b_count);
    for (auto& v : p.b_f32) v = normal(rng);
  } else {
    p.b_bf16.resize(b_count);
    for (auto& v : p.b_bf16) v = RefFloatToBf16(normal(rng));
  }
  return p;
}

class Bf16GemmTest : public ::testing::TestWithParam<Bf16Case> {};

// FP32 inputs carry 24 significant bits; the GEMM must round them to BF16 first (an unrounded or
// truncated operand errs by ~2^-9 relative per element, far outside the FP32-accumulation bound).
TEST_P(Bf16GemmTest, RandomWithinAccumulationBound) {
  const Bf16Case& c = GetParam();
  std::mt19937_64 rng(static_cast<uint64_t>(c.shape.m * 7919 + c.shape.n * 31 + c.shape.k));
  const Bf16Problem p = RandomBf16Problem(c, rng);
  absl::StatusOr<std::vector<float>> d = RunBf16Gemm(p, c.out, /*accumulate=*/false);
  ASSERT_TRUE(d.ok()) << d.status();
  ExpectWithinBound(*d, RefBf16Gemm(p), c.shape.n, c.shape.k, c.out);
}

INSTANTIATE_TEST_SUITE_P(AllCases, Bf16GemmTest, ::testing::ValuesIn(Bf16Cases(true)),
                         [](const auto& info) { return info.param.Name(); });

// accumulate = true: D += result (FP32 output only).
class Bf16GemmAccumulateTest : public ::testing::TestWithParam<Bf16Case> {};

TEST_P(Bf16GemmAccumulateTest, AddsToExistingD) {
  const Bf16Case& c = GetParam();
  std::mt19937_64 rng(static_cast<uint64_t>(c.shape.m * 7919 + c.shape.n * 31 + c.shape.k + 5));
  const Bf16Problem p = RandomBf16Problem(c, rng);
  std::normal_distribution<float> normal(0.0f, 10.0f);
  std::vector<float> d_init(c.shape.m * c.shape.n);
  for (auto& v : d_init) v = normal(rng);
  absl::StatusOr<std::vector<float>> d = RunBf16Gemm(p, OutputType::kF32, true, d_init);
  ASSERT_TRUE(d.ok()) << d.status();
  ExpectWithinBound(*d, RefBf16Gemm(p, &d_init), c.shape.n, c.shape.k, OutputType::kF32);
}

INSTANTIATE_TEST_SUITE_P(AllCases, Bf16GemmAccumulateTest, ::testing::ValuesIn(Bf16Cases(false)),
                         [](const auto& info) { return info.param.Name(); });

// FP32 inputs that sit on, just above and just below BF16 rounding ties, multiplied by an
// identity so that D shows each rounded operand exactly; expected values written from RNE.
TEST(Bf16GemmRoundingTest, FloatInputsRoundToNearestEven) {
  const std::vector<std::pair<float, float>> cases = {
      {1.0f + 0x1p-8f, 1.0f},                            // tie, last bit even: down
      {1.0f + 0x1p-7f + 0x1p-8f, 1.0f + 0x1p-6f},        // tie, last bit odd: up
      {1.0f + 0x1p-8f + 0x1p-20f, 1.0f + 0x1p-7f},       // above the tie: up
      {1.0f + 0x1p-8f - 0x1p-20f, 1.0f},                 // below the tie: down
      {-(1.0f + 0x1p-7f + 0x1p-8f), -(1.0f + 0x1p-6f)},  // negative tie: away from zero to even
      {255.5f, 256.0f},                                  // tie between 255 (odd) and 256
      {3.0f, 3.0f},                                      // exact
      {0x1p-100f * (1.0f + 0x1p-8f), 0x1p-100f},         // small normal, tie
  };
  const int64_t k = static_cast<int64_t>(cases.size());
  std::vector<float> values;
  for (const auto& [in, out] : cases) {
    values.push_back(in);
    ASSERT_EQ(RefBf16ToDouble(RefFloatToBf16(in)), out);  // the table agrees with the reference
  }
  std::vector<float> identity(k * k, 0.0f);
  for (int64_t i = 0; i < k; ++i) identity[i * k + i] = 1.0f;

  for (OutputType out : {OutputType::kF32, OutputType::kBF16}) {
    SCOPED_TRACE(OutName(out));
    // Values in A (1 x K) times the identity as B: D[0][j] = bf16(a_j).
    Bf16Problem row;
    row.shape = {1, k, k};
    row.a_f32 = values;
    row.b_f32 = identity;
    absl::StatusOr<std::vector<float>> d = RunBf16Gemm(row, out, false);
    ASSERT_TRUE(d.ok()) << d.status();
    for (int64_t j = 0; j < k; ++j) EXPECT_EQ((*d)[j], cases[j].second) << "A input " << j;

    // The identity as A times the values in B (1 x K): D[i][0] = bf16(b_i).
    Bf16Problem col;
    col.shape = {k, 1, k};
    col.a_f32 = identity;
    col.b_f32 = values;
    d = RunBf16Gemm(col, out, false);
    ASSERT_TRUE(d.ok()) << d.status();
    for (int64_t i = 0; i < k; ++i) EXPECT_EQ((*d)[i], cases[i].second) << "B input " << i;
  }
}

// ---------------------------------------------------------------------------------------------
// Validation: InvalidArgument naming the field.

// True when `field` occurs in `message` as a whole identifier (not inside a longer name).
bool MentionsField(std::string_view message, std::string_view field) {
  auto is_ident = [](char ch) {
    return (ch >= 'a' && ch <= 'z') || (ch >= 'A' && ch <= 'Z') || (ch >= '0' && ch <= '9') ||
           ch == '_';
  };
  for (size_t pos = message.find(field); pos != std::string_view::npos;
       pos = message.find(field, pos + 1)) {
    const bool start_ok = pos == 0 || !is_ident(message[pos - 1]);
    const size_t end = pos + field.size();
    const bool end_ok = end == message.size() || !is_ident(message[end]);
    if (start_ok && end_ok) return true;
  }
  return false;
}

void ExpectInvalid(const absl::Status& status, std::initializer_list<std::string_view> fields) {
  EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument) << status;
  bool named = false;
  for (std::string_view f : fields)
    named = named || MentionsField(std::string(status.message()), f);
  std::string wanted;
  for (std::string_view f : fields)
    absl::StrAppend(&wanted, wanted.empty() ? "" : " or ", std::string(f));
  EXPECT_TRUE(named) << "message does not name " << wanted << ": " << status.message();
}

// A valid 3 x 4 x 5 FP8 problem with its buffers; each test breaks one field.
class GemmValidationTest : public ::testing::Test {
 protected:
  void SetUp() override {
    args_.m = 3;
    args_.n = 4;
    args_.k = 5;
    args_.a = a_.data();
    args_.b = b_.data();
    args_.a_scale_inv = &scale_;
    args_.b_scale_inv = &scale_;
    args_.d = d_.data();
    required_ = GemmWorkspaceBytes(args_);
    workspace_.resize(required_ + 64);
    args_.workspace = AlignTo64(workspace_.data());  // the documented 64-byte alignment
    args_.workspace_bytes = required_;

    bf16_args_.m = 3;
    bf16_args_.n = 4;
    bf16_args_.k = 5;
    bf16_args_.a = af_.data();
    bf16_args_.b = bf_.data();
    bf16_args_.d = d_.data();
    bf16_required_ = GemmWorkspaceBytes(bf16_args_);
    bf16_workspace_.resize(bf16_required_ + 64);
    bf16_args_.workspace = AlignTo64(bf16_workspace_.data());
    bf16_args_.workspace_bytes = bf16_required_;
  }

  absl::Status Fp8(const Fp8GemmArgs& args) { return CpuOps().gemm_fp8(args, Stream{}); }
  absl::Status Bf16(const Bf16GemmArgs& args) { return CpuOps().gemm_bf16(args, Stream{}); }

  std::vector<uint8_t> a_ = std::vector<uint8_t>(15, 0x38);  // 1.0 in E4M3
  std::vector<uint8_t> b_ = std::vector<uint8_t>(20, 0x38);
  std::vector<float> af_ = std::vector<float>(15, 1.0f);
  std::vector<float> bf_ = std::vector<float>(20, 1.0f);
  float scale_ = 1.0f;
  std::vector<float> d_ = std::vector<float>(12, 0.0f);
  Fp8GemmArgs args_;
  size_t required_ = 0;
  std::vector<uint8_t> workspace_;
  Bf16GemmArgs bf16_args_;
  size_t bf16_required_ = 0;
  std::vector<uint8_t> bf16_workspace_;
};

TEST_F(GemmValidationTest, MisalignedWorkspaceIsRejected) {
  args_.workspace = static_cast<uint8_t*>(args_.workspace) + 4;
  const absl::Status s = Fp8(args_);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
  EXPECT_NE(std::string(s.message()).find("workspace"), std::string::npos) << s;
}

TEST_F(GemmValidationTest, ValidArgumentsRun) {
  ASSERT_TRUE(Fp8(args_).ok()) << Fp8(args_);
  for (float v : d_) EXPECT_EQ(v, 5.0f);  // K ones
  ASSERT_TRUE(Bf16(bf16_args_).ok()) << Bf16(bf16_args_);
  for (float v : d_) EXPECT_EQ(v, 5.0f);
}

TEST_F(GemmValidationTest, Fp8NullPointers) {
  Fp8GemmArgs args = args_;
  args.a = nullptr;
  ExpectInvalid(Fp8(args), {"a"});
  args = args_;
  args.b = nullptr;
  ExpectInvalid(Fp8(args), {"b"});
  args = args_;
  args.d = nullptr;
  ExpectInvalid(Fp8(args), {"d"});
  args = args_;
  args.a_scale_inv = nullptr;
  ExpectInvalid(Fp8(args), {"a_scale_inv"});
  args = args_;
  args.b_scale_inv = nullptr;
  ExpectInvalid(Fp8(args), {"b_scale_inv"});
}

TEST_F(GemmValidationTest, Mx32NeedsTheE8m0Scales) {
  Fp8GemmArgs args = args_;
  args.scaling = GemmScaling::kMx32;
  ExpectInvalid(Fp8(args), {"a_e8m0 is null"});
  const std::vector<uint8_t> ones(64, 127);  // scale 1 for every block of every row
  args.a_e8m0 = ones.data();
  ExpectInvalid(Fp8(args), {"b_e8m0 is null"});
}

// OCP MX v1.0: E8M0 code e scales by 2^(e - 127) and code 255 is NaN. One row, one column, two
// blocks of K = 64: ones everywhere, block scales chosen per block.
TEST(GemmMx32Test, E8m0ScalesAreAppliedExactlyPerBlock) {
  const Shape s{1, 1, 64};
  Fp8Problem p;
  p.shape = s;
  p.scaling = GemmScaling::kMx32;
  const uint8_t one = EncodeFp8(1.0f, Fp8Format::kE4M3);
  p.a.assign(64, one);
  p.b.assign(64, one);
  p.a_scale_inv = {1.0f};
  p.b_scale_inv = {1.0f};
  auto run = [&](uint8_t a0, uint8_t a1, uint8_t b0, uint8_t b1) {
    p.a_e8m0 = {a0, a1};
    p.b_e8m0 = {b0, b1};
    absl::StatusOr<std::vector<float>> d = RunFp8Gemm(p, OutputType::kF32, false);
    EXPECT_TRUE(d.ok()) << d.status();
    return d.ok() ? (*d)[0] : 0.0f;
  };
  EXPECT_EQ(run(127, 127, 127, 127), 64.0f);
  // 32 * 2^3 * 2^-2 + 32 * 2^0 * 2^1: each block its own pair of scales.
  EXPECT_EQ(run(130, 127, 125, 128), 32.0f * 2.0f + 32.0f * 2.0f);
  // Far from 1: 32 * 2^100 * 2^-90 + 32 * 2^-120 * 2^-3, exact in FP32 (2^15 + 2^-118).
  EXPECT_EQ(run(227, 7, 37, 124), std::ldexp(1.0f, 15) + std::ldexp(1.0f, -118));
  EXPECT_TRUE(std::isnan(run(255, 127, 127, 127))) << "code 255 is NaN";
}

TEST_F(GemmValidationTest, Fp8WorkspaceTooSmall) {
  // The CPU backend decodes the operands to BF16 in the workspace, so it needs some.
  ASSERT_GT(required_, 0u);
  Fp8GemmArgs args = args_;
  args.workspace_bytes = required_ - 1;
  ExpectInvalid(Fp8(args), {"workspace", "workspace_bytes"});
  args = args_;
  args.workspace = nullptr;
  ExpectInvalid(Fp8(args), {"workspace", "workspace_bytes"});
}

TEST_F(GemmValidationTest, Fp8BadShapes) {
  for (int64_t k : {0, -1}) {
    Fp8GemmArgs args = args_;
    args.k = k;
    ExpectInvalid(Fp8(args), {"k"});
  }
  Fp8GemmArgs args = args_;
  args.m = -1;
  ExpectInvalid(Fp8(args), {"m"});
  args = args_;
  args.n = -1;
  ExpectInvalid(Fp8(args), {"n"});
}

TEST_F(GemmValidationTest, Fp8AccumulateNeedsFloatOutput) {
  Fp8GemmArgs args = args_;
  args.out_type = OutputType::kBF16;
  args.accumulate = true;
  ExpectInvalid(Fp8(args), {"accumulate"});
}

TEST_F(GemmValidationTest, Bf16BadArguments) {
  Bf16GemmArgs args = bf16_args_;
  args.a = nullptr;
  ExpectInvalid(Bf16(args), {"a"});
  args = bf16_args_;
  args.b = nullptr;
  ExpectInvalid(Bf16(args), {"b"});
  args = bf16_args_;
  args.d = nullptr;
  ExpectInvalid(Bf16(args), {"d"});
  for (int64_t k : {0, -1}) {
    args = bf16_args_;
    args.k = k;
    ExpectInvalid(Bf16(args), {"k"});
  }
  args = bf16_args_;
  args.out_type = OutputType::kBF16;
  args.accumulate = true;
  ExpectInvalid(Bf16(args), {"accumulate"});
  // FP32 operands are rounded to BF16 in the workspace when the backend needs one.
  if (bf16_required_ > 0) {
    args = bf16_args_;
    args.workspace_bytes = bf16_required_ - 1;
    ExpectInvalid(Bf16(args), {"workspace", "workspace_bytes"});
  }
}

// The fp32-mode GEMM against a double-precision reference: FP32 accumulation of K products of
// values in [-1, 1] is within K * 2^-24 * sum|a b| of the exact result (a loose, standard bound).
TEST(F32GemmTest, MatchesDoubleReferenceAndAccumulates) {
  for (const auto& [m, n, k] :
       std::vector<std::array<int64_t, 3>>{{1, 1, 1}, {7, 5, 3}, {64, 96, 128}, {33, 130, 257}}) {
    std::mt19937 rng(static_cast<uint32_t>(m * 131 + n * 7 + k));
    std::uniform_real_distribution<float> dist(-1.0f, 1.0f);
    std::vector<float> a(static_cast<size_t>(m * k)), b(static_cast<size_t>(n * k)),
        d(static_cast<size_t>(m * n)), d0(static_cast<size_t>(m * n));
    for (float& x : a) x = dist(rng);
    for (float& x : b) x = dist(rng);
    for (float& x : d0) x = dist(rng);
    for (bool accumulate : {false, true}) {
      d = d0;
      F32GemmArgs args{.m = m,
                       .n = n,
                       .k = k,
                       .a = a.data(),
                       .b = b.data(),
                       .d = d.data(),
                       .accumulate = accumulate};
      ASSERT_TRUE(CpuOps().gemm_f32(args, Stream{}).ok());
      for (int64_t i = 0; i < m; ++i) {
        for (int64_t j = 0; j < n; ++j) {
          double exact = accumulate ? d0[static_cast<size_t>(i * n + j)] : 0.0, mag = 0.0;
          for (int64_t p = 0; p < k; ++p) {
            const double prod = static_cast<double>(a[static_cast<size_t>(i * k + p)]) *
                                b[static_cast<size_t>(j * k + p)];
            exact += prod;
            mag += std::fabs(prod);
          }
          const double bound = static_cast<double>(k + 1) * std::ldexp(1.0, -24) * (mag + 1.0);
          ASSERT_NEAR(d[static_cast<size_t>(i * n + j)], exact, bound)
              << m << "x" << n << "x" << k << " at (" << i << ", " << j << ")";
        }
      }
    }
  }
  F32GemmArgs bad{.m = 0, .n = 1, .k = 1};
  EXPECT_EQ(CpuOps().gemm_f32(bad, Stream{}).code(), absl::StatusCode::kInvalidArgument);
}

// ---------------------------------------------------------------------------------------------
// A large GEMM: 2048^3 with tensor scales (E4M3 x E5M2, the HYBRID backward mix), compared with
// the reference on 64 random outputs (the full double reference would take minutes).

TEST(GemmLargeTest, TensorScaled2048Sampled) {
  const Shape s{2048, 2048, 2048};
  std::mt19937_64 rng(2048);
  const Fp8Problem p =
      RandomProblem(s, Fp8Format::kE4M3, Fp8Format::kE5M2, GemmScaling::kTensor, rng);
  absl::StatusOr<std::vector<float>> d = RunFp8Gemm(p, OutputType::kF32, false);
  ASSERT_TRUE(d.ok()) << d.status();
  const double scale = static_cast<double>(p.a_scale_inv[0]) * p.b_scale_inv[0];
  std::uniform_int_distribution<int64_t> pick(0, s.m * s.n - 1);
  int64_t finite = 0;
  for (float v : *d) finite += std::isfinite(v) ? 1 : 0;
  EXPECT_EQ(finite, s.m * s.n) << "non-finite outputs";
  for (int sample = 0; sample < 64; ++sample) {
    const int64_t idx = pick(rng);
    const int64_t i = idx / s.n;
    const int64_t j = idx % s.n;
    double sum = 0.0;
    double abs_sum = 0.0;
    for (int64_t l = 0; l < s.k; ++l) {
      const double prod = RefDecodeFp8(p.a[i * s.k + l], p.a_format) *
                          RefDecodeFp8(p.b[j * s.k + l], p.b_format) * scale;
      sum += prod;
      abs_sum += std::fabs(prod);
    }
    const double bound = WithinBound(s.k, abs_sum, sum, OutputType::kF32);
    EXPECT_LE(std::fabs((*d)[idx] - sum), bound)
        << "D[" << i << "][" << j << "] = " << (*d)[idx] << ", reference " << sum;
  }
}

}  // namespace
}  // namespace fp8rt::kernels

// The CPU backend's internal conversions: the AVX-512 FP8 -> BF16 decoder and the two ways of
// packing B (direct AMX-layout loops, generic blocked offsets) must give identical results.
#include "kernels/cpu/cpu_ops.h"

namespace fp8rt::kernels {
namespace {

TEST(CpuDecodeTest, EveryCodeDecodesToItsExactBf16) {
  // All 256 codes, shifted so that every SIMD lane position sees every code, plus a tail.
  std::vector<uint8_t> codes(256 * 33 + 7);
  for (size_t i = 0; i < codes.size(); ++i) codes[i] = static_cast<uint8_t>(i * 7 + i / 256);
  for (Fp8Format format : {Fp8Format::kE4M3, Fp8Format::kE5M2}) {
    std::vector<uint16_t> out(codes.size());
    cpu_internal::DecodeFp8ToBf16(codes.data(), static_cast<int64_t>(codes.size()), format,
                                  out.data());
    for (size_t i = 0; i < codes.size(); ++i) {
      const float v = DecodeFp8(codes[i], format);
      if (std::isnan(v)) {
        EXPECT_TRUE(std::isnan(Bf16ToFloat(out[i]))) << int(codes[i]);
      } else {
        ASSERT_EQ(Bf16ToFloat(out[i]), v) << "code " << int(codes[i]) << " at " << i;
      }
    }
  }
}

TEST(CpuPackingTest, GenericPackingMatchesTheAmxLoopsBitForBit) {
  if (cpu_internal::UsesF32Matmul()) {
    GTEST_SKIP() << "no oneDNN BF16 matmul on this CPU: B is not packed (FP32 matmul path)";
  }
  std::mt19937 gen(42);
  int shapes_through_amx_loop = 0;
  for (auto [m, n, k] : {std::tuple<int64_t, int64_t, int64_t>{8, 64, 32},
                         {17, 130, 100},
                         {64, 256, 384},
                         {5, 1, 1}}) {
    std::vector<uint8_t> a(static_cast<size_t>(m * k)), b(static_cast<size_t>(n * k));
    std::normal_distribution<float> dist(0.0f, 3.0f);
    for (auto& c : a) c = EncodeFp8(dist(gen), Fp8Format::kE4M3);
    for (auto& c : b) c = EncodeFp8(dist(gen), Fp8Format::kE5M2);
    const float sa = 0.37f, sb = 1.9f;
    std::vector<float> d_fast(static_cast<size_t>(m * n)), d_generic(d_fast.size());
    Fp8GemmArgs g;
    g.m = m;
    g.n = n;
    g.k = k;
    g.a = a.data();
    g.b = b.data();
    g.b_format = Fp8Format::kE5M2;
    g.a_scale_inv = &sa;
    g.b_scale_inv = &sb;
    std::vector<uint8_t> ws(GemmWorkspaceBytes(g) + 64);
    g.workspace = ws.data() + (64 - reinterpret_cast<uintptr_t>(ws.data()) % 64) % 64;
    g.workspace_bytes = GemmWorkspaceBytes(g);
    g.d = d_fast.data();
    const int64_t amx_packs = cpu_internal::AmxLayoutPacksForTesting();
    ASSERT_TRUE(CpuOps().gemm_fp8(g, {}).ok());
    if (cpu_internal::AmxLayoutPacksForTesting() > amx_packs) ++shapes_through_amx_loop;
    cpu_internal::ForceGenericPackingForTesting(true);
    g.d = d_generic.data();
    const absl::Status s = CpuOps().gemm_fp8(g, {});
    cpu_internal::ForceGenericPackingForTesting(false);
    ASSERT_TRUE(s.ok()) << s;
    for (size_t i = 0; i < d_fast.size(); ++i) {
      ASSERT_EQ(std::bit_cast<uint32_t>(d_fast[i]), std::bit_cast<uint32_t>(d_generic[i]))
          << m << "x" << n << "x" << k << " at " << i;
    }
  }
  if (shapes_through_amx_loop == 0) {
    GTEST_SKIP() << "oneDNN picked no AMX weights layout on this CPU: the direct packing loop "
                    "never ran, so only the generic path was exercised";
  }
}

// The BF16 GEMM's B (FP32 values, rounded to nearest even, or BF16 bits) packed by the
// vectorised AMX-layout loop and by the generic blocked path gives the same bits, full blocks
// and partial ones.
TEST(CpuPackingTest, Bf16GemmGenericPackingMatchesTheAmxLoopsBitForBit) {
  if (cpu_internal::UsesF32Matmul()) {
    GTEST_SKIP() << "no oneDNN BF16 matmul on this CPU: B is not packed (FP32 matmul path)";
  }
  std::mt19937 gen(7);
  std::normal_distribution<float> dist(0.0f, 2.0f);
  int shapes_through_amx_loop = 0;
  for (const bool b_f32 : {true, false}) {
    for (auto [m, n, k] : {std::tuple<int64_t, int64_t, int64_t>{8, 64, 32},
                           {17, 130, 100},
                           {64, 256, 384},
                           {5, 1, 1}}) {
      std::vector<float> a(static_cast<size_t>(m * k)), b(static_cast<size_t>(n * k));
      for (float& v : a) v = dist(gen);
      for (float& v : b) v = dist(gen);
      std::vector<uint16_t> b16(b.size());
      for (size_t i = 0; i < b.size(); ++i) b16[i] = FloatToBf16(b[i]);
      std::vector<float> d_fast(static_cast<size_t>(m * n)), d_generic(d_fast.size());
      Bf16GemmArgs g;
      g.m = m;
      g.n = n;
      g.k = k;
      g.a = a.data();
      g.a_type = InputType::kF32;
      g.b = b_f32 ? static_cast<const void*>(b.data()) : b16.data();
      g.b_type = b_f32 ? InputType::kF32 : InputType::kBF16;
      std::vector<uint8_t> ws(GemmWorkspaceBytes(g) + 64);
      g.workspace = ws.data() + (64 - reinterpret_cast<uintptr_t>(ws.data()) % 64) % 64;
      g.workspace_bytes = GemmWorkspaceBytes(g);
      g.d = d_fast.data();
      const int64_t amx_packs = cpu_internal::AmxLayoutPacksForTesting();
      ASSERT_TRUE(CpuOps().gemm_bf16(g, {}).ok());
      if (cpu_internal::AmxLayoutPacksForTesting() > amx_packs) ++shapes_through_amx_loop;
      cpu_internal::ForceGenericPackingForTesting(true);
      g.d = d_generic.data();
      const absl::Status s = CpuOps().gemm_bf16(g, {});
      cpu_internal::ForceGenericPackingForTesting(false);
      ASSERT_TRUE(s.ok()) << s;
      for (size_t i = 0; i < d_fast.size(); ++i) {
        ASSERT_EQ(std::bit_cast<uint32_t>(d_fast[i]), std::bit_cast<uint32_t>(d_generic[i]))
            << (b_f32 ? "f32" : "bf16") << " " << m << "x" << n << "x" << k << " at " << i;
      }
    }
  }
  if (shapes_through_amx_loop == 0) {
    GTEST_SKIP() << "oneDNN picked no AMX weights layout on this CPU: the direct packing loop "
                    "never ran, so only the generic path was exercised";
  }
}

// B given as K x N (Fp8GemmArgs::b_transposed, tensor scaling: the CPU backward's dgrad and
// wgrad) gives the exact product of the same data with B as N x K (exactly representable data, see
// ExactProblem), on the vectorised AMX packing loop, the generic blocked path and the FP32-matmul
// path, FP32 and BF16 output, full and partial blocks. Block and mx32 scaling refuse it.
TEST(Fp8GemmBTransposedTest, GivesTheExactProductOnEveryPath) {
  std::mt19937_64 rng(91);
  enum class Path { kAmxLoop, kGeneric, kF32Matmul };
  int amx_loop_runs = 0;
  for (const Shape s : {Shape{8, 64, 32}, Shape{17, 130, 100}, Shape{64, 256, 384}, Shape{5, 1, 1},
                        Shape{3, 65, 33}}) {
    for (const Path path : {Path::kAmxLoop, Path::kGeneric, Path::kF32Matmul}) {
      for (const OutputType out : {OutputType::kF32, OutputType::kBF16}) {
        const Fp8Problem p =
            ExactProblem(s, Fp8Format::kE4M3, Fp8Format::kE5M2, GemmScaling::kTensor, rng);
        Fp8Problem t = p;
        t.b_transposed = true;
        for (int64_t r = 0; r < s.n; ++r) {
          for (int64_t c = 0; c < s.k; ++c) t.b[c * s.n + r] = p.b[r * s.k + c];
        }
        cpu_internal::ForceGenericPackingForTesting(path == Path::kGeneric);
        cpu_internal::ForceF32MatmulForTesting(path == Path::kF32Matmul);
        const int64_t amx_packs = cpu_internal::AmxLayoutPacksForTesting();
        const absl::StatusOr<std::vector<float>> d = RunFp8Gemm(t, out, /*accumulate=*/false);
        amx_loop_runs += cpu_internal::AmxLayoutPacksForTesting() > amx_packs;
        cpu_internal::ForceGenericPackingForTesting(false);
        cpu_internal::ForceF32MatmulForTesting(false);
        ASSERT_TRUE(d.ok()) << d.status();
        SCOPED_TRACE(absl::StrCat(s.m, "x", s.n, "x", s.k, " path ", static_cast<int>(path),
                                  out == OutputType::kF32 ? " f32" : " bf16"));
        ExpectExact(*d, RefFp8Gemm(p), s.n, out);
      }
    }
  }
  for (const GemmScaling scaling : {GemmScaling::kBlock, GemmScaling::kMx32}) {
    Fp8Problem p =
        ExactProblem(Shape{8, 64, 128}, Fp8Format::kE4M3, Fp8Format::kE4M3, scaling, rng);
    MxScales(p);
    p.b_transposed = true;
    const absl::StatusOr<std::vector<float>> d = RunFp8Gemm(p, OutputType::kF32, false);
    EXPECT_EQ(d.status().code(), absl::StatusCode::kInvalidArgument) << d.status();
    EXPECT_NE(d.status().message().find("b_transposed"), std::string::npos) << d.status();
  }
  if (amx_loop_runs == 0) {
    GTEST_SKIP() << "oneDNN picked no AMX weights layout on this CPU (or has no BF16 matmul): "
                    "the direct K x N packing loop never ran; the generic and FP32 paths passed";
  }
}

// PackFp8AmxLayout, from B as N x K and from B^T as K x N, against oneDNN's definition of the
// AMX layout (see the BF16 packing test below): element (r, c) of B goes to
// (c / 32) * k_stride + (r / 64) * n_stride + ((c % 32) / 2) * 128 + (r % 64) * 2 + c % 2 as the
// BF16 bits of its decoded value (FP8 values are exact in BF16; a NaN code gives a BF16 NaN), and
// the padding is zero. Every code, both formats, both outer orders, full and partial blocks.
TEST(CpuPackingTest, Fp8PackingFollowsTheBlockedLayoutFromEitherOrientation) {
  std::mt19937 gen(12);
  std::uniform_int_distribution<int> code(0, 255);
  for (const Fp8Format format : {Fp8Format::kE4M3, Fp8Format::kE5M2}) {
    for (auto [n, k] :
         {std::pair<int64_t, int64_t>{64, 32}, {130, 100}, {64, 96}, {1, 1}, {200, 64}}) {
      std::vector<uint8_t> b(static_cast<size_t>(n * k)), bt(b.size());
      for (size_t i = 0; i < b.size(); ++i) b[i] = static_cast<uint8_t>(i < 256 ? i : code(gen));
      for (int64_t r = 0; r < n; ++r) {
        for (int64_t c = 0; c < k; ++c) bt[c * n + r] = b[r * k + c];
      }
      for (const bool transposed : {false, true}) {
        for (const bool n_outer : {true, false}) {
          const int64_t kp = (k + 31) / 32 * 32, np = (n + 63) / 64 * 64;
          const int64_t kblocks = kp / 32, nblocks = np / 64;
          const int64_t k_stride = n_outer ? 2048 : 2048 * nblocks;
          const int64_t n_stride = n_outer ? 2048 * kblocks : 2048;
          std::vector<uint16_t> got(static_cast<size_t>(kp * np), 0xDEAD);
          cpu_internal::PackFp8AmxLayout(transposed ? bt.data() : b.data(), transposed, n, k,
                                         format, kp, np, k_stride, n_stride, got.data());
          int64_t bad = 0;
          for (int64_t r = 0; r < np; ++r) {
            for (int64_t c = 0; c < kp; ++c) {
              const int64_t at = (c / 32) * k_stride + (r / 64) * n_stride + ((c % 32) / 2) * 128 +
                                 (r % 64) * 2 + c % 2;
              const uint16_t g = got[static_cast<size_t>(at)];
              if (r >= n || c >= k) {
                bad += g != 0;
                continue;
              }
              const double want = RefDecodeFp8(b[r * k + c], format);
              bad += std::isnan(want) ? !std::isnan(Bf16ToFloat(g))
                                      : std::bit_cast<uint32_t>(Bf16ToFloat(g)) !=
                                            std::bit_cast<uint32_t>(static_cast<float>(want));
            }
          }
          EXPECT_EQ(bad, 0) << (format == Fp8Format::kE4M3 ? "e4m3 " : "e5m2 ") << n << "x" << k
                            << (transposed ? " from K x N" : " from N x K")
                            << (n_outer ? ", n blocks outer" : ", k blocks outer");
        }
      }
    }
  }
}

// PackBf16AmxLayout against oneDNN's definition of the layout (format tags BA16a64b2a /
// AB16a64b2a: blocks of 32 k x 64 n, inside them 16 rows of k pairs, each row 64 n of (even k,
// odd k)), with the outer block strides given: element (r, c) of B goes to
// (c / 32) * k_stride + (r / 64) * n_stride + ((c % 32) / 2) * 128 + (r % 64) * 2 + c % 2, and the
// padding is zero. FP32 is rounded as FloatToBf16 rounds (ties to even, NaN kept quiet, Inf and
// -0 kept), BF16 bits are copied. Both outer orders, full and partial blocks.
TEST(CpuPackingTest, Bf16PackingFollowsTheBlockedLayoutAndRoundsAsFloatToBf16) {
  std::mt19937 gen(11);
  std::normal_distribution<float> dist(0.0f, 2.0f);
  const float specials[] = {std::numeric_limits<float>::quiet_NaN(),
                            -std::numeric_limits<float>::infinity(),
                            -0.0f,
                            1.0f + 0x1p-8f,      // a tie: to even, 1
                            1.0f + 3 * 0x1p-8f,  // a tie: to even, up
                            3.4e38f,             // rounds up to Inf
                            1e-40f};             // subnormal
  for (const bool f32 : {true, false}) {
    for (auto [n, k] : {std::pair<int64_t, int64_t>{64, 32}, {130, 100}, {64, 96}, {1, 1}}) {
      for (const bool n_outer : {true, false}) {
        std::vector<float> b(static_cast<size_t>(n * k));
        for (float& v : b) v = dist(gen);
        for (size_t i = 0; i < std::size(specials) && i < b.size(); ++i)
          b[i * 7 % b.size()] = specials[i];
        std::vector<uint16_t> b16(b.size());
        for (size_t i = 0; i < b.size(); ++i) b16[i] = FloatToBf16(b[i]);
        const int64_t kp = (k + 31) / 32 * 32, np = (n + 63) / 64 * 64;
        const int64_t kblocks = kp / 32, nblocks = np / 64;
        // AB: k blocks outermost; BA: n blocks outermost.
        const int64_t k_stride = n_outer ? 2048 : 2048 * nblocks;
        const int64_t n_stride = n_outer ? 2048 * kblocks : 2048;
        std::vector<uint16_t> got(static_cast<size_t>(kp * np), 0xDEAD);
        cpu_internal::PackBf16AmxLayout(f32 ? static_cast<const void*>(b.data()) : b16.data(), f32,
                                        n, k, kp, np, k_stride, n_stride, got.data());
        int64_t bad = 0;
        for (int64_t r = 0; r < np; ++r) {
          for (int64_t c = 0; c < kp; ++c) {
            const int64_t at = (c / 32) * k_stride + (r / 64) * n_stride + ((c % 32) / 2) * 128 +
                               (r % 64) * 2 + c % 2;
            const uint16_t want = r < n && c < k ? FloatToBf16(b[r * k + c]) : uint16_t{0};
            bad += got[static_cast<size_t>(at)] != want;
          }
        }
        EXPECT_EQ(bad, 0) << (f32 ? "f32 " : "bf16 ") << n << "x" << k
                          << (n_outer ? " n blocks outer" : " k blocks outer");
      }
    }
  }
  // The reference rounding itself, on the specials (kernels/formats.h).
  EXPECT_EQ(FloatToBf16(1.0f + 0x1p-8f), 0x3F80);
  EXPECT_EQ(FloatToBf16(1.0f + 3 * 0x1p-8f), 0x3F82);
  EXPECT_EQ(FloatToBf16(3.4e38f), 0x7F80);
  EXPECT_EQ(FloatToBf16(-0.0f), 0x8000);
}

}  // namespace
}  // namespace fp8rt::kernels
