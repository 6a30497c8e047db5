#!/usr/bin/env bash
# The GPU check on one bare GPU machine (python3 with a CUDA torch >= 2.11, transformers, no network, no
# .venv), in <= 6 minutes; writes two files to --out (default $OUT): gpu_check.json and
# gpu_check_logs.tar.gz. Sections and figures: launch/gpu_check.py. Exit 1 if a section failed.
#
#   make gpu-wheels          # here, once: hydra-core, omegaconf, antlr4 wheels -> .cache/gpu-wheels (git-ignored)
#   # the device tool (this workplace), the wheels carried beside the working tree:
#   run(command="bash launch/gpu_check.sh", carry=[".cache/gpu-wheels"], timeout_s=420)
#   # elsewhere: launch/gpu_check.sh --out DIR       CPU rehearsal: launch/gpu_check.sh --out DIR --device cpu
#
# The pure-Python packages train.py needs and the machine lacks are installed from .cache/gpu-wheels with
# `pip install --no-index --no-deps --target` into a temporary folder put on PYTHONPATH (nothing else changes).
set -euo pipefail
cd "$(dirname "$0")/.."
if [ -n "${PYTHON:-}" ]; then python=$PYTHON; elif [ -x .venv/bin/python ]; then python=.venv/bin/python; else python=python3; fi
wheels=.cache/gpu-wheels
if ! "$python" -c 'import hydra, omegaconf' 2>/dev/null; then
    if ! ls "$wheels"/*.whl >/dev/null 2>&1; then
        echo "gpu_check.sh: hydra/omegaconf are missing and $wheels holds no wheels (make gpu-wheels, then carry it)" >&2
        exit 2
    fi
    site=$(mktemp -d /tmp/gpu_check_site.XXXXXX)
    "$python" -m pip install --quiet --no-index --no-deps --no-compile --no-cache-dir --target "$site" "$wheels"/*.whl
    export PYTHONPATH="$site${PYTHONPATH:+:$PYTHONPATH}"
fi
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader >&2 2>/dev/null || true
exec "$python" launch/gpu_check.py "$@"
