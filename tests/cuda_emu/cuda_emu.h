// pagedkv's CUDA-on-CPU runtime for tests: runs the kernels of csrc/ops/cuda/*.cuh on the CPU. Each GPU
// thread is a fiber (POSIX ucontext) with its own stack; the fibers of a block take turns on one OS
// thread, switching at __syncthreads and at warp collectives (shuffles, ballots, __syncwarp); blocks are
// spread over OS threads. Warps are 32 lanes and a collective meets only the lanes its mask names.
// Checks a GPU would not report: every thread of a block must reach the same barriers (and none may
// exit while others wait), and every lane of a mask the same collective with the same mask; otherwise
// the launch fails with a cuda_emu::LaunchError naming the threads and source lines. Shared memory is
// poisoned (0xFF) at each block start and sized exactly (so ASan sees overruns). Schedule::kReverse
// runs the threads of a block in reverse order between synchronisation points, so a missing barrier
// shows whichever side reads first.
#pragma once

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <functional>
#include <stdexcept>
#include <string>
#include <tuple>
#include <type_traits>
#include <utility>

#define PAGEDKV_CUDA_EMU 1

// ----- CUDA spellings that have no meaning on the CPU
#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __launch_bounds__(...)
#define __align__(n) __attribute__((aligned(n)))
// __shared__ is left undefined on purpose: kernels declare shared memory with PAGEDKV_SHARED* macros.

// ----- vector types (with CUDA's alignment, so a misaligned vector access is undefined here too)
struct uint3 { unsigned x, y, z; };
struct dim3 {
  unsigned x, y, z;
  constexpr dim3(unsigned x_ = 1, unsigned y_ = 1, unsigned z_ = 1) : x(x_), y(y_), z(z_) {}
};
struct alignas(16) uint4 { unsigned x, y, z, w; };
struct alignas(16) int4 { int x, y, z, w; };
struct alignas(16) float4 { float x, y, z, w; };
struct alignas(8) uint2 { unsigned x, y; };
struct alignas(8) int2 { int x, y; };
struct alignas(8) float2 { float x, y; };
inline uint4 make_uint4(unsigned x, unsigned y, unsigned z, unsigned w) { return {x, y, z, w}; }
inline int4 make_int4(int x, int y, int z, int w) { return {x, y, z, w}; }
inline float4 make_float4(float x, float y, float z, float w) { return {x, y, z, w}; }
inline float2 make_float2(float x, float y) { return {x, y}; }

namespace cuda_emu {

// A launch that broke a rule the emulator checks (divergent barrier or collective, a collective naming
// a lane outside its mask, ...). what() names the block, the threads and the source lines.
struct LaunchError : std::runtime_error {
  using std::runtime_error::runtime_error;
};

enum class Schedule { kForward, kReverse };
// The order in which the threads of a block run between synchronisation points (for later launches).
void set_schedule(Schedule schedule);
Schedule schedule();
// OS threads that run blocks (default: the hardware's concurrency).
void set_num_workers(int workers);

struct Block;
struct Fiber;

// The running GPU thread.
struct ThreadState {
  uint3 thread_idx;
  const Block* block;
  Fiber* fiber;
};
ThreadState& current();
const uint3& block_idx();
const dim3& block_dim();
const dim3& grid_dim();

// Shared memory of the current block: the dynamic (extern) buffer of the launch's size, and one
// variable per tag (a static object's address) for static __shared__ declarations.
unsigned char* dynamic_shared();
void* static_shared(const void* tag, size_t bytes, size_t align);

void syncthreads(const char* file, int line);

// Warp collectives: every lane named in mask deposits a 64-bit payload; once all of them have, each
// gets a snapshot of the payloads of its warp (lanes outside the mask read as absent).
struct WarpSnapshot {
  uint64_t payload[32];
  unsigned mask;
  int lane;
};
WarpSnapshot warp_collective(const char* file, int line, const char* op, unsigned mask, uint64_t payload);
[[noreturn]] void collective_error(const char* file, int line, const char* what);

template <typename T>
uint64_t to_payload(T v) {
  static_assert(std::is_trivially_copyable_v<T> && sizeof(T) <= 8, "shuffled values are at most 8 bytes");
  uint64_t bits = 0;
  std::memcpy(&bits, &v, sizeof(T));
  return bits;
}
template <typename T>
T from_payload(uint64_t bits) {
  T v;
  std::memcpy(&v, &bits, sizeof(T));
  return v;
}

// Lane src_lane's value, read by lane `lane` (width-segmented as in CUDA).
template <typename T>
T shuffle_read(const char* file, int line, const WarpSnapshot& s, int src_lane) {
  if (!(s.mask >> src_lane & 1u)) collective_error(file, line, "shuffle reads a lane outside its mask");
  return from_payload<T>(s.payload[src_lane]);
}

template <typename T>
T shfl(const char* file, int line, unsigned mask, T v, int src, int width = 32) {
  const WarpSnapshot s = warp_collective(file, line, "__shfl_sync", mask, to_payload(v));
  const int base = s.lane & ~(width - 1);
  return shuffle_read<T>(file, line, s, base + (src & (width - 1)));
}
template <typename T>
T shfl_up(const char* file, int line, unsigned mask, T v, unsigned delta, int width = 32) {
  const WarpSnapshot s = warp_collective(file, line, "__shfl_up_sync", mask, to_payload(v));
  if (int(s.lane & (width - 1)) < int(delta)) return v;
  return shuffle_read<T>(file, line, s, s.lane - int(delta));
}
template <typename T>
T shfl_down(const char* file, int line, unsigned mask, T v, unsigned delta, int width = 32) {
  const WarpSnapshot s = warp_collective(file, line, "__shfl_down_sync", mask, to_payload(v));
  if (int(s.lane & (width - 1)) + int(delta) >= width) return v;
  return shuffle_read<T>(file, line, s, s.lane + int(delta));
}
template <typename T>
T shfl_xor(const char* file, int line, unsigned mask, T v, int lane_mask, int width = 32) {
  const WarpSnapshot s = warp_collective(file, line, "__shfl_xor_sync", mask, to_payload(v));
  const int src = s.lane ^ lane_mask;
  if ((src & ~(width - 1)) != (s.lane & ~(width - 1))) return v;
  return shuffle_read<T>(file, line, s, src);
}
unsigned ballot(const char* file, int line, unsigned mask, bool predicate);
bool all(const char* file, int line, unsigned mask, bool predicate);
void syncwarp(const char* file, int line, unsigned mask);

// Runs body once per thread of every block of the grid (what kernel<<<grid, block, smem>>> does).
void run_grid(dim3 grid, dim3 block, size_t dynamic_smem, const std::function<void()>& body);

// kernel<<<grid, block, smem>>>(args...): arguments are converted to the kernel's parameter types
// once; each thread calls the kernel with its own copies (parameters are passed by value).
template <typename... Params, typename... Args>
void launch(dim3 grid, dim3 block, size_t dynamic_smem, void (*kernel)(Params...), Args&&... args) {
  static_assert(sizeof...(Params) == sizeof...(Args), "wrong number of kernel arguments");
  const std::tuple<std::decay_t<Params>...> params(std::forward<Args>(args)...);
  run_grid(grid, block, dynamic_smem, [&] { std::apply(kernel, params); });
}

}  // namespace cuda_emu

#define threadIdx (static_cast<const uint3&>(::cuda_emu::current().thread_idx))
#define blockIdx (::cuda_emu::block_idx())
#define blockDim (::cuda_emu::block_dim())
#define gridDim (::cuda_emu::grid_dim())
#define __syncthreads() ::cuda_emu::syncthreads(__FILE__, __LINE__)
#define __syncwarp(mask) ::cuda_emu::syncwarp(__FILE__, __LINE__, (mask))
#define __shfl_sync(...) ::cuda_emu::shfl(__FILE__, __LINE__, __VA_ARGS__)
#define __shfl_up_sync(...) ::cuda_emu::shfl_up(__FILE__, __LINE__, __VA_ARGS__)
#define __shfl_down_sync(...) ::cuda_emu::shfl_down(__FILE__, __LINE__, __VA_ARGS__)
#define __shfl_xor_sync(...) ::cuda_emu::shfl_xor(__FILE__, __LINE__, __VA_ARGS__)
#define __ballot_sync(mask, predicate) ::cuda_emu::ballot(__FILE__, __LINE__, (mask), (predicate))
#define __any_sync(mask, predicate) (::cuda_emu::ballot(__FILE__, __LINE__, (mask), (predicate)) != 0u)
#define __all_sync(mask, predicate) ::cuda_emu::all(__FILE__, __LINE__, (mask), (predicate))

// ----- device functions
template <typename T>
inline T __ldg(const T* p) { return *p; }

// Atomics: real ones, since blocks run on several OS threads.
inline int atomicAdd(int* p, int v) { return __atomic_fetch_add(p, v, __ATOMIC_SEQ_CST); }
inline unsigned atomicAdd(unsigned* p, unsigned v) { return __atomic_fetch_add(p, v, __ATOMIC_SEQ_CST); }
inline unsigned long long atomicAdd(unsigned long long* p, unsigned long long v) {
  return __atomic_fetch_add(p, v, __ATOMIC_SEQ_CST);
}
inline float atomicAdd(float* p, float v) {
  float old, desired;
  __atomic_load(p, &old, __ATOMIC_SEQ_CST);
  do {
    desired = old + v;
  } while (!__atomic_compare_exchange(p, &old, &desired, false, __ATOMIC_SEQ_CST, __ATOMIC_SEQ_CST));
  return old;
}
template <typename T>
inline T atomic_cas_impl(T* p, T compare, T value) {
  __atomic_compare_exchange_n(p, &compare, value, false, __ATOMIC_SEQ_CST, __ATOMIC_SEQ_CST);
  return compare;  // the old value either way
}
inline int atomicCAS(int* p, int compare, int value) { return atomic_cas_impl(p, compare, value); }
inline unsigned atomicCAS(unsigned* p, unsigned compare, unsigned value) { return atomic_cas_impl(p, compare, value); }
inline unsigned long long atomicCAS(unsigned long long* p, unsigned long long compare, unsigned long long value) {
  return atomic_cas_impl(p, compare, value);
}
inline int atomicExch(int* p, int v) { return __atomic_exchange_n(p, v, __ATOMIC_SEQ_CST); }
inline unsigned atomicExch(unsigned* p, unsigned v) { return __atomic_exchange_n(p, v, __ATOMIC_SEQ_CST); }
inline int atomicMax(int* p, int v) {
  int old = __atomic_load_n(p, __ATOMIC_SEQ_CST);
  while (old < v && !__atomic_compare_exchange_n(p, &old, v, false, __ATOMIC_SEQ_CST, __ATOMIC_SEQ_CST)) {
  }
  return old;
}
inline int atomicMin(int* p, int v) {
  int old = __atomic_load_n(p, __ATOMIC_SEQ_CST);
  while (old > v && !__atomic_compare_exchange_n(p, &old, v, false, __ATOMIC_SEQ_CST, __ATOMIC_SEQ_CST)) {
  }
  return old;
}

// CUDA's overloaded min/max for device code.
inline int min(int a, int b) { return a < b ? a : b; }
inline int max(int a, int b) { return a > b ? a : b; }
inline unsigned min(unsigned a, unsigned b) { return a < b ? a : b; }
inline unsigned max(unsigned a, unsigned b) { return a > b ? a : b; }
inline long long min(long long a, long long b) { return a < b ? a : b; }
inline long long max(long long a, long long b) { return a > b ? a : b; }
inline long min(long a, long b) { return a < b ? a : b; }
inline long max(long a, long b) { return a > b ? a : b; }
inline float min(float a, float b) { return fminf(a, b); }
inline float max(float a, float b) { return fmaxf(a, b); }
