// Helpers shared by the fuzz targets of tests/fuzz (see README.md there).
//
// Defines:
//   FUZZ_CHECK(cond)       aborts with the condition and a message when a harness invariant
//                          fails, so libFuzzer records the input as a crash.
//   QuietProtobuf()        drops protobuf's log lines (a parse of random bytes logs one for
//                          each invalid UTF-8 string, which would bury the fuzzer's output).
//   FixShardChecksums      rewrites the checksums of shard-format bytes (runtime/core/
//                          checkpoint_io.h) so that mutated bytes still pass them.
//   FP8RT_FUZZ_QUIET_PROTOBUF_INIT()  defines LLVMFuzzerInitialize to call QuietProtobuf().
//   ToBytes(data, size)    a copy of libFuzzer's input as std::byte.
//   SmallRunSpec()         the small valid run spec of the controller target and its seeds.
//   HfFuzzShape(k)         hf_fuzzer's models: k 0 GPT-2, 1 Llama, 2 Llama tied, 3 Mixtral (2
//                          experts), each 1 block of d_model 4, 2 heads, d_ff 4, vocab 4.
//
// Why FixShardChecksums: a shard file stores an XXH64 per section and one over the whole body,
// and a random mutation almost never keeps them right, so a fuzzer fed only raw bytes would test
// little past the first checksum. The shard and manifest targets parse each input twice: as it
// is (the checksum checks themselves) and after this fix-up (everything behind them).
#ifndef FP8RT_TESTS_FUZZ_FUZZ_SUPPORT_H_
#define FP8RT_TESTS_FUZZ_FUZZ_SUPPORT_H_

#include <xxhash.h>

#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <vector>

#include "fp8rt/v1/control.pb.h"
#include "google/protobuf/stubs/logging.h"
#include "runtime/spec/run_spec.h"
#include "tests/support/hf_test_shapes.h"

#define FUZZ_CHECK(cond, ...)                                                            \
  do {                                                                                   \
    if (!(cond)) {                                                                       \
      std::fprintf(stderr, "%s:%d: FUZZ_CHECK(%s) failed: ", __FILE__, __LINE__, #cond); \
      std::fprintf(stderr, __VA_ARGS__);                                                 \
      std::fprintf(stderr, "\n");                                                        \
      std::abort();                                                                      \
    }                                                                                    \
  } while (false)

// Defines libFuzzer's LLVMFuzzerInitialize for a target that parses protobuf messages.
#define FP8RT_FUZZ_QUIET_PROTOBUF_INIT()               \
  extern "C" int LLVMFuzzerInitialize(int*, char***) { \
    fp8rt::fuzz::QuietProtobuf();                      \
    return 0;                                          \
  }

namespace fp8rt::fuzz {

inline void QuietProtobuf() { google::protobuf::SetLogHandler(nullptr); }

inline std::vector<std::byte> ToBytes(const uint8_t* data, size_t size) {
  return std::vector<std::byte>(reinterpret_cast<const std::byte*>(data),
                                reinterpret_cast<const std::byte*>(data) + size);
}

// A 1-layer model on dp 2 (world 2), 10 steps, a checkpoint every 2 steps keeping 2. data.path
// is "data.txt", which the controller never opens.
inline v1::RunSpec SmallRunSpec() {
  v1::RunSpec spec = RunSpecDefaults();
  auto* model = spec.mutable_model();
  model->set_layers(1);
  model->set_d_model(128);
  model->set_heads(4);
  model->set_d_ff(256);
  model->set_seq_len(16);
  model->set_vocab(256);
  spec.mutable_parallel()->set_dp(2);
  spec.mutable_train()->set_steps(10);
  spec.mutable_data()->set_path("data.txt");
  spec.mutable_checkpoint()->set_every(2);
  spec.mutable_checkpoint()->set_keep(2);
  return spec;
}

inline uint64_t LoadLe(const std::byte* p, int bytes) {
  uint64_t v = 0;
  for (int i = 0; i < bytes; ++i) v |= static_cast<uint64_t>(p[i]) << (8 * i);
  return v;
}

inline void StoreLe64(std::byte* p, uint64_t v) {
  for (int i = 0; i < 8; ++i) p[i] = static_cast<std::byte>((v >> (8 * i)) & 0xff);
}

// Walks `data` as a version 1 shard (magic and version are not checked: the parser's job) and
// stores the right XXH64 in every section whose header and bytes fit before the trailer, then the
// right trailer. Stops at the first section that does not fit, leaving the rest as it was. Written
// from the format in checkpoint_io.h, independently of the parser under test.
inline void FixShardChecksums(std::vector<std::byte>& data) {
  constexpr uint64_t kHeader = 16;
  constexpr uint64_t kTrailer = 8;
  const uint64_t n = data.size();
  if (n < kHeader + kTrailer) return;
  const uint64_t body_end = n - kTrailer;
  const uint64_t count = LoadLe(&data[12], 4);
  uint64_t pos = kHeader;
  for (uint64_t i = 0; i < count; ++i) {
    if (body_end - pos < 4) break;
    const uint64_t name_len = LoadLe(&data[pos], 4);
    if (name_len > body_end - pos - 4) break;
    pos += 4 + name_len;
    if (body_end - pos < 16) break;
    const uint64_t length = LoadLe(&data[pos], 8);
    if (length > body_end - pos - 16) break;
    StoreLe64(&data[pos + 8], XXH64(&data[pos + 16], length, 0));
    pos += 16 + length;
  }
  StoreLe64(&data[body_end], XXH64(data.data(), body_end, 0));
}

// hf_fuzzer's models (the three architectures of hf_test_shapes.h, shrunk so that a whole
// checkpoint fits a 4096-byte input): kind 0 GPT-2, 1 Llama, 2 Llama with tied embeddings, 3
// Mixtral with 2 experts.
inline model::ModelShape HfFuzzShape(int kind) {
  model::ModelShape s = kind == 0   ? test::HfGpt2Shape()
                        : kind == 3 ? test::HfMixtralShape(2)
                                    : test::HfLlamaShape(kind == 2);
  s.layers = 1;
  s.d_model = 4;
  s.heads = 2;
  s.kv_heads = kind == 0 ? 0 : 1;
  s.d_ff = 4;
  s.seq_len = 4;
  s.vocab = 4;
  if (kind == 0) s.max_positions = 4;
  return s;
}

}  // namespace fp8rt::fuzz

#endif  // FP8RT_TESTS_FUZZ_FUZZ_SUPPORT_H_
