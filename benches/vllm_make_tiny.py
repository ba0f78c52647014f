"""Tiny random checkpoints forged to 4 bits, for benches/vllm_check.py (run with FORGE's python).

    python benches/vllm_make_tiny.py OUT [--format awq|gptq|compressed-tensors] [--symmetric]
        [llama qwen3_moe mixtral deepseek]

writes OUT/<family>/src (bf16, tests/tiny_models.make_model) and OUT/<family>/<format>
(forge.quantize_model, group size 32; ``gptq`` implies ``symmetric=True``, the only GPTQ v1 grid
vLLM loads; ``--symmetric`` picks the symmetric grid for the other formats too, and names the
folder ``<format>-sym``). Dimensions are tiny_models' with what vLLM's CPU paths
need: hidden 128 (vLLM's AWQ MoE method requires hidden % 128 == 0, else it routes to MoeWNA16),
and for DeepSeek-V3 kv_lora_rank 512 + qk_rope_head_dim 64 (vLLM CPU's MLA backend) and the
released config's ``topk_method: noaux_tc`` / ``scoring_func: sigmoid``.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

import tiny_models  # noqa: E402

FAMILIES = ["llama", "qwen3_moe", "mixtral", "deepseek"]


def _vllm_dims(kind: str):
    base = tiny_models.CONFIGS[kind]

    def cfg():
        c = base()
        over = {"hidden_size": 128}
        if kind == "deepseek":
            over.update(
                q_lora_rank=64,
                kv_lora_rank=512,
                qk_rope_head_dim=64,
                qk_nope_head_dim=64,
                v_head_dim=64,
                qk_head_dim=128,
                head_dim=64,
                # the released DeepSeek-V3 config.json carries these; transformers' config class does
                # not, and without them vLLM builds softmax routing with no e_score_correction_bias
                # (KeyError on load)
                topk_method="noaux_tc",
                scoring_func="sigmoid",
            )
        d = c.to_dict()
        d.update(over)
        return type(c).from_dict(d)

    return cfg


FORMATS = ["awq", "gptq", "compressed-tensors"]


def make(
    kind: str, root: Path, group_size: int = 32, fmt: str = "awq", symmetric: bool = False
) -> tuple[Path, Path]:
    import forge

    if fmt not in FORMATS:
        raise ValueError(f"format {fmt!r}: one of {FORMATS}")
    sym = symmetric or fmt == "gptq"
    src = root / kind / "src"
    out = root / kind / (fmt + ("-sym" if symmetric and fmt != "gptq" else ""))
    orig = dict(tiny_models.CONFIGS)
    tiny_models.CONFIGS[kind] = _vllm_dims(kind)
    try:
        tiny_models.make_model(kind, src, shard="200KB")
    finally:
        tiny_models.CONFIGS.update(orig)
    forge.quantize_model(
        src, out, group_size=group_size, format=fmt, symmetric=sym, progress=False, overwrite=True
    )
    return src, out


if __name__ == "__main__":
    import argparse

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out")
    ap.add_argument("families", nargs="*", help=f"default: {' '.join(FAMILIES)}")
    ap.add_argument("--format", default="awq", choices=FORMATS)
    ap.add_argument("--symmetric", action="store_true")
    ap.add_argument("--group-size", type=int, default=32)
    a = ap.parse_intermixed_args()
    for k in a.families:
        if k not in FAMILIES:
            ap.error(f"family {k!r}: one of {FAMILIES}")
    for k in a.families or FAMILIES:
        print(k, *make(k, Path(a.out), a.group_size, a.format, a.symmetric))
