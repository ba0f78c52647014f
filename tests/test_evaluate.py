"""forge.evaluate, the ``eval`` command and the FP8 reference loader on the trained
DeepSeek-V3-tiny (shared/assets, skipped when absent), plus a tiny forged model."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")

import forge  # noqa: E402
from forge.__main__ import main  # noqa: E402
from forge.errors import CheckpointError, InvalidValueError  # noqa: E402

# the `shared` folder beside the repository root
ASSETS = Path(__file__).resolve().parents[1].parent / "shared" / "assets" / "deepseek-v3-tiny"
TEXT = Path(__file__).resolve().parents[1] / "README.md"
needs_assets = pytest.mark.skipif(not (ASSETS / "bf16").is_dir(), reason=f"{ASSETS} not present")


@pytest.fixture(scope="module")
def forged_tiny(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("ds") / "awq"
    forge.quantize_model(ASSETS / "bf16", out, method="rtn", group_size=128, progress=False)
    return out


@needs_assets
def test_fp8_reference_dequantizes_by_block():
    """kv_a_proj_with_mqa (160 rows: a partial 128-row block) within e4m3 error of bf16."""
    fp8 = forge.load_fp8_dequantized(ASSETS / "fp8", dtype=torch.float32)
    bf16 = transformers.AutoModelForCausalLM.from_pretrained(ASSETS / "bf16", dtype=torch.float32)
    ours, theirs = dict(fp8.named_parameters()), dict(bf16.named_parameters())
    for name in (
        "model.layers.1.self_attn.kv_a_proj_with_mqa.weight",
        "model.layers.2.mlp.experts.down_proj",
    ):
        err = float((ours[name] - theirs[name]).norm() / theirs[name].norm())
        assert err < 0.04, (name, err)  # README: 2.69 % at worst; transformers' own path: up to 35 %
    assert fp8.model.layers[1].mlp.gate.e_score_correction_bias.dtype == torch.float32


@needs_assets
def test_evaluate_forged_beside_fp8_original(forged_tiny):
    report = forge.evaluate(
        forged_tiny,
        TEXT,
        ref_dir=ASSETS / "fp8",
        seqlen=64,
        max_windows=2,
        samples=2,
        max_new_tokens=4,
        progress=False,
    )
    assert report.windows == 2 and len(report.prompts) == 2
    assert report.forged.kind == "w4a16" and report.reference.kind == "fp8-dequantized"
    assert report.forged.tokens == report.reference.tokens == 2 * 63
    for e in (report.forged, report.reference):
        assert math.isfinite(e.perplexity) and len(e.samples) == 2
    # 4-bit RTN g128 costs little on this model (README: +0.9 % on its own text)
    assert abs(math.log(report.forged.perplexity / report.reference.perplexity)) < 0.1
    assert "forged vs reference perplexity" in report.table()


@needs_assets
def test_eval_command(forged_tiny, tmp_path, capsys):
    out = tmp_path / "report.json"
    argv = ["forge-rs", "eval", str(forged_tiny), "--text", str(TEXT), "--seqlen", "32"]
    argv += [
        "--max-windows",
        "1",
        "--samples",
        "1",
        "--max-new-tokens",
        "2",
        "--no-progress",
        "--json",
        str(out),
    ]
    assert main(argv) == 0
    assert "perplexity" in capsys.readouterr().out
    assert json.loads(out.read_text())["forged"]["tokens"] == 31


def test_evaluate_errors(tmp_path):
    with pytest.raises(InvalidValueError, match="seqlen"):
        forge.evaluate(tmp_path, TEXT, seqlen=1)
    with pytest.raises(FileNotFoundError, match="text_file"):
        forge.evaluate(tmp_path, tmp_path / "missing.txt")
    with pytest.raises(CheckpointError, match="config.json"):
        forge.evaluate(tmp_path, TEXT)
    assert main(["forge-rs", "eval", str(tmp_path), "--text", str(TEXT)]) == 2
