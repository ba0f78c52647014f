"""The calibrated GPTQ run (`method="gptq"`) against plain PyTorch / transformers references.

Hessians are checked against ``XᵀX`` of layer inputs captured from transformers' own modules
of the ORIGINAL model (fp32); the written weights against ``forge.gptq_quantize`` on the tapped
Hessian; the next layer's inputs against a forward of the dequantized checkpoint (unpacked by
the tests' own AWQ unpacker); and resume against an uninterrupted run, byte for byte.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file, save_file
from tiny_models import dequantized_state_dict, make_fp8_variant, make_model, read_tensors

import forge
from forge import calibrate, errors

G = 32


def _opts(ids_file, **kw):
    o = dict(
        method="gptq", calib=ids_file, nsamples=8, seqlen=32, group_size=G, progress=False, chunk_tokens=64
    )
    o.update(kw)
    return o


class Tap:
    def __init__(self):
        self.inputs: dict[int, list[torch.Tensor]] = {}
        self.hessians: dict[str, tuple[torch.Tensor, int]] = {}

    def __call__(self, event, **d):
        if event == "layer_input":
            self.inputs[d["layer"]] = [t.detach().float().cpu().clone() for t in d["hidden"]]
        elif event == "hessian":
            self.hessians[d["module"]] = (d["hessian"].detach().float().cpu().clone(), d["tokens"])


def _run(monkeypatch, src, out, ids_file, **kw):
    tap = Tap()
    monkeypatch.setattr(calibrate, "TAP", tap)
    rep = forge.quantize_model(src, out, **_opts(ids_file, **kw))
    return rep, tap


def _count_full_forwards(monkeypatch) -> dict:
    """Counts the run's whole-layer forwards (``calibrate._forward``) in ``["full"]``."""
    calls = {"full": 0}
    full = calibrate._forward

    def counting(*a, **k):
        calls["full"] += 1
        return full(*a, **k)

    monkeypatch.setattr(calibrate, "_forward", counting)
    return calls


def _ref_model(src):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32).eval()


def _layer_fwd(model, li, h):
    layer = model.model.layers[li]
    pos = torch.arange(h.shape[1])[None].expand(h.shape[0], -1)
    pe = model.model.rotary_emb(h, pos)
    out = layer(h, attention_mask=None, position_ids=pos, position_embeddings=pe)
    return out[0] if isinstance(out, tuple) else out


def _close(a, b, rel=1e-4):
    err = float((a - b).abs().max())
    scale = float(b.abs().max()) or 1.0
    assert err <= rel * scale, f"max |diff| {err:.3e} > {rel} x {scale:.3e}"


def _small_blocks(monkeypatch, small: bool) -> None:
    """Routed rows gathered 5 at a time, routed outputs accumulated 24 tokens at a time (the
    run has 256 tokens): the bounded-memory expert pass in many pieces."""
    if small:
        monkeypatch.setattr(calibrate, "GATHER_ROWS", 5)
        monkeypatch.setattr(calibrate, "OUTPUT_WINDOW", 24)


@pytest.mark.parametrize("small", [False, True])
def test_hessians_equal_xtx_of_the_layers_inputs(small, monkeypatch, src, ids_file, tmp_path):
    """Dense linears, shared experts and each routed expert over exactly its routed tokens."""
    _small_blocks(monkeypatch, small)
    _, tap = _run(monkeypatch, src, tmp_path / "o", ids_file, true_sequential=False)
    model = _ref_model(src)
    cap: dict[str, list[torch.Tensor]] = {}

    def grab(name):
        return lambda _m, a: cap.setdefault(name, []).append(a[0].reshape(-1, a[0].shape[-1]))

    for li in (0, 1):
        layer = model.model.layers[li]
        hooks = [m.register_forward_pre_hook(grab(f"model.layers.{li}.{n}")) for n, m in layer.named_modules()
                 if isinstance(m, torch.nn.Linear)]  # fmt: skip
        moe_in = []
        if li == 1:
            hooks.append(layer.mlp.register_forward_pre_hook(lambda _m, a, acc=moe_in: acc.append(a[0])))
        with torch.no_grad():
            for h in tap.inputs[li]:
                _layer_fwd(model, li, h)
        for hk in hooks:
            hk.remove()
        for name in (
            "self_attn.q_a_proj",
            "self_attn.kv_a_proj_with_mqa",
            "self_attn.o_proj",
            "mlp.down_proj" if li == 0 else "mlp.shared_experts.up_proj",
        ):
            full = f"model.layers.{li}.{name}"
            x = torch.cat(cap[full]).double()
            h, n = tap.hessians[full]
            assert n == x.shape[0]
            _close(h.double(), x.T @ x / n)
        if li == 1:
            x = torch.cat([m.reshape(-1, m.shape[-1]) for m in moe_in])
            _, _, idx = layer.mlp.gate(x)
            for e in range(8):
                xe = x[(idx == e).any(-1)].double()
                h, n = tap.hessians[f"model.layers.1.mlp.experts.{e}.gate_proj+up_proj"]
                assert n == xe.shape[0]
                if n >= 64 // 8:  # not a fallback expert
                    _close(h.double(), xe.T @ xe / n)


def test_written_weights_are_gptq_of_the_tapped_hessian(monkeypatch, src, ids_file, tmp_path):
    out = tmp_path / "o"
    _, tap = _run(monkeypatch, src, out, ids_file)
    deq = dequantized_state_dict(out, G)
    w = read_tensors(src)
    for module in ("model.layers.0.self_attn.q_a_proj", "model.layers.1.mlp.shared_experts.down_proj"):
        h, _ = tap.hessians[module]
        r = forge.gptq_quantize(w[f"{module}.weight"].float(), h, group_size=G, mode="range", percdamp=0.01)
        ref = forge.dequantize_awq(*forge.pack_awq(r.codes, r.qmeta, G), G)
        _close(deq[f"{module}.weight"].float(), ref, rel=1e-6)
    forge.verify(out)


@pytest.mark.parametrize("small", [False, True])
def test_gptq_beats_rtn_and_next_layer_inputs_follow_the_checkpoint(
    small, monkeypatch, src, ids_file, tmp_path
):
    _small_blocks(monkeypatch, small)
    out = tmp_path / "o"
    _, tap = _run(monkeypatch, src, out, ids_file)
    rows = json.loads((out / "forge/report.json").read_text())["linears"]
    gptq_rows = [r for r in rows if r["method"] == "gptq"]
    assert len(gptq_rows) > 20
    for r in gptq_rows:
        assert r["err_gptq"] < r["err_rtn"], r
    # The next layer's inputs are a forward of the dequantized checkpoint's layer.
    from transformers import AutoModelForCausalLM

    sd = dequantized_state_dict(out, G)
    model = _ref_model(src)
    missing, unexpected = model.load_state_dict({k: v.float() for k, v in sd.items()}, strict=False)
    # transformers 5 fuses experts: load them by hand.
    for li in (1, 2):
        ex = model.model.layers[li].mlp.experts
        gu = [
            torch.cat([sd[f"model.layers.{li}.mlp.experts.{e}.{p}.weight"] for p in ("gate_proj", "up_proj")])
            for e in range(8)
        ]
        ex.gate_up_proj.data = torch.stack(gu).float()
        ex.down_proj.data = torch.stack(
            [sd[f"model.layers.{li}.mlp.experts.{e}.down_proj.weight"] for e in range(8)]
        ).float()
    del AutoModelForCausalLM
    for li in (0, 1):
        with torch.no_grad():
            got = [_layer_fwd(model, li, h) for h in tap.inputs[li]]
        for a, b in zip(got, tap.inputs[li + 1], strict=True):
            _close(a, b, rel=2e-4)


def test_few_token_experts_take_the_fallback(monkeypatch, src, ids_file, tmp_path):
    # Expert 0 of layer 1 is never chosen (bias -100 in selection): zero routed tokens.
    dead = tmp_path / "dead"
    dead.mkdir()
    for f in src.iterdir():
        if f.suffix == ".safetensors":
            t = load_file(f)
            key = "model.layers.1.mlp.gate.e_score_correction_bias"
            if key in t:
                t[key] = t[key].clone()
                t[key][0] = -100.0
            save_file(t, dead / f.name, metadata={"format": "pt"})
        else:
            (dead / f.name).write_bytes(f.read_bytes())
    for mode in ("pooled", "rtn"):
        out = tmp_path / mode
        _run(monkeypatch, dead, out, ids_file, few_tokens=mode)
        rows = json.loads((out / "forge/report.json").read_text())["linears"]
        r0 = [r for r in rows if r["module"].startswith("model.layers.1.mlp.experts.0.")]
        assert r0 and all(r["tokens"] == 0 and r["fallback"] == mode for r in r0)
        assert all(r["method"] == ("gptq" if mode == "pooled" else "rtn") for r in r0)
        forge.verify(out)
        sd = dequantized_state_dict(out, G)
        assert all(bool(torch.isfinite(v.float()).all()) for v in sd.values())
    stats = load_file(tmp_path / "rtn" / "forge" / "router_stats.safetensors")
    layers = stats["layers"].tolist()
    assert stats["counts"][layers.index(1), 0] == 0
    # every token routes to top-2 experts: counts sum to 2 * tokens
    assert float(stats["counts"][layers.index(1)].sum()) == 2 * 8 * 32


def test_resume_after_an_abort_is_byte_identical(monkeypatch, src, ids_file, tmp_path):
    whole = tmp_path / "whole"
    forge.quantize_model(src, whole, **_opts(ids_file))
    part = tmp_path / "part"
    monkeypatch.setenv("FORGE_TEST_ABORT_AFTER_LAYERS", "3")
    with pytest.raises(RuntimeError, match="test abort"):
        forge.quantize_model(src, part, **_opts(ids_file))
    assert not (part / "config.json").exists()
    monkeypatch.delenv("FORGE_TEST_ABORT_AFTER_LAYERS")
    with pytest.raises(errors.CheckpointError, match="different options"):
        forge.quantize_model(src, part, **_opts(ids_file, nsamples=4, resume=True))
    rep = forge.quantize_model(src, part, **_opts(ids_file, resume=True))
    assert rep.resumed_units == 3  # non-layer tensors + 2 layers
    files = [f for f in sorted(whole.iterdir()) if f.name.endswith((".safetensors", ".json"))]
    files.append(whole / "forge" / "router_stats.safetensors")
    assert len(files) >= 4
    for f in files:
        rel = f.relative_to(whole)
        assert (part / rel).read_bytes() == f.read_bytes(), rel
    forge.verify(part)


def test_resume_from_an_older_state_redoes_the_layers_after_it(monkeypatch, src, ids_file, tmp_path):
    """States are saved only every few layers when they are large (``STATE_BUDGET``): a
    resumed run restarts from the last saved layer and redoes the ones after it."""
    whole = tmp_path / "whole"
    forge.quantize_model(src, whole, **_opts(ids_file))
    calls = []

    def first_only(self, nbytes, seconds):
        calls.append(nbytes)
        return len(calls) == 1

    part = tmp_path / "part"
    monkeypatch.setattr(calibrate._StatePolicy, "due", first_only)
    monkeypatch.setenv("FORGE_TEST_ABORT_AFTER_LAYERS", "3")
    with pytest.raises(RuntimeError, match="test abort"):
        forge.quantize_model(src, part, **_opts(ids_file))
    assert len(calls) == 2  # asked after layers 0 and 1; saved after layer 0 only
    assert [p.name for p in (part / "forge-state").glob("*.safetensors")] != []
    monkeypatch.delenv("FORGE_TEST_ABORT_AFTER_LAYERS")
    monkeypatch.undo()
    rep = forge.quantize_model(src, part, **_opts(ids_file, resume=True))
    assert rep.resumed_units == 2  # non-layer tensors + layer 0; layer 1 redone
    for f in sorted(whole.rglob("*")):
        if f.is_file() and f.suffix in (".safetensors", ".json") and f.name != "report.json":
            rel = f.relative_to(whole)
            assert (part / rel).read_bytes() == f.read_bytes(), rel
    forge.verify(part)


def test_activation_placements_give_the_same_checkpoint(monkeypatch, src, ids_file, tmp_path):
    """Activations in files against the in-memory default, whose Hessians and next-layer
    inputs the reference tests above check; the attention residuals are written over the
    chunks in files too (as many full-layer forwards). (On a CPU machine ``auto`` is ``cpu``;
    the GPU placements are compared in the cuda tests.)"""
    where = "disk"
    calls = _count_full_forwards(monkeypatch)
    forge.quantize_model(src, tmp_path / "auto", **_opts(ids_file))
    in_memory, calls["full"] = calls["full"], 0
    rep = forge.quantize_model(src, tmp_path / where, **_opts(ids_file, activations=where))
    assert any("activations on disk" in n for n in rep.notes), rep.notes
    assert calls["full"] == in_memory, (calls["full"], in_memory)
    files = sorted((tmp_path / "auto").glob("*.safetensors"))
    assert files
    for f in files:
        assert (tmp_path / where / f.name).read_bytes() == f.read_bytes(), f.name


def test_state_policy_keeps_saving_time_within_its_budget():
    p = calibrate._StatePolicy()
    nbytes = 10 * 2**30
    # before any save: 1 GB/s assumed, 10.7 s per save -> due after 9 x 10.7 s of layers
    assert not p.due(nbytes, 50.0)
    assert p.due(nbytes, 50.0)
    p.saved(nbytes, 2.0)  # measured: 2 s per save -> due after 18 s of layers
    assert not p.due(nbytes, 10.0)
    assert p.due(nbytes, 9.0)
    p.saved(1, 0.0)
    assert p.due(1, 0.0)  # cheap states are saved after every layer


def test_write_safetensors_streams_a_file_safetensors_reads(tmp_path):
    from safetensors.torch import load_file

    ts = {
        "a": torch.randn(3, 5).bfloat16(),
        "b": torch.arange(7, dtype=torch.float64),
        "c": torch.zeros(0, dtype=torch.uint8),
        "d": torch.randn(2, 2, 2),
    }
    path = tmp_path / "x.safetensors"
    calibrate.write_safetensors(
        str(path),
        {k: (v.dtype, tuple(v.shape)) for k, v in ts.items()},
        {k: (lambda v=v: v) for k, v in ts.items()},
    )
    back = load_file(path)
    assert set(back) == set(ts)
    for k, v in ts.items():
        assert back[k].dtype == v.dtype and torch.equal(back[k], v), k
    with pytest.raises(errors.InvalidValueError, match="changed while being written"):
        calibrate.write_safetensors(str(path), {"a": (torch.float32, (3,))}, {"a": lambda: torch.zeros(4)})


@pytest.mark.parametrize("kind", ["deepseek", "qwen3_moe", "llama"])
def test_attention_cache_changes_nothing_but_the_passes(kind, monkeypatch, src, ids_file, tmp_path):
    """Later stages and the final pass run ``h + mlp(norm(h))`` from the cached attention
    residual: fewer full-layer forwards, byte-identical checkpoint and next-layer inputs."""
    model = src if kind == "deepseek" else make_model(kind, tmp_path / kind)
    calls = _count_full_forwards(monkeypatch)
    results = {}
    for label, layers in (("cached", calibrate._MLP_TAIL_LAYERS), ("rerun", frozenset())):
        monkeypatch.setattr(calibrate, "_MLP_TAIL_LAYERS", layers)
        calls["full"] = 0
        _, tap = _run(monkeypatch, model, tmp_path / label, ids_file)
        results[label] = (calls["full"], tap.inputs)
    (n_cached, in_cached), (n_rerun, in_rerun) = results["cached"], results["rerun"]
    assert n_cached < n_rerun, (n_cached, n_rerun)
    for li in in_rerun:
        for a, b in zip(in_cached[li], in_rerun[li], strict=True):
            assert torch.equal(a, b), li
    files = [f for f in sorted((tmp_path / "rerun").iterdir()) if f.name.endswith(".safetensors")]
    assert files
    for f in files:
        assert (tmp_path / "cached" / f.name).read_bytes() == f.read_bytes(), f.name


def test_attention_cache_layers_end_with_the_mlp_tail():
    """Every decoder layer the cache trusts ends its forward exactly as the cache replays it."""
    import importlib
    import inspect
    import re

    tail = (
        "residual = hidden_states\n"
        "hidden_states = self.post_attention_layernorm(hidden_states)\n"
        "hidden_states = self.mlp(hidden_states)\n"
        "hidden_states = residual + hidden_states\n"
        "return hidden_states"
    )
    modules = {
        "DeepseekV3DecoderLayer": "deepseek_v3",
        "Qwen3MoeDecoderLayer": "qwen3_moe",
        "Qwen2MoeDecoderLayer": "qwen2_moe",
        "MixtralDecoderLayer": "mixtral",
        "LlamaDecoderLayer": "llama",
        "MistralDecoderLayer": "mistral",
        "Qwen2DecoderLayer": "qwen2",
        "Qwen3DecoderLayer": "qwen3",
    }
    assert set(modules) == set(calibrate._MLP_TAIL_LAYERS)
    for cls_name, mod in modules.items():
        cls = getattr(importlib.import_module(f"transformers.models.{mod}.modeling_{mod}"), cls_name)
        src = re.sub(r"\n\s+", "\n", inspect.getsource(cls.forward)).strip()
        assert src.endswith(tail), cls_name


@pytest.mark.parametrize(
    "kind", ["qwen3_moe", "mixtral", "llama", "qwen2_moe", "olmoe", "deepseek_v2", "qwen2", "mistral"]
)
def test_other_families_quantize_and_verify(kind, ids_file, tmp_path):
    """Every family the run names (Qwen2-MoE's gated shared expert, OLMoE, DeepSeek-V2's MLA
    without q_lora, dense Qwen2 / Mistral through the generic family): GPTQ beats RTN on every
    linear, the output verifies, and forge's own runtime (float32 on the CPU) gives the logits
    of the same checkpoint dequantized into the plain transformers model."""
    src = make_model(kind, tmp_path / kind)
    rep = forge.quantize_model(src, tmp_path / "o", **_opts(ids_file))
    assert rep.quantizer == "gptq-range" and rep.quantized > 0
    forge.verify(tmp_path / "o")
    rows = json.loads((tmp_path / "o" / "forge/report.json").read_text())["linears"]
    assert all(r["err_gptq"] < r["err_rtn"] for r in rows if r["method"] == "gptq")
    model, _ = forge.load_quantized(tmp_path / "o", dtype=torch.float32, tokenizer=False)
    ref = forge.load_dequantized_model(tmp_path / "o", dtype=torch.float32)
    ids = torch.randint(0, 256, (2, 24), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        got, want = model(ids).logits, ref(ids).logits
    assert float((got - want).abs().max()) <= 1e-5 * float(want.abs().max()) + 1e-6, kind


def test_fp8_source_and_block_hessians(src, ids_file, tmp_path):
    fp8 = make_fp8_variant(src, tmp_path / "fp8")
    rep = forge.quantize_model(fp8, tmp_path / "o", **_opts(ids_file, hessian="block"))
    assert rep.quantized > 0
    forge.verify(tmp_path / "o")


def test_cli_gptq_and_bad_inputs(src, ids_file, tmp_path):
    env = dict(os.environ)
    cmd = [sys.executable, "-m", "forge", "quantize", str(src), str(tmp_path / "cli"), "--method", "gptq",
           "--calib", str(ids_file), "--nsamples", "4", "--seqlen", "16", "--group-size", "32", "--no-progress"]  # fmt: skip
    r = subprocess.run(cmd, capture_output=True, text=True, env=env)
    assert r.returncode == 0, r.stderr
    forge.verify(tmp_path / "cli")
    bad = [
        (dict(calib=tmp_path / "missing.txt"), "calib"),
        (dict(seqlen=4096), "seqlen"),
        (dict(nsamples=0), "nsamples"),
    ]
    empty = tmp_path / "empty.txt"
    empty.write_text("")
    bad.append((dict(calib=empty), "empty"))
    for kw, msg in bad:
        out = tmp_path / f"bad{len(msg)}{msg}"
        with pytest.raises((errors.ForgeError, OSError), match=msg):
            forge.quantize_model(src, out, **_opts(ids_file, **kw))
        assert not (out / "config.json").exists()


def test_nan_activations_and_unknown_family(src, ids_file, tmp_path):
    nan = tmp_path / "nan"
    nan.mkdir()
    for f in src.iterdir():
        if f.suffix == ".safetensors":
            t = load_file(f)
            if "model.embed_tokens.weight" in t:
                t["model.embed_tokens.weight"] = t["model.embed_tokens.weight"].clone()
                t["model.embed_tokens.weight"][:, 3] = float("nan")
            save_file(t, nan / f.name, metadata={"format": "pt"})
        else:
            (nan / f.name).write_bytes(f.read_bytes())
    with pytest.raises(errors.InvalidValueError, match="NaN"):
        forge.quantize_model(nan, tmp_path / "o", **_opts(ids_file))
    assert not (tmp_path / "o" / "config.json").exists()
    odd = tmp_path / "odd"
    odd.mkdir()
    for f in src.iterdir():
        (odd / f.name).write_bytes(f.read_bytes())
    cfg = json.loads((odd / "config.json").read_text())
    cfg["model_type"] = "no_such_model"
    cfg["architectures"] = ["NoSuchForCausalLM"]
    (odd / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(errors.CheckpointError, match="Llama-like dense models, DeepSeek"):
        forge.quantize_model(odd, tmp_path / "o2", **_opts(ids_file))


@pytest.mark.cuda
def test_gptq_run_on_cuda_agrees_with_the_cpu(src, ids_file, tmp_path):
    """The GPU run (bf16 forward, tensor-core Hessians, CUDA GPTQ) reaches the CPU run's quality:
    every linear beats RTN, and its output error stays within 2x of the CPU run's."""
    forge.quantize_model(src, tmp_path / "cpu", **_opts(ids_file))
    forge.quantize_model(src, tmp_path / "gpu", **_opts(ids_file, device="cuda"))
    forge.verify(tmp_path / "gpu")
    rows = {
        d: {
            r["module"]: r
            for r in json.loads((tmp_path / d / "forge" / "report.json").read_text())["linears"]
        }
        for d in ("cpu", "gpu")
    }
    assert rows["cpu"].keys() == rows["gpu"].keys()
    for m, g in rows["gpu"].items():
        c = rows["cpu"][m]
        if g["method"] == "gptq" and c["method"] == "gptq":
            assert g["err_gptq"] < g["err_rtn"], g
            assert g["err_gptq"] <= 2.0 * c["err_gptq"] + 1e-6, (m, g["err_gptq"], c["err_gptq"])
    a, b = dequantized_state_dict(tmp_path / "cpu", G), dequantized_state_dict(tmp_path / "gpu", G)
    same = sum(int((a[k] == b[k]).sum()) for k in a) / sum(a[k].numel() for k in a)
    assert same > 0.8, same


@pytest.mark.cuda
def test_routed_inputs_in_host_memory_give_the_same_checkpoint(monkeypatch, src, ids_file, tmp_path):
    """When the collected expert inputs do not fit on the GPU they live in pinned host memory
    and are gathered from there, and activations kept in host memory stream through reused
    page-locked buffers (the attention residuals written over them as on the GPU, so no more
    full-layer forwards): the same checkpoint, byte for byte."""
    _small_blocks(monkeypatch, True)
    calls = _count_full_forwards(monkeypatch)
    forge.quantize_model(src, tmp_path / "dev", **_opts(ids_file, device="cuda"))
    on_device, calls["full"] = calls["full"], 0
    made = []
    real = calibrate._Collected.__init__

    def spy(self, *a, **k):
        real(self, *a, **k)
        made.append(self.x.device.type)

    monkeypatch.setattr(calibrate._Collected, "__init__", spy)
    monkeypatch.setattr(calibrate._Collected, "DEVICE_SHARE", 0.0)
    forge.quantize_model(src, tmp_path / "host", **_opts(ids_file, device="cuda", activations="cpu"))
    assert made and set(made) == {"cpu"}
    assert calls["full"] == on_device, (calls["full"], on_device)
    for f in sorted((tmp_path / "dev").glob("*.safetensors")):
        assert (tmp_path / "host" / f.name).read_bytes() == f.read_bytes(), f.name


@pytest.mark.parametrize("fmt", ["gptq", "compressed-tensors"])
def test_gptq_run_writes_every_format(fmt, src, ids_file, tmp_path):
    """The calibrated run packs through the run's output format: same codes as the AWQ run."""
    forge.quantize_model(src, tmp_path / "awq", **_opts(ids_file, symmetric=True))
    forge.quantize_model(src, tmp_path / fmt, **_opts(ids_file, symmetric=True, format=fmt))
    assert forge.verify(tmp_path / fmt).format == fmt
    tokens = torch.randint(0, 256, (1, 24), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        a = forge.load_quantized(tmp_path / "awq", dtype=torch.float32)[0](tokens).logits
        b = forge.load_quantized(tmp_path / fmt, dtype=torch.float32)[0](tokens).logits
    _close(b, a, rel=1e-5)


def test_prefetch_reads_ahead_without_changing_a_byte(src, ids_file, tmp_path):
    """``Session.prefetch`` (the next unit's read-ahead) leaves the mapped bytes as they were
    and refuses a unit index outside the plan with a clear error."""
    from forge import _native

    opts = json.dumps(_opts(str(ids_file), device="cpu"))
    sess = _native.Session(str(src), str(tmp_path / "o"), opts)
    units = sess.units()
    before = {t["name"]: bytes(sess.tensor(t["name"])) for u in units for t in u["tensors"]}
    for u in units:
        sess.prefetch(u["index"])
    after = {n: bytes(sess.tensor(n)) for n in before}
    assert after == before
    with pytest.raises(Exception, match=str(len(units))):
        sess.prefetch(len(units))


def _rtn_reference(w: torch.Tensor, qmeta: torch.Tensor, g: int) -> torch.Tensor:
    """Round to nearest on the grid, per element: ``(clamp(round(w/s + z), 0, 15) − z)·fp16(s)``."""
    from forge.quant import decode_qmeta

    scale, zero, sym = decode_qmeta(qmeta)
    k = w.shape[-1]
    z = torch.where(sym, torch.full_like(zero, 8), zero).float().repeat_interleave(g, -1)[..., :k]
    s = scale.repeat_interleave(g, -1)[..., :k]
    q = torch.clamp(torch.round(w.float() * (1.0 / s) + z), 0, 15)
    return (q - z) * s.half().float()


def test_report_errors_are_relative_output_errors_from_the_activations():
    """The report's ``err_gptq`` / ``err_rtn`` are ``‖X(W−Ŵ)ᵀ‖² / ‖XWᵀ‖²`` computed here from
    the activations themselves (RTN on the grid written here per element), for several
    linears reported in one batch (one host sync)."""
    g = torch.Generator().manual_seed(5)
    rows = []
    for n, k in [(8, 64), (16, 32), (4, 128)]:
        x = torch.randn(200, k, generator=g, dtype=torch.float64)
        w = torch.randn(n, k, generator=g, dtype=torch.float64)
        h = (x.t() @ x).float()
        qmeta, _, _ = calibrate.build_quant_grid(w.float(), 32, 4, False, "minmax")
        grid = calibrate._decode(qmeta, 32, k, "cpu")
        deq = w + 0.05 * torch.randn(n, k, generator=g, dtype=torch.float64)
        s = calibrate._Solved(None, qmeta, deq.float(), {}, grid)
        rtn = _rtn_reference(w, qmeta, 32).double()
        ref = [((x @ (w - wh).t()) ** 2).sum() / ((x @ w.t()) ** 2).sum() for wh in (deq, rtn)]
        rows.append((w.float(), s, h, ref))
    none = calibrate._Solved(None, None, None, {}, None)
    calibrate.report_errors([(w, s, h) for w, s, h, _ in rows] + [(rows[0][0], none, None)])
    for _, s, _, (eg, er) in rows:
        _close(torch.tensor(s.info["err_gptq"]), eg.float(), rel=1e-4)
        _close(torch.tensor(s.info["err_rtn"]), er.float(), rel=1e-4)
    assert none.info == {"err_gptq": None, "err_rtn": None}


@pytest.mark.parametrize("block", [None, 8])
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_hessian_refuses_nan_or_inf_inputs(block, bad):
    """A Hessian whose inputs held NaN or Inf (in any row, any later batch) is refused when
    it is taken; a clean one equals ``XᵀX`` computed here. The forward's check agrees."""
    g = torch.Generator().manual_seed(2)
    xs = [torch.randn(20, 32, generator=g) for _ in range(3)]
    h = calibrate._Hessian(32, torch.device("cpu"), block)
    for x in xs:
        h.add(x)
    x = torch.cat(xs).double()
    want = x.t() @ x
    if block:
        mask = torch.block_diag(*[torch.ones(block, block)] * (32 // block)).bool()
        want = torch.where(mask, want, 0.0)
    _close(h.full().double(), want, rel=1e-5)
    assert calibrate._all_finite(x)
    dirty = xs[2].clone()
    dirty[7, 13] = bad
    assert not calibrate._all_finite(dirty)
    h.add(dirty)
    with pytest.raises(errors.InvalidValueError, match="NaN or Inf"):
        h.full()


def test_host_buffers_fall_back_to_pageable_memory(monkeypatch):
    """Page-locked host memory refused (no GPU, or the driver says no): the buffer is plain
    pageable memory of the asked shape and dtype, not an error."""
    real = torch.empty

    def refuse(*a, pin_memory=False, **k):
        if pin_memory:
            raise RuntimeError("cudaHostAlloc: out of memory")
        return real(*a, **k)

    monkeypatch.setattr(torch, "empty", refuse)
    b = calibrate._host_buffer((3, 5), torch.bfloat16)
    assert b.shape == (3, 5) and b.dtype == torch.bfloat16 and not b.is_pinned()


@pytest.mark.parametrize("k", [96, 100])
def test_grid_dequant_equals_the_per_element_formula(k):
    """Dequantization and the report's RTN baseline, applied group by group from a batch grid,
    equal ``(q − z)·fp16(s)`` and ``clamp(round(w/s + z))`` written per element here (a last
    partial group included), for each matrix of the batch."""
    from forge.quant import build_quant_grid, decode_qmeta

    g = torch.Generator().manual_seed(k)
    w = torch.randn(3, 8, k, generator=g)
    qmeta = build_quant_grid(w.reshape(24, k), 32, 4, False, "minmax")[0].reshape(3, 8, -1, 4)
    grids = calibrate._decode(qmeta, 32, k, "cpu")
    scale, zero, sym = decode_qmeta(qmeta)
    z = torch.where(sym, torch.full_like(zero, 8), zero).float().repeat_interleave(32, -1)[..., :k]
    s = scale.repeat_interleave(32, -1)[..., :k]
    for i in range(3):
        codes = torch.randint(0, 16, (k, 8), generator=g, dtype=torch.uint8)
        want = (codes.t().float() - z[i]) * s[i].half().float()
        assert torch.equal(calibrate._dequant(codes, grids[i]), want)
        assert torch.equal(calibrate._rtn_dequant(w[i], grids[i]), _rtn_reference(w[i], qmeta[i], 32))


def test_expert_with_mismatched_shapes_is_refused(src, ids_file, tmp_path):
    """An expert whose up projection is not the gate's shape (a broken checkpoint) is refused
    with an error naming the expert's projections, before anything is written."""
    bad = tmp_path / "bad"
    bad.mkdir()
    name = "model.layers.1.mlp.experts.2.up_proj.weight"
    found = False
    for f in src.iterdir():
        if f.suffix == ".safetensors":
            t = load_file(f)
            if name in t:
                t[name] = t[name][:-8].clone()  # still packable: only the MLP is broken
                found = True
            save_file(t, bad / f.name, metadata={"format": "pt"})
        else:
            (bad / f.name).write_bytes(f.read_bytes())
    assert found
    with pytest.raises(errors.ShapeError, match=r"layer 1: expert 2: gate_proj .* up_proj"):
        forge.quantize_model(bad, tmp_path / "o", **_opts(ids_file))
    assert not (tmp_path / "o" / "config.json").exists()


def test_experts_of_unequal_shapes_are_refused(src, ids_file, tmp_path):
    """The routed experts of a layer are stacked: an expert whose MLP is whole (and packable)
    but twice as wide as expert 0's is refused naming both shapes, before anything is written."""
    bad = tmp_path / "bad"
    bad.mkdir()
    pre = "model.layers.1.mlp.experts.3."
    for f in src.iterdir():
        if f.suffix == ".safetensors":
            t = load_file(f)
            for leaf in ("gate_proj", "up_proj"):
                if f"{pre}{leaf}.weight" in t:
                    t[f"{pre}{leaf}.weight"] = t[f"{pre}{leaf}.weight"].repeat(2, 1)
            if f"{pre}down_proj.weight" in t:
                t[f"{pre}down_proj.weight"] = t[f"{pre}down_proj.weight"].repeat(1, 2)
            save_file(t, bad / f.name, metadata={"format": "pt"})
        else:
            (bad / f.name).write_bytes(f.read_bytes())
    with pytest.raises(errors.ShapeError, match=r"layer 1: expert 3: down_proj .* must have one shape"):
        forge.quantize_model(bad, tmp_path / "o", **_opts(ids_file))
    assert not (tmp_path / "o" / "config.json").exists()


def _routed_reference(gate_up, down, act, x, idx, wts, keep=None, reap=None):
    """The routed output token by token in float64 (plain PyTorch): ``Σ_j w_j · D_e act(G_e x) ⊙
    (U_e x)`` over the token's experts ``e = idx[t, j]``; ``keep`` maps compact ids to stacked ones.
    ``reap`` (float64, one per expert), when given, gets REAP's ``Σ w_j ‖y_e‖`` per expert."""
    i = down.shape[-1]
    out = torch.zeros(x.shape, dtype=torch.float64, device=x.device)
    for t in range(x.shape[0]):
        for j in range(idx.shape[1]):
            e = int(idx[t, j])
            e = keep[e] if keep is not None else e
            h = gate_up[e].double() @ x[t].double()
            y = down[e].double() @ (act(h[:i]) * h[i:])
            out[t] += float(wts[t, j]) * y
            if reap is not None:
                reap[int(idx[t, j])] += float(wts[t, j]) * float(y.norm())
    return out


def test_routed_experts_stacked_views_and_keep():
    """Per-expert outputs read the stacked weights' views; ``keep`` compacts the experts in
    place (ascending ids) or by gathering (any order), and the routed output of the kept
    experts equals the plain-PyTorch formula on the original weights."""
    e_, d, i, t, k = 6, 16, 8, 40, 2
    gate_up, down = torch.randn(e_, 2 * i, d), torch.randn(e_, d, i)
    x = torch.randn(t, d)
    for keep in ([0, 2, 5], [4, 1, 3]):
        routed = calibrate._RoutedExperts(gate_up.clone(), down.clone(), torch.nn.functional.silu)
        routed.keep(keep)
        assert routed.n_experts == len(keep) and routed.gate_up.shape[0] == len(keep)
        idx = torch.stack([torch.randperm(len(keep))[:k] for _ in range(t)])
        wts = torch.softmax(torch.randn(t, k), 1)
        out = routed.compute(x, idx, wts)
        _close(
            out.double(), _routed_reference(gate_up, down, torch.nn.functional.silu, x, idx, wts, keep), 1e-5
        )


@pytest.mark.parametrize("remap", [False, True])
@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)])
def test_grouped_routed_output_matches_the_formula(device, remap):
    """The grouped routed output (two grouped GEMMs over the pairs sorted by expert plus an
    ``embedding_bag``; what runs on Hopper GPUs) agrees with the float64 formula to bf16
    rounding, with the per-expert loop it replaced, and gives the same REAP sums; a remap
    layout's pruned picks (weight 0) contribute nothing. On the CPU it runs where this torch's
    ``torch._grouped_mm`` does (the run itself uses it only on CUDA)."""
    e_, d, i, t, k = 16, 256, 128, 3000, 4
    dev = torch.device(device)
    if device == "cpu" and not calibrate._grouped_mm_runs(dev):
        pytest.skip("this torch has no torch._grouped_mm on the CPU")
    gate_up = (torch.randn(e_, 2 * i, d, device=dev) * d**-0.5).bfloat16()
    down = (torch.randn(e_, d, i, device=dev) * i**-0.5).bfloat16()
    routed = calibrate._RoutedExperts(gate_up, down, torch.nn.functional.silu)
    if device == "cuda":
        if not routed.grouped(dev, torch.bfloat16):
            pytest.skip("grouped GEMMs need torch._grouped_mm on a Hopper (sm90+) GPU")
    else:
        assert not routed.grouped(dev, torch.bfloat16)  # the run keeps the loop on the CPU
    x = torch.randn(t, d, device=dev).bfloat16()
    skew = torch.arange(1, e_ + 1, dtype=torch.float32, device=dev) ** -0.8
    idx = torch.multinomial(skew.expand(t, -1), k)  # distinct experts per token, skewed counts
    wts = torch.softmax(torch.randn(t, k, device=dev), 1)
    keep = None
    if remap:
        keep = [0, 1, 2, 3, 5, 8, 9, 12, 13, 15]
        m = torch.full((e_,), -1, dtype=torch.long)
        m[torch.tensor(keep)] = torch.arange(len(keep))
        routed.keep(keep)
        routed.remap = m.to(dev)
        idx, wts = routed.remapped(idx, wts)
        assert bool((idx == len(keep)).any()) and bool((wts[idx == len(keep)] == 0).all())
    stats = {}
    outs = {}
    for name in ("grouped", "per_expert"):
        routed.stats = calibrate._Stats(routed.n_experts)
        outs[name] = getattr(routed, f"_compute_{name}")(x, idx, wts).double()
        stats[name] = routed.stats.reap.clone()
    routed.stats = None
    safe = torch.where(idx < routed.n_experts, idx, 0)
    cpu = [v.cpu() for v in (routed.gate_up, routed.down)]
    reap = torch.zeros(routed.n_experts, dtype=torch.float64)
    ref = _routed_reference(*cpu, torch.nn.functional.silu, x.cpu(), safe.cpu(), wts.cpu(), reap=reap).to(dev)
    assert outs["grouped"].dtype == torch.float64 and torch.isfinite(outs["grouped"]).all()
    _close(outs["grouped"], ref, 1.5e-2)
    _close(outs["per_expert"], ref, 1e-2)
    _close(outs["grouped"], outs["per_expert"], 1.5e-2)
    torch.testing.assert_close(stats["grouped"], stats["per_expert"], rtol=1e-2, atol=0)
    torch.testing.assert_close(stats["grouped"], reap, rtol=1e-2, atol=0)  # the formula's REAP
    torch.testing.assert_close(stats["per_expert"], reap, rtol=1e-2, atol=0)
    assert bool((stats["grouped"] > 0).all())
