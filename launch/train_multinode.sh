#!/usr/bin/env bash
# Multi-node: run this once on every node, with the same MASTER_ADDR/MASTER_PORT and NNODES, and
# NODE_RANK 0..NNODES-1; Hydra overrides are appended:
#   NNODES=2 NODE_RANK=0 MASTER_ADDR=10.0.0.1 NPROC_PER_NODE=8 bash launch/train_multinode.sh \
#       model=qwen3_30b_a3b parallel=tp4_ep8 rollout=sglang rollout.sglang.model_path=/ckpt/Qwen3-30B-A3B
#
# LAUNCHER=torchrun (the default): torchrun with the c10d rendezvous on MASTER_ADDR:MASTER_PORT and
#   elastic restarts: a lost rank or node stops the group and torchrun starts it again, up to
#   MAX_RESTARTS (default 3) times, resuming from the latest complete checkpoint (checkpoint.resume=auto
#   is added; save often enough: checkpoint.save_every). Its stores listen on every interface.
# LAUNCHER=gspo: the project's launcher (gspo_megatron/launcher.py): one store, on MASTER_ADDR only;
#   no restarts (a failure ends the job; a new job resumes with checkpoint.resume=auto).
#
# Every node must reach MASTER_ADDR:MASTER_PORT. Where a host resolves its own name to 127.0.0.1 (or
# not at all), gloo/NCCL advertise an address the peers cannot reach: set SOCKET_IFNAME to the real
# interface (e.g. eth0, ib0; passed on as GLOO_SOCKET_IFNAME and NCCL_SOCKET_IFNAME) and, for torchrun,
# LOCAL_ADDR to this node's address on it.
set -euo pipefail
cd "$(dirname "$0")/.."
: "${NNODES:?set NNODES (number of nodes)}"
: "${NODE_RANK:?set NODE_RANK (0..NNODES-1)}"
: "${MASTER_ADDR:?set MASTER_ADDR (address of node 0, reachable from every node)}"
MASTER_PORT=${MASTER_PORT:-29500}
NPROC_PER_NODE=${NPROC_PER_NODE:-$(python3 -c 'import torch; print(max(torch.cuda.device_count(), 1))')}
LAUNCHER=${LAUNCHER:-torchrun}
if [ -n "${SOCKET_IFNAME:-}" ]; then
  export GLOO_SOCKET_IFNAME="$SOCKET_IFNAME" NCCL_SOCKET_IFNAME="$SOCKET_IFNAME"
fi
case "$LAUNCHER" in
  torchrun)
    # is_host: node 0 serves the rendezvous (torchrun would guess it from host names); the rendezvous
    # assigns the node ranks. RUN_ID names the job: agents of another job on the same endpoint never join.
    local_addr=()
    if [ -n "${LOCAL_ADDR:-}" ]; then local_addr=(--local-addr "$LOCAL_ADDR"); fi
    exec python3 -m torch.distributed.run --nnodes "$NNODES" --nproc-per-node "$NPROC_PER_NODE" \
      --rdzv-backend c10d --rdzv-endpoint "$MASTER_ADDR:$MASTER_PORT" --rdzv-id "${RUN_ID:-gspo}" \
      --rdzv-conf "is_host=$([ "$NODE_RANK" = 0 ] && echo 1 || echo 0)" "${local_addr[@]}" \
      --max-restarts "${MAX_RESTARTS:-3}" -m gspo_megatron.train checkpoint.resume=auto "$@" ;;
  gspo)
    # node 0 serves the one store on MASTER_ADDR only (an address of node 0, not 0.0.0.0); the other
    # nodes' ranks dial it. Ctrl-C/SIGTERM save and exit 130/143.
    exec python3 -m gspo_megatron.launcher --nnodes "$NNODES" --node-rank "$NODE_RANK" \
      --nproc-per-node "$NPROC_PER_NODE" --master-addr "$MASTER_ADDR" --master-port "$MASTER_PORT" "$@" ;;
  *)
    echo "LAUNCHER=$LAUNCHER: use torchrun (elastic restarts) or gspo (the project's launcher)" >&2
    exit 2 ;;
esac
