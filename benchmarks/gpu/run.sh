#!/usr/bin/env bash
# The GPU run in one command (benchmarks/gpu/run.py says what it does):
#   bash benchmarks/gpu/run.sh                        # GPU machine; results in ${OUT:-benchmarks/results/gpu}
#   bash benchmarks/gpu/run.sh --device cpu --quick   # the dry run, here and in `make test`
# On a machine without the project's packages (the GPU machine: torch, triton and transformers
# but no pyzmq, msgspec, pydantic, nixl), the wheels that `python benchmarks/gpu/pack_wheels.py`
# put in .whl/ are installed into a private folder first.
set -uo pipefail
cd "$(dirname "$0")/../.."
PY=${PYTHON:-python3}
if [ -x .venv/bin/python ] && [ -z "${PYTHON:-}" ]; then PY=.venv/bin/python; fi
if ! "$PY" -c "import zmq, msgspec, pydantic, nixl" 2>/dev/null; then
    if ! ls .whl/*.whl >/dev/null 2>&1; then
        echo "missing packages and no .whl/ (run: python benchmarks/gpu/pack_wheels.py)" >&2
        exit 2
    fi
    SITE=${TMPDIR:-/tmp}/tandem-gpu-site
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target "$SITE" .whl/*.whl || exit 3
    export PYTHONPATH="$SITE:$PWD${PYTHONPATH:+:$PYTHONPATH}"
fi
# UCX's CUDA modules (cuda_copy, cuda_ipc) load libcudart and libnvidia-ml; pip's CUDA runtime
# sits inside site-packages, where the loader does not look.
CUDART=$("$PY" -c "
import glob, os, site
hits = [h for b in site.getsitepackages() for h in glob.glob(os.path.join(b, 'nvidia', '**', 'libcudart.so.*'), recursive=True)]
print(os.path.dirname(hits[0]) if hits else '')" 2>/dev/null)
if [ -n "$CUDART" ]; then export LD_LIBRARY_PATH="$CUDART${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"; fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
exec "$PY" -m benchmarks.gpu.run "$@"
