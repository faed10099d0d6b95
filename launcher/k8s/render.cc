// Index:
//   Sizing             ranks per pod, threads, CPU/memory/GPU requests for a flavor
//   CheckName, ...     the flags' values
//   k*Template         the manifests, with ${...} placeholders
//   Render, WriteRendered
#include "launcher/k8s/render.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <span>
#include <sstream>
#include <tuple>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_replace.h"
#include "runtime/spec/run_spec.h"

namespace fp8rt::k8s {
namespace {

namespace fs = std::filesystem;

// GPUs per node assumed when --workers is not given on GPU.
constexpr int kGpusPerNode = 8;

// Per-rank resources of the Worker pods, by flavor. Starting points: edit the rendered files for
// a real model. Threads per rank = OMP_NUM_THREADS; the pod requests slots x threads cores.
struct Sizing {
  int threads_per_rank;
  int memory_request_gib_per_rank;
  int memory_limit_gib_per_rank;
  int shm_gib;  // the Memory emptyDir at /dev/shm (counts against the memory limit)
};
constexpr Sizing kCpuSizing = {2, 2, 4, 1};
constexpr Sizing kGpuSizing = {4, 16, 32, 8};

absl::Status FlagError(const std::string& flag, const std::string& message) {
  return absl::InvalidArgumentError(absl::StrCat(flag, ": ", message));
}

// A DNS-1035 label: lower-case letters, digits and '-', starting with a letter, ending with a
// letter or digit.
bool IsDns1035Label(const std::string& s, size_t max_len) {
  if (s.empty() || s.size() > max_len) return false;
  if (!(s.front() >= 'a' && s.front() <= 'z')) return false;
  if (s.back() == '-') return false;
  for (char c : s) {
    if (!((c >= 'a' && c <= 'z') || (c >= '0' && c <= '9') || c == '-')) return false;
  }
  return true;
}

// A DNS-1123 label (namespaces): like the above, but may start with a digit.
bool IsDns1123Label(const std::string& s) {
  if (s.empty() || s.size() > 63 || s.front() == '-' || s.back() == '-') return false;
  for (char c : s) {
    if (!((c >= 'a' && c <= 'z') || (c >= '0' && c <= '9') || c == '-')) return false;
  }
  return true;
}

// An image reference: [registry[:port]/]path[:tag][@digest]. Only the characters those use, so
// that the value is safe inside the rendered (double-quoted) YAML.
bool IsImageReference(const std::string& s) {
  if (s.empty() || s.size() > 512 || s.front() == '-' || s.front() == ':' || s.front() == '/') {
    return false;
  }
  for (char c : s) {
    const bool ok = (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') ||
                    c == '.' || c == '_' || c == '-' || c == '/' || c == ':' || c == '@';
    if (!ok) return false;
  }
  return true;
}

absl::StatusOr<std::string> ReadFile(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return absl::NotFoundError(absl::StrCat(path, ": cannot read the file"));
  std::ostringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

constexpr char kKustomizationTemplate[] =
    R"(# fp8rt run "${NAME}", rendered by `fp8rt k8s render` from ${SPEC_FILE}.
# Needs:  the Kubeflow MPI Operator (MPIJob v2beta1), a storage class with ReadWriteMany
#         volumes${GPU_NOTE}.
# Deploy: kubectl apply -k <this folder>
# Follow: kubectl ${NS_FLAG}logs -f job/${NAME}-launcher
#         kubectl ${NS_FLAG}port-forward svc/${NAME}-controller 50051 9464, then
#         fp8rt runs get ${NAME} --controller 127.0.0.1:50051 --token-file token
# The fields are explained in deploy/kubernetes/base of the fp8rt repository.
apiVersion: kustomize.config.k8s.io/v1beta1
kind: Kustomization
${NAMESPACE_LINE}
labels:
  - pairs:
      app.kubernetes.io/part-of: fp8rt
      app.kubernetes.io/instance: ${NAME}
    includeSelectors: false

resources:
  - controller.yaml
  - data-pvc.yaml
  - mpijob.yaml

# The MPIJob refers to the generated objects by name and kustomize does not rewrite names inside
# custom resources: no content-hash suffixes.
generatorOptions:
  disableNameSuffixHash: true

configMapGenerator:
  # The run spec, mounted at /etc/fp8rt/run.yaml in the worker pods.
  - name: ${NAME}-spec
    files:
      - run.yaml

secretGenerator:
  # The controller's bearer token: a random one written next to this file (keep it private; it
  # is not rewritten when you render again).
  - name: ${NAME}-token
    files:
      - token
${TLS_SECRET})";

constexpr char kControllerTemplate[] =
    R"(# fp8rt-controller of run ${NAME} (see deploy/kubernetes/base/controller-*.yaml).
apiVersion: apps/v1
kind: Deployment
metadata:
  name: ${NAME}-controller
  labels:
    app.kubernetes.io/name: fp8rt
    app.kubernetes.io/component: controller
spec:
  replicas: 1
  strategy:
    type: Recreate
  selector:
    matchLabels:
      app.kubernetes.io/name: fp8rt
      app.kubernetes.io/component: controller
      fp8rt/run: ${NAME}
  template:
    metadata:
      labels:
        app.kubernetes.io/name: fp8rt
        app.kubernetes.io/component: controller
        fp8rt/run: ${NAME}
    spec:
      automountServiceAccountToken: false
      enableServiceLinks: false
      securityContext:
        runAsNonRoot: true
        runAsUser: 1000
        runAsGroup: 1000
        fsGroup: 1000
        seccompProfile:
          type: RuntimeDefault
      containers:
        - name: controller
          image: "${IMAGE}"
          command: ["fp8rt-controller"]
          args:
            - --token-file
            - /etc/fp8rt/token/token
            - --state-dir
            - /data/controller/state
            - --listen
            - 0.0.0.0:50051
            - --metrics-listen
            - 0.0.0.0:9464
            - --heartbeat-timeout-s
            - "30"
${TLS_CONTROLLER_ARGS}          ports:
            - name: grpc
              containerPort: 50051
            - name: metrics
              containerPort: 9464
          readinessProbe:
${PROBE}            periodSeconds: 5
            failureThreshold: 3
          livenessProbe:
${PROBE}            initialDelaySeconds: 10
            periodSeconds: 10
            failureThreshold: 6
            timeoutSeconds: 5
          resources:
            requests:
              cpu: 250m
              memory: 256Mi
            limits:
              memory: 1Gi
          securityContext:
            allowPrivilegeEscalation: false
            readOnlyRootFilesystem: true
            capabilities:
              drop: ["ALL"]
          volumeMounts:
            - name: token
              mountPath: /etc/fp8rt/token
              readOnly: true
${TLS_MOUNT_6}            - name: data
              mountPath: /data
            - name: tmp
              mountPath: /tmp
      volumes:
        - name: token
          secret:
            secretName: ${NAME}-token
            defaultMode: 0440
${TLS_VOLUME_6}        - name: data
          persistentVolumeClaim:
            claimName: ${NAME}-data
        - name: tmp
          emptyDir:
            sizeLimit: 64Mi
---
apiVersion: v1
kind: Service
metadata:
  name: ${NAME}-controller
  labels:
    app.kubernetes.io/name: fp8rt
    app.kubernetes.io/component: controller
    fp8rt/run: ${NAME}
  annotations:
    prometheus.io/scrape: "true"
    prometheus.io/port: "9464"
    prometheus.io/path: /metrics
spec:
  type: ClusterIP
  selector:
    app.kubernetes.io/name: fp8rt
    app.kubernetes.io/component: controller
    fp8rt/run: ${NAME}
  ports:
    - name: grpc
      port: 50051
      targetPort: grpc
      appProtocol: ${GRPC_APP_PROTOCOL}
    - name: metrics
      port: 9464
      targetPort: metrics
      appProtocol: http
)";

constexpr char kPvcTemplate[] =
    R"(# Run folder (/data/runs/${NAME}) and controller state, shared by the controller and every worker
# pod: ReadWriteMany. Size it for checkpoint.keep checkpoints of your model.
apiVersion: v1
kind: PersistentVolumeClaim
metadata:
  name: ${NAME}-data
  labels:
    app.kubernetes.io/name: fp8rt
    app.kubernetes.io/component: data
spec:
  accessModes:
    - ReadWriteMany
  resources:
    requests:
      storage: 50Gi
)";

constexpr char kMpiJobTemplate[] =
    R"(# The ranks of run ${NAME}: ${WORLD} = slotsPerWorker ${SLOTS} x ${WORKERS} Worker pods = parallel.dp x
# parallel.tp of run.yaml (see deploy/kubernetes/base/mpijob.yaml).
apiVersion: kubeflow.org/v2beta1
kind: MPIJob
metadata:
  name: ${NAME}
  labels:
    app.kubernetes.io/name: fp8rt
    app.kubernetes.io/component: training
spec:
  slotsPerWorker: ${SLOTS}
  runPolicy:
    cleanPodPolicy: Running
    backoffLimit: 3
  mpiImplementation: OpenMPI
  sshAuthMountPath: /home/mpiuser/.ssh
  mpiReplicaSpecs:
    Launcher:
      replicas: 1
      restartPolicy: OnFailure
      template:
        metadata:
          labels:
            app.kubernetes.io/name: fp8rt
            app.kubernetes.io/component: launcher
        spec:
          enableServiceLinks: false
          securityContext:
            runAsNonRoot: true
            runAsUser: 1000
            runAsGroup: 1000
            seccompProfile:
              type: RuntimeDefault
          containers:
            - name: launcher
              image: "${IMAGE}"
              env:
                - name: FP8RT_RUN_ID
                  value: "${NAME}"
                - name: FP8RT_WORLD_SIZE
                  value: "${WORLD}"
                # Forwarded to the ranks by mpirun (OMPI_MCA_* always, the others by name).
                - name: OMP_NUM_THREADS
                  value: "${THREADS}"
${EXTRA_ENV}                - name: OMPI_MCA_btl_vader_single_copy_mechanism
                  value: "none"
                # Between pods TCP over the pod network (eth0), shared memory within a pod: the
                # daemons' and ranks' sockets never on an interface other pods cannot reach.
                - name: OMPI_MCA_btl
                  value: "self,vader,tcp"
                - name: OMPI_MCA_btl_tcp_if_include
                  value: "eth0"
                - name: OMPI_MCA_oob_tcp_if_include
                  value: "eth0"
                - name: OMPI_MCA_mca_base_env_list
                  value: "${ENV_LIST}"
              command: ["mpirun"]
              args:
                - -np
                - $(FP8RT_WORLD_SIZE)
                - --bind-to
                - none
                - -wdir
                - /opt/fp8rt
                - fp8rt-worker
                - --spec
                - /etc/fp8rt/run.yaml
                - --run-dir
                - /data/runs/$(FP8RT_RUN_ID)
                - --controller
                - ${NAME}-controller:50051
                - --token-file
                - /etc/fp8rt/token/token
${TLS_WORKER_ARGS}                - --resume
              resources:
                requests:
                  cpu: 100m
                  memory: 128Mi
                limits:
                  memory: 512Mi
              securityContext:
                allowPrivilegeEscalation: false
                capabilities:
                  drop: ["ALL"]
    Worker:
      replicas: ${WORKERS}
      restartPolicy: OnFailure
      template:
        metadata:
          labels:
            app.kubernetes.io/name: fp8rt
            app.kubernetes.io/component: worker
        spec:
          enableServiceLinks: false
          automountServiceAccountToken: false
          securityContext:
            runAsNonRoot: true
            runAsUser: 1000
            runAsGroup: 1000
            fsGroup: 1000
            seccompProfile:
              type: RuntimeDefault
${TOLERATIONS}          containers:
            - name: worker
              image: "${IMAGE}"
              command: ["/usr/sbin/sshd"]
              args: ["-De", "-f", "/home/mpiuser/.sshd_config"]
              resources:
                requests:
                  cpu: "${CPU}"
                  memory: ${MEMORY_REQUEST}
                limits:
${GPU_LIMIT}                  memory: ${MEMORY_LIMIT}
              securityContext:
                allowPrivilegeEscalation: false
                capabilities:
                  drop: ["ALL"]
              volumeMounts:
                - name: run-spec
                  mountPath: /etc/fp8rt/run.yaml
                  subPath: run.yaml
                  readOnly: true
                - name: token
                  mountPath: /etc/fp8rt/token
                  readOnly: true
${TLS_MOUNT_8}                - name: data
                  mountPath: /data
                - name: shm
                  mountPath: /dev/shm
          volumes:
            - name: run-spec
              configMap:
                name: ${NAME}-spec
            - name: token
              secret:
                secretName: ${NAME}-token
                defaultMode: 0440
${TLS_VOLUME_8}            - name: data
              persistentVolumeClaim:
                claimName: ${NAME}-data
            - name: shm
              emptyDir:
                medium: Memory
                sizeLimit: ${SHM}
)";

constexpr char kGpuEnv[] = R"(                - name: NCCL_DEBUG
                  value: "WARN"
                - name: NCCL_SOCKET_IFNAME
                  value: "eth0"
)";

constexpr char kGpuTolerations[] = R"(          tolerations:
            - key: nvidia.com/gpu
              operator: Exists
              effect: NoSchedule
)";

}  // namespace

absl::StatusOr<Rendered> Render(const RenderOptions& options) {
  if (options.image.empty()) return FlagError("--image", "required (the fp8rt container image)");
  if (!IsImageReference(options.image)) {
    return FlagError("--image", absl::StrCat("'", options.image,
                                             "' is not an image reference "
                                             "([registry/]name[:tag][@digest])"));
  }
  std::string name = options.name;
  if (name.empty()) {
    name = fs::path(options.spec_path).stem().string();
    if (!IsDns1035Label(name, 40)) {
      return FlagError("--name", absl::StrCat("the spec file's name '", name,
                                              "' is not a valid run name: give --name (lower-case "
                                              "letters, digits and '-', starting with a letter, "
                                              "at most 40 characters)"));
    }
  } else if (!IsDns1035Label(name, 40)) {
    return FlagError("--name", absl::StrCat("'", name,
                                            "' must be lower-case letters, digits and '-', "
                                            "start with a letter, not end with '-', and have at "
                                            "most 40 characters"));
  }
  if (!options.ns.empty() && !IsDns1123Label(options.ns)) {
    return FlagError("--namespace", absl::StrCat("'", options.ns,
                                                 "' is not a namespace name (lower-case letters, "
                                                 "digits and '-', at most 63 characters)"));
  }

  absl::StatusOr<v1::RunSpec> spec = LoadRunSpec(options.spec_path, std::span<const std::string>());
  if (!spec.ok()) return spec.status();
  // The data files (data.path, data.val_path, init.from) are read in the pods, not here: check
  // everything else (a stand-in data file would also be measured for the validation tail).
  const int64_t world64 = int64_t{spec->parallel().dp()} * spec->parallel().tp();
  if (absl::Status s = ValidateRunSpec(*spec, static_cast<int>(world64), DataFileCheck::kSkip);
      !s.ok()) {
    return s;
  }
  const int world = static_cast<int>(world64);
  // GPU pods are for ranks that use them: `device: cuda` renders them, with or without --gpu.
  const bool cuda = spec->device() == v1::RunSpec::DEVICE_CUDA;
  if (options.gpu && !cuda) {
    return FlagError("--gpu",
                     "the spec's ranks run on CPU (device: cpu, the default); set `device: cuda` "
                     "in the spec to train on GPUs (GPU pods follow)");
  }
  const bool gpu = cuda;

  int workers = options.workers;
  if (workers < 0) return FlagError("--workers", absl::StrCat("must be positive, got ", workers));
  if (workers == 0) {
    if (!gpu) {
      workers = world;
    } else if (world <= kGpusPerNode) {
      workers = 1;
    } else if (world % kGpusPerNode == 0) {
      workers = world / kGpusPerNode;
    } else {
      return FlagError("--workers",
                       absl::StrCat("give the number of GPU worker pods: the world size ", world,
                                    " (parallel.dp x parallel.tp) is not a multiple of ",
                                    kGpusPerNode, " GPUs per node"));
    }
  }
  if (world % workers != 0) {
    return FlagError("--workers", absl::StrCat(workers, " worker pods cannot share ", world,
                                               " ranks (parallel.dp x parallel.tp) equally"));
  }
  const int slots = world / workers;
  const Sizing& sizing = gpu ? kGpuSizing : kCpuSizing;

  absl::StatusOr<std::string> spec_text = ReadFile(options.spec_path);
  if (!spec_text.ok()) return spec_text.status();

  // TLS: the three PEM files go into the folder and a Secret <name>-tls; the controller serves
  // with the certificate, the ranks (and a port-forwarded CLI) verify it with the CA.
  const bool tls = !options.tls_cert.empty() || !options.tls_key.empty() ||
                   !options.tls_ca.empty();
  std::map<std::string, std::string> tls_files;
  if (tls) {
    for (const auto& [flag, path, file] :
         {std::tuple<const char*, const std::string&, const char*>{"--tls-cert", options.tls_cert,
                                                                  "tls.crt"},
          {"--tls-key", options.tls_key, "tls.key"},
          {"--tls-ca", options.tls_ca, "ca.crt"}}) {
      if (path.empty()) {
        return FlagError(flag, "--tls-cert, --tls-key and --tls-ca go together");
      }
      absl::StatusOr<std::string> pem = ReadFile(path);
      if (!pem.ok()) return FlagError(flag, std::string(pem.status().message()));
      if (pem->find("-----BEGIN ") == std::string::npos) {
        return FlagError(flag, absl::StrCat("'", path, "' is not a PEM file (no -----BEGIN line)"));
      }
      tls_files[file] = *std::move(pem);
    }
  }
  auto mount = [](int indent) {
    const std::string pad(static_cast<size_t>(indent), ' ');
    return absl::StrCat(pad, "- name: tls\n", pad, "  mountPath: /etc/fp8rt/tls\n", pad,
                        "  readOnly: true\n");
  };
  auto volume = [](int indent, const std::string& name) {
    const std::string pad(static_cast<size_t>(indent), ' ');
    return absl::StrCat(pad, "- name: tls\n", pad, "  secret:\n", pad, "    secretName: ", name,
                        "-tls\n", pad, "    defaultMode: 0440\n");
  };

  const std::vector<std::pair<std::string, std::string>> vars = {
      {"${NAME}", name},
      {"${IMAGE}", options.image},
      {"${SPEC_FILE}", fs::path(options.spec_path).filename().string()},
      {"${NAMESPACE_LINE}", options.ns.empty() ? "" : absl::StrCat("namespace: ", options.ns)},
      {"${NS_FLAG}", options.ns.empty() ? "" : absl::StrCat("-n ", options.ns, " ")},
      {"${GPU_NOTE}", gpu ? ", the NVIDIA device plugin (nvidia.com/gpu)" : ""},
      {"${WORLD}", absl::StrCat(world)},
      {"${SLOTS}", absl::StrCat(slots)},
      {"${WORKERS}", absl::StrCat(workers)},
      {"${THREADS}", absl::StrCat(sizing.threads_per_rank)},
      {"${CPU}", absl::StrCat(slots * sizing.threads_per_rank)},
      {"${MEMORY_REQUEST}", absl::StrCat(slots * sizing.memory_request_gib_per_rank, "Gi")},
      {"${MEMORY_LIMIT}", absl::StrCat(slots * sizing.memory_limit_gib_per_rank, "Gi")},
      {"${SHM}", absl::StrCat(sizing.shm_gib, "Gi")},
      {"${EXTRA_ENV}", gpu ? kGpuEnv : ""},
      {"${ENV_LIST}", gpu ? "OMP_NUM_THREADS;NCCL_DEBUG;NCCL_SOCKET_IFNAME" : "OMP_NUM_THREADS"},
      {"${TOLERATIONS}", gpu ? kGpuTolerations : ""},
      {"${GPU_LIMIT}", gpu ? absl::StrCat("                  nvidia.com/gpu: ", slots, "\n") : ""},
      {"${TLS_SECRET}",
       tls ? absl::StrCat("  # TLS of the controller (fp8rt k8s render --tls-*): its certificate must "
                          "name\n  # ",
                          name, "-controller, the address the ranks dial.\n  - name: ", name,
                          "-tls\n    files:\n      - tls.crt\n      - tls.key\n      - ca.crt\n")
           : ""},
      {"${TLS_CONTROLLER_ARGS}",
       tls ? "            - --tls-cert\n            - /etc/fp8rt/tls/tls.crt\n"
             "            - --tls-key\n            - /etc/fp8rt/tls/tls.key\n"
           : ""},
      // Kubernetes' gRPC probe speaks plaintext only: with TLS the probes read /metrics.
      {"${PROBE}", tls ? "            httpGet:\n              path: /metrics\n"
                         "              port: 9464\n"
                       : "            grpc:\n              port: 50051\n"},
      {"${GRPC_APP_PROTOCOL}", tls ? "https" : "kubernetes.io/h2c"},
      {"${TLS_WORKER_ARGS}",
       tls ? "                - --tls-ca\n                - /etc/fp8rt/tls/ca.crt\n" : ""},
      {"${TLS_MOUNT_6}", tls ? mount(12) : ""},
      {"${TLS_VOLUME_6}", tls ? volume(8, name) : ""},
      {"${TLS_MOUNT_8}", tls ? mount(16) : ""},
      {"${TLS_VOLUME_8}", tls ? volume(12, name) : ""},
  };
  Rendered rendered;
  rendered.name = name;
  rendered.world = world;
  rendered.workers = workers;
  rendered.slots = slots;
  rendered.gpu = gpu;
  rendered.files["kustomization.yaml"] = absl::StrReplaceAll(kKustomizationTemplate, vars);
  rendered.files["controller.yaml"] = absl::StrReplaceAll(kControllerTemplate, vars);
  rendered.files["data-pvc.yaml"] = absl::StrReplaceAll(kPvcTemplate, vars);
  rendered.files["mpijob.yaml"] = absl::StrReplaceAll(kMpiJobTemplate, vars);
  rendered.files["run.yaml"] = *std::move(spec_text);
  for (auto& [file, pem] : tls_files) rendered.files[file] = std::move(pem);
  return rendered;
}

absl::Status WriteRendered(const std::string& dir, const Rendered& rendered, bool* token_created) {
  std::error_code ec;
  fs::create_directories(dir, ec);
  if (ec) return absl::InvalidArgumentError(absl::StrCat("--out ", dir, ": ", ec.message()));
  for (const auto& [file, content] : rendered.files) {
    const std::string path = (fs::path(dir) / file).string();
    std::ofstream out(path, std::ios::binary | std::ios::trunc);
    out << content;
    out.close();
    if (!out) return absl::InternalError(absl::StrCat(path, ": cannot write the file"));
    if (file == "tls.key") chmod(path.c_str(), 0600);  // a private key: the owner's only
  }
  // The token: 32 random bytes as hex, created only if absent (O_EXCL), never readable by others.
  *token_created = false;
  const std::string token_path = (fs::path(dir) / "token").string();
  const int fd = open(token_path.c_str(), O_WRONLY | O_CREAT | O_EXCL, 0600);
  if (fd < 0) {
    if (errno == EEXIST) return absl::OkStatus();
    return absl::InternalError(absl::StrCat(token_path, ": ", std::strerror(errno)));
  }
  unsigned char bytes[32];
  std::ifstream random("/dev/urandom", std::ios::binary);
  random.read(reinterpret_cast<char*>(bytes), sizeof(bytes));
  std::string hex;
  constexpr char kHex[] = "0123456789abcdef";
  for (unsigned char b : bytes) {
    hex.push_back(kHex[b >> 4]);
    hex.push_back(kHex[b & 15]);
  }
  hex.push_back('\n');
  const bool ok = random.gcount() == sizeof(bytes) &&
                  write(fd, hex.data(), hex.size()) == static_cast<ssize_t>(hex.size());
  close(fd);
  if (!ok) {
    unlink(token_path.c_str());
    return absl::InternalError(absl::StrCat(token_path, ": cannot write a random token"));
  }
  *token_created = true;
  return absl::OkStatus();
}

}  // namespace fp8rt::k8s
