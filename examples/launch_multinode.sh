#!/usr/bin/env bash
# Multi-node torchrun, as in OSLO's tutorial: run this same command on every node.
#   NNODES=2 NODE_RANK=0 MASTER_ADDR=node0.example MASTER_PORT=29500 bash examples/launch_multinode.sh
#   NNODES=2 NODE_RANK=1 MASTER_ADDR=node0.example MASTER_PORT=29500 bash examples/launch_multinode.sh
# On GPU nodes set GPUS_PER_NODE to the GPU count; the script picks nccl by itself.
# Hybrid sharding by default: each node holds one replica sharded over its own ranks, and only the
# gradient all-reduce crosses nodes (--replicate auto); pass --replicate 1 to shard over every rank.
# A node that dies fails the job: the other agents exit non-zero within seconds (MAX_RESTARTS=0);
# with MAX_RESTARTS=N torchrun restarts the survivors, which wait up to RDZV_JOIN_TIMEOUT seconds
# for the lost node to rejoin. Pass --save-every N and --resume auto to go on from the last checkpoint.
set -euo pipefail
: "${NNODES:?number of nodes}" "${NODE_RANK:?the rank of this node, 0..NNODES-1}" "${MASTER_ADDR:?address of node 0}"
MASTER_PORT="${MASTER_PORT:-29500}"
GPUS_PER_NODE="${GPUS_PER_NODE:-2}"   # processes per node (CPU ranks when there is no GPU)
MAX_RESTARTS="${MAX_RESTARTS:-0}"
RDZV_JOIN_TIMEOUT="${RDZV_JOIN_TIMEOUT:-600}"   # seconds the first agents wait for the others
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
exec torchrun \
  --nnodes="$NNODES" --node_rank="$NODE_RANK" --nproc_per_node="$GPUS_PER_NODE" \
  --rdzv_id="${RDZV_ID:-shardwrap-gpt2}" --rdzv_backend=c10d --rdzv_endpoint="$MASTER_ADDR:$MASTER_PORT" \
  --rdzv_conf="join_timeout=$RDZV_JOIN_TIMEOUT" --max_restarts="$MAX_RESTARTS" \
  examples/train_gpt2.py --replicate auto "$@"
