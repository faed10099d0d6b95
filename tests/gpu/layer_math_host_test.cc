// The per-element arithmetic of the CUDA layer ops (kernels/cuda/layer_math.cuh), compiled as host
// code, against the CPU reference it mirrors (kernels/layer_ops.h, kernels/cpu/layer_ops_cpu.cc).
// Needs no GPU, so it runs in every build: an operation out of order or a wrong constant in the
// mirror fails here; tests/gpu/layer_ops_cuda_test.cc then checks the compiled kernels on a device.
//
// The shim (tests/gpu/host_shim.h) maps the CUDA intrinsics layer_math.cuh uses to their IEEE
// definitions: __fadd_rn / __fsub_rn / __fmul_rn / __fdiv_rn / __fsqrt_rn are FP32 operations
// rounded to nearest even (the host's default rounding; separate non-inlined calls, so nothing is
// contracted into an FMA), and tanhf is the host's tanhf, the function std::tanh(float) of the CPU
// reference calls. So every function must equal
// the reference bit for bit here, GELU included (on the device tanhf differs by a few ulp; that
// tolerance belongs to layer_ops_cuda_test).
//
// Index: AdamWOne over random elements and a grid of special values (zeros, denormals, huge
// values, Inf, NaN) under several scalar sets; AddF32 as ResidualForward / ResidualBackward over
// random bit patterns; GELU forward and backward over a dense range and random bit patterns;
// RMSNorm forward and backward, the per-element functions driven in the CPU's order of sums.
// Tolerances: none. NaN results are compared as "both NaN": which NaN payload an operation with
// NaN operands returns depends on the order the compiler puts commutative operands in, which
// neither backend promises.
#include <bit>
#include <cmath>
#include <cstdint>
#include <limits>
#include <numbers>
#include <random>
#include <span>
#include <string>
#include <vector>

#include "gtest/gtest.h"
#include "kernels/layer_ops.h"
#include "tests/gpu/host_shim.h"
// After the shim, which lets it compile as host code.
#include "kernels/cuda/layer_math.cuh"

namespace fp8rt::kernels {
namespace {

namespace dev = cuda_internal;

uint32_t Bits(float x) { return std::bit_cast<uint32_t>(x); }
float FromBits(uint32_t b) { return std::bit_cast<float>(b); }

// Equal bits, or both NaN.
bool Same(float a, float b) { return Bits(a) == Bits(b) || (std::isnan(a) && std::isnan(b)); }

// Counts the elements where `got` and `want` differ (Same), remembering the first.
struct Mismatches {
  int64_t count = 0;
  std::string first;
  void Check(float got, float want, const std::string& where) {
    if (Same(got, want)) return;
    if (count++ == 0) {
      first = where + ": got " + std::to_string(got) + " (0x" + ToHex(Bits(got)) + "), want " +
              std::to_string(want) + " (0x" + ToHex(Bits(want)) + ")";
    }
  }
  static std::string ToHex(uint32_t b) {
    static const char* kDigits = "0123456789abcdef";
    std::string s(8, '0');
    for (int i = 7; i >= 0; --i, b >>= 4) s[static_cast<size_t>(i)] = kDigits[b & 15];
    return s;
  }
};

// Values of every class: signed zeros, the smallest and largest denormals, FLT_MIN, ordinary
// values, values whose square or product overflows, FLT_MAX, Inf and NaN.
std::vector<float> SpecialValues() {
  const float inf = std::numeric_limits<float>::infinity();
  const std::vector<float> magnitudes = {0.0f,
                                         std::numeric_limits<float>::denorm_min(),
                                         FromBits(0x007FFFFFu),
                                         std::numeric_limits<float>::min(),
                                         1e-20f,
                                         3e-4f,
                                         0.5f,
                                         1.0f,
                                         3.25f,
                                         1e19f,
                                         3e38f,
                                         std::numeric_limits<float>::max(),
                                         inf};
  std::vector<float> out;
  for (float m : magnitudes) {
    out.push_back(m);
    out.push_back(-m);
  }
  out.push_back(std::numeric_limits<float>::quiet_NaN());
  out.push_back(FromBits(0xFFC00123u));  // negative NaN with a payload
  return out;
}

// Random floats: mostly N(0, s) for a few scales, some random bit patterns (every class).
std::vector<float> RandomValues(size_t n, uint32_t seed, float scale, bool any_bits) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> normal(0.0f, scale);
  std::vector<float> x(n);
  for (float& v : x) v = any_bits && rng() % 8 == 0 ? FromBits(rng()) : normal(rng);
  return x;
}

// --- AdamW
// -----------------------------------------------------------------------------------------

// The step scalars as the optimizer computes them (host FP64, rounded once to FP32) at step t.
AdamWArgs Scalars(double lr, double weight_decay, double clip, double beta1, double beta2,
                  double eps, int t) {
  AdamWArgs k;
  k.lr = static_cast<float>(lr);
  k.decay = static_cast<float>(lr * weight_decay);
  k.clip_scale = static_cast<float>(clip);
  k.beta1 = static_cast<float>(beta1);
  k.one_minus_beta1 = static_cast<float>(1.0 - beta1);
  k.beta2 = static_cast<float>(beta2);
  k.one_minus_beta2 = static_cast<float>(1.0 - beta2);
  k.bias1 = static_cast<float>(1.0 - std::pow(beta1, t));
  k.bias2 = static_cast<float>(1.0 - std::pow(beta2, t));
  k.eps = static_cast<float>(eps);
  return k;
}

// Runs the CPU reference and AdamWOne on the same four arrays and compares master, m and v.
void CheckAdamW(AdamWArgs k, std::vector<float> master, const std::vector<float>& grad,
                std::vector<float> m, std::vector<float> v, const std::string& what) {
  std::vector<float> cpu_master = master, cpu_m = m, cpu_v = v;
  k.master = cpu_master.data();
  k.grad = grad.data();
  k.m = cpu_m.data();
  k.v = cpu_v.data();
  k.count = static_cast<int64_t>(grad.size());
  AdamWUpdate(k);
  Mismatches mm;
  for (size_t i = 0; i < grad.size(); ++i) {
    dev::AdamWOne(k, grad[i], master[i], m[i], v[i]);
    const std::string at = what + " element " + std::to_string(i);
    mm.Check(master[i], cpu_master[i], at + " master");
    mm.Check(m[i], cpu_m[i], at + " m");
    mm.Check(v[i], cpu_v[i], at + " v");
  }
  EXPECT_EQ(mm.count, 0) << mm.first;
}

const AdamWArgs kAdamWConfigs[] = {
    Scalars(3e-4, 0.1, 1.0, 0.9, 0.95, 1e-8, 1),      // first step: bias corrections small
    Scalars(3e-4, 0.1, 0.37, 0.9, 0.95, 1e-8, 1000),  // clipped gradients, late step
    Scalars(1e-2, 0.0, 1.0, 0.9, 0.999, 1e-6, 7),     // no decay
    Scalars(6e-4, 0.01, 2.5e-3, 0.95, 0.99, 0.0, 3),  // eps 0: 0 / 0 where v is 0
    Scalars(1.0, 0.5, 1e30, 0.5, 0.5, 1e-30, 2),      // g * g overflows for most gradients
};

TEST(LayerMathTest, AdamWEqualsTheCpuReferenceOnRandomValues) {
  constexpr size_t kN = 200000;
  int config = 0;
  for (const AdamWArgs& k : kAdamWConfigs) {
    const std::vector<float> master = RandomValues(kN, 10 + config, 0.05f, false);
    const std::vector<float> grad = RandomValues(kN, 20 + config, 1e-3f, true);
    const std::vector<float> m = RandomValues(kN, 30 + config, 1e-3f, false);
    std::vector<float> v = RandomValues(kN, 40 + config, 1e-3f, false);
    for (float& x : v) x = x * x;  // a second moment is >= 0
    CheckAdamW(k, master, grad, m, v, "config " + std::to_string(config));
    ++config;
  }
}

// Every combination of special values in master, grad, m and v (v's negative values and NaNs
// included: the update must still be the same operations, whatever they give).
TEST(LayerMathTest, AdamWEqualsTheCpuReferenceOnSpecialValues) {
  const std::vector<float> s = SpecialValues();
  std::vector<float> master, grad, m, v;
  for (float a : s) {
    for (float b : s) {
      for (float c : s) {
        for (float d : s) {
          master.push_back(a);
          grad.push_back(b);
          m.push_back(c);
          v.push_back(d);
        }
      }
    }
  }
  int config = 0;
  for (const AdamWArgs& k : kAdamWConfigs) {
    CheckAdamW(k, master, grad, m, v, "specials, config " + std::to_string(config++));
  }
}

// --- residual
// --------------------------------------------------------------------------------------

TEST(LayerMathTest, AddF32IsTheResidualForwardAndBackward) {
  constexpr size_t kN = 1 << 20;
  std::vector<float> a = RandomValues(kN, 1, 3.0f, true);
  std::vector<float> b = RandomValues(kN, 2, 3.0f, true);
  std::vector<float> dout = RandomValues(kN, 3, 3.0f, true);
  // Every pair of specials, appended (dout takes b's special).
  for (float x : SpecialValues()) {
    for (float y : SpecialValues()) {
      a.push_back(x);
      b.push_back(y);
      dout.push_back(y);
    }
  }
  const int64_t n = static_cast<int64_t>(a.size());
  std::vector<float> out(a.size());
  ResidualForward(out, a, b, n);
  std::vector<float> da = a, db = b;  // backward accumulates onto these
  ResidualBackward(da, db, dout, n);
  Mismatches mm;
  for (size_t i = 0; i < a.size(); ++i) {
    const std::string at = "element " + std::to_string(i);
    mm.Check(dev::AddF32(a[i], b[i]), out[i], at + " forward");
    mm.Check(dev::AddF32(a[i], dout[i]), da[i], at + " da");
    mm.Check(dev::AddF32(b[i], dout[i]), db[i], at + " db");
  }
  EXPECT_EQ(mm.count, 0) << mm.first;
}

// --- GELU
// ------------------------------------------------------------------------------------------

TEST(LayerMathTest, GeluEqualsTheCpuReference) {
  // A dense sweep of [-12, 12] (both tails of tanh and the cubic's range) plus random bit
  // patterns of every class, plus the specials.
  std::vector<float> x;
  for (int i = -1200000; i <= 1200000; ++i) x.push_back(static_cast<float>(i) * 1e-5f);
  std::mt19937 rng(5);
  for (int i = 0; i < 1000000; ++i) x.push_back(FromBits(rng()));
  for (float s : SpecialValues()) x.push_back(s);
  const int64_t n = static_cast<int64_t>(x.size());
  const std::vector<float> dout = RandomValues(x.size(), 6, 2.0f, true);
  const std::vector<float> dx0 = RandomValues(x.size(), 7, 1.0f, false);
  std::vector<float> out(x.size());
  GeluForward(out, x, n);
  std::vector<float> dx = dx0;
  GeluBackward(dx, dout, x, n);
  Mismatches mm;
  for (size_t i = 0; i < x.size(); ++i) {
    const std::string at = "x = " + std::to_string(x[i]) + " (element " + std::to_string(i) + ")";
    mm.Check(dev::GeluForwardOne(x[i]), out[i], at + " forward");
    mm.Check(dev::GeluBackwardOne(dx0[i], dout[i], x[i]), dx[i], at + " backward");
  }
  EXPECT_EQ(mm.count, 0) << mm.first;
  // The constants are the reference's: GELU(1) from its definition, in double, agrees closely.
  EXPECT_NEAR(dev::GeluForwardOne(1.0f),
              0.5 * (1.0 + std::tanh(std::sqrt(2.0 / std::numbers::pi) * 1.044715)), 1e-6);
}

// --- RMSNorm
// ---------------------------------------------------------------------------------------

// The per-element functions, with the row and column sums taken in the CPU's order (index
// ascending), give the CPU's results bit for bit. On the GPU only those sums' order differs.
TEST(LayerMathTest, RmsNormEqualsTheCpuReferenceInTheCpuSumOrder) {
  struct Shape {
    int64_t n, c;
  };
  for (const Shape& s : {Shape{1, 1}, Shape{3, 7}, Shape{17, 768}, Shape{64, 1031}}) {
    SCOPED_TRACE("n = " + std::to_string(s.n) + ", c = " + std::to_string(s.c));
    const size_t nc = static_cast<size_t>(s.n * s.c);
    const std::vector<float> x = RandomValues(nc, 11, 2.0f, false);
    const std::vector<float> w = RandomValues(static_cast<size_t>(s.c), 12, 1.0f, false);
    const std::vector<float> dout = RandomValues(nc, 13, 1.0f, false);
    const std::vector<float> dx0 = RandomValues(nc, 14, 0.5f, false);
    const std::vector<float> dw0 = RandomValues(static_cast<size_t>(s.c), 15, 0.5f, false);
    constexpr float kEps = 1e-5f;

    std::vector<float> out(nc), rstd(static_cast<size_t>(s.n));
    RmsNormForward(out, rstd, x, w, s.n, s.c, kEps);
    std::vector<float> dx = dx0, dw = dw0;
    RmsNormBackward(dx, dw, dout, x, w, rstd, s.n, s.c);

    Mismatches mm;
    std::vector<float> dev_dw = dw0;
    for (int64_t r = 0; r < s.n; ++r) {
      const std::string row = "row " + std::to_string(r);
      float sum_sq = 0.0f, gx = 0.0f;
      for (int64_t j = 0; j < s.c; ++j) {
        sum_sq = dev::AddF32(sum_sq, dev::RmsNormSquare(x[r * s.c + j]));
        gx = dev::AddF32(gx, dev::RmsNormGxTerm(dout[r * s.c + j], w[j], x[r * s.c + j]));
      }
      const float rs = dev::RmsNormRstd(sum_sq, s.c, kEps);
      mm.Check(rs, rstd[r], row + " rstd");
      const float coef = dev::RmsNormCoef(rs, gx, s.c);
      for (int64_t j = 0; j < s.c; ++j) {
        const int64_t i = r * s.c + j;
        const std::string at = row + " col " + std::to_string(j);
        mm.Check(dev::RmsNormOut(x[i], rs, w[j]), out[i], at + " out");
        mm.Check(dev::RmsNormDx(dx0[i], rs, dout[i], w[j], coef, x[i]), dx[i], at + " dx");
        dev_dw[j] = dev::AddF32(dev_dw[j], dev::RmsNormDweightTerm(dout[i], x[i], rs));
      }
    }
    for (int64_t j = 0; j < s.c; ++j) mm.Check(dev_dw[j], dw[j], "dweight " + std::to_string(j));
    EXPECT_EQ(mm.count, 0) << mm.first;
  }
}

}  // namespace
}  // namespace fp8rt::kernels
