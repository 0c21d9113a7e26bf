"""An OpenAI-compatible chat endpoint per trajectory: an agent written against the OpenAI client drives the
engine, while the trajectory's token ids, log-probs and routing rows stay here.

    rollout.agent.name=openai_endpoint rollout.agent.client=import:my_agents:solve

    def solve(base_url: str, api_key: str, record: PromptRecord, tools: list[dict]) -> None:
        client = openai.OpenAI(base_url=base_url, api_key=api_key)
        messages = [{"role": "user", "content": record.prompt}]
        reply = client.chat.completions.create(model="policy", messages=messages, tools=tools)
        ...  # run the tools it asks for, append the messages, ask again; return when done

Design decisions:
- One loopback server for the run (``127.0.0.1``, a free port), one session per trajectory: its base URL
  carries a random path token and its API key is random, so one trajectory's client cannot write into
  another's, nor another user's process into either. A request from a non-loopback address is refused.
- Token in, token out, as every agent (``templates.py``): the first request's messages are rendered by the
  chat template into the trajectory's prompt; every later request must repeat the messages so far -- the
  assistant messages as this endpoint returned them -- and only the messages after the last assistant
  message are new: their delta is rendered and inserted as ids. A request that rewrites history is
  refused (400, naming the message), never re-tokenised.
- The run's sampling settings apply (the trainer scores the engine's log-probs at ``rollout.temperature``):
  a request's ``temperature``/``top_p`` are ignored, its ``max_tokens`` is capped by the trajectory's budget.
- Tool calls are parsed from the turn with the model family's format and returned as OpenAI
  ``tool_calls``; the client runs its tools (this endpoint runs none).
"""

from __future__ import annotations

import asyncio
import dataclasses
import ipaddress
import json
import secrets
import threading
import time
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from gspo_megatron.contracts.samples import FinishReason
from gspo_megatron.rollout.agents.agent import AgentContext
from gspo_megatron.rollout.agents.conversation import TurnLimitError
from gspo_megatron.rollout.agents.daemon_thread import in_daemon_thread
from gspo_megatron.rollout.agents.templates import HFChatTemplate
from gspo_megatron.rollout.data.records import PromptRecord

ClientFunction = Callable[[str, str, PromptRecord, list[dict]], None]
TURN_TIMEOUT_S = 600.0  # the longest one request waits for its turn (the engine's batch included)


class EndpointError(ValueError):
    """A request the endpoint refuses (400): the message says what and why."""


class EndpointSession:
    """One trajectory's chat completions."""

    def __init__(self, ctx: AgentContext, template: HFChatTemplate, loop: asyncio.AbstractEventLoop, base_url: str):
        self.ctx, self.template, self.loop = ctx, template, loop
        self.base_url, self.api_key = base_url, secrets.token_urlsafe(24)
        self.history: list[dict] = []  # the messages accounted for: what was rendered and what was returned
        self.calls = 0
        self.lock = threading.Lock()  # one request at a time per trajectory

    def chat(self, body: dict) -> dict:
        """A chat completion (called from the server's request thread)."""
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            raise EndpointError("messages must be a non-empty list")
        with self.lock:
            turn = self._turn(messages, body.get("max_tokens"), body.get("tools"))
            future = asyncio.run_coroutine_threadsafe(turn, self.loop)
            return future.result(TURN_TIMEOUT_S)

    async def _turn(self, messages: list[dict], max_tokens: object, tools: object) -> dict:
        ctx = self.ctx
        if not self.history:  # the first request: its messages (and tools) are the prompt
            tool_list = tools if isinstance(tools, list) else None
            ctx.conversation.restart(self.template.render(messages, generation_prompt=True, tools=tool_list))
        else:
            new = self._new_messages(messages)
            ctx.conversation.insert(self.template.delta(new))
        params = ctx.turn_params()
        if isinstance(max_tokens, int) and max_tokens > 0:
            params = dataclasses.replace(params, max_new_tokens=min(params.max_new_tokens, max_tokens))
        try:
            turn = await ctx.conversation.generate(params)
        except TurnLimitError as error:
            raise EndpointError(str(error)) from None
        parsed = ctx.parse(turn.output_ids)
        tool_calls = [
            {
                "id": f"call_{self._next_call()}",
                "type": "function",
                "function": {"name": call.name, "arguments": json.dumps(call.arguments)},
            }
            for call in parsed.calls
        ]
        reply: dict[str, Any] = {"role": "assistant", "content": parsed.content or None}
        if tool_calls:
            reply["tool_calls"] = tool_calls
        self.history = [*messages, reply]
        ctx.tool_calls += len(tool_calls)
        finish = "tool_calls" if tool_calls else ("length" if turn.finish_reason == FinishReason.LENGTH else "stop")
        generated = len(turn.output_ids)
        return {
            "id": f"chatcmpl-{secrets.token_hex(8)}",
            "object": "chat.completion",
            "created": int(time.time()),
            "model": "policy",
            "choices": [{"index": 0, "message": reply, "finish_reason": finish, "logprobs": None}],
            "usage": {
                "prompt_tokens": len(ctx.conversation.ids) - generated,
                "completion_tokens": generated,
                "total_tokens": len(ctx.conversation.ids),
            },
        }

    def _next_call(self) -> int:
        self.calls += 1
        return self.calls

    def _new_messages(self, messages: list[dict]) -> list[dict]:
        """The messages after the history, which they must repeat as it was (token in, token out)."""
        if len(messages) <= len(self.history):
            raise EndpointError(f"{len(messages)} messages add nothing to the {len(self.history)} of the conversation")
        for index, (sent, held) in enumerate(zip(messages, self.history, strict=False)):
            if _canonical(sent) != _canonical(held):
                raise EndpointError(
                    f"message {index} ({held.get('role')}) differs from the conversation's: a trajectory's history "
                    "is its tokens, so earlier messages cannot change; send them as they were returned"
                )
        new = messages[len(self.history) :]
        if any(message.get("role") == "assistant" for message in new):
            raise EndpointError("an assistant message can only come from this endpoint")
        return new


def _canonical(message: dict) -> tuple:
    """What of a message the comparison looks at: role, text, and the calls' names and arguments."""
    calls = tuple(
        (call["function"]["name"], json.dumps(json.loads(call["function"]["arguments"] or "{}"), sort_keys=True))
        for call in message.get("tool_calls") or ()
    )
    return message.get("role"), message.get("content") or "", calls, message.get("tool_call_id") or ""


class _EndpointHTTPServer(ThreadingHTTPServer):
    # every trajectory's client connects at once (a step's rollouts start together) while the engine's
    # forward holds the GIL and the accept loop lags: the default listen backlog of 5 then overflows and
    # the kernel resets connections (a client sees APIConnectionError before its first turn)
    request_queue_size = 1024
    daemon_threads = True


class SessionServer:
    """The run's endpoint: one loopback HTTP server, one session per trajectory (module docstring)."""

    def __init__(self, template: HFChatTemplate, host: str = "127.0.0.1"):
        if not ipaddress.ip_address(host).is_loopback:
            raise ValueError(f"the agent endpoint listens on loopback only, not {host}")
        self.template = template
        self.sessions: dict[str, EndpointSession] = {}
        self._server = _EndpointHTTPServer((host, 0), _handler(self))
        self.port = self._server.server_address[1]
        self._thread = threading.Thread(target=self._server.serve_forever, name="agent-endpoint", daemon=True)
        self._thread.start()

    def open(self, ctx: AgentContext, loop: asyncio.AbstractEventLoop) -> EndpointSession:
        token = secrets.token_urlsafe(16)
        session = EndpointSession(ctx, self.template, loop, f"http://127.0.0.1:{self.port}/s/{token}/v1")
        self.sessions[token] = session
        return session

    def close_session(self, session: EndpointSession) -> None:
        self.sessions = {token: s for token, s in self.sessions.items() if s is not session}

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()


def _handler(server: SessionServer) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        def log_message(self, format: str, *args: object) -> None:
            return None

        def do_POST(self) -> None:
            if not ipaddress.ip_address(self.client_address[0]).is_loopback:
                return self._reply(403, {"error": {"message": "the agent endpoint answers loopback clients only"}})
            parts = self.path.strip("/").split("/")
            session = server.sessions.get(parts[1]) if len(parts) == 5 and parts[0] == "s" else None
            if session is None or parts[2:] != ["v1", "chat", "completions"]:
                return self._reply(404, {"error": {"message": f"no endpoint at {self.path}"}})
            if not secrets.compare_digest(self.headers.get("Authorization", ""), f"Bearer {session.api_key}"):
                return self._reply(401, {"error": {"message": "a session's requests carry its API key"}})
            try:
                body = json.loads(self.rfile.read(int(self.headers.get("Content-Length", "0"))))
                return self._reply(200, session.chat(body))
            except (EndpointError, json.JSONDecodeError) as error:
                return self._reply(400, {"error": {"message": str(error), "type": "invalid_request_error"}})
            except Exception as error:  # noqa: BLE001 - the client gets an answer, never a dropped connection
                message = f"{type(error).__name__}: {error}"
                return self._reply(500, {"error": {"message": message, "type": "server_error"}})

        def _reply(self, status: int, payload: dict) -> None:
            data = json.dumps(payload).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

    return Handler


def endpoint_agent(server: SessionServer, client: ClientFunction) -> Callable:
    """The agent of ``rollout.agent.name=openai_endpoint``: the user's ``client`` function drives the trajectory
    through its session's endpoint, in a worker thread; the trajectory ends when it returns."""

    async def agent(ctx: AgentContext) -> None:
        session = server.open(ctx, asyncio.get_running_loop())
        tools = [spec.openai() for spec in ctx.tools.specs()]
        try:
            await in_daemon_thread(lambda: client(session.base_url, session.api_key, ctx.record, tools), "agent-client")
        finally:
            server.close_session(session)

    return agent
