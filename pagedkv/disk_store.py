"""Records of the prefix cache's disk tier: one block's KV bytes behind a header that says what they are.

The block manager decides which block goes to which disk record (``take_disk_writes`` / ``take_disk_reads``);
a ``DiskStore`` moves the bytes between a host-tier slot and its record in one file, and checks on every read
that the record holds what the manager expects: the model fingerprint, the block's hash, its parent's hash
and its token ids, and a checksum of the bytes. A record that fails any check (never written, torn by a crash,
written for another block or another model) reads as a miss, never as KV.

With ``persist=True`` the records live in a named file of the directory (one per fingerprint) that outlives
the process: ``scan`` reads its headers back and ``restore_records`` registers them in a new manager, so a
restarted engine finds its prefixes on disk.
"""
from __future__ import annotations

import ctypes
import fcntl
import hashlib
import os
import struct
import tempfile
import zlib
from collections.abc import Sequence
from typing import NamedTuple

import torch

from .validation import check_int

__all__ = ["DiskStore", "StoredRecord", "record_identity", "restore_records"]

_MAGIC = b"PKVDISK1"
_VERSION = 2
# magic, version, header bytes, fingerprint digest, block hash, parent hash, has parent, tokens,
# payload bytes, payload crc32, salt bytes; then the token ids (int64), the salt and the crc32 of
# everything before it.
_FIXED = struct.Struct("<8sII32sQQIIQII")
_ALIGN = 4096
_U64 = (1 << 64) - 1
_MAX_SALT = 1024                 # longer salts are not kept: such a record reads, but is not restored
_SALT_NOT_KEPT = 0xFFFFFFFF


class StoredRecord(NamedTuple):
    """A record's header as ``DiskStore.scan`` found it."""
    record: int
    block_hash: int
    parent_hash: int | None
    token_ids: tuple[int, ...]
    cache_salt: bytes


def record_identity(block_hash: int, parent_hash: int | None, token_ids: Sequence[int]) -> tuple[int, int | None,
                                                                                                  tuple[int, ...]]:
    """The identity a record is written under and checked against: (block hash, parent hash or None, tokens).
    Hashes are 64-bit (signed or unsigned: stored as unsigned); tokens are int64."""
    def hash64(name, value):
        value = check_int(name, value)
        if not -(1 << 63) <= value <= _U64:
            raise ValueError(f"{name} {value} does not fit in 64 bits")
        return value & _U64

    tokens = tuple(check_int("token id", t, minimum=-(1 << 63), maximum=(1 << 63) - 1) for t in token_ids)
    return hash64("block_hash", block_hash), None if parent_hash is None else hash64("parent_hash", parent_hash), tokens


class DiskStore:
    """``num_records`` records of ``record_bytes`` each in one file under ``directory``.

    ``fingerprint`` (str or bytes) names what the bytes mean (model, KV dtype and scales, layout, block size):
    a record written under another fingerprint reads as a miss. By default the file is created with a unique
    name and unlinked at once, so its space returns to the file system when the store is closed or the process
    ends, crash included. With ``persist=True`` it is ``pagedkv-<fingerprint digest>.kv`` in ``directory``,
    kept after close, resized to ``num_records`` when reopened, and locked while open: a second store on the
    same file (another process) gets a private unlinked file instead (``persistent`` is then False). Either
    way the space is allocated up front (``posix_fallocate``), so a full disk fails here, not mid-run.
    ``write`` and ``read`` are thread-safe (positioned I/O on one descriptor) and release the GIL while the
    kernel copies, so a background thread can run them beside the model.
    """

    def __init__(self, directory: str | os.PathLike, num_records: int, record_bytes: int, *, block_size: int,
                 fingerprint: str | bytes, persist: bool = False):
        check_int("num_records", num_records, minimum=1)
        check_int("record_bytes", record_bytes, minimum=1)
        check_int("block_size", block_size, minimum=1)
        if not isinstance(fingerprint, (str, bytes)):
            raise TypeError(f"fingerprint must be str or bytes, got {type(fingerprint).__name__}")
        if not isinstance(persist, bool):
            raise TypeError(f"persist must be a bool, got {persist!r}")
        directory = os.fspath(directory)
        if not os.path.isdir(directory):
            raise ValueError(f"disk cache directory {directory!r} does not exist (or is not a directory)")
        self.num_records, self.record_bytes, self.block_size = int(num_records), int(record_bytes), int(block_size)
        raw = fingerprint.encode() if isinstance(fingerprint, str) else bytes(fingerprint)
        self.fingerprint = hashlib.sha256(raw).digest()
        self.header_bytes = _header_bytes(self.block_size)
        self.stride = self.record_stride(self.record_bytes, self.block_size)
        size = self.stride * self.num_records
        if size >= 1 << 62:
            raise ValueError(f"a disk cache of {self.num_records} records of {self.stride} bytes is too large")
        self.path: str | None = None
        fd = self._open_persistent(directory) if persist else -1
        if fd < 0:
            fd, path = tempfile.mkstemp(prefix="pagedkv-", suffix=".kv", dir=directory)
            os.unlink(path)
        try:
            if self.path is not None and os.fstat(fd).st_size > size:
                os.ftruncate(fd, size)          # fewer records than the file's last owner kept
            try:
                os.posix_fallocate(fd, 0, size)
            except OSError as e:
                if e.errno not in (95, 22):     # EOPNOTSUPP / EINVAL: a file system without fallocate
                    raise OSError(e.errno, f"cannot reserve {size} bytes for the disk cache in {directory!r}: "
                                           f"{e.strerror}") from None
                os.ftruncate(fd, size)
        except BaseException:
            os.close(fd)
            if self.path is not None and self._created:
                os.unlink(self.path)
            raise
        self._fd = fd
        self.directory = directory

    @property
    def persistent(self) -> bool:
        """Whether the records outlive the store (a named file, see the class)."""
        return self.path is not None

    def _open_persistent(self, directory: str) -> int:
        path = os.path.join(directory, f"pagedkv-{self.fingerprint.hex()[:32]}.kv")
        self._created = not os.path.exists(path)
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            os.close(fd)            # another store holds it: this one gets a private file
            return -1
        self.path = path
        return fd

    @staticmethod
    def record_stride(record_bytes: int, block_size: int) -> int:
        """Bytes of the file one record takes: its header and its payload, each rounded up to 4 KiB."""
        return _header_bytes(block_size) + _round_up(record_bytes, _ALIGN)

    # ---- records ----------------------------------------------------------------------------------------
    def write(self, record: int, payload: torch.Tensor, identity, cache_salt: bytes | str | None = None) -> None:
        """Writes ``payload`` (a contiguous CPU tensor of record_bytes bytes: one host-tier slot) to ``record``
        under ``identity`` (block hash, parent hash or None, token ids) and block 0's ``cache_salt`` (kept so
        that ``scan`` can restore the block; a salt over 1 KiB is not kept). OSError when the write fails."""
        view = self._payload_view(payload, writable=False)
        block_hash, parent, tokens = self._check_identity(identity)
        salt = _salt_bytes(cache_salt)
        if salt and parent is not None:
            raise ValueError("only block 0 (parent hash None) has a cache salt")
        record = self._check_record(record)
        crc = zlib.crc32(view)
        kept = len(salt) <= _MAX_SALT
        fixed = _FIXED.pack(_MAGIC, _VERSION, self.header_bytes, self.fingerprint, block_hash,
                            0 if parent is None else parent, parent is not None, len(tokens), self.record_bytes, crc,
                            len(salt) if kept else _SALT_NOT_KEPT)
        body = fixed + struct.pack(f"<{len(tokens)}q", *tokens) + (salt if kept else b"")
        header = body + struct.pack("<I", zlib.crc32(body))
        header += bytes(self.header_bytes - len(header))
        offset = record * self.stride
        written = os.pwritev(self._fd, [header, view], offset)
        if written != self.header_bytes + self.record_bytes:
            raise OSError(f"short write to disk record {record}: {written} of {self.header_bytes + self.record_bytes}"
                          " bytes")

    def read(self, record: int, out: torch.Tensor, identity) -> bool:
        """Reads ``record`` into ``out`` (a contiguous CPU tensor of record_bytes bytes) and checks it: True when
        the header names this store's fingerprint and ``identity`` and the bytes match their checksum; False
        (a miss) otherwise, with ``out`` holding whatever was read."""
        view = self._payload_view(out, writable=True)
        block_hash, parent, tokens = self._check_identity(identity)
        record = self._check_record(record)
        header = bytearray(self.header_bytes)
        try:
            got = os.preadv(self._fd, [header, view], record * self.stride)
        except OSError:
            return False
        if got != self.header_bytes + self.record_bytes:
            return False
        stored = self._parse_header(header)
        if stored is None or stored[0] != (block_hash, parent, tokens):
            return False
        return zlib.crc32(view) == stored[1]

    def scan(self) -> list[StoredRecord]:
        """The records whose header is whole and names this store's fingerprint (a persistent file reopened:
        what earlier stores wrote), in record order; their payloads are checked when read. Reads only the
        headers (``header_bytes`` per record)."""
        self._check_open()
        found = []
        header = bytearray(self.header_bytes)
        for record in range(self.num_records):
            try:
                got = os.preadv(self._fd, [header], record * self.stride)
            except OSError:
                continue
            stored = self._parse_header(header) if got == self.header_bytes else None
            if stored is not None and stored[2] is not None:
                (h, p, tokens), _, salt = stored
                found.append(StoredRecord(record, h, p, tokens, salt))
        return found

    def _parse_header(self, header: bytearray):
        """((hash, parent, tokens), payload crc32, salt or None when not kept) of a whole header with this
        store's fingerprint and geometry; None otherwise."""
        (magic, version, header_bytes, fingerprint, h, p, has_parent, n, nbytes, crc,
         salt_len) = _FIXED.unpack_from(header, 0)
        kept = salt_len != _SALT_NOT_KEPT
        if (magic != _MAGIC or version != _VERSION or header_bytes != self.header_bytes or not 1 <= n <= self.block_size
                or nbytes != self.record_bytes or fingerprint != self.fingerprint or (kept and salt_len > _MAX_SALT)):
            return None
        end = _FIXED.size + 8 * n + (salt_len if kept else 0)
        if struct.unpack_from("<I", header, end)[0] != zlib.crc32(memoryview(header)[:end]):
            return None
        tokens = struct.unpack_from(f"<{n}q", header, _FIXED.size)
        salt = bytes(header[_FIXED.size + 8 * n:end]) if kept else None
        return (h, p if has_parent else None, tokens), crc, salt

    def fileno(self) -> int:
        """The records' file descriptor (the file itself has no name)."""
        self._check_open()
        return self._fd

    def close(self) -> None:
        """Releases the file: its space returns to the file system, or, persistent, its records are flushed to
        the disk and kept for the next store. Idempotent."""
        if self._fd >= 0:
            try:
                if self.path is not None:
                    os.fsync(self._fd)
            finally:
                os.close(self._fd)
                self._fd = -1

    def __enter__(self) -> "DiskStore":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __del__(self) -> None:
        if getattr(self, "_fd", -1) >= 0:
            self.close()

    def __repr__(self) -> str:
        return (f"DiskStore({self.directory!r}, num_records={self.num_records}, record_bytes={self.record_bytes}, "
                f"block_size={self.block_size})")

    # ---- checks ------------------------------------------------------------------------------------------
    def _check_open(self) -> None:
        if self._fd < 0:
            raise ValueError("the disk store is closed")

    def _check_record(self, record) -> int:
        self._check_open()
        check_int("record", record, minimum=0)
        if record >= self.num_records:
            raise ValueError(f"record {record} is out of range [0, {self.num_records})")
        return int(record)

    def _check_identity(self, identity) -> tuple[int, int | None, tuple[int, ...]]:
        try:
            block_hash, parent, tokens = identity
        except (TypeError, ValueError):
            raise TypeError("identity must be (block_hash, parent_hash or None, token_ids)") from None
        ident = record_identity(block_hash, parent, tokens)
        if not 1 <= len(ident[2]) <= self.block_size:
            raise ValueError(f"identity holds {len(ident[2])} token ids; a record holds 1 to {self.block_size}")
        return ident

    def _payload_view(self, tensor, *, writable: bool) -> memoryview:
        if not isinstance(tensor, torch.Tensor):
            raise TypeError(f"expected a torch.Tensor, got {type(tensor).__name__}")
        if tensor.device.type != "cpu" or not tensor.is_contiguous():
            raise ValueError(f"the record's tensor must be a contiguous CPU tensor, got {tensor.device} "
                             f"{'contiguous' if tensor.is_contiguous() else 'strided'}")
        nbytes = tensor.numel() * tensor.element_size()
        if nbytes != self.record_bytes:
            raise ValueError(f"the record's tensor holds {nbytes} bytes; records hold {self.record_bytes}")
        if writable and tensor.requires_grad:
            raise ValueError("cannot read into a tensor that requires grad")
        # A byte view of the tensor's memory (no numpy needed): the kernel copies straight between it and the
        # file. The caller holds the tensor for the duration of the call.
        return memoryview((ctypes.c_char * nbytes).from_address(tensor.data_ptr())).cast("B")


def _header_bytes(block_size: int) -> int:
    return _round_up(_FIXED.size + 8 * block_size + _MAX_SALT + 4, _ALIGN)


def _salt_bytes(salt) -> bytes:
    if salt is None:
        return b""
    if isinstance(salt, str):
        return salt.encode()
    if isinstance(salt, bytes):
        return salt
    raise TypeError(f"cache_salt must be bytes, str or None, got {type(salt).__name__}")


def restore_records(manager, store: DiskStore) -> int:
    """Registers in ``manager`` (a BlockManager whose disk tier has ``store.num_records`` records and holds
    nothing yet) the records ``store.scan()`` finds, parents before children, so that its prefix cache hits
    them on disk; returns how many it restored. A block 0 goes to the group whose record hash it carries
    (each group's differs), a child to its parent's. A record whose parent block is not on disk, or that the
    manager refuses (another block's hash, a copy of a block already restored), stays free and is
    overwritten in time. Chains are linked by their 64-bit block hashes, so a restored hit is as exact as
    the manager's hash algorithm (tokens are compared block by block as always; hash_algo='sha256' for
    records that others could write)."""
    children: dict[int | None, list[StoredRecord]] = {}
    for found in store.scan():
        children.setdefault(found.parent_hash, []).append(found)
    restored = 0
    todo: list[tuple[int | None, int | None, StoredRecord]] = [(None, None, r) for r in children.get(None, [])]
    while todo:
        parent_record, group, found = todo.pop()
        salt = found.cache_salt or None
        for g in range(manager.num_groups) if group is None else (group,):
            if manager.restore_disk_record(found.record, found.block_hash, parent_record, list(found.token_ids),
                                           cache_salt=salt, group=g):
                restored += 1
                todo.extend((found.record, g, child) for child in children.get(found.block_hash, ()))
                break
    return restored


def _round_up(n: int, m: int) -> int:
    return -(-n // m) * m
