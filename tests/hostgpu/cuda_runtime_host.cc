// The CUDA runtime entry points fp8rt's NCCL backend calls, emulated on the host (host_gpu.h says
// the model): device memory is registered host memory, and streams are queues of work that the
// emulated device runs in stream order. Errors are CUDA's codes, and the last one is kept per
// thread as CUDA does.
//
// Locks: `dev_mu` (the streams and events; work runs with it held) is taken before `rt.mu` (the
// allocations), never after; nccl_host.cc's lock is taken before both, and never while either is
// held here.
#include <cuda_runtime.h>
#include <sanitizer/asan_interface.h>  // no-op macros without AddressSanitizer

#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <functional>
#include <iterator>
#include <map>
#include <mutex>
#include <set>
#include <thread>
#include <utility>
#include <vector>

#include "kernels/cuda/device_pool.h"
#include "tests/hostgpu/host_gpu.h"

namespace {

// Vector clocks of the device's happens-before order (the stream-order checks of host_gpu.h): for
// each stream, the last of its pieces of work (1-based) that is ordered before a point.
using VectorClock = std::map<const CUstream_st*, uint64_t>;

void Merge(VectorClock& into, const VectorClock& from) {
  for (const auto& [s, n] : from) {
    uint64_t& x = into[s];
    if (n > x) x = n;
  }
}

// Whether piece n of stream s happens before the point of clock c.
bool Before(const VectorClock& c, const CUstream_st* s, uint64_t n) {
  const auto it = c.find(s);
  return n == 0 || (it != c.end() && it->second >= n);
}

// A piece of work on a stream: runs (step() returns true once done) when every (stream, n) it
// depends on has done its n-th piece.
struct Work {
  std::function<bool()> step;
  std::vector<std::pair<CUstream_st*, uint64_t>> after;
};

}  // namespace

struct CUstream_st {
  unsigned flags = 0;
  bool legacy = false;
  bool live = true;  // destroyed streams finish their work; the object is never freed
  std::deque<Work> queue;
  uint64_t enqueued = 0;  // pieces of work ever enqueued; the n-th is done when done >= n
  uint64_t done = 0;
  VectorClock clock;  // of its last piece of work
};
struct CUevent_st {
  unsigned flags = 0;
  CUstream_st* stream = nullptr;  // of the last record (null: never recorded)
  uint64_t index = 0;
  VectorClock clock;  // of the last record
};

namespace {

enum Kind : int { kNone = 0, kDevice = 1, kPool = 2, kPinned = 3 };

struct Allocation {
  size_t bytes = 0;
  Kind kind = kDevice;
  // Stream-ordered (cudaMallocAsync, the staging pool): allocated on `stream` after its piece
  // `at`; work elsewhere must be ordered after that.
  const CUstream_st* stream = nullptr;
  uint64_t at = 0;
  std::map<const CUstream_st*, uint64_t> uses;  // the last piece of work of each stream using it
  bool free_enqueued = false;                   // cudaFreeAsync'd; Release runs in stream order
  // The data-race checks: the byte ranges pieces of work touched, with the call's name for a
  // report. Kept: every write not since covered by a later write, and every read not since
  // covered by a later write or a later read on its stream. An older touch that a newer one covers
  // orders nothing the newer does not (the newer came after it, or was reported).
  struct Touch {
    size_t begin = 0, end = 0;  // bytes from the allocation's base
    const CUstream_st* stream = nullptr;
    uint64_t index = 0;
    const char* what = "";
    bool write = false;
  };
  std::vector<Touch> touches;
};

struct Runtime {
  std::mutex mu;
  std::map<const char*, Allocation> allocations;  // by base address
  std::set<cudaEvent_t> events;
};

Runtime& State() {
  static Runtime* runtime = new Runtime;  // outlives every static that frees memory at exit
  return *runtime;
}

std::recursive_mutex dev_mu;
CUstream_st& LegacyStream() {
  static auto* legacy = [] {
    auto* s = new CUstream_st;
    s->legacy = true;
    return s;
  }();
  return *legacy;
}
std::vector<CUstream_st*>& Streams() {  // every stream but the legacy one, ever created
  static auto* streams = new std::vector<CUstream_st*>;
  return *streams;
}
// The device's work the calling host thread has seen end (its waits and successful queries):
// what it enqueues comes after that. One per thread, as in CUDA, where another thread's wait
// orders nothing for this one; never destroyed (a free from a static destructor still merges), and
// kept reachable for LeakSanitizer.
VectorClock& HostClock() {
  static auto* all = new std::vector<VectorClock*>;  // guarded by dev_mu
  thread_local VectorClock* clock = [] {
    std::lock_guard<std::recursive_mutex> lock(dev_mu);
    all->push_back(new VectorClock);
    return all->back();
  }();
  return *clock;
}
int query_ticks = 0;  // queries since the device last ran (lazy streams)
std::atomic<int64_t> lazy_progress_runs{
    0};  // host waits that ran every stream (lazy_progress_after)

std::atomic<int64_t> stream_races{0};
std::mutex race_mu;
std::string& FirstRace() {  // guarded by race_mu; never destroyed
  static auto* first = new std::string;
  return *first;
}

// Counts a breach; the first since the last reset is also printed, since its consequence (a
// use-after-free that ASan reports, or a wrong result) may end the test before it can be asked.
void Race(const std::string& why) {
  if (stream_races.fetch_add(1) != 0) return;
  std::fprintf(stderr, "hostgpu: stream-order breach: %s\n", why.c_str());
  std::lock_guard<std::mutex> lock(race_mu);
  FirstRace() = why;
}

// A stream's name in race reports.
std::string NameOf(const CUstream_st* s) {
  if (s->legacy) return "the legacy default stream";
  char buf[48];
  std::snprintf(buf, sizeof(buf), "stream %p", static_cast<const void*>(s));
  return buf;
}

thread_local cudaError_t last_error = cudaSuccess;
thread_local int current_device = 0;

cudaError_t Fail(cudaError_t e) {
  last_error = e;
  return e;
}

// The allocation that holds [p, p + bytes), if p lies in one; `inside` false when p does but the
// range runs past its end; `offset`, when given, p's offset in it.
Allocation* Find(Runtime& rt, const void* p, size_t bytes, bool* inside, size_t* offset = nullptr) {
  *inside = true;
  const char* c = static_cast<const char*>(p);
  auto it = rt.allocations.upper_bound(c);
  if (it == rt.allocations.begin()) return nullptr;
  --it;
  if (c >= it->first + it->second.bytes) return nullptr;
  *inside = c + bytes <= it->first + it->second.bytes;
  if (offset != nullptr) *offset = static_cast<size_t>(c - it->first);
  return &it->second;
}

// The bytes an allocation of `bytes` takes: 256-byte aligned, as cudaMalloc's are, rounded up to
// 256 and 256 more, so that it is never empty and its end never starts another allocation. The
// tail past `bytes` is poisoned for AddressSanitizer: an op that reads or writes past its array's
// end, which on a GPU would corrupt or read another array unnoticed, is reported.
size_t Footprint(size_t bytes) { return ((bytes + 255) / 256) * 256 + 256; }

cudaError_t Release(void* p, bool pinned) {
  if (p == nullptr) return cudaSuccess;
  Runtime& rt = State();
  size_t bytes = 0;
  {
    std::lock_guard<std::mutex> lock(rt.mu);
    auto it = rt.allocations.find(static_cast<const char*>(p));
    if (it == rt.allocations.end() || (it->second.kind == kPinned) != pinned) {
      return Fail(cudaErrorInvalidValue);
    }
    bytes = it->second.bytes;
    rt.allocations.erase(it);
  }
  ASAN_UNPOISON_MEMORY_REGION(p, Footprint(bytes));
  std::free(p);
  return cudaSuccess;
}

Kind KindOf(const void* p, size_t bytes, bool* inside) {
  Runtime& rt = State();
  std::lock_guard<std::mutex> lock(rt.mu);
  const Allocation* a = Find(rt, p, bytes, inside);
  return a == nullptr ? kNone : a->kind;
}

// The stream object of a handle: the null, legacy and per-thread handles are the legacy stream.
// Null for a handle that is no live stream.
// `dead`: also a destroyed stream (which still runs the work enqueued before).
CUstream_st* StreamOf(cudaStream_t s, bool dead = false) {
  if (s == nullptr || s == cudaStreamLegacy || s == cudaStreamPerThread) return &LegacyStream();
  std::lock_guard<std::recursive_mutex> lock(dev_mu);
  for (CUstream_st* x : Streams()) {
    if (x == s) return x->live || dead ? x : nullptr;
  }
  return nullptr;
}

bool ValidEvent(cudaEvent_t e) {
  Runtime& rt = State();
  std::lock_guard<std::mutex> lock(rt.mu);
  return rt.events.count(e) != 0;
}

// With dev_mu held: runs every piece of work that can run, until none can.
void RunDevice() {
  std::vector<CUstream_st*> all = Streams();
  all.push_back(&LegacyStream());
  for (bool progress = true; progress;) {
    progress = false;
    for (CUstream_st* s : all) {
      while (!s->queue.empty()) {
        Work& w = s->queue.front();
        bool ready = true;
        for (const auto& [stream, n] : w.after) ready &= stream->done >= n;
        if (!ready || (w.step && !w.step())) break;
        s->queue.pop_front();
        ++s->done;
        progress = true;
      }
    }
  }
}

// What a piece of work touches, for the stream-order checks (host_gpu.h): the allocations its
// pointers lie in (`uses`; pointers in none are left to the call's own checks), or the one it
// frees (`frees`); `what` names the call in a report.
struct Access {
  fp8rt::hostgpu::Uses uses;
  const void* frees = nullptr;
  const char* what = "";
};

// With rt.mu held: the data-race rules for a read (or a write) of bytes [begin, end) of `a` by
// piece `index` of `s`, whose clock is `c`: it must come after every write of those bytes on
// another stream, and a write also after every read of them there; then it is kept as a touch.
// `what` names the call and is kept for later reports (a string literal, as every caller passes).
void CheckDataRace(Allocation& a, size_t begin, size_t end, const CUstream_st* s, uint64_t index,
                   const VectorClock& c, bool write, const char* what) {
  for (const Allocation::Touch& t : a.touches) {
    if (t.stream == s || (!write && !t.write) || t.end <= begin || end <= t.begin) continue;
    if (Before(c, t.stream, t.index)) continue;
    Race(std::string(what) + " on " + NameOf(s) + (write ? " writes" : " reads") + " memory that " +
         t.what + " on " + NameOf(t.stream) + (t.write ? " writes" : " reads") +
         ", without waiting for it (an event, a host wait or the legacy stream's implicit order)");
  }
  std::erase_if(a.touches, [&](const Allocation::Touch& t) {
    return begin <= t.begin && t.end <= end && (write || (t.stream == s && !t.write));
  });
  a.touches.push_back({begin, end, s, index, what, write});
}

// With dev_mu held: the checks of host_gpu.h's "Stream order" for piece `index` of `s`, whose
// clock is `c`. No data race between streams (CheckDataRace), and the CUDA rules of stream-ordered
// memory: work may use memory only after its stream-ordered allocation (on another stream: through
// an event, a host wait or the legacy stream's implicit order) and never once its cudaFreeAsync is
// enqueued; a cudaFreeAsync must come after every use on other streams. A breach is counted
// (StreamRaces), whatever order the device then runs the work in.
void CheckAccess(const CUstream_st* s, uint64_t index, const VectorClock& c, const Access& access) {
  if (access.uses.reads.empty() && access.uses.writes.empty() && access.frees == nullptr) return;
  Runtime& rt = State();
  std::lock_guard<std::mutex> lock(rt.mu);
  // The allocations it uses, and the byte ranges it reads and writes in each.
  struct Range {
    size_t begin, end;
    bool write;
  };
  std::map<Allocation*, std::vector<Range>> used;
  auto find = [&rt](const void* p, size_t* offset) -> Allocation* {
    bool inside = true;
    return p == nullptr ? nullptr : Find(rt, p, 1, &inside, offset);
  };
  auto add = [&find, &used](const fp8rt::hostgpu::Use& u, bool write) {
    size_t begin = 0;
    Allocation* a = find(u.p, &begin);
    if (a == nullptr) return;
    const size_t end = u.bytes == 0 ? a->bytes : std::min(a->bytes, begin + u.bytes);
    used[a].push_back({begin, end, write});
  };
  for (const auto& u : access.uses.writes) add(u, /*write=*/true);
  for (const auto& u : access.uses.reads) add(u, /*write=*/false);
  for (auto& [a, ranges] : used) {
    for (const Range& r : ranges)
      CheckDataRace(*a, r.begin, r.end, s, index, c, r.write, access.what);
    if (a->free_enqueued) {
      Race(std::string(access.what) + " on " + NameOf(s) +
           " uses memory whose cudaFreeAsync is already enqueued");
    } else if (a->stream != nullptr && a->stream != s && !Before(c, a->stream, a->at)) {
      Race(std::string(access.what) + " on " + NameOf(s) +
           " uses memory allocated in stream order on " + NameOf(a->stream) +
           " without waiting for that stream (an event, a host wait or the legacy stream's "
           "implicit order)");
    }
    uint64_t& last = a->uses[s];
    if (index > last) last = index;
  }
  if (Allocation* a = find(access.frees, nullptr); a != nullptr) {
    if (a->free_enqueued) Race("a second cudaFreeAsync on " + NameOf(s) + " of the same memory");
    for (const auto& [t, n] : a->uses) {
      if (t != s && !Before(c, t, n)) {
        Race("cudaFreeAsync on " + NameOf(s) + " of memory that work on " + NameOf(t) +
             " uses, without waiting for it (an event, a host wait or the legacy stream's "
             "implicit order): the pool may hand the "
             "memory out again while that work still runs");
      }
    }
    a->free_enqueued = true;
  }
}

// Enqueues `step` on `s`, after `wait`'s last record (cudaStreamWaitEvent), in the legacy
// stream's order against blocking streams, checking `access`; returns its index on `s`, and its
// clock in `clock_out` when given.
uint64_t Enqueue(CUstream_st* s, std::function<bool()> step, const CUevent_st* wait = nullptr,
                 const Access& access = {}, VectorClock* clock_out = nullptr) {
  std::lock_guard<std::recursive_mutex> lock(dev_mu);
  Work w{std::move(step), {}};
  VectorClock c = s->clock;
  Merge(c, HostClock());
  if (wait != nullptr && wait->stream != nullptr) {
    w.after.emplace_back(wait->stream, wait->index);
    Merge(c, wait->clock);
  }
  if (s->legacy) {
    for (CUstream_st* b : Streams()) {
      if (b->flags == cudaStreamDefault) {
        w.after.emplace_back(b, b->enqueued);
        if (!Before(c, b, b->enqueued)) Merge(c, b->clock);  // else covered already
      }
    }
  } else if (s->flags == cudaStreamDefault) {
    w.after.emplace_back(&LegacyStream(), LegacyStream().enqueued);
    Merge(c, LegacyStream().clock);
  }
  const uint64_t index = s->enqueued + 1;
  c[s] = index;
  CheckAccess(s, index, c, access);
  if (clock_out != nullptr) *clock_out = c;
  s->clock = std::move(c);
  s->queue.push_back(std::move(w));
  s->enqueued = index;
  if (!fp8rt::hostgpu::settings().lazy_streams) RunDevice();
  return index;
}

// With dev_mu held: the host has seen the work of clock `c` end (a wait, or a query that answered
// cudaSuccess), so what it enqueues from now on comes after it.
void Waited(const VectorClock& c) { Merge(HostClock(), c); }

// `stream`: a stream-ordered allocation on it (cudaMallocAsync, the pool). The allocation is a
// point in that stream's order (an empty piece of work, since the pool may make the stream wait
// there for the memory's previous user): work on other streams must come after it, and so must a
// cudaFreeAsync elsewhere.
cudaError_t Allocate(void** p, size_t bytes, Kind kind, CUstream_st* stream = nullptr) {
  if (p == nullptr) return Fail(cudaErrorInvalidValue);
  void* mem = std::aligned_alloc(256, Footprint(bytes));
  if (mem == nullptr) return Fail(cudaErrorMemoryAllocation);
  ASAN_POISON_MEMORY_REGION(static_cast<char*>(mem) + bytes, Footprint(bytes) - bytes);
  Allocation a;
  a.bytes = bytes;
  a.kind = kind;
  if (stream != nullptr) {
    a.stream = stream;
    a.at = Enqueue(stream, nullptr);  // takes dev_mu, which comes before rt.mu
    a.uses[stream] = a.at;
  }
  Runtime& rt = State();
  std::lock_guard<std::mutex> lock(rt.mu);
  rt.allocations[static_cast<const char*>(mem)] = std::move(a);
  *p = mem;
  return cudaSuccess;
}

// With dev_mu held: runs `s`'s work up to its n-th piece and, first, the work that work waits
// for, and nothing else (lazy streams: a missing dependency leaves the work it should have waited
// for undone); whether it got there.
bool RunUntil(CUstream_st* s, uint64_t n) {
  while (s->done < n && !s->queue.empty()) {
    // Dependencies always point at work enqueued earlier, so this recursion ends.
    const std::vector<std::pair<CUstream_st*, uint64_t>> after = s->queue.front().after;
    bool ready = true;
    for (const auto& [t, m] : after) ready &= t->done >= m || RunUntil(t, m);
    Work& w = s->queue.front();
    if (!ready || (w.step && !w.step())) return false;
    s->queue.pop_front();
    ++s->done;
  }
  return s->done >= n;
}

// The host waits until `run` (called with dev_mu held: runs the device, says whether the wait is
// over) returns true. Work that waits for other ranks progresses only on MPI's thread. A wait
// that makes no progress for a minute says so on stderr (a kernel that never ends, or work that
// waits for something never enqueued), then goes on waiting, as CUDA would.
template <typename Run>
void WaitFor(Run run, const char* what) {
  const auto start = std::chrono::steady_clock::now();
  const fp8rt::hostgpu::Settings& settings = fp8rt::hostgpu::settings();
  const bool progress = settings.lazy_streams && settings.lazy_progress_after.count() > 0;
  bool told = false, ran_all = false;
  for (;;) {
    {
      std::lock_guard<std::recursive_mutex> lock(dev_mu);
      if (run()) return;
      if (progress && std::chrono::steady_clock::now() - start > settings.lazy_progress_after) {
        RunDevice();  // Settings::lazy_progress_after
        if (!ran_all) ++lazy_progress_runs;
        ran_all = true;
      }
    }
    if (!told && std::chrono::steady_clock::now() - start > std::chrono::minutes(1)) {
      std::fprintf(stderr, "hostgpu: the host has waited a minute for %s\n", what);
      told = true;
    }
    std::this_thread::sleep_for(std::chrono::microseconds(50));
  }
}

// The host waits for piece n of `s`; `seen`: the clock the wait then orders the host after (null:
// none, where CUDA's call gives the host no such order).
void WaitPiece(CUstream_st* s, uint64_t n, const char* what, const VectorClock* seen) {
  WaitFor(
      [s, n, seen] {
        if (!RunUntil(s, n)) return false;
        if (seen != nullptr) Waited(*seen);
        return true;
      },
      what);
}

// The host waits for everything enqueued on `s` so far.
void WaitStream(CUstream_st* s, const char* what) {
  uint64_t n = 0;
  VectorClock c;
  {
    std::lock_guard<std::recursive_mutex> lock(dev_mu);
    n = s->enqueued;
    c = s->clock;
  }
  WaitPiece(s, n, what, &c);
}

void WaitDevice() {
  WaitFor(
      [] {
        RunDevice();
        bool idle = LegacyStream().queue.empty();
        for (CUstream_st* s : Streams()) idle &= s->queue.empty();
        if (idle) {
          Waited(LegacyStream().clock);
          for (CUstream_st* s : Streams()) Waited(s->clock);
        }
        return idle;
      },
      "the device (a synchronisation)");
}

// A query of `s` up to its n-th piece, whose clock is `c`: runs the device every time (default),
// or with lazy streams every stream_polls-th query, and then only what the query needs.
bool Query(CUstream_st* s, uint64_t n, const VectorClock& c) {
  std::lock_guard<std::recursive_mutex> lock(dev_mu);
  if (!fp8rt::hostgpu::settings().lazy_streams) {
    RunDevice();
  } else if (++query_ticks >= fp8rt::hostgpu::settings().stream_polls) {
    query_ticks = 0;
    RunUntil(s, n);
  }
  if (s->done < n) return false;
  Waited(c);
  return true;
}

// The stream, piece and clock of `event`'s last record ({null, 0}: never recorded).
struct Record {
  CUstream_st* stream = nullptr;
  uint64_t index = 0;
  VectorClock clock;
};
Record LastRecord(cudaEvent_t event) {
  std::lock_guard<std::recursive_mutex> lock(dev_mu);
  return {event->stream, event->index, event->clock};
}

// Whether CUDA work may be enqueued on `s` now: a live stream that no NCCL call still
// ncclInProgress is about to use (`call` is counted as misuse otherwise).
cudaError_t CheckEnqueue(cudaStream_t s, const char* call, CUstream_st** stream) {
  *stream = StreamOf(s);
  if (*stream == nullptr) return Fail(cudaErrorInvalidResourceHandle);
  if (fp8rt::hostgpu::NcclHoldsStream(s, call)) return Fail(cudaErrorInvalidValue);
  return cudaSuccess;
}

// Checks a copy's sides against its kind: the device side in registered memory, the host side not
// in device memory, both within their allocations. `pageable`: a host side in plain host memory.
cudaError_t CheckCopy(void* dst, const void* src, size_t count, cudaMemcpyKind kind, bool* pageable,
                      Kind* dst_kind, Kind* src_kind) {
  *pageable = false;
  if (dst == nullptr || src == nullptr) return Fail(cudaErrorInvalidValue);
  const bool dst_device = kind == cudaMemcpyHostToDevice || kind == cudaMemcpyDeviceToDevice;
  const bool src_device = kind == cudaMemcpyDeviceToHost || kind == cudaMemcpyDeviceToDevice;
  bool dst_inside = true, src_inside = true;
  const Kind d = KindOf(dst, count, &dst_inside), s = KindOf(src, count, &src_inside);
  if (!dst_inside || !src_inside) return Fail(cudaErrorInvalidValue);
  if (kind != cudaMemcpyDefault) {
    auto side_ok = [](Kind k, bool device) {
      return device ? k != kNone : (k != kDevice && k != kPool);
    };
    if (!side_ok(d, dst_device) || !side_ok(s, src_device)) return Fail(cudaErrorInvalidValue);
  }
  *pageable = (kind == cudaMemcpyHostToDevice && s == kNone) ||
              (kind == cudaMemcpyDeviceToHost && d == kNone);
  *dst_kind = d;
  *src_kind = s;
  return cudaSuccess;
}

cudaError_t CheckSet(void* p, size_t count) {
  bool inside = true;
  if (p == nullptr || KindOf(p, count, &inside) == kNone || !inside) {
    return Fail(cudaErrorInvalidValue);
  }
  return cudaSuccess;
}

// A copy on `stream` (cudaStreamLegacy for the synchronous form). The host waits for it when
// `sync`, or when either side is pageable memory, as CUDA's does. The order that gives the host
// is CUDA's ("API synchronization behavior"): after the copy when it ends in host memory, or from
// pinned to device memory synchronously; after the stream's earlier work only, from pageable host
// memory to the device (the call returns once the data is staged); none from device to device.
cudaError_t Copy(void* dst, const void* src, size_t count, cudaMemcpyKind kind, cudaStream_t stream,
                 bool sync, const char* call) {
  CUstream_st* s = nullptr;
  if (const cudaError_t e = CheckEnqueue(stream, call, &s); e != cudaSuccess) return e;
  if (count == 0) return cudaSuccess;
  bool pageable = false;
  Kind d = kNone, k = kNone;
  if (const cudaError_t e = CheckCopy(dst, src, count, kind, &pageable, &d, &k); e != cudaSuccess) {
    return e;
  }
  const bool to_device = d == kDevice || d == kPool;
  const bool from_device = k == kDevice || k == kPool;
  VectorClock before, after;
  {
    std::lock_guard<std::recursive_mutex> lock(dev_mu);
    before = s->clock;
  }
  const uint64_t n = Enqueue(
      s,
      [dst, src, count] {
        std::memmove(dst, src, count);
        return true;
      },
      nullptr,
      Access{.uses = {.reads = {{src, count}}, .writes = {{dst, count}}},
             .frees = nullptr,
             .what = call},
      &after);
  if (sync || pageable) {
    const VectorClock* seen = !to_device     ? &after    // ends in host memory
                              : from_device  ? nullptr   // device to device
                              : k == kPinned ? &after    // pinned to device
                                             : &before;  // pageable to device
    WaitPiece(s, n, sync ? "a synchronous cudaMemcpy" : "a cudaMemcpyAsync of pageable memory",
              seen);
  }
  return cudaSuccess;
}

// A memset on `stream` (cudaStreamLegacy for the synchronous form, which the host waits for).
cudaError_t Set(void* p, int value, size_t count, cudaStream_t stream, bool sync,
                const char* call) {
  CUstream_st* s = nullptr;
  if (const cudaError_t e = CheckEnqueue(stream, call, &s); e != cudaSuccess) return e;
  if (count == 0) return cudaSuccess;
  if (const cudaError_t e = CheckSet(p, count); e != cudaSuccess) return e;
  bool inside = true;
  const bool pinned = KindOf(p, 1, &inside) == kPinned;
  VectorClock after;
  const uint64_t n = Enqueue(
      s,
      [p, value, count] {
        std::memset(p, value, count);
        return true;
      },
      nullptr,
      Access{.uses = {.reads = {}, .writes = {{p, count}}}, .frees = nullptr, .what = call},
      &after);
  // The host waits, but CUDA's cudaMemset orders the host after it only for pinned memory.
  if (sync) WaitPiece(s, n, "a synchronous cudaMemset", pinned ? &after : nullptr);
  return cudaSuccess;
}

}  // namespace

namespace fp8rt::hostgpu {

bool DeviceRange(const void* p, size_t bytes, int* kind) {
  bool inside = true;
  const Kind k = p == nullptr ? kNone : KindOf(p, bytes == 0 ? 1 : bytes, &inside);
  if (kind != nullptr) *kind = k;
  return k != kNone && inside;
}
bool ValidStream(void* stream) { return StreamOf(static_cast<cudaStream_t>(stream)) != nullptr; }
// A stream destroyed after the NCCL call still gets its kernel (cudaStreamDestroy while NCCL
// holds the stream is refused as misuse, so this is a stream destroyed with work queued).
void EnqueueKernel(void* stream, std::function<bool()> step, Uses uses, const char* call) {
  CUstream_st* s = StreamOf(static_cast<cudaStream_t>(stream), /*dead=*/true);
  if (s != nullptr)
    Enqueue(s, std::move(step), nullptr, Access{.uses = std::move(uses), .what = call});
}
void* StreamId(void* stream) { return StreamOf(static_cast<cudaStream_t>(stream), /*dead=*/true); }
int Launch(void* stream, std::function<void()> work, const char* call, Uses uses) {
  CUstream_st* s = nullptr;
  if (const cudaError_t e = CheckEnqueue(static_cast<cudaStream_t>(stream), call, &s);
      e != cudaSuccess) {
    return e;
  }
  Enqueue(
      s,
      [work = std::move(work)] {
        work();
        return true;
      },
      nullptr, Access{.uses = std::move(uses), .what = call});
  return cudaSuccess;
}
int64_t LazyProgressRuns() { return lazy_progress_runs.load(); }
int64_t StreamRaces() { return stream_races.load(); }
std::string FirstStreamRace() {
  std::lock_guard<std::mutex> lock(race_mu);
  return FirstRace();
}
void ResetStreamRaces() {
  std::lock_guard<std::mutex> lock(race_mu);
  stream_races = 0;
  FirstRace().clear();
}
void RunAll() {
  std::lock_guard<std::recursive_mutex> lock(dev_mu);
  RunDevice();
}

}  // namespace fp8rt::hostgpu

namespace fp8rt::kernels::cuda_internal {

cudaError_t MallocFromDevicePool(void** p, size_t bytes, cudaStream_t stream) {
  CUstream_st* s = nullptr;
  if (const cudaError_t e = CheckEnqueue(stream, "MallocFromDevicePool", &s); e != cudaSuccess) {
    return e;
  }
  return Allocate(p, bytes, kPool, s);
}

}  // namespace fp8rt::kernels::cuda_internal

extern "C" {

cudaError_t cudaMalloc(void** p, size_t bytes) { return Allocate(p, bytes, kDevice); }
// Stream-ordered device memory (the CUDA table's allocate_device: its pool on the default stream).
cudaError_t cudaMallocAsync(void** p, size_t bytes, cudaStream_t stream) {
  CUstream_st* s = nullptr;
  if (const cudaError_t e = CheckEnqueue(stream, "cudaMallocAsync", &s); e != cudaSuccess) return e;
  return Allocate(p, bytes, kDevice, s);
}
// cudaFree and cudaFreeHost wait for the device, as CUDA's do.
cudaError_t cudaFree(void* p) {
  if (p == nullptr) return cudaSuccess;
  WaitDevice();
  return Release(p, /*pinned=*/false);
}
cudaError_t cudaMallocHost(void** p, size_t bytes) { return Allocate(p, bytes, kPinned); }
cudaError_t cudaFreeHost(void* p) {
  if (p == nullptr) return cudaSuccess;
  WaitDevice();
  return Release(p, /*pinned=*/true);
}
cudaError_t cudaFreeAsync(void* p, cudaStream_t stream) {
  CUstream_st* s = nullptr;
  if (const cudaError_t e = CheckEnqueue(stream, "cudaFreeAsync", &s); e != cudaSuccess) return e;
  if (p != nullptr) {  // the start of live device memory, as CUDA requires
    Runtime& rt = State();
    std::lock_guard<std::mutex> lock(rt.mu);
    const auto it = rt.allocations.find(static_cast<const char*>(p));
    if (it == rt.allocations.end() || it->second.kind == kPinned) {
      return Fail(cudaErrorInvalidValue);
    }
  }
  Enqueue(
      s,
      [p] {
        (void)Release(p, /*pinned=*/false);
        return true;
      },
      nullptr, Access{.uses = {}, .frees = p, .what = "cudaFreeAsync"});
  return cudaSuccess;
}

cudaError_t cudaMemcpy(void* dst, const void* src, size_t count, cudaMemcpyKind kind) {
  return Copy(dst, src, count, kind, cudaStreamLegacy, /*sync=*/true, "cudaMemcpy");
}
cudaError_t cudaMemcpyAsync(void* dst, const void* src, size_t count, cudaMemcpyKind kind,
                            cudaStream_t stream) {
  return Copy(dst, src, count, kind, stream, /*sync=*/false, "cudaMemcpyAsync");
}
cudaError_t cudaMemset(void* p, int value, size_t count) {
  return Set(p, value, count, cudaStreamLegacy, /*sync=*/true, "cudaMemset");
}
cudaError_t cudaMemsetAsync(void* p, int value, size_t count, cudaStream_t stream) {
  return Set(p, value, count, stream, /*sync=*/false, "cudaMemsetAsync");
}

cudaError_t cudaPointerGetAttributes(cudaPointerAttributes* attributes, const void* p) {
  if (attributes == nullptr) return Fail(cudaErrorInvalidValue);
  *attributes = cudaPointerAttributes{};
  attributes->type = cudaMemoryTypeUnregistered;
  attributes->device = -2;
  attributes->hostPointer = const_cast<void*>(p);
  bool inside = true;
  const Kind k = KindOf(p, 1, &inside);
  if (k != kNone) {
    attributes->type = k == kPinned ? cudaMemoryTypeHost : cudaMemoryTypeDevice;
    attributes->device = 0;
    attributes->devicePointer = const_cast<void*>(p);
    attributes->hostPointer = k == kPinned ? const_cast<void*>(p) : nullptr;
  }
  return cudaSuccess;
}

cudaError_t cudaSetDevice(int device) {
  if (device != 0) return Fail(cudaErrorInvalidDevice);
  current_device = device;
  return cudaSuccess;
}
cudaError_t cudaGetDevice(int* device) {
  if (device == nullptr) return Fail(cudaErrorInvalidValue);
  *device = current_device;
  return cudaSuccess;
}
cudaError_t cudaGetDeviceCount(int* count) {
  if (count == nullptr) return Fail(cudaErrorInvalidValue);
  *count = 1;
  return cudaSuccess;
}
cudaError_t cudaDeviceSynchronize(void) {
  WaitDevice();
  return cudaSuccess;
}

cudaError_t cudaGetLastError(void) {
  const cudaError_t e = last_error;
  last_error = cudaSuccess;
  return e;
}
cudaError_t cudaPeekAtLastError(void) { return last_error; }
const char* cudaGetErrorName(cudaError_t error) {
  switch (error) {
    case cudaSuccess:
      return "cudaSuccess";
    case cudaErrorInvalidValue:
      return "cudaErrorInvalidValue";
    case cudaErrorMemoryAllocation:
      return "cudaErrorMemoryAllocation";
    case cudaErrorInvalidDevice:
      return "cudaErrorInvalidDevice";
    case cudaErrorInvalidResourceHandle:
      return "cudaErrorInvalidResourceHandle";
    case cudaErrorNotReady:
      return "cudaErrorNotReady";
    default:
      return "cudaErrorUnknown";
  }
}
const char* cudaGetErrorString(cudaError_t error) {
  return error == cudaSuccess ? "no error" : "error of the host emulation of CUDA (tests/hostgpu)";
}

cudaError_t cudaStreamCreateWithFlags(cudaStream_t* stream, unsigned int flags) {
  if (stream == nullptr) return Fail(cudaErrorInvalidValue);
  auto* s = new CUstream_st;
  s->flags = flags;
  {
    std::lock_guard<std::recursive_mutex> lock(dev_mu);
    Streams().push_back(s);
    *stream = s;
  }
  fp8rt::hostgpu::StreamCreated(s);  // outside dev_mu: nccl_host.cc's lock comes first
  return cudaSuccess;
}
cudaError_t cudaStreamCreate(cudaStream_t* stream) {
  return cudaStreamCreateWithFlags(stream, cudaStreamDefault);
}
cudaError_t cudaStreamDestroy(cudaStream_t stream) {
  CUstream_st* s = StreamOf(stream);
  if (s == nullptr || s->legacy) return Fail(cudaErrorInvalidResourceHandle);
  if (fp8rt::hostgpu::NcclHoldsStream(stream, "cudaStreamDestroy")) {
    return Fail(cudaErrorInvalidValue);
  }
  std::lock_guard<std::recursive_mutex> lock(dev_mu);
  s->live = false;  // its queued work still runs
  return cudaSuccess;
}
cudaError_t cudaStreamQuery(cudaStream_t stream) {
  CUstream_st* s = StreamOf(stream);
  if (s == nullptr) return Fail(cudaErrorInvalidResourceHandle);
  uint64_t n = 0;
  VectorClock c;
  {
    std::lock_guard<std::recursive_mutex> lock(dev_mu);
    n = s->enqueued;
    c = s->clock;
  }
  return Query(s, n, c) ? cudaSuccess : cudaErrorNotReady;
}
cudaError_t cudaStreamSynchronize(cudaStream_t stream) {
  CUstream_st* s = StreamOf(stream);
  if (s == nullptr) return Fail(cudaErrorInvalidResourceHandle);
  WaitStream(s, "cudaStreamSynchronize");
  return cudaSuccess;
}
cudaError_t cudaStreamWaitEvent(cudaStream_t stream, cudaEvent_t event, unsigned int flags) {
  if (!ValidEvent(event)) return Fail(cudaErrorInvalidResourceHandle);
  if (flags != 0) return Fail(cudaErrorInvalidValue);
  CUstream_st* s = nullptr;
  if (const cudaError_t e = CheckEnqueue(stream, "cudaStreamWaitEvent", &s); e != cudaSuccess) {
    return e;
  }
  std::lock_guard<std::recursive_mutex> lock(dev_mu);
  Enqueue(s, nullptr, event);  // never recorded: no wait
  return cudaSuccess;
}
cudaError_t cudaLaunchHostFunc(cudaStream_t stream, cudaHostFn_t fn, void* data) {
  if (fn == nullptr) return Fail(cudaErrorInvalidValue);
  return static_cast<cudaError_t>(fp8rt::hostgpu::Launch(
      stream, [fn, data] { fn(data); }, "cudaLaunchHostFunc"));
}

cudaError_t cudaEventCreateWithFlags(cudaEvent_t* event, unsigned int flags) {
  if (event == nullptr) return Fail(cudaErrorInvalidValue);
  auto* e = new CUevent_st;
  e->flags = flags;
  Runtime& rt = State();
  std::lock_guard<std::mutex> lock(rt.mu);
  rt.events.insert(e);
  *event = e;
  return cudaSuccess;
}
cudaError_t cudaEventCreate(cudaEvent_t* event) {
  return cudaEventCreateWithFlags(event, cudaEventDefault);
}
cudaError_t cudaEventDestroy(cudaEvent_t event) {
  Runtime& rt = State();
  {
    std::lock_guard<std::mutex> lock(rt.mu);
    if (rt.events.erase(event) == 0) return Fail(cudaErrorInvalidResourceHandle);
  }
  delete event;
  return cudaSuccess;
}
cudaError_t cudaEventRecord(cudaEvent_t event, cudaStream_t stream) {
  if (!ValidEvent(event)) return Fail(cudaErrorInvalidResourceHandle);
  CUstream_st* s = nullptr;
  if (const cudaError_t e = CheckEnqueue(stream, "cudaEventRecord", &s); e != cudaSuccess) {
    return e;
  }
  std::lock_guard<std::recursive_mutex> lock(dev_mu);
  const uint64_t n = Enqueue(s, nullptr);
  event->stream = s;
  event->index = n;
  event->clock = s->clock;
  return cudaSuccess;
}
// An event never recorded is complete, as in CUDA.
cudaError_t cudaEventQuery(cudaEvent_t event) {
  if (!ValidEvent(event)) return Fail(cudaErrorInvalidResourceHandle);
  const Record r = LastRecord(event);
  return r.stream == nullptr || Query(r.stream, r.index, r.clock) ? cudaSuccess : cudaErrorNotReady;
}
cudaError_t cudaEventSynchronize(cudaEvent_t event) {
  if (!ValidEvent(event)) return Fail(cudaErrorInvalidResourceHandle);
  const Record r = LastRecord(event);
  if (r.stream != nullptr) {
    WaitPiece(r.stream, r.index, "cudaEventSynchronize", &r.clock);
  }
  return cudaSuccess;
}

}  // extern "C"
