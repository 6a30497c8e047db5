#!/usr/bin/env bash
# One machine: launch/local.sh [NPROC] [hydra overrides...]
#   launch/local.sh 8 parallel=cp2_ep2 trainer.max_steps=50
#   launch/local.sh 8 -m batch=packed,padded          # a Hydra sweep, one folder per run
set -euo pipefail
cd "$(dirname "$0")/.."
nproc=${1:-8}; shift || true
exec .venv/bin/torchrun --standalone --nproc-per-node "$nproc" train.py "$@"
