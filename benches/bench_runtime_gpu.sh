#!/usr/bin/env bash
# Decode speed of a forged model on a GPU. MODEL=dense (default): a random Llama-style 1.2B model;
# MODEL=moe: a random DeepSeek-V3-architecture MoE at reduced size (MLA, sigmoid group-limited
# routing, shared expert; hidden 2048, 8 layers with 1 dense, 64 routed experts of 1408, top-6).
# Built in bf16, forged to AWQ g128 (RTN on the GPU), then bench_runtime.py: W4A16 through
# forge.load_quantized vs bf16, batch 1 and 16, CUDA graphs where they capture, then eager (dense
# also: the per-call AwqLinear vs nn.Linear rows; moe also: one AwqExperts layer, grouped GEMV vs
# per-expert loop and its tensor-core form, T = 1..16384), then bench_prefill.py (one forward of
# 512-8192 tokens, the runtime's dense route on and off, MoE: the experts' grouped tensor-core
# form against their loop, against bf16). Rows are appended to
# $OUT/results-<gpu>-runtime[-moe].json as measured; a mode that fails is recorded with its error.
# Needs the wheel installed (PYTHONPATH) as in gpu_suite.sh.
set -euo pipefail
OUT=${OUT:-./gpu-out}
MODEL=${MODEL:-dense}
mkdir -p "$OUT"
work=$(mktemp -d)
python3 - "$work" "$MODEL" <<'PY'
import sys, torch
from transformers import AutoModelForCausalLM, DeepseekV3Config, LlamaConfig
if sys.argv[2] == "moe":
    cfg = DeepseekV3Config(vocab_size=32000, hidden_size=2048, intermediate_size=8192, moe_intermediate_size=1408,
                           num_hidden_layers=8, first_k_dense_replace=1, n_routed_experts=64, num_experts_per_tok=6,
                           n_shared_experts=1, n_group=8, topk_group=4, num_attention_heads=16, num_key_value_heads=16,
                           q_lora_rank=768, kv_lora_rank=512, qk_rope_head_dim=64, qk_nope_head_dim=128,
                           v_head_dim=128, max_position_embeddings=2048, num_nextn_predict_layers=0)
else:
    cfg = LlamaConfig(vocab_size=32000, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
                      num_attention_heads=16, num_key_value_heads=4, max_position_embeddings=2048)
torch.manual_seed(0)
with torch.device("cuda"):  # built on the GPU: the MoE model's 4B parameters initialise in seconds
    m = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
if sys.argv[2] == "moe":  # transformers leaves fused expert tensors uninitialised
    with torch.no_grad():
        for p in m.parameters():
            if p.dim() >= 2:
                p.normal_(0.0, 0.02)
m.save_pretrained(sys.argv[1] + "/bf16")
PY
python3 -c "import forge, sys; forge.quantize_model(sys.argv[1] + '/bf16', sys.argv[1] + '/awq', group_size=128, device='cuda', progress=False)" "$work"
gpu=$(python3 -c "import torch; print(torch.cuda.get_device_name().split()[1].lower())")
if [ "$MODEL" = moe ]; then extra=(--moe-micro); suffix=-moe; else extra=(--micro); suffix=; fi
python3 benches/bench_runtime.py "$work/awq" "$work/bf16" --device cuda --batch 1 16 "${extra[@]}" --eager-too \
  --json "$OUT/results-$gpu-runtime$suffix.json" "$@"
# prefill / evaluation shapes: one forward of batch x seqlen tokens, the dense route on and off
python3 benches/bench_prefill.py "$work/awq" "$work/bf16" --json "$OUT/results-$gpu-prefill$suffix.json"
rm -rf "$work"
