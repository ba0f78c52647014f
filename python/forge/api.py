"""`quantize_model`, `inspect` and `verify`: the Python front door of the quantization run.

Glue only: options are passed to the Rust orchestrator (`forge-run`, the same code as the
``forge-rs`` command line), which streams the checkpoint layer by layer with the GIL released.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any

from . import _native

__all__ = [
    "QuantizeReport",
    "VerifyReport",
    "default_options",
    "quantize_model",
    "prune_model",
    "inspect",
    "verify",
]


@dataclass(frozen=True)
class QuantizeReport:
    """What a finished run did."""

    out_dir: str
    arch: str
    """Detected model family (``deepseek``, ``qwen-moe``, ``mixtral``, ``generic``)."""
    quantizer: str
    """``rtn-range``, ``rtn-mse``, ``gptq-range`` or ``gptq-mse``."""
    quantized: int
    """Number of linears written quantized (in the run's ``format``)."""
    modules_to_not_convert: list[str]
    """Modules left unquantized, as written to config.json."""
    units: int
    """Decoder layers plus the non-layer tensors."""
    resumed_units: int
    """Units taken over from an interrupted run."""
    bytes_in: int
    bytes_out: int
    shards: int
    seconds: float
    notes: list[str] = field(default_factory=list)
    """Decisions worth knowing (fused groups pulled out, unpackable shapes skipped)."""


@dataclass(frozen=True)
class VerifyReport:
    """Result of :func:`verify`."""

    ok: bool
    problems: list[str]
    tensors: int
    quantized: int
    unquantized: int
    group_size: int
    shards: int
    format: str = "awq"
    """``awq``, ``gptq`` or ``compressed-tensors`` (from config.json)."""


def default_options() -> dict[str, Any]:
    """Every option of :func:`quantize_model` with its default (defined once, in the Rust run)."""
    return _native.default_options()


def quantize_model(
    model_dir: str | os.PathLike[str], out_dir: str | os.PathLike[str], **options: Any
) -> QuantizeReport:
    """Quantizes a Hugging Face safetensors folder to a 4-bit folder that vLLM loads (AWQ "gemm"
    by default; ``format="gptq"`` or ``"compressed-tensors"`` for the other layouts).

    The model is streamed one decoder layer at a time (memory bounded by one layer); every linear
    inside the decoder layers is quantized except routers, norms, embeddings, ``lm_head``, MTP
    layers and the family's default exclusions (DeepSeek: ``kv_b_proj``).

    Options (keywords; :func:`default_options` lists them with their defaults, and the same
    names, with ``-`` for ``_``, are ``forge-rs quantize`` flags):

    * ``method``: ``"rtn"`` (data-free round to nearest, in Rust) or ``"gptq"`` (calibrated:
      layer-by-layer forward over ``calib`` text, per-expert Hessians, error propagation).
    * ``format``: ``"awq"`` (default), ``"gptq"`` (GPTQ v1; needs ``symmetric=True``) or
      ``"compressed-tensors"`` (``pack-quantized``, llm-compressor's W4A16 layout).
    * ``group_size`` (32/64/128), ``symmetric``, ``grid`` (``"range"`` or ``"mse"``, with
      ``mse_grid``, ``mse_shrink``, ``mse_norm``), ``include`` / ``exclude`` (module patterns:
      dotted segments such as ``"kv_b_proj"`` or globs), ``default_excludes``,
      ``skip_unpackable``, ``max_shard_size`` (``"5GB"`` or bytes).
    * GPTQ: ``calib`` (text, ``.jsonl`` with ``text``, or token ids ``.json``/``.pt``),
      ``nsamples``, ``seqlen``, ``seed``, ``damp``, ``act_order``, ``block_size``,
      ``true_sequential``, ``hessian`` (``"full"``/``"block"``), ``few_tokens``
      (``"pooled"``/``"rtn"``), ``few_tokens_threshold``, ``chunk_tokens``, ``activations``
      (``"auto"``/``"gpu"``/``"cpu"``/``"disk"``), ``offload_dir``.
    * Run: ``resume``, ``overwrite``, ``threads``, ``device`` (``"cpu"``, ``"cuda"``,
      ``"cuda:N"``), ``progress``.

    A non-empty ``out_dir`` is refused unless ``overwrite`` or ``resume``; ``resume=True``
    continues an interrupted run and writes the same bytes as an uninterrupted one.

    Raises ``forge.errors.CheckpointError`` for unreadable or inconsistent input,
    ``ShapeError`` when a selected linear cannot be packed with ``group_size``,
    ``InvalidValueError`` for NaN/Inf weights or bad options, ``OSError`` for I/O failures.
    """
    for k in ("include", "exclude"):
        if isinstance(options.get(k), str):
            options[k] = [options[k]]
        elif options.get(k) is not None:
            options[k] = list(options[k])
    for k in ("calib", "offload_dir", "router_stats"):
        if options.get(k) is not None:
            options[k] = os.fspath(options[k])
    opts = _native.validate_options(_json(options))
    if runs_in_python(opts):
        from .calibrate import run_layerwise

        out = run_layerwise(model_dir, out_dir, opts)
    else:
        out = _native.quantize_model(os.fspath(model_dir), os.fspath(out_dir), _json(options))
    return QuantizeReport(**out)


def runs_in_python(opts: dict[str, Any]) -> bool:
    """Whether the run is driven from Python (``forge.calibrate``): GPTQ and router statistics
    (the calibration forward), and every pruning run (the forward when the experts are chosen
    from calibration text; the expert map and pruning report in all cases). The data-free RTN
    run is a Rust loop."""
    pruning = any(opts.get(k) is not None for k in ("keep_experts", "prune_ratio", "keep_mass"))
    return opts["method"] == "gptq" or bool(opts.get("stats_only")) or pruning


def prune_model(
    model_dir: str | os.PathLike[str], out_dir: str | os.PathLike[str], **options: Any
) -> QuantizeReport:
    """Prunes the routed experts a domain does not use, and optionally quantizes the rest.

    Same options as :func:`quantize_model` (and the same as ``forge-rs prune`` flags): the kept
    experts and the rest of the model are quantized in the same run (``method="rtn"``, the
    default, or ``"gptq"``), or not at all with ``method="none"`` (a bf16 checkpoint). Pruning
    options:

    * ``keep_experts`` (routed experts kept per MoE layer) or ``prune_ratio`` (fraction pruned);
      with DeepSeek's group-limited routing the same number is kept from every group.
    * ``criterion``: ``"reap"`` (default: mean over routed tokens of router weight times the
      expert output's norm), ``"frequency"`` (routed tokens), ``"mass"`` (router probability
      mass: sigmoid for DeepSeek, softmax otherwise) or ``"random"`` (seeded; a baseline).
    * The statistics come from ``calib`` (a layer-by-layer forward over the text, through the
      already pruned earlier layers) or from ``router_stats`` (a ``router_stats.safetensors``
      of an earlier run, e.g. ``stats_only=True``). ``sparse_forward`` skips the routed
      experts in that forward (fast, approximate; not with ``criterion="reap"``).
    * ``remap``: keep the full router and ship ``expert_map`` for forge's vLLM plugin (per-layer
      expert counts allowed: ``keep_mass``) instead of the default compact checkpoint, which
      stock vLLM and transformers load with no plugin.

    The output holds ``forge/expert_map.{pt,json}``, ``forge/pruning.{md,json}`` and
    ``forge/router_stats.{safetensors,json,png}`` beside the weights.
    """
    return quantize_model(model_dir, out_dir, **options)


def _json(options: dict[str, Any]) -> str:
    import json

    from .errors import InvalidValueError

    try:
        return json.dumps(options)
    except TypeError as exc:
        raise InvalidValueError(
            f"options must be plain values (str, int, float, bool, lists): {exc}"
        ) from exc


def inspect(path: str | os.PathLike[str]) -> dict[str, Any]:
    """Layers, experts, dtypes, sizes and quantization status of a checkpoint folder (headers only)."""
    return _native.inspect(os.fspath(path))


def verify(path: str | os.PathLike[str], *, raise_on_error: bool = True) -> VerifyReport:
    """Checks that ``path`` is a complete, consistent 4-bit checkpoint for vLLM (AWQ, GPTQ v1 or
    compressed-tensors ``pack-quantized``, as its config.json says).

    Every expected tensor present with the right shape and dtype, the index matching the shards,
    config.json matching the tensors, no stray tensors. With ``raise_on_error`` a failing check
    raises ``forge.errors.CheckpointError`` listing the problems.
    """
    r = VerifyReport(**_native.verify(os.fspath(path)))
    if raise_on_error and not r.ok:
        from .errors import CheckpointError

        listed = "\n  ".join(r.problems)
        raise CheckpointError(f"{os.fspath(path)}: {len(r.problems)} problem(s):\n  {listed}")
    return r
