#!/usr/bin/env bash
# On an NVIDIA GPU machine: run the kernel tests compiled (not interpreted)
# and time every kernel against its reference and the bandwidth it should
# reach. Budget: under 5 minutes on an H200. Works offline when the machine's
# python already has torch and triton (the device machines reach no registry).
#   bash benches/gpu_check.sh            (OUT=dir to copy the JSON there)
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if ! "$PY" -c "import torch, triton" 2>/dev/null; then
  "$PY" -m pip install -q torch triton safetensors numpy tqdm pytest hypothesis scipy || exit 1
fi
# editable install without network: no build isolation, no dependency resolution
"$PY" -c "import hybridspec.kernels" 2>/dev/null \
  || "$PY" -m pip install -q --no-build-isolation --no-deps -e . || exit 1
export TRITON_INTERPRET=0
nvidia-smi --query-gpu=name,memory.total --format=csv || true
"$PY" -c "import torch; print('cuda available:', torch.cuda.is_available(), torch.__version__)"
timeout 240 "$PY" -m pytest -q -p no:cacheprovider tests/kernels 2>&1 | tail -20
status=${PIPESTATUS[0]}
timeout 120 "$PY" benches/kernel_timing.py
[ -n "${OUT:-}" ] && cp benches/out/kernel_timing.json "$OUT/" 2>/dev/null
exit "$status"
