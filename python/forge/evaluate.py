"""``evaluate``: perplexity and greedy samples of a forged checkpoint, beside its original.

Perplexity is measured over non-overlapping windows of ``seqlen`` tokens of one text file
(labels = input ids: every token after the first of a window is predicted), the way the
README's numbers are. The forged folder runs through :func:`forge.load_quantized` (W4A16
modules); the reference through transformers' ``from_pretrained``, except FP8 DeepSeek
folders (dequantized per ``weight_block_size`` block here, as transformers' own CPU path
gets partial blocks wrong) and AWQ folders (:func:`forge.load_dequantized_model`).
"""

from __future__ import annotations

import math
import os
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from .errors import CheckpointError, InvalidValueError

__all__ = ["ModelEval", "EvalReport", "evaluate", "load_reference"]


@dataclass
class ModelEval:
    """Perplexity and samples of one model."""

    model_dir: str
    kind: str
    """How it was loaded: ``w4a16`` (load_quantized), ``fp8-dequantized``, ``awq-dequantized``, ``dense``."""
    perplexity: float
    nll: float
    """Mean negative log-likelihood per predicted token (nats)."""
    tokens: int
    """Predicted tokens (``windows * (seqlen - 1)``)."""
    seconds: float
    """Wall time of the perplexity pass."""
    samples: list[str] = field(default_factory=list)
    """Greedy continuations of the prompts, in the order of ``EvalReport.prompts``."""


@dataclass
class EvalReport:
    """Result of :func:`evaluate`."""

    text_file: str
    seqlen: int
    windows: int
    prompts: list[str]
    forged: ModelEval
    reference: ModelEval | None = None

    def table(self) -> str:
        """Side-by-side summary as plain text."""
        rows = [("", "forged") + (("reference",) if self.reference else ())]
        evals = [self.forged] + ([self.reference] if self.reference else [])
        rows.append(("perplexity",) + tuple(f"{e.perplexity:.4f}" for e in evals))
        rows.append(("nll/token",) + tuple(f"{e.nll:.5f}" for e in evals))
        rows.append(("tokens",) + tuple(str(e.tokens) for e in evals))
        rows.append(("seconds",) + tuple(f"{e.seconds:.1f}" for e in evals))
        rows.append(("loaded as",) + tuple(e.kind for e in evals))
        width = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
        lines = [f"{self.text_file}: {self.windows} windows of {self.seqlen} tokens"]
        lines += ["  ".join(c.ljust(w) for c, w in zip(r, width, strict=True)).rstrip() for r in rows]
        if self.reference is not None and self.reference.perplexity > 0:
            delta = 100.0 * (self.forged.perplexity / self.reference.perplexity - 1.0)
            lines.append(f"forged vs reference perplexity: {delta:+.2f} %")
        for i, prompt in enumerate(self.prompts):
            lines.append(f"--- sample {i + 1}: {prompt!r}")
            for e, label in zip(evals, ("forged", "reference"), strict=False):
                if i < len(e.samples):
                    lines.append(f"  {label:9s} {e.samples[i]!r}")
        return "\n".join(lines)


def _is_fp8(config: dict) -> bool:
    qc = config.get("quantization_config")
    return isinstance(qc, dict) and str(qc.get("quant_method", "")).lower() == "fp8"


def load_reference(model_dir: str | os.PathLike, device: str = "cpu", dtype: torch.dtype = torch.bfloat16):
    """The original model of a comparison: ``(model, kind)``.

    FP8 block-quantized folders (DeepSeek's release format) are dequantized by their
    ``weight_block_size`` (partial edge blocks included); AWQ folders through
    :func:`forge.load_dequantized_model`; anything else with ``from_pretrained``.
    """
    from .loading import load_fp8_dequantized, read_checkpoint_config

    root = Path(model_dir)
    config = read_checkpoint_config(root)
    qc = config.get("quantization_config")
    method = str(qc.get("quant_method", "")).lower() if isinstance(qc, dict) else ""
    if method == "fp8":
        return load_fp8_dequantized(root, device=device, dtype=dtype), "fp8-dequantized"
    if method == "awq":
        from .checkpoint import load_dequantized_model

        return load_dequantized_model(root, dtype=dtype).to(device), "awq-dequantized"
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(root), dtype=dtype)
    return model.to(device).eval(), "dense"


def _encode(tokenizer, text: str) -> list[int]:
    if hasattr(tokenizer, "encode"):
        try:
            return list(tokenizer.encode(text, add_special_tokens=False))
        except TypeError:
            return list(tokenizer.encode(text))
    return list(tokenizer(text))


@torch.no_grad()
def _perplexity(model, windows: torch.Tensor, device, progress: bool, desc: str) -> tuple[float, int, float]:
    from tqdm.auto import tqdm

    total, count = 0.0, 0
    t0 = time.perf_counter()
    for row in tqdm(windows, desc=desc, unit="win", disable=not progress):
        ids = row[None].to(device)
        logits = model(input_ids=ids).logits[0, :-1].float()
        total += float(torch.nn.functional.cross_entropy(logits, ids[0, 1:], reduction="sum"))
        count += ids.shape[1] - 1
    return total / count, count, time.perf_counter() - t0


@torch.no_grad()
def _samples(model, tokenizer, prompts: list[list[int]], device, max_new_tokens: int) -> list[str]:
    out = []
    for ids in prompts:
        x = torch.tensor([ids], device=device)
        y = model.generate(
            x,
            attention_mask=torch.ones_like(x),
            max_new_tokens=max_new_tokens,
            do_sample=False,
            pad_token_id=getattr(model.generation_config, "eos_token_id", None) or 0,
        )
        new = y[0, len(ids) :].tolist()
        out.append(tokenizer.decode(new) if hasattr(tokenizer, "decode") else str(new))
    return out


def evaluate(
    model_dir: str | os.PathLike,
    text_file: str | os.PathLike,
    ref_dir: str | os.PathLike | None = None,
    seqlen: int = 512,
    max_windows: int | None = None,
    device: str = "cpu",
    samples: int = 3,
    *,
    dtype: torch.dtype = torch.bfloat16,
    max_new_tokens: int = 32,
    prompt_tokens: int = 16,
    tokenizer=None,
    progress: bool = True,
) -> EvalReport:
    """Perplexity of the forged ``model_dir`` on ``text_file`` and ``samples`` greedy samples.

    With ``ref_dir`` the original model is measured on the same windows and prompts
    (:func:`load_reference`). The text is tokenized once with the forged folder's tokenizer
    (else ``ref_dir``'s, else ``tokenizer``) and cut into ``min(max_windows, len // seqlen)``
    non-overlapping windows; prompts are the first ``prompt_tokens`` tokens of windows spread
    evenly over the text.
    """
    from .loading import load_quantized

    if seqlen < 2:
        raise InvalidValueError(f"seqlen: must be >= 2, got {seqlen}")
    if max_windows is not None and max_windows < 1:
        raise InvalidValueError(f"max_windows: must be >= 1 or None, got {max_windows}")
    text_path = Path(text_file)
    if not text_path.is_file():
        raise FileNotFoundError(f"text_file: {text_path} does not exist")
    model, tok = load_quantized(model_dir, device=device, dtype=dtype, decode=False)  # prefill only
    if tok is None and ref_dir is not None:
        from .loading import _tokenizer

        tok = _tokenizer(Path(ref_dir))
    tok = tokenizer if tokenizer is not None else tok
    if tok is None:
        raise CheckpointError(f"{model_dir}: no tokenizer in the folder (pass tokenizer= or ref_dir=)")
    ids = _encode(tok, text_path.read_text(encoding="utf-8"))
    n = len(ids) // seqlen
    if max_windows is not None:
        n = min(n, max_windows)
    if n == 0:
        raise InvalidValueError(f"text_file: {len(ids)} tokens, fewer than one window of seqlen {seqlen}")
    windows = torch.tensor(ids[: n * seqlen], dtype=torch.long).view(n, seqlen)
    picks = sorted({round(i * (n - 1) / max(samples - 1, 1)) for i in range(samples)}) if samples > 0 else []
    prompts = [windows[i, :prompt_tokens].tolist() for i in picks]
    prompt_text = [tok.decode(p) if hasattr(tok, "decode") else str(p) for p in prompts]

    def run(m, kind: str, where) -> ModelEval:
        nll, count, secs = _perplexity(m, windows, device, progress, f"ppl {kind}")
        return ModelEval(
            str(where),
            kind,
            math.exp(nll),
            nll,
            count,
            secs,
            _samples(m, tok, prompts, device, max_new_tokens),
        )

    forged = run(model, "w4a16", model_dir)
    del model
    reference = None
    if ref_dir is not None:
        ref, kind = load_reference(ref_dir, device=device, dtype=dtype)
        reference = run(ref, kind, ref_dir)
    return EvalReport(str(text_path), seqlen, n, prompt_text, forged, reference)
