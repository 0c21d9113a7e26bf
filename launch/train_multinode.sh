#!/usr/bin/env bash
# Multi-node: run this once on every node, with the same MASTER_ADDR/MASTER_PORT and NNODES, and
# NODE_RANK 0..NNODES-1; Hydra overrides are appended:
#   NNODES=2 NODE_RANK=0 MASTER_ADDR=10.0.0.1 NPROC_PER_NODE=8 bash launch/train_multinode.sh \
#       model=qwen3_30b_a3b parallel=tp4_ep8 rollout=sglang rollout.sglang.model_path=/ckpt/Qwen3-30B-A3B
#
# Every node must reach MASTER_ADDR:MASTER_PORT. Where a host resolves its own name to 127.0.0.1,
# gloo/NCCL advertise loopback and peers get "connection refused": set SOCKET_IFNAME to the real
# interface (e.g. eth0, ib0); it is passed on as GLOO_SOCKET_IFNAME and NCCL_SOCKET_IFNAME.
set -euo pipefail
cd "$(dirname "$0")/.."
: "${NNODES:?set NNODES (number of nodes)}"
: "${NODE_RANK:?set NODE_RANK (0..NNODES-1)}"
: "${MASTER_ADDR:?set MASTER_ADDR (address of node 0, reachable from every node)}"
MASTER_PORT=${MASTER_PORT:-29500}
NPROC_PER_NODE=${NPROC_PER_NODE:-$(python3 -c 'import torch; print(max(torch.cuda.device_count(), 1))')}
if [ -n "${SOCKET_IFNAME:-}" ]; then
  export GLOO_SOCKET_IFNAME="$SOCKET_IFNAME" NCCL_SOCKET_IFNAME="$SOCKET_IFNAME"
fi
# gspo_megatron/launcher.py: node 0 serves the one store on MASTER_ADDR only (it must be an address of
# node 0, not 0.0.0.0); the other nodes' ranks dial it. Ctrl-C/SIGTERM save and exit 130/143.
exec python3 -m gspo_megatron.launcher --nnodes "$NNODES" --node-rank "$NODE_RANK" \
  --nproc-per-node "$NPROC_PER_NODE" --master-addr "$MASTER_ADDR" --master-port "$MASTER_PORT" "$@"
