"""CPU threads of the engine on a machine it may share with other processes.

torch's CPU ops (its own kernels, MKL, oneDNN and pagedkv's at::parallel_for) run on GNU OpenMP, whose
idle threads spin before they sleep. Measured with benchmarks/bench_engine.py --contention 1 on a 2-core
machine (engine tok/s, quiet / beside one busy process): 2 threads with libgomp's default policy
3932 / 131; OMP_WAIT_POLICY=PASSIVE 2544 / 2133; 1 thread 2357 / 2305. Spinning threads are fast alone
and collapse when a core is taken; passive threads survive but cost a third when alone. So the engine
keeps the default policy and runs with the CPUs other processes leave free (ThreadTuner).
"""
import os


def available_cpus() -> int:
    """CPUs this process may use: its affinity mask, capped by a cgroup v2 CPU quota (containers)."""
    try:
        count = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        count = os.cpu_count() or 1
    try:
        with open("/sys/fs/cgroup/cpu.max") as f:
            quota, period = f.read().split()[:2]
        if quota != "max":
            count = min(count, max(1, int(quota) // int(period)))
    except (OSError, ValueError):
        pass
    return count


class ThreadTuner:
    """Chooses the CPU thread count of each engine step from how many CPUs other processes are using.

    Spinning OpenMP threads make 2 threads ~1.6x faster than 1 on a quiet 2-core machine, and ~30x
    slower than 1 when another process holds a core (every parallel region waits for a descheduled
    thread). So before each step the engine reads the number of runnable threads of the whole machine
    (`procs_running` in /proc/stat), subtracts its own runnable threads (/proc/self/task: the caller and
    any OpenMP worker still spinning), smooths that count of other runnable threads over steps, and runs with the CPUs left
    (at least one, at most `threads`). Where /proc/stat is missing it keeps `threads`.
    """

    def __init__(self, threads: int, smoothing: float = 0.6, stat_path: str = "/proc/stat"):
        self.max_threads = threads
        self.cpus = min(threads, available_cpus())
        self.smoothing = smoothing
        self.stat_path = stat_path
        self.others = 0.0                     # smoothed count of other runnable threads
        self.current = threads
        self.enabled = threads > 1 and os.path.exists(stat_path)

    @property
    def threads(self) -> int:
        """The thread count the next step runs with (reads /proc/stat)."""
        if not self.enabled:
            return self.max_threads
        running = _procs_running(self.stat_path)
        if running is not None:
            others = max(0, running - _own_running_threads())
            self.others += self.smoothing * (others - self.others)
            self.current = max(1, min(self.max_threads, self.cpus - round(self.others)))
        return self.current


def _procs_running(path: str) -> int | None:
    try:
        with open(path, "rb") as f:
            for line in f:
                if line.startswith(b"procs_running"):
                    return int(line.split()[1])
    except (OSError, ValueError, IndexError):
        pass
    return None



def _own_running_threads() -> int:
    """This process's threads in state R (running or runnable); at least 1, the caller."""
    count = 0
    try:
        for task in os.listdir("/proc/self/task"):
            try:
                with open(f"/proc/self/task/{task}/stat", "rb") as f:
                    if f.read().rsplit(b")", 1)[1].split()[0] == b"R":
                        count += 1
            except (OSError, IndexError):
                continue
    except OSError:
        pass
    return max(count, 1)
