#!/usr/bin/env bash
# One machine: launch/local.sh [--dry-run] [NPROC] [hydra overrides...]
#   launch/local.sh 8 parallel=cp2_ep2 trainer.max_steps=50
#   launch/local.sh 8 -m batch=packed,padded          # a Hydra sweep, one folder per run
#   MAX_RESTARTS=1 launch/local.sh 4 ...              # restart the group once after a failed rank
# MAX_RESTARTS defaults to 0 here: on a workstation a failing rank is usually a bug or bad
# input, which a restart would only repeat; the cluster script (slurm.sbatch) defaults to 3.
# --dry-run (or DRY_RUN=1) prints the torchrun line instead of running it.
set -euo pipefail
cd "$(dirname "$0")/.."
dry_run=${DRY_RUN:-0}
if [[ ${1:-} == --dry-run ]]; then dry_run=1; shift; fi
nproc=${1:-8}; shift || true
[[ $nproc =~ ^[1-9][0-9]*$ ]] || { echo "launch/local.sh: NPROC=$nproc is not a positive number (usage: launch/local.sh [NPROC] [overrides...])" >&2; exit 2; }

# A restarted group must not meet the failed attempt in the rendezvous store: with the store
# shared across rounds (torch 2.13's default) gloo reads the dead ranks' addresses again
# ("connectFullMesh failed ... Connection refused"); one store per round avoids that.
export TORCH_DISABLE_SHARE_RDZV_TCP_STORE=${TORCH_DISABLE_SHARE_RDZV_TCP_STORE:-1}
cmd=(.venv/bin/torchrun --standalone --nproc-per-node "$nproc" --max-restarts "${MAX_RESTARTS:-0}" train.py "$@")
if [[ $dry_run == 1 ]]; then printf -v line '%q ' "${cmd[@]}"; echo "${line% }"; exit 0; fi
exec "${cmd[@]}"
