"""Entry point: ``python -m gspo_megatron.train [overrides]``, ``gspo-train``, or under torchrun.

Compose the Hydra config, validate it once, build the trainer, train, clean up.
The module's top level imports nothing heavy: reward workers (forkserver/spawn) re-import the main
module, and each would otherwise pay hydra, the config schema and torch again at start-up.
"""

from __future__ import annotations

import logging
import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING, NoReturn, cast

from gspo_megatron.core.known_warnings import filter_known_warnings, optional_accelerators_notice

if TYPE_CHECKING:
    from omegaconf import DictConfig

filter_known_warnings()  # before anything that warns is imported: reviewed third-party noise only


def run(cfg: DictConfig, run_dir: str) -> str:
    """Train with an already composed config; returns the summary text (driver) or ''."""
    from omegaconf import DictConfig, OmegaConf

    from gspo_megatron.config.recipes import toy_settings_notice
    from gspo_megatron.config.schema import to_train_config
    from gspo_megatron.config.validate import validate_config, validate_for_machine
    from gspo_megatron.core.config_node import freeze_config
    from gspo_megatron.loop.build import build_trainer, world_size_from_env
    from gspo_megatron.loop.trainer import QuietLog
    from gspo_megatron.run.hydra_output import keep_hydra_output
    from gspo_megatron.run.reaper import keep_reaper, start_reaper
    from gspo_megatron.run.refused_start import remove_startup_record
    from gspo_megatron.run.run_dir_owner import claim_run_dir
    from gspo_megatron.run.run_log import open_run_log
    from gspo_megatron.run.signals import SignalWatch

    logging.getLogger("megatron").setLevel(logging.WARNING)  # it lists every parameter at INFO
    cfg = resolve_model_paths(cfg)  # hub ids -> local snapshot folders, before anything reads them
    if cfg.model.hf_checkpoint:  # the weights decide the model's shape, not the model YAML
        from gspo_megatron.policy.models.hf_checkpoint import hf_shape_fields

        cfg = cast(DictConfig, OmegaConf.merge(cfg, {"model": hf_shape_fields(cfg.model.hf_checkpoint)}))
    typed = to_train_config(cfg)
    validate_config(typed, world_size_from_env())
    validate_for_machine(typed)  # optional packages the config asks for (wandb, tensorboard)
    freeze_config(typed)  # read-only from here on: every part of the run sees the settings config.yaml records
    config_yaml = OmegaConf.to_yaml(cfg, resolve=True)
    driver = _is_driver_process()  # the driver owns the run directory and speaks for the run
    # lock the run directory, and refuse a wrong fresh start or resume before building
    claim = claim_run_dir(Path(run_dir), typed.checkpoint, config_yaml) if driver else None
    keep_reaper(start_reaper())  # whatever this process starts dies with it, even by SIGKILL (run/reaper.py)
    for notice in (toy_settings_notice(typed), optional_accelerators_notice()) if driver else ():
        if notice:
            print(notice, flush=True)
    try:
        if claim is not None:  # run_dir= given: Hydra's record and train.log go there, not the working directory
            keep_hydra_output(cfg, Path(run_dir))
        # SIGTERM/SIGINT: finish the step (within checkpoint.signal_grace_s), save, stop (run/signals.py)
        with SignalWatch(typed.checkpoint.signal_grace_s) as signals:
            trainer = build_trainer(typed, Path(run_dir), config_yaml)
            try:
                log = open_run_log(typed, Path(run_dir), config_yaml) if driver else QuietLog()
                summary = trainer.train(log, signals)
                if driver:  # the routing report of the whole run (matplotlib: imported only now)
                    from gspo_megatron.run.routing_report import write_routing_report

                    write_routing_report(run_dir, charts=typed.logging.charts)
            finally:
                trainer.close()  # reward workers, the engine and the servers it launched, groups
    except BaseException:
        if claim is not None:  # a directory the claim made that holds only the start-up record goes
            claim.release()
            remove_startup_record(Path(run_dir), claim.created)
        raise
    if claim is not None:
        claim.release()
    return summary


# The keys whose value names a model folder (rollout.sglang exists with rollout=sglang only); a hub id given
# to any of them resolves to the same snapshot.
MODEL_PATH_KEYS = ("model.hf_checkpoint", "tokenizer.path", "rollout.sglang.model_path")


def resolve_model_paths(cfg: DictConfig) -> DictConfig:
    """``cfg`` with every model path given as a hub id replaced by its local snapshot folder
    (``core/hub_checkpoints.py`` states the rule); each distinct value is resolved once."""
    import copy

    from omegaconf import OmegaConf, read_write

    from gspo_megatron.core.hub_checkpoints import resolve_model_path

    resolved: dict[str, str] = {}
    changed: dict[str, str] = {}
    for key in MODEL_PATH_KEYS:
        value = OmegaConf.select(cfg, key)
        if key == "tokenizer.path" and OmegaConf.select(cfg, "tokenizer.kind") != "hf":
            continue  # the symbol tokenizer reads no path: nothing to fetch for it
        if value:
            if value not in resolved:
                resolved[value] = resolve_model_path(key, value)
            if resolved[value] != value:
                changed[key] = resolved[value]
    if not changed:
        return cfg
    resolved_cfg = copy.deepcopy(cfg)  # the given config stays as it was
    with read_write(resolved_cfg):
        for key, path in changed.items():
            OmegaConf.update(resolved_cfg, key, path)
    return resolved_cfg


def _is_driver_process() -> bool:
    return int(os.environ.get("RANK", "0")) == 0


def main() -> None:
    """Register the config schema, then let Hydra compose the config from the package's conf/ (package
    data: ``pkg://gspo_megatron.conf``, so an installed wheel finds it) and the command line."""
    import hydra

    from gspo_megatron.config.known_keys import UnknownConfigKeyError
    from gspo_megatron.config.store import register_configs

    try:
        check_command_line_keys(sys.argv[1:])
    except UnknownConfigKeyError as error:  # before Hydra composes or writes anything
        exit_without_teardown(f"[gspo] {error}")
    register_configs()
    try:
        hydra.main(config_path="pkg://gspo_megatron.conf", config_name="config", version_base="1.3")(train_from_hydra)()
    except SystemExit as stop:  # Hydra's own (a bad override, --help) and a signalled stop's
        exit_without_teardown(stop.code)
    exit_without_teardown(0)


def check_command_line_keys(argv: list[str]) -> None:
    """Refuse an override of a key the schema does not have, with or without '+' (``config/known_keys.py``):
    Hydra would refuse ``trainer.stepz=3`` advising ``+trainer.stepz=3``, and accept that silently. The
    command line is read by Hydra's own parser; one it cannot read is left to Hydra, which names it."""
    from hydra._internal.utils import get_args_parser

    from gspo_megatron.config.compose import check_overrides

    try:
        args, _ = get_args_parser().parse_known_args(argv)
    except SystemExit:  # argparse's error exit; Hydra prints the same message when it parses
        return
    check_overrides(args.overrides)


def exit_without_teardown(code: object) -> NoReturn:
    """End the process the way ``multiprocessing`` ends its children: the non-daemon threads joined, the
    atexit handlers run (logging, multiprocessing's managers and children, wandb, ...), stdout and
    stderr flushed, then ``os._exit``. What is skipped is the interpreter's module teardown, which
    frees torch, megatron-core, matplotlib and transformers object by object after every file of the
    run is closed: 1.8 s of the main job's exit on 2 cores (0.1 s with this), and 1.2 s for
    ``python -c "import torch, megatron.core.models.gpt, megatron.core.optimizer"`` alone. An
    exception other than ``SystemExit`` does not come here: it ends the process as Python does.
    ``code`` is ``SystemExit``'s: None (0), an int, or a message (printed to stderr, exit 1)."""
    import atexit
    import threading

    if code is not None and not isinstance(code, int):
        print(code, file=sys.stderr)
        code = 1
    # threading's own exit, as multiprocessing's children run it (process.py ``_bootstrap``): the hooks
    # registered with threading._register_atexit first -- concurrent.futures' wakes an executor's idle
    # workers, which a bare join of every non-daemon thread waits on forever while the executor lives
    # (a qwen3_5_moe_tiny run's summary printed, its main thread in Thread.join of "ThreadPoolExecutor-1_0")
    # -- then the non-daemon threads joined
    threading._shutdown()  # type: ignore[attr-defined]
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        stream.flush()
    os._exit(code or 0)


def train_from_hydra(cfg: DictConfig) -> None:
    from hydra.core.hydra_config import HydraConfig

    from gspo_megatron.loop.trainer import TrainingInterrupted

    run_dir = cfg.run_dir or HydraConfig.get().runtime.output_dir
    try:
        start_threads(cfg)
        summary = run(cfg, run_dir)
    except TrainingInterrupted as stop:
        print(f"[gspo] {stop}", file=sys.stderr, flush=True)
        sys.exit(stop.exit_code)
    except Exception as error:
        refused_start(error, hydra_made=None if cfg.run_dir else Path(run_dir))
        raise
    if summary:
        print(summary)


def engine_generates_beside_training(cfg: DictConfig) -> bool:
    """Whether the driver's embedded engine generates in a thread while its trainer trains: one-step
    asynchronous rollout only (``rollout.async_rollout`` with a bound above 0; ``rollout/build.py`` gives the
    scheduler ``max_staleness`` only then). A synchronous run -- the main job -- generates, then trains."""
    rollout = cfg.rollout
    return rollout.engine == "embedded" and bool(rollout.async_rollout) and rollout.max_staleness >= 1


def start_threads(cfg: DictConfig) -> None:
    """This process's torch intra-op threads by the rule of ``core/threads.py``, set once at start-up
    (the command line's run only: a test or tool calling ``run`` keeps the count it chose), and said
    once, by the driver."""
    from gspo_megatron.core.threads import apply_thread_plan, plan_threads, usable_cores

    driver = _is_driver_process()
    overlap = driver and engine_generates_beside_training(cfg)
    local_ranks = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    plan = plan_threads(usable_cores(), local_ranks, overlap, cfg.trainer.cpu_threads, os.environ)
    apply_thread_plan(plan)
    if driver:
        workers = "reward workers too" if plan.from_environment else "reward workers 1 each"
        print(f"threads: {plan.intra_op} intra-op ({plan.rule}; {workers})", flush=True)


def refused_start(error: Exception, hydra_made: Path | None) -> None:
    """Remove Hydra's directory for this job (``run_dir=`` not given) if it holds only the start-up record;
    then end a refusal (``run/refused_start.py``) with its message alone, exit status 1, unless
    HYDRA_FULL_ERROR=1 asks for the traceback. Any other error returns, to be raised with its traceback."""
    from gspo_megatron.run.refused_start import is_refusal, refusal_message, remove_startup_record, wants_traceback

    if hydra_made is not None and _is_driver_process():
        remove_startup_record(hydra_made, [hydra_made])
    if is_refusal(error) and not wants_traceback():
        print(refusal_message(error), file=sys.stderr, flush=True)
        sys.exit(1)  # Hydra's exit status for a failed job, as before


if __name__ == "__main__":
    main()
