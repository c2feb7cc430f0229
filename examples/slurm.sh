#!/bin/bash
# Train on a SLURM cluster: one task per GPU, started by srun; Lightning's SLURMEnvironment reads each task's rank.
#
#   sbatch examples/slurm.sh                              # 4 nodes × 8 GPUs, strategy "3d": the planner's layout
#   sbatch --nodes=1 examples/slurm.sh --strategy zero3   # arguments after the script go to examples/train_gpt.py
#
# Before the time limit SLURM sends USR1 (--signal): every rank finishes the same optimizer step, writes
# hpc_ckpt_<n>.ckpt, and rank 0 requeues the job, which resumes from it bit for bit (docs/guides/launching.md).
#SBATCH --job-name=meshlight
#SBATCH --nodes=4
#SBATCH --ntasks-per-node=8
#SBATCH --gpus-per-node=8
#SBATCH --cpus-per-task=8
#SBATCH --time=04:00:00
#SBATCH --signal=USR1@90
#SBATCH --requeue
#SBATCH --output=%x-%j.out
set -euo pipefail
cd "${SLURM_SUBMIT_DIR:-.}"

# --devices and --num-nodes must match the allocation: Lightning checks them against srun's tasks
srun python examples/train_gpt.py --accelerator "${ACCELERATOR:-gpu}" \
    --devices "$SLURM_NTASKS_PER_NODE" --num-nodes "$SLURM_NNODES" --out "runs/slurm-$SLURM_JOB_ID" "$@"
