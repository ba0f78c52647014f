"""Prefill (and evaluation) speed of a forged checkpoint on CUDA: one forward pass over
batch x seqlen tokens (no KV cache, the shape of ``forge.evaluate``'s windows and of a
prompt's prefill) through ``forge.load_quantized`` (W4A16), with the runtime's dense route
(``forge.runtime.DENSE_ROUTE``: calls of ``DENSE_MIN_ROWS`` rows or more dequantize, then
cuBLAS) off and at each ``--min-rows`` threshold, against the bf16 original in the same
process: the data behind ``DENSE_MIN_ROWS``. A MoE model also gets a row field with its
experts run one by one (``forge.runtime.GROUPED_TC = False``) instead of the grouped
tensor-core form.

    python benches/bench_prefill.py FORGED_DIR ORIG_DIR [--shapes 1x512 1x2048 4x2048]
        [--min-rows 1024 2048 4096 8192] [--json out.json]

tokens/s = batch * seqlen / the median of 5 timed forwards (CUDA events, after 2 warm-up
forwards). Each row is appended to the JSON file as soon as it is measured, so a failure
(an out-of-memory at the largest shape) keeps the rows before it; the failing row is
recorded with its error.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch


@torch.no_grad()
def forward_seconds(model, ids: torch.Tensor, reps: int = 5) -> float:
    """Median seconds of one forward pass over ``ids`` (logits of every position)."""
    for _ in range(2):
        model(input_ids=ids, use_cache=False)
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        model(input_ids=ids, use_cache=False)
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) / 1e3)
    times.sort()
    return times[len(times) // 2]


def timed(model, ids: torch.Tensor, **settings):
    """(seconds a forward, float32 logits) of the W4A16 ``model`` with ``forge.runtime``'s
    module settings (``DENSE_ROUTE``, ``DENSE_MIN_ROWS``, ``GROUPED_TC``) set as given, and
    restored after."""
    from forge import runtime

    saved = {name: getattr(runtime, name) for name in settings}
    for name, value in settings.items():
        setattr(runtime, name, value)
    try:
        t = forward_seconds(model, ids)
        with torch.no_grad():
            return t, model(input_ids=ids, use_cache=False).logits.float()
    finally:
        for name, value in saved.items():
            setattr(runtime, name, value)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("forged")
    p.add_argument("original")
    p.add_argument("--shapes", nargs="+", default=["1x512", "1x2048", "4x2048"], help="BATCHxSEQLEN")
    p.add_argument(
        "--min-rows",
        type=int,
        nargs="+",
        default=[1024, 2048, 4096, 8192],
        help="DENSE_MIN_ROWS values to run the dense route at (one row field each)",
    )
    p.add_argument("--json", default="bench_prefill.json")
    args = p.parse_args()

    from transformers import AutoModelForCausalLM

    import forge

    out = Path(args.json)
    rows: list[dict] = []

    def add(row: dict) -> None:
        rows.append(row)
        out.write_text(json.dumps(dict(device=torch.cuda.get_device_name(), rows=rows), indent=1) + "\n")
        print(json.dumps(row), flush=True)

    w4, _ = forge.load_quantized(args.forged, device="cuda", tokenizer=False, decode=False)
    bf16 = AutoModelForCausalLM.from_pretrained(args.original, dtype=torch.bfloat16).cuda().eval()
    vocab = bf16.config.vocab_size
    moe = any(isinstance(m, forge.runtime.AwqExperts) for m in w4.modules())
    for shape in args.shapes:
        batch, seqlen = (int(v) for v in shape.split("x"))
        ids = torch.randint(0, vocab, (batch, seqlen), generator=torch.Generator().manual_seed(0)).cuda()
        row = dict(batch=batch, seqlen=seqlen, min_rows=args.min_rows)
        try:
            tokens = batch * seqlen
            row["bf16_tok_s"] = tokens / forward_seconds(bf16, ids)
            t_fused, fused = timed(w4, ids, DENSE_ROUTE=False)
            row["w4a16_fused_tok_s"] = tokens / t_fused
            if moe:
                # the experts one by one after reading the counts back, instead of the grouped
                # tensor-core form
                t_loop, loop = timed(w4, ids, DENSE_ROUTE=False, GROUPED_TC=False)
                row["w4a16_moe_loop_tok_s"] = tokens / t_loop
                row["grouped_vs_moe_loop"] = t_loop / t_fused
                row["moe_loop_logits_max_abs_diff"] = float((loop - fused).abs().max())
                del loop
            for rows_min in args.min_rows:
                t, routed = timed(w4, ids, DENSE_ROUTE=True, DENSE_MIN_ROWS=rows_min)
                row[f"w4a16_route{rows_min}_tok_s"] = tokens / t
                row[f"route{rows_min}_vs_fused"] = t_fused / t
                # the same weights either way: the logits differ only by the GEMMs' summation
                # order (and what that flips downstream, e.g. a MoE router's choices)
                row[f"route{rows_min}_logits_max_abs_diff"] = float((routed - fused).abs().max())
                del routed
            row["logits_max_abs"] = float(fused.abs().max())
            del fused
        except Exception as e:  # noqa: BLE001 - record the failure, keep the other rows
            row["error"] = f"{type(e).__name__}: {e}"
            torch.cuda.empty_cache()
        add(row)


if __name__ == "__main__":
    main()
