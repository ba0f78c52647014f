"""vLLM plugin for forge's REMAP expert-pruning layout (spec §5, issue 11 item 4).

A remap checkpoint keeps the family's expert count E in config.json (DeepSeek ``n_routed_experts``,
Qwen-MoE ``num_experts``, Mixtral ``num_local_experts``) and the FULL router (``gate.weight``
[E, D], ``gate.e_score_correction_bias`` [E]), but its expert tensors are compact per layer
(``model.layers.L.mlp.experts.{c}.*``, c in 0..k_L-1, k_L may differ per layer), and config.json
carries::

    "forge_expert_pruning": {"layout": "remap", "criterion": ..., "num_original_experts": E,
                             "expert_map": {"<layer>": [E ints: compact id, or -1 if pruned]}}

Semantics: routing is computed over the ORIGINAL E experts exactly as vLLM does for the family
(softmax/sigmoid, correction bias, group-limited top-k, renormalisation, routed_scaling_factor);
then each chosen id is mapped to its compact id, a pruned choice goes to compact expert 0 with
weight 0, and the surviving weights are rescaled so each token's weight sum is what vLLM computed
(:func:`remap_routing`). The COMPACT layout (``"layout": "compact"``: router sliced, expert count =
k in config) and checkpoints without the key need no plugin: it does nothing for them.

Installed as the ``vllm.general_plugins`` entry point ``forge_expert_remap`` (pyproject). vLLM calls
:func:`register` in every process; it is idempotent. What it patches (vLLM 0.32):

* ``vllm.model_executor.layers.fused_moe.layer.FusedMoEFactory`` (and the same name re-exported by
  the ``fused_moe`` package and any already-imported model module): every family builds its MoE
  layer through it with ``prefix`` ``...layers.L.<mlp|block_sparse_moe>.experts``. For a remap
  model and a layer L in ``expert_map`` it builds the experts with ``num_experts = k_L``; while it
  runs, ``layer.create_fused_moe_router`` is given ``global_num_experts = E`` so the router still
  routes over E (the gate / bias modules are built by the model code from config's E, unchanged).
* on that layer's router instance (a ``BaseRouter``: ``CPURouter``, ``GroupedTopKRouter``,
  ``FusedTopKRouter``, ``FusedTopKBiasRouter``, ... whichever vLLM picked), ``_compute_routing`` is
  wrapped: its (weights, ids) go through :func:`remap_routing` with the layer's map, a
  non-persistent int64 buffer ``forge_expert_map`` [E] on the MoE runner (the layer's device).
  vLLM's ``_select_experts`` then applies its own EPLB mapping and index dtype as usual.
* that layer's ``routed_experts.forward_monolithic`` raises: monolithic kernels route inside the
  kernel from the logits, where the remap cannot be applied.

Nothing is changed for other models: the wrappers pass straight through when the model's config has
no ``forge_expert_pruning`` with layout ``remap``. If the installed vLLM lacks what this plugin
patches, loading a remap checkpoint raises an error naming the vLLM version and the missing piece
(other models are unaffected).

This module imports only torch and the standard library at import time (vLLM is imported inside
:func:`register`), and ``forge/__init__`` is lazy: importing it needs neither vLLM nor forge's
compiled extension.
"""

from __future__ import annotations

import inspect
import logging
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

__all__ = ["RemapSpec", "parse_expert_pruning", "register", "remap_architectures", "remap_routing"]

# under "vllm." so that vLLM's logging configuration (handlers, VLLM_LOGGING_LEVEL) shows it
log = logging.getLogger("vllm.forge_expert_remap")

CONFIG_KEY = "forge_expert_pruning"
# A remap checkpoint's `architectures` carry this prefix (forge-run's REMAP_ARCH_PREFIX): stock vLLM
# refuses the unknown name, and register() maps each prefixed family name to the family's class.
REMAP_ARCH_PREFIX = "ForgeRemap"
_FAMILY_ARCHS = (
    "DeepseekV2ForCausalLM",
    "DeepseekV3ForCausalLM",
    "Qwen2MoeForCausalLM",
    "Qwen3MoeForCausalLM",
    "MixtralForCausalLM",
)
# the FusedMoE prefix of decoder layer L: model.layers.L.mlp.experts (DeepSeek, Qwen-MoE),
# model.layers.L.block_sparse_moe.experts (Mixtral); multimodal wrappers prepend more
_LAYER_RE = re.compile(r"(?:^|\.)layers\.(\d+)\.[A-Za-z_][A-Za-z0-9_]*\.experts$")

_REGISTERED = False
_INSTALL_ERROR: str | None = None  # why the vLLM patch could not be installed (None: installed)
# while a remap layer's factory call runs: the ORIGINAL expert count its router must route over
_ROUTER_EXPERTS: list[int] = []


# ----------------------------------------------------------------------------- the remap


def remap_routing(
    topk_ids: torch.Tensor, topk_weights: torch.Tensor, layer_map: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Maps routing over the original experts onto a layer's compact experts.

    ``topk_ids`` [..., top_k] (any integer dtype; original ids in 0..E-1), ``topk_weights`` [...,
    top_k], ``layer_map`` [E] (compact id, or -1 for a pruned expert). Returns (ids, weights) in the
    input dtypes: ``ids = layer_map[topk_ids]``; a pruned choice becomes compact id 0 with weight 0;
    the surviving weights are rescaled so each token's sum equals its original sum (whatever
    normalisation / routed_scaling_factor produced it); a token whose choices are all pruned gets
    all-zero weights (never NaN). An id outside 0..E-1 (e.g. a -1 padding route) is treated as
    pruned, so no negative or out-of-range id ever comes out (given a map validated by
    :func:`parse_expert_pruning`: kept ids 0..k-1).

    Tensor ops only (no ``.item()``, no Python loop over tokens, no host sync): safe under CUDA
    graphs and ``torch.compile``. With nothing pruned among the choices it returns the weights
    unchanged bit for bit (the rescale factor is exactly 1).
    """
    n = layer_map.shape[0]
    ids = topk_ids.long()
    in_range = (ids >= 0) & (ids < n)
    mapped = layer_map.long()[ids.clamp(0, n - 1)]
    keep = in_range & (mapped >= 0)
    zero_i = torch.zeros_like(mapped)
    new_ids = torch.where(keep, mapped, zero_i).to(topk_ids.dtype)
    kept_w = torch.where(keep, topk_weights, torch.zeros_like(topk_weights))
    total = topk_weights.sum(dim=-1, keepdim=True)
    kept = kept_w.sum(dim=-1, keepdim=True)
    nonzero = kept != 0
    scale = torch.where(nonzero, total / torch.where(nonzero, kept, torch.ones_like(kept)), 0.0)
    return new_ids, kept_w * scale.to(kept_w.dtype)


# ----------------------------------------------------------------------------- the config key


@dataclass(frozen=True)
class RemapSpec:
    num_original_experts: int
    maps: dict[int, tuple[int, ...]]  # layer index -> [E] compact id or -1
    criterion: str | None = None

    def experts_in(self, layer: int) -> int:
        """k_L: the number of experts layer `layer` keeps."""
        return sum(1 for c in self.maps[layer] if c >= 0)


def _cfg_get(cfg: Any, key: str):
    if isinstance(cfg, Mapping):
        return cfg.get(key)
    return getattr(cfg, key, None)


def parse_expert_pruning(config: Any) -> RemapSpec | None:
    """The remap spec of a model config (a transformers config object or the config.json dict).

    None when there is no ``forge_expert_pruning`` key or its layout is not ``remap`` (``compact``
    needs no plugin). Raises ValueError for a remap entry that is malformed: maps whose length is
    not E, or whose kept (non -1) entries are not the dense ids 0..k_L-1 in original order (an
    out-of-range compact id among them), or that keep no expert.
    """
    entry = _cfg_get(config, CONFIG_KEY)
    if entry is None:
        return None
    if not isinstance(entry, Mapping):
        raise ValueError(f"{CONFIG_KEY} must be an object, got {type(entry).__name__}")
    layout = entry.get("layout")
    if layout != "remap":
        if layout != "compact":
            raise ValueError(f"{CONFIG_KEY}.layout must be 'remap' or 'compact', got {layout!r}")
        return None
    n = entry.get("num_original_experts")
    if not isinstance(n, int) or isinstance(n, bool) or n <= 0:
        raise ValueError(f"{CONFIG_KEY}.num_original_experts must be a positive int, got {n!r}")
    raw = entry.get("expert_map")
    if not isinstance(raw, Mapping) or not raw:
        raise ValueError(f"{CONFIG_KEY}.expert_map must be a non-empty object {{layer: [E ints]}}")
    maps: dict[int, tuple[int, ...]] = {}
    for key, m in raw.items():
        try:
            layer = int(key)
        except (TypeError, ValueError):
            raise ValueError(f"{CONFIG_KEY}.expert_map: layer key {key!r} is not an integer") from None
        where = f"{CONFIG_KEY}.expert_map[{key!r}]"
        if not isinstance(m, list | tuple) or len(m) != n:
            size = len(m) if isinstance(m, list | tuple) else type(m).__name__
            raise ValueError(f"{where}: expected {n} entries (num_original_experts), got {size}")
        if not all(isinstance(c, int) and not isinstance(c, bool) for c in m):
            raise ValueError(f"{where}: entries must be ints")
        kept = [c for c in m if c != -1]
        if not kept:
            raise ValueError(f"{where}: keeps no expert (at least one is required: compact id 0)")
        k = len(kept)
        for e, c in enumerate(m):
            if c < -1 or c >= k:
                raise ValueError(
                    f"{where}: expert {e} has compact id {c}, outside 0..{k - 1} (the map keeps {k} "
                    "experts; -1 marks a pruned one)"
                )
        if kept != list(range(k)):
            raise ValueError(f"{where}: kept compact ids must be 0..{k - 1} in original id order, got {kept}")
        maps[layer] = tuple(m)
    crit = entry.get("criterion")
    return RemapSpec(num_original_experts=n, maps=maps, criterion=crit if isinstance(crit, str) else None)


def layer_index(prefix: str) -> int | None:
    """Decoder layer index of a FusedMoE prefix ``...layers.L.<block>.experts``; None otherwise."""
    m = _LAYER_RE.search(prefix or "")
    return int(m.group(1)) if m else None


# ----------------------------------------------------------------------------- vLLM side


def _vllm_version() -> str:
    try:
        import vllm

        return str(getattr(vllm, "__version__", "unknown"))
    except Exception:  # pragma: no cover - only for the message
        return "unknown"


def _incompatible(what: str) -> RuntimeError:
    return RuntimeError(
        f"forge expert-remap plugin: this checkpoint uses forge's REMAP expert-pruning layout "
        f"({CONFIG_KEY}.layout == 'remap'), which needs the plugin's vLLM patch, but the installed "
        f"vLLM {_vllm_version()} does not match what the plugin knows (written for vLLM 0.32): "
        f"{what}. Re-export the checkpoint with layout 'compact' (no plugin needed) or use vLLM 0.32."
    )


_SPEC_CACHE: dict[int, tuple[Any, RemapSpec | None]] = {}


def _current_spec() -> RemapSpec | None:
    """The remap spec of the model vLLM is building now (None: not a remap model)."""
    from vllm.config import get_current_vllm_config

    model_config = getattr(get_current_vllm_config(), "model_config", None)
    if model_config is None:
        return None
    for attr in ("hf_config", "hf_text_config"):
        cfg = getattr(model_config, attr, None)
        if cfg is None:
            continue
        hit = _SPEC_CACHE.get(id(cfg))
        if hit is not None and hit[0] is cfg:
            spec = hit[1]
        else:
            spec = parse_expert_pruning(cfg)
            _SPEC_CACHE[id(cfg)] = (cfg, spec)
        if spec is not None or _cfg_get(cfg, CONFIG_KEY) is not None:
            return spec
    return None


def _attach_remap(runner, layer: int, layer_map: tuple[int, ...], base_router_cls) -> None:
    """Wraps the layer's router so its routing goes through remap_routing with the layer's map."""
    router = getattr(runner, "router", None)
    if not isinstance(router, base_router_cls):
        raise _incompatible(
            f"the MoE layer's router is {type(router).__name__}, not a BaseRouter with _compute_routing"
        )
    experts = getattr(runner, "routed_experts", None)
    if experts is None or not isinstance(runner, torch.nn.Module):
        raise _incompatible("FusedMoEFactory did not return an nn.Module runner with routed_experts")
    # created inside vLLM's model construction, so on the layer's device (torch.device context)
    runner.register_buffer("forge_expert_map", torch.tensor(layer_map, dtype=torch.int64), persistent=False)
    compute = router._compute_routing  # bound method of this router instance
    params = inspect.signature(compute).parameters
    if "router_logits" not in params:
        raise _incompatible(f"{type(router).__name__}._compute_routing has no router_logits argument")

    def _compute_routing_remapped(*args, **kwargs):
        topk_weights, topk_ids = compute(*args, **kwargs)
        topk_ids, topk_weights = remap_routing(topk_ids, topk_weights, runner.forge_expert_map)
        return topk_weights, topk_ids

    router._compute_routing = _compute_routing_remapped
    router.forge_remap_layer = layer

    def _monolithic(*args, **kwargs):
        raise _incompatible(
            f"layer {layer}: vLLM chose a monolithic MoE kernel "
            f"({type(experts.quant_method).__name__}), which routes inside the kernel where the "
            "expert remap cannot be applied"
        )

    experts.forward_monolithic = _monolithic


def _install() -> None:
    """Patches vLLM 0.32 (see the module docstring). Raises AttributeError/ImportError/TypeError
    when the installed vLLM does not have what it patches."""
    import sys

    import vllm.model_executor.layers.fused_moe as fm_pkg
    from vllm.model_executor.layers.fused_moe import layer as layer_mod
    from vllm.model_executor.layers.fused_moe.router.base_router import BaseRouter

    factory = layer_mod.FusedMoEFactory
    make_router = layer_mod.create_fused_moe_router
    if getattr(factory, "_forge_remap", False):
        return
    sig = inspect.signature(factory)
    router_sig = inspect.signature(make_router)
    for name in ("num_experts", "prefix", "router", "enable_eplb", "num_redundant_experts"):
        if name not in sig.parameters:
            raise TypeError(f"FusedMoEFactory has no {name!r} argument")
    for name in ("global_num_experts", "num_logical_experts"):
        if name not in router_sig.parameters:
            raise TypeError(f"create_fused_moe_router has no {name!r} argument")
    if not hasattr(BaseRouter, "_compute_routing"):
        raise AttributeError("BaseRouter has no _compute_routing")

    def create_fused_moe_router(*args, **kwargs):
        if _ROUTER_EXPERTS:
            bound = router_sig.bind(*args, **kwargs)
            bound.arguments["global_num_experts"] = _ROUTER_EXPERTS[-1]
            bound.arguments["num_logical_experts"] = _ROUTER_EXPERTS[-1]
            return make_router(*bound.args, **bound.kwargs)
        return make_router(*args, **kwargs)

    def FusedMoEFactory(*args, **kwargs):  # noqa: N802 - vLLM's name
        spec = _current_spec()
        if spec is None:
            return factory(*args, **kwargs)
        bound = sig.bind(*args, **kwargs)
        arg = bound.arguments
        prefix = arg.get("prefix", "")
        layer = layer_index(prefix)
        if layer is None or layer not in spec.maps:
            # a MoE layer the map does not list keeps all E experts
            return factory(*args, **kwargs)
        n_experts = arg["num_experts"]
        if n_experts != spec.num_original_experts:
            raise ValueError(
                f"{CONFIG_KEY}: num_original_experts is {spec.num_original_experts} but the model "
                f"builds {prefix} with {n_experts} experts (config's expert count must stay E)"
            )
        if arg.get("router") is not None:
            raise _incompatible(f"{prefix}: the model passes its own router to FusedMoEFactory")
        if arg.get("enable_eplb") or arg.get("num_redundant_experts"):
            raise NotImplementedError(
                f"{CONFIG_KEY} remap layout: EPLB / redundant experts are not supported"
            )
        k = spec.experts_in(layer)
        arg["num_experts"] = k
        _ROUTER_EXPERTS.append(n_experts)
        try:
            runner = factory(*bound.args, **bound.kwargs)
        finally:
            _ROUTER_EXPERTS.pop()
        if getattr(runner, "router", None) is not None and runner.router.global_num_experts != n_experts:
            raise _incompatible(
                f"{prefix}: the router was not built through layer.create_fused_moe_router "
                f"(it routes over {runner.router.global_num_experts} experts, not {n_experts})"
            )
        _attach_remap(runner, layer, spec.maps[layer], BaseRouter)
        log.info("forge expert remap: %s keeps %d of %d experts", prefix, k, n_experts)
        return runner

    FusedMoEFactory._forge_remap = True
    FusedMoEFactory.__wrapped__ = factory
    layer_mod.create_fused_moe_router = create_fused_moe_router
    # rebind the name wherever it was imported (`from ...fused_moe import FusedMoEFactory`): the
    # package re-export (model modules imported later get the wrapper) and modules already loaded
    # (module __dict__ only: getattr would trigger lazy modules' imports, e.g. transformers')
    for name, mod in list(sys.modules.items()):
        if name.startswith("vllm.") and getattr(mod, "__dict__", {}).get("FusedMoEFactory") is factory:
            mod.FusedMoEFactory = FusedMoEFactory
    fm_pkg.FusedMoEFactory = FusedMoEFactory
    layer_mod.FusedMoEFactory = FusedMoEFactory


def _install_guard() -> None:
    """Where the patch could not be installed: fail loading a remap checkpoint with a clear error
    (other models load as usual). Hooks the model-class resolution, present across vLLM versions."""
    try:
        from vllm.model_executor.models.registry import _ModelRegistry
    except Exception:  # nothing to hook: warn once, here
        log.warning(
            "forge expert-remap plugin inactive (%s); remap checkpoints would load WRONGLY", _INSTALL_ERROR
        )
        return
    resolve = _ModelRegistry.resolve_model_cls
    if getattr(resolve, "_forge_remap_guard", False):
        return

    def resolve_model_cls(self, *args, **kwargs):
        for a in (*args, *kwargs.values()):
            cfg = getattr(a, "hf_config", None)
            if cfg is not None and parse_expert_pruning(cfg) is not None:
                raise _incompatible(_INSTALL_ERROR or "unknown")
        return resolve(self, *args, **kwargs)

    resolve_model_cls._forge_remap_guard = True
    _ModelRegistry.resolve_model_cls = resolve_model_cls


def remap_architectures(architectures: list[str]) -> list[str]:
    """The ``architectures`` of a remap checkpoint (what forge's writer puts in config.json)."""
    return [a if a.startswith(REMAP_ARCH_PREFIX) else REMAP_ARCH_PREFIX + a for a in architectures]


def _register_architectures() -> None:
    """Registers ``ForgeRemap<Family>`` as the family's own vLLM model class (remap checkpoints
    carry that name so that vLLM without this plugin refuses them)."""
    from vllm import ModelRegistry

    models = ModelRegistry.models
    for arch in _FAMILY_ARCHS:
        alias, entry = REMAP_ARCH_PREFIX + arch, models.get(arch)
        if entry is None or alias in models:
            continue
        if hasattr(entry, "module_name") and hasattr(entry, "class_name"):
            ModelRegistry.register_model(alias, f"{entry.module_name}:{entry.class_name}")
        else:
            ModelRegistry.register_model(alias, entry.load_model_cls())


def register() -> None:
    """The ``vllm.general_plugins`` entry point. Idempotent (vLLM calls it in every process)."""
    global _REGISTERED, _INSTALL_ERROR
    if _REGISTERED:
        return
    _REGISTERED = True
    try:
        _install()
        _register_architectures()
        _INSTALL_ERROR = None
    except (ImportError, AttributeError, TypeError) as exc:
        _INSTALL_ERROR = f"{type(exc).__name__}: {exc}"
        _install_guard()
