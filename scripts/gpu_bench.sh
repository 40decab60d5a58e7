#!/usr/bin/env bash
# The GPU check of issue 7: decode MBU with CUDA graphs and the engine against HF transformers, on
# TinyLlama-1.1B-shaped random weights in bf16. Needs only torch, triton and transformers; at most 7.5 min.
#
#   scripts/gpu_bench.sh OUT_DIR
#
# Writes into OUT_DIR: nvidia-smi.txt, decode_torch.json and decode_triton.json (workbench bench decode,
# batches 1 8 32), prefill.json, hf.json (batch-1 decode and the offline set against transformers' generate),
# summary.txt (the targets: MBU >= 0.7 at batch 1; >= 2x transformers' decode tokens/s, identical tokens).
# Each step has its own time limit, and a failed step does not stop the others (its .err file says why).
set -uo pipefail
OUT=${1:?usage: scripts/gpu_bench.sh OUT_DIR}
mkdir -p "$OUT"
cd "$(dirname "$0")/.." || exit 1
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
PY=${PYTHON:-python}
MODEL=${MODEL:-TinyLlama-1.1B}  # overridable, with DEVICE, for a dry run on the CPU
DEVICE=${DEVICE:-cuda}
CKPT="$OUT/tinyllama-bf16"

nvidia-smi > "$OUT/nvidia-smi.txt" 2>&1 || true
"$PY" -c "import torch, triton, transformers; print('torch', torch.__version__, 'triton', triton.__version__,
'transformers', transformers.__version__, 'cuda', torch.cuda.is_available())" > "$OUT/versions.txt" 2>&1

step() {  # step NAME TIMEOUT_S ARGS...: one workbench command, JSON to NAME.json, stderr to NAME.err
    local name=$1 limit=$2
    shift 2
    echo "== $name: workbench $*"
    timeout "$limit" "$PY" -m workbench.cli "$@" --json > "$OUT/$name.json" 2> "$OUT/$name.err" \
        || echo "   $name failed (exit $?); see $OUT/$name.err"
}

# one random HF checkpoint, shared by our engine and transformers (written through transformers)
timeout 60 "$PY" -c "from workbench.model import save_random_checkpoint; save_random_checkpoint('$MODEL', '$CKPT', \
seed=0, dtype='bf16')" > "$OUT/checkpoint.log" 2>&1 || echo "checkpoint failed; see $OUT/checkpoint.log"

step decode_torch 90 bench decode --model "$CKPT" --dtype bf16 --device "$DEVICE" --batch 1 8 32 --prompt-len 512 \
    --steps 20 --warmup 3
step decode_triton 90 bench decode --model "$CKPT" --dtype bf16 --device "$DEVICE" --batch 1 8 32 --prompt-len 512 \
    --steps 20 --warmup 3 --attention-backend triton
step prefill 45 bench prefill --model "$CKPT" --dtype bf16 --device "$DEVICE" --prompt-len 512 1024 2048 --repeats 5
step hf 150 bench hf --model "$CKPT" --dtype bf16 --device "$DEVICE" --prompt-len 128 --new-tokens 128 --repeats 3 \
    --num-requests 64 --context 1024 --max-num-seqs 32

"$PY" - "$OUT" > "$OUT/summary.txt" 2>&1 <<'EOF'
import json, sys
from pathlib import Path

out = Path(sys.argv[1])


def load(name):
    try:
        return json.loads((out / f"{name}.json").read_text())
    except (OSError, ValueError):
        return None


for name in ("decode_torch", "decode_triton"):
    d = load(name)
    if d is None:
        print(f"{name}: no result")
        continue
    print(f"{name} (read bandwidth {d['machine']['read_bandwidth'] / 1e9:.0f} GB/s):")
    for r in d["results"]:
        print(f"  batch {r['batch']:>3}: {r['step_s'] * 1e3:7.3f} ms/step  {r['tokens_per_s']:9.1f} tok/s  "
              f"mbu {r['mbu']:.3f}  gemv_ratio {r['gemv_ratio']:.3f}  overhead {r['overhead_share']:.1%}  "
              f"cuda_graphs {r['cuda_graphs']}")
    b1 = d["results"][0]
    print(f"  target MBU >= 0.7 at batch 1: {'met' if b1['mbu'] >= 0.7 else 'NOT met'} ({b1['mbu']:.3f})")
p = load("prefill")
if p:
    for r in p["results"]:
        print(f"prefill {r['prompt_len']:>5}: {r['time_s'] * 1e3:8.2f} ms  mfu {r['mfu']:.3f}")
h = load("hf")
if h:
    for key in ("decode", "offline"):
        if key in h:
            r = h[key]
            print(f"hf {key}: ours {r['ours_tokens_per_s']:.1f} tok/s, transformers {r['hf_tokens_per_s']:.1f} tok/s, "
                  f"ratio {r['ratio']:.2f}, identical tokens {r['identical_tokens']}")
    if "decode" in h:
        r = h["decode"]
        print(f"target >= 2x transformers' decode tokens/s: {'met' if r['ratio'] >= 2 else 'NOT met'}")
EOF
cat "$OUT/summary.txt"
rm -rf "$CKPT"
