"""4bit-forge: streamed 4-bit (W4A16) GPTQ/AWQ quantization of giant MoE LLMs.

The heavy maths runs in Rust (``forge._native``); this package is the Python surface.

The public names below are loaded on first use (PEP 562), so ``import forge.vllm_plugin`` (which
vLLM does in every process through its ``vllm.general_plugins`` entry point) imports only that
module: it works where forge's compiled extension is absent and costs vLLM no extra imports. A
missing extension still raises its ImportError at the first use of a name that needs it.
"""

from __future__ import annotations

import importlib

# public name -> (submodule, attribute)
_EXPORTS = {
    "__version__": ("_native", "__version__"),
    "QuantizeReport": ("api", "QuantizeReport"),
    "VerifyReport": ("api", "VerifyReport"),
    "default_options": ("api", "default_options"),
    "inspect": ("api", "inspect"),
    "quantize_model": ("api", "quantize_model"),
    "prune_model": ("api", "prune_model"),
    "verify": ("api", "verify"),
    "load_dequantized_model": ("checkpoint", "load_dequantized_model"),
    "load_dequantized_state_dict": ("checkpoint", "load_dequantized_state_dict"),
    "GPTQ": ("gptq", "GPTQ"),
    **{
        name: ("quant", name)
        for name in (
            "GPTQResult",
            "HessianFactor",
            "awq_matmul",
            "build_quant_grid",
            "cuda_status",
            "decode_qmeta",
            "dequantize_awq",
            "dequantize_awq_dense",
            "dequantize_gptq",
            "encode_qmeta",
            "gptq_quantize",
            "gptq_solve",
            "gptq_solve_batched",
            "hessian_update",
            "hessian_update_segmented",
            "pack_awq",
            "pack_gptq",
            "prepare_hessian",
            "prepare_hessian_batched",
            "quantize_pack_awq",
            "quantize_rtn",
            "tile_awq",
            "unpack_awq",
            "unpack_gptq",
        )
    },
    # W4A16 runtime: forged checkpoints as transformers models, and their evaluation
    "EvalReport": ("evaluate", "EvalReport"),
    "ModelEval": ("evaluate", "ModelEval"),
    "evaluate": ("evaluate", "evaluate"),
    "load_fp8_dequantized": ("loading", "load_fp8_dequantized"),
    "load_quantized": ("loading", "load_quantized"),
    "AwqExperts": ("runtime", "AwqExperts"),
    "AwqLinear": ("runtime", "AwqLinear"),
}

__all__ = ["errors", *_EXPORTS]


def __getattr__(name: str):
    if name in _EXPORTS:
        module, attr = _EXPORTS[name]
        value = getattr(importlib.import_module(f".{module}", __name__), attr)
    else:
        # submodules as attributes (`forge.api`, `forge.errors`, ...), as an eager import made them
        try:
            value = importlib.import_module(f".{name}", __name__)
        except ModuleNotFoundError as exc:
            if exc.name != f"{__name__}.{name}":
                raise
            raise AttributeError(f"module {__name__!r} has no attribute {name!r}") from None
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
