// A shim of NCCL's entry points for the GPU tests (issue 23): it makes NCCL's non-blocking
// completion visible on one GPU. With two or more ranks a collective on a non-blocking
// communicator may return ncclInProgress and reach its stream later, from NCCL's own thread; with
// one rank NCCL usually enqueues at once, which hides the difference. A test executable linked
// with the shim (nccl_shim.cc among its sources, and FP8RT_NCCL_SHIM_WRAP in
// tests/gpu/CMakeLists.txt among its link options: the link's --wrap routes
// ncclAllReduce, ncclAllGather, ncclReduceScatter, ncclBroadcast, ncclSend, ncclRecv,
// ncclGroupStart, ncclGroupEnd and ncclCommGetAsyncError here) calls NCCL as usual until it turns
// the shim on. Then a wrapped collective (or a whole ncclGroupStart..ncclGroupEnd) is not passed
// to NCCL at once: its call returns ncclInProgress, and a thread makes the real call `delay`
// later; until then the wrapped ncclCommGetAsyncError answers ncclInProgress. That is NCCL's
// documented contract, only slower, so results must come out right and the caller must wait for
// them. The flags below change what a call does; set them only while no collective is in flight.
#ifndef FP8RT_TESTS_GPU_NCCL_SHIM_H_
#define FP8RT_TESTS_GPU_NCCL_SHIM_H_

#include <atomic>
#include <chrono>

namespace shim {

extern std::atomic<bool> on;  // defer every wrapped call by `delay`
// Deferred calls are never made: a collective that never ends.
extern std::atomic<bool> hang;
// Collectives are not passed to NCCL: a host function that blocks until `released` takes their
// place on their stream, and the call returns ncclSuccess (a collective enqueued that never ends).
extern std::atomic<bool> stall;
extern std::atomic<bool> released;
// Each call first puts a host function that sleeps `slow_ms` (default 400) on its stream, then
// makes the real call: the collective completes well after NCCL enqueued it.
extern std::atomic<bool> slow;
extern std::atomic<int> slow_ms;
// When >= 0, an all-reduce or broadcast is followed, on its stream, by a memset of its receive
// buffer to this byte: the collective's result is then that pattern, not its input, so that a
// result copied back to the host before the collective ran would show (with one rank an in-place
// all-reduce or broadcast leaves its input as it was).
extern std::atomic<int> mark;
// How much later a deferred call is made (default 150 ms); read when a call is deferred.
extern std::chrono::milliseconds delay;

// Waits for the deferred calls' threads and clears the counts and the error they left.
void Reset();
// Calls deferred since the last Reset.
int Deferred();

}  // namespace shim

#endif  // FP8RT_TESTS_GPU_NCCL_SHIM_H_
