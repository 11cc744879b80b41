#!/usr/bin/env bash
# On an NVIDIA GPU machine, in stages (each with its own timeout; the default
# runs them all, in this order; the first four in under 9.5 minutes at most):
#   kernels  the kernel tests compiled (not interpreted; every file of
#            tests/kernels/triton: Mamba-1/2, GDN, conv window, attention,
#            ..., and the seam's tests in tests/kernels; the native CPU
#            kernels' tests in tests/kernels/cpu need no GPU) and
#            the CUDA-graph tests (capture, replay against eager)  ≤ 180 s
#   timing   every kernel (Mamba-2 and GDN verify and replay, conv window,
#            rejection) against its reference and the bandwidth it should
#            reach (benches/kernel_timing.py)                  ≤ 70 s
#   graphs   decoding with CUDA graphs against eager launches
#            (benches/cuda_graphs.py)                           ≤ 100 s
#   check    the rollback-correctness suite on the GPU path: float32 eager,
#            float32 with CUDA graphs, float64 (whose attention takes the
#            torch reference, so no graphs)                     ≤ 3 × 70 s
#   tp       tests/test_tensor_parallel.py's family logits, speculative parity
#            (Bamba, GDN) and rollback suite over 2 ranks of an NCCL group,
#            rank r on GPU r (HYBRIDSPEC_TP_BACKEND=nccl); skipped, saying
#            so, with fewer than 2 GPUs                         ≤ 300 s
# The longest stage comes last, so a run cut short still has the others.
# A device session with less time runs some: `bash benches/gpu_check.sh kernels graphs`.
# Works offline when the machine's python already has torch and triton (the
# device machines reach no registry). OUT=dir copies the JSON there, and the
# whole output (gpu_check.log).
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"  # benches/*.py put benches/ first on sys.path
PY=${PYTHON:-python3}
STAGES=${*:-kernels timing graphs check tp}
if [ -n "${OUT:-}" ]; then exec > >(tee -a "$OUT/gpu_check.log") 2>&1; fi
if ! "$PY" -c "import torch, triton" 2>/dev/null; then
  "$PY" -m pip install -q torch triton safetensors numpy tqdm pytest hypothesis scipy || exit 1
fi
# editable install without network: no build isolation, no dependency resolution
"$PY" -c "import hybridspec.kernels" 2>/dev/null \
  || "$PY" -m pip install -q --no-build-isolation --no-deps -e . || exit 1
export TRITON_INTERPRET=0
nvidia-smi --query-gpu=name,memory.total --format=csv || true
"$PY" -c "import torch; print('cuda available:', torch.cuda.is_available(), torch.__version__)"
status=0
for stage in $STAGES; do
  start=$SECONDS
  echo "== $stage"
  case $stage in
    kernels)
      timeout 180 "$PY" -m pytest -q -p no:cacheprovider tests/kernels/triton tests/kernels/test_*.py tests/test_cuda_graphs.py 2>&1 | tail -20
      [ "${PIPESTATUS[0]}" -eq 0 ] || status=1 ;;
    check)
      for run in "float32 0" "float32 1" "float64 0"; do  # dtype, HYBRIDSPEC_CUDA_GRAPHS
        set -- $run
        echo "-- check --dtype $1, CUDA graphs $2"
        HYBRIDSPEC_CUDA_GRAPHS=$2 timeout 70 "$PY" -m hybridspec.cli.main check --quick --device cuda --dtype "$1" \
          2>&1 | tail -3
        [ "${PIPESTATUS[0]}" -eq 0 ] || status=1
      done ;;
    timing)
      timeout 70 "$PY" benches/kernel_timing.py || status=1
      [ -n "${OUT:-}" ] && cp benches/out/kernel_timing.json "$OUT/" 2>/dev/null ;;
    graphs)
      timeout 100 "$PY" benches/cuda_graphs.py --batches 1 4 16 --tokens 48 --repeats 3 || status=1
      [ -n "${OUT:-}" ] && cp benches/out/cuda_graphs.json "$OUT/" 2>/dev/null ;;
    tp)
      gpus=$("$PY" -c "import torch; print(torch.cuda.device_count())")
      if [ "$gpus" -lt 2 ]; then
        echo "-- tp skipped: $gpus GPU(s); tensor parallel over NCCL needs 2"
      else
        HYBRIDSPEC_TP_BACKEND=nccl timeout 300 "$PY" -m pytest -q -p no:cacheprovider tests/test_tensor_parallel.py \
          -k "family or speculative or rollback" 2>&1 | tail -20
        [ "${PIPESTATUS[0]}" -eq 0 ] || status=1
      fi ;;
    *)
      echo "unknown stage '$stage' (kernels, check, timing, graphs, tp)"; status=2 ;;
  esac
  echo "== $stage: $((SECONDS - start)) s"
done
exit "$status"
