"""Every ``tools/bench_*.py`` runs at its smallest shape and prints the lines its reader looks for (issue 65:
a benchmark nothing ran broke unnoticed). The output's structure is asserted -- the ratio lines, the
columns -- never a time.

Fast tier: ``bench_loss_head.py`` (tensor functions, in this process). Every other tool is ``slow``, and
says why in ``SLOW_BECAUSE``: it starts ranks or processes, or builds megatron's model, which needs its
process-wide CPU bridges and a process group (``policy/cpu_bridges.py``), in its own process.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from gspo_megatron.testing.train_runs import TINY_JOB

ROOT = Path(__file__).resolve().parents[3]
TOOLS = ROOT / "tools"
NUMBER = r"[-+]?\d+(?:\.\d+)?"
SMALL_RUN = ["trainer.prompts_per_step=2", "rollout.group_size=2"]  # the main job with 4 rows a step
# the tiny model on the one-token task with 4 rows a step, where a tool's output does not depend on the job:
# bench_routing_diagnostics.py's 4 runs and bench_threads.py's 2 processes took 22 s each with the main job
# (CI, issue 65) and about a fifth to two fifths less with this one (alternated runs on 2 loaded cores)
TINY_RUN = [*SMALL_RUN, *TINY_JOB]

# tool -> (its smallest arguments, the lines its output must hold: one regex each, matched per line)
SMOKE: dict[str, tuple[list[str], list[str]]] = {
    "bench_loss_head.py": (
        ["--tokens", "64", "--vocab", "128", "--seq-len", "16", "--repeats", "1", "--threads", "1"],
        [
            rf"^ours \(log-probs \+ gspo\)\s+median\s+{NUMBER} ms\s+min\s+{NUMBER} ms\s+peak",
            rf"^F\.cross_entropy\s+median\s+{NUMBER} ms",
            rf"^ratio ours / cross_entropy: time \(median\) {NUMBER}x, time \(min\) {NUMBER}x, peak memory {NUMBER}x$",
        ],
    ),
    "bench_async.py": (
        ["--steps", "2", "--warmup", "1", "--reps", "1", *SMALL_RUN, "model=tiny", "rollout.max_new_tokens=2"],
        [
            r"^arm\s+steps\s+tokens/s\s+x sync\s+trainer idle\s+engine idle\s+age 0\s+age 1\s+age 2\s+age 3\s+age 4$",
            rf"^sync\s+1\s+{NUMBER}\s+1\.00x\s+{NUMBER}\s+{NUMBER}\s+1\.000(\s+0\.000){{4}}$",
            *(
                rf"^{arm}\s+1\s+{NUMBER}\s+{NUMBER}x(\s+{NUMBER}){{7}}$"
                for arm in ("one_step", "stream_k2", "stream_k4")
            ),
        ],
    ),
    "bench_embedded_engine.py": (
        ["--hidden", "32", "--layers", "1", "--experts", "2", "--batch", "2", "--new-tokens", "4", "--repeats", "1"],
        [
            rf"^use_cache=True\s+{NUMBER} tokens/s",
            rf"^use_cache=False\s+{NUMBER} tokens/s",
            rf"^update_weights: \d+ tensors, {NUMBER} MiB in {NUMBER} ms",
            rf"^megatron export_hf_weights: {NUMBER} ms; export -> update_weights .*: {NUMBER} ms$",
            rf"^KV cache speed-up: {NUMBER}x; ",
        ],
    ),
    "bench_hf_export.py": (
        ["--hidden-size", "32", "--layers", "1", "--experts", "2", "--repeats", "1", "--shard-mib", "1"],
        [
            r"^model: \d+ MiB of parameters in \d+ shards",
            rf"^export: {NUMBER} s \(\d+ MB/s\)\s+raw: {NUMBER} s \(\d+ MB/s\)$",
            rf"^export / raw = {NUMBER}\s",
        ],
    ),
    "bench_model.py": (
        [
            "--layouts",
            "single",
            "--batch",
            "2",
            "--seq",
            "8",
            "--micro-batches",
            "1",
            "--warmup",
            "0",
            "--repeats",
            "1",
        ],
        [
            r"^layout\s+ranks\s+step ms\s+tokens/s\s+x 1 rank\s+params MiB/rank\s+x\s+step peak MiB/rank\s+x$",
            rf"^single\s+1\s+{NUMBER}\s+\d+\s+1\.00\s+{NUMBER}\s+1\.00\s+{NUMBER}\s+1\.00$",
        ],
    ),
    "bench_plan_memory.py": (
        ["--shapes", "tiny"],
        [
            rf"^tiny\s+tokens=\s*\d+ measured=\s*{NUMBER} MiB predicted=\s*{NUMBER} MiB predicted/measured={NUMBER}$",
            rf"^worst factor {NUMBER} \((within|OUTSIDE) the {NUMBER}x tolerance\)$",
        ],
    ),
    "bench_rank_start.py": (
        ["--ranks", "1", "--repeats", "1"],
        [
            rf"^fork server\s+median\s+{NUMBER} s\s+min\s+{NUMBER} s",
            rf"^spawn\s+median\s+{NUMBER} s\s+min\s+{NUMBER} s",
            rf"^fork server / spawn \(median\): {NUMBER}$",
        ],
    ),
    "bench_token_budget.py": (
        ["--rows", "4", "--prompt", "4", "--min-response", "2", "--max-response", "8", "--micro-batch-size", "2"]
        + ["--budget", "32", "--hidden", "32", "--layers", "1", "--rounds", "1"],
        [
            rf"^padded to longest row\s+micro-batches\s+\d+\s+padded-token fraction {NUMBER}\s+update {NUMBER} s",
            rf"^token budget 32\s+micro-batches\s+\d+\s+padded-token fraction {NUMBER}\s+update {NUMBER} s",
            rf"^update time padded / budget: {NUMBER}x",
        ],
    ),
    "bench_rl_step.py": (
        ["--steps", "2", "--gemm-share", *SMALL_RUN],
        [
            r"^phase\s+first step s\s+mean s\s+share$",
            *(
                rf"^{phase}\s+{NUMBER}\s+{NUMBER}\s+{NUMBER}%$"
                for phase in ("generate", "reward", "old_logp", "update")
            ),
            rf"^step\s+{NUMBER}\s+{NUMBER}\s+100\.0%$",
            r"^--- GEMMs per phase, torch\.profiler over steps 2\.\.2 \(rank 0\)$",
            *(
                rf"^{phase}\s+{NUMBER}\s+{NUMBER}\s+{NUMBER}\s+{NUMBER}%\s+{NUMBER}\s+{NUMBER}$"
                for phase in ("generate", "old_logp", "update", "three phases")
            ),
        ],
    ),
    "bench_routing_diagnostics.py": (
        ["--steps", "3", *TINY_RUN],
        [
            rf"^diagnostics off\s+median step\s+{NUMBER} ms over \d+ steps",
            rf"^diagnostics every step\s+median step\s+{NUMBER} ms over \d+ steps",
            rf"^overhead: {NUMBER}% of step time \(ratio {NUMBER}\); target < 5%$",
        ],
    ),
    # TRL is optional (the [bench] extra): our side alone here; with TRL, test_bench_vs_trl.py's kill test
    # runs TRL's side too
    "bench_vs_trl.py": (
        ["--ours-only", "--shape", "default", "--rounds", "2", "--reps", "1", *SMALL_RUN],
        [
            rf"^rep 1/1: ours {NUMBER} s/round$",
            r"^\s+ours s$",
            rf"^round\s+{NUMBER}$",
            *(rf"^  {phase}\s+{NUMBER}$" for phase in ("generate", "reward", "old_logp", "update", "weight_sync")),
            rf"^tokens/s\s+{NUMBER}\s+\(completion tokens\)$",
            rf"^start-up\s+{NUMBER}\s+\(process start to the first round",
            rf"^wind-down\s+{NUMBER}\s+\(",
            r"^round min-max  ours .*no TRL run \(--ours-only\)$",
        ],
    ),
    "bench_threads.py": (
        ["--steps", "2", "--reps", "1", "--settings", "1", *TINY_RUN],
        [
            r"^default: (rule: \d+ core|trainer\.cpu_threads=|OMP_NUM_THREADS=)",
            r"^setting\s+threads\s+wall s\s+min-max\s+step s\s+x best$",
            rf"^default\s+\d+\s+{NUMBER}\s+{NUMBER}-{NUMBER}\s+{NUMBER}\s+{NUMBER}x$",
            rf"^OMP_NUM_THREADS=1\s+1\s+{NUMBER}\s+{NUMBER}-{NUMBER}\s+{NUMBER}\s+{NUMBER}x$",
            rf"^default / best = {NUMBER} \(median wall time of the whole job\)$",
        ],
    ),
}
FAST = {"bench_loss_head.py"}
SLOW_BECAUSE = {
    "bench_async.py": "trains four times in a rank",
    "bench_embedded_engine.py": "times the weight sync from a megatron model built in its process",
    "bench_hf_export.py": "builds a megatron model in its process",
    "bench_model.py": "starts gloo ranks",
    "bench_plan_memory.py": "builds a megatron model in its process",
    "bench_rank_start.py": "starts ranks, forked and spawned",
    "bench_token_budget.py": "starts a rank",
    "bench_rl_step.py": "trains in a rank",
    "bench_routing_diagnostics.py": "trains four times in ranks",
    "bench_vs_trl.py": "trains in a rank",
    "bench_threads.py": "runs the main job as processes",
}


def test_every_benchmark_has_a_smoke_run_and_a_tier():
    tools = {path.name for path in TOOLS.glob("bench_*.py")}
    assert set(SMOKE) == tools, f"give each tools/bench_*.py its smallest arguments here: {sorted(tools ^ set(SMOKE))}"
    assert FAST | set(SLOW_BECAUSE) == tools and not FAST & set(SLOW_BECAUSE)


def assert_structure(output: str, patterns: list[str]) -> None:
    lines = output.splitlines()
    missing = [p for p in patterns if not any(re.search(p, line) for line in lines)]
    assert not missing, f"lines not printed: {missing}\noutput:\n{output[-4000:]}"


def test_bench_loss_head_smoke(capsys):
    import bench_loss_head  # tools/ is on the import path (tests/conftest.py)

    arguments, patterns = SMOKE["bench_loss_head.py"]
    bench_loss_head.main(arguments)
    assert_structure(capsys.readouterr().out, patterns)


@pytest.mark.slow
@pytest.mark.parametrize("tool", sorted(SLOW_BECAUSE))
def test_benchmark_smoke(tool, tmp_path):
    arguments, patterns = SMOKE[tool]
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    done = subprocess.run(
        [sys.executable, str(TOOLS / tool), *arguments],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    assert_structure(done.stdout, patterns)
