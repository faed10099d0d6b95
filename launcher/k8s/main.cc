// fp8rt-k8s (run as `fp8rt k8s`): Kubernetes manifests for a training run.
//
//   fp8rt k8s render RUN.yaml --image IMG [--name NAME] [--namespace NS] [--gpu] [--workers N]
//                             [--out DIR]
//
// Writes a kustomization folder (launcher/k8s/render.h) that `kubectl apply -k DIR` deploys: the
// controller, its volume and token, the spec as a ConfigMap and the ranks as an MPIJob, sized
// from the spec's parallel.dp x parallel.tp, on GPU Worker pods when the spec says `device: cuda`.
// DIR defaults to <name>-k8s.
// Exit codes: 0 written; 2 bad options or spec (the message names the flag or the field);
// 1 the folder could not be written.
#include <cstdio>
#include <optional>
#include <string>

#include "CLI/CLI.hpp"
#include "launcher/k8s/render.h"
#include "runtime/core/program.h"

int main(int argc, char** argv) {
  CLI::App app{"Kubernetes manifests for fp8rt runs", "fp8rt k8s"};
  app.require_subcommand(1);
  CLI::App* render = app.add_subcommand(
      "render", "write a kustomization (controller, volume, token, spec, MPIJob) for a run spec");
  fp8rt::k8s::RenderOptions options;
  std::string out;
  render->add_option("spec", options.spec_path, "run spec (YAML)")->required();
  render->add_option("--image", options.image, "container image of every pod")->required();
  render->add_option("--name", options.name,
                     "run name: MPIJob, object prefix, run id (default: the spec file's name)");
  render->add_option("--namespace", options.ns, "namespace of every object");
  render->add_flag("--gpu", options.gpu,
                   "GPU workers: one rank per GPU, NCCL settings (implied by the spec's "
                   "device: cuda; refused for a device: cpu spec)");
  render->add_option("--workers", options.workers,
                     "worker pods (default: one rank per pod on CPU; up to 8 GPUs per pod)");
  render->add_option("--out", out, "output folder (default: <name>-k8s)");
  render->add_option("--tls-cert", options.tls_cert,
                     "PEM certificate of the controller (naming <name>-controller): it serves TLS");
  render->add_option("--tls-key", options.tls_key, "PEM private key of --tls-cert");
  render->add_option("--tls-ca", options.tls_ca, "PEM CA the ranks verify the controller with");
  if (std::optional<int> exit_code = fp8rt::ParseCommandLine(app, argc, argv)) return *exit_code;

  absl::StatusOr<fp8rt::k8s::Rendered> rendered = fp8rt::k8s::Render(options);
  if (!rendered.ok()) {
    std::fprintf(stderr, "fp8rt k8s render: %s\n",
                 std::string(rendered.status().message()).c_str());
    return 2;
  }
  if (out.empty()) out = rendered->name + "-k8s";
  bool token_created = false;
  if (absl::Status s = fp8rt::k8s::WriteRendered(out, *rendered, &token_created); !s.ok()) {
    std::fprintf(stderr, "fp8rt k8s render: %s\n", std::string(s.message()).c_str());
    return 1;
  }
  std::printf("wrote %s/: run %s, %d ranks = %d %s worker pod%s x %d rank%s\n", out.c_str(),
              rendered->name.c_str(), rendered->world, rendered->workers,
              rendered->gpu ? "GPU" : "CPU", rendered->workers == 1 ? "" : "s", rendered->slots,
              rendered->slots == 1 ? "" : "s");
  std::printf("%s %s/token\n", token_created ? "new random token in" : "kept the token in",
              out.c_str());
  std::printf("deploy with: kubectl apply -k %s\n", out.c_str());
  return 0;
}
