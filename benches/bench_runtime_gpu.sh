#!/usr/bin/env bash
# Decode speed of a forged dense model on a GPU: builds a random Llama-style 1.2B model in bf16,
# forges it (AWQ g128, RTN on the GPU), and runs bench_runtime.py (W4A16 through
# forge.load_quantized vs bf16, batch 1 and 16, CUDA graphs for both, then eager; plus the
# per-call AwqLinear vs nn.Linear rows). Needs the wheel installed (PYTHONPATH) as in
# gpu_suite.sh.  OUT: where results-<gpu>-runtime.json goes (rows appended as measured).
set -euo pipefail
OUT=${OUT:-./gpu-out}
mkdir -p "$OUT"
work=$(mktemp -d)
python3 - "$work" <<'PY'
import sys, torch
from transformers import AutoModelForCausalLM, LlamaConfig
cfg = LlamaConfig(vocab_size=32000, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
                  num_attention_heads=16, num_key_value_heads=4, max_position_embeddings=2048)
torch.manual_seed(0)
AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16).save_pretrained(sys.argv[1] + "/bf16")
PY
python3 -c "import forge, sys; forge.quantize_model(sys.argv[1] + '/bf16', sys.argv[1] + '/awq', group_size=128, device='cuda', progress=False)" "$work"
gpu=$(python3 -c "import torch; print(torch.cuda.get_device_name().split()[1].lower())")
python3 benches/bench_runtime.py "$work/awq" "$work/bf16" --device cuda --batch 1 16 --micro --eager-too \
  --json "$OUT/results-$gpu-runtime.json" "$@"
rm -rf "$work"
