// deploy/grafana: the dashboard JSON and the provisioning files, offline (no Grafana here).
//   - structure: schemaVersion, unique panel ids, gridPos on the 24-column grid without
//     overlaps, the datasource/run/layer variables, every query on the datasource variable,
//     every $variable defined, the panels the dashboard promises (loss linear and log, the
//     validation loss with the training loss, tokens/s, grad norm, per-layer
//     scale/underflow/saturation, checkpoint age, workers, recipe version);
//   - types: the dashboard as a TypeScript literal of @grafana/schema's Dashboard, and each
//     panel's options and custom field config as its panel plugin's Options / FieldConfig (tsc:
//     unknown or misspelt fields and wrong value types are errors);
//   - provisioning: the datasource and dashboard provider files.
// The PromQL of every query is evaluated by a real Prometheus in monitoring_test.cc.
// Run: node tests/deploy/dashboard.test.js (ctest: deploy_dashboard_test); exit 77 = skipped.
"use strict";

const fs = require("fs");
const os = require("os");
const path = require("path");

const here = __dirname;
const repo = path.resolve(here, "..", "..");
if (!fs.existsSync(path.join(here, "node_modules", "@grafana", "schema"))) {
  console.log("SKIP: tests/deploy/node_modules is missing: run scripts/bootstrap (npm ci in " +
              "tests/deploy installs @grafana/schema and typescript)");
  process.exit(77);
}

const test = require("node:test");
const assert = require("node:assert/strict");
const YAML = require("yaml");
const { runTsc } = require("./lib/manifests");

const dashboardFile = path.join(repo, "deploy", "grafana", "dashboards", "fp8rt.json");
const dashboard = JSON.parse(fs.readFileSync(dashboardFile, "utf8"));

// Every panel, with the panels of collapsed rows.
function allPanels(d) {
  const out = [];
  for (const p of d.panels || []) {
    out.push(p);
    for (const inner of p.panels || []) out.push(inner);
  }
  return out;
}
const panels = allPanels(dashboard);
const queryPanels = panels.filter((p) => p.type !== "row");
const exprs = (p) => (p.targets || []).map((t) => t.expr);

test("schemaVersion, uid, title", () => {
  assert.ok(Number.isInteger(dashboard.schemaVersion) && dashboard.schemaVersion >= 36,
            `schemaVersion ${dashboard.schemaVersion}`);
  assert.match(dashboard.uid, /^[a-zA-Z0-9_-]{1,40}$/);
  assert.ok(dashboard.title);
});

test("panel ids are unique", () => {
  const ids = panels.map((p) => p.id);
  assert.equal(new Set(ids).size, ids.length, `ids ${ids}`);
  for (const id of ids) assert.ok(Number.isInteger(id) && id > 0, `id ${id}`);
});

test("gridPos on the 24-column grid, no overlaps", () => {
  const boxes = [];
  for (const p of dashboard.panels) {
    const g = p.gridPos;
    assert.ok(g, `panel ${p.id} (${p.title}) has no gridPos`);
    for (const k of ["x", "y", "w", "h"]) {
      assert.ok(Number.isInteger(g[k]) && g[k] >= 0, `panel ${p.id} gridPos.${k} = ${g[k]}`);
    }
    assert.ok(g.w >= 1 && g.h >= 1, `panel ${p.id} is empty`);
    assert.ok(g.x + g.w <= 24, `panel ${p.id} (${p.title}) ends at column ${g.x + g.w} > 24`);
    if (p.type === "row") assert.deepEqual([g.x, g.w, g.h], [0, 24, 1], `row ${p.title}`);
    for (const b of boxes) {
      const apart = g.x + g.w <= b.g.x || b.g.x + b.g.w <= g.x || g.y + g.h <= b.g.y ||
                    b.g.y + b.g.h <= g.y;
      assert.ok(apart, `panels ${b.id} (${b.title}) and ${p.id} (${p.title}) overlap`);
    }
    boxes.push({ id: p.id, title: p.title, g });
  }
  // Panels are listed top to bottom, as Grafana lays them out.
  const ys = dashboard.panels.map((p) => p.gridPos.y);
  assert.deepEqual(ys, [...ys].sort((a, b) => a - b));
});

const vars = Object.fromEntries(dashboard.templating.list.map((v) => [v.name, v]));

test("variables: a prometheus datasource, run and layer from label_values", () => {
  assert.equal(vars.datasource && vars.datasource.type, "datasource");
  assert.equal(vars.datasource.query, "prometheus");
  for (const [name, label] of [["run", "run"], ["layer", "layer"]]) {
    const v = vars[name];
    assert.ok(v, `variable ${name} is missing`);
    assert.equal(v.type, "query");
    assert.equal(v.datasource.uid, "${datasource}");
    const q = typeof v.query === "string" ? v.query : v.query.query;
    assert.match(q, new RegExp(`^label_values\\((fp8rt_[a-z0-9_]+)(\\{[^}]*\\})?,\\s*${label}\\)$`),
                 `variable ${name}: ${q}`);
  }
  assert.equal(vars.run.multi, false, "panels select one run with run=\"$run\"");
  assert.equal(vars.layer.multi, true);
});

test("every query runs on the datasource variable", () => {
  for (const p of queryPanels) {
    assert.deepEqual(p.datasource, { type: "prometheus", uid: "${datasource}" },
                     `panel ${p.title}`);
    const refs = new Set();
    for (const t of p.targets || []) {
      assert.deepEqual(t.datasource, p.datasource, `panel ${p.title} target ${t.refId}`);
      assert.ok(t.expr && t.expr.trim(), `panel ${p.title} target ${t.refId} has no expr`);
      assert.ok(!refs.has(t.refId), `panel ${p.title}: refId ${t.refId} twice`);
      refs.add(t.refId);
    }
    assert.ok(refs.size > 0, `panel ${p.title} has no query`);
  }
  for (const a of dashboard.annotations.list.filter((a) => !a.builtIn)) {
    assert.equal(a.datasource.uid, "${datasource}", `annotation ${a.name}`);
  }
});

test("every $variable used is defined", () => {
  const builtins = new Set(["__rate_interval", "__interval", "__range", "__range_s", "__range_ms",
                            "__interval_ms"]);
  const text = JSON.stringify(dashboard);
  for (const m of text.matchAll(/\$\{?([A-Za-z_][A-Za-z0-9_]*)/g)) {
    assert.ok(vars[m[1]] || builtins.has(m[1]), `$${m[1]} is not a variable of the dashboard`);
  }
  // A repeated panel repeats over a defined multi-value variable.
  for (const p of panels.filter((p) => p.repeat)) {
    assert.ok(vars[p.repeat] && vars[p.repeat].multi, `panel ${p.title} repeats ${p.repeat}`);
  }
});

function panelsUsing(re, type) {
  return queryPanels.filter((p) => (!type || p.type === type) && exprs(p).some((e) => re.test(e)));
}
const isLog = (p) => {
  const s = ((p.fieldConfig.defaults.custom || {}).scaleDistribution || {});
  return s.type === "log";
};

test("the promised panels are there", () => {
  const loss = panelsUsing(/fp8rt_train_loss/, "timeseries");
  assert.ok(loss.some((p) => !isLog(p)), "loss on a linear axis");
  assert.ok(loss.some(isLog), "loss on a log axis");
  // The validation loss (eval.every), next to the training loss it is compared with.
  const val = panelsUsing(/fp8rt_eval_loss/, "timeseries");
  assert.equal(val.length, 1, "one validation loss panel");
  assert.ok(exprs(val[0]).some((e) => /fp8rt_train_loss/.test(e)),
            "the validation loss panel shows the training loss too");
  assert.ok(exprs(val[0]).includes('fp8rt_eval_loss{run="$run"}'), `${exprs(val[0])}`);
  assert.ok(val[0].gridPos.y < 17, "the validation loss is in the Training row");
  assert.ok(panelsUsing(/fp8rt_tokens_per_second/, "timeseries").length > 0, "tokens/s");
  assert.ok(panelsUsing(/fp8rt_grad_norm/, "timeseries").length > 0, "grad norm");
  const perLayer = (re) => panelsUsing(re).filter((p) => exprs(p).some((e) => /\$layer/.test(e)));
  assert.ok(perLayer(/fp8rt_fp8_scale/).length > 0, "per-layer scale");
  for (const [name, re] of [["underflow", /fp8rt_fp8_underflow_ratio/],
                            ["saturation", /fp8rt_fp8_saturation_ratio/]]) {
    assert.ok(perLayer(re).some((p) => p.type === "heatmap"), `${name} heatmap`);
    assert.ok(perLayer(re).some((p) => p.type === "timeseries" && p.repeat === "layer"),
              `${name} per layer over time (repeated panel)`);
    for (const p of perLayer(re)) {
      assert.equal(p.fieldConfig.defaults.unit, "percentunit", `${p.title}: ratios as percent`);
    }
  }
  const age = /time\(\)\s*-\s*fp8rt_checkpoint_last_committed_timestamp_seconds/;
  assert.ok(panelsUsing(age).length > 0, "checkpoint age");
  assert.ok(panelsUsing(/fp8rt_workers_connected/).length > 0, "workers connected");
  assert.ok(panelsUsing(/fp8rt_recipe_version/).length > 0, "recipe version");
  // Per-run panels select the run.
  for (const p of queryPanels) {
    for (const e of exprs(p)) assert.match(e, /run="\$run"/, `panel ${p.title}: ${e}`);
  }
});

// tsc: string enums of @grafana/schema accept their values as strings in JSON, so types are
// mapped to plain literals first (JSONish); optional fields and excess-property checks remain.
function typeCheckDashboard(d) {
  const plugin = (type) => ({ timeseries: "timeseries", stat: "stat", heatmap: "heatmap" })[type];
  const base = "@grafana/schema/dist/types/raw/composable";
  const lines = [
    'import type { AnnotationQuery, Dashboard, DataQuery } from "@grafana/schema";',
    `import type * as timeseries from "${base}/timeseries/panelcfg/x/types.gen";`,
    `import type * as stat from "${base}/stat/panelcfg/x/types.gen";`,
    `import type * as heatmap from "${base}/heatmap/panelcfg/x/types.gen";`,
    "type JSONish<T> = T extends string ? `${T}` : T extends number ? number :",
    "  T extends boolean ? boolean : T extends (infer U)[] ? JSONish<U>[] :",
    "  T extends object ? { [K in keyof T]: JSONish<T[K]> } : T;",
    // The schema's DataQuery is what every datasource's query has in common; a query's own
    // fields (Prometheus: expr, legendFormat, ...) are the datasource plugin's.
    "type Query = JSONish<DataQuery> & { [field: string]: unknown };",
    'type Annotation = Omit<JSONish<AnnotationQuery>, "target"> & { target?: Query };',
    'type Dash = Omit<JSONish<Dashboard>, "annotations"> &',
    "  { annotations?: { list?: Annotation[] } };",
    `export const dashboard: Dash = ${JSON.stringify(d)};`,
  ];
  const labels = [["dashboard", "dashboard"]];
  for (const p of allPanels(d).filter((p) => p.type !== "row")) {
    const ns = plugin(p.type);
    if (!ns) return [`panel ${p.title}: type ${p.type} has no options type here (add it)`];
    lines.push(`export const p${p.id}_options: JSONish<${ns}.Options> = ` +
               `${JSON.stringify(p.options)};`);
    labels.push([`p${p.id}_options`, `panel ${p.id} (${p.title}) options`]);
    const custom = (p.fieldConfig.defaults || {}).custom;
    if (custom) {
      lines.push(`export const p${p.id}_custom: JSONish<${ns}.FieldConfig> = ` +
                 `${JSON.stringify(custom)};`);
      labels.push([`p${p.id}_custom`, `panel ${p.id} (${p.title}) fieldConfig.defaults.custom`]);
    }
  }
  const dir = fs.mkdtempSync(path.join(os.tmpdir(), "fp8rt-dashboard-"));
  try {
    fs.symlinkSync(path.join(here, "node_modules"), path.join(dir, "node_modules"));
    const file = path.join(dir, "dashboard.ts");
    fs.writeFileSync(file, lines.join("\n") + "\n");
    return runTsc(file, lines, labels);
  } finally {
    fs.rmSync(dir, { recursive: true, force: true });
  }
}

test("types: @grafana/schema Dashboard and each panel plugin's options", () => {
  assert.deepEqual(typeCheckDashboard(dashboard), []);
});

test("the type check sees misspelt fields and wrong values", () => {
  const broken = JSON.parse(JSON.stringify(dashboard));
  const ts = allPanels(broken).find((p) => p.type === "timeseries");
  ts.options.legend.placment = "bottom";
  const heat = allPanels(broken).find((p) => p.type === "heatmap");
  heat.options.color.mode = "rainbow";
  broken.graphTooltpi = 1;
  const errors = typeCheckDashboard(broken).join("\n");
  assert.match(errors, /placment/);
  assert.match(errors, /rainbow/);
  assert.match(errors, /graphTooltpi/);
});

test("provisioning: a prometheus datasource and a file provider", () => {
  const prov = path.join(repo, "deploy", "grafana", "provisioning");
  const ds = YAML.parse(fs.readFileSync(path.join(prov, "datasources", "fp8rt.yaml"), "utf8"));
  assert.equal(ds.apiVersion, 1);
  assert.equal(ds.datasources.length, 1);
  assert.equal(ds.datasources[0].type, "prometheus");
  assert.match(ds.datasources[0].url, /^https?:\/\//);
  const db = YAML.parse(fs.readFileSync(path.join(prov, "dashboards", "fp8rt.yaml"), "utf8"));
  assert.equal(db.apiVersion, 1);
  assert.equal(db.providers[0].type, "file");
  assert.ok(path.isAbsolute(db.providers[0].options.path));
});
