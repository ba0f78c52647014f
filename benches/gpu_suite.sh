#!/usr/bin/env bash
# Every GPU check in one go, for a GPU machine with torch/transformers/pytest but no Rust:
# installs the wheel and the prebuilt Rust GPU test binary from WHEEL_DIR (default .whl),
# then runs the Rust GPU tests, `pytest -m cuda` over the whole suite (on sm_90 the grouped MoE
# tests again with FORGE_GEMM_WG=0, for the mma.sync form, and the W4A16 GEMM test with the
# 256-token wgmma tile forced) and the GPU benches,
# keeping every log under OUT (default ./gpu-out); GPU_GIB=79.1 runs the bench within an 80 GB
# card's memory (benches/gpu_budget.py).
#   Build here:  maturin build --release -o .whl
#                cargo test -p forge-cuda --release --no-run  (copy target/release/deps/gpu-* to .whl/gpu-tests)
set -uo pipefail
WHEEL_DIR=${WHEEL_DIR:-.whl}
OUT=${OUT:-./gpu-out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/forge-site "$WHEEL_DIR"/*.whl || exit 1
export PYTHONPATH=/tmp/forge-site
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$OUT/gpu.txt"
echo "== Rust GPU tests"
if [ -x "$WHEEL_DIR/gpu-tests" ]; then
  "$WHEEL_DIR/gpu-tests" --ignored --test-threads 1 2>&1 | tail -25 | tee "$OUT/rust_gpu.log"
fi
echo "== pytest -m cuda"
python3 -m pytest -m cuda -q -p no:cacheprovider tests 2>&1 | tail -25 | tee "$OUT/pytest_cuda.log"
# On an sm_90 GPU the grouped MoE form runs wgmma where the shape allows; FORGE_GEMM_WG=0 runs its
# mma.sync kernel (what GPUs without wgmma run) on those shapes too.
if nvidia-smi --query-gpu=compute_cap --format=csv,noheader | grep -q '^9\.0'; then
  echo "== the grouped MoE form's mma.sync kernel (FORGE_GEMM_WG=0)"
  if [ -x "$WHEEL_DIR/gpu-tests" ]; then
    FORGE_GEMM_WG=0 "$WHEEL_DIR/gpu-tests" --ignored --test-threads 1 grouped 2>&1 | tail -5 | tee "$OUT/rust_gpu_mma.log"
  fi
  FORGE_GEMM_WG=0 python3 -m pytest -m cuda -q -p no:cacheprovider tests/test_runtime_cuda.py 2>&1 | tail -5 \
    | tee "$OUT/pytest_cuda_mma.log"
  # The plain GEMM's 256-token tile on every wgmma case of the W4A16 test (the plan takes it
  # past M = 128 only where it prices lower).
  echo "== the wgmma GEMM with its 256-token tile forced (FORGE_GEMM_WG_TOKENS=256)"
  if [ -x "$WHEEL_DIR/gpu-tests" ]; then
    FORGE_GEMM_WG_TOKENS=256 "$WHEEL_DIR/gpu-tests" --ignored --test-threads 1 w4a16_gemm_matches_cpu 2>&1 | tail -5 \
      | tee "$OUT/rust_gpu_t256.log"
  fi
fi
echo "== GPTQ on one DeepSeek-V3-shaped MoE layer"
python3 benches/bench_gptq_layer.py ${GPU_GIB:+--gpu-gib "$GPU_GIB"} --json "$OUT/bench_gptq_layer.json" 2>&1 | tail -30 | tee "$OUT/bench_gptq_layer.log"
