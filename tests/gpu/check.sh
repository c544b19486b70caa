#!/usr/bin/env bash
# GPU check of objfs.torch_io, for a machine with an NVIDIA GPU.  NOT for CI: it may install a
# multi-GB CUDA build of torch.  Run from the repository root:
#
#     bash tests/gpu/check.sh
#
# 1. Finds a Python whose torch sees CUDA ($PYTHON, then ./.venv-gpu, then python3), or creates
#    ./.venv-gpu and pip-installs torch (CUDA build from PyPI), safetensors, pytest and numpy.
# 2. Runs tests/test_torch_io_cuda.py (project pytest config and conftest ignored: no plugins needed).
# 3. Generates a ${SIZE_MB} MiB safetensors file and benchmarks, on a warm page cache,
#    load_safetensors against load_file + .to(cuda) and against raw pinned H2D bandwidth.
#
# Every step is bounded with timeout(1).  Knobs: PYTHON, SIZE_MB (default 3072), BENCH_FILE,
# REPEAT (default 3), DEVICE (default cuda:0).
set -euo pipefail

SIZE_MB=${SIZE_MB:-3072}
BENCH_FILE=${BENCH_FILE:-/tmp/objfs-bench-${SIZE_MB}.safetensors}
REPEAT=${REPEAT:-3}
DEVICE=${DEVICE:-cuda:0}
VENV=.venv-gpu

if [[ ! -f objfs/torch_io.py ]]; then
    echo "run from the repository root" >&2
    exit 2
fi

has_cuda_torch() {
    timeout 120 "$1" -c 'import torch, safetensors, pytest, numpy, sys
sys.exit(0 if torch.cuda.is_available() else 1)' 2>/dev/null
}

py=""
for candidate in "${PYTHON:-}" "$VENV/bin/python" "$(command -v python3 || true)"; do
    if [[ -n "$candidate" && -x "$candidate" ]] && has_cuda_torch "$candidate"; then
        py=$candidate
        break
    fi
done
if [[ -z "$py" ]]; then
    echo "== creating $VENV and installing torch (CUDA), safetensors, pytest, numpy"
    [[ -x "$VENV/bin/python" ]] || python3 -m venv "$VENV"
    timeout 1800 "$VENV/bin/pip" install -q torch safetensors pytest numpy
    timeout 600 "$VENV/bin/pip" install -q -e . --no-deps
    py=$VENV/bin/python
    has_cuda_torch "$py" || { echo "torch in $VENV does not see a CUDA GPU" >&2; exit 1; }
fi
# Import objfs from this checkout whether or not it is pip-installed in $py.
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
"$py" -c 'import torch; print("python", torch.__file__); print("torch", torch.__version__,
"cuda", torch.version.cuda, torch.cuda.get_device_name(0))'
nvidia-smi --query-gpu=name,memory.total,pcie.link.gen.current,pcie.link.width.current \
    --format=csv 2>/dev/null || true

echo "== CUDA tests"
timeout 900 "$py" -m pytest -c /dev/null --rootdir "$PWD" --noconftest -W error -p no:cacheprovider -q -rs \
    tests/test_torch_io_cuda.py

echo "== benchmark (${SIZE_MB} MiB, warm page cache, $DEVICE)"
if [[ ! -f "$BENCH_FILE" ]]; then
    timeout 600 "$py" tests/benchmarks/bench_torch_io.py --make "$SIZE_MB" "$BENCH_FILE"
fi
timeout 900 "$py" tests/benchmarks/bench_torch_io.py "$BENCH_FILE" --device "$DEVICE" \
    --repeat "$REPEAT" --modes warm
