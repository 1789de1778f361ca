"""LLM.stats(): prefix-cache hit metrics with the hit rate, KV usage, queues, speculative counters; and the
optional Prometheus endpoint that exports them under vLLM-like names prefixed `pagedkv:`."""
import urllib.error
import urllib.request

import pytest

from engine_fixtures import save_tiny_llama, shared_prefix_prompts
from pagedkv.engine import LLM, SamplingParams

PARAMS = SamplingParams(max_tokens=6, ignore_eos=True)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny_llama_stats")
    model = save_tiny_llama(path)
    return str(path), shared_prefix_prompts(model.config.vocab_size)


def test_stats_report_hits_usage_and_queues(tiny):
    path, prompts = tiny
    llm = LLM(path, block_size=8)
    fresh = llm.stats()
    assert fresh["queries"] == fresh["hits"] == 0 and fresh["hit_rate"] == 0.0 and fresh["kv_cache_usage"] == 0.0
    for p in prompts:
        llm.add_request(p, PARAMS)
    llm.step()                                  # prompts admitted together: no hits among them yet
    during = llm.stats()
    assert during["num_running"] + during["num_waiting"] == len(prompts) and during["num_swapped"] == 0
    assert during["kv_cache_usage"] == during["used_blocks"] / llm.num_blocks > 0
    while llm.has_unfinished():
        llm.step()
    llm.generate(prompts, PARAMS)               # every prompt's full blocks are cached now
    s = llm.stats()
    assert s["queries"] == 2 * sum(len(p) for p in prompts)
    assert 0 < s["hits"] < s["queries"] and s["hit_rate"] == s["hits"] / s["queries"]
    assert s["hits"] == s["cached_prompt_tokens"]
    assert s["generation_tokens"] == 2 * len(prompts) * PARAMS.max_tokens
    assert s["num_running"] == s["num_waiting"] == 0 and s["kv_cache_usage"] == 0.0
    assert s["num_preemptions"] == 0 and s["spec_draft_tokens"] == 0 and s["spec_acceptance_rate"] == 0.0


def scrape(port: int) -> dict[str, float]:
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    values = {}
    for line in text.splitlines():
        if line.startswith("pagedkv:"):
            name_labels, value = line.rsplit(" ", 1)
            name, labels = name_labels.split("{", 1)
            assert labels.startswith('model_name="'), line
            values[name] = float(value)
    return values


def test_prometheus_endpoint_mirrors_stats(tiny):
    pytest.importorskip("prometheus_client", reason="metrics need prometheus_client (pip install 'pagedkv[metrics]')")
    path, prompts = tiny
    with LLM(path, block_size=8, metrics_port=0, num_blocks=20, speculative="ngram",
             num_speculative_tokens=2) as llm:
        port = llm.metrics.port
        llm.generate(prompts, PARAMS)
        llm.generate(prompts, PARAMS)
        m, s = scrape(port), llm.stats()
        assert m["pagedkv:prefix_cache_queries_total"] == s["queries"] > 0
        assert m["pagedkv:prefix_cache_hits_total"] == s["hits"] > 0
        assert m["pagedkv:prefix_cache_hit_blocks_total"] == s["hit_blocks"]
        assert m["pagedkv:prefix_cache_evictions_total"] == s["evictions"] > 0
        assert m["pagedkv:generation_tokens_total"] == s["generation_tokens"] == 2 * len(prompts) * 6
        assert m["pagedkv:spec_decode_num_draft_tokens_total"] == s["spec_draft_tokens"]
        assert m["pagedkv:kv_cache_usage_perc"] == 0.0 and m["pagedkv:num_requests_running"] == 0
        llm.add_request(prompts[0], PARAMS)
        llm.step()
        m = scrape(port)
        assert m["pagedkv:kv_cache_usage_perc"] == llm.stats()["kv_cache_usage"] > 0
        assert m["pagedkv:num_requests_running"] == 1
    with pytest.raises(urllib.error.URLError):     # close() stopped the server
        scrape(port)


def test_metrics_option_is_checked(tiny, monkeypatch):
    path, _ = tiny
    with pytest.raises(ValueError, match="metrics_port"):
        LLM(path, metrics_port=70000)
    with pytest.raises(TypeError, match="metrics_port"):
        LLM(path, metrics_port="9000")
    monkeypatch.setitem(__import__("sys").modules, "prometheus_client", None)
    with pytest.raises(ImportError, match=r"pagedkv\[metrics\]"):
        LLM(path, metrics_port=0)
