// GPU benchmarks of `fp8rt bench ... --device cuda` (see bench_cuda.h).
//
// Method (METHOD.md of the device notes): inputs of random nonzero data several times the L2;
// every case called once to warm up (module load, cuBLASLt handle and heuristic, clocks); then
// interleaved rounds, each timing every case `samples` times with CUDA events around
// `iterations` back-to-back calls on one stream. The fastest sample estimates each case (noise
// only adds time) and the median is reported beside it; the ratio compares cases timed in the
// same process, on the same GPU, under the same conditions.
#include "launcher/bench/bench_cuda.h"

#include <cuda_runtime.h>
#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <map>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "kernels/cuda/cuda_backend.h"
#include "kernels/ops.h"
#include "launcher/bench/bench_kernels.h"
#include "runtime/core/checks.h"
#include "runtime/core/status.h"

namespace fp8rt::bench {
namespace {

class DeviceBuffer {
 public:
  static absl::StatusOr<DeviceBuffer> Create(size_t bytes) {
    DeviceBuffer b;
    CUDA_RETURN_IF_ERROR(cudaMalloc(&b.ptr_, std::max<size_t>(bytes, 1)));
    b.bytes_ = bytes;
    return b;
  }
  DeviceBuffer() = default;
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;
  DeviceBuffer(DeviceBuffer&& o) noexcept : ptr_(o.ptr_), bytes_(o.bytes_) { o.ptr_ = nullptr; }
  DeviceBuffer& operator=(DeviceBuffer&& o) noexcept {
    std::swap(ptr_, o.ptr_);
    std::swap(bytes_, o.bytes_);
    return *this;
  }
  ~DeviceBuffer() {
    if (ptr_ != nullptr) (void)cudaFree(ptr_);
  }
  template <class T = void>
  T* as() const {
    return static_cast<T*>(ptr_);
  }
  size_t bytes() const { return bytes_; }

 private:
  void* ptr_ = nullptr;
  size_t bytes_ = 0;
};

// The op table and a stream of our own; Unavailable (with the runtime's reason) without a GPU.
struct Gpu {
  const kernels::OpTable* ops = nullptr;
  cudaStream_t stream = nullptr;
  cudaEvent_t start = nullptr, stop = nullptr;
  std::string name;
  ~Gpu() {
    if (start != nullptr) (void)cudaEventDestroy(start);
    if (stop != nullptr) (void)cudaEventDestroy(stop);
    if (stream != nullptr) (void)cudaStreamDestroy(stream);
  }
};

absl::Status OpenGpu(Gpu& gpu) {
  absl::StatusOr<const kernels::OpTable*> ops = kernels::CudaOps();
  if (!ops.ok())
    return absl::UnavailableError(absl::StrCat("--device cuda: ", ops.status().message()));
  gpu.ops = *ops;
  int device = 0;
  CUDA_RETURN_IF_ERROR(cudaGetDevice(&device));
  cudaDeviceProp prop{};
  CUDA_RETURN_IF_ERROR(cudaGetDeviceProperties(&prop, device));
  gpu.name = prop.name;
  CUDA_RETURN_IF_ERROR(cudaStreamCreateWithFlags(&gpu.stream, cudaStreamNonBlocking));
  CUDA_RETURN_IF_ERROR(cudaEventCreate(&gpu.start));
  CUDA_RETURN_IF_ERROR(cudaEventCreate(&gpu.stop));
  return absl::OkStatus();
}

struct Case {
  std::string name;
  std::function<absl::Status()> enqueue;  // one call, enqueued on the GPU's stream
};

struct Timing {
  double best = 0.0;
  double median = 0.0;
  int samples = 0;
};

nlohmann::ordered_json TimingJson(const Timing& t) {
  nlohmann::ordered_json j;
  j["best_s"] = t.best;
  j["median_s"] = t.median;
  j["samples"] = t.samples;
  return j;
}

absl::StatusOr<std::map<std::string, Timing>> RunInterleaved(Gpu& gpu,
                                                             const std::vector<Case>& cases,
                                                             int rounds, int samples,
                                                             int iterations) {
  if (rounds < 1 || samples < 1 || iterations < 1) {
    return absl::InvalidArgumentError("--rounds, --samples and --iterations must be >= 1");
  }
  for (const Case& c : cases) {  // warm-up
    for (int i = 0; i < 2; ++i) FP8RT_RETURN_IF_ERROR(c.enqueue());
  }
  CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(gpu.stream));
  std::map<std::string, std::vector<double>> seconds;
  for (int round = 0; round < rounds; ++round) {
    for (const Case& c : cases) {
      std::fprintf(stderr, "\r  round %d/%d: %-40s", round + 1, rounds, c.name.c_str());
      std::fflush(stderr);
      for (int s = 0; s < samples; ++s) {
        CUDA_RETURN_IF_ERROR(cudaEventRecord(gpu.start, gpu.stream));
        for (int i = 0; i < iterations; ++i) FP8RT_RETURN_IF_ERROR(c.enqueue());
        CUDA_RETURN_IF_ERROR(cudaEventRecord(gpu.stop, gpu.stream));
        CUDA_RETURN_IF_ERROR(cudaEventSynchronize(gpu.stop));
        float ms = 0.0f;
        CUDA_RETURN_IF_ERROR(cudaEventElapsedTime(&ms, gpu.start, gpu.stop));
        seconds[c.name].push_back(1e-3 * ms / iterations);
      }
    }
  }
  std::fprintf(stderr, "\r%-60s\r", "");
  std::map<std::string, Timing> out;
  for (auto& [name, v] : seconds) {
    std::sort(v.begin(), v.end());
    out[name] = Timing{v.front(), v[v.size() / 2], static_cast<int>(v.size())};
  }
  return out;
}

// Deterministic pseudo-random values in (-amp, amp), never all zero, filled on all cores.
void FillUniform(float* x, int64_t n, float amp, uint32_t seed) {
#pragma omp parallel for schedule(static)
  for (int64_t i = 0; i < n; ++i) {
    uint64_t h = (static_cast<uint64_t>(i) + 1) * 0x9E3779B97F4A7C15ull + seed;
    h ^= h >> 29;
    h *= 0xBF58476D1CE4E5B9ull;
    h ^= h >> 32;
    const float u = static_cast<float>(h >> 40) * 0x1p-24f;  // [0, 1)
    x[i] = (2.0f * u - 1.0f) * amp;
  }
}

absl::StatusOr<DeviceBuffer> UploadFloats(const std::vector<float>& host) {
  FP8RT_ASSIGN_OR_RETURN(DeviceBuffer d, DeviceBuffer::Create(host.size() * sizeof(float)));
  CUDA_RETURN_IF_ERROR(
      cudaMemcpy(d.as(), host.data(), host.size() * sizeof(float), cudaMemcpyHostToDevice));
  return d;
}

}  // namespace

absl::StatusOr<nlohmann::ordered_json> CudaQuantizeBench(const CudaQuantizeBenchOptions& options) {
  if (options.mib < 1) return absl::InvalidArgumentError("--mib must be >= 1");
  Gpu gpu;
  FP8RT_RETURN_IF_ERROR(OpenGpu(gpu));
  const int64_t n = static_cast<int64_t>(options.mib) * (1 << 20) / 4;
  std::vector<float> host(static_cast<size_t>(n));
  FillUniform(host.data(), n, 5.0f, 1234);
  FP8RT_ASSIGN_OR_RETURN(DeviceBuffer x, UploadFloats(host));
  host = {};
  FP8RT_ASSIGN_OR_RETURN(DeviceBuffer copy, DeviceBuffer::Create(static_cast<size_t>(n) * 4));
  FP8RT_ASSIGN_OR_RETURN(DeviceBuffer codes, DeviceBuffer::Create(static_cast<size_t>(n)));
  FP8RT_ASSIGN_OR_RETURN(DeviceBuffer scale_inv, DeviceBuffer::Create(sizeof(float)));
  FP8RT_ASSIGN_OR_RETURN(DeviceBuffer stats, DeviceBuffer::Create(sizeof(kernels::QuantStats)));

  kernels::QuantizeArgs q;
  q.format = kernels::Fp8Format::kE4M3;
  q.granularity = kernels::Granularity::kTensor;
  q.input = x.as();
  q.rows = 1;
  q.cols = n;
  q.has_scale = true;
  q.scale = 448.0f / 5.0f;  // a delayed scale from a previous amax of 5
  q.codes = codes.as<uint8_t>();
  q.scale_inv = scale_inv.as<float>();
  q.stats = stats.as<kernels::QuantStats>();
  const kernels::Stream stream{gpu.stream};
  const std::vector<Case> cases = {
      {"memcpy",
       [&]() -> absl::Status {
         CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(copy.as(), x.as(), static_cast<size_t>(n) * 4,
                                              cudaMemcpyDeviceToDevice, gpu.stream));
         return absl::OkStatus();
       }},
      {"quantize_e4m3_tensor", [&] { return gpu.ops->quantize(q, stream); }},
  };
  FP8RT_ASSIGN_OR_RETURN(
      auto t, RunInterleaved(gpu, cases, options.rounds, options.samples, options.iterations));
  kernels::QuantStats check;
  CUDA_RETURN_IF_ERROR(cudaMemcpy(&check, stats.as(), sizeof(check), cudaMemcpyDeviceToHost));
  if (check.count != n) {
    return absl::InternalError(absl::StrCat("quantize counted ", check.count, " values, not ", n));
  }
  const double bytes_copy = 8.0 * static_cast<double>(n);   // read + write
  const double bytes_quant = 5.0 * static_cast<double>(n);  // read FP32, write FP8
  const Timing& tq = t["quantize_e4m3_tensor"];
  const Timing& tc = t["memcpy"];

  nlohmann::ordered_json j;
  j["benchmark"] = "quantize";
  j["device"] = "cuda";
  j["gpu"] = gpu.name;
  j["ratio"] = (bytes_quant / tq.best) / (bytes_copy / tc.best);
  j["ratio_definition"] =
      "quantize effective bandwidth (5 bytes/element: FP32 in, FP8 out; amax and statistics in "
      "the same pass) over device-to-device cudaMemcpy bandwidth (8 bytes/element: read + "
      "write), fastest of interleaved samples timed with CUDA events";
  j["target"] = 0.9;
  j["ratio_median"] = (bytes_quant / tq.median) / (bytes_copy / tc.median);
  j["elements"] = n;
  j["input_mib"] = options.mib;
  j["quantize_gb_per_s"] = bytes_quant / tq.best / 1e9;
  j["memcpy_gb_per_s"] = bytes_copy / tc.best / 1e9;
  j["quantize_gelem_per_s"] = static_cast<double>(n) / tq.best / 1e9;
  j["iterations_per_sample"] = options.iterations;
  j["quantize"] = TimingJson(tq);
  j["memcpy"] = TimingJson(tc);
  j["check"] = {{"amax", check.amax},
                {"count", check.count},
                {"saturated", check.saturated},
                {"underflow", check.underflow},
                {"subnormal", check.subnormal}};
  return j;
}

absl::StatusOr<nlohmann::ordered_json> CudaGemmBench(const CudaGemmBenchOptions& options) {
  if (options.size < 16) return absl::InvalidArgumentError("--size must be >= 16");
  Gpu gpu;
  FP8RT_RETURN_IF_ERROR(OpenGpu(gpu));
  const int64_t s = options.size;
  const size_t count = static_cast<size_t>(s * s);
  const kernels::Stream stream{gpu.stream};

  // FP32 operands, then their BF16 roundings and FP8 quantizations (not timed).
  std::vector<float> host(count);
  FillUniform(host.data(), s * s, 2.0f, 1);
  FP8RT_ASSIGN_OR_RETURN(DeviceBuffer a32, UploadFloats(host));
  FillUniform(host.data(), s * s, 2.0f, 2);
  FP8RT_ASSIGN_OR_RETURN(DeviceBuffer b32, UploadFloats(host));
  host = {};
  FP8RT_ASSIGN_OR_RETURN(DeviceBuffer a16, DeviceBuffer::Create(count * 2));
  FP8RT_ASSIGN_OR_RETURN(DeviceBuffer b16, DeviceBuffer::Create(count * 2));
  for (auto [src, dst] : {std::pair{&a32, &a16}, std::pair{&b32, &b16}}) {
    kernels::ConvertArgs c;
    c.from = kernels::InputType::kF32;
    c.to = kernels::InputType::kBF16;
    c.input = src->as();
    c.output = dst->as();
    c.count = s * s;
    FP8RT_RETURN_IF_ERROR(gpu.ops->convert(c, stream));
  }
  const int64_t kb = (s + 127) / 128;
  FP8RT_ASSIGN_OR_RETURN(DeviceBuffer a8, DeviceBuffer::Create(count));
  FP8RT_ASSIGN_OR_RETURN(DeviceBuffer b8, DeviceBuffer::Create(count));
  FP8RT_ASSIGN_OR_RETURN(DeviceBuffer a8_block, DeviceBuffer::Create(count));
  FP8RT_ASSIGN_OR_RETURN(DeviceBuffer b8_block, DeviceBuffer::Create(count));
  FP8RT_ASSIGN_OR_RETURN(DeviceBuffer a_si, DeviceBuffer::Create(sizeof(float)));
  FP8RT_ASSIGN_OR_RETURN(DeviceBuffer b_si, DeviceBuffer::Create(sizeof(float)));
  FP8RT_ASSIGN_OR_RETURN(DeviceBuffer a_si_block,
                         DeviceBuffer::Create(static_cast<size_t>(s * kb) * 4));
  FP8RT_ASSIGN_OR_RETURN(DeviceBuffer b_si_block,
                         DeviceBuffer::Create(static_cast<size_t>(kb * kb) * 4));
  struct Quant {
    const DeviceBuffer* in;
    const DeviceBuffer* codes;
    const DeviceBuffer* scale_inv;
    kernels::Granularity granularity;
  };
  for (const Quant& qd :
       {Quant{&a32, &a8, &a_si, kernels::Granularity::kTensor},
        Quant{&b32, &b8, &b_si, kernels::Granularity::kTensor},
        Quant{&a32, &a8_block, &a_si_block, kernels::Granularity::kTile1x128},
        Quant{&b32, &b8_block, &b_si_block, kernels::Granularity::kBlock128x128}}) {
    kernels::QuantizeArgs q;
    q.granularity = qd.granularity;
    q.input = qd.in->as();
    q.rows = s;
    q.cols = s;
    q.codes = qd.codes->as<uint8_t>();
    q.scale_inv = qd.scale_inv->as<float>();
    FP8RT_RETURN_IF_ERROR(gpu.ops->quantize(q, stream));
  }
  FP8RT_ASSIGN_OR_RETURN(DeviceBuffer d8, DeviceBuffer::Create(count * 2));
  FP8RT_ASSIGN_OR_RETURN(DeviceBuffer d8_block, DeviceBuffer::Create(count * 2));
  FP8RT_ASSIGN_OR_RETURN(DeviceBuffer d8_fast, DeviceBuffer::Create(count * 2));
  FP8RT_ASSIGN_OR_RETURN(DeviceBuffer d16, DeviceBuffer::Create(count * 2));

  kernels::Fp8GemmArgs g8;
  g8.m = g8.n = g8.k = s;
  g8.a = a8.as<uint8_t>();
  g8.b = b8.as<uint8_t>();
  g8.a_scale_inv = a_si.as<float>();
  g8.b_scale_inv = b_si.as<float>();
  g8.out_type = kernels::OutputType::kBF16;
  g8.d = d8.as();
  // The same GEMM with fast accumulation (the training forward's default,
  // precision.fp8_fast_accum_forward): no FP32 promotion of the tensor cores' partial sums.
  kernels::Fp8GemmArgs g8f = g8;
  g8f.fast_accum = true;
  g8f.d = d8_fast.as();
  kernels::Fp8GemmArgs g8b = g8;
  g8b.scaling = kernels::GemmScaling::kBlock;
  g8b.a = a8_block.as<uint8_t>();
  g8b.b = b8_block.as<uint8_t>();
  g8b.a_scale_inv = a_si_block.as<float>();
  g8b.b_scale_inv = b_si_block.as<float>();
  g8b.d = d8_block.as();
  kernels::Bf16GemmArgs g16;
  g16.m = g16.n = g16.k = s;
  g16.a_type = g16.b_type = kernels::InputType::kBF16;
  g16.a = a16.as();
  g16.b = b16.as();
  g16.out_type = kernels::OutputType::kBF16;
  g16.d = d16.as();
  FP8RT_ASSIGN_OR_RETURN(
      DeviceBuffer ws8,
      DeviceBuffer::Create(kernels::CudaGemmWorkspaceBytes(g8) + kernels::kCublasLtWorkspaceBytes));
  FP8RT_ASSIGN_OR_RETURN(DeviceBuffer ws8b,
                         DeviceBuffer::Create(kernels::CudaGemmWorkspaceBytes(g8b) +
                                              kernels::kCublasLtWorkspaceBytes));
  FP8RT_ASSIGN_OR_RETURN(DeviceBuffer ws16,
                         DeviceBuffer::Create(kernels::CudaGemmWorkspaceBytes(g16) +
                                              kernels::kCublasLtWorkspaceBytes));
  g8.workspace = ws8.as();
  g8.workspace_bytes = ws8.bytes();
  g8f.workspace = ws8.as();  // the cases run one after another on one stream
  g8f.workspace_bytes = ws8.bytes();
  g8b.workspace = ws8b.as();
  g8b.workspace_bytes = ws8b.bytes();
  g16.workspace = ws16.as();
  g16.workspace_bytes = ws16.bytes();

  // Which path each GEMM takes (the headline must be cuBLASLt's FP8, not the fallback).
  auto path_of = [&](const std::function<absl::Status()>& call) -> absl::StatusOr<std::string> {
    const auto before = kernels::cuda_testing::GetGemmPathCounts();
    FP8RT_RETURN_IF_ERROR(call());
    CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(gpu.stream));
    return kernels::cuda_testing::GetGemmPathCounts().cublaslt > before.cublaslt
               ? std::string("cublaslt")
               : std::string("fallback kernel");
  };
  const std::vector<Case> cases = {
      {"fp8_e4m3_tensor", [&] { return gpu.ops->gemm_fp8(g8, stream); }},
      {"bf16", [&] { return gpu.ops->gemm_bf16(g16, stream); }},
      {"fp8_e4m3_block", [&] { return gpu.ops->gemm_fp8(g8b, stream); }},
      {"fp8_e4m3_tensor_fast_accum", [&] { return gpu.ops->gemm_fp8(g8f, stream); }},
  };
  nlohmann::ordered_json paths;
  for (const Case& c : cases) {
    FP8RT_ASSIGN_OR_RETURN(std::string path, path_of(c.enqueue));
    paths[c.name] = path;
  }
  FP8RT_ASSIGN_OR_RETURN(
      auto t, RunInterleaved(gpu, cases, options.rounds, options.samples, options.iterations));

  // Sanity: the FP8 result is close to the BF16 one (FP8 operands: ~2^-4 relative per value,
  // averaging out over K).
  // And what fast accumulation changes: its result against the promoted one, same operands.
  std::vector<uint16_t> h8(count), h16(count), h8f(count);
  CUDA_RETURN_IF_ERROR(cudaMemcpy(h8.data(), d8.as(), count * 2, cudaMemcpyDeviceToHost));
  CUDA_RETURN_IF_ERROR(cudaMemcpy(h16.data(), d16.as(), count * 2, cudaMemcpyDeviceToHost));
  CUDA_RETURN_IF_ERROR(cudaMemcpy(h8f.data(), d8_fast.as(), count * 2, cudaMemcpyDeviceToHost));
  double err2 = 0.0, ref2 = 0.0, fast2 = 0.0, promoted2 = 0.0;
#pragma omp parallel for reduction(+ : err2, ref2, fast2, promoted2) schedule(static)
  for (int64_t i = 0; i < s * s; ++i) {
    const double v8 = kernels::Bf16ToFloat(h8[static_cast<size_t>(i)]);
    const double v16 = kernels::Bf16ToFloat(h16[static_cast<size_t>(i)]);
    const double v8f = kernels::Bf16ToFloat(h8f[static_cast<size_t>(i)]);
    err2 += (v8 - v16) * (v8 - v16);
    ref2 += v16 * v16;
    fast2 += (v8f - v8) * (v8f - v8);
    promoted2 += v8 * v8;
  }

  const double flop =
      2.0 * static_cast<double>(s) * static_cast<double>(s) * static_cast<double>(s);
  const Timing& t8 = t["fp8_e4m3_tensor"];
  const Timing& t16 = t["bf16"];
  const Timing& t8b = t["fp8_e4m3_block"];
  const Timing& t8f = t["fp8_e4m3_tensor_fast_accum"];
  nlohmann::ordered_json j;
  j["benchmark"] = "gemm";
  j["device"] = "cuda";
  j["gpu"] = gpu.name;
  j["ratio"] = t16.best / t8.best;
  j["ratio_definition"] =
      "FP8 GEMM throughput (E4M3 x E4M3, tensor scales, BF16 out, FP32 accumulation with "
      "promotion) over BF16 GEMM throughput (BF16 operands, BF16 out, FP32 accumulation), both "
      "through the CUDA op table, fastest of interleaved samples timed with CUDA events";
  j["target"] = 1.8;
  j["ratio_median"] = t16.median / t8.median;
  j["ratio_block"] = t16.best / t8b.best;
  j["ratio_fast_accum"] = t16.best / t8f.best;
  j["m"] = s;
  j["n"] = s;
  j["k"] = s;
  j["tflops"] = {{"fp8", flop / t8.best / 1e12},
                 {"bf16", flop / t16.best / 1e12},
                 {"fp8_block", flop / t8b.best / 1e12},
                 {"fp8_fast_accum", flop / t8f.best / 1e12}};
  j["paths"] = paths;
  j["fp8_vs_bf16_rel_rms_diff"] = ref2 > 0.0 ? std::sqrt(err2 / ref2) : 0.0;
  j["fast_accum_vs_promoted_rel_rms_diff"] = promoted2 > 0.0 ? std::sqrt(fast2 / promoted2) : 0.0;
  j["iterations_per_sample"] = options.iterations;
  j["timings"] = {{"fp8_e4m3_tensor", TimingJson(t8)},
                  {"bf16", TimingJson(t16)},
                  {"fp8_e4m3_block", TimingJson(t8b)},
                  {"fp8_e4m3_tensor_fast_accum", TimingJson(t8f)}};
  return j;
}

absl::StatusOr<nlohmann::ordered_json> CudaAttentionBench(const CudaAttentionBenchOptions& o) {
  FP8RT_RETURN_IF_ERROR(CheckAttentionShape(o.batch, o.seq, o.heads, o.kv_heads, o.head_dim));
  Gpu gpu;
  FP8RT_RETURN_IF_ERROR(OpenGpu(gpu));
  const int64_t b = o.batch, t = o.seq, h = o.heads, hkv = o.kv_heads, dh = o.head_dim;
  const int64_t size = b * t * h * dh, kv_size = b * t * hkv * dh;
  std::vector<float> host(static_cast<size_t>(size));
  auto upload = [&](int64_t n, uint32_t seed) -> absl::StatusOr<DeviceBuffer> {
    host.resize(static_cast<size_t>(n));
    FillUniform(host.data(), n, 2.0f, seed);
    return UploadFloats(host);
  };
  FP8RT_ASSIGN_OR_RETURN(DeviceBuffer q, upload(size, 11));
  FP8RT_ASSIGN_OR_RETURN(DeviceBuffer k, upload(kv_size, 12));
  FP8RT_ASSIGN_OR_RETURN(DeviceBuffer v, upload(kv_size, 13));
  FP8RT_ASSIGN_OR_RETURN(DeviceBuffer dout, upload(size, 14));
  FP8RT_ASSIGN_OR_RETURN(DeviceBuffer out32, DeviceBuffer::Create(size * 4));
  FP8RT_ASSIGN_OR_RETURN(DeviceBuffer out16, DeviceBuffer::Create(size * 4));
  FP8RT_ASSIGN_OR_RETURN(DeviceBuffer lse, DeviceBuffer::Create(b * h * t * 4));
  FP8RT_ASSIGN_OR_RETURN(DeviceBuffer dq, DeviceBuffer::Create(size * 4));
  FP8RT_ASSIGN_OR_RETURN(DeviceBuffer dk, DeviceBuffer::Create(kv_size * 4));
  FP8RT_ASSIGN_OR_RETURN(DeviceBuffer dv, DeviceBuffer::Create(kv_size * 4));
  const kernels::LayerOps& L = *gpu.ops->layer;
  const kernels::Stream stream{gpu.stream};
  // One forward and backward through a pair of entries (the gradients accumulate: their values
  // are not looked at).
  auto pass = [&](decltype(L.attention_forward) fwd, decltype(L.attention_backward) bwd,
                  const DeviceBuffer& out) -> absl::Status {
    FP8RT_RETURN_IF_ERROR(fwd(out.as<float>(), lse.as<float>(), q.as<float>(), k.as<float>(),
                              v.as<float>(), b, t, h, hkv, dh, stream));
    return bwd(dq.as<float>(), dk.as<float>(), dv.as<float>(), dout.as<float>(), q.as<float>(),
               k.as<float>(), v.as<float>(), out.as<float>(), lse.as<float>(), b, t, h, hkv, dh,
               stream);
  };
  const std::vector<Case> cases = {
      {"fp32_warp_kernels", [&] { return pass(L.attention_forward, L.attention_backward, out32); }},
      {"fused_bf16_tensor_cores",
       [&] { return pass(L.attention_forward_bf16, L.attention_backward_bf16, out16); }},
  };
  FP8RT_ASSIGN_OR_RETURN(auto tm, RunInterleaved(gpu, cases, o.rounds, o.samples, o.iterations));
  std::vector<float> a(static_cast<size_t>(size)), c(static_cast<size_t>(size));
  CUDA_RETURN_IF_ERROR(cudaMemcpy(a.data(), out32.as(), size * 4, cudaMemcpyDeviceToHost));
  CUDA_RETURN_IF_ERROR(cudaMemcpy(c.data(), out16.as(), size * 4, cudaMemcpyDeviceToHost));
  double diff = 0.0, largest = 0.0;
  for (size_t i = 0; i < a.size(); ++i) {
    diff = std::max(diff, std::fabs(double{a[i]} - c[i]));
    largest = std::max(largest, std::fabs(double{a[i]}));
  }
  const Timing& slow = tm["fp32_warp_kernels"];
  const Timing& fast = tm["fused_bf16_tensor_cores"];
  // Causal: about half of the T^2 scores; forward 2 products, backward 5 (of 2 flops each).
  const double flops =
      3.5 * 2.0 * static_cast<double>(b * h) * static_cast<double>(t * t) * static_cast<double>(dh);
  nlohmann::ordered_json j;
  j["benchmark"] = "attention";
  j["device"] = "cuda";
  j["gpu"] = gpu.name;
  j["ratio"] = slow.best / fast.best;
  j["ratio_definition"] =
      "time of the FP32 warp-per-row attention (forward + backward) over the fused BF16 "
      "tensor-core attention on the same inputs, fastest of interleaved samples timed with CUDA "
      "events";
  j["target"] = 2.0;  // a first estimate: tensor cores against CUDA-core FP32, no GPU run yet
  j["ratio_median"] = slow.median / fast.median;
  j["shape"] = {{"batch", b}, {"seq", t}, {"heads", h}, {"kv_heads", hkv}, {"head_dim", dh}};
  j["fused_tflop_per_s"] = flops / fast.best / 1e12;
  j["fp32_tflop_per_s"] = flops / slow.best / 1e12;
  j["fp32"] = TimingJson(slow);
  j["fused"] = TimingJson(fast);
  j["max_abs_out_difference"] = diff;
  j["max_abs_out"] = largest;
  return j;
}

}  // namespace fp8rt::bench
