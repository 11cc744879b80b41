#!/usr/bin/env bash
# On an NVIDIA GPU machine: run the kernel tests compiled (not interpreted)
# and the CUDA-graph tests (capture, replay against eager), time every kernel
# against its reference and the bandwidth it should reach, and time decoding
# with graphs against eager launches. Budget: under 7 minutes on an H200. Works offline when the machine's
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
timeout 240 "$PY" -m pytest -q -p no:cacheprovider tests/kernels tests/test_cuda_graphs.py 2>&1 | tail -20
status=${PIPESTATUS[0]}
timeout 120 "$PY" benches/kernel_timing.py
# CUDA graphs against eager launches (captures, replays, same tokens): benches/out/cuda_graphs.json
timeout 150 "$PY" benches/cuda_graphs.py --batches 1 4 16 --tokens 48 --repeats 3 || status=1
[ -n "${OUT:-}" ] && cp benches/out/kernel_timing.json benches/out/cuda_graphs.json "$OUT/" 2>/dev/null
exit "$status"
