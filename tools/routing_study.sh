#!/usr/bin/env bash
# The routing-stability study as one command: the supervised warm start (once; ~30 s), the sweep,
# the report.
#   bash tools/routing_study.sh                            # +experiment=routing_stability (36 runs)
#   bash tools/routing_study.sh routing_stability_quick    # 8 runs, <= 15 min
#   bash tools/routing_study.sh routing_stability_miniature  # 8 runs of 2 steps, tiny model (test reference)
#   bash tools/routing_study.sh routing_stability_offpolicy  # off-policy pressure arms (issue 31; hours)
#   bash tools/routing_study.sh e1_routing_shape     # E1: 4 routing shapes at width 64 (issue 67; ~50 min)
#   bash tools/routing_study.sh e1_qwen35_shape      # E1 on Qwen3.5's shape, 8 and 40 x 256 top-8 (~40 min)
#   bash tools/routing_study.sh routing_stability trainer.steps=24   # extra Hydra overrides
# Writes multirun/<experiment>_<timestamp>/ (one run directory per config and seed), stores its runs in
# reports/<experiment>/ (store.json, stored_runs/<run>/: manifest, config, gzip'd per-step metrics and routing;
# tools/store_runs.py) and writes the report from that store alone (tools/regenerate_report.py:
# study.html, study.json, comparison.*), so `python3 tools/regenerate_report.py reports/<experiment> --check`
# rebuilds its numbers bit for bit from the repository. Every run records its commit, command, threads and
# warm start (provenance.json, kept in the manifest) and the report records them, the seeds and the configs.
# One CPU thread per run unless OMP_NUM_THREADS says otherwise: torch's CPU results depend on the
# thread count, so the same command reproduces a report only at the same count (runs record it).
set -euo pipefail
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
cd "$(dirname "$0")/.."
experiment="${1:-routing_stability}"
shift || true
# the supervised warm start each experiment's model.hf_checkpoint names (none: random init); kept when
# its warm_start.json names this command, a clean checkout of this commit and this thread count
report=routing_study  # tools/regenerate_report.py's report kind
case "$experiment" in
  routing_stability_miniature | *random_init) init="" ;;
  e1_routing_shape | e1_qwen35_shape) init="" report=routing_shape_study  # a warm start per shape, checkpoints/e1_<shape>
    shapes="width64_6x32_top4 width64_6x128_top8 width64_24x128_top8 width64_48x128_top8"
    if [ "$experiment" = e1_qwen35_shape ]; then shapes="width64_qwen35_8x256_top8 width64_qwen35_40x256_top8"; fi
    for shape in $shapes; do
      python3 tools/sft_warmstart.py --model "$shape" --digits 5 --min-digits 3 --steps 100 \
        --out "checkpoints/e1_${shape}" --keep-if-current
    done ;;
  routing_stability_offpolicy) init=checkpoints/small_moe_reasoner_3to8 digits=8 ;;
  *) init=checkpoints/small_moe_reasoner_3to5 digits=5 ;;
esac
if [ -n "$init" ]; then
  python3 tools/sft_warmstart.py --model small_moe --digits "$digits" --min-digits 3 --steps 100 --out "$init" \
    --keep-if-current
fi
sweep="multirun/${experiment}_$(date +%Y%m%d_%H%M%S)"
python3 -m gspo_megatron.train --multirun "+experiment=${experiment}" "hydra.sweep.dir=${sweep}" "$@"
python3 tools/store_runs.py "$sweep" --study "reports/${experiment}" --report "$report"
python3 tools/regenerate_report.py "reports/${experiment}"
