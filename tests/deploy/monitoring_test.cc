// deploy/prometheus and the queries of deploy/grafana against the real thing: promtool on the
// rules and their unit tests, then a real fp8rt-controller fed a run by a fake worker over gRPC
// (register, heartbeats, steps with FP8 statistics of several sites, a skipped step, a
// validation loss every other step, collective bytes, a committed checkpoint), scraped by a real
// Prometheus (started on loopback with a temp TSDB) running deploy/prometheus/prometheus.yml with
// its rules:
//   - Prometheus loads rules.yml and evaluates every rule without error;
//   - every PromQL expression of rules.yml and of the dashboard (panels, annotations, variable
//     queries) parses (HTTP 200, status success), and every metric it names is in the
//     controller's scrape (`up`, which Prometheus writes for each target, excepted);
//   - every dashboard panel query returns series for the fed run, and the variable queries
//     return its run and layers.
// Expected names come from the scrape and docs/metrics.md's contract, not from the queries.
//
// Index:
//   helpers            files, processes, HTTP GET, the controller and the fake worker
//   PromQL helpers     metric names of an expression, Grafana variables substituted
//   tests              promtool, rules loaded, every expression evaluated
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <map>
#include <memory>
#include <set>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "fp8rt/v1/control.grpc.pb.h"
#include "gmock/gmock.h"
#include "grpcpp/grpcpp.h"
#include "gtest/gtest.h"
#include "nlohmann/json.hpp"
#include "runtime/checkpoint/checkpoint_dir.h"
#include "runtime/checkpoint/checkpoint_io.h"
#include "runtime/spec/run_spec.h"
#include "tests/support/test_support.h"
#include "yaml-cpp/yaml.h"

namespace fp8rt {
namespace {

namespace fs = std::filesystem;
using Json = nlohmann::json;
using ::testing::HasSubstr;

const std::string kBin = FP8RT_BIN_DIR;
const std::string kSource = FP8RT_SOURCE_DIR;
const fs::path kPrometheusDir = fs::path(kSource) / "deploy" / "prometheus";
const fs::path kDashboard = fs::path(kSource) / "deploy" / "grafana" / "dashboards" / "fp8rt.json";
constexpr char kToken[] = "monitoring-test-token-0123456789";
constexpr char kRun[] = "mon";

using test::FreePort;
using test::ReadFile;
using Process = test::ChildProcess;

bool Installed(const std::string& program) {
  return std::system(("command -v " + program + " > /dev/null 2>&1").c_str()) == 0;
}

// Runs a shell command; its exit status and output (stdout and stderr).
int Shell(const std::string& cmd, std::string* output) {
  FILE* pipe = popen((cmd + " 2>&1").c_str(), "r");
  if (pipe == nullptr) return -1;
  char buf[4096];
  size_t n;
  output->clear();
  while ((n = fread(buf, 1, sizeof(buf), pipe)) > 0) output->append(buf, n);
  const int status = pclose(pipe);
  return WIFEXITED(status) ? WEXITSTATUS(status) : -1;
}

std::string UrlEncode(const std::string& s) {
  std::string out;
  char hex[4];
  for (unsigned char c : s) {
    if (std::isalnum(c) || c == '-' || c == '_' || c == '.' || c == '~') {
      out += static_cast<char>(c);
    } else {
      std::snprintf(hex, sizeof(hex), "%%%02X", c);
      out += hex;
    }
  }
  return out;
}

struct HttpResponse {
  int status = 0;  // 0: no connection
  std::string body;
};

// GET http://<host:port><target> over a plain socket (HTTP/1.0: the server closes).
HttpResponse Get(const std::string& address, const std::string& target) {
  HttpResponse r;
  const size_t colon = address.rfind(':');
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_port = htons(static_cast<uint16_t>(std::stoi(address.substr(colon + 1))));
  inet_pton(AF_INET, address.substr(0, colon).c_str(), &addr.sin_addr);
  const int fd = socket(AF_INET, SOCK_STREAM, 0);
  if (connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0) {
    close(fd);
    return r;
  }
  const std::string request = "GET " + target + " HTTP/1.0\r\nHost: " + address + "\r\n\r\n";
  if (write(fd, request.data(), request.size()) != static_cast<ssize_t>(request.size())) {
    close(fd);
    return r;
  }
  std::string response;
  char buf[8192];
  ssize_t n;
  while ((n = read(fd, buf, sizeof(buf))) > 0) response.append(buf, static_cast<size_t>(n));
  close(fd);
  const size_t space = response.find(' ');
  const size_t body = response.find("\r\n\r\n");
  if (space == std::string::npos || body == std::string::npos) return r;
  r.status = std::atoi(response.c_str() + space + 1);
  r.body = response.substr(body + 4);
  return r;
}

// ---------------------------------------------------------------------------------------------
// The fake worker: rank 0 and rank 1 of a world-2 run, over the controller's gRPC API.

std::unique_ptr<grpc::ClientContext> Ctx() { return test::BearerContext(kToken); }

v1::SiteStats Site(const std::string& layer, v1::TensorRole role, float amax, double underflow,
                   double saturation, int64_t expert = -1) {
  v1::SiteStats s;
  s.set_layer(layer);
  s.set_tensor(role);
  s.set_amax(amax);
  s.set_scale(448.0f / amax);
  s.set_underflow_ratio(underflow);
  s.set_saturation_ratio(saturation);
  s.set_expert(expert);
  return s;
}

// Registers the run, reports steps 1..steps (step 3 skipped) with FP8 statistics and collective
// bytes, and commits a checkpoint of step 2 acknowledged by both ranks.
void FeedRun(v1::Control::Stub& control, const fs::path& run_dir, int64_t steps) {
  v1::RunSpec spec = test::TinyModelSpec();
  spec.mutable_parallel()->set_dp(2);
  spec.mutable_train()->set_steps(1000);
  spec.mutable_data()->set_path("/only/on/the/workers.txt");
  for (int rank = 0; rank < 2; ++rank) {
    v1::RegisterRequest req;
    req.set_run_id(kRun);
    req.set_rank(rank);
    req.set_world_size(2);
    if (rank == 0) *req.mutable_spec() = spec;
    req.set_run_dir(run_dir.string());
    req.set_hostname("fake-worker");
    req.set_pid(1000 + rank);
    v1::RegisterResponse resp;
    const grpc::Status s = control.Register(Ctx().get(), req, &resp);
    ASSERT_TRUE(s.ok()) << "rank " << rank << ": " << s.error_message();
  }
  for (int64_t step = 1; step <= steps; ++step) {
    v1::ReportStepRequest req;
    req.set_run_id(kRun);
    auto* sm = req.mutable_metrics();
    const bool skipped = step == 3;
    sm->set_step(step);
    sm->set_loss(5.0 - 0.1 * static_cast<double>(step));
    sm->set_grad_norm(skipped ? std::nan("") : 1.25);
    sm->set_lr(1e-3);
    sm->set_tokens_per_s(1000.0 + static_cast<double>(step));
    sm->set_skipped(skipped);
    sm->set_step_time_s(0.5);
    sm->set_recipe_version(1);
    if (step % 2 == 0) sm->set_val_loss(5.2 - 0.1 * static_cast<double>(step));  // eval.every 2
    for (const v1::SiteStats& s :
         {Site("blocks.0.attn.qkv", v1::TENSOR_ROLE_INPUT, 3.0f, 0.001, 0.0),
          Site("blocks.0.mlp.fc1", v1::TENSOR_ROLE_WEIGHT, 0.5f, 0.0, 0.0),
          Site("blocks.0.mlp.fc1", v1::TENSOR_ROLE_GRAD_OUTPUT, 1e-4f, 0.2, 0.002),
          Site("blocks.1.mlp.fc2", v1::TENSOR_ROLE_GRAD_OUTPUT, 2e-4f, 0.1, 0.0, 1),
          Site("lm_head", v1::TENSOR_ROLE_INPUT, 8.0f, 0.0, 0.0005)}) {
      *req.add_sites() = s;
    }
    for (const auto& [op, dtype] : std::vector<std::pair<std::string, std::string>>{
             {"all_gather", "fp8"}, {"reduce_scatter", "f32"}, {"all_reduce", "f32"}}) {
      auto* c = req.add_comm();
      c->set_op(op);
      c->set_dtype(dtype);
      c->set_bytes(1000 * step);  // cumulative since the workers started
    }
    v1::ReportStepResponse resp;
    const grpc::Status s = control.ReportStep(Ctx().get(), req, &resp);
    ASSERT_TRUE(s.ok()) << "step " << step << ": " << s.error_message();
  }
  // A checkpoint of step 2: both ranks write a shard and acknowledge it.
  v1::BeginCheckpointRequest begin;
  begin.set_run_id(kRun);
  begin.set_step(2);
  v1::BeginCheckpointResponse begun;
  const grpc::Status s = control.BeginCheckpoint(Ctx().get(), begin, &begun);
  ASSERT_TRUE(s.ok()) << s.error_message();
  bool committed = false;
  for (int rank = 0; rank < 2; ++rank) {
    ShardWriter writer;
    std::vector<std::byte> bytes(512 + rank, std::byte{7});
    ASSERT_TRUE(writer.Add("master/blocks.0.mlp.fc1", bytes).ok());
    const auto written = writer.Write((fs::path(begun.temp_dir()) / ShardFileName(rank)).string());
    ASSERT_TRUE(written.ok()) << written.status();
    v1::AckShardRequest ack;
    ack.set_run_id(kRun);
    ack.set_step(2);
    ack.set_rank(rank);
    ack.set_file(ShardFileName(rank));
    ack.set_size(written->size);
    ack.set_xxh64(written->xxh64);
    v1::AckShardResponse acked;
    const grpc::Status a = control.AckShard(Ctx().get(), ack, &acked);
    ASSERT_TRUE(a.ok()) << a.error_message();
    committed = acked.committed();
  }
  ASSERT_TRUE(committed);
}

void Heartbeats(v1::Control::Stub& control, int64_t step) {
  for (int rank = 0; rank < 2; ++rank) {
    v1::HeartbeatRequest req;
    req.set_run_id(kRun);
    req.set_rank(rank);
    req.set_step(step);
    v1::HeartbeatResponse resp;
    (void)control.Heartbeat(Ctx().get(), req, &resp);
  }
}

// ---------------------------------------------------------------------------------------------
// PromQL helpers.

// Names of the metrics an expression selects: identifiers outside strings, label matchers,
// ranges and label lists (by/without/on/ignoring/group_*), that are not functions, aggregations,
// keywords or numbers. (A scanner, not std::regex: GCC 12's <regex> does not build warning-free
// under the sanitizers.)
std::set<std::string> MetricNames(const std::string& expr) {
  static const std::set<std::string> kLabelLists = {"by",       "without",    "on",
                                                    "ignoring", "group_left", "group_right"};
  static const std::set<std::string> kNotMetrics = {
      "and",    "or",   "unless",  "bool",         "offset",  "inf",   "nan",
      "sum",    "min",  "max",     "avg",          "group",   "count", "stddev",
      "stdvar", "topk", "bottomk", "count_values", "quantile"};
  const auto ident_start = [](char c) {
    return std::isalpha(static_cast<unsigned char>(c)) || c == '_' || c == ':';
  };
  const auto ident_char = [&](char c) {
    return ident_start(c) || std::isdigit(static_cast<unsigned char>(c));
  };
  std::set<std::string> names;
  const size_t n = expr.size();
  size_t i = 0;
  const auto skip_spaces = [&] {
    while (i < n && std::isspace(static_cast<unsigned char>(expr[i]))) ++i;
  };
  const auto skip_string = [&] {  // at a quote
    const char quote = expr[i++];
    while (i < n && expr[i] != quote) i += (expr[i] == '\\' && quote != '`') ? 2 : 1;
    ++i;
  };
  const auto skip_until = [&](char close) {  // at the opening character
    ++i;
    while (i < n && expr[i] != close) {
      if (expr[i] == '"' || expr[i] == '\'' || expr[i] == '`') {
        skip_string();
      } else {
        ++i;
      }
    }
    ++i;
  };
  while (i < n) {
    const char c = expr[i];
    if (c == '"' || c == '\'' || c == '`') {
      skip_string();
    } else if (c == '{') {
      skip_until('}');
    } else if (c == '[') {
      skip_until(']');
    } else if (std::isdigit(static_cast<unsigned char>(c)) || c == '.') {
      // A number (1, 0.001, 1e-9) or a duration (5m): digits, then letters, signs of exponents.
      while (i < n &&
             (std::isalnum(static_cast<unsigned char>(expr[i])) || expr[i] == '.' ||
              ((expr[i] == '-' || expr[i] == '+') && (expr[i - 1] == 'e' || expr[i - 1] == 'E')))) {
        ++i;
      }
    } else if (ident_start(c)) {
      const size_t begin = i;
      while (i < n && ident_char(expr[i])) ++i;
      const std::string name = expr.substr(begin, i - begin);
      skip_spaces();
      const bool call = i < n && expr[i] == '(';
      if (kLabelLists.contains(name)) {
        if (call) skip_until(')');
      } else if (name == "offset") {
        while (i < n && (std::isalnum(static_cast<unsigned char>(expr[i])) || expr[i] == '-')) ++i;
      } else if (!call && !kNotMetrics.contains(name)) {
        names.insert(name);
      }
    } else {
      ++i;
    }
  }
  return names;
}

// `label_values(SELECTOR, LABEL)` -> {SELECTOR, LABEL}; empty strings if it is not one.
std::pair<std::string, std::string> LabelValues(const std::string& query) {
  const std::string prefix = "label_values(";
  const size_t open = query.find(prefix);
  const size_t close = query.rfind(')');
  const size_t comma = query.rfind(',');
  if (open != 0 || close == std::string::npos || comma == std::string::npos || comma < open) {
    return {};
  }
  std::string label = query.substr(comma + 1, close - comma - 1);
  label.erase(0, label.find_first_not_of(' '));
  label.erase(label.find_last_not_of(' ') + 1);
  return {query.substr(prefix.size(), comma - prefix.size()), label};
}

// A query as Grafana sends it: the dashboard's variables and Grafana's own replaced.
std::string Substitute(std::string expr, const std::map<std::string, std::string>& values) {
  for (const auto& [name, value] : values) {
    for (const std::string& form : {"${" + name + "}", "$" + name}) {
      for (size_t at = expr.find(form); at != std::string::npos; at = expr.find(form, at)) {
        // $layer must not eat the start of $layers: only whole names.
        const size_t end = at + form.size();
        if (form[1] != '{' && end < expr.size() &&
            (std::isalnum(static_cast<unsigned char>(expr[end])) || expr[end] == '_')) {
          at = end;
          continue;
        }
        expr.replace(at, form.size(), value);
        at += value.size();
      }
    }
  }
  return expr;
}

struct PromQuery {
  std::string where;  // what it is, for messages
  std::string expr;
  bool expect_data;  // a panel query of the fed run must return series
};

// Every expression of rules.yml (expr) and of the dashboard (panel targets, annotation targets,
// variable queries as their label_values selector).
std::vector<PromQuery> AllQueries(std::map<std::string, std::string>* variable_queries) {
  std::vector<PromQuery> out;
  const YAML::Node rules = YAML::LoadFile((kPrometheusDir / "rules.yml").string());
  for (const YAML::Node& group : rules["groups"]) {
    for (const YAML::Node& rule : group["rules"]) {
      const std::string name =
          rule["alert"] ? rule["alert"].as<std::string>() : rule["record"].as<std::string>();
      out.push_back({"rules.yml " + name, rule["expr"].as<std::string>(), false});
    }
  }
  const Json dashboard = Json::parse(ReadFile(kDashboard));
  std::vector<Json> panels;
  for (const Json& p : dashboard["panels"]) {
    panels.push_back(p);
    if (p.contains("panels")) {
      for (const Json& q : p["panels"]) panels.push_back(q);
    }
  }
  for (const Json& p : panels) {
    if (!p.contains("targets")) continue;
    for (const Json& t : p["targets"]) {
      out.push_back(
          {"panel '" + p["title"].get<std::string>() + "' " + t["refId"].get<std::string>(),
           t["expr"].get<std::string>(), true});
    }
  }
  for (const Json& a : dashboard["annotations"]["list"]) {
    if (a.contains("target") && a["target"].contains("expr")) {
      out.push_back({"annotation '" + a["name"].get<std::string>() + "'",
                     a["target"]["expr"].get<std::string>(), false});
    }
  }
  for (const Json& v : dashboard["templating"]["list"]) {
    if (v["type"] != "query") continue;
    const std::string q = v["query"].is_string() ? v["query"].get<std::string>()
                                                 : v["query"]["query"].get<std::string>();
    const auto [selector, label] = LabelValues(q);
    EXPECT_FALSE(selector.empty() || label.empty()) << "variable " << v["name"] << ": " << q;
    if (selector.empty()) continue;
    out.push_back({"variable $" + v["name"].get<std::string>(), selector, true});
    (*variable_queries)[v["name"].get<std::string>()] = selector + "|" + label;
  }
  return out;
}

// ---------------------------------------------------------------------------------------------

class MonitoringTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    if (!Installed("prometheus") || !Installed("promtool")) return;  // each test skips
    char tmpl[] = "/tmp/fp8rt-monitoring-XXXXXX";
    dir_ = new fs::path(mkdtemp(tmpl));
    const fs::path token = *dir_ / "token";
    std::ofstream(token) << kToken << "\n";
    fs::permissions(token, fs::perms::owner_read | fs::perms::owner_write);

    // The controller on free ports; its ready file gives the addresses.
    const fs::path ready = *dir_ / "ready.json";
    controller_ = new Process({kBin + "/fp8rt-controller", "--token-file", token.string(),
                               "--state-dir", (*dir_ / "state").string(), "--listen", "127.0.0.1:0",
                               "--metrics-listen", "127.0.0.1:0", "--ready-file", ready.string()},
                              *dir_ / "controller.log");
    for (int i = 0; i < 400 && !fs::exists(ready); ++i) {
      std::this_thread::sleep_for(std::chrono::milliseconds(25));
    }
    if (!fs::exists(ready)) {
      setup_error_ = "fp8rt-controller did not start: " + ReadFile(*dir_ / "controller.log");
      return;
    }
    const Json j = Json::parse(ReadFile(ready));
    metrics_ = new std::string(j["metrics"].get<std::string>());
    auto channel =
        grpc::CreateChannel(j["grpc"].get<std::string>(), grpc::InsecureChannelCredentials());
    control_ = v1::Control::NewStub(channel).release();
    FeedRun(*control_, *dir_ / "runs" / kRun, 5);
    if (::testing::Test::HasFatalFailure()) {
      setup_error_ = "feeding the run failed";
      return;
    }

    // deploy/prometheus/prometheus.yml with the controller as target, 1 s intervals and the
    // rules file by absolute path: the rest (job name, metrics path) as shipped.
    YAML::Node config = YAML::LoadFile((kPrometheusDir / "prometheus.yml").string());
    config["global"]["scrape_interval"] = "1s";
    config["global"]["evaluation_interval"] = "1s";
    YAML::Node rule_files;
    for (const YAML::Node& f : config["rule_files"]) {
      rule_files.push_back((kPrometheusDir / f.as<std::string>()).string());
    }
    config["rule_files"] = rule_files;
    YAML::Node job = config["scrape_configs"][0];
    job["scrape_interval"] = "1s";
    job["scrape_timeout"] = "1s";
    YAML::Node targets;
    targets.push_back(*metrics_);
    job["static_configs"][0]["targets"] = targets;
    job_name_ = new std::string(job["job_name"].as<std::string>());
    const fs::path config_file = *dir_ / "prometheus.yml";
    std::ofstream(config_file) << YAML::Dump(config) << "\n";
    prometheus_address_ = new std::string("127.0.0.1:" + std::to_string(FreePort()));
    prometheus_ = new Process({"prometheus", "--config.file=" + config_file.string(),
                               "--storage.tsdb.path=" + (*dir_ / "tsdb").string(),
                               "--web.listen-address=" + *prometheus_address_},
                              *dir_ / "prometheus.log");

    // Ready once it has scraped the run's FP8 series at least 3 times (rate() needs two
    // samples) and evaluated the rules; heartbeats keep the ranks connected meanwhile.
    const auto end = std::chrono::steady_clock::now() + std::chrono::seconds(60);
    while (std::chrono::steady_clock::now() < end) {
      Heartbeats(*control_, 5);
      const HttpResponse r = Get(
          *prometheus_address_,
          "/api/v1/query?query=" + UrlEncode("count_over_time(fp8rt_fp8_scale{run=\"mon\"}[1m])"));
      if (r.status == 200) {
        const Json j2 = Json::parse(r.body, nullptr, false);
        if (!j2.is_discarded() && !j2["data"]["result"].empty() &&
            std::stod(j2["data"]["result"][0]["value"][1].get<std::string>()) >= 3) {
          return;
        }
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(250));
    }
    setup_error_ =
        "Prometheus did not scrape the controller: " + ReadFile(*dir_ / "prometheus.log");
  }

  static void TearDownTestSuite() {
    delete prometheus_;
    delete control_;
    delete controller_;
    if (dir_ != nullptr) fs::remove_all(*dir_);
    delete dir_;
    delete metrics_;
    delete prometheus_address_;
    delete job_name_;
  }

  void SetUp() override {
    if (!Installed("prometheus") || !Installed("promtool")) {
      GTEST_SKIP() << "prometheus/promtool not installed (Debian package prometheus; "
                      "scripts/bootstrap installs it)";
    }
    ASSERT_EQ(setup_error_, "");
  }

  // GET /api/v1/query; the parsed answer, empty if it was not JSON.
  static Json Evaluate(const std::string& expr, int* http_status) {
    const HttpResponse r = Get(*prometheus_address_, "/api/v1/query?query=" + UrlEncode(expr));
    *http_status = r.status;
    const Json j = Json::parse(r.body, nullptr, false);
    return j.is_discarded() ? Json::object() : j;
  }

  static fs::path* dir_;
  static Process* controller_;
  static Process* prometheus_;
  static v1::Control::Stub* control_;
  static std::string* metrics_;
  static std::string* prometheus_address_;
  static std::string* job_name_;
  static std::string setup_error_;
};

fs::path* MonitoringTest::dir_ = nullptr;
Process* MonitoringTest::controller_ = nullptr;
Process* MonitoringTest::prometheus_ = nullptr;
v1::Control::Stub* MonitoringTest::control_ = nullptr;
std::string* MonitoringTest::metrics_ = nullptr;
std::string* MonitoringTest::prometheus_address_ = nullptr;
std::string* MonitoringTest::job_name_ = nullptr;
std::string MonitoringTest::setup_error_;

TEST_F(MonitoringTest, PromtoolChecksTheRulesAndTheConfig) {
  std::string out;
  EXPECT_EQ(Shell("promtool check rules " + (kPrometheusDir / "rules.yml").string(), &out), 0)
      << out;
  EXPECT_THAT(out, HasSubstr("SUCCESS"));
  EXPECT_EQ(Shell("promtool check config " + (kPrometheusDir / "prometheus.yml").string(), &out), 0)
      << out;
}

TEST_F(MonitoringTest, RuleUnitTestsPass) {
  std::string out;
  EXPECT_EQ(Shell("cd " + kPrometheusDir.string() + " && promtool test rules rules_test.yml", &out),
            0)
      << out;
  EXPECT_THAT(out, HasSubstr("SUCCESS"));
}

TEST_F(MonitoringTest, EveryAlertIsTestedFiringAndQuiet) {
  const YAML::Node rules = YAML::LoadFile((kPrometheusDir / "rules.yml").string());
  const YAML::Node tests = YAML::LoadFile((kPrometheusDir / "rules_test.yml").string());
  std::map<std::string, std::pair<int, int>> cases;  // alert -> (firing, quiet) cases
  for (const YAML::Node& group : rules["groups"]) {
    for (const YAML::Node& rule : group["rules"]) {
      if (rule["alert"]) cases[rule["alert"].as<std::string>()] = {0, 0};
    }
  }
  ASSERT_GE(cases.size(), 5u);
  for (const YAML::Node& t : tests["tests"]) {
    for (const YAML::Node& a : t["alert_rule_test"]) {
      const std::string name = a["alertname"].as<std::string>();
      ASSERT_TRUE(cases.contains(name)) << "rules_test.yml tests unknown alert " << name;
      (a["exp_alerts"].size() > 0 ? cases[name].first : cases[name].second)++;
    }
  }
  for (const auto& [name, counts] : cases) {
    EXPECT_GT(counts.first, 0) << name << " has no firing case in rules_test.yml";
    EXPECT_GT(counts.second, 0) << name << " has no quiet case in rules_test.yml";
  }
}

TEST_F(MonitoringTest, PrometheusEvaluatesEveryRuleWithoutError) {
  const YAML::Node rules = YAML::LoadFile((kPrometheusDir / "rules.yml").string());
  size_t expected = 0;
  for (const YAML::Node& group : rules["groups"]) expected += group["rules"].size();
  // Every rule evaluated at least once (evaluation every second) and healthy.
  Json groups;
  for (int attempt = 0; attempt < 40; ++attempt) {
    const HttpResponse r = Get(*prometheus_address_, "/api/v1/rules");
    ASSERT_EQ(r.status, 200) << r.body;
    groups = Json::parse(r.body)["data"]["groups"];
    bool all_evaluated = true;
    for (const Json& g : groups) {
      for (const Json& rule : g["rules"]) {
        all_evaluated &= rule.value("lastEvaluation", "").rfind("0001-", 0) != 0;
      }
    }
    if (all_evaluated) break;
    std::this_thread::sleep_for(std::chrono::milliseconds(250));
  }
  size_t loaded = 0;
  for (const Json& g : groups) {
    for (const Json& rule : g["rules"]) {
      ++loaded;
      EXPECT_EQ(rule["health"], "ok") << rule["name"] << ": " << rule.value("lastError", "");
      EXPECT_EQ(rule.value("lastError", ""), "") << rule["name"];
    }
  }
  EXPECT_EQ(loaded, expected);
}

TEST_F(MonitoringTest, EveryQueryParsesAndNamesOnlyScrapedMetrics) {
  // The metric names of the controller's scrape (docs/metrics.md's series, as served).
  const HttpResponse scrape = Get(*metrics_, "/metrics");
  ASSERT_EQ(scrape.status, 200);
  std::set<std::string> scraped;
  std::istringstream lines(scrape.body);
  for (std::string line; std::getline(lines, line);) {
    if (line.empty() || line[0] == '#') continue;
    scraped.insert(line.substr(0, line.find_first_of("{ ")));
  }
  ASSERT_TRUE(scraped.contains("fp8rt_fp8_saturation_ratio")) << scrape.body;
  // And what Prometheus holds (the scrape plus `up` and its scrape_* series for the target).
  const HttpResponse names = Get(*prometheus_address_, "/api/v1/label/__name__/values");
  ASSERT_EQ(names.status, 200);
  std::set<std::string> stored;
  const Json names_answer = Json::parse(names.body);
  for (const Json& n : names_answer["data"]) stored.insert(n.get<std::string>());
  ASSERT_TRUE(stored.contains("up")) << names.body;

  std::map<std::string, std::string> variable_queries;
  const std::vector<PromQuery> queries = AllQueries(&variable_queries);
  ASSERT_GT(queries.size(), 20u);
  // Grafana's values for the dashboard's variables; $__rate_interval is at least 4 scrapes.
  const std::map<std::string, std::string> values = {
      {"run", kRun},         {"layer", "blocks.0.mlp.fc1"},
      {"tensor", ".+"},      {"__rate_interval", "1m"},
      {"__interval", "15s"}, {"__range", "1h"}};
  for (const auto& q : queries) {
    SCOPED_TRACE(q.where + ": " + q.expr);
    const std::string expr = Substitute(q.expr, values);
    ASSERT_EQ(expr.find('$'), std::string::npos) << "an unknown variable is left: " << expr;
    int status = 0;
    const Json answer = Evaluate(expr, &status);
    EXPECT_EQ(status, 200) << answer.dump();
    EXPECT_EQ(answer.value("status", ""), "success") << answer.dump();
    const std::set<std::string> used = MetricNames(expr);
    EXPECT_FALSE(used.empty()) << "no metric found in the expression";
    for (const std::string& name : used) {
      if (name == "up") {  // written by Prometheus for each target
        EXPECT_TRUE(stored.contains(name));
        continue;
      }
      EXPECT_TRUE(scraped.contains(name)) << name << " is not in the controller's scrape";
      EXPECT_TRUE(stored.contains(name)) << name << " is not in Prometheus";
    }
    if (q.expect_data && status == 200) {
      EXPECT_FALSE(answer["data"]["result"].empty()) << "no series for run " << kRun;
    }
  }

  // The variable queries give Grafana the run and its layers.
  for (const auto& [name, spec] : variable_queries) {
    const std::string selector = Substitute(spec.substr(0, spec.find('|')), values);
    const std::string label = spec.substr(spec.find('|') + 1);
    int status = 0;
    const Json answer = Evaluate(selector, &status);
    std::set<std::string> found;
    for (const Json& series : answer["data"]["result"]) {
      if (series["metric"].contains(label)) found.insert(series["metric"][label]);
    }
    if (name == "run") {
      EXPECT_TRUE(found.contains(kRun)) << "$run";
    } else if (name == "layer") {
      EXPECT_EQ(found, (std::set<std::string>{"blocks.0.attn.qkv", "blocks.0.mlp.fc1",
                                              "blocks.1.mlp.fc2", "lm_head"}));
    } else {
      EXPECT_FALSE(found.empty()) << "$" << name;
    }
  }
}

TEST(MetricNamesTest, FindsSelectorsNotFunctionsLabelsOrNumbers) {
  EXPECT_EQ(MetricNames(R"(max by (run, layer) (fp8rt_a{run="x", layer=~"b.*"}) > 0.001
                           and on (run) (fp8rt_b{state="running"} == 1))"),
            (std::set<std::string>{"fp8rt_a", "fp8rt_b"}));
  EXPECT_EQ(MetricNames(R"(time() - fp8rt_c[5m] offset 1h > 1e3)"),
            (std::set<std::string>{"fp8rt_c"}));
  EXPECT_EQ(MetricNames(R"q(sum(rate(x_total{a="sum(y)"}[1m])) / ignoring (op) group_left z)q"),
            (std::set<std::string>{"x_total", "z"}));
  EXPECT_EQ(LabelValues(R"(label_values(fp8rt_fp8_scale{run="$run"}, layer))"),
            (std::pair<std::string, std::string>{R"(fp8rt_fp8_scale{run="$run"})", "layer"}));
  EXPECT_EQ(Substitute(R"(f{run="$run", layer=~"${layer}", l="$layers"})",
                       {{"run", "r"}, {"layer", "L"}}),
            R"(f{run="r", layer=~"L", l="$layers"})");
}

}  // namespace
}  // namespace fp8rt
