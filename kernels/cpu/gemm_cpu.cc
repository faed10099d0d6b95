// CPU GEMMs on oneDNN's BF16 matmul (AMX-BF16 / AVX512-BF16 where the CPU has them).
//
// FP8 values are exact in BF16, so an FP8 GEMM decodes its operands to BF16 (a 256-entry table)
// and runs a BF16 x BF16 -> FP32 matmul: products exact, FP32 accumulation. B is packed straight
// into oneDNN's preferred weights layout while it is decoded (no separate reorder). Tensor scales
// are applied by oneDNN as one multiplication by sa*sb of the FP32 accumulator. Block scales are
// applied per 128-wide slice of K: the slice's partial product is computed in FP32, multiplied by
// sa(m, kb) * sb(n/128, kb) and added to an FP32 accumulator (the promotion DeepGEMM does).
// On a CPU without BF16 matmul kernels in oneDNN (no AVX512-BF16 or AMX: oneDNN 2.6 has no BF16
// matmul for AVX2, e.g. on AMD EPYC before Zen 4), the same GEMMs run on oneDNN's FP32 matmul:
// the operands are widened from BF16 (or decoded from FP8) to FP32 exactly, the product of two
// BF16 values is exact in FP32 (8 + 8 significand bits), and the accumulation is FP32, so the
// contract is the same; only the summation order differs. Bf16MatmulAvailable() decides, once.
// oneDNN reports errors by exception; they are turned into Status here and never escape.
#include <omp.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <cmath>
#include <cstring>
#include <limits>
#include <map>
#include <memory>
#include <mutex>
#include <tuple>

#include "absl/strings/str_cat.h"
#include "kernels/cpu/cpu_ops.h"
#include "oneapi/dnnl/dnnl.hpp"
#include "runtime/core/status.h"

namespace fp8rt::kernels::cpu_internal {

constexpr size_t kAlign = 64;
size_t Padded(size_t bytes) { return (bytes + kAlign - 1) / kAlign * kAlign; }

// Bytes reserved for B packed into oneDNN's weights layout: K and N rounded up to 64 covers the
// blockings brgemm uses (the AMX one pads K to 32 and N to 64).
size_t PackedBBytes(int64_t n, int64_t k) {
  return Padded(static_cast<size_t>((k + 63) / 64 * 64) * static_cast<size_t>((n + 63) / 64 * 64) *
                2);
}

namespace {

bool g_force_generic_packing = false;  // tests only: see ForceGenericPackingForTesting
bool g_force_f32_matmul = false;       // tests only: see ForceF32MatmulForTesting
std::atomic<int64_t> g_amx_layout_packs{0};  // tests only: see AmxLayoutPacksForTesting

dnnl::engine& CpuEngine() {
  static dnnl::engine* engine = new dnnl::engine(dnnl::engine::kind::cpu, 0);
  return *engine;
}

// How the B operand reaches oneDNN: packed into the weights layout oneDNN prefers (the fast
// AMX path), as plain n x k rows (the 128-wide K slices of block scaling), or as plain k x n rows
// (B given transposed, on the FP32-matmul path: oneDNN's own weights order).
enum class BLayout : uint8_t { kPacked, kPlain, kPlainKxN };

// A cached matmul primitive: D(m x n) = alpha * A(m x k, row stride lda) x B^T [+ D], with alpha
// a run-time scalar (a binary-multiply post-op keeps oneDNN on its brgemm/AMX kernels, which a
// run-time output scale would not).
struct MatmulKey {
  int64_t m, n, k, lda, ldb;
  BLayout b_layout;
  bool accumulate;
  OutputType out_type;
  bool f32_inputs = false;  // FP32 A and B (plain layouts) instead of BF16
  auto operator<=>(const MatmulKey&) const = default;
};

struct Matmul {
  dnnl::matmul primitive;
  dnnl::memory::desc a_md, b_md, d_md;
  bool output_scale = false;  // alpha as a run-time output scale instead of a post-op
};

dnnl::memory::desc ScalarDesc() {
  return dnnl::memory::desc({1, 1}, dnnl::memory::data_type::f32, {1, 1});
}

absl::StatusOr<std::shared_ptr<const Matmul>> CreateMatmul(const MatmulKey& key) {
  using dt = dnnl::memory::data_type;
  const dt in_type = key.f32_inputs ? dt::f32 : dt::bf16;
  dnnl::memory::desc a_md({key.m, key.k}, in_type, {key.lda, 1});
  // B is stored n x k: as the k x n weights of oneDNN it has strides {1, ldb}; stored k x n
  // (kPlainKxN) it has strides {ldb, 1}.
  dnnl::memory::desc b_md =
      key.b_layout == BLayout::kPacked
          ? dnnl::memory::desc({key.k, key.n}, in_type, dnnl::memory::format_tag::any)
      : key.b_layout == BLayout::kPlainKxN
          ? dnnl::memory::desc({key.k, key.n}, in_type, {key.ldb, 1})
          : dnnl::memory::desc({key.k, key.n}, in_type, {1, key.ldb});
  dnnl::memory::desc d_md({key.m, key.n}, key.out_type == OutputType::kF32 ? dt::f32 : dt::bf16,
                          {key.n, 1});
  // FP32 inputs: alpha as a run-time output scale. oneDNN 2.6's FP32 kernels accept it with the
  // sum post-op, while a binary-multiply post-op followed by sum sends them to the reference
  // kernel (ref:any, ~100x slower; seen on AVX2).
  dnnl::post_ops ops;
  dnnl::primitive_attr attr;
  if (key.f32_inputs) {
    attr.set_output_scales(0, {DNNL_RUNTIME_F32_VAL});
  } else {
    ops.append_binary(dnnl::algorithm::binary_mul, ScalarDesc());
  }
  if (key.accumulate) ops.append_sum(1.0f);
  attr.set_post_ops(ops);
  dnnl::matmul::primitive_desc pd(dnnl::matmul::desc(a_md, b_md, d_md), attr, CpuEngine());
  auto mm = std::make_shared<Matmul>();
  mm->output_scale = key.f32_inputs;
  mm->primitive = dnnl::matmul(pd);
  mm->a_md = a_md;
  mm->b_md = pd.weights_desc();
  mm->d_md = d_md;
  return std::shared_ptr<const Matmul>(mm);
}

// Primitives are created once per shape and layout: creating one costs far more than a small
// matmul. Bounded; a model has few shapes.
class MatmulCache {
 public:
  absl::StatusOr<std::shared_ptr<const Matmul>> Get(const MatmulKey& key) {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = cache_.find(key);
    if (it != cache_.end()) return it->second;
    absl::StatusOr<std::shared_ptr<const Matmul>> created;
    try {
      created = CreateMatmul(key);
    } catch (const dnnl::error& e) {
      return absl::InternalError(absl::StrCat("oneDNN matmul ", key.m, "x", key.n, "x", key.k, ": ",
                                              e.what(), " (status ", e.status, ")"));
    }
    if (!created.ok()) return created.status();
    if (cache_.size() > 4096) cache_.clear();
    cache_[key] = *created;
    return *created;
  }

 private:
  std::mutex mu_;
  std::map<MatmulKey, std::shared_ptr<const Matmul>> cache_;  // Guarded by mu_
};

MatmulCache& Cache() {
  static MatmulCache* cache = new MatmulCache();
  return *cache;
}

absl::Status Execute(const Matmul& mm, const void* a, const void* b, void* d, float alpha) {
  try {
    dnnl::engine& engine = CpuEngine();
    dnnl::memory a_mem(mm.a_md, engine, const_cast<void*>(a));
    dnnl::memory b_mem(mm.b_md, engine, const_cast<void*>(b));
    dnnl::memory d_mem(mm.d_md, engine, d);
    dnnl::memory alpha_mem(
        mm.output_scale ? dnnl::memory::desc({1}, dnnl::memory::data_type::f32, {1}) : ScalarDesc(),
        engine, &alpha);
    dnnl::stream stream(engine);
    mm.primitive.execute(
        stream, {{DNNL_ARG_SRC, a_mem},
                 {DNNL_ARG_WEIGHTS, b_mem},
                 {DNNL_ARG_DST, d_mem},
                 {mm.output_scale ? DNNL_ARG_ATTR_OUTPUT_SCALES
                                  : DNNL_ARG_ATTR_MULTIPLE_POST_OP(0) | DNNL_ARG_SRC_1,
                  alpha_mem}});
    stream.wait();
  } catch (const dnnl::error& e) {
    return absl::InternalError(
        absl::StrCat("oneDNN matmul failed: ", e.what(), " (status ", e.status, ")"));
  }
  return absl::OkStatus();
}

// Whether this CPU has oneDNN BF16 matmul kernels: a tiny BF16 primitive is created once.
bool Bf16MatmulAvailable() {
  static const bool available = [] {
    try {
      using dt = dnnl::memory::data_type;
      dnnl::memory::desc a({8, 8}, dt::bf16, {8, 1}), b({8, 8}, dt::bf16, {1, 8}),
          d({8, 8}, dt::f32, {8, 1});
      dnnl::matmul::primitive_desc pd(dnnl::matmul::desc(a, b, d), CpuEngine());
      return true;
    } catch (const dnnl::error&) {
      return false;
    }
  }();
  return available && !g_force_f32_matmul;
}

void Bf16ToF32(const uint16_t* in, int64_t n, float* out) {
#pragma omp parallel for schedule(static)
  for (int64_t i = 0; i < n; ++i) out[i] = Bf16ToFloat(in[i]);
}

void Fp8ToF32(const uint8_t* codes, int64_t n, Fp8Format format, float* out) {
  const std::array<uint16_t, 256>& lut = Fp8ToBf16Table(format);
#pragma omp parallel for schedule(static)
  for (int64_t i = 0; i < n; ++i) out[i] = Bf16ToFloat(lut[codes[i]]);
}

// D (m x n, FP32 or BF16) [+]= alpha * A B^T on the FP32 matmul, A and B FP32 (B n x k plain,
// or k x n with `b_kxn`). BF16 output goes through the FP32 accumulator `acc` (m x n) and is
// rounded once, as the BF16 matmul's sum post-op does.
absl::Status F32Matmul(int64_t m, int64_t n, int64_t k, const float* a, const float* b,
                       OutputType out_type, bool accumulate, void* d, float alpha, float* acc,
                       bool b_kxn = false);

// Offset of element (k, n) of the k x n weights in a blocked oneDNN layout, from its blocking
// descriptor: outer block indices times their strides, plus the position inside the nested
// inner blocks (listed outermost first).
int64_t BlockedOffset(const dnnl_blocking_desc_t& blk, int64_t k, int64_t n) {
  int64_t x[2] = {k, n};
  int64_t block[2] = {1, 1};
  for (int i = 0; i < blk.inner_nblks; ++i) block[blk.inner_idxs[i]] *= blk.inner_blks[i];
  int64_t offset = (x[0] / block[0]) * blk.strides[0] + (x[1] / block[1]) * blk.strides[1];
  int64_t rem[2] = {x[0] % block[0], x[1] % block[1]};
  int64_t inner_stride = 1;
  for (int i = blk.inner_nblks - 1; i >= 0; --i) {
    const int d = static_cast<int>(blk.inner_idxs[i]);
    offset += (rem[d] % blk.inner_blks[i]) * inner_stride;
    rem[d] /= blk.inner_blks[i];
    inner_stride *= blk.inner_blks[i];
  }
  return offset;
}

// True for oneDNN's AMX BF16 weights layout (blocks 16@k, 64@n, 2@k: pairs of k adjacent, 64 n
// per row of a block), which has direct packing loops; false sends packing through
// BlockedOffset (and always does under ForceGenericPackingForTesting).
bool IsAmxLayout(const dnnl::memory::desc& md) {
  const dnnl_blocking_desc_t& blk = md.data.format_desc.blocking;
  return !g_force_generic_packing && blk.inner_nblks == 3 && blk.inner_blks[0] == 16 &&
         blk.inner_idxs[0] == 0 && blk.inner_blks[1] == 64 && blk.inner_idxs[1] == 1 &&
         blk.inner_blks[2] == 2 && blk.inner_idxs[2] == 0;
}

// Writes B (n x k) into `dst` in oneDNN's weights layout `md`, zero-padded, after checking that
// the layout fits the `capacity` the workspace reserves. The AMX layout goes through `amx_pack`
// (a direct, vectorised loop: PackFp8AmxLayout, PackBf16AmxLayout), called with the padded dims
// (k, n) and the outer block strides (k, n); any other blocking oneDNN picks goes through
// BlockedOffset, element (r, c) given by load(r, c) as BF16 bits.
template <class AmxPack, class Load>
absl::Status PackB(const dnnl::memory::desc& md, int64_t n, int64_t k, AmxPack amx_pack, Load load,
                   uint16_t* dst, size_t capacity) {
  if (md.get_size() > capacity) {
    return absl::InternalError(absl::StrCat("oneDNN's weights layout needs ", md.get_size(),
                                            " bytes, the workspace reserves ", capacity));
  }
  const dnnl_blocking_desc_t& blk = md.data.format_desc.blocking;
  if (IsAmxLayout(md)) {
    amx_pack(md.data.padded_dims[0], md.data.padded_dims[1], blk.strides[0], blk.strides[1]);
    g_amx_layout_packs.fetch_add(1, std::memory_order_relaxed);
    return absl::OkStatus();
  }
  std::memset(dst, 0, md.get_size());
#pragma omp parallel for schedule(static)
  for (int64_t r = 0; r < n; ++r) {
    for (int64_t c = 0; c < k; ++c) dst[BlockedOffset(blk, c, r)] = load(r, c);
  }
  return absl::OkStatus();
}

absl::Status F32Matmul(int64_t m, int64_t n, int64_t k, const float* a, const float* b,
                       OutputType out_type, bool accumulate, void* d, float alpha, float* acc,
                       bool b_kxn) {
  const MatmulKey key{m,
                      n,
                      k,
                      k,
                      b_kxn ? n : k,
                      b_kxn ? BLayout::kPlainKxN : BLayout::kPlain,
                      accumulate,
                      OutputType::kF32,
                      true};
  if (out_type == OutputType::kF32) {
    FP8RT_ASSIGN_OR_RETURN(std::shared_ptr<const Matmul> mm, Cache().Get(key));
    return Execute(*mm, a, b, d, alpha);
  }
  auto* d16 = static_cast<uint16_t*>(d);
  if (accumulate) Bf16ToF32(d16, m * n, acc);
  FP8RT_ASSIGN_OR_RETURN(std::shared_ptr<const Matmul> mm, Cache().Get(key));
  FP8RT_RETURN_IF_ERROR(Execute(*mm, a, b, acc, alpha));
  RoundToBf16(acc, m * n, d16);
  return absl::OkStatus();
}

// Block-scaled product: acc (m x n, FP32) [+]= sum_kb sa(m, kb) sb(n/128, kb) A_kb B_kb^T.
// A and B are BF16, or FP32 with `f32` (the FP32-matmul path).
absl::Status BlockScaledGemm(const Fp8GemmArgs& args, const void* a, const void* b,
                             float* partial, float* acc, bool accumulate, bool f32) {
  const int64_t m = args.m, n = args.n, k = args.k;
  const int64_t kblocks = (k + 127) / 128;
  const int64_t nblocks = (n + 127) / 128;
  const int64_t tile_rows = std::min<int64_t>(m, 256);
  for (int64_t m0 = 0; m0 < m; m0 += tile_rows) {
    const int64_t rows = std::min(tile_rows, m - m0);
    for (int64_t kb = 0; kb < kblocks; ++kb) {
      const int64_t k0 = kb * 128;
      const int64_t klen = std::min<int64_t>(128, k - k0);
      FP8RT_ASSIGN_OR_RETURN(
          std::shared_ptr<const Matmul> mm,
          Cache().Get({rows, n, klen, k, k, BLayout::kPlain, false, OutputType::kF32, f32}));
      const size_t es = f32 ? 4 : 2;
      FP8RT_RETURN_IF_ERROR(Execute(*mm, static_cast<const char*>(a) + (m0 * k + k0) * es,
                                    static_cast<const char*>(b) + k0 * es, partial, 1.0f));
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

// Carves the workspace in the order GemmWorkspaceBytes (kernels/gemm_common.cc) sizes it.
class Carver {
 public:
  explicit Carver(void* base) : next_(static_cast<uint8_t*>(base)) {}
  template <class T>
  T* Take(size_t bytes) {
    T* p = reinterpret_cast<T*>(next_);
    next_ += Padded(bytes);
    return p;
  }

 private:
  uint8_t* next_;
};

}  // namespace

void ForceGenericPackingForTesting(bool force) { g_force_generic_packing = force; }
void ForceF32MatmulForTesting(bool force) { g_force_f32_matmul = force; }
int64_t AmxLayoutPacksForTesting() { return g_amx_layout_packs.load(std::memory_order_relaxed); }
bool UsesF32Matmul() { return !Bf16MatmulAvailable(); }

namespace {

// The FP32-matmul path of GemmFp8Cpu (see the file comment); workspace as GemmWorkspaceBytes.
absl::Status GemmFp8CpuF32(const Fp8GemmArgs& args) {
  const int64_t m = args.m, n = args.n, k = args.k;
  Carver ws(args.workspace);
  auto* a32 = ws.Take<float>(static_cast<size_t>(m * k) * 4);
  auto* b32 = ws.Take<float>(static_cast<size_t>(n * k) * 4);
  Fp8ToF32(args.a, m * k, args.a_format, a32);
  Fp8ToF32(args.b, n * k, args.b_format, b32);  // K x N when b_transposed: the matmul reads it so
  if (args.scaling == GemmScaling::kTensor) {
    float* acc = args.out_type == OutputType::kBF16 ? ws.Take<float>(static_cast<size_t>(m * n) * 4)
                                                     : nullptr;
    return F32Matmul(m, n, k, a32, b32, args.out_type, args.accumulate, args.d,
                     args.a_scale_inv[0] * args.b_scale_inv[0], acc, args.b_transposed);
  }
  auto* partial = ws.Take<float>(static_cast<size_t>(std::min<int64_t>(m, 256) * n) * 4);
  if (args.out_type == OutputType::kF32) {
    return BlockScaledGemm(args, a32, b32, partial, static_cast<float*>(args.d), args.accumulate,
                           true);
  }
  auto* acc = ws.Take<float>(static_cast<size_t>(m * n) * 4);
  FP8RT_RETURN_IF_ERROR(BlockScaledGemm(args, a32, b32, partial, acc, false, true));
  RoundToBf16(acc, m * n, static_cast<uint16_t*>(args.d));
  return absl::OkStatus();
}

// The FP32-matmul path of GemmBf16Cpu: operands rounded to BF16 as the BF16 path does, then
// widened back exactly.
absl::Status GemmBf16CpuF32(const Bf16GemmArgs& args) {
  const int64_t m = args.m, n = args.n, k = args.k;
  Carver ws(args.workspace);
  auto* a32 = ws.Take<float>(static_cast<size_t>(m * k) * 4);
  auto* b32 = ws.Take<float>(static_cast<size_t>(n * k) * 4);
  for (auto [in, type, count, out] : {std::tuple{args.a, args.a_type, m * k, a32},
                                      std::tuple{args.b, args.b_type, n * k, b32}}) {
    if (type == InputType::kF32) {
      const float* f = static_cast<const float*>(in);
#pragma omp parallel for schedule(static)
      for (int64_t i = 0; i < count; ++i) out[i] = Bf16ToFloat(FloatToBf16(f[i]));
    } else {
      Bf16ToF32(static_cast<const uint16_t*>(in), count, out);
    }
  }
  float* acc =
      args.out_type == OutputType::kBF16 ? ws.Take<float>(static_cast<size_t>(m * n) * 4) : nullptr;
  return F32Matmul(m, n, k, a32, b32, args.out_type, args.accumulate, args.d, 1.0f, acc);
}

// Codes times their 1x32 block's E8M0 scale, into FP32 (exact: the scale is a power of two and
// the product of a 3- or 2-bit-mantissa value with it stays in FP32's range for scales of real
// data); rows x k codes, rows x ceil(k/32) scales.
void DecodeMx32(const uint8_t* codes, const uint8_t* e8m0, int64_t rows, int64_t k,
                Fp8Format format, float* out) {
  const int64_t kb = (k + 31) / 32;
  float lut[256];
  for (int c = 0; c < 256; ++c) lut[c] = DecodeFp8(static_cast<uint8_t>(c), format);
#pragma omp parallel for schedule(static)
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t b = 0; b < kb; ++b) {
      const uint8_t e = e8m0[r * kb + b];
      const float scale = e == 255 ? std::numeric_limits<float>::quiet_NaN()
                                   : std::ldexp(1.0f, static_cast<int>(e) - 127);
      const int64_t c1 = std::min(k, (b + 1) * 32);
      for (int64_t c = b * 32; c < c1; ++c) out[r * k + c] = lut[codes[r * k + c]] * scale;
    }
  }
}

// kMx32: both operands decoded with their block scales into FP32, then the BF16 GEMM, whose
// rounding of those values to BF16 is exact (at most 3 mantissa bits), with FP32 accumulation.
absl::Status GemmMx32Cpu(const Fp8GemmArgs& args) {
  const int64_t m = args.m, n = args.n, k = args.k;
  Carver ws(args.workspace);
  auto* a32 = ws.Take<float>(static_cast<size_t>(m * k) * 4);
  auto* b32 = ws.Take<float>(static_cast<size_t>(n * k) * 4);
  DecodeMx32(args.a, args.a_e8m0, m, k, args.a_format, a32);
  DecodeMx32(args.b, args.b_e8m0, n, k, args.b_format, b32);
  Bf16GemmArgs g;
  g.m = m;
  g.n = n;
  g.k = k;
  g.a = a32;
  g.b = b32;
  g.out_type = args.out_type;
  g.d = args.d;
  g.accumulate = args.accumulate;
  g.workspace_bytes = GemmWorkspaceBytes(g);
  g.workspace = ws.Take<uint8_t>(g.workspace_bytes);
  return GemmBf16Cpu(g, {});
}

}  // namespace

absl::Status GemmFp8Cpu(const Fp8GemmArgs& args, Stream) {
  const size_t required = GemmWorkspaceBytes(args);
  FP8RT_RETURN_IF_ERROR(ValidateGemmArgs(args, required));
  if (args.scaling == GemmScaling::kMx32) return GemmMx32Cpu(args);
  if (!Bf16MatmulAvailable()) return GemmFp8CpuF32(args);
  const int64_t m = args.m, n = args.n, k = args.k;
  Carver ws(args.workspace);
  auto* a16 = ws.Take<uint16_t>(static_cast<size_t>(m * k) * 2);
  DecodeFp8ToBf16(args.a, m * k, args.a_format, a16);

  if (args.scaling == GemmScaling::kTensor) {
    const size_t packed_bytes = PackedBBytes(n, k);
    auto* b_packed = ws.Take<uint16_t>(packed_bytes);
    FP8RT_ASSIGN_OR_RETURN(
        std::shared_ptr<const Matmul> mm,
        Cache().Get({m, n, k, k, k, BLayout::kPacked, args.accumulate, args.out_type, false}));
    const uint8_t* b = args.b;
    const std::array<uint16_t, 256>& lut = Fp8ToBf16Table(args.b_format);
    // B(r, c): b[r * k + c], or b[c * n + r] when B comes transposed (K x N).
    const int64_t row_stride = args.b_transposed ? 1 : k, col_stride = args.b_transposed ? n : 1;
    FP8RT_RETURN_IF_ERROR(PackB(
        mm->b_md, n, k,
        [&](int64_t kp, int64_t np, int64_t k_stride, int64_t n_stride) {
          PackFp8AmxLayout(b, args.b_transposed, n, k, args.b_format, kp, np, k_stride, n_stride,
                           b_packed);
        },
        [&](int64_t r, int64_t c) { return lut[b[r * row_stride + c * col_stride]]; }, b_packed,
        packed_bytes));
    return Execute(*mm, a16, b_packed, args.d, args.a_scale_inv[0] * args.b_scale_inv[0]);
  }
  auto* b16 = ws.Take<uint16_t>(static_cast<size_t>(n * k) * 2);
  DecodeFp8ToBf16(args.b, n * k, args.b_format, b16);
  auto* partial = ws.Take<float>(static_cast<size_t>(std::min<int64_t>(m, 256) * n) * 4);
  if (args.out_type == OutputType::kF32) {
    return BlockScaledGemm(args, a16, b16, partial, static_cast<float*>(args.d), args.accumulate,
                           false);
  }
  auto* acc = ws.Take<float>(static_cast<size_t>(m * n) * 4);
  FP8RT_RETURN_IF_ERROR(BlockScaledGemm(args, a16, b16, partial, acc, false, false));
  RoundToBf16(acc, m * n, static_cast<uint16_t*>(args.d));
  return absl::OkStatus();
}

absl::Status GemmBf16Cpu(const Bf16GemmArgs& args, Stream) {
  const size_t required = GemmWorkspaceBytes(args);
  FP8RT_RETURN_IF_ERROR(ValidateGemmArgs(args, required));
  if (!Bf16MatmulAvailable()) return GemmBf16CpuF32(args);
  const int64_t m = args.m, n = args.n, k = args.k;
  Carver ws(args.workspace);
  const uint16_t* a16 = static_cast<const uint16_t*>(args.a);
  if (args.a_type == InputType::kF32) {
    auto* dst = ws.Take<uint16_t>(static_cast<size_t>(m * k) * 2);
    RoundToBf16(static_cast<const float*>(args.a), m * k, dst);
    a16 = dst;
  }
  const size_t packed_bytes = PackedBBytes(n, k);
  auto* b_packed = ws.Take<uint16_t>(packed_bytes);
  FP8RT_ASSIGN_OR_RETURN(
      std::shared_ptr<const Matmul> mm,
      Cache().Get({m, n, k, k, k, BLayout::kPacked, args.accumulate, args.out_type, false}));
  const bool b_f32 = args.b_type == InputType::kF32;
  auto amx_pack = [&](int64_t kp, int64_t np, int64_t k_stride, int64_t n_stride) {
    PackBf16AmxLayout(args.b, b_f32, n, k, kp, np, k_stride, n_stride, b_packed);
  };
  if (b_f32) {
    const float* b = static_cast<const float*>(args.b);
    FP8RT_RETURN_IF_ERROR(PackB(
        mm->b_md, n, k, amx_pack, [&](int64_t r, int64_t c) { return FloatToBf16(b[r * k + c]); },
        b_packed, packed_bytes));
  } else {
    const uint16_t* b = static_cast<const uint16_t*>(args.b);
    FP8RT_RETURN_IF_ERROR(PackB(
        mm->b_md, n, k, amx_pack, [&](int64_t r, int64_t c) { return b[r * k + c]; }, b_packed,
        packed_bytes));
  }
  return Execute(*mm, a16, b_packed, args.d, 1.0f);
}

// FP32 operands straight from the caller's buffers (B in its plain n x k layout: oneDNN's f32
// kernels read it without packing).
absl::Status GemmF32Cpu(const F32GemmArgs& args, Stream) {
  FP8RT_RETURN_IF_ERROR(ValidateGemmArgs(args));
  FP8RT_ASSIGN_OR_RETURN(std::shared_ptr<const Matmul> mm,
                         Cache().Get({args.m, args.n, args.k, args.k, args.k, BLayout::kPlain,
                                      args.accumulate, OutputType::kF32, true}));
  return Execute(*mm, args.a, args.b, args.d, 1.0f);
}

}  // namespace fp8rt::kernels::cpu_internal

namespace fp8rt::kernels {

// The CPU backend's workspace, each part 64-byte aligned (carved in this order below):
//   tensor scaling: [A as BF16][B packed for oneDNN (K and N padded to 64)]
//   block scaling:  [A as BF16][B as BF16][partial product of one 256-row tile][FP32 accumulator
//                   for BF16 output]
//   bf16 GEMM:      [A as BF16 when given FP32][B packed]
//   without BF16 matmul kernels (cpu_internal::UsesF32Matmul): [A as FP32][B as FP32], then for
//   block scaling the partial product, and the FP32 accumulator for BF16 output
size_t GemmWorkspaceBytes(const Fp8GemmArgs& args) {
  const size_t m = static_cast<size_t>(args.m), n = static_cast<size_t>(args.n),
               k = static_cast<size_t>(args.k);
  if (args.scaling == GemmScaling::kMx32) {  // [A as FP32][B as FP32][the BF16 GEMM's]
    Bf16GemmArgs g;
    g.m = args.m;
    g.n = args.n;
    g.k = args.k;
    g.out_type = args.out_type;
    return cpu_internal::Padded(m * k * 4) + cpu_internal::Padded(n * k * 4) +
           cpu_internal::Padded(GemmWorkspaceBytes(g));
  }
  if (cpu_internal::UsesF32Matmul()) {
    size_t f32 = cpu_internal::Padded(m * k * 4) + cpu_internal::Padded(n * k * 4);
    if (args.scaling != GemmScaling::kTensor) f32 += cpu_internal::Padded((m < 256 ? m : 256) * n * 4);
    if (args.out_type == OutputType::kBF16) f32 += cpu_internal::Padded(m * n * 4);
    return f32;
  }
  size_t bytes = cpu_internal::Padded(m * k * 2);
  if (args.scaling == GemmScaling::kTensor) {
    return bytes + cpu_internal::PackedBBytes(args.n, args.k);
  }
  bytes += cpu_internal::Padded(n * k * 2);
  const size_t tile_rows = m < 256 ? m : 256;
  bytes += cpu_internal::Padded(tile_rows * n * 4);
  if (args.out_type == OutputType::kBF16) bytes += cpu_internal::Padded(m * n * 4);
  return bytes;
}

size_t GemmWorkspaceBytes(const Bf16GemmArgs& args) {
  if (cpu_internal::UsesF32Matmul()) {
    const size_t m = static_cast<size_t>(args.m), n = static_cast<size_t>(args.n),
                 k = static_cast<size_t>(args.k);
    return cpu_internal::Padded(m * k * 4) + cpu_internal::Padded(n * k * 4) +
           (args.out_type == OutputType::kBF16 ? cpu_internal::Padded(m * n * 4) : 0);
  }
  const size_t a_bytes = static_cast<size_t>(args.m) * static_cast<size_t>(args.k) * 2;
  return (args.a_type == InputType::kF32 ? cpu_internal::Padded(a_bytes) : 0) +
         cpu_internal::PackedBBytes(args.n, args.k);
}

}  // namespace fp8rt::kernels
