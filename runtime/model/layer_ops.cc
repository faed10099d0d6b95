// FP32 CPU reference of the non-GEMM layer ops; formulas and conventions in layer_ops.h.
#include "runtime/model/layer_ops.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <numbers>
#include <span>

#include "runtime/core/check.h"

namespace fp8rt::model {
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

// ---- Causal multi-head attention core ----

void AttentionForward(std::span<float> out, std::span<float> probs, std::span<const float> q,
                      std::span<const float> k, std::span<const float> v, int64_t b, int64_t t,
                      int64_t h, int64_t dh) {
  const int64_t size = b * t * h * dh;
  CheckSize(out, size, "attention out");
  CheckSize(probs, b * h * t * t, "attention probs");
  CheckSize(q, size, "attention q");
  CheckSize(k, size, "attention k");
  CheckSize(v, size, "attention v");
  FP8RT_CHECK(dh > 0) << "attention head dim " << dh;
  const float scale = 1.0f / std::sqrt(static_cast<float>(dh));
  // Offset of token `pos` of head `hh` in batch row `bb` of a [B, T, H, Dh] tensor.
  auto at = [&](int64_t bb, int64_t pos, int64_t hh) { return ((bb * t + pos) * h + hh) * dh; };
  for (int64_t bb = 0; bb < b; ++bb) {
    for (int64_t hh = 0; hh < h; ++hh) {
      for (int64_t i = 0; i < t; ++i) {
        float* p = probs.data() + ((bb * h + hh) * t + i) * t;
        const float* qi = q.data() + at(bb, i, hh);
        // Scores over the visible keys j <= i, then a max-subtracted softmax.
        float max_score = -std::numeric_limits<float>::infinity();
        for (int64_t j = 0; j <= i; ++j) {
          const float* kj = k.data() + at(bb, j, hh);
          float s = 0.0f;
          for (int64_t d = 0; d < dh; ++d) s += qi[d] * kj[d];
          p[j] = s * scale;
          max_score = std::max(max_score, p[j]);
        }
        float sum = 0.0f;
        for (int64_t j = 0; j <= i; ++j) {
          p[j] = std::exp(p[j] - max_score);
          sum += p[j];
        }
        const float inv_sum = 1.0f / sum;
        for (int64_t j = 0; j <= i; ++j) p[j] *= inv_sum;
        for (int64_t j = i + 1; j < t; ++j) p[j] = 0.0f;  // masked: future keys
        float* oi = out.data() + at(bb, i, hh);
        std::fill_n(oi, dh, 0.0f);
        for (int64_t j = 0; j <= i; ++j) {
          const float* vj = v.data() + at(bb, j, hh);
          for (int64_t d = 0; d < dh; ++d) oi[d] += p[j] * vj[d];
        }
      }
    }
  }
}

void AttentionBackward(std::span<float> dq, std::span<float> dk, std::span<float> dv,
                       std::span<const float> dout, std::span<const float> q,
                       std::span<const float> k, std::span<const float> v,
                       std::span<const float> probs, int64_t b, int64_t t, int64_t h, int64_t dh) {
  const int64_t size = b * t * h * dh;
  CheckSize(dq, size, "attention dq");
  CheckSize(dk, size, "attention dk");
  CheckSize(dv, size, "attention dv");
  CheckSize(dout, size, "attention dout");
  CheckSize(q, size, "attention q");
  CheckSize(k, size, "attention k");
  CheckSize(v, size, "attention v");
  CheckSize(probs, b * h * t * t, "attention probs");
  FP8RT_CHECK(dh > 0) << "attention head dim " << dh;
  const float scale = 1.0f / std::sqrt(static_cast<float>(dh));
  auto at = [&](int64_t bb, int64_t pos, int64_t hh) { return ((bb * t + pos) * h + hh) * dh; };
  for (int64_t bb = 0; bb < b; ++bb) {
    for (int64_t hh = 0; hh < h; ++hh) {
      for (int64_t i = 0; i < t; ++i) {
        const float* p = probs.data() + ((bb * h + hh) * t + i) * t;
        const float* doi = dout.data() + at(bb, i, hh);
        const float* qi = q.data() + at(bb, i, hh);
        float* dqi = dq.data() + at(bb, i, hh);
        // sum_j p[i, j] dp[i, j], the softmax Jacobian's rank-one term.
        float p_dot_dp = 0.0f;
        for (int64_t j = 0; j <= i; ++j) {
          const float* vj = v.data() + at(bb, j, hh);
          float dp = 0.0f;
          for (int64_t d = 0; d < dh; ++d) dp += doi[d] * vj[d];
          p_dot_dp += p[j] * dp;
        }
        for (int64_t j = 0; j <= i; ++j) {
          const float* kj = k.data() + at(bb, j, hh);
          const float* vj = v.data() + at(bb, j, hh);
          float* dkj = dk.data() + at(bb, j, hh);
          float* dvj = dv.data() + at(bb, j, hh);
          float dp = 0.0f;
          for (int64_t d = 0; d < dh; ++d) dp += doi[d] * vj[d];
          const float ds = p[j] * (dp - p_dot_dp) * scale;
          for (int64_t d = 0; d < dh; ++d) {
            dqi[d] += ds * kj[d];
            dkj[d] += ds * qi[d];
            dvj[d] += p[j] * doi[d];
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

}  // namespace fp8rt::model
