"""What a run writes for people: metrics JSONL, the routing records, TensorBoard, optional wandb, progress,
notes, summary.

Only the driver rank writes (the other ranks' log is ``loop/trainer.py:QuietLog``). The run-directory format
is ``core/run_dir.py``'s (shared with the report and comparison tools). On resume, metrics past the
checkpoint's step are cut from ``metrics.jsonl`` so the file holds one line per step, as an uninterrupted
run would.
Every step records ``time/run_wall_s``, the run's wall time up to that step across resumes (the last
kept step's value carried into the resuming process), so the summary times the whole run, not only
the process that finished it.

Design decisions:
- Every number of the summary names its window (``core/run_dir.py``'s "first 20%", "last 20%", "whole run",
  ``window_mean``), the same windows and the same code the routing report and ``tools/compare_runs.py``'s
  verdicts use, so a label means one number wherever it appears (a test builds a run and checks).
- The routing-volatility line is printed whenever a routing kind was measured; what was not measured says
  why (under R3 the old-policy pass replays the engine's routing, so "update" has no free routing to
  compare) instead of the line disappearing.
"""

from __future__ import annotations

import json
import math
import time
from pathlib import Path
from typing import Any

from gspo_megatron.algorithms.ratio_dispersion import LENGTH_BUCKETS, bucket_name
from gspo_megatron.config.schema import TrainConfig
from gspo_megatron.core.provenance import PROVENANCE_FILE, provenance
from gspo_megatron.core.run_dir import (
    CONFIG_FILE,
    FIRST_FIFTH,
    LAST_FIFTH,
    METRICS_FILE,
    ROUTING_FILE,
    WHOLE_RUN,
    JsonlLog,
    ResumeMode,
    drop_records_from_step,
    open_run_file,
    read_jsonl,
    refuse_link,
    resume_mode,
    window_mean,
    write_run_file,
)
from gspo_megatron.policy.checkpoint.store import latest_checkpoint
from gspo_megatron.policy.routing.replay import ReplayMode

RUN_WALL_KEY = "time/run_wall_s"


def open_run_log(cfg: TrainConfig, run_dir: Path, config_yaml: str) -> RunLog:
    """The driver's run log of ``cfg``'s run in ``run_dir``: on resume, what steps past the latest
    checkpoint wrote is cut (they run again)."""
    return RunLog(
        run_dir,
        cfg.trainer.steps,
        tensorboard=cfg.logging.tensorboard,
        wandb_project=cfg.logging.wandb_project if cfg.logging.wandb else None,
        progress=cfg.logging.progress,
        charts=cfg.logging.charts,
        config_yaml=config_yaml,
        resume_step=_resume_step(cfg, run_dir),
        routing=cfg.routing.enabled and cfg.model.is_moe,
        replay=cfg.routing.replay,
    )


def _resume_step(cfg: TrainConfig, run_dir: Path) -> int:
    """The step a resumed run continues after (0: a fresh run)."""
    if resume_mode(cfg.checkpoint.resume) is ResumeMode.false:
        return 0
    path = latest_checkpoint(run_dir)
    return int(path.name.split("_")[-1]) if path is not None else 0


class RunLog:
    def __init__(
        self,
        run_dir: Path,
        total_steps: int,
        *,
        tensorboard: bool,
        wandb_project: str | None,
        progress: bool,
        config_yaml: str,
        charts: bool = True,
        resume_step: int = 0,
        routing: bool = False,
        replay: str = ReplayMode.none,
    ):
        """``routing``: write the steps' routing records to ``routing.jsonl`` (diagnostics on, an MoE model);
        ``replay``: ``routing.replay``, which the summary needs to say why a routing kind was not measured."""
        self.replay = replay
        self.run_dir = run_dir
        run_dir.mkdir(parents=True, exist_ok=True)
        self.config_yaml = config_yaml  # written by ``write_config`` once a resumed checkpoint has loaded
        # Keep what steps 1..resume_step wrote (nothing on a fresh run), as an uninterrupted run would.
        drop_records_from_step(run_dir / METRICS_FILE, resume_step + 1)
        drop_records_from_step(run_dir / ROUTING_FILE, resume_step + 1)
        self.metrics = JsonlLog(run_dir / METRICS_FILE)
        self.routing = JsonlLog(run_dir / ROUTING_FILE) if routing else None
        self.history: list[dict] = read_jsonl(run_dir / METRICS_FILE) if resume_step else []
        self.resume_step = resume_step
        self.charts = charts
        # the wall time earlier processes spent on the steps kept (0 on a fresh run)
        self.wall_before = (_number(self.history[-1].get(RUN_WALL_KEY)) or 0.0) if self.history else 0.0
        self.tb = None
        if tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self.tb = SummaryWriter(str(run_dir / "tensorboard"))
        self.wandb = None
        if wandb_project:
            import wandb  # optional extra

            self.wandb = wandb.init(project=wandb_project, dir=str(run_dir), config={"run_dir": str(run_dir)})
        self.bar = None
        if progress:
            from tqdm import tqdm

            self.bar = tqdm(total=total_steps, initial=resume_step, desc="RL steps", unit="step", dynamic_ncols=True)
        self.started = time.monotonic()

    def write_config(self, **inputs: object) -> None:
        """``config.yaml`` and ``provenance.json`` (commit, command and ``inputs`` such as the thread
        count; a resume keeps the earlier starts under ``previous``, so a run continued on other code
        says so)."""
        write_run_file(self.run_dir / CONFIG_FILE, self.config_yaml)
        path = self.run_dir / PROVENANCE_FILE
        refuse_link(path)  # before reading it: a link's target is neither read nor written
        earlier = json.loads(path.read_text()) if path.is_file() else None
        record = provenance(**inputs)
        if earlier is not None:
            record["previous"] = earlier.pop("previous", []) + [earlier]
        write_run_file(path, json.dumps(record, indent=2) + "\n")

    def log_step(self, step: int, metrics: dict, routing_records: list[dict] | tuple = ()) -> None:
        if self.routing is not None:
            for routing_record in routing_records:
                self.routing.append(routing_record)
        record = {"step": step, **{k: _number(v) for k, v in metrics.items()}, RUN_WALL_KEY: self.run_wall_s()}
        self.metrics.append(record)
        self.history.append(record)
        if self.tb is not None:
            for key, value in record.items():
                if key != "step" and value is not None and math.isfinite(value):
                    self.tb.add_scalar(key, value, step)
        if self.wandb is not None:
            self.wandb.log(record, step=step)
        if self.bar is not None:
            self.bar.update(1)
            self.bar.set_postfix(
                reward=f"{record.get('reward/mean', float('nan')):.3f}",
                clip=f"{record.get('loss/clip_frac_seq', float('nan')):.3f}",
                t_roll=f"{record.get('time/rollout', 0):.1f}s",
                t_upd=f"{record.get('time/update', 0):.1f}s",
            )

    def close(self) -> str:
        """Write the reward-curve PNG and return the one-screen summary text."""
        if self.bar is not None:
            self.bar.close()
        if self.tb is not None:
            self.tb.close()
        if self.wandb is not None:
            self.wandb.finish()
        self.metrics.close()
        if self.routing is not None:
            self.routing.close()
        plot = self._plot()
        resumed = (self.resume_step, time.monotonic() - self.started) if self.resume_step else None
        return summary_text(self.history, self.run_wall_s(), plot, resumed=resumed, replay=self.replay)

    def note(self, text: str) -> None:
        """A line for the person watching the run (a resume, a held adaptive clip)."""
        print(text)

    def run_wall_s(self) -> float:
        """Wall seconds of the whole run so far: earlier processes' share plus this process's."""
        return self.wall_before + time.monotonic() - self.started

    def _plot(self) -> Path | None:
        if not self.history or not self.charts:
            return None
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        steps = [r["step"] for r in self.history]
        fig, axes = plt.subplots(1, 2, figsize=(10, 3.5))
        for key, label in (("reward/mean", "train reward"), ("eval/pass@1", "eval pass@1")):
            pts = [(r["step"], r[key]) for r in self.history if r.get(key) is not None]
            if pts:
                axes[0].plot(*zip(*pts, strict=True), marker="o" if key.startswith("eval") else None, label=label)
        axes[0].set_xlabel("step")
        axes[0].set_title("reward")
        axes[0].legend()
        axes[1].plot(steps, [r.get("response/length_mean") for r in self.history], label="response length")
        axes[1].set_xlabel("step")
        axes[1].set_title("tokens per response")
        fig.tight_layout()
        path = self.run_dir / "reward_curve.png"
        try:
            with open_run_file(path, "wb") as file:
                fig.savefig(file, format="png", dpi=100)
        finally:
            plt.close(fig)
        return path


def _number(value: Any) -> float | None:
    try:
        return float(value)
    except (TypeError, ValueError):
        return None


def fifth_mean(history: list[dict], key: str, first: bool) -> float:
    """The mean of ``key`` over the first (or last) fifth of the steps that report it (nan if none do)."""
    mean = window_mean([r.get(key) for r in history], FIRST_FIFTH if first else LAST_FIFTH)
    return float("nan") if mean is None else mean


def _format(value: float | None, digits: int) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


UPDATE_KEY, ENGINE_KEY = "routing/update_changed_frac", "routing/rollout_vs_train_changed_frac"


def routing_volatility_line(history: list[dict], replay: str) -> str | None:
    """The summary's routing line (None when no routing kind was measured); what was not measured says why."""
    changed = [r.get(UPDATE_KEY) for r in history]
    engine = [r.get(ENGINE_KEY) for r in history]
    if window_mean(changed, WHOLE_RUN) is None and window_mean(engine, WHOLE_RUN) is None:
        return None
    if window_mean(changed, WHOLE_RUN) is not None:
        # activation volatility: the fraction of (token, layer) whose expert set an update changed
        update = (
            f"expert sets changed by an update: {_format(window_mean(changed, WHOLE_RUN), 3)} of tokens per layer"
            f" ({WHOLE_RUN}; {FIRST_FIFTH}: {_format(window_mean(changed, FIRST_FIFTH), 3)},"
            f" {LAST_FIFTH}: {_format(window_mean(changed, LAST_FIFTH), 3)})"
        )
    elif replay == ReplayMode.rollout:
        update = (
            "expert sets changed by an update: not measured under R3 (routing.replay=rollout: the old-policy pass "
            "replays the engine's routing, so there is no free routing to compare)"
        )
    else:
        update = "expert sets changed by an update: not measured (add update to routing.kinds)"
    engine_last = window_mean(engine, LAST_FIFTH)
    if engine_last is not None:
        expected = " (R3 replays the engine's routing: 0 expected)" if replay == ReplayMode.rollout else ""
        update += f"; engine vs trainer ({LAST_FIFTH}): {engine_last:.3f}{expected}"
    return f"  routing volatility  {update}"


def summary_text(
    history: list[dict],
    wall_s: float,
    plot: Path | None,
    resumed: tuple[int, float] | None = None,
    replay: str = ReplayMode.none,
) -> str:
    """The one-screen summary; ``wall_s`` is the whole run's, ``resumed`` = (step, this process's seconds),
    ``replay`` the run's ``routing.replay``. Every number names its window (``core/run_dir.py``)."""
    if not history:
        return "no steps were run"

    def window(key: str, first: bool) -> float:
        return fifth_mean(history, key, first)

    lines = [
        "=" * 64,
        f"gspo-megatron run summary: {len(history)} steps in {wall_s / 60:.1f} min"
        + (f" (resumed at step {resumed[0]}: {resumed[1] / 60:.1f} min in this process)" if resumed else ""),
        f"  reward/mean       first 20%: {window('reward/mean', True):.3f}"
        f"   last 20%: {window('reward/mean', False):.3f}",
        f"  response length   first 20%: {window('response/length_mean', True):.2f}"
        f"   last 20%: {window('response/length_mean', False):.2f}",
        f"  clip frac (seq)   last 20%: {window('loss/clip_frac_seq', False):.4f}"
        f"   (token) last 20%: {window('loss/clip_frac_token', False):.4f}",
    ]
    gaps = [r["loss/ratio_token_seq_gap"] for r in history if r.get("loss/ratio_token_seq_gap") is not None]
    if gaps:  # 0 for one-token answers, where GSPO's sequence ratio is GRPO's token ratio
        spreads = "no length bucket measured"
        for low, high in sorted(LENGTH_BUCKETS, key=lambda bucket: bucket != (5, 16)):  # 5-16 first, if measured
            name = bucket_name(low, high)
            spread_token = window(f"loss/ratio_var_token/{name}", False)
            spread_seq = window(f"loss/ratio_var_seq/{name}", False)
            if not (math.isnan(spread_token) or math.isnan(spread_seq)):
                tokens = f"{low}-{high}" if high is not None else f"{low}+"
                spreads = (
                    f"token ratio spread E[(w-1)^2] {spread_token:.3g} vs sequence {spread_seq:.3g} at {tokens} tokens"
                )
                break
        lines.append(f"  sequence vs token ratio: mean |w_t - s_i| = {sum(gaps) / len(gaps):.4g} ({spreads})")
    routing = routing_volatility_line(history, replay)
    if routing is not None:
        lines.append(routing)
    evals = [r for r in history if r.get("eval/pass@1") is not None]
    if evals:
        lines.append(f"  eval pass@1       first: {evals[0]['eval/pass@1']:.3f}   last: {evals[-1]['eval/pass@1']:.3f}")
    if plot is not None:
        lines.append(f"  reward curve: {plot}")
    lines.append("=" * 64)
    return "\n".join(lines)
