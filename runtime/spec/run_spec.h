// Run spec loading and validation: YAML -> fp8rt.v1.RunSpec (proto/fp8rt/v1/run_spec.proto).
//
// The proto is the schema. The loader walks the message's Descriptor, so a YAML key is a field
// name, a section is a sub-message, an enum is written as its lower-case value name without the
// enum's prefix (`precision.mode: fp8` for MODE_FP8; the *_UNSPECIFIED value is not accepted) and
// a repeated string is a YAML sequence. Anything else is an error:
//
//   tiny.yaml:12:3: precision.scalng: unknown key (did you mean scaling?)
//   tiny.yaml:20:10: train.steps: expected an integer, got 'ten'
//   tiny.yaml:9:9: precision.mode: expected one of fp32, bf16, fp8, got 'fp16'
//
// Types are strict: an integer field takes a plain integer (not 1.5, not a quoted "10"), a
// number field takes an integer or a decimal, a bool takes true/false, a scalar never takes a
// list or a map, and a key may appear once per section. An empty section (`checkpoint:`) is an
// empty map; an empty `precision.exclude:` is an empty list.
//
// Required keys (missing ones are an error naming the first, in this order):
//   model.layers, model.d_model, model.heads, model.d_ff, model.seq_len, model.vocab,
//   train.steps, data.path
//
// Defaults of every other key (set in one place, RunSpecDefaults() in run_spec.cc):
//   parallel:   dp 1, tp 1, ep 1
//   precision:  mode fp8, format hybrid, scaling delayed, amax_history_len 16,
//               amax_compute_algo max, margin 0, exclude [], fsdp_gather fp8, grad_reduce fp32
//   train:      micro_batch 1, grad_accum 1, seed 1, lr 3e-4, warmup 0, min_lr 0,
//               weight_decay 0.1, clip 1.0 (0 disables clipping)
//   init:       from "" (the seeded initialisation; a safetensors path starts from its weights),
//               ignore_config false (a config.json beside the weights must describe the model)
//   model:      family plain (unset); the family sets the architecture fields (ResolveModel):
//                 plain: norm rmsnorm, mlp gelu, positions none, bias false, tie_embeddings false
//                 gpt2:  norm layernorm, mlp gelu, positions learned, bias true,
//                        tie_embeddings true
//                 llama: norm rmsnorm, mlp swiglu, positions rope, bias false,
//                        tie_embeddings false
//               and for every family: kv_heads = heads, max_positions = seq_len, rope_theta 10000,
//               norm_eps 1e-5. A field written in the spec overrides its family's value.
//   data:       format text, shuffle true (each epoch a seeded permutation of the sequences of
//               model.seq_len + 1 tokens, from train.seed and the epoch; false: file order),
//               val_path "" and val_fraction 0 (no validation data; set one of them for eval:
//               val_path a token file in data.format, val_fraction in (0, 1) the held-out tail
//               of data.path, see ValidationSplit)
//   eval:       every 0 (off; N: the validation loss before the training of every step with
//               step % N == 0 and of the last step), batches 8 (micro-batches of
//               train.micro_batch sequences per DP rank: the mean over the first
//               batches * micro_batch * dp sequences of the validation data, in file order)
//   checkpoint: every 0 (off), keep 3
//   metrics:    every 1, per_rank_fp8_stats false
//   moe:        experts 0 (dense), top_k 2, every 1, capacity_factor 1.25, aux_loss_coef 0.01,
//               drop_tokens true
//   health:     saturation_threshold 0 (off), underflow_threshold 0 (off), intervals 3, demote false
//   device:     cpu (a top-level key: `device: cpu` or `device: cuda`; a RunSpec message whose
//               device is unset, such as one stored before the field existed, also means cpu:
//               the one enum for which the zero value is not "not set")
//
// Overrides ("--set train.steps=20") are `dotted.path=value`, applied in order after the file,
// with the same typing and errors; the value is read as YAML, so `precision.mode=bf16`,
// `train.lr=1e-3` and `precision.exclude=[lm_head, blocks.0.attn.qkv]` all work. A repeated
// string also takes a comma-separated override value (`precision.exclude=a,b`; an empty value
// clears the list); overrides replace a list, they never append. Override errors start with
// "override 'KEY=VALUE': ".
//
// Every error is InvalidArgument, except NotFound for a spec file that does not exist. Parse
// errors start with "<file>:<line>:<column>: " where YAML gives a position (else "<file>: "),
// then the field path. Loading does not run the cross-field checks: call ValidateRunSpec once
// the world size is known. Relative data paths are relative to the working directory.
//
// Stateless and thread-safe.
#ifndef FP8RT_RUNTIME_SPEC_RUN_SPEC_H_
#define FP8RT_RUNTIME_SPEC_RUN_SPEC_H_

#include <cstdint>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "fp8rt/v1/run_spec.pb.h"

namespace fp8rt {

// A RunSpec holding every default listed above (required keys left zero/empty).
v1::RunSpec RunSpecDefaults();

// Reads the YAML file at `path`, applies `overrides` ("a.b=value") and checks required keys.
[[nodiscard]] absl::StatusOr<v1::RunSpec> LoadRunSpec(const std::string& path,
                                                      std::span<const std::string> overrides);

// Same on YAML text already in memory; `source_name` stands for the file name in errors.
[[nodiscard]] absl::StatusOr<v1::RunSpec> ParseRunSpec(const std::string& yaml_text,
                                                       const std::string& source_name,
                                                       std::span<const std::string> overrides);

// Cross-field checks, each failure an InvalidArgument naming the field:
//   - model sizes, parallel sizes, train.steps, micro_batch, grad_accum, metrics.every and
//     checkpoint.keep positive; warmup, min_lr, weight_decay, clip, checkpoint.every >= 0;
//     lr > 0; every number finite
//   - model.d_model % model.heads == 0
//   - parallel.dp * parallel.tp == world_size (world_size 0 skips this check)
//   - parallel.ep divides parallel.dp
//   - model.heads, model.d_model, model.d_ff and model.kv_heads divisible by parallel.tp;
//     model.kv_heads divides model.heads; rope needs an even head size; learned positions need
//     max_positions >= seq_len; rope_theta > 0, norm_eps >= 0
//   - precision.scaling block: d_model / tp and d_ff / tp multiples of 128 (whole 128x128
//     blocks on every tensor-parallel shard; with tp 1, d_model and d_ff multiples of 128)
//   - moe: experts a multiple of parallel.ep, top_k in [1, experts], every >= 1, capacity_factor
//     > 0, aux_loss_coef >= 0, tp 1 with MoE, ep 1 without; expert rows divisible by dp / ep
//   - health thresholds in [0, 1], health.intervals positive
//   - device: a known value (cpu or cuda). Whether a GPU is there is checked by the worker, not
//     here.
//   - precision.mode fp8: the FP8 weights' rows per tensor-parallel rank (3 d_model / tp,
//     d_model, d_ff / tp) divisible by parallel.dp (by 128 * dp with block scaling): FSDP
//     gathers whole rows / blocks
//   - train.warmup <= train.steps, train.min_lr <= train.lr
//   - precision.margin in [0, 32], precision.amax_history_len in [1, 4096], exclude names
//     non-empty
//   - data.format text (byte-level tokens) needs model.vocab >= 256; u16 and llmc need
//     vocab <= 65536
//   - data.val_fraction 0 or in (0, 1); data.val_path and data.val_fraction not both set;
//     eval.every >= 0; with eval.every > 0: eval.batches >= 1, validation data set
//     (data.val_path or data.val_fraction), and (with data_file kCheck) holding at least
//     eval.batches * train.micro_batch * parallel.dp windows of model.seq_len + 1 tokens
//     (counted from the file's size; the message gives both counts)
//   - data.val_path, when set, names a readable regular file (with data_file kCheck)
//   - init.from, when set, names an existing, readable regular file (with kCheck)
//   - data.path names an existing, readable regular file (the message names the path), unless
//     `data_file` is kSkip (a process that never reads the data, such as the controller, which
//     still requires data.path to be non-empty)
enum class DataFileCheck { kCheck, kSkip };

// The model section with its family's defaults filled in (see the defaults above): every
// architecture field explicit (family, norm, mlp, positions set; kv_heads, max_positions,
// rope_theta, norm_eps, bias, tie_embeddings present). Fields the spec wrote are kept.
v1::RunSpec::Model ResolveModel(const v1::RunSpec::Model& model);

[[nodiscard]] absl::Status ValidateRunSpec(const v1::RunSpec& spec, int world_size,
                                           DataFileCheck data_file = DataFileCheck::kCheck);

// The FP8-capable GEMM layers of the spec's model (what precision.exclude and a recipe may name),
// in model order, lm_head last. Per block: attn.qkv, attn.proj, then the MLP's mlp.fc1, mlp.fc2
// (gelu) or mlp.gate, mlp.up, mlp.down (swiglu); in an MoE block (moe.experts > 0 and
// (l + 1) % moe.every == 0) mlp.experts.E.{fc1, fc2 | gate, up, down} for every expert E instead
// (the router is always FP32 and not listed). runtime/model's Transformer::LayerNames builds the
// same list from the model's shape (a test holds them equal).
std::vector<std::string> ModelLayerNames(const v1::RunSpec& spec);

// precision.overrides: at most this many entries, each pattern at most this many bytes.
inline constexpr int kMaxPrecisionOverrides = 256;
inline constexpr size_t kMaxLayerPatternBytes = 256;

// precision.overrides alone (ValidateRunSpec runs it too): the count and every pattern's length
// first (a long pattern is refused before anything quotes it, and then by a bounded prefix),
// then each entry's values (mode fp8 or bf16, enums the proto defines, margin in [0, 32],
// amax_history_len in [0, 4096]), then that each pattern matches a layer of ModelLayerNames.
// Needs precision.mode fp8. InvalidArgument "precision.overrides[i].<field>: ...".
[[nodiscard]] absl::Status ValidatePrecisionOverrides(const v1::RunSpec& spec);

// The rows the FSDP shards of a run's FP8 GEMM weights are cut in when it starts with `spec`
// (model::ShardCut::row_unit; model::Transformer::RowUnitOf of its recipe): 0 outside fp8
// mode; else 128 when block scaling is anywhere in it (the section, an override, or
// health.action block_scaling), 32 with mx32, 1 otherwise. Fixed for the run.
int64_t FsdpRowUnit(const v1::RunSpec& spec);

// A recipe given live (`merged`: the run's spec with the recipe merged in) on a run that started
// as `run`: InvalidArgument naming the field (model.d_model or model.d_ff) when its block
// scaling (128 rows) or mx32 (32 rows) blocks would straddle the FSDP shards the run was cut in.
[[nodiscard]] absl::Status CheckLiveRecipeShards(const v1::RunSpec& run,
                                                 const v1::RunSpec& merged);

// One override in a line: "'blocks.*.mlp.fc2': bf16" or "'blocks.0.*': scaling current, margin 2".
std::string DescribeOverride(const v1::RunSpec::Precision::Override& o);

// The precision section one layer trains with: `p` without its exclude list and overrides, its
// mode bf16 when precision.exclude names the layer, else with the fields the first override
// whose `layers` glob (runtime/core/glob.h) matches the layer sets. `matched`, when given, is set
// to that override's index (-1: none). Outside fp8 mode, `p`'s own values.
v1::RunSpec::Precision LayerPrecision(const v1::RunSpec::Precision& p, std::string_view layer,
                                      int* matched = nullptr);

// data.val_fraction's split of a corpus of `tokens` tokens: training reads tokens [0, split),
// validation [split, tokens), split = floor(tokens * (1 - val_fraction)) (nanoGPT's
// data[:int(n * 0.9)] for val_fraction 0.1). `tokens` when val_fraction is not in (0, 1).
uint64_t ValidationSplit(uint64_t tokens, double val_fraction);

}  // namespace fp8rt

#endif  // FP8RT_RUNTIME_SPEC_RUN_SPEC_H_
