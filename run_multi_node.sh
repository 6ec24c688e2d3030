#!/usr/bin/env bash
# Multi-node GEARS training with torchrun (c10d rendezvous); under Slurm, one torchrun per node via srun.
set -euo pipefail

usage() {
  cat <<'USAGE'
Usage: [VAR=value ...] ./run_multi_node.sh [--config FILE] [key=value ...]

Starts train_distributed.py with torchrun on this node (run it on every node), or, inside a Slurm
allocation, launches one torchrun per node with srun. Arguments after the options go to
train_distributed.py unchanged (config file and key=value overrides).

Environment variables (defaults in brackets):
  NNODES          number of nodes taking part                  [1, or SLURM_NNODES under Slurm]
  NODE_RANK       this node's index, 0..NNODES-1 (static rendezvous only; c10d assigns ranks)
                                                               [0, or SLURM_NODEID under Slurm]
  NPROC_PER_NODE  processes per node: GPUs per node, or CPU processes
                                                               [GPUs visible, else 1]
  MASTER_ADDR     address of the head node, reachable from all nodes
                                                               [127.0.0.1, or the first host of
                                                                `scontrol show hostnames` under Slurm]
  MASTER_PORT     TCP port of the rendezvous on the head node  [29500, or under Slurm
                                                                20000 + SLURM_JOB_ID % 20000, so
                                                                jobs sharing a node differ]
  RDZV_BACKEND    c10d (elastic, default) or static (uses NODE_RANK)          [c10d]
  RDZV_ID         job id shared by all nodes                   [SLURM_JOB_ID, else "gears"]
  MAX_RESTARTS    torchrun restarts of the whole group after a worker failure;
                  restarted workers resume from the last checkpoint          [0]
  PYTHON          python interpreter                            [python]
  SRUN_ARGS       extra arguments for srun under Slurm          [empty]
                  (--cpus-per-task=$SLURM_CPUS_PER_TASK is passed when set: since Slurm 22.05
                  srun does not inherit it, and torchrun's workers would share one core)
  OMP_NUM_THREADS CPU threads per worker; unset, each worker takes the physical cores of its
                  CPU mask (the srun task's CPUs under Slurm) divided by NPROC_PER_NODE, and
                  torchrun's own OMP_NUM_THREADS=1 is replaced by that share       [unset]
  OMP_WAIT_POLICY how idle OpenMP threads wait: PASSIVE (set by train_distributed.py) sleeps,
                  so a busy core slows a worker instead of stalling it           [PASSIVE]
  TORCH_DISABLE_SHARE_RDZV_TCP_STORE
                  1: the workers' process group gets its own store per restart. torchrun's
                  default reuses the rendezvous store, whose stale keys can make a restarted
                  group dial a dead peer (pytorch/pytorch#135712)                   [1]
  NCCL_* / GLOO_SOCKET_IFNAME / NCCL_SOCKET_IFNAME are passed through to the workers.

Examples:
  # two nodes, 4 GPUs each: run on node 0 and on node 1 with the head node's address
  NNODES=2 NPROC_PER_NODE=4 MASTER_ADDR=10.0.0.1 ./run_multi_node.sh train.epochs=20
  # inside an sbatch allocation (see examples/slurm.sbatch)
  ./run_multi_node.sh --config configs/norman.yaml
USAGE
}

for arg in "$@"; do
  case "$arg" in -h|--help) usage; exit 0 ;; esac
done

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
PYTHON="${PYTHON:-python}"
gpus=$("$PYTHON" -c 'import torch; print(torch.cuda.device_count())' 2>/dev/null || echo 0)
[ "$gpus" -gt 0 ] 2>/dev/null || gpus=1
NPROC_PER_NODE="${NPROC_PER_NODE:-$gpus}"
if [[ "${SLURM_JOB_ID:-}" =~ ^[0-9]+$ ]]; then
  default_port=$((20000 + SLURM_JOB_ID % 20000))  # as gears.train.distributed.default_master_port
else
  default_port=29500
fi
MASTER_PORT="${MASTER_PORT:-$default_port}"
RDZV_BACKEND="${RDZV_BACKEND:-c10d}"
MAX_RESTARTS="${MAX_RESTARTS:-0}"
export TORCH_DISABLE_SHARE_RDZV_TCP_STORE="${TORCH_DISABLE_SHARE_RDZV_TCP_STORE:-1}"

launch() {  # launch NNODES NODE_RANK args...
  local nnodes="$1" node_rank="$2"; shift 2
  local rdzv=(--rdzv_backend=c10d --rdzv_endpoint="${MASTER_ADDR}:${MASTER_PORT}" --rdzv_id="${RDZV_ID}")
  if [ "$RDZV_BACKEND" = "static" ]; then
    rdzv=(--node_rank="$node_rank" --master_addr="$MASTER_ADDR" --master_port="$MASTER_PORT")
  fi
  exec "$PYTHON" -m torch.distributed.run --nnodes="$nnodes" --nproc_per_node="$NPROC_PER_NODE" \
    --max_restarts="$MAX_RESTARTS" "${rdzv[@]}" "$here/train_distributed.py" "$@"
}

# Inside a task of an srun step, or in the allocation itself (the batch script, or salloc's shell,
# which runs in an "interactive" step): the same step ids as gears.train.distributed.in_srun_task.
step="${SLURM_STEP_ID:-${SLURM_STEPID:-}}"
case "$step" in
  ""|batch|extern|interactive|429496729[0-5]) in_srun_task=0 ;;
  *) in_srun_task=1 ;;
esac
if [ -n "${SLURM_JOB_ID:-}" ] && [ "$in_srun_task" = 0 ] && command -v srun >/dev/null; then
  # In the batch script or salloc shell of an allocation: one srun task per node, each running
  # torchrun.
  MASTER_ADDR="${MASTER_ADDR:-$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)}"
  NNODES="${NNODES:-${SLURM_NNODES:-1}}"
  RDZV_ID="${RDZV_ID:-$SLURM_JOB_ID}"
  export MASTER_ADDR MASTER_PORT NNODES NPROC_PER_NODE RDZV_BACKEND RDZV_ID MAX_RESTARTS PYTHON
  cpus=()
  [ -n "${SLURM_CPUS_PER_TASK:-}" ] && cpus=(--cpus-per-task="$SLURM_CPUS_PER_TASK")
  # shellcheck disable=SC2086
  exec srun --nodes="$NNODES" --ntasks-per-node=1 "${cpus[@]}" ${SRUN_ARGS:-} \
    bash -c 'NODE_RANK=$SLURM_NODEID exec "$0" "$@"' "$here/run_multi_node.sh" "$@"
fi

MASTER_ADDR="${MASTER_ADDR:-127.0.0.1}"
NNODES="${NNODES:-${SLURM_NNODES:-1}}"
NODE_RANK="${NODE_RANK:-${SLURM_NODEID:-0}}"
RDZV_ID="${RDZV_ID:-${SLURM_JOB_ID:-gears}}"
echo "run_multi_node: node ${NODE_RANK}/${NNODES}, ${NPROC_PER_NODE} process(es) per node, rendezvous ${RDZV_BACKEND} at ${MASTER_ADDR}:${MASTER_PORT}" >&2
launch "$NNODES" "$NODE_RANK" "$@"
