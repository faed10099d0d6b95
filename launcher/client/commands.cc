// The controller commands of fp8rt (see commands.h). Contents:
//   CommonOptions, Context        what every command gets: connection options, --json, output
//   Print*                        the human forms: run table and details, layer table, recipe,
//                                 checkpoints
//   RecipeFlags, ApplyRecipeFlags, RecipeDiff
//                                 recipe set: flags -> the new recipe, and what changed
//   the commands                  one function per leaf command
//   RunControlCommand             CLI11 tree, dispatch, errors -> exit codes
#include "launcher/client/commands.h"

#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "CLI/CLI.hpp"
#include "absl/status/status.h"
#include "absl/strings/ascii.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "launcher/client/control_client.h"
#include "launcher/client/format.h"
#include "runtime/core/quote.h"
#include "runtime/core/status.h"
#include "runtime/spec/run_spec.h"

namespace fp8rt::cli {
namespace {

using Precision = v1::RunSpec::Precision;

constexpr int kExitOk = 0, kExitFailed = 1, kExitBadInput = 2;

// ---------------------------------------------------------------------------------------------
// What every command gets

struct CommonOptions {
  ConnectionOptions connection;  // as given on the command line (ResolveConnectionOptions fills
                                 // the rest)
  bool json = false;             // one JSON document on stdout instead of tables
};

struct Context {
  const CommonOptions& options;
  // Connects with the resolved options (nothing is sent until the first call).
  absl::StatusOr<std::unique_ptr<ControllerClient>> Connect() const {
    FP8RT_ASSIGN_OR_RETURN(ConnectionOptions resolved,
                           ResolveConnectionOptions(options.connection));
    return ControllerClient::Connect(resolved);
  }
};

// Strings that are not UTF-8 (a run folder's name, say) are written with U+FFFD in place of the
// bad bytes rather than failing the command.
void PrintJson(const nlohmann::ordered_json& document) {
  const std::string text =
      document.dump(2, ' ', false, nlohmann::ordered_json::error_handler_t::replace);
  std::fputs(text.c_str(), stdout);
  std::fputc('\n', stdout);
}

void AddCommonOptions(CLI::App* command, CommonOptions* options) {
  ConnectionOptions& c = options->connection;
  command
      ->add_option("--controller", c.controller,
                   absl::StrCat("controller address HOST:PORT (default: $", kControllerEnv,
                                ", else ", kDefaultController, ")"))
      ->type_name("HOST:PORT");
  command
      ->add_option("--token-file", c.token_file,
                   absl::StrCat("file holding the controller's bearer token (default: $",
                                kTokenFileEnv, "; required)"))
      ->type_name("FILE");
  command
      ->add_option("--tls-ca", c.tls_ca,
                   "connect with TLS, trusting this root CA (PEM); default: plaintext")
      ->type_name("FILE");
  command
      ->add_option(
          "--timeout-s", c.timeout_s,
          absl::StrFormat("deadline of every call in seconds (default %g)", kDefaultTimeoutS))
      ->type_name("S");
  command->add_flag("--json", options->json, "print one JSON document instead of a table");
}

// ---------------------------------------------------------------------------------------------
// Human forms

std::string StateWord(v1::RunState state) { return EnumWord(v1::RunState_descriptor(), state); }

std::string LossText(const v1::StepMetrics& m) {
  return m.step() == 0 ? "-" : absl::StrFormat("%.4f", m.loss());
}

void PrintRunTable(const std::vector<const v1::Run*>& runs) {
  using A = Table::Align;
  Table table({{"RUN"},
               {"STATE"},
               {"STEP", A::kRight},
               {"LOSS", A::kRight},
               {"TOKENS/S", A::kRight},
               {"WORKERS", A::kRight},
               {"RECIPE", A::kRight},
               {"CHECKPOINT", A::kRight}});
  for (const v1::Run* run : runs) {
    const v1::StepMetrics& last = run->last_step();
    table.AddRow(
        {run->run_id(), StateWord(run->state()),
         absl::StrCat(last.step(), "/", run->spec().train().steps()), LossText(last),
         last.step() == 0 ? "-" : absl::StrFormat("%.0f", last.tokens_per_s()),
         absl::StrCat(run->workers_connected(), "/", run->world_size()),
         absl::StrCat("v", run->recipe_version()),
         run->last_checkpoint_step() == 0 ? "-" : absl::StrCat(run->last_checkpoint_step())});
  }
  std::fputs(table.Render().c_str(), stdout);
}

std::string PrecisionText(const Precision& p) {
  std::string text = EnumWord(Precision::Mode_descriptor(), p.mode());
  if (p.mode() == Precision::MODE_FP8) {
    absl::StrAppend(&text, ", format ", EnumWord(Precision::Format_descriptor(), p.format()),
                    ", scaling ", EnumWord(Precision::Scaling_descriptor(), p.scaling()),
                    ", margin ", p.margin());
  }
  return text;
}

void PrintRunDetails(const v1::Run& run) {
  const v1::RunSpec& spec = run.spec();
  const v1::StepMetrics& last = run.last_step();
  Table table({{"run"}, {run.run_id()}});
  auto row = [&](const std::string& key, const std::string& value) { table.AddRow({key, value}); };
  row("state", StateWord(run.state()));
  row("run dir", run.run_dir());
  row("workers", absl::StrCat(run.workers_connected(), "/", run.world_size(), " connected"));
  row("step",
      absl::StrCat(last.step(), "/", spec.train().steps(), " (", run.skipped_steps(), " skipped)"));
  row("loss", LossText(last));
  if (run.val_loss_step() != 0) {
    row("val loss", absl::StrFormat("%.4f (step %d)", run.val_loss(), run.val_loss_step()));
  }
  if (last.step() != 0) {
    row("grad norm", absl::StrFormat("%.4g", last.grad_norm()));
    row("lr", absl::StrFormat("%.4g", last.lr()));
    row("tokens/s", absl::StrFormat("%.0f", last.tokens_per_s()));
    row("time per step", absl::StrFormat("%.3f s", last.step_time_s()));
  }
  row("recipe", absl::StrCat("version ", run.recipe_version()));
  row("checkpoint",
      run.last_checkpoint_step() == 0 ? "none" : absl::StrCat("step ", run.last_checkpoint_step()));
  row("created", FormatUnixMs(run.created_unix_ms()));
  const v1::RunSpec::Model& m = spec.model();
  row("model",
      absl::StrFormat("%d layers, d_model %d, heads %d, d_ff %d, seq_len %d, vocab %d", m.layers(),
                      m.d_model(), m.heads(), m.d_ff(), m.seq_len(), m.vocab()));
  row("layout", absl::StrFormat("dp %d x tp %d, ep %d", spec.parallel().dp(), spec.parallel().tp(),
                                spec.parallel().ep()));
  row("precision", PrecisionText(spec.precision()));
  // The header row is the run id; no separate title line.
  std::fputs(table.Render().c_str(), stdout);
}

// One layer's effective recipe in words: "bf16 (precision.exclude)", or "fp8 delayed hybrid
// margin 0 history 16 max (override #1)".
std::string LayerRecipeText(const v1::LayerRecipe& r) {
  std::string text = EnumWord(Precision::Mode_descriptor(), r.mode());
  if (r.mode() == Precision::MODE_FP8) {
    absl::StrAppend(&text, " ", EnumWord(Precision::Scaling_descriptor(), r.scaling()), " ",
                    EnumWord(Precision::Format_descriptor(), r.format()), " margin ", r.margin(),
                    " history ", r.amax_history_len(), " ",
                    EnumWord(Precision::AmaxComputeAlgo_descriptor(), r.amax_compute_algo()));
  }
  if (r.override_index() == -2) absl::StrAppend(&text, " (precision.exclude)");
  if (r.override_index() >= 0) absl::StrAppend(&text, " (override #", r.override_index(), ")");
  return text;
}

void PrintLayers(const std::string& run_id, const v1::GetLayersResponse& layers) {
  if (!layers.recipes().empty()) {
    std::printf("run %s: each layer's recipe (version %lld)\n", run_id.c_str(),
                static_cast<long long>(layers.recipes(0).recipe_version()));
    Table recipes({{"LAYER"}, {"RECIPE"}});
    for (const v1::LayerRecipe& r : layers.recipes()) {
      recipes.AddRow({r.layer(), LayerRecipeText(r)});
    }
    std::fputs(recipes.Render().c_str(), stdout);
  }
  if (layers.sites().empty()) {
    std::printf("run %s: no FP8 statistics reported yet\n", run_id.c_str());
    return;
  }
  const bool experts = std::any_of(layers.sites().begin(), layers.sites().end(),
                                   [](const v1::SiteStats& s) { return s.expert() >= 0; });
  using A = Table::Align;
  std::vector<Table::Column> columns = {{"LAYER"}, {"TENSOR"}};
  if (experts) columns.push_back({"EXPERT", A::kRight});
  for (const char* title : {"AMAX", "SCALE", "UNDERFLOW %", "SATURATION %"}) {
    columns.push_back({title, A::kRight});
  }
  Table table(std::move(columns));
  for (const v1::SiteStats& s : layers.sites()) {
    std::vector<std::string> cells = {s.layer(), EnumWord(v1::TensorRole_descriptor(), s.tensor())};
    if (experts) cells.push_back(s.expert() >= 0 ? absl::StrCat(s.expert()) : "-");
    cells.push_back(absl::StrFormat("%.6g", s.amax()));
    cells.push_back(absl::StrFormat("%.6g", s.scale()));
    cells.push_back(FormatPercent(s.underflow_ratio()));
    cells.push_back(FormatPercent(s.saturation_ratio()));
    table.AddRow(std::move(cells));
  }
  std::printf("run %s: FP8 statistics of step %lld (%d sites)\n", run_id.c_str(),
              static_cast<long long>(layers.step()), layers.sites_size());
  std::fputs(table.Render().c_str(), stdout);
}

// Sites by layer (natural order), then tensor (input, weight, grad_output: the enum's order),
// then expert.
void SortSites(v1::GetLayersResponse* layers) {
  std::sort(layers->mutable_sites()->begin(), layers->mutable_sites()->end(),
            [](const v1::SiteStats& a, const v1::SiteStats& b) {
              if (a.layer() != b.layer()) return NaturalLess(a.layer(), b.layer());
              if (a.tensor() != b.tensor()) return a.tensor() < b.tensor();
              return a.expert() < b.expert();
            });
}

std::string ExcludeText(const v1::Recipe& recipe) {
  return recipe.exclude().empty() ? "(none)" : absl::StrJoin(recipe.exclude(), ", ");
}

void PrintRecipe(const std::string& run_id, const v1::RecipeVersion& version) {
  const v1::Recipe& r = version.recipe();
  std::printf("run %s: recipe version %lld (%s: %s), effective from step %lld, %s\n",
              run_id.c_str(), static_cast<long long>(version.version()), version.source().c_str(),
              version.reason().c_str(), static_cast<long long>(version.effective_step()),
              version.applied_step() == 0
                  ? "not applied yet"
                  : absl::StrCat("applied at step ", version.applied_step()).c_str());
  Table table({{"  FIELD"}, {"VALUE"}});
  table.AddRow({"  exclude", ExcludeText(r)});
  std::vector<std::string> overrides;
  for (const Precision::Override& o : r.overrides()) overrides.push_back(DescribeOverride(o));
  table.AddRow({"  overrides", overrides.empty() ? "(none)" : absl::StrJoin(overrides, "; ")});
  table.AddRow({"  scaling", EnumWord(Precision::Scaling_descriptor(), r.scaling())});
  table.AddRow({"  amax_history_len", absl::StrCat(r.amax_history_len())});
  table.AddRow({"  amax_compute_algo",
                EnumWord(Precision::AmaxComputeAlgo_descriptor(), r.amax_compute_algo())});
  table.AddRow({"  margin", absl::StrCat(r.margin())});
  table.AddRow({"  fsdp_gather", EnumWord(Precision::FsdpGather_descriptor(), r.fsdp_gather())});
  table.AddRow({"  grad_reduce", EnumWord(Precision::GradReduce_descriptor(), r.grad_reduce())});
  std::fputs(table.Render().c_str(), stdout);
}

void PrintCheckpoints(const std::string& run_id, const v1::ListCheckpointsResponse& list) {
  if (list.checkpoints().empty()) {
    std::printf("run %s: no committed checkpoints\n", run_id.c_str());
    return;
  }
  using A = Table::Align;
  Table table({{"STEP", A::kRight}, {"SIZE", A::kRight}, {"CREATED"}, {"DIR"}});
  for (const v1::CheckpointInfo& c : list.checkpoints()) {
    table.AddRow({absl::StrCat(c.step()), FormatBytes(c.bytes()), FormatUnixMs(c.created_unix_ms()),
                  c.dir()});
  }
  std::fputs(table.Render().c_str(), stdout);
}

// ---------------------------------------------------------------------------------------------
// recipe set: the changes a user asked for

struct RecipeFlags {
  std::string exclude;                      // --exclude a,b (replaces the list; "" clears it)
  std::vector<std::string> exclude_add;     // --exclude-add L (repeatable, or a,b)
  std::vector<std::string> exclude_remove;  // --exclude-remove L (repeatable, or a,b)
  std::string scaling, amax_compute_algo, fsdp_gather, grad_reduce;  // enum words
  int amax_history_len = 0;
  int margin = 0;
  std::string reason;  // --reason TEXT (default: a summary of the changes)
  // --override 'GLOB:key=value,...' (repeatable; replaces the override list), --clear-overrides
  std::vector<std::string> overrides;
  bool clear_overrides = false;

  // Set by the CLI: which options were given.
  CLI::Option* exclude_opt = nullptr;
  CLI::Option* scaling_opt = nullptr;
  CLI::Option* amax_history_len_opt = nullptr;
  CLI::Option* amax_compute_algo_opt = nullptr;
  CLI::Option* margin_opt = nullptr;
  CLI::Option* fsdp_gather_opt = nullptr;
  CLI::Option* grad_reduce_opt = nullptr;
  CLI::Option* reason_opt = nullptr;
};

// Layer names from --exclude-style values: comma-separated, blanks around names ignored.
std::vector<std::string> LayerList(const std::vector<std::string>& values) {
  std::vector<std::string> names;
  for (const std::string& value : values) {
    for (absl::string_view name : absl::StrSplit(value, ',')) {
      name = absl::StripAsciiWhitespace(name);
      if (!name.empty()) names.emplace_back(name);
    }
  }
  return names;
}

// --override 'GLOB:key=value,...': the layers glob, then any of mode, scaling, format, margin,
// amax_history_len, amax_compute_algo (the spec's precision.overrides fields). InvalidArgument
// naming --override and quoting a bounded prefix of the bad part.
absl::StatusOr<Precision::Override> ParseOverrideFlag(const std::string& text) {
  const size_t colon = text.find(':');
  if (colon == std::string::npos || colon == 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("--override: expected GLOB:key=value[,key=value...], got ",
                     QuoteBounded(text)));
  }
  Precision::Override o;
  o.set_layers(text.substr(0, colon));
  for (absl::string_view part : absl::StrSplit(text.substr(colon + 1), ',', absl::SkipEmpty())) {
    part = absl::StripAsciiWhitespace(part);
    const size_t eq = part.find('=');
    const std::string key(part.substr(0, eq));
    const std::string value(eq == absl::string_view::npos ? "" : part.substr(eq + 1));
    const std::string flag = absl::StrCat("--override ", key);
    auto number = [&](int lo, int hi) -> absl::StatusOr<int> {
      int v = 0;
      if (!absl::SimpleAtoi(value, &v) || v < lo || v > hi) {
        return absl::InvalidArgumentError(absl::StrCat(flag, ": expected an integer in [", lo,
                                                       ", ", hi, "], got ", QuoteBounded(value)));
      }
      return v;
    };
    if (key == "mode") {
      FP8RT_ASSIGN_OR_RETURN(const int v, ParseEnumWord(Precision::Mode_descriptor(), value, flag));
      o.set_mode(static_cast<Precision::Mode>(v));
    } else if (key == "scaling") {
      FP8RT_ASSIGN_OR_RETURN(const int v,
                             ParseEnumWord(Precision::Scaling_descriptor(), value, flag));
      o.set_scaling(static_cast<Precision::Scaling>(v));
    } else if (key == "format") {
      FP8RT_ASSIGN_OR_RETURN(const int v,
                             ParseEnumWord(Precision::Format_descriptor(), value, flag));
      o.set_format(static_cast<Precision::Format>(v));
    } else if (key == "amax_compute_algo") {
      FP8RT_ASSIGN_OR_RETURN(const int v,
                             ParseEnumWord(Precision::AmaxComputeAlgo_descriptor(), value, flag));
      o.set_amax_compute_algo(static_cast<Precision::AmaxComputeAlgo>(v));
    } else if (key == "margin") {
      FP8RT_ASSIGN_OR_RETURN(const int v, number(0, 32));
      o.set_margin(v);
    } else if (key == "amax_history_len") {
      FP8RT_ASSIGN_OR_RETURN(const int v, number(1, 4096));
      o.set_amax_history_len(v);
    } else {
      return absl::InvalidArgumentError(absl::StrCat(
          "--override: unknown key ", QuoteBounded(key),
          " (expected mode, scaling, format, margin, amax_history_len, amax_compute_algo)"));
    }
  }
  return o;
}

// A recipe setter for one enum flag: parses the word (InvalidArgument naming the flag).
struct EnumChange {
  CLI::Option* option;
  const std::string* word;
  const google::protobuf::EnumDescriptor* type;
  std::function<void(v1::Recipe*, int)> set;
};

// Applies the flags to `recipe`; InvalidArgument naming the flag for a bad enum word, removing
// a layer that is not excluded, or no change asked at all. With recipe == nullptr, only checks
// the flags (so that bad words fail before anything is sent).
absl::Status ApplyRecipeFlags(const RecipeFlags& f, v1::Recipe* recipe) {
  const EnumChange enums[] = {
      {f.scaling_opt, &f.scaling, Precision::Scaling_descriptor(),
       [](v1::Recipe* r, int v) { r->set_scaling(static_cast<Precision::Scaling>(v)); }},
      {f.amax_compute_algo_opt, &f.amax_compute_algo, Precision::AmaxComputeAlgo_descriptor(),
       [](v1::Recipe* r, int v) {
         r->set_amax_compute_algo(static_cast<Precision::AmaxComputeAlgo>(v));
       }},
      {f.fsdp_gather_opt, &f.fsdp_gather, Precision::FsdpGather_descriptor(),
       [](v1::Recipe* r, int v) { r->set_fsdp_gather(static_cast<Precision::FsdpGather>(v)); }},
      {f.grad_reduce_opt, &f.grad_reduce, Precision::GradReduce_descriptor(),
       [](v1::Recipe* r, int v) { r->set_grad_reduce(static_cast<Precision::GradReduce>(v)); }},
  };
  bool changed = false;
  for (const EnumChange& change : enums) {
    if (change.option->count() == 0) continue;
    FP8RT_ASSIGN_OR_RETURN(const int value,
                           ParseEnumWord(change.type, *change.word, change.option->get_name()));
    if (recipe != nullptr) change.set(recipe, value);
    changed = true;
  }
  if (f.amax_history_len_opt->count() > 0) {
    if (recipe != nullptr) recipe->set_amax_history_len(f.amax_history_len);
    changed = true;
  }
  if (f.margin_opt->count() > 0) {
    if (recipe != nullptr) recipe->set_margin(f.margin);
    changed = true;
  }
  const std::vector<std::string> add = LayerList(f.exclude_add);
  const std::vector<std::string> remove = LayerList(f.exclude_remove);
  if (f.exclude_opt->count() > 0 || !add.empty() || !remove.empty()) changed = true;
  std::vector<Precision::Override> overrides;
  for (const std::string& text : f.overrides) {
    FP8RT_ASSIGN_OR_RETURN(Precision::Override o, ParseOverrideFlag(text));
    overrides.push_back(std::move(o));
  }
  if (!overrides.empty() || f.clear_overrides) changed = true;
  if (!changed) {
    return absl::InvalidArgumentError(
        "nothing to change: give at least one of --exclude, --exclude-add, --exclude-remove, "
        "--override, --clear-overrides, --scaling, --amax-history-len, --amax-compute-algo, "
        "--margin, --fsdp-gather, --grad-reduce");
  }
  if (recipe == nullptr) return absl::OkStatus();
  if (!overrides.empty() || f.clear_overrides) {
    recipe->clear_overrides();
    for (Precision::Override& o : overrides) *recipe->add_overrides() = std::move(o);
  }

  if (f.exclude_opt->count() > 0) {
    recipe->clear_exclude();
    for (const std::string& name : LayerList({f.exclude})) recipe->add_exclude(name);
  }
  for (const std::string& name : remove) {
    auto* list = recipe->mutable_exclude();
    auto it = std::find(list->begin(), list->end(), name);
    if (it == list->end()) {
      return absl::InvalidArgumentError(
          absl::StrCat("--exclude-remove: ", name,
                       " is not excluded (excluded now: ", ExcludeText(*recipe), ")"));
    }
    list->erase(it);
  }
  for (const std::string& name : add) {
    const auto& list = recipe->exclude();
    if (std::find(list.begin(), list.end(), name) == list.end()) recipe->add_exclude(name);
  }
  return absl::OkStatus();
}

// "margin 0 -> 2, exclude +blocks.0.mlp.fc1": what differs between two recipes, field by field.
std::vector<std::string> RecipeDiff(const v1::Recipe& before, const v1::Recipe& after) {
  std::vector<std::string> changes;
  const nlohmann::ordered_json a = ToJson(before), b = ToJson(after);
  for (const auto& [key, value] : b.items()) {
    if (key == "exclude") continue;
    if (a[key] != value) {
      changes.push_back(absl::StrCat(key, " ", a[key].dump(), " -> ", value.dump()));
    }
  }
  // Strings dump with quotes; enum words read better without.
  for (std::string& change : changes)
    change.erase(std::remove(change.begin(), change.end(), '"'), change.end());
  const auto& old_list = before.exclude();
  const auto& new_list = after.exclude();
  for (const std::string& name : new_list) {
    if (std::find(old_list.begin(), old_list.end(), name) == old_list.end()) {
      changes.push_back(absl::StrCat("exclude +", name));
    }
  }
  for (const std::string& name : old_list) {
    if (std::find(new_list.begin(), new_list.end(), name) == new_list.end()) {
      changes.push_back(absl::StrCat("exclude -", name));
    }
  }
  return changes;
}

// ---------------------------------------------------------------------------------------------
// The commands

absl::Status RunsList(const Context& ctx) {
  FP8RT_ASSIGN_OR_RETURN(auto client, ctx.Connect());
  FP8RT_ASSIGN_OR_RETURN(v1::ListRunsResponse list, client->ListRuns());
  std::sort(list.mutable_runs()->begin(), list.mutable_runs()->end(),
            [](const v1::Run& a, const v1::Run& b) { return a.run_id() < b.run_id(); });
  if (ctx.options.json) {
    PrintJson(ToJson(list));
  } else if (list.runs().empty()) {
    std::printf("no runs (controller %s)\n", client->options().controller.c_str());
  } else {
    std::vector<const v1::Run*> runs;
    for (const v1::Run& run : list.runs()) runs.push_back(&run);
    PrintRunTable(runs);
  }
  return absl::OkStatus();
}

absl::Status RunsGet(const Context& ctx, const std::string& run_id) {
  FP8RT_ASSIGN_OR_RETURN(auto client, ctx.Connect());
  FP8RT_ASSIGN_OR_RETURN(const v1::Run run, client->GetRun(run_id));
  if (ctx.options.json) {
    PrintJson(ToJson(run));
  } else {
    PrintRunDetails(run);
  }
  return absl::OkStatus();
}

absl::Status RunsStop(const Context& ctx, const std::string& run_id) {
  FP8RT_ASSIGN_OR_RETURN(auto client, ctx.Connect());
  FP8RT_ASSIGN_OR_RETURN(const v1::Run run, client->StopRun(run_id));
  if (ctx.options.json) {
    PrintJson(ToJson(run));
  } else {
    std::printf(
        "run %s: %s; the workers save a checkpoint and exit when their next heartbeat tells "
        "them\n",
        run.run_id().c_str(), StateWord(run.state()).c_str());
  }
  return absl::OkStatus();
}

// Prints the new run token, or writes it to `out` (created 0600, never overwritten) and prints
// where it is. --json: {"run_id": RUN, "token": T} or {"run_id": RUN, "token_file": F}.
absl::Status RunsToken(const Context& ctx, const std::string& run_id, const std::string& out) {
  FP8RT_ASSIGN_OR_RETURN(auto client, ctx.Connect());
  FP8RT_ASSIGN_OR_RETURN(const v1::CreateRunTokenResponse created, client->CreateRunToken(run_id));
  if (out.empty()) {
    if (ctx.options.json) {
      PrintJson(nlohmann::ordered_json{{"run_id", run_id}, {"token", created.token()}});
    } else {
      std::printf("%s\n", created.token().c_str());
    }
    return absl::OkStatus();
  }
  const int fd = open(out.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0600);
  if (fd < 0) {
    return absl::ErrnoToStatus(errno, absl::StrCat("--out ", out, ": cannot create the file"));
  }
  const std::string text = created.token() + "\n";
  const bool written = write(fd, text.data(), text.size()) == static_cast<ssize_t>(text.size());
  const bool closed = close(fd) == 0;
  if (!written || !closed) {
    unlink(out.c_str());
    return absl::UnavailableError(absl::StrCat("--out ", out, ": cannot write the token"));
  }
  if (ctx.options.json) {
    PrintJson(nlohmann::ordered_json{{"run_id", run_id}, {"token_file", out}});
  } else {
    std::printf(
        "run %s: token written to %s (mode 0600); give it to the run's workers with "
        "--token-file\n",
        run_id.c_str(), out.c_str());
  }
  return absl::OkStatus();
}

absl::Status Layers(const Context& ctx, const std::string& run_id) {
  FP8RT_ASSIGN_OR_RETURN(auto client, ctx.Connect());
  FP8RT_ASSIGN_OR_RETURN(v1::GetLayersResponse layers, client->GetLayers(run_id));
  SortSites(&layers);
  if (ctx.options.json) {
    PrintJson(ToJson(layers));
  } else {
    PrintLayers(run_id, layers);
  }
  return absl::OkStatus();
}

absl::Status RecipeGet(const Context& ctx, const std::string& run_id) {
  FP8RT_ASSIGN_OR_RETURN(auto client, ctx.Connect());
  FP8RT_ASSIGN_OR_RETURN(const v1::RecipeVersion version, client->GetRecipe(run_id));
  if (ctx.options.json) {
    PrintJson(ToJson(version));
  } else {
    PrintRecipe(run_id, version);
  }
  return absl::OkStatus();
}

// Read, change, write. The Runs service has no compare-and-set: an update made by someone else
// (or the health policy) between the read and the write is overwritten by this one; the new
// version's number shows it (it is then more than one above the version read).
absl::Status RecipeSet(const Context& ctx, const std::string& run_id, const RecipeFlags& flags) {
  FP8RT_RETURN_IF_ERROR(ApplyRecipeFlags(flags, nullptr));  // bad words before any call
  FP8RT_ASSIGN_OR_RETURN(auto client, ctx.Connect());
  FP8RT_ASSIGN_OR_RETURN(const v1::RecipeVersion current, client->GetRecipe(run_id));
  v1::Recipe recipe = current.recipe();
  FP8RT_RETURN_IF_ERROR(ApplyRecipeFlags(flags, &recipe));
  const std::vector<std::string> changes = RecipeDiff(current.recipe(), recipe);
  const std::string reason =
      flags.reason_opt->count() > 0
          ? flags.reason
          : absl::StrCat("fp8rt recipe set: ",
                         changes.empty() ? "no change" : absl::StrJoin(changes, ", "));
  FP8RT_ASSIGN_OR_RETURN(const v1::RecipeVersion updated,
                         client->UpdateRecipe(run_id, recipe, reason));
  if (ctx.options.json) {
    PrintJson(ToJson(updated));
  } else {
    std::printf("recipe version %lld takes effect at step %lld\n",
                static_cast<long long>(updated.version()),
                static_cast<long long>(updated.effective_step()));
    for (const std::string& change : changes) std::printf("  %s\n", change.c_str());
  }
  return absl::OkStatus();
}

absl::Status CheckpointsList(const Context& ctx, const std::string& run_id) {
  FP8RT_ASSIGN_OR_RETURN(auto client, ctx.Connect());
  FP8RT_ASSIGN_OR_RETURN(const v1::ListCheckpointsResponse list, client->ListCheckpoints(run_id));
  if (ctx.options.json) {
    PrintJson(ToJson(list));
  } else {
    PrintCheckpoints(run_id, list);
  }
  return absl::OkStatus();
}

absl::Status CheckpointsSave(const Context& ctx, const std::string& run_id) {
  FP8RT_ASSIGN_OR_RETURN(auto client, ctx.Connect());
  FP8RT_RETURN_IF_ERROR(client->SaveCheckpoint(run_id));
  if (ctx.options.json) {
    // SaveCheckpointResponse is empty; say what was asked instead of printing {}.
    PrintJson({{"run_id", run_id}, {"save_requested", true}});
  } else {
    std::printf("run %s: checkpoint requested; the workers save at their next step\n",
                run_id.c_str());
  }
  return absl::OkStatus();
}

// ---------------------------------------------------------------------------------------------
// The command tree

struct Leaf {
  CLI::App* app;
  std::string name;  // "runs list", for error lines
  std::function<absl::Status(const Context&)> run;
};

int ExitCode(const absl::Status& status) {
  if (status.ok()) return kExitOk;
  return status.code() == absl::StatusCode::kInvalidArgument ||
                 status.code() == absl::StatusCode::kNotFound
             ? kExitBadInput
             : kExitFailed;
}

}  // namespace

const char kControlCommandsUsage[] =
    "  runs list | runs get RUN | runs stop RUN\n"
    "                  the controller's runs: state, step, loss; stop asks the workers to save\n"
    "                  and exit\n"
    "  runs token RUN [--out FILE]\n"
    "                  a new token valid for RUN only (admin token needed); printed, or\n"
    "                  written to FILE (mode 0600)\n"
    "  layers RUN      each layer's effective recipe, and the per-layer FP8 table: amax,\n"
    "                  scale, underflow %, saturation %\n"
    "  recipe get RUN | recipe set RUN [--exclude a,b | --exclude-add L | --exclude-remove L]\n"
    "                  [--scaling delayed|current|block] [--amax-history-len N]\n"
    "                  [--amax-compute-algo max|most_recent] [--margin M]\n"
    "                  [--fsdp-gather fp8|bf16] [--grad-reduce bf16|fp32] [--reason TEXT]\n"
    "                  [--override 'GLOB:key=value,...' ... | --clear-overrides]\n"
    "                  the FP8 recipe; set schedules a new version a few steps ahead\n"
    "  checkpoints list RUN | checkpoints save RUN\n"
    "                  committed checkpoints; save asks for one at the next step\n"
    "                  (these take --controller HOST:PORT, --token-file F, --tls-ca F,\n"
    "                  --timeout-s S and --json; defaults from FP8RT_CONTROLLER and\n"
    "                  FP8RT_TOKEN_FILE)\n";

bool IsControlCommand(std::string_view command) {
  return command == "runs" || command == "layers" || command == "recipe" ||
         command == "checkpoints";
}

int RunControlCommand(int argc, char** argv) {
  SilenceGrpcLogging();
  CLI::App app{"fp8rt: talk to fp8rt-controller", "fp8rt"};
  app.require_subcommand(1);
  CommonOptions common;
  const Context ctx{common};
  std::string run_id;
  RecipeFlags recipe_flags;
  std::vector<Leaf> leaves;

  auto leaf = [&](CLI::App* parent, const std::string& name, const std::string& help,
                  bool takes_run, std::function<absl::Status(const Context&)> run) {
    CLI::App* command = parent->add_subcommand(name, help);
    if (takes_run) command->add_option("run", run_id, "run id")->required();
    AddCommonOptions(command, &common);
    const std::string path = parent == &app ? name : absl::StrCat(parent->get_name(), " ", name);
    leaves.push_back({command, path, std::move(run)});
    return command;
  };

  CLI::App* runs = app.add_subcommand("runs", "the controller's runs")->require_subcommand(1);
  leaf(runs, "list", "list the runs: state, step, loss, workers", false,
       [](const Context& c) { return RunsList(c); });
  leaf(runs, "get", "one run in detail", true,
       [&](const Context& c) { return RunsGet(c, run_id); });
  leaf(runs, "stop", "ask the run's workers to save and exit", true,
       [&](const Context& c) { return RunsStop(c, run_id); });
  std::string token_out;
  leaf(runs, "token", "a new token valid for this run only (needs the admin token)", true,
       [&](const Context& c) { return RunsToken(c, run_id, token_out); })
      ->add_option("--out", token_out, "write the token to this new file (mode 0600)");
  leaf(&app, "layers", "the per-layer FP8 table of the latest statistics", true,
       [&](const Context& c) { return Layers(c, run_id); });

  CLI::App* recipe = app.add_subcommand("recipe", "the run's FP8 recipe")->require_subcommand(1);
  leaf(recipe, "get", "the recipe in force (newest version)", true,
       [&](const Context& c) { return RecipeGet(c, run_id); });
  CLI::App* set =
      leaf(recipe, "set", "change the recipe: a new version, effective a few steps ahead", true,
           [&](const Context& c) { return RecipeSet(c, run_id, recipe_flags); });
  RecipeFlags& f = recipe_flags;
  f.exclude_opt = set->add_option("--exclude", f.exclude,
                                  "layers kept out of FP8, replacing the list (a,b; \"\" clears)");
  set->add_option("--exclude-add", f.exclude_add, "exclude a layer from FP8")
      ->type_name("LAYER")
      ->excludes(f.exclude_opt);
  set->add_option("--exclude-remove", f.exclude_remove, "bring an excluded layer back to FP8")
      ->type_name("LAYER")
      ->excludes(f.exclude_opt);
  f.scaling_opt = set->add_option("--scaling", f.scaling,
                                  absl::StrJoin(EnumWords(Precision::Scaling_descriptor()), "|"));
  f.amax_history_len_opt =
      set->add_option("--amax-history-len", f.amax_history_len, "amax history length H");
  f.amax_compute_algo_opt =
      set->add_option("--amax-compute-algo", f.amax_compute_algo,
                      absl::StrJoin(EnumWords(Precision::AmaxComputeAlgo_descriptor()), "|"));
  f.margin_opt = set->add_option("--margin", f.margin, "scale = fp8_max / amax / 2^margin");
  f.fsdp_gather_opt =
      set->add_option("--fsdp-gather", f.fsdp_gather,
                      absl::StrJoin(EnumWords(Precision::FsdpGather_descriptor()), "|"));
  f.grad_reduce_opt =
      set->add_option("--grad-reduce", f.grad_reduce,
                      absl::StrJoin(EnumWords(Precision::GradReduce_descriptor()), "|"));
  CLI::Option* override_opt =
      set->add_option("--override", f.overrides,
                      "a per-layer recipe, GLOB:key=value,... (mode, scaling, format, margin, "
                      "amax_history_len, amax_compute_algo); repeatable, the first match wins, "
                      "replaces the list")
          ->type_name("GLOB:K=V,...");
  set->add_flag("--clear-overrides", f.clear_overrides, "remove every per-layer recipe")
      ->excludes(override_opt);
  f.reason_opt = set->add_option("--reason", f.reason,
                                 "why (recorded with the version; default: the changes)");

  CLI::App* checkpoints =
      app.add_subcommand("checkpoints", "the run's checkpoints")->require_subcommand(1);
  leaf(checkpoints, "list", "committed checkpoints, oldest first", true,
       [&](const Context& c) { return CheckpointsList(c, run_id); });
  leaf(checkpoints, "save", "ask the workers to save at their next step", true,
       [&](const Context& c) { return CheckpointsSave(c, run_id); });

  // The command named in errors: as far as argv spells it.
  std::string command = argc > 1 ? argv[1] : "";
  if (argc > 2 && argv[2][0] != '-' && command != "layers") absl::StrAppend(&command, " ", argv[2]);
  try {
    app.parse(argc, argv);
  } catch (const CLI::CallForHelp& e) {
    return app.exit(e);
  } catch (const CLI::ParseError& e) {
    std::fprintf(stderr, "fp8rt %s: %s (see fp8rt %s --help)\n", command.c_str(), e.what(),
                 command.c_str());
    return kExitBadInput;
  }
  for (const Leaf& l : leaves) {
    if (!l.app->parsed()) continue;
    const absl::Status status = l.run(ctx);
    if (!status.ok()) {
      std::fflush(stdout);
      std::fprintf(stderr, "fp8rt %s: %s: %s\n", l.name.c_str(),
                   absl::StatusCodeToString(status.code()).c_str(),
                   std::string(status.message()).c_str());
    }
    return ExitCode(status);
  }
  std::fprintf(stderr, "fp8rt %s: no command given (see fp8rt help)\n", command.c_str());
  return kExitBadInput;
}

}  // namespace fp8rt::cli
