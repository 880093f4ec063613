#!/usr/bin/env bash
# Run one experiment module on every host of a Cloud TPU pod slice (one process per host,
# JAX's multi-controller runtime; jax.distributed finds the coordinator from the TPU
# metadata, so each process is started with --tpu-pod).
#
#   experiments/launch_pod.sh TPU_NAME ZONE MODULE [ARGS...]
#   experiments/launch_pod.sh my-v5p-256 us-east5-a train --preset paper --workdir /mnt/shared/run1
#
# Every host must hold this repository at the same path with its venv installed
# (`setup` below does both from a git URL). The workdir must be one place every host
# sees: a Cloud Storage bucket (`--workdir gs://BUCKET/run`) or a shared filesystem (NFS,
# Filestore): each process writes its part of the orbax checkpoint there, and process 0
# alone writes metrics, logs and plots. docs/guides/pod.md walks through a run from zero.
set -euo pipefail
if [ "$#" -lt 3 ]; then
  echo "usage: $0 TPU_NAME ZONE MODULE [ARGS...]   (or: $0 TPU_NAME ZONE setup GIT_URL)" >&2
  exit 2
fi
name=$1 zone=$2 module=$3
shift 3
repo_dir=${REPO_DIR:-stablerl_jax}
if [ "$module" = setup ]; then
  url=${1:?setup needs the git URL of the repository}
  cmd="git clone -q $url $repo_dir 2>/dev/null || git -C $repo_dir pull -q; cd $repo_dir &&
python3 -m pip install -q uv && uv venv -q --allow-existing .venv &&
uv pip install -q -p .venv -e . 'jax[tpu]==0.10.2'"
else
  args=$(printf '%q ' "$@")
  cmd="cd $repo_dir && .venv/bin/python -m experiments.$module --tpu-pod $args"
fi
exec gcloud compute tpus tpu-vm ssh "$name" --zone "$zone" --worker=all --command "$cmd"
