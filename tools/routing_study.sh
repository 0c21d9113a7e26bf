#!/usr/bin/env bash
# The routing-stability study as one command: the supervised warm start (once; ~30 s), the sweep,
# the report.
#   bash tools/routing_study.sh                            # +experiment=routing_stability (36 runs)
#   bash tools/routing_study.sh routing_stability_quick    # 8 runs, <= 15 min
#   bash tools/routing_study.sh routing_stability_miniature  # 8 runs of 2 steps, tiny model (test reference)
#   bash tools/routing_study.sh routing_stability_offpolicy  # off-policy pressure arms (issue 31; hours)
#   bash tools/routing_study.sh routing_stability trainer.steps=24   # extra Hydra overrides
# Writes multirun/<experiment>_<timestamp>/ (one run directory per config and seed) and
# reports/<experiment>/{study.html,study.json,comparison.*}; every run records its commit and command
# (provenance.json) and the report records them, the seeds and the composed configs.
# One CPU thread per run unless OMP_NUM_THREADS says otherwise: torch's CPU results depend on the
# thread count, so the same command reproduces a report only at the same count (runs record it).
set -euo pipefail
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
cd "$(dirname "$0")/.."
experiment="${1:-routing_stability}"
shift || true
# the supervised warm start each experiment's model.hf_checkpoint names (none: random init); kept when
# its warm_start.json names this command, a clean checkout of this commit and this thread count
case "$experiment" in
  routing_stability_miniature | *random_init) init="" ;;
  routing_stability_offpolicy) init=checkpoints/small_moe_reasoner_3to8 digits=8 ;;
  *) init=checkpoints/small_moe_reasoner_3to5 digits=5 ;;
esac
if [ -n "$init" ]; then
  python3 tools/sft_warmstart.py --model small_moe --digits "$digits" --min-digits 3 --steps 100 --out "$init" \
    --keep-if-current
fi
sweep="multirun/${experiment}_$(date +%Y%m%d_%H%M%S)"
python3 -m gspo_megatron.train --multirun "+experiment=${experiment}" "hydra.sweep.dir=${sweep}" "$@"
python3 tools/compare_runs.py "$sweep" --out "reports/${experiment}"
