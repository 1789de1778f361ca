"""Runs vLLM's `LLM.generate` on the cases of a JSON file and writes each output's tokens, the logprob of
each token and the prompt tokens vLLM served from its prefix cache. tests/test_integration_vllm.py
starts it in a fresh process per setting of PAGEDKV_VLLM_ATTENTION (the plugin is chosen per process);
cases marked "plugin_only" run only with the plugin on.

    python tests/vllm_generate.py CASES.json OUT.json
"""
import gc
import json
import os
import sys


def generate(case: dict) -> list[list[dict]]:
    """The case's prompts through one LLM, `passes` times (later passes hit the prefix cache)."""
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    llm = LLM(model=case["model"], skip_tokenizer_init=True, seed=0, enforce_eager=True, **case["llm"])
    params = SamplingParams(temperature=0.0, max_tokens=case["max_tokens"], ignore_eos=True, logprobs=1,
                            detokenize=False)
    prompts = [TokensPrompt(prompt_token_ids=p) for p in case["prompts"]]
    passes = []
    for _ in range(case.get("passes", 1)):
        outputs = llm.generate(prompts, params, use_tqdm=False)
        passes.append([{"tokens": list(o.outputs[0].token_ids),
                        "logprobs": [lp[t].logprob for lp, t in zip(o.outputs[0].logprobs, o.outputs[0].token_ids)],
                        "cached": o.num_cached_tokens or 0} for o in outputs])
    del llm
    gc.collect()
    return passes


def main(cases_path: str, out_path: str) -> None:
    with open(cases_path) as f:
        cases = json.load(f)
    plugin_on = os.environ.get("PAGEDKV_VLLM_ATTENTION") == "1"
    results = {case["name"]: generate(case) for case in cases if plugin_on or not case.get("plugin_only")}
    with open(out_path, "w") as f:
        json.dump(results, f)


if __name__ == "__main__":
    main(*sys.argv[1:])
