"""Issue 10 "Trust the output": outputs that would load wrong in vLLM are never written, and
``verify`` catches broken checkpoint folders (missing tensors and layers, unindexed shards, wrong
shapes, config contradicting tensors, NaN/Inf, hostile config values, named pipes)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from tiny_models import awq_unpack, make_model, read_tensors, write_sharded

from forge import api, errors

G = 32


@pytest.fixture(scope="module")
def llama_out(tmp_path_factory) -> Path:
    """A quantized tiny Llama whose layer 0 down_proj has an all-zero output row and an all-zero group."""
    root = tmp_path_factory.mktemp("trust")
    src = make_model("llama", root / "src")
    t = read_tensors(src)
    w = t["model.layers.0.mlp.down_proj.weight"]
    w[3] = 0.0  # a whole output row
    w[5, :G] = 0.0  # one group
    t["model.layers.0.mlp.down_proj.weight"] = w
    write_sharded(t, src)
    out = root / "out"
    api.quantize_model(src, out, group_size=G, max_shard_size="60KB", progress=False)
    return out


@pytest.fixture
def broken(llama_out, tmp_path) -> Path:
    """A fresh copy of the good output to break."""
    dst = tmp_path / "broken"
    shutil.copytree(llama_out, dst)
    return dst


@pytest.fixture(scope="module")
def deepseek_out(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("trust_ds")
    src = make_model("deepseek", root / "src")
    out = root / "out"
    api.quantize_model(src, out, group_size=G, max_shard_size="60KB", progress=False)
    return out


def _problems(folder: Path) -> list[str]:
    r = api.verify(folder, raise_on_error=False)
    return r.problems


def _rewrite(folder: Path, edit) -> None:
    t = read_tensors(folder)
    edit(t)
    write_sharded(t, folder)


def _config(folder: Path) -> dict:
    return json.loads((folder / "config.json").read_text())


# ----------------------------------------------------------------------------- zero groups


def test_all_zero_row_quantizes_and_verifies(llama_out):
    # an fp16 scale of 0 (EPS = 1e-9 rounds to 0 in fp16) made verify reject the output
    assert api.verify(llama_out).ok
    t = read_tensors(llama_out)
    m = "model.layers.0.mlp.down_proj"
    w, _, _, scales = awq_unpack(t[f"{m}.qweight"], t[f"{m}.qzeros"], t[f"{m}.scales"], G)
    assert torch.all(scales > 0)
    assert torch.equal(w[3], torch.zeros_like(w[3]))
    assert torch.equal(w[5, :G], torch.zeros(G))


def test_quantize_refuses_group_sizes_vllm_cannot_load(tmp_path):
    src = make_model("llama", tmp_path / "src")
    with pytest.raises(errors.ForgeError, match="32, 64 or 128"):
        api.quantize_model(src, tmp_path / "out", group_size=256, progress=False)
    assert not (tmp_path / "out").exists()


# ----------------------------------------------------------------------------- verify


def test_good_outputs_verify(llama_out, deepseek_out):
    assert _problems(llama_out) == []
    assert _problems(deepseek_out) == []


def test_missing_down_proj(broken):
    m = "model.layers.1.mlp.down_proj"

    def edit(t):
        for s in ("qweight", "qzeros", "scales"):
            del t[f"{m}.{s}"]

    _rewrite(broken, edit)
    p = _problems(broken)
    assert any(m in x and "missing" in x for x in p), p


def test_missing_member_of_fused_group(broken):
    m = "model.layers.0.self_attn.k_proj"

    def edit(t):
        for s in ("qweight", "qzeros", "scales"):
            del t[f"{m}.{s}"]

    _rewrite(broken, edit)
    p = _problems(broken)
    assert any(m in x and "missing" in x for x in p), p


def test_missing_whole_layer(broken):
    _rewrite(broken, lambda t: [t.pop(k) for k in list(t) if k.startswith("model.layers.1.")])
    p = _problems(broken)
    assert any("layers.1" in x and "missing" in x for x in p), p


def test_shard_omitted_by_index(broken):
    index = json.loads((broken / "model.safetensors.index.json").read_text())
    shard = sorted(set(index["weight_map"].values()))[-1]
    index["weight_map"] = {k: v for k, v in index["weight_map"].items() if v != shard}
    (broken / "model.safetensors.index.json").write_text(json.dumps(index))
    p = _problems(broken)
    assert any(shard in x and "not referenced" in x for x in p), p


def test_linear_with_wrong_dims(broken):
    # internally consistent triple, but out_features 64 - 8 where config.json implies 64
    m = "model.layers.0.self_attn.o_proj"

    def edit(t):
        t[f"{m}.qweight"] = t[f"{m}.qweight"][:, :-1].clone()
        t[f"{m}.qzeros"] = t[f"{m}.qzeros"][:, :-1].clone()
        t[f"{m}.scales"] = t[f"{m}.scales"][:, :-8].clone()

    _rewrite(broken, edit)
    p = _problems(broken)
    assert any(m in x and "config.json implies" in x for x in p), p


def test_config_dims_contradict_tensors(broken):
    cfg = _config(broken)
    cfg["hidden_size"] = 96
    (broken / "config.json").write_text(json.dumps(cfg))
    p = _problems(broken)
    assert any("embed_tokens" in x and "contradicts config.json" in x for x in p), p


@pytest.mark.parametrize("value", [float("nan"), float("inf")])
def test_non_finite_copied_tensor(broken, value):
    name = "model.layers.1.input_layernorm.weight"

    def edit(t):
        t[name] = t[name].clone()
        t[name][7] = value

    _rewrite(broken, edit)
    p = _problems(broken)
    assert any(name in x and "non-finite value at flat element 7" in x for x in p), p


def test_zero_fp16_scale_rejected(broken):
    m = "model.layers.0.mlp.up_proj"

    def edit(t):
        t[f"{m}.scales"] = t[f"{m}.scales"].clone()
        t[f"{m}.scales"][1, 2] = 0.0

    _rewrite(broken, edit)
    p = _problems(broken)
    assert any(f"{m}.scales" in x and "not a positive finite" in x for x in p), p


def _verify_subprocess(folder: Path, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "forge", "verify", str(folder)],
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def test_huge_expert_count_in_config_is_a_problem_not_a_crash(deepseek_out, tmp_path):
    # verify used to allocate a list as long as n_routed_experts
    dst = tmp_path / "ds"
    shutil.copytree(deepseek_out, dst)
    cfg = _config(dst)
    cfg["n_routed_experts"] = 1 << 40
    (dst / "config.json").write_text(json.dumps(cfg))
    r = _verify_subprocess(dst)
    assert r.returncode == 1, (r.returncode, r.stdout, r.stderr)
    assert "routed experts" in r.stdout, r.stdout


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="needs named pipes")
@pytest.mark.parametrize("name", ["config.json", "model.safetensors.index.json", "extra.safetensors"])
def test_named_pipe_never_hangs(broken, name):
    p = broken / name
    if p.exists():
        p.unlink()
    os.mkfifo(p)
    r = _verify_subprocess(broken, timeout=60)
    assert r.returncode == 1, (r.returncode, r.stdout, r.stderr)
    assert "not a regular file" in r.stdout + r.stderr, (r.stdout, r.stderr)


# ----------------------------------------------------------------------------- CLI


@pytest.mark.parametrize("threads", ["100000", str(64 * (os.cpu_count() or 1) + 1)])
def test_cli_rejects_absurd_thread_counts(tmp_path, capfd, threads):
    import forge

    src = tmp_path / "src"
    capfd.readouterr()
    code = forge._native.cli_main(
        ["forge-rs", "quantize", str(src), str(tmp_path / "out"), "--threads", threads, "--no-progress"]
    )
    err = capfd.readouterr().err
    assert code == 1 and "--threads" in err and "too many" in err, err
    assert not (tmp_path / "out").exists()
