// The block manager's statistics, listed once. The stats struct, take_step_stats() and the Python dict of
// stats() are all generated from PAGEDKV_BLOCK_MANAGER_STATS, in its order, so a new statistic is one
// line here. The Python stub's _Stats TypedDict (pagedkv/_C.pyi) is checked against this list, keys, types
// and order, by tests/test_stubs.py.
#pragma once
#include <cstdint>

// COUNTER(name): an int64 that accumulates from construction (take_step_stats gives its change since the
// previous call). GAUGE(type, name): a current value. RATIO(name, num, den): num / den of two counters,
// 0.0 while den is 0 (the Python dict only).
#define PAGEDKV_BLOCK_MANAGER_STATS(COUNTER, GAUGE, RATIO)                                          \
  COUNTER(queries)                  /* prompt tokens looked up in the prefix cache */              \
  COUNTER(hits)                     /* of those, tokens whose KV was already cached */             \
  RATIO(hit_rate, hits, queries)                                                                    \
  COUNTER(query_blocks)             /* prompt blocks looked up, every group's entries */           \
  COUNTER(hit_blocks)               /* of those, blocks hit ... */                                 \
  COUNTER(hit_blocks_in_use)        /* ... that another sequence was using */                      \
  COUNTER(hit_blocks_revived)       /* ... taken back from the free list */                        \
  COUNTER(events_dropped)           /* KV events lost to a full buffer */                          \
  COUNTER(evictions)                /* cached blocks reused for other content */                   \
  COUNTER(cow_copies)               /* copy-on-write block copies queued */                        \
  COUNTER(swapped_out_blocks)                                                                       \
  COUNTER(swapped_in_blocks)                                                                        \
  COUNTER(host_hit_blocks)          /* hit blocks served from the host tier (loaded) */            \
  COUNTER(offloaded_blocks)         /* device blocks copied to the host tier (confirmed) */        \
  COUNTER(offload_failures)         /* offloads the runner reported failed */                      \
  COUNTER(loaded_blocks)            /* host slots copied back to the device (confirmed) */         \
  COUNTER(load_failures)            /* loads the runner reported failed */                         \
  COUNTER(host_evictions)           /* host slots reused for other content */                      \
  COUNTER(disk_hit_blocks)          /* blocks prefetch queued to read from the disk tier */        \
  COUNTER(disk_writes)              /* host slots written to the disk tier (confirmed) */          \
  COUNTER(disk_write_failures)      /* disk writes the runner reported failed */                   \
  COUNTER(disk_reads)               /* disk records read into host slots (confirmed) */            \
  COUNTER(disk_read_failures)       /* disk reads the runner reported failed (entry dropped) */    \
  COUNTER(disk_evictions)           /* disk records reused for other content */                    \
  GAUGE(int32_t, num_blocks)                                                                        \
  GAUGE(int32_t, used_blocks)       /* GPU blocks referenced by a sequence or a pin */             \
  GAUGE(int32_t, free_blocks)                                                                       \
  GAUGE(int32_t, cached_blocks)     /* GPU blocks registered in the prefix cache (used or free) */ \
  GAUGE(int32_t, cached_free_blocks) /* free blocks that still hold reusable cached KV */          \
  GAUGE(int32_t, num_seqs)                                                                          \
  GAUGE(int32_t, num_swapped_seqs)                                                                  \
  GAUGE(int32_t, num_cpu_blocks)                                                                    \
  GAUGE(int32_t, free_cpu_blocks)                                                                   \
  GAUGE(int32_t, pinned_blocks)     /* GPU blocks held by pins */                                  \
  GAUGE(int32_t, num_host_blocks)   /* host tier slots */                                          \
  GAUGE(int32_t, free_host_blocks)                                                                  \
  GAUGE(int32_t, cached_host_blocks) /* host slots registered in the prefix cache */                \
  GAUGE(int32_t, num_disk_blocks)   /* disk tier records */                                        \
  GAUGE(int32_t, free_disk_blocks)                                                                  \
  GAUGE(int32_t, used_disk_blocks)  /* disk records held by pending writes and reads */            \
  GAUGE(int32_t, cached_disk_blocks) /* disk records registered in the prefix cache */

namespace pagedkv {

struct BlockManagerStats {
#define PAGEDKV_COUNTER_FIELD(name) int64_t name = 0;
#define PAGEDKV_GAUGE_FIELD(type, name) type name = 0;
#define PAGEDKV_NO_FIELD(name, num, den)
  PAGEDKV_BLOCK_MANAGER_STATS(PAGEDKV_COUNTER_FIELD, PAGEDKV_GAUGE_FIELD, PAGEDKV_NO_FIELD)
#undef PAGEDKV_COUNTER_FIELD
#undef PAGEDKV_GAUGE_FIELD
#undef PAGEDKV_NO_FIELD
};

}  // namespace pagedkv
