// `fp8rt quantize` as a user runs it: the fp8rt binary (which execs fp8rt-quantize) on .npy files.
// Expected figures are recomputed here from the input and from the written outputs (codes and
// dequantized values), using NVIDIA's cuda_fp8.h decoder where available as the reference for
// FP8 values; nothing is compared with captured output.
#include <sys/wait.h>

#include <cmath>
#include <cstdio>
#include <filesystem>
#include <random>
#include <string>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "nlohmann/json.hpp"
#include "runtime/core/npy.h"

#ifdef FP8RT_HAVE_CUDA_FP8_H
#include <cuda_fp8.h>
#endif

namespace fp8rt {
namespace {

namespace fs = std::filesystem;
using ::testing::HasSubstr;

struct Result {
  int exit_code = -1;
  std::string out;  // stdout
  std::string err;  // stderr
};

Result RunFp8rt(const std::string& args) {
  const fs::path dir = fs::path(::testing::TempDir()) / "quantize_cli";
  fs::create_directories(dir);
  const std::string err_file = (dir / "stderr.txt").string();
  const std::string cmd = std::string(FP8RT_BIN_DIR) + "/fp8rt quantize " + args + " 2>" + err_file;
  Result r;
  FILE* pipe = popen(cmd.c_str(), "r");
  char buf[4096];
  size_t n;
  while ((n = fread(buf, 1, sizeof(buf), pipe)) > 0) r.out.append(buf, n);
  const int status = pclose(pipe);
  r.exit_code = WIFEXITED(status) ? WEXITSTATUS(status) : -1;
  FILE* ef = fopen(err_file.c_str(), "r");
  while (ef != nullptr && (n = fread(buf, 1, sizeof(buf), ef)) > 0) r.err.append(buf, n);
  if (ef != nullptr) fclose(ef);
  return r;
}

std::string TempPath(const std::string& name) {
  const fs::path dir = fs::path(::testing::TempDir()) / "quantize_cli";
  fs::create_directories(dir);
  return (dir / name).string();
}

// Heavy-tailed data: normal values, a few outliers, a band of tiny values.
std::vector<float> MakeData(int64_t n, uint32_t seed) {
  std::mt19937 gen(seed);
  std::normal_distribution<float> dist(0.0f, 1.0f);
  std::vector<float> x(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) {
    float v = dist(gen);
    if (i % 97 == 0) v *= 50.0f;
    if (i % 5 == 1) v *= 1e-4f;
    x[static_cast<size_t>(i)] = v;
  }
  return x;
}

// Value of an E4M3 code from the OCP definition (bias 7, S.1111.111 is NaN).
double E4M3Value(uint8_t c) {
  const int e = (c >> 3) & 0xF, m = c & 7;
  if ((c & 0x7F) == 0x7F) return NAN;
  const double mag = e == 0 ? std::ldexp(m, -9) : std::ldexp(8 + m, e - 10);
  return (c & 0x80) ? -mag : mag;
}

TEST(QuantizeCliTest, JsonReportMatchesTheWrittenOutputs) {
  const int64_t rows = 64, cols = 300;
  const std::vector<float> x = MakeData(rows * cols, 7);
  const std::string in = TempPath("in.npy"), deq = TempPath("deq.npy"),
                    codes = TempPath("codes.npy");
  const int64_t shape[] = {rows, cols};
  ASSERT_TRUE(WriteNpy(in, NpyDtype::kF32, shape, x.data()).ok());

  Result r = RunFp8rt(in + " --json --out " + deq + " --codes " + codes);
  ASSERT_EQ(r.exit_code, 0) << r.err;
  const auto j = nlohmann::json::parse(r.out);  // exactly one JSON object on stdout
  for (const char* key : {"format", "granularity", "amax", "scale", "rel_rms_error",
                          "underflow_ratio", "subnormal_ratio", "saturated", "nonfinite"}) {
    EXPECT_TRUE(j.contains(key)) << key;
  }
  EXPECT_EQ(j["format"], "e4m3");
  EXPECT_EQ(j["granularity"], "tensor");

  float amax = 0.0f;
  for (float v : x) amax = std::max(amax, std::fabs(v));
  EXPECT_EQ(j["amax"].get<float>(), amax);
  EXPECT_EQ(j["scale"].get<float>(), 448.0f / amax);  // DESIGN.md: fp8_max / amax / 2^0

  auto c = ReadNpy(codes);
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->dtype, NpyDtype::kU8);
  EXPECT_EQ(c->shape, (std::vector<int64_t>{rows, cols}));
  auto d = ReadNpyAsFloatMatrix(deq);
  ASSERT_TRUE(d.ok()) << d.status();
  ASSERT_EQ(d->rows, rows);
  ASSERT_EQ(d->cols, cols);

  const float scale_inv = j["scale_inv"].get<float>();
  int64_t underflow = 0, subnormal = 0;
  double err2 = 0.0, ref2 = 0.0;
  for (size_t i = 0; i < x.size(); ++i) {
    const uint8_t code = static_cast<uint8_t>(c->data[i]);
#ifdef FP8RT_HAVE_CUDA_FP8_H
    const __half_raw h = __nv_cvt_fp8_to_halfraw(code, __NV_E4M3);
    const double value = static_cast<double>(static_cast<float>(__half(h)));
    ASSERT_EQ(value, E4M3Value(code));
#else
    const double value = E4M3Value(code);
#endif
    // The dequantized output is the decoded code times scale_inv, in FP32.
    ASSERT_EQ(d->values[i], static_cast<float>(value) * scale_inv) << i;
    underflow += (x[i] != 0.0f && (code & 0x7F) == 0);
    subnormal += ((code & 0x78) == 0 && (code & 0x07) != 0);
    err2 += (d->values[i] - static_cast<double>(x[i])) * (d->values[i] - static_cast<double>(x[i]));
    ref2 += static_cast<double>(x[i]) * x[i];
  }
  const double n = static_cast<double>(x.size());
  EXPECT_GT(underflow, 0);  // the data was built to underflow
  EXPECT_DOUBLE_EQ(j["underflow_ratio"].get<double>(), underflow / n);
  EXPECT_DOUBLE_EQ(j["subnormal_ratio"].get<double>(), subnormal / n);
  EXPECT_NEAR(j["rel_rms_error"].get<double>(), std::sqrt(err2 / ref2), 1e-12);
  EXPECT_EQ(j["saturated"].get<int64_t>(), 0);  // scale from amax never saturates
  EXPECT_EQ(j["nonfinite"].get<int64_t>(), 0);
}

TEST(QuantizeCliTest, FixedScaleSaturatesWhatExceedsTheFormat) {
  const std::vector<float> x = MakeData(4096, 11);
  const std::string in = TempPath("fixed.npy");
  const int64_t shape[] = {4096};
  ASSERT_TRUE(WriteNpy(in, NpyDtype::kF32, shape, x.data()).ok());
  const float s = 1024.0f;
  Result r = RunFp8rt(in + " --scale 1024 --format e5m2 --json");
  ASSERT_EQ(r.exit_code, 0) << r.err;
  const auto j = nlohmann::json::parse(r.out);
  EXPECT_EQ(j["scale"].get<float>(), s);
  EXPECT_EQ(j["shape"], nlohmann::json::array({4096}));
  int64_t saturated = 0;
  // E5M2 values from 61440 = 57344 + half an ulp up round past the maximum and are clamped.
  for (float v : x) saturated += std::fabs(v * s) >= 61440.0f;
  EXPECT_GT(saturated, 0);
  EXPECT_EQ(j["saturated"].get<int64_t>(), saturated);
}

TEST(QuantizeCliTest, OneDimensionalInputKeepsItsShape) {
  const std::vector<float> x = MakeData(1000, 3);
  const std::string in = TempPath("vec.npy"), deq = TempPath("vec_deq.npy");
  const int64_t shape[] = {1000};
  ASSERT_TRUE(WriteNpy(in, NpyDtype::kF32, shape, x.data()).ok());
  Result r = RunFp8rt(in + " --granularity mx32 --out " + deq);
  ASSERT_EQ(r.exit_code, 0) << r.err;
  EXPECT_THAT(r.out, HasSubstr("granularity mx32"));  // the readable report
  auto d = ReadNpy(deq);
  ASSERT_TRUE(d.ok()) << d.status();
  EXPECT_EQ(d->shape, (std::vector<int64_t>{1000}));
  EXPECT_EQ(d->dtype, NpyDtype::kF32);
}

TEST(QuantizeCliTest, EveryGranularityAndFormatRuns) {
  const std::vector<float> x = MakeData(130 * 257, 5);
  const std::string in = TempPath("grid.npy");
  const int64_t shape[] = {130, 257};
  ASSERT_TRUE(WriteNpy(in, NpyDtype::kF32, shape, x.data()).ok());
  for (const char* format : {"e4m3", "e5m2"}) {
    double tensor_err = 0.0;
    for (const char* g : {"tensor", "row", "1x128", "128x128", "mx32"}) {
      Result r = RunFp8rt(in + " --json --format " + format + " --granularity " + g);
      ASSERT_EQ(r.exit_code, 0) << format << " " << g << ": " << r.err;
      const auto j = nlohmann::json::parse(r.out);
      EXPECT_EQ(j["granularity"], g);
      const double err = j["rel_rms_error"].get<double>();
      // E4M3 keeps 3 mantissa bits, E5M2 2: the relative rounding error of one value is at
      // most 2^-4 or 2^-3; with underflow of tiny values it stays below these bounds.
      EXPECT_LT(err, std::string(format) == "e4m3" ? 0.0625 : 0.125) << format << " " << g;
      if (std::string(g) == "tensor") tensor_err = err;
      if (std::string(g) == "1x128") {
        EXPECT_LE(err, tensor_err);  // finer scales are never worse on this data
      }
    }
  }
}

TEST(QuantizeCliTest, BadInputIsAClearErrorWithExitCode2) {
  const std::string missing = TempPath("does_not_exist.npy");
  Result r = RunFp8rt(missing);
  EXPECT_EQ(r.exit_code, 2);
  EXPECT_THAT(r.err, HasSubstr(missing));

  // A truncated file: the header promises more data than there is.
  const std::vector<float> x(1000, 1.0f);
  const std::string good = TempPath("good.npy"), cut = TempPath("cut.npy");
  const int64_t shape[] = {1000};
  ASSERT_TRUE(WriteNpy(good, NpyDtype::kF32, shape, x.data()).ok());
  fs::copy_file(good, cut, fs::copy_options::overwrite_existing);
  fs::resize_file(cut, 500);
  r = RunFp8rt(cut);
  EXPECT_EQ(r.exit_code, 2);
  EXPECT_THAT(r.err, HasSubstr(cut));
  EXPECT_THAT(r.err, HasSubstr("truncated"));

  // Not a .npy file at all.
  const std::string text = TempPath("text.npy");
  FILE* f = fopen(text.c_str(), "w");
  fputs("hello, world\n", f);
  fclose(f);
  r = RunFp8rt(text);
  EXPECT_EQ(r.exit_code, 2);
  EXPECT_THAT(r.err, HasSubstr(text));

  // Unsupported dtype and rank.
  const std::vector<int32_t> ints(12, 3);
  const std::string i32 = TempPath("ints.npy"), cube = TempPath("cube.npy");
  const int64_t shape12[] = {12};
  ASSERT_TRUE(WriteNpy(i32, NpyDtype::kI32, shape12, ints.data()).ok());
  r = RunFp8rt(i32);
  EXPECT_EQ(r.exit_code, 2);
  EXPECT_THAT(r.err, HasSubstr("dtype"));
  const std::vector<float> c(8, 1.0f);
  const int64_t shape3[] = {2, 2, 2};
  ASSERT_TRUE(WriteNpy(cube, NpyDtype::kF32, shape3, c.data()).ok());
  r = RunFp8rt(cube);
  EXPECT_EQ(r.exit_code, 2);
  EXPECT_THAT(r.err, HasSubstr("2-D"));

  // Bad options name the option.
  r = RunFp8rt(good + " --scale 2 --granularity row");
  EXPECT_EQ(r.exit_code, 2);
  EXPECT_THAT(r.err, HasSubstr("--scale"));
  r = RunFp8rt(good + " --scale -1");
  EXPECT_EQ(r.exit_code, 2);
  EXPECT_THAT(r.err, HasSubstr("--scale"));
  r = RunFp8rt(good + " --format e3m4");
  EXPECT_EQ(r.exit_code, 2);
  EXPECT_THAT(r.err, HasSubstr("--format"));
  r = RunFp8rt(good + " --granularity 64x64");
  EXPECT_EQ(r.exit_code, 2);
  EXPECT_THAT(r.err, HasSubstr("--granularity"));
  // An output that cannot be written loses nothing and says which file.
  r = RunFp8rt(good + " --out /nonexistent-dir/deq.npy");
  EXPECT_EQ(r.exit_code, 2);
  EXPECT_THAT(r.err, HasSubstr("/nonexistent-dir/deq.npy"));
}

TEST(QuantizeCliTest, NonFiniteInputsAreCountedAndReported) {
  std::vector<float> x = MakeData(512, 9);
  x[3] = NAN;
  x[100] = INFINITY;
  const std::string in = TempPath("nan.npy");
  const int64_t shape[] = {512};
  ASSERT_TRUE(WriteNpy(in, NpyDtype::kF32, shape, x.data()).ok());
  Result r = RunFp8rt(in + " --json --granularity 1x128");
  ASSERT_EQ(r.exit_code, 0) << r.err;
  const auto j = nlohmann::json::parse(r.out);
  EXPECT_EQ(j["nonfinite"].get<int64_t>(), 2);
  EXPECT_EQ(j["amax"], "nan");  // a NaN anywhere makes the amax NaN
}

}  // namespace
}  // namespace fp8rt
