// CUDA's runtime and NCCL emulated on CPU ranks, for the tests of parallel/nccl/ (issue 23).
//
// NcclCommunicator's protocol with NCCL (non-blocking communicators, ncclInProgress, polling
// ncclCommGetAsyncError, streams and events, deadlines, the watchdog, aborts, splits, staging host
// buffers) decides whether its results are right with two or more ranks, and one GPU cannot show
// it: with one rank NCCL launches at once. A test executable built with cuda_runtime_host.cc and
// nccl_host.cc instead of libcudart and libnccl (tests/hostgpu/CMakeLists.txt) runs the same
// NcclCommunicator source under mpirun, each rank a CPU process, the ranks' data moving over MPI.
//
// The model:
//   - Device memory is host memory that the runtime has registered (cudaMalloc, cudaMallocAsync
//     and the staging pool: device memory; cudaMallocHost: pinned). cudaPointerGetAttributes tells
//     them from plain host memory as CUDA does. A copy fails when its device side is not registered
//     memory, when its host side is device memory, or when it runs past its allocation. Each
//     allocation's tail past the bytes asked for is poisoned for AddressSanitizer, so that work
//     reading or writing past its array's end (on a GPU: another array, unnoticed) is reported.
//   - Streams are queues. Their work (copies, memsets, event records, waits on events, host
//     functions, frees, NCCL's kernels) runs in stream order, after the events it waits for, and
//     with the legacy default stream's implicit ordering against blocking streams. With
//     Settings::lazy_streams the device runs only when the host waits: a synchronisation (a
//     stream, an event, the device, a synchronous copy or memset, cudaFree), a copy to or from
//     pageable memory, or every `stream_polls`-th query of a stream or event (until then a query
//     answers cudaErrorNotReady; one count for all streams, events and threads). Without it (the
//     default) work runs as soon as it can, as it is enqueued. cudaStreamPerThread is taken as
//     the legacy stream. Host code that reads device memory directly is not ordered: the tests
//     read device memory with cudaMemcpy, and pinned memory directly, as a caller may after a call
//     that waited.
//   - NCCL on a non-blocking communicator works as its documentation says, and as it does with
//     several ranks: a collective (or a ncclGroupStart..ncclGroupEnd of sends and receives)
//     returns ncclInProgress; it is put on its stream at the poll of ncclCommGetAsyncError that
//     first answers ncclSuccess, at least `polls` polls and `delay` after the call. There it is a
//     kernel: when the stream reaches it, and after the communicator's earlier kernels started
//     (NCCL runs one communicator's work in call order), it reads its send buffer and starts MPI
//     non-blocking operations; it ends, writing its receive buffer, once every rank has sent its
//     part. So a result read before the backend waited for the kernel (through the stream or an
//     event after it) is the buffer as it was.
//   - NCCL forbids, after a call answered ncclInProgress, another call on that communicator and
//     CUDA work on the stream the call will use, until the state is ncclSuccess. The first fails
//     with ncclInvalidUsage, the second with cudaErrorInvalidValue; both are counted
//     (Stats::misuse), so that a test can assert none.
//   - Faults (Settings; every rank sets the same): a call that never reaches its stream (`hang`),
//     a kernel that never ends (`hang_on_stream`), an asynchronous error instead of the kernel
//     (`fail`), or after it was enqueued and hangs (`fail_on_stream`, reported 20 ms later). All
//     ranks see the fault together, or with `fault_rank` only that world rank does: a dead peer,
//     whose part never comes, so that the others' kernels start and wait for it. ncclCommAbort
//     ends the communicator's kernels, so that a host waiting behind them returns, as on a GPU
//     (a started kernel's MPI operations are left pending to the process's end).
//   - Communicator creation (the unique id is compared across ranks), ncclCommSplit (the child's
//     handle is written when the parent leaves ncclInProgress) and ncclCommFinalize (ends when the
//     communicator's kernels have) are deferred the same way, but their MPI parts run at the call
//     and block: a rank missing from them hangs the others instead of failing them at the
//     deadline (not modelled). A setup that never completes is a fault of its own
//     (Settings::setup_hang).
//   - With lazy streams and Settings::lazy_progress_after, a host wait that has not finished in
//     that time runs every stream, as a GPU eventually runs all queued work.
//   - Stream order: the device keeps CUDA's happens-before order (vector clocks over the streams:
//     stream order, events waited for, the legacy stream's implicit order, and what the calling
//     host thread has seen end: a synchronisation, a query answered cudaSuccess, a copy that CUDA
//     makes synchronous for the host; each thread its own; lazy progress is no such edge). Each
//     piece of work that names memory (copies, memsets, Launch's pointers when it is enqueued;
//     NCCL kernels' send and receive buffers when NCCL puts them on their stream; a group's
//     sends and receives all on its first call's stream) is checked against the rules of
//     stream-ordered memory, whatever order the device then runs it in: memory from
//     cudaMallocAsync or the pool is used on another stream, or freed there, only after its
//     allocation (a point in its stream's order: the pool may make the stream wait there for the
//     memory's previous user), and never once its cudaFreeAsync is enqueued; a cudaFreeAsync
//     comes after every use on other streams (else the pool may hand the memory out again while
//     that work still runs) and only once. And it is checked for data races between streams,
//     whatever memory it lies in: work that reads bytes must come after the last work on another
//     stream that wrote any of them, and work that writes bytes after that and after every read
//     of any of them on another stream since, each through an event, a host wait or the legacy
//     stream's implicit order. The unit is the byte: two streams writing disjoint parts of one
//     array race not. Copies read their source's and write their destination's bytes, memsets
//     write theirs, NCCL kernels read their send and write their receive buffers' bytes, and
//     Launch's work says what it reads and writes (a pointer without a size stands for the bytes
//     from it to its allocation's end: an op may use any of them, never one before it). A breach of
//     any rule is counted (StreamRaces), so that a test can assert none. cudaLaunchHostFunc's
//     function names no memory and is not checked.
//   - Tests may put work of their own on the device (Launch: stream_ops.h runs the CPU op table
//     there).
//   - MPI is called only from the thread that initialised it (MPI_THREAD_FUNNELED): other
//     threads (the backend's watchdog) see NCCL's state and the streams as they are, and run only
//     work that needs no MPI.
//   - With eager streams a kernel is waited for where it is enqueued (the host goes on as if it
//     ran); ranks whose NCCL calls diverge would wait for ever, so after two minutes the process
//     says so and aborts.
// One CUDA device (ordinal 0) exists. Only the entry points fp8rt and its tests call are there;
// groups may hold only sends and receives, and communicators span MPI_COMM_WORLD's ranks in order.
// Blocking communicators (fp8rt creates none) complete a call before it returns, and a fault that
// never ends makes that call wait for ever.
#ifndef FP8RT_TESTS_HOSTGPU_HOST_GPU_H_
#define FP8RT_TESTS_HOSTGPU_HOST_GPU_H_

#include <chrono>
#include <cstdint>
#include <functional>
#include <string>
#include <vector>

namespace fp8rt::hostgpu {

// How the emulation behaves. Change it only while no NCCL work is in flight: a call takes the
// fault settings in force when it is made.
struct Settings {
  // A deferred NCCL call stays ncclInProgress for at least this many polls of
  // ncclCommGetAsyncError
  int polls = 3;
  // and at least this long after the call.
  std::chrono::microseconds delay{500};
  bool lazy_streams = false;
  int stream_polls = 3;
  // With lazy streams: a host wait still unfinished after this long runs every stream, as a GPU
  // runs all queued work eventually (zero: never). Without it a rank whose host waits for one
  // stream never runs another stream's collective that a peer waits for (the MoE training run's
  // dp gathers and ep all-to-alls), which a GPU running both kernels concurrently does not do
  // when every rank issues them in the same order. The price: such a wait runs the other
  // streams' work first, so a dependency missing there no longer shows in the results (a timed
  // fallback, so which waits take it varies from run to run; train_host_nccl_test counts them).
  // The stream-order checks still see it where both sides name the same memory: they judge the
  // happens-before order, not the order the work ran in.
  std::chrono::milliseconds lazy_progress_after{0};
  bool hang = false;
  bool hang_on_stream = false;
  int fail = 0;  // an ncclResult_t; 0 (ncclSuccess): none
  int fail_on_stream = 0;
  int fault_rank = -1;  // the faults above on this MPI_COMM_WORLD rank only; -1: on every rank
  // Communicator setup that never completes (on the ranks fault_rank names): the new
  // communicator of ncclCommInitRankConfig, or of ncclCommSplit, stays ncclInProgress; the
  // parent of a split does; or the parent completes but the child's handle is never written
  // (NCCL 2.23+ writes it from its own thread, after the parent's state may read ncclSuccess).
  // A child never handed out is freed with its parent. Non-blocking communicators only (a
  // blocking call would wait for ever).
  enum class SetupHang { kNone, kInit, kSplitChild, kSplitParent, kSplitHandle };
  SetupHang setup_hang = SetupHang::kNone;
};
Settings& settings();

struct Stats {
  int64_t deferred = 0;  // NCCL calls that returned ncclInProgress
  int64_t kernels = 0;   // NCCL kernels that ended with their results
  // Of them, on a stream other than their communicator's own (the first stream created after
  // the communicator: NcclCommunicator's stream_), so fp8rt's started collectives.
  int64_t side_stream = 0;
  int64_t side_reduce_scatter = 0;   // of those, reduce-scatters (fp8rt: gradient reductions)
  int64_t side_bf16_all_gather = 0;  // and BF16 all-gathers (fp8rt: fsdp_gather bf16)
  int64_t caller_memory = 0;  // of them, receiving into memory the caller allocated (not staging)
  int64_t misuse = 0;         // refused calls (see above)
  std::string first_misuse;
  int64_t aborted = 0;    // ncclCommAbort calls
  int64_t abandoned = 0;  // kernels the abort ended after they started, a peer's part missing
  int64_t live = 0;       // communicators now created and not yet destroyed or aborted
};
Stats stats();
void ResetStats();

// Between the two files.
// cuda_runtime_host.cc: whether [p, p + bytes) lies inside one registered allocation; `kind`
// receives 1 for cudaMalloc, 2 for the staging pool, 3 for cudaMallocHost (0 otherwise).
bool DeviceRange(const void* p, size_t bytes, int* kind = nullptr);
// cuda_runtime_host.cc: whether `stream` is a live stream (or the null, legacy or per-thread
// stream).
bool ValidStream(void* stream);
// The memory a piece of work reads and writes, for the stream-order checks: [p, p + bytes), or
// with bytes 0 from p to the end of its allocation (clipped there). Pointers into no allocation,
// null included, are not checked.
struct Use {
  Use(const void* p, size_t bytes = 0) : p(p), bytes(bytes) {}  // NOLINT: a bare pointer is a Use
  const void* p;
  size_t bytes;
};
struct Uses {
  std::vector<Use> reads;
  std::vector<Use> writes;
};
// cuda_runtime_host.cc: puts a kernel on `stream`, in stream order; `step` is called when the
// stream reaches it, and again until it returns true (it may decline on a thread other than
// MPI's). Called with nccl_host.cc's lock held.
// `uses`: the buffers it reads and writes, and `call` its name (a string literal: reports name it
// later), for the stream-order checks.
void EnqueueKernel(void* stream, std::function<bool()> step, Uses uses, const char* call);
// cuda_runtime_host.cc: one identity per stream (the null, legacy and per-thread handles share
// the legacy stream's), and running every piece of work the device can run now.
void* StreamId(void* stream);
void RunAll();
// cuda_runtime_host.cc: how many host waits ran every stream (Settings::lazy_progress_after).
int64_t LazyProgressRuns();
// cuda_runtime_host.cc: a kernel launch, for work the tests put on the device (stream_ops.h):
// `work` runs when `stream` reaches it, in stream order. Returns a cudaError_t: `call` is misuse
// while a NCCL call still ncclInProgress holds the stream, as any CUDA work there.
// `uses`: the pointers it is given, read or written, for the stream-order checks; `call` a string
// literal (reports name it later).
int Launch(void* stream, std::function<void()> work, const char* call, Uses uses = {});
// cuda_runtime_host.cc: breaches of the CUDA rules of stream-ordered memory seen since
// ResetStreamRaces (see "Stream order" above), and the first of them (empty: none).
int64_t StreamRaces();
std::string FirstStreamRace();
void ResetStreamRaces();
// nccl_host.cc: a stream was created; the newest communicator without its own stream takes it.
void StreamCreated(void* stream);
// nccl_host.cc: whether a NCCL call still ncclInProgress will be put on `stream`, in which case
// `call`, CUDA work on that stream, is counted as misuse.
bool NcclHoldsStream(void* stream, const char* call);

}  // namespace fp8rt::hostgpu

#endif  // FP8RT_TESTS_HOSTGPU_HOST_GPU_H_
