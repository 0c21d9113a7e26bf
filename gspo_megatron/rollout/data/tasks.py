"""Tasks: named sources of prompt records, each naming the reward function that scores it.

Design decisions:
- A task is looked up by name in one registry (duplicates rejected, valid names listed in errors)
  and built from ``TaskConfig`` plus the tokenizer. The trainer calls only ``next_batch``,
  ``eval_records``, ``state_dict``/``load_state_dict`` and reads ``reward``.
- Synthetic tasks are pure functions of (task name, seed, index): record i is drawn from
  ``random.Random(f"{name}/{seed}/{i}")``, so the stream is reproducible on any machine, resuming
  needs only the index, and the eval stream (``eval_seed``) never overlaps the training stream's draws.
- Synthetic prompts stay <= 12 SymbolTokenizer tokens and answers 1-4 tokens, so a tiny model
  on CPU can learn them in a few hundred steps. Each record carries a ``reference_response`` (the
  response a perfect policy writes, stop token excluded) for supervised warm-up and for tests.
- ``reasoning_max_digit`` asks for "<think> ... </think> answer D": its reference response scans the
  digits ("step d" per digit with the running max) and re-checks once with the trigger word "Wait",
  so step-counting shapers (Step-GRPO, arXiv 2604.16890) have something to count.
- Dataset tasks (``jsonl``, ``parquet``) wrap ``PromptDataset`` and must name their reward in config:
  there is no sensible default verifier for arbitrary data. Their evaluation is the first
  ``trainer.eval_prompts`` records of ``task.eval_dataset`` (a held-out file, read with the training
  file's settings), or without one the first records of the training file in file order -- prompts the
  policy also trains on, which the docs say.
"""

from __future__ import annotations

import abc
import random
from collections.abc import Callable
from dataclasses import replace

from gspo_megatron.core.registry import Registry
from gspo_megatron.rollout.agents.tools.corpus import LOOKUP_SPEC
from gspo_megatron.rollout.data.config import DatasetConfig, TaskConfig
from gspo_megatron.rollout.data.datasets import PromptDataset
from gspo_megatron.rollout.data.fact_lookup import Fact, world
from gspo_megatron.rollout.data.records import PromptRecord
from gspo_megatron.rollout.data.tokenizer import HFTokenizer, SymbolTokenizer, Tokenizer

MAX_PROMPT_TOKENS_SYNTHETIC = 12


class Task(abc.ABC):
    """A source of prompt records with a reward function name."""

    name: str = ""
    default_reward: str | None = None

    def __init__(self, config: TaskConfig, tokenizer: Tokenizer, prompt_budget: int | None = None):
        """``prompt_budget``: the most prompt tokens the model's context leaves (None: no model limit);
        dataset tasks drop longer prompts, synthetic prompts stay within MAX_PROMPT_TOKENS_SYNTHETIC."""
        self.config = config
        self.tokenizer = tokenizer
        reward = config.reward or self.default_reward
        if not reward:
            raise ValueError(f"task {self.name!r} needs task.reward (e.g. exact_match, math_verify)")
        self.reward: str = reward

    @abc.abstractmethod
    def next_batch(self, batch_size: int) -> list[PromptRecord]:
        """The next ``batch_size`` training records (advances the position)."""

    @abc.abstractmethod
    def eval_records(self, count: int) -> list[PromptRecord]:
        """A fixed list of records for evaluation (does not move the training position)."""

    @abc.abstractmethod
    def longest_prompt_tokens(self) -> int:
        """The most tokens a prompt of this task has, known before any is drawn: with what may follow a
        prompt, it must fit the model's positions (checked at start-up, ``rollout/build.py:check_positions``)."""

    @abc.abstractmethod
    def state_dict(self) -> dict: ...

    @abc.abstractmethod
    def load_state_dict(self, state: dict) -> None: ...


TASKS: Registry[Callable[[TaskConfig, Tokenizer, int | None], Task]] = Registry("task")


def register_task(name: str):
    """Class decorator: registers a Task subclass (any ``(TaskConfig, Tokenizer, prompt_budget) -> Task`` factory)."""

    def decorator(factory):
        TASKS.register(name, factory)
        factory.name = name
        return factory

    return decorator


def available_tasks() -> list[str]:
    return TASKS.names()


def build_task(config: TaskConfig, tokenizer: Tokenizer, prompt_budget: int | None = None) -> Task:
    """The task ``config.name`` names; ``prompt_budget`` (the model's context less the response
    tokens) bounds the prompts a dataset task keeps."""
    return TASKS.get(config.name)(config, tokenizer, prompt_budget)


class SeededTask(Task):
    """A synthetic task: record i of a stream is a pure function of (task name, seed, i); the training stream is
    ``task.seed``'s, the held-out one ``task.eval_seed``'s, and resuming needs only the position."""

    def __init__(self, config: TaskConfig, tokenizer: Tokenizer, prompt_budget: int | None = None):
        super().__init__(config, tokenizer, prompt_budget)
        if config.eval_dataset is not None:
            raise ValueError(
                f"task.eval_dataset={config.eval_dataset!r} is read by the dataset tasks (jsonl, parquet); task "
                f"{self.name!r} draws its held-out prompts from task.eval_seed: remove task.eval_dataset"
            )
        self._stop_strings = [tokenizer.decode([i]) for i in tokenizer.stop_token_ids]
        self._index = 0

    @abc.abstractmethod
    def record(self, seed: int, index: int) -> PromptRecord:
        """Record ``index`` of the stream ``seed`` (drawn from ``random.Random(f"{name}/{seed}/{index}")``)."""

    def next_batch(self, batch_size: int) -> list[PromptRecord]:
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        start, self._index = self._index, self._index + batch_size
        return [self.record(self.config.seed, i) for i in range(start, start + batch_size)]

    def eval_records(self, count: int) -> list[PromptRecord]:
        return [self.record(self.config.eval_seed, i) for i in range(count)]

    def state_dict(self) -> dict:
        return {"task": self.name, "seed": self.config.seed, "index": self._index}

    def load_state_dict(self, state: dict) -> None:
        if state.get("task") != self.name or state.get("seed") != self.config.seed:
            raise ValueError(
                f"task state {state} belongs to another task or seed (this is {self.name!r}, "
                f"seed {self.config.seed}); resume with the same task config"
            )
        self._index = int(state["index"])


class SyntheticDigitTask(SeededTask):
    """Digit-string problems drawn deterministically from (seed, index)."""

    default_reward = "exact_match"
    max_digits_allowed = MAX_PROMPT_TOKENS_SYNTHETIC - 3  # "<word> " + digits + "="

    def __init__(self, config: TaskConfig, tokenizer: Tokenizer, prompt_budget: int | None = None):
        super().__init__(config, tokenizer, prompt_budget)
        if config.max_digits > self.max_digits_allowed:
            raise ValueError(
                f"task {self.name!r} allows at most {self.max_digits_allowed} digits (short prompts "
                f"and answers for tiny models); got task.max_digits={config.max_digits}"
            )

    @abc.abstractmethod
    def problem(self, digits: str) -> tuple[str, str, str]:
        """(prompt, answer, reference_response) for a digit string."""

    def record(self, seed: int, index: int) -> PromptRecord:
        rng = random.Random(f"{self.name}/{seed}/{index}")
        length = rng.randint(self.config.min_digits, self.config.max_digits)
        digits = "".join(str(rng.randrange(10)) for _ in range(length))
        prompt, answer, reference = self.problem(digits)
        metadata = {
            "digits": digits,
            "reference_response": reference,
            "stop_strings": list(self._stop_strings),
            "answer_pattern": r"\d+",
        }
        return PromptRecord(prompt, answer, metadata, tuple(self.tokenizer.encode(prompt)))

    def longest_prompt_tokens(self) -> int:
        """The prompt of ``task.max_digits`` digits, each digit repeated (``problem`` writes every digit):
        exact for the symbol tokenizer and tokenizers that split digits one by one (a token per digit);
        for a tokenizer that merges digits, the longest of these ten."""
        digits = self.config.max_digits
        return max(len(self.tokenizer.encode(self.problem(str(d) * digits)[0])) for d in range(10))


@register_task("max_digit")
class MaxDigitTask(SyntheticDigitTask):
    def problem(self, digits):
        answer = max(digits)
        return f"max {digits}=", answer, answer


@register_task("sum_mod10")
class SumMod10Task(SyntheticDigitTask):
    def problem(self, digits):
        answer = str(sum(int(d) for d in digits) % 10)
        return f"sum {digits}=", answer, answer


@register_task("copy_reverse")
class CopyReverseTask(SyntheticDigitTask):
    max_digits_allowed = 4  # the answer is the digits reversed: at most 4 answer tokens

    def problem(self, digits):
        answer = digits[::-1]
        return f"reverse {digits}=", answer, answer


@register_task("running_max")
class RunningMaxTask(SyntheticDigitTask):
    """ "max 3817=" -> "3888": the largest digit so far at each position (3-5 answer tokens). Each
    position is a max_digit problem over a prefix, and the default reward credits each position, so a
    random model earns some reward from its first step and GSPO's sequence ratio averages tokens that
    are each right or wrong."""

    default_reward = "position_match"

    def problem(self, digits):
        running, answer = "0", []
        for digit in digits:
            running = max(running, digit)
            answer.append(running)
        return f"max {digits}=", "".join(answer), "".join(answer)


@register_task("reasoning_max_digit")
class ReasoningMaxDigitTask(SyntheticDigitTask):
    default_reward = "think_answer"

    def problem(self, digits):
        answer = max(digits)
        running, steps = "0", []
        for digit in digits:
            running = max(running, digit)
            steps.append(f"step {running}")
        reference = f"<think> {' '.join(steps)} Wait {answer} </think> answer {answer}"
        return f"max {digits}=", answer, reference


@register_task("calculator_add")
class CalculatorAddTask(SyntheticDigitTask):
    """ "4821+3917=" -> "8738": the digits split into two numbers to add -- too long for a tiny model to add
    in its head, one call for a calculator (``rollout.agent.tools=[calculator]``). The reward scores the
    trajectory's last turn (``Sample.answer_ids``); ``reference_response`` is the tool-using trajectory in
    the symbol format, the calculator's answer between its turns (``tools/sft_warmstart.py --demos
    calculator`` trains on its generated parts)."""

    def problem(self, digits):
        half = len(digits) // 2
        first, second = str(int(digits[:half] or "0")), str(int(digits[half:]))  # no leading zeros
        total = str(int(first) + int(second))
        call = f"<calculator {first}+{second}>"
        return f"{first}+{second}=", total, f"{call} {total}\n{total}"


@register_task("fact_lookup")
class FactLookupTask(SeededTask):
    """ "code zorv=" -> "4821": the code of a made-up entity, written only in the task's corpus
    (``fact_lookup.py``), so the one way to the answer is a ``lookup`` call (``rollout.agent.tools=[lookup]``,
    ``rollout.agent.corpus_dir`` the shipped corpus). Record i asks about an entity drawn from
    ``random.Random(f"fact_lookup/{seed}/{i}")``; the reward scores the trajectory's last turn. The
    ``reference_response`` is the tool-using trajectory in the symbol format, the document between its turns.
    A model with its own tokenizer is asked in words, through its chat template with the tool's schema."""

    default_reward = "exact_match"

    def __init__(
        self,
        config: TaskConfig,
        tokenizer: Tokenizer,
        prompt_budget: int | None = None,
        facts: tuple[Fact, ...] | None = None,
    ):
        """``facts``: the world asked about (None: the shipped corpus's; the warm start passes its own)."""
        super().__init__(config, tokenizer, prompt_budget)
        self.facts = world() if facts is None else facts

    def prompt(self, fact: Fact) -> str:
        if isinstance(self.tokenizer, SymbolTokenizer):
            return f"code {fact.name}="
        if not isinstance(self.tokenizer, HFTokenizer):
            raise TypeError(f"task {self.name!r} has no prompt for a {type(self.tokenizer).__name__}")
        question = (
            f"What is the code of {fact.name}? Look it up with the lookup tool (query: {fact.name}), "
            "then answer with the code's digits alone."
        )
        return self.tokenizer.render_prompt([{"role": "user", "content": question}], tools=[LOOKUP_SPEC.openai()])

    def record(self, seed: int, index: int) -> PromptRecord:
        fact = random.Random(f"{self.name}/{seed}/{index}").choice(self.facts)
        prompt = self.prompt(fact)
        metadata = {
            "entity": fact.name,
            "reference_response": f"<lookup {fact.name}> {fact.document}\n{fact.code}",
            "stop_strings": list(self._stop_strings),
            "answer_pattern": r"\d+",
        }
        return PromptRecord(prompt, fact.code, metadata, tuple(self.tokenizer.encode(prompt)))

    def longest_prompt_tokens(self) -> int:
        return max(len(self.tokenizer.encode(self.prompt(fact))) for fact in self.facts)


class DatasetTask(Task):
    """Records from a local prompt file; the reward function must be named in config."""

    file_format = ""

    def __init__(self, config: TaskConfig, tokenizer: Tokenizer, prompt_budget: int | None = None):
        super().__init__(config, tokenizer, prompt_budget)
        dataset_config = config.dataset
        if dataset_config.format == "auto":
            dataset_config = replace(dataset_config, format=self.file_format)
        elif dataset_config.format != self.file_format:
            raise ValueError(
                f"task {self.name!r} reads {self.file_format} files but task.dataset.format="
                f"{dataset_config.format!r}; use task={dataset_config.format} or format=auto"
            )
        self.dataset = PromptDataset(dataset_config, tokenizer, prompt_budget)
        self.eval_dataset = self._held_out(dataset_config, prompt_budget)

    def _held_out(self, dataset_config: DatasetConfig, prompt_budget: int | None) -> PromptDataset | None:
        """``task.eval_dataset`` read with the training file's settings, in file order; errors name the key."""
        path = self.config.eval_dataset
        if path is None:
            return None
        try:
            return PromptDataset(replace(dataset_config, path=path, shuffle=False), self.tokenizer, prompt_budget)
        except (OSError, ValueError, KeyError) as error:  # the file's own message, under the key that named it
            raise ValueError(f"task.eval_dataset={path!r}: {error}") from error

    def next_batch(self, batch_size: int) -> list[PromptRecord]:
        return self.dataset.next_batch(batch_size)

    def longest_prompt_tokens(self) -> int:
        """Every record is tokenized as the file is read (longer ones were dropped against the budget)."""
        return max((len(record.prompt_ids or ()) for record in self.dataset.records), default=0)

    def eval_records(self, count: int) -> list[PromptRecord]:
        """The first ``count`` records of ``task.eval_dataset`` in file order; without one, of the training file."""
        source = self.eval_dataset if self.eval_dataset is not None else self.dataset
        return source.records[:count]

    def state_dict(self) -> dict:
        return {"task": self.name, "dataset": self.dataset.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        if state.get("task") != self.name:
            raise ValueError(f"task state belongs to task {state.get('task')!r}, not {self.name!r}")
        self.dataset.load_state_dict(state["dataset"])


@register_task("jsonl")
class JsonlTask(DatasetTask):
    file_format = "jsonl"


@register_task("parquet")
class ParquetTask(DatasetTask):
    file_format = "parquet"
