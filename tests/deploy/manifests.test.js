// deploy/kubernetes and deploy/prometheus/operator as `kubectl kustomize` renders them, checked
// offline (lib/manifests.js): schemas (kubernetes-models; the MPIJob against our JSON schema of
// the MPI Operator's v2beta1 API), unknown fields (tsc on kubernetes-models' types), and the
// stack working together (names resolve, one shared volume at one path, ranks = slots x workers
// = dp x tp of run.yaml, forwarded variables, non-root pods), plus what each overlay promises.
// Mutated copies show that each check catches what it is for.
// Run: node tests/deploy/manifests.test.js (ctest: deploy_manifests_test); exit 77 = skipped.
"use strict";

const fs = require("fs");
const path = require("path");
const { execFileSync } = require("child_process");

const here = __dirname;
const repo = path.resolve(here, "..", "..");

function skip(why) {
  console.log(`SKIP: ${why}`);
  process.exit(77);
}
if (!fs.existsSync(path.join(here, "node_modules", "kubernetes-models"))) {
  skip("tests/deploy/node_modules is missing: run scripts/bootstrap (npm ci in tests/deploy)");
}
// kustomize is built into kubectl >= 1.14, but only kubectl >= 1.21 carries a kustomize (v4+)
// that reads these kustomizations (labels:, patches:). kubectl is not packaged by Debian 12
// (its kubernetes-client is 1.20 with kustomize 2.0.3), so scripts/bootstrap cannot install it.
let kustomizeVersion = null;
try {
  const v = JSON.parse(execFileSync("kubectl", ["version", "--client", "-o", "json"],
                                    { encoding: "utf8", stdio: ["ignore", "pipe", "ignore"] }));
  kustomizeVersion = v.kustomizeVersion || null;
} catch (e) {
  skip("kubectl not found: these tests need `kubectl kustomize` (kubectl >= 1.21). Debian 12 " +
       "does not package a recent kubectl, so scripts/bootstrap does not install it; install " +
       "kubectl from the Kubernetes release and rerun");
}
const major = kustomizeVersion && Number((/^v?(\d+)/.exec(kustomizeVersion) || [])[1]);
if (!(major >= 4)) {
  skip(`kubectl's kustomize is ${kustomizeVersion || "missing"}; these kustomizations need ` +
       "kustomize >= v4 (kubectl >= 1.21)");
}

const test = require("node:test");
const assert = require("node:assert/strict");
const YAML = require("yaml");
const m = require("./lib/manifests");

function kustomize(dir) {
  const out = execFileSync("kubectl", ["kustomize", dir], { cwd: repo, encoding: "utf8" });
  return m.parseManifests(out, dir);
}
const clone = (x) => JSON.parse(JSON.stringify(x));
const byKind = (objects, kind) => objects.find((o) => o.kind === kind);

const builds = {
  base: kustomize("deploy/kubernetes/base"),
  cpu: kustomize("deploy/kubernetes/overlays/cpu"),
  gpu: kustomize("deploy/kubernetes/overlays/gpu"),
};

for (const [name, objects] of Object.entries(builds)) {
  test(`${name}: every object passes its schema`, () => {
    assert.deepEqual(m.validateSchemas(objects), []);
    const kinds = objects.map((o) => o.kind).sort();
    // The overlays add the TLS Secret (deploy/kubernetes/components/tls).
    assert.deepEqual(kinds, ["ConfigMap", "Deployment", "MPIJob", "PersistentVolumeClaim",
                             "Secret", ...(name === "base" ? [] : ["Secret"]), "Service"]);
  });
  test(`${name}: no unknown fields (tsc on kubernetes-models' types)`, () => {
    assert.deepEqual(m.typeCheck(objects), []);
  });
  test(`${name}: the objects work together`, () => {
    assert.deepEqual(m.checkStack(objects), []);
  });
}
test("cpu overlay: threads, /dev/shm, vader, :cpu image, no GPUs", () => {
  assert.deepEqual(m.checkFlavor(builds.cpu, "cpu"), []);
});
test("gpu overlay: one rank per GPU, NCCL settings, /dev/shm, :cuda image", () => {
  assert.deepEqual(m.checkFlavor(builds.gpu, "gpu"), []);
});

test("the ConfigMap carries deploy/kubernetes/base/run.yaml as it is", () => {
  const file = fs.readFileSync(path.join(repo, "deploy/kubernetes/base/run.yaml"), "utf8");
  for (const objects of Object.values(builds)) {
    assert.equal(byKind(objects, "ConfigMap").data["run.yaml"], file);
  }
});

test("the base token is a placeholder the controller refuses", () => {
  // fp8rt-controller requires >= 16 characters after trimming (controller_main.cc): a
  // deployment that forgot to replace the Secret stops at start instead of running with it.
  const secret = byKind(builds.base, "Secret");
  const token = secret.stringData
    ? secret.stringData.token : Buffer.from(secret.data.token, "base64").toString();
  assert.ok(token.trim().length < 16, `placeholder '${token}' would be accepted`);
});

test("cpu and gpu overlays: the controller serves TLS and every rank verifies it", () => {
  for (const name of ["cpu", "gpu"]) {
    const objects = builds[name];
    const args = byKind(objects, "Deployment").spec.template.spec.containers[0].args;
    assert.ok(args.includes("--tls-cert") && args.includes("--tls-key"), `${name}: no TLS`);
    const launcher = byKind(objects, "MPIJob").spec.mpiReplicaSpecs.Launcher.template.spec
      .containers[0];
    assert.equal(launcher.args[launcher.args.indexOf("--tls-ca") + 1], "/etc/fp8rt/tls/ca.crt");
    const grpc = byKind(objects, "Service").spec.ports.find((p) => p.name === "grpc");
    assert.equal(grpc.appProtocol, "https", name);
    // The Secret is a placeholder that fp8rt-controller refuses (not PEM: controller_main.cc,
    // tests/integration/cli_control_test.cc), like the token.
    const tls = objects.find((o) => o.kind === "Secret" && o.metadata.name === "fp8rt-tls");
    for (const key of ["tls.crt", "tls.key", "ca.crt"]) {
      const v = tls.stringData ? tls.stringData[key]
        : Buffer.from(tls.data[key], "base64").toString();
      assert.ok(!v.includes("-----BEGIN"), `${name}: ${key} is not a placeholder`);
    }
  }
});

const tlsSecret = (o) => o.find((x) => x.kind === "Secret" && x.metadata.name === "fp8rt-tls");

// Each mutation breaks one thing the checks are for; the error must say what.
const mutations = [
  ["Worker pods without the TLS Secret", "cpu", (o) => {
    const w = byKind(o, "MPIJob").spec.mpiReplicaSpecs.Worker.template.spec.containers[0];
    w.volumeMounts = w.volumeMounts.filter((v) => v.name !== "tls");
  }, "checkStack", /--tls-ca: \/etc\/fp8rt\/tls\/ca\.crt is on no volume mounted/],
  ["a gRPC probe on a TLS port", "gpu", (o) => {
    byKind(o, "Deployment").spec.template.spec.containers[0].readinessProbe =
      { grpc: { port: 50051 } };
  }, "checkStack", /readinessProbe is a gRPC probe/],
  ["ranks that do not verify a TLS controller", "cpu", (o) => {
    const l = byKind(o, "MPIJob").spec.mpiReplicaSpecs.Launcher.template.spec.containers[0];
    l.args.splice(l.args.indexOf("--tls-ca"), 2);
  }, "checkStack", /serves TLS but the ranks have no --tls-ca/],
  ["a TLS Secret without the CA", "gpu", (o) => {
    delete tlsSecret(o).stringData["ca.crt"];
  }, "checkStack", /Secret fp8rt-tls has no key 'ca\.crt'/],
  ["a misspelt container field", "cpu", (o) => {
    byKind(o, "Deployment").spec.template.spec.containers[0].imagePullPolcy = "Always";
  }, "typeCheck", /imagePullPolcy/],
  ["an MPIJob field the operator does not know", "cpu", (o) => {
    byKind(o, "MPIJob").spec.slotsPerWorkers = 2;
  }, "validateSchemas", /slotsPerWorkers/],
  ["a cleanPodPolicy outside the enum", "cpu", (o) => {
    byKind(o, "MPIJob").spec.runPolicy.cleanPodPolicy = "Sometimes";
  }, "validateSchemas", /cleanPodPolicy.*allowed values/],
  ["a bad port type in a pod template", "gpu", (o) => {
    byKind(o, "MPIJob").spec.mpiReplicaSpecs.Worker.template.spec.containers[0].ports =
      [{ containerPort: "ssh" }];
  }, "validateSchemas", /Worker\.template.*containerPort/],
  ["workers that do not add up to the spec's world", "cpu", (o) => {
    byKind(o, "MPIJob").spec.mpiReplicaSpecs.Worker.replicas = 3;
  }, "checkStack", /-np 2 != slotsPerWorker 1 x Worker replicas 3/],
  ["a spec whose dp x tp differs from the ranks", "cpu", (o) => {
    const cm = byKind(o, "ConfigMap");
    cm.data["run.yaml"] = cm.data["run.yaml"].replace(/^( +)dp: 2$/m, "$1dp: 4");
  }, "checkStack", /parallel\.dp x parallel\.tp = 4, but mpirun -np 2/],
  ["a variable set on the Worker (never reaches the ranks)", "gpu", (o) => {
    byKind(o, "MPIJob").spec.mpiReplicaSpecs.Worker.template.spec.containers[0].env =
      [{ name: "NCCL_DEBUG", value: "INFO" }];
  }, "checkStack", /Worker env NCCL_DEBUG never reaches the ranks/],
  ["a Launcher variable mpirun does not forward", "gpu", (o) => {
    byKind(o, "MPIJob").spec.mpiReplicaSpecs.Launcher.template.spec.containers[0].env
      .push({ name: "NCCL_IB_DISABLE", value: "1" });
  }, "checkStack", /NCCL_IB_DISABLE is not forwarded/],
  ["a Service that selects no controller", "base", (o) => {
    byKind(o, "Service").spec.selector["app.kubernetes.io/component"] = "ctl";
  }, "checkStack", /selector app\.kubernetes\.io\/component=ctl does not match/],
  ["a controller listening on loopback", "base", (o) => {
    const args = byKind(o, "Deployment").spec.template.spec.containers[0].args;
    args[args.indexOf("0.0.0.0:50051")] = "127.0.0.1:50051";
  }, "checkStack", /--listen must be 0\.0\.0\.0:PORT/],
  ["workers that point at another controller", "base", (o) => {
    const args = byKind(o, "MPIJob").spec.mpiReplicaSpecs.Launcher.template.spec.containers[0].args;
    args[args.indexOf("fp8rt-controller:50051")] = "controller:50051";
  }, "checkStack", /--controller host controller is not Service fp8rt-controller/],
  ["run folders on a volume the controller does not see", "base", (o) => {
    const pod = byKind(o, "MPIJob").spec.mpiReplicaSpecs.Worker.template.spec;
    pod.volumes.find((v) => v.name === "data").persistentVolumeClaim.claimName = "other";
  }, "checkStack", /--run-dir \/data\/runs\/tiny is not on PersistentVolumeClaim fp8rt-data/],
  ["a ReadWriteOnce volume", "base", (o) => {
    byKind(o, "PersistentVolumeClaim").spec.accessModes = ["ReadWriteOnce"];
  }, "checkStack", /ReadWriteMany/],
  ["a root worker", "base", (o) => {
    byKind(o, "MPIJob").spec.mpiReplicaSpecs.Worker.template.spec.securityContext.runAsUser = 0;
  }, "checkStack", /Worker: securityContext\.runAsUser must be a non-zero uid/],
  ["a launcher without --resume", "base", (o) => {
    const c = byKind(o, "MPIJob").spec.mpiReplicaSpecs.Launcher.template.spec.containers[0];
    c.args = c.args.filter((a) => a !== "--resume");
  }, "checkStack", /--resume is missing/],
  ["GPU pods whose ranks run on CPU", "gpu", (o) => {
    const args = byKind(o, "MPIJob").spec.mpiReplicaSpecs.Launcher.template.spec.containers[0].args;
    args.splice(args.indexOf("--set"), 2);
  }, "checkFlavor:gpu", /ranks run on CPU in GPU pods/],
  ["GPUs that do not match the slots", "gpu", (o) => {
    byKind(o, "MPIJob").spec.mpiReplicaSpecs.Worker.template.spec.containers[0]
      .resources.limits["nvidia.com/gpu"] = 1;
  }, "checkFlavor:gpu", /nvidia\.com\/gpu limit 1 != slotsPerWorker 2/],
  ["no /dev/shm on CPU workers", "cpu", (o) => {
    const c = byKind(o, "MPIJob").spec.mpiReplicaSpecs.Worker.template.spec.containers[0];
    c.volumeMounts = c.volumeMounts.filter((v) => v.mountPath !== "/dev/shm");
  }, "checkFlavor:cpu", /Memory emptyDir at \/dev\/shm/],
];
for (const [what, build, mutate, check, expected] of mutations) {
  test(`the checks catch ${what}`, () => {
    const objects = clone(builds[build]);
    mutate(objects);
    const [fn, flavor] = check.split(":");
    const errors = flavor ? m.checkFlavor(objects, flavor) : m[fn](objects);
    assert.match(errors.join("\n"), expected);
  });
}

// --- the Prometheus Operator's resources -------------------------------------------------------

const operator = kustomize("deploy/prometheus/operator");

test("operator: ServiceMonitor and PrometheusRule pass their schemas and types", () => {
  assert.deepEqual(operator.map((o) => o.kind).sort(), ["PrometheusRule", "ServiceMonitor"]);
  assert.deepEqual(m.validateSchemas(operator), []);
  assert.deepEqual(m.typeCheck(operator), []);
});

test("operator: the ServiceMonitor scrapes the controller's metrics port", () => {
  const sm = byKind(operator, "ServiceMonitor");
  const service = byKind(builds.base, "Service");
  for (const [k, v] of Object.entries(sm.spec.selector.matchLabels)) {
    assert.equal(service.metadata.labels[k], v, `Service label ${k}`);
  }
  const port = service.spec.ports.find((p) => p.name === sm.spec.endpoints[0].port);
  assert.ok(port, `the Service has no port named ${sm.spec.endpoints[0].port}`);
  const container = byKind(builds.base, "Deployment").spec.template.spec.containers[0];
  const target = container.ports.find((p) => p.name === port.targetPort);
  const metricsListen = container.args[container.args.indexOf("--metrics-listen") + 1];
  assert.equal(`0.0.0.0:${target.containerPort}`, metricsListen);
  assert.equal(sm.spec.endpoints[0].path, "/metrics");
});

test("operator: the PrometheusRule holds exactly the groups of rules.yml", () => {
  const rules = YAML.parse(fs.readFileSync(path.join(repo, "deploy/prometheus/rules.yml"), "utf8"));
  assert.deepEqual(byKind(operator, "PrometheusRule").spec.groups, rules.groups);
});
