// FP32 CPU reference of the non-GEMM layer ops and the CPU backend's LayerOps entries; formulas
// and conventions in kernels/layer_ops.h.
#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <limits>
#include <numbers>
#include <span>
#include <vector>

#include "absl/strings/str_cat.h"
#include "kernels/cpu/activations_cpu.h"
#include "kernels/cpu/attention_cpu.h"
#include "kernels/cpu/cpu_ops.h"
#include "kernels/cpu/quantize_one.h"
#include "kernels/cpu/rows_cpu.h"
#include "kernels/layer_ops.h"
#include "kernels/ops.h"
#include "runtime/core/check.h"
#include "runtime/core/status.h"

namespace fp8rt::kernels {
namespace {

// Aborts unless `s` holds exactly `expected` elements; `what` names the buffer.
template <typename T>
void CheckSize(std::span<T> s, int64_t expected, const char* what) {
  FP8RT_CHECK(expected >= 0 && static_cast<int64_t>(s.size()) == expected)
      << what << " has " << s.size() << " elements, expected " << expected;
}

// sqrt(2/pi), the GELU tanh-approximation constant.
constexpr float kGeluScale = static_cast<float>(std::numbers::sqrt2 * std::numbers::inv_sqrtpi);
constexpr float kGeluCubic = 0.044715f;

}  // namespace

// ---- Embedding ----

void EmbeddingForward(std::span<float> out, std::span<const int32_t> tokens,
                      std::span<const float> table, int64_t n, int64_t v, int64_t c) {
  CheckSize(out, n * c, "embedding out");
  CheckSize(tokens, n, "embedding tokens");
  CheckSize(table, v * c, "embedding table");
  for (int64_t i = 0; i < n; ++i) {
    const int64_t tok = tokens[i];
    FP8RT_CHECK(tok >= 0 && tok < v)
        << "token " << tok << " at " << i << " outside [0, " << v << ")";
    std::copy_n(table.begin() + tok * c, c, out.begin() + i * c);
  }
}

void EmbeddingBackward(std::span<float> dtable, std::span<const float> dout,
                       std::span<const int32_t> tokens, int64_t n, int64_t v, int64_t c) {
  CheckSize(dtable, v * c, "embedding dtable");
  CheckSize(dout, n * c, "embedding dout");
  CheckSize(tokens, n, "embedding tokens");
  for (int64_t i = 0; i < n; ++i) {
    const int64_t tok = tokens[i];
    FP8RT_CHECK(tok >= 0 && tok < v)
        << "token " << tok << " at " << i << " outside [0, " << v << ")";
    for (int64_t j = 0; j < c; ++j) dtable[tok * c + j] += dout[i * c + j];
  }
}

// ---- RMSNorm ----

void RmsNormForward(std::span<float> out, std::span<float> rstd, std::span<const float> x,
                    std::span<const float> weight, int64_t n, int64_t c, float eps) {
  CheckSize(out, n * c, "rmsnorm out");
  CheckSize(rstd, n, "rmsnorm rstd");
  CheckSize(x, n * c, "rmsnorm x");
  CheckSize(weight, c, "rmsnorm weight");
  FP8RT_CHECK(c > 0) << "rmsnorm over 0 channels";
  for (int64_t i = 0; i < n; ++i) {
    const float* xi = x.data() + i * c;
    float sum_sq = 0.0f;
    for (int64_t j = 0; j < c; ++j) sum_sq += xi[j] * xi[j];
    const float r = 1.0f / std::sqrt(sum_sq / static_cast<float>(c) + eps);
    rstd[i] = r;
    for (int64_t j = 0; j < c; ++j) out[i * c + j] = xi[j] * r * weight[j];
  }
}

void RmsNormBackward(std::span<float> dx, std::span<float> dweight, std::span<const float> dout,
                     std::span<const float> x, std::span<const float> weight,
                     std::span<const float> rstd, int64_t n, int64_t c) {
  CheckSize(dx, n * c, "rmsnorm dx");
  CheckSize(dweight, c, "rmsnorm dweight");
  CheckSize(dout, n * c, "rmsnorm dout");
  CheckSize(x, n * c, "rmsnorm x");
  CheckSize(weight, c, "rmsnorm weight");
  CheckSize(rstd, n, "rmsnorm rstd");
  for (int64_t i = 0; i < n; ++i) {
    const float* xi = x.data() + i * c;
    const float* dyi = dout.data() + i * c;
    const float r = rstd[i];
    // mean_c(g * x) with g = dout * weight: the part of the gradient through rstd.
    float gx = 0.0f;
    for (int64_t j = 0; j < c; ++j) gx += dyi[j] * weight[j] * xi[j];
    const float coef = r * r * r * gx / static_cast<float>(c);
    for (int64_t j = 0; j < c; ++j) {
      dx[i * c + j] += r * dyi[j] * weight[j] - coef * xi[j];
      dweight[j] += dyi[j] * xi[j] * r;
    }
  }
}

// ---- LayerNorm ----

void LayerNormForward(std::span<float> out, std::span<float> mean, std::span<float> rstd,
                      std::span<const float> x, std::span<const float> weight,
                      std::span<const float> bias, int64_t n, int64_t c, float eps) {
  CheckSize(out, n * c, "layernorm out");
  CheckSize(mean, n, "layernorm mean");
  CheckSize(rstd, n, "layernorm rstd");
  CheckSize(x, n * c, "layernorm x");
  CheckSize(weight, c, "layernorm weight");
  CheckSize(bias, c, "layernorm bias");
  FP8RT_CHECK(c > 0) << "layernorm over 0 channels";
  for (int64_t i = 0; i < n; ++i) {
    const float* xi = x.data() + i * c;
    float sum = 0.0f;
    for (int64_t j = 0; j < c; ++j) sum += xi[j];
    const float m = sum / static_cast<float>(c);
    // The variance about the mean already computed (two passes: no cancellation of E[x^2] - m^2).
    float sum_sq = 0.0f;
    for (int64_t j = 0; j < c; ++j) {
      const float d = xi[j] - m;
      sum_sq += d * d;
    }
    const float r = 1.0f / std::sqrt(sum_sq / static_cast<float>(c) + eps);
    mean[i] = m;
    rstd[i] = r;
    for (int64_t j = 0; j < c; ++j) out[i * c + j] = (xi[j] - m) * r * weight[j] + bias[j];
  }
}

void LayerNormBackward(std::span<float> dx, std::span<float> dweight, std::span<float> dbias,
                       std::span<const float> dout, std::span<const float> x,
                       std::span<const float> weight, std::span<const float> mean,
                       std::span<const float> rstd, int64_t n, int64_t c) {
  CheckSize(dx, n * c, "layernorm dx");
  CheckSize(dweight, c, "layernorm dweight");
  CheckSize(dbias, c, "layernorm dbias");
  CheckSize(dout, n * c, "layernorm dout");
  CheckSize(x, n * c, "layernorm x");
  CheckSize(weight, c, "layernorm weight");
  CheckSize(mean, n, "layernorm mean");
  CheckSize(rstd, n, "layernorm rstd");
  for (int64_t i = 0; i < n; ++i) {
    const float* xi = x.data() + i * c;
    const float* dyi = dout.data() + i * c;
    const float m = mean[i];
    const float r = rstd[i];
    // mean_c(g) and mean_c(g * xhat), g = dout * weight: the gradient through mean and rstd.
    float g_sum = 0.0f;
    float gx_sum = 0.0f;
    for (int64_t j = 0; j < c; ++j) {
      const float xhat = (xi[j] - m) * r;
      const float g = dyi[j] * weight[j];
      g_sum += g;
      gx_sum += g * xhat;
    }
    const float g_mean = g_sum / static_cast<float>(c);
    const float gx_mean = gx_sum / static_cast<float>(c);
    for (int64_t j = 0; j < c; ++j) {
      const float xhat = (xi[j] - m) * r;
      const float g = dyi[j] * weight[j];
      dx[i * c + j] += (g - g_mean - xhat * gx_mean) * r;
      dweight[j] += dyi[j] * xhat;
      dbias[j] += dyi[j];
    }
  }
}

// ---- Bias ----

void BiasForward(std::span<float> out, std::span<const float> bias, int64_t n, int64_t c) {
  CheckSize(out, n * c, "bias out");
  CheckSize(bias, c, "bias bias");
  for (int64_t i = 0; i < n; ++i) {
    for (int64_t j = 0; j < c; ++j) out[i * c + j] += bias[j];
  }
}

void BiasBackward(std::span<float> dbias, std::span<const float> dout, int64_t n, int64_t c) {
  CheckSize(dbias, c, "bias dbias");
  CheckSize(dout, n * c, "bias dout");
  for (int64_t i = 0; i < n; ++i) {
    for (int64_t j = 0; j < c; ++j) dbias[j] += dout[i * c + j];
  }
}

// ---- RoPE ----

void cpu_internal::RopeCosSin(int64_t pos, int64_t i, int64_t dh, float theta, float& cos_out,
                              float& sin_out) {
  const double inv_freq =
      std::pow(static_cast<double>(theta), -2.0 * static_cast<double>(i) / static_cast<double>(dh));
  const double angle = static_cast<double>(pos) * inv_freq;
  cos_out = static_cast<float>(std::cos(angle));
  sin_out = static_cast<float>(std::sin(angle));
}

using cpu_internal::RopeCosSin;

namespace {

// The rotation of every head of every row, by (cos, sin) (kForward) or its transpose accumulated
// into `out` (backward). In place is safe forward: each pair is read before it is written.
template <bool kForward>
void RopeRows(float* out, const float* in, int64_t n, int64_t t, int64_t h, int64_t dh,
              float theta) {
  const int64_t half = dh / 2;
  for (int64_t r = 0; r < n; ++r) {
    const int64_t pos = r % t;
    for (int64_t i = 0; i < half; ++i) {
      float c, s;
      RopeCosSin(pos, i, dh, theta, c, s);
      for (int64_t hh = 0; hh < h; ++hh) {
        const int64_t at = (r * h + hh) * dh + i;
        const float a = in[at];
        const float b = in[at + half];
        if constexpr (kForward) {
          out[at] = a * c - b * s;
          out[at + half] = b * c + a * s;
        } else {
          out[at] += a * c + b * s;
          out[at + half] += b * c - a * s;
        }
      }
    }
  }
}

}  // namespace

void RopeForward(std::span<float> out, std::span<const float> x, int64_t n, int64_t t, int64_t h,
                 int64_t dh, float theta) {
  CheckSize(out, n * h * dh, "rope out");
  CheckSize(x, n * h * dh, "rope x");
  FP8RT_CHECK(dh % 2 == 0) << "rope head dim " << dh << " is odd";
  FP8RT_CHECK(n == 0 || t > 0) << "rope sequence length " << t;
  RopeRows<true>(out.data(), x.data(), n, t, h, dh, theta);
}

void RopeBackward(std::span<float> dx, std::span<const float> dout, int64_t n, int64_t t, int64_t h,
                  int64_t dh, float theta) {
  CheckSize(dx, n * h * dh, "rope dx");
  CheckSize(dout, n * h * dh, "rope dout");
  FP8RT_CHECK(dh % 2 == 0) << "rope head dim " << dh << " is odd";
  FP8RT_CHECK(n == 0 || t > 0) << "rope sequence length " << t;
  FP8RT_CHECK(dx.empty() || dx.data() != dout.data()) << "rope_backward: dx aliases dout";
  RopeRows<false>(dx.data(), dout.data(), n, t, h, dh, theta);
}

// ---- Causal grouped-query attention core ----

namespace {

// The checks and the index helpers shared by the reference's forward and backward: offsets of
// token `pos` of query head hh in batch row bb of a [B, T, H, Dh] tensor, and of its kv head in a
// [B, T, Hkv, Dh] one, and the row's scores s_j = (q_i . k_j) * scale for j <= i.
struct AttentionShape {
  int64_t b, t, h, hkv, dh, group;
  float scale;
  int64_t At(int64_t bb, int64_t pos, int64_t hh) const { return ((bb * t + pos) * h + hh) * dh; }
  int64_t KvAt(int64_t bb, int64_t pos, int64_t hh) const {
    return ((bb * t + pos) * hkv + hh / group) * dh;
  }
  void Scores(float* s, const float* q, const float* k, int64_t bb, int64_t hh, int64_t i) const {
    const float* qi = q + At(bb, i, hh);
    for (int64_t j = 0; j <= i; ++j) {
      const float* kj = k + KvAt(bb, j, hh);
      float dot = 0.0f;
      for (int64_t d = 0; d < dh; ++d) dot += qi[d] * kj[d];
      s[j] = dot * scale;
    }
  }
};

AttentionShape CheckedAttentionShape(int64_t b, int64_t t, int64_t h, int64_t hkv, int64_t dh) {
  FP8RT_CHECK(dh > 0) << "attention head dim " << dh;
  FP8RT_CHECK(hkv > 0 && h % hkv == 0) << "attention: " << hkv << " kv heads for " << h << " heads";
  return {b, t, h, hkv, dh, h / hkv, 1.0f / std::sqrt(static_cast<float>(dh))};
}

}  // namespace

void AttentionForward(std::span<float> out, std::span<float> lse, std::span<const float> q,
                      std::span<const float> k, std::span<const float> v, int64_t b, int64_t t,
                      int64_t h, int64_t hkv, int64_t dh) {
  const int64_t size = b * t * h * dh;
  const int64_t kv_size = b * t * hkv * dh;
  CheckSize(out, size, "attention out");
  CheckSize(lse, b * h * t, "attention lse");
  CheckSize(q, size, "attention q");
  CheckSize(k, kv_size, "attention k");
  CheckSize(v, kv_size, "attention v");
  const AttentionShape a = CheckedAttentionShape(b, t, h, hkv, dh);
  std::vector<float> p(static_cast<size_t>(t));  // one row of scores, then probabilities
  for (int64_t bb = 0; bb < b; ++bb) {
    for (int64_t hh = 0; hh < h; ++hh) {
      for (int64_t i = 0; i < t; ++i) {
        a.Scores(p.data(), q.data(), k.data(), bb, hh, i);
        float max_score = -std::numeric_limits<float>::infinity();
        for (int64_t j = 0; j <= i; ++j) max_score = std::max(max_score, p[j]);
        float sum = 0.0f;
        for (int64_t j = 0; j <= i; ++j) sum += std::exp(p[j] - max_score);
        const float row_lse = max_score + std::log(sum);
        lse[(bb * h + hh) * t + i] = row_lse;
        float* oi = out.data() + a.At(bb, i, hh);
        std::fill_n(oi, dh, 0.0f);
        for (int64_t j = 0; j <= i; ++j) {
          const float pj = std::exp(p[j] - row_lse);
          const float* vj = v.data() + a.KvAt(bb, j, hh);
          for (int64_t d = 0; d < dh; ++d) oi[d] += pj * vj[d];
        }
      }
    }
  }
}

void AttentionBackward(std::span<float> dq, std::span<float> dk, std::span<float> dv,
                       std::span<const float> dout, std::span<const float> q,
                       std::span<const float> k, std::span<const float> v,
                       std::span<const float> out, std::span<const float> lse, int64_t b, int64_t t,
                       int64_t h, int64_t hkv, int64_t dh) {
  const int64_t size = b * t * h * dh;
  const int64_t kv_size = b * t * hkv * dh;
  CheckSize(dq, size, "attention dq");
  CheckSize(dk, kv_size, "attention dk");
  CheckSize(dv, kv_size, "attention dv");
  CheckSize(dout, size, "attention dout");
  CheckSize(q, size, "attention q");
  CheckSize(k, kv_size, "attention k");
  CheckSize(v, kv_size, "attention v");
  CheckSize(out, size, "attention out");
  CheckSize(lse, b * h * t, "attention lse");
  const AttentionShape a = CheckedAttentionShape(b, t, h, hkv, dh);
  std::vector<float> p(static_cast<size_t>(t));
  // Query heads ascending (outer loop), so each kv head's dk and dv add its group's query heads
  // in ascending order, each over i ascending.
  for (int64_t bb = 0; bb < b; ++bb) {
    for (int64_t hh = 0; hh < h; ++hh) {
      for (int64_t i = 0; i < t; ++i) {
        const int64_t at = a.At(bb, i, hh);
        const float* doi = dout.data() + at;
        const float* qi = q.data() + at;
        const float* oi = out.data() + at;
        float* dqi = dq.data() + at;
        const float row_lse = lse[(bb * h + hh) * t + i];
        a.Scores(p.data(), q.data(), k.data(), bb, hh, i);
        // D_i = dout_i . out_i, the softmax Jacobian's rank-one term.
        float row_term = 0.0f;
        for (int64_t d = 0; d < dh; ++d) row_term += doi[d] * oi[d];
        for (int64_t j = 0; j <= i; ++j) {
          const float pj = std::exp(p[j] - row_lse);
          const float* kj = k.data() + a.KvAt(bb, j, hh);
          const float* vj = v.data() + a.KvAt(bb, j, hh);
          float* dkj = dk.data() + a.KvAt(bb, j, hh);
          float* dvj = dv.data() + a.KvAt(bb, j, hh);
          float dp = 0.0f;
          for (int64_t d = 0; d < dh; ++d) dp += doi[d] * vj[d];
          const float ds = pj * (dp - row_term) * a.scale;
          for (int64_t d = 0; d < dh; ++d) {
            dqi[d] += ds * kj[d];
            dkj[d] += ds * qi[d];
            dvj[d] += pj * doi[d];
          }
        }
      }
    }
  }
}

// ---- GELU ----

void GeluForward(std::span<float> out, std::span<const float> x, int64_t n) {
  CheckSize(out, n, "gelu out");
  CheckSize(x, n, "gelu x");
  for (int64_t i = 0; i < n; ++i) {
    const float xi = x[i];
    const float u = kGeluScale * (xi + kGeluCubic * xi * xi * xi);
    out[i] = 0.5f * xi * (1.0f + std::tanh(u));
  }
}

void GeluBackward(std::span<float> dx, std::span<const float> dout, std::span<const float> x,
                  int64_t n) {
  CheckSize(dx, n, "gelu dx");
  CheckSize(dout, n, "gelu dout");
  CheckSize(x, n, "gelu x");
  for (int64_t i = 0; i < n; ++i) {
    const float xi = x[i];
    const float u = kGeluScale * (xi + kGeluCubic * xi * xi * xi);
    const float th = std::tanh(u);
    const float du = kGeluScale * (1.0f + 3.0f * kGeluCubic * xi * xi);
    const float grad = 0.5f * (1.0f + th) + 0.5f * xi * (1.0f - th * th) * du;
    dx[i] += dout[i] * grad;
  }
}

// ---- SwiGLU ----

void SwigluForward(std::span<float> out, std::span<const float> gate, std::span<const float> up,
                   int64_t n) {
  CheckSize(out, n, "swiglu out");
  CheckSize(gate, n, "swiglu gate");
  CheckSize(up, n, "swiglu up");
  for (int64_t i = 0; i < n; ++i) {
    const float g = gate[i];
    const float s = 1.0f / (1.0f + std::exp(-g));
    out[i] = g * s * up[i];
  }
}

void SwigluBackward(std::span<float> dgate, std::span<float> dup, std::span<const float> dout,
                    std::span<const float> gate, std::span<const float> up, int64_t n) {
  CheckSize(dgate, n, "swiglu dgate");
  CheckSize(dup, n, "swiglu dup");
  CheckSize(dout, n, "swiglu dout");
  CheckSize(gate, n, "swiglu gate");
  CheckSize(up, n, "swiglu up");
  for (int64_t i = 0; i < n; ++i) {
    const float g = gate[i];
    const float s = 1.0f / (1.0f + std::exp(-g));
    // d silu / d gate = s + g s (1 - s) = s (1 + g (1 - s)).
    const float dsilu = s * (1.0f + g * (1.0f - s));
    dgate[i] += dout[i] * up[i] * dsilu;
    dup[i] += dout[i] * (g * s);
  }
}

// ---- Residual add ----

void ResidualForward(std::span<float> out, std::span<const float> a, std::span<const float> b,
                     int64_t n) {
  CheckSize(out, n, "residual out");
  CheckSize(a, n, "residual a");
  CheckSize(b, n, "residual b");
  for (int64_t i = 0; i < n; ++i) out[i] = a[i] + b[i];
}

void ResidualBackward(std::span<float> da, std::span<float> db, std::span<const float> dout,
                      int64_t n) {
  CheckSize(da, n, "residual da");
  CheckSize(db, n, "residual db");
  CheckSize(dout, n, "residual dout");
  for (int64_t i = 0; i < n; ++i) {
    da[i] += dout[i];
    db[i] += dout[i];
  }
}

// ---- Cross-entropy ----

float CrossEntropyForward(std::span<float> probs, std::span<const float> logits,
                          std::span<const int32_t> targets, int64_t n, int64_t v) {
  CheckSize(probs, n * v, "cross-entropy probs");
  CheckSize(logits, n * v, "cross-entropy logits");
  CheckSize(targets, n, "cross-entropy targets");
  FP8RT_CHECK(n > 0 && v > 0) << "cross-entropy over " << n << " x " << v;
  float loss_sum = 0.0f;
  for (int64_t i = 0; i < n; ++i) {
    const int64_t target = targets[i];
    FP8RT_CHECK(target >= 0 && target < v)
        << "target " << target << " at " << i << " outside [0, " << v << ")";
    const float* li = logits.data() + i * v;
    float* pi = probs.data() + i * v;
    const float max_logit = *std::max_element(li, li + v);
    float sum = 0.0f;
    for (int64_t j = 0; j < v; ++j) {
      pi[j] = std::exp(li[j] - max_logit);
      sum += pi[j];
    }
    const float inv_sum = 1.0f / sum;
    for (int64_t j = 0; j < v; ++j) pi[j] *= inv_sum;
    // logsumexp - logit[target], which stays finite where probs[target] underflows to 0.
    loss_sum += max_logit + std::log(sum) - li[target];
  }
  return loss_sum / static_cast<float>(n);
}

void CrossEntropyBackward(std::span<float> dlogits, std::span<const float> probs,
                          std::span<const int32_t> targets, int64_t n, int64_t v, float dloss) {
  CheckSize(dlogits, n * v, "cross-entropy dlogits");
  CheckSize(probs, n * v, "cross-entropy probs");
  CheckSize(targets, n, "cross-entropy targets");
  FP8RT_CHECK(n > 0) << "cross-entropy over " << n << " rows";
  const float row_scale = dloss / static_cast<float>(n);
  for (int64_t i = 0; i < n; ++i) {
    const int64_t target = targets[i];
    FP8RT_CHECK(target >= 0 && target < v)
        << "target " << target << " at " << i << " outside [0, " << v << ")";
    for (int64_t j = 0; j < v; ++j) {
      const float indicator = j == target ? 1.0f : 0.0f;
      dlogits[i * v + j] += row_scale * (probs[i * v + j] - indicator);
    }
  }
}

// ---- AdamW and the gradient norm ----

namespace {

// The AdamW update of element i (AdamWUpdate's formula); returns the new master value.
inline float AdamWOne(const AdamWArgs& k, int64_t i) {
  const float g = k.grad[i] * k.clip_scale;
  float p = k.master[i];
  p -= k.decay * p;  // decoupled weight decay, on the weight before this step's update
  const float m = k.beta1 * k.m[i] + k.one_minus_beta1 * g;
  const float v = k.beta2 * k.v[i] + k.one_minus_beta2 * (g * g);
  const float m_hat = m / k.bias1;
  const float v_hat = v / k.bias2;
  p -= k.lr * m_hat / (std::sqrt(v_hat) + k.eps);
  k.m[i] = m;
  k.v[i] = v;
  k.master[i] = p;
  return p;
}

// The update fused with the tensor-scaled FP8 shard's quantization: one pass over master, grad,
// m, v.
template <Fp8Format F>
void AdamWFp8Tensor(const AdamWArgs& k) {
  const AdamWFp8Output& o = k.fp8;
  cpu_internal::SpanStats s;
  for (int64_t i = 0; i < k.count; ++i) {
    o.codes[i] = cpu_internal::QuantizeOne<F>(AdamWOne(k, i), o.scale, s);
  }
  cpu_internal::FinishAdamWTensorShard(o, s, k.count);
}

// The update fused with the 128x128 block-scaled shard's quantization: each strip of 128 rows is
// updated, then quantized by the quantize op while it is still in cache (a block's scale needs
// its updated amax). The strips are whole rows of the block grid, so the codes, scales and
// merged statistics are the quantize op's over the whole shard.
absl::Status AdamWFp8Block(const AdamWArgs& k) {
  return cpu_internal::AdamWFp8BlockStrips(k, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) AdamWOne(k, i);
  });
}

}  // namespace

void cpu_internal::FinishAdamWTensorShard(const AdamWFp8Output& o, const SpanStats& s,
                                          int64_t count) {
  *o.scale_inv = 1.0f / o.scale;  // as the tensor quantize writes it
  QuantStats& out = *o.stats;
  out = QuantStats{};
  out.amax = s.amax_bits > 0x7F800000u ? std::numeric_limits<float>::quiet_NaN()
                                       : std::bit_cast<float>(s.amax_bits);
  out.count = count;
  out.underflow = s.underflow;
  out.subnormal = s.subnormal;
  out.saturated = s.saturated;
  out.nonfinite = s.nonfinite;
}

absl::Status cpu_internal::AdamWFp8BlockStrips(
    const AdamWArgs& k, const std::function<void(int64_t, int64_t)>& update) {
  const AdamWFp8Output& o = k.fp8;
  const ScaleGrid grid = GetScaleGrid(Granularity::kBlock128x128, o.rows, o.cols);
  QuantStats total;
  for (int64_t r0 = 0; r0 < o.rows; r0 += grid.block_rows) {
    const int64_t strip_rows = std::min(grid.block_rows, o.rows - r0);
    const int64_t begin = r0 * o.cols, end = begin + strip_rows * o.cols;
    update(begin, end);
    QuantizeArgs q;
    q.format = o.format;
    q.granularity = Granularity::kBlock128x128;
    q.input = k.master + begin;
    q.rows = strip_rows;
    q.cols = o.cols;
    q.margin = o.margin;
    q.codes = o.codes + begin;
    q.scale_inv = o.scale_inv + (r0 / grid.block_rows) * grid.cols;
    QuantStats strip;
    q.stats = &strip;
    FP8RT_RETURN_IF_ERROR(cpu_internal::QuantizeCpu(q, Stream{}));
    if (r0 == 0) {
      total = strip;
    } else {
      total.Merge(strip);
    }
  }
  *o.stats = total;
  return absl::OkStatus();
}

absl::Status ValidateAdamWFp8Output(const AdamWFp8Output& o, int64_t count, const char* op) {
  if (o.codes == nullptr) return absl::OkStatus();
  if (o.stats == nullptr || o.scale_inv == nullptr) {
    return absl::InvalidArgumentError(absl::StrCat(op, ": fp8.stats or fp8.scale_inv is null"));
  }
  if (o.format != Fp8Format::kE4M3 && o.format != Fp8Format::kE5M2) {
    return absl::InvalidArgumentError(absl::StrCat(op, ": fp8.format must be e4m3 or e5m2"));
  }
  if (!o.block) {
    if (!(std::isfinite(o.scale) && o.scale > 0.0f)) {
      return absl::InvalidArgumentError(
          absl::StrCat(op, ": fp8.scale must be finite and > 0, got ", o.scale));
    }
    return absl::OkStatus();
  }
  if (o.rows <= 0 || o.cols <= 0 || o.rows > count / o.cols || o.rows * o.cols != count) {
    return absl::InvalidArgumentError(absl::StrCat(op, ": fp8.rows x fp8.cols (", o.rows, " x ",
                                                   o.cols, ") must be > 0 and equal count ", count,
                                                   " with block scaling"));
  }
  if (o.margin < 0 || o.margin > 64) {
    return absl::InvalidArgumentError(
        absl::StrCat(op, ": fp8.margin must be in [0, 64], got ", o.margin));
  }
  return absl::OkStatus();
}

absl::Status AdamWUpdate(const AdamWArgs& k) {
  if (k.fp8.codes == nullptr) {
    for (int64_t i = 0; i < k.count; ++i) AdamWOne(k, i);
    return absl::OkStatus();
  }
  if (k.fp8.block) return AdamWFp8Block(k);
  if (k.fp8.format == Fp8Format::kE5M2) {
    AdamWFp8Tensor<Fp8Format::kE5M2>(k);
  } else {
    AdamWFp8Tensor<Fp8Format::kE4M3>(k);
  }
  return absl::OkStatus();
}

double SumOfSquares(const float* x, int64_t count) {
  double sum = 0.0;
  for (int64_t i = 0; i < count; ++i) {
    const double g = x[i];
    sum += g * g;
  }
  return sum;
}

// ---- The CPU backend's LayerOps entries ----

namespace cpu_internal {
namespace {

// InvalidArgument naming the first negative size.
absl::Status CheckSizes(const char* op, std::initializer_list<std::pair<const char*, int64_t>> s) {
  for (const auto& [name, value] : s) {
    if (value < 0) {
      return absl::InvalidArgumentError(absl::StrCat(op, ": ", name, " is ", value, " (< 0)"));
    }
  }
  return absl::OkStatus();
}

template <typename T>
std::span<T> Span(T* p, int64_t n) {
  return std::span<T>(p, static_cast<size_t>(n));
}

absl::Status EmbeddingForwardEntry(float* out, const int32_t* tokens, const float* table, int64_t n,
                                   int64_t v, int64_t c, Stream) {
  FP8RT_RETURN_IF_ERROR(CheckSizes("embedding_forward", {{"n", n}, {"v", v}, {"c", c}}));
  EmbeddingForwardFast(out, tokens, table, n, v, c);
  return absl::OkStatus();
}
absl::Status EmbeddingBackwardEntry(float* dtable, const float* dout, const int32_t* tokens,
                                    int64_t n, int64_t v, int64_t c, Stream) {
  FP8RT_RETURN_IF_ERROR(CheckSizes("embedding_backward", {{"n", n}, {"v", v}, {"c", c}}));
  EmbeddingBackwardFast(dtable, dout, tokens, n, v, c);
  return absl::OkStatus();
}
absl::Status RmsNormForwardEntry(float* out, float* rstd, const float* x, const float* weight,
                                 int64_t n, int64_t c, float eps, Stream) {
  FP8RT_RETURN_IF_ERROR(CheckSizes("rmsnorm_forward", {{"n", n}, {"c", c}}));
  if (n == 0) return absl::OkStatus();
  if (c == 0) return absl::InvalidArgumentError("rmsnorm_forward: c is 0 with rows to normalise");
  RmsNormForwardFast(out, rstd, x, weight, n, c, eps);
  return absl::OkStatus();
}
absl::Status RmsNormBackwardEntry(float* dx, float* dweight, const float* dout, const float* x,
                                  const float* weight, const float* rstd, int64_t n, int64_t c,
                                  Stream) {
  FP8RT_RETURN_IF_ERROR(CheckSizes("rmsnorm_backward", {{"n", n}, {"c", c}}));
  if (n == 0) return absl::OkStatus();
  if (c == 0) return absl::InvalidArgumentError("rmsnorm_backward: c is 0 with rows to normalise");
  RmsNormBackwardFast(dx, dweight, dout, x, weight, rstd, n, c);
  return absl::OkStatus();
}
// InvalidArgument unless `hkv` kv heads can serve `h` query heads (called with rows to process).
absl::Status CheckKvHeads(const char* op, int64_t h, int64_t hkv) {
  if (hkv == 0 || h % hkv != 0) {
    return absl::InvalidArgumentError(
        absl::StrCat(op, ": hkv is ", hkv, ", which does not divide h = ", h));
  }
  return absl::OkStatus();
}
absl::Status AttentionForwardEntry(float* out, float* lse, const float* q, const float* k,
                                   const float* v, int64_t b, int64_t t, int64_t h, int64_t hkv,
                                   int64_t dh, Stream) {
  FP8RT_RETURN_IF_ERROR(
      CheckSizes("attention_forward", {{"b", b}, {"t", t}, {"h", h}, {"hkv", hkv}, {"dh", dh}}));
  if (b == 0 || t == 0 || h == 0) return absl::OkStatus();
  if (dh == 0) return absl::InvalidArgumentError("attention_forward: dh is 0");
  FP8RT_RETURN_IF_ERROR(CheckKvHeads("attention_forward", h, hkv));
  AttentionForwardFast(out, lse, q, k, v, b, t, h, hkv, dh);
  return absl::OkStatus();
}
absl::Status AttentionBackwardEntry(float* dq, float* dk, float* dv, const float* dout,
                                    const float* q, const float* k, const float* v,
                                    const float* out, const float* lse, int64_t b, int64_t t,
                                    int64_t h, int64_t hkv, int64_t dh, Stream) {
  FP8RT_RETURN_IF_ERROR(
      CheckSizes("attention_backward", {{"b", b}, {"t", t}, {"h", h}, {"hkv", hkv}, {"dh", dh}}));
  if (b == 0 || t == 0 || h == 0) return absl::OkStatus();
  if (dh == 0) return absl::InvalidArgumentError("attention_backward: dh is 0");
  FP8RT_RETURN_IF_ERROR(CheckKvHeads("attention_backward", h, hkv));
  AttentionBackwardFast(dq, dk, dv, dout, q, k, v, out, lse, b, t, h, hkv, dh);
  return absl::OkStatus();
}
absl::Status GeluForwardEntry(float* out, const float* x, int64_t n, Stream) {
  FP8RT_RETURN_IF_ERROR(CheckSizes("gelu_forward", {{"n", n}}));
  cpu_internal::GeluForwardVec(out, x, n);
  return absl::OkStatus();
}
absl::Status GeluBackwardEntry(float* dx, const float* dout, const float* x, int64_t n, Stream) {
  FP8RT_RETURN_IF_ERROR(CheckSizes("gelu_backward", {{"n", n}}));
  cpu_internal::GeluBackwardVec(dx, dout, x, n);
  return absl::OkStatus();
}
// InvalidArgument naming `eps` unless it is finite and >= 0.
absl::Status CheckEps(const char* op, float eps) {
  if (!(std::isfinite(eps) && eps >= 0.0f)) {
    return absl::InvalidArgumentError(
        absl::StrCat(op, ": eps is ", eps, " (must be finite, >= 0)"));
  }
  return absl::OkStatus();
}
absl::Status LayerNormForwardEntry(float* out, float* mean, float* rstd, const float* x,
                                   const float* weight, const float* bias, int64_t n, int64_t c,
                                   float eps, Stream) {
  constexpr const char* kOp = "layernorm_forward";
  FP8RT_RETURN_IF_ERROR(CheckSizes(kOp, {{"n", n}, {"c", c}}));
  FP8RT_RETURN_IF_ERROR(CheckEps(kOp, eps));
  if (n == 0) return absl::OkStatus();
  if (c == 0) return absl::InvalidArgumentError("layernorm_forward: c is 0 with rows to normalise");
  LayerNormForwardFast(out, mean, rstd, x, weight, bias, n, c, eps);
  return absl::OkStatus();
}
absl::Status LayerNormBackwardEntry(float* dx, float* dweight, float* dbias, const float* dout,
                                    const float* x, const float* weight, const float* mean,
                                    const float* rstd, int64_t n, int64_t c, Stream) {
  FP8RT_RETURN_IF_ERROR(CheckSizes("layernorm_backward", {{"n", n}, {"c", c}}));
  if (n == 0) return absl::OkStatus();
  if (c == 0) {
    return absl::InvalidArgumentError("layernorm_backward: c is 0 with rows to normalise");
  }
  LayerNormBackwardFast(dx, dweight, dbias, dout, x, weight, mean, rstd, n, c);
  return absl::OkStatus();
}
absl::Status BiasForwardEntry(float* out, const float* bias, int64_t n, int64_t c, Stream) {
  FP8RT_RETURN_IF_ERROR(CheckSizes("bias_forward", {{"n", n}, {"c", c}}));
  BiasForwardFast(out, bias, n, c);
  return absl::OkStatus();
}
absl::Status BiasBackwardEntry(float* dbias, const float* dout, int64_t n, int64_t c, Stream) {
  FP8RT_RETURN_IF_ERROR(CheckSizes("bias_backward", {{"n", n}, {"c", c}}));
  BiasBackwardFast(dbias, dout, n, c);
  return absl::OkStatus();
}
// The checks shared by rope_forward and rope_backward; *work is false when there is nothing to do.
absl::Status CheckRope(const char* op, int64_t n, int64_t t, int64_t h, int64_t dh, float theta,
                       bool* work) {
  FP8RT_RETURN_IF_ERROR(CheckSizes(op, {{"n", n}, {"t", t}, {"h", h}, {"dh", dh}}));
  if (!(std::isfinite(theta) && theta > 0.0f)) {
    return absl::InvalidArgumentError(
        absl::StrCat(op, ": theta is ", theta, " (must be finite, > 0)"));
  }
  *work = n > 0 && h > 0;
  if (!*work) return absl::OkStatus();
  if (dh == 0 || dh % 2 != 0) {
    return absl::InvalidArgumentError(absl::StrCat(op, ": dh is ", dh, " (must be even, > 0)"));
  }
  if (t == 0) return absl::InvalidArgumentError(absl::StrCat(op, ": t is 0 with rows to rotate"));
  return absl::OkStatus();
}
absl::Status RopeForwardEntry(float* out, const float* x, int64_t n, int64_t t, int64_t h,
                              int64_t dh, float theta, Stream) {
  bool work = false;
  FP8RT_RETURN_IF_ERROR(CheckRope("rope_forward", n, t, h, dh, theta, &work));
  if (!work) return absl::OkStatus();
  RopeFast(true, out, x, n, t, h, dh, theta);
  return absl::OkStatus();
}
absl::Status RopeBackwardEntry(float* dx, const float* dout, int64_t n, int64_t t, int64_t h,
                               int64_t dh, float theta, Stream) {
  bool work = false;
  FP8RT_RETURN_IF_ERROR(CheckRope("rope_backward", n, t, h, dh, theta, &work));
  if (!work) return absl::OkStatus();
  if (dx == dout) return absl::InvalidArgumentError("rope_backward: dx aliases dout");
  RopeFast(false, dx, dout, n, t, h, dh, theta);
  return absl::OkStatus();
}
absl::Status SwigluForwardEntry(float* out, const float* gate, const float* up, int64_t n, Stream) {
  FP8RT_RETURN_IF_ERROR(CheckSizes("swiglu_forward", {{"n", n}}));
  cpu_internal::SwigluForwardVec(out, gate, up, n);
  return absl::OkStatus();
}
absl::Status SwigluBackwardEntry(float* dgate, float* dup, const float* dout, const float* gate,
                                 const float* up, int64_t n, Stream) {
  FP8RT_RETURN_IF_ERROR(CheckSizes("swiglu_backward", {{"n", n}}));
  cpu_internal::SwigluBackwardVec(dgate, dup, dout, gate, up, n);
  return absl::OkStatus();
}
absl::Status ResidualForwardEntry(float* out, const float* a, const float* b, int64_t n, Stream) {
  FP8RT_RETURN_IF_ERROR(CheckSizes("residual_forward", {{"n", n}}));
  ResidualForwardFast(out, a, b, n);
  return absl::OkStatus();
}
absl::Status ResidualBackwardEntry(float* da, float* db, const float* dout, int64_t n, Stream) {
  FP8RT_RETURN_IF_ERROR(CheckSizes("residual_backward", {{"n", n}}));
  ResidualBackwardFast(da, db, dout, n);
  return absl::OkStatus();
}
absl::Status CrossEntropyForwardEntry(float* probs, float* losses, const float* logits,
                                      const int32_t* targets, int64_t n, int64_t v, Stream) {
  FP8RT_RETURN_IF_ERROR(CheckSizes("cross_entropy_forward", {{"n", n}, {"v", v}}));
  if (n == 0) return absl::OkStatus();
  if (v == 0) return absl::InvalidArgumentError("cross_entropy_forward: v is 0 with rows");
  CrossEntropyForwardFast(probs, losses, logits, targets, n, v);
  return absl::OkStatus();
}
absl::Status CrossEntropyBackwardEntry(float* dlogits, const float* probs, const int32_t* targets,
                                       int64_t n, int64_t v, float dloss, Stream) {
  FP8RT_RETURN_IF_ERROR(CheckSizes("cross_entropy_backward", {{"n", n}, {"v", v}}));
  if (n == 0) return absl::OkStatus();
  if (v == 0) return absl::InvalidArgumentError("cross_entropy_backward: v is 0 with rows");
  CrossEntropyBackwardFast(dlogits, probs, targets, n, v, dloss);
  return absl::OkStatus();
}
absl::Status FillEntry(float* x, float value, int64_t n, Stream) {
  FP8RT_RETURN_IF_ERROR(CheckSizes("fill", {{"n", n}}));
  std::fill_n(x, n, value);
  return absl::OkStatus();
}
absl::Status CopyEntry(float* dst, const float* src, int64_t n, Stream) {
  FP8RT_RETURN_IF_ERROR(CheckSizes("copy", {{"n", n}}));
  if (n > 0) std::memcpy(dst, src, static_cast<size_t>(n) * sizeof(float));
  return absl::OkStatus();
}
template <typename T>
absl::Status TransposeOf(const char* op, T* dst, const T* src, int64_t rows, int64_t cols) {
  FP8RT_RETURN_IF_ERROR(CheckSizes(op, {{"rows", rows}, {"cols", cols}}));
  constexpr int64_t kB = 32;  // strips of kB rows; each writes its own columns of dst
  const int64_t strips = (rows + kB - 1) / kB;
#pragma omp parallel for schedule(static) if (strips > 1 && rows * cols >= (int64_t{1} << 16))
  for (int64_t strip = 0; strip < strips; ++strip) {
    cpu_internal::TransposeRows(dst, src, rows, cols, strip * kB, std::min(rows, (strip + 1) * kB));
  }
  return absl::OkStatus();
}
absl::Status TransposeEntry(float* dst, const float* src, int64_t rows, int64_t cols, Stream) {
  return TransposeOf("transpose", dst, src, rows, cols);
}
absl::Status TransposeBytesEntry(uint8_t* dst, const uint8_t* src, int64_t rows, int64_t cols,
                                 Stream) {
  return TransposeOf("transpose_bytes", dst, src, rows, cols);
}
// Copies the q, k, v pieces of every kv head's group between the fused layout and the three
// tensors (kernels/layer_ops.h: split_heads).
template <bool kSplit>
void MoveHeads(float* q, float* k, float* v, float* qkv, int64_t n, int64_t kv_heads,
               int64_t q_per_kv, int64_t dh) {
  const size_t bytes = static_cast<size_t>(dh) * sizeof(float);
  const auto move = [&](float* part, float* fused) {
    if constexpr (kSplit) {
      std::memcpy(part, fused, bytes);
    } else {
      std::memcpy(fused, part, bytes);
    }
  };
  for (int64_t r = 0; r < n; ++r) {
    for (int64_t g = 0; g < kv_heads; ++g) {
      const int64_t pair = r * kv_heads + g;  // (row, kv head)
      float* fused = qkv + pair * (q_per_kv + 2) * dh;
      for (int64_t j = 0; j < q_per_kv; ++j) move(q + (pair * q_per_kv + j) * dh, fused + j * dh);
      move(k + pair * dh, fused + q_per_kv * dh);
      move(v + pair * dh, fused + (q_per_kv + 1) * dh);
    }
  }
}
absl::Status SplitHeadsEntry(float* q, float* k, float* v, const float* qkv, int64_t n,
                             int64_t kv_heads, int64_t q_per_kv, int64_t dh, Stream) {
  FP8RT_RETURN_IF_ERROR(CheckSizes(
      "split_heads", {{"n", n}, {"kv_heads", kv_heads}, {"q_per_kv", q_per_kv}, {"dh", dh}}));
  // Only read when splitting.
  MoveHeads<true>(q, k, v, const_cast<float*>(qkv), n, kv_heads, q_per_kv, dh);
  return absl::OkStatus();
}
absl::Status JoinHeadsEntry(float* qkv, const float* q, const float* k, const float* v, int64_t n,
                            int64_t kv_heads, int64_t q_per_kv, int64_t dh, Stream) {
  FP8RT_RETURN_IF_ERROR(CheckSizes(
      "join_heads", {{"n", n}, {"kv_heads", kv_heads}, {"q_per_kv", q_per_kv}, {"dh", dh}}));
  // Only read when joining.
  MoveHeads<false>(const_cast<float*>(q), const_cast<float*>(k), const_cast<float*>(v), qkv, n,
                   kv_heads, q_per_kv, dh);
  return absl::OkStatus();
}
absl::Status SumSquaresEntry(const float* x, int64_t count, double* out, Stream) {
  FP8RT_RETURN_IF_ERROR(CheckSizes("sum_squares", {{"count", count}}));
  *out = SumOfSquares(x, count);
  return absl::OkStatus();
}
absl::Status AdamWEntry(const AdamWArgs& args, Stream) {
  FP8RT_RETURN_IF_ERROR(CheckSizes("adamw", {{"count", args.count}}));
  if (args.count > 0 &&
      (args.master == nullptr || args.grad == nullptr || args.m == nullptr || args.v == nullptr)) {
    return absl::InvalidArgumentError("adamw: a null master, grad, m or v pointer");
  }
  FP8RT_RETURN_IF_ERROR(ValidateAdamWFp8Output(args.fp8, args.count, "adamw"));
  return AdamWFast(args);
}
absl::Status SynchronizeEntry(Stream) { return absl::OkStatus(); }
absl::StatusOr<void*> AllocateEntry(size_t bytes) {
  constexpr size_t kAlign = 64;
  void* p =
      bytes > std::numeric_limits<size_t>::max() - (kAlign - 1)
          ? nullptr  // the rounding up would wrap around
          : std::aligned_alloc(kAlign, std::max(kAlign, (bytes + kAlign - 1) / kAlign * kAlign));
  if (p == nullptr) {
    return absl::ResourceExhaustedError(
        absl::StrCat("allocating ", bytes, " bytes of host memory"));
  }
  return p;
}
void DeallocateEntry(void* p) { std::free(p); }

absl::Status PrefetchEntry(const void*, size_t, Stream) { return absl::OkStatus(); }

absl::Status CopyBytesEntry(void* dst, const void* src, size_t bytes, Stream) {
  if (bytes == 0) return absl::OkStatus();
  if (dst == nullptr) return absl::InvalidArgumentError("copy_bytes: dst is null");
  if (src == nullptr) return absl::InvalidArgumentError("copy_bytes: src is null");
  std::memcpy(dst, src, bytes);
  return absl::OkStatus();
}

absl::Status ZeroBytesEntry(void* p, size_t bytes, Stream) {
  if (bytes == 0) return absl::OkStatus();
  if (p == nullptr) return absl::InvalidArgumentError("zero_bytes: p is null");
  std::memset(p, 0, bytes);
  return absl::OkStatus();
}

}  // namespace

const LayerOps kLayerOps = {
    .embedding_forward = &EmbeddingForwardEntry,
    .embedding_backward = &EmbeddingBackwardEntry,
    .rmsnorm_forward = &RmsNormForwardEntry,
    .rmsnorm_backward = &RmsNormBackwardEntry,
    .attention_forward = &AttentionForwardEntry,
    .attention_backward = &AttentionBackwardEntry,
    .attention_forward_bf16 = &AttentionForwardEntry,
    .attention_backward_bf16 = &AttentionBackwardEntry,
    .gelu_forward = &GeluForwardEntry,
    .gelu_backward = &GeluBackwardEntry,
    .layernorm_forward = &LayerNormForwardEntry,
    .layernorm_backward = &LayerNormBackwardEntry,
    .bias_forward = &BiasForwardEntry,
    .bias_backward = &BiasBackwardEntry,
    .rope_forward = &RopeForwardEntry,
    .rope_backward = &RopeBackwardEntry,
    .swiglu_forward = &SwigluForwardEntry,
    .swiglu_backward = &SwigluBackwardEntry,
    .residual_forward = &ResidualForwardEntry,
    .residual_backward = &ResidualBackwardEntry,
    .cross_entropy_forward = &CrossEntropyForwardEntry,
    .cross_entropy_backward = &CrossEntropyBackwardEntry,
    .moe_route = &cpu_internal::MoeRouteCpu,
    .gather_rows = &cpu_internal::GatherRowsCpu,
    .scatter_rows = &cpu_internal::ScatterRowsCpu,
    .moe_combine = &cpu_internal::MoeCombineCpu,
    .moe_combine_backward = &cpu_internal::MoeCombineBackwardCpu,
    .moe_router_backward = &cpu_internal::MoeRouterBackwardCpu,
    .fill = &FillEntry,
    .copy = &CopyEntry,
    .transpose = &TransposeEntry,
    .transpose_bytes = &TransposeBytesEntry,
    .split_heads = &SplitHeadsEntry,
    .join_heads = &JoinHeadsEntry,
    .sum_squares = &SumSquaresEntry,
    .adamw = &AdamWEntry,
    .synchronize = &SynchronizeEntry,
    .allocate = &AllocateEntry,
    .deallocate = &DeallocateEntry,
    .allocate_device = &AllocateEntry,
    .allocate_host = &AllocateEntry,
    .zero_bytes = &ZeroBytesEntry,
    .prefetch = &PrefetchEntry,
    .copy_bytes = &CopyBytesEntry,
};

}  // namespace cpu_internal

}  // namespace fp8rt::kernels
