"""Decode tokens/s of a forged checkpoint (forge.load_quantized, W4A16) vs its bf16 original.

    python benches/bench_runtime.py FORGED_DIR ORIG_DIR [--device cpu|cuda] [--batch 1 16]
        [--new-tokens 32] [--json out.json]

Greedy decoding with ``model.generate`` (``min_new_tokens = max_new_tokens``, so every row
decodes the same count) after a 16-token prompt; tokens/s = batch * new_tokens / wall time of
the generate call minus the prefill-only call. On CUDA both models use a static KV cache and
``torch.compile(mode="reduce-overhead")`` (CUDA graphs). Each row is appended to the JSON
file as soon as it is measured.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

import forge


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def _graphed(forward):
    """``forward`` compiled with CUDA graphs; each call starts a new graph step and the logits
    are copied out, so generate's next step may overwrite the graph's buffers."""
    compiled = torch.compile(forward, mode="reduce-overhead")

    def step(*args, **kwargs):
        torch.compiler.cudagraph_mark_step_begin()
        out = compiled(*args, **kwargs)
        out.logits = out.logits.clone()
        return out

    return step


@torch.no_grad()
def decode_rate(model, batch: int, new_tokens: int, device: str, vocab: int) -> float:
    ids = torch.randint(0, vocab, (batch, 16), generator=torch.Generator().manual_seed(0)).to(device)
    kw = dict(do_sample=False, attention_mask=torch.ones_like(ids), pad_token_id=0)
    if device.startswith("cuda"):
        kw["cache_implementation"] = "static"
    model.generate(ids, max_new_tokens=4, min_new_tokens=4, **kw)  # warm-up (compiles, converts)
    times = {}
    for n in (1, new_tokens + 1):
        _sync(device)
        t0 = time.perf_counter()
        model.generate(ids, max_new_tokens=n, min_new_tokens=n, **kw)
        _sync(device)
        times[n] = time.perf_counter() - t0
    return batch * new_tokens / (times[new_tokens + 1] - times[1])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("forged")
    p.add_argument("original")
    p.add_argument("--device", default="cpu")
    p.add_argument("--batch", type=int, nargs="+", default=[1, 16])
    p.add_argument("--new-tokens", type=int, default=32)
    p.add_argument(
        "--no-graphs", dest="graphs", action="store_false", help="eager (no torch.compile / CUDA graphs)"
    )
    p.add_argument("--json", default="bench_runtime.json")
    args = p.parse_args()
    from forge.evaluate import load_reference

    rows: list[dict] = []
    out = Path(args.json)
    loaders = {
        "w4a16": lambda: forge.load_quantized(args.forged, device=args.device, tokenizer=False)[0],
        "bf16": lambda: load_reference(args.original, device=args.device)[0],
    }
    for name, load in loaders.items():
        model = load().eval()
        if args.device.startswith("cuda") and args.graphs:
            model.forward = _graphed(model.forward)
        vocab = model.config.get_text_config().vocab_size
        for batch in args.batch:
            rate = decode_rate(model, batch, args.new_tokens, args.device, vocab)
            row = {"model": name, "device": args.device, "batch": batch, "new_tokens": args.new_tokens}
            row["tokens_per_s"] = round(rate, 2)
            row["torch_threads"] = torch.get_num_threads()
            rows.append(row)
            out.write_text(json.dumps(rows, indent=2))
            print(json.dumps(row), flush=True)
        del model


if __name__ == "__main__":
    main()
