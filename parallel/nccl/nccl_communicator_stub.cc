// The NCCL backend when fp8rt is built without CUDA (FP8RT_CUDA=OFF): its one entry point for
// code that builds either way fails loudly.
#include "parallel/nccl/nccl_communicator.h"

namespace fp8rt::parallel {

absl::StatusOr<std::unique_ptr<CommunicatorFactory>> CreateNcclCommunicatorFactory(
    Communicator& bootstrap, int device, const NcclOptions& options) {
  (void)bootstrap;
  (void)device;
  (void)options;
  return absl::UnavailableError(
      "the NCCL backend is not built into this fp8rt (configure with -DFP8RT_CUDA=ON, with nvcc "
      "and NCCL installed)");
}

}  // namespace fp8rt::parallel
