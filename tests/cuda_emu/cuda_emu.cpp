// The fiber scheduler behind cuda_emu.h: one ucontext fiber per GPU thread, one OS thread per worker,
// blocks handed to workers from a shared counter. A worker runs a block's fibers in schedule order,
// each until it blocks (barrier, collective) or ends; a collective completes when every lane of its
// mask has arrived, a barrier when every thread of the block has. Anything else is a LaunchError.
#include "cuda_emu.h"

#include <sys/mman.h>
#include <ucontext.h>

#include <algorithm>
#include <atomic>
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <mutex>
#include <new>
#include <sstream>
#include <thread>
#include <vector>

#if defined(__SANITIZE_ADDRESS__)
#include <sanitizer/common_interface_defs.h>
#define CUDA_EMU_ASAN 1
#endif

namespace cuda_emu {
namespace {

constexpr size_t kStackBytes = 256 * 1024;  // generous: ASan frames are large
constexpr int kWarpSize = 32;

enum class State { kRunnable, kAtBarrier, kAtCollective, kDone, kFailed };

std::atomic<Schedule> g_schedule{Schedule::kForward};
std::atomic<int> g_workers{0};

thread_local ThreadState* t_current = nullptr;

}  // namespace

struct Fiber {
  ThreadState thread{};
  ucontext_t context{};
  void* stack = nullptr;
  int linear = 0;
  State state = State::kRunnable;
  const char* file = "";  // where it waits (barrier or collective)
  int line = 0;
  const char* op = "";
  unsigned mask = 0;  // the collective's mask, limited to the lanes that exist
  uint64_t payload = 0;
  WarpSnapshot snapshot{};
  void* fake_stack = nullptr;  // ASan's fake stack of this fiber while switched out

  Fiber() {
    stack = mmap(nullptr, kStackBytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    if (stack == MAP_FAILED) throw std::bad_alloc();
  }
  ~Fiber() { munmap(stack, kStackBytes); }
  Fiber(const Fiber&) = delete;
  Fiber& operator=(const Fiber&) = delete;
};

struct Block {
  uint3 block_idx{};
  dim3 block_dim;
  dim3 grid_dim;
  unsigned char* dynamic = nullptr;
  size_t dynamic_bytes = 0;
  std::vector<std::pair<const void*, void*>> statics;
  std::string error;
};

namespace {

struct Worker {
  ucontext_t scheduler{};
  std::vector<std::unique_ptr<Fiber>> fibers;
  const std::function<void()>* body = nullptr;
  Block* block = nullptr;
  Fiber* running = nullptr;
  const void* scheduler_stack = nullptr;  // for ASan's stack-switch annotations
  size_t scheduler_stack_size = 0;
};

thread_local Worker* t_worker = nullptr;

void fiber_to_scheduler(Fiber* f, bool finished) {
  Worker* w = t_worker;
#ifdef CUDA_EMU_ASAN
  __sanitizer_start_switch_fiber(finished ? nullptr : &f->fake_stack, w->scheduler_stack, w->scheduler_stack_size);
#else
  (void)finished;
#endif
  swapcontext(&f->context, &w->scheduler);
#ifdef CUDA_EMU_ASAN
  __sanitizer_finish_switch_fiber(f->fake_stack, &w->scheduler_stack, &w->scheduler_stack_size);
#endif
}

void fiber_main() {
  Worker* w = t_worker;
  Fiber* f = w->running;
#ifdef CUDA_EMU_ASAN
  __sanitizer_finish_switch_fiber(nullptr, &w->scheduler_stack, &w->scheduler_stack_size);
#endif
  try {
    (*w->body)();
    f->state = State::kDone;
  } catch (const std::exception& e) {
    if (w->block->error.empty()) w->block->error = std::string("exception in a kernel thread: ") + e.what();
    f->state = State::kFailed;
  }
  fiber_to_scheduler(f, true);
  std::abort();  // a finished fiber is never resumed
}

void resume(Worker& w, Fiber& f) {
  w.running = &f;
  t_current = &f.thread;
#ifdef CUDA_EMU_ASAN
  void* scheduler_fake_stack = nullptr;
  __sanitizer_start_switch_fiber(&scheduler_fake_stack, f.stack, kStackBytes);
#endif
  swapcontext(&w.scheduler, &f.context);
#ifdef CUDA_EMU_ASAN
  __sanitizer_finish_switch_fiber(scheduler_fake_stack, nullptr, nullptr);
#endif
  t_current = nullptr;
  w.running = nullptr;
}

std::string describe_thread(const Fiber& f) {
  std::ostringstream s;
  s << "thread (" << f.thread.thread_idx.x << "," << f.thread.thread_idx.y << "," << f.thread.thread_idx.z << ")";
  return s.str();
}

std::string describe_place(const Fiber& f) {
  std::ostringstream s;
  switch (f.state) {
    case State::kDone: return "has exited";
    case State::kFailed: return "failed";
    case State::kRunnable: return "is running";
    case State::kAtBarrier: s << "waits at __syncthreads " << f.file << ":" << f.line; break;
    case State::kAtCollective:
      s << "waits at " << f.op << " " << f.file << ":" << f.line << " with mask 0x" << std::hex << f.mask;
      break;
  }
  return s.str();
}

// Threads grouped by where they are: "threads 0-31 wait at ...; threads 32-127 have exited".
std::string describe_threads(const std::vector<Fiber*>& fibers) {
  std::vector<std::pair<std::string, std::vector<int>>> groups;
  for (const Fiber* f : fibers) {
    const std::string place = describe_place(*f);
    auto it = std::find_if(groups.begin(), groups.end(), [&](const auto& g) { return g.first == place; });
    if (it == groups.end()) groups.push_back({place, {f->linear}});
    else it->second.push_back(f->linear);
  }
  std::ostringstream s;
  for (size_t g = 0; g < groups.size(); ++g) {
    if (g > 0) s << "; ";
    s << "threads ";
    const std::vector<int>& ids = groups[g].second;
    for (size_t i = 0; i < ids.size();) {
      size_t j = i;
      while (j + 1 < ids.size() && ids[j + 1] == ids[j] + 1) ++j;
      if (i > 0) s << ",";
      s << ids[i];
      if (j > i) s << "-" << ids[j];
      i = j + 1;
    }
    s << " " << groups[g].first;
  }
  return s.str();
}

std::string block_name(const Block& b) {
  std::ostringstream s;
  s << "block (" << b.block_idx.x << "," << b.block_idx.y << "," << b.block_idx.z << ")";
  return s.str();
}

unsigned existing_lanes(int warp, int num_threads) {
  const int lanes = std::min(kWarpSize, num_threads - warp * kWarpSize);
  return lanes >= 32 ? 0xffffffffu : (1u << lanes) - 1u;
}

// Called when fiber f has just arrived at a collective: completes it when every lane of the mask
// waits at the same collective with the same mask. A lane of the mask that has exited or waits at a
// barrier can never arrive: a divergence. (Lanes elsewhere may still come; if nothing can run any
// more, run_block reports the deadlock.)
void try_complete_collective(Worker& w, Fiber& f) {
  const int warp = f.linear / kWarpSize;
  std::vector<Fiber*> named;
  for (int lane = 0; lane < kWarpSize; ++lane) {
    if (f.mask >> lane & 1u) named.push_back(w.fibers[warp * kWarpSize + lane].get());
  }
  for (Fiber* other : named) {
    if (other->state == State::kDone || other->state == State::kAtBarrier) {
      w.block->error = block_name(*w.block) + ": divergent warp collective (every lane of the mask must reach it): " +
                       describe_threads(named);
      return;
    }
    if (other->state != State::kAtCollective || other->file != f.file || other->line != f.line ||
        other->op != f.op || other->mask != f.mask) {
      return;
    }
  }
  WarpSnapshot snapshot{};
  snapshot.mask = f.mask;
  for (Fiber* other : named) snapshot.payload[other->linear % kWarpSize] = other->payload;
  for (Fiber* other : named) {
    other->snapshot = snapshot;
    other->snapshot.lane = other->linear % kWarpSize;
    other->state = State::kRunnable;
  }
}

// Runs one block to completion; returns "" or the error.
std::string run_block(Worker& w, Block& b, int num_threads, Schedule schedule) {
  while (int(w.fibers.size()) < num_threads) w.fibers.push_back(std::make_unique<Fiber>());
  for (int i = 0; i < num_threads; ++i) {
    Fiber& f = *w.fibers[i];
    f.linear = i;
    f.thread.thread_idx = {unsigned(i) % b.block_dim.x, unsigned(i) / b.block_dim.x % b.block_dim.y,
                           unsigned(i) / (b.block_dim.x * b.block_dim.y)};
    f.thread.block = &b;
    f.thread.fiber = &f;
    f.state = State::kRunnable;
    f.fake_stack = nullptr;
    getcontext(&f.context);
    f.context.uc_stack.ss_sp = f.stack;
    f.context.uc_stack.ss_size = kStackBytes;
    f.context.uc_link = nullptr;
    makecontext(&f.context, fiber_main, 0);
  }
  w.block = &b;
  std::vector<Fiber*> all(num_threads);
  for (int i = 0; i < num_threads; ++i) all[i] = w.fibers[i].get();
  while (true) {
    for (int k = 0; k < num_threads; ++k) {
      Fiber& f = *w.fibers[schedule == Schedule::kForward ? k : num_threads - 1 - k];
      while (f.state == State::kRunnable) {
        resume(w, f);
        if (f.state == State::kAtCollective && b.error.empty()) try_complete_collective(w, f);
        if (!b.error.empty()) return b.error;
      }
    }
    int done = 0, at_collective = 0, runnable = 0;
    for (Fiber* f : all) {
      runnable += f->state == State::kRunnable;
      done += f->state == State::kDone;
      at_collective += f->state == State::kAtCollective;
    }
    if (done == num_threads) return "";
    if (runnable > 0) continue;  // a collective completed late in the pass
    if (at_collective > 0) {
      return block_name(b) + ": divergent warp collective, lanes of a mask wait at different places: " +
             describe_threads(all);
    }
    const Fiber* first = nullptr;
    bool same = done == 0;
    for (Fiber* f : all) {
      if (!first) first = f;
      same = same && f->file == first->file && f->line == first->line;
    }
    if (!same) {
      return block_name(b) + ": divergent __syncthreads (every thread of the block must reach the same barrier): " +
             describe_threads(all);
    }
    for (Fiber* f : all) f->state = State::kRunnable;
  }
}

void run_blocks(dim3 grid, dim3 block_dim, size_t dynamic_smem, const std::function<void()>& body,
                std::atomic<int64_t>& next, int64_t num_blocks, std::mutex& error_mutex, std::string& error) {
  Worker w;
  w.body = &body;
  t_worker = &w;
  const int num_threads = int(block_dim.x * block_dim.y * block_dim.z);
  const Schedule schedule = g_schedule.load();
  for (int64_t id = next++; id < num_blocks; id = next++) {
    Block b;
    b.block_idx = {unsigned(id % grid.x), unsigned(id / grid.x % grid.y), unsigned(id / (int64_t(grid.x) * grid.y))};
    b.block_dim = block_dim;
    b.grid_dim = grid;
    // Exactly the requested size (ASan flags an overrun), poisoned so a read before a write shows.
    b.dynamic_bytes = dynamic_smem;
    b.dynamic = static_cast<unsigned char*>(::operator new(std::max<size_t>(dynamic_smem, 1), std::align_val_t(16)));
    std::memset(b.dynamic, 0xFF, dynamic_smem);
    std::string block_error = run_block(w, b, num_threads, schedule);
    ::operator delete(b.dynamic, std::align_val_t(16));
    for (auto& entry : b.statics) ::operator delete(entry.second, std::align_val_t(16));
    if (!block_error.empty()) {
      const std::lock_guard<std::mutex> lock(error_mutex);
      if (error.empty()) error = block_error;
      next = num_blocks;  // stop the other workers too
      break;
    }
  }
  t_worker = nullptr;
}

// The launch fails with this message (the first one recorded in the block wins).
void record_error(const char* file, int line, const char* what) {
  Fiber* f = t_worker->running;
  Block& b = *t_worker->block;
  if (b.error.empty()) {
    b.error = block_name(b) + " " + describe_thread(*f) + " at " + file + ":" + std::to_string(line) + ": " + what;
  }
}

// Leaves the running fiber for good (the scheduler ends the block on its error).
[[noreturn]] void abandon_fiber() {
  Fiber* f = t_worker->running;
  f->state = State::kFailed;
  fiber_to_scheduler(f, false);
  std::abort();  // a failed fiber is never resumed
}

}  // namespace

void set_schedule(Schedule schedule) { g_schedule = schedule; }
Schedule schedule() { return g_schedule.load(); }
void set_num_workers(int workers) { g_workers = workers; }

ThreadState& current() {
  if (t_current == nullptr) {
    std::fprintf(stderr, "cuda_emu: device code called outside a kernel launch\n");
    std::abort();
  }
  return *t_current;
}
const uint3& block_idx() { return current().block->block_idx; }
const dim3& block_dim() { return current().block->block_dim; }
const dim3& grid_dim() { return current().block->grid_dim; }

unsigned char* dynamic_shared() { return current().block->dynamic; }

void* static_shared(const void* tag, size_t bytes, size_t align) {
  Block& b = *const_cast<Block*>(current().block);
  for (const auto& entry : b.statics) {
    if (entry.first == tag) return entry.second;
  }
  void* p = ::operator new(std::max<size_t>(bytes, 1), std::align_val_t(std::max<size_t>(align, 16)));
  std::memset(p, 0xFF, bytes);
  b.statics.push_back({tag, p});
  return p;
}

void syncthreads(const char* file, int line) {
  Fiber* f = current().fiber;
  f->state = State::kAtBarrier;
  f->file = file;
  f->line = line;
  f->op = "__syncthreads";
  fiber_to_scheduler(f, false);
}

WarpSnapshot warp_collective(const char* file, int line, const char* op, unsigned mask, uint64_t payload) {
  Fiber* f = current().fiber;
  const Block& b = *f->thread.block;
  const int num_threads = int(b.block_dim.x * b.block_dim.y * b.block_dim.z);
  const int lane = f->linear % kWarpSize;
  const unsigned effective = mask & existing_lanes(f->linear / kWarpSize, num_threads);
  if (!(effective >> lane & 1u)) {
    {  // no heap object may stay alive in the frames of a fiber that is abandoned
      std::ostringstream s;
      s << op << " called by lane " << lane << " whose own bit is not in mask 0x" << std::hex << mask;
      record_error(file, line, s.str().c_str());
    }
    abandon_fiber();
  }
  f->state = State::kAtCollective;
  f->file = file;
  f->line = line;
  f->op = op;
  f->mask = effective;
  f->payload = payload;
  fiber_to_scheduler(f, false);
  return f->snapshot;
}

void collective_error(const char* file, int line, const char* what) {
  record_error(file, line, what);
  abandon_fiber();
}

unsigned ballot(const char* file, int line, unsigned mask, bool predicate) {
  const WarpSnapshot s = warp_collective(file, line, "__ballot_sync", mask, predicate ? 1 : 0);
  unsigned bits = 0;
  for (int lane = 0; lane < kWarpSize; ++lane) {
    if ((s.mask >> lane & 1u) && s.payload[lane] != 0) bits |= 1u << lane;
  }
  return bits;
}

bool all(const char* file, int line, unsigned mask, bool predicate) {
  const WarpSnapshot s = warp_collective(file, line, "__all_sync", mask, predicate ? 1 : 0);
  for (int lane = 0; lane < kWarpSize; ++lane) {
    if ((s.mask >> lane & 1u) && s.payload[lane] == 0) return false;
  }
  return true;
}

void syncwarp(const char* file, int line, unsigned mask) { warp_collective(file, line, "__syncwarp", mask, 0); }

void run_grid(dim3 grid, dim3 block, size_t dynamic_smem, const std::function<void()>& body) {
  const int64_t num_blocks = int64_t(grid.x) * grid.y * grid.z;
  const int64_t num_threads = int64_t(block.x) * block.y * block.z;
  if (num_threads < 1 || num_threads > 1024) {
    throw LaunchError("cuda_emu: a block has 1..1024 threads, got " + std::to_string(num_threads));
  }
  if (num_blocks == 0) return;
  int workers = g_workers.load();
  if (workers <= 0) workers = int(std::max(1u, std::thread::hardware_concurrency()));
  workers = int(std::min<int64_t>(workers, num_blocks));
  std::atomic<int64_t> next{0};
  std::mutex error_mutex;
  std::string error;
  if (workers == 1) {
    run_blocks(grid, block, dynamic_smem, body, next, num_blocks, error_mutex, error);
  } else {
    std::vector<std::thread> threads;
    for (int i = 0; i < workers; ++i) {
      threads.emplace_back(
          [&] { run_blocks(grid, block, dynamic_smem, body, next, num_blocks, error_mutex, error); });
    }
    for (std::thread& t : threads) t.join();
  }
  if (!error.empty()) throw LaunchError(error);
}

}  // namespace cuda_emu
