"""DiskStore: a disk-tier record holds one block's bytes behind a header; every read checks the header."""
import os
import subprocess
import sys
import threading

import pytest
import torch

from pagedkv import allocate_host_tier
from pagedkv.disk_store import DiskStore

DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.float8_e4m3fn, torch.float8_e5m2]
BLOCK = 16


def _tier(dtype, slots=4, layers=3, heads=2, dim=8, seed=0):
    tier = allocate_host_tier(slots, layers, BLOCK, heads, dim, dtype=dtype, pin_memory=False)
    g = torch.Generator().manual_seed(seed)
    tier.view(torch.uint8).copy_(torch.randint(0, 256, tier.view(torch.uint8).shape, dtype=torch.uint8, generator=g))
    return tier


def _ident(i, parent=None):
    return (1000 + i, parent, list(range(i, i + BLOCK)))


def _same(a, b):    # bit-equal (random bytes hold NaNs)
    return torch.equal(a.view(torch.uint8), b.view(torch.uint8))


def _store(tmp_path, tier, num_records=8, fingerprint="model-a"):
    return DiskStore(tmp_path, num_records, tier[0].numel() * tier.element_size(), block_size=BLOCK,
                     fingerprint=fingerprint)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_round_trip_every_dtype_leaves_other_records_alone(tmp_path, dtype):
    tier = _tier(dtype)
    with _store(tmp_path, tier) as store:
        for slot, record in [(0, 5), (1, 0), (2, 7)]:
            store.write(record, tier[slot], _ident(record, parent=record - 1 if record else None))
        out = torch.empty_like(tier[0])
        for slot, record in [(0, 5), (1, 0), (2, 7)]:
            out.view(torch.uint8).fill_(0xFF)
            assert store.read(record, out, _ident(record, parent=record - 1 if record else None))
            assert _same(out, tier[slot])
        for record in (1, 2, 3, 4, 6):      # never written: a miss
            assert not store.read(record, out, _ident(record))


def test_every_identity_field_is_checked(tmp_path):
    tier = _tier(torch.float16)
    with _store(tmp_path, tier) as store:
        store.write(3, tier[1], (77, 55, list(range(BLOCK))))
        out = torch.empty_like(tier[0])
        assert store.read(3, out, (77, 55, list(range(BLOCK))))
        assert not store.read(3, out, (78, 55, list(range(BLOCK))))                 # block hash
        assert not store.read(3, out, (77, 56, list(range(BLOCK))))                 # parent hash
        assert not store.read(3, out, (77, None, list(range(BLOCK))))               # root vs child
        assert not store.read(3, out, (77, 55, list(range(1, BLOCK + 1))))          # tokens
        assert not store.read(3, out, (77, 55, list(range(BLOCK - 1))))             # a shorter block
        store.write(4, tier[2], (77, None, [5]))                                      # a root, one token
        assert store.read(4, out, (77, None, [5]))
        assert not store.read(4, out, (77, 0, [5]))


def test_torn_or_corrupted_records_read_as_misses(tmp_path):
    tier = _tier(torch.bfloat16)
    with _store(tmp_path, tier) as store:
        store.write(2, tier[0], _ident(2))
        out = torch.empty_like(tier[0])
        assert store.read(2, out, _ident(2))
        base = 2 * store.stride
        for where in (0, 60, 100, store.header_bytes + 7,
                      store.header_bytes + store.record_bytes - 1):
            old = os.pread(store.fileno(), 1, base + where)
            os.pwrite(store.fileno(), bytes([old[0] ^ 0x40]), base + where)
            assert not store.read(2, out, _ident(2)), where
            os.pwrite(store.fileno(), old, base + where)
            assert store.read(2, out, _ident(2)), where


def test_a_foreign_models_record_is_a_miss(tmp_path):
    tier = _tier(torch.float32)
    with _store(tmp_path, tier, fingerprint="model-a") as a, _store(tmp_path, tier, fingerprint="model-b") as b, \
            _store(tmp_path, tier, fingerprint="model-a") as a2:
        a.write(1, tier[3], _ident(1))
        raw = os.pread(a.fileno(), a.stride, a.stride)
        out = torch.empty_like(tier[0])
        for other, expect in ((b, False), (a2, True)):    # the same bytes under another fingerprint, or the same
            os.pwrite(other.fileno(), raw, other.stride)
            assert other.read(1, out, _ident(1)) is expect
        assert _same(out, tier[3])


def test_the_file_has_no_name_and_threads_share_it(tmp_path):
    tier = _tier(torch.float16, slots=8)
    with _store(tmp_path, tier, num_records=8) as store:
        assert os.listdir(tmp_path) == []       # unlinked at once: nothing is left behind, crash included
        outs = [torch.empty_like(tier[0]) for _ in range(8)]
        results = [None] * 8

        def work(i):
            store.write(i, tier[i], _ident(i))
            results[i] = store.read(i, outs[i], _ident(i))

        threads = [threading.Thread(target=work, args=(i,)) for i in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert results == [True] * 8
        assert all(_same(outs[i], tier[i]) for i in range(8))
    with pytest.raises(ValueError, match="closed"):
        store.read(0, outs[0], _ident(0))
    store.close()   # idempotent


def test_bad_arguments_raise_and_write_nothing(tmp_path):
    tier = _tier(torch.float32)
    with _store(tmp_path, tier) as store:
        store.write(0, tier[0], _ident(0))
        out = torch.empty_like(tier[0])
        bad = [
            ((8, tier[1], _ident(0)), ValueError, "out of range"),
            ((-1, tier[1], _ident(0)), ValueError, ">= 0|out of range"),
            ((True, tier[1], _ident(0)), TypeError, "record"),
            ((0, tier[1][:1], _ident(0)), ValueError, "bytes"),
            ((0, tier[1].transpose(0, 1), _ident(0)), ValueError, "contiguous"),
            ((0, tier[1].numpy(), _ident(0)), TypeError, "torch.Tensor"),
            ((0, tier[1].to("meta"), _ident(0)), ValueError, "CPU"),
            ((0, tier[1], (1, None)), TypeError, "identity"),
            ((0, tier[1], (1, None, [])), ValueError, "token ids"),
            ((0, tier[1], (1, None, list(range(BLOCK + 1)))), ValueError, "token ids"),
            ((0, tier[1], (1 << 64, None, [1])), ValueError, "64 bits"),
            ((0, tier[1], (1, -(1 << 63) - 1, [1])), ValueError, "64 bits"),
            ((0, tier[1], (1, None, [1.5])), TypeError, "token id"),
            ((0, tier[1], (1, None, [1 << 63])), ValueError, "token id"),
        ]
        for args, exc, match in bad:
            with pytest.raises(exc, match=match):
                store.write(*args)
            assert store.read(0, out, _ident(0)) and _same(out, tier[0]), args
    with pytest.raises(ValueError, match="does not exist"):
        DiskStore(tmp_path / "missing", 1, 64, block_size=BLOCK, fingerprint="x")
    with pytest.raises(ValueError):
        DiskStore(tmp_path, 0, 64, block_size=BLOCK, fingerprint="x")
    with pytest.raises(TypeError, match="fingerprint"):
        DiskStore(tmp_path, 1, 64, block_size=BLOCK, fingerprint=3)


def test_a_full_disk_fails_at_construction_and_leaves_no_file(tmp_path):
    code = (f"from pagedkv.disk_store import DiskStore\n"
            f"try:\n    DiskStore({str(tmp_path)!r}, 1 << 20, 1 << 30, block_size=16, fingerprint='x')\n"
            f"except OSError as e:\n    print('OSError', e)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.startswith("OSError") and "disk cache" in out.stdout, out
    assert os.listdir(tmp_path) == []
    with pytest.raises(ValueError, match="too large"):
        DiskStore(tmp_path, 1 << 40, 1 << 30, block_size=16, fingerprint="x")


def _persistent(tmp_path, tier, num_records=8, fingerprint="model-a"):
    return DiskStore(tmp_path, num_records, tier[0].numel() * tier.element_size(), block_size=BLOCK,
                     fingerprint=fingerprint, persist=True)


def test_a_persistent_store_keeps_its_records_for_the_next_one(tmp_path):
    tier = _tier(torch.bfloat16, slots=4)
    with _persistent(tmp_path, tier) as store:
        assert store.persistent and os.listdir(tmp_path) == [os.path.basename(store.path)]
        store.write(6, tier[0], _ident(0), b"salt-0")
        store.write(2, tier[1], _ident(1, parent=1000))
        store.write(4, tier[2], _ident(2, parent=1001), None)
        with pytest.raises(ValueError, match="block 0"):
            store.write(5, tier[3], _ident(3, parent=1002), b"salt")
    with _persistent(tmp_path, tier) as again:
        found = again.scan()
        assert [(r.record, r.block_hash, r.parent_hash, r.token_ids, r.cache_salt) for r in found] == [
            (2, 1001, 1000, tuple(range(1, 1 + BLOCK)), b""), (4, 1002, 1001, tuple(range(2, 2 + BLOCK)), b""),
            (6, 1000, None, tuple(range(0, BLOCK)), b"salt-0")]
        out = torch.empty_like(tier[0])
        assert again.read(2, out, _ident(1, parent=1000)) and _same(out, tier[1])
    with _persistent(tmp_path, tier, fingerprint="model-b") as other:     # another model: another file
        assert other.scan() == [] and len(os.listdir(tmp_path)) == 2
    with _persistent(tmp_path, tier, num_records=4) as fewer:            # records past the new end are gone
        assert [r.record for r in fewer.scan()] == [2]
    with _persistent(tmp_path, tier) as grown:
        assert [r.record for r in grown.scan()] == [2]


def test_scan_skips_torn_headers_and_unkept_salts(tmp_path):
    tier = _tier(torch.float32, slots=4)
    with _persistent(tmp_path, tier) as store:
        store.write(0, tier[0], _ident(0))
        store.write(1, tier[1], _ident(5), b"x" * 2000)                   # a salt too long to keep
        store.write(3, tier[2], _ident(1, parent=1000))
        os.pwrite(store.fileno(), b"\x01", 3 * store.stride + 60)        # a flipped byte in record 3's header
        assert [r.record for r in store.scan()] == [0]
        out = torch.empty_like(tier[0])
        assert store.read(1, out, _ident(5)) and _same(out, tier[1])      # it still reads


def test_a_second_process_on_the_same_cache_gets_a_private_file(tmp_path):
    tier = _tier(torch.float16)
    with _persistent(tmp_path, tier) as first:
        first.write(0, tier[0], _ident(0))
        code = (f"from pagedkv.disk_store import DiskStore\n"
                f"s = DiskStore({str(tmp_path)!r}, 8, {first.record_bytes}, block_size={BLOCK}, "
                f"fingerprint='model-a', persist=True)\n"
                f"print(s.persistent, len(s.scan()))\n")
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
        assert out.returncode == 0 and out.stdout.split() == ["False", "0"], out
    assert len(os.listdir(tmp_path)) == 1
    with pytest.raises(TypeError, match="persist"):
        DiskStore(tmp_path, 1, 64, block_size=BLOCK, fingerprint="x", persist="yes")


def test_a_full_disk_leaves_no_persistent_file(tmp_path):
    code = (f"from pagedkv.disk_store import DiskStore\n"
            f"try:\n    DiskStore({str(tmp_path)!r}, 1 << 20, 1 << 30, block_size=16, fingerprint='x', persist=True)\n"
            f"except OSError as e:\n    print('OSError', e)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.startswith("OSError"), out
    assert os.listdir(tmp_path) == []
