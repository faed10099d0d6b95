// Kubernetes manifests for one training run (`fp8rt k8s render`, launcher/k8s/main.cc).
//
// Render() turns a run spec into a kustomization folder that `kubectl apply -k` deploys as it is:
// a whole fp8rt stack named after the run, the same shape as deploy/kubernetes (whose comments
// explain every field), with the numbers taken from the spec:
//   kustomization.yaml   namespace, the ConfigMap (from run.yaml) and Secret (from token)
//                        generators, the image
//   controller.yaml      Deployment and Service <name>-controller (gRPC 50051, metrics 9464)
//   data-pvc.yaml        PersistentVolumeClaim <name>-data (ReadWriteMany): run folder, state
//   mpijob.yaml          MPIJob <name> (kubeflow.org/v2beta1): ranks = parallel.dp x parallel.tp
//                        = slotsPerWorker x Worker replicas; with the spec's `device: cuda`, GPU
//                        Worker pods: one rank per GPU (nvidia.com/gpu = slotsPerWorker)
//   run.yaml             the spec file, byte for byte
//   tls.crt, tls.key, ca.crt   with --tls-*: the controller serves TLS (Secret <name>-tls),
//                        the ranks verify it; its probes read /metrics
// Open MPI's TCP transport between pods on eth0 (OMPI_MCA_btl, btl/oob_tcp_if_include) always.
// The token file is not rendered: WriteRendered() creates a random one unless the folder already
// has one (so that rendering again keeps the running controller's token).
//
// The spec is loaded (LoadRunSpec) and validated for its own world size (ValidateRunSpec) except
// for data.path, which names a file in the pods (relative to /opt/fp8rt, the ranks' working
// directory, where the image ships the demo corpus), not on this machine.
//
// Errors are InvalidArgument naming the flag (--name, --namespace, --image, --workers, --gpu) or
// the spec field; NotFound for a missing spec file. Stateless and thread-safe.
#ifndef FP8RT_LAUNCHER_K8S_RENDER_H_
#define FP8RT_LAUNCHER_K8S_RENDER_H_

#include <map>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

namespace fp8rt::k8s {

// What to render. Every field but spec_path and image has a default.
struct RenderOptions {
  // The run spec (YAML, runtime/spec/run_spec.h). Required.
  std::string spec_path;
  // Container image of every pod (deploy/Dockerfile.cpu or deploy/Dockerfile). Required.
  std::string image;
  // Run name: the MPIJob, the prefix of every other object, the run id at the controller and the
  // run folder /data/runs/<name>. A DNS-1035 label of at most 40 characters (the operator appends
  // pod suffixes). Empty: the spec file's name without its extension.
  std::string name;
  // Namespace of every object; empty: the one kubectl applies to.
  std::string ns;
  // Asks for GPU workers (nvidia.com/gpu, NCCL settings, one rank per GPU). The spec decides: a
  // `device: cuda` spec gets GPU workers anyway, and --gpu with a `device: cpu` spec (whose ranks
  // would leave the GPUs idle) is an error naming --gpu.
  bool gpu = false;
  // Worker pods; each hosts world / workers ranks. 0: one rank per pod on CPU; on GPU one pod
  // for up to 8 ranks, else world / 8 pods of 8 GPUs (world must then be a multiple of 8).
  int workers = 0;
  // TLS for the controller: PEM certificate (naming <name>-controller), its key, and the CA the
  // ranks verify it with; all three or none. Copied into the folder as tls.crt, tls.key, ca.crt
  // (Secret <name>-tls). Errors name the flag (--tls-cert, --tls-key, --tls-ca).
  std::string tls_cert, tls_key, tls_ca;
};

// The rendered folder and the numbers it was sized with.
struct Rendered {
  std::string name;                          // the run name (RenderOptions::name or its default)
  int world = 0;                             // ranks: parallel.dp x parallel.tp
  int workers = 0;                           // Worker pods
  int slots = 0;                             // ranks per Worker pod (slotsPerWorker)
  bool gpu = false;                          // GPU Worker pods (the spec's device: cuda)
  std::map<std::string, std::string> files;  // file name -> content
};

// Loads and checks the spec and renders the manifests (nothing is written).
[[nodiscard]] absl::StatusOr<Rendered> Render(const RenderOptions& options);

// Writes the files into `dir` (created if needed) and a random token file `dir`/token (mode
// 0600) unless it exists; `*token_created` says which. Errors name the path.
[[nodiscard]] absl::Status WriteRendered(const std::string& dir, const Rendered& rendered,
                                         bool* token_created);

}  // namespace fp8rt::k8s

#endif  // FP8RT_LAUNCHER_K8S_RENDER_H_
