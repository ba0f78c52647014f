"""4bit-forge: streamed 4-bit (W4A16) GPTQ/AWQ quantization of giant MoE LLMs.

The heavy maths runs in Rust (``forge._native``); this package is the Python surface.
"""

from __future__ import annotations

from . import errors
from ._native import __version__
from .api import QuantizeReport, VerifyReport, default_options, inspect, prune_model, quantize_model, verify
from .checkpoint import load_dequantized_model, load_dequantized_state_dict
from .gptq import GPTQ
from .quant import (
    GPTQResult,
    HessianFactor,
    awq_matmul,
    build_quant_grid,
    cuda_status,
    decode_qmeta,
    dequantize_awq,
    dequantize_gptq,
    encode_qmeta,
    gptq_quantize,
    gptq_solve,
    gptq_solve_batched,
    hessian_update,
    hessian_update_segmented,
    pack_awq,
    pack_gptq,
    prepare_hessian,
    prepare_hessian_batched,
    quantize_pack_awq,
    quantize_rtn,
    unpack_awq,
    unpack_gptq,
)

__all__ = [
    "__version__",
    "errors",
    "QuantizeReport",
    "VerifyReport",
    "inspect",
    "load_dequantized_model",
    "load_dequantized_state_dict",
    "quantize_model",
    "prune_model",
    "default_options",
    "verify",
    "GPTQ",
    "GPTQResult",
    "HessianFactor",
    "awq_matmul",
    "build_quant_grid",
    "cuda_status",
    "decode_qmeta",
    "dequantize_awq",
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
    "unpack_awq",
    "unpack_gptq",
]

# W4A16 runtime: forged checkpoints as transformers models, and their evaluation
from .evaluate import EvalReport, ModelEval, evaluate  # noqa: E402
from .loading import load_fp8_dequantized, load_quantized  # noqa: E402
from .runtime import AwqExperts, AwqLinear  # noqa: E402

__all__ += [
    "AwqExperts",
    "AwqLinear",
    "EvalReport",
    "ModelEval",
    "evaluate",
    "load_fp8_dequantized",
    "load_quantized",
]
