"""Runs folders through vLLM and saves their raw logits (tests/test_vllm_plugin.py's vLLM side).

Runs under the python of a vLLM install (FORGE_VLLM_PYTHON), never forge's venv: it imports only
torch and vLLM (forge's plugin is loaded by vLLM itself, through its entry point).

    python tests/vllm_plugin_worker.py OUT.pt MODEL [MODEL ...] [--dtype float32]

Each MODEL runs in its own ``vllm.LLM`` (CPU, enforce_eager, max_model_len 128, tokenizer skipped,
fixed token-id prompts, ``logprobs_mode="raw_logits"``, full-vocabulary prompt logprobs and greedy
logprobs), one after the other in this process. OUT.pt gets {"prompts": [...], MODEL: {"ok": True,
"prompt_logits": [...], "tokens": [...], "gen_logits": [...]} or {"ok": False, "error": "..."}}.
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
import traceback
from pathlib import Path

# the prompts and the logprob densifier of benches/vllm_check.py (same vLLM-side code, one place)
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benches"))
from vllm_check import _dense, prompts  # noqa: E402


def run_one(model: str, dtype: str, max_new: int) -> dict:
    from vllm import LLM, SamplingParams

    cfg = json.loads((Path(model) / "config.json").read_text())
    vocab = int(cfg["vocab_size"])
    llm = LLM(
        model=model,
        dtype=dtype,
        enforce_eager=True,
        max_model_len=128,
        skip_tokenizer_init=True,
        max_logprobs=-1,
        logprobs_mode="raw_logits",
        seed=0,
    )
    try:
        sp = SamplingParams(
            temperature=0.0, max_tokens=max_new, prompt_logprobs=-1, logprobs=-1, detokenize=False
        )
        ps = prompts(vocab)
        outs = llm.generate([{"prompt_token_ids": p} for p in ps], sp, use_tqdm=False)
        res = {"ok": True, "prompts": ps, "prompt_logits": [], "tokens": [], "gen_logits": []}
        for o in outs:
            c = o.outputs[0]
            res["prompt_logits"].append(_dense(o.prompt_logprobs, vocab))
            res["tokens"].append(list(c.token_ids))
            res["gen_logits"].append(_dense(c.logprobs, vocab))
        return res
    finally:
        llm.llm_engine.engine_core.shutdown()
        del llm
        gc.collect()


def main() -> None:
    import torch

    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("models", nargs="+")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--max-new-tokens", type=int, default=4)
    args = ap.parse_args()
    results = {}
    for m in args.models:
        try:
            results[m] = run_one(m, args.dtype, args.max_new_tokens)
        except Exception as exc:  # a load error is a result too (the out-of-range map test)
            results[m] = {
                "ok": False,
                "error": f"{type(exc).__name__}: {exc}",
                "trace": traceback.format_exc(),
            }
        torch.save(results, args.out)


if __name__ == "__main__":
    main()
