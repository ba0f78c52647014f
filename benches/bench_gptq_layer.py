"""One DeepSeek-V3-shaped MoE layer through the calibrated GPTQ run, timed by phase.

Builds a one-layer checkpoint with DeepSeek-V3's real dimensions (hidden 7168, MLA with
q_lora 1536 / kv_lora 512 / 128 heads, 256 routed experts of 2048 plus one shared, top-8 in
8 groups) and random weights stored as FP8 E4M3 with 128x128 ``weight_scale_inv`` blocks,
as the released checkpoint is; then runs ``forge.quantize_model(method="gptq")`` on the GPU
over ``--tokens`` calibration tokens and prints seconds per phase (read, FP8 dequant, forward,
Hessians, GPTQ, pack+write, ...), the GPTQ side (the layer's seconds less its forward pass),
peak GPU memory, and a projection to the whole model
(58 MoE + 3 dense layers at 512 x 4096 calibration tokens): the token phases (forward,
Hessians, expert gather + forward) extrapolated linearly through the two largest runs, the
solves and I/O as measured, and an upper bound that multiplies the
token-dependent phases of the largest run by the token ratio.

The routing is skewed on purpose (``e_score_correction_bias`` drawn from a normal with
``--skew`` standard deviation), so experts see uneven token counts as in a real model.

    python benches/bench_gptq_layer.py [--tokens 8192,65536,262144] [--json out.json] [--keep DIR]
                                       [--gpu-gib 79.1]  (an 80 GB card's memory on a larger one)

Rows are written to the JSON file as soon as they are measured.
"""

from __future__ import annotations

import argparse
import json
import math
import shutil
import tempfile
import time
from pathlib import Path

import gpu_budget
import torch

TOKEN_PHASES = ("forward", "hessian", "experts: gather + forward", "store activations")


def write_row(path: str | None, row: dict) -> None:
    print(json.dumps(row), flush=True)
    if path:
        p = Path(path)
        rows = json.loads(p.read_text()) if p.exists() else []
        rows.append(row)
        p.write_text(json.dumps(rows, indent=1) + "\n")


def fp8_blocks(w: torch.Tensor, block: int = 128) -> tuple[torch.Tensor, torch.Tensor]:
    n, k = w.shape
    nb, kb = math.ceil(n / block), math.ceil(k / block)
    pad = torch.zeros(nb * block, kb * block, device=w.device, dtype=torch.float32)
    pad[:n, :k] = w.float()
    blocks = pad.view(nb, block, kb, block)
    amax = blocks.abs().amax(dim=(1, 3)).clamp(min=1e-12)
    scale = amax / 448.0
    q = (blocks / scale[:, None, :, None]).view(nb * block, kb * block)[:n, :k]
    return q.to(torch.float8_e4m3fn).cpu(), scale.float().cpu()


def build_checkpoint(folder: Path, experts: int, seed: int, skew: float) -> None:
    from safetensors.torch import save_file
    from transformers import DeepseekV3Config

    cfg = DeepseekV3Config(
        vocab_size=4096,
        hidden_size=7168,
        intermediate_size=18432,
        moe_intermediate_size=2048,
        num_hidden_layers=1,
        first_k_dense_replace=0,
        n_routed_experts=experts,
        num_experts_per_tok=8,
        n_shared_experts=1,
        n_group=8,
        topk_group=4,
        num_attention_heads=128,
        num_key_value_heads=128,
        q_lora_rank=1536,
        kv_lora_rank=512,
        qk_rope_head_dim=64,
        qk_nope_head_dim=128,
        v_head_dim=128,
        max_position_embeddings=4096,
        num_nextn_predict_layers=0,
    )
    d = cfg.to_dict()
    d["quantization_config"] = {
        "quant_method": "fp8",
        "fmt": "e4m3",
        "activation_scheme": "dynamic",
        "weight_block_size": [128, 128],
    }
    d["architectures"] = ["DeepseekV3ForCausalLM"]
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(d, indent=1))
    g = torch.Generator(device="cuda").manual_seed(seed)
    H, INTER, Q, KV = 7168, 2048, 1536, 512
    heads, nope, rope, v = 128, 128, 64, 128
    pre = "model.layers.0."
    linears = {
        "self_attn.q_a_proj": (Q, H),
        "self_attn.q_b_proj": (heads * (nope + rope), Q),
        "self_attn.kv_a_proj_with_mqa": (KV + rope, H),
        "self_attn.kv_b_proj": (heads * (nope + v), KV),
        "self_attn.o_proj": (H, heads * v),
        "mlp.shared_experts.gate_proj": (INTER, H),
        "mlp.shared_experts.up_proj": (INTER, H),
        "mlp.shared_experts.down_proj": (H, INTER),
    }
    for e in range(experts):
        linears[f"mlp.experts.{e}.gate_proj"] = (INTER, H)
        linears[f"mlp.experts.{e}.up_proj"] = (INTER, H)
        linears[f"mlp.experts.{e}.down_proj"] = (H, INTER)
    other = {
        "model.embed_tokens.weight": torch.randn(4096, H, generator=g, device="cuda")
        .mul(0.02)
        .bfloat16()
        .cpu(),
        "model.norm.weight": torch.ones(H, dtype=torch.bfloat16),
        "lm_head.weight": torch.randn(4096, H, generator=g, device="cuda").mul(0.02).bfloat16().cpu(),
        pre + "input_layernorm.weight": torch.ones(H, dtype=torch.bfloat16),
        pre + "post_attention_layernorm.weight": torch.ones(H, dtype=torch.bfloat16),
        pre + "self_attn.q_a_layernorm.weight": torch.ones(Q, dtype=torch.bfloat16),
        pre + "self_attn.kv_a_layernorm.weight": torch.ones(KV, dtype=torch.bfloat16),
        pre + "mlp.gate.weight": torch.randn(experts, H, generator=g, device="cuda")
        .mul(0.02)
        .bfloat16()
        .cpu(),
        pre + "mlp.gate.e_score_correction_bias": torch.randn(experts, generator=g, device="cuda")
        .mul(skew)
        .cpu(),
    }
    shard: dict[str, torch.Tensor] = dict(other)
    size, n = 0, 0
    index: dict[str, str] = {}
    names = list(linears)
    total = len(names)

    def flush(last=False):
        nonlocal shard, size, n
        if not shard:
            return
        n += 1
        fname = f"model-{n:05d}.safetensors"
        save_file(shard, folder / fname, metadata={"format": "pt"})
        for k in shard:
            index[k] = fname
        shard, size = {}, 0

    for i, name in enumerate(names):
        out_f, in_f = linears[name]
        w = torch.randn(out_f, in_f, generator=g, device="cuda") * (1.0 / math.sqrt(in_f))
        q, s = fp8_blocks(w)
        shard[f"{pre}{name}.weight"] = q
        shard[f"{pre}{name}.weight_scale_inv"] = s
        size += q.numel()
        if size > 4e9 or i == total - 1:
            flush()
    # rename shards to the HF convention
    files = sorted({f for f in index.values()})
    rename = {f: f"model-{i + 1:05d}-of-{len(files):05d}.safetensors" for i, f in enumerate(files)}
    for f, r in rename.items():
        (folder / f).rename(folder / r)
    weight_map = {k: rename[f] for k, f in index.items()}
    total_size = sum((folder / f).stat().st_size for f in rename.values())
    (folder / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": total_size}, "weight_map": weight_map})
    )


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument(
        "--tokens",
        default="8192,65536,262144",
        help="calibration token counts, comma-separated (seqlen 512 windows); the projection fits the two largest, so the first run also warms up",
    )
    ap.add_argument("--experts", type=int, default=256)
    ap.add_argument("--skew", type=float, default=0.05, help="std of e_score_correction_bias (routing skew)")
    ap.add_argument("--few-tokens-threshold", type=int, default=16)
    ap.add_argument("--json", default=None)
    ap.add_argument("--keep", default=None, help="build the checkpoint here and keep it")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--profile",
        default=None,
        help="after the timed runs, profile one more run of the smallest token count and write "
        "torch.profiler's tables (operators by CUDA time and by their own CPU time) to this file",
    )
    ap.add_argument(
        "--per-expert",
        action="store_true",
        help="the routed output expert by expert even where grouped GEMMs run (the formulation "
        "they replaced, for a same-machine comparison)",
    )
    gpu_budget.add_argument(ap)
    args = ap.parse_args()
    import forge
    import forge.calibrate as cal

    if args.per_expert:
        cal._RoutedExperts.grouped = lambda self, device, dtype: False

    if not torch.cuda.is_available():
        print("no GPU: this bench needs CUDA")
        return 2
    gpu_budget.hold_beyond(args.gpu_gib)
    root = Path(args.keep) if args.keep else Path(tempfile.mkdtemp(prefix="forge-layer-"))
    src, out = root / "src", root / "out"
    t0 = time.perf_counter()
    if not (src / "model.safetensors.index.json").exists():
        build_checkpoint(src, args.experts, args.seed, args.skew)
    write_row(args.json, {"row": "build checkpoint", "seconds": time.perf_counter() - t0,
                          "bytes": sum(f.stat().st_size for f in src.iterdir())})  # fmt: skip
    seqlen = 512
    runs = []

    def calibrate_once(tokens: int):
        nsamples = max(1, tokens // seqlen)
        ids = torch.randint(0, 4096, (nsamples * seqlen * 2,), generator=torch.Generator().manual_seed(1))
        calib = root / "calib.pt"
        torch.save(ids, calib)
        return forge.quantize_model(
            src, out, method="gptq", calib=calib, nsamples=nsamples, seqlen=seqlen, group_size=128,
            device="cuda", overwrite=True, progress=False, few_tokens_threshold=args.few_tokens_threshold,
            chunk_tokens=8192,
        )  # fmt: skip

    counts = [int(t) for t in str(args.tokens).split(",")]
    for tokens in counts:
        nsamples = max(1, tokens // seqlen)
        torch.cuda.reset_peak_memory_stats()
        t0 = time.perf_counter()
        try:
            rep = calibrate_once(tokens)
        except Exception as exc:  # keep what was measured
            write_row(args.json, {"row": "gptq layer", "tokens": nsamples * seqlen, "error": repr(exc)})
            raise
        wall = time.perf_counter() - t0
        report = json.loads((out / "forge" / "report.json").read_text())
        phases = report["phase_seconds"]
        peak = torch.cuda.max_memory_allocated() / 2**30
        layer_s = report["layer_seconds"].get("0")
        # The headline figure: the layer's GPTQ-side work, i.e. all but its forward pass.
        gptq_side = layer_s - phases.get("forward", 0.0) if layer_s else None
        row = {"row": "gptq layer", "device": torch.cuda.get_device_name(),
               "routed output": "per expert" if args.per_expert else "forge", "gpu_budget_gib": args.gpu_gib, "tokens": nsamples * seqlen, "wall_s": wall,
               "layer_s": layer_s, "gptq_side_s": gptq_side, "phases": phases, "peak_gpu_gib": peak,
               "quantized": rep.quantized}  # fmt: skip
        write_row(args.json, row)
        runs.append(row)
        print(f"\n{nsamples * seqlen} tokens: {'phase':32s} {'seconds':>9s}")
        for k, v in sorted(phases.items(), key=lambda kv: -kv[1]):
            print(f"{'':14s}{k:32s} {v:9.2f}")
        outside = (
            row["layer_s"] - sum(v for k, v in phases.items() if k != "total") if row["layer_s"] else 0.0
        )
        print(f"peak GPU memory {peak:.1f} GiB; layer time outside the phases {outside:.2f} s")
        if gptq_side is not None:
            print(
                f"GPTQ side (layer {layer_s:.1f} s - forward {phases.get('forward', 0.0):.1f} s): {gptq_side:.1f} s"
            )
    if args.profile:
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            calibrate_once(min(counts))
        ka = prof.key_averages()
        table = "\n\n".join(
            f"sorted by {key}\n" + ka.table(sort_by=key, row_limit=45, max_name_column_width=70)
            for key in ("cuda_time_total", "self_cpu_time_total")
        )
        Path(args.profile).write_text(table)
        print(table, flush=True)
    # Projection to 512 x 4096 calibration tokens. Upper bound: phases that scale with the
    # tokens (forward, Hessians, expert gather + forward) proportionally from the largest run,
    # the solves and I/O as they are (they depend on the weights only); proportional scaling
    # of a short run overstates, since per-launch overheads do not grow with the tokens.
    # Linear: with two or more runs, the token phases extrapolated along the line through the
    # two largest runs (never below the largest measurement), the others as measured there.
    full = 512 * 4096
    runs.sort(key=lambda r: r["tokens"])
    r2 = runs[-1]
    ratio = full / r2["tokens"]
    upper = {k: v * (ratio if k in TOKEN_PHASES else 1.0) for k, v in r2["phases"].items() if k != "total"}
    proj_phases = upper
    how = (
        f"upper bound from the {r2['tokens']}-token run: token phases x{ratio:.0f}, solves and I/O unchanged"
    )
    if len(runs) >= 2:
        r1 = runs[-2]
        dt = r2["tokens"] - r1["tokens"]
        proj_phases = {
            k: v
            + (
                max(0.0, (v - r1["phases"].get(k, 0.0)) / dt) * (full - r2["tokens"])
                if k in TOKEN_PHASES
                else 0.0
            )
            for k, v in r2["phases"].items()
            if k != "total"
        }
        how = (
            f"token phases linear through the {r1['tokens']}- and {r2['tokens']}-token runs, "
            "solves and I/O as measured"
        )
    # The one-layer model never saves a resume state (none after the last layer); a whole run
    # spends at most STATE_BUDGET of its time on them.
    from forge.calibrate import STATE_BUDGET

    def with_state_saves(phases: dict) -> dict:
        return {
            **phases,
            "save state (at most, amortized)": sum(phases.values()) * STATE_BUDGET / (1 - STATE_BUDGET),
        }

    # The upper bound carries the same allowance.
    proj_phases, upper = with_state_saves(proj_phases), with_state_saves(upper)
    per_layer = sum(proj_phases.values())
    proj = {
        "row": "projection: DeepSeek-V3 (58 MoE + 3 dense layers), 512 x 4096 tokens",
        "per_moe_layer_s": per_layer,
        "phases_s": proj_phases,
        "whole_model_h": per_layer * 61 / 3600,
        "upper_bound_per_moe_layer_s": sum(upper.values()),
        "how": how,
    }
    write_row(args.json, proj)
    print(f"projection: {per_layer:.0f} s per MoE layer, {proj['whole_model_h']:.2f} h for 61 layers ({how})")
    if not args.keep:
        shutil.rmtree(root, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
