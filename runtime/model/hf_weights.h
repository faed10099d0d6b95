// Hugging Face checkpoints of the gpt2 and llama families: the tensor names, shapes and layouts
// that transformers' GPT2LMHeadModel, LlamaForCausalLM and MixtralForCausalLM (llama with an MoE
// MLP in every block) load, the config.json they read, and the conversion between those tensors
// and fp8rt's logical parameters (transformer.h's names, each a row-major [rows, cols] tensor of
// the whole model, before any TP split or FSDP shard).
//
// Index:
//   CheckHfArchitecture  whether a shape is exactly one of the three Hugging Face architectures
//   HfConfigJson         config.json for a shape
//   CheckHfConfig        whether a config.json describes a shape (init.from's check)
//   ToHuggingFace        logical parameters -> Hugging Face tensors (export)
//   FromHuggingFace      safetensors files -> logical parameters (all at once)
//   ForEachHfParam       the same one parameter at a time (init.from, LoadHuggingFace)
//
// Layouts (H heads, KV key/value heads, Dh head size, Q = H / KV):
//   - GPT-2's linears are Conv1D, [in, out]: the transpose of fp8rt's [out, in]. c_attn
//     concatenates q, k and v along out (all q heads, then all k, then all v); fp8rt's attn.qkv
//     groups rows by head (q_h, k_h, v_h).
//   - Llama's q_proj, k_proj, v_proj, o_proj, gate/up/down_proj are [out, in] like fp8rt's; q, k
//     and v are fp8rt's attn.qkv rows regrouped (fp8rt: per kv group g, its Q query heads, k_g,
//     v_g). RoPE is Hugging Face's rotate-half on those rows as they are, so no permutation of
//     the head dimension is needed.
//   - Mixtral's block_sparse_moe.gate [E, C] is fp8rt's mlp.router, and expert e's w1, w3 [F, C]
//     and w2 [C, F] are its mlp.experts.e.gate, up and down, all [out, in] as they are. Mixtral
//     routes as fp8rt does (the softmax over every expert, the top k, renormalised) but never
//     drops a token, and keeps the experts' rows in full precision where fp8rt's dispatch sends
//     them in FP8 and its combine in BF16: the two forwards differ by that rounding alone where
//     moe.drop_tokens is false or nothing is dropped. config.json's router_aux_loss_coef is
//     moe.aux_loss_coef as it is, but transformers' load-balancing loss (training only, with
//     output_router_logits) is one term over every layer's routing concatenated, where fp8rt's
//     is the Switch Transformer's per layer (by choice: docs/operations.md): top_k / layers times
//     fp8rt's at one coefficient where every layer routes alike, and no fixed ratio elsewhere.
//   - Norm gains and biases are vectors; fp8rt keeps them as [1, n] (or [n, 1] for the biases of
//     column-parallel layers): the same values.
// Conversions are exact copies of FP32 values (no arithmetic), so export -> import -> export is
// bit for bit.
#ifndef FP8RT_RUNTIME_MODEL_HF_WEIGHTS_H_
#define FP8RT_RUNTIME_MODEL_HF_WEIGHTS_H_

#include <cstdint>
#include <functional>
#include <map>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "runtime/core/safetensors.h"
#include "runtime/model/model_shape.h"

namespace fp8rt::model {

// A tensor in Hugging Face's naming and layout.
struct HfTensor {
  std::string name;  // "transformer.h.0.attn.c_attn.weight"
  std::vector<int64_t> shape;
  std::vector<float> values;
};

// OK when `shape` is the gpt2 or llama architecture exactly (gpt2: LayerNorm, GELU, learned
// positions, biases, tied embeddings, dense; llama: RMSNorm, SwiGLU, RoPE, no biases, dense or,
// as Mixtral, with an MoE MLP in every block). InvalidArgument naming the field that differs (the
// family plain has no Hugging Face class: model.family; MoE outside llama: moe.experts; MoE in
// only some blocks: moe.every).
absl::Status CheckHfArchitecture(const ModelShape& shape);

// config.json for GPT2LMHeadModel, LlamaForCausalLM or MixtralForCausalLM (model_type,
// architectures, the sizes, epsilon, rope_theta, Mixtral's num_local_experts,
// num_experts_per_tok and router_aux_loss_coef, tie_word_embeddings, torch_dtype `dtype`:
// "float32" or "bfloat16").
absl::StatusOr<std::string> HfConfigJson(const ModelShape& shape, const std::string& dtype);

// Whether config.json (`text`, read from `path`) describes the model `shape`: its class
// (model_type gpt2, llama or mixtral, as CheckHfArchitecture places the shape; a llama shape also
// reads mistral, Llama's tensors with a sliding window, where the window masks nothing) and every
// key that changes what the weights compute: the sizes, heads and kv heads, head_dim, the
// activation, the norm's epsilon, rope_theta (no rope_scaling), tied embeddings, GPT-2's attention
// scaling, Mixtral's experts and top k, the sliding window (none, or at least seq_len). A key the
// file leaves out takes transformers' default for the class (so does null where the class reads
// it as its default), and a key under its other name (the classes' attribute_map: GPT-2's
// num_attention_heads, hidden_size, num_hidden_layers, max_position_embeddings; Mixtral's
// num_experts) counts as the key. Keys that do not change the forward (max_position_embeddings of
// a RoPE model, token ids, the aux-loss coefficient, dropouts, router jitter) are not read.
// InvalidArgument "PATH: KEY is V, but the spec's FIELD is W" (V quoted to 32 bytes), or naming
// the file for text that is not a JSON object.
absl::Status CheckHfConfig(const ModelShape& shape, std::string_view text, const std::string& path);

// The Hugging Face tensors of a model whose logical parameters are `params` (every parameter of
// `shapes`, by name), in the order the model's layers run. InvalidArgument naming the parameter
// for a missing one or a wrong size.
absl::StatusOr<std::vector<HfTensor>> ToHuggingFace(
    const ModelShape& shape, const std::map<std::string, LogicalShape>& shapes,
    const LogicalParams& params);

// The logical parameters (every one of `shapes`) from Hugging Face weights: one file, or the
// files of an index (SafetensorsSet). InvalidArgument naming the file and the tensor for a
// missing tensor, a tensor of another shape or dtype (F32, BF16 and F16 are read), and a tensor
// the model has no place for. Non-parameter buffers are let through: GPT-2's `*.attn.bias` /
// `*.attn.masked_bias`, and Llama's `*.self_attn.rotary_emb.inv_freq` when its values are the
// frequencies of model.rope_theta (else InvalidArgument naming rope_theta). A file saved from the
// base model (GPT2Model, LlamaModel), whose names lack "transformer." / "model.", reads too.
absl::StatusOr<LogicalParams> FromHuggingFace(const ModelShape& shape,
                                              const std::map<std::string, LogicalShape>& shapes,
                                              const SafetensorsSet& file);

// FromHuggingFace one parameter at a time: every check first (fn is never called when one fails),
// then fn(name, its logical tensor) for each parameter of `shapes` in name order, so that a large
// model never exists whole in FP32 (about twice its largest parameter at once). fn's first error
// ends the walk and is returned. An MoE expert's weight missing from `shapes` is another ep
// rank's (a rank's model holds its own experts only): its tensor is checked, not converted.
absl::Status ForEachHfParam(
    const ModelShape& shape, const std::map<std::string, LogicalShape>& shapes,
    const SafetensorsSet& file,
    const std::function<absl::Status(const std::string&, std::span<const float>)>& fn);

}  // namespace fp8rt::model

#endif  // FP8RT_RUNTIME_MODEL_HF_WEIGHTS_H_
