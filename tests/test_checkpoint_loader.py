"""forge.checkpoint: reading an AWQ folder back through the project's dequantisation.

The AWQ folders are built by hand in the tests (tiny random Llama, ``forge.pack_awq``, a
config.json, one or two safetensors shards), and the expectation is an independent
plain-PyTorch unpacker of the vLLM AWQ layout (docs: shared/notes/formats.md).
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch

import forge
from forge.checkpoint import load_dequantized_model, load_dequantized_state_dict
from forge.errors import CheckpointError

safetensors_torch = pytest.importorskip("safetensors.torch")
transformers = pytest.importorskip("transformers")

GROUP = 32
AWQ_ORDER = [0, 2, 4, 6, 1, 3, 5, 7]  # nibble i of a word holds column 8c + AWQ_ORDER[i]
LINEAR = re.compile(r"^model\.layers\.\d+\.(self_attn\.[qkvo]_proj|mlp\.(gate|up|down)_proj)\.weight$")


def ref_unpack_awq(packed: torch.Tensor) -> torch.Tensor:
    """(R, N/8) int32 -> (R, N) int64 nibbles, AWQ column order (plain torch)."""
    rows, words = packed.shape
    w = packed.to(torch.int64) & 0xFFFFFFFF
    out = torch.empty(rows, words * 8, dtype=torch.int64)
    for i, col in enumerate(AWQ_ORDER):
        out[:, col::8] = (w >> (4 * i)) & 0xF
    return out


def ref_dequant_awq(
    qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor, group: int
) -> torch.Tensor:
    """W (N, K) float32 = (q - z) * s, from the packed tensors alone."""
    q = ref_unpack_awq(qweight)  # (K, N)
    z = ref_unpack_awq(qzeros).repeat_interleave(group, dim=0)  # (K, N)
    s = scales.to(torch.float32).repeat_interleave(group, dim=0)
    return ((q - z).to(torch.float32) * s).T.contiguous()


def tiny_llama(tie: bool) -> transformers.LlamaForCausalLM:
    config = transformers.LlamaConfig(
        vocab_size=96,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        tie_word_embeddings=tie,
    )
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(config).eval()


def write_awq(model, root: Path, shards: int = 2) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """Writes ``model`` as an AWQ folder (fp16 non-linears) in ``shards`` files.

    Returns (original fp32 state dict, the tensors written)."""
    root.mkdir(parents=True, exist_ok=True)
    original = {k: v.detach().clone() for k, v in model.state_dict().items()}
    if model.config.tie_word_embeddings:
        original.pop("lm_head.weight", None)
    written: dict[str, torch.Tensor] = {}
    for name, w in original.items():
        if LINEAR.match(name):
            qmeta, _, _ = forge.build_quant_grid(w, GROUP, 4, False, "range")
            codes = forge.quantize_rtn(w, qmeta, 4, GROUP)
            qweight, qzeros, scales = forge.pack_awq(codes, qmeta, GROUP)
            base = name.removesuffix(".weight")
            written[f"{base}.qweight"], written[f"{base}.qzeros"], written[f"{base}.scales"] = (
                qweight,
                qzeros,
                scales,
            )
        else:
            written[name] = w.to(torch.float16).contiguous()
    names = sorted(written)
    if shards == 1:
        safetensors_torch.save_file(written, str(root / "model.safetensors"))
    else:
        weight_map = {}
        per = -(-len(names) // shards)
        for s in range(shards):
            file = f"model-{s + 1:05d}-of-{shards:05d}.safetensors"
            part = {n: written[n] for n in names[s * per : (s + 1) * per]}
            safetensors_torch.save_file(part, str(root / file))
            weight_map.update(dict.fromkeys(part, file))
        total = sum(t.numel() * t.element_size() for t in written.values())
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        (root / "model.safetensors.index.json").write_text(json.dumps(index))
    config = model.config.to_dict()
    config["quantization_config"] = {
        "quant_method": "awq",
        "bits": 4,
        "group_size": GROUP,
        "zero_point": True,
        "version": "gemm",
        "modules_to_not_convert": [],
    }
    (root / "config.json").write_text(json.dumps(config))
    return original, written


@pytest.fixture(scope="module")
def awq_tied(tmp_path_factory):
    model = tiny_llama(tie=True)
    root = tmp_path_factory.mktemp("awq_tied")
    original, written = write_awq(model, root, shards=2)
    return model, root, original, written


def test_state_dict_matches_independent_unpacker(awq_tied):
    _, root, original, written = awq_tied
    sd = load_dequantized_state_dict(root, dtype=torch.float32)
    assert set(sd) == set(original)
    n_linear = 0
    for name, w in original.items():
        if LINEAR.match(name):
            n_linear += 1
            base = name.removesuffix(".weight")
            qw, qz, sc = (written[f"{base}.{p}"] for p in ("qweight", "qzeros", "scales"))
            expect = ref_dequant_awq(qw, qz, sc, GROUP)
            assert sd[name].dtype == torch.float32 and sd[name].shape == w.shape
            torch.testing.assert_close(sd[name], expect, rtol=0, atol=0)
            # and a 4-bit approximation of the original: within one step (the rounded zero
            # point shifts the grid by up to half a step), most within half a step
            step = sc.to(torch.float32).repeat_interleave(GROUP, dim=0).T
            err = (sd[name] - w).abs()
            assert bool((err <= step * 1.01 + 1e-6).all()), name
            assert float((err <= 0.5 * step * 1.01 + 1e-6).float().mean()) > 0.95, name
        else:
            # passed through unchanged (the stored fp16 bytes)
            assert sd[name].dtype == torch.float16
            assert torch.equal(sd[name], written[name])
    assert n_linear == 2 * 7


def test_state_dict_dtype_cast(awq_tied):
    _, root, original, _ = awq_tied
    sd = load_dequantized_state_dict(root)  # default float16
    assert sd["model.layers.0.mlp.down_proj.weight"].dtype == torch.float16
    assert (
        sd["model.layers.0.mlp.down_proj.weight"].shape
        == original["model.layers.0.mlp.down_proj.weight"].shape
    )


def _logits(model, ids):
    with torch.no_grad():
        return model(input_ids=ids, use_cache=False).logits.float()


@pytest.mark.parametrize("tie", [True, False])
def test_model_loads_and_logits_close(tmp_path, tie):
    model = tiny_llama(tie=tie)
    _, written = write_awq(model, tmp_path, shards=1 if tie else 3)
    loaded = load_dequantized_model(tmp_path, dtype=torch.float32)
    assert type(loaded).__name__ == "LlamaForCausalLM"
    assert not hasattr(loaded.config, "quantization_config")
    assert all(p.dtype == torch.float32 for p in loaded.parameters())
    if tie:
        assert loaded.lm_head.weight.data_ptr() == loaded.model.embed_tokens.weight.data_ptr()
    ids = torch.randint(0, 96, (2, 16), generator=torch.Generator().manual_seed(1))
    # exact: the original model given the independently dequantised weights (and the
    # fp16-rounded other tensors) computes the same logits
    expect = {}
    for name, t in written.items():
        base, _, leaf = name.rpartition(".")
        if leaf == "qweight":
            expect[f"{base}.weight"] = ref_dequant_awq(
                t, written[f"{base}.qzeros"], written[f"{base}.scales"], GROUP
            )
        elif leaf not in ("qzeros", "scales"):
            expect[name] = t.to(torch.float32)
    reference = tiny_llama(tie=tie)
    reference.load_state_dict(expect, strict=not tie)
    torch.testing.assert_close(_logits(loaded, ids), _logits(reference, ids), rtol=1e-5, atol=1e-5)
    # and close to the unquantized model (4-bit group 32 on random weights: ~10 % relative)
    ref, got = _logits(model, ids), _logits(loaded, ids)
    rel = float((got - ref).norm() / ref.norm())
    assert rel < 0.25, rel
    # the loaded weights are exactly the dequantised ones
    sd = load_dequantized_state_dict(tmp_path, dtype=torch.float32)
    for name, t in loaded.state_dict().items():
        if name in sd:
            torch.testing.assert_close(t, sd[name].to(torch.float32), rtol=0, atol=0)


def test_model_fp16(awq_tied):
    _, root, _, _ = awq_tied
    loaded = load_dequantized_model(root)
    assert {p.dtype for p in loaded.parameters()} == {torch.float16}


# ----------------------------------------------------------------------------- errors


def _copy(src: Path, dst: Path) -> Path:
    import shutil

    shutil.copytree(src, dst)
    return dst


def test_missing_qzeros_names_tensor_and_file(awq_tied, tmp_path):
    _, src, _, _ = awq_tied
    root = _copy(src, tmp_path / "awq")
    index_path = root / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    victim = "model.layers.1.self_attn.k_proj.qzeros"
    index["weight_map"].pop(victim)
    index_path.write_text(json.dumps(index))
    with pytest.raises(CheckpointError, match=r"model\.layers\.1\.self_attn\.k_proj.*no qzeros") as exc:
        load_dequantized_state_dict(root)
    assert isinstance(exc.value, ValueError)
    assert re.search(r"model-0000\d-of-00002\.safetensors", str(exc.value)), str(exc.value)


def test_missing_qzeros_single_file(tmp_path):
    model = tiny_llama(tie=True)
    _, written = write_awq(model, tmp_path, shards=1)
    del written["model.layers.0.mlp.up_proj.qzeros"]
    safetensors_torch.save_file(written, str(tmp_path / "model.safetensors"))
    with pytest.raises(
        CheckpointError, match=r"model\.safetensors.*model\.layers\.0\.mlp\.up_proj.*no qzeros"
    ):
        load_dequantized_state_dict(tmp_path)


def test_missing_shard_names_file(awq_tied, tmp_path):
    _, src, _, _ = awq_tied
    root = _copy(src, tmp_path / "awq")
    (root / "model-00002-of-00002.safetensors").unlink()
    with pytest.raises(CheckpointError, match=r"model-00002-of-00002\.safetensors.*does not exist"):
        load_dequantized_state_dict(root)


def test_index_names_tensor_absent_from_shard(awq_tied, tmp_path):
    _, src, _, _ = awq_tied
    root = _copy(src, tmp_path / "awq")
    index_path = root / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    index["weight_map"]["model.layers.0.extra.weight"] = "model-00001-of-00002.safetensors"
    index_path.write_text(json.dumps(index))
    with pytest.raises(
        CheckpointError, match=r"model-00001-of-00002\.safetensors.*model\.layers\.0\.extra\.weight"
    ):
        load_dequantized_state_dict(root)


def test_weight_beside_qweight(tmp_path):
    model = tiny_llama(tie=True)
    original, written = write_awq(model, tmp_path, shards=1)
    name = "model.layers.0.self_attn.q_proj.weight"
    written[name] = original[name].half()
    safetensors_torch.save_file(written, str(tmp_path / "model.safetensors"))
    with pytest.raises(CheckpointError, match=r"q_proj.*both \.weight and \.qweight"):
        load_dequantized_state_dict(tmp_path)


def test_not_awq_config(awq_tied, tmp_path):
    _, src, _, _ = awq_tied
    root = _copy(src, tmp_path / "awq")
    config = json.loads((root / "config.json").read_text())
    config["quantization_config"]["quant_method"] = "gptq"
    (root / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match=r"config\.json.*'gptq'"):
        load_dequantized_state_dict(root)
    del config["quantization_config"]
    (root / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match="no quantization_config"):
        load_dequantized_state_dict(root)


def test_no_weights_and_not_a_dir(tmp_path):
    with pytest.raises(CheckpointError, match="not a directory"):
        load_dequantized_state_dict(tmp_path / "nope")
    (tmp_path / "config.json").write_text(
        json.dumps({"quantization_config": {"quant_method": "awq", "bits": 4, "group_size": 32}})
    )
    with pytest.raises(CheckpointError, match="neither model.safetensors.index.json nor model.safetensors"):
        load_dequantized_state_dict(tmp_path)


def test_model_rejects_unexpected_tensor(tmp_path):
    model = tiny_llama(tie=True)
    _, written = write_awq(model, tmp_path, shards=1)
    written["model.layers.0.mlp.bogus.weight"] = torch.zeros(4, dtype=torch.float16)
    safetensors_torch.save_file(written, str(tmp_path / "model.safetensors"))
    with pytest.raises(CheckpointError, match=r"unexpected \['model\.layers\.0\.mlp\.bogus\.weight'\]"):
        load_dequantized_model(tmp_path, dtype=torch.float32)


def test_moe_folder_loads_into_fused_experts(tmp_path):
    """Per-expert AWQ tensors land in transformers 5's stacked ``experts.gate_up_proj`` /
    ``down_proj``, in expert order, equal to the tests' own unpacking of the folder."""
    from tiny_models import dequantized_state_dict, make_model

    src = make_model("deepseek", tmp_path / "src")
    out = tmp_path / "awq"
    forge.quantize_model(src, out, group_size=32, progress=False)
    model = forge.load_dequantized_model(out, dtype=torch.float32)
    sd = dequantized_state_dict(out, 32)
    ex = model.model.layers[1].mlp.experts
    if not hasattr(ex, "gate_up_proj"):
        pytest.skip("this transformers keeps one module per expert")
    for e in range(8):
        p = f"model.layers.1.mlp.experts.{e}."
        gu = torch.cat([sd[p + "gate_proj.weight"], sd[p + "up_proj.weight"]]).float()
        assert torch.equal(ex.gate_up_proj[e], gu)
        assert torch.equal(ex.down_proj[e], sd[p + "down_proj.weight"].float())
