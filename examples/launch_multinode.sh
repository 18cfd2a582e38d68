#!/usr/bin/env bash
# Multi-node torchrun, as in OSLO's tutorial: run this same command on every node.
#   NNODES=2 NODE_RANK=0 MASTER_ADDR=node0.example MASTER_PORT=29500 bash examples/launch_multinode.sh
#   NNODES=2 NODE_RANK=1 MASTER_ADDR=node0.example MASTER_PORT=29500 bash examples/launch_multinode.sh
# On GPU nodes set GPUS_PER_NODE to the GPU count; the script picks nccl by itself.
set -euo pipefail
: "${NNODES:?number of nodes}" "${NODE_RANK:?the rank of this node, 0..NNODES-1}" "${MASTER_ADDR:?address of node 0}"
MASTER_PORT="${MASTER_PORT:-29500}"
GPUS_PER_NODE="${GPUS_PER_NODE:-2}"   # processes per node (CPU ranks when there is no GPU)
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
exec torchrun \
  --nnodes="$NNODES" --node_rank="$NODE_RANK" --nproc_per_node="$GPUS_PER_NODE" \
  --rdzv_backend=c10d --rdzv_endpoint="$MASTER_ADDR:$MASTER_PORT" \
  examples/train_gpt2.py "$@"
