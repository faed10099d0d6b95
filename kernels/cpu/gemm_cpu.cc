// CPU GEMMs on oneDNN's BF16 matmul (AMX-BF16 / AVX512-BF16 where the CPU has them).
//
// FP8 values are exact in BF16, so an FP8 GEMM decodes its operands to BF16 (a 256-entry table)
// and runs a BF16 x BF16 -> FP32 matmul: products exact, FP32 accumulation. Tensor scales are
// applied by oneDNN as one output scale sa*sb on the FP32 accumulator. Block scales are applied
// per 128-wide slice of K: the slice's partial product is computed in FP32, multiplied by
// sa(m, kb) * sb(n/128, kb) and added to an FP32 accumulator (the promotion DeepGEMM does).
// oneDNN reports errors by exception; they are turned into Status here and never escape.
#include <omp.h>

#include <algorithm>
#include <array>
#include <cstring>
#include <map>
#include <memory>
#include <mutex>

#include "absl/strings/str_cat.h"
#include "kernels/cpu/cpu_ops.h"
#include "oneapi/dnnl/dnnl.hpp"

namespace fp8rt::kernels::cpu_internal {
namespace {

constexpr size_t kAlign = 64;
size_t Padded(size_t bytes) { return (bytes + kAlign - 1) / kAlign * kAlign; }

dnnl::engine& CpuEngine() {
  static dnnl::engine* engine = new dnnl::engine(dnnl::engine::kind::cpu, 0);
  return *engine;
}

// One matmul call: D(m x n, ldd) = alpha * A(m x k, lda) x B(n x k, ldb)^T [+ D].
struct MatmulCall {
  const uint16_t* a;
  int64_t lda;
  const uint16_t* b;
  int64_t ldb;
  int64_t m, n, k;
  float alpha;
  bool accumulate;
  void* d;
  OutputType out_type;
};

// Primitives are created once per shape and layout and reused: creating a primitive descriptor
// costs far more than a small matmul. The output scale is a run-time argument, so a new scale
// every step does not make a new primitive.
struct MatmulKey {
  int64_t m, n, k, lda, ldb;
  bool accumulate;
  OutputType out_type;
  auto operator<=>(const MatmulKey&) const = default;
};

class MatmulCache {
 public:
  absl::StatusOr<std::shared_ptr<dnnl::matmul>> Get(const MatmulKey& key) {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = cache_.find(key);
    if (it != cache_.end()) return it->second;
    dnnl::primitive_attr attr;
    attr.set_output_scales(0, {DNNL_RUNTIME_F32_VAL});
    if (key.accumulate) {
      dnnl::post_ops ops;
      ops.append_sum(1.0f);
      attr.set_post_ops(ops);
    }
    dnnl::matmul::primitive_desc pd(dnnl::matmul::desc(ADesc(key), BDesc(key), DDesc(key)), attr,
                                    CpuEngine());
    auto prim = std::make_shared<dnnl::matmul>(pd);
    if (cache_.size() > 4096) cache_.clear();  // bounded: shapes of one model are few
    cache_[key] = prim;
    return prim;
  }

  static dnnl::memory::desc ADesc(const MatmulKey& k) {
    return dnnl::memory::desc({k.m, k.k}, dnnl::memory::data_type::bf16, {k.lda, 1});
  }
  // B is stored n x k row-major, which is B^T (k x n) with strides {1, ldb}.
  static dnnl::memory::desc BDesc(const MatmulKey& k) {
    return dnnl::memory::desc({k.k, k.n}, dnnl::memory::data_type::bf16, {1, k.ldb});
  }
  static dnnl::memory::desc DDesc(const MatmulKey& k) {
    return dnnl::memory::desc({k.m, k.n},
                              k.out_type == OutputType::kF32 ? dnnl::memory::data_type::f32
                                                             : dnnl::memory::data_type::bf16,
                              {k.n, 1});
  }

 private:
  std::mutex mu_;
  std::map<MatmulKey, std::shared_ptr<dnnl::matmul>> cache_;  // Guarded by mu_
};

MatmulCache& Cache() {
  static MatmulCache* cache = new MatmulCache();
  return *cache;
}

absl::Status RunMatmul(const MatmulCall& c) {
  const MatmulKey key{c.m, c.n, c.k, c.lda, c.ldb, c.accumulate, c.out_type};
  try {
    absl::StatusOr<std::shared_ptr<dnnl::matmul>> prim = Cache().Get(key);
    if (!prim.ok()) return prim.status();
    dnnl::engine& engine = CpuEngine();
    dnnl::memory a_mem(MatmulCache::ADesc(key), engine, const_cast<uint16_t*>(c.a));
    dnnl::memory b_mem(MatmulCache::BDesc(key), engine, const_cast<uint16_t*>(c.b));
    dnnl::memory d_mem(MatmulCache::DDesc(key), engine, c.d);
    float alpha = c.alpha;
    dnnl::memory scale_mem({{1}, dnnl::memory::data_type::f32, {1}}, engine, &alpha);
    dnnl::stream stream(engine);
    (*prim)->execute(stream, {{DNNL_ARG_SRC, a_mem},
                              {DNNL_ARG_WEIGHTS, b_mem},
                              {DNNL_ARG_DST, d_mem},
                              {DNNL_ARG_ATTR_OUTPUT_SCALES, scale_mem}});
    stream.wait();
  } catch (const dnnl::error& e) {
    return absl::InternalError(absl::StrCat("oneDNN matmul ", c.m, "x", c.n, "x", c.k,
                                            " failed: ", e.what(), " (status ", e.status, ")"));
  }
  return absl::OkStatus();
}

// Decodes n FP8 codes to BF16 bits (exact).
void DecodeToBf16(const uint8_t* codes, int64_t n, Fp8Format format, uint16_t* out) {
  std::array<uint16_t, 256> lut;
  for (int c = 0; c < 256; ++c) lut[c] = FloatToBf16(DecodeFp8(static_cast<uint8_t>(c), format));
#pragma omp parallel for schedule(static)
  for (int64_t i = 0; i < n; ++i) out[i] = lut[codes[i]];
}

// Rounds n floats to BF16, nearest even.
void RoundToBf16(const float* in, int64_t n, uint16_t* out) {
#pragma omp parallel for schedule(static)
  for (int64_t i = 0; i < n; ++i) out[i] = FloatToBf16(in[i]);
}

// Block-scaled product: acc (m x n, FP32) [+]= sum_kb sa(m, kb) sb(n/128, kb) A_kb B_kb^T.
absl::Status BlockScaledGemm(const Fp8GemmArgs& args, const uint16_t* a, const uint16_t* b,
                             float* partial, float* acc, bool accumulate) {
  const int64_t m = args.m, n = args.n, k = args.k;
  const int64_t kblocks = (k + 127) / 128;
  const int64_t nblocks = (n + 127) / 128;
  const int64_t tile_rows = std::min<int64_t>(m, 256);
  for (int64_t m0 = 0; m0 < m; m0 += tile_rows) {
    const int64_t rows = std::min(tile_rows, m - m0);
    for (int64_t kb = 0; kb < kblocks; ++kb) {
      const int64_t k0 = kb * 128;
      const int64_t klen = std::min<int64_t>(128, k - k0);
      MatmulCall call{a + m0 * k + k0, k, b + k0, k, rows, n, klen, 1.0f, false, partial,
                      OutputType::kF32};
      if (absl::Status s = RunMatmul(call); !s.ok()) return s;
      const bool first = kb == 0 && !accumulate;
#pragma omp parallel for schedule(static)
      for (int64_t r = 0; r < rows; ++r) {
        const float sa = args.a_scale_inv[(m0 + r) * kblocks + kb];
        float* out = acc + (m0 + r) * n;
        const float* p = partial + r * n;
        for (int64_t nb = 0; nb < nblocks; ++nb) {
          const float s = sa * args.b_scale_inv[nb * kblocks + kb];
          const int64_t c1 = std::min(n, (nb + 1) * 128);
          if (first) {
            for (int64_t c = nb * 128; c < c1; ++c) out[c] = s * p[c];
          } else {
            for (int64_t c = nb * 128; c < c1; ++c) out[c] += s * p[c];
          }
        }
      }
    }
  }
  return absl::OkStatus();
}

}  // namespace

absl::Status GemmFp8Cpu(const Fp8GemmArgs& args, Stream) {
  const size_t required = GemmWorkspaceBytes(args);
  if (absl::Status s = ValidateGemmArgs(args, required); !s.ok()) return s;
  const int64_t m = args.m, n = args.n, k = args.k;
  auto* ws = static_cast<uint8_t*>(args.workspace);
  auto* a16 = reinterpret_cast<uint16_t*>(ws);
  ws += Padded(static_cast<size_t>(m * k) * 2);
  auto* b16 = reinterpret_cast<uint16_t*>(ws);
  ws += Padded(static_cast<size_t>(n * k) * 2);
  DecodeToBf16(args.a, m * k, args.a_format, a16);
  DecodeToBf16(args.b, n * k, args.b_format, b16);

  if (args.scaling == GemmScaling::kTensor) {
    const float alpha = args.a_scale_inv[0] * args.b_scale_inv[0];
    return RunMatmul({a16, k, b16, k, m, n, k, alpha, args.accumulate, args.d, args.out_type});
  }
  auto* partial = reinterpret_cast<float*>(ws);
  ws += Padded(static_cast<size_t>(std::min<int64_t>(m, 256) * n) * 4);
  if (args.out_type == OutputType::kF32) {
    return BlockScaledGemm(args, a16, b16, partial, static_cast<float*>(args.d), args.accumulate);
  }
  auto* acc = reinterpret_cast<float*>(ws);
  if (absl::Status s = BlockScaledGemm(args, a16, b16, partial, acc, false); !s.ok()) return s;
  auto* d16 = static_cast<uint16_t*>(args.d);
  RoundToBf16(acc, m * n, d16);
  return absl::OkStatus();
}

absl::Status GemmBf16Cpu(const Bf16GemmArgs& args, Stream) {
  const size_t required = GemmWorkspaceBytes(args);
  if (absl::Status s = ValidateGemmArgs(args, required); !s.ok()) return s;
  const int64_t m = args.m, n = args.n, k = args.k;
  auto* ws = static_cast<uint8_t*>(args.workspace);
  const uint16_t* a16 = static_cast<const uint16_t*>(args.a);
  const uint16_t* b16 = static_cast<const uint16_t*>(args.b);
  if (args.a_type == InputType::kF32) {
    auto* dst = reinterpret_cast<uint16_t*>(ws);
    RoundToBf16(static_cast<const float*>(args.a), m * k, dst);
    a16 = dst;
    ws += Padded(static_cast<size_t>(m * k) * 2);
  }
  if (args.b_type == InputType::kF32) {
    auto* dst = reinterpret_cast<uint16_t*>(ws);
    RoundToBf16(static_cast<const float*>(args.b), n * k, dst);
    b16 = dst;
  }
  return RunMatmul({a16, k, b16, k, m, n, k, 1.0f, args.accumulate, args.d, args.out_type});
}

}  // namespace fp8rt::kernels::cpu_internal
