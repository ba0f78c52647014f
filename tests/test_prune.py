"""Expert pruning (issue 11) against plain PyTorch / transformers references.

* Router statistics: counts from DeepSeek's routing written out in this file, probability mass
  as ``sigmoid(x Wᵀ)`` summed, REAP as the mean of router weight x ‖expert output‖ — all from
  the ORIGINAL model's own modules (fp32), fed the same calibration windows.
* Compact checkpoints: transformers loads the written folder (router rows sliced, experts
  renumbered, the family's expert count updated) and its logits equal the original model's
  with the pruned experts excluded from selection (sigmoid: never chosen; softmax: logit −∞).
* Remap layout: the next layer's inputs equal the original model with the routed experts'
  weights remapped as the spec says (pruned picks weight 0, the rest rescaled).
* Kept sets follow the criterion with group balance; bad inputs write nothing verify accepts;
  a resumed pruning run is byte-identical.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from tiny_models import make_fp8_variant, make_model, read_tensors

import forge
from forge import calibrate, errors

G = 32


def _opts(ids_file, **kw):
    o = dict(calib=ids_file, nsamples=8, seqlen=32, group_size=G, progress=False, chunk_tokens=64)
    o.update(kw)
    return o


def _windows(ids_file) -> torch.Tensor:
    return calibrate.load_calibration(ids_file, None, 8, 32, 0)


def _model(folder):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()


def _moe_layers(model):
    return [i for i, layer in enumerate(model.model.layers) if hasattr(layer.mlp, "experts")]


def _deepseek_route(gate, x):
    """DeepSeek-V3 routing, written from the notes: sigmoid scores, bias for selection only,
    group score = sum of the top-2 biased scores, top groups, top-k, unbiased weights."""
    s = torch.sigmoid(x @ gate.weight.float().T)
    b = s + gate.e_score_correction_bias.float()
    e, ng = s.shape[1], gate.num_group
    gs = b.view(-1, ng, e // ng).topk(2, dim=-1).values.sum(-1)
    keep = torch.zeros_like(gs, dtype=torch.bool).scatter_(1, gs.topk(gate.topk_group, dim=-1).indices, True)
    b = b.masked_fill(~keep.repeat_interleave(e // ng, dim=1), float("-inf"))
    idx = b.topk(gate.top_k, dim=-1).indices
    w = s.gather(1, idx)
    w = w / (w.sum(-1, keepdim=True) + 1e-20) * gate.routed_scaling_factor
    return s, idx, w


def _expert_out(experts, e, x):
    g, u = F.linear(x, experts.gate_up_proj[e]).chunk(2, dim=-1)
    return F.linear(F.silu(g) * u, experts.down_proj[e])


def _gate_inputs(model, ids) -> dict[int, torch.Tensor]:
    got: dict[int, list[torch.Tensor]] = {}
    hs = []
    for li in _moe_layers(model):
        gate = model.model.layers[li].mlp.gate
        hs.append(
            gate.register_forward_pre_hook(
                lambda _m, a, li=li: got.setdefault(li, []).append(a[0].reshape(-1, a[0].shape[-1]))
            )
        )
    with torch.no_grad():
        model(ids)
    for h in hs:
        h.remove()
    return {li: torch.cat(v) for li, v in got.items()}


def test_stats_only_equal_plain_torch(src, ids_file, tmp_path):
    out = tmp_path / "stats"
    forge.prune_model(src, out, **_opts(ids_file, stats_only=True))
    assert not (out / "config.json").exists() and not list(out.glob("*.safetensors"))
    from safetensors import safe_open

    with safe_open(out / "forge/router_stats.safetensors", "pt") as f:
        st = {k: f.get_tensor(k) for k in f.keys()}
        meta = json.loads(f.metadata()["forge"])
    assert meta["scoring"] == "sigmoid" and meta["num_experts"] == 8
    model = _model(src)
    xs = _gate_inputs(model, _windows(ids_file))
    assert st["layers"].tolist() == sorted(xs)
    for row, li in enumerate(st["layers"].tolist()):
        mlp = model.model.layers[li].mlp
        with torch.no_grad():
            s, idx, w = _deepseek_route(mlp.gate, xs[li])
            counts = torch.bincount(idx.flatten(), minlength=8).double()
            reap = torch.zeros(8, dtype=torch.float64)
            for e in range(8):
                tok, slot = (idx == e).nonzero(as_tuple=True)
                if len(tok):
                    y = _expert_out(mlp.experts, e, xs[li][tok])
                    reap[e] = (w[tok, slot] * y.norm(dim=-1)).double().sum()
        assert torch.equal(st["counts"][row], counts)
        torch.testing.assert_close(st["mass"][row], s.sum(0).double(), rtol=1e-5, atol=1e-3)
        torch.testing.assert_close(st["reap"][row], reap, rtol=1e-4, atol=1e-4)
    assert (out / "forge/router_stats.png").read_bytes()[:4] == b"\x89PNG"


def test_sparse_forward_skips_the_routed_experts(src, ids_file, tmp_path):
    """``sparse_forward``: the first MoE layer's statistics are exact (nothing routed runs before
    it); the next one's come from inputs computed with the routed experts skipped: equal to the
    original model with its routed experts' output zeroed (attention + residual + shared expert)."""
    out = tmp_path / "sparse"
    forge.prune_model(src, out, **_opts(ids_file, stats_only=True, sparse_forward=True))
    st = read_tensors_file(out / "forge/router_stats.safetensors")
    assert float(st["reap"].abs().sum()) == 0.0  # no expert output was computed
    with pytest.raises(errors.InvalidValueError, match="no REAP"):
        forge.prune_model(
            src, tmp_path / "o", router_stats=out / "forge/router_stats.safetensors", keep_experts=4
        )
    model = _model(src)
    for li in _moe_layers(model):
        model.model.layers[li].mlp.experts.forward = lambda x, idx, w: torch.zeros_like(x)
    xs = _gate_inputs(model, _windows(ids_file))
    for row, li in enumerate(st["layers"].tolist()):
        with torch.no_grad():
            s, idx, _ = _deepseek_route(model.model.layers[li].mlp.gate, xs[li])
        assert torch.equal(st["counts"][row], torch.bincount(idx.flatten(), minlength=8).double())
        torch.testing.assert_close(st["mass"][row], s.sum(0).double(), rtol=1e-5, atol=1e-3)


def _check_map(emap: list[int], keep: int, n_group: int):
    kept = [e for e, c in enumerate(emap) if c >= 0]
    assert len(kept) == keep >= 1
    assert [emap[e] for e in kept] == list(range(keep))  # dense, in original order
    assert all(c == -1 for c in emap if c < 0)
    per = len(emap) // n_group
    assert all(sum(1 for e in kept if e // per == g) == keep // n_group for g in range(n_group))
    return kept


@pytest.mark.parametrize("criterion", ["frequency", "reap"])
def test_compact_prune_equals_the_original_with_pruned_experts_unselectable(
    criterion, src, ids_file, tmp_path
):
    out = tmp_path / "compact"
    forge.prune_model(src, out, **_opts(ids_file, keep_experts=4, criterion=criterion, method="none"))
    forge.verify(out)
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["n_routed_experts"] == 4 and "quantization_config" not in cfg
    block = cfg["forge_expert_pruning"]
    assert block["layout"] == "compact" and block["num_original_experts"] == 8
    emaps = json.loads((out / "forge/expert_map.json").read_text())
    pruning = json.loads((out / "forge/pruning.json").read_text())
    assert emaps["layers"] == [1, 2] and len(pruning["layers"]) == 2
    stats = read_tensors_file(out / "forge/router_stats.safetensors")
    orig, new = read_tensors(src), read_tensors(out)
    kept_of = {}
    for row, li in enumerate(emaps["layers"]):
        kept = _check_map(emaps["expert_map"][row], 4, 2)
        kept_of[li] = kept
        assert block["expert_map"][str(li)] == emaps["expert_map"][row]
        # The criterion, per group (2 groups of 4): the best 2 of each.
        score = (
            stats["counts"][row]
            if criterion == "frequency"
            else stats["reap"][row] / stats["counts"][row].clamp(min=1)
        )
        want = sorted(
            g * 4 + int(i) for g in range(2) for i in torch.topk(score[g * 4 : g * 4 + 4], 2).indices
        )
        assert kept == want, (li, kept, want)
        p = f"model.layers.{li}.mlp."
        assert torch.equal(new[p + "gate.weight"], orig[p + "gate.weight"][kept])
        assert torch.equal(
            new[p + "gate.e_score_correction_bias"], orig[p + "gate.e_score_correction_bias"][kept]
        )
        for c, e in enumerate(kept):
            for leaf in ("gate_proj", "up_proj", "down_proj"):
                assert torch.equal(
                    new[f"{p}experts.{c}.{leaf}.weight"], orig[f"{p}experts.{e}.{leaf}.weight"]
                )
        assert f"{p}experts.4.gate_proj.weight" not in new
    # transformers loads the compact folder; its logits equal the original model's with the
    # pruned experts made unselectable (bias -1e9 keeps every group's top-2 among survivors).
    ids = _windows(ids_file)[:2]
    pruned = _model(out)
    ref = _model(src)
    with torch.no_grad():
        for li, kept in kept_of.items():
            b = ref.model.layers[li].mlp.gate.e_score_correction_bias
            mask = torch.ones(8, dtype=torch.bool)
            mask[kept] = False
            b[mask] = -1e9
        torch.testing.assert_close(pruned(ids).logits, ref(ids).logits, rtol=1e-5, atol=1e-5)


def read_tensors_file(path: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(path)


def test_softmax_router_compact_prune_equals_masked_logits(ids_file, tmp_path):
    src = make_model("qwen3_moe", tmp_path / "qwen")
    out = tmp_path / "o"
    forge.prune_model(src, out, **_opts(ids_file, prune_ratio=0.5, criterion="mass", method="none"))
    forge.verify(out)
    cfg = json.loads((out / "config.json").read_text())
    assert cfg.get("num_experts", cfg.get("num_local_experts")) == 4  # transformers 5 writes the latter
    emaps = json.loads((out / "forge/expert_map.json").read_text())
    ref = _model(src)
    for row, li in enumerate(emaps["layers"]):
        kept = [e for e, c in enumerate(emaps["expert_map"][row]) if c >= 0]
        gate = ref.model.layers[li].mlp.gate
        dead = torch.ones(8, dtype=torch.bool)
        dead[kept] = False

        def fwd(h, gate=gate, dead=dead):
            logits = F.linear(h.reshape(-1, gate.hidden_dim), gate.weight).masked_fill(dead, float("-inf"))
            p = logits.softmax(-1)
            w, idx = p.topk(gate.top_k, dim=-1)
            if gate.norm_topk_prob:
                w = w / w.sum(-1, keepdim=True)
            return logits, w, idx

        gate.forward = fwd
    ids = _windows(ids_file)[:2]
    with torch.no_grad():
        torch.testing.assert_close(_model(out)(ids).logits, ref(ids).logits, rtol=1e-5, atol=1e-5)


def test_remap_layout_follows_the_spec_routing(monkeypatch, src, ids_file, tmp_path):
    inputs: dict[int, list[torch.Tensor]] = {}
    monkeypatch.setattr(
        calibrate,
        "TAP",
        lambda ev, **d: (
            inputs.__setitem__(d["layer"], [t.clone() for t in d["hidden"]]) if ev == "layer_input" else None
        ),
    )
    out = tmp_path / "remap"
    forge.prune_model(
        src, out, **_opts(ids_file, keep_experts=3, remap=True, criterion="frequency", method="none")
    )
    forge.verify(out)
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["n_routed_experts"] == 8 and cfg["forge_expert_pruning"]["layout"] == "remap"
    assert cfg["architectures"] == ["ForgeRemapDeepseekV3ForCausalLM"]  # stock vLLM refuses it
    with pytest.raises(errors.CheckpointError, match="remap"):
        forge.load_quantized(out)  # runs only in vLLM with forge's plugin
    new, orig = read_tensors(out), read_tensors(src)
    maps = {int(k): torch.tensor(v) for k, v in cfg["forge_expert_pruning"]["expert_map"].items()}
    for li, m in maps.items():
        p = f"model.layers.{li}.mlp."
        assert torch.equal(new[p + "gate.weight"], orig[p + "gate.weight"])  # full router
        kept = torch.nonzero(m >= 0).flatten().tolist()
        assert len(kept) == 3 and m[kept].tolist() == [0, 1, 2]
        for c, e in enumerate(kept):
            assert torch.equal(new[f"{p}experts.{c}.up_proj.weight"], orig[f"{p}experts.{e}.up_proj.weight"])
        assert f"{p}experts.3.up_proj.weight" not in new
    # Layer 2's inputs = the original layers 0-1 with layer 1's routing remapped (plain torch).
    ref = _model(src)
    experts = ref.model.layers[1].mlp.experts
    orig_fwd = experts.forward

    def remapped(x, idx, w, m=maps[1]):
        ok = m[idx] >= 0
        w2 = torch.where(ok, w, torch.zeros_like(w))
        w2 = w2 * (w.sum(-1, keepdim=True) / w2.sum(-1, keepdim=True).clamp(min=1e-30))
        return orig_fwd(x, idx, w2)

    experts.forward = remapped
    ids = _windows(ids_file)
    with torch.no_grad():
        h = ref.model(ids, output_hidden_states=True).hidden_states[2]
    got = torch.cat(inputs[2])
    torch.testing.assert_close(got, h, rtol=1e-4, atol=1e-4)


def test_prune_and_gptq_from_fp8_in_one_run(monkeypatch, src, ids_file, tmp_path):
    fp8 = make_fp8_variant(src, tmp_path / "fp8")
    hs: dict[str, int] = {}
    monkeypatch.setattr(
        calibrate,
        "TAP",
        lambda ev, **d: hs.__setitem__(d["module"], d["tokens"]) if ev == "hessian" else None,
    )
    out = tmp_path / "o"
    rep = forge.prune_model(fp8, out, **_opts(ids_file, method="gptq", keep_experts=6))
    assert rep.quantized > 0
    forge.verify(out)
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["n_routed_experts"] == 6 and cfg["quantization_config"]["quant_method"] == "awq"
    t = read_tensors(out)
    assert "model.layers.1.mlp.experts.5.up_proj.qweight" in t
    assert "model.layers.1.mlp.experts.6.up_proj.qweight" not in t
    # Every calibration token reaches top_k surviving experts: their Hessians split them exactly.
    tokens = sum(n for m, n in hs.items() if m.startswith("model.layers.1.mlp.experts.") and "down" in m)
    assert tokens == 8 * 32 * 2
    model, _ = forge.load_quantized(out)
    with torch.no_grad():
        assert torch.isfinite(model(_windows(ids_file)[:1]).logits).all()


def test_prune_from_saved_stats_binds_the_experts_it_says(src, ids_file, tmp_path):
    """Pruning from a router_stats file needs no calibration; expert c of the output is the RTN
    of original expert keep[c], byte for byte the same tensors as an unpruned RTN run writes."""
    stats_dir = tmp_path / "stats"
    forge.prune_model(src, stats_dir, **_opts(ids_file, stats_only=True))
    stats = stats_dir / "forge/router_stats.safetensors"
    out = tmp_path / "o"
    forge.prune_model(
        src,
        out,
        router_stats=stats,
        keep_experts=4,
        criterion="frequency",
        method="rtn",
        group_size=G,
        progress=False,
    )
    forge.verify(out)
    rep = json.loads((out / "forge/pruning.json").read_text())
    assert rep["bytes_after"] < rep["bytes_before"] and [r["kept"] for r in rep["layers"]] == [4, 4]
    assert json.loads((out / "forge/expert_map.json").read_text())["layers"] == [1, 2]
    assert torch.load(out / "forge/expert_map.pt")["expert_map"].shape == (2, 8)
    full = tmp_path / "full"
    forge.quantize_model(src, full, group_size=G, progress=False)
    st = read_tensors_file(stats)
    cfg = json.loads((out / "config.json").read_text())
    a, b = read_tensors(out), read_tensors(full)
    for row, li in enumerate(st["layers"].tolist()):
        m = cfg["forge_expert_pruning"]["expert_map"][str(li)]
        kept = _check_map(m, 4, 2)
        counts = st["counts"][row]
        assert kept == sorted(
            g * 4 + int(i) for g in range(2) for i in torch.topk(counts[g * 4 : g * 4 + 4], 2).indices
        )
        for c, e in enumerate(kept):
            for sfx in ("qweight", "qzeros", "scales"):
                n = f"model.layers.{li}.mlp.experts.{{}}.down_proj.{sfx}"
                assert torch.equal(a[n.format(c)], b[n.format(e)])


def test_gptq_with_experts_from_saved_stats(src, ids_file, tmp_path):
    """GPTQ on experts chosen at open from a saved statistics file: the written experts are the
    ones the file's counts pick per group, and the pruned model's routing reaches only them."""
    stats_dir = tmp_path / "stats"
    forge.prune_model(src, stats_dir, **_opts(ids_file, stats_only=True))
    out = tmp_path / "o"
    forge.prune_model(
        src,
        out,
        **_opts(ids_file, method="gptq", keep_experts=4, criterion="frequency"),
        router_stats=stats_dir / "forge/router_stats.safetensors",
    )
    forge.verify(out)
    st = read_tensors_file(stats_dir / "forge/router_stats.safetensors")
    cfg = json.loads((out / "config.json").read_text())
    for row, li in enumerate(st["layers"].tolist()):
        c = st["counts"][row]
        want = sorted(g * 4 + int(i) for g in range(2) for i in torch.topk(c[g * 4 : g * 4 + 4], 2).indices)
        assert _check_map(cfg["forge_expert_pruning"]["expert_map"][str(li)], 4, 2) == want
    rep = json.loads((out / "forge/pruning.json").read_text())
    assert [r["kept_experts"] for r in rep["layers"]] == [
        [e for e, c in enumerate(cfg["forge_expert_pruning"]["expert_map"][str(li)]) if c >= 0]
        for li in (1, 2)
    ]


def test_bad_pruning_inputs_write_nothing_verify_accepts(src, ids_file, tmp_path):
    llama = make_model("llama", tmp_path / "llama")
    qwen = make_model("qwen3_moe", tmp_path / "qwen")
    forge.prune_model(qwen, tmp_path / "qstats", **_opts(ids_file, stats_only=True))
    cases = [
        (src, dict(keep_experts=9), "keep_experts"),
        (src, dict(keep_experts=1), "keep_experts"),  # fewer than top_k
        (src, dict(keep_experts=5), "keep_experts"),  # not a multiple of n_group
        (src, dict(keep_experts=4, prune_ratio=0.5), "prune_ratio"),
        (src, dict(keep_experts=4, criterion="reap", sparse_forward=True), "sparse_forward"),
        (llama, dict(keep_experts=2), "expert"),
    ]
    for i, (model, kw, msg) in enumerate(cases):
        out = tmp_path / f"bad{i}"
        with pytest.raises(errors.ForgeError, match=msg):
            forge.prune_model(model, out, **_opts(ids_file, **kw))
        assert not (out / "config.json").exists()
    out = tmp_path / "other"
    with pytest.raises(errors.ForgeError, match="router_stats"):
        forge.prune_model(
            src,
            out,
            router_stats=tmp_path / "qstats/forge/router_stats.safetensors",
            keep_experts=4,
            progress=False,
        )
    assert not (out / "config.json").exists()


def test_pruning_resume_is_byte_identical(monkeypatch, src, ids_file, tmp_path):
    kw = _opts(ids_file, keep_experts=6, method="gptq")
    whole = tmp_path / "whole"
    forge.prune_model(src, whole, **kw)
    part = tmp_path / "part"
    monkeypatch.setenv("FORGE_TEST_ABORT_AFTER_LAYERS", "3")
    with pytest.raises(RuntimeError, match="test abort"):
        forge.prune_model(src, part, **kw)
    monkeypatch.delenv("FORGE_TEST_ABORT_AFTER_LAYERS")
    with pytest.raises(errors.CheckpointError, match="different options"):
        forge.prune_model(src, part, **dict(kw, keep_experts=4, resume=True))
    forge.prune_model(src, part, **dict(kw, resume=True))
    for f in sorted(whole.iterdir()):
        if f.name.endswith((".safetensors", ".json")):
            assert (part / f.name).read_bytes() == f.read_bytes(), f.name
    for name in ("forge/expert_map.json", "forge/router_stats.safetensors"):
        assert (part / name).read_bytes() == (whole / name).read_bytes(), name


def test_experts_bind_while_the_previous_unit_syncs(src, ids_file, tmp_path):
    """The run fsyncs unit i on a worker thread (``Session.sync_unit``) while it binds the
    next layer's experts: the sync must not hold the session, or ``bind_experts`` fails with
    "Already borrowed" (seen in CI). Unit 0 is synced over and over on a thread while the
    MoE layer is bound, and the kept experts are the ones the map then reports."""
    import threading

    from forge import _native

    opts = json.dumps(_opts(str(ids_file), device="cpu", prune_ratio=0.5, criterion="frequency"))
    sess = _native.Session(str(src), str(tmp_path / "o"), opts)
    units = sess.units()
    moe = next(u for u in units if u["experts"] is not None)
    sess.write_unquantized(0)
    sess.quantize_rtn(0)
    started, stop, errors_seen = threading.Event(), threading.Event(), []

    def sync_loop():
        started.set()
        try:
            while not stop.is_set():
                sess.sync_unit(0, None)
        except Exception as exc:  # reported below
            errors_seen.append(exc)

    worker = threading.Thread(target=sync_loop)
    worker.start()
    started.wait()
    try:
        for _ in range(50):  # each call lands while a sync is (very likely) in flight
            sess.bind_experts(moe["layer"], [0, 2, 5, 7])
    finally:
        stop.set()
        worker.join()
    assert errors_seen == []
    assert sess.expert_map()[moe["layer"]] == [0, -1, 1, -1, -1, 2, -1, 3]
    sess.commit(0, None)
    assert sess.units()[0]["done"]


def test_cli_prune_stats_only_and_compact(src, ids_file, tmp_path):
    base = [sys.executable, "-m", "forge", "prune", str(src)]
    common = [
        "--calib",
        str(ids_file),
        "--nsamples",
        "4",
        "--seqlen",
        "16",
        "--group-size",
        "32",
        "--no-progress",
    ]
    r = subprocess.run(
        base + [str(tmp_path / "s"), "--stats-only"] + common,
        capture_output=True,
        text=True,
        env=dict(os.environ),
    )
    assert r.returncode == 0, r.stderr
    assert (tmp_path / "s/forge/router_stats.json").exists()
    r = subprocess.run(
        base + [str(tmp_path / "c"), "--prune-ratio", "0.5", "--criterion", "frequency"] + common,
        capture_output=True,
        text=True,
        env=dict(os.environ),
    )
    assert r.returncode == 0, r.stderr
    assert json.loads((tmp_path / "c/config.json").read_text())["n_routed_experts"] == 4
    forge.verify(tmp_path / "c")


@pytest.mark.cuda
def test_pruning_run_on_cuda_agrees_with_the_cpu(src, ids_file, tmp_path):
    """Statistics, pruning and GPTQ in one run on the GPU (bf16 forward): the router statistics
    match the CPU run's (fp32) to bf16 precision, and the output verifies."""
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    kw = _opts(ids_file, method="gptq", keep_experts=6, criterion="mass")
    forge.prune_model(src, tmp_path / "cpu", **kw)
    forge.prune_model(src, tmp_path / "gpu", **dict(kw, device="cuda"))
    forge.verify(tmp_path / "gpu")
    a = read_tensors_file(tmp_path / "cpu/forge/router_stats.safetensors")
    b = read_tensors_file(tmp_path / "gpu/forge/router_stats.safetensors")
    assert torch.equal(a["layers"], b["layers"])
    assert torch.equal(b["counts"].sum(1), a["counts"].sum(1))  # every token routed top_k times
    torch.testing.assert_close(b["mass"], a["mass"], rtol=0.03, atol=0.5)
    cfg = json.loads((tmp_path / "gpu/config.json").read_text())
    assert cfg["n_routed_experts"] == 6
