#!/usr/bin/env bash
# The GPU check, on one GPU node, in under 8 minutes: launch/gpu_check.sh [--sections parity,cp,...]
# Packed vs padded bf16 parity with flash-attn varlen, the CP attention with cp=2 on NCCL, the
# world-size gradient parity on NCCL, one process vs torchrun layout parity of train.py, and
# a 20-step `make train` on CUDA. Progress goes to stderr; the last stdout line is one JSON
# object of figures ("ok", "failed", "skipped", one entry per section). Exit 1 if a check failed.
# Logs and run folders: outputs/gpu_check/<time>/ (--work DIR to choose). See launch/gpu_check.py.
set -euo pipefail
cd "$(dirname "$0")/.."
python=${PYTHON:-.venv/bin/python}
"$python" -c 'import torch, sys; sys.exit(0 if torch.cuda.is_available() else "gpu_check.sh: no CUDA device visible (on CPU: launch/gpu_check.py --device cpu)")'
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader >&2 || true
exec "$python" launch/gpu_check.py --device cuda "$@"
