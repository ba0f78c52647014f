"""``load_quantized``: a 4-bit checkpoint folder as a transformers model running W4A16.

The model is built from ``config.json`` on the meta device (nothing allocated), every
quantized linear is replaced by :class:`forge.runtime.AwqLinear` and every MoE experts
module holding quantized experts by :class:`forge.runtime.AwqExperts`; all other tensors
(embeddings, norms, routers, ``e_score_correction_bias``, linears kept in bf16) are read
from the safetensors shards and assigned in the dtype the model declares for them.

Formats are read by small functions (``_READERS``) that turn a folder's quantized tensors
into AWQ "gemm" triples, the layout the runtime modules run: AWQ as stored, GPTQ v1
(``sym``, trivial ``g_idx``) and compressed-tensors ``pack-quantized`` repacked once at load.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from .checkpoint import model_name
from .errors import CheckpointError
from .runtime import PACK, AwqExperts, AwqLinear, prepare_decode

__all__ = ["load_quantized", "load_fp8_dequantized", "read_checkpoint_config"]

_INDEX = "model.safetensors.index.json"
_SINGLE = "model.safetensors"
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)

_EXPERT = re.compile(r"^(?P<experts>.+\.experts)\.(?P<e>\d+)\.(?P<proj>[A-Za-z0-9_]+)$")
_PROJ = {"gate_proj": "gate", "w1": "gate", "up_proj": "up", "w3": "up", "down_proj": "down", "w2": "down"}


@dataclass
class AwqTensors:
    """One quantized linear in vLLM's AWQ "gemm" layout (``K = in``, ``N = out``)."""

    qweight: torch.Tensor
    qzeros: torch.Tensor
    scales: torch.Tensor
    group_size: int
    file: str


# --------------------------------------------------------------------------- files


class _Shards:
    """Tensor names of a folder and lazy reads (``model.safetensors[.index.json]``)."""

    def __init__(self, root: Path) -> None:
        self.root = root
        index = root / _INDEX
        if index.is_file():
            try:
                weight_map = json.loads(index.read_text())["weight_map"]
            except (OSError, ValueError, KeyError, TypeError) as exc:
                raise CheckpointError(f"{index}: cannot read weight_map: {exc}") from exc
            if not isinstance(weight_map, dict):
                raise CheckpointError(f"{index}: weight_map is not an object")
            self.file_of = {str(k): str(v) for k, v in weight_map.items()}
        elif (root / _SINGLE).is_file():
            self.file_of = dict.fromkeys(self._keys(_SINGLE), _SINGLE)
        else:
            raise CheckpointError(f"{root}: neither {_INDEX} nor {_SINGLE} found")
        self._open: dict[str, Any] = {}

    def _handle(self, file: str):
        from safetensors import SafetensorError, safe_open

        if file not in self._open:
            path = self.root / file
            if not path.is_file():
                raise CheckpointError(f"{path}: shard listed in {_INDEX} does not exist")
            try:
                self._open[file] = safe_open(str(path), framework="pt")
            except SafetensorError as exc:
                raise CheckpointError(f"{path}: cannot read shard: {exc}") from exc
        return self._open[file]

    def _keys(self, file: str) -> list[str]:
        return list(self._handle(file).keys())

    def get(self, name: str) -> torch.Tensor:
        file = self.file_of[name]
        handle = self._handle(file)
        try:
            return handle.get_tensor(name)
        except Exception as exc:  # safetensors raises several types for a missing key
            raise CheckpointError(
                f"{self.root / file}: tensor {name!r} is listed for this shard but cannot be read: {exc}"
            ) from exc

    def path(self, name: str) -> Path:
        return self.root / self.file_of[name]


def read_checkpoint_config(model_dir: str | os.PathLike) -> dict[str, Any]:
    """``config.json`` of a folder as a dict (a clear error when absent or unreadable)."""
    path = Path(model_dir) / "config.json"
    if not path.is_file():
        raise CheckpointError(f"{path}: no config.json")
    try:
        config = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"{path}: cannot read config.json: {exc}") from exc
    if not isinstance(config, dict):
        raise CheckpointError(f"{path}: config.json is not an object")
    return config


# --------------------------------------------------------------------------- readers


def _pack_awq_words(codes: torch.Tensor) -> torch.Tensor:
    """``(R, N)`` integers 0..15 -> ``(R, N/8)`` int32 in AWQ nibble order."""
    c = codes.to(torch.int64).reshape(codes.shape[0], -1, PACK)
    word = torch.zeros(c.shape[:2], dtype=torch.int64)
    for i, col in enumerate(AWQ_ORDER):
        word |= c[:, :, col] << (4 * i)
    return torch.where(word >= 2**31, word - 2**32, word).to(torch.int32)


def _unpack_plain(packed: torch.Tensor, dim: int) -> torch.Tensor:
    """int32 words -> 4-bit values along ``dim`` (0: rows, 1: columns), plain nibble order."""
    w = packed.to(torch.int64) & 0xFFFFFFFF
    parts = [(w >> (4 * i)) & 0xF for i in range(PACK)]
    return torch.stack(parts, dim=dim + 1).flatten(dim, dim + 1)


def _int_field(qc: dict, key: str, path: Path, alt: str | None = None) -> int:
    value = qc.get(key, qc.get(alt) if alt else None)
    if not isinstance(value, int) or isinstance(value, bool):
        raise CheckpointError(f"{path}: quantization_config.{key} is {value!r}, expected an int")
    return value


def _prefixes(names, suffix: str) -> list[str]:
    return sorted(n[: -len(suffix)] for n in names if n.endswith(suffix))


def _require(shards: _Shards, base: str, parts: tuple[str, ...], fmt: str) -> None:
    missing = [p for p in parts if f"{base}.{p}" not in shards.file_of]
    if missing:
        where = shards.path(f"{base}.{parts[0]}")
        raise CheckpointError(
            f"{where}: {fmt} linear {base!r} has no {', '.join(base + '.' + m for m in missing)}"
        )


def _read_awq(shards: _Shards, qc: dict, path: Path) -> tuple[dict[str, AwqTensors], set[str]]:
    bits = _int_field(qc, "bits", path, "w_bit")
    group = _int_field(qc, "group_size", path, "q_group_size")
    if bits != 4:
        raise CheckpointError(f"{path}: quantization_config.bits is {bits}, only 4-bit AWQ is supported")
    if qc.get("zero_point", True) is False:
        raise CheckpointError(
            f"{path}: quantization_config.zero_point false is not supported (vLLM needs it)"
        )
    version = str(qc.get("version", "gemm")).lower()
    if version != "gemm":
        raise CheckpointError(f"{path}: quantization_config.version is {version!r}, expected 'gemm'")
    out, used = {}, set()
    parts = ("qweight", "qzeros", "scales")
    for base in _prefixes(shards.file_of, ".qweight"):
        _require(shards, base, parts, "AWQ")
        tensors = [shards.get(f"{base}.{p}") for p in parts]
        out[base] = AwqTensors(
            *tensors, group if group > 0 else tensors[0].shape[0], str(shards.path(f"{base}.qweight"))
        )
        used.update(f"{base}.{p}" for p in parts)
    return out, used


def _read_gptq(shards: _Shards, qc: dict, path: Path) -> tuple[dict[str, AwqTensors], set[str]]:
    bits = _int_field(qc, "bits", path)
    group = _int_field(qc, "group_size", path)
    if bits != 4:
        raise CheckpointError(f"{path}: quantization_config.bits is {bits}, only 4-bit GPTQ is supported")
    fmt = str(qc.get("checkpoint_format", "gptq")).lower()
    if fmt != "gptq":
        raise CheckpointError(
            f"{path}: quantization_config.checkpoint_format is {fmt!r}, only 'gptq' (v1) is supported"
        )
    out, used = {}, set()
    parts = ("qweight", "qzeros", "scales")
    for base in _prefixes(shards.file_of, ".qweight"):
        _require(shards, base, parts, "GPTQ")
        qweight, qzeros, scales = (shards.get(f"{base}.{p}") for p in parts)
        k = qweight.shape[0] * PACK
        g = group if group > 0 else k
        if f"{base}.g_idx" in shards.file_of:
            g_idx = shards.get(f"{base}.g_idx")
            if not torch.equal(g_idx.to(torch.int64), torch.arange(k) // g):
                raise CheckpointError(
                    f"{shards.path(base + '.g_idx')}: {base}.g_idx is not k // group_size (act-order "
                    "checkpoints are not supported)"
                )
            used.add(f"{base}.g_idx")
        codes = _unpack_plain(qweight, 0)  # (K, N)
        zeros = (_unpack_plain(qzeros, 1) + 1) & 0xF  # v1 stores z - 1
        out[base] = AwqTensors(
            _pack_awq_words(codes),
            _pack_awq_words(zeros),
            scales.to(torch.float16),
            g,
            str(shards.path(f"{base}.qweight")),
        )
        used.update(f"{base}.{p}" for p in parts)
    return out, used


def _read_compressed_tensors(shards: _Shards, qc: dict, path: Path) -> tuple[dict[str, AwqTensors], set[str]]:
    fmt = str(qc.get("format", "")).lower()
    if fmt != "pack-quantized":
        raise CheckpointError(
            f"{path}: quantization_config.format is {fmt!r}, only 'pack-quantized' is supported"
        )
    groups = qc.get("config_groups")
    if not isinstance(groups, dict) or not groups:
        raise CheckpointError(f"{path}: quantization_config.config_groups is missing or empty")
    schemes = []
    for name, group in groups.items():
        weights = group.get("weights") if isinstance(group, dict) else None
        if not isinstance(weights, dict):
            raise CheckpointError(f"{path}: quantization_config.config_groups.{name}.weights is missing")
        if weights.get("num_bits") != 4 or weights.get("type", "int") != "int":
            raise CheckpointError(f"{path}: config_groups.{name}: only 4-bit int weights are supported")
        if weights.get("strategy", "group") != "group" or not isinstance(weights.get("group_size"), int):
            raise CheckpointError(
                f"{path}: config_groups.{name}: only strategy 'group' with a group_size is supported"
            )
        schemes.append(weights)
    if len({(w["group_size"], bool(w.get("symmetric", True))) for w in schemes}) != 1:
        raise CheckpointError(
            f"{path}: config_groups with different group sizes or symmetry are not supported"
        )
    group, symmetric = schemes[0]["group_size"], bool(schemes[0].get("symmetric", True))
    out, used = {}, set()
    parts = ("weight_packed", "weight_scale", "weight_shape")
    for base in _prefixes(shards.file_of, ".weight_packed"):
        _require(shards, base, parts + (() if symmetric else ("weight_zero_point",)), "compressed-tensors")
        packed, scale, shape = (shards.get(f"{base}.{p}") for p in parts)
        n, k = (int(v) for v in shape.tolist())
        codes = _unpack_plain(packed, 1)[:, :k]  # (N, K): stored int4 + 8 = AWQ code
        if symmetric:
            zeros = torch.full((scale.shape[1], n), 8, dtype=torch.int64)
        else:
            zeros = _unpack_plain(shards.get(f"{base}.weight_zero_point"), 0)[:n].t()  # stored z + 8 = AWQ z
            used.add(f"{base}.weight_zero_point")
        out[base] = AwqTensors(
            _pack_awq_words(codes.t().contiguous()),
            _pack_awq_words(zeros.contiguous()),
            scale.t().to(torch.float16).contiguous(),
            group,
            str(shards.path(f"{base}.weight_packed")),
        )
        used.update(f"{base}.{p}" for p in parts)
    return out, used


# quant_method -> reader; the suffixes mark a format's tensors (to catch mixed folders)
_READERS: dict[str, Callable[[_Shards, dict, Path], tuple[dict[str, AwqTensors], set[str]]]] = {
    "awq": _read_awq,
    "gptq": _read_gptq,
    "compressed-tensors": _read_compressed_tensors,
}
_MARKERS = {
    "awq": (".qweight", ".qzeros", ".scales"),
    "gptq": (".qweight", ".qzeros", ".scales", ".g_idx"),
    "compressed-tensors": (".weight_packed", ".weight_scale", ".weight_shape", ".weight_zero_point"),
}


# --------------------------------------------------------------------------- model surgery


def _set_tensor(model: nn.Module, name: str, value: torch.Tensor, path: Path) -> None:
    """Assigns ``value`` to the parameter or buffer ``name`` of a meta-built model, cast to its dtype."""
    owner, _, attr = name.rpartition(".")
    module = model.get_submodule(owner) if owner else model
    current = module._parameters.get(attr) if attr in module._parameters else module._buffers.get(attr)
    if current is None:
        raise CheckpointError(f"{path}: tensor {name!r} has no place in {type(model).__name__}")
    if tuple(current.shape) != tuple(value.shape):
        raise CheckpointError(
            f"{path}: tensor {name!r} has shape {tuple(value.shape)}, the model expects {tuple(current.shape)}"
        )
    if value.is_floating_point() and current.is_floating_point():
        value = value.to(current.dtype)
    if attr in module._parameters:
        module._parameters[attr] = nn.Parameter(value, requires_grad=False)
    else:
        module._buffers[attr] = value


def _mtp_layer(name: str, num_layers: int | None) -> bool:
    """DeepSeek MTP layers (index >= num_hidden_layers) are not part of the causal LM."""
    m = re.match(r"^model\.layers\.(\d+)\.", name)
    return bool(m and num_layers is not None and int(m.group(1)) >= num_layers)


def _build_experts(
    experts_name: str,
    module: nn.Module,
    members: dict[int, dict[str, Any]],
    root: Path,
    act: str,
) -> nn.Module:
    """Stacks one layer's per-expert tensors into ``module`` (dense) or an :class:`AwqExperts`."""
    if not (hasattr(module, "gate_up_proj") and hasattr(module, "down_proj")):
        raise CheckpointError(
            f"{root}: experts module {experts_name!r} ({type(module).__name__}) has no gate_up_proj/down_proj"
        )
    e_count, two_i, h = module.gate_up_proj.shape
    i = two_i // 2
    extra = sorted(e for e in members if e >= e_count)
    if extra:
        raise CheckpointError(
            f"{root}: {experts_name}.{extra[0]} is beyond the config's {e_count} experts (n_routed_experts)"
        )
    for e in range(e_count):
        for proj in ("gate", "up", "down"):
            if proj not in members.get(e, {}):
                raise CheckpointError(f"{root}: missing tensor(s) of {experts_name}.{e} {proj} projection")
    kinds = {
        proj: {isinstance(members[e][proj], AwqTensors) for e in range(e_count)}
        for proj in ("gate", "up", "down")
    }
    for proj, kind in kinds.items():
        if len(kind) != 1:
            raise CheckpointError(
                f"{root}: {experts_name}: {proj} projections are partly quantized, partly not"
            )
    q_gate_up, q_down = kinds["gate"] == {True}, kinds["down"] == {True}
    if q_gate_up != (kinds["up"] == {True}):
        raise CheckpointError(
            f"{root}: {experts_name}: gate and up projections must be both quantized or neither"
        )
    if not q_gate_up and not q_down:
        gate_up = torch.stack([torch.cat([members[e]["gate"], members[e]["up"]], 0) for e in range(e_count)])
        _set_tensor(module, "gate_up_proj", gate_up, root)
        _set_tensor(module, "down_proj", torch.stack([members[e]["down"] for e in range(e_count)]), root)
        return module
    groups = {
        members[e][p].group_size
        for e in range(e_count)
        for p in ("gate", "up", "down")
        if isinstance(members[e][p], AwqTensors)
    }
    if len(groups) != 1:
        raise CheckpointError(f"{root}: {experts_name}: experts use several group sizes {sorted(groups)}")
    dtype = module.gate_up_proj.dtype
    new = AwqExperts(e_count, h, i, groups.pop(), act, q_gate_up, q_down, device="meta", dtype=dtype)

    def put(attr: str, tensors: list[torch.Tensor], what: str) -> None:
        want = getattr(new, attr)
        value = torch.stack(tensors)
        if tuple(value.shape) != tuple(want.shape):
            raise CheckpointError(
                f"{root}: {experts_name} {what}: stacked shape {tuple(value.shape)}, expected {tuple(want.shape)}"
            )
        if value.is_floating_point():
            value = value.to(want.dtype)
        if attr in new._parameters:
            new._parameters[attr] = nn.Parameter(value, requires_grad=False)
        else:
            new._buffers[attr] = value

    rng = range(e_count)
    if q_gate_up:
        put(
            "gate_up_qweight",
            [torch.cat([members[e]["gate"].qweight, members[e]["up"].qweight], 1) for e in rng],
            "qweight",
        )
        put(
            "gate_up_qzeros",
            [torch.cat([members[e]["gate"].qzeros, members[e]["up"].qzeros], 1) for e in rng],
            "qzeros",
        )
        put(
            "gate_up_scales",
            [torch.cat([members[e]["gate"].scales, members[e]["up"].scales], 1) for e in rng],
            "scales",
        )
    else:
        put("gate_up_proj", [torch.cat([members[e]["gate"], members[e]["up"]], 0) for e in rng], "weight")
    if q_down:
        for part in ("qweight", "qzeros", "scales"):
            put(f"down_{part}", [getattr(members[e]["down"], part) for e in rng], part)
    else:
        put("down_proj", [members[e]["down"] for e in rng], "weight")
    return new


def _fix_meta_buffers(model: nn.Module, root: Path) -> None:
    """Recomputes non-persistent buffers (rotary ``inv_freq``) that stayed on the meta device."""
    for name, module in list(model.named_modules()):
        if not any(b is not None and b.is_meta for b in module._buffers.values()):
            continue
        if name.endswith("rotary_emb") or type(module).__name__.endswith("RotaryEmbedding"):
            with torch.device("cpu"):
                fresh = type(module)(module.config)
            owner, _, attr = name.rpartition(".")
            setattr(model.get_submodule(owner) if owner else model, attr, fresh)
    left = [n for n, b in model.named_buffers() if b.is_meta] + [
        n for n, p in model.named_parameters() if p.is_meta
    ]
    if left:
        raise CheckpointError(
            f"{root}: no tensor in the checkpoint for {left[:5]}{' ...' if len(left) > 5 else ''} "
            f"({len(left)} missing)"
        )


def _keep_fp32(model: nn.Module, dtype: torch.dtype) -> None:
    """Upcasts what transformers keeps in float32 (``_keep_in_fp32_modules[_strict]``), as
    ``from_pretrained`` does (e.g. DeepSeek's ``e_score_correction_bias``)."""
    patterns = set(getattr(model, "_keep_in_fp32_modules_strict", None) or ())
    if dtype == torch.float16:
        patterns |= set(getattr(model, "_keep_in_fp32_modules", None) or ())
    if dtype == torch.float32 or not patterns:
        return
    match = re.compile("|".join(rf"(^|\.){re.escape(p)}($|\.)" for p in sorted(patterns)))
    for name, t in list(model.named_parameters()) + list(model.named_buffers()):
        if match.search(name) and t.is_floating_point() and t.dtype != torch.float32:
            owner, _, attr = name.rpartition(".")
            module = model.get_submodule(owner) if owner else model
            if attr in module._parameters:
                module._parameters[attr] = nn.Parameter(t.data.float(), requires_grad=False)
            else:
                module._buffers[attr] = t.float()


def _linear_bias(shards: _Shards, base: str) -> torch.Tensor | None:
    return shards.get(f"{base}.bias") if f"{base}.bias" in shards.file_of else None


def _assemble(
    root: Path,
    shards: _Shards,
    quantized: dict[str, AwqTensors],
    used: set[str],
    dtype: torch.dtype,
    get: Callable[[str], torch.Tensor] | None = None,
) -> nn.Module:
    """The model of ``root`` built on meta, with ``quantized`` swapped in and the rest loaded.

    ``used`` names tensors already consumed (by a reader); ``get`` reads a dense tensor
    (default: as stored).
    """
    from transformers import AutoConfig, AutoModelForCausalLM

    get = shards.get if get is None else get
    config = AutoConfig.from_pretrained(str(root))
    if hasattr(config, "quantization_config"):
        delattr(config, "quantization_config")
    config.dtype = dtype
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    text_config = config.get_text_config() if hasattr(config, "get_text_config") else config
    num_layers = getattr(text_config, "num_hidden_layers", None)
    act = getattr(text_config, "hidden_act", "silu")

    modules = dict(model.named_modules())
    state_names = set(model.state_dict(keep_vars=True))
    experts: dict[str, dict[int, dict[str, Any]]] = {}

    # quantized linears
    for base, awq in sorted(quantized.items()):
        if _mtp_layer(base, num_layers):
            continue
        target = model_name(base, modules.__contains__)
        if target is not None and isinstance(modules[target], nn.Linear):
            lin = modules[target]
            bias = _linear_bias(shards, base)
            if bias is not None:
                used.add(f"{base}.bias")
            try:
                new = AwqLinear.from_tensors(
                    awq.qweight, awq.qzeros, awq.scales, awq.group_size, bias, name=base
                )
            except ValueError as exc:
                raise CheckpointError(f"{awq.file}: {exc}") from exc
            if (new.in_features, new.out_features) != (lin.in_features, lin.out_features):
                raise CheckpointError(
                    f"{awq.file}: {base!r} is {new.in_features}x{new.out_features} (in x out), the model "
                    f"expects {lin.in_features}x{lin.out_features}"
                )
            if bias is not None:
                new.bias = bias.to(dtype)
            owner, _, attr = target.rpartition(".")
            setattr(model.get_submodule(owner), attr, new)
            continue
        m = _EXPERT.match(base)
        if m and m.group("proj") in _PROJ:
            experts.setdefault(m.group("experts"), {}).setdefault(int(m.group("e")), {})[
                _PROJ[m.group("proj")]
            ] = awq
            continue
        raise CheckpointError(
            f"{awq.file}: quantized tensor {base + '.qweight'!r} has no linear in {type(model).__name__}"
        )

    # everything else
    for name in sorted(shards.file_of):
        if name in used or _mtp_layer(name, num_layers):
            continue
        target = model_name(name, state_names.__contains__)
        if target is not None:
            _set_tensor(model, target, get(name), shards.path(name))
            continue
        base, _, leaf = name.rpartition(".")
        m = _EXPERT.match(base)
        if leaf == "weight" and m and m.group("proj") in _PROJ:
            experts.setdefault(m.group("experts"), {}).setdefault(int(m.group("e")), {})[
                _PROJ[m.group("proj")]
            ] = get(name)
            continue
        raise CheckpointError(f"{shards.path(name)}: tensor {name!r} has no place in {type(model).__name__}")

    modules = dict(model.named_modules())
    for ckpt_name, members in sorted(experts.items()):
        target = model_name(ckpt_name, modules.__contains__)
        if target is None:
            raise CheckpointError(
                f"{root}: experts {ckpt_name!r} have no experts module in {type(model).__name__}"
            )
        new = _build_experts(ckpt_name, modules[target], members, root, act)
        if new is not modules[target]:
            owner, _, attr = target.rpartition(".")
            setattr(model.get_submodule(owner), attr, new)

    tied = bool(
        getattr(config, "tie_word_embeddings", False) or getattr(text_config, "tie_word_embeddings", False)
    )
    if tied:
        model.tie_weights()
    _fix_meta_buffers(model, root)
    _keep_fp32(model, dtype)
    model.eval()
    if (root / "generation_config.json").is_file():
        from transformers import GenerationConfig

        model.generation_config = GenerationConfig.from_pretrained(str(root))
    return model


def dequantize_fp8_blocks(
    w: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int], where: str
) -> torch.Tensor:
    """``w (N, K)`` (FP8) times ``scale_inv[r // bn, c // bk]`` in float32, on ``w``'s device:
    DeepSeek's ``weight_scale_inv`` per ``bn x bk`` block, edge blocks partial. Whole blocks
    broadcast the scales (no ``N x K`` scale tensor); the products are the same floats either
    way. ``where`` (file and tensor) prefixes the error for a scale of the wrong shape."""
    bn, bk = block
    n, k = w.shape
    nb, kb = -(-n // bn), -(-k // bk)
    if tuple(scale_inv.shape) != (nb, kb):
        raise CheckpointError(
            f"{where}: weight_scale_inv has shape {tuple(scale_inv.shape)}, expected ({nb}, {kb}) for "
            f"{tuple(w.shape)} in {bn}x{bk} blocks"
        )
    x = w.to(torch.float32)
    s = scale_inv.to(device=x.device, dtype=torch.float32)
    if n % bn == 0 and k % bk == 0:
        return (x.view(nb, bn, kb, bk) * s[:, None, :, None]).view(n, k)
    return x * s.repeat_interleave(bn, 0)[:n].repeat_interleave(bk, 1)[:, :k]


def _fp8_reader(shards: _Shards, qc: dict, path: Path) -> tuple[Callable[[str], torch.Tensor], set[str]]:
    """Dense reads of an FP8 block-quantized folder: ``w = fp8 * scale_inv[block]``."""
    block = qc.get("weight_block_size")
    if not (isinstance(block, list) and len(block) == 2 and all(isinstance(b, int) and b > 0 for b in block)):
        raise CheckpointError(
            f"{path}: quantization_config.weight_block_size is {block!r}, expected [rows, cols]"
        )
    bn, bk = block
    used = {n for n in shards.file_of if n.endswith("_scale_inv")}

    def get(name: str) -> torch.Tensor:
        t = shards.get(name)
        if t.dtype not in (torch.float8_e4m3fn, torch.float8_e5m2):
            return t
        if f"{name}_scale_inv" not in shards.file_of:
            raise CheckpointError(f"{shards.path(name)}: FP8 tensor {name!r} has no {name + '_scale_inv'!r}")
        s = shards.get(f"{name}_scale_inv")
        return dequantize_fp8_blocks(t, s, (bn, bk), f"{shards.path(name)}: {name}")

    return get, used


def load_fp8_dequantized(
    model_dir: str | os.PathLike, device: str | torch.device = "cpu", dtype: torch.dtype = torch.bfloat16
) -> nn.Module:
    """A DeepSeek-style FP8 folder (``weight_scale_inv`` per ``weight_block_size`` block) as a
    dense transformers model in ``dtype``, dequantized block by block (partial edge blocks
    included; transformers' CPU FP8 path takes the block size from the shape ratio instead)."""
    root = Path(model_dir)
    qc = read_checkpoint_config(root).get("quantization_config")
    if not isinstance(qc, dict) or str(qc.get("quant_method", "")).lower() != "fp8":
        raise CheckpointError(f"{root / 'config.json'}: quantization_config.quant_method is not 'fp8'")
    shards = _Shards(root)
    get, used = _fp8_reader(shards, qc, root / "config.json")
    return _assemble(root, shards, {}, used, dtype, get).to(device)


def load_quantized(
    model_dir: str | os.PathLike,
    device: str | torch.device = "cpu",
    dtype: torch.dtype = torch.bfloat16,
    *,
    tokenizer: bool = True,
    decode: bool = True,
):
    """Loads a 4-bit checkpoint folder as a transformers causal LM with W4A16 modules.

    Reads ``config.json`` and its ``quantization_config`` (``awq`` "gemm", ``gptq`` v1 or
    ``compressed-tensors`` ``pack-quantized``, all 4-bit), builds
    ``AutoModelForCausalLM.from_config`` on the meta device, swaps each quantized linear for
    an :class:`~forge.runtime.AwqLinear` and each experts module with quantized experts for
    an :class:`~forge.runtime.AwqExperts` (per-expert tensors ``experts.{e}.gate_proj``/
    ``w1`` ... are stacked; experts kept unquantized are loaded into the model's own module),
    and loads every other tensor in the dtype the model declares (``dtype`` for weights,
    float32 where transformers keeps it). Pruned checkpoints load when the config's expert
    count matches the files. DeepSeek MTP layers are skipped.

    On CUDA with ``decode`` (the default), each :class:`~forge.runtime.AwqLinear` makes its
    decode copy of the codes now (:func:`forge.runtime.prepare_decode`: ``K·N/2`` more bytes a
    layer), so that ``generate``'s compiled decode steps run the tiled GEMV; pass
    ``decode=False`` for prefill-only use (perplexity), where eager decode-sized calls still
    make the copy on first use.

    Returns ``(model, tokenizer)`` (``tokenizer`` is ``None`` when the folder has none that
    ``AutoTokenizer`` can read). Raises :class:`forge.errors.CheckpointError` naming the
    file and tensor for missing or extra tensors, a wrong ``quantization_config``, or a
    folder that mixes formats.
    """
    root = Path(model_dir)
    if not root.is_dir():
        raise CheckpointError(f"{root}: not a directory")
    cfg_path = root / "config.json"
    raw_cfg = read_checkpoint_config(root)
    pruning = raw_cfg.get("forge_expert_pruning")
    if isinstance(pruning, dict) and pruning.get("layout") == "remap":
        raise CheckpointError(
            f"{cfg_path}: a remap-layout pruned checkpoint (forge_expert_pruning.layout = 'remap'): its "
            "routing over the original experts runs in vLLM with forge's plugin (forge.vllm_plugin); "
            "prune with the default compact layout to run it here or in stock vLLM"
        )
    qc = raw_cfg.get("quantization_config")
    if not isinstance(qc, dict):
        raise CheckpointError(f"{cfg_path}: no quantization_config (not a quantized checkpoint)")
    method = str(qc.get("quant_method", "")).lower()
    if method not in _READERS:
        raise CheckpointError(
            f"{cfg_path}: quantization_config.quant_method is {method!r}, expected one of {sorted(_READERS)}"
        )
    shards = _Shards(root)
    own = set(_MARKERS[method])
    for name in sorted(shards.file_of):
        for other, suffixes in _MARKERS.items():
            hit = next((s for s in suffixes if name.endswith(s) and s not in own), None)
            if other != method and hit:
                raise CheckpointError(
                    f"{shards.path(name)}: tensor {name!r} belongs to the {other} format, but "
                    f"config.json says quant_method {method!r} (mixed formats)"
                )
    quantized, used = _READERS[method](shards, qc, cfg_path)

    model = _assemble(root, shards, quantized, used, dtype)
    model.to(device)
    if decode:
        prepare_decode(model)
    model.config.forge_quantization = {
        "format": method,
        **{k: v for k, v in qc.items() if k != "quant_method"},
    }
    tok = _tokenizer(root) if tokenizer else None
    return model, tok


def _tokenizer(root: Path):
    """``AutoTokenizer`` of the folder, or ``None`` when it has no readable tokenizer."""
    try:
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(str(root))
    except Exception:  # no or unreadable tokenizer files: the model is still usable
        return None
