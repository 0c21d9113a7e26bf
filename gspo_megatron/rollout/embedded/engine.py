"""In-process rollout engine: transformers' model of the family with our own KV-cache decode loop.

Design decisions:
- The model is the family's transformers causal LM (``core/model_families.py``: ``Qwen3MoeForCausalLM``,
  ``MixtralForCausalLM``) built from its config (``model_type`` picks the family) with random init;
  real weights arrive through ``update_weights`` as HF checkpoint-named tensors (see
  ``embedded_weights``), the same path that feeds SGLang.
- Our own decode loop (not ``model.generate``): it gives exact control of sampling, log-probs, stop
  rules and routing capture. Rows (prompt x sample) are batched with LEFT padding, an attention mask
  and position ids = (number of real tokens before) so a padded row sees the same positions as alone.
  A row that finishes leaves the batch and the cache (``keep_cache_rows``: KV, and a gated DeltaNet's
  conv and recurrent states) after that step,
  so long-tailed lengths cost what the rows still running cost (``generate`` in transformers and
  TRL keeps feeding finished rows to the end). Sampling draws from per-row generators, so the
  tokens do not depend on which rows share the batch.
- ``use_cache=False`` re-runs the whole sequence each step (reference and benchmark for the cache).
- The prefill feeds each distinct prompt once and copies its KV rows, last logits and routed experts to the rows
  that repeat it (``_prefill_once_per_prompt``; SGLang's prefix cache shares a group's prompt alike): rows are
  computed independently, so each row gets what its own prefill computes, and the main job's prefill (256 rows,
  16 prompts) does 1/16 of the work. A retract's recompute feeds every running row's own tokens. CPU seconds of
  a ``generate`` of the main job's 256 rows of 16 prompts (20-40-token prompts, 3 new tokens): 0.093-0.104
  before, 0.023-0.036 after (issue 65, docs/benchmarks.md).
- The forward: ``lean_forward.py``'s for a Qwen3-MoE (transformers' math over the model's own parameters without
  its per-call machinery; its KV cache grows in place) unless ``rollout.embedded.forward=transformers``; every
  other model runs transformers' own forward. Both feed the same ``RouterCapture``.
- The KV cache is passed under the name the installed transformers' forward declares: ``cache``
  (5.x; ``past_key_values`` is deprecated there and removed in 5.40) or ``past_key_values`` (older
  releases), read once from the class's signature (``cache_argument``), so no deprecated argument is ever passed.
- Log-probs are log_softmax(logits / T) of the sampled token before top-k/top-p (see ``sampling``).
- Stop rules (checked in this order after each token): a ``stop_token_ids`` token, a ``stop`` string
  in the decoded tail (needs ``decode``), then ``max_new_tokens``. The stop token / the tokens that
  complete a stop string are KEPT in ``output_ids`` (as SGLang's output_ids do), so the trainer
  scores the token that ended the sample.
- Routed experts follow SGLang's layout int32 [prompt + output - 1, num_hidden_layers, top_k]. Dense
  layers are included to keep that shape and hold -1 (no expert); they are captured by forward hooks
  on each MoE layer's router (``mlp.gate``), whose top-k is the softmax -> top-k the block itself used.

In-flight weight updates (``request_update``, from another thread; the mailbox is ``inflight.py``; the training
loop's use is streaming's ``rollout.inflight_update_mode``, ``rollout/inflight_sync.py``):
- The decode loop takes a pending update at a step boundary -- before a forward -- so every forward runs
  under one version. A token's version is that of the forward whose logits it was sampled from: a row's
  versions go to ``Sample.extra["token_versions"]`` when they differ (the key agents and partial rollouts
  use), and ``Sample.weight_version`` is the oldest, as SGLang's retracted samples record it.
- ``in_place``: the KV cache is kept. The next forward feeds the token sampled last under the old weights
  over the old KV; every forward after computes under the new weights over that KV. A token's log-prob is
  that of the forward that sampled it, and each position's routing row stays that of the forward that
  computed its KV (the old weights' before the update, the new weights' from the update on), so one trainer
  forward replaying the rows reproduces the routing every token was sampled with: R3 is exact, as under
  SGLang's ``pause_mode=in_place`` (docs/agents.md). Without a KV cache (``use_cache=False``) there is no
  KV to keep and ``in_place`` is refused.
- ``retract``: the running rows' KV is computed again: the next forward feeds each row's whole sequence
  under the new weights (SGLang re-queues a retracted request and prefills it again), so every token
  sampled after the update has the log-prob of a full forward of the new weights. Its routing: the
  recompute routes the earlier positions under the new weights, while the tokens before the update were
  sampled over the old routing. One row per position cannot replay both (the rule ``RoutingVersionError``
  applies to agents, docs/agents.md), so a row that returns routed experts and that the new weights route
  otherwise at any of its real positions ENDS at the update (``FinishReason.ABORT``: its tokens, log-probs
  and rows so far, all of the old version, exact; ``Sample.extra[RETRACT_REROUTED]`` counts the
  positions) -- its trajectory ends at its last exact token, as an agent's at its last exact turn. A row the
  new weights route alike at every position goes on: its rows are both versions'. Rows that return no
  routing always go on. For R3 across updates use ``in_place``: the loop refuses ``retract`` where an MoE
  engine returns routing (``config/validate.py``), so a trained group never holds such an ``ABORT`` row.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
from collections import Counter
from collections.abc import Callable, Iterable

import torch
from transformers import PretrainedConfig
from transformers.cache_utils import DynamicCache

from gspo_megatron.contracts.samples import TOKEN_VERSIONS, FinishReason, RowRequest, Sample, SamplingParams
from gspo_megatron.core.fp8_blocks import fake_quantize_named_tensors
from gspo_megatron.core.model_families import family
from gspo_megatron.rollout.config import EmbeddedConfig, EmbeddedForward, InflightUpdateMode
from gspo_megatron.rollout.embedded.inflight import (
    RETRACT_REROUTED,
    InflightUpdate,
    UpdateMailbox,
    UpdateTicket,
    inflight_update_mode,
)
from gspo_megatron.rollout.embedded.kv_cache import KeptCache, cache_argument, keep_cache_rows
from gspo_megatron.rollout.embedded.lean_forward import (
    LeanForwardRefusal,
    Qwen3MoeLeanForward,
    growing_cache,
    lean_forward_for,
)
from gspo_megatron.rollout.embedded.router_capture import RouterCapture
from gspo_megatron.rollout.embedded.sampling import RowUniforms, row_generators, sample_next_tokens
from gspo_megatron.rollout.embedded.weights import HfWeightLoader
from gspo_megatron.rollout.engine import EngineSession, RolloutEngine, TurnRequest, TurnResult
from gspo_megatron.rollout.sglang.config import WeightQuantization

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
_STOP_TAIL_EXTRA_TOKENS = 8  # decode this many tokens beyond the longest stop string's length


def _rerouted_positions(
    held: torch.Tensor, fresh: torch.Tensor, mask: torch.Tensor, active: list[int]
) -> dict[int, int]:
    """After a retract's recompute: the chunk rows (``active``, in batch order) with real positions (``mask`` 1)
    whose new top-k experts (``fresh``, [A, P, layers, k]) differ as a set from the held ones: {row: how many}."""
    differs = (held.sort(-1).values != fresh.sort(-1).values).flatten(2).any(-1) & mask.bool().cpu()
    return {row: count for row, count in zip(active, differs.sum(-1).tolist(), strict=True) if count}


class _GroupsDone:
    """How many groups of a ``generate_rows`` call have all their rows finished, against how many are needed."""

    def __init__(self, group_of_row: list[int], needed: int):
        self.group_of_row = group_of_row
        self.unfinished = Counter(group_of_row)  # rows still running, per group
        self.needed = needed
        self.complete = 0

    @property
    def reached(self) -> bool:
        return self.complete >= self.needed

    def finish(self, row: int) -> None:
        group = self.group_of_row[row]
        self.unfinished[group] -= 1
        if self.unfinished[group] == 0:
            self.complete += 1


class EmbeddedEngine(RolloutEngine):
    """Generation with transformers' model of the family in the caller's process."""

    def __init__(
        self,
        hf_config: PretrainedConfig,
        config: EmbeddedConfig | None = None,
        decode: Callable[[list[int]], str] | None = None,
    ):
        self.config = config if config is not None else EmbeddedConfig()
        self.decode = decode
        hf_config = copy.deepcopy(hf_config)  # the attention choice below must not leak to the caller
        hf_config._attn_implementation = self.config.attn_implementation
        _, model_class = family(hf_config.model_type).transformers_classes()
        self._cache_argument = cache_argument(model_class)
        self.model = model_class(hf_config).to(device=self.config.device, dtype=_DTYPES[self.config.dtype]).eval()
        self._lean = self._lean_forward()
        self._loader = HfWeightLoader(self.model)
        self._seed_source = torch.Generator().manual_seed(self.config.seed)
        self.weight_version = 0
        self._updates = UpdateMailbox(self.update_weights)  # in-flight updates (``request_update``)
        self._kept: list[KeptCache | None] = []  # the last turn chunk's rows' caches (``_generate_chunk``)

    def _lean_forward(self) -> Qwen3MoeLeanForward | None:
        """The lean decode forward (``lean_forward.py``) where the config asks for it and it serves this model."""
        if self.config.forward != EmbeddedForward.lean:
            return None
        lean = lean_forward_for(self.model)
        return None if isinstance(lean, LeanForwardRefusal) else lean

    # ------------------------------------------------------------------ weights
    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int) -> None:
        """Copy HF-named tensors in as they stream; the version is set only after all loaded. With
        ``weight_quantization=fp8_block`` each projection weight arrives through its FP8 round trip."""
        if self.config.weight_quantization == WeightQuantization.fp8_block:
            named_tensors = fake_quantize_named_tensors(named_tensors)
        for name, tensor in named_tensors:
            self._loader.load(name, tensor)
        self.weight_version = version

    def request_update(
        self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int, mode: str
    ) -> UpdateTicket:
        """Thread-safe: load a new version into a running generation at its next decode step boundary
        (``mode``: ``in_place`` or ``retract``, module docstring), or at once if none runs. ``ticket.wait
        (timeout_s)`` returns when it is applied; the tensors must stay valid until then (``inflight.py``).
        ``update_weights`` is for between generation calls only."""
        chosen = inflight_update_mode(mode)
        if chosen == InflightUpdateMode.in_place and not self.config.use_cache:
            raise ValueError(
                "an in_place update keeps the KV cache, and rollout.embedded.use_cache=false keeps none (every "
                "step computes the whole sequence again): use mode retract, or rollout.embedded.use_cache=true"
            )
        return self._updates.request(InflightUpdate(named_tensors, version, chosen))

    def release_memory(self) -> None:
        """Colocated: the model's weights to host memory (on a CPU engine they are there already)."""
        if torch.device(self.config.device).type != "cpu":
            self.model.to("cpu")

    def resume_memory(self) -> None:
        if torch.device(self.config.device).type != "cpu":
            self.model.to(self.config.device)

    def health(self):
        return {"ok": True, "weight_version": self.weight_version, "device": self.config.device}

    # ------------------------------------------------------------------ generation
    def generate(self, prompts: list[list[int]], params: SamplingParams) -> list[list[Sample]]:
        with self._updates.generating():
            return self._generate(prompts, params)

    def _generate(self, prompts: list[list[int]], params: SamplingParams) -> list[list[Sample]]:
        self._check_request(prompts, params)
        seed = self._call_seed(params)
        rows = [prompt for prompt in prompts for _ in range(params.n)]
        generators = row_generators(seed, len(rows))
        samples: list[Sample] = []
        step = self.config.max_batch_size
        for start in range(0, len(rows), step):
            samples += self._generate_chunk(rows[start : start + step], generators[start : start + step], params)
        return [samples[i * params.n : (i + 1) * params.n] for i in range(len(prompts))]

    def generate_rows(self, rows: list[RowRequest], params: SamplingParams, groups_needed: int) -> list[Sample]:
        """``RolloutEngine.generate_rows``: rows in chunks of ``max_batch_size`` as ``generate``'s; after each
        decoded token the rows that finished count towards their groups, and once ``groups_needed`` groups
        are complete the rows still decoding stop (``ABORT``, their tokens kept) and later chunks do not start."""
        with self._updates.generating():
            return self._generate_rows(rows, params, groups_needed)

    def _generate_rows(self, rows: list[RowRequest], params: SamplingParams, groups_needed: int) -> list[Sample]:
        self._check_request([row.prompt_ids for row in rows], params)
        seed = self._call_seed(params)
        generators = row_generators(seed, len(rows))
        done = _GroupsDone([row.group for row in rows], groups_needed)
        samples: list[Sample] = []
        step = self.config.max_batch_size
        for start in range(0, len(rows), step):
            chunk = rows[start : start + step]
            if done.reached:
                samples += [self._sample(row.prompt_ids, [], [], FinishReason.ABORT, None, [], {}) for row in chunk]
                continue
            budgets = [row.max_new_tokens for row in chunk]
            samples += self._generate_chunk(
                [row.prompt_ids for row in chunk], generators[start : start + step], params, budgets, done, start
            )
        return samples

    def generate_turns(self, requests: list[TurnRequest]) -> list[TurnResult]:
        """``RolloutEngine.generate_turns`` with each trajectory's KV cache kept in its session: a turn feeds
        only the tokens its session has not (the last turn's final token, the inserted ones), so every
        position goes through one forward, under the weights live then, and its routing row is that
        forward's. Rows of one call share a batch (with padding between a row's cached and new positions);
        each draws from its own turn's seed. An in-flight update requested meanwhile lands as the call ends."""
        with self._updates.generating(takes_updates=False):
            return self._generate_turns(requests)

    def _generate_turns(self, requests: list[TurnRequest]) -> list[TurnResult]:
        if not self.config.use_cache:  # no cache to keep: feed the whole context again
            return super().generate_turns(requests)
        self._check_request([request.ids for request in requests], requests[0].params if requests else SamplingParams())
        results: list[TurnResult | None] = [None] * len(requests)
        by_params: dict[SamplingParams, list[int]] = {}
        for index, request in enumerate(requests):  # rows of one call share stops and sampling settings
            by_params.setdefault(dataclasses.replace(request.params, seed=None, max_new_tokens=1), []).append(index)
        step = self.config.max_batch_size
        for params, indices in by_params.items():
            for start in range(0, len(indices), step):
                chunk = [requests[i] for i in indices[start : start + step]]
                for index, result in zip(indices[start : start + step], self._turn_chunk(chunk, params), strict=True):
                    results[index] = result
        return [result for result in results if result is not None]

    def _turn_chunk(self, requests: list[TurnRequest], params: SamplingParams) -> list[TurnResult]:
        sessions = [request.session for request in requests]
        fed = [session.fed if session is not None else 0 for session in sessions]
        for session in sessions:
            if session is not None and session.fed and not isinstance(session.state, KeptCache):
                raise ValueError("a turn continues a session another engine (or no cache) kept; start it afresh")
        new_ids = [request.ids[first:] for request, first in zip(requests, fed, strict=True)]
        generators = [row_generators(self._call_seed(request.params), 1)[0] for request in requests]
        budgets = [request.params.max_new_tokens for request in requests]
        samples = self._generate_chunk(new_ids, generators, params, budgets, sessions=sessions)
        kept = self._kept
        return [
            TurnResult(
                sample.output_ids,
                sample.output_log_probs,
                sample.finish_reason,
                sample.weight_version,
                sample.routed_experts,
                EngineSession(first + len(new) + len(sample.output_ids) - 1, kept_cache),
            )
            for sample, kept_cache, first, new in zip(samples, kept, fed, new_ids, strict=True)
        ]

    def session_state(self, session: EngineSession) -> dict:
        """The session's kept KV cache as CPU tensors (a carried trajectory in a checkpoint continues on the
        very KV its positions' routing rows were computed with)."""
        kept = session.state if isinstance(session.state, KeptCache) else None
        layers = [[keys.cpu(), values.cpu()] for keys, values in kept.layers] if kept is not None else None
        return {"fed": session.fed, "kv": layers}

    def session_from_state(self, state: dict) -> EngineSession:
        layers = state.get("kv")
        if layers is None:
            return EngineSession(int(state["fed"]))
        device = self.config.device
        kept = KeptCache(tuple((keys.to(device), values.to(device)) for keys, values in layers))
        if kept.length != int(state["fed"]):
            raise ValueError(f"a saved session of {state['fed']} fed positions holds KV of {kept.length}")
        return EngineSession(int(state["fed"]), kept)

    def _resume_sessions(
        self, sessions: list[EngineSession | None], mask: torch.Tensor, positions: torch.Tensor
    ) -> tuple[DynamicCache, torch.Tensor, torch.Tensor]:
        """The batch's KV cache of its rows' cached positions (each row's left-padded to the longest), the
        attention mask over cached and new positions, and the new positions' ids (after each row's cached)."""
        kept = [s.state if s is not None and isinstance(s.state, KeptCache) else None for s in sessions]
        lengths = [k.length if k is not None else 0 for k in kept]
        width, batch = max(lengths), len(sessions)
        if width == 0:
            return DynamicCache(config=self.model.config), mask, positions
        template = next(k for k in kept if k is not None and k.length)
        layers = []
        for layer, (keys_like, values_like) in enumerate(template.layers):
            keys = keys_like.new_zeros(batch, keys_like.shape[0], width, keys_like.shape[2])
            values = values_like.new_zeros(batch, values_like.shape[0], width, values_like.shape[2])
            for row, cached in enumerate(kept):
                if cached is not None and cached.length:
                    keys[row, :, width - cached.length :] = cached.layers[layer][0]
                    values[row, :, width - cached.length :] = cached.layers[layer][1]
            layers.append((keys, values))
        cached_mask = torch.zeros((batch, width), dtype=mask.dtype, device=mask.device)
        for row, length in enumerate(lengths):
            cached_mask[row, width - length :] = 1 if length else 0
        offsets = torch.tensor(lengths, device=positions.device)[:, None]
        positions = torch.where(mask.bool(), positions + offsets, torch.zeros_like(positions))
        return (
            DynamicCache(ddp_cache_data=layers, config=self.model.config),
            torch.cat([cached_mask, mask], -1),
            positions,
        )

    def _call_seed(self, params: SamplingParams) -> int:
        """The call's seed: ``params.seed``, else the next draw of the engine's own generator."""
        return params.seed if params.seed is not None else int(torch.randint(0, 2**62, (), generator=self._seed_source))

    def _check_request(self, prompts, params: SamplingParams) -> None:
        if params.stop and self.decode is None:
            raise ValueError(
                "stop strings need a decode(ids) -> str callable: pass decode= to EmbeddedEngine, or use stop_token_ids"
            )
        vocab = self.model.config.vocab_size
        for i, prompt in enumerate(prompts):
            if len(prompt) == 0:
                raise ValueError(f"prompt {i} is empty; every prompt needs at least one token")
            if min(prompt) < 0 or max(prompt) >= vocab:
                raise ValueError(f"prompt {i} has token ids outside [0, {vocab}) (the model's vocab)")

    @torch.no_grad()
    def _generate_chunk(
        self,
        prompts: list[list[int]],
        generators,
        params: SamplingParams,
        budgets: list[int] | None = None,
        done: _GroupsDone | None = None,
        first_row: int = 0,
        sessions: list[EngineSession | None] | None = None,
    ) -> list[Sample]:
        """``budgets``: each row's max_new_tokens (``params.max_new_tokens`` for all by default); ``done``: the
        call's group count (``generate_rows``), rows numbered from ``first_row`` in it; ``sessions``: turns
        (``generate_turns``), where ``prompts`` are each row's tokens not yet fed, after its session's cached
        positions; each row's cache when it left is ``self._kept`` afterwards."""
        budgets = budgets if budgets is not None else [params.max_new_tokens] * len(prompts)
        device = self.config.device
        batch, width = len(prompts), max(len(p) for p in prompts)
        # left padding, built from one flat tensor (a copy per row cost 256 tensor ops in the main job)
        real = torch.arange(width) >= (width - torch.tensor([len(p) for p in prompts]))[:, None]
        ids = torch.full((batch, width), self.config.pad_token_id, dtype=torch.long)
        ids[real] = torch.tensor([token for prompt in prompts for token in prompt], dtype=torch.long)
        ids, mask = ids.to(device), real.long().to(device)
        positions = (mask.cumsum(-1) - 1).clamp(min=0)
        cache = self._new_cache(width + max(budgets)) if self.config.use_cache else None
        if sessions is not None:  # turns: each row continues its trajectory's cached positions
            cache, mask, positions = self._resume_sessions(sessions, mask, positions)
        outputs: list[list[int]] = [[] for _ in range(batch)]
        log_probs: list[list[float]] = [[] for _ in range(batch)]
        versions: list[list[int]] = [[] for _ in range(batch)]  # each token's weight version
        finish: list[FinishReason | None] = [None] * batch
        extras: list[dict] = [{} for _ in range(batch)]
        # routed experts of every position this call feeds (padding included), -1 where never fed
        routing = None
        if params.return_routed_experts:
            layers, top_k = self.model.config.num_hidden_layers, self.model.config.num_experts_per_tok
            routing = torch.full((batch, width + max(budgets), layers, top_k), -1, dtype=torch.int32)
        active = list(range(batch))  # chunk rows still generating, in the order of the model's batch
        kept: list[KeptCache | None] = [None] * batch  # turns: each row's cache when it leaves the batch
        feed_ids, feed_positions, fed = ids, positions, 0
        capture = RouterCapture(self.model) if routing is not None else None
        uniforms = RowUniforms(generators)  # every active row draws at every step (rows only leave)
        with capture if capture is not None else contextlib.nullcontext():
            for step in range(max(budgets)):
                retracted = 0  # a retract update: this forward computes positions 0..retracted-1 again
                update = self._updates.take()  # an in-flight update lands here, between two forwards
                if update is not None and update.mode == InflightUpdateMode.retract and fed > 0:
                    retracted, fed, feed_ids, feed_positions = fed, 0, ids, positions
                    cache = self._new_cache(width + max(budgets)) if cache is not None else None
                # the prefill feeds each prompt once; a retract's recompute (fed 0 again, later) feeds every row's own
                # prompt and tokens, which differ between the samples of one prompt
                if step == 0 and cache is not None and sessions is None:
                    logits = self._prefill_once_per_prompt(prompts, ids, mask, positions, cache, capture)
                else:
                    logits = self._forward(feed_ids, mask, feed_positions, cache, capture)
                new = feed_ids.shape[1] if cache is not None or fed == 0 else 1
                step_rows = capture.take(len(active), new) if capture is not None else None
                rerouted: dict[int, int] = {}  # rows ended by a retract update: {row: positions routed otherwise}
                if retracted and step_rows is not None and routing is not None:
                    held = routing[active, :retracted]
                    rerouted = _rerouted_positions(held, step_rows[:, :retracted], mask[:, :retracted], active)
                going = [i for i, r in enumerate(active) if r not in rerouted]  # the rows that go on
                going_rows = [active[i] for i in going]
                every = len(going) == len(active)  # no row ended by a retract: no gather needed
                if step_rows is not None and routing is not None:
                    routing[_rows_index(going_rows, batch), fed : fed + new] = step_rows if every else step_rows[going]
                fed += new
                draws = uniforms.at(active, step) if params.temperature > 0 else None
                tokens, token_log_probs = sample_next_tokens(logits[:, -1], params, draws)
                going_tokens, going_log_probs = tokens, token_log_probs  # ``tokens`` stays the active rows'
                if not every:
                    going_index = torch.tensor(going, dtype=torch.long, device=tokens.device)
                    going_tokens, going_log_probs = tokens[going_index], token_log_probs[going_index]
                self._record(
                    going_rows,
                    going_tokens,
                    going_log_probs,
                    outputs,
                    log_probs,
                    versions,
                    finish,
                    params,
                    budgets,
                )
                for r, count in rerouted.items():  # it ends at its last exact token (module docstring)
                    finish[r], extras[r] = FinishReason.ABORT, {RETRACT_REROUTED: count}
                keep = [i for i, r in enumerate(active) if finish[r] is None]
                if done is not None:
                    for r in active:
                        if finish[r] is not None and r not in rerouted:  # an ended row is no finished sample
                            done.finish(first_row + r)
                    if done.reached:  # enough groups are complete: the rows still decoding stop here
                        for r in active:
                            finish[r] = finish[r] or FinishReason.ABORT
                        break
                if sessions is not None and cache is not None:  # a row leaving keeps its cache
                    for i, r in enumerate(active):
                        if finish[r] is not None:
                            kept[r] = KeptCache.of_row(cache, mask, i)
                if not keep:
                    break
                if len(keep) < len(active):
                    # finished rows leave the batch (and the KV cache): the rest decode as they would
                    # alone, since sampling draws from per-row generators
                    index = torch.tensor(keep, device=device)
                    active = [active[i] for i in keep]
                    ids, positions, mask, tokens = ids[index], positions[index], mask[index], tokens[index]
                    if cache is not None:
                        keep_cache_rows(cache, index)
                next_ids = tokens.unsqueeze(-1)
                next_positions = positions[:, -1:] + 1
                ids, positions = torch.cat([ids, next_ids], -1), torch.cat([positions, next_positions], -1)
                mask = torch.cat([mask, torch.ones_like(next_ids)], -1)
                feed_ids, feed_positions = (next_ids, next_positions) if cache is not None else (ids, positions)
        if sessions is not None and cache is not None:  # rows stopped by a group count keep theirs too
            for i, r in enumerate(active):
                if kept[r] is None:
                    kept[r] = KeptCache.of_row(cache, mask, i)
        self._kept = kept
        return [
            self._sample(
                prompts[r],
                outputs[r],
                log_probs[r],
                finish[r],
                None if routing is None else routing[r, width - len(prompts[r]) :],
                versions[r],
                extras[r],
            )
            for r in range(batch)
        ]

    def _prefill_once_per_prompt(
        self,
        prompts: list[list[int]],
        ids: torch.Tensor,
        mask: torch.Tensor,
        positions: torch.Tensor,
        cache: DynamicCache,
        capture: RouterCapture | None,
    ) -> torch.Tensor:
        """The prefill of rows that repeat prompts (a group's samples): each distinct prompt is fed once, then its
        KV cache rows, last logits and routed experts are copied to every row of it (SGLang's prefix cache does
        the same for a shared prompt). Rows are computed independently of each other, so every row gets what
        its own prefill computes; only the work is divided by the samples per prompt (the main job: 256 rows of
        16 prompts)."""
        first_row: dict[tuple[int, ...], int] = {}  # each distinct prompt -> the first row that has it
        for row, prompt in enumerate(prompts):
            first_row.setdefault(tuple(prompt), row)
        if len(first_row) == len(prompts):
            return self._forward(ids, mask, positions, cache, capture)
        number = {prompt: n for n, prompt in enumerate(first_row)}
        distinct = torch.tensor(list(first_row.values()), device=ids.device)
        logits = self._forward(ids[distinct], mask[distinct], positions[distinct], cache, capture)
        rows = torch.tensor([number[tuple(prompt)] for prompt in prompts], device=ids.device)  # each row's prompt
        keep_cache_rows(cache, rows)
        if capture is not None:
            capture.select_rows(len(first_row), rows)
        return logits.index_select(0, rows)

    def _new_cache(self, capacity: int) -> DynamicCache:
        """A fresh KV cache for ``capacity`` positions: the lean forward's is written in place (``GrowingKVLayer``:
        one room of that size), transformers' concatenates."""
        if self._lean is not None:
            return growing_cache(self.model.config, capacity)
        return DynamicCache(config=self.model.config)

    def _forward(
        self,
        ids: torch.Tensor,
        mask: torch.Tensor,
        positions: torch.Tensor,
        cache: DynamicCache | None,
        capture: RouterCapture | None,
    ) -> torch.Tensor:
        """The last position's logits [B, 1, V] of feeding ``ids`` over ``cache``; the routers' top-k go to
        ``capture`` (transformers' forward through its hooks, the lean forward by its return)."""
        if self._lean is not None:
            out = self._lean(ids, mask, positions, cache)
            if capture is not None:
                for layer, indices in out.routed.items():
                    capture.record(layer, indices)
            return out.logits
        return self.model(
            input_ids=ids,
            attention_mask=mask,
            position_ids=positions,
            use_cache=cache is not None,
            logits_to_keep=1,
            **{self._cache_argument: cache},
        ).logits

    def _record(
        self,
        rows,
        tokens,
        token_log_probs,
        outputs,
        log_probs,
        versions,
        finish,
        params: SamplingParams,
        budgets: list[int],
    ) -> None:
        """Append each active row's sampled token (``rows[i]`` sampled ``tokens[i]``) with the weight version that
        sampled it; mark rows that stop."""
        for row, token, log_prob in zip(rows, tokens.tolist(), token_log_probs.tolist(), strict=True):
            outputs[row].append(token)
            log_probs[row].append(log_prob)
            versions[row].append(self.weight_version)
            if token in params.stop_token_ids or self._hit_stop_string(outputs[row], params.stop):
                finish[row] = FinishReason.STOP
            elif len(outputs[row]) >= budgets[row]:
                finish[row] = FinishReason.LENGTH

    def _hit_stop_string(self, output: list[int], stops: tuple[str, ...]) -> bool:
        if not stops:
            return False
        if self.decode is None:
            raise ValueError("stop strings need the engine's decode function (EmbeddedEngine(decode=...))")
        window = max(len(s) for s in stops) + _STOP_TAIL_EXTRA_TOKENS
        tail = self.decode(output[-window:])
        return any(stop in tail for stop in stops)

    def _sample(self, prompt, output, log_probs, finish, routing, versions: list[int], extra: dict) -> Sample:
        """A row's sample; tokens of more than one weight version (an in-flight update) list each token's, and the
        sample's version is the oldest (module docstring)."""
        if routing is not None:
            routing = routing[: len(prompt) + len(output) - 1].contiguous()
        if len(set(versions)) > 1:
            extra = {**extra, TOKEN_VERSIONS: list(versions)}
        return Sample(
            prompt_ids=list(prompt),
            output_ids=output,
            output_log_probs=torch.tensor(log_probs, dtype=torch.float32),
            finish_reason=finish,
            routed_experts=routing,
            weight_version=min(versions, default=self.weight_version),
            extra=extra,
        )


def _rows_index(rows: list[int], batch: int) -> list[int] | slice:
    """``rows`` of a ``batch``-row tensor as an index: a slice when they are every row in order (a plain copy,
    where a list index scatters row by row: the prefill's routing rows, 256 x 30 positions in the main job)."""
    return slice(None) if len(rows) == batch and rows == list(range(batch)) else rows
