"""``SGLangEngine``: the RolloutEngine backed by SGLang servers (launched here or attached to).

Design decisions:
- The async client lives on an event loop this engine runs in its own thread. ``generate`` and
  ``update_weights`` are plain synchronous calls that work whether or not the caller already runs
  an event loop (the trainer is synchronous; notebooks and async drivers are not).
- One ``/generate`` per sample (not SGLang's ``n``): samples then spread over servers by load, each
  can carry its own seed, and a failed sample is retried alone.
- Weight sync follows SGLang 0.5.x's bracket on every server: pause_generation -> begin_weight_update
  -> updates -> end_weight_update -> flush_cache -> continue_generation. A fault never leaves a server
  unusable: the session is ended (SGLang refuses every later begin while one is open), the update group
  is torn down, a distributed or tensor update is retried through the disk path (``fallback_to_disk``), and
  ``continue_generation`` is always sent; a failure that remains is raised. A stop (``RunInterrupted``,
  a second signal raised from its handler) is no failure of the sync: it is not retried through the disk
  path and is raised as it is, so the run exits 128 + signal (``core/interrupts.py``).
- The flush is skipped under ``pause_mode=in_place``: paused requests stay in SGLang's running batch and
  its flush answers 400 while the batch is not empty (those requests keep their KV cache by design). The
  prefix cache then keeps a multi-turn trajectory's KV across the update, which is what keeps its routing
  exact across weight versions; after a flush (``retract``) its next turn is refused (``docs/agents.md``).
- Distributed sync (``group_sender.py``): the driver's update group, formed on the first update and
  re-formed whenever the set of live servers changes; each byte-size bucket is one
  ``/update_weights_from_distributed`` per server while the bucket is broadcast, the first failure wins
  (a refused bucket fails at once with the server's message). With pipeline stages each stage's first
  rank sends its own layers over its own group (``StagedWeights``, ``rollout/sglang/stage_turns.py``), the
  version set with ``/update_weight_version`` once every stage has sent. The groups are destroyed on the
  servers at shutdown, so a later run can form them with the same names.
- Memory: weights are streamed, never listed. The bucket being sent is the only one held (the next is
  gathered after it has left), so the driver's extra memory is about one bucket whatever the model size;
  a retry through the disk path reads the weights again (the trainer's stream re-exports).
- Tensor sync (``weight_sync=tensor``, servers on the trainer's host: the colocated path): each bucket
  is one ``/update_weights_from_tensor`` per server carrying handles to the driver's memory
  (``tensor_handles.py``: named shared-memory files on CPU, CUDA IPC on a GPU), one payload per server
  TP rank; the bucket is dropped once every server has answered. A failure falls back to disk as above.
- Disk sync: buckets become safetensors shards plus an index under ``<disk_sync_dir>/v<version>/``
  (an absolute path: the server resolves a relative one against its own cwd) beside copies of the
  checkpoint's non-weight files, then ``/update_weights_from_disk``; older ``v*`` directories are
  removed once the servers hold the new version. The directory must be visible to the servers. A
  relative ``disk_sync_dir`` lies under the run directory (two runs from one working directory once
  loaded each other's weights), and the engine creates it private (0700) and refuses one that is a
  link or another user's (``core/run_dir.py:private_directory``).
- Every server's SGLang version is checked against ``version.SUPPORTED_SGLANG`` at start-up.
- The servers answer to this run only (``auth.py``): launched ones get a fresh API key (or the one in
  the variable ``api_key_env`` names), attached ones take the key from that variable; every call carries
  it, and a server that answers without it is refused at start-up.
- Seeds: SGLang honours ``sampling_seed`` only under ``--enable-deterministic-inference``; without it
  no seed is sent and a warning says samples are not reproducible.
- The weight version is sent with every update and read back from ``meta_info.weight_version``; a
  sample an update landed in (an in-flight update, ``update_weights_in_flight``, either pause mode) records
  the OLDEST version among ``meta_info.weight_versions`` (its spans are kept in ``Sample.extra``), so
  staleness is never under-counted, and each token's version in ``Sample.extra["token_versions"]``.
  SGLang 0.5.23 reports versions per request as spans of output tokens, not per token: the split point is
  the request's output length when the version changed (``GenerateResult.token_versions``), exact with the
  overlap schedule off (the CPU launch); with it on, a token whose forward was in flight at the pause may
  be counted to the new version.
"""

from __future__ import annotations

import asyncio
import json
import uuid
import warnings
from collections import Counter
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

from gspo_megatron.contracts.samples import TOKEN_VERSIONS, FinishReason, RowRequest, Sample, SamplingParams
from gspo_megatron.core.fp8_blocks import QuantizedStream, quantize_named_tensors
from gspo_megatron.core.interrupts import RunInterrupted
from gspo_megatron.core.ports import free_port
from gspo_megatron.core.run_dir import private_directory
from gspo_megatron.rollout.engine import EngineSession, RolloutEngine, TurnRequest, TurnResult, split_rows
from gspo_megatron.rollout.sglang.auth import ApiKey, key_from_environment, new_launch_key, private_key_config
from gspo_megatron.rollout.sglang.client import ServerState, SGLangHTTPClient
from gspo_megatron.rollout.sglang.config import LaunchMode, PauseMode, SGLangConfig, WeightQuantization, WeightSync
from gspo_megatron.rollout.sglang.disk_sync import remove_older_versions, write_safetensors_checkpoint
from gspo_megatron.rollout.sglang.group_sender import GroupSender, SenderBrief, StagedWeights
from gspo_megatron.rollout.sglang.launcher import LaunchedServer, build_launch_command
from gspo_megatron.rollout.sglang.protocol import build_generate_request, parse_generate_response
from gspo_megatron.rollout.sglang.server_calls import LoopThread, ServerCalls, gather, make_client
from gspo_megatron.rollout.sglang.tensor_handles import update_from_tensor_body
from gspo_megatron.rollout.sglang.version import check_sglang_version
from gspo_megatron.rollout.sglang.weight_sync import bucket_named_tensors


class WeightSyncError(RuntimeError):
    """A weight update failed on at least one server (the servers were told to continue anyway)."""


class SGLangEngine(RolloutEngine):
    def __init__(self, config: SGLangConfig, run_dir: Path | None = None):
        """``run_dir``: the run's directory, which a relative ``disk_sync_dir`` lies under (None: the
        working directory, for an engine a tool builds on its own)."""
        config.require_targets()
        self.config = config
        self._run_dir = run_dir
        self.weight_version = 0
        self._closed = False
        self._launched: list[LaunchedServer] = []
        self._routed_layout = _routed_experts_layout(config)
        self._sender: GroupSender | None = None  # the driver's distributed sender (formed with the client)
        self._seeds_honoured = config.enable_deterministic_inference
        self._tp_sizes: dict[str, int] = {}  # url -> the server's TP size (``_inspect_servers``)
        launching = config.mode == LaunchMode.launch
        self._api_key = key_from_environment(config.api_key_env)  # launch: a fresh one unless configured
        if launching and self._api_key is None:
            self._api_key = new_launch_key()
        self._loop = LoopThread()
        try:
            urls = self._launch_servers() if launching else list(config.urls)
            self._client: SGLangHTTPClient = self._loop.run(make_client(urls, config, self._api_key))
            self._calls = ServerCalls(self._client, self._loop)
            self._sender = GroupSender(
                self._calls,
                config,
                config.weight_sync_group_name,
                config.weight_sync_master_address,
                config.weight_sync_master_port,
            )
            if config.mode == LaunchMode.attach:
                self._loop.run(
                    self._client.wait_healthy(
                        config.attach_timeout_s, config.health_poll_interval_s, config.progress_every_s
                    )
                )
            self._inspect_servers()
        except BaseException:
            self.shutdown()
            raise

    def _inspect_servers(self) -> None:
        """Check each server's SGLang version; in attach mode learn whether seeds are honoured and each
        server's TP size (what a weight sync addresses: its ranks in the update group, its payloads)."""
        self._loop.run(self._client.check_key_enforced())
        servers = self._client.pool.servers
        infos = self._loop.run(gather([self._client.call(server, "GET", "/server_info") for server in servers]))
        for server, info in zip(servers, infos, strict=True):
            info = info if isinstance(info, dict) else {}
            check_sglang_version(info.get("version"), server.url)
            attached = self.config.mode == LaunchMode.attach
            self._tp_sizes[server.url] = int(info.get("tp_size", self.config.tp)) if attached else self.config.tp
        if self.config.mode == LaunchMode.attach:
            self._seeds_honoured = all(isinstance(i, dict) and i.get("enable_deterministic_inference") for i in infos)

    # ------------------------------------------------------------------ generation
    def generate(self, prompts: list[list[int]], params: SamplingParams) -> list[list[Sample]]:
        self._check_sampling(params)
        return self._loop.run(self._generate_all(prompts, params))

    def generate_rows(self, rows: list[RowRequest], params: SamplingParams, groups_needed: int) -> list[Sample]:
        """``RolloutEngine.generate_rows``: a request per row (its own ``max_new_tokens`` and ``rid``), a group's
        rows on one server; once ``groups_needed`` groups have all their rows answered, every row still
        running is stopped with ``POST /abort_request {"rid": ...}`` on the live servers, and SGLang answers
        each with what it generated (finish reason abort; HTTP 503 for a non-streaming request)."""
        self._check_sampling(params)
        return self._loop.run(self._generate_rows(rows, params, groups_needed))

    def generate_turns(self, requests: list[TurnRequest]) -> list[TurnResult]:
        """``RolloutEngine.generate_turns``: every turn a request of its own, all at once; a trajectory stays on
        the server of its first turn (``EngineSession.state``: its URL), whose prefix cache holds its earlier
        positions. The server answers rows for the whole context; those of positions an earlier turn fed come
        back as ``TurnResult.earlier_rows``: SGLang writes a position's row into the slot of its KV when the
        forward computes it and reads a request's rows through its KV slots (0.5.23
        ``srt/state_capturer/base.py`` ``on_forward_end`` / ``TopkCaptureOutput.finalize``, ``get_topk``), so
        a prefix-cache hit returns the row recorded when that KV was computed, and a position computed again
        (its KV flushed or evicted) a new one; ``Conversation`` tells the two apart."""
        for request in requests:
            self._check_sampling(request.params)
        return self._loop.run(self._generate_turns(requests))

    async def _generate_turns(self, requests: list[TurnRequest]) -> list[TurnResult]:
        assigned: dict[str, int] = {}
        live = {server.url: server for server in self._client.pool.alive()}
        tasks = []
        for request in requests:
            pinned = live.get(str(request.session.state)) if request.session is not None else None
            server = pinned or self._server_for_group(assigned, 1)
            tasks.append(asyncio.create_task(self._generate_one(request.ids, request.params, 0, server)))
        try:
            samples = await asyncio.gather(*tasks)
        except BaseException:
            await _cancel(tasks)
            raise
        results = []
        for request, sample in zip(requests, samples, strict=True):
            rows, earlier = split_rows(sample.routed_experts, request)
            session = EngineSession(len(request.ids) + len(sample.output_ids) - 1, sample.extra.get("server"))
            results.append(
                TurnResult(
                    list(sample.output_ids),
                    sample.output_log_probs,
                    sample.finish_reason,
                    sample.weight_version,
                    rows,
                    session,
                    earlier,
                )
            )
        return results

    def _check_sampling(self, params: SamplingParams) -> None:
        if params.return_routed_experts and self._routed_layout is None:
            raise ValueError(
                "return_routed_experts needs SGLangConfig.enable_return_routed_experts=true (the server "
                "flag) and the layout: num_hidden_layers / num_experts_per_tok or a model_path with config.json"
            )
        if params.seed is not None and not self._seeds_honoured:
            warnings.warn(
                "SamplingParams.seed is ignored: SGLang honours sampling_seed only when the server runs with "
                "--enable-deterministic-inference (SGLangConfig.enable_deterministic_inference=true); samples "
                "are not reproducible",
                RuntimeWarning,
                stacklevel=3,
            )

    async def _generate_all(self, prompts: list[list[int]], params: SamplingParams) -> list[list[Sample]]:
        """Each prompt's group goes to one server (the group shares its prompt's prefix cache there), the
        groups spread over the live servers by load: the server with the fewest requests in flight plus
        samples assigned by this call takes the next group. A server that dies has its requests re-sent
        to the others (``SGLangHTTPClient.post_preferring``); each sample records the server that made it."""
        assigned: dict[str, int] = {}
        tasks = []
        for index, prompt in enumerate(prompts):
            server = self._server_for_group(assigned, params.n)
            tasks.append(
                [
                    asyncio.create_task(self._generate_one(prompt, params, index * params.n + k, server))
                    for k in range(params.n)
                ]
            )
        flat = [task for row in tasks for task in row]
        try:
            await asyncio.gather(*flat)
        except BaseException:
            await _cancel(flat)
            raise
        return [[task.result() for task in row] for row in tasks]

    async def _generate_rows(self, rows: list[RowRequest], params: SamplingParams, needed: int) -> list[Sample]:
        if needed <= 0:  # the step is complete without them: nothing starts
            return [_unstarted(row) for row in rows]
        call = uuid.uuid4().hex[:12]
        rids = [f"gspo-{call}-{index}" for index in range(len(rows))]
        group_sizes = Counter(row.group for row in rows)
        assigned: dict[str, int] = {}
        server_of_group: dict[int, ServerState | None] = {}
        stopping = asyncio.Event()  # set once enough groups are complete: an abort is then the answer
        tasks = []
        for index, row in enumerate(rows):
            if row.group not in server_of_group:
                server_of_group[row.group] = self._server_for_group(assigned, group_sizes[row.group])
            row_params = replace(params, n=1, max_new_tokens=row.max_new_tokens)
            request = self._generate_one(
                row.prompt_ids, row_params, index, server_of_group[row.group], rids[index], stopping
            )
            tasks.append(asyncio.create_task(request))
        rid_of = dict(zip(tasks, rids, strict=True))
        group_of = {task: row.group for task, row in zip(tasks, rows, strict=True)}
        unfinished = Counter(group_sizes)
        complete, pending = 0, set(tasks)
        try:
            while pending and complete < needed:
                done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
                for task in done:
                    task.result()  # a failed request fails the call
                    unfinished[group_of[task]] -= 1
                    complete += unfinished[group_of[task]] == 0
            if pending:
                stopping.set()
                await self._abort([rid_of[task] for task in pending])
                await asyncio.gather(*pending)
        except BaseException:
            await _cancel(tasks)
            raise
        return [task.result() for task in tasks]

    def _server_for_group(self, assigned: dict[str, int], samples: int) -> ServerState | None:
        """The live server with the fewest requests in flight plus samples this call assigned it (``assigned``,
        updated); None without one (``post_preferring`` then raises NoServersLeftError, naming the servers)."""
        live = self._client.pool.alive()
        if not live:
            return None
        server = min(live, key=lambda s: (s.in_flight + assigned.get(s.url, 0), s.served))
        assigned[server.url] = assigned.get(server.url, 0) + samples
        return server

    async def _abort(self, rids: list[str]) -> None:
        """``/abort_request`` for each request id on every live server (one that does not hold it ignores it)."""
        live = self._client.pool.alive()
        await gather([self._client.post_preferring(s, "/abort_request", {"rid": rid}) for s in live for rid in rids])

    async def _generate_one(
        self,
        prompt: list[int],
        params: SamplingParams,
        sample_index: int,
        server: ServerState | None = None,
        rid: str | None = None,
        stopping: asyncio.Event | None = None,
    ) -> Sample:
        """One sample; an aborted answer is retried (``abort_retries``: a pause in mode abort) unless
        ``stopping`` is set, when the abort was the caller's own (``generate_rows``)."""
        seed = None if params.seed is None or not self._seeds_honoured else params.seed + sample_index
        body = build_generate_request(
            prompt,
            params,
            sampling_seed=seed,
            skip_special_tokens=self.config.skip_special_tokens,
            no_stop_trim=self.config.no_stop_trim,
            rid=rid,
        )
        layout = self._routed_layout if params.return_routed_experts else None
        for attempt in range(self.config.abort_retries + 1):  # noqa: B007 - read after the loop
            response, server = await self._client.post_preferring(server, "/generate", body)
            result = parse_generate_response(response, len(prompt), routed_experts_layout=layout)
            if result.finish_reason is not FinishReason.ABORT or (stopping is not None and stopping.is_set()):
                break
        oldest = result.oldest_weight_version
        version = oldest if oldest is not None else self.weight_version
        extra: dict[str, Any] = {"abort_retries": attempt, "server": server.url if server is not None else None}
        if len(result.weight_versions) > 1:  # an update landed while it ran: each token's version kept
            extra["weight_versions"] = [list(span) for span in result.weight_versions]
            token_versions = result.token_versions(version)
            if len(set(token_versions)) > 1:
                extra[TOKEN_VERSIONS] = token_versions
        return Sample(
            prompt_ids=list(prompt),
            output_ids=result.output_ids,
            output_log_probs=result.output_log_probs,
            finish_reason=result.finish_reason,
            routed_experts=result.routed_experts,
            weight_version=version,
            extra=extra,
        )

    # ------------------------------------------------------------------ weight sync
    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int) -> None:
        """Stream ``named_tensors`` into every live server, one bucket at a time (nothing is listed), paused in
        ``rollout.sglang.pause_mode``: ``_update`` says how."""
        self._update(named_tensors, version, self.config.pause_mode)

    def update_weights_in_flight(
        self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int, mode: str
    ) -> None:
        """An in-flight update (``rollout.inflight_update_mode``): the same bracket, paused in ``mode``
        (``in_place``: the running requests keep their KV cache; ``retract``: they are re-queued and their KV is
        computed again under the new weights), called while another thread's ``generate`` has requests running.
        Each request's tokens after the update carry the new version: SGLang 0.5.23 records, for every live
        request, (old version, output tokens so far) when the version changes (``scheduler.py``
        ``record_weight_version_change``) and answers them as ``meta_info.weight_versions`` spans, which
        ``_generate_one`` turns into ``Sample.extra["token_versions"]``."""
        if mode not in (PauseMode.in_place, PauseMode.retract):
            raise ValueError(f"an in-flight update pauses in_place or retract, not {mode!r}")
        self._update(named_tensors, version, PauseMode(mode))

    def _update(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int, pause_mode: PauseMode) -> None:
        """Stream ``named_tensors`` into every live server between ``/pause_generation`` in ``pause_mode`` and
        ``/continue_generation``.

        Each attempt iterates ``named_tensors`` once. A re-iterable (a list, or the trainer's export
        stream, whose every pass is a fresh export) lets a failed distributed update be retried through
        the disk path; a one-shot iterator cannot be read twice, so its failure is raised as it is. With
        ``weight_quantization=fp8_block`` every projection goes out as block FP8 and its scales
        (``core/fp8_blocks.py``)."""
        # every pipeline stage sends its own layers (a distributed sync only; any other path reads the
        # stream as one full export)
        distributed = self.config.weight_sync == WeightSync.distributed
        staged = named_tensors if distributed and isinstance(named_tensors, StagedWeights) else None
        if self.config.weight_quantization == WeightQuantization.fp8_block:  # the FP8 checkpoint's tensors
            named_tensors = (
                quantize_named_tensors(named_tensors)
                if isinstance(named_tensors, Iterator)
                else QuantizedStream(named_tensors)
            )
        servers = self._client.pool.alive()
        failure: BaseException | None = None
        try:
            self._calls.on_all(servers, "POST", "/pause_generation", {"mode": pause_mode})
            direct = {WeightSync.distributed: self._sync_distributed, WeightSync.tensor: self._sync_by_tensor}
            sync = direct.get(self.config.weight_sync)
            if sync is not None:
                try:
                    self._in_session(
                        servers, lambda: sync(servers, named_tensors if staged is None else staged, version)
                    )
                except RunInterrupted:
                    raise  # told to stop: no second sync through the disk path
                except Exception as error:
                    self._drop_update_group()  # a distributed update's group is in an unknown state
                    if not (self.config.fallback_to_disk and self.config.model_path):
                        raise
                    if isinstance(named_tensors, Iterator):
                        raise RuntimeError(
                            f"{error} (no disk fallback: the weights came as a one-shot iterator, which the "
                            f"disk path cannot read again; pass a list or a re-iterable stream)"
                        ) from error
                    warnings.warn(
                        f"distributed weight update to version {version} failed ({error}); "
                        f"retrying through the disk path",
                        RuntimeWarning,
                        stacklevel=2,
                    )
                    self._in_session(servers, lambda: self._sync_from_disk(servers, named_tensors, version))
            else:
                self._in_session(servers, lambda: self._sync_from_disk(servers, named_tensors, version))
            if pause_mode != PauseMode.in_place:  # in_place requests stay running: SGLang refuses
                self._calls.on_all(servers, "POST", "/flush_cache", None)
        except BaseException as error:  # noqa: BLE001 - re-raised below after un-pausing
            failure = error
        finally:
            try:
                self._calls.on_all(servers, "POST", "/continue_generation", {})
            except BaseException as error:  # noqa: BLE001
                failure = failure or error
        if isinstance(failure, RunInterrupted):
            raise failure  # a stop, not a failure of the sync: the run exits 128 + signal
        if failure is not None:
            raise WeightSyncError(f"weight update to version {version} failed: {failure}") from failure
        self.weight_version = version
        remove_older_versions(self._disk_sync_root(), keep=f"v{version}")

    def _in_session(self, servers, update) -> None:
        """Run ``update`` inside begin/end_weight_update; the session is ended even when it fails."""
        if not self.config.bracket_weight_update:
            return update()
        self._calls.on_all(servers, "POST", "/begin_weight_update", {})
        try:
            update()
        except BaseException:
            self._calls.best_effort(servers, "/end_weight_update", {})
            raise
        self._calls.on_all(servers, "POST", "/end_weight_update", {})

    def _drop_update_group(self) -> None:
        if self._sender is not None:
            self._sender.drop()

    def _sync_distributed(self, servers, named_tensors, version: int) -> None:
        """One group from the driver; or, for ``StagedWeights``, a group per pipeline stage, each sending
        its own layers in turn, the version set on every server only once every stage has sent."""
        assert self._sender is not None
        if not isinstance(named_tensors, StagedWeights):
            self._sender.send(servers, self._tp_sizes, named_tensors, version)
            return
        brief = SenderBrief(
            urls=tuple(server.url for server in servers),
            tp_sizes={server.url: self._tp_sizes[server.url] for server in servers},
            fp8_block=self.config.weight_quantization == WeightQuantization.fp8_block,
            api_key=self._api_key,
        )
        own = self._sender
        named_tensors.send_by_stages(
            brief, lambda named: own.send(servers, brief.tp_sizes, brief.quantized(named), None)
        )
        body = {"new_version": str(version), "abort_all_requests": False}
        self._calls.on_all(servers, "POST", "/update_weight_version", body)

    def _server_tp_sizes(self, servers) -> list[int]:
        return [self._tp_sizes[server.url] for server in servers]

    def _sync_by_tensor(self, servers, named_tensors, version: int) -> None:
        """Each bucket as handles to this process's memory (``tensor_handles.py``): servers on this host."""
        tp_sizes = self._server_tp_sizes(servers)
        buckets = bucket_named_tensors(named_tensors, self.config.weight_bucket_bytes)
        try:
            for bucket in buckets:
                self._loop.run(self._bucket_into_each(servers, tp_sizes, bucket, version))
                del bucket  # every rank has loaded it (the server's TP barrier): its memory may go
        finally:
            buckets.close()

    async def _bucket_into_each(self, servers, tp_sizes: list[int], bucket, version: int) -> None:
        """One tensor bucket into every live server, each with its own TP ranks' payloads (as ``_all``)."""
        path = "/update_weights_from_tensor"
        await gather(
            [
                self._calls.all([server], "POST", path, update_from_tensor_body(bucket, tp, version))
                for server, tp in zip(servers, tp_sizes, strict=True)
                if server.alive
            ]
        )

    def _sync_from_disk(self, servers, named_tensors, version: int) -> None:
        root = private_directory(self.config.disk_sync_root(self._run_dir), "rollout.sglang.disk_sync_dir")
        directory = write_safetensors_checkpoint(
            named_tensors,
            root / f"v{version}",
            template_dir=self.config.model_path,
            bucket_bytes=self.config.weight_bucket_bytes,
        )
        body = {"model_path": str(directory), "weight_version": str(version), "flush_cache": False}
        self._calls.on_all(servers, "POST", "/update_weights_from_disk", body)

    def _disk_sync_root(self) -> Path:
        return self.config.disk_sync_root(self._run_dir).resolve()

    def release_memory(self) -> None:
        """Colocated: every live server frees its weights and KV cache (SGLang's memory saver, launched
        with ``--enable-memory-saver`` on a GPU; on CPU the saver is SGLang's no-op and the calls keep
        only the protocol: the weights' static state is stashed and restored, the cache flushed)."""
        self._calls.on_all(self._client.pool.alive(), "POST", "/release_memory_occupation", {})

    def resume_memory(self) -> None:
        self._calls.on_all(self._client.pool.alive(), "POST", "/resume_memory_occupation", {})

    # ------------------------------------------------------------------ lifecycle
    def health(self) -> Mapping[str, object]:
        pool = self._client.pool
        if not pool.alive():
            raise RuntimeError("no SGLang server is alive:\n" + pool.describe())
        return {
            "ok": True,
            "weight_version": self.weight_version,
            "servers": {s.url: {"alive": s.alive, "in_flight": s.in_flight, "served": s.served} for s in pool.servers},
        }

    @property
    def server_urls(self) -> list[str]:
        return [server.url for server in self._client.pool.servers]

    @property
    def api_key(self) -> ApiKey | None:
        """The key every server of this engine requires (a launched server's, to attach another client)."""
        return self._api_key

    @property
    def launched_servers(self) -> list[LaunchedServer]:
        return list(self._launched)

    def shutdown(self) -> None:
        if self._closed:
            return
        self._closed = True
        client = getattr(self, "_client", None)
        if client is not None:
            self._drop_update_group()  # attached servers outlive us: free the group name for the next run
            self._loop.run(client.aclose())
        self._loop.close()
        for server in self._launched:
            server.stop(self.config.shutdown_grace_s)

    def _launch_servers(self) -> list[str]:
        config = self.config
        if config.model_path is None:
            raise ValueError("rollout.sglang.mode=launch needs rollout.sglang.model_path")
        ports = list(config.ports) or [free_port() for _ in range(config.num_servers)]
        assert self._api_key is not None, "launched servers always get a key"
        with private_key_config(self._api_key) as key_config:  # removed once every server is up
            self._start_servers(ports, key_config)
            for server in self._launched:  # all start in parallel, then each is waited for
                server.wait_healthy(config.startup_timeout_s, config.health_poll_interval_s)
        return [server.url for server in self._launched]

    def _start_servers(self, ports: list[int], key_config: Path) -> None:
        config = self.config
        assert config.model_path is not None
        for index, port in enumerate(ports):
            command = build_launch_command(
                config.launch_command,
                model_path=config.model_path,
                tp=config.tp,
                host=config.host,
                port=port,
                enable_return_routed_experts=config.enable_return_routed_experts,
                enable_deterministic_inference=config.enable_deterministic_inference,
                extra_args=config.extra_args,
                key_config=key_config,
            )
            server = LaunchedServer(
                command, f"http://{config.host}:{port}", config.log_root(self._run_dir) / f"server_{index}_{port}.log"
            )
            self._launched.append(server)
            server.start()


def _unstarted(row: RowRequest) -> Sample:
    """A row ``generate_rows`` did not send: aborted before its first token."""
    return Sample(list(row.prompt_ids), [], torch.zeros(0), FinishReason.ABORT)


def _routed_experts_layout(config: SGLangConfig) -> tuple[int, int] | None:
    if not config.enable_return_routed_experts:
        return None
    layers, top_k = config.num_hidden_layers, config.num_experts_per_tok
    if (layers is None or top_k is None) and config.model_path:
        path = Path(config.model_path) / "config.json"
        if path.is_file():
            hf = json.loads(path.read_text())
            hf = hf.get("text_config", hf)
            layers = layers if layers is not None else hf.get("num_hidden_layers")
            top_k = top_k if top_k is not None else hf.get("num_experts_per_tok")
    if layers is None or top_k is None:
        raise ValueError(
            "enable_return_routed_experts needs the routed-experts layout: set SGLangConfig.num_hidden_layers "
            "and num_experts_per_tok, or model_path to a checkpoint whose config.json has them"
        )
    return int(layers), int(top_k)


async def _cancel(tasks: list[asyncio.Task]) -> None:
    """Cancel the requests of a call that failed and wait until each has ended."""
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
