// Writes the binary seeds of tests/fuzz/corpus: shard files, MANIFEST files, controller request
// lists, and Hugging Face checkpoints with their config.json, each valid or one step from valid,
// made with the real writers (ShardWriter, protobuf serialization, WriteSafetensors,
// HfConfigJson) so that the seeds follow the formats as the code writes them.
//   make_fuzz_corpus CORPUS_DIR     (tests/fuzz/README.md; the .npy and YAML seeds are not made
//                                    here: make_npy_corpus.py, and run specs written by hand)
// Existing seeds of the same names are overwritten; other files are left alone.
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <limits>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/match.h"
#include "fp8rt/v1/checkpoint.pb.h"
#include "fp8rt/v1/control.pb.h"
#include "fp8rt/v1/scaling.pb.h"
#include "runtime/checkpoint/checkpoint_dir.h"
#include "runtime/checkpoint/checkpoint_io.h"
#include "runtime/core/safetensors.h"
#include "runtime/model/hf_weights.h"
#include "runtime/spec/run_spec.h"
#include "tests/fuzz/fuzz_support.h"

namespace fp8rt::fuzz {
namespace {

namespace fs = std::filesystem;

[[noreturn]] void Die(const std::string& what) {
  std::fprintf(stderr, "make_fuzz_corpus: %s\n", what.c_str());
  std::exit(1);
}

void Check(const absl::Status& s) {
  if (!s.ok()) Die(s.ToString());
}

std::string ReadAll(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) Die("cannot read " + path);
  return std::string(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
}

void WriteSeed(const fs::path& dir, const std::string& name, const std::string& bytes) {
  fs::create_directories(dir);
  std::ofstream out(dir / name, std::ios::binary | std::ios::trunc);
  out.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
  if (!out) Die("cannot write " + (dir / name).string());
}

// The bytes ShardWriter writes for `writer`.
std::string ShardBytes(const ShardWriter& writer, const fs::path& scratch) {
  const std::string path = (scratch / "shard").string();
  Check(writer.Write(path).status());
  return ReadAll(path);
}

std::span<const std::byte> Bytes(const std::string& s) {
  return std::as_bytes(std::span<const char>(s.data(), s.size()));
}

// ---------------------------------------------------------------------------------------------
// Shards.

void MakeShards(const fs::path& dir, const fs::path& scratch) {
  {
    ShardWriter empty;
    WriteSeed(dir, "empty.shard", ShardBytes(empty, scratch));
  }
  ShardWriter w;
  std::vector<float> master = {0.5f, -1.25f, 3.0f, 448.0f};
  Check(w.Add("master/blocks.0.mlp.fc1", std::as_bytes(std::span<const float>(master))));
  Check(w.Add("adam_m/blocks.0.mlp.fc1", std::as_bytes(std::span<const float>(master))));
  v1::ScalingState scaling;
  Check(w.AddProto("scaling/blocks.0.mlp.fc1/weight", scaling));
  Check(w.Add("rng", Bytes("0123456789abcdef")));
  Check(w.Add("data_position", Bytes(std::string(8, '\0'))));
  Check(w.Add("empty", {}));
  const std::string good = ShardBytes(w, scratch);
  WriteSeed(dir, "rank-00000.shard", good);

  // One step from valid, each a different check.
  std::string bad = good;
  bad[0] = 'G';
  WriteSeed(dir, "bad-magic.shard", bad);
  bad = good;
  bad[8] = 2;
  WriteSeed(dir, "bad-version.shard", bad);
  WriteSeed(dir, "truncated.shard", good.substr(0, good.size() / 2));
  bad = good;
  bad[good.size() / 2] ^= 0x40;
  WriteSeed(dir, "bit-flip.shard", bad);
  WriteSeed(dir, "trailing-bytes.shard", good + "x");
  bad = good;
  bad[12] = 100;  // section count
  WriteSeed(dir, "bad-count.shard", bad);
}

// ---------------------------------------------------------------------------------------------
// Manifests: MANIFEST files as CheckpointDir::Commit writes them (one section "manifest").

v1::CheckpointManifest GoodManifest() {
  v1::CheckpointManifest m;
  m.set_step(100);
  m.set_world_size(2);
  m.set_dp(2);
  m.set_tp(1);
  m.set_ep(1);
  for (int rank = 0; rank < 2; ++rank) {
    v1::CheckpointShard* s = m.add_shards();
    s->set_rank(rank);
    s->set_file(ShardFileName(rank));
    s->set_size(1234 + rank);
    s->set_xxh64(0x0123456789abcdefULL + rank);
  }
  v1::RunSpec spec = RunSpecDefaults();
  spec.mutable_model()->set_layers(2);
  spec.mutable_model()->set_d_model(128);
  spec.mutable_train()->set_steps(200);
  spec.mutable_data()->set_path("examples/data/kjv.txt");
  *m.mutable_spec() = spec;
  m.set_created_unix_ms(1764000000000);
  m.set_data_position(4096);
  return m;
}

std::string ManifestBytes(const v1::CheckpointManifest& m, const fs::path& scratch) {
  ShardWriter w;
  Check(w.AddProto("manifest", m));
  return ShardBytes(w, scratch);
}

void MakeManifests(const fs::path& dir, const fs::path& scratch) {
  const v1::CheckpointManifest good = GoodManifest();
  WriteSeed(dir, "MANIFEST", ManifestBytes(good, scratch));
  {
    v1::CheckpointManifest m = good;
    m.clear_spec();
    m.set_world_size(1);
    m.mutable_shards()->DeleteSubrange(1, 1);
    WriteSeed(dir, "one-rank", ManifestBytes(m, scratch));
  }
  {
    v1::CheckpointManifest m = good;
    m.set_step(99);
    WriteSeed(dir, "other-step", ManifestBytes(m, scratch));
  }
  {
    v1::CheckpointManifest m = good;
    m.mutable_shards(1)->set_rank(0);
    WriteSeed(dir, "rank-twice", ManifestBytes(m, scratch));
  }
  {
    v1::CheckpointManifest m = good;
    m.mutable_shards(1)->set_file("../rank-00001.shard");
    WriteSeed(dir, "path-in-name", ManifestBytes(m, scratch));
  }
  {
    v1::CheckpointManifest m = good;
    m.mutable_shards(1)->set_file(ShardFileName(0));
    WriteSeed(dir, "file-twice", ManifestBytes(m, scratch));
  }
  {
    v1::CheckpointManifest m = good;
    m.set_world_size(3);
    WriteSeed(dir, "rank-missing", ManifestBytes(m, scratch));
  }
  {
    v1::CheckpointManifest m = good;
    m.set_world_size(0);
    m.clear_shards();
    WriteSeed(dir, "no-world", ManifestBytes(m, scratch));
  }
  {
    ShardWriter w;  // the right section name holding something else
    Check(w.Add("manifest", Bytes("\xff\xff\xff")));
    WriteSeed(dir, "not-a-message", ShardBytes(w, scratch));
  }
  {
    ShardWriter w;
    Check(w.AddProto("manifesto", good));
    WriteSeed(dir, "wrong-section", ShardBytes(w, scratch));
  }
}

// ---------------------------------------------------------------------------------------------
// Controller request lists: selector byte, 2-byte little-endian length, serialized request
// (controller_rpc_fuzzer.cc). Selectors as there.

enum Method : uint8_t {
  kRegister = 0,
  kHeartbeat = 1,
  kReportStep = 2,
  kBeginCheckpoint = 3,
  kAckShard = 4,
  kGetRun = 5,
  kStopRun = 6,
  kGetLayers = 7,
  kGetRecipe = 8,
  kUpdateRecipe = 9,
  kListCheckpoints = 10,
  kSaveCheckpoint = 11,
  kWatchEvents = 12,
  kListRuns = 13,
  kRestart = 14,
  kCreateRunToken = 15,
};

class Requests {
 public:
  Requests& Add(Method method, const google::protobuf::MessageLite& request) {
    const std::string bytes = request.SerializeAsString();
    if (bytes.size() > 0xffff) Die("request too large");
    out_.push_back(static_cast<char>(method));
    out_.push_back(static_cast<char>(bytes.size() & 0xff));
    out_.push_back(static_cast<char>(bytes.size() >> 8));
    out_ += bytes;
    return *this;
  }
  Requests& Add(Method method) {
    out_.push_back(static_cast<char>(method));
    out_ += std::string(2, '\0');
    return *this;
  }
  const std::string& bytes() const { return out_; }

 private:
  std::string out_;
};

template <typename T>
T WithRun(const std::string& run_id) {
  T r;
  r.set_run_id(run_id);
  return r;
}

v1::ReportStepRequest Step(int64_t step, bool with_sites) {
  v1::ReportStepRequest r = WithRun<v1::ReportStepRequest>("fuzz");
  v1::StepMetrics* m = r.mutable_metrics();
  m->set_step(step);
  m->set_loss(5.5 - 0.1 * static_cast<double>(step));
  m->set_grad_norm(1.5);
  m->set_lr(1e-3);
  m->set_tokens_per_s(12000);
  m->set_step_time_s(0.25);
  m->set_recipe_version(1);
  if (with_sites) {
    for (const char* layer : {"blocks.0.mlp.fc1", "blocks.0.attn.qkv"}) {
      v1::SiteStats* s = r.add_sites();
      s->set_layer(layer);
      s->set_tensor(v1::TENSOR_ROLE_WEIGHT);
      s->set_amax(3.5f);
      s->set_scale(128.0f);
      s->set_underflow_ratio(0.001);
      s->set_saturation_ratio(0.05);  // above the harness spec's threshold: health events
      s->set_expert(-1);
    }
    v1::CommBytes* c = r.add_comm();
    c->set_op("all_gather");
    c->set_dtype("fp8");
    c->set_bytes(1 << 20);
    v1::ExpertLoad* e = r.add_experts();
    e->set_layer("blocks.0.mlp");
    e->set_expert(0);
    e->set_tokens(100);
  }
  return r;
}

v1::AckShardRequest Ack(int64_t step, int rank) {
  v1::AckShardRequest r = WithRun<v1::AckShardRequest>("fuzz");
  r.set_step(step);
  r.set_rank(rank);
  r.set_file(ShardFileName(rank));
  // size and xxh64 left 0: the harness fills in those of the shard it wrote.
  r.set_data_position(4096);
  return r;
}

void MakeRequests(const fs::path& dir) {
  v1::HeartbeatRequest hb = WithRun<v1::HeartbeatRequest>("fuzz");
  hb.set_rank(1);
  hb.set_step(3);
  WriteSeed(dir, "heartbeat", Requests().Add(kHeartbeat, hb).bytes());
  WriteSeed(dir, "report-step", Requests().Add(kReportStep, Step(1, true)).bytes());

  v1::BeginCheckpointRequest begin = WithRun<v1::BeginCheckpointRequest>("fuzz");
  begin.set_step(2);
  WriteSeed(dir, "checkpoint-commit",
            Requests()
                .Add(kReportStep, Step(2, false))
                .Add(kBeginCheckpoint, begin)
                .Add(kAckShard, Ack(2, 1))
                .Add(kAckShard, Ack(2, 0))
                .Add(kListCheckpoints, WithRun<v1::ListCheckpointsRequest>("fuzz"))
                .bytes());

  // Commit, restart the controller, and resume: rank 0 registers again with --resume.
  v1::RegisterRequest resume = WithRun<v1::RegisterRequest>("fuzz");
  resume.set_rank(0);
  resume.set_world_size(2);
  *resume.mutable_spec() = SmallRunSpec();  // the controller target's ValidSpec, less health
  resume.set_run_dir("/run");               // absolute: the harness puts it in its sandbox
  resume.set_hostname("node-0");
  resume.set_pid(4242);
  resume.set_resume(true);
  WriteSeed(dir, "commit-restart-resume",
            Requests()
                .Add(kBeginCheckpoint, begin)
                .Add(kAckShard, Ack(2, 0))
                .Add(kAckShard, Ack(2, 1))
                .Add(kRestart)
                .Add(kRegister, resume)
                .Add(kGetRun, WithRun<v1::GetRunRequest>("fuzz"))
                .bytes());

  // A new run of another id and world size, then its other rank.
  v1::RegisterRequest fresh = resume;
  fresh.set_run_id("exp-2.b_x");
  fresh.set_world_size(1);
  fresh.mutable_spec()->mutable_parallel()->set_dp(1);
  fresh.set_resume(false);
  WriteSeed(dir, "register-new-run", Requests().Add(kRegister, fresh).bytes());
  v1::RegisterRequest other = WithRun<v1::RegisterRequest>("fuzz");
  other.set_rank(1);
  other.set_world_size(2);
  WriteSeed(dir, "register-rank-1", Requests().Add(kRegister, other).bytes());

  // Tokens for the registered run and for one not registered yet, kept across a restart.
  WriteSeed(dir, "run-tokens-restart",
            Requests()
                .Add(kCreateRunToken, WithRun<v1::CreateRunTokenRequest>("fuzz"))
                .Add(kCreateRunToken, WithRun<v1::CreateRunTokenRequest>("later-run"))
                .Add(kRestart)
                .Add(kCreateRunToken, WithRun<v1::CreateRunTokenRequest>("fuzz"))
                .bytes());
  WriteSeed(dir, "run-token-bad-id",
            Requests().Add(kCreateRunToken, WithRun<v1::CreateRunTokenRequest>("../x")).bytes());

  v1::UpdateRecipeRequest update = WithRun<v1::UpdateRecipeRequest>("fuzz");
  v1::Recipe* recipe = update.mutable_recipe();
  recipe->set_scaling(v1::RunSpec::Precision::SCALING_CURRENT);
  recipe->set_amax_history_len(32);
  recipe->set_amax_compute_algo(v1::RunSpec::Precision::AMAX_COMPUTE_ALGO_MOST_RECENT);
  recipe->set_margin(1);
  recipe->set_fsdp_gather(v1::RunSpec::Precision::FSDP_GATHER_BF16);
  recipe->set_grad_reduce(v1::RunSpec::Precision::GRAD_REDUCE_BF16);
  recipe->add_exclude("blocks.0.mlp.fc2");
  recipe->add_exclude("lm_head");
  update.set_reason("fuzz seed");
  v1::ReportStepRequest applied = Step(5, false);
  applied.set_recipe_applied_step(5);
  applied.mutable_metrics()->set_recipe_version(2);
  WriteSeed(dir, "update-recipe",
            Requests()
                .Add(kUpdateRecipe, update)
                .Add(kGetRecipe, WithRun<v1::GetRecipeRequest>("fuzz"))
                .Add(kReportStep, applied)
                .bytes());

  WriteSeed(dir, "stop-save-watch",
            Requests()
                .Add(kSaveCheckpoint, WithRun<v1::SaveCheckpointRequest>("fuzz"))
                .Add(kStopRun, WithRun<v1::StopRunRequest>("fuzz"))
                .Add(kHeartbeat, hb)
                .Add(kWatchEvents, WithRun<v1::WatchEventsRequest>("fuzz"))
                .Add(kGetLayers, WithRun<v1::GetLayersRequest>("fuzz"))
                .Add(kListRuns)
                .bytes());

  v1::ReportStepRequest finish = Step(10, true);
  finish.mutable_metrics()->set_skipped(true);
  WriteSeed(dir, "finish-run", Requests().Add(kReportStep, finish).bytes());

  // One step from valid.
  v1::HeartbeatRequest bad_rank = hb;
  bad_rank.set_rank(2);
  WriteSeed(dir, "heartbeat-bad-rank", Requests().Add(kHeartbeat, bad_rank).bytes());
  WriteSeed(dir, "unknown-run",
            Requests().Add(kGetRun, WithRun<v1::GetRunRequest>("nope")).bytes());
  WriteSeed(dir, "bad-run-id",
            Requests().Add(kGetRun, WithRun<v1::GetRunRequest>("Fuzz/..")).bytes());
  v1::AckShardRequest bad_file = Ack(2, 1);
  bad_file.set_file("rank-00000.shard");
  WriteSeed(dir, "ack-wrong-file",
            Requests().Add(kBeginCheckpoint, begin).Add(kAckShard, bad_file).bytes());
  v1::RegisterRequest relative = resume;
  relative.set_run_dir("runs/x");
  WriteSeed(dir, "register-relative-dir", Requests().Add(kRegister, relative).bytes());

  // Issue 19's classes of input validation, one seed each: a name over the length cap, an enum
  // number the proto does not define, a step past kMaxStep (then a recipe, which is scheduled at
  // latest step + lead), and a long file name that the error quotes by its prefix.
  v1::UpdateRecipeRequest long_name = update;
  long_name.mutable_recipe()->add_exclude(std::string(300, 'L'));
  WriteSeed(dir, "recipe-long-exclude", Requests().Add(kUpdateRecipe, long_name).bytes());
  v1::UpdateRecipeRequest bad_enum = update;
  bad_enum.mutable_recipe()->set_scaling(static_cast<v1::RunSpec::Precision::Scaling>(99));
  WriteSeed(dir, "recipe-undefined-enum", Requests().Add(kUpdateRecipe, bad_enum).bytes());
  v1::HeartbeatRequest huge_step = hb;
  huge_step.set_step(std::numeric_limits<int64_t>::max());
  WriteSeed(dir, "heartbeat-huge-step",
            Requests().Add(kHeartbeat, huge_step).Add(kUpdateRecipe, update).bytes());
  v1::AckShardRequest long_file = Ack(2, 0);
  long_file.set_file(std::string(300, 'f'));
  WriteSeed(dir, "ack-long-file",
            Requests().Add(kBeginCheckpoint, begin).Add(kAckShard, long_file).bytes());
}

// ---------------------------------------------------------------------------------------------
// Hugging Face weights and config.json (hf_fuzzer: a selector byte, then the file).

void MakeHf(const fs::path& dir, const fs::path& scratch) {
  static const char* const kNames[] = {"gpt2", "llama", "llama-tied", "mixtral"};
  for (int kind = 0; kind < 4; ++kind) {
    const model::ModelShape shape = HfFuzzShape(kind);
    const auto shapes = test::HfParamShapes(shape);
    model::LogicalParams params;
    float next = 0.0f;
    for (const auto& [name, ls] : shapes) {
      std::vector<float>& v = params[name];
      for (int64_t i = 0; i < ls.rows * ls.cols; ++i) v.push_back(next += 0.125f);
    }
    absl::StatusOr<std::vector<model::HfTensor>> tensors =
        model::ToHuggingFace(shape, shapes, params);
    Check(tensors.status());
    // As save_pretrained writes them, and (GPT-2) as GPT2Model's, names without "transformer.".
    for (const bool base : {false, true}) {
      if (base && kind != 0) continue;
      std::vector<SafetensorsWriteTensor> write;
      for (const model::HfTensor& t : *tensors) {
        std::string name = t.name;
        if (base && absl::StartsWith(name, "transformer.")) name = name.substr(12);
        write.push_back({.name = name, .shape = t.shape, .data = t.values.data()});
      }
      const std::string path = (scratch / "model.safetensors").string();
      Check(WriteSafetensors(path, write, {{"format", "pt"}}));
      WriteSeed(dir, std::string(kNames[kind]) + (base ? "-base" : "") + ".safetensors",
                std::string(1, static_cast<char>(kind)) + ReadAll(path));
    }
    absl::StatusOr<std::string> config = model::HfConfigJson(shape, "float32");
    Check(config.status());
    WriteSeed(dir, std::string(kNames[kind]) + "-config.json",
              std::string(1, static_cast<char>(kind | 4)) + *config);
  }
}

}  // namespace
}  // namespace fp8rt::fuzz

int main(int argc, char** argv) {
  using namespace fp8rt::fuzz;
  if (argc != 2) {
    std::fprintf(stderr, "usage: %s CORPUS_DIR (tests/fuzz/corpus)\n", argv[0]);
    return 2;
  }
  const fs::path corpus = argv[1];
  std::error_code ec;
  const fs::path scratch = fs::temp_directory_path() / "fp8rt-make-fuzz-corpus";
  fs::remove_all(scratch, ec);
  fs::create_directories(scratch);
  MakeShards(corpus / "shard_fuzzer", scratch);
  MakeManifests(corpus / "manifest_fuzzer", scratch);
  MakeRequests(corpus / "controller_rpc_fuzzer");
  MakeHf(corpus / "hf_fuzzer", scratch);
  fs::remove_all(scratch, ec);
  return 0;
}
