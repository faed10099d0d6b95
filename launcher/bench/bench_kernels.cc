#include "launcher/bench/bench_kernels.h"

#include <cblas.h>
#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <random>
#include <vector>

#include "absl/strings/str_cat.h"
#include "kernels/layer_ops.h"
#include "kernels/ops.h"
#include "launcher/bench/bench_util.h"
#include "oneapi/dnnl/dnnl.hpp"
#include "runtime/core/aligned_buffer.h"
#include "runtime/core/status.h"

namespace fp8rt::bench {
namespace {

// Fills x with N(0, 1) values, in parallel (one generator per thread, fixed seeds).
void FillNormal(float* x, int64_t n, uint32_t seed) {
#pragma omp parallel
  {
    std::mt19937 gen(seed + 7919u * static_cast<uint32_t>(omp_get_thread_num()));
    std::normal_distribution<float> dist(0.0f, 1.0f);
#pragma omp for schedule(static)
    for (int64_t i = 0; i < n; ++i) x[i] = dist(gen);
  }
}

// memcpy split over the OpenMP team, like the quantize kernel.
void ParallelCopy(const float* src, float* dst, int64_t n) {
#pragma omp parallel
  {
    const int t = omp_get_thread_num(), nt = omp_get_num_threads();
    const int64_t b = n * t / nt, e = n * (t + 1) / nt;
    std::memcpy(dst + b, src + b, static_cast<size_t>(e - b) * sizeof(float));
  }
}

nlohmann::ordered_json TimingJson(const Timing& t) {
  nlohmann::ordered_json j;
  j["best_s"] = t.best_seconds;
  j["median_s"] = t.median_seconds;
  j["samples"] = t.samples;
  return j;
}

}  // namespace

absl::StatusOr<nlohmann::ordered_json> QuantizeBench(const QuantizeBenchOptions& options) {
  if (options.mib < 1) return absl::InvalidArgumentError("--mib must be >= 1");
  const int64_t n = static_cast<int64_t>(options.mib) * (1 << 20) / 4;
  // 64-byte aligned like every tensor fp8rt allocates (AlignedBuffer).
  AlignedBuffer x_buf(static_cast<size_t>(n) * 4), copy_buf(static_cast<size_t>(n) * 4),
      codes_buf(static_cast<size_t>(n));
  float* x = x_buf.as<float>();
  float* copy = copy_buf.as<float>();
  uint8_t* codes = codes_buf.as<uint8_t>();
  FillNormal(x, n, 1234);
  ParallelCopy(x, copy, n);  // touch every page before timing
  std::memset(codes, 0, static_cast<size_t>(n));

  float scale_inv = 0.0f;
  kernels::QuantStats stats;
  kernels::QuantizeArgs q;
  q.format = kernels::Fp8Format::kE4M3;
  q.granularity = kernels::Granularity::kTensor;
  q.input = x;
  q.rows = 1;
  q.cols = n;
  q.has_scale = true;
  q.scale = 448.0f / 5.0f;  // a delayed scale from a previous amax of 5
  q.codes = codes;
  q.scale_inv = &scale_inv;
  q.stats = &stats;
  const kernels::OpTable& ops = kernels::CpuOps();
  absl::Status status = ops.quantize(q, {});
  if (!status.ok()) return status;

  std::vector<Case> cases = {
      {"memcpy", [&] { ParallelCopy(x, copy, n); }},
      {"quantize_e4m3_tensor", [&] { (void)ops.quantize(q, {}); }},
  };
  auto t = RunInterleaved(cases, options.rounds, options.samples);
  const double bytes_copy = 2.0 * 4.0 * static_cast<double>(n);  // read + write
  const double bytes_quant = 5.0 * static_cast<double>(n);       // read FP32, write FP8
  const double bw_copy = bytes_copy / t["memcpy"].best_seconds;
  const double bw_quant = bytes_quant / t["quantize_e4m3_tensor"].best_seconds;

  nlohmann::ordered_json j;
  j["benchmark"] = "quantize";
  j["ratio"] = bw_quant / bw_copy;
  j["ratio_definition"] =
      "quantize effective bandwidth (5 bytes/element) over memcpy bandwidth (8 bytes/element: "
      "read + write), fastest of interleaved samples";
  j["ratio_median"] = (bytes_quant / t["quantize_e4m3_tensor"].median_seconds) /
                      (bytes_copy / t["memcpy"].median_seconds);
  j["elements"] = n;
  j["input_mib"] = options.mib;
  j["threads"] = omp_get_max_threads();
  j["quantize_gb_per_s"] = bw_quant / 1e9;
  j["memcpy_gb_per_s"] = bw_copy / 1e9;
  j["quantize_gelem_per_s"] = static_cast<double>(n) / t["quantize_e4m3_tensor"].best_seconds / 1e9;
  j["quantize"] = TimingJson(t["quantize_e4m3_tensor"]);
  j["memcpy"] = TimingJson(t["memcpy"]);
  j["check"] = {{"amax", stats.amax}, {"saturated", stats.saturated}, {"count", stats.count}};
  return j;
}

absl::StatusOr<nlohmann::ordered_json> GemmBench(const GemmBenchOptions& options) {
  if (options.size < 16) return absl::InvalidArgumentError("--size must be >= 16");
  if (options.scaling != "tensor" && options.scaling != "mx32") {
    return absl::InvalidArgumentError("--scaling must be tensor or mx32");
  }
  const bool mx = options.scaling == "mx32";
  const int64_t s = options.size;
  std::vector<float> a(static_cast<size_t>(s * s)), b(static_cast<size_t>(s * s)),
      d(static_cast<size_t>(s * s)), d_ref(static_cast<size_t>(s * s));
  FillNormal(a.data(), s * s, 1);
  FillNormal(b.data(), s * s, 2);
  const kernels::OpTable& ops = kernels::CpuOps();

  // FP8 operands: current scaling of each tensor (not timed; the GEMM consumes FP8).
  std::vector<uint8_t> a8(a.size()), b8(b.size());
  float a_si = 0.0f, b_si = 0.0f;
  for (auto [src, dst, si] : {std::tuple{&a, &a8, &a_si}, std::tuple{&b, &b8, &b_si}}) {
    kernels::QuantizeArgs q;
    q.input = src->data();
    q.rows = s;
    q.cols = s;
    q.codes = dst->data();
    q.scale_inv = si;
    if (absl::Status st = ops.quantize(q, {}); !st.ok()) return st;
  }
  kernels::Fp8GemmArgs g;
  g.m = g.n = g.k = s;
  g.a = a8.data();
  g.b = b8.data();
  g.a_scale_inv = &a_si;
  g.b_scale_inv = &b_si;
  g.d = d.data();
  AlignedBuffer ws(kernels::GemmWorkspaceBytes(g));
  g.workspace = ws.data();
  g.workspace_bytes = ws.size();
  if (absl::Status st = ops.gemm_fp8(g, {}); !st.ok()) return st;

  // MXFP8 operands: one E8M0 scale per 1x32 block along K (OCP MX v1.0), the same data.
  const int64_t kb32 = (s + 31) / 32;
  std::vector<uint8_t> a8mx(a.size()), b8mx(b.size()), a_e8m0(static_cast<size_t>(s * kb32)),
      b_e8m0(static_cast<size_t>(s * kb32));
  for (auto [src, dst, e8m0] : {std::tuple{&a, &a8mx, &a_e8m0}, std::tuple{&b, &b8mx, &b_e8m0}}) {
    kernels::QuantizeArgs q;
    q.granularity = kernels::Granularity::kMx32;
    q.input = src->data();
    q.rows = s;
    q.cols = s;
    q.codes = dst->data();
    q.e8m0_scales = e8m0->data();
    if (absl::Status st = ops.quantize(q, {}); !st.ok()) return st;
  }
  std::vector<float> dmx(d.size());
  kernels::Fp8GemmArgs gmx = g;
  gmx.scaling = kernels::GemmScaling::kMx32;
  gmx.a = a8mx.data();
  gmx.b = b8mx.data();
  gmx.a_e8m0 = a_e8m0.data();
  gmx.b_e8m0 = b_e8m0.data();
  gmx.d = dmx.data();
  AlignedBuffer wsmx(kernels::GemmWorkspaceBytes(gmx));
  gmx.workspace = wsmx.data();
  gmx.workspace_bytes = wsmx.size();
  if (absl::Status st = ops.gemm_fp8(gmx, {}); !st.ok()) return st;

  kernels::Bf16GemmArgs g16;
  g16.m = g16.n = g16.k = s;
  g16.a = a.data();
  g16.b = b.data();
  g16.d = d.data();
  AlignedBuffer ws16(kernels::GemmWorkspaceBytes(g16));
  g16.workspace = ws16.data();
  g16.workspace_bytes = ws16.size();

  // oneDNN f32 matmul, B^T via strides (the same TN layout).
  dnnl::engine engine(dnnl::engine::kind::cpu, 0);
  dnnl::stream stream(engine);
  using dt = dnnl::memory::data_type;
  dnnl::memory::desc a_md({s, s}, dt::f32, {s, 1}), b_md({s, s}, dt::f32, {1, s}),
      d_md({s, s}, dt::f32, {s, 1});
  dnnl::matmul::primitive_desc pd(dnnl::matmul::desc(a_md, b_md, d_md), engine);
  dnnl::matmul f32_matmul(pd);
  dnnl::memory a_mem(a_md, engine, a.data()), b_mem(b_md, engine, b.data()),
      d_mem(d_md, engine, d_ref.data());

  std::vector<Case> cases = {
      {"sgemm_openblas",
       [&] {
         cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, s, s, s, 1.0f, a.data(), s, b.data(),
                     s, 0.0f, d_ref.data(), s);
       }},
      {"f32_onednn",
       [&] {
         f32_matmul.execute(
             stream, {{DNNL_ARG_SRC, a_mem}, {DNNL_ARG_WEIGHTS, b_mem}, {DNNL_ARG_DST, d_mem}});
         stream.wait();
       }},
      {"fp8_e4m3_tensor", [&] { (void)ops.gemm_fp8(g, {}); }},
      {"fp8_e4m3_mx32", [&] { (void)ops.gemm_fp8(gmx, {}); }},
      {"bf16", [&] { (void)ops.gemm_bf16(g16, {}); }},
  };
  auto t = RunInterleaved(cases, options.rounds, options.samples);
  const double flop =
      2.0 * static_cast<double>(s) * static_cast<double>(s) * static_cast<double>(s);
  const double fp32_best = std::min(t["sgemm_openblas"].best_seconds, t["f32_onednn"].best_seconds);

  // Sanity: the FP8 result must be close to the FP32 one (FP8 inputs: ~2^-4 relative per value).
  (void)ops.gemm_fp8(g, {});
  cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, s, s, s, 1.0f, a.data(), s, b.data(), s,
              0.0f, d_ref.data(), s);
  (void)ops.gemm_fp8(gmx, {});
  double err2 = 0.0, ref2 = 0.0, err2mx = 0.0;
  for (size_t i = 0; i < d.size(); ++i) {
    err2 += (static_cast<double>(d[i]) - d_ref[i]) * (static_cast<double>(d[i]) - d_ref[i]);
    err2mx += (static_cast<double>(dmx[i]) - d_ref[i]) * (static_cast<double>(dmx[i]) - d_ref[i]);
    ref2 += static_cast<double>(d_ref[i]) * d_ref[i];
  }

  const std::string headline = mx ? "fp8_e4m3_mx32" : "fp8_e4m3_tensor";
  nlohmann::ordered_json j;
  j["benchmark"] = "gemm";
  j["scaling"] = options.scaling;
  j["ratio"] = fp32_best / t[headline].best_seconds;
  j["ratio_definition"] =
      mx ? "MXFP8 GEMM throughput (E4M3, E8M0 scale per 1x32 block along K, FP32 out, decode "
           "and scaling included) over the faster FP32 GEMM (OpenBLAS sgemm or oneDNN f32), "
           "fastest of interleaved samples"
         : "FP8 GEMM throughput (E4M3, tensor scales, FP32 out, decode included) over the faster "
           "FP32 GEMM (OpenBLAS sgemm or oneDNN f32), fastest of interleaved samples";
  j["ratio_median"] = std::min(t["sgemm_openblas"].median_seconds, t["f32_onednn"].median_seconds) /
                      t[headline].median_seconds;
  j["mx32_over_tensor"] = t["fp8_e4m3_tensor"].best_seconds / t["fp8_e4m3_mx32"].best_seconds;
  j["m"] = s;
  j["n"] = s;
  j["k"] = s;
  j["threads"] = omp_get_max_threads();
  j["tflops"] = {{"fp8", flop / t["fp8_e4m3_tensor"].best_seconds / 1e12},
                 {"bf16", flop / t["bf16"].best_seconds / 1e12},
                 {"f32_onednn", flop / t["f32_onednn"].best_seconds / 1e12},
                 {"sgemm_openblas", flop / t["sgemm_openblas"].best_seconds / 1e12}};
  j["bf16_over_fp32"] = fp32_best / t["bf16"].best_seconds;
  j["fp8_vs_fp32_rel_rms_diff"] = std::sqrt(err2 / ref2);
  j["mx32_vs_fp32_rel_rms_diff"] = std::sqrt(err2mx / ref2);
  j["tflops"]["fp8_mx32"] = flop / t["fp8_e4m3_mx32"].best_seconds / 1e12;
  for (const char* name :
       {"fp8_e4m3_tensor", "fp8_e4m3_mx32", "bf16", "f32_onednn", "sgemm_openblas"}) {
    j["timings"][name] = TimingJson(t[name]);
  }
  return j;
}

}  // namespace fp8rt::bench

namespace fp8rt::bench {
namespace {

// The materialised baseline of AttentionBench: per (batch row, query head), row-major sgemm
// calls on the head's strided views of q, k, v (rows H * Dh or Hkv * Dh apart).
struct MaterialisedAttention {
  int64_t b, t, h, hkv, dh;
  std::vector<float> probs;  // [B, H, T, T], kept from the forward for the backward
  std::vector<float> dp;     // [B, H, T, T] scratch of the backward

  void Forward(float* out, const float* q, const float* k, const float* v) {
    const float scale = 1.0f / std::sqrt(static_cast<float>(dh));
    const int64_t group = h / hkv, ld = h * dh, ldkv = hkv * dh;
#pragma omp parallel for schedule(static)
    for (int64_t task = 0; task < b * h; ++task) {
      const int64_t bb = task / h, hh = task % h;
      const float* qh = q + (bb * t * h + hh) * dh;
      const int64_t kv = (bb * t * hkv + hh / group) * dh;
      float* p = probs.data() + task * t * t;
      cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, t, t, dh, scale, qh, ld, k + kv, ldkv,
                  0.0f, p, t);
      for (int64_t i = 0; i < t; ++i) {
        float* row = p + i * t;
        float mx = -std::numeric_limits<float>::infinity();
        for (int64_t j = 0; j <= i; ++j) mx = std::max(mx, row[j]);
        float sum = 0.0f;
        for (int64_t j = 0; j <= i; ++j) sum += row[j] = std::exp(row[j] - mx);
        for (int64_t j = 0; j <= i; ++j) row[j] /= sum;
        std::fill(row + i + 1, row + t, 0.0f);
      }
      cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, t, dh, t, 1.0f, p, t, v + kv, ldkv,
                  0.0f, out + (bb * t * h + hh) * dh, ld);
    }
  }

  // dk and dv of a kv head are written by each of its query heads: the heads of one group run on
  // one thread, in order.
  void Backward(float* dq, float* dk, float* dv, const float* dout, const float* q, const float* k,
                const float* v) {
    const float scale = 1.0f / std::sqrt(static_cast<float>(dh));
    const int64_t group = h / hkv, ld = h * dh, ldkv = hkv * dh;
#pragma omp parallel for schedule(static)
    for (int64_t task = 0; task < b * hkv; ++task) {
      const int64_t bb = task / hkv, g = task % hkv;
      const int64_t kv = (bb * t * hkv + g) * dh;
      for (int64_t hh = g * group; hh < (g + 1) * group; ++hh) {
        const int64_t at = (bb * t * h + hh) * dh;
        const float* p = probs.data() + (bb * h + hh) * t * t;
        float* ds = dp.data() + (bb * h + hh) * t * t;
        cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, t, t, dh, 1.0f, dout + at, ld, v + kv,
                    ldkv, 0.0f, ds, t);
        for (int64_t i = 0; i < t; ++i) {
          float dot = 0.0f;
          for (int64_t j = 0; j <= i; ++j) dot += p[i * t + j] * ds[i * t + j];
          for (int64_t j = 0; j < t; ++j)
            ds[i * t + j] = p[i * t + j] * (ds[i * t + j] - dot) * scale;
        }
        cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, t, dh, t, 1.0f, ds, t, k + kv, ldkv,
                    1.0f, dq + at, ld);
        cblas_sgemm(CblasRowMajor, CblasTrans, CblasNoTrans, t, dh, t, 1.0f, ds, t, q + at, ld,
                    1.0f, dk + kv, ldkv);
        cblas_sgemm(CblasRowMajor, CblasTrans, CblasNoTrans, t, dh, t, 1.0f, p, t, dout + at, ld,
                    1.0f, dv + kv, ldkv);
      }
    }
  }
};

}  // namespace

absl::Status CheckAttentionShape(int batch, int seq, int heads, int kv_heads, int head_dim) {
  for (auto [name, value] :
       {std::pair{"--batch", batch}, std::pair{"--seq", seq}, std::pair{"--heads", heads},
        std::pair{"--kv-heads", kv_heads}, std::pair{"--head-dim", head_dim}}) {
    if (value < 1) return absl::InvalidArgumentError(absl::StrCat(name, " must be >= 1"));
  }
  if (heads % kv_heads != 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("--kv-heads ", kv_heads, " does not divide --heads ", heads));
  }
  return absl::OkStatus();
}

absl::StatusOr<nlohmann::ordered_json> AttentionBench(const AttentionBenchOptions& o) {
  FP8RT_RETURN_IF_ERROR(CheckAttentionShape(o.batch, o.seq, o.heads, o.kv_heads, o.head_dim));
  const int64_t b = o.batch, t = o.seq, h = o.heads, hkv = o.kv_heads, dh = o.head_dim;
  const int64_t size = b * t * h * dh, kv_size = b * t * hkv * dh;
  std::vector<float> q(size), k(kv_size), v(kv_size), dout(size), out(size), lse(b * h * t),
      out_ref(size), dq(size), dk(kv_size), dv(kv_size);
  FillNormal(q.data(), size, 11);
  FillNormal(k.data(), kv_size, 12);
  FillNormal(v.data(), kv_size, 13);
  FillNormal(dout.data(), size, 14);
  MaterialisedAttention ref{
      b, t, h, hkv, dh, std::vector<float>(b * h * t * t), std::vector<float>(b * h * t * t)};
  const kernels::LayerOps& L = *kernels::CpuOps().layer;
  openblas_set_num_threads(1);  // one sgemm per head and thread: the team is OpenMP's
  auto flash = [&] {
    (void)L.attention_forward(out.data(), lse.data(), q.data(), k.data(), v.data(), b, t, h, hkv,
                              dh, {});
    (void)L.attention_backward(dq.data(), dk.data(), dv.data(), dout.data(), q.data(), k.data(),
                               v.data(), out.data(), lse.data(), b, t, h, hkv, dh, {});
  };
  auto materialised = [&] {
    ref.Forward(out_ref.data(), q.data(), k.data(), v.data());
    ref.Backward(dq.data(), dk.data(), dv.data(), dout.data(), q.data(), k.data(), v.data());
  };
  absl::Status st = L.attention_forward(out.data(), lse.data(), q.data(), k.data(), v.data(), b, t,
                                        h, hkv, dh, {});
  if (!st.ok()) return st;
  std::vector<Case> cases = {{"flash", flash}, {"materialised", materialised}};
  auto tm = RunInterleaved(cases, o.rounds, o.samples);
  // Sanity: both compute the same attention (FP32, other summation orders).
  flash();
  materialised();
  double diff = 0.0, largest = 0.0;
  for (int64_t i = 0; i < size; ++i) {
    diff = std::max(diff, std::fabs(double{out[i]} - out_ref[i]));
    largest = std::max(largest, std::fabs(double{out_ref[i]}));
  }
  nlohmann::ordered_json j;
  j["benchmark"] = "attention";
  j["ratio"] = tm["materialised"].best_seconds / tm["flash"].best_seconds;
  j["ratio_definition"] =
      "time of the materialised attention (OpenBLAS sgemm per head, [T, T] probabilities kept) "
      "over the table's flash attention, forward + backward, fastest of interleaved samples";
  j["ratio_median"] = tm["materialised"].median_seconds / tm["flash"].median_seconds;
  j["shape"] = {{"batch", b}, {"seq", t}, {"heads", h}, {"kv_heads", hkv}, {"head_dim", dh}};
  j["threads"] = omp_get_max_threads();
  j["flash"] = TimingJson(tm["flash"]);
  j["materialised"] = TimingJson(tm["materialised"]);
  j["saved_bytes"] = {{"flash_lse", b * h * t * 4}, {"materialised_probs", b * h * t * t * 4}};
  j["check"] = {{"max_abs_out_difference", diff}, {"max_abs_out", largest}};
  return j;
}

}  // namespace fp8rt::bench
