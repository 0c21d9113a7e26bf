"""The rollout side's config: the ``rollout`` section, the in-process engine's and dynamic truncated rollout's.

Design decisions:
- Plain dataclasses with typed defaults; the lead registers them in Hydra's ConfigStore
  (``conf/rollout/embedded.yaml`` holds the YAML defaults of the embedded engine).
- The model shape is not here: the embedded engine is built from the policy's (``model.*``, resolved in
  ``loop/build.py:rollout_settings``), so engine and trainer cannot disagree on it. The engine's own
  ``model`` and ``model_config_path`` keys, which no run read, were removed (issue 63;
  ``core/config_migrations.py:REMOVED`` names the replacement to a run that sets them).
- Truncated-rollout strings (trigger words, probe suffix, thinking close) are text, turned into token
  ids by the caller's tokenizer at run time, so the same config serves any tokenizer.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from gspo_megatron.core.config_node import ConfigChoice, ConfigNode
from gspo_megatron.rollout.sglang.config import SGLangConfig, WeightQuantization


def check_max_staleness(max_staleness: int) -> None:
    """``rollout.max_staleness``: the one-step scheduler's rule (``rollout/scheduler.py``); a bound above 1 is the
    streaming scheduler's (``rollout/streaming.py``)."""
    if max_staleness not in (0, 1):
        raise ValueError(
            f"rollout.max_staleness={max_staleness}: one-step asynchronous rollout supports 0 (synchronous) or 1; "
            "a bound above 1 is the streaming mode (rollout.async_rollout=true, rollout/streaming.py)"
        )


class StalenessMode(ConfigChoice):
    """``rollout.staleness_mode``: what the streaming mode (``rollout.max_staleness`` > 1) does with work that
    could pass the bound (``rollout/staleness.py``)."""

    wait = "wait"  # the producer waits at the gate: nothing is dropped
    drop = "drop"  # the producer runs on; a group past the bound when taken is dropped


class PartialRollout(ConfigChoice):
    """``rollout.partial``: what becomes of the groups over-sampling started but a step did not need
    (``rollout/agents/partial.py``)."""

    drop = "drop"  # discarded: their prompts are spent
    # carried into the next step with their tokens, log-probs and weight versions (the member is named as the
    # YAML value, which Hydra matches against member names; `continue` is a keyword: PARTIAL_CONTINUE below)
    vars()["continue"] = "continue"


PARTIAL_CONTINUE = PartialRollout("continue")


class RolloutEngineName(ConfigChoice):
    """``rollout.engine``."""

    embedded = "embedded"  # in-process transformers engine (rollout/embedded/engine.py)
    sglang = "sglang"  # SGLang servers, launched or attached (rollout/sglang/)


class Placement(ConfigChoice):
    """``rollout.placement``: where the engine runs relative to the trainer (loop/colocation.py)."""

    separate = "separate"  # the engine keeps its memory (SGLang: GPUs of its own; embedded: beside the trainer)
    colocated = "colocated"  # trainer and engine share the devices and take turns (release / resume)


class EngineDtype(ConfigChoice):
    """``rollout.embedded.dtype``."""

    float32 = "float32"
    bfloat16 = "bfloat16"
    float16 = "float16"


class InflightUpdateMode(ConfigChoice):
    """How a weight update lands in a running generation (``rollout/embedded/inflight.py``; SGLang's
    ``pause_mode`` names the same two); ``rollout.inflight_update_mode`` (streaming: ``rollout/streaming.py``)."""

    off = "off"  # the key's default: a weight sync waits for the round in flight (no in-flight update)
    in_place = "in_place"  # the KV cache is kept: positions computed before the update keep the old weights' KV
    retract = "retract"  # the running rows' KV is computed again under the new weights before they go on


class AttentionImplementation(ConfigChoice):
    sdpa = "sdpa"
    eager = "eager"


# the HF model_type (``model.family``) the lean forward serves (``embedded/lean_forward.py:lean_forward_for``;
# the planner's memory model reads the same rule from the config)
LEAN_FORWARD_MODEL_TYPE = "qwen3_moe"


class EmbeddedForward(ConfigChoice):
    """``rollout.embedded.forward``: the model's forward in the embedded engine's decode loop."""

    lean = "lean"  # embedded/lean_forward.py where it serves the model (Qwen3-MoE, SDPA), transformers' elsewhere
    transformers = "transformers"  # transformers' own forward always (the reference)


@dataclass
class EmbeddedConfig(ConfigNode):
    """The transformers-based rollout engine that runs inside the trainer process."""

    dtype: EngineDtype = EngineDtype.float32
    # fp8_block: each synced projection weight rounded through block FP8 and back (an FP8 engine's weights,
    # emulated: the compute stays in ``dtype``)
    weight_quantization: WeightQuantization = WeightQuantization.none
    device: str = "cpu"
    max_batch_size: int = 32  # rows (prompt x sample) decoded together; more are split into chunks
    seed: int = 0  # seeds the engine's generator used when SamplingParams.seed is None
    use_cache: bool = True  # KV cache; False re-runs the whole sequence each step (tests/benchmark)
    attn_implementation: AttentionImplementation = AttentionImplementation.sdpa
    forward: EmbeddedForward = EmbeddedForward.lean
    pad_token_id: int = 0  # filler for left padding; masked, so any valid id works

    def validate(self) -> None:
        if self.max_batch_size < 1:
            raise ValueError(f"max_batch_size must be >= 1, got {self.max_batch_size}")
        if self.dtype not in tuple(EngineDtype):
            raise ValueError(f"rollout.embedded.dtype={self.dtype!r} is unknown; valid: {', '.join(EngineDtype)}")


class ToolErrorPolicy(ConfigChoice):
    """``rollout.agent.on_tool_error``: what a failed tool call does to its trajectory (always counted)."""

    show = "show"  # the model reads the error as the tool's answer and goes on
    end = "end"  # the trajectory ends there (its reward is what it answered by then)


AGENT_TOOLS = ("calculator", "lookup", "python")


@dataclass
class AgentConfig(ConfigNode):
    """``rollout.agent``: multi-turn trajectories with tools (``rollout/agents/``, docs/agents.md)."""

    # none | tool_calling | openai_endpoint (``client`` drives it) | import:package.module:function (an async agent)
    name: str = "none"
    client: str | None = None  # openai_endpoint: import:package.module:function, an OpenAI-client agent
    max_turns: int = 4  # generated turns per trajectory, for every agent (a turn past it: TurnLimitError)
    max_tokens: int = 64  # generated + inserted tokens per trajectory, after its prompt
    # calculator | lookup | python | import:package.module:Name (a user's tool: rollout/agents/tools/user_tools.py)
    tools: list[str] = field(default_factory=lambda: ["calculator"])
    tool_format: str = "auto"  # auto (symbol tokenizer: symbol; else the family's) | hermes_json | symbol
    on_tool_error: ToolErrorPolicy = ToolErrorPolicy.show
    tool_timeout_s: float = 10.0  # one call's wall time (the python tool's own limits come first)
    trajectory_timeout_s: float = 300.0  # a trajectory running longer ends (counted: agent/timeouts)
    corpus_dir: str | None = None  # the lookup tool's documents (a task may ship its own)
    scratch_dir: str | None = None  # the python tool's scratch root (null: a temporary directory per run)
    max_wait_s: float = 0.05  # the longest a waiting turn waits for others to share the engine's batch

    @property
    def enabled(self) -> bool:
        return self.name != "none"

    def validate(self) -> None:
        key = "rollout.agent."
        if (
            self.enabled
            and self.name not in ("tool_calling", "openai_endpoint")
            and not self.name.startswith("import:")
        ):
            raise ValueError(
                f"{key}name={self.name!r} is not an agent: use none, tool_calling, openai_endpoint or "
                "import:package.module:function"
            )
        if self.name == "openai_endpoint" and not (self.client or "").startswith("import:"):
            raise ValueError(
                f"{key}name=openai_endpoint needs {key}client=import:package.module:function, the function that "
                "drives each trajectory through its OpenAI-compatible endpoint (docs/agents.md)"
            )
        for name in ("max_turns", "max_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"{key}{name}={getattr(self, name)} must be >= 1")
        unknown = [tool for tool in self.tools if tool not in AGENT_TOOLS and not tool.startswith("import:")]
        if unknown:
            raise ValueError(
                f"{key}tools has {unknown}; the built-in tools are {list(AGENT_TOOLS)}, a user's tool is "
                "import:package.module:Name (docs/agents.md)"
            )
        if self.tool_format not in ("auto", "hermes_json", "symbol"):
            raise ValueError(f"{key}tool_format={self.tool_format!r} is not one of auto, hermes_json, symbol")
        for name in ("tool_timeout_s", "trajectory_timeout_s", "max_wait_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{key}{name}={getattr(self, name)} must be > 0 seconds")
        if self.enabled and "lookup" in self.tools and self.corpus_dir is None:
            raise ValueError(f"{key}tools has lookup, which needs {key}corpus_dir (a directory of text files)")


@dataclass
class TruncatedRolloutConfig(ConfigNode):
    """Dynamic Truncated Rollout (Step-GRPO, arXiv 2604.16890; DEER arXiv 2504.15895); training only.

    Defaults follow DEER's released code (BugSmith/DEER ``vllm-deer*.py``) except where marked CHOICE.
    """

    # The probes run at shaping.trigger_words (the one trigger list; step counting counts the same words;
    # DEER's code uses "Wait" alone, --points 1) and at these token ids, each of which must decode to one
    # of those words (checked where the tokenizer is, loop/build.py).
    trigger_token_ids: list[int] = field(default_factory=list)
    end_think: str = "</think>"  # the model closing its thinking block ends the probing phase
    end_think_token_ids: list[int] = field(default_factory=list)  # same, as token ids
    # DEER's answer-inducing text ends at "\boxed", so the probe's first token is the "{" it makes
    # near-certain, and ``probe_skip_tokens=1`` leaves it out of the confidence. A suffix that already
    # ends in "{" must set probe_skip_tokens=0 (checked), or the first ANSWER token would be skipped.
    probe_suffix: str = "\n**Final Answer**\n\\boxed"
    probe_skip_tokens: int = 1
    probe_max_tokens: int = 20  # greedy probe answer length
    probe_stop_at_end_think: bool = True  # the probe stops when it closes thinking (DEER: stop ["</think>"])
    # DEER's Qwen3 rule (vllm-deer-qwen3.py): a probe that does not close thinking within
    # probe_max_tokens has confidence 0 (Qwen3 is over-confident otherwise). Set true for Qwen3.
    probe_require_end_think: bool = False
    close_thinking: str = "\n</think>\n\n"  # inserted after an exit, before the answer
    confidence_threshold: float = 0.95  # exit when the probe's confidence is strictly above this
    max_probes: int = 10
    # Forced answer: thinking may use floor(think_ratio * max_new_tokens) tokens; at that limit the
    # block is closed and the answer sampled in the rest (DEER --think_ratio 0.9). 1.0: off (a response
    # that runs out then ends with no answer, exit "length").
    think_ratio: float = 0.9
    # Repetition exit (DEER --rep): a thinking chunk (the text between triggers) whose set of words
    # equals the previous chunk's counts one repeat (never reset); at this many, thinking is closed
    # and the answer sampled. 0: off (DEER's default; it uses 3 when on).
    repetition_exit: int = 0
    eos_token_ids: list[int] = field(default_factory=list)  # end of the whole response
    # CHOICE (Step-GRPO says the model "internalizes dynamic early exit" but not whether the inserted
    # exit is trained on): false (default) -- the closing text an exit inserts is context, not an
    # action; it is left out of the loss, so the exit decision itself gets no direct gradient and the
    # model learns early exit only through the shorter, rewarded trajectories it is shown. true -- the
    # inserted tokens are trained on like sampled ones (the policy is pushed to emit the close where
    # the probe was confident); needs trainer.old_log_probs=trainer and no mismatch correction, since
    # the engine has no log-prob for a token it did not sample. Either way they are never compared
    # with the engine's log-probs.
    train_on_exit_tokens: bool = False

    def validate(self) -> None:
        owner = "rollout.truncation"
        if not 0.0 < self.confidence_threshold < 1.0:
            raise ValueError(f"{owner}.confidence_threshold must be in (0, 1), got {self.confidence_threshold}")
        if self.max_probes < 0 or self.probe_max_tokens < 1:
            raise ValueError(f"{owner}: max_probes must be >= 0 and probe_max_tokens >= 1")
        if self.probe_skip_tokens < 0:
            raise ValueError(f"{owner}.probe_skip_tokens must be >= 0, got {self.probe_skip_tokens}")
        if self.probe_suffix.endswith("{") and self.probe_skip_tokens > 0:
            raise ValueError(
                f"{owner}.probe_suffix ends with '{{', so the probe's first token is already the answer, "
                f"but probe_skip_tokens={self.probe_skip_tokens} would leave it out of the confidence; "
                f"set probe_skip_tokens=0, or end the suffix at '\\boxed' (DEER)"
            )
        if self.probe_require_end_think and not (self.end_think or self.end_think_token_ids):
            raise ValueError(f"{owner}.probe_require_end_think needs end_think or end_think_token_ids")
        if not 0.0 < self.think_ratio <= 1.0:
            raise ValueError(f"{owner}.think_ratio must be in (0, 1], got {self.think_ratio}")
        if self.repetition_exit < 0:
            raise ValueError(f"{owner}.repetition_exit must be >= 0 (0: off), got {self.repetition_exit}")


@dataclass
class RolloutSection(ConfigNode):
    engine: RolloutEngineName = RolloutEngineName.embedded
    group_size: int = 8  # responses per prompt (G)
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    max_new_tokens: int = 8
    eval_temperature: float = 0.0
    truncated: bool = False  # dynamic truncated rollout (Step-GRPO), training rollouts only
    return_routed_experts: bool = False  # set automatically when R3 replay needs them
    async_rollout: bool = False  # generate step k+1 while step k trains (rollout/scheduler.py)
    # policy versions a sample may lag: async mode 0 (= synchronous), 1 (one step ahead), k > 1 (streaming,
    # rollout/streaming.py); partial=continue >= 1
    max_staleness: int = 1
    staleness_mode: StalenessMode = StalenessMode.wait  # streaming (max_staleness > 1): wait | drop
    # streaming: off (a weight sync waits for the round in flight) | in_place | retract (it lands inside the round)
    inflight_update_mode: InflightUpdateMode = InflightUpdateMode.off
    # start over_sample x the step's groups, stop once the step's groups are complete (rollout/agents/partial.py)
    over_sample: float = 1.0
    partial: PartialRollout = PartialRollout.drop  # the groups not needed: drop | continue (into the next step)
    # separate | colocated: trainer and engine share the devices and take turns (loop/colocation.py)
    placement: Placement = Placement.separate
    embedded: EmbeddedConfig = field(default_factory=EmbeddedConfig)
    sglang: SGLangConfig = field(default_factory=SGLangConfig)
    truncation: TruncatedRolloutConfig = field(default_factory=TruncatedRolloutConfig)
    agent: AgentConfig = field(default_factory=AgentConfig)

    def validate(self) -> None:
        # training samples must be drawn at T > 0: the trainer scores them with log_softmax(logits / T)
        if not (math.isfinite(self.temperature) and self.temperature > 0):
            raise ValueError(
                f"rollout.temperature={self.temperature}: training rollouts need a finite temperature > 0 "
                "(the policy's log-probs are log_softmax(logits / T)); greedy decoding is for evaluation: "
                "rollout.eval_temperature=0"
            )
        if not (math.isfinite(self.eval_temperature) and self.eval_temperature >= 0):
            raise ValueError(f"rollout.eval_temperature={self.eval_temperature} must be >= 0 (0: greedy evaluation)")
        if not 0 < self.top_p <= 1:  # also refuses nan
            raise ValueError(f"rollout.top_p={self.top_p} must be in (0, 1] (1: no nucleus filtering)")
        if self.top_k != -1 and self.top_k < 1:
            raise ValueError(f"rollout.top_k={self.top_k} must be >= 1, or -1 (off)")
        if self.max_new_tokens < 1:
            raise ValueError(f"rollout.max_new_tokens={self.max_new_tokens} must be >= 1")
        if self.group_size < 2:
            raise ValueError(
                f"rollout.group_size={self.group_size}: group-relative advantages need >= 2 responses per prompt"
            )
        self._check_inflight_updates()  # before the streaming rules: an in-flight key's error names it
        self._check_partial_rollouts()
        if self.agent.enabled and self.truncated:
            raise ValueError(
                f"rollout.agent.name={self.agent.name} with rollout.truncated=true: Dynamic Truncated Rollout "
                "wraps single-turn generation; set rollout.truncated=false or rollout.agent.name=none"
            )
        if self.placement == Placement.colocated and self.async_rollout:
            raise ValueError(
                "rollout.placement=colocated with rollout.async_rollout=true: colocated, the engine and the "
                "trainer take turns on the same devices, so generation cannot run beside training; set "
                "rollout.async_rollout=false or rollout.placement=separate"
            )

    def _check_streaming(self) -> None:
        """A bound above 1 is the streaming mode: asynchronous, on either engine (``rollout/streaming.py``)."""
        if self.max_staleness < 0:
            raise ValueError(f"rollout.max_staleness={self.max_staleness} must be >= 0 (0: synchronous)")
        if self.max_staleness <= 1:
            return
        if not self.async_rollout:
            raise ValueError(
                f"rollout.max_staleness={self.max_staleness}: a bound above 1 is the streaming mode, which "
                "generates beside training; set rollout.async_rollout=true, or rollout.max_staleness to 0 or 1"
            )

    def _check_inflight_updates(self) -> None:
        """An in-flight update lands a weight sync inside the streaming producer's round: the embedded engine's
        decode loop takes it between two forwards (``rollout/embedded/inflight.py``), SGLang's servers between
        ``/pause_generation`` in that mode and ``/continue_generation`` (``SGLangEngine.update_weights_in_flight``)."""
        mode = self.inflight_update_mode
        if mode == InflightUpdateMode.off:
            return
        key = f"rollout.inflight_update_mode={mode}"
        if not (self.async_rollout and self.max_staleness > 1):
            raise ValueError(
                f"{key} lands a weight sync inside the streaming producer's round; without streaming "
                f"(rollout.async_rollout={self.async_rollout}, rollout.max_staleness={self.max_staleness}) no "
                "round runs beside the sync: set rollout.async_rollout=true and rollout.max_staleness >= 2, or "
                "rollout.inflight_update_mode=off"
            )
        embedded = self.engine == RolloutEngineName.embedded
        if embedded and mode == InflightUpdateMode.in_place and not self.embedded.use_cache:
            raise ValueError(
                f"{key} keeps the KV cache, and rollout.embedded.use_cache=false keeps none: set "
                "rollout.embedded.use_cache=true, or rollout.inflight_update_mode=retract"
            )

    def response_budget(self) -> tuple[str, int]:
        """The most tokens a row holds after its prompt, and the key that sets it: one response
        (``rollout.max_new_tokens``), or an agent's whole trajectory (``rollout.agent.max_tokens``: its
        turns, each at most ``max_new_tokens``, and the tool answers inserted between them)."""
        if self.agent.enabled:
            return "rollout.agent.max_tokens", self.agent.max_tokens
        return "rollout.max_new_tokens", self.max_new_tokens

    def prompt_budget(self, max_positions: int) -> int:
        """The most prompt tokens a row may have: prompt + what follows must fit ``model.max_position_embeddings``."""
        return max_positions - self.response_budget()[1]

    def _check_partial_rollouts(self) -> None:
        if not (math.isfinite(self.over_sample) and self.over_sample >= 1.0):
            raise ValueError(f"rollout.over_sample={self.over_sample} must be >= 1 (1: no over-sampling)")
        carries = self.partial == PARTIAL_CONTINUE
        if carries and self.over_sample == 1.0:
            raise ValueError(
                "rollout.partial=continue carries the groups over-sampling started but did not need, and "
                "rollout.over_sample=1 starts none more; set rollout.over_sample > 1 (e.g. 1.5)"
            )
        if carries and not self.async_rollout:  # async with over-sampling is refused below
            if self.max_staleness < 1:
                raise ValueError(
                    f"rollout.max_staleness={self.max_staleness}: rollout.partial=continue trains samples started "
                    "on an older policy; set rollout.max_staleness >= 1 (the versions a token may lag)"
                )
        else:
            self._check_streaming()
        if self.over_sample == 1.0:
            return
        refused = {
            "rollout.async_rollout=true": self.async_rollout,
            "rollout.truncated=true": self.truncated,
        }
        for setting, on in refused.items():
            if on:
                raise ValueError(
                    f"rollout.over_sample={self.over_sample} with {setting}: over-sampling is built for "
                    f"synchronous rollouts without truncation; set rollout.over_sample=1 or drop {setting}"
                )
        if self.agent.enabled:
            self._check_carried_trajectories()

    def _check_carried_trajectories(self) -> None:
        """Over-sampling with an agent carries a trajectory's engine session across a weight update
        (``rollout/agents/carried.py``); exact only where the session keeps the KV its routing rows came from."""
        refused = {
            # the client drives the trajectory from its own thread: no cut between turns, no run again
            f"rollout.agent.name={self.agent.name}": (
                self.agent.name == "openai_endpoint",
                "an endpoint client's trajectory cannot be cut between turns and run again; use an agent function",
            ),
            # a server's prefix cache may evict a carried trajectory's KV before its next turn (and a resumed
            # run's server has none): computed again under newer weights, that turn would be refused
            f"rollout.engine={self.engine}": (
                self.engine != RolloutEngineName.embedded,
                "carried trajectories continue on the embedded engine's kept KV cache; set rollout.engine=embedded",
            ),
            "rollout.embedded.use_cache=false": (
                self.engine == RolloutEngineName.embedded and not self.embedded.use_cache,
                "without a KV cache a carried trajectory's earlier positions are computed again under the new "
                "weights, which its routing rows were not; set rollout.embedded.use_cache=true",
            ),
        }
        for setting, (on, why) in refused.items():
            if on:
                raise ValueError(
                    f"rollout.over_sample={self.over_sample} with an agent, {setting}: "
                    f"{why} (or set rollout.over_sample=1)"
                )
