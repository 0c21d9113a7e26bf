"""This project against Hugging Face TRL's GRPOTrainer on the same work: per-round time and its split.

    pip install -e '.[bench]'                       # TRL and what it needs (not part of setup.sh)
    python tools/bench_vs_trl.py --shape medium      # 4-layer 16-expert MoE, 32 x <= 64-token answers
    python tools/bench_vs_trl.py --shape default     # the main job: fine-grained MoE, 256 three-token answers
    python tools/bench_vs_trl.py --shape medium trainer.old_log_probs=rollout  # any of our overrides
    python tools/bench_vs_trl.py --ours-only --shape default   # our side alone (no TRL needed): our column

Same work on both sides, all taken from this project's composed config:
- the same weights: one HF checkpoint (``save_pretrained`` of a transformers Qwen3-MoE with this
  config's shape), loaded by TRL and by our run (``model.hf_checkpoint``);
- the same tokenizer (``rollout/data/symbol_hf.py``: the symbol tokenizer as an HF fast tokenizer, same ids),
  the same prompts in the same order and the same reward function on the same records;
- the same batch: ``prompts_per_step x group_size`` completions per round (TRL's generation batch,
  ``num_generations = group_size``), ``updates_per_rollout`` optimizer steps per round on equal
  slices, each in micro-batches of ``micro_batch_size`` rows (TRL's per-device batch, with gradient
  accumulation making up the mini-batch; its old log-probs are computed in the same chunks), at most
  ``max_new_tokens`` new tokens, the same sampling temperature;
- the same torch thread count in both processes (``--threads``; default torch's own here: the cores,
  or ``OMP_NUM_THREADS``. A plain ``python -m gspo_megatron.train`` follows ``core/threads.py``'s rule
  instead -- 1 on 2 cores with the main job's asynchronous rollout -- so pass ``--threads`` to match it);
- the same algorithm: GSPO as TRL spells it (``importance_sampling_level="sequence"``, ``loss_type
  ="grpo"``: mean over tokens, then over sequences) or GRPO (token level), the same clip range, no KL,
  group-normalised advantages; Adam with the same lr (constant), betas, eps, and gradient clipping.
  TRL computes old log-probs with a forward pass because generation and updates are misaligned
  (``steps_per_generation > gradient_accumulation_steps``), as our ``old_log_probs=trainer`` does.

TRL's keywords are read through the typed sections the trainer reads (``trl_settings``), so a renamed
key fails the fast tier's test of it, not TRL's process at benchmark time. A child that dies ends the
benchmark at once (within a second) with its traceback, or the signal that killed it (``await_child``);
each TRL child's pid is printed as it starts; ``--timeout`` bounds each side's run.

Each side runs ``--rounds`` rounds in a fresh process; the sides alternate ``--reps`` times (ours,
TRL, ours, TRL, ...) so load on the shared cores hits both alike. The first round of every run is
warm-up and is not counted; per-round times are the median over all later rounds of all repetitions.
Reported apart, medians over the repetitions with their min-max: start-up, from starting the
process to the beginning of the first round (ours: the first ``train_step``, after the build and the
first weight sync; TRL: ``on_train_begin``, after its optimizer is built, where its round clock
starts), also as the CPU seconds the process itself had used by then (steadier than wall time on a
loaded machine); and wind-down, from the end of the last round to the process's exit (ours writes
the final checkpoint, the run summary and the routing report there; TRL saves nothing).

Phases: ours as ``tools/bench_rl_step.py`` splits them (generate, reward, advantages, old_logp,
update, weight_sync, other). TRL: ``generate`` (``_generate_single_turn``), ``reward``
(``_calculate_rewards``), ``old_logp+prep`` (the rest of ``_generate_and_score_completions``: old
log-probs, advantages, padding), ``update`` (the rest of the round: forward/backward/optimizer and
the Trainer's own bookkeeping). Completion tokens per second count the tokens each side generated.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import queue
import signal
import statistics
import sys
import tempfile
import time
import traceback
from pathlib import Path

SHAPES = {
    # the main job, as conf/config.yaml composes it
    "default": [],
    # the medium shape: 4-layer Qwen3-MoE, hidden 256, 16 experts top-4; 32 completions of
    # <= 64 tokens, 4 updates per round (8 rows each)
    "medium": [
        "model.num_layers=4",
        "model.hidden_size=256",
        "model.num_attention_heads=4",
        "model.num_kv_heads=2",
        "model.head_dim=64",
        "model.num_experts=16",
        "model.top_k=4",
        "model.moe_intermediate_size=128",
        "rollout.max_new_tokens=64",
        "rollout.group_size=8",
        "trainer.prompts_per_step=4",
        "trainer.updates_per_rollout=4",
        "trainer.micro_batch_size=8",
    ],
}
# the schedule both sides can express: constant lr, no warm-up; no evaluation, logging or checkpoints
COMMON = [
    "optimizer.decay_style=constant",
    "optimizer.warmup_steps=0",
    "trainer.eval_every=0",
    "logging.progress=false",
    "logging.tensorboard=false",
]


def compose_work(overrides: list[str]):
    from gspo_megatron.config.compose import compose
    from gspo_megatron.config.schema import to_train_config
    from gspo_megatron.config.store import register_configs

    register_configs()
    return to_train_config(compose(overrides))


def write_shared_checkpoint(cfg, out: Path) -> None:
    """The initial weights both sides load: transformers' Qwen3-MoE of this shape, and the tokenizer."""
    import torch
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    from gspo_megatron.policy.models.hf_checkpoint import hf_config_dict
    from gspo_megatron.rollout.data.symbol_hf import symbol_tokenizer_as_hf
    from gspo_megatron.rollout.data.tokenizer import SymbolTokenizer

    if cfg.tokenizer.kind != "symbol":
        raise SystemExit(f"tokenizer.kind={cfg.tokenizer.kind}: the benchmark builds the symbol tokenizer only")
    torch.manual_seed(cfg.model.init_seed)
    model = Qwen3MoeForCausalLM(Qwen3MoeConfig(**hf_config_dict(cfg.model, torch.float32)))
    model.save_pretrained(out)
    symbol_tokenizer_as_hf(SymbolTokenizer(cfg.model.vocab_size)).save_pretrained(out)


def task_work(cfg, count: int):
    """The prompts our run draws, in its order (the task is deterministic in its seed), the reward
    function our run scores with, and the tokenizer that decodes what was generated."""
    from gspo_megatron.rollout.data.tasks import build_task
    from gspo_megatron.rollout.data.tokenizer import build_tokenizer
    from gspo_megatron.rollout.rewards.registry import resolve_reward

    tokenizer = build_tokenizer(cfg.tokenizer.kind, cfg.tokenizer.path, cfg.model.vocab_size)
    task = build_task(cfg.task, tokenizer)
    reward = resolve_reward(cfg.shaping.reward_name(cfg.task.reward or task.reward))
    return task.next_batch(count), reward, tokenizer


# ---------------------------------------------------------------- TRL side (a fresh process per run)
def trl_batch(cfg) -> tuple[int, int]:
    """(TRL's per-device batch, its gradient accumulation) for our micro-batches: one mini-batch (rows /
    updates) cut into ``micro_batch_size`` rows each; TRL's per-device batch is its micro-batch and
    gradient accumulation makes up the mini-batch."""
    rows = cfg.trainer.prompts_per_step * cfg.rollout.group_size
    per_update = rows // cfg.trainer.updates_per_rollout
    micro = min(cfg.trainer.micro_batch_size, per_update)
    return micro, per_update // micro


def trl_settings(cfg, rounds: int, out_dir: str) -> dict:
    """``GRPOConfig``'s keywords for our run, read through the typed sections the trainer reads
    (``TrainConfig``: trainer, rollout, algorithm.loss, algorithm.kl, optimizer), so a renamed or moved
    key fails here, in the fast tier's test of this function, not in TRL's process at benchmark time."""
    from gspo_megatron.algorithms.losses import SEQUENCE_LEVEL_LOSSES

    t, r, loss, kl, o = cfg.trainer, cfg.rollout, cfg.algorithm.loss, cfg.algorithm.kl, cfg.optimizer
    micro, accumulation = trl_batch(cfg)
    return dict(
        output_dir=out_dir,
        use_cpu=True,
        bf16=False,
        seed=t.seed,
        per_device_train_batch_size=micro,
        gradient_accumulation_steps=accumulation,
        steps_per_generation=t.updates_per_rollout * accumulation,
        num_iterations=1,
        num_generations=r.group_size,
        max_completion_length=r.max_new_tokens,
        temperature=r.temperature,
        top_p=r.top_p,
        max_steps=rounds * t.updates_per_rollout,
        learning_rate=o.lr,
        lr_scheduler_type="constant",
        warmup_steps=0,
        weight_decay=o.weight_decay,
        adam_beta1=o.adam_beta1,
        adam_beta2=o.adam_beta2,
        adam_epsilon=o.adam_eps,
        max_grad_norm=o.clip_grad,
        beta=kl.coef,
        epsilon=loss.clip_low,
        epsilon_high=loss.clip_high,
        importance_sampling_level="sequence" if loss.name in SEQUENCE_LEVEL_LOSSES else "token",
        loss_type="grpo",
        scale_rewards="group",
        shuffle_dataset=False,
        remove_unused_columns=False,
        report_to="none",
        save_strategy="no",
        logging_strategy="no",
        disable_dropout=True,
        dataloader_num_workers=0,
    )


def trl_run(cfg, hf_dir: str, rounds: int, out_dir: str, threads: int) -> dict:
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from gspo_megatron.rollout.rewards.pool import call_reward

    first_round: dict[str, float] = {}
    torch.set_num_threads(threads)
    records, score, tokenizer = task_work(cfg, cfg.trainer.prompts_per_step * rounds)
    dataset = Dataset.from_dict({"prompt": [rec.prompt for rec in records], "record": list(range(len(records)))})
    generated_tokens = []

    def reward(prompts, completions, completion_ids, record, **_):
        """Our reward function on the text our run would score: the generated ids decoded with the stop
        token kept (TRL's ``completions`` drop it, and our verifiers check that a response ended). Called
        as the trainer's reward pool calls it (``call_reward``: a plain number or bool becomes a
        RewardResult, a failure scores 0)."""
        generated_tokens.append(sum(len(ids) for ids in completion_ids))
        return [
            call_reward(score, tokenizer.decode(ids), records[i]).reward
            for ids, i in zip(completion_ids, record, strict=True)
        ]

    args = GRPOConfig(**trl_settings(cfg, rounds, out_dir))
    model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32)
    trainer = GRPOTrainer(
        model=model,
        reward_funcs=[reward],
        args=args,
        train_dataset=dataset,
        processing_class=AutoTokenizer.from_pretrained(hf_dir),
    )
    phases = {name: _wrap(trainer, name) for name in ("_generate_single_turn", "_calculate_rewards")}
    phases["score"] = _wrap(trainer, "_generate_and_score_completions")

    class RoundClock(TrainerCallback):
        """Optimizer step k lasts from the end of step k-1 (or the start of training) to its own end,
        so whatever the Trainer does between steps (fetching the next batch included) is counted."""

        def __init__(self):
            self.step_seconds, self._last = [], 0.0

        def on_train_begin(self, *_, **__):
            self._last = time.perf_counter()
            first_round.update(at=time.time(), cpu=time.process_time())

        def on_step_end(self, *_, **__):
            now = time.perf_counter()
            self.step_seconds.append(now - self._last)
            self._last = now

    clock = RoundClock()
    trainer.add_callback(clock)
    trainer.train()
    per = cfg.trainer.updates_per_rollout
    out = []
    for k in range(rounds):
        step = sum(clock.step_seconds[k * per : (k + 1) * per])
        gen, rew, both = (phases[n][k] for n in ("_generate_single_turn", "_calculate_rewards", "score"))
        out.append(
            {
                "generate": gen,
                "reward": rew,
                "old_logp+prep": both - gen - rew,
                "update": step - both,
                "step": step,
                "tokens": generated_tokens[k],
            }
        )
    return {"first_round": first_round, "rounds": out}


def _wrap(trainer, name: str) -> list[float]:
    seconds: list[float] = []
    inner = getattr(trainer, name)

    def timed(*args, **kwargs):
        start = time.perf_counter()
        try:
            return inner(*args, **kwargs)
        finally:
            seconds.append(time.perf_counter() - start)

    setattr(trainer, name, timed)
    return seconds


def _trl_process(cfg, hf_dir: str, rounds: int, threads: int, results) -> None:
    """TRL's run in its own process: ("ok", numbers) or ("error", its traceback) on ``results``."""
    try:
        with tempfile.TemporaryDirectory(prefix="bench_trl_") as out_dir:
            results.put(("ok", trl_run(cfg, hf_dir, rounds, out_dir, threads)))
    except BaseException:  # whatever ended the run must reach the parent
        results.put(("error", traceback.format_exc()))
        raise


def run_trl(cfg, hf_dir: str, rounds: int, threads: int, timeout_s: float = 3600.0) -> dict:
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    started = time.time()
    process = ctx.Process(target=_trl_process, args=(cfg, hf_dir, rounds, threads, results))
    process.start()
    print(f"TRL run started (pid {process.pid})", flush=True)
    try:
        result = await_child(process, results, "the TRL run", timeout_s)
    finally:
        if process.is_alive():  # an error or Ctrl-C here: the child goes with the benchmark
            process.kill()
        process.join(timeout=30)
    return {**result, **outside_rounds(started, result["first_round"], time.time(), result["rounds"])}


def await_child(process, results, what: str, timeout_s: float, poll_s: float = 1.0):
    """The child's result, waiting at most ``timeout_s``; a child that dies or fails ends the wait at
    once (within ``poll_s``) with a SystemExit naming its traceback or the signal that killed it.

    Each look at the queue is bounded by ``poll_s``, between them the child's liveness is checked: a
    plain ``queue.get()`` waits forever on a child that died without writing (issue 65: an
    AttributeError in TRL's process left the benchmark waiting for 10 minutes and more)."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            kind, payload = results.get(timeout=poll_s)
            break
        except queue.Empty:
            if not process.is_alive():
                try:  # what it wrote just before it exited may still be in the pipe: one more bounded look
                    kind, payload = results.get(timeout=poll_s)
                    break
                except queue.Empty:
                    raise SystemExit(f"{what} (pid {process.pid}) died: {exit_text(process.exitcode)}") from None
            if time.monotonic() > deadline:
                raise SystemExit(
                    f"{what} (pid {process.pid}) gave no result within {timeout_s:.0f} s (--timeout)"
                ) from None
    if kind == "error":
        raise SystemExit(f"{what} (pid {process.pid}) failed:\n{payload}")
    return payload


def exit_text(exitcode: int | None) -> str:
    """A process's exit code in words: a negative code is the signal that ended it."""
    if exitcode is not None and exitcode < 0:
        return f"killed by signal {-exitcode} ({signal.Signals(-exitcode).name}), no traceback"
    return f"exit code {exitcode} without a result"


def outside_rounds(started: float, first_round: dict[str, float], ended: float, rounds: list[dict]) -> dict:
    """Start-up (process start to the first round, wall and the process's CPU seconds) and wind-down
    (the last round's end to the process's exit), from wall-clock times (``time.time()``: the same
    clock in parent and child)."""
    startup = first_round["at"] - started
    return {
        "startup": startup,
        "startup_cpu": first_round["cpu"],
        "wind_down": ended - started - startup - sum(r["step"] for r in rounds),
    }


# ---------------------------------------------------------------- our side
def run_ours(cfg, overrides: list[str], rounds: int, threads: int, timeout_s: float = 3600.0) -> dict:
    from gspo_megatron.testing.distributed import run_distributed

    with tempfile.TemporaryDirectory(prefix="bench_ours_") as run_dir:
        started = time.time()
        (result,) = run_distributed(
            _ours_worker,
            1,
            [f"trainer.steps={rounds}", *overrides],
            run_dir,
            timeout=timeout_s,
            threads_per_rank=threads,
        )[:1]
        ended = time.time()
        records = [json.loads(line) for line in (Path(run_dir) / "metrics.jsonl").read_text().splitlines()]
    steps = result["rounds"]
    rows = cfg.trainer.prompts_per_step * cfg.rollout.group_size
    for step, record in zip(steps, records, strict=False):
        step["tokens"] = record["response/length_mean"] * rows
    return {**result, **outside_rounds(started, result["first_round"], ended, steps)}


def _ours_worker(ctx, overrides: list[str], run_dir: str) -> dict:
    """``tools/bench_rl_step.py``'s worker, also noting when the first round began."""
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from bench_rl_step import _Timed, bench_worker, shadow_method

    from gspo_megatron.loop.trainer import RLTrainer

    first_round: dict[str, float] = {}
    train_step, save = RLTrainer.train_step, _Timed(RLTrainer.save)

    def noting_the_first_round(trainer):
        if not first_round:
            first_round.update(at=time.time(), cpu=time.process_time())
        return train_step(trainer)

    shadow_method(RLTrainer, "train_step", noting_the_first_round)  # this rank's process only
    shadow_method(RLTrainer, "save", lambda trainer, *args, **kwargs: save(trainer, *args, **kwargs))
    rounds = bench_worker(ctx, overrides, run_dir)
    return {"first_round": first_round, "rounds": rounds, "checkpoint": save.seconds[-1] if save.seconds else 0.0}


# ---------------------------------------------------------------- report
OURS = ["generate", "reward", "advantages", "old_logp", "update", "weight_sync", "other"]
TRL = ["generate", "reward", "old_logp+prep", "update"]


def summarise(runs: list[dict], phases: list[str]) -> dict:
    later = [r for run in runs for r in run["rounds"][1:]]
    out = {k: statistics.median(r[k] for r in later) for k in [*phases, "step"]}
    out["tokens_per_s"] = statistics.median(r["tokens"] / r["step"] for r in later)
    for key in ("startup", "startup_cpu", "wind_down", "checkpoint"):
        values = [run.get(key, 0.0) for run in runs]
        out[key], out[f"{key}_spread"] = statistics.median(values), (min(values), max(values))
    out["step_spread"] = (min(r["step"] for r in later), max(r["step"] for r in later))
    return out


def report(ours: dict, trl: dict | None, rounds_counted: int) -> str:
    """The table: our column and TRL's, with the ratio line; ours alone (``--ours-only``) without them."""
    if trl is None:
        return _report_ours(ours, rounds_counted)
    lines = [f"{'':<14}{'ours s':>9}{'TRL s':>9}", f"{'round':<14}{ours['step']:>9.3f}{trl['step']:>9.3f}"]
    lines.append(f"{'  ratio':<14}{ours['step'] / trl['step']:>9.2f}x  (ours / TRL; < 1: ours faster)")
    for name in OURS:
        lines.append(f"  {name:<12}{ours[name]:>9.3f}")
    for name in TRL:
        lines.append(f"  {name:<12}{'':>9}{trl[name]:>9.3f}")
    lines.append(f"{'tokens/s':<14}{ours['tokens_per_s']:>9.0f}{trl['tokens_per_s']:>9.0f}  (completion tokens)")
    for key, label, what in OUTSIDE_ROUNDS:
        (o_min, o_max), (t_min, t_max) = ours[f"{key}_spread"], trl[f"{key}_spread"]
        lines.append(
            f"{label:<14}{ours[key]:>9.1f}{trl[key]:>9.1f}  ({what}; min-max ours {o_min:.1f}-{o_max:.1f}, "
            f"TRL {t_min:.1f}-{t_max:.1f})"
        )
    (o_min, o_max) = ours["checkpoint_spread"]
    lines.append(
        f"{'  checkpoint':<14}{ours['checkpoint']:>9.1f}{'':>9}  (ours: writing the final checkpoint, part of the "
        f"wind-down; TRL writes none; min-max {o_min:.1f}-{o_max:.1f})"
    )
    lines.append(
        f"round min-max  ours {ours['step_spread'][0]:.3f}-{ours['step_spread'][1]:.3f}  "
        f"TRL {trl['step_spread'][0]:.3f}-{trl['step_spread'][1]:.3f}; medians over {rounds_counted} rounds each"
    )
    return "\n".join(lines)


OUTSIDE_ROUNDS = (
    ("startup", "start-up", "process start to the first round"),
    ("startup_cpu", "  CPU s", "the process's CPU seconds by then"),
    ("wind_down", "wind-down", "the last round's end to the process's exit"),
)


def _report_ours(ours: dict, rounds_counted: int) -> str:
    lines = [f"{'':<14}{'ours s':>9}", f"{'round':<14}{ours['step']:>9.3f}"]
    lines += [f"  {name:<12}{ours[name]:>9.3f}" for name in OURS]
    lines.append(f"{'tokens/s':<14}{ours['tokens_per_s']:>9.0f}  (completion tokens)")
    for key, label, what in OUTSIDE_ROUNDS:
        low, high = ours[f"{key}_spread"]
        lines.append(f"{label:<14}{ours[key]:>9.1f}  ({what}; min-max {low:.1f}-{high:.1f})")
    lines.append(
        f"{'  checkpoint':<14}{ours['checkpoint']:>9.1f}  (writing the final checkpoint, part of the wind-down)"
    )
    low, high = ours["step_spread"]
    lines.append(
        f"round min-max  ours {low:.3f}-{high:.3f}; medians over {rounds_counted} rounds; no TRL run (--ours-only)"
    )
    return "\n".join(lines)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", choices=sorted(SHAPES), default="medium")
    parser.add_argument("--rounds", type=int, default=6, help="rounds per run (the first is warm-up)")
    parser.add_argument("--reps", type=int, default=2, help="runs per side, alternating")
    parser.add_argument(
        "--threads",
        type=int,
        default=None,
        help="torch threads of each side's process (default: torch's own here: the cores, or OMP_NUM_THREADS)",
    )
    parser.add_argument("--json", default=None, help="also write the raw per-round numbers here")
    parser.add_argument("--ours-only", action="store_true", help="run our side alone (no TRL needed): our column")
    parser.add_argument("--timeout", type=float, default=3600.0, help="seconds each side's run may take")
    parser.add_argument("overrides", nargs="*", help="our Hydra overrides (applied to both sides' config)")
    args = parser.parse_args(argv)
    if args.rounds < 2:
        parser.error("--rounds must be >= 2 (the first round is warm-up)")
    if not args.ours_only:
        try:
            import trl  # noqa: F401
        except ImportError:
            raise SystemExit(
                "TRL is not installed: pip install -e '.[bench]' (or --ours-only: our side alone)"
            ) from None
    import torch

    threads = args.threads or torch.get_num_threads()
    with tempfile.TemporaryDirectory(prefix="bench_vs_trl_") as tmp:
        hf_dir = str(Path(tmp) / "init")
        overrides = [*SHAPES[args.shape], *COMMON, *args.overrides]
        cfg = compose_work(overrides)
        write_shared_checkpoint(cfg, Path(hf_dir))
        overrides.append(f"model.hf_checkpoint={hf_dir}")
        cfg = compose_work([*overrides, f"trainer.steps={args.rounds}"])
        ours_runs, trl_runs = [], []
        for rep in range(args.reps):
            ours_runs.append(run_ours(cfg, overrides, args.rounds, threads, args.timeout))
            ours_s = statistics.median(r["step"] for r in ours_runs[-1]["rounds"][1:])
            line = f"rep {rep + 1}/{args.reps}: ours {ours_s:.3f} s/round"
            if not args.ours_only:
                trl_runs.append(run_trl(cfg, hf_dir, args.rounds, threads, args.timeout))
                line += f", TRL {statistics.median(r['step'] for r in trl_runs[-1]['rounds'][1:]):.3f} s/round"
            print(line, flush=True)
    print(f"shape {args.shape}; {threads} torch thread(s) per side; overrides: {' '.join(overrides[:-1])}")
    trl_summary = None if args.ours_only else summarise(trl_runs, TRL)
    print(report(summarise(ours_runs, OURS), trl_summary, (args.rounds - 1) * args.reps))
    if args.json:
        Path(args.json).write_text(json.dumps({"ours": ours_runs, "trl": trl_runs}, indent=1))


if __name__ == "__main__":
    main()
