"""Memory and read-throughput benchmark of a whole quantization run (issue 3, "Memory").

Writes a synthetic Llama-shaped bf16 checkpoint of ``--gb`` gigabytes in several safetensors
shards to a folder on disk, then, in the same run:

1. reads every shard with ``cat shard... > /dev/null`` (after dropping the page cache when
   running as root, otherwise warm and said so) -> the disk/page-cache read throughput;
2. quantizes it in a child process (``python -m forge quantize``, the ``forge-rs`` CLI code)
   with the same cache state, measuring the child's peak RSS (VmHWM, polled)
   and wall time.

It prints the peak RSS against the size of the largest decoder layer (the bound the design
promises: memory bounded by one layer, not by the checkpoint), and the quantization read
throughput against ``cat``'s. The child's baseline RSS (Python + torch + forge imported,
nothing run) is measured separately and reported, since it is a fixed cost unrelated to the
model size.

Run:  python benches/bench_memory.py [--gb 2] [--json out.json] [--keep DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import torch
from tqdm.auto import tqdm

LINEARS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj")
MLP = ("mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")


def layer_tensors(i: int, hidden: int, inter: int, kv: int, gen: torch.Generator) -> dict[str, torch.Tensor]:
    """One Llama decoder layer, bf16, weights ~ N(0, 1/hidden) (random but realistic scale)."""
    p = f"model.layers.{i}."
    shapes = {
        "self_attn.q_proj": (hidden, hidden),
        "self_attn.k_proj": (kv, hidden),
        "self_attn.v_proj": (kv, hidden),
        "self_attn.o_proj": (hidden, hidden),
        "mlp.gate_proj": (inter, hidden),
        "mlp.up_proj": (inter, hidden),
        "mlp.down_proj": (hidden, inter),
    }
    out = {}
    for name, shape in shapes.items():
        w = torch.empty(shape, dtype=torch.bfloat16)
        w.normal_(0.0, shape[1] ** -0.5, generator=gen)
        out[p + name + ".weight"] = w
    out[p + "input_layernorm.weight"] = torch.ones(hidden, dtype=torch.bfloat16)
    out[p + "post_attention_layernorm.weight"] = torch.ones(hidden, dtype=torch.bfloat16)
    return out


def nbytes(tensors: dict[str, torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors.values())


def write_checkpoint(root: Path, args: argparse.Namespace) -> dict:
    """Writes config.json + shards (``layers_per_shard`` decoder layers each) + index."""
    from safetensors.torch import save_file

    h, inter, vocab = args.hidden, args.intermediate, args.vocab
    kv = h // 4  # GQA, 4 query heads per KV head
    layer_bytes = 2 * (2 * h * h + 2 * kv * h + 3 * inter * h + 2 * h)
    emb_bytes = 2 * vocab * h
    n_layers = max(1, round((args.gb * 1e9 - 2 * emb_bytes) / layer_bytes))
    gen = torch.Generator().manual_seed(0)
    weight_map: dict[str, str] = {}
    files: list[Path] = []
    # shard 1: embeddings; then layers; the last shard: norm + lm_head
    groups: list[list[int | str]] = [["embed"]]
    for i in range(0, n_layers, args.layers_per_shard):
        groups.append(list(range(i, min(n_layers, i + args.layers_per_shard))))
    groups.append(["head"])
    total = 0
    largest_layer = 0
    bar = tqdm(
        total=2 * emb_bytes + n_layers * layer_bytes, desc="write checkpoint", unit="B", unit_scale=True
    )
    for s, group in enumerate(groups):
        tensors: dict[str, torch.Tensor] = {}
        for item in group:
            if item == "embed":
                t = torch.empty(vocab, h, dtype=torch.bfloat16).normal_(0.0, 0.02, generator=gen)
                tensors["model.embed_tokens.weight"] = t
            elif item == "head":
                tensors["model.norm.weight"] = torch.ones(h, dtype=torch.bfloat16)
                t = torch.empty(vocab, h, dtype=torch.bfloat16).normal_(0.0, h**-0.5, generator=gen)
                tensors["lm_head.weight"] = t
            else:
                layer = layer_tensors(int(item), h, inter, kv, gen)
                largest_layer = max(largest_layer, nbytes(layer))
                tensors.update(layer)
        file = f"model-{s + 1:05d}-of-{len(groups):05d}.safetensors"
        save_file(tensors, str(root / file), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(tensors, file))
        files.append(root / file)
        total += nbytes(tensors)
        bar.update(nbytes(tensors))
        del tensors
    bar.close()
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (root / "model.safetensors.index.json").write_text(json.dumps(index, indent=1))
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": h,
        "intermediate_size": inter,
        "num_hidden_layers": n_layers,
        "num_attention_heads": h // 128,
        "num_key_value_heads": kv // 128,
        "head_dim": 128,
        "vocab_size": vocab,
        "rms_norm_eps": 1e-5,
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
    }
    (root / "config.json").write_text(json.dumps(config, indent=1))
    return {
        "layers": n_layers,
        "hidden": h,
        "intermediate": inter,
        "vocab": vocab,
        "shards": len(files),
        "checkpoint_bytes": sum(f.stat().st_size for f in files),
        "largest_layer_bytes": largest_layer,
        "embedding_bytes": emb_bytes,
        "files": [str(f) for f in files],
    }


def cached_kib() -> int:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("Cached:"):
            return int(line.split()[1])
    return -1


def drop_caches() -> bool:
    """Drops the page cache (root only); True when it did (the Cached figure fell)."""
    before = cached_kib()
    try:
        os.sync()
        Path("/proc/sys/vm/drop_caches").write_text("3\n")
    except OSError:
        return False
    return cached_kib() < before


def _status(pid: int | str) -> dict[str, int]:
    """Memory fields of /proc/PID/status in bytes (VmHWM, VmRSS, RssAnon, RssFile, ...)."""
    out = {}
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            key, _, rest = line.partition(":")
            if key.startswith(("Vm", "Rss")) and rest.strip().endswith("kB"):
                out[key] = int(rest.split()[0]) * 1024
    except (OSError, ValueError):
        pass
    return out


def run_child(cmd: list[str], poll_s: float = 0.02) -> tuple[float, dict[str, int], str]:
    """Runs ``cmd``; returns (wall seconds, peak memory figures in bytes, stdout).

    ``hwm`` is the child's VmHWM (peak resident set, including file pages it has mmapped),
    ``anon`` the largest RssAnon seen (heap and other private memory: what cannot be paged
    back to the checkpoint files), polled every ``poll_s``. ``wait4``'s ``ru_maxrss`` is NOT
    used: Linux carries the parent's high-water mark over fork/exec into it.
    """
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=None, text=True)
    chunks: list[str] = []
    reader = threading.Thread(target=lambda: chunks.append(proc.stdout.read()), daemon=True)
    reader.start()
    peak = {"hwm": 0, "anon": 0, "file": 0}
    while proc.poll() is None:
        st = _status(proc.pid)
        peak["hwm"] = max(peak["hwm"], st.get("VmHWM", 0))
        peak["anon"] = max(peak["anon"], st.get("RssAnon", 0))
        peak["file"] = max(peak["file"], st.get("RssFile", 0))
        time.sleep(poll_s)
    wall = time.perf_counter() - t0
    reader.join()
    if proc.returncode != 0:
        raise SystemExit(f"error: {' '.join(cmd)} exited with {proc.returncode}")
    return wall, peak, "".join(chunks)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gb", type=float, default=2.0, help="checkpoint size in GB (default 2; issue: 4-8)")
    ap.add_argument("--hidden", type=int, default=4096)
    ap.add_argument("--intermediate", type=int, default=11008)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--layers-per-shard", type=int, default=2)
    ap.add_argument("--group-size", type=int, default=128)
    ap.add_argument("--grid", choices=("range", "mse"), default="range")
    ap.add_argument("--threads", type=int, default=None, help="threads for the quantizer (default: all)")
    ap.add_argument(
        "--dir", default=None, help="parent folder for the checkpoint (default: system temp, on disk)"
    )
    ap.add_argument("--warm", action="store_true", help="do not drop the page cache (measure from RAM)")
    ap.add_argument("--keep", action="store_true", help="keep the generated checkpoint and output")
    ap.add_argument("--json", default=None, help="write the results as JSON to this file")
    args = ap.parse_args()

    work = Path(tempfile.mkdtemp(prefix="forge-bench-mem-", dir=args.dir))
    src, dst = work / "model", work / "awq"
    src.mkdir()
    try:
        t0 = time.perf_counter()
        ckpt = write_checkpoint(src, args)
        gen_s = time.perf_counter() - t0
        gb = ckpt["checkpoint_bytes"] / 1e9
        print(
            f"checkpoint: {ckpt['layers']} layers x {ckpt['largest_layer_bytes'] / 1e9:.3f} GB, "
            f"{ckpt['shards']} shards, {gb:.2f} GB bf16 (written in {gen_s:.1f} s) in {src}"
        )

        # 1. cat
        cold = False if args.warm else drop_caches()
        t0 = time.perf_counter()
        subprocess.run(["sh", "-c", 'cat "$@" > /dev/null', "cat", *ckpt["files"]], check=True)
        cat_s = time.perf_counter() - t0
        if cold:
            cache_state = "cold (page cache dropped)"
        elif args.warm:
            cache_state = "warm (--warm)"
        else:
            cache_state = "warm (page cache could not be dropped: not root)"
        print(f"cat:      {cat_s:6.2f} s  {gb / cat_s:6.2f} GB/s  [{cache_state}]")

        # 2. baseline RSS of the child: interpreter + torch + forge, nothing run
        probe = "import forge, forge.api, pathlib; print(pathlib.Path('/proc/self/status').read_text())"
        _, _, status = run_child([sys.executable, "-c", probe])
        fields = {
            ln.split(":")[0]: int(ln.split()[1]) * 1024 for ln in status.splitlines() if ln.endswith("kB")
        }
        base_rss, base_anon = fields["VmHWM"], fields["RssAnon"]

        # 3. quantize in a child, same cache state
        if cold:
            drop_caches()
        cmd = [
            sys.executable,
            "-m",
            "forge",
            "quantize",
            str(src),
            str(dst),
            "--group-size",
            str(args.group_size),
        ]
        cmd += ["--grid", args.grid, "--overwrite", "--json"]
        if args.threads:
            cmd += ["--threads", str(args.threads)]
        q_wall, peak, out = run_child(cmd)
        peak_rss, peak_anon = peak["hwm"], peak["anon"]
        report = {}
        text = out[out.find("{") :] if "{" in out else ""
        try:
            report = json.loads(text)
        except ValueError:
            print("note: no JSON report from the child; using its wall time", file=sys.stderr)
        run_s = float(report.get("seconds", q_wall))
        out_bytes = sum(f.stat().st_size for f in dst.glob("*.safetensors"))
    finally:
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)

    layer = ckpt["largest_layer_bytes"]
    result = {
        "machine": {
            "cpus": os.cpu_count(),
            "platform": platform.platform(),
            "python": platform.python_version(),
        },
        "checkpoint": {k: v for k, v in ckpt.items() if k != "files"},
        "cache": cache_state,
        "cat_seconds": cat_s,
        "cat_gb_per_s": gb / cat_s,
        "quantize_wall_seconds": q_wall,
        "quantize_run_seconds": run_s,
        "quantize_gb_per_s": gb / run_s,
        "throughput_ratio_vs_cat": (gb / run_s) / (gb / cat_s),
        "peak_rss_bytes": peak_rss,
        "peak_anon_rss_bytes": peak_anon,
        "peak_file_rss_bytes": peak["file"],
        "baseline_rss_bytes": base_rss,
        "baseline_anon_rss_bytes": base_anon,
        "peak_rss_over_largest_layer": peak_rss / layer,
        "net_anon_rss_over_largest_layer": (peak_anon - base_anon) / layer,
        "peak_rss_over_checkpoint": peak_rss / ckpt["checkpoint_bytes"],
        "output_bytes": out_bytes,
        "grid": args.grid,
        "group_size": args.group_size,
        "threads": args.threads,
        "report": report,
    }
    print(f"quantize: {run_s:6.2f} s  {gb / run_s:6.2f} GB/s  (child wall {q_wall:.2f} s incl. Python start)")
    print(f"          -> {out_bytes / 1e9:.2f} GB AWQ g{args.group_size} ({args.grid} grid)")
    print()
    print(f"largest decoder layer      {layer / 1e9:7.3f} GB")
    print(f"peak RSS (VmHWM)           {peak_rss / 1e9:7.3f} GB   = {peak_rss / layer:.2f} x largest layer")
    print(f"  of which mmapped files   {peak['file'] / 1e9:7.3f} GB   (page cache the OS can reclaim)")
    print(
        f"peak anonymous RSS         {peak_anon / 1e9:7.3f} GB   = {peak_anon / layer:.2f} x largest layer"
        f"  (baseline after imports {base_anon / 1e9:.3f} GB; net {(peak_anon - base_anon) / layer:.2f} x)"
    )
    print(f"peak RSS vs whole checkpoint              {peak_rss / ckpt['checkpoint_bytes']:.2f} x")
    print(
        f"read throughput            {gb / run_s:7.2f} GB/s quantize vs {gb / cat_s:.2f} GB/s cat = "
        f"{result['throughput_ratio_vs_cat']:.3f} x  [{cache_state}]"
    )
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2))
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
