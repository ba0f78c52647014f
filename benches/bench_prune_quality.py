"""Expert pruning quality: held-out perplexity of the trained tiny DeepSeek-V3 MoE pruned by
each criterion, with and without 4-bit GPTQ on top (issue 11's test bed).

Model: ``$FORGE_ASSETS/deepseek-v3-tiny/bf16`` (16 routed experts per MoE layer, 4 groups,
top-4; its experts specialise by text domain, see the asset's README). Calibration: the
Python-docs training split (one domain). Evaluation: the Python-docs held-out split (in
domain) and the King James New Testament (the other domain), the first ``--windows``
non-overlapping 512-token windows of each, float32.

Rows: ``fp`` (unpruned), then for each criterion (``reap``, ``frequency``, ``random``) and
pruning ratio (0.25 → 12 kept, 0.5 → 8 kept; the same number from every routing group):

* ``none``: bf16 pruned checkpoint, experts chosen from ONE ``stats_only`` run's statistics
  (``router_stats=``), written natively with no forward;
* ``gptq``: pruning and GPTQ (g128, act_order) in one calibrated run (experts chosen layer by
  layer from statistics of the already pruned and quantized earlier layers).

Each row is appended to the JSON file as soon as it is measured (rerunning skips finished
rows); ``--plot`` writes perplexity vs pruning ratio per criterion as a PNG.

Run:  python benches/bench_prune_quality.py [--windows 32] [--nsamples 128] [--device cpu]
      [--json benches/results-prune-quality-cpu.json] [--plot benches/results-prune-quality-cpu.png]
"""

from __future__ import annotations

import argparse
import math
import sys
import time
import warnings
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_quality as bq  # noqa: E402  (texts, result rows, dequantized copies)

import forge  # noqa: E402
from forge.evaluate import _perplexity, load_reference  # noqa: E402

CRITERIA = ["reap", "frequency", "random"]
RATIOS = [0.25, 0.5]


def perplexities(
    folder: Path, texts: dict[str, Path], tokenizer, windows: int, device: str
) -> dict[str, float]:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model, _ = load_reference(folder, device=device, dtype=torch.float32)
    out = {}
    for name in ("pydocs_eval", "kjv_nt"):
        if name in texts:
            w = bq.windows_of(tokenizer, texts[name], 512, windows)
            nll, _, _ = _perplexity(model, w, device, False, name)
            out[name] = math.exp(nll)
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--windows", type=int, default=32)
    p.add_argument("--nsamples", type=int, default=128)
    p.add_argument("--seqlen", type=int, default=512)
    p.add_argument("--device", default="cpu")
    p.add_argument("--json", type=Path, default=Path("benches/results-prune-quality-cpu.json"))
    p.add_argument("--plot", type=Path, default=None)
    p.add_argument("--work", type=Path, default=Path("/tmp/forge-prune-bench"))
    p.add_argument("--docs", default=None)
    p.add_argument("--no-gptq", action="store_true", help="pruning only")
    args = p.parse_args()
    from transformers import AutoTokenizer

    src = bq.ASSETS / "bf16"
    texts = bq.build_texts(args.work / "texts", args.docs)
    tokenizer = AutoTokenizer.from_pretrained(str(src))
    rows = bq.Rows(args.json, {"model": str(src), "windows": args.windows, "nsamples": args.nsamples})
    common = dict(group_size=128, device=args.device, progress=False, overwrite=True)
    cal = dict(calib=str(texts["pydocs_train"]), nsamples=args.nsamples, seqlen=args.seqlen)

    def row(variant: str, criterion: str, ratio: float, quant: str, folder: Path | None, secs: float | None):
        for text, ppl in perplexities(folder or src, texts, tokenizer, args.windows, args.device).items():
            rows.add(
                dict(model="ds-v3-tiny", variant=variant, text=text, windows=args.windows, nsamples=args.nsamples,
                     seqlen=args.seqlen, criterion=criterion, prune_ratio=ratio, quant=quant, ppl=ppl, run_s=secs)
            )  # fmt: skip
            print(f"  {variant:24s} {text:12s} {ppl:9.3f}", flush=True)

    if rows.find(variant="fp", text="pydocs_eval", windows=args.windows, nsamples=args.nsamples) is None:
        row("fp", "", 0.0, "none", None, None)
    stats = args.work / "stats"
    if not (stats / "forge/router_stats.safetensors").is_file():
        forge.prune_model(str(src), str(stats), stats_only=True, **cal, **common)
    for criterion in CRITERIA:
        for ratio in RATIOS:
            for quant in ("none",) if args.no_gptq else ("none", "gptq"):
                variant = f"{criterion}-{ratio}-{quant}"
                if rows.find(
                    variant=variant, text="pydocs_eval", windows=args.windows, nsamples=args.nsamples
                ):
                    continue
                out = args.work / variant
                t0 = time.perf_counter()
                if quant == "none":
                    forge.prune_model(str(src), str(out), router_stats=str(stats / "forge/router_stats.safetensors"),
                                      prune_ratio=ratio, criterion=criterion, **common)  # fmt: skip
                    folder = out
                else:
                    forge.prune_model(str(src), str(out), method="gptq", act_order=True, prune_ratio=ratio,
                                      criterion=criterion, **cal, **common)  # fmt: skip
                    folder = bq.dense_copy(out, args.work / f"{variant}-dense")
                row(variant, criterion, ratio, quant, folder, time.perf_counter() - t0)
    if args.plot:
        plot(rows.rows, args.plot)
    return 0


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    texts = [t for t in ("pydocs_eval", "kjv_nt") if any(r["text"] == t for r in rows)]
    fig, axes = plt.subplots(1, len(texts), figsize=(5 * len(texts), 3.8), squeeze=False)
    for ax, text in zip(axes[0], texts, strict=True):
        fp = next((r["ppl"] for r in rows if r["variant"] == "fp" and r["text"] == text), None)
        for criterion in CRITERIA:
            for quant, style in (("none", "-"), ("gptq", "--")):
                pts = sorted(
                    (r["prune_ratio"], r["ppl"])
                    for r in rows
                    if r["text"] == text and r.get("criterion") == criterion and r.get("quant") == quant
                )
                if pts and fp is not None:
                    pts = [(0.0, fp)] + pts
                    ax.plot(*zip(*pts, strict=True), style, marker="o", label=f"{criterion} {quant}")
        ax.set_title(f"{text} (calibrated on Python docs)")
        ax.set_xlabel("fraction of routed experts pruned")
        ax.set_ylabel("perplexity")
        ax.set_yscale("log")
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


if __name__ == "__main__":
    sys.exit(main())
