// deploy/Dockerfile (CUDA) and deploy/Dockerfile.cpu, checked without a Docker engine (none runs
// here, and no Dockerfile linter is packaged): the files are parsed and held against the
// repository and the Kubernetes manifests.
//   - every COPY source from the build context exists, and the build copies every source folder
//     the root CMakeLists.txt builds (tests are off in the image);
//   - the build stage runs scripts/bootstrap (the package list developers and CI use);
//   - what the manifests run is in the image: fp8rt-controller and fp8rt-worker (installed by
//     CMake), mpirun (openmpi-bin), /usr/sbin/sshd (openssh-server) with the config file the
//     Worker pods name; the user is the pods' uid with its home holding sshAuthMountPath; the
//     working directory is mpirun's -wdir and holds the spec's relative data.path;
//   - the runtime packages provide every shared library the built binaries link (readelf and
//     dpkg on this machine's build, when the binaries are there), but the CUDA libraries that
//     deploy/Dockerfile copies next to them (cudart, cuBLASLt, NCCL: a CUDA build links them);
//   - the CUDA image builds with FP8RT_CUDA=ON from the NVIDIA CUDA devel image, the CPU one OFF.
// Run: node tests/deploy/dockerfile.test.js [BIN_DIR] (ctest: deploy_dockerfile_test).
"use strict";

const fs = require("fs");
const path = require("path");
const { execFileSync, spawnSync } = require("child_process");

const here = __dirname;
const repo = path.resolve(here, "..", "..");
if (!fs.existsSync(path.join(here, "node_modules", "yaml"))) {
  console.log("SKIP: tests/deploy/node_modules is missing: run scripts/bootstrap (npm ci)");
  process.exit(77);
}
const test = require("node:test");
const assert = require("node:assert/strict");
const YAML = require("yaml");

const binDir = process.argv[2] || path.join(repo, "build", "bin");

// Instructions of a Dockerfile: continuation lines joined, comments dropped, `stage` = the name
// of the FROM they belong to.
function parseDockerfile(file) {
  const text = fs.readFileSync(file, "utf8");
  const lines = [];
  let current = "";
  for (const raw of text.split("\n")) {
    if (/^\s*#/.test(raw) && current === "") continue;
    if (/^\s*#/.test(raw)) continue;  // a comment inside a continued instruction
    const line = raw.replace(/\s+$/, "");
    if (line.endsWith("\\")) {
      current += line.slice(0, -1) + " ";
      continue;
    }
    current += line;
    if (current.trim() !== "") lines.push(current.trim());
    current = "";
  }
  const out = [];
  let stage = null;
  const args = {};
  for (const line of lines) {
    const m = /^(\w+)\s+(.*)$/.exec(line);
    assert.ok(m, `${file}: cannot parse '${line}'`);
    const cmd = m[1].toUpperCase();
    let rest = m[2];
    if (cmd === "ARG") {
      const [k, v] = rest.split("=");
      if (v !== undefined && stage === null) args[k] = v;
    }
    rest = rest.replace(/\$\{(\w+)\}/g, (all, k) => (args[k] !== undefined ? args[k] : all));
    if (cmd === "FROM") stage = (/\bAS\s+(\S+)/i.exec(rest) || [])[1] || rest;
    out.push({ cmd, rest, stage });
  }
  return out;
}

// The flags and operands of a COPY instruction.
function copyParts(rest) {
  const words = rest.split(/\s+/);
  const flags = words.filter((w) => w.startsWith("--"));
  const operands = words.filter((w) => !w.startsWith("--"));
  const from = (flags.find((f) => f.startsWith("--from=")) || "").slice(7) || null;
  return { from, sources: operands.slice(0, -1), dest: operands[operands.length - 1] };
}

// Every CMakeLists.txt of the sources (not build folders, node modules or the git folder).
function cmakeListsFiles(dir) {
  const out = [];
  for (const e of fs.readdirSync(dir, { withFileTypes: true })) {
    if (e.isDirectory()) {
      if (/^(build.*|node_modules|\..*|runs)$/.test(e.name)) continue;
      out.push(...cmakeListsFiles(path.join(dir, e.name)));
    } else if (e.name === "CMakeLists.txt") {
      out.push(path.join(dir, e.name));
    }
  }
  return out;
}

const dockerfiles = {
  cuda: parseDockerfile(path.join(repo, "deploy", "Dockerfile")),
  cpu: parseDockerfile(path.join(repo, "deploy", "Dockerfile.cpu")),
};
const readYaml = (rel) => YAML.parseAllDocuments(fs.readFileSync(path.join(repo, rel), "utf8"))
  .map((d) => d.toJS());
const mpijob = readYaml("deploy/kubernetes/base/mpijob.yaml")[0];
const deployment = readYaml("deploy/kubernetes/base/controller-deployment.yaml")[0];
const launcher = mpijob.spec.mpiReplicaSpecs.Launcher.template.spec.containers[0];
const workerPod = mpijob.spec.mpiReplicaSpecs.Worker.template.spec;
const runtimeOf = (d) => d.filter((i) => i.stage === "runtime");
const runtimePackages = (d) => {
  const run = runtimeOf(d).find((i) => i.cmd === "RUN" && /apt-get install/.test(i.rest));
  assert.ok(run, "the runtime stage installs no packages");
  const after = run.rest.split(/apt-get install/)[1].split("&&")[0];
  return after.split(/\s+/).filter((w) => w && !w.startsWith("-"));
};

for (const [flavor, d] of Object.entries(dockerfiles)) {
  test(`${flavor}: every COPY source from the context exists`, () => {
    for (const i of d.filter((i) => i.cmd === "COPY")) {
      const { from, sources } = copyParts(i.rest);
      if (from) continue;
      for (const s of sources) {
        assert.ok(fs.existsSync(path.join(repo, s)), `COPY ${s}: not in the repository`);
      }
    }
  });

  test(`${flavor}: the build copies every folder CMake builds and runs scripts/bootstrap`, () => {
    const build = d.filter((i) => i.stage === "build");
    const copied = build.filter((i) => i.cmd === "COPY" && !copyParts(i.rest).from)
      .flatMap((i) => copyParts(i.rest).sources.map((s) => s.replace(/\/$/, "")));
    const cmake = fs.readFileSync(path.join(repo, "CMakeLists.txt"), "utf8");
    for (const m of cmake.matchAll(/^\s*add_subdirectory\(([^)\s]+)\)/gm)) {
      // FP8RT_TESTS=OFF in the image; tests/fuzz is only added by a FP8RT_FUZZ build.
      if (m[1] === "tests" || m[1].startsWith("tests/")) continue;
      const top = m[1].split("/")[0];
      assert.ok(copied.includes(top) || copied.includes(m[1]), `${m[1]} is not copied`);
    }
    assert.ok(copied.includes("CMakeLists.txt"));
    assert.ok(build.some((i) => i.cmd === "RUN" && /(^|\s)scripts\/bootstrap(\s|$)/.test(i.rest)),
              "the build stage does not run scripts/bootstrap");
    const configure = build.find((i) => i.cmd === "RUN" && /cmake -S/.test(i.rest));
    assert.match(configure.rest, /-DFP8RT_TESTS=OFF/);
    assert.match(configure.rest, flavor === "cuda" ? /-DFP8RT_CUDA=ON/ : /-DFP8RT_CUDA=OFF/);
  });

  test(`${flavor}: the programs the manifests run are in the image`, () => {
    // fp8rt-controller (Deployment) and fp8rt-worker (mpirun's program) are installed by CMake
    // into /usr/local/bin, which the runtime stage copies.
    const programs = [deployment.spec.template.spec.containers[0].command[0],
                      launcher.args[launcher.args.indexOf("fp8rt-worker")], "fp8rt"];
    const installed = new Set();
    for (const f of cmakeListsFiles(repo)) {
      const text = fs.readFileSync(f, "utf8");
      for (const m of text.matchAll(/install\(TARGETS\s+([^)]*?)\s+RUNTIME/g)) {
        for (const t of m[1].split(/\s+/)) installed.add(t);
      }
    }
    for (const p of programs) assert.ok(installed.has(p), `${p} is not installed by CMake`);
    const copiesInstall = runtimeOf(d).some((i) => i.cmd === "COPY" &&
      copyParts(i.rest).from === "build" && copyParts(i.rest).dest === "/usr/local/");
    assert.ok(copiesInstall, "the runtime stage does not copy the installed binaries");
    // mpirun and sshd from Debian packages.
    const pkgs = runtimePackages(d);
    assert.equal(launcher.command[0], "mpirun");
    assert.ok(pkgs.includes("openmpi-bin"), "mpirun: openmpi-bin is not installed");
    const sshd = workerPod.containers[0].command[0];
    assert.equal(sshd, "/usr/sbin/sshd");
    assert.ok(pkgs.includes("openssh-server"), "sshd: openssh-server is not installed");
    assert.ok(pkgs.includes("openssh-client"), "mpirun's ssh: openssh-client is not installed");
    // The sshd config the Worker names is copied there.
    const wargs = workerPod.containers[0].args;
    const config = wargs[wargs.indexOf("-f") + 1];
    assert.ok(runtimeOf(d).some((i) => i.cmd === "COPY" && copyParts(i.rest).dest === config),
              `${config} is not copied into the image`);
  });

  test(`${flavor}: user, home and working directory match the pods`, () => {
    const rt = runtimeOf(d);
    const user = rt.filter((i) => i.cmd === "USER").pop();
    assert.ok(user, "no USER: the image would run as root");
    const uid = Number(user.rest.split(":")[0]);
    for (const pod of [deployment.spec.template.spec, workerPod,
                       mpijob.spec.mpiReplicaSpecs.Launcher.template.spec]) {
      assert.equal(pod.securityContext.runAsUser, uid);
    }
    const useradd = rt.find((i) => i.cmd === "RUN" && /useradd/.test(i.rest));
    const m = /useradd[^&]*--uid (\d+)[^&]*\s(\w+)\s*$/.exec(useradd.rest.split("&&")
      .find((c) => /useradd/.test(c)).trim());
    assert.ok(m, "useradd --uid N ... NAME not found");
    assert.equal(Number(m[1]), uid);
    assert.equal(mpijob.spec.sshAuthMountPath, `/home/${m[2]}/.ssh`);
    const workdir = rt.filter((i) => i.cmd === "WORKDIR").pop().rest;
    const wdir = launcher.args[launcher.args.indexOf("-wdir") + 1];
    assert.equal(workdir, wdir);
    // The spec's relative data.path is read from there: the image copies examples/ (with the
    // corpus that scripts/bootstrap writes) under it.
    const spec = YAML.parse(fs.readFileSync(path.join(repo, "deploy/kubernetes/base/run.yaml"),
                                            "utf8"));
    const data = spec.data.path;
    assert.ok(!path.isAbsolute(data));
    const top = data.split("/")[0];
    assert.ok(rt.some((i) => i.cmd === "COPY" && copyParts(i.rest).from === "build" &&
                             copyParts(i.rest).dest.replace(/\/$/, "") === `${wdir}/${top}`),
              `${wdir}/${top} is not copied into the image`);
    const bootstrap = fs.readFileSync(path.join(repo, "scripts/bootstrap"), "utf8");
    assert.ok(bootstrap.includes(data.replace(/^examples\//, "examples/")) ||
              bootstrap.includes(path.basename(data)), `bootstrap does not write ${data}`);
  });
}

test("cuda: the toolkit and NCCL come from the NVIDIA CUDA devel image", () => {
  const d = dockerfiles.cuda;
  const from = d.find((i) => i.cmd === "FROM" && i.stage === "cuda");
  assert.match(from.rest, /^nvidia\/cuda:13\.0\.\d+-devel-/);
  const copies = d.filter((i) => i.cmd === "COPY" && copyParts(i.rest).from === "cuda");
  assert.ok(copies.some((i) => /\/usr\/local\/cuda-13\.0/.test(i.rest)), "toolkit");
  assert.ok(copies.some((i) => /libnccl/.test(i.rest)), "NCCL library");
  assert.ok(copies.some((i) => /nccl\S*\.h/.test(i.rest)), "NCCL header");
  assert.ok(d.some((i) => i.cmd === "ENV" && /NVIDIA_DRIVER_CAPABILITIES=compute/.test(i.rest)));
});

test("both images install the same runtime packages", () => {
  assert.deepEqual(runtimePackages(dockerfiles.cuda).sort(),
                   runtimePackages(dockerfiles.cpu).sort());
});

// The shared libraries deploy/Dockerfile copies from the CUDA toolkit into
// /usr/local/lib/fp8rt-cuda (its `cp -a ... /install/usr/local/lib/fp8rt-cuda/`), as regular
// expressions over library names made from the file name globs.
function cudaImageLibraries(d) {
  const patterns = [];
  for (const i of d.filter((i) => i.cmd === "RUN")) {
    const cp = /cp -a\s+(.*?)\s+\/install\/usr\/local\/lib\/fp8rt-cuda\//.exec(i.rest);
    if (!cp) continue;
    for (const src of cp[1].split(/\s+/)) {
      const glob = path.basename(src).replace(/[.+^${}()|[\]\\]/g, "\\$&").replace(/\*/g, ".*");
      patterns.push(new RegExp(`^${glob}$`));
    }
  }
  return patterns;
}

// The Debian packages owning the shared libraries the binaries link directly (NEEDED entries),
// but those whose names match one of `carried` (shipped by the image itself): package ->
// [binary: library].
function neededPackages(binaries, carried = []) {
  const libs = [];
  for (const binary of binaries) {
    const ldd = execFileSync("ldd", [binary], { encoding: "utf8" });
    const paths = {};
    for (const m of ldd.matchAll(/^\s*(\S+) => (\/\S+)/gm)) paths[m[1]] = m[2];
    const dynamic = execFileSync("readelf", ["-d", binary], { encoding: "utf8" });
    for (const m of dynamic.matchAll(/\(NEEDED\)\s+Shared library: \[([^\]]+)\]/g)) {
      if (carried.some((re) => re.test(m[1]))) continue;
      assert.ok(paths[m[1]], `${binary}: ${m[1]} not found by ldd`);
      libs.push({ what: `${path.basename(binary)}: ${m[1]}`, file: fs.realpathSync(paths[m[1]]) });
    }
  }
  // One dpkg call for all (it is slow to start), each library under its /usr/lib and /lib names
  // (merged /usr: dpkg knows a file by the path its package installed); "package: /path" lines,
  // exit 1 when some names are unknown.
  const variants = (f) =>
    [f, f.replace(/^\/usr\/lib\//, "/lib/"), f.replace(/^\/lib\//, "/usr/lib/")];
  const query = [...new Set(libs.flatMap((l) => variants(l.file)))];
  const out = spawnSync("dpkg", ["-S", ...query], { encoding: "utf8" }).stdout || "";
  const owners = {};
  for (const line of out.split("\n")) {
    const m = /^([^:]+)(?::[^:]+)?: (\/.*)$/.exec(line);
    if (m) owners[m[2]] = m[1];
  }
  for (const l of libs) l.owner = variants(l.file).map((f) => owners[f]).find(Boolean);
  const pkgs = new Map();
  for (const l of libs) {
    assert.ok(l.owner, `${l.what}: ${l.file} belongs to no Debian package`);
    pkgs.set(l.owner, [...(pkgs.get(l.owner) || []), l.what]);
  }
  return pkgs;
}

test("the runtime packages provide every library the binaries link", (t) => {
  const programs = ["fp8rt-controller", "fp8rt-worker", "fp8rt", "fp8rt-launch", "fp8rt-k8s"]
    .map((p) => path.join(binDir, p)).filter((p) => fs.existsSync(p));
  const tools = ["ldd", "readelf", "dpkg"].filter((tool) => {
    try {
      execFileSync("sh", ["-c", `command -v ${tool}`], { stdio: "ignore" });
      return false;
    } catch (e) {
      return true;
    }
  });
  if (programs.length === 0 || tools.length > 0) {
    t.skip(`needs built binaries in ${binDir} (found none) and ldd, readelf, dpkg ` +
           `(missing: ${tools.join(", ") || "none"})`);
    return;
  }
  // Libraries of the Debian base image itself (priority required, always in debian:12-slim),
  // and the sanitizer runtimes of an ASan/UBSan build (scripts/test's second pass; images are
  // built without them).
  const base = new Set(["libc6", "libgcc-s1", "libstdc++6", "zlib1g"]);
  const sanitizer = /^lib(a|ub|l|t|hwa)san\d+$/;
  const pkgs = new Set(runtimePackages(dockerfiles.cpu));
  // A CUDA build links cudart, cuBLASLt and NCCL (fp8rt-worker's device: cuda): the CUDA image
  // carries them in /usr/local/lib/fp8rt-cuda, no Debian package does.
  const carried = cudaImageLibraries(dockerfiles.cuda);
  for (const lib of ["libcudart.so.13", "libcublasLt.so.13", "libnccl.so.2"]) {
    assert.ok(carried.some((re) => re.test(lib)), `deploy/Dockerfile does not carry ${lib}`);
  }
  for (const [pkg, users] of neededPackages(programs, carried)) {
    if (base.has(pkg) || sanitizer.test(pkg)) continue;
    assert.ok(pkgs.has(pkg), `${users.join(", ")} come from ${pkg}, which the runtime stage ` +
                             "does not install");
  }
});
