#!/usr/bin/env bash
# The kernels' GPU check: kernel tests on CUDA (bf16 and a >2**31-element block pool included), then
# `python -m kernels.bench`, in under 8 minutes, with JSON and logs written to OUTDIR.
#   usage: scripts/gpu_check.sh OUTDIR
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

# 450 s of work inside the script's own budget; the outer timeout is a last resort below 8 minutes
exec timeout --kill-after=10 470 "$PY" scripts/gpu_check.py "$OUTDIR" --budget-s 450
