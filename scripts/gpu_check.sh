#!/usr/bin/env bash
# The GPU check (scripts/gpu_check.py): the decode executor's CUDA-graph decode in bf16 against the eager step and
# transformers, the kernel tests on CUDA (bf16 and a >2**31-element block pool included), `python -m workbench.kernels.bench`,
# the engine benchmarks (decode with both backends, prefill, against transformers), and beyond one device (TP over
# NCCL at size 1 against the plain engine; a disaggregated pair sharing the GPU), speculative decoding's verify
# step (oracle proposer, k 4, bf16: tokens with and without, the speed-up), in under 5 minutes, with
# JSON and logs written to OUTDIR.
#   usage: scripts/gpu_check.sh OUTDIR          (DRY_RUN=1: on the CPU, the decode, dist and speculative checks on a tiny model)
# Needs only the preinstalled torch, triton and transformers (pytest if present; built-in checks otherwise).
# Nothing is installed: the repository root goes on PYTHONPATH. PYTHON overrides the interpreter (default python3).
set -euo pipefail

if [[ $# -ne 1 ]]; then
    echo "usage: $0 OUTDIR" >&2
    exit 2
fi
OUTDIR=$1
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
mkdir -p "$OUTDIR"
OUTDIR=$(cd "$OUTDIR" && pwd)
PY=${PYTHON:-python3}

cd "$ROOT"
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
export TRITON_INTERPRET=0  # tests/conftest.py defaults it to 1; here the kernels are compiled for the GPU
export HF_HUB_OFFLINE=1

if [[ -n "${DRY_RUN:-}" ]]; then
    export TRITON_INTERPRET=1
    exec "$PY" scripts/gpu_check.py "$OUTDIR" --dry-run
fi
# 285 s of work inside the script's own budget; the outer timeout is a last resort below 5 minutes
exec timeout --kill-after=3 295 "$PY" scripts/gpu_check.py "$OUTDIR" --budget-s 285
