// fp8rt report (see report.h). Contents:
//   reading the run folder   ReadJsonl, RunData, Load
//   SVG                      Esc, Fmt, NiceTicks, Ramp, LineChart, Timeline, Heatmap
//   the page                 RenderReport, RunReportCommand
#include "launcher/report/report.h"

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <limits>
#include <map>
#include <optional>
#include <sstream>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "launcher/client/format.h"
#include "nlohmann/json.hpp"
#include "runtime/core/quote.h"
#include "runtime/core/status.h"

namespace fp8rt::report {
namespace {

namespace fs = std::filesystem;
using Json = nlohmann::json;
constexpr double kNaN = std::numeric_limits<double>::quiet_NaN();

// ---------------------------------------------------------------------------------------------
// Reading the run folder

// Calls `each` with every complete line of `path` parsed as JSON. An unfinished last line (a run
// still writing) is left out; any other line that is not a JSON object is InvalidArgument naming
// the file and line.
absl::Status ReadJsonl(const fs::path& path, const std::function<void(const Json&)>& each) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return absl::NotFoundError(absl::StrCat(path.string(), ": cannot open"));
  const std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  size_t at = 0;
  for (int line = 1;; ++line) {
    const size_t end = text.find('\n', at);
    if (end == std::string::npos) break;  // nothing more, or an unfinished last line
    const std::string_view row(text.data() + at, end - at);
    at = end + 1;
    if (row.empty()) continue;
    const Json j = Json::parse(row, nullptr, /*allow_exceptions=*/false);
    if (j.is_discarded() || !j.is_object()) {
      return absl::InvalidArgumentError(absl::StrCat(path.string(), ":", line,
                                                     ": not a JSON object: ",
                                                     QuoteBounded(absl::string_view(row.data(), row.size()))));
    }
    each(j);
  }
  return absl::OkStatus();
}

double Number(const Json& j, const char* key) {
  const auto it = j.find(key);
  return it != j.end() && it->is_number() ? it->get<double>() : kNaN;
}

struct StepRow {
  int64_t step = 0;
  double loss = kNaN, val_loss = kNaN, grad_norm = kNaN, tokens_per_s = kNaN, lr = kNaN;
  int64_t recipe_version = 1;
  bool skipped = false;
};

struct SiteCell {
  double amax = kNaN, scale = kNaN;
  double underflow = 0, saturation = 0;  // sums over the ranks' files
  int ranks = 0;
};

struct EventRow {
  int64_t step = 0;
  std::string kind, message;
};

struct Checkpoint {
  int64_t step = 0;
  int files = 0;
  uint64_t bytes = 0;
  bool committed = false;  // has its MANIFEST
};

struct RunData {
  fs::path dir;
  std::vector<StepRow> steps;
  // site -> step -> cell, sites in model order ("blocks.2" before "blocks.10").
  std::map<std::string, std::map<int64_t, SiteCell>, decltype(&cli::NaturalLess)> sites{
      &cli::NaturalLess};
  int stats_files = 0;
  bool have_events = false;
  std::vector<EventRow> events;
  std::vector<Checkpoint> checkpoints;
};

absl::StatusOr<RunData> Load(const fs::path& dir) {
  RunData run;
  run.dir = dir;
  std::error_code ec;
  if (!fs::is_directory(dir, ec)) {
    return absl::NotFoundError(absl::StrCat(dir.string(), ": no such run folder"));
  }
  const fs::path metrics = dir / "metrics.jsonl";
  if (!fs::exists(metrics, ec)) {
    return absl::NotFoundError(absl::StrCat(
        metrics.string(), ": not found (is ", dir.string(), " the --run-dir of a run?)"));
  }
  std::map<int64_t, StepRow> by_step;  // a resumed run may write a step again: the last wins
  FP8RT_RETURN_IF_ERROR(ReadJsonl(metrics, [&](const Json& j) {
    StepRow r;
    r.step = static_cast<int64_t>(Number(j, "step"));
    r.loss = Number(j, "loss");
    r.val_loss = Number(j, "val_loss");
    r.grad_norm = Number(j, "grad_norm");
    r.tokens_per_s = Number(j, "tokens_per_s");
    r.lr = Number(j, "lr");
    const double v = Number(j, "recipe_version");
    r.recipe_version = std::isfinite(v) ? static_cast<int64_t>(v) : 1;
    r.skipped = j.value("skipped", false);
    by_step[r.step] = r;
  }));
  for (auto& [step, row] : by_step) run.steps.push_back(row);

  std::vector<fs::path> stats;
  for (const auto& e : fs::directory_iterator(dir / "fp8_stats", ec)) {
    if (e.path().extension() == ".jsonl") stats.push_back(e.path());
  }
  std::sort(stats.begin(), stats.end());
  for (size_t f = 0; f < stats.size(); ++f) {
    FP8RT_RETURN_IF_ERROR(ReadJsonl(stats[f], [&](const Json& j) {
      if (!j.contains("site") || !j["site"].is_string()) return;  // MoE token counts
      SiteCell& c = run.sites[j["site"].get<std::string>()]
                             [static_cast<int64_t>(Number(j, "step"))];
      if (f == 0 || !std::isfinite(c.amax)) {
        c.amax = Number(j, "amax");
        c.scale = Number(j, "scale");
      }
      const double u = Number(j, "underflow_ratio"), s = Number(j, "saturation_ratio");
      c.underflow += std::isfinite(u) ? u : 0;
      c.saturation += std::isfinite(s) ? s : 0;
      ++c.ranks;
    }));
  }
  run.stats_files = static_cast<int>(stats.size());

  const fs::path events = dir / "events.jsonl";
  if (fs::exists(events, ec)) {
    run.have_events = true;
    FP8RT_RETURN_IF_ERROR(ReadJsonl(events, [&](const Json& j) {
      run.events.push_back({static_cast<int64_t>(Number(j, "step")), j.value("kind", ""),
                            j.value("message", "")});
    }));
  }

  for (const auto& e : fs::directory_iterator(dir / "checkpoints", ec)) {
    const std::string name = e.path().filename().string();
    int64_t step = 0;
    if (!e.is_directory() || std::sscanf(name.c_str(), "step-%ld", &step) != 1) continue;
    Checkpoint c;
    c.step = step;
    c.committed = fs::exists(e.path() / "MANIFEST", ec);
    for (const auto& f : fs::directory_iterator(e.path(), ec)) {
      if (!f.is_regular_file()) continue;
      ++c.files;
      c.bytes += f.file_size(ec);
    }
    run.checkpoints.push_back(c);
  }
  std::sort(run.checkpoints.begin(), run.checkpoints.end(),
            [](const Checkpoint& a, const Checkpoint& b) { return a.step < b.step; });
  return run;
}

// ---------------------------------------------------------------------------------------------
// SVG

std::string Esc(std::string_view text) {
  std::string out;
  for (char c : text) {
    switch (c) {
      case '&': out += "&amp;"; break;
      case '<': out += "&lt;"; break;
      case '>': out += "&gt;"; break;
      case '"': out += "&quot;"; break;
      default: out += c;
    }
  }
  return out;
}

std::string Fmt(double v) {
  if (!std::isfinite(v)) return "-";
  const double a = std::fabs(v);
  if (a != 0 && (a < 1e-3 || a >= 1e5)) return absl::StrFormat("%.3g", v);
  return absl::StrFormat("%.4g", v);
}

// About `n` round tick values covering [lo, hi].
std::vector<double> NiceTicks(double lo, double hi, int n = 5) {
  if (!(hi > lo)) return {lo};
  const double raw = (hi - lo) / n, mag = std::pow(10.0, std::floor(std::log10(raw)));
  const double f = raw / mag, step = (f < 1.5 ? 1 : f < 3.5 ? 2 : f < 7.5 ? 5 : 10) * mag;
  std::vector<double> t;
  for (double v = std::ceil(lo / step) * step; v <= hi + 1e-9 * step; v += step) t.push_back(v);
  return t;
}

// Viridis-like ramp: t in [0, 1] -> "#rrggbb".
std::string Ramp(double t) {
  static const int kStops[][3] = {
      {68, 1, 84}, {59, 82, 139}, {33, 145, 140}, {94, 201, 98}, {253, 231, 37}};
  t = std::clamp(t, 0.0, 1.0) * 4;
  const int i = std::min(3, static_cast<int>(t));
  const double f = t - i;
  int rgb[3];
  for (int k = 0; k < 3; ++k) {
    rgb[k] = static_cast<int>(std::lround(kStops[i][k] + f * (kStops[i + 1][k] - kStops[i][k])));
  }
  return absl::StrFormat("#%02x%02x%02x", rgb[0], rgb[1], rgb[2]);
}

constexpr int kW = 920, kLeft = 78, kRight = 24, kTop = 34, kBottom = 40;

struct Series {
  std::string name, color;
  std::vector<std::pair<double, double>> points;  // (step, value); NaN values break the line
};

// The step axis shared by every plot: [first, last] step of the run.
struct StepAxis {
  double lo = 0, hi = 1;
  double X(double step) const {
    return kLeft + (step - lo) / std::max(1e-9, hi - lo) * (kW - kLeft - kRight);
  }
};

std::string XAxis(const StepAxis& ax, int y) {
  std::string s = absl::StrFormat(
      "<line x1='%d' y1='%d' x2='%d' y2='%d' stroke='#444'/>", kLeft, y, kW - kRight, y);
  for (double t : NiceTicks(ax.lo, ax.hi, 8)) {
    const double x = ax.X(t);
    absl::StrAppendFormat(&s,
                          "<line x1='%.1f' y1='%d' x2='%.1f' y2='%d' stroke='#444'/>"
                          "<text x='%.1f' y='%d' font-size='11' text-anchor='middle'>%s</text>",
                          x, y, x, y + 4, x, y + 16, Fmt(t));
  }
  absl::StrAppendFormat(&s, "<text x='%d' y='%d' font-size='11' text-anchor='end'>step</text>",
                        kW - kRight, y + 30);
  return s;
}

std::string LineChart(const std::string& id, const std::string& title, const StepAxis& ax,
                      const std::vector<Series>& series, bool log_y) {
  constexpr int kH = 250;
  double lo = std::numeric_limits<double>::infinity(), hi = -lo;
  auto tr = [&](double v) { return log_y ? std::log10(v) : v; };
  for (const Series& s : series) {
    for (const auto& [x, v] : s.points) {
      if (!std::isfinite(v) || (log_y && v <= 0)) continue;
      lo = std::min(lo, tr(v));
      hi = std::max(hi, tr(v));
    }
  }
  std::string svg = absl::StrFormat(
      "<svg id='%s' class='plot' xmlns='http://www.w3.org/2000/svg' width='%d' height='%d' "
      "viewBox='0 0 %d %d'><text x='%d' y='20' font-size='14' font-weight='bold'>%s</text>",
      id, kW, kH, kW, kH, kLeft, Esc(title));
  if (!std::isfinite(lo)) {
    return svg + absl::StrFormat("<text x='%d' y='%d' font-size='12'>no values recorded</text>"
                                 "</svg>",
                                 kLeft, kH / 2);
  }
  if (hi - lo < 1e-12) {
    lo -= 0.5;
    hi += 0.5;
  }
  const double pad = 0.05 * (hi - lo);
  lo -= pad;
  hi += pad;
  const int y0 = kH - kBottom;
  auto Y = [&](double v) { return y0 - (tr(v) - lo) / (hi - lo) * (y0 - kTop); };
  // Grid and y ticks.
  std::vector<double> ticks;
  if (log_y) {
    for (double e = std::ceil(lo); e <= hi; e += 1) ticks.push_back(std::pow(10.0, e));
    if (ticks.size() < 2) ticks = {std::pow(10.0, lo + pad), std::pow(10.0, hi - pad)};
  } else {
    ticks = NiceTicks(lo, hi);
  }
  for (double t : ticks) {
    const double y = Y(t);
    absl::StrAppendFormat(&svg,
                          "<line x1='%d' y1='%.1f' x2='%d' y2='%.1f' stroke='#ddd'/>"
                          "<text x='%d' y='%.1f' font-size='11' text-anchor='end'>%s</text>",
                          kLeft, y, kW - kRight, y, kLeft - 6, y + 4, Fmt(t));
  }
  svg += XAxis(ax, y0);
  int legend_x = kLeft + 8 + static_cast<int>(title.size()) * 8 + 20;
  for (const Series& s : series) {
    // One polyline per run of finite values.
    std::string pts;
    int n = 0;
    auto flush = [&] {
      if (n >= 2) {
        absl::StrAppendFormat(&svg,
                              "<polyline class='series' data-name='%s' fill='none' stroke='%s' "
                              "stroke-width='1.6' points='%s'/>",
                              Esc(s.name), s.color, pts);
      } else if (n == 1) {  // a lone value: a dot
        double x = 0, y = 0;
        std::sscanf(pts.c_str(), "%lf,%lf", &x, &y);
        absl::StrAppendFormat(&svg,
                              "<circle class='series' data-name='%s' cx='%.1f' cy='%.1f' r='3' "
                              "fill='%s'/>",
                              Esc(s.name), x, y, s.color);
      }
      pts.clear();
      n = 0;
    };
    for (const auto& [x, v] : s.points) {
      if (!std::isfinite(v) || (log_y && v <= 0)) {
        flush();
        continue;
      }
      absl::StrAppendFormat(&pts, "%s%.1f,%.1f", n == 0 ? "" : " ", ax.X(x), Y(v));
      ++n;
    }
    flush();
    absl::StrAppendFormat(&svg,
                          "<rect x='%d' y='10' width='12' height='4' fill='%s'/>"
                          "<text x='%d' y='16' font-size='11'>%s</text>",
                          legend_x, s.color, legend_x + 16, Esc(s.name));
    legend_x += 30 + static_cast<int>(s.name.size()) * 7;
  }
  return svg + "</svg>";
}

// Recipe versions, controller events and checkpoints on the step axis, a lane each.
std::string Timeline(const RunData& run, const StepAxis& ax) {
  constexpr int kH = 190;
  std::string svg = absl::StrFormat(
      "<svg id='timeline' class='plot' xmlns='http://www.w3.org/2000/svg' width='%d' "
      "height='%d' viewBox='0 0 %d %d'><text x='%d' y='20' font-size='14' "
      "font-weight='bold'>Recipe versions, controller events and checkpoints</text>",
      kW, kH, kW, kH, kLeft);
  const int lane_recipe = 50, lane_events = 95, lane_ckpt = 135, y_axis = kH - kBottom;
  for (const auto& [y, name] : std::vector<std::pair<int, const char*>>{
           {lane_recipe, "recipe"}, {lane_events, "events"}, {lane_ckpt, "checkpoints"}}) {
    absl::StrAppendFormat(&svg,
                          "<text x='%d' y='%d' font-size='11' text-anchor='end'>%s</text>"
                          "<line x1='%d' y1='%d' x2='%d' y2='%d' stroke='#eee'/>",
                          kLeft - 6, y + 4, name, kLeft, y, kW - kRight, y);
  }
  // Recipe versions: a band per version, labelled where it starts.
  for (size_t i = 0; i < run.steps.size();) {
    size_t j = i;
    while (j + 1 < run.steps.size() && run.steps[j + 1].recipe_version == run.steps[i].recipe_version)
      ++j;
    const double x0 = std::max<double>(kLeft, ax.X(run.steps[i].step - 0.5));
    const double x1 = std::min<double>(kW - kRight, ax.X(run.steps[j].step + 0.5));
    const int64_t v = run.steps[i].recipe_version;
    absl::StrAppendFormat(&svg,
                          "<rect class='recipe-band' x='%.1f' y='%d' width='%.1f' height='16' "
                          "fill='%s' opacity='0.8'><title>recipe version %d: steps %d-%d</title>"
                          "</rect><text x='%.1f' y='%d' font-size='10' fill='#fff'>v%d</text>",
                          x0, lane_recipe - 8, std::max(1.0, x1 - x0), Ramp(0.15 + 0.2 * (v % 4)),
                          v, run.steps[i].step, run.steps[j].step, x0 + 3, lane_recipe + 4, v);
    i = j + 1;
  }
  // Controller events: a mark each, coloured by kind, the message as its tooltip.
  static const std::map<std::string, std::string> kColour = {
      {"recipe_applied", "#1f77b4"},       {"recipe_updated", "#9ecae1"},
      {"checkpoint_committed", "#2ca02c"}, {"checkpoint_refused", "#d62728"},
      {"layer_demoted", "#ff7f0e"},        {"fp8_health", "#ffbb78"},
      {"layer_recipe_changed", "#ff7f0e"}, {"layer_promoted", "#8c564b"},
      {"worker_lost", "#d62728"},          {"run_failed", "#d62728"},
      {"run_finished", "#333333"},         {"step_skipped", "#e377c2"}};
  for (const EventRow& e : run.events) {
    const auto it = kColour.find(e.kind);
    const std::string colour = it != kColour.end() ? it->second : "#7f7f7f";
    // Events before the first recorded step (run_registered at 0) sit at the axis' start.
    const double x = std::clamp(ax.X(static_cast<double>(e.step)), double{kLeft}, double{kW - kRight});
    absl::StrAppendFormat(&svg,
                          "<circle class='event' data-kind='%s' cx='%.1f' cy='%d' r='5' "
                          "fill='%s'><title>step %d: %s: %s</title></circle>",
                          Esc(e.kind), x, lane_events, colour, e.step, Esc(e.kind),
                          Esc(e.message));
  }
  if (!run.have_events) {
    absl::StrAppendFormat(&svg,
                          "<text x='%d' y='%d' font-size='11' fill='#777'>no events.jsonl: the "
                          "run had no controller</text>",
                          kLeft + 8, lane_events + 4);
  }
  for (const Checkpoint& c : run.checkpoints) {
    const double x = ax.X(static_cast<double>(c.step));
    absl::StrAppendFormat(&svg,
                          "<path class='checkpoint' d='M%.1f %d l6 10 h-12 z' fill='%s'>"
                          "<title>checkpoint of step %d (%s)</title></path>",
                          x, lane_ckpt - 6, c.committed ? "#2ca02c" : "#bbbbbb", c.step,
                          c.committed ? "committed" : "no MANIFEST");
  }
  return svg + XAxis(ax, y_axis) + "</svg>";
}

// Sites x steps, one cell each, coloured by `value` (log10 when `log`); missing cells grey.
std::string Heatmap(const RunData& run, const std::string& id, const std::string& title,
                    bool log, const std::function<double(const SiteCell&)>& value) {
  std::vector<int64_t> steps;
  for (const auto& [site, cells] : run.sites) {
    for (const auto& [step, c] : cells) steps.push_back(step);
  }
  std::sort(steps.begin(), steps.end());
  steps.erase(std::unique(steps.begin(), steps.end()), steps.end());
  const int rows = static_cast<int>(run.sites.size());
  const int label_w = 230, cell_h = std::clamp(480 / std::max(1, rows), 5, 14);
  const int top = 40, height = top + rows * cell_h + 40;
  const double cell_w = static_cast<double>(kW - label_w - kRight) / std::max<size_t>(1, steps.size());
  double lo = std::numeric_limits<double>::infinity(), hi = -lo;
  auto tr = [&](double v) { return log ? (v > 0 ? std::log10(v) : kNaN) : v; };
  for (const auto& [site, cells] : run.sites) {
    for (const auto& [step, c] : cells) {
      const double v = tr(value(c));
      if (!std::isfinite(v)) continue;
      lo = std::min(lo, v);
      hi = std::max(hi, v);
    }
  }
  if (!std::isfinite(lo)) lo = hi = 0;
  std::string svg = absl::StrFormat(
      "<svg id='%s' class='plot heatmap' xmlns='http://www.w3.org/2000/svg' width='%d' "
      "height='%d' viewBox='0 0 %d %d'><text x='8' y='20' font-size='14' "
      "font-weight='bold'>%s</text>",
      id, kW, height, kW, height, Esc(title));
  // The colour scale.
  absl::StrAppendFormat(&svg,
                        "<defs><linearGradient id='%s-ramp'><stop offset='0' stop-color='%s'/>"
                        "<stop offset='0.5' stop-color='%s'/><stop offset='1' stop-color='%s'/>"
                        "</linearGradient></defs><rect x='%d' y='10' width='160' height='10' "
                        "fill='url(#%s-ramp)'/><text x='%d' y='19' font-size='10' "
                        "text-anchor='end'>%s</text><text x='%d' y='19' font-size='10'>%s</text>",
                        id, Ramp(0), Ramp(0.5), Ramp(1), kW - kRight - 230, id,
                        kW - kRight - 234, Fmt(log ? std::pow(10.0, lo) : lo), kW - kRight - 66,
                        Fmt(log ? std::pow(10.0, hi) : hi));
  int r = 0;
  for (const auto& [site, cells] : run.sites) {
    const int y = top + r * cell_h;
    absl::StrAppendFormat(&svg,
                          "<text x='%d' y='%d' font-size='%d' text-anchor='end'>%s</text>",
                          label_w - 6, y + cell_h - 1, std::min(11, cell_h), Esc(site));
    for (size_t k = 0; k < steps.size(); ++k) {
      const auto it = cells.find(steps[k]);
      const double raw = it != cells.end() ? value(it->second) : kNaN;
      const double v = tr(raw);
      const std::string fill =
          std::isfinite(v) ? Ramp(hi > lo ? (v - lo) / (hi - lo) : 0.5) : std::string("#eeeeee");
      absl::StrAppendFormat(&svg,
                            "<rect class='cell' x='%.2f' y='%d' width='%.2f' height='%d' "
                            "fill='%s'><title>%s step %d: %s</title></rect>",
                            label_w + k * cell_w, y, cell_w + 0.3, cell_h, fill, Esc(site),
                            steps[k], Fmt(raw));
    }
    ++r;
  }
  if (!steps.empty()) {
    const int y = top + rows * cell_h + 4;
    for (double t : NiceTicks(static_cast<double>(steps.front()),
                              static_cast<double>(steps.back()), 8)) {
      const auto at = std::lower_bound(steps.begin(), steps.end(), static_cast<int64_t>(t));
      if (at == steps.end()) continue;
      const double x = label_w + (at - steps.begin() + 0.5) * cell_w;
      absl::StrAppendFormat(&svg, "<text x='%.1f' y='%d' font-size='10' text-anchor='middle'>%d"
                                  "</text>", x, y + 10, *at);
    }
  }
  return svg + "</svg>";
}

// ---------------------------------------------------------------------------------------------
// The page

const char kStyle[] =
    "body{font-family:sans-serif;margin:24px;color:#222;max-width:980px}"
    "h1{font-size:22px}h2{font-size:17px;margin-top:28px;border-bottom:1px solid #ccc}"
    "table{border-collapse:collapse;font-size:13px}td,th{border:1px solid #ccc;padding:3px 8px;"
    "text-align:left}th{background:#f3f3f3}svg.plot{display:block;margin:8px 0}"
    ".note{color:#666;font-size:13px}";

}  // namespace

absl::StatusOr<std::string> RenderReport(const std::string& run_dir) {
  FP8RT_ASSIGN_OR_RETURN(const RunData run, Load(fs::path(run_dir)));
  StepAxis ax;
  if (!run.steps.empty()) {
    ax.lo = static_cast<double>(run.steps.front().step);
    ax.hi = static_cast<double>(std::max(run.steps.back().step, run.steps.front().step + 1));
  }
  auto series = [&](const std::string& name, const std::string& colour, double StepRow::*field) {
    Series s{name, colour, {}};
    for (const StepRow& r : run.steps) s.points.emplace_back(r.step, r.*field);
    return s;
  };
  Series val = series("validation loss", "#d62728", &StepRow::val_loss);
  std::erase_if(val.points, [](const auto& p) { return !std::isfinite(p.second); });

  std::string html = absl::StrCat(
      "<!DOCTYPE html><html lang='en'><head><meta charset='utf-8'><title>fp8rt report: ",
      Esc(run.dir.filename().string()), "</title><style>", kStyle, "</style></head><body>",
      "<h1>fp8rt run report: ", Esc(run.dir.string()), "</h1>");

  // Summary.
  int skipped = 0;
  double best_val = kNaN;
  std::vector<double> tps;
  std::vector<int64_t> versions;
  for (const StepRow& r : run.steps) {
    skipped += r.skipped;
    if (std::isfinite(r.val_loss) && !(r.val_loss >= best_val)) best_val = r.val_loss;
    if (std::isfinite(r.tokens_per_s)) tps.push_back(r.tokens_per_s);
    if (versions.empty() || versions.back() != r.recipe_version) versions.push_back(r.recipe_version);
  }
  std::sort(tps.begin(), tps.end());
  const StepRow* first = run.steps.empty() ? nullptr : &run.steps.front();
  const StepRow* last = run.steps.empty() ? nullptr : &run.steps.back();
  std::string version_list;
  for (int64_t v : versions) absl::StrAppend(&version_list, version_list.empty() ? "" : " → ", v);
  html += "<h2>Summary</h2><table id='summary'>";
  const std::vector<std::pair<std::string, std::string>> summary = {
      {"steps recorded", absl::StrCat(run.steps.size(), first ? absl::StrCat(" (", first->step,
                                                                             "–", last->step, ")")
                                                              : "")},
      {"loss first → last", first ? Fmt(first->loss) + " → " + Fmt(last->loss) : "-"},
      {"best validation loss", Fmt(best_val)},
      {"median tokens/s", tps.empty() ? "-" : Fmt(tps[tps.size() / 2])},
      {"skipped steps", absl::StrCat(skipped)},
      {"recipe versions", version_list.empty() ? "-" : version_list},
      {"FP8 sites (fp8_stats files)", absl::StrCat(run.sites.size(), " (", run.stats_files, ")")},
      {"controller events", run.have_events ? absl::StrCat(run.events.size()) : "none recorded"},
      {"checkpoints", absl::StrCat(run.checkpoints.size())}};
  for (const auto& [k, v] : summary) {
    absl::StrAppend(&html, "<tr><th>", Esc(k), "</th><td>", Esc(v), "</td></tr>");
  }
  html += "</table>";

  html += "<h2>Training</h2>";
  html += LineChart("loss", "Loss", ax, {series("loss", "#1f77b4", &StepRow::loss), val}, false);
  html += LineChart("grad-norm", "Gradient norm (log scale)", ax,
                    {series("grad norm", "#9467bd", &StepRow::grad_norm)}, true);
  html += LineChart("tokens-per-s", "Tokens per second", ax,
                    {series("tokens/s", "#2ca02c", &StepRow::tokens_per_s)}, false);

  html += "<h2>Recipes, events and checkpoints</h2>";
  html += Timeline(run, ax);
  if (!run.events.empty()) {
    html += "<table id='events'><tr><th>step</th><th>event</th><th>message</th></tr>";
    for (const EventRow& e : run.events) {
      absl::StrAppend(&html, "<tr><td>", e.step, "</td><td>", Esc(e.kind), "</td><td>",
                      Esc(e.message), "</td></tr>");
    }
    html += "</table>";
  }

  html += "<h2>FP8 health per site</h2>";
  if (run.sites.empty()) {
    html += "<p class='note'>No per-site statistics: the run folder has no fp8_stats/ (set "
            "metrics.per_rank_fp8_stats: true in the run spec).</p>";
  } else {
    html += absl::StrCat("<p class='note'>Each row a quantization site, each column a step with "
                         "statistics (every metrics.every steps). Amax and scale from rank 0 "
                         "(equal on every rank after the amax sync); underflow and saturation "
                         "the mean over ",
                         run.stats_files, " rank file(s). Hover a cell for its value.</p>");
    html += Heatmap(run, "heat-scale", "Scale (log colour)", true,
                    [](const SiteCell& c) { return c.scale; });
    html += Heatmap(run, "heat-amax", "Amax (log colour)", true,
                    [](const SiteCell& c) { return c.amax; });
    html += Heatmap(run, "heat-underflow", "Underflow fraction", false, [](const SiteCell& c) {
      return c.ranks > 0 ? c.underflow / c.ranks : kNaN;
    });
    html += Heatmap(run, "heat-saturation", "Saturation fraction", false, [](const SiteCell& c) {
      return c.ranks > 0 ? c.saturation / c.ranks : kNaN;
    });
  }

  html += "<h2>Checkpoints</h2>";
  if (run.checkpoints.empty()) {
    html += "<p class='note'>No checkpoints in the run folder.</p>";
  } else {
    html += "<table id='checkpoints'><tr><th>step</th><th>state</th><th>files</th>"
            "<th>size</th></tr>";
    for (const Checkpoint& c : run.checkpoints) {
      absl::StrAppend(&html, "<tr><td>", c.step, "</td><td>",
                      c.committed ? "committed" : "incomplete (no MANIFEST)", "</td><td>",
                      c.files, "</td><td>", cli::FormatBytes(c.bytes), "</td></tr>");
    }
    html += "</table>";
  }
  html += "<p class='note'>Written by fp8rt report from the run folder alone.</p></body></html>\n";
  return html;
}

int RunReportCommand(int argc, char** argv) {
  const char* usage =
      "usage: fp8rt report RUN_DIR [--out FILE]\n"
      "  one self-contained HTML file (inline SVG, no network) picturing the run: loss and\n"
      "  validation loss, gradient norm, tokens/s, recipe versions, controller events and\n"
      "  checkpoints on one timeline, per-site heatmaps of scale, amax, underflow and\n"
      "  saturation. Default FILE: RUN_DIR/report.html.\n";
  std::string run_dir, out;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == "--help" || a == "-h") {
      std::fputs(usage, stdout);
      return 0;
    }
    if (a == "--out") {
      if (i + 1 >= argc) {
        std::fprintf(stderr, "fp8rt report: --out needs a file name\n%s", usage);
        return 2;
      }
      out = argv[++i];
    } else if (a.starts_with("--out=")) {
      out = a.substr(6);
    } else if (a.starts_with("-") || !run_dir.empty()) {
      std::fprintf(stderr, "fp8rt report: unexpected argument %s\n%s", QuoteBounded(a).c_str(),
                   usage);
      return 2;
    } else {
      run_dir = a;
    }
  }
  if (run_dir.empty()) {
    std::fprintf(stderr, "fp8rt report: RUN_DIR is required\n%s", usage);
    return 2;
  }
  if (out.empty()) out = (fs::path(run_dir) / "report.html").string();
  const absl::StatusOr<std::string> html = RenderReport(run_dir);
  if (!html.ok()) {
    std::fprintf(stderr, "fp8rt report: %s\n", std::string(html.status().message()).c_str());
    return 2;
  }
  // Written beside its destination and renamed: a reader never sees half a report.
  const std::string tmp = out + ".tmp";
  {
    std::ofstream f(tmp, std::ios::binary | std::ios::trunc);
    f << *html;
    f.close();
    if (!f) {
      std::fprintf(stderr, "fp8rt report: cannot write %s: %s\n", tmp.c_str(),
                   std::strerror(errno));
      return 1;
    }
  }
  std::error_code ec;
  fs::rename(tmp, out, ec);
  if (ec) {
    std::fprintf(stderr, "fp8rt report: cannot write %s: %s\n", out.c_str(), ec.message().c_str());
    fs::remove(tmp, ec);
    return 1;
  }
  std::printf("fp8rt report: wrote %s (%s)\n", out.c_str(),
              cli::FormatBytes(html->size()).c_str());
  return 0;
}

}  // namespace fp8rt::report
