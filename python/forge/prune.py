"""Expert pruning: the files a pruned run ships beside its weights.

The decisions are made elsewhere, each in one place: router statistics by the layer-by-layer
forward (``forge.calibrate``), the kept experts by ``forge._native.select_experts`` (Rust; the
criteria ``reap``, ``frequency``, ``mass``, ``random``, group balance), the output layout
(compact renumbering or the remap layout's per-layer experts, router slicing, config.json) by
the Rust run's plan. This module turns the result into:

* ``forge/expert_map.pt`` and ``forge/expert_map.json``: ``expert_map[L, E]``, per MoE layer the
  compact id of each original expert, dense ``0..k-1`` in original order, ``-1`` when pruned;
* ``forge/pruning.json`` and ``forge/pruning.md``: kept / pruned per layer, the share of routed
  tokens, router probability mass and REAP saliency the kept experts carry;
* ``forge/router_stats.png``: a heat map of the statistics (layers x experts, each row sorted).
"""

from __future__ import annotations

import io
import json
from typing import Any

import torch

__all__ = ["expert_map_tensor", "kept_experts", "pruning_files", "stats_heatmap"]


def expert_map_tensor(expert_map: dict[int, list[int]]) -> tuple[list[int], torch.Tensor]:
    """The MoE layers (sorted) and ``expert_map[L, E]`` (int64) of a session's bound maps."""
    layers = sorted(expert_map)
    if not layers:
        return [], torch.zeros(0, 0, dtype=torch.int64)
    return layers, torch.tensor([expert_map[k] for k in layers], dtype=torch.int64)


def kept_experts(expert_map: dict[int, list[int]]) -> dict[int, list[int]]:
    """Per layer, the kept original expert ids in compact order (``Session.expert_map`` gives
    length-E maps: compact id, or -1 when pruned)."""
    return {int(k): [e for e, c in enumerate(m) if c >= 0] for k, m in expert_map.items()}


def _share(v: torch.Tensor, kept: torch.Tensor) -> float | None:
    total = float(v.sum())
    return float(v[kept].sum()) / total if total > 0 else None


def pruning_files(
    pruning: dict[str, Any], expert_map: dict, stats: dict, scoring: str, sizes: tuple[int, int]
) -> list[tuple[str, bytes]]:
    """The expert map and the pruning report (see the module documentation)."""
    layers, table = expert_map_tensor({int(k): list(v) for k, v in expert_map.items()})
    files: list[tuple[str, bytes]] = []
    buf = io.BytesIO()
    torch.save({"layers": torch.tensor(layers, dtype=torch.int64), "expert_map": table}, buf)
    files.append(("forge/expert_map.pt", buf.getvalue()))
    files.append(
        (
            "forge/expert_map.json",
            (
                json.dumps(
                    {
                        "layout": pruning["layout"],
                        "criterion": pruning["criterion"],
                        "num_experts": int(pruning["num_experts"]),
                        "layers": layers,
                        "expert_map": table.tolist(),
                    }
                )
                + "\n"
            ).encode(),
        )
    )
    rows = []
    for li, m in zip(layers, table, strict=True):
        kept = m >= 0
        row: dict[str, Any] = {
            "layer": li,
            "kept": int(kept.sum()),
            "pruned": int((~kept).sum()),
            "kept_experts": torch.nonzero(kept).flatten().tolist(),
            "pruned_experts": torch.nonzero(~kept).flatten().tolist(),
        }
        s = stats.get(li)
        if s is not None:
            row["tokens_retained"] = _share(s.counts, kept)
            row["mass_retained"] = _share(s.mass, kept)
            row["reap_retained"] = _share(s.reap, kept)
        rows.append(row)
    report = {
        "layout": pruning["layout"],
        "criterion": pruning["criterion"],
        "num_experts": int(pruning["num_experts"]),
        "scoring": scoring,
        "bytes_before": int(sizes[0]),
        "bytes_after": int(sizes[1]),
        "layers": rows,
    }
    files.append(("forge/pruning.json", (json.dumps(report, indent=1) + "\n").encode()))

    def pct(v: float | None) -> str:
        return "" if v is None else f"{100 * v:.1f} %"

    lines = [
        "# 4bit-forge expert pruning",
        "",
        f"Layout `{pruning['layout']}`, criterion `{pruning['criterion']}`, "
        f"{pruning['num_experts']} routed experts per layer originally; router probabilities: {scoring}.",
        f"Checkpoint: {sizes[0] / 2**20:,.1f} MiB before, {sizes[1] / 2**20:,.1f} MiB after "
        f"({100 * sizes[1] / max(sizes[0], 1):.1f} %).",
        "",
        "| layer | kept | pruned | routed tokens kept | probability mass kept | REAP saliency kept | pruned experts |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['layer']} | {r['kept']} | {r['pruned']} | {pct(r.get('tokens_retained'))} | "
            f"{pct(r.get('mass_retained'))} | {pct(r.get('reap_retained'))} | "
            f"{', '.join(map(str, r['pruned_experts']))} |"
        )
    files.append(("forge/pruning.md", ("\n".join(lines) + "\n").encode()))
    return files


def stats_heatmap(stats: dict, kept: dict[int, list[int]] | None = None) -> bytes | None:
    """PNG: per MoE layer, each expert's share of the layer's routed tokens, experts sorted by
    it (left: most used); pruned experts hatched when ``kept`` is given. ``None`` without
    matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    layers = sorted(stats)
    if not layers:
        return None
    share = []
    pruned_at = []
    for li in layers:
        c = stats[li].counts.double()
        v = c / c.sum().clamp(min=1)
        order = torch.argsort(v, descending=True, stable=True)
        share.append(v[order])
        if kept and li in kept:
            k = set(kept[li])
            pruned_at.append([j for j, e in enumerate(order.tolist()) if e not in k])
        else:
            pruned_at.append([])
    img = torch.stack(share).numpy()
    fig, ax = plt.subplots(figsize=(min(14, 3 + 0.05 * img.shape[1]), 1.5 + 0.25 * len(layers)))
    im = ax.imshow(img, aspect="auto", cmap="viridis", interpolation="nearest")
    for row, cols in enumerate(pruned_at):
        for col in cols:
            ax.add_patch(plt.Rectangle((col - 0.5, row - 0.5), 1, 1, fill=False, hatch="xx", lw=0))
    ax.set_yticks(range(len(layers)), [str(li) for li in layers])
    ax.set_ylabel("layer")
    ax.set_xlabel("experts, sorted by routed-token share" + (" (hatched: pruned)" if kept else ""))
    fig.colorbar(im, ax=ax, label="share of routed tokens")
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=100)
    plt.close(fig)
    return buf.getvalue()
