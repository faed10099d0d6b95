// Offline validation of fp8rt's Kubernetes manifests (the output of `kubectl kustomize` or of
// `fp8rt k8s render`). Index:
//   parseManifests      multi-document YAML -> objects (a YAML error is an error)
//   validateSchemas     every object against its kind's schema: core kinds and the Prometheus
//                       Operator's with kubernetes-models, the MPIJob with our JSON schema of the
//                       MPI Operator's v2beta1 API (ajv) and its pod templates as PodTemplateSpecs
//   typeCheck           the same objects as TypeScript literals of kubernetes-models' interfaces:
//                       unknown fields (typos) are errors, which the schemas above let through
//   checkStack          what makes the objects work together: names that resolve, one shared
//                       volume at the same path, ranks = slots x workers = dp x tp of run.yaml,
//                       variables that reach the ranks, non-root pods, probes, resources
//   checkFlavor         what the cpu and gpu overlays promise (threads, /dev/shm, GPUs, NCCL)
// Every check returns a list of error strings naming the object and the field; empty = valid.
"use strict";

const fs = require("fs");
const os = require("os");
const path = require("path");
const { execFileSync } = require("child_process");
const YAML = require("yaml");
const Ajv = require("ajv");

// kind -> apiVersion, the kubernetes-models module of its class and its TypeScript interface.
const KINDS = {
  Deployment: { apiVersion: "apps/v1", module: "kubernetes-models/apps/v1/Deployment" },
  Service: { apiVersion: "v1", module: "kubernetes-models/v1/Service" },
  PersistentVolumeClaim: {
    apiVersion: "v1",
    module: "kubernetes-models/v1/PersistentVolumeClaim",
  },
  Secret: { apiVersion: "v1", module: "kubernetes-models/v1/Secret" },
  ConfigMap: { apiVersion: "v1", module: "kubernetes-models/v1/ConfigMap" },
  ServiceMonitor: {
    apiVersion: "monitoring.coreos.com/v1",
    module: "@kubernetes-models/prometheus-operator/monitoring.coreos.com/v1/ServiceMonitor",
  },
  PrometheusRule: {
    apiVersion: "monitoring.coreos.com/v1",
    module: "@kubernetes-models/prometheus-operator/monitoring.coreos.com/v1/PrometheusRule",
  },
};
const POD_TEMPLATE_MODULE = "kubernetes-models/v1/PodTemplateSpec";

function parseManifests(text, source) {
  const docs = YAML.parseAllDocuments(text);
  const objects = [];
  for (const doc of docs) {
    if (doc.errors.length > 0) throw new Error(`${source}: ${doc.errors[0].message}`);
    const obj = doc.toJS();
    if (obj !== null && obj !== undefined) objects.push(obj);
  }
  return objects;
}

function describe(obj) {
  return `${obj.kind}/${obj.metadata && obj.metadata.name}`;
}

let mpijobValidator = null;
function mpijobSchema() {
  if (mpijobValidator === null) {
    const schema = JSON.parse(
      fs.readFileSync(path.join(__dirname, "..", "mpijob-v2beta1.schema.json"), "utf8"),
    );
    mpijobValidator = new Ajv({ allErrors: true, strict: true }).compile(schema);
  }
  return mpijobValidator;
}

function modelErrors(Class, data, what) {
  try {
    new Class(data).validate();
    return [];
  } catch (e) {
    return [`${what}: ${e.message}`];
  }
}

// kustomize wraps long base64 values of Secret data over several lines; the API server decodes
// them with Go's base64 decoder, which skips line breaks, but the schema's "byte" format does not:
// check the value without them.
function forSchema(obj) {
  if (obj.kind !== "Secret" || !obj.data) return obj;
  const data = Object.fromEntries(Object.entries(obj.data).map(([k, v]) =>
    [k, String(v).replace(/[\r\n]/g, "")]));
  return { ...obj, data };
}

function validateSchemas(objects) {
  const errors = [];
  for (const obj of objects) {
    const what = describe(obj);
    if (obj.kind === "MPIJob") {
      const validate = mpijobSchema();
      if (!validate(obj)) {
        for (const e of validate.errors) {
          errors.push(`${what}: ${e.instancePath || "/"} ${e.message} ${JSON.stringify(e.params)}`);
        }
      }
      const { PodTemplateSpec } = require(POD_TEMPLATE_MODULE);
      for (const [role, replica] of Object.entries((obj.spec && obj.spec.mpiReplicaSpecs) || {})) {
        if (replica && replica.template) {
          errors.push(
            ...modelErrors(PodTemplateSpec, replica.template, `${what} ${role}.template`),
          );
        }
      }
      continue;
    }
    const entry = KINDS[obj.kind];
    if (!entry) {
      errors.push(`${what}: unexpected kind ${obj.kind} (apiVersion ${obj.apiVersion})`);
      continue;
    }
    if (obj.apiVersion !== entry.apiVersion) {
      errors.push(`${what}: apiVersion ${obj.apiVersion}, expected ${entry.apiVersion}`);
    }
    const Class = require(entry.module)[obj.kind];
    errors.push(...modelErrors(Class, forSchema(obj), what));
  }
  return errors;
}

// Writes every object as a typed TypeScript constant and runs tsc: excess-property checks make
// unknown fields errors at any depth. The MPIJob's pod templates are typed as PodTemplateSpecs.
function typeCheck(objects) {
  const dir = fs.mkdtempSync(path.join(os.tmpdir(), "fp8rt-manifests-"));
  try {
    fs.symlinkSync(path.join(__dirname, "..", "node_modules"), path.join(dir, "node_modules"));
    const lines = [];
    const imported = new Set();
    const use = (module, iface) => {
      if (!imported.has(iface)) {
        lines.push(`import type { ${iface} } from "${module}";`);
        imported.add(iface);
      }
      return iface;
    };
    const labels = [];
    objects.forEach((obj, i) => {
      if (obj.kind === "MPIJob") {
        for (const [role, replica] of Object.entries(obj.spec.mpiReplicaSpecs || {})) {
          const t = use(POD_TEMPLATE_MODULE, "IPodTemplateSpec");
          lines.push(`export const o${i}_${role}: ${t} = ${JSON.stringify(replica.template)};`);
          labels.push([`o${i}_${role}`, `${describe(obj)} ${role}.template`]);
        }
        return;
      }
      const entry = KINDS[obj.kind];
      if (!entry) return;  // reported by validateSchemas
      const t = use(entry.module, `I${obj.kind}`);
      lines.push(`export const o${i}: ${t} = ${JSON.stringify(obj)};`);
      labels.push([`o${i}`, describe(obj)]);
    });
    const file = path.join(dir, "manifests.ts");
    fs.writeFileSync(file, lines.join("\n") + "\n");
    return runTsc(file, lines, labels);
  } finally {
    fs.rmSync(dir, { recursive: true, force: true });
  }
}

// Runs tsc on `file`; its diagnostics, each with the constant's label (what it was built from).
function runTsc(file, lines, labels) {
  const tsc = require.resolve("typescript/bin/tsc");
  try {
    execFileSync(
      process.execPath,
      [tsc, "--noEmit", "--strict", "--skipLibCheck", "--module", "commonjs", "--moduleResolution",
       "node", "--target", "es2020", file],
      { encoding: "utf8", stdio: ["ignore", "pipe", "pipe"] },
    );
    return [];
  } catch (e) {
    const out = `${e.stdout || ""}${e.stderr || ""}`.trim();
    return out.split("\n").filter((l) => l.trim() !== "").map((l) => {
      const m = /\((\d+),(\d+)\)/.exec(l);
      const line = m ? lines[Number(m[1]) - 1] || "" : "";
      const label = labels.find(([name]) => line.startsWith(`export const ${name}:`));
      return `${label ? label[1] : "typescript"}: ${l.replace(/^.*?error /, "error ")}`;
    });
  }
}

// --- stack checks -------------------------------------------------------------------------------

function ofKind(objects, kind) {
  return objects.filter((o) => o.kind === kind);
}

function envValue(container, name) {
  const e = (container.env || []).find((v) => v.name === name);
  return e ? e.value : undefined;
}

// Kubernetes' $(VAR) expansion of command/args from the container's env.
function expand(container, s) {
  return String(s).replace(/\$\(([A-Za-z_][A-Za-z0-9_]*)\)/g, (m, name) => {
    const v = envValue(container, name);
    return v === undefined ? m : v;
  });
}

// The value after `flag` in an argument list (flag value) or of --flag=value.
function flagValue(args, flag) {
  for (let i = 0; i < args.length; ++i) {
    if (args[i] === flag && i + 1 < args.length) return args[i + 1];
    if (args[i].startsWith(`${flag}=`)) return args[i].slice(flag.length + 1);
  }
  return undefined;
}

// The volume mounted at the longest mountPath that contains `file`, with the path inside it.
function volumeFor(podSpec, container, file) {
  let best = null;
  for (const m of container.volumeMounts || []) {
    const mp = m.mountPath.replace(/\/$/, "");
    if (file === mp || file.startsWith(`${mp}/`)) {
      if (!best || mp.length > best.mount.mountPath.length) best = { mount: m };
    }
  }
  if (!best) return null;
  best.volume = (podSpec.volumes || []).find((v) => v.name === best.mount.name) || null;
  best.rest = file.slice(best.mount.mountPath.replace(/\/$/, "").length).replace(/^\//, "");
  return best;
}

// For `file` read by `container`: which Secret/ConfigMap key or PVC it comes from, or an error.
function resolveFile(podSpec, container, file, what) {
  const found = volumeFor(podSpec, container, file);
  if (!found) return { error: `${what}: ${file} is on no volume mounted in the container` };
  if (!found.volume) {
    return { error: `${what}: volumeMount ${found.mount.name} names no volume of the pod` };
  }
  const v = found.volume;
  const key = found.mount.subPath || found.rest;
  if (v.secret) return { secret: v.secret.secretName, key, mount: found.mount };
  if (v.configMap) return { configMap: v.configMap.name, key, mount: found.mount };
  if (v.persistentVolumeClaim) {
    return { pvc: v.persistentVolumeClaim.claimName, mount: found.mount, rest: found.rest };
  }
  return { other: v, mount: found.mount };
}

function checkKeySource(objects, ref, what, errors) {
  if (ref.error) return errors.push(ref.error);
  if (ref.secret !== undefined) {
    const s = ofKind(objects, "Secret").find((o) => o.metadata.name === ref.secret);
    if (!s) return errors.push(`${what}: Secret ${ref.secret} is not among the manifests`);
    const keys = Object.keys({ ...(s.data || {}), ...(s.stringData || {}) });
    if (!keys.includes(ref.key)) {
      errors.push(`${what}: Secret ${ref.secret} has no key '${ref.key}' (has ${keys})`);
    }
  } else if (ref.configMap !== undefined) {
    const c = ofKind(objects, "ConfigMap").find((o) => o.metadata.name === ref.configMap);
    if (!c) return errors.push(`${what}: ConfigMap ${ref.configMap} is not among the manifests`);
    if (!Object.keys(c.data || {}).includes(ref.key)) {
      errors.push(`${what}: ConfigMap ${ref.configMap} has no key '${ref.key}'`);
    }
  } else {
    errors.push(`${what}: expected a file from a Secret or a ConfigMap`);
  }
}

function checkPodSecurity(podSpec, what, errors) {
  const sc = podSpec.securityContext || {};
  if (sc.runAsNonRoot !== true) errors.push(`${what}: securityContext.runAsNonRoot must be true`);
  if (!(sc.runAsUser > 0)) errors.push(`${what}: securityContext.runAsUser must be a non-zero uid`);
  for (const c of podSpec.containers) {
    const csc = c.securityContext || {};
    if (csc.allowPrivilegeEscalation !== false) {
      errors.push(`${what} container ${c.name}: allowPrivilegeEscalation must be false`);
    }
    if (csc.privileged) errors.push(`${what} container ${c.name}: must not be privileged`);
    if (!c.resources || !c.resources.requests || !c.resources.requests.memory) {
      errors.push(`${what} container ${c.name}: resources.requests.memory is missing`);
    }
  }
  return sc.runAsUser;
}

// A Service port's targetPort as the container port number it reaches, or undefined.
function targetContainerPort(container, targetPort) {
  for (const p of container.ports || []) {
    if (p.name === targetPort || p.containerPort === targetPort) return p.containerPort;
  }
  return undefined;
}

// The world size of run.yaml: parallel.dp x parallel.tp (run_spec.h: both default to 1).
function specWorld(runYaml) {
  const spec = YAML.parse(runYaml) || {};
  const par = spec.parallel || {};
  return (par.dp === undefined ? 1 : par.dp) * (par.tp === undefined ? 1 : par.tp);
}

function checkStack(objects) {
  const errors = [];
  const one = (kind) => {
    const found = ofKind(objects, kind);
    if (found.length !== 1) errors.push(`expected one ${kind}, found ${found.length}`);
    return found[0];
  };
  const deploy = one("Deployment");
  const service = one("Service");
  const pvc = one("PersistentVolumeClaim");
  const job = one("MPIJob");
  if (!deploy || !service || !pvc || !job) return errors;

  // The shared volume.
  if (!(pvc.spec.accessModes || []).includes("ReadWriteMany")) {
    errors.push(`${describe(pvc)}: accessModes must include ReadWriteMany (controller and ` +
                `workers on different nodes share the run folders)`);
  }

  // The controller.
  const dw = `${describe(deploy)}`;
  if (deploy.spec.replicas !== 1) errors.push(`${dw}: spec.replicas must be 1`);
  if (!deploy.spec.strategy || deploy.spec.strategy.type !== "Recreate") {
    errors.push(`${dw}: spec.strategy.type must be Recreate (never two controllers on one state)`);
  }
  const podSpec = deploy.spec.template.spec;
  const controller = podSpec.containers.find((c) =>
    [...(c.command || []), ...(c.args || [])].some((a) => /fp8rt-controller$/.test(a)));
  if (!controller) {
    errors.push(`${dw}: no container runs fp8rt-controller`);
    return errors;
  }
  const cargs = [...(controller.command || []), ...(controller.args || [])].map((a) =>
    expand(controller, a));
  const listen = flagValue(cargs, "--listen");
  const metricsListen = flagValue(cargs, "--metrics-listen");
  if (!listen || !listen.startsWith("0.0.0.0:")) {
    errors.push(`${dw}: --listen must be 0.0.0.0:PORT in a pod (got ${listen})`);
  }
  if (!metricsListen || !metricsListen.startsWith("0.0.0.0:")) {
    errors.push(`${dw}: --metrics-listen must be 0.0.0.0:PORT in a pod (got ${metricsListen})`);
  }
  const grpcPort = listen ? Number(listen.split(":").pop()) : NaN;
  const metricsPort = metricsListen ? Number(metricsListen.split(":").pop()) : NaN;
  for (const [port, name] of [[grpcPort, "gRPC"], [metricsPort, "metrics"]]) {
    if (!(controller.ports || []).some((p) => p.containerPort === port)) {
      errors.push(`${dw}: the ${name} port ${port} is not a containerPort`);
    }
  }
  const tokenFile = flagValue(cargs, "--token-file");
  const stateDir = flagValue(cargs, "--state-dir");
  let controllerToken = null;
  if (!tokenFile) errors.push(`${dw}: --token-file is missing`);
  else {
    controllerToken = resolveFile(podSpec, controller, tokenFile, `${dw} --token-file`);
    checkKeySource(objects, controllerToken, `${dw} --token-file`, errors);
  }
  let controllerData = null;
  if (!stateDir) errors.push(`${dw}: --state-dir is missing`);
  else {
    controllerData = resolveFile(podSpec, controller, stateDir, `${dw} --state-dir`);
    if (controllerData.pvc !== pvc.metadata.name) {
      errors.push(`${dw}: --state-dir ${stateDir} is not on PersistentVolumeClaim ` +
                  `${pvc.metadata.name}`);
    }
  }
  for (const probe of ["readinessProbe", "livenessProbe"]) {
    const p = controller[probe];
    if (!p) {
      errors.push(`${dw}: ${probe} is missing`);
      continue;
    }
    const port = p.grpc ? p.grpc.port
      : p.tcpSocket ? targetContainerPort(controller, p.tcpSocket.port)
        : p.httpGet ? targetContainerPort(controller, p.httpGet.port) : undefined;
    if (port !== grpcPort && port !== metricsPort) {
      errors.push(`${dw}: ${probe} probes port ${port}, not the controller's`);
    }
  }
  // TLS: the certificate and key are Secret keys in the pod; Kubernetes' gRPC probe speaks
  // plaintext only, so a TLS controller must be probed another way.
  const controllerTls = flagValue(cargs, "--tls-cert") !== undefined;
  for (const flag of ["--tls-cert", "--tls-key"]) {
    const file = flagValue(cargs, flag);
    if (file === undefined) {
      if (controllerTls) errors.push(`${dw}: --tls-cert without ${flag}`);
      continue;
    }
    checkKeySource(objects, resolveFile(podSpec, controller, file, `${dw} ${flag}`),
                   `${dw} ${flag}`, errors);
  }
  if (controllerTls) {
    for (const probe of ["readinessProbe", "livenessProbe"]) {
      if (controller[probe] && controller[probe].grpc) {
        errors.push(`${dw}: ${probe} is a gRPC probe, which speaks plaintext to a TLS port`);
      }
    }
  }
  const uid = checkPodSecurity(podSpec, dw, errors);

  // The Service reaches the controller's pods and ports.
  const sw = describe(service);
  const podLabels = deploy.spec.template.metadata.labels || {};
  for (const [k, v] of Object.entries(service.spec.selector || {})) {
    if (podLabels[k] !== v) errors.push(`${sw}: selector ${k}=${v} does not match the pods`);
  }
  if (Object.keys(service.spec.selector || {}).length === 0) {
    errors.push(`${sw}: spec.selector is empty`);
  }
  const servicePort = (containerPort) =>
    (service.spec.ports || []).find((p) =>
      targetContainerPort(controller, p.targetPort === undefined ? p.port : p.targetPort) ===
      containerPort);
  const grpcService = servicePort(grpcPort);
  if (!grpcService) errors.push(`${sw}: no port reaches the controller's gRPC port ${grpcPort}`);
  if (!servicePort(metricsPort)) {
    errors.push(`${sw}: no port reaches the controller's metrics port ${metricsPort}`);
  }

  // The MPIJob.
  const jw = describe(job);
  const specs = job.spec.mpiReplicaSpecs || {};
  if (!specs.Launcher || !specs.Worker) return errors;
  const launcherPod = specs.Launcher.template.spec;
  const workerPod = specs.Worker.template.spec;
  const launcher = launcherPod.containers[0];
  const worker = workerPod.containers[0];
  const largs = [...(launcher.command || []), ...(launcher.args || [])].map((a) =>
    expand(launcher, a));
  if (!/(^|\/)mpirun$/.test(largs[0] || "")) {
    errors.push(`${jw}: the Launcher must run mpirun (runs ${largs[0]})`);
  }
  const workerAt = largs.findIndex((a) => /(^|\/)fp8rt-worker$/.test(a));
  if (workerAt < 0) {
    errors.push(`${jw}: the Launcher's mpirun does not start fp8rt-worker`);
    return errors;
  }
  const mpirunArgs = largs.slice(1, workerAt);
  const wargs = largs.slice(workerAt + 1);
  const wj = `${jw} fp8rt-worker`;

  // Ranks: mpirun -np = slotsPerWorker x Worker replicas = dp x tp of the spec.
  const np = Number(flagValue(mpirunArgs, "-np") || flagValue(mpirunArgs, "-n"));
  const slots = job.spec.slotsPerWorker === undefined ? 1 : job.spec.slotsPerWorker;
  const replicas = specs.Worker.replicas === undefined ? 1 : specs.Worker.replicas;
  if (!(np > 0)) errors.push(`${jw}: mpirun -np is missing or not a number`);
  if (np !== slots * replicas) {
    errors.push(`${jw}: mpirun -np ${np} != slotsPerWorker ${slots} x Worker replicas ${replicas}`);
  }

  // The spec file comes from a ConfigMap in the Worker pods (where the ranks run).
  const specFile = flagValue(wargs, "--spec");
  let runYaml = null;
  if (!specFile) errors.push(`${wj}: --spec is missing`);
  else {
    const ref = resolveFile(workerPod, worker, specFile, `${wj} --spec`);
    checkKeySource(objects, ref, `${wj} --spec`, errors);
    const cm = ref.configMap && ofKind(objects, "ConfigMap").find((o) =>
      o.metadata.name === ref.configMap);
    if (cm && cm.data && cm.data[ref.key] !== undefined) runYaml = cm.data[ref.key];
  }
  if (runYaml !== null) {
    const world = specWorld(runYaml);
    if (world !== np) {
      errors.push(`${jw}: run.yaml's parallel.dp x parallel.tp = ${world}, but mpirun -np ${np}`);
    }
  }

  // The token: the same Secret as the controller's.
  const wtoken = flagValue(wargs, "--token-file");
  if (!wtoken) errors.push(`${wj}: --token-file is missing`);
  else {
    const ref = resolveFile(workerPod, worker, wtoken, `${wj} --token-file`);
    checkKeySource(objects, ref, `${wj} --token-file`, errors);
    if (controllerToken && ref.secret !== controllerToken.secret) {
      errors.push(`${wj}: token Secret ${ref.secret} differs from the controller's ` +
                  `${controllerToken.secret}`);
    }
  }

  // TLS both ways or neither: ranks that trust a CA talk TLS, and a TLS controller refuses
  // plaintext. The CA file is a Secret key in the Worker pods, where the ranks run.
  const tlsCa = flagValue(wargs, "--tls-ca");
  if (controllerTls && tlsCa === undefined) {
    errors.push(`${wj}: the controller serves TLS but the ranks have no --tls-ca`);
  }
  if (!controllerTls && tlsCa !== undefined) {
    errors.push(`${wj}: --tls-ca, but the controller serves plaintext (no --tls-cert)`);
  }
  if (tlsCa !== undefined) {
    checkKeySource(objects, resolveFile(workerPod, worker, tlsCa, `${wj} --tls-ca`),
                   `${wj} --tls-ca`, errors);
  }

  // The run folder: on the controller's volume, at the same path in both pods (the controller
  // renames the checkpoint folders the ranks write).
  const runDir = flagValue(wargs, "--run-dir");
  if (!runDir) errors.push(`${wj}: --run-dir is missing`);
  else {
    const ref = resolveFile(workerPod, worker, runDir, `${wj} --run-dir`);
    if (ref.pvc !== pvc.metadata.name) {
      errors.push(`${wj}: --run-dir ${runDir} is not on PersistentVolumeClaim ` +
                  `${pvc.metadata.name}`);
    } else {
      const there = resolveFile(podSpec, controller, runDir, `${dw} (run folder)`);
      if (there.pvc !== ref.pvc || (there.mount.subPath || "") !== (ref.mount.subPath || "")) {
        errors.push(`${jw}: the run folder ${runDir} is not the same path of the same volume ` +
                    `in the controller's pod`);
      }
    }
  }
  if (!wargs.includes("--resume")) {
    errors.push(`${wj}: --resume is missing (a restarted launcher must continue the run)`);
  }

  // The controller address: the Service's name and gRPC port.
  const address = flagValue(wargs, "--controller");
  if (!address) errors.push(`${wj}: --controller is missing`);
  else if (grpcService) {
    const [host, port] = [address.slice(0, address.lastIndexOf(":")),
                          Number(address.slice(address.lastIndexOf(":") + 1))];
    const name = service.metadata.name;
    const ns = service.metadata.namespace;
    const ok = [name, ns && `${name}.${ns}`, ns && `${name}.${ns}.svc`,
                ns && `${name}.${ns}.svc.cluster.local`].includes(host);
    if (!ok) errors.push(`${wj}: --controller host ${host} is not Service ${name}`);
    if (port !== grpcService.port) {
      errors.push(`${wj}: --controller port ${port} is not the Service's gRPC port ` +
                  `${grpcService.port}`);
    }
  }

  // Variables for the ranks must be forwarded by mpirun (ranks are children of sshd).
  const forwarded = new Set((envValue(launcher, "OMPI_MCA_mca_base_env_list") || "")
    .split(";").map((s) => s.split("=")[0]).filter((s) => s !== ""));
  for (let i = 0; i < mpirunArgs.length; ++i) {
    if (mpirunArgs[i] === "-x" && i + 1 < mpirunArgs.length) forwarded.add(mpirunArgs[i + 1]);
  }
  for (const e of launcher.env || []) {
    if (e.name.startsWith("OMPI_") || e.name === "FP8RT_RUN_ID" || e.name === "FP8RT_WORLD_SIZE") {
      continue;
    }
    if (!forwarded.has(e.name)) {
      errors.push(`${jw}: Launcher env ${e.name} is not forwarded to the ranks ` +
                  `(add it to OMPI_MCA_mca_base_env_list)`);
    }
  }
  for (const e of worker.env || []) {
    errors.push(`${jw}: Worker env ${e.name} never reaches the ranks (set it on the Launcher)`);
  }

  // Worker pods run sshd; ssh keys where the image's user finds them.
  const wcmd = [...(worker.command || []), ...(worker.args || [])];
  if (!/sshd$/.test(wcmd[0] || "")) {
    errors.push(`${jw}: the Worker must run sshd (runs ${wcmd[0]})`);
  }
  const wuid = checkPodSecurity(workerPod, `${jw} Worker`, errors);
  const luid = checkPodSecurity(launcherPod, `${jw} Launcher`, errors);
  if (uid !== wuid || uid !== luid) {
    errors.push(`${jw}: controller, launcher and workers must run as one uid (${uid}, ${luid}, ` +
                `${wuid}): the controller renames folders the ranks create`);
  }

  // One image everywhere.
  const images = new Set([controller, launcher, worker].map((c) => c.image));
  if (images.size !== 1) errors.push(`all containers must run the same image, got ${[...images]}`);
  return errors;
}

function resourceOf(container, kind, name) {
  const r = container.resources || {};
  return (r[kind] || {})[name];
}

function cpuCount(q) {
  if (q === undefined) return NaN;
  const s = String(q);
  return s.endsWith("m") ? Number(s.slice(0, -1)) / 1000 : Number(s);
}

// What the cpu and gpu overlays (and `fp8rt k8s render [--gpu]`) promise. The overlays also
// pick the image tag (:cpu, :cuda*); `render --image` takes any image, so `imageTag` is optional.
function checkFlavor(objects, flavor, { imageTag = true } = {}) {
  const errors = [];
  const job = ofKind(objects, "MPIJob")[0];
  if (!job) return ["no MPIJob"];
  const jw = describe(job);
  const launcher = job.spec.mpiReplicaSpecs.Launcher.template.spec.containers[0];
  const workerPod = job.spec.mpiReplicaSpecs.Worker.template.spec;
  const worker = workerPod.containers[0];
  const slots = job.spec.slotsPerWorker === undefined ? 1 : job.spec.slotsPerWorker;

  const shm = (worker.volumeMounts || []).find((m) => m.mountPath === "/dev/shm");
  const shmVolume = shm && (workerPod.volumes || []).find((v) => v.name === shm.name);
  if (!shmVolume || !shmVolume.emptyDir || shmVolume.emptyDir.medium !== "Memory") {
    errors.push(`${jw}: Worker pods need a Memory emptyDir at /dev/shm`);
  }
  if (envValue(launcher, "OMPI_MCA_btl_vader_single_copy_mechanism") !== "none") {
    errors.push(`${jw}: OMPI_MCA_btl_vader_single_copy_mechanism=none is missing on the Launcher`);
  }
  const threads = Number(envValue(launcher, "OMP_NUM_THREADS"));
  if (!(threads >= 1)) errors.push(`${jw}: OMP_NUM_THREADS is not set on the Launcher`);
  const cpus = cpuCount(resourceOf(worker, "requests", "cpu"));
  if (!(cpus >= slots * threads)) {
    errors.push(`${jw}: Worker cpu request ${cpus} < slotsPerWorker ${slots} x OMP_NUM_THREADS ` +
                `${threads}`);
  }
  const gpus = resourceOf(worker, "limits", "nvidia.com/gpu");
  const image = worker.image || "";
  if (flavor === "cpu") {
    if (gpus !== undefined) errors.push(`${jw}: a CPU Worker must not request nvidia.com/gpu`);
    if (imageTag && !/:cpu$/.test(image)) {
      errors.push(`${jw}: expected the :cpu image, got ${image}`);
    }
  } else if (flavor === "gpu") {
    if (Number(gpus) !== slots) {
      errors.push(`${jw}: nvidia.com/gpu limit ${gpus} != slotsPerWorker ${slots} (one rank ` +
                  `per GPU)`);
    }
    for (const name of ["NCCL_DEBUG", "NCCL_SOCKET_IFNAME"]) {
      if (!envValue(launcher, name)) errors.push(`${jw}: ${name} is not set on the Launcher`);
    }
    // GPU pods must also run the ranks on their GPUs: --set device=cuda, or device: cuda in the
    // spec a ConfigMap carries.
    const args = launcher.args || [];
    const setsCuda = args.some((a, i) => a === "--set" && args[i + 1] === "device=cuda");
    const specCuda = ofKind(objects, "ConfigMap").some((cm) =>
      Object.values(cm.data || {}).some((v) => /^device:\s*cuda\s*(#.*)?$/m.test(String(v))));
    if (!setsCuda && !specCuda) {
      errors.push(`${jw}: the ranks run on CPU in GPU pods: add --set device=cuda to the ` +
                  `fp8rt-worker arguments (or device: cuda to the spec)`);
    }
    if (imageTag && !/:cuda/.test(image)) {
      errors.push(`${jw}: expected a :cuda* image, got ${image}`);
    }
  } else {
    errors.push(`unknown flavor ${flavor}`);
  }
  return errors;
}

module.exports = {
  parseManifests,
  validateSchemas,
  typeCheck,
  runTsc,
  checkStack,
  checkFlavor,
  specWorld,
  describe,
};
