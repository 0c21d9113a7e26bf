#!/usr/bin/env bash
# Study E2's runs (issue 67; reports/e2_off_policy/README.md): one stream of runs, one at a time, seeds outermost
# and arms innermost, so a stream cut short still covers every arm for the seeds it finished.
#   bash tools/e2_off_policy.sh OUT_DIR STOP_AT SEED...      e.g. bash tools/e2_off_policy.sh /tmp/e2/runs 11:25 1 3 5 7
#   bash tools/e2_off_policy.sh --arms gspo_r3_upr32 OUT_DIR STOP_AT SEED...    (only these arms, comma-separated)
#   bash tools/e2_off_policy.sh --experiment e2_qwen35_shape --arms ... OUT_DIR STOP_AT SEED...   (another
#     conf/experiment/ file of the same design: E2 on Qwen3.5's shape, reports/e2_qwen35_shape/README.md)
# OUT_DIR/<arm>_seed<seed>/ is each run's directory (tools/store_runs.py reads them). STOP_AT (HH:MM, UTC) is the
# stated bound: no run starts at or after it (a run already going is not stopped; its owner stops it by pid).
# Each run: one CPU thread (OMP_NUM_THREADS=1, trainer.cpu_threads=1 in the experiment), nice 10.
set -euo pipefail
# the pre-registered arms; gspo_r3_upr32 (GSPO + R3) was added by the README's amendment and runs with --arms
arms=(grpo_upr32 grpo_r3_upr32 gspo_upr32 grpo_lr3e-4_upr32 grpo_upr1)
experiment=e2_off_policy
while [ "${1:-}" = "--arms" ] || [ "${1:-}" = "--experiment" ]; do
  case "$1" in
    --arms) IFS=, read -r -a arms <<< "${2:?--arms needs a comma-separated list of arms}" ;;
    --experiment) experiment="${2:?--experiment needs the name of a conf/experiment/ file}" ;;
  esac
  shift 2
done
if [ "$#" -lt 3 ]; then
  echo "usage: bash tools/e2_off_policy.sh [--experiment NAME] [--arms ARM,...] OUT_DIR STOP_AT(HH:MM UTC) SEED..." >&2
  exit 2
fi
out="$1" stop_at="$2"
shift 2
cd "$(dirname "$0")/.."
export OMP_NUM_THREADS=1
# arm name -> its overrides on top of conf/experiment/<experiment>.yaml (both: 32 updates per rollout, lr 1e-3)
declare -A overrides=(
  [grpo_upr32]="algorithm=grpo"
  [grpo_r3_upr32]="algorithm=grpo_rollout_routing_replay"
  [gspo_upr32]="algorithm=gspo"
  [grpo_lr3e-4_upr32]="algorithm=grpo optimizer.lr=3.0e-4 optimizer.min_lr=3.0e-5"
  [grpo_upr1]="algorithm=grpo trainer.updates_per_rollout=1 trainer.micro_batch_size=128"
  [gspo_r3_upr32]="algorithm=gspo routing.replay=rollout"
)
for arm in "${arms[@]}"; do
  if [ -z "${overrides[$arm]+set}" ]; then
    echo "e2_off_policy: unknown arm '$arm'; known: ${!overrides[*]}" >&2
    exit 2
  fi
done
mkdir -p "$out"
for seed in "$@"; do
  for arm in "${arms[@]}"; do
    if [[ "$(date -u +%H:%M)" > "$stop_at" || "$(date -u +%H:%M)" == "$stop_at" ]]; then
      echo "e2_off_policy: $(date -u +%H:%M) UTC is past $stop_at; not starting $arm seed $seed" >&2
      exit 0
    fi
    run="$out/${arm}_seed${seed}"
    echo "e2_off_policy: $(date -u +%H:%M:%S) start $run" >&2
    # shellcheck disable=SC2086  # the overrides are words
    nice -n 10 python3 -m gspo_megatron.train +experiment="$experiment" ${overrides[$arm]} \
      trainer.seed="$seed" run_dir="$run" > "$out/${arm}_seed${seed}.log" 2>&1
  done
done
