"""forge.load_quantized: tiny forged checkpoints load as W4A16 transformers models.

References are independent of forge's loader: the AWQ folder is unpacked by
``tiny_models.awq_unpack`` (plain torch) into a float32 HF folder that transformers'
``from_pretrained`` loads (it also fuses per-expert tensors into its experts modules), and
for the dense Llama also ``forge.load_dequantized_model``. Tolerance: max |logits - ref| /
max |ref| below 1e-4 for a float32 load (both sides fp32 GEMMs on the same weights) and
5e-2 for bfloat16 (activations and the int4pack scale/zero pairs in bf16).

GPTQ v1 and compressed-tensors folders are written from the AWQ folder by this file's own
packers (formats.md layouts) and must give the same logits as the AWQ folder.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")
pytest.importorskip("safetensors")

from tiny_models import awq_unpack, make_model, read_tensors, write_sharded  # noqa: E402

import forge  # noqa: E402
from forge.errors import CheckpointError  # noqa: E402
from forge.runtime import AwqExperts, AwqLinear  # noqa: E402

GROUP = 32
FP32_TOL, BF16_TOL = 1e-4, 5e-2
TOKENS = torch.randint(0, 256, (2, 11), generator=torch.Generator().manual_seed(7))


def forge_folder(root: Path, kind: str, **kw) -> Path:
    src = make_model(kind, root / f"src-{kind}")
    out = root / f"awq-{kind}"
    forge.quantize_model(src, out, method="rtn", group_size=GROUP, progress=False, **kw)
    return out


def reference_folder(awq_dir: Path, root: Path) -> Path:
    """Float32 HF folder with every AWQ triple dequantized by the test's own unpacker."""
    cfg = json.loads((awq_dir / "config.json").read_text())
    group = cfg["quantization_config"]["group_size"]
    cfg.pop("quantization_config")
    tensors = read_tensors(awq_dir)
    dense = {}
    for name, t in tensors.items():
        if name.endswith(".qweight"):
            base = name[: -len(".qweight")]
            dense[base + ".weight"] = awq_unpack(
                t, tensors[base + ".qzeros"], tensors[base + ".scales"], group
            )[0]
        elif not name.endswith((".qzeros", ".scales")):
            dense[name] = t.float() if t.is_floating_point() else t
    root.mkdir(parents=True, exist_ok=True)
    (root / "config.json").write_text(json.dumps(cfg))
    write_sharded(dense, root, n_shards=2)
    return root


@torch.no_grad()
def ref_logits(folder: Path) -> torch.Tensor:
    model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    return model(TOKENS).logits


@torch.no_grad()
def our_logits(folder: Path, dtype=torch.float32) -> torch.Tensor:
    model, _ = forge.load_quantized(folder, dtype=dtype)
    return model(TOKENS).logits.float()


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max())


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("forged")
    return {kind: forge_folder(root, kind) for kind in ("llama", "deepseek", "qwen3_moe", "mixtral")}


@pytest.mark.parametrize("kind", ["llama", "deepseek", "qwen3_moe", "mixtral"])
def test_load_quantized_matches_dequantized_reference(folders, kind, tmp_path):
    awq = folders[kind]
    model, tokenizer = forge.load_quantized(awq, dtype=torch.float32)
    assert tokenizer is None  # the tiny folders carry a placeholder tokenizer.json
    quantized = sum(1 for n in read_tensors(awq) if n.endswith(".qweight") and ".experts." not in n)
    assert sum(isinstance(m, AwqLinear) for m in model.modules()) == quantized
    assert any(isinstance(m, AwqExperts) for m in model.modules()) == (kind != "llama")
    assert not any(p.is_meta for p in model.state_dict().values())
    with torch.no_grad():
        ours = model(TOKENS).logits
    assert rel(ours, ref_logits(reference_folder(awq, tmp_path / "ref"))) < FP32_TOL
    if kind == "llama":  # dense models also load through forge's own dequantizing loader
        with torch.no_grad():
            assert rel(ours, forge.load_dequantized_model(awq, dtype=torch.float32)(TOKENS).logits) < FP32_TOL


def test_load_quantized_bf16_generates(folders, tmp_path):
    awq = folders["deepseek"]
    model, _ = forge.load_quantized(awq)  # bfloat16, the default
    assert model.model.embed_tokens.weight.dtype == torch.bfloat16
    assert model.model.layers[1].mlp.gate.e_score_correction_bias.dtype == torch.float32
    ref_dir = reference_folder(awq, tmp_path / "ref")
    with torch.no_grad():
        assert rel(model(TOKENS).logits.float(), ref_logits(ref_dir)) < BF16_TOL
    out = model.generate(TOKENS[:1], max_new_tokens=6, do_sample=False)
    assert out.shape == (1, TOKENS.shape[1] + 6)
    fp32, _ = forge.load_quantized(awq, dtype=torch.float32)
    ref = transformers.AutoModelForCausalLM.from_pretrained(ref_dir, dtype=torch.float32)
    greedy = fp32.generate(TOKENS[:1], max_new_tokens=6, do_sample=False)
    assert torch.equal(greedy, ref.generate(TOKENS[:1], max_new_tokens=6, do_sample=False))


def test_pruned_compact_checkpoint(folders, tmp_path):
    """Experts renumbered densely, router rows and bias sliced, n_routed_experts = 4."""
    src = folders["deepseek"]
    keep = [0, 2, 5, 7]  # two per routing group of four, order kept
    tensors = read_tensors(src)
    pruned = {}
    for name, t in tensors.items():
        if ".mlp.experts." in name:
            head, rest = name.split(".mlp.experts.")
            e, tail = rest.split(".", 1)
            if int(e) in keep:
                pruned[f"{head}.mlp.experts.{keep.index(int(e))}.{tail}"] = t
        elif name.endswith(("mlp.gate.weight", "mlp.gate.e_score_correction_bias")):
            pruned[name] = t[keep]
        else:
            pruned[name] = t
    out = tmp_path / "pruned"
    write_sharded(pruned, out)
    cfg = json.loads((src / "config.json").read_text())
    cfg["n_routed_experts"] = len(keep)
    (out / "config.json").write_text(json.dumps(cfg))
    model, _ = forge.load_quantized(out, dtype=torch.float32)
    assert model.model.layers[1].mlp.experts.num_experts == len(keep)
    with torch.no_grad():
        ours = model(TOKENS).logits
    assert rel(ours, ref_logits(reference_folder(out, tmp_path / "ref"))) < FP32_TOL


def test_unquantized_experts_stay_dense(tmp_path):
    awq = forge_folder(tmp_path, "deepseek", exclude=["mlp.experts"])
    model, _ = forge.load_quantized(awq, dtype=torch.float32)
    experts = model.model.layers[1].mlp.experts
    assert type(experts).__name__ == "DeepseekV3Experts"
    assert not any(isinstance(m, AwqExperts) for m in model.modules())
    with torch.no_grad():
        assert rel(model(TOKENS).logits, ref_logits(reference_folder(awq, tmp_path / "ref"))) < FP32_TOL


# --------------------------------------------------------------------------- other formats

AWQ_ORDER = [0, 2, 4, 6, 1, 3, 5, 7]


def unpack_awq_words(packed: torch.Tensor) -> torch.Tensor:
    w = packed.to(torch.int64) & 0xFFFFFFFF
    out = torch.empty(w.shape[0], w.shape[1] * 8, dtype=torch.int64)
    for i, col in enumerate(AWQ_ORDER):
        out[:, col::8] = (w >> (4 * i)) & 0xF
    return out


def pack_plain(values: torch.Tensor, dim: int) -> torch.Tensor:
    """4-bit values -> int32 words along ``dim``, plain order (value j of a word at bits 4j)."""
    v = values.to(torch.int64).movedim(dim, -1)
    v = v.reshape(*v.shape[:-1], -1, 8)
    word = sum(v[..., j] << (4 * j) for j in range(8))
    word = torch.where(word >= 2**31, word - 2**32, word)
    return word.to(torch.int32).movedim(-1, dim).contiguous()


def convert_folder(awq_dir: Path, out: Path, fmt: str) -> Path:
    """The AWQ folder rewritten as GPTQ v1 or compressed-tensors pack-quantized (asymmetric)."""
    tensors = read_tensors(awq_dir)
    cfg = json.loads((awq_dir / "config.json").read_text())
    group = cfg["quantization_config"]["group_size"]
    new = {}
    for name, t in tensors.items():
        if name.endswith((".qzeros", ".scales")):
            continue
        if not name.endswith(".qweight"):
            new[name] = t
            continue
        base = name[: -len(".qweight")]
        codes = unpack_awq_words(t)  # (K, N)
        zeros = unpack_awq_words(tensors[base + ".qzeros"])  # (K/G, N)
        scales = tensors[base + ".scales"]
        k, n = codes.shape
        if fmt == "gptq":
            new[base + ".qweight"] = pack_plain(codes, 0)  # (K/8, N)
            new[base + ".qzeros"] = pack_plain((zeros - 1) & 0xF, 1)  # zero - 1
            new[base + ".scales"] = scales
            new[base + ".g_idx"] = (torch.arange(k) // group).to(torch.int32)
        else:
            new[base + ".weight_packed"] = pack_plain(codes.T, 1)  # (N, K/8), int4 + 8
            new[base + ".weight_scale"] = scales.T.contiguous()
            new[base + ".weight_zero_point"] = pack_plain(zeros.T, 0)  # (N/8, K/G)
            new[base + ".weight_shape"] = torch.tensor([n, k], dtype=torch.int64)
    if fmt == "gptq":
        qc = {"quant_method": "gptq", "bits": 4, "group_size": group, "desc_act": False, "sym": False}
        qc["checkpoint_format"] = "gptq"
    else:
        weights = {"num_bits": 4, "type": "int", "symmetric": False, "strategy": "group", "group_size": group}
        qc = {
            "quant_method": "compressed-tensors",
            "format": "pack-quantized",
            "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights}},
            "ignore": ["lm_head"],
        }
    cfg["quantization_config"] = qc
    write_sharded(new, out)
    (out / "config.json").write_text(json.dumps(cfg))
    return out


@pytest.mark.parametrize("fmt", ["gptq", "compressed-tensors"])
@pytest.mark.parametrize("kind", ["llama", "qwen3_moe"])
def test_other_formats_give_the_awq_logits(folders, tmp_path, fmt, kind):
    awq = folders[kind]
    other = convert_folder(awq, tmp_path / fmt, fmt)
    assert rel(our_logits(other), our_logits(awq)) < 1e-6


# --------------------------------------------------------------------------- bad folders


def rewrite(src: Path, dst: Path, edit_tensors=None, edit_config=None) -> Path:
    shutil.copytree(src, dst)
    if edit_tensors is not None:
        tensors = read_tensors(src)
        edit_tensors(tensors)
        write_sharded(tensors, dst)
    if edit_config is not None:
        cfg = json.loads((dst / "config.json").read_text())
        edit_config(cfg)
        (dst / "config.json").write_text(json.dumps(cfg))
    return dst


def _set(cfg, **qc):
    cfg["quantization_config"].update(qc)


BAD = {
    "missing-qzeros": (
        lambda t: t.pop("model.layers.1.self_attn.o_proj.qzeros"),
        None,
        r"model\.layers\.1\.self_attn\.o_proj\.qzeros",
    ),
    "missing-expert": (
        lambda t: [t.pop(k) for k in list(t) if ".layers.2.mlp.experts.5." in k],
        None,
        r"model\.layers\.2\.mlp\.experts\.5",
    ),
    "extra-expert": (
        lambda t: t.update(
            {
                k.replace(".experts.0.", ".experts.8."): v
                for k, v in list(t.items())
                if ".layers.1.mlp.experts.0." in k
            }
        ),
        None,
        r"experts\.8 is beyond the config's 8 experts",
    ),
    "missing-norm": (
        lambda t: t.pop("model.layers.0.input_layernorm.weight"),
        None,
        r"model\.layers\.0\.input_layernorm\.weight",
    ),
    "unknown-tensor": (
        lambda t: t.update({"model.layers.0.mystery.weight": torch.zeros(3)}),
        None,
        r"'model\.layers\.0\.mystery\.weight' has no place",
    ),
    "mixed-formats": (
        lambda t: t.update({"model.layers.1.self_attn.o_proj.g_idx": torch.zeros(64, dtype=torch.int32)}),
        None,
        r"o_proj\.g_idx' belongs to the gptq format.*mixed formats",
    ),
    "wrong-shape": (
        lambda t: t.update({"model.norm.weight": torch.ones(65)}),
        None,
        r"'model\.norm\.weight' has shape \(65,\)",
    ),
    "quant-method": (None, lambda c: _set(c, quant_method="bitsandbytes"), r"quant_method is 'bitsandbytes'"),
    "bits": (None, lambda c: _set(c, bits=8), r"quantization_config\.bits is 8"),
    "no-quantization-config": (None, lambda c: c.pop("quantization_config"), "no quantization_config"),
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_bad_folders_name_the_problem(folders, tmp_path, case):
    edit_tensors, edit_config, pattern = BAD[case]
    bad = rewrite(folders["deepseek"], tmp_path / case, edit_tensors, edit_config)
    with pytest.raises(CheckpointError, match=pattern):
        forge.load_quantized(bad)


def test_missing_shard_file(folders, tmp_path):
    bad = rewrite(folders["llama"], tmp_path / "bad")
    victim = sorted(bad.glob("*.safetensors"))[-1]
    victim.unlink()
    with pytest.raises(CheckpointError, match=victim.name):
        forge.load_quantized(bad)


@pytest.mark.parametrize("n,k", [(256, 384), (200, 300), (128, 130), (5, 7)])
def test_fp8_block_dequant_is_the_product_of_each_element_and_its_block_scale(n, k):
    """``w[r, c] * scale_inv[r // 128, c // 128]`` in float32, bit for bit, for whole and partial
    edge blocks (the broadcast and the spread paths); a scale of the wrong shape is refused
    with the tensor's name."""
    from forge.errors import CheckpointError
    from forge.loading import dequantize_fp8_blocks

    g = torch.Generator().manual_seed(n + k)
    w = (torch.randn(n, k, generator=g) * 40).to(torch.float8_e4m3fn)
    s = torch.rand(-(-n // 128), -(-k // 128), generator=g) + 0.01
    rows = torch.arange(n)[:, None] // 128
    cols = torch.arange(k)[None, :] // 128
    want = w.float() * s[rows, cols]
    got = dequantize_fp8_blocks(w, s, (128, 128), "m.safetensors: x.weight")
    assert got.dtype == torch.float32 and torch.equal(got, want)
    with pytest.raises(CheckpointError, match=r"m\.safetensors: x\.weight: weight_scale_inv has shape"):
        dequantize_fp8_blocks(
            w, torch.ones(s.shape[0], s.shape[1] + 1), (128, 128), "m.safetensors: x.weight"
        )
