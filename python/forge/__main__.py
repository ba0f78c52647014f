"""``python -m forge``: the ``forge-rs`` command line (quantize, inspect, verify, eval).

Runs the same Rust CLI code as the ``forge-rs`` binary, compiled into the extension module, so a
source install without the binary still has the full command line. ``main`` is also the
``forge-rs`` console-script entry point. ``eval`` is parsed here (it runs PyTorch); every other
command goes to the native CLI.
"""

from __future__ import annotations

import argparse
import signal
import sys

from . import _native


def _eval_main(argv: list[str]) -> int:
    """``forge-rs eval MODEL_DIR --text FILE [--ref ORIG_DIR]``: perplexity and samples."""
    import torch

    from .errors import ForgeError
    from .evaluate import evaluate

    p = argparse.ArgumentParser(
        prog="forge-rs eval",
        description="Perplexity over non-overlapping windows and greedy samples of a forged checkpoint, "
        "beside the original (--ref).",
    )
    p.add_argument("model_dir", help="forged checkpoint folder (AWQ, GPTQ v1 or compressed-tensors)")
    p.add_argument("--text", required=True, help="UTF-8 text file to measure perplexity on")
    p.add_argument("--ref", default=None, help="original model folder (bf16, FP8 DeepSeek, ...)")
    p.add_argument("--seqlen", type=int, default=512, help="window length in tokens (default 512)")
    p.add_argument("--max-windows", type=int, default=None, help="evaluate at most this many windows")
    p.add_argument("--device", default="cpu", help="cpu or cuda[:N] (default cpu)")
    p.add_argument("--samples", type=int, default=3, help="greedy samples per model (default 3)")
    p.add_argument("--max-new-tokens", type=int, default=32, help="tokens per sample (default 32)")
    p.add_argument("--dtype", choices=["bfloat16", "float16", "float32"], default="bfloat16")
    p.add_argument("--json", default=None, help="also write the report as JSON to this file")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    args = p.parse_args(argv)
    try:
        report = evaluate(
            args.model_dir,
            args.text,
            ref_dir=args.ref,
            seqlen=args.seqlen,
            max_windows=args.max_windows,
            device=args.device,
            samples=args.samples,
            dtype=getattr(torch, args.dtype),
            max_new_tokens=args.max_new_tokens,
            progress=not args.no_progress,
        )
    except (ForgeError, FileNotFoundError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(report.table())
    if args.json:
        import dataclasses
        import json

        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(dataclasses.asdict(report), f, indent=2)
    return 0


def main(argv: list[str] | None = None) -> int:
    """Runs the CLI on ``argv`` (default ``sys.argv``) and returns its exit code."""
    args = list(sys.argv if argv is None else argv)
    if len(args) > 1 and args[1] == "eval":
        return _eval_main(args[2:])
    if args:
        args[0] = "forge-rs"
    # Ctrl-C stops a native run at once, as it does for the binary; `--resume` continues it.
    prev = signal.signal(signal.SIGINT, signal.SIG_DFL)
    sys.stdout.flush()
    out = _native.cli_main(args)
    if isinstance(out, int):
        return out
    # A calibrated run (--method gptq, or pruning / router statistics from calibration text):
    # the forward pass runs here, in Python.
    signal.signal(signal.SIGINT, prev)
    return _calibrate_main(*out)


def _calibrate_main(model_dir: str, out_dir: str, options: dict, as_json: bool) -> int:
    import json

    from .api import quantize_model
    from .errors import ForgeError

    try:
        r = quantize_model(model_dir, out_dir, **options)
    except KeyboardInterrupt:
        print("forge-rs: interrupted; rerun with --resume to continue", file=sys.stderr)
        return 130
    except (ForgeError, OSError) as exc:
        print(f"forge-rs: error: {exc}", file=sys.stderr)
        return 1
    if as_json:
        print(json.dumps(r.__dict__, indent=2))
    else:
        what = "router statistics" if options.get("stats_only") else f"{r.quantized} linears quantized"
        print(
            f"{what} ({r.arch} family, {r.quantizer}) in {r.seconds:.1f}s into {r.shards} shard(s); "
            f"report: {out_dir}/forge/report.md",
            file=sys.stderr,
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
