"""The OpenAI-compatible endpoint: an agent written against the ``openai`` client drives trajectories over the
embedded engine; the trajectory's tokens are the engine's plus the rendered deltas (token in, token out);
history cannot be rewritten; sessions answer only their own key, on loopback only."""

from __future__ import annotations

import http.client
import os
import socket
import sys
import threading
import time
from pathlib import Path

import openai
import psutil
import pytest
import torch
from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "data"))  # the local HF tokenizer builder
from local_hf_tokenizer import build_local_hf_tokenizer

from gspo_megatron.contracts.samples import SamplingParams
from gspo_megatron.core.tool_call_formats import HERMES_JSON
from gspo_megatron.rollout.agents.endpoint import SessionServer, endpoint_agent
from gspo_megatron.rollout.agents.templates import HFChatTemplate
from gspo_megatron.rollout.agents.tools.calculator import Calculator
from gspo_megatron.rollout.agents.tools.runner import ToolRunner
from gspo_megatron.rollout.agents.trajectories import TrajectoryRunner
from gspo_megatron.rollout.config import AgentConfig, EmbeddedConfig
from gspo_megatron.rollout.data.records import PromptRecord
from gspo_megatron.rollout.data.tokenizer import HFTokenizer
from gspo_megatron.rollout.embedded.engine import EmbeddedEngine
from gspo_megatron.testing.agents import openai_client_agent

PARAMS = SamplingParams(temperature=1.0, max_new_tokens=6, n=2, seed=5, return_routed_experts=True)
seen: dict[str, list] = {}  # what the client functions saw (they run in the runner's worker threads)


def two_requests(base_url: str, api_key: str, record: PromptRecord, tools: list[dict]) -> None:
    """A user's agent: ask, run a tool (here: a fixed answer), ask again with the history echoed back."""
    client = openai.OpenAI(base_url=base_url, api_key=api_key, max_retries=0, timeout=120)
    messages: list = [{"role": "user", "content": record.prompt}]
    first = client.chat.completions.create(model="policy", messages=messages, tools=tools)
    messages.append(first.choices[0].message.model_dump(exclude_none=True))
    messages.append({"role": "tool", "tool_call_id": "call_1", "content": "3"})
    second = client.chat.completions.create(model="policy", messages=messages, tools=tools)
    seen.setdefault("messages", []).append(list(messages))
    # rewriting history is refused, and so is another session's key
    later = [*messages, second.choices[0].message.model_dump(exclude_none=True), {"role": "user", "content": "and?"}]
    with pytest.raises(openai.BadRequestError, match="message 0 .user. differs from the conversation"):
        client.chat.completions.create(model="policy", messages=[{"role": "user", "content": "other"}, *later[1:]])
    stranger = openai.OpenAI(base_url=base_url, api_key="not-the-key", max_retries=0, timeout=30)
    with pytest.raises(openai.AuthenticationError):
        stranger.chat.completions.create(model="policy", messages=messages)


@pytest.fixture
def setting(tmp_path):
    build_local_hf_tokenizer(tmp_path)
    tokenizer = HFTokenizer(tmp_path)
    config = Qwen3MoeConfig(
        vocab_size=tokenizer.vocab_size,
        hidden_size=32,
        intermediate_size=48,
        moe_intermediate_size=16,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        num_experts=4,
        num_experts_per_tok=2,
        max_position_embeddings=512,
    )
    torch.manual_seed(0)
    engine = EmbeddedEngine(config, EmbeddedConfig(), tokenizer.decode)
    engine.update_weights(Qwen3MoeForCausalLM(config).state_dict().items(), version=1)
    template = HFChatTemplate(tokenizer, HERMES_JSON)
    server = SessionServer(template)
    yield tokenizer, engine, template, server
    server.close()


def test_an_openai_client_agent_drives_trajectories_token_in_token_out(setting):
    tokenizer, engine, template, server = setting
    agent_config = AgentConfig(name="openai_endpoint", client="import:x:y", max_turns=4, max_tokens=60)
    runner = TrajectoryRunner(
        engine,
        endpoint_agent(server, two_requests),
        template,
        lambda record: ToolRunner([Calculator()]),
        agent_config,
        tokenizer.decode,
    )
    records = [PromptRecord("what is 1 + 2 ?", "3", {}, tuple(tokenizer.encode("what is 1 + 2 ?")))]
    seen.clear()
    samples = [s for group in runner.generate(records, PARAMS) for s in group]
    assert len(samples) == 2 and len(seen["messages"]) == 2
    for sample in samples:
        first, second = sample.turns
        assert sample.extra["agent"]["error"] is None  # the client's own checks passed
        # the prompt is the template's rendering of the first request (with its tools); after the first
        # turn's engine ids comes the rendered delta of the tool message, then the second turn
        messages = [{"role": "user", "content": "what is 1 + 2 ?"}]
        tools = [Calculator().spec.openai()]
        assert sample.prompt_ids == template.render(messages, generation_prompt=True, tools=tools)
        delta = template.delta([{"role": "tool", "tool_call_id": "call_1", "content": "3"}])
        assert sample.output_ids[first.end : second.start] == delta
        assert sample.inserted_mask[first.end : second.start].all()
        assert sample.routed_experts.shape[0] == len(sample.prompt_ids) + len(sample.output_ids) - 1


def endpoint_runner(setting, client, trajectory_timeout_s: float = 300.0) -> TrajectoryRunner:
    tokenizer, engine, template, server = setting
    config = AgentConfig(
        name="openai_endpoint",
        client="import:x:y",
        max_turns=4,
        max_tokens=60,
        trajectory_timeout_s=trajectory_timeout_s,
    )
    return TrajectoryRunner(
        engine, endpoint_agent(server, client), template, lambda r: ToolRunner([Calculator()]), config, tokenizer.decode
    )


def test_more_trajectories_than_the_default_executors_threads_all_finish(setting):
    # each client holds a thread for its whole trajectory: with asyncio.to_thread (min(32, cores + 4) threads,
    # 6 on 2 cores) the engine's call queued behind clients that waited for it, and every trajectory timed out
    tokenizer = setting[0]
    runner = endpoint_runner(setting, openai_client_agent, trajectory_timeout_s=60)
    count = min(32, (os.cpu_count() or 1) + 4) + 2
    prompt = "what is 1 + 2 ?"
    records = [PromptRecord(prompt, "3", {}, tuple(tokenizer.encode(prompt)))] * (count // 2)
    samples = [s for group in runner.generate(records, PARAMS) for s in group]
    assert len(samples) == 2 * (count // 2) > min(32, (os.cpu_count() or 1) + 4)
    for sample in samples:
        assert not sample.extra["agent"]["timeout"] and sample.extra["agent"]["error"] is None
        assert len(sample.turns) == 2
    assert max(runner.batch_sizes) > 1  # the trajectories' turns shared the engine's calls


def test_a_client_that_never_returns_ends_its_trajectory_at_the_timeout_and_holds_nothing_up(setting):
    # asyncio.run joins its default executor's threads at the end: a hung client in one held the step forever
    release = threading.Event()

    def hangs(base_url, api_key, record, tools):
        release.wait()

    runner = endpoint_runner(setting, hangs, trajectory_timeout_s=1.0)
    prompt = "what is 1 + 2 ?"
    try:
        done = threading.Event()
        outcome: list = []
        worker = threading.Thread(
            target=lambda: (
                outcome.append(runner.generate([PromptRecord(prompt, "3", {}, (1, 2))], PARAMS)),
                done.set(),
            ),
            daemon=True,
        )
        worker.start()
        assert done.wait(60), "the step waited for a client past its trajectory timeout"
        (samples,) = outcome[0]
        assert [s.extra["agent"]["timeout"] for s in samples] == [True, True]
    finally:
        release.set()


def test_a_turn_past_max_turns_is_refused_naming_the_key(setting):
    tokenizer = setting[0]
    refused: list[str] = []

    def keeps_asking(base_url, api_key, record, tools):
        client = openai.OpenAI(base_url=base_url, api_key=api_key, max_retries=0, timeout=120)
        messages: list = [{"role": "user", "content": record.prompt}]
        try:
            for _ in range(6):
                reply = client.chat.completions.create(model="policy", messages=messages)
                messages += [reply.choices[0].message.model_dump(exclude_none=True), {"role": "user", "content": "?"}]
        except openai.BadRequestError as error:
            refused.append(str(error))

    runner = endpoint_runner(setting, keeps_asking)  # max_turns=4
    prompt = "what is 1 + 2 ?"
    (samples,) = runner.generate([PromptRecord(prompt, "3", {}, tuple(tokenizer.encode(prompt)))], PARAMS)
    assert [len(s.turns) for s in samples] == [4, 4]
    assert len(refused) == 2 and all("rollout.agent.max_turns" in message for message in refused)


def test_the_endpoint_listens_on_loopback_only(setting):
    _, _, template, server = setting
    host, port = server._server.server_address
    assert host == "127.0.0.1"
    with pytest.raises(ValueError, match="loopback only"):
        SessionServer(template, host="0.0.0.0")
    others = [
        a.address
        for addresses in psutil.net_if_addrs().values()
        for a in addresses
        if a.family == socket.AF_INET and not a.address.startswith("127.")
    ]
    if not others:
        pytest.skip("this machine has no non-loopback IPv4 address to try")
    with pytest.raises(OSError), socket.create_connection((others[0], port), timeout=5):
        pass  # nothing listens there: another host cannot reach the endpoint


def test_clients_that_connect_together_while_accepting_lags_are_all_answered(setting):
    # a step's trajectories all connect at once while the engine's forward holds the GIL; with the listen
    # backlog at http.server's default (5) the kernel reset the overflow: a client saw APIConnectionError
    # before its first turn (CI, 2026-12-06), the trajectory ended empty and the step failed
    _, _, _, server = setting
    server._server.shutdown()  # the accept loop stops; the listening socket stays open
    statuses: list[object] = []

    def connect() -> None:
        try:
            connection = http.client.HTTPConnection("127.0.0.1", server.port, timeout=60)
            connection.request("POST", "/s/none/v1/chat/completions", body=b"{}")
            statuses.append(connection.getresponse().status)
        except OSError as error:
            statuses.append(error)

    clients = [threading.Thread(target=connect) for _ in range(48)]
    for client in clients:
        client.start()
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and _queued_connections(server.port) < 48 and len(statuses) < 48:
        time.sleep(0.05)  # until every client's connection waits in the backlog (or was refused)
    accepting = threading.Thread(target=server._server.serve_forever, daemon=True)
    accepting.start()
    for client in clients:
        client.join(timeout=60)
    assert statuses == [404] * 48  # every one answered (no session at that path), none reset


def _queued_connections(port: int) -> int:
    """Established connections to ``port`` that the server has not accepted (the kernel's accept queue)."""
    ours = [c for c in psutil.net_connections("tcp4") if c.raddr and c.raddr.port == port]
    return sum(c.status == psutil.CONN_ESTABLISHED for c in ours)
