// The block emulator of host_cuda.h: each CUDA thread of a block a fiber on the launching thread.
#include "tests/gpu/host_cuda.h"

#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <map>
#include <mutex>
#include <new>
#include <span>
#include <vector>

#if defined(__SANITIZE_ADDRESS__)
#include <sanitizer/asan_interface.h>
#include <sanitizer/common_interface_defs.h>
#define FP8RT_HOST_CUDA_ASAN 1
#endif

#if !defined(__x86_64__)
#error "tests/gpu/host_cuda.cc switches fibers with x86-64 code"
#endif

// fp8rt_host_cuda_switch(save, load): saves the callee-saved registers, MXCSR and the x87
// control word on the current stack, stores the stack pointer in *save, and resumes the context
// whose stack pointer is `load` (saved the same way, or prepared by Prepare below). No signal
// mask is saved: no system call per switch, unlike swapcontext.
extern "C" void fp8rt_host_cuda_switch(void** save, void* load);
asm(R"(
  .text
  .globl fp8rt_host_cuda_switch
  .type fp8rt_host_cuda_switch, @function
fp8rt_host_cuda_switch:
  pushq %rbp
  pushq %rbx
  pushq %r12
  pushq %r13
  pushq %r14
  pushq %r15
  subq $8, %rsp
  stmxcsr (%rsp)
  fnstcw 4(%rsp)
  movq %rsp, (%rdi)
  movq %rsi, %rsp
  ldmxcsr (%rsp)
  fldcw 4(%rsp)
  addq $8, %rsp
  popq %r15
  popq %r14
  popq %r13
  popq %r12
  popq %rbx
  popq %rbp
  ret
  .size fp8rt_host_cuda_switch, .-fp8rt_host_cuda_switch
  .section .note.GNU-stack,"",@progbits
  .text
)");

namespace fp8rt::host_cuda {
namespace {

constexpr size_t kStackBytes = size_t{512} << 10;
constexpr int kMaxThreads = 1024;
constexpr int64_t kMaxBlocks = int64_t{1} << 24;  // blocks a launch: what a run could take
constexpr int kDefaultSharedLimit = 48 << 10;
constexpr int kSharedOptin = 227 << 10;  // sm_90: 232,448 bytes

enum class Wait { kNone, kBlock, kWarp };

struct Fiber {
  void* sp = nullptr;
  unsigned char* stack = nullptr;  // kStackBytes above a guard page
  bool finished = false;
  Wait wait = Wait::kNone;
  const char* what = "";  // the warp operation it waits at
  unsigned mask = 0;
  uint64_t bits = 0;
  int src = 0;
  uint64_t result = 0;
  Builtins builtins;
#ifdef FP8RT_HOST_CUDA_ASAN
  void* fake_stack = nullptr;
#endif
};

struct State {
  std::mutex launch_mu;     // one launch at a time
  std::vector<Fiber> pool;  // never shrinks: each fiber keeps its stack for later launches
  std::span<Fiber> fibers;  // the running block's threads: the first of the pool
  int current = -1;         // the running fiber, -1: the scheduler
  void* scheduler_sp = nullptr;
  const std::function<void()>* body = nullptr;
  unsigned char* smem = nullptr;
  std::string error;                   // of the running launch
  std::string last_error;              // TakeLaunchError's
  std::map<const void*, int> allowed;  // SetMaxDynamicSharedMemory
  // Every static shared variable a thread has declared (StaticShared), filled before each block.
  std::vector<std::pair<unsigned char*, size_t>> statics;
  Stats stats;
  uint64_t seed = 0x9E3779B97F4A7C15ULL;
  uint64_t rng = 0;  // the running launch's schedule
#ifdef FP8RT_HOST_CUDA_ASAN
  const void* scheduler_stack_bottom = nullptr;
  size_t scheduler_stack_size = 0;
#endif
};
State& S() {
  static State* state = new State;  // never destroyed: fibers' stacks stay mapped to the end
  return *state;
}

const Builtins kOutside{};

// --- switching ---------------------------------------------------------------------------------

#ifdef FP8RT_HOST_CUDA_ASAN
// AddressSanitizer's fiber annotations around every switch (its stack bounds and fake stacks).
void StartSwitch(void** fake_save, const void* bottom, size_t size) {
  __sanitizer_start_switch_fiber(fake_save, bottom, size);
}
void FinishSwitch(void* fake, bool record_from) {
  State& s = S();
  if (record_from) {
    __sanitizer_finish_switch_fiber(fake, &s.scheduler_stack_bottom, &s.scheduler_stack_size);
  } else {
    __sanitizer_finish_switch_fiber(fake, nullptr, nullptr);
  }
}
#endif

// From the running fiber back to the scheduler; returns when the scheduler resumes it. A fiber
// that finished never resumes.
void Yield() {
  State& s = S();
  Fiber& f = s.fibers[static_cast<size_t>(s.current)];
#ifdef FP8RT_HOST_CUDA_ASAN
  StartSwitch(f.finished ? nullptr : &f.fake_stack, s.scheduler_stack_bottom,
              s.scheduler_stack_size);
  fp8rt_host_cuda_switch(&f.sp, s.scheduler_sp);
  FinishSwitch(f.fake_stack, /*record_from=*/true);
#else
  fp8rt_host_cuda_switch(&f.sp, s.scheduler_sp);
#endif
}

[[noreturn]] void FiberMain() {
#ifdef FP8RT_HOST_CUDA_ASAN
  FinishSwitch(nullptr, /*record_from=*/true);
#endif
  State& s = S();
  (*s.body)();
  s.fibers[static_cast<size_t>(s.current)].finished = true;
  Yield();
  std::fputs("host_cuda: a finished fiber resumed\n", stderr);
  std::abort();
}

void Resume(int i) {
  State& s = S();
  Fiber& f = s.fibers[static_cast<size_t>(i)];
  s.current = i;
#ifdef FP8RT_HOST_CUDA_ASAN
  void* fake = nullptr;
  StartSwitch(&fake, f.stack, kStackBytes);
  fp8rt_host_cuda_switch(&s.scheduler_sp, f.sp);
  FinishSwitch(fake, /*record_from=*/false);
#else
  fp8rt_host_cuda_switch(&s.scheduler_sp, f.sp);
#endif
  s.current = -1;
}

// A fresh context on f's stack whose first resumption enters FiberMain (the frame
// fp8rt_host_cuda_switch pops: MXCSR and control word, six registers, the return address).
void Prepare(Fiber& f) {
  if (f.stack == nullptr) {
    const size_t page = static_cast<size_t>(sysconf(_SC_PAGESIZE));
    void* m = mmap(nullptr, kStackBytes + page, PROT_READ | PROT_WRITE,
                   MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    if (m == MAP_FAILED) {
      std::perror("host_cuda: mmap of a fiber stack");
      std::abort();
    }
    mprotect(m, page, PROT_NONE);  // a guard page below the stack: an overflow faults
    f.stack = static_cast<unsigned char*>(m) + page;
  }
#ifdef FP8RT_HOST_CUDA_ASAN
  // The frames of a fiber abandoned mid-kernel (a launch that could not progress) stay poisoned;
  // a fiber that returned left only FiberMain's, which the next FiberMain lays out again.
  if (!f.finished) __asan_unpoison_memory_region(f.stack, kStackBytes);
  f.fake_stack = nullptr;
#endif
  auto top = reinterpret_cast<uintptr_t>(f.stack + kStackBytes) & ~uintptr_t{15};
  auto* slot = reinterpret_cast<uint64_t*>(top - 16);  // 16-byte aligned: FiberMain's entry
  slot[1] = 0;                                         // its (never used) return address
  slot[0] = reinterpret_cast<uint64_t>(&FiberMain);
  for (int r = 1; r <= 6; ++r) slot[-r] = 0;  // rbp, rbx, r12 .. r15
  auto* control = reinterpret_cast<uint32_t*>(slot - 7);
  control[0] = 0x1F80;  // MXCSR: round to nearest, exceptions masked
  control[1] = 0x037F;  // x87 control word: the default
  f.sp = slot - 7;
  f.finished = false;
  f.wait = Wait::kNone;
}

// --- barriers ----------------------------------------------------------------------------------

std::string Describe(const Fiber& f) {
  const uint3 t = f.builtins.thread_idx;
  std::string who = "thread (" + std::to_string(t.x) + ", " + std::to_string(t.y) + ", " +
                    std::to_string(t.z) + ")";
  if (f.finished) return who + " has returned";
  if (f.wait == Wait::kBlock) return who + " waits at __syncthreads";
  char mask[16];
  std::snprintf(mask, sizeof(mask), "%08x", f.mask);
  return who + " waits at " + f.what + " (mask 0x" + mask + ")";
}

// A permutation of 0 .. n - 1 from the schedule's generator (xorshift64*, seeded per launch).
std::vector<int> Shuffled(int n) {
  State& s = S();
  std::vector<int> order(static_cast<size_t>(n));
  for (int i = 0; i < n; ++i) order[static_cast<size_t>(i)] = i;
  for (int i = n - 1; i > 0; --i) {
    s.rng ^= s.rng >> 12;
    s.rng ^= s.rng << 25;
    s.rng ^= s.rng >> 27;
    const uint64_t r = s.rng * 0x2545F4914F6CDD1DULL;
    std::swap(order[static_cast<size_t>(i)], order[static_cast<size_t>(r % (uint64_t{0} + i + 1))]);
  }
  return order;
}

// Releases warp w's operations whose lanes have all arrived; whether any was.
bool ReleaseWarp(int w) {
  State& s = S();
  const int n = static_cast<int>(s.fibers.size());
  const int first = w * 32, last = std::min(n, first + 32);
  bool released = false;
  for (int i = first; i < last; ++i) {
    const Fiber& f = s.fibers[static_cast<size_t>(i)];
    if (f.finished || f.wait != Wait::kWarp) continue;
    // Every lane of f's mask waits at the same operation with the same mask.
    bool ready = true;
    for (int lane = 0; lane < 32 && ready; ++lane) {
      if ((f.mask >> lane & 1u) == 0) continue;
      const int j = first + lane;
      ready = j < last && !s.fibers[static_cast<size_t>(j)].finished &&
              s.fibers[static_cast<size_t>(j)].wait == Wait::kWarp &&
              s.fibers[static_cast<size_t>(j)].mask == f.mask &&
              std::strcmp(s.fibers[static_cast<size_t>(j)].what, f.what) == 0;
    }
    if (!ready) continue;
    for (int lane = 0; lane < 32; ++lane) {
      if ((f.mask >> lane & 1u) == 0) continue;
      Fiber& g = s.fibers[static_cast<size_t>(first + lane)];
      const int src = first + g.src;
      g.result = src < last ? s.fibers[static_cast<size_t>(src)].bits : g.bits;
      g.wait = Wait::kNone;
    }
    ++s.stats.warp_collectives;
    released = true;
  }
  return released;
}

// Runs warp w until each of its threads has returned or waits at __syncthreads, or the warp
// can go no further (a warp operation that not all of its lanes reach). Its lanes resume in a
// new random order after every release.
void RunWarp(int w, int64_t* live) {
  State& s = S();
  const int n = static_cast<int>(s.fibers.size());
  const int first = w * 32, lanes = std::min(n, first + 32) - first;
  for (;;) {
    bool ran = false;
    for (const int lane : Shuffled(lanes)) {
      Fiber& f = s.fibers[static_cast<size_t>(first + lane)];
      if (f.finished || f.wait != Wait::kNone) continue;
      Resume(first + lane);
      ran = true;
      if (f.finished) --*live;
    }
    if (!ran && !ReleaseWarp(w)) return;
  }
}

// Releases the block barrier when every thread that has not returned waits there; false (with
// s.error saying what each thread waits for) when some wait elsewhere.
bool ReleaseBlock() {
  State& s = S();
  bool all_at_block = true;
  for (const Fiber& f : s.fibers) all_at_block &= f.finished || f.wait == Wait::kBlock;
  if (all_at_block) {
    for (Fiber& f : s.fibers) f.wait = Wait::kNone;
    ++s.stats.block_barriers;
    return true;
  }
  const uint3 b = s.fibers[0].builtins.block_idx;
  s.error = "block (" + std::to_string(b.x) + ", " + std::to_string(b.y) + ", " +
            std::to_string(b.z) + ") can no longer progress:";
  int told = 0;
  for (const Fiber& f : s.fibers) {
    if (f.finished) continue;
    if (++told > 8) {
      s.error += " ...";
      break;
    }
    s.error += " " + Describe(f) + ";";
  }
  return false;
}

Fiber& Running(const char* what) {
  State& s = S();
  if (s.current < 0) {
    std::fprintf(stderr, "host_cuda: %s outside a kernel\n", what);
    std::abort();
  }
  return s.fibers[static_cast<size_t>(s.current)];
}

}  // namespace

const Builtins& Current() {
  State& s = S();
  return s.current < 0 ? kOutside : s.fibers[static_cast<size_t>(s.current)].builtins;
}

int Lane() { return S().current < 0 ? 0 : S().current % 32; }

void SyncThreads() {
  Fiber& f = Running("__syncthreads");
  f.wait = Wait::kBlock;
  Yield();
}

uint64_t WarpCollective(const char* what, unsigned mask, uint64_t bits, int src_lane) {
  Fiber& f = Running(what);
  if ((mask >> Lane() & 1u) == 0) {
    std::fprintf(stderr, "host_cuda: %s by lane %d, which its mask 0x%08x leaves out\n", what,
                 Lane(), mask);
    std::abort();
  }
  f.wait = Wait::kWarp;
  f.what = what;
  f.mask = mask;
  f.bits = bits;
  f.src = src_lane;
  Yield();
  return f.result;
}

void CheckWidth(int width) {
  if (width != 32) {
    std::fprintf(stderr, "host_cuda: shuffle width %d (only 32 is emulated)\n", width);
    std::abort();
  }
}

unsigned char* DynamicShared() {
  Running("dynamic shared memory");
  return S().smem;
}

void StaticShared(void* p, size_t bytes) {
  Running("static shared memory");
  State& s = S();
  auto* const at = static_cast<unsigned char*>(p);
  for (const auto& [q, n] : s.statics) {
    if (q == at) return;
  }
  std::memset(at, 0xFF, bytes);
  s.statics.emplace_back(at, bytes);
}

void SetMaxDynamicSharedMemory(const void* kernel, int bytes) {
  std::lock_guard<std::mutex> lock(S().launch_mu);
  S().allowed[kernel] = bytes;
}

std::string RunGrid(const void* kernel, dim3 grid, dim3 block, size_t dynamic_bytes,
                    const std::function<void()>& body) {
  State& s = S();
  std::lock_guard<std::mutex> lock(s.launch_mu);
  ++s.stats.launches;
  s.error.clear();
  s.rng = (s.seed ^ (0xD1B54A32D192ED03ULL * static_cast<uint64_t>(s.stats.launches))) | 1;
  const int64_t threads = int64_t{block.x} * block.y * block.z;
  const int64_t total_blocks = int64_t{grid.x} * grid.y * grid.z;
  const auto allowed_it = s.allowed.find(kernel);
  const int allowed = allowed_it == s.allowed.end() ? kDefaultSharedLimit : allowed_it->second;
  if (threads < 1 || threads > kMaxThreads) {
    s.error = "invalid configuration: " + std::to_string(threads) + " threads per block";
  } else if (total_blocks < 1) {
    s.error = "invalid configuration: an empty grid";
  } else if (total_blocks > kMaxBlocks) {
    s.error = "a grid of " + std::to_string(total_blocks) + " blocks, over the emulator's " +
              std::to_string(kMaxBlocks);
  } else if (dynamic_bytes > static_cast<size_t>(kSharedOptin)) {
    s.error = std::to_string(dynamic_bytes) + " bytes of dynamic shared memory, over sm_90's " +
              std::to_string(kSharedOptin);
  } else if (dynamic_bytes > static_cast<size_t>(allowed)) {
    s.error = std::to_string(dynamic_bytes) +
              " bytes of dynamic shared memory, over the kernel's limit of " +
              std::to_string(allowed) + " (cudaFuncSetAttribute first)";
  }
  if (!s.error.empty()) {
    if (s.last_error.empty()) s.last_error = "launch refused: " + s.error;
    return s.error;
  }
  if (s.pool.size() < static_cast<size_t>(threads)) s.pool.resize(static_cast<size_t>(threads));
  s.fibers = std::span<Fiber>(s.pool.data(), static_cast<size_t>(threads));
  s.body = &body;
  void* smem = ::operator new (std::max<size_t>(dynamic_bytes, 1), std::align_val_t{128});
  s.smem = static_cast<unsigned char*>(smem);
  // The blocks one at a time, in a random order: a GPU runs them at once and in no set order, so
  // a kernel whose block reads what another block of the launch writes (without an atomic) gives
  // other bits under another schedule.
  const std::vector<int> blocks = Shuffled(static_cast<int>(total_blocks));
  for (size_t next = 0; next < blocks.size() && s.error.empty(); ++next) {
    const auto b = static_cast<unsigned>(blocks[next]);
    const unsigned bx = b % grid.x, by = b / grid.x % grid.y, bz = b / (grid.x * grid.y);
    ++s.stats.blocks;
    std::memset(s.smem, 0xFF, dynamic_bytes);
    for (const auto& [p, n] : s.statics) std::memset(p, 0xFF, n);
    for (int i = 0; i < threads; ++i) {
      Fiber& f = s.fibers[static_cast<size_t>(i)];
      Prepare(f);
      f.builtins.thread_idx = {static_cast<unsigned>(i) % block.x,
                               static_cast<unsigned>(i) / block.x % block.y,
                               static_cast<unsigned>(i) / (block.x * block.y)};
      f.builtins.block_idx = {bx, by, bz};
      f.builtins.block_dim = block;
      f.builtins.grid_dim = grid;
    }
    // The warps one at a time, each as far as it can go, in a new random order after every
    // __syncthreads.
    int64_t live = threads;
    const int warps = static_cast<int>((threads + 31) / 32);
    while (live > 0) {
      for (const int w : Shuffled(warps)) RunWarp(w, &live);
      if (live > 0 && !ReleaseBlock()) break;
    }
  }
  ::operator delete (smem, std::align_val_t{128});
  s.smem = nullptr;
  s.body = nullptr;
  if (!s.error.empty() && s.last_error.empty()) s.last_error = s.error;
  return s.error;
}

void SetScheduleSeed(uint64_t seed) {
  std::lock_guard<std::mutex> lock(S().launch_mu);
  S().seed = seed;
}

std::string TakeLaunchError() {
  std::lock_guard<std::mutex> lock(S().launch_mu);
  std::string e;
  e.swap(S().last_error);
  return e;
}

Stats stats() {
  std::lock_guard<std::mutex> lock(S().launch_mu);
  return S().stats;
}

}  // namespace fp8rt::host_cuda

namespace nvcuda::wmma::internal {

void CheckTile(const char* what, const void* p, unsigned ldm, size_t element_bytes) {
  if (reinterpret_cast<uintptr_t>(p) % 32 != 0 || (ldm * element_bytes) % 16 != 0) {
    std::fprintf(stderr,
                 "host_cuda: %s at %p with leading dimension %u: the pointer must be 32-byte "
                 "aligned and the leading dimension a multiple of 16 bytes\n",
                 what, p, ldm);
    std::abort();
  }
}

int OwnLane() { return ::fp8rt::host_cuda::Lane(); }

}  // namespace nvcuda::wmma::internal
