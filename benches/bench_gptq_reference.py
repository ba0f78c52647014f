"""Per-linear GPTQ error of forge against the GPTQ authors' algorithm on the same layer inputs.

Runs the calibrated run on the trained deepseek-v3-tiny (``../shared/assets``) with a tap that
records every linear's Hessian, then solves each linear again with a plain-PyTorch port of
the reference ``GPTQ.fasterquant`` (blocked Algorithm 1, per-group min/max grid that
includes 0, found when the group starts, on the already-updated weights) and compares the
relative output errors ``tr(ΔW H ΔWᵀ) / tr(W H Wᵀ)``. Target: forge ≤ 1.02 × reference.

    python benches/bench_gptq_reference.py [--calib FILE] [--nsamples 16] [--seqlen 256] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import math
import tempfile
from pathlib import Path

import torch

import forge
from forge import calibrate

ASSET = Path(__file__).resolve().parents[1].parent / "shared" / "assets" / "deepseek-v3-tiny" / "bf16"


def find_params(x: torch.Tensor, maxq: int = 15):
    xmin = torch.minimum(x.min(1).values, torch.zeros(1))
    xmax = torch.maximum(x.max(1).values, torch.zeros(1))
    tmp = (xmin == 0) & (xmax == 0)
    xmin[tmp], xmax[tmp] = -1, +1
    scale = (xmax - xmin) / maxq
    zero = torch.round(-xmin / scale)
    return scale[:, None], zero[:, None]


def fasterquant(w: torch.Tensor, h: torch.Tensor, g: int, blocksize: int = 128, percdamp: float = 0.01):
    """The reference loop (float64 here), returning the dequantized weight."""
    w = w.double().clone()
    h = h.double().clone()
    n, k = w.shape
    dead = torch.diag(h) == 0
    h[dead, dead] = 1
    w[:, dead] = 0
    damp = percdamp * torch.mean(torch.diag(h))
    h += damp * torch.eye(k, dtype=h.dtype)
    hinv = torch.linalg.cholesky(torch.cholesky_inverse(torch.linalg.cholesky(h)), upper=True)
    q = torch.zeros_like(w)
    scale = zero = None
    for i1 in range(0, k, blocksize):
        i2 = min(i1 + blocksize, k)
        w1 = w[:, i1:i2].clone()
        q1 = torch.zeros_like(w1)
        err1 = torch.zeros_like(w1)
        hinv1 = hinv[i1:i2, i1:i2]
        for i in range(i2 - i1):
            col = w1[:, i]
            if (i1 + i) % g == 0:
                scale, zero = find_params(w[:, i1 + i : i1 + i + g].float())
                scale, zero = scale.double(), zero.double()
            qc = (torch.clamp(torch.round(col[:, None] / scale) + zero, 0, 15) - zero) * scale
            q1[:, i] = qc[:, 0]
            e = (col - q1[:, i]) / hinv1[i, i]
            w1[:, i:] -= e[:, None] @ hinv1[i, i:][None, :]
            err1[:, i] = e
        q[:, i1:i2] = q1
        w[:, i2:] -= err1 @ hinv[i1:i2, i2:]
    return q


def rel_err(w, wq, h):
    d = (w - wq).double()
    return float(((d @ h.double()) * d).sum() / ((w.double() @ h.double()) * w.double()).sum())


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--calib", default=None, help="calibration text (default: this repo's README and docs)")
    ap.add_argument("--nsamples", type=int, default=16)
    ap.add_argument("--seqlen", type=int, default=256)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    if not ASSET.is_dir():
        print(f"missing {ASSET}")
        return 2
    root = Path(tempfile.mkdtemp(prefix="forge-ref-"))
    calib = Path(args.calib) if args.calib else root / "calib.txt"
    if not args.calib:
        repo = Path(__file__).resolve().parents[1]
        calib.write_text(
            "\n\n".join(p.read_text() for p in [repo / "README.md", *sorted((repo / "docs").glob("*.md"))])
        )
    hs: dict[str, torch.Tensor] = {}
    calibrate.TAP = lambda ev, **d: (
        hs.__setitem__(d["module"], d["hessian"].double().cpu()) if ev == "hessian" else None
    )
    out = root / "out"
    forge.quantize_model(ASSET, out, method="gptq", calib=calib, nsamples=args.nsamples, seqlen=args.seqlen,
                         group_size=128, progress=False)  # fmt: skip
    calibrate.TAP = None
    rows = json.loads((out / "forge" / "report.json").read_text())["linears"]
    from safetensors.torch import load_file

    src = load_file(ASSET / "model.safetensors")
    results = []
    for r in rows:
        name = r["module"]
        if r["method"] != "gptq" or name not in hs:
            continue
        if "+" in name:  # joint gate+up solve of an expert
            base, leaves = name.rsplit(".", 1)
            w = torch.cat([src[f"{base}.{leaf}.weight"] for leaf in leaves.split("+")]).float()
        else:
            w = src[f"{name}.weight"].float()
        ref = fasterquant(w, hs[name], 128)
        e_ref = rel_err(w, ref, hs[name])
        results.append(
            {"module": name, "forge": r["err_gptq"], "reference": e_ref, "ratio": r["err_gptq"] / e_ref}
        )
    ratios = [x["ratio"] for x in results]
    gmean = math.exp(sum(math.log(x) for x in ratios) / len(ratios))
    summary = {"linears": len(ratios), "geomean_ratio": gmean, "max_ratio": max(ratios),
               "share_within_1.02": sum(x <= 1.02 for x in ratios) / len(ratios)}  # fmt: skip
    print(json.dumps(summary, indent=1))
    if args.json:
        Path(args.json).write_text(json.dumps({"summary": summary, "linears": results}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
