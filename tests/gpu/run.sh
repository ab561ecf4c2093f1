#!/usr/bin/env bash
# GPU checks for a lent device (one H200): the `gpu` tests and the snapshot bandwidth figures.
# Usage: bash tests/gpu/run.sh   (from the repository root; writes results under ${OUT:-gpu-results})
# Budget: well under 8 minutes. Needs a CUDA build of torch and cuda-python on that machine.
set -euo pipefail
cd "$(dirname "$0")/../.."
out="${OUT:-gpu-results}"
mkdir -p "$out"
py="${PYTHON:-python3}"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv | tee "$out/gpu.csv"
"$py" -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda)" | tee "$out/torch.txt"
# The cuda-checkpoint toggle runs on a process holding 4 GiB; -s keeps its timing line.
TIMESLICE_GPU_CHECKPOINT_GIB=4 "$py" -m pytest -q -s -m gpu tests/test_cuda_checkpoint.py \
  tests/test_vllm_backend.py 2>&1 | tee "$out/pytest-gpu.txt"
for gib in 1 4 16; do
  timeout 150 "$py" bench/snapshot.py --device cuda --gib "$gib" --rounds 3 \
    --json "$out/snapshot-cuda-${gib}gib.json" | tee -a "$out/snapshot.txt"
done
