// Hugging Face tensors <-> fp8rt's logical parameters (see hf_weights.h). One table of entries
// per architecture (Entries) drives both directions: each entry says which Hugging Face tensor
// holds which parameter and how an element of one is an element of the other (Visit).
#include "runtime/model/hf_weights.h"

#include <charconv>
#include <cmath>
#include <cstdlib>
#include <functional>
#include <set>
#include <string_view>
#include <system_error>
#include <tuple>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "nlohmann/json.hpp"
#include "runtime/core/quote.h"
#include "runtime/core/status.h"
#include "runtime/core/strict_json.h"

namespace fp8rt::model {
namespace {

enum class Kind : uint8_t {
  kCopy,       // the same values in the same order
  kTranspose,  // Hugging Face [in, out] (GPT-2's Conv1D), fp8rt [out, in]
  kQkvRows,    // hf[o, c] = qkv[QkvRow(offset + o), c]   (Llama's q/k/v_proj; GPT-2's c_attn bias)
  kQkvConv1D,  // hf[c, o] = qkv[QkvRow(o), c]            (GPT-2's c_attn weight)
};

struct Entry {
  std::string hf;
  std::vector<int64_t> hf_shape;
  std::string ours;
  Kind kind = Kind::kCopy;
  int64_t offset = 0;
  bool expert = false;  // an MoE expert's weight: a rank holds those of its ep rank only
};

bool IsGpt2(const ModelShape& s) { return s.norm == NormKind::kLayer; }

// The shortest decimal that reads back as `x` (1e-05, not the double nearest the float).
double Shortest(float x) {
  char buf[32];
  const auto r = std::to_chars(buf, buf + sizeof(buf), x);
  return std::strtod(std::string(buf, r.ptr).c_str(), nullptr);
}

// The fp8rt attn.qkv row of row o of q, k and v concatenated (all H query heads, then the KV key
// heads, then the KV value heads, Dh rows each): fp8rt groups rows by kv head g as [its Q query
// heads | k_g | v_g].
int64_t QkvRow(const ModelShape& s, int64_t o) {
  const int64_t h = s.heads, kv = s.kv(), dh = s.head_dim(), q = h / kv, group = (q + 2) * dh;
  const int64_t d = o % dh;
  if (o < h * dh) {
    const int64_t head = o / dh;
    return head / q * group + head % q * dh + d;
  }
  if (o < (h + kv) * dh) return (o - h * dh) / dh * group + q * dh + d;
  return (o - (h + kv) * dh) / dh * group + (q + 1) * dh + d;
}

std::vector<Entry> Entries(const ModelShape& s) {
  const int64_t c = s.d_model, f = s.d_ff, v = s.vocab, h = s.heads, kv = s.kv();
  const int64_t dh = s.head_dim(), qkv = (h + 2 * kv) * dh;
  std::vector<Entry> e;
  auto add = [&](std::string hf, std::vector<int64_t> shape, std::string ours,
                 Kind kind = Kind::kCopy, int64_t offset = 0) {
    e.push_back({std::move(hf), std::move(shape), std::move(ours), kind, offset});
  };
  if (IsGpt2(s)) {
    add("transformer.wte.weight", {v, c}, "embedding/weight");
    add("transformer.wpe.weight", {s.max_positions, c}, "positions/weight");
    for (int64_t l = 0; l < s.layers; ++l) {
      const std::string hf = absl::StrCat("transformer.h.", l, "."),
                        o = absl::StrCat("blocks.", l, ".");
      add(hf + "ln_1.weight", {c}, o + "attn_norm/weight");
      add(hf + "ln_1.bias", {c}, o + "attn_norm/bias");
      add(hf + "attn.c_attn.weight", {c, qkv}, o + "attn.qkv/weight", Kind::kQkvConv1D);
      add(hf + "attn.c_attn.bias", {qkv}, o + "attn.qkv/bias", Kind::kQkvRows);
      add(hf + "attn.c_proj.weight", {c, c}, o + "attn.proj/weight", Kind::kTranspose);
      add(hf + "attn.c_proj.bias", {c}, o + "attn.proj/bias");
      add(hf + "ln_2.weight", {c}, o + "mlp_norm/weight");
      add(hf + "ln_2.bias", {c}, o + "mlp_norm/bias");
      add(hf + "mlp.c_fc.weight", {c, f}, o + "mlp.fc1/weight", Kind::kTranspose);
      add(hf + "mlp.c_fc.bias", {f}, o + "mlp.fc1/bias");
      add(hf + "mlp.c_proj.weight", {f, c}, o + "mlp.fc2/weight", Kind::kTranspose);
      add(hf + "mlp.c_proj.bias", {c}, o + "mlp.fc2/bias");
    }
    add("transformer.ln_f.weight", {c}, "final_norm/weight");
    add("transformer.ln_f.bias", {c}, "final_norm/bias");
    return e;  // the LM head is wte (tie_word_embeddings)
  }
  add("model.embed_tokens.weight", {v, c}, "embedding/weight");
  for (int64_t l = 0; l < s.layers; ++l) {
    const std::string hf = absl::StrCat("model.layers.", l, "."),
                      o = absl::StrCat("blocks.", l, ".");
    add(hf + "input_layernorm.weight", {c}, o + "attn_norm/weight");
    add(hf + "self_attn.q_proj.weight", {h * dh, c}, o + "attn.qkv/weight", Kind::kQkvRows, 0);
    add(hf + "self_attn.k_proj.weight", {kv * dh, c}, o + "attn.qkv/weight", Kind::kQkvRows,
        h * dh);
    add(hf + "self_attn.v_proj.weight", {kv * dh, c}, o + "attn.qkv/weight", Kind::kQkvRows,
        (h + kv) * dh);
    add(hf + "self_attn.o_proj.weight", {c, c}, o + "attn.proj/weight");
    add(hf + "post_attention_layernorm.weight", {c}, o + "mlp_norm/weight");
    if (s.HasMoe(l)) {
      // Mixtral's MixtralSparseMoeBlock: the router `gate` [E, C] (a Linear without bias), and
      // per expert w1 (gate_proj), w3 (up_proj) [F, C] and w2 (down_proj) [C, F].
      add(hf + "block_sparse_moe.gate.weight", {s.moe.experts, c}, o + "mlp.router/weight");
      for (int64_t x = 0; x < s.moe.experts; ++x) {
        const std::string he = absl::StrCat(hf, "block_sparse_moe.experts.", x, ".");
        const std::string oe = absl::StrCat(o, "mlp.experts.", x, ".");
        for (const auto& [w, ours, shape] :
             {std::tuple<const char*, const char*, std::vector<int64_t>>{"w1", "gate", {f, c}},
              {"w3", "up", {f, c}},
              {"w2", "down", {c, f}}}) {
          e.push_back({.hf = absl::StrCat(he, w, ".weight"),
                       .hf_shape = shape,
                       .ours = absl::StrCat(oe, ours, "/weight"),
                       .expert = true});
        }
      }
      continue;
    }
    add(hf + "mlp.gate_proj.weight", {f, c}, o + "mlp.gate/weight");
    add(hf + "mlp.up_proj.weight", {f, c}, o + "mlp.up/weight");
    add(hf + "mlp.down_proj.weight", {c, f}, o + "mlp.down/weight");
  }
  add("model.norm.weight", {c}, "final_norm/weight");
  if (!s.tie_embeddings) add("lm_head.weight", {v, c}, "lm_head/weight");
  return e;
}

int64_t Elements(const std::vector<int64_t>& shape) {
  int64_t n = 1;
  for (const int64_t d : shape) n *= d;
  return n;
}

// Calls fn(hf_index, our_index) for every element of the entry's Hugging Face tensor; `ours` is
// the parameter's logical shape.
void Visit(const ModelShape& s, const Entry& e, const LogicalShape& ours,
           const std::function<void(size_t, size_t)>& fn) {
  const int64_t n = Elements(e.hf_shape);
  const int64_t cols = e.hf_shape.size() == 2 ? e.hf_shape[1] : 1;
  for (int64_t i = 0; i < n; ++i) {
    const int64_t r = i / cols, k = i % cols;
    int64_t j = i;
    switch (e.kind) {
      case Kind::kCopy:
        break;
      case Kind::kTranspose:  // hf [r, k] = ours [k, r]; ours has hf rows as its columns
        j = k * ours.cols + r;
        break;
      case Kind::kQkvRows:
        j = QkvRow(s, e.offset + r) * ours.cols + k;
        break;
      case Kind::kQkvConv1D:  // hf [c, o] = ours [QkvRow(o), c]
        j = QkvRow(s, k) * ours.cols + r;
        break;
    }
    fn(static_cast<size_t>(i), static_cast<size_t>(j));
  }
}

// Whether `name` is Llama's model.layers.N.self_attn.rotary_emb.inv_freq for a layer N of `s`.
bool IsInvFreq(const ModelShape& s, const std::string& name) {
  constexpr std::string_view kPrefix = "model.layers.", kSuffix = ".self_attn.rotary_emb.inv_freq";
  if (!name.starts_with(kPrefix) || !name.ends_with(kSuffix) ||
      name.size() <= kPrefix.size() + kSuffix.size()) {
    return false;
  }
  const std::string_view digits =
      std::string_view(name).substr(kPrefix.size(), name.size() - kPrefix.size() - kSuffix.size());
  int64_t layer = -1;
  const auto [end, ec] = std::from_chars(digits.data(), digits.data() + digits.size(), layer);
  return ec == std::errc() && end == digits.data() + digits.size() && layer >= 0 &&
         layer < s.layers && (digits.size() == 1 || digits[0] != '0');
}

// Llama's rotary_emb.inv_freq buffer (transformers before 4.31 saved one per layer): torch's
// 1 / theta^(2i / head_dim) in FP32, i < head_dim / 2, rounded to the tensor's dtype when the
// model was cast (model.half(), torch_dtype). It must be the frequencies of the spec's
// model.rope_theta, or the file's attention would differ from the model's: within 1e-5 relative
// in F32 (pow may differ in its last bits between libraries), one unit in the last place of F16
// (2^-10 relative, 2^-24 absolute below its normal range) or BF16 (2^-7 relative).
absl::Status CheckInvFreq(const ModelShape& s, const SafetensorsFile& file,
                          const SafetensorsTensor& t) {
  const int64_t half = s.head_dim() / 2;
  const std::vector<int64_t> want_shape = {half};
  FP8RT_ASSIGN_OR_RETURN(const std::vector<float> got, file.ReadFloat32(t.name, want_shape));
  const float rel = t.dtype == SafetensorsDtype::kBF16  ? 0x1p-7f
                    : t.dtype == SafetensorsDtype::kF16 ? 0x1p-10f
                                                        : 1e-5f;
  const float abs = t.dtype == SafetensorsDtype::kF16 ? 0x1p-24f : 0.0f;
  for (int64_t i = 0; i < half; ++i) {
    const float e = static_cast<float>(2 * i) / static_cast<float>(s.head_dim());
    const float want = 1.0f / std::pow(s.rope_theta, e);
    const float g = got[static_cast<size_t>(i)];
    if (!(std::fabs(g - want) <= rel * want + abs)) {
      return absl::InvalidArgumentError(
          absl::StrCat(file.name(), ": tensor '", t.name.substr(0, 64), "' holds ", g, " at ", i,
                       ", but model.rope_theta ", s.rope_theta, " (head_dim ", s.head_dim(),
                       ") gives ", want, ": the file was trained with another rope_theta"));
    }
  }
  return absl::OkStatus();
}

}  // namespace

absl::Status CheckHfArchitecture(const ModelShape& s) {
  auto bad = [](const char* field, const std::string& why) {
    return absl::InvalidArgumentError(absl::StrCat(
        field, ": ", why,
        " (Hugging Face's GPT2LMHeadModel and LlamaForCausalLM are the gpt2 and llama families as "
        "they are; MixtralForCausalLM is llama with an MoE MLP in every block)"));
  };
  if (s.moe.experts > 0 && (s.norm == NormKind::kLayer || s.mlp != MlpKind::kSwiglu)) {
    return bad("moe.experts",
               "an MoE model has a Hugging Face class only as Mixtral (the llama family)");
  }
  if (s.norm == NormKind::kLayer) {
    if (s.mlp != MlpKind::kGelu) return bad("model.mlp", "GPT-2 has a GELU MLP");
    if (s.positions != PositionKind::kLearned)
      return bad("model.positions", "GPT-2 has learned positions");
    if (!s.bias) return bad("model.bias", "GPT-2 has biases");
    if (!s.tie_embeddings) return bad("model.tie_embeddings", "GPT-2's LM head is tied");
    if (s.kv() != s.heads) return bad("model.kv_heads", "GPT-2 has no grouped-query attention");
    return absl::OkStatus();
  }
  if (s.mlp != MlpKind::kSwiglu) {
    return bad("model.family", "only the gpt2 and llama families can be exported or imported");
  }
  if (s.positions != PositionKind::kRope) return bad("model.positions", "Llama has RoPE");
  if (s.bias) return bad("model.bias", "Llama has no biases");
  if (s.moe.experts > 0 && s.moe_every != 1) {
    return bad("moe.every", absl::StrCat("Mixtral has an MoE MLP in every block (moe.every: 1), "
                                         "this model in one block of every ",
                                         s.moe_every));
  }
  return absl::OkStatus();
}

absl::StatusOr<std::string> HfConfigJson(const ModelShape& s, const std::string& dtype) {
  FP8RT_RETURN_IF_ERROR(CheckHfArchitecture(s));
  nlohmann::ordered_json j;
  if (IsGpt2(s)) {
    j["architectures"] = {"GPT2LMHeadModel"};
    j["model_type"] = "gpt2";
    j["vocab_size"] = s.vocab;
    j["n_positions"] = s.max_positions;
    j["n_ctx"] = s.max_positions;
    j["n_embd"] = s.d_model;
    j["n_layer"] = s.layers;
    j["n_head"] = s.heads;
    j["n_inner"] = s.d_ff;
    j["activation_function"] = "gelu_new";  // the tanh approximation
    j["layer_norm_epsilon"] = Shortest(s.norm_eps);
    j["resid_pdrop"] = 0.0;
    j["embd_pdrop"] = 0.0;
    j["attn_pdrop"] = 0.0;
    j["scale_attn_weights"] = true;
  } else {
    const bool mixtral = s.moe.experts > 0;
    j["architectures"] = {mixtral ? "MixtralForCausalLM" : "LlamaForCausalLM"};
    j["model_type"] = mixtral ? "mixtral" : "llama";
    j["vocab_size"] = s.vocab;
    j["hidden_size"] = s.d_model;
    j["intermediate_size"] = s.d_ff;
    j["num_hidden_layers"] = s.layers;
    j["num_attention_heads"] = s.heads;
    j["num_key_value_heads"] = s.kv();
    j["head_dim"] = s.head_dim();
    j["hidden_act"] = "silu";
    j["max_position_embeddings"] = s.max_positions;
    j["rms_norm_eps"] = Shortest(s.norm_eps);
    j["rope_theta"] = Shortest(s.rope_theta);
    if (mixtral) {
      // Mixtral routes every token to its top num_experts_per_tok experts of the softmax over
      // all of them, renormalised, and never drops one (fp8rt drops over capacity unless
      // moe.drop_tokens is false); it has no sliding window here.
      j["num_local_experts"] = s.moe.experts;
      j["num_experts_per_tok"] = s.moe.top_k;
      j["router_aux_loss_coef"] = s.moe.aux_loss_coef;
      j["output_router_logits"] = false;
      j["router_jitter_noise"] = 0.0;
      j["sliding_window"] = nullptr;
    } else {
      j["attention_bias"] = false;
      j["mlp_bias"] = false;
    }
  }
  j["tie_word_embeddings"] = s.tie_embeddings;
  // fp8rt's tokens are the data's ids and none is special. Left out, these keys take the class's
  // defaults (GPT-2: 50256, Llama and Mixtral: 1 and 2), and transformers' generate would stop at
  // byte 0x02 of a byte-level model; null makes it generate to its length limit.
  j["bos_token_id"] = nullptr;
  j["eos_token_id"] = nullptr;
  j["pad_token_id"] = nullptr;
  j["torch_dtype"] = dtype;
  return j.dump(2) + "\n";
}

namespace {

// What CheckHfConfig compares: a config.json key, the value it must have (what the spec's shape
// says), the spec field that says it, and transformers' default for the key in this class.
struct ConfigKey {
  std::string key;
  nlohmann::json want;
  std::string field;
  nlohmann::json fallback;  // null: the key may be absent (then it equals `want`)
};

// A config value in an error: strings quoted, other values as JSON, at most 32 bytes of either.
std::string Shown(const nlohmann::json& v) {
  if (v.is_string()) return QuoteBounded(v.get<std::string>(), 32);
  const std::string d = v.dump();
  return d.size() <= 32 ? d : QuoteBounded(d, 32);
}

// Whether `got` (a config value) is `want`: numbers as the spec holds them (floats compared in
// FP32, the spec's precision), everything else exactly.
bool SameValue(const nlohmann::json& got, const nlohmann::json& want) {
  if (want.is_number_float()) {
    return got.is_number() &&
           static_cast<float>(got.get<double>()) == static_cast<float>(want.get<double>());
  }
  if (want.is_number_integer()) return got.is_number_integer() && got.get<int64_t>() == want;
  return got == want;
}

}  // namespace

absl::Status CheckHfConfig(const ModelShape& s, std::string_view text, const std::string& path) {
  FP8RT_RETURN_IF_ERROR(CheckHfArchitecture(s));
  using J = nlohmann::json;
  FP8RT_ASSIGN_OR_RETURN(J j, ParseStrictObject(text, path, "config.json"));
  auto refuse = [&](const std::string& message) {
    return absl::InvalidArgumentError(absl::StrCat(path, ": ", message));
  };
  const bool gpt2 = IsGpt2(s), mixtral = s.moe.experts > 0;
  const std::string type = gpt2 ? "gpt2" : mixtral ? "mixtral" : "llama";
  if (!j.contains("model_type")) {
    return refuse(absl::StrCat("model_type is missing (the spec's model is ", type, ")"));
  }
  const J got_type = j["model_type"];
  // Mistral (MistralForCausalLM) is Llama's architecture and tensor names with a sliding window:
  // a llama model reads it where the window masks nothing.
  const bool mistral = type == "llama" && got_type == "mistral";
  if (got_type != type && !mistral) {
    return refuse(absl::StrCat("model_type is ", Shown(got_type), ", but the spec's model is ",
                               type, " (model.family", mixtral ? ", moe.experts" : "",
                               type == "llama" ? "; llama also reads mistral" : "", ")"));
  }
  // The config classes' attribute_map: a key under its other name counts as the key (both
  // present must agree).
  const std::vector<std::pair<const char*, const char*>> aliases =
      gpt2 ? std::vector<std::pair<const char*, const char*>>{{"num_attention_heads", "n_head"},
                                                              {"hidden_size", "n_embd"},
                                                              {"num_hidden_layers", "n_layer"},
                                                              {"max_position_embeddings",
                                                               "n_positions"}}
      : mixtral
          ? std::vector<std::pair<const char*, const char*>>{{"num_experts", "num_local_experts"}}
          : std::vector<std::pair<const char*, const char*>>{};
  for (const auto& [alias, key] : aliases) {
    if (!j.contains(alias)) continue;
    if (j.contains(key) && j[key] != j[alias]) {
      return refuse(absl::StrCat(key, " is ", Shown(j[key]), ", but its other name ", alias, " is ",
                                 Shown(j[alias])));
    }
    j[key] = j[alias];
  }
  // Keys whose null means the class's default: as if left out.
  for (const char* key : {"n_inner", "num_key_value_heads", "head_dim"}) {
    if (j.contains(key) && j[key].is_null()) j.erase(key);
  }
  // transformers' names of the functions fp8rt runs: silu (swish), and GELU's tanh approximation
  // (gelu_new, gelu_pytorch_tanh, gelu_fast: the same formula).
  if (j.contains("hidden_act") && j["hidden_act"] == "swish") j["hidden_act"] = "silu";
  if (j.contains("activation_function") && (j["activation_function"] == "gelu_pytorch_tanh" ||
                                            j["activation_function"] == "gelu_fast")) {
    j["activation_function"] = "gelu_new";
  }

  std::vector<ConfigKey> keys;
  if (gpt2) {
    keys = {
        {"vocab_size", s.vocab, "model.vocab", 50257},
        {"n_positions", s.max_positions, "model.max_positions", 1024},
        {"n_embd", s.d_model, "model.d_model", 768},
        {"n_layer", s.layers, "model.layers", 12},
        {"n_head", s.heads, "model.heads", 12},
        // n_inner left out: 4 * n_embd, which the key before has checked is model.d_model.
        {"n_inner", s.d_ff, "model.d_ff", J(4 * s.d_model)},
        {"activation_function", "gelu_new", "model.mlp (gelu, the tanh approximation)", "gelu_new"},
        {"layer_norm_epsilon", Shortest(s.norm_eps), "model.norm_eps", 1e-5},
        {"tie_word_embeddings", true, "model.tie_embeddings", true},
        {"scale_attn_weights", true, "model.family (gpt2: scores scaled by 1/sqrt(Dh))", true},
        {"scale_attn_by_inverse_layer_idx", false, "model.family (gpt2: no per-layer scaling)",
         false}};
  } else {
    keys = {
        {"vocab_size", s.vocab, "model.vocab", 32000},
        {"hidden_size", s.d_model, "model.d_model", 4096},
        {"intermediate_size", s.d_ff, "model.d_ff", mixtral || mistral ? 14336 : 11008},
        {"num_hidden_layers", s.layers, "model.layers", 32},
        {"num_attention_heads", s.heads, "model.heads", 32},
        // Left out: 8 (Mistral, Mixtral) or num_attention_heads, checked just before.
        {"num_key_value_heads", s.kv(), "model.kv_heads", mixtral || mistral ? J(8) : J(s.heads)},
        {"head_dim", s.head_dim(), "model.d_model / model.heads", s.head_dim()},
        {"hidden_act", "silu", "model.mlp (swiglu)", "silu"},
        {"rms_norm_eps", Shortest(s.norm_eps), "model.norm_eps", mixtral ? 1e-5 : 1e-6},
        {"tie_word_embeddings", s.tie_embeddings, "model.tie_embeddings", false},
        {"rope_theta", Shortest(s.rope_theta), "model.rope_theta", mixtral ? 1e6 : 10000.0}};
    // RoPE without scaling: rope_scaling (transformers 4) or rope_parameters (5), whose type is
    // rope_type or type; a rope_theta given in both must be the spec's in both.
    for (const char* key : {"rope_scaling", "rope_parameters"}) {
      if (!j.contains(key) || j[key].is_null()) continue;
      const J rp = j[key];
      const J kind = !rp.is_object()            ? rp
                     : rp.contains("rope_type") ? rp["rope_type"]
                     : rp.contains("type")      ? rp["type"]
                                                : J("default");
      if (kind != "default") {
        return refuse(absl::StrCat(key, " has rope type ", Shown(kind),
                                   ", but fp8rt's RoPE (model.rope_theta) has no scaling"));
      }
      if (rp.contains("rope_theta")) {
        if (!j.contains("rope_theta")) j["rope_theta"] = rp["rope_theta"];
        keys.push_back(
            {absl::StrCat(key, ".rope_theta"), Shortest(s.rope_theta), "model.rope_theta", J()});
        j[absl::StrCat(key, ".rope_theta")] = rp["rope_theta"];
      }
    }
    if (mixtral || mistral) {
      // A sliding window at least seq_len long masks nothing (MistralConfig's default is 4096,
      // MixtralConfig's none).
      const J window = j.contains("sliding_window") ? j["sliding_window"] : mistral ? J(4096) : J();
      if (!window.is_null() &&
          !(window.is_number_integer() && window.get<int64_t>() >= s.seq_len)) {
        return refuse(absl::StrCat(
            "sliding_window is ", Shown(window), ", shorter than the spec's model.seq_len ",
            s.seq_len, ": fp8rt's attention has no window (a shorter model.seq_len loads it)"));
      }
    }
    if (mixtral) {
      keys.push_back({"num_local_experts", s.moe.experts, "moe.experts", 8});
      keys.push_back({"num_experts_per_tok", s.moe.top_k, "moe.top_k", 2});
    } else {
      keys.push_back({"attention_bias", false, "model.bias", false});
      keys.push_back({"mlp_bias", false, "model.bias", false});
    }
  }
  for (const ConfigKey& k : keys) {
    const bool present = j.contains(k.key);
    const J& got = present ? j[k.key] : k.fallback.is_null() ? k.want : k.fallback;
    if (SameValue(got, k.want)) continue;
    return refuse(absl::StrCat(
        k.key, " is ", Shown(got),
        present ? "" : " (transformers' default for the key left out or null)", ", but the spec's ",
        k.field, " is ", Shown(k.want),
        " (set the spec to match, or init.ignore_config: true to load the weights anyway)"));
  }
  return absl::OkStatus();
}

absl::StatusOr<std::vector<HfTensor>> ToHuggingFace(
    const ModelShape& shape, const std::map<std::string, LogicalShape>& shapes,
    const LogicalParams& params) {
  FP8RT_RETURN_IF_ERROR(CheckHfArchitecture(shape));
  std::vector<HfTensor> out;
  for (const Entry& e : Entries(shape)) {
    const auto s = shapes.find(e.ours);
    const auto p = params.find(e.ours);
    if (s == shapes.end() || p == params.end()) {
      return absl::InvalidArgumentError(
          absl::StrCat("parameter ", e.ours, " (for ", e.hf, ") is missing"));
    }
    if (static_cast<int64_t>(p->second.size()) != s->second.rows * s->second.cols) {
      return absl::InvalidArgumentError(absl::StrCat("parameter ", e.ours, " has ",
                                                     p->second.size(), " values, expected ",
                                                     s->second.rows * s->second.cols));
    }
    HfTensor t{e.hf, e.hf_shape, std::vector<float>(static_cast<size_t>(Elements(e.hf_shape)))};
    Visit(shape, e, s->second, [&](size_t i, size_t j) { t.values[i] = p->second[j]; });
    out.push_back(std::move(t));
  }
  return out;
}

absl::Status ForEachHfParam(
    const ModelShape& shape, const std::map<std::string, LogicalShape>& shapes,
    const SafetensorsSet& file,
    const std::function<absl::Status(const std::string&, std::span<const float>)>& fn) {
  FP8RT_RETURN_IF_ERROR(CheckHfArchitecture(shape));
  std::vector<Entry> entries = Entries(shape);
  // A file saved from the base model (GPT2Model, LlamaModel; the original gpt2 checkpoint is one)
  // names its tensors without the causal-LM class's prefix: "wte.weight", not
  // "transformer.wte.weight". transformers loads either, and so does this: when the embedding
  // (the first entry, prefixed in every family) is there only without it, every name is.
  const std::string prefix = IsGpt2(shape) ? "transformer." : "model.";
  const bool bare = file.Find(entries.front().hf) == nullptr &&
                    file.Find(entries.front().hf.substr(prefix.size())) != nullptr;
  if (bare) {
    for (Entry& e : entries) {
      if (e.hf.starts_with(prefix)) e.hf.erase(0, prefix.size());
    }
  }
  std::set<std::string> known;
  for (const Entry& e : entries) known.insert(e.hf);
  for (const SafetensorsFile& part : file.files()) {
    for (const SafetensorsTensor& t : part.tensors()) {
      if (known.contains(t.name)) continue;
      if (IsGpt2(shape) &&
          (t.name.ends_with(".attn.bias") || t.name.ends_with(".attn.masked_bias"))) {
        continue;  // GPT-2's causal-mask buffers, not parameters
      }
      if (!IsGpt2(shape) && IsInvFreq(shape, bare ? prefix + t.name : t.name)) {
        FP8RT_RETURN_IF_ERROR(CheckInvFreq(shape, part, t));
        continue;  // Llama's RoPE frequencies (older transformers saved them): no parameter
      }
      return absl::InvalidArgumentError(absl::StrCat(
          part.name(), ": tensor '", t.name.substr(0, 64), "' is not a parameter of this model (",
          shape.layers, " layers, ",
          IsGpt2(shape)           ? "gpt2"
          : shape.moe.experts > 0 ? absl::StrCat("mixtral, ", shape.moe.experts, " experts")
                                  : "llama",
          shape.tie_embeddings ? ", tied embeddings" : "", ")"));
    }
  }
  // Every check first, so that no parameter is converted (and fn never called) when anything is
  // wrong.
  std::map<std::string, std::vector<const Entry*>> sources;  // parameter -> its entries
  for (const Entry& e : entries) {
    // An expert of another ep rank is not in this rank's shapes: its tensor is checked as every
    // other, and not converted.
    const bool here = shapes.contains(e.ours);
    if (!here && !e.expert) {
      return absl::InvalidArgumentError(absl::StrCat("model has no parameter ", e.ours));
    }
    if (file.Find(e.hf) == nullptr) {
      return absl::InvalidArgumentError(
          absl::StrCat(file.name(), ": tensor '", e.hf, "' is missing (the model's ", e.ours, ")"));
    }
    FP8RT_RETURN_IF_ERROR(file.CheckFloat32(e.hf, e.hf_shape));
    if (here) sources[e.ours].push_back(&e);
  }
  for (const auto& [name, s] : shapes) {
    if (!sources.contains(name)) {
      return absl::InvalidArgumentError(
          absl::StrCat(file.name(), ": no tensor holds the model's parameter ", name));
    }
  }
  // One parameter at a time: its logical tensor (in `dst`, reused) and the FP32 values of its
  // Hugging Face tensors, about twice the largest parameter at once.
  std::vector<float> dst;
  for (const auto& [name, s] : shapes) {
    dst.assign(static_cast<size_t>(s.rows * s.cols), 0.0f);
    for (const Entry* e : sources[name]) {
      FP8RT_ASSIGN_OR_RETURN(const std::vector<float> values, file.ReadFloat32(e->hf, e->hf_shape));
      Visit(shape, *e, s, [&](size_t i, size_t j) { dst[j] = values[i]; });
    }
    FP8RT_RETURN_IF_ERROR(fn(name, dst));
  }
  return absl::OkStatus();
}

absl::StatusOr<LogicalParams> FromHuggingFace(const ModelShape& shape,
                                              const std::map<std::string, LogicalShape>& shapes,
                                              const SafetensorsSet& file) {
  LogicalParams params;
  FP8RT_RETURN_IF_ERROR(
      ForEachHfParam(shape, shapes, file, [&](const std::string& name, std::span<const float> v) {
        params[name].assign(v.begin(), v.end());
        return absl::OkStatus();
      }));
  return params;
}

}  // namespace fp8rt::model
