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
// RMSNorm and LayerNorm forward and backward, the per-element functions driven in the CPU's order
// of sums; RoPE's cos and sin and pair rotations (forward and backward) over positions, heads and
// frequencies; SwiGLU forward and backward over a dense range, random bit patterns and specials;
// sum_squares' grid and order (layer_math.cuh): the block count as a function of the count, each
// thread's strided chain in ascending order, every element added exactly once, two sums derived by
// hand from the documented order, and the order's error bound against the exact sum and the CPU.
// Tolerances: none, but for the sum_squares bounds (derived where they are checked). NaN results
// are compared as "both NaN": which NaN payload an operation with NaN operands returns depends on
// the order the compiler puts commutative operands in, which neither backend promises.
#include <algorithm>
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
  ASSERT_TRUE(AdamWUpdate(k).ok());
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

// --- LayerNorm
// -------------------------------------------------------------------------------------

// As for RMSNorm: the per-element functions in the CPU's order of sums are the CPU, bit for bit.
TEST(LayerMathTest, LayerNormEqualsTheCpuReferenceInTheCpuSumOrder) {
  struct Shape {
    int64_t n, c;
  };
  for (const Shape& s : {Shape{1, 1}, Shape{3, 7}, Shape{17, 768}, Shape{64, 1031}}) {
    SCOPED_TRACE("n = " + std::to_string(s.n) + ", c = " + std::to_string(s.c));
    const size_t nc = static_cast<size_t>(s.n * s.c);
    std::vector<float> x = RandomValues(nc, 21, 2.0f, false);
    for (float& e : x) e += 1.5f;
    const std::vector<float> w = RandomValues(static_cast<size_t>(s.c), 22, 1.0f, false);
    const std::vector<float> b = RandomValues(static_cast<size_t>(s.c), 23, 0.5f, false);
    const std::vector<float> dout = RandomValues(nc, 24, 1.0f, false);
    const std::vector<float> dx0 = RandomValues(nc, 25, 0.5f, false);
    const std::vector<float> dw0 = RandomValues(static_cast<size_t>(s.c), 26, 0.5f, false);
    const std::vector<float> db0 = RandomValues(static_cast<size_t>(s.c), 27, 0.5f, false);
    constexpr float kEps = 1e-5f;

    std::vector<float> out(nc), mean(static_cast<size_t>(s.n)), rstd(static_cast<size_t>(s.n));
    LayerNormForward(out, mean, rstd, x, w, b, s.n, s.c, kEps);
    std::vector<float> dx = dx0, dw = dw0, db = db0;
    LayerNormBackward(dx, dw, db, dout, x, w, mean, rstd, s.n, s.c);

    Mismatches mm;
    std::vector<float> dev_dw = dw0, dev_db = db0;
    for (int64_t r = 0; r < s.n; ++r) {
      const std::string row = "row " + std::to_string(r);
      const float* xr = x.data() + r * s.c;
      float sum = 0.0f;
      for (int64_t j = 0; j < s.c; ++j) sum = dev::AddF32(sum, xr[j]);
      const float m = dev::LayerNormMean(sum, s.c);
      float sum_sq = 0.0f;
      for (int64_t j = 0; j < s.c; ++j) {
        sum_sq = dev::AddF32(sum_sq, dev::LayerNormSquare(dev::LayerNormCentered(xr[j], m)));
      }
      const float rs = dev::LayerNormRstd(sum_sq, s.c, kEps);
      mm.Check(m, mean[r], row + " mean");
      mm.Check(rs, rstd[r], row + " rstd");
      float g_sum = 0.0f, gx_sum = 0.0f;
      for (int64_t j = 0; j < s.c; ++j) {
        const float g = dev::LayerNormG(dout[r * s.c + j], w[j]);
        g_sum = dev::AddF32(g_sum, g);
        gx_sum = dev::AddF32(gx_sum, dev::LayerNormGxTerm(g, dev::LayerNormXhat(xr[j], m, rs)));
      }
      const float g_mean = dev::LayerNormMean(g_sum, s.c);
      const float gx_mean = dev::LayerNormMean(gx_sum, s.c);
      for (int64_t j = 0; j < s.c; ++j) {
        const int64_t i = r * s.c + j;
        const std::string at = row + " col " + std::to_string(j);
        const float xhat = dev::LayerNormXhat(x[i], m, rs);
        mm.Check(dev::LayerNormOut(x[i], m, rs, w[j], b[j]), out[i], at + " out");
        mm.Check(
            dev::LayerNormDx(dx0[i], dev::LayerNormG(dout[i], w[j]), g_mean, xhat, gx_mean, rs),
            dx[i], at + " dx");
        dev_dw[j] = dev::AddF32(dev_dw[j], dev::LayerNormDweightTerm(dout[i], xhat));
        dev_db[j] = dev::AddF32(dev_db[j], dout[i]);
      }
    }
    for (int64_t j = 0; j < s.c; ++j) {
      mm.Check(dev_dw[j], dw[j], "dweight " + std::to_string(j));
      mm.Check(dev_db[j], db[j], "dbias " + std::to_string(j));
    }
    EXPECT_EQ(mm.count, 0) << mm.first;
  }
}

// --- RoPE
// ------------------------------------------------------------------------------------------

// RopeCosSin with the pair rotations is the CPU's RopeForward and RopeBackward bit for bit (on
// the host the FP64 functions are the same), over long sequences and several thetas.
TEST(LayerMathTest, RopeEqualsTheCpuReference) {
  struct Shape {
    int64_t n, t, h, dh;
    float theta;
  };
  for (const Shape& s : {Shape{1, 1, 1, 2, 10000.0f}, Shape{7, 3, 2, 8, 10000.0f},
                         Shape{4096, 4096, 2, 64, 500000.0f}, Shape{600, 200, 3, 130, 1.5f}}) {
    SCOPED_TRACE("n = " + std::to_string(s.n) + ", dh = " + std::to_string(s.dh));
    const size_t sz = static_cast<size_t>(s.n * s.h * s.dh);
    const std::vector<float> x = RandomValues(sz, 31, 1.0f, true);
    const std::vector<float> dout = RandomValues(sz, 32, 1.0f, true);
    const std::vector<float> dx0 = RandomValues(sz, 33, 0.5f, false);
    std::vector<float> out(sz), dx = dx0;
    RopeForward(out, x, s.n, s.t, s.h, s.dh, s.theta);
    RopeBackward(dx, dout, s.n, s.t, s.h, s.dh, s.theta);
    Mismatches mm;
    const int64_t half = s.dh / 2;
    for (int64_t r = 0; r < s.n; ++r) {
      for (int64_t i = 0; i < half; ++i) {
        float c, sn;
        dev::RopeCosSin(r % s.t, i, s.dh, s.theta, c, sn);
        for (int64_t hh = 0; hh < s.h; ++hh) {
          const size_t a = static_cast<size_t>((r * s.h + hh) * s.dh + i), b = a + half;
          const std::string at = "row " + std::to_string(r) + " head " + std::to_string(hh) +
                                 " pair " + std::to_string(i);
          float oa, ob;
          dev::RopeForwardPair(x[a], x[b], c, sn, oa, ob);
          mm.Check(oa, out[a], at + " forward first");
          mm.Check(ob, out[b], at + " forward second");
          float da = dx0[a], db = dx0[b];
          dev::RopeBackwardPair(dout[a], dout[b], c, sn, da, db);
          mm.Check(da, dx[a], at + " backward first");
          mm.Check(db, dx[b], at + " backward second");
        }
      }
    }
    EXPECT_EQ(mm.count, 0) << mm.first;
  }
}

// --- SwiGLU
// ----------------------------------------------------------------------------------------

TEST(LayerMathTest, SwigluEqualsTheCpuReference) {
  // A dense sweep of [-100, 100] (both saturations of the sigmoid and exp's overflow), random bit
  // patterns, specials; up and dout random.
  std::vector<float> gate;
  for (int i = -500000; i <= 500000; ++i) gate.push_back(static_cast<float>(i) * 2e-4f);
  std::mt19937 rng(8);
  for (int i = 0; i < 500000; ++i) gate.push_back(FromBits(rng()));
  for (float v : SpecialValues()) gate.push_back(v);
  const int64_t n = static_cast<int64_t>(gate.size());
  const std::vector<float> up = RandomValues(gate.size(), 9, 2.0f, true);
  const std::vector<float> dout = RandomValues(gate.size(), 10, 1.0f, true);
  const std::vector<float> dg0 = RandomValues(gate.size(), 11, 1.0f, false);
  const std::vector<float> du0 = RandomValues(gate.size(), 12, 1.0f, false);
  std::vector<float> out(gate.size()), dg = dg0, du = du0;
  SwigluForward(out, gate, up, n);
  SwigluBackward(dg, du, dout, gate, up, n);
  Mismatches mm;
  for (size_t i = 0; i < gate.size(); ++i) {
    const float o = dev::SwigluForwardOne(gate[i], up[i]);
    float g = dg0[i], u = du0[i];
    dev::SwigluBackwardOne(dout[i], gate[i], up[i], g, u);
    if (Same(o, out[i]) && Same(g, dg[i]) && Same(u, du[i])) continue;  // names only for misses
    const std::string at =
        "gate = " + std::to_string(gate[i]) + " (element " + std::to_string(i) + ")";
    mm.Check(o, out[i], at + " forward");
    mm.Check(g, dg[i], at + " dgate");
    mm.Check(u, du[i], at + " dup");
  }
  EXPECT_EQ(mm.count, 0) << mm.first;
}

// --- sum of squares
// ---------------------------------------------------------------------------------

// tests/gpu/layer_ops_cuda_test.cc writes the documented order out with these constants (it
// compiles against cuda_runtime.h and cannot include layer_math.cuh): change both together.
static_assert(dev::kSumSquaresThreads == 256 && dev::kSumSquaresMaxBlocks == 512 &&
                  dev::kSumSquaresPerBlock == 8192,
              "update SumSquaresInTheDocumentedOrder in tests/gpu/layer_ops_cuda_test.cc");

constexpr double kU64 = 0x1p-53;  // FP64 unit roundoff

// The pairwise tree of PairwiseTreeF64 (kernels/cuda/layer_ops_cuda.cu), which synchronises a
// block and so cannot run here: for w = T/2, ..., 1, s[t] = s[t] + s[t + w] for every t < w.
double PairwiseTree(std::vector<double> s) {
  for (size_t w = s.size() / 2; w > 0; w /= 2) {
    for (size_t t = 0; t < w; ++t) s[t] = s[t] + s[t + w];
  }
  return s[0];
}

// sum_squares as the two kernels compute it: the kernel's own SumSquaresBlocks and
// SumSquaresStrided for pass 1's chains, the documented trees and pass 2 around them.
double KernelOrderSum(const float* x, int64_t count) {
  const int64_t t_count = dev::kSumSquaresThreads;
  const int64_t blocks = dev::SumSquaresBlocks(count);
  const int64_t grid = blocks * t_count;
  std::vector<double> partial(static_cast<size_t>(blocks));
  std::vector<double> s(static_cast<size_t>(t_count));
  for (int64_t b = 0; b < blocks; ++b) {
    for (int64_t t = 0; t < t_count; ++t) {
      s[static_cast<size_t>(t)] = dev::SumSquaresStrided(x, count, b * t_count + t, grid);
    }
    partial[static_cast<size_t>(b)] = PairwiseTree(s);
  }
  if (blocks == 1) return partial[0];
  for (int64_t t = 0; t < t_count; ++t) {
    double chain = 0.0;
    for (int64_t i = t; i < blocks; i += t_count) chain += partial[static_cast<size_t>(i)];
    s[static_cast<size_t>(t)] = chain;
  }
  return PairwiseTree(s);
}

// The exact sum of squares (each square exact in double; compensated long double sum, whose
// leftover error is far below one FP64 ulp of the sum).
double ExactSumOfSquares(const float* x, int64_t count) {
  long double sum = 0.0L, comp = 0.0L;
  for (int64_t i = 0; i < count; ++i) {
    const long double t = static_cast<long double>(static_cast<double>(x[i]) * x[i]);
    const long double s = sum + t;
    comp += std::abs(sum) >= t ? (sum - s) + t : (t - s) + sum;
    sum = s;
  }
  return static_cast<double>(sum + comp);
}

// Additions a square passes through on its way to the result (layer_math.cuh): its chain in
// pass 1, the block tree, and with more than one block the chain and tree of pass 2.
int64_t KernelOrderDepth(int64_t count) {
  const int64_t t_count = dev::kSumSquaresThreads;
  const int64_t blocks = dev::SumSquaresBlocks(count);
  const int64_t grid = blocks * t_count;
  const int64_t tree = std::countr_zero(static_cast<uint64_t>(t_count));  // log2 T
  int64_t depth = (count + grid - 1) / grid + tree;
  if (blocks > 1) depth += (blocks + t_count - 1) / t_count + tree;
  return depth;
}

// Counts on both sides of every change of the grid: one block up to 8192 elements, a block more
// per 8192 up to 512 blocks (4194304 elements), then 512 blocks with ever longer chains; and
// chains that end inside and after the eight-wide unrolled step.
const int64_t kSumSquaresCounts[] = {
    1,       7,      255,   256,    257,     2048,    2049,    8191,    8192,
    8193,    16384,  16385, 262151, 1000003, 4194303, 4194304, 4194305, 4194304 + 131072 * 8,
    5000011, 9000001};

TEST(LayerMathTest, SumSquaresBlocksIsAFunctionOfTheCountAlone) {
  // Written out from the rule: ceil(count / 8192), at least 1, at most 512.
  struct Case {
    int64_t count;
    int blocks;
  };
  for (const Case& c : {Case{0, 1}, Case{1, 1}, Case{8191, 1}, Case{8192, 1}, Case{8193, 2},
                        Case{16384, 2}, Case{16385, 3}, Case{262151, 33}, Case{4194303, 512},
                        Case{4194304, 512}, Case{4194305, 512}, Case{int64_t{1} << 40, 512},
                        Case{std::numeric_limits<int64_t>::max(), 512}}) {
    EXPECT_EQ(dev::SumSquaresBlocks(c.count), c.blocks) << "count " << c.count;
  }
  static_assert(dev::SumSquaresBlocks(8193) == 2, "usable in constant expressions");
  // Never fewer blocks for more elements, and never more than one block per 8192 elements (so a
  // small count pays for a small grid).
  int prev = 1;
  for (int64_t count = 1; count <= 5000000; count += 997) {
    const int b = dev::SumSquaresBlocks(count);
    EXPECT_GE(b, prev) << count;
    EXPECT_LE(static_cast<int64_t>(b - 1) * dev::kSumSquaresPerBlock, count) << count;
    prev = b;
  }
}

// One thread's chain equals x[first]^2 + x[first + stride]^2 + ... added one by one in
// ascending order, for chains of every length around the eight-wide unrolled step, over values
// whose squares span the FP64 range of FP32 squares (so any other order gives other bits). The
// elements past `count` are NaN: reading one would show.
TEST(LayerMathTest, SumSquaresStridedAddsItsChainInAscendingOrder) {
  std::mt19937 rng(91);
  std::uniform_real_distribution<float> unit(0.0f, 1.0f);
  std::vector<float> x(40000);
  for (float& v : x) v = std::exp2(unit(rng) * 120.0f - 60.0f) * (rng() % 2 ? 1.0f : -1.0f);
  std::vector<float> guarded = x;
  guarded.resize(x.size() + 4000, std::numeric_limits<float>::quiet_NaN());
  int64_t differs_from_descending = 0;
  for (int64_t stride : {int64_t{1}, int64_t{3}, int64_t{256}, int64_t{1000}}) {
    for (int64_t len = 0; len <= 25; ++len) {
      for (int64_t first : {int64_t{0}, int64_t{1}, stride - 1}) {
        const int64_t count = first + (len - 1) * stride + 1;  // exactly `len` elements
        if (count < 0 || count > static_cast<int64_t>(x.size())) continue;
        double want = 0.0;
        for (int64_t i = first; i < count; i += stride) {
          const double a = x[static_cast<size_t>(i)];
          want += a * a;
        }
        double descending = 0.0;
        for (int64_t i = first + (len - 1) * stride; len > 0 && i >= first; i -= stride) {
          const double a = x[static_cast<size_t>(i)];
          descending += a * a;
        }
        differs_from_descending += descending != want;
        const double got = dev::SumSquaresStrided(guarded.data(), count, first, stride);
        EXPECT_EQ(std::bit_cast<uint64_t>(got), std::bit_cast<uint64_t>(want))
            << "stride " << stride << ", first " << first << ", " << len << " elements: got " << got
            << ", want " << want;
      }
    }
  }
  EXPECT_GT(differs_from_descending, 10) << "the data does not tell orders apart";
}

// Every element is added exactly once and nothing past `count` is read: all ones sum to the
// count exactly (every partial sum is an integer below 2^53), a single one anywhere gives 1, and
// NaNs past the end never show.
TEST(LayerMathTest, SumSquaresOrderAddsEveryElementExactlyOnce) {
  for (int64_t count : kSumSquaresCounts) {
    std::vector<float> x(static_cast<size_t>(count), 1.0f);
    x.resize(static_cast<size_t>(count) + 200000, std::numeric_limits<float>::quiet_NaN());
    EXPECT_EQ(KernelOrderSum(x.data(), count), static_cast<double>(count)) << "count " << count;
    std::fill(x.begin(), x.begin() + count, 0.0f);
    for (int64_t at : {int64_t{0}, count / 3, count / 2, count - 1}) {
      x[static_cast<size_t>(at)] = -1.0f;
      EXPECT_EQ(KernelOrderSum(x.data(), count), 1.0) << "count " << count << ", one at " << at;
      x[static_cast<size_t>(at)] = 0.0f;
    }
  }
}

// Two sums worked out by hand from the documented order, with x[0] = 2^27 (square 2^54, where
// the FP64 spacing is 4) and every other element 1. The CPU adds the ones one at a time to 2^54:
// each 2^54 + 1 rounds back to 2^54, so it returns 2^54.
TEST(LayerMathTest, SumSquaresOrderGivesTheSumsWorkedOutByHand) {
  constexpr double kBig = 0x1p54;
  {
    // 512 elements, one block of 256 threads, G = 256: thread 0 adds x[0]^2 + x[256]^2 = 2^54 + 1
    // -> 2^54; threads 1..255 hold 2. Tree level w = 128: s[0] = 2^54 + 2, a tie, -> 2^54 (even);
    // s[1..127] = 4. Each later level doubles s[w] and adds it exactly: s[0] gains 4 + 8 + ...
    // + 256 = 508.
    std::vector<float> x(512, 1.0f);
    x[0] = 0x1p27f;
    EXPECT_EQ(KernelOrderSum(x.data(), 512), kBig + 508.0);
    EXPECT_EQ(SumOfSquares(x.data(), 512), kBig);
  }
  {
    // 16384 elements, two blocks, G = 512, 32 elements per thread: thread 0's chain loses all 31
    // of its ones (2^54 + 1 -> 2^54 each time); the other 255 threads of block 0 hold 32 each, and
    // the tree adds multiples of 32 to 2^54 exactly: block 0 = 2^54 + 255 * 32. Block 1 = 8192.
    // Pass 2 adds the two: 2^54 + 8160 + 8192 = 2^54 + 16352, exact.
    std::vector<float> x(16384, 1.0f);
    x[0] = 0x1p27f;
    EXPECT_EQ(KernelOrderSum(x.data(), 16384), kBig + 16352.0);
    EXPECT_EQ(SumOfSquares(x.data(), 16384), kBig);
  }
}

// Error bound. All terms are >= 0 and exact in FP64, so a sum whose terms pass through at most h
// additions is within gamma_h S <= 1.01 h U S of the exact sum S (U = 2^-53, h U < 0.01; Higham,
// "Accuracy and Stability of Numerical Algorithms", chapter 4). The kernel order has h =
// KernelOrderDepth(count) (about count / 2^17 + 18), the CPU's index order h = count - 1; the two
// results are within the sum of both bounds of each other. Data: half N(0, 3), half log-uniform
// over 2^-30..2^30 (squares across many binades).
TEST(LayerMathTest, SumSquaresOrderIsWithinItsErrorBound) {
  std::mt19937 rng(62);
  std::normal_distribution<float> normal(0.0f, 3.0f);
  std::uniform_real_distribution<float> unit(0.0f, 1.0f);
  for (int64_t count : kSumSquaresCounts) {
    std::vector<float> x(static_cast<size_t>(count));
    for (size_t i = 0; i < x.size(); ++i) {
      x[i] = i % 2 == 0 ? normal(rng) : std::exp2(unit(rng) * 60.0f - 30.0f);
    }
    const double exact = ExactSumOfSquares(x.data(), count);
    const double got = KernelOrderSum(x.data(), count);
    const double cpu = SumOfSquares(x.data(), count);
    const double bound = 1.01 * static_cast<double>(KernelOrderDepth(count)) * kU64 * exact;
    const double cpu_bound = 1.01 * static_cast<double>(count - 1) * kU64 * exact;
    EXPECT_LE(std::abs(got - exact), bound) << "count " << count << ": got " << got;
    EXPECT_LE(std::abs(got - cpu), bound + cpu_bound) << "count " << count << ": cpu " << cpu;
  }
}

}  // namespace
}  // namespace fp8rt::kernels
