"""Output formats of the native run: ``format`` = ``awq`` | ``gptq`` | ``compressed-tensors``.

Each tiny model (Llama, DeepSeek-V3 with MoE and an MTP layer) is quantized data-free in every
format; every quantized linear is unpacked by this file's OWN few lines of torch per format
(formats.md layouts, nothing from forge) and the codes, zero points and scales must be equal
across formats (same grid). ``forge.load_quantized`` must give the same logits for all formats,
``forge.verify`` must accept each folder and name the tensor of a corrupted one.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")
from safetensors.torch import load_file, save_file  # noqa: E402
from tiny_models import awq_unpack, make_model, read_tensors  # noqa: E402

import forge  # noqa: E402
from forge.errors import CheckpointError  # noqa: E402

G = 32
FORMATS = ["awq", "gptq", "compressed-tensors"]
TOKENS = torch.randint(0, 256, (2, 9), generator=torch.Generator().manual_seed(3))


def nibbles(p: torch.Tensor, dim: int) -> torch.Tensor:
    """int32 words -> their 8 nibbles in plain order, spread along ``dim`` (0 rows, 1 columns)."""
    u = p.to(torch.int64) & 0xFFFFFFFF
    parts = torch.stack([(u >> (4 * i)) & 0xF for i in range(8)], dim=dim + 1)
    return parts.flatten(dim, dim + 1)


def unpack_awq(t: dict, m: str):
    _, codes, zeros, scales = awq_unpack(t[m + ".qweight"], t[m + ".qzeros"], t[m + ".scales"], G)
    return codes, zeros, scales


def unpack_gptq(t: dict, m: str):
    codes = nibbles(t[m + ".qweight"], 0)  # [K/8, N] -> [K, N]
    zeros = nibbles(t[m + ".qzeros"], 1) + 1  # [K/G, N/8] -> [K/G, N], stored z - 1
    k = codes.shape[0]
    assert torch.equal(t[m + ".g_idx"].to(torch.int64), torch.arange(k) // G), m
    return codes, zeros, t[m + ".scales"].float()


def unpack_ct(t: dict, m: str):
    codes = nibbles(t[m + ".weight_packed"], 1).t()  # [N, K/8] -> [N, K] -> [K, N]
    n, k = t[m + ".weight_shape"].tolist()
    assert tuple(codes.shape) == (k, n), m
    scales = t[m + ".weight_scale"].float().t()  # [N, K/G] -> [K/G, N]
    if m + ".weight_zero_point" in t:
        zeros = nibbles(t[m + ".weight_zero_point"], 0).t()  # [N/8, K/G] -> [N, K/G] -> [K/G, N]
    else:
        zeros = torch.full_like(scales, 8, dtype=torch.int64)
    return codes, zeros, scales


UNPACK = {
    "awq": (".qweight", unpack_awq),
    "gptq": (".qweight", unpack_gptq),
    "compressed-tensors": (".weight_packed", unpack_ct),
}


def grids(folder: Path, fmt: str) -> dict[str, tuple]:
    suffix, unpack = UNPACK[fmt]
    t = read_tensors(folder)
    return {n[: -len(suffix)]: unpack(t, n[: -len(suffix)]) for n in t if n.endswith(suffix)}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("formats")
    out = {}
    for kind in ("llama", "deepseek"):
        src = make_model(kind, root / f"src-{kind}")
        for sym in (True, False):
            for fmt in FORMATS:
                if fmt == "gptq" and not sym:
                    continue
                dst = root / f"{kind}-{fmt}-{sym}"
                forge.quantize_model(src, dst, format=fmt, symmetric=sym, group_size=G, progress=False)
                out[kind, fmt, sym] = dst
        out[kind, "src"] = src
    return out


@pytest.mark.parametrize("kind", ["llama", "deepseek"])
@pytest.mark.parametrize("sym", [True, False])
def test_formats_hold_the_same_grid(runs, kind, sym):
    fmts = [f for f in FORMATS if (kind, f, sym) in runs]
    ref = grids(runs[kind, "awq", sym], "awq")
    assert ref
    for fmt in fmts[1:]:
        got = grids(runs[kind, fmt, sym], fmt)
        assert got.keys() == ref.keys(), fmt
        for m, (codes, zeros, scales) in ref.items():
            c, z, s = got[m]
            assert torch.equal(c.to(torch.int64), codes.to(torch.int64)), (fmt, m)
            assert torch.equal(z.to(torch.int64), zeros.to(torch.int64)), (fmt, m)
            assert torch.equal(s, scales), (fmt, m)
            if sym:
                assert bool((zeros == 8).all()), m


@pytest.mark.parametrize("kind", ["llama", "deepseek"])
def test_config_blocks_and_verify(runs, kind):
    for (k, fmt, *rest), folder in runs.items():
        if k != kind or fmt == "src":
            continue
        sym = rest[0]
        rep = forge.verify(folder)
        assert rep.ok and rep.format == fmt and rep.quantized > 0, (fmt, rep.problems)
        qc = json.loads((folder / "config.json").read_text())["quantization_config"]
        assert qc["quant_method"] == fmt
        if fmt == "gptq":
            assert qc | {"dynamic": None} == {
                "quant_method": "gptq",
                "bits": 4,
                "group_size": G,
                "desc_act": False,
                "sym": True,
                "checkpoint_format": "gptq",
                "lm_head": False,
                "dynamic": None,
            }
        if fmt == "compressed-tensors":
            assert qc["format"] == "pack-quantized"
            w = qc["config_groups"]["group_0"]["weights"]
            assert (w["num_bits"], w["type"], w["symmetric"], w["strategy"], w["group_size"]) == (
                4,
                "int",
                sym,
                "group",
                G,
            )
            assert "lm_head" in qc["ignore"]
        if kind == "deepseek":  # kv_b_proj (default exclusion), routers and the MTP layer stay bf16
            skip = {
                "awq": qc.get("modules_to_not_convert"),
                "gptq": [
                    r.removeprefix("-:").removesuffix(r"(?:\.|$)").replace("\\", "")
                    for r in qc.get("dynamic", {})
                ],
                "compressed-tensors": qc.get("ignore"),
            }[fmt]
            assert "model.layers.0.self_attn.kv_b_proj" in skip, fmt
            assert "model.layers.1.mlp.gate" in skip, fmt


@pytest.mark.parametrize("kind", ["llama", "deepseek"])
def test_load_quantized_gives_the_same_logits(runs, kind):
    def run(folder):
        model, _ = forge.load_quantized(folder, dtype=torch.float32, tokenizer=False)
        with torch.no_grad():
            return model(TOKENS).logits

    for sym in (True, False):
        ref = run(runs[kind, "awq", sym])
        for fmt in FORMATS[1:]:
            if (kind, fmt, sym) in runs:
                torch.testing.assert_close(run(runs[kind, fmt, sym]), ref, rtol=1e-5, atol=1e-5)


def rewrite(folder: Path, name: str, edit) -> None:
    """Applies ``edit(tensors) `` to the shard holding ``name``, keeping the index consistent."""
    index_path = folder / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    shard = folder / index["weight_map"][name]
    tensors = load_file(shard)
    edit(tensors)
    save_file(tensors, shard)
    index["weight_map"] = {k: v for k, v in index["weight_map"].items() if k != name or name in tensors}
    total = sum(t.numel() * t.element_size() for t in read_tensors(folder).values())
    index["metadata"]["total_size"] = total
    index_path.write_text(json.dumps(index))


def test_verify_rejects_corrupted_folders(runs, tmp_path):
    gptq = shutil.copytree(runs["llama", "gptq", True], tmp_path / "gptq")
    m = "model.layers.0.mlp.up_proj"
    rewrite(gptq, m + ".g_idx", lambda t: t.pop(m + ".g_idx"))
    with pytest.raises(CheckpointError, match=rf"{m}\.g_idx"):
        forge.verify(gptq)

    ct = shutil.copytree(runs["llama", "compressed-tensors", True], tmp_path / "ct")

    def bad_shape(t):
        t[m + ".weight_shape"] = torch.tensor([7, 64], dtype=torch.int64)

    rewrite(ct, m + ".weight_shape", bad_shape)
    rep = forge.verify(ct, raise_on_error=False)
    assert not rep.ok and any(f"{m}.weight_shape" in p and "[7, 64]" in p for p in rep.problems), rep

    # a GPTQ tensor in a compressed-tensors folder is a stray vLLM would choke on
    ct2 = shutil.copytree(runs["llama", "compressed-tensors", True], tmp_path / "ct2")
    rewrite(ct2, m + ".weight_shape", lambda t: t.update({m + ".g_idx": torch.zeros(64, dtype=torch.int32)}))
    index = json.loads((ct2 / "model.safetensors.index.json").read_text())
    index["weight_map"][m + ".g_idx"] = index["weight_map"][m + ".weight_shape"]
    (ct2 / "model.safetensors.index.json").write_text(json.dumps(index))
    rep = forge.verify(ct2, raise_on_error=False)
    assert any(f"{m}.g_idx" in p for p in rep.problems), rep.problems


def test_gptq_needs_symmetric_and_cli_flag(runs, tmp_path):
    src = runs["llama", "src"]
    with pytest.raises(Exception, match=r"format.*sym"):
        forge.quantize_model(src, tmp_path / "x", format="gptq", group_size=G, progress=False)
    with pytest.raises(Exception, match="format"):
        forge.quantize_model(src, tmp_path / "y", format="exl2", progress=False)
    assert forge.default_options()["format"] == "awq"
    cmd = [
        sys.executable,
        "-m",
        "forge",
        "quantize",
        str(src),
        str(tmp_path / "cli"),
        "--format",
        "compressed-tensors",
        "--sym",
        "--group-size",
        str(G),
        "--no-progress",
    ]
    subprocess.run(cmd, check=True, capture_output=True)
    qc = json.loads((tmp_path / "cli" / "config.json").read_text())["quantization_config"]
    assert qc["quant_method"] == "compressed-tensors"
    assert qc["config_groups"]["group_0"]["weights"]["symmetric"] is True
    r = subprocess.run(cmd[:5] + [str(tmp_path / "cli2"), "--format", "gptq"], capture_output=True, text=True)
    assert r.returncode != 0 and "sym" in r.stderr
