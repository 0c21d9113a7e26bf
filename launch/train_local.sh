#!/usr/bin/env bash
# Single node, any number of ranks, any Hydra overrides appended:
#   bash launch/train_local.sh                       # 1 rank: the default GSPO run on the tiny MoE
#   NPROC=2 bash launch/train_local.sh parallel=tp2  # 2 ranks, tensor parallel
#   NPROC=4 bash launch/train_local.sh parallel=tp2_ep2 algorithm=grpo_routing_replay
# NPROC must be a multiple of tp*pp*cp (the rest is data parallelism). On CPU the ranks use gloo.
# Several ranks start through gspo_megatron/launcher.py: its one store and gloo listen on 127.0.0.1
# only; Ctrl-C/SIGTERM save and exit 130/143; no rank outlives it.
set -euo pipefail
cd "$(dirname "$0")/.."
NPROC=${NPROC:-1}
if [ "$NPROC" = 1 ]; then
  exec python3 -m gspo_megatron.train "$@"
fi
exec python3 -m gspo_megatron.launcher --nproc-per-node "$NPROC" --master-addr 127.0.0.1 "$@"
