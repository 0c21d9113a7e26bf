#!/usr/bin/env bash
# The routing-stability study as one command: the supervised warm start (once; ~30 s), the sweep,
# the report.
#   bash tools/routing_study.sh                            # +experiment=routing_stability (36 runs)
#   bash tools/routing_study.sh routing_stability_quick    # 8 runs, <= 15 min
#   bash tools/routing_study.sh routing_stability trainer.steps=24   # extra Hydra overrides
# Writes multirun/<experiment>_<timestamp>/ (one run directory per config and seed) and
# reports/<experiment>/{study.html,study.json,comparison.*}.
set -euo pipefail
cd "$(dirname "$0")/.."
experiment="${1:-routing_stability}"
shift || true
init=checkpoints/small_moe_reasoner_3to5  # = model.hf_checkpoint in conf/experiment/routing_stability.yaml
if [ ! -f "$init/config.json" ]; then
  python3 tools/sft_warmstart.py --model small_moe --digits 5 --min-digits 3 --steps 100 --out "$init"
fi
sweep="multirun/${experiment}_$(date +%Y%m%d_%H%M%S)"
python3 -m gspo_megatron.train --multirun "+experiment=${experiment}" "hydra.sweep.dir=${sweep}" "$@"
python3 tools/compare_runs.py "$sweep" --out "reports/${experiment}"
