#!/usr/bin/env bash
# Study E4's runs (pre-registration: reports/e4_shaping/README.md): two warm starts, then every arm as a Hydra
# sweep over seeds, in blocks of seeds (1-3 for every arm, then 4-6), warm start W150 before W300, so a study cut
# short still covers every arm of the first warm start.
#
#   bash tools/e4_shaping_study.sh OUT [STOP_AT]     # OUT: warm starts and sweeps; STOP_AT: e.g. 11:22 (UTC)
#   python3 tools/store_runs.py OUT/sweeps/* --study reports/e4_shaping --report e4_shaping_study
#   python3 tools/regenerate_report.py reports/e4_shaping
#
# No sweep starts after STOP_AT (default: none); the sweeps not started are listed in OUT/progress.log.
# One process at a time, 1 thread (the warm starts are bit-identical only at a fixed thread count), nice 10.
set -euo pipefail
OUT=${1:?usage: bash tools/e4_shaping_study.sh OUT [STOP_AT]}
STOP_AT=${2:-}
cd "$(dirname "$0")/.."
export OMP_NUM_THREADS=1
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
mkdir -p "$OUT/sweeps"
LOG="$OUT/progress.log"

declare -A STEPS=([w150]=150 [w300]=300)  # supervised steps: W300 is the shaping study's (at ceiling), W150 is not
declare -A ARM=(
  [vanilla]="optimizer.lr=1e-12 optimizer.min_lr=1e-12 trainer.steps=1 trainer.eval_every=1"
  [baseline]="shaping=none"
  [kimi_length]="shaping=kimi_length shaping.warmup_steps=10"
  [dapo_overlong]="shaping=dapo_overlong shaping.dapo_overlong.cache_length=11"
  [step_grpo_reward]="shaping=step_grpo"
  [grsp_ascending]="shaping=grsp shaping.grsp.weight_order=ascending"
  [step_grpo_advantage]="shaping=step_grpo shaping.combine=advantage"
  [grsp_descending]="shaping=grsp shaping.grsp.weight_order=descending"
)
MAIN_ARMS="vanilla baseline kimi_length dapo_overlong step_grpo_reward grsp_ascending"
EXTRA_ARMS="step_grpo_advantage grsp_descending"  # W150 only

past_stop() { [[ -n "$STOP_AT" ]] && (($(date -u +%s) >= $(date -u -d "$STOP_AT" +%s))); }

for ws in w150 w300; do
  if [[ ! -f "$OUT/ws_$ws/warm_start.json" ]]; then
    echo "$(date -u +%T) warm start $ws" >>"$LOG"
    nice -n 10 python3 tools/sft_warmstart.py --out "$OUT/ws_$ws" --steps "${STEPS[$ws]}" \
      --digits 5 --min-digits 2 --max-waits 5 >"$OUT/ws_$ws.log" 2>&1
  fi
done

for ws in w150 w300; do
  arms=$MAIN_ARMS
  [[ $ws == w150 ]] && arms="$arms $EXTRA_ARMS"
  for block in a b; do
    seeds=$([[ $block == a ]] && echo 1,2,3 || echo 4,5,6)
    for arm in $arms; do
      sweep="$OUT/sweeps/${ws}_${arm}_$block"
      if past_stop; then
        echo "$(date -u +%T) not started (past $STOP_AT): $sweep" >>"$LOG"
        continue
      fi
      [[ -d "$sweep" ]] && { echo "$(date -u +%T) exists, kept: $sweep" >>"$LOG"; continue; }
      echo "$(date -u +%T) start $sweep" >>"$LOG"
      # shellcheck disable=SC2086  # the arm's overrides are words
      nice -n 10 python3 -m gspo_megatron.train --multirun +experiment=e4_shaping \
        "model.hf_checkpoint=$OUT/ws_$ws" "trainer.seed=$seeds" "hydra.sweep.dir=$sweep" \
        "hydra.sweep.subdir=${ws}-${arm}_s\${trainer.seed}" ${ARM[$arm]} >"$sweep.log" 2>&1 ||
        echo "$(date -u +%T) FAILED (see $sweep.log): $sweep" >>"$LOG"
    done
  done
done
echo "$(date -u +%T) done" >>"$LOG"
