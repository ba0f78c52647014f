"""vLLM general plugin used by benches/vllm_check.py on hosts without vLLM's CPU int4 kernels.

vLLM-CPU's 4-bit kernels (dense ``cpu_gemm_wna16``, MoE WNA16) need AVX-512/AMX. On an AVX2-only
host every AWQ checkpoint fails at the first forward. This plugin keeps everything that checks a
checkpoint's LAYOUT inside vLLM — its config parsing, its ``AutoAWQConfig`` method selection, its
weight loaders (names, shapes, merged gate/up and qkv shards, the FusedMoE expert mapping) and
its own AWQ unpacking code — and only replaces the int4 matmul: once after loading, every AWQ
layer is dequantized with vLLM's code and handed to vLLM's unquantized CPU path.

* dense: ``AutoAWQMarlinLinearMethod.process_weights_after_loading`` runs vLLM's
  ``_convert_awq_to_standard_format`` (AWQ order -> GPTQ-like standard packing, the conversion its
  CPU kernel consumes), unpacks that with vLLM's ``unpack_quantized_values_into_int32``,
  W = (q - z) * s in float32, cast to the model dtype, then swaps in ``UnquantizedLinearMethod``.
* MoE: ``AutoAWQMoEMethod`` skips the int4 backend selection (which raises on AVX2) and its
  ``process_weights_after_loading`` dequantizes with vLLM's ``_unpack_and_dequant_int4_awq``
  (the EMULATION backend's unpacker) into ``w13_weight`` [E, 2I, H] / ``w2_weight`` [E, H, I],
  then swaps in ``UnquantizedFusedMoEMethod``.

Not the product's plugin: a test tool. Registered by vllm_check.py through a throw-away
``*.dist-info/entry_points.txt`` (group ``vllm.general_plugins``) on PYTHONPATH; vLLM loads it in
every process, so ``register`` is idempotent. With $FORGE_VLLM_CHECK_DUMP it also saves the float
weights vLLM hands to its unquantized path (both runs), for a per-tensor comparison.
"""

from __future__ import annotations

_REGISTERED = False


def _mark(kind: str) -> None:
    """Appends `kind` to $FORGE_VLLM_CHECK_MARKER (how the driver counts the layers it dequantized)."""
    import os

    path = os.environ.get("FORGE_VLLM_CHECK_MARKER")
    if path:
        with open(path, "a") as fh:
            fh.write(kind + "\n")


def _dequant_dense(layer) -> None:
    import torch
    from vllm.model_executor.layers.linear import UnquantizedLinearMethod
    from vllm.model_executor.layers.quantization import auto_awq
    from vllm.model_executor.layers.quantization.utils.quant_utils import (
        unpack_quantized_values_into_int32,
    )
    from vllm.scalar_type import scalar_types

    dtype = layer.scales.dtype  # the model dtype (params_dtype)
    auto_awq._convert_awq_to_standard_format(layer, "qweight", "qzeros", 4)
    q = unpack_quantized_values_into_int32(layer.qweight.data, scalar_types.uint4, 0)  # [K, N]
    z = unpack_quantized_values_into_int32(layer.qzeros.data, scalar_types.uint4, 0)  # [N, G]
    s = layer.scales.data  # [G, N]
    g = q.shape[0] // s.shape[0]
    w_kn = (q - z.t().repeat_interleave(g, 0)).to(torch.float32) * s.to(torch.float32).repeat_interleave(g, 0)
    weight = w_kn.t().contiguous().to(dtype)
    for name in ("qweight", "qzeros", "scales"):
        delattr(layer, name)
    layer.register_parameter("weight", torch.nn.Parameter(weight, requires_grad=False))
    layer.quant_method = UnquantizedLinearMethod()
    layer.quant_method.process_weights_after_loading(layer)
    _mark("dense")


def _dequant_moe(layer) -> None:
    import torch
    from vllm.model_executor.layers.fused_moe.oracle.int_wna16 import _unpack_and_dequant_int4_awq
    from vllm.model_executor.layers.fused_moe.unquantized_fused_moe_method import (
        UnquantizedFusedMoEMethod,
    )

    dtype = layer.w13_scales.dtype
    f32 = torch.float32
    # w13_qweight [E, H, 2I/8] -> [E, 2I, H]; w2_qweight [E, I, H/8] -> [E, H, I]
    w13 = _unpack_and_dequant_int4_awq(
        layer.w13_qweight.data, layer.w13_scales.data.to(f32), layer.w13_qzeros.data, True, f32
    )
    w2 = _unpack_and_dequant_int4_awq(
        layer.w2_qweight.data, layer.w2_scales.data.to(f32), layer.w2_qzeros.data, True, f32
    )
    for name in ("w13_qweight", "w2_qweight", "w13_scales", "w2_scales", "w13_qzeros", "w2_qzeros"):
        delattr(layer, name)
    layer.register_parameter("w13_weight", torch.nn.Parameter(w13.to(dtype), requires_grad=False))
    layer.register_parameter("w2_weight", torch.nn.Parameter(w2.to(dtype), requires_grad=False))
    method = UnquantizedFusedMoEMethod(layer.moe_config)
    layer._replace_quant_method(method)
    method.process_weights_after_loading(layer)
    _mark("moe")


def _dump_hooks(folder: str) -> None:
    """Saves every linear's / MoE layer's float weights as vLLM hands them to its unquantized path
    (after loading, merging and, in the forged run, this plugin's dequantization), one file per
    layer: the driver compares them tensor by tensor, independent of forward-pass determinism."""
    import os

    import torch
    from vllm.model_executor.layers.fused_moe.unquantized_fused_moe_method import (
        UnquantizedFusedMoEMethod,
    )
    from vllm.model_executor.layers.linear import UnquantizedLinearMethod

    os.makedirs(folder, exist_ok=True)

    def save(name, tensors):
        path = os.path.join(folder, f"{name or 'unnamed'}.{os.getpid()}.pt")
        torch.save({k: v.detach().cpu().clone() for k, v in tensors.items()}, path)

    lin = UnquantizedLinearMethod.process_weights_after_loading
    moe = UnquantizedFusedMoEMethod.process_weights_after_loading

    def lin_hook(self, layer):
        if getattr(layer, "weight", None) is not None:
            save(getattr(layer, "prefix", ""), {"weight": layer.weight})
        return lin(self, layer)

    def moe_hook(self, layer):
        save(getattr(layer, "layer_name", ""), {"w13_weight": layer.w13_weight, "w2_weight": layer.w2_weight})
        return moe(self, layer)

    UnquantizedLinearMethod.process_weights_after_loading = lin_hook
    UnquantizedFusedMoEMethod.process_weights_after_loading = moe_hook


def register() -> None:
    global _REGISTERED
    if _REGISTERED:
        return
    _REGISTERED = True
    import os

    if os.environ.get("FORGE_VLLM_CHECK_DUMP"):
        _dump_hooks(os.environ["FORGE_VLLM_CHECK_DUMP"])
    if os.environ.get("FORGE_VLLM_CHECK_DEQUANT", "1") == "0":
        return
    from vllm.model_executor.layers.fused_moe.fused_moe_method_base import FusedMoEMethodBase
    from vllm.model_executor.layers.quantization import auto_awq
    from vllm.scalar_type import scalar_types

    def dense_pwal(self, layer):
        _dequant_dense(layer)

    def moe_pwal(self, layer):
        _dequant_moe(layer)

    auto_awq.AutoAWQMarlinLinearMethod.process_weights_after_loading = dense_pwal

    def moe_init(self, quant_config, moe):
        FusedMoEMethodBase.__init__(self, moe)
        self.quant_config = quant_config
        if quant_config.weight_bits != 4:
            raise ValueError("AutoAWQMoEMethod only supports 4bit now.")
        self.quant_type = scalar_types.uint4
        self.input_dtype = None
        self.use_marlin = True
        self.wna16_moe_backend, self.experts_cls = None, None

    auto_awq.AutoAWQMoEMethod.__init__ = moe_init
    auto_awq.AutoAWQMoEMethod.process_weights_after_loading = moe_pwal
