// CUDA's runtime and NCCL emulated on CPU ranks, for the tests of parallel/nccl/ (issue 23).
//
// NcclCommunicator's protocol with NCCL (non-blocking communicators, ncclInProgress, polling
// ncclCommGetAsyncError, deadlines, aborts, splits, staging host buffers) decides whether its
// results are right with two or more ranks, and one GPU cannot show it: with one rank NCCL
// launches at once. A test executable built with cuda_runtime_host.cc and nccl_host.cc instead
// of libcudart and libnccl (tests/hostgpu/CMakeLists.txt) runs the same NcclCommunicator source
// under mpirun, each rank a CPU process, the ranks' data moving over MPI.
//
// The model, and what it leaves out:
//   - Device memory is host memory that the runtime has registered (cudaMalloc, the device pool,
//     cudaMallocHost for pinned memory); cudaPointerGetAttributes tells them from plain host
//     memory as CUDA does. A copy whose kind disagrees with where its pointers live fails.
//   - Streams execute their work when it is enqueued: a copy, a memset or an event record has
//     happened when its call returns, so every stream and event is always complete. Kernels
//     running on after their launch, and the ordering between streams, are not modelled (a GPU
//     shows those: tests/gpu/).
//   - NCCL on a non-blocking communicator works as its documentation says, and as it does with
//     several ranks: a collective (or a ncclGroupStart..ncclGroupEnd of sends and receives)
//     returns ncclInProgress and reaches its stream later. Here its data leave at the call (an
//     MPI non-blocking operation) and its results are written to the receive buffers only at the
//     poll of ncclCommGetAsyncError that first answers ncclSuccess: at least `polls` polls and
//     `delay` after the call, and not before every rank has sent its part. So a result read
//     before NCCL's state left ncclInProgress is the buffer as it was before the collective.
//   - Another call on a communicator while its state is ncclInProgress fails with
//     ncclInvalidUsage, and CUDA work enqueued meanwhile on the stream that call will use fails
//     with cudaErrorInvalidValue; both are counted (Stats::misuse), so that a test can assert
//     none. NCCL's documentation forbids both: after ncclInProgress, query the state until it is
//     ncclSuccess before calling NCCL again or issuing CUDA work on NCCL's streams.
//   - Communicator creation (the unique id must be the same on every rank: it is checked),
//     ncclCommSplit (the child's handle is written when the parent leaves ncclInProgress) and
//     ncclCommFinalize are deferred the same way.
//   - MPI is called only from the thread that created the communicator (the MPI library is
//     initialised with MPI_THREAD_FUNNELED): other threads' polls (the watchdog's) see the state
//     as it is.
// One CUDA device (ordinal 0) exists. Only the entry points fp8rt and its tests call are there.
#ifndef FP8RT_TESTS_HOSTGPU_HOST_GPU_H_
#define FP8RT_TESTS_HOSTGPU_HOST_GPU_H_

#include <chrono>
#include <cstdint>
#include <string>

namespace fp8rt::hostgpu {

// How NCCL's deferred work behaves. Change it only while no NCCL work is in flight.
struct Settings {
  // A deferred call stays ncclInProgress for at least this many polls of ncclCommGetAsyncError
  int polls = 3;
  // and at least this long after the call.
  std::chrono::microseconds delay{500};
  // Deferred collectives never complete (and move no data): a peer that hangs.
  bool hang = false;
  // When not ncclSuccess, deferred collectives end with this asynchronous error (a peer that
  // failed) instead of their results.
  int fail = 0;
};
Settings& settings();

struct Stats {
  int64_t deferred = 0;  // NCCL calls that returned ncclInProgress
  int64_t misuse = 0;    // calls on a communicator still ncclInProgress, refused
  std::string first_misuse;
  int64_t aborted = 0;  // ncclCommAbort calls
};
Stats stats();
void ResetStats();

// For nccl_host.cc: whether [p, p + bytes) lies inside one allocation the device can address
// (cudaMalloc, the device pool or cudaMallocHost), and whether `stream` is a live stream (or the
// null, legacy or per-thread stream).
bool DeviceRange(const void* p, size_t bytes);
bool ValidStream(void* stream);
// For cuda_runtime_host.cc: whether a NCCL call still ncclInProgress will be put on `stream`, in
// which case `call`, CUDA work on that stream, is counted as misuse (NCCL's documentation: until
// the communicator's state is ncclSuccess, issue no CUDA work on the streams NCCL uses).
bool NcclHoldsStream(void* stream, const char* call);

}  // namespace fp8rt::hostgpu

#endif  // FP8RT_TESTS_HOSTGPU_HOST_GPU_H_
