"""Type stub of pagedkv._C, the native module: the block manager (csrc/core, bound in csrc/bindings.cpp),
block hashing, and the build's facts. Importing it also registers the torch.ops.pagedkv operators.

Token ids and sequence ids are taken as lists or tuples of ints (numpy integers included), 1-D integer
tensors (CPU or CUDA), or any 1-D integer buffer (numpy arrays of any integer dtype, array.array,
memoryview); batched results come back as CPU tensors. Errors: an unknown sequence id or a double free is
a KeyError; a malformed argument a ValueError; running out of blocks a RuntimeError; a wrong type (a
float, a bool, a str) a TypeError; an integer outside int64 an OverflowError. A call that raises leaves
the manager as it was.
"""
from collections.abc import Sequence
from typing import Any, ClassVar, Literal, Protocol, SupportsIndex, TypeAlias, TypedDict, overload, type_check_only

import torch
from typing_extensions import Buffer, deprecated


@type_check_only
class _ArrayLike(Protocol):
    """A numpy array (whose stubs declare the buffer protocol only from Python 3.12)."""
    def __array__(self) -> Any: ...


# 1-D integers: a list or tuple of ints, a 1-D integer tensor, a numpy array, array.array, memoryview.
_Ints: TypeAlias = Sequence[SupportsIndex] | torch.Tensor | Buffer | _ArrayLike
_IdOrIds: TypeAlias = SupportsIndex | _Ints   # one sequence id, or several
_Salt: TypeAlias = bytes | str | None
_HashAlgo: TypeAlias = Literal["xxh64", "sha256", "weak8"]
# (start, end, priority) or (start, end, priority, duration): token positions [start, end) (end None: to
# the end, decode tokens included), priority 0-100, duration in clock units after the block is freed
# (None: for ever).
_RetentionRange: TypeAlias = (tuple[SupportsIndex, SupportsIndex | None, SupportsIndex]
                              | tuple[SupportsIndex, SupportsIndex | None, SupportsIndex, float | None])
_Retention: TypeAlias = Sequence[_RetentionRange] | None


class _Stats(TypedDict):
    """stats() / take_step_stats(): counters (since construction, or since the previous take_step_stats)
    and gauges (current values)."""
    queries: int               # prompt tokens looked up in the prefix cache
    hits: int                  # of them, tokens whose KV was cached
    hit_rate: float            # hits / queries (0.0 before any query)
    query_blocks: int          # the same in blocks, every group's table entries
    hit_blocks: int
    hit_blocks_in_use: int     # hits on blocks another sequence holds
    hit_blocks_revived: int    # hits on free blocks taken back from the free list
    events_dropped: int        # KV events dropped on overflow of max_pending_events
    evictions: int             # cached blocks reused for other content
    cow_copies: int            # copy-on-write copies queued
    swapped_out_blocks: int
    swapped_in_blocks: int
    host_hit_blocks: int       # hit blocks loaded from the host tier
    offloaded_blocks: int      # device blocks copied to the host tier (confirmed)
    offload_failures: int
    loaded_blocks: int         # host slots copied back to the device (confirmed)
    load_failures: int
    host_evictions: int        # host slots reused for other content
    disk_hit_blocks: int       # blocks prefetch() queued to read from the disk tier
    disk_writes: int           # host slots written to the disk tier (confirmed)
    disk_write_failures: int
    disk_reads: int            # disk records read into host slots (confirmed)
    disk_read_failures: int    # failed reads (their disk entries dropped)
    disk_evictions: int        # disk records reused for other content
    num_blocks: int
    used_blocks: int
    free_blocks: int
    cached_blocks: int         # blocks whose KV the prefix cache holds (in use or free), every group
    cached_free_blocks: int
    num_seqs: int
    num_swapped_seqs: int
    num_cpu_blocks: int
    free_cpu_blocks: int
    pinned_blocks: int
    num_host_blocks: int
    free_host_blocks: int
    cached_host_blocks: int    # host slots whose KV the prefix cache holds
    num_disk_blocks: int
    free_disk_blocks: int
    used_disk_blocks: int      # disk records held by pending writes and reads
    cached_disk_blocks: int    # disk records whose KV the prefix cache holds


class _KvEvent(TypedDict):
    """One KV event of take_events()."""
    seq: int                                        # consecutive; a jump means events were dropped
    kind: Literal["stored", "removed", "cleared"]
    block_hashes: list[int]
    parent_block_hash: int | None                   # stored: the first block's parent (None for block 0)
    token_ids: list[int] | None                     # stored: the blocks' tokens
    cache_salt: bytes | None                        # stored from block 0: the salt
    block_size: int
    medium: Literal["GPU", "CPU", "DISK"]           # CPU: the host tier, DISK: the disk tier


@type_check_only
class _pybind11_type(type):
    """The metaclass pybind11 gives the classes it binds (pybind11_builtins.pybind11_type)."""


built_with_cuda: bool   # whether the CUDA kernels (pagedkv/_C_cuda, PAGEDKV_CUDA) were built and loaded


def hash_block_tokens(token_ids: _Ints, parent_hash: SupportsIndex | None = None, *, algo: _HashAlgo = "xxh64",
                      cache_salt: _Salt = None) -> int:
    """Hash of one block: xxh64(seed=0, parent as 8 little-endian bytes + tokens as int64 little-endian).

    Block 0 (parent_hash None) hashes its tokens alone, unless cache_salt is given: the salt then acts as
    the parent, xxh64(b"\\xa5" + salt), so salted and unsalted blocks never share a hash. algo "sha256"
    keeps the first 8 bytes of SHA-256 (little-endian); "weak8" keeps 8 bits of xxh64 (tests that force
    collisions). These are the hashes of KV events and cached_blocks().
    """


def sha256_available() -> bool:
    """Always True: SHA-256 is built in (kept for callers that checked it)."""


def _set_dlpack_exchange(enabled: bool) -> None:
    """Tests only: False makes tensors cross through __dlpack__ capsules and torch.from_dlpack, as under a
    torch without the DLPack exchange table (before 2.10)."""


def _dlpack_exchange() -> bool:
    """Whether tensors cross through torch's DLPack exchange table."""


class AllocStatus(metaclass=_pybind11_type):
    """Result of can_allocate / can_swap_in.

    Members:

      OK : fits now

      LATER : does not fit now; may after other sequences finish

      NEVER : can never fit in this pool
    """
    OK: ClassVar[AllocStatus]
    LATER: ClassVar[AllocStatus]
    NEVER: ClassVar[AllocStatus]
    __members__: ClassVar[dict[str, AllocStatus]]

    def __init__(self, value: SupportsIndex) -> None:
        """The member whose value is `value` (0: OK, 1: LATER, 2: NEVER)."""

    def __eq__(self, other: object) -> bool: ...
    def __ne__(self, other: object) -> bool: ...
    def __hash__(self) -> int: ...
    def __index__(self) -> int: ...
    def __int__(self) -> int: ...

    @property
    def name(self) -> str:
        """'OK', 'LATER' or 'NEVER'."""

    @property
    def value(self) -> int:
        """The member's integer value."""


class BlockManager(metaclass=_pybind11_type):
    """Where every token's KV lives: a pool of num_blocks GPU blocks of block_size tokens (and
    num_cpu_blocks for swapping), a block table per sequence, an exact prefix cache, LRU eviction by
    retention priority, copy-on-write, fork, swap, and sliding-window groups of layers.

    The slot of token position p of a sequence is block_table[p // block_size] * block_size +
    p % block_size. Every call validates all its arguments before it changes anything.
    """

    def __init__(self, num_blocks: SupportsIndex, block_size: SupportsIndex, *, num_cpu_blocks: SupportsIndex = 0,
                 enable_prefix_caching: bool = True, watermark: float = 0.0, hash_algo: _HashAlgo = "xxh64",
                 enable_events: bool = False, max_pending_events: SupportsIndex = 65536,
                 default_priority: SupportsIndex = 35, decode_priority: SupportsIndex | None = None,
                 max_pinned_fraction: float = 0.5, sliding_window: SupportsIndex | None = None,
                 group_windows: Sequence[SupportsIndex | None] | None = None, num_host_blocks: SupportsIndex = 0,
                 host_offload_min_priority: SupportsIndex = 0, num_disk_blocks: SupportsIndex = 0) -> None:
        """A manager of num_blocks GPU blocks of block_size tokens; every block is usable.

        num_cpu_blocks: CPU blocks for swap_out / swap_in (0: no swapping). watermark: the fraction of
        the pool that admission keeps free (can_allocate says LATER rather than go below it).
        hash_algo: the block hash of events and cached_blocks() ("xxh64", "sha256", "weak8"); hits are
        exact whatever it is. enable_events: record KV events for take_events(), at most
        max_pending_events (the oldest are dropped on overflow). default_priority / decode_priority
        (None: the default): the retention priority (0-100) of prompt / decode blocks no retention range
        covers. max_pinned_fraction: the most of the pool pins may hold. num_host_blocks: host-tier slots
        of the prefix cache (0: no tier; see take_offloads / take_loads); blocks below
        host_offload_min_priority are dropped, not offloaded. num_disk_blocks: disk-tier records below the
        host tier (0: no tier; it needs num_host_blocks > 0; see take_disk_writes / prefetch). group_windows: one window
        (tokens; None: full attention) per group of layers (default: one group, full attention).
        sliding_window=w (deprecated, a DeprecationWarning) is group_windows=[w]; give one or neither. A
        second call on a live manager is a TypeError.
        """

    def can_allocate(self, token_ids: _Ints, *, cache_salt: _Salt = None,
                     num_new_tokens: SupportsIndex | None = None) -> AllocStatus:
        """Whether the prompt's blocks fit: OK now, LATER after others finish, NEVER in this pool.

        Cached blocks in use cost no free block. With num_new_tokens (chunked prefill), NEVER only when the
        most the sequence holds over a prefill in chunks of that size cannot fit.
        """

    def allocate(self, seq_id: SupportsIndex, token_ids: _Ints, *, cache_salt: _Salt = None,
                 retention: _Retention = None, num_new_tokens: SupportsIndex | None = None) -> int:
        """Allocates the prompt's blocks; returns the number of leading tokens whose KV is already cached.

        At most ceil(len / block_size) - 1 blocks hit: the last block is always computed. cache_salt
        (bytes or str) is mixed into block 0, so different salts never share blocks.
        retention: [(start, end, priority[, duration])] token ranges whose blocks are evicted later (priority
        0-100, default 35; end None: to the end; duration: clock units after the block is freed).
        num_new_tokens: blocks only for the cached tokens and the next num_new_tokens (chunked prefill;
        reserve() the later chunks).
        """

    def allocate_batch(self, seq_ids: _Ints, prompts: Sequence[_Ints] | torch.Tensor | Buffer | _ArrayLike, *,
                       cache_salts: Sequence[_Salt] | None = None,
                       retentions: Sequence[_Retention] | None = None) -> list[int]:
        """Admits prompts in order while can_allocate says OK, in one call; returns the cached-token count of
        each admitted prompt (its length is the number admitted: seq_ids[:len(result)]).

        prompts: a list of prompts, or a 2-D integer array or tensor (one prompt per row). cache_salts and
        retentions: one entry per prompt. The whole batch is validated before the first prompt is admitted.
        """

    def can_reserve(self, seq_ids: _IdOrIds, num_tokens: _IdOrIds) -> bool:
        """Whether the free blocks suffice for reserve(seq_ids, num_tokens)."""

    def reserve(self, seq_ids: _IdOrIds, num_tokens: _IdOrIds) -> None:
        """Chunked prefill: gives each sequence the blocks of its first num_tokens tokens in every group
        (after mark_computed of the previous chunk, so that a window has released what it no longer reads).
        """

    def num_allocated_tokens(self, seq_id: SupportsIndex) -> int:
        """Tokens of the sequence that have blocks (its length once its whole prompt is reserved)."""

    def mark_computed(self, seq_ids: _IdOrIds, num_tokens: _IdOrIds | None = None) -> None:
        """The KV of the first num_tokens (default: all) tokens of each sequence is written: its full blocks
        enter the prefix cache, and a sliding window releases the blocks no future query reads.

        seq_ids: one id or several (distinct); num_tokens: one count for all, or one per sequence.
        """

    def can_append(self, seq_ids: _IdOrIds, num_lookahead_slots: SupportsIndex = 0) -> bool:
        """Whether every sequence can append 1 + num_lookahead_slots tokens now."""

    def append_token(self, seq_id: SupportsIndex, token_id: SupportsIndex) -> int:
        """Appends one token; returns the slot for its KV (group 0's).

        A token that starts a block gets a new block; a shared last block (after fork) is copied on write,
        the copy queued for take_copies(). RuntimeError when no block is free.
        """

    def append_tokens(self, seq_ids: _Ints, token_ids: _Ints, counts: _Ints | None = None) -> torch.Tensor:
        """Batched decode step: appends one token per sequence, or counts[i] tokens to sequence i (its input
        and draft tokens, concatenated in token_ids); returns each token's slot (int64 tensor).
        """

    def truncate(self, seq_ids: _IdOrIds, num_tokens: _IdOrIds) -> None:
        """Rolls sequences back to their first num_tokens tokens (rejected draft tokens); blocks past them are
        released (cached ones stay cached).
        """

    def take_copies(self) -> torch.Tensor:
        """Drains the queued copy-on-write copies: an int64 [n, 2] CPU tensor of (src, dst) GPU blocks,
        copy_blocks' block_mapping, to perform before the next KV write. Until taken, a copy's source is
        never handed out again.
        """

    def free(self, seq_id: SupportsIndex) -> None:
        """Releases the sequence's blocks, tail first; blocks with cached KV stay cached until reused.
        KeyError for an unknown id (a double free).
        """

    def fork(self, parent_seq_id: SupportsIndex, child_seq_id: SupportsIndex) -> None:
        """The child shares every block of the parent (reference counts); the first write into a shared
        block copies it (copy-on-write).
        """

    def distinct_blocks(self, seq_ids: _IdOrIds) -> int:
        """Distinct blocks the sequences hold over every group (a block they share counts once; entries a window
        released excepted): what swap_out / swap_in moves. The sequences are all resident or all swapped out.
        """

    def can_swap_out(self, seq_ids: _IdOrIds) -> bool:
        """Whether enough CPU blocks are free to swap the sequences out."""

    def swap_out(self, seq_ids: _IdOrIds) -> torch.Tensor:
        """Moves the sequences to CPU blocks; returns the copies to perform, an int64 [n, 2] CPU tensor of
        (gpu_block, cpu_block): swap_blocks' block_mapping."""

    def can_swap_in(self, seq_ids: _IdOrIds, num_lookahead_slots: SupportsIndex = 0) -> AllocStatus:
        """Whether the swapped-out sequences fit back (with room for num_lookahead_slots more tokens each)."""

    def swap_in(self, seq_ids: _IdOrIds) -> torch.Tensor:
        """Moves the sequences back to GPU blocks; returns the copies to perform, an int64 [n, 2] CPU tensor
        of (cpu_block, gpu_block): swap_blocks' block_mapping."""

    def block_table(self, seq_id: SupportsIndex, *, group: int = 0) -> list[int]:
        """The sequence's block table in `group`; entries its sliding window released hold block 0 (a pad)."""

    def block_tables(self, seq_ids: _Ints, *, max_blocks: int | None = None, pad: int = 0,
                     group: int = 0) -> torch.Tensor:
        """Block tables of `group` as an int32 tensor [len(seq_ids), max_blocks], rows padded with `pad`
        (entries released by a sliding window too).
        """

    def slot_mapping(self, seq_id: SupportsIndex, start: SupportsIndex = 0, end: SupportsIndex | None = None, *,
                     group: int = 0) -> torch.Tensor:
        """Slots (int64 tensor) of token positions [start, end) of one sequence (default end: its length)."""

    def slot_mappings(self, seq_ids: _Ints, starts: _Ints, ends: _Ints | None = None, *,
                      group: int = 0) -> torch.Tensor:
        """Concatenated slots of positions [starts[i], ends[i]) of each sequence (default end: its length); a
        prefill batch's slot mapping, chunked or not.
        """

    def attention_inputs(self, seq_ids: _Ints, starts: _Ints, ends: _Ints | None = None, *,
                         max_blocks: int | None = None, pad: int = 0,
                         group: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """What paged attention needs for a step whose sequence i has queries at positions [starts[i], ends[i])
        (default end: its length), in one call: (slot_mapping int64 [total], block_tables int32 [n, width],
        seq_lens int32 [n] (= ends), query_start_loc int32 [n + 1]). The same as slot_mappings, block_tables and
        seq_lens, and the cumulative query lengths, without a Python crossing for each.
        """

    @deprecated("seq_lens(seq_ids) is deprecated: use num_tokens(seq_ids)")
    def seq_lens(self, seq_ids: _Ints, *, group: int = 0) -> torch.Tensor:
        """Deprecated (a DeprecationWarning): num_tokens(seq_ids), the same int32 tensor of token counts."""

    def num_released_blocks(self, seq_id: SupportsIndex, *, group: int = 0) -> int:
        """Leading entries of the sequence's table in `group` that its sliding window released."""

    def blocks_held(self, num_tokens: SupportsIndex, num_computed: SupportsIndex = 0) -> int:
        """Blocks a sequence of num_tokens tokens, the first num_computed computed, holds over all groups."""

    @property
    def num_groups(self) -> int:
        """The number of groups of layers (each with its own block table per sequence)."""

    @property
    def group_windows(self) -> list[int | None]:
        """One window (tokens; None: full attention) per group of layers."""

    @property
    @deprecated("sliding_window is deprecated: read group_windows")
    def sliding_window(self) -> int | None:
        """Deprecated (a DeprecationWarning): group_windows[0]. The window of a one-group manager (None:
        full attention); a ValueError on a manager with several groups."""

    @overload
    def num_tokens(self, seq_ids: SupportsIndex) -> int:  # type: ignore[overload-overlap]  # a 0-d tensor: int
        """Tokens (prompt and appended) of one sequence. The keyword seq_id= is deprecated."""
    @overload
    def num_tokens(self, seq_ids: _Ints) -> torch.Tensor:
        """Tokens (prompt and appended) of one sequence, an int, or of each of several, an int32 tensor
        (paged attention's seq_lens). The keyword seq_id= is deprecated (a DeprecationWarning)."""

    def num_computed_tokens(self, seq_id: SupportsIndex) -> int:
        """Tokens whose KV is written (mark_computed, or prefix hits)."""

    def token_ids(self, seq_id: SupportsIndex) -> list[int]:
        """The sequence's tokens."""

    def is_swapped(self, seq_id: SupportsIndex) -> bool:
        """Whether the sequence is swapped out to CPU blocks."""

    def __contains__(self, seq_id: SupportsIndex, /) -> bool:
        """Whether the manager holds a sequence with this id."""

    @property
    def num_blocks(self) -> int:
        """GPU blocks in the pool."""

    @property
    def num_cpu_blocks(self) -> int:
        """CPU blocks for swapping."""

    @property
    def block_size(self) -> int:
        """Tokens per block."""

    @property
    def watermark_blocks(self) -> int:
        """Blocks admission keeps free (watermark * num_blocks)."""

    @property
    def enable_prefix_caching(self) -> bool:
        """Whether computed blocks are registered in the prefix cache."""

    @property
    def hash_algo(self) -> str:
        """The block hash of events and cached_blocks(): 'xxh64', 'sha256' or 'weak8'."""

    @property
    def num_free_blocks(self) -> int:
        """GPU blocks no sequence holds (cached or not)."""

    @property
    def num_free_cpu_blocks(self) -> int:
        """CPU blocks no swapped-out sequence holds."""

    def stats(self) -> _Stats:
        """Cumulative counters (queries and hits in tokens and blocks, evictions, copies, swaps, dropped
        events) and gauges (used / free / cached blocks, sequences).
        """

    def take_step_stats(self) -> _Stats:
        """Like stats(), but the counters count only what happened since the previous call."""

    def take_events(self) -> list[_KvEvent]:
        """Drains the KV events recorded since the previous call, in order (enable_events=True): dicts with
        seq, kind ('stored' | 'removed' | 'cleared'), block_hashes, parent_block_hash, token_ids and
        cache_salt (stored), block_size, medium ('GPU', 'CPU': the host tier, or 'DISK': the disk tier).
        """

    def cached_blocks(self, medium: Literal["GPU", "CPU", "DISK"] = "GPU") -> list[tuple[int, int | None]]:
        """(block_hash, parent_block_hash) of every block whose KV the prefix cache holds now on `medium` ('GPU':
        device blocks, 'CPU': the host tier, 'DISK': the disk tier); replaying that medium's KV events gives
        the same multiset.
        """

    @property
    def host_tier_enabled(self) -> bool:
        """Whether the host tier is in use: num_host_blocks > 0 and prefix caching (any groups and windows)."""

    @property
    def num_host_blocks(self) -> int:
        """Host-tier slots (num_host_blocks)."""

    @property
    def num_free_host_blocks(self) -> int:
        """Host-tier slots that no pending offload or load holds (those with cached KV included)."""

    @property
    def host_offload_min_priority(self) -> int:
        """Blocks below this retention priority are dropped, not offloaded."""

    def lookup(self, token_ids: _Ints, *, cache_salt: _Salt = None) -> tuple[int, int, int]:
        """The prompt's prefix hit as allocate() would take it now: (device_blocks, host_blocks, disk_blocks),
        the leading blocks hit on the device, after them those loaded from the host tier (with several groups:
        from the first block any group loads; a windowed group loads only its window's blocks), and after the
        hit the blocks that would hit once the disk tier's reads are confirmed (those prefetch() reads and
        the host entries between them).
        """

    def plan_offloads(self, max_blocks: SupportsIndex) -> int:
        """Clean ahead: of the max_blocks cached free device blocks the pool would evict first, queues copies to
        the host tier of those it lacks, so that reusing them later needs no copy; returns how many it queued.
        """

    def take_offloads(self) -> torch.Tensor:
        """Drains the queued offloads: an int64 [n, 2] CPU tensor of (device block, host slot). Each device
        block is held (never handed out) until complete_offloads.
        """

    def complete_offloads(self, ok: bool | Sequence[bool] | torch.Tensor = True) -> None:
        """The outcome of every offload taken and not yet completed, in the order taken (one bool for all, or
        one per offload): a copy that failed leaves no host entry.
        """

    def take_loads(self) -> torch.Tensor:
        """Drains the queued loads of host hits: an int64 [n, 2] CPU tensor of (host slot, device block), to
        copy before the step's attention reads them; both are held until complete_loads.
        """

    def complete_loads(self, ok: bool | Sequence[bool] | torch.Tensor = True) -> list[int]:
        """The outcome of every load taken and not yet completed, in the order taken (one bool for all, or one
        per load). A sequence whose load failed keeps as computed the tokens before the first failed block:
        num_computed_tokens drops and the rest is recomputed in blocks private to it. Returns the ids of the
        sequences for which no such point is safe (a windowed group would need blocks its window released, or
        no free block can replace a shared one): their num_computed_tokens is 0 and they refuse everything but
        free(); free them and allocate them again (the failed host entries are dropped, so they hit less).
        """

    def must_readmit(self, seq_id: SupportsIndex) -> bool:
        """Whether a failed load left the sequence to be freed and re-admitted (complete_loads returned it)."""

    def num_loading_blocks(self, seq_id: SupportsIndex) -> int:
        """Blocks of the sequence whose loads from the host tier are not confirmed yet."""

    @property
    def disk_tier_enabled(self) -> bool:
        """Whether the disk tier is in use: num_disk_blocks > 0 below an enabled host tier."""

    @property
    def num_disk_blocks(self) -> int:
        """Disk-tier records (num_disk_blocks)."""

    @property
    def num_free_disk_blocks(self) -> int:
        """Disk-tier records that no pending write or read holds (those with cached KV included)."""

    @property
    def num_pending_disk_reads(self) -> int:
        """Disk reads queued by prefetch() and not yet completed (taken or not)."""

    def plan_disk_writes(self, max_slots: SupportsIndex) -> int:
        """Clean ahead: of the max_slots cached free host slots the host tier would evict first, queues writes
        to the disk tier of those it lacks; returns how many it queued.
        """

    def take_disk_writes(self) -> torch.Tensor:
        """Drains the queued disk writes: an int64 [n, 2] CPU tensor of (host slot, disk record). Each host slot
        is held (never reused) until complete_disk_writes.
        """

    def complete_disk_writes(self, ok: bool | Sequence[bool] | torch.Tensor = True) -> None:
        """The outcome of every disk write taken and not yet completed, in the order taken (one bool for all, or
        one per write): a confirmed write stores the entry on disk (a 'DISK' stored event); a failed one
        leaves no disk entry.
        """

    def prefetch(self, token_ids: _Ints, *, cache_salt: _Salt = None) -> int:
        """Queues reads from the disk tier into host slots for the prompt's blocks after its device/host hit
        that only the disk holds (up to the first block no tier holds), evicting host entries of at most the
        block's priority; stops when no slot can be taken. Returns how many reads it queued.
        """

    def take_disk_reads(self) -> torch.Tensor:
        """Drains the queued disk reads: an int64 [n, 2] CPU tensor of (disk record, host slot); both are held
        until complete_disk_reads, and allocate() treats the block as not on the host meanwhile.
        """

    def complete_disk_reads(self, ok: bool | Sequence[bool] | torch.Tensor = True) -> None:
        """The outcome of every disk read taken and not yet completed, in the order taken (one bool for all, or
        one per read): a confirmed read gives the entry its host slot (a 'CPU' stored event; it stays on
        disk); a failed one (stale or foreign file) drops the disk entry (a 'DISK' removed event).
        """

    def disk_record_identity(self, record: SupportsIndex) -> tuple[int, int | None, list[int]]:
        """(block_hash, parent_block_hash or None, token_ids) of what the disk record holds or is being written
        or read: what the runner writes in the record's header and checks on read (the events' hashes).
        ValueError for a record out of range, KeyError for one that holds nothing.
        """

    def disk_record_salt(self, record: SupportsIndex) -> bytes:
        """The cache salt of the block the disk record holds or is being written or read (block 0 of a salted
        prompt; b'' otherwise): with disk_record_identity, what restore_disk_record needs after a restart.
        ValueError for a record out of range, KeyError for one that holds nothing.
        """

    def restore_disk_record(self, record: SupportsIndex, block_hash: SupportsIndex, parent_record: SupportsIndex | None,
                            token_ids: _Ints, *, cache_salt: _Salt = None, group: SupportsIndex = 0) -> bool:
        """Re-registers a disk record an earlier run of the same model wrote (its header read back and checked
        by the runner): the block `token_ids` whose chained hash is `block_hash`, after the block that disk
        record `parent_record` holds (None: block 0 of a prompt, salted with `cache_salt`). Restore parents
        before children. Returns False and changes nothing when the hash is not that block's after that
        parent, the record is in use or holds something, the parent record holds nothing, or the block has a
        disk copy already, or is in another group than `group` (the group of a block 0; a child is in its
        parent's); True adds a 'DISK' stored event for group 0. ValueError: no disk tier, a record or group
        out of range, not one block of tokens, a salt after block 0, or hash_algo='weak8'.
        """

    def set_time(self, now: float) -> None:
        """Advances the manager's clock (the unit of retention durations; it starts at 0 and is never read
        from the wall): free blocks whose priority duration has run out fall back to the default.
        """

    @property
    def now(self) -> float:
        """The manager's clock (set_time)."""

    def pin(self, seq_id: SupportsIndex) -> int:
        """Keeps the sequence's full cached blocks cached after free() until unpin(); returns how many
        blocks the pin holds. RuntimeError if it would pin more than max_pinned_blocks.
        """

    def unpin(self, seq_id: SupportsIndex) -> None:
        """Lets the sequence's pin go (also after free()); its blocks then age like any freed block.
        KeyError unless the sequence is pinned.
        """

    def is_pinned(self, seq_id: SupportsIndex) -> bool:
        """Whether the sequence holds a pin."""

    def pinned_blocks(self, seq_id: SupportsIndex) -> list[int]:
        """The blocks the sequence's pin holds."""

    def block_priority(self, block: SupportsIndex) -> int:
        """The eviction priority GPU block `block` has now."""

    @property
    def num_pinned_blocks(self) -> int:
        """Blocks held by pins."""

    @property
    def max_pinned_blocks(self) -> int:
        """The most blocks pins may hold (max_pinned_fraction of the pool)."""

    @property
    def default_priority(self) -> int:
        """Retention priority of prompt blocks no range covers."""

    @property
    def decode_priority(self) -> int:
        """Retention priority of decode blocks no range covers."""

    def reset_prefix_cache(self) -> None:
        """Forgets every registration (live sequences re-register on their next mark_computed), lets every
        pin go, and puts free blocks back at the default priority.
        """

    def check_invariants(self) -> None:
        """Checks the manager's internal consistency; RuntimeError naming the first violation."""

    def __repr__(self) -> str: ...
