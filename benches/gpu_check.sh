#!/usr/bin/env bash
# On an NVIDIA GPU machine: run the kernel tests compiled (not interpreted)
# and time every kernel against its reference and the bandwidth it should
# reach. Budget: under 5 minutes on an H200.
#   bash benches/gpu_check.sh            (OUT=dir to copy the JSON there)
set -uo pipefail
cd "$(dirname "$0")/.."
if [ ! -d .venv ]; then
  python3 -m venv .venv && . .venv/bin/activate && pip install -q torch triton safetensors numpy tqdm pytest hypothesis scipy \
    && pip install -q --no-deps -e .
else
  . .venv/bin/activate
fi
export TRITON_INTERPRET=0
nvidia-smi --query-gpu=name,memory.total --format=csv || true
timeout 240 python -m pytest -q -p no:cacheprovider tests/kernels 2>&1 | tail -20
status=${PIPESTATUS[0]}
timeout 120 python benches/kernel_timing.py
[ -n "${OUT:-}" ] && cp benches/out/kernel_timing.json "$OUT/" 2>/dev/null
exit "$status"
