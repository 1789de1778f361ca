"""One fingerprint names what a KV block's bytes mean (kv_identity.kv_fingerprint): the disk tier keeps its
digest in every record's header and KV transfer compares its fields in the handshake. It is equal for two
engines that would write the same bytes and differs for every field that changes them."""
import pytest

from engine_fixtures import save_tiny_llama
from pagedkv.engine import LLM
from pagedkv.engine.kv.identity import fingerprint_digest, kv_fingerprint
from pagedkv.engine.kv.transfer import FingerprintMismatch, check_fingerprint, fingerprint


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    a, b = tmp_path_factory.mktemp("id_a"), tmp_path_factory.mktemp("id_b")
    save_tiny_llama(a, seed=0)
    save_tiny_llama(b, seed=1)     # the same shapes, other weights
    return str(a), str(b)


def test_the_fingerprint_names_each_field_that_changes_the_bytes(models):
    a, b = models
    base = kv_fingerprint(LLM(a, block_size=8, num_blocks=16))
    assert base == kv_fingerprint(LLM(a, block_size=8, num_blocks=32)), "the pool size does not change a block"
    for other, field_name in ((LLM(b, block_size=8, num_blocks=16), "model"),
                              (LLM(a, block_size=16, num_blocks=16), "block_size"),
                              (LLM(a, block_size=8, num_blocks=16, dtype="bfloat16"), "kv_dtype")):
        theirs = kv_fingerprint(other)
        assert fingerprint_digest(theirs) != fingerprint_digest(base)
        with pytest.raises(FingerprintMismatch) as info:
            check_fingerprint(base, theirs)
        assert info.value.field in (field_name, "cache_layout")


def test_disk_records_and_kv_transfer_share_the_fingerprint(models, tmp_path):
    a, _ = models
    llm = LLM(a, block_size=8, num_blocks=16, host_cache_bytes=1 << 20, disk_cache_dir=str(tmp_path),
              disk_cache_bytes=4 << 20)
    same = LLM(a, block_size=8, num_blocks=16, host_cache_bytes=1 << 20, disk_cache_dir=str(tmp_path),
               disk_cache_bytes=4 << 20)
    try:
        assert llm.disk_tier.store.fingerprint == same.disk_tier.store.fingerprint
        transfer = fingerprint(llm)
        assert transfer.pop("protocol") >= 1
        assert kv_fingerprint(llm) == transfer
    finally:
        llm.close()
        same.close()
