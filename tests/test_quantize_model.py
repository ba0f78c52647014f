"""End-to-end quantization runs on tiny random checkpoints (DeepSeek-V3 bf16 + FP8 with an MTP layer,
Qwen3-MoE, Mixtral, Llama): the output passes verify, every quantized linear unpacked by an
independent plain-PyTorch AWQ unpacker matches forge's own dequantization and the original weight
within half a quantization step, untouched tensors are byte-identical, the dequantized model's logits
are close to the original's, and resume (test hook and real SIGKILL) gives byte-identical output."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from tiny_models import (
    awq_unpack,
    dequantized_state_dict,
    dir_bytes,
    logits,
    make_fp8_variant,
    make_model,
    read_tensors,
    save_hf_folder,
    source_weights_f32,
)

import forge
from forge import api, errors

G = 32
KINDS = ["deepseek", "deepseek_fp8", "qwen3_moe", "mixtral", "llama"]


@pytest.fixture(scope="module")
def sources(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("src")
    out = {}
    for kind in ["deepseek", "qwen3_moe", "mixtral", "llama"]:
        out[kind] = make_model(kind, root / kind)
    out["deepseek_fp8"] = make_fp8_variant(out["deepseek"], root / "deepseek_fp8")
    return out


@pytest.fixture(scope="module")
def runs(sources, tmp_path_factory) -> dict[str, tuple[Path, api.QuantizeReport]]:
    root = tmp_path_factory.mktemp("out")
    res = {}
    for kind in KINDS:
        out = root / kind
        rep = api.quantize_model(sources[kind], out, group_size=G, max_shard_size="60KB", progress=False)
        res[kind] = (out, rep)
    return res


def _config(folder: Path) -> dict:
    return json.loads((folder / "config.json").read_text())


@pytest.mark.parametrize("kind", KINDS)
def test_output_verifies_and_has_exact_tensor_set(kind, sources, runs):
    out, rep = runs[kind]
    v = api.verify(out)
    assert v.ok and v.quantized == rep.quantized > 0
    assert rep.shards >= 2, "several output shards expected with a 60KB limit"
    src = read_tensors(sources[kind])
    dst = read_tensors(out)
    quantized = {k[: -len(".qweight")] for k in dst if k.endswith(".qweight")}
    assert len(quantized) == rep.quantized
    expected = set()
    for k in src:
        if k.endswith("_scale_inv"):
            continue  # FP8 scales are always dropped
        m = k[: -len(".weight")] if k.endswith(".weight") else None
        if m in quantized:
            expected |= {f"{m}.qweight", f"{m}.qzeros", f"{m}.scales"}
        else:
            expected.add(k)
    assert set(dst) == expected
    for k, t in dst.items():
        assert t.dtype != torch.float8_e4m3fn, k
    # Index and files: HF names, no leftovers.
    names = sorted(p.name for p in out.iterdir())
    assert "forge-manifest.json" not in names and not any(n.endswith(".partial") for n in names)
    assert f"model-00001-of-{rep.shards:05d}.safetensors" in names
    # Side files copied byte for byte; the old index is not.
    for f in ["tokenizer.json", "tokenizer_config.json", "modeling_custom.py", "generation_config.json"]:
        assert (out / f).read_bytes() == (sources[kind] / f).read_bytes()
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"]) == set(dst)


@pytest.mark.parametrize("kind", KINDS)
def test_config_quantization_config(kind, sources, runs):
    out, rep = runs[kind]
    cfg, src_cfg = _config(out), _config(sources[kind])
    q = cfg.pop("quantization_config")
    src_cfg.pop("quantization_config", None)
    assert cfg == src_cfg, "everything but quantization_config is kept"
    assert {k: q[k] for k in ("quant_method", "bits", "group_size", "zero_point", "version")} == {
        "quant_method": "awq",
        "bits": 4,
        "group_size": G,
        "zero_point": True,
        "version": "gemm",
    }
    skip = q["modules_to_not_convert"]
    assert skip == rep.modules_to_not_convert
    dst = read_tensors(out)
    quantized = [k[: -len(".qweight")] for k in dst if k.endswith(".qweight")]
    # vLLM matches entries as substrings: none may hit a quantized module.
    for m in quantized:
        assert not any(s in m for s in skip), m
    if kind.startswith("deepseek"):
        assert "model.layers.1.mlp.gate" in skip  # router
        assert "model.layers.0.self_attn.kv_b_proj" in skip  # default exclusion
        assert "model.layers.3.eh_proj" in skip and "model.layers.3.mlp.experts" in skip  # MTP
        assert not any(".layers.3." in m for m in quantized), "the MTP layer is never quantized"
    if kind == "qwen3_moe":
        assert skip == ["model.layers.1.mlp.gate"]
    if kind == "mixtral":
        assert skip == ["model.layers.0.block_sparse_moe.gate", "model.layers.1.block_sparse_moe.gate"]
    if kind == "llama":
        assert skip == []


@pytest.mark.parametrize("kind", KINDS)
def test_unpacked_weights_match_core_and_original(kind, sources, runs):
    out, _ = runs[kind]
    dst = read_tensors(out)
    src = source_weights_f32(sources[kind])
    worst, over, total = 0.0, 0, 0
    for k in dst:
        if not k.endswith(".qweight"):
            continue
        m = k[: -len(".qweight")]
        qw, qz, sc = dst[k], dst[m + ".qzeros"], dst[m + ".scales"]
        w, codes, zeros, s = awq_unpack(qw, qz, sc, G)
        core = forge.dequantize_awq(qw, qz, sc, G)
        assert torch.equal(w, core), m
        orig = src[m + ".weight"].float()
        assert w.shape == orig.shape
        step = s.t().repeat_interleave(G, dim=1)  # [N, K] scale of each element's group
        err = (w - orig).abs() / step
        worst = max(worst, err.max().item())
        over += (err > 0.5 + 2**-9).sum().item()
        total += err.numel()
        assert (codes >= 0).all() and (codes <= 15).all()
    # Round to nearest: within half a step (plus the fp16 rounding of the stored scale) ...
    assert over / total < 0.002, (over, total)
    # ... except at a group's extreme, where the rounded zero point and the log2 Q8.8 scale encoding
    # (scale up to 2^(1/512) below range/15) can push the element to the clamp:
    # |err| <= (0.5 + 15 * (2^(1/512) - 1)) * s + fp16 rounding.
    assert worst <= 0.5 + 15 * (2 ** (1 / 512) - 1) + 2**-9, worst


@pytest.mark.parametrize("kind", KINDS)
def test_unquantized_tensors_byte_identical(kind, sources, runs):
    out, _ = runs[kind]
    src = read_tensors(sources[kind])
    dst = read_tensors(out)
    src_f32 = source_weights_f32(sources[kind])
    for k, t in dst.items():
        if k.endswith((".qweight", ".qzeros", ".scales")):
            continue
        if src[k].dtype == torch.float8_e4m3fn:
            # FP8 kept unquantized (excluded linears, MTP layer) → bf16 of fp8 × block scale.
            assert t.dtype == torch.bfloat16
            assert torch.equal(t, src_f32[k].to(torch.bfloat16)), k
        else:
            assert t.dtype == src[k].dtype and torch.equal(t.view(torch.uint8), src[k].view(torch.uint8)), k


@pytest.mark.parametrize("kind", KINDS)
def test_dequantized_model_logits_close(kind, sources, runs, tmp_path):
    out, _ = runs[kind]
    cfg = _config(out)
    n_layers = cfg["num_hidden_layers"]
    deq = save_hf_folder(dequantized_state_dict(out, G), cfg, tmp_path / "deq", drop_from_layer=n_layers)
    if kind == "deepseek_fp8":
        ref_dir = save_hf_folder(
            source_weights_f32(sources[kind]), cfg, tmp_path / "ref", drop_from_layer=n_layers
        )
    else:
        ref_dir = save_hf_folder(read_tensors(sources[kind]), cfg, tmp_path / "ref", drop_from_layer=n_layers)
    tokens = torch.randint(0, cfg["vocab_size"], (2, 24), generator=torch.Generator().manual_seed(0))
    ref = logits(ref_dir, tokens)
    got = logits(deq, tokens)
    rel = ((got - ref).norm() / ref.norm()).item()
    cos = torch.nn.functional.cosine_similarity(got.flatten(), ref.flatten(), dim=0).item()
    print(f"{kind}: relative logit error {rel:.4f}, cosine {cos:.4f}")
    # Measured on these i.i.d.-Gaussian tiny models (g32, RTN range): 0.14-0.18 relative error,
    # cosine >= 0.983. Random weights are the worst case for 4 bits (no outliers to spare, every
    # linear loses ~8% of its output): the bound is what that weight noise implies, and a wrong
    # nibble order or scale layout gives errors above 1.
    assert rel < 0.25 and cos > 0.97, (rel, cos)
    assert rel > 1e-4, "quantization happened"
    # Per linear: the output error on random inputs stays at the 4-bit g32 level.
    sd = dequantized_state_dict(out, G)
    src = source_weights_f32(sources[kind])
    gen = torch.Generator().manual_seed(1)
    for k in read_tensors(out):
        if k.endswith(".qweight"):
            m = k[: -len(".qweight")] + ".weight"
            w = src[m].float()
            x = torch.randn(w.shape[1], 16, generator=gen)
            e = ((sd[m] - w) @ x).norm() / (w @ x).norm()
            assert e < 0.12, (m, e.item())


def test_options_mse_symmetric_include(sources, tmp_path):
    src = sources["llama"]
    r_range = api.quantize_model(src, tmp_path / "range", group_size=G, progress=False)
    r_mse = api.quantize_model(src, tmp_path / "mse", grid="mse", group_size=G, progress=False)
    assert r_mse.quantizer == "rtn-mse" and r_range.quantizer == "rtn-range"
    api.verify(tmp_path / "mse")
    orig = source_weights_f32(src)

    def total_err(folder):
        t = read_tensors(folder)
        e = 0.0
        for k in t:
            if k.endswith(".qweight"):
                m = k[:-8]
                w, *_ = awq_unpack(t[k], t[m + ".qzeros"], t[m + ".scales"], G)
                e += ((w - orig[m + ".weight"].float()) ** 2).sum().item()
        return e

    assert total_err(tmp_path / "mse") < total_err(tmp_path / "range")
    api.quantize_model(src, tmp_path / "sym", symmetric=True, group_size=G, progress=False)
    t = read_tensors(tmp_path / "sym")
    for k in t:
        if k.endswith(".qzeros"):
            assert (t[k] == 0x88888888 - 2**32).all(), "symmetric zero point 8 in every nibble"
    # experts only
    rep = api.quantize_model(
        sources["deepseek"], tmp_path / "experts", group_size=G, include="mlp.experts", progress=False
    )
    api.verify(tmp_path / "experts")
    t = read_tensors(tmp_path / "experts")
    q = [k for k in t if k.endswith(".qweight")]
    assert q and all(".mlp.experts." in k for k in q) and len(q) == rep.quantized == 2 * 8 * 3


def test_fused_groups_are_all_or_none(sources, tmp_path):
    rep = api.quantize_model(
        sources["llama"], tmp_path / "a", group_size=G, exclude=["k_proj"], progress=False
    )
    api.verify(tmp_path / "a")
    skip = rep.modules_to_not_convert
    for proj in ["q_proj", "k_proj", "v_proj", "qkv_proj"]:
        assert f"model.layers.0.self_attn.{proj}" in skip
    assert any("qkv_proj" in n for n in rep.notes)
    t = read_tensors(tmp_path / "a")
    assert "model.layers.0.self_attn.o_proj.qweight" in t and "model.layers.0.self_attn.q_proj.weight" in t

    # One expert excluded → the whole MoE of that layer stays unquantized (vLLM fuses experts).
    rep = api.quantize_model(
        sources["qwen3_moe"], tmp_path / "b", group_size=G, exclude=["experts.3.up_proj"], progress=False
    )
    api.verify(tmp_path / "b")
    assert "model.layers.1.mlp.experts" in rep.modules_to_not_convert
    t = read_tensors(tmp_path / "b")
    assert not any(".experts." in k and k.endswith(".qweight") for k in t)

    # DeepSeek: q_a_proj and kv_a_proj_with_mqa go together; kv_b_proj can be quantized on request.
    rep = api.quantize_model(
        sources["deepseek"],
        tmp_path / "c",
        group_size=G,
        exclude="q_a_proj",
        default_excludes=False,
        progress=False,
    )
    api.verify(tmp_path / "c")
    t = read_tensors(tmp_path / "c")
    assert "model.layers.0.self_attn.kv_a_proj_with_mqa.weight" in t
    assert "model.layers.0.self_attn.kv_b_proj.qweight" in t
    assert "model.layers.0.self_attn.fused_qkv_a_proj" in rep.modules_to_not_convert


def test_refuses_non_empty_out_dir_and_overwrites(sources, tmp_path):
    out = tmp_path / "o"
    out.mkdir()
    (out / "config.json").write_text("{}")
    (out / "model-00001-of-00009.safetensors.partial").write_text("x")
    with pytest.raises(errors.CheckpointError, match="not empty.*--overwrite"):
        api.quantize_model(sources["llama"], out, group_size=G, progress=False)
    # --overwrite never deletes a user's files: it refuses and names them.
    (out / "keep.txt").write_text("x")
    with pytest.raises(errors.CheckpointError, match="keep.txt"):
        api.quantize_model(sources["llama"], out, group_size=G, overwrite=True, progress=False)
    assert (out / "keep.txt").read_text() == "x"
    (out / "keep.txt").unlink()
    rep = api.quantize_model(sources["llama"], out, group_size=G, overwrite=True, progress=False)
    assert not (out / "model-00001-of-00009.safetensors.partial").exists() and rep.quantized == 14
    with pytest.raises(errors.CheckpointError, match="model directory"):
        api.quantize_model(sources["llama"], sources["llama"], group_size=G, overwrite=True, progress=False)


def test_resume_after_test_hook_abort_is_byte_identical(sources, tmp_path, monkeypatch):
    src = sources["deepseek_fp8"]
    clean = tmp_path / "clean"
    api.quantize_model(src, clean, group_size=G, max_shard_size="100KB", progress=False)
    out = tmp_path / "out"
    monkeypatch.setenv("FORGE_TEST_ABORT_AFTER_LAYERS", "2")
    with pytest.raises(errors.CheckpointError, match="test hook"):
        api.quantize_model(src, out, group_size=G, max_shard_size="100KB", progress=False)
    assert (out / "forge-manifest.json").exists() and not (out / "config.json").exists()
    assert not api.verify(out, raise_on_error=False).ok
    with pytest.raises(errors.CheckpointError, match="not empty"):
        api.quantize_model(src, out, group_size=G, max_shard_size="100KB", progress=False)
    with pytest.raises(errors.CheckpointError, match="different options"):
        api.quantize_model(
            src, out, group_size=G, symmetric=True, max_shard_size="100KB", resume=True, progress=False
        )
    # Abort once more mid-way, then finish.
    with pytest.raises(errors.CheckpointError, match="test hook"):
        api.quantize_model(src, out, group_size=G, max_shard_size="100KB", resume=True, progress=False)
    monkeypatch.delenv("FORGE_TEST_ABORT_AFTER_LAYERS")
    rep = api.quantize_model(src, out, group_size=G, max_shard_size="100KB", resume=True, progress=False)
    assert rep.resumed_units == 4
    assert dir_bytes(out) == dir_bytes(clean)
    with pytest.raises(errors.CheckpointError, match="finished checkpoint"):
        api.quantize_model(src, out, group_size=G, max_shard_size="100KB", resume=True, progress=False)


def test_kill_while_publishing_resumes_byte_identically(sources, tmp_path, monkeypatch):
    src = sources["deepseek_fp8"]
    kw = dict(group_size=G, max_shard_size="60KB", progress=False)
    clean = tmp_path / "clean"
    rep = api.quantize_model(src, clean, **kw)
    assert rep.shards >= 3
    out = tmp_path / "out"
    monkeypatch.setenv("FORGE_TEST_ABORT_AFTER_RENAMES", "1")
    with pytest.raises(errors.CheckpointError, match="test hook"):
        api.quantize_model(src, out, **kw)
    assert (out / f"model-00001-of-{rep.shards:05}.safetensors").exists()
    assert not (out / "config.json").exists() and not (out / "model.safetensors.index.json").exists()
    manifest = json.loads((out / "forge-manifest.json").read_text())
    assert manifest["finishing"]["renamed"] == [f"model-00001-of-{rep.shards:05}.safetensors"]
    monkeypatch.delenv("FORGE_TEST_ABORT_AFTER_RENAMES")
    rep2 = api.quantize_model(src, out, resume=True, **kw)
    assert rep2.resumed_units == rep2.units
    assert dir_bytes(out) == dir_bytes(clean)


def test_pickle_only_folder_is_refused_without_unpickling(tmp_path):
    d = tmp_path / "legacy"
    d.mkdir()
    (d / "config.json").write_text('{"model_type": "llama"}')
    # Unpickling this would create a file: the run must never load it.
    import pickle

    class Boom:
        def __reduce__(self):
            return (open, (str(tmp_path / "pwned"), "w"))

    (d / "pytorch_model.bin").write_bytes(pickle.dumps(Boom()))
    with pytest.raises(errors.CheckpointError, match=r"safe_serialization=True") as e:
        api.quantize_model(d, tmp_path / "out", group_size=G, progress=False)
    assert "pytorch_model.bin" in str(e.value) and "save_pretrained" in str(e.value)
    assert not (tmp_path / "pwned").exists()


@pytest.mark.parametrize(
    ("option", "value"),
    [
        ("threads", "x"),
        ("threads", 1.5),
        ("group_size", None),
        ("group_size", "128"),
        ("max_shard_size", -5),
        ("max_shard_size", "-5"),
        ("max_shard_size", "-5GB"),
        ("symmetric", "yes"),
        ("resume", None),
    ],
)
def test_option_type_errors_name_the_argument(sources, tmp_path, option, value):
    with pytest.raises(errors.ForgeError) as e:
        api.quantize_model(sources["llama"], tmp_path / "out", progress=False, **{option: value})
    msg = str(e.value)
    assert isinstance(e.value, ValueError), type(e.value)
    assert option in msg and "unknown unit" not in msg, msg
    assert not (tmp_path / "out").exists()


def _cli(capfd, *args) -> tuple[int, str, str]:
    """The forge-rs command line, run in-process (the Rust code prints to fds 1 and 2)."""
    capfd.readouterr()
    code = forge._native.cli_main(["forge-rs", *map(str, args)])
    out, err = capfd.readouterr()
    return code, out, err


def _python_m_forge(*args, env=None, **kw):
    return subprocess.run(
        [sys.executable, "-m", "forge", *map(str, args)], env=env, capture_output=True, text=True, **kw
    )


def test_sigkill_then_resume_is_byte_identical(sources, tmp_path, capfd):
    src = sources["deepseek"]
    args = ["quantize", src, None, "--group-size", G, "--max-shard-size", "100KB", "--no-progress"]
    clean = tmp_path / "clean"
    code, _, err = _cli(capfd, *[clean if a is None else a for a in args])
    assert code == 0, err
    # The real thing: `python -m forge` in a child, killed with SIGKILL after two finished layers.
    out = tmp_path / "out"
    env = dict(os.environ, FORGE_TEST_UNIT_DELAY_MS="300")
    p = subprocess.Popen(
        [sys.executable, "-m", "forge", *[str(out if a is None else a) for a in args]],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    manifest = out / "forge-manifest.json"
    deadline = time.time() + 60
    while time.time() < deadline and p.poll() is None:
        try:
            if len(json.loads(manifest.read_text())["done"]) >= 2:
                break
        except (OSError, ValueError, KeyError):
            pass
        time.sleep(0.02)
    p.send_signal(signal.SIGKILL)
    p.communicate()
    assert p.returncode == -signal.SIGKILL
    assert not (out / "config.json").exists()
    code, stdout, _ = _cli(capfd, "verify", out)
    assert code == 1 and "problem" in stdout
    code, _, err = _cli(capfd, *[out if a is None else a for a in args], "--resume")
    assert code == 0, err
    assert dir_bytes(out) == dir_bytes(clean)
    assert _cli(capfd, "verify", out)[0] == 0


def test_cli_inspect_verify_and_errors(sources, runs, tmp_path, capfd):
    code, out, err = _cli(capfd, "inspect", sources["deepseek_fp8"], "--json")
    assert code == 0, err
    info = json.loads(out)
    assert info["family"] == "deepseek" and info["mtp_layers"] == [3] and info["layers"] == 4
    assert info["experts_per_layer"] == {"1": 8, "2": 8, "3": 8}
    assert "F8_E4M3" in info["dtypes"] and info["status"].startswith("FP8 source")
    code, out, _ = _cli(capfd, "inspect", runs["deepseek"][0])
    assert code == 0 and "quantized (awq)" in out
    assert forge.api.inspect(runs["qwen3_moe"][0])["experts_config"] == 8
    code, out, _ = _cli(capfd, "verify", runs["mixtral"][0])
    assert code == 0 and out.startswith("OK")
    code, _, err = _cli(capfd, "quantize", tmp_path / "nope", tmp_path / "o")
    assert code == 1 and err.startswith("forge-rs: error:") and err.count("\n") == 1
    assert _cli(capfd, "quantize")[0] == 2
    code, out, _ = _cli(capfd, "--version")
    assert code == 0 and "forge-rs" in out
    # `python -m forge` reaches the same command line.
    r = _python_m_forge("verify", runs["llama"][0])
    assert r.returncode == 0 and r.stdout.startswith("OK"), r.stderr


def _copy(folder: Path, dst: Path) -> Path:
    dst.mkdir()
    for f in folder.iterdir():
        (dst / f.name).write_bytes(f.read_bytes())
    return dst


def test_verify_catches_inconsistent_outputs(runs, tmp_path):
    from safetensors.torch import save_file

    good = runs["qwen3_moe"][0]
    # A stray expert id ≥ num_experts and a .weight next to a .qweight.
    bad = _copy(good, tmp_path / "bad")
    idx = json.loads((bad / "model.safetensors.index.json").read_text())
    t = read_tensors(good)
    extra = {
        "model.layers.1.mlp.experts.8.down_proj.qweight": t["model.layers.1.mlp.experts.0.down_proj.qweight"],
        "model.layers.1.self_attn.o_proj.weight": torch.zeros(64, 64, dtype=torch.bfloat16),
    }
    save_file(extra, bad / "model-extra.safetensors")
    for k in extra:
        idx["weight_map"][k] = "model-extra.safetensors"
    (bad / "model.safetensors.index.json").write_text(json.dumps(idx))
    rep = api.verify(bad, raise_on_error=False)
    text = "\n".join(rep.problems)
    assert "expert id" in text and "both .weight and .qweight" in text and "total_size" in text
    # config.json that does not list the router.
    bad2 = _copy(good, tmp_path / "bad2")
    cfg = json.loads((bad2 / "config.json").read_text())
    cfg["quantization_config"]["modules_to_not_convert"] = []
    (bad2 / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(
        errors.CheckpointError, match="mlp.gate: unquantized but not in modules_to_not_convert"
    ):
        api.verify(bad2)
