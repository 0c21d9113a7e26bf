"""Build the rollout side on the driver: tokenizer, task, engine (no weights yet), agents, reward pool, sampling.

What it is built from is ``RolloutSettings``: the rollout side's own sections and the few values the
composition root (``loop/build.py:rollout_settings``) resolves from the others -- the model's shape as
the engine's HF config, its vocabulary, and whether the run needs the engine's routed experts.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING

from gspo_megatron.algorithms.config import AlgorithmConfig
from gspo_megatron.contracts.samples import SamplingParams
from gspo_megatron.rollout.config import RolloutSection
from gspo_megatron.rollout.data.config import TaskConfig, TokenizerConfig
from gspo_megatron.rollout.data.tasks import Task, build_task
from gspo_megatron.rollout.data.tokenizer import Tokenizer, build_tokenizer
from gspo_megatron.rollout.engine import RolloutEngine
from gspo_megatron.rollout.engines import ENGINES, ModelShape
from gspo_megatron.rollout.producer import DrawnGroup, RolloutProducer
from gspo_megatron.rollout.rewards.config import RewardConfig
from gspo_megatron.rollout.rewards.pool import RewardPool
from gspo_megatron.rollout.scheduler import RolloutScheduler
from gspo_megatron.rollout.shaping.config import ShapingConfig
from gspo_megatron.rollout.side import Evaluation, RolloutSide, batch_response_tokens, batch_versions
from gspo_megatron.rollout.streaming import StreamingScheduler

if TYPE_CHECKING:
    from gspo_megatron.rollout.agents.trajectories import TrajectoryRunner


@dataclass(frozen=True)
class RolloutSettings:
    """Everything the rollout side is built from. Not a config section: resolved once at start-up."""

    rollout: RolloutSection
    task: TaskConfig
    tokenizer: TokenizerConfig
    reward: RewardConfig
    shaping: ShapingConfig
    algorithm: AlgorithmConfig  # the advantage estimator and dynamic sampling
    model: ModelShape  # the policy's shape, as the embedded engine builds it
    model_vocab_size: int  # model.vocab_size: the tokenizer's ids must fit
    max_positions: int  # model.max_position_embeddings: a row's prompt and what follows it must fit
    return_routed_experts: bool  # R3 or a diagnostic needs the engine's routing
    seed: int  # trainer.seed: sampling seeds are a function of (seed, step)
    prompts_per_step: int  # trainer.prompts_per_step
    steps: int  # trainer.steps: the one-step-ahead generation stops after the last
    eval_prompts: int  # trainer.eval_prompts
    eval_samples: int  # trainer.eval_samples
    run_dir: Path | None = None  # what the engine writes (SGLang's disk sync) goes under it; None: a tool's cwd


def build_rollout_side(settings: RolloutSettings) -> RolloutSide:
    """The driver's rollout side, ready to generate once the first weight sync has loaded the engine."""
    producer = build_producer(settings)
    rollout = settings.rollout
    if rollout.async_rollout and rollout.max_staleness > 1:
        return RolloutSide(producer, streaming_scheduler(settings, producer), evaluation(settings, producer))
    scheduler = RolloutScheduler(
        producer.produce,
        rollout.max_staleness if rollout.async_rollout else 0,
        # bounded by trainer.steps, not stop_after_steps: a job stopped early still prefetches
        # (and checkpoints) the batch the uninterrupted run would train next
        settings.steps,
        versions_of=batch_versions,
        carried_staleness=rollout.max_staleness if producer.partial is not None else 0,
        tokens_of=batch_response_tokens,
    )
    return RolloutSide(producer, scheduler, evaluation(settings, producer))


def streaming_scheduler(settings: RolloutSettings, producer: RolloutProducer) -> StreamingScheduler[DrawnGroup]:
    """``rollout.max_staleness`` > 1 (``rollout/streaming.py``): rounds of ``trainer.prompts_per_step`` groups."""
    rollout = settings.rollout
    return StreamingScheduler(
        producer.draw_round,
        producer.assemble,
        drawn_group_token_versions,
        batch_versions,
        rollout.max_staleness,
        rollout.staleness_mode,
        settings.prompts_per_step,
        settings.steps,
        inflight_update_mode=rollout.inflight_update_mode,
        spanning_samples_of=drawn_group_spanning_samples,
    )


def drawn_group_token_versions(group: DrawnGroup) -> list[int]:
    """The weight version of each response token of a group (what admission reads)."""
    from gspo_megatron.rollout.agents.partial import token_versions

    return [version for sample in group.samples for version in token_versions(sample)]


def drawn_group_spanning_samples(group: DrawnGroup) -> int:
    """How many of a group's samples hold tokens of more than one weight version (an in-flight update)."""
    from gspo_megatron.rollout.agents.partial import token_versions

    return sum(len(set(token_versions(sample))) > 1 for sample in group.samples)


def build_producer(settings: RolloutSettings) -> RolloutProducer:
    """The producer -- tokenizer, task, engine (no weights yet), agents, verifier pool, sampling -- as
    training uses it; also what evaluates a checkpoint on its own (``build_evaluation``)."""
    from gspo_megatron.rollout.agents.partial import PartialRollouts

    rollout = settings.rollout
    tokenizer = build_tokenizer(
        settings.tokenizer.kind, settings.tokenizer.path, model_vocab_size=settings.model_vocab_size
    )
    if tokenizer.vocab_size > settings.model_vocab_size:
        raise ValueError(
            f"the tokenizer has {tokenizer.vocab_size} tokens but model.vocab_size is {settings.model_vocab_size}; "
            "raise model.vocab_size (a multiple of parallel.tp)"
        )
    prompt_budget = rollout.prompt_budget(settings.max_positions)
    task = build_task(settings.task, tokenizer, prompt_budget)  # dataset prompts past the context are dropped
    check_positions(task, rollout, settings.max_positions)
    engine = ENGINES.get(rollout.engine).build(rollout, settings.model, tokenizer.decode, settings.run_dir)
    sampling = SamplingParams(
        temperature=rollout.temperature,
        top_p=rollout.top_p,
        top_k=rollout.top_k,
        max_new_tokens=rollout.max_new_tokens,
        stop_token_ids=tuple(tokenizer.stop_token_ids),
        n=rollout.group_size,
        return_routed_experts=settings.return_routed_experts,
    )
    training_engine: RolloutEngine = engine
    if rollout.truncated:
        from gspo_megatron.rollout.agents.truncated import TruncatedRolloutEngine
        from gspo_megatron.rollout.shaping.triggers import check_trigger_token_ids

        triggers = settings.shaping.trigger_words
        check_trigger_token_ids(rollout.truncation.trigger_token_ids, triggers, tokenizer.decode)
        training_engine = TruncatedRolloutEngine(
            engine, rollout.truncation, triggers, tokenizer.encode, tokenizer.decode
        )
    agent = build_agent(settings, engine, tokenizer) if rollout.agent.enabled else None
    return RolloutProducer(
        engine=engine,
        training_engine=training_engine,
        task=task,
        tokenizer=tokenizer,
        rewards=RewardPool(settings.shaping.reward_name(settings.task.reward or task.reward), settings.reward),
        algorithm=settings.algorithm,
        shaping=settings.shaping,
        sampling=sampling,
        seed=settings.seed,
        pad_token_id=tokenizer.pad_token_id,
        prompts_per_step=settings.prompts_per_step,
        train_on_exit_tokens=rollout.truncated and rollout.truncation.train_on_exit_tokens,
        partial=PartialRollouts(
            rollout.over_sample,
            rollout.partial,
            rollout.max_staleness,
            engine,  # with an agent: a carried trajectory's session in a checkpoint (its KV cache)
            rollout.response_budget(),
        )
        if rollout.over_sample > 1
        else None,
        agent=agent,
    )


def check_positions(task: Task, rollout: RolloutSection, max_positions: int) -> None:
    """Refuse, before the first rollout, a task whose longest prompt and the tokens that may follow it
    (``RolloutSection.response_budget``) pass the model's positions: nothing would stop the engine and
    the trainer from running rows longer than ``model.max_position_embeddings`` (RoPE has no bound)."""
    longest = task.longest_prompt_tokens()
    key, follows = rollout.response_budget()
    if longest + follows > max_positions:
        raise ValueError(
            f"task {task.name!r}: its longest prompt has {longest} tokens and {key}={follows} may follow, "
            f"{longest + follows} positions, more than model.max_position_embeddings={max_positions}; raise "
            f"model.max_position_embeddings to at least {longest + follows}, lower {key}, or shorten the "
            "task's prompts"
        )


def build_agent(settings: RolloutSettings, engine: RolloutEngine, tokenizer: Tokenizer) -> TrajectoryRunner:
    """The multi-turn trajectories of ``rollout.agent``: its agent function, the turn template of the
    tokenizer (checked to extend its own rendering), the tools each trajectory gets."""
    from gspo_megatron.core.registry import import_function
    from gspo_megatron.core.tool_call_formats import FAMILY_TOOL_CALL_FORMAT, SYMBOL, tool_call_format
    from gspo_megatron.rollout.agents.agent import BUILTIN_AGENTS
    from gspo_megatron.rollout.agents.templates import build_template
    from gspo_megatron.rollout.agents.toolkit import ToolKit
    from gspo_megatron.rollout.agents.trajectories import TrajectoryRunner
    from gspo_megatron.rollout.data.tokenizer import SymbolTokenizer

    config = settings.rollout.agent
    if config.tool_format != "auto":
        format = tool_call_format(config.tool_format)
    elif isinstance(tokenizer, SymbolTokenizer):
        format = SYMBOL
    else:
        format = tool_call_format(FAMILY_TOOL_CALL_FORMAT.get(settings.model.family, "hermes_json"))
    kit = ToolKit(config)
    template = build_template(tokenizer, format, [spec.openai() for spec in kit.specs()])
    closing = []
    if config.name == "openai_endpoint":
        from gspo_megatron.rollout.agents.endpoint import SessionServer, endpoint_agent
        from gspo_megatron.rollout.agents.templates import HFChatTemplate

        if not isinstance(template, HFChatTemplate):
            raise ValueError(
                "rollout.agent.name=openai_endpoint renders chat messages with the model's chat template: "
                "set tokenizer.kind=hf (the symbol tokenizer has none)"
            )
        server = SessionServer(template)
        closing.append(server.close)
        agent = endpoint_agent(server, import_function(config.client or "", "agent client"))
    elif config.name in BUILTIN_AGENTS:
        agent = BUILTIN_AGENTS[config.name]
    else:
        agent = import_function(config.name, "agent")
    return TrajectoryRunner(engine, agent, template, kit.for_record, config, tokenizer.decode, closing)


def evaluation(settings: RolloutSettings, producer: RolloutProducer) -> Evaluation:
    """The run's evaluation prompts and sampling (``trainer.eval_samples`` per prompt at
    ``rollout.eval_temperature``, the run's seed, no routed experts)."""
    params = replace(
        producer.sampling,
        n=settings.eval_samples,
        temperature=settings.rollout.eval_temperature,
        seed=settings.seed,
        return_routed_experts=False,
    )
    return Evaluation(producer.task.eval_records(settings.eval_prompts), params)


def build_evaluation(settings: RolloutSettings) -> tuple[RolloutProducer, Evaluation]:
    """A producer with the run's evaluation prompts and sampling: what the trainer evaluates, for
    evaluating weights outside a run. The caller loads the engine's weights."""
    producer = build_producer(settings)
    return producer, evaluation(settings, producer)
