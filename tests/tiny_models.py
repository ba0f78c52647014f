"""Tiny random checkpoints for the quantization-run tests, and an independent AWQ unpacker.

Everything here is plain PyTorch / transformers / safetensors: nothing from `forge`, so the tests
check forge against code that shares none of its logic.
"""

from __future__ import annotations

import functools
import json
import math
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

AWQ_ORDER = [0, 2, 4, 6, 1, 3, 5, 7]
FP8_MAX = 448.0


# What the small configs share: two small layers, one KV head.
SMALL = dict(
    vocab_size=256,
    hidden_size=64,
    num_hidden_layers=2,
    num_attention_heads=2,
    num_key_value_heads=1,
    max_position_embeddings=128,
)


# What the DeepSeek generations share: MLA dimensions, a dense first layer, routed experts
# beside one shared expert.
DEEPSEEK_SMALL = dict(
    **{**SMALL, "num_key_value_heads": 2},
    intermediate_size=128,
    moe_intermediate_size=32,
    first_k_dense_replace=1,
    n_routed_experts=8,
    n_shared_experts=1,
    num_experts_per_tok=2,
    kv_lora_rank=32,
    qk_rope_head_dim=16,
    qk_nope_head_dim=16,
    v_head_dim=32,
)

# What the Qwen MoE generations share: a dense first layer, 8 routed experts, top-2.
QWEN_MOE_SMALL = dict(
    **SMALL,
    intermediate_size=128,
    moe_intermediate_size=32,
    num_experts=8,
    num_experts_per_tok=2,
    mlp_only_layers=[0],
)


def deepseek_config(num_layers: int = 3):
    from transformers import DeepseekV3Config

    return DeepseekV3Config(
        **{**DEEPSEEK_SMALL, "num_hidden_layers": num_layers},
        n_group=2,
        topk_group=1,
        q_lora_rank=32,
        num_nextn_predict_layers=1,
    )


def qwen3_moe_config():
    from transformers import Qwen3MoeConfig

    return Qwen3MoeConfig(**QWEN_MOE_SMALL, head_dim=32)


def mixtral_config():
    from transformers import MixtralConfig

    return MixtralConfig(**SMALL, intermediate_size=64, num_local_experts=4, num_experts_per_tok=2)


def qwen2_moe_config():
    """Qwen2-MoE: a shared expert beside the routed ones, weighted by its own sigmoid gate."""
    from transformers import Qwen2MoeConfig

    return Qwen2MoeConfig(**QWEN_MOE_SMALL, shared_expert_intermediate_size=64)


def olmoe_config():
    from transformers import OlmoeConfig

    return OlmoeConfig(**SMALL, intermediate_size=32, num_experts=8, num_experts_per_tok=2, eos_token_id=2)


def deepseek_v2_config():
    """DeepSeek-V2(-Lite): MLA without a query down-projection (q_proj), softmax routing."""
    from transformers import DeepseekV2Config

    return DeepseekV2Config(
        **DEEPSEEK_SMALL,
        q_lora_rank=None,
        n_group=1,
        topk_group=1,
        topk_method="greedy",
    )


def dense_config(kind: str):
    """Llama, Qwen2 or Mistral: dense models (the last two through the generic family)."""
    from transformers import LlamaConfig, MistralConfig, Qwen2Config

    cls = {"llama": LlamaConfig, "qwen2": Qwen2Config, "mistral": MistralConfig}[kind]
    return cls(**SMALL, intermediate_size=128)


CONFIGS = {
    "deepseek": deepseek_config,
    "qwen3_moe": qwen3_moe_config,
    "mixtral": mixtral_config,
    "llama": functools.partial(dense_config, "llama"),
    "qwen2_moe": qwen2_moe_config,
    "olmoe": olmoe_config,
    "deepseek_v2": deepseek_v2_config,
    "qwen2": functools.partial(dense_config, "qwen2"),
    "mistral": functools.partial(dense_config, "mistral"),
}


def random_model(cfg):
    """A bf16 transformers model of `cfg` with matrices drawn from N(0, 0.05²) (scaled up so
    quantization error is visible against the weights' range) and router biases from
    N(0, 0.01²), from torch's current seed."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_config(cfg).to(torch.bfloat16)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 2:
                p.normal_(0.0, 0.05)
            elif "e_score_correction_bias" in name:
                p.normal_(0.0, 0.01)
    return model


def make_model(kind: str, out: Path, seed: int = 0, shard: str = "60KB") -> Path:
    """Saves a random tiny model of `kind` in several bf16 shards (plus tokenizer-like side files).

    Random init is scaled up so quantization error is visible against the weights' range, and the
    DeepSeek variant gets a hand-made MTP layer (index num_hidden_layers) like the released weights.
    """

    torch.manual_seed(seed)
    cfg = CONFIGS[kind]()
    model = random_model(cfg)
    model.save_pretrained(out, max_shard_size=shard)
    (out / "tokenizer.json").write_text('{"version": "1.0", "model": {"type": "WordLevel"}}\n')
    (out / "tokenizer_config.json").write_text('{"chat_template": "{{ messages }}"}\n')
    (out / "modeling_custom.py").write_text("# custom code file, copied verbatim\n")
    if kind == "deepseek":
        add_mtp_layer(out, cfg)
    return out


def read_tensors(folder: Path) -> dict[str, torch.Tensor]:
    out = {}
    for f in sorted(folder.glob("*.safetensors")):
        with safe_open(f, "pt") as h:
            for k in h.keys():
                out[k] = h.get_tensor(k)
    return out


def write_sharded(tensors: dict[str, torch.Tensor], folder: Path, n_shards: int = 3) -> None:
    """Writes `tensors` into `n_shards` files plus the index, in name order."""
    folder.mkdir(parents=True, exist_ok=True)
    for f in folder.glob("*.safetensors"):
        f.unlink()
    names = sorted(tensors)
    per = math.ceil(len(names) / n_shards)
    weight_map, total = {}, 0
    for i in range(n_shards):
        chunk = names[i * per : (i + 1) * per]
        if not chunk:
            continue
        fname = f"model-{i + 1:05d}-of-{n_shards:05d}.safetensors"
        save_file({k: tensors[k].contiguous() for k in chunk}, folder / fname, metadata={"format": "pt"})
        for k in chunk:
            weight_map[k] = fname
            total += tensors[k].numel() * tensors[k].element_size()
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))


def add_mtp_layer(folder: Path, cfg) -> None:
    """Adds DeepSeek's MTP layer (index num_hidden_layers) by hand, as in the released weights."""
    t = read_tensors(folder)
    n = cfg.num_hidden_layers
    last = f"model.layers.{n - 1}."
    g = torch.Generator().manual_seed(1234)
    mtp = {}
    for k, v in t.items():
        if k.startswith(last):
            mtp[k.replace(last, f"model.layers.{n}.")] = v.clone()
    h, vocab = cfg.hidden_size, cfg.vocab_size
    rnd = lambda *s: (torch.randn(*s, generator=g) * 0.05).to(torch.bfloat16)  # noqa: E731
    mtp[f"model.layers.{n}.enorm.weight"] = torch.ones(h, dtype=torch.bfloat16)
    mtp[f"model.layers.{n}.hnorm.weight"] = torch.ones(h, dtype=torch.bfloat16)
    mtp[f"model.layers.{n}.eh_proj.weight"] = rnd(h, 2 * h)
    mtp[f"model.layers.{n}.shared_head.norm.weight"] = torch.ones(h, dtype=torch.bfloat16)
    mtp[f"model.layers.{n}.shared_head.head.weight"] = rnd(vocab, h)
    mtp[f"model.layers.{n}.embed_tokens.weight"] = rnd(vocab, h)
    t.update(mtp)
    write_sharded(t, folder, n_shards=4)


def is_fp8_candidate(name: str, shape) -> bool:
    """Which weights DeepSeek ships in FP8: every 2-D linear inside the layers except the router."""
    return (
        name.endswith(".weight")
        and len(shape) == 2
        and ".layers." in name
        and "norm" not in name
        and "embed" not in name
        and not name.endswith("mlp.gate.weight")
    )


def fp8_block_quantize(w: torch.Tensor, block: int = 128) -> tuple[torch.Tensor, torch.Tensor]:
    n, k = w.shape
    nb, kb = math.ceil(n / block), math.ceil(k / block)
    w = w.float()
    pad = torch.zeros(nb * block, kb * block)
    pad[:n, :k] = w
    blocks = pad.view(nb, block, kb, block)
    amax = blocks.abs().amax(dim=(1, 3)).clamp(min=1e-12)
    scale = amax / FP8_MAX
    q = (blocks / scale[:, None, :, None]).view(nb * block, kb * block)[:n, :k]
    return q.to(torch.float8_e4m3fn), scale.float()


def fp8_block_dequantize(q: torch.Tensor, scale_inv: torch.Tensor, block: int = 128) -> torch.Tensor:
    n, k = q.shape
    s = scale_inv.repeat_interleave(block, 0)[:n].repeat_interleave(block, 1)[:, :k]
    return q.float() * s


def make_fp8_variant(src: Path, dst: Path) -> Path:
    """DeepSeek-style FP8 copy of `src`: F8_E4M3 weights + fp32 weight_scale_inv [ceil(N/128), ceil(K/128)]."""
    dst.mkdir(parents=True, exist_ok=True)
    t = read_tensors(src)
    out = {}
    for k, v in t.items():
        if is_fp8_candidate(k, v.shape):
            q, s = fp8_block_quantize(v)
            out[k] = q
            out[k + "_scale_inv"] = s
        else:
            out[k] = v
    write_sharded(out, dst, n_shards=3)
    cfg = json.loads((src / "config.json").read_text())
    cfg["quantization_config"] = {
        "quant_method": "fp8",
        "fmt": "e4m3",
        "activation_scheme": "dynamic",
        "weight_block_size": [128, 128],
    }
    (dst / "config.json").write_text(json.dumps(cfg, indent=2))
    for f in src.iterdir():
        if f.suffix not in (".safetensors",) and f.name not in (
            "config.json",
            "model.safetensors.index.json",
        ):
            (dst / f.name).write_bytes(f.read_bytes())
    return dst


def source_weights_f32(src: Path) -> dict[str, torch.Tensor]:
    """The source's tensors as the quantizer sees them: FP8 dequantized with its block scale."""
    t = read_tensors(src)
    out = {}
    for k, v in t.items():
        if k.endswith("_scale_inv"):
            continue
        if v.dtype == torch.float8_e4m3fn:
            out[k] = fp8_block_dequantize(v, t[k + "_scale_inv"])
        else:
            out[k] = v
    return out


def awq_unpack(qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor, group_size: int):
    """Independent AWQ "gemm" unpacker: returns (W [N, K] f32, codes [K, N], zeros [K/G, N], scales)."""
    k, n8 = qweight.shape
    n = n8 * 8

    def unpack(p: torch.Tensor) -> torch.Tensor:
        rows = p.shape[0]
        u = p.to(torch.int64) & 0xFFFFFFFF
        out = torch.empty(rows, n, dtype=torch.int64)
        for i, col in enumerate(AWQ_ORDER):
            out[:, col::8] = (u >> (4 * i)) & 0xF
        return out

    codes = unpack(qweight)
    zeros = unpack(qzeros)
    g_of = torch.arange(k) // group_size
    s = scales.float()
    w_kn = (codes - zeros[g_of]).float() * s[g_of]
    return w_kn.t().contiguous(), codes, zeros, s


def dequantized_state_dict(out_dir: Path, group_size: int) -> dict[str, torch.Tensor]:
    """Every tensor of an AWQ folder with the quantized linears unpacked back to `<module>.weight`."""
    t = read_tensors(out_dir)
    sd = {}
    for k, v in t.items():
        if k.endswith(".qweight"):
            m = k[: -len(".qweight")]
            w, *_ = awq_unpack(v, t[m + ".qzeros"], t[m + ".scales"], group_size)
            sd[m + ".weight"] = w
        elif k.endswith(".qzeros") or k.endswith(".scales"):
            continue
        else:
            sd[k] = v
    return sd


def save_hf_folder(
    sd: dict[str, torch.Tensor], config: dict, folder: Path, drop_from_layer: int | None = None
):
    """An unquantized HF folder (bf16) from a state dict, for `from_pretrained`."""
    folder.mkdir(parents=True, exist_ok=True)
    keep = {}
    for k, v in sd.items():
        if drop_from_layer is not None and ".layers." in k:
            idx = int(k.split(".layers.")[1].split(".")[0])
            if idx >= drop_from_layer:
                continue
        keep[k] = v.to(torch.bfloat16) if v.is_floating_point() and v.dtype != torch.float32 else v
        if v.dtype == torch.float32 and not k.endswith("e_score_correction_bias"):
            keep[k] = v.to(torch.bfloat16)
    cfg = dict(config)
    cfg.pop("quantization_config", None)
    (folder / "config.json").write_text(json.dumps(cfg, indent=2))
    write_sharded(keep, folder, n_shards=2)
    return folder


def logits(folder: Path, tokens: torch.Tensor) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    model.eval()
    with torch.no_grad():
        return model(tokens).logits.float()


def dir_bytes(folder: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir()) if p.is_file()}
