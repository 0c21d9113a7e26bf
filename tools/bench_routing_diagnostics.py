"""Overhead of the routing diagnostics: step time with them on (every step) vs off, same run.

    python tools/bench_routing_diagnostics.py                       # the default run's task, 12 steps
    python tools/bench_routing_diagnostics.py --steps 20 algorithm=grpo_routing_replay
    python tools/bench_routing_diagnostics.py rollout.max_new_tokens=8 task.reward=last_number

Runs the real trainer twice in spawned processes with identical seeds -- ``routing.enabled=false``
(baseline) and ``routing.enabled=true routing.every_n_steps=1`` with the configured kinds (default
``update`` and ``rollout_vs_train``; add ``'routing.kinds=[update,rollout_vs_train,minibatch]'``
to include the drift across updates, which costs a forward pass per update) -- and prints
the median wall time of ``train_step`` for each and the ratio. Each variant runs twice, in ABBA
order; the first two steps of each run are warm-up and not counted. Target: < 5% at the
default sampling rate (``routing.every_n_steps`` in conf; every step here, the worst case).
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time


def timed_worker(ctx, overrides: list[str], run_dir: str) -> list[float]:
    import gspo_megatron.loop.trainer as trainer_module
    from gspo_megatron.config.compose import compose
    from gspo_megatron.train import run

    durations: list[float] = []
    original = trainer_module.RLTrainer.train_step

    def timed(self):
        start = time.perf_counter()
        out = original(self)
        durations.append(time.perf_counter() - start)
        return out

    trainer_module.RLTrainer.train_step = timed  # type: ignore[method-assign]  # timed, then run as usual
    run(compose(overrides), run_dir)
    return durations


def main(argv=None) -> None:
    from gspo_megatron.testing.distributed import run_distributed

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args(argv)
    base = [
        f"trainer.steps={args.steps}",
        "trainer.eval_every=0",
        "logging.progress=false",
        "logging.tensorboard=false",
        *args.overrides,
    ]
    variants = {
        "diagnostics off": base + ["routing.enabled=false"],
        "diagnostics every step": base + ["routing.enabled=true", "routing.every_n_steps=1"],
    }
    # ABBA order: drifts of the machine (frequency, other load) hit both variants alike
    steps: dict[str, list[float]] = {name: [] for name in variants}
    for name in ["diagnostics off", "diagnostics every step", "diagnostics every step", "diagnostics off"]:
        with tempfile.TemporaryDirectory() as run_dir:
            (durations,) = run_distributed(timed_worker, 1, variants[name], run_dir, timeout=1800)
        steps[name] += durations[2:]
    medians = {name: statistics.median(values) for name, values in steps.items()}
    for name, median in medians.items():
        print(f"{name:24s} median step {median * 1000:8.1f} ms over {len(steps[name])} steps (2 runs)")
    ratio = medians["diagnostics every step"] / medians["diagnostics off"]
    print(f"overhead: {100 * (ratio - 1):+.1f}% of step time (ratio {ratio:.3f}); target < 5%")


if __name__ == "__main__":
    main()
