"""Reading an AWQ checkpoint back through the project's own dequantisation.

An AWQ output folder (``model.safetensors.index.json`` + shards, or one
``model.safetensors``; ``config.json`` with ``quantization_config``) holds every quantized
linear ``X`` as ``X.qweight`` / ``X.qzeros`` / ``X.scales`` and no ``X.weight``.
:func:`load_dequantized_state_dict` turns each such triple into ``X.weight (N, K)`` with
:func:`forge.dequantize_awq` and passes every other tensor through unchanged;
:func:`load_dequantized_model` builds the matching transformers model from the config and
loads that state dict into it. This is how the examples measure the quality of a 4-bit
checkpoint on a CPU without vLLM.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Any

import torch

from .errors import CheckpointError
from .quant import dequantize_awq

__all__ = ["load_dequantized_state_dict", "load_dequantized_model", "read_quantization_config"]

_INDEX = "model.safetensors.index.json"
_SINGLE = "model.safetensors"
_AWQ_PARTS = ("qweight", "qzeros", "scales")


def read_quantization_config(awq_dir: str | os.PathLike) -> dict[str, Any]:
    """The ``quantization_config`` of ``awq_dir/config.json``, checked to be 4-bit AWQ."""
    from .loading import read_checkpoint_config

    path = Path(awq_dir) / "config.json"
    qc = read_checkpoint_config(awq_dir).get("quantization_config")
    if not isinstance(qc, dict):
        raise CheckpointError(f"{path}: no quantization_config (not a quantized checkpoint)")
    method = str(qc.get("quant_method", "")).lower()
    if method != "awq":
        raise CheckpointError(f"{path}: quantization_config.quant_method is {method!r}, expected 'awq'")
    bits = qc.get("bits", qc.get("w_bit"))
    if bits != 4:
        raise CheckpointError(f"{path}: quantization_config.bits is {bits!r}, only 4-bit AWQ is supported")
    group_size = qc.get("group_size", qc.get("q_group_size"))
    if not isinstance(group_size, int) or isinstance(group_size, bool) or group_size <= 0:
        raise CheckpointError(
            f"{path}: quantization_config.group_size is {group_size!r}, expected a positive int"
        )
    return qc


def _shard_map(awq_dir: Path) -> dict[str, str]:
    """tensor name -> shard file name, from the index or the single file."""
    index = awq_dir / _INDEX
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise CheckpointError(f"{index}: cannot read weight_map: {exc}") from exc
        if not isinstance(weight_map, dict):
            raise CheckpointError(f"{index}: weight_map is not an object")
        return {str(k): str(v) for k, v in weight_map.items()}
    single = awq_dir / _SINGLE
    if single.is_file():
        from safetensors import safe_open

        with safe_open(str(single), framework="pt") as f:
            return dict.fromkeys(f.keys(), _SINGLE)
    raise CheckpointError(f"{awq_dir}: neither {_INDEX} nor {_SINGLE} found")


def _read_all(awq_dir: Path, weight_map: dict[str, str]) -> dict[str, torch.Tensor]:
    from safetensors import SafetensorError, safe_open

    by_file: dict[str, list[str]] = {}
    for name, file in weight_map.items():
        by_file.setdefault(file, []).append(name)
    tensors: dict[str, torch.Tensor] = {}
    for file, names in sorted(by_file.items()):
        path = awq_dir / file
        if not path.is_file():
            raise CheckpointError(f"{path}: shard listed in the index (e.g. for {names[0]!r}) does not exist")
        try:
            with safe_open(str(path), framework="pt") as f:
                present = set(f.keys())
                for name in names:
                    if name not in present:
                        raise CheckpointError(
                            f"{path}: the index maps tensor {name!r} to this shard, but it is absent"
                        )
                    tensors[name] = f.get_tensor(name)
        except SafetensorError as exc:
            raise CheckpointError(f"{path}: cannot read shard: {exc}") from exc
    return tensors


def load_dequantized_state_dict(
    awq_dir: str | os.PathLike, dtype: torch.dtype = torch.float16
) -> dict[str, torch.Tensor]:
    """State dict of an AWQ folder with every quantized linear turned back into ``X.weight``.

    ``X.weight`` is ``forge.dequantize_awq(qweight, qzeros, scales, group_size)`` cast to
    ``dtype``; every tensor that is not part of an AWQ triple is returned as stored.
    Raises :class:`forge.errors.CheckpointError` naming the file and tensor when a triple is
    incomplete, a shard is missing, or a ``.weight`` sits beside a ``.qweight``.
    """
    awq_dir = Path(awq_dir)
    if not awq_dir.is_dir():
        raise CheckpointError(f"{awq_dir}: not a directory")
    group_size = int(read_quantization_config(awq_dir)["group_size"])
    weight_map = _shard_map(awq_dir)

    # Check triples on names first, so a broken checkpoint fails before reading gigabytes.
    prefixes: set[str] = set()
    for name in weight_map:
        base, _, leaf = name.rpartition(".")
        if leaf in _AWQ_PARTS and base:
            prefixes.add(base)
    for base in sorted(prefixes):
        missing = [p for p in _AWQ_PARTS if f"{base}.{p}" not in weight_map]
        if missing:
            have = [p for p in _AWQ_PARTS if f"{base}.{p}" in weight_map]
            where = weight_map[f"{base}.{have[0]}"]
            raise CheckpointError(
                f"{awq_dir / where}: quantized linear {base!r} has {', '.join(have)} "
                f"but no {', '.join(missing)}"
            )
        if f"{base}.weight" in weight_map:
            raise CheckpointError(
                f"{awq_dir / weight_map[base + '.weight']}: {base!r} has both .weight and .qweight"
            )

    raw = _read_all(awq_dir, weight_map)
    out: dict[str, torch.Tensor] = {}
    for name, tensor in raw.items():
        base, _, leaf = name.rpartition(".")
        if base in prefixes and leaf in _AWQ_PARTS:
            continue
        out[name] = tensor
    for base in sorted(prefixes):
        qweight, qzeros, scales = (raw[f"{base}.{p}"] for p in _AWQ_PARTS)
        try:
            w = dequantize_awq(qweight, qzeros, scales, group_size)
        except ValueError as exc:  # ShapeError / DTypeError from the core
            raise CheckpointError(f"{awq_dir / weight_map[base + '.qweight']}: {base!r}: {exc}") from exc
        out[f"{base}.weight"] = w.to(dtype)
        del raw[f"{base}.qweight"], raw[f"{base}.qzeros"], raw[f"{base}.scales"]
    return out


RENAMES = (
    (re.compile(r"\.block_sparse_moe\.e_score_correction_bias$"), ".mlp.gate.e_score_correction_bias"),
    (re.compile(r"\.block_sparse_moe\."), ".mlp."),
)
"""Checkpoint name -> model name, tried in order when a name is not in the model as it is:
checkpoints keep Mixtral's ``block_sparse_moe`` (vLLM's names), transformers 5 calls it ``mlp``."""


def model_name(name: str, held) -> str | None:
    """The model's name for checkpoint name ``name``: itself when ``held(name)``, else the first
    of :data:`RENAMES` that gives a held one, else None."""
    if held(name):
        return name
    for pattern, repl in RENAMES:
        if held(renamed := pattern.sub(repl, name)):
            return renamed
    return None


_EXPERT_KEY = re.compile(r"^(.*)\.experts\.(\d+)\.(gate_proj|up_proj|down_proj|w1|w3|w2)\.weight$")
_GATE, _UP, _DOWN = ("gate_proj", "w1"), ("up_proj", "w3"), ("down_proj", "w2")


def _fuse_experts(state: dict[str, torch.Tensor], own: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Per-expert weights (the checkpoint layout) stacked into transformers 5's fused
    ``experts.gate_up_proj`` ``(E, 2I, D)`` / ``experts.down_proj`` ``(E, D, I)`` when the model
    holds those; unchanged otherwise (transformers 4 keeps one module per expert)."""
    groups: dict[str, dict[int, dict[str, torch.Tensor]]] = {}
    for k, v in state.items():
        m = _EXPERT_KEY.match(k)
        if m and f"{m.group(1)}.experts.gate_up_proj" in own:
            groups.setdefault(m.group(1), {}).setdefault(int(m.group(2)), {})[m.group(3)] = v
    if not groups:
        return state
    out = {
        k: v
        for k, v in state.items()
        if not (_EXPERT_KEY.match(k) and _EXPERT_KEY.match(k).group(1) in groups)
    }
    for prefix, experts in groups.items():
        ids = sorted(experts)
        if ids != list(range(len(ids))):
            raise CheckpointError(f"{prefix}.experts: expert ids {ids[:8]}... are not 0..{len(ids) - 1}")

        def pick(e, names, prefix=prefix, experts=experts):
            for n in names:
                if n in experts[e]:
                    return experts[e][n]
            raise CheckpointError(f"missing tensor {prefix}.experts.{e}.{names[0]}.weight")

        out[f"{prefix}.experts.gate_up_proj"] = torch.stack(
            [torch.cat([pick(e, _GATE), pick(e, _UP)]) for e in ids]
        )
        out[f"{prefix}.experts.down_proj"] = torch.stack([pick(e, _DOWN) for e in ids])
    return out


def _renamed(state: dict[str, torch.Tensor], own: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``state`` with each name the model does not hold renamed by the first of
    :data:`RENAMES` that gives one it does (a per-expert weight counts as held when the model
    has its fused experts module); other names unchanged."""

    def held(name: str) -> bool:
        m = _EXPERT_KEY.match(name)
        return name in own or (m is not None and f"{m.group(1)}.experts.gate_up_proj" in own)

    return {model_name(name, held) or name: tensor for name, tensor in state.items()}


def load_dequantized_model(awq_dir: str | os.PathLike, dtype: torch.dtype = torch.float16):
    """The transformers ``AutoModelForCausalLM`` of an AWQ folder, with dequantised weights.

    The model is built from ``config.json`` without its ``quantization_config`` (so
    transformers does not look for an AWQ backend), in ``dtype``, and the state dict of
    :func:`load_dequantized_state_dict` is loaded strictly: every parameter and persistent
    buffer must be present with its shape, except ``lm_head.weight`` when the config ties
    the embeddings (the head is then re-tied to ``embed_tokens``). Returns the model in
    eval mode. Use ``dtype=torch.float32`` for fast CPU evaluation.
    """
    from transformers import AutoConfig, AutoModelForCausalLM

    awq_dir = Path(awq_dir)
    state = load_dequantized_state_dict(awq_dir, dtype)
    config = AutoConfig.from_pretrained(str(awq_dir))
    if hasattr(config, "quantization_config"):
        delattr(config, "quantization_config")
    # Parameters are created in ``dtype`` (as from_pretrained does); buffers that
    # transformers computes in float32 (rotary inv_freq) stay float32. The config's own
    # dtype (the checkpoint's, usually float16) would otherwise win in from_config.
    config.dtype = dtype
    prev = torch.get_default_dtype()
    try:
        torch.set_default_dtype(dtype)
        try:
            model = AutoModelForCausalLM.from_config(config, dtype=dtype)
        except TypeError:  # transformers < 4.56 spells it torch_dtype
            model = AutoModelForCausalLM.from_config(config, torch_dtype=dtype)
    finally:
        torch.set_default_dtype(prev)
    for param in model.parameters():
        if param.dtype != dtype:
            param.data = param.data.to(dtype)

    own = model.state_dict()
    state = _fuse_experts(_renamed(state, own), own)
    # MTP layers (index >= num_hidden_layers) are not part of the causal LM (vLLM skips them too).
    n_layers = getattr(
        config.get_text_config() if hasattr(config, "get_text_config") else config, "num_hidden_layers", None
    )
    if n_layers is not None:
        mtp = re.compile(r"^model\.layers\.(\d+)\.")
        state = {k: v for k, v in state.items() if not ((m := mtp.match(k)) and int(m.group(1)) >= n_layers)}
    text_config = config.get_text_config() if hasattr(config, "get_text_config") else config
    tied = bool(
        getattr(config, "tie_word_embeddings", False) or getattr(text_config, "tie_word_embeddings", False)
    )
    missing = sorted(set(own) - set(state))
    if tied and missing == ["lm_head.weight"]:
        missing = []
    unexpected = sorted(set(state) - set(own))
    if missing or unexpected:
        raise CheckpointError(
            f"{awq_dir}: state dict does not match {type(model).__name__}: "
            f"missing {missing[:5]}{'...' if len(missing) > 5 else ''}, "
            f"unexpected {unexpected[:5]}{'...' if len(unexpected) > 5 else ''}"
        )
    for name, tensor in state.items():
        if tuple(own[name].shape) != tuple(tensor.shape):
            raise CheckpointError(
                f"{awq_dir}: tensor {name!r} has shape {tuple(tensor.shape)}, "
                f"the model expects {tuple(own[name].shape)}"
            )
    if tied and "lm_head.weight" not in state:
        result = model.load_state_dict(state, strict=False)
        if list(result.missing_keys) not in ([], ["lm_head.weight"]) or result.unexpected_keys:
            raise CheckpointError(f"{awq_dir}: unexpected load result {result}")
        model.tie_weights()
    else:
        model.load_state_dict(state, strict=True)
    model.eval()
    return model
