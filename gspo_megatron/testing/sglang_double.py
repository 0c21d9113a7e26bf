"""TEST DOUBLE of an SGLang server: a real HTTP server on 127.0.0.1 that follows SGLang 0.5.x's protocol.

It is not SGLang and runs no model. It exists because SGLang needs a GPU; it lets the client, the
launcher and weight sync be tested against real sockets, real HTTP and real failures.

What it follows (SGLang 0.5.x ``http_server.py`` / ``io_struct.py``):
- ``POST /generate`` with ``input_ids``, ``sampling_params``, ``return_logprob``,
  ``return_routed_experts``; answers ``output_ids`` and ``meta_info`` with ``output_token_logprobs``
  ([[logprob, token_id, null], ...]), ``finish_reason`` ({"type": stop|length|abort}),
  ``prompt_tokens``, ``completion_tokens``, ``weight_version`` and, when launched with
  ``--enable-return-routed-experts`` and asked, ``routed_experts`` (base64 little-endian int32,
  [prompt + completion - 1, layers, top_k]). Tokens and log-probs are deterministic pseudo-random
  functions of (input_ids, sampling_seed, weight_version).
- Routed experts through a prefix cache, as SGLang 0.5.23 keeps them: a forward writes each position's row
  into the slot of its KV (``srt/state_capturer/base.py``, ``on_forward_end`` and
  ``TopkCaptureOutput.finalize``) and a request reads its rows through its KV slots (``get_topk``), so a
  position served from the radix cache answers the row recorded when its KV was computed. The double keeps
  a row per token prefix, computed as a pseudo-random function of (that prefix, the weight version then);
  a request is served the longest cached prefix of its input, at most all but its last token
  (``schedule_batch.py`` ``_compute_max_prefix_len``), computes the rest under the current version and
  caches it; ``meta_info.cached_tokens`` is the served length. ``/flush_cache`` empties the cache;
  ``--disable-radix-cache`` keeps none; nothing is evicted.
- ``/health``, ``/health_generate``, ``/server_info``, ``/flush_cache``, ``/pause_generation``,
  ``/continue_generation``, ``/abort_request``, ``/init_weights_update_group``,
  ``/update_weights_from_distributed``, ``/update_weights_from_disk``, ``/begin_weight_update``,
  ``/end_weight_update``, ``/destroy_weights_update_group``, ``/update_weight_version``.
  ``/generate`` bodies are accepted or refused exactly as SGLang 0.5.23 does (``sglang_double_rules``;
  tests/contract compares the two on a table of bodies); control payloads are validated (missing /
  mistyped fields -> HTTP 400); the call order is recorded. State SGLang keeps is modelled: a
  distributed update outside begin/end is refused (the disk path has no session check), a second begin
  while a session is open is refused, a group name cannot be initialised twice until destroyed
  (several names may be open at once), ``/flush_cache`` answers 400 while requests run (an
  ``in_place`` pause keeps them running), an aborted non-streaming request answers HTTP 503, and
  ``sampling_seed`` acts only with ``deterministic_inference`` (``--enable-deterministic-inference``).
- In-flight updates: a request held at a pause (``/pause_generation``) while the version changes answers
  SGLang's ``meta_info.weight_versions`` spans (every answer carries them, one span when nothing landed): its
  first half of tokens drawn under the version it started on, the rest under the new one (SGLang records each
  live request's output length at the change, ``scheduler.py`` ``record_weight_version_change``). After an
  ``in_place`` pause the positions fed before the update keep the routing row of the version then (their KV is
  kept); after ``retract`` every position is computed again under the new version.
- The weight-update routes live in ``sglang_double_weights.py`` (a mixin of the double).
- ``api_key`` (``--api-key``, or ``api-key`` in a ``--config`` YAML file) is enforced as SGLang 0.5.23's
  middleware does (``sglang/srt/utils/auth.py``, ``decide_request_auth`` and ``add_api_key_middleware``):
  before routing, every path but ``/health*``, ``/ready*``, ``/metrics*`` (and OPTIONS) needs
  ``Authorization: Bearer <key>`` (scheme case-insensitive), else HTTP 401 ``{"error": "Unauthorized"}``
  and the request is not recorded. The double's own ``/_double/state`` is exempt.
  tests/contract/test_sglang_api_key_contract.py compares the two.
- With ``join_weight_groups`` it really joins the trainer's update group (gloo or nccl, rank =
  rank_offset) and receives each broadcast tensor, recording its shape, dtype and sum.

Fault injection (``DoubleFaults``): 503 on the first K health checks or generates, aborted requests,
failing distributed or disk weight updates, requests accepted and never answered,
dying after N generates (in-flight and new connections are dropped, the listener closes), malformed
JSON, wrong-size routed experts, log-probs whose token ids disagree with output_ids.

``GET /_double/state`` is the double's own endpoint (not SGLang's) so a test can inspect a double
that runs in another process. ``python -m gspo_megatron.testing.sglang_double`` accepts
``sglang.launch_server``'s arguments, so the launcher can start it as a fake ``launch_server``.
"""

from __future__ import annotations

import argparse
import base64
import contextlib
import hashlib
import json
import random
import secrets
import socket
import struct
import subprocess
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

from gspo_megatron.rollout.sglang.auth import OPEN_PATH_PREFIXES, UNAUTHORIZED_BODY
from gspo_megatron.testing.sglang_double_faults import HOLD_TIMEOUT_S, DoubleFaults
from gspo_megatron.testing.sglang_double_rules import generate_body_error
from gspo_megatron.testing.sglang_double_weights import WeightState, WeightUpdateRoutes

SGLANG_VERSION = "0.5.23"  # what /server_info reports (the version whose behaviour the double follows)
_PAUSE_MODES = {"abort", "retract", "in_place"}


class _DoubleHTTPServer(ThreadingHTTPServer):
    daemon_threads = True
    request_queue_size = 1024  # as a real server's: the default 5 resets concurrent clients when accepting lags
    allow_reuse_address = True


class SGLangServerDouble(WeightUpdateRoutes):
    """A test double of one SGLang server (tp ranks are simulated only in /server_info)."""

    def __init__(
        self,
        *,
        host: str = "127.0.0.1",
        port: int = 0,
        vocab_size: int = 1000,
        eos_token_id: int = 2,
        num_layers: int = 2,
        top_k: int = 2,
        num_experts: int = 8,
        tp_size: int = 1,
        enable_return_routed_experts: bool = False,
        faults: DoubleFaults | None = None,
        join_weight_groups: bool = False,
        model_path: str = "double-model",
        deterministic_inference: bool = False,
        version: str = SGLANG_VERSION,
        api_key: str | None = None,
        radix_cache: bool = True,
    ):
        self.api_key = api_key
        self.radix_cache = radix_cache
        self._prefix_rows: dict[str, list[int]] = {}  # token-prefix key -> its routing row (module docstring)
        self.vocab_size, self.eos_token_id = vocab_size, eos_token_id
        self.num_layers, self.top_k, self.num_experts, self.tp_size = num_layers, top_k, num_experts, tp_size
        self.enable_return_routed_experts = enable_return_routed_experts
        self.faults = faults or DoubleFaults()
        self.join_weight_groups = join_weight_groups
        self.model_path = model_path
        # SGLang honours sampling_seed only when launched with --enable-deterministic-inference.
        self.deterministic_inference = deterministic_inference
        self.version = version
        self.pause_mode: str | None = None
        self.last_pause_mode: str | None = None  # the mode of the latest pause (what an update landed in)
        self._distributed_failures = 0
        self._disk_failures = 0
        self.weight_version = "default"
        self.calls: list[tuple[str, Any]] = []  # (path, payload) in arrival order
        self.generate_count = 0  # /generate requests that arrived
        self.max_in_flight = 0  # most /generate requests handled at once
        self._in_flight = 0
        self.dead = False
        self._health_calls = 0
        self._unseeded = 0
        self._lock = threading.Lock()
        self._in_flight_changed = threading.Condition(self._lock)
        self._running = threading.Event()
        self._running.set()
        self._paused_event = threading.Event()  # set while paused (``paused``; DoubleFaults.hold_until_paused)
        self._stopped = threading.Event()  # set by ``stop`` (DoubleFaults.generate_never_answers)
        self._weights = WeightState()
        self._server = _DoubleHTTPServer((host, port), self._handler_class())
        self._thread: threading.Thread | None = None

    # -------------------------------------------------------------- lifecycle
    @property
    def url(self) -> str:
        host, port = self._server.server_address[:2]
        host = host.decode() if isinstance(host, bytes) else host
        return f"http://{host}:{port}"

    @property
    def received_weights(self) -> dict:
        return dict(self._weights.received)

    def paths(self) -> list[str]:
        with self._lock:
            return [path for path, _ in self.calls]

    def start(self) -> SGLangServerDouble:
        self._thread = threading.Thread(
            target=self._server.serve_forever, kwargs={"poll_interval": 0.05}, name="sglang-double", daemon=True
        )
        self._thread.start()
        return self

    def wait_in_flight(self, count: int, timeout_s: float = HOLD_TIMEOUT_S) -> bool:
        """Until ``count`` /generate requests are in flight at once (False past ``timeout_s``): a test then
        pauses with them certainly running, without racing a clock."""
        with self._lock:
            return self._in_flight_changed.wait_for(lambda: self._in_flight >= count, timeout_s)

    @property
    def paused(self) -> bool:
        """Between /pause_generation and /continue_generation (a stopped server is not paused)."""
        return self._paused_event.is_set() and not self.dead

    def stop(self) -> None:
        """Stop serving and close the listening socket (new connections are refused)."""
        self.dead = True
        self._stopped.set()
        self._paused_event.set()  # release held and paused generates so they can drop their connections
        self._running.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._server.shutdown()
            self._thread = None
        self._server.server_close()

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc):
        self.stop()

    def serve_forever(self) -> None:
        """Serve in the calling thread (the CLI); ``stop`` from another thread ends it."""
        self._thread = threading.current_thread()
        self._server.serve_forever()

    # -------------------------------------------------------------- endpoints
    def _health(self, _body) -> tuple[int, Any]:
        with self._lock:
            self._health_calls += 1
            warming = self._health_calls <= self.faults.startup_503
        return (503, {"error": "server is starting"}) if warming else (200, None)

    def _server_info(self, _body):
        return 200, {
            "tp_size": self.tp_size,
            "model_path": self.model_path,
            "weight_version": self.weight_version,
            "enable_return_routed_experts": self.enable_return_routed_experts,
            "version": self.version,
            "enable_deterministic_inference": self.deterministic_inference,
        }

    def _generate(self, body):
        error = generate_body_error(body)
        if error:
            return 400, {"error": {"message": error}}
        with self._lock:
            self.generate_count += 1
            index = self.generate_count
            dying = self.faults.die_after is not None and index > self.faults.die_after
            unseeded = self._unseeded = self._unseeded + 1
        if dying:
            self._die()
            return None  # drop the connection without an answer
        with self._lock:
            started = (self.weight_version, self.pause_mode)  # what an update landing in it changes
            self._in_flight += 1
            self.max_in_flight = max(self.max_in_flight, self._in_flight)
            self._in_flight_changed.notify_all()
            if self.faults.hold_until_in_flight:
                held = self.faults.hold_until_in_flight
                self._in_flight_changed.wait_for(lambda: self.max_in_flight >= held, timeout=HOLD_TIMEOUT_S)
        try:
            if self.faults.hold_until_paused:
                self._paused_event.wait(HOLD_TIMEOUT_S)
            if self.faults.generate_delay_s:
                threading.Event().wait(self.faults.generate_delay_s)
            if self.faults.generate_never_answers:
                self._stopped.wait(HOLD_TIMEOUT_S)
                return None  # no answer: the connection is dropped
            self._running.wait()
        finally:
            with self._lock:
                self._in_flight -= 1
        if self.dead:
            return None
        if index <= self.faults.generate_503:
            return 503, {"error": {"message": "temporarily unavailable"}}
        if self.faults.malformed_json:
            return 200, '{"output_ids": [1, 2, '  # truncated on purpose
        sample = self._sample(
            body, aborted=index <= self.faults.abort_first, unseeded=unseeded, started_version=started[0]
        )
        if sample["meta_info"]["finish_reason"]["type"] == "abort":
            return 503, sample  # non-streaming SGLang answers an aborted request with HTTP 503
        return 200, sample

    def _sample(self, body: dict, *, aborted: bool, unseeded: int, started_version: str | None = None) -> dict:
        """One answer. A request an update landed in (the version changed while it was held at a pause) has its
        first half of tokens drawn under the version it started on, the rest under the new one, and answers
        SGLang's spans (module docstring, "In-flight updates")."""
        prompt = body["input_ids"]
        params = body.get("sampling_params") or {}
        requested = params.get("max_new_tokens")
        max_new = 128 if requested is None else int(requested)
        stop_ids = list(params.get("stop_token_ids") or []) or [self.eos_token_id]
        seed = params.get("sampling_seed") if self.deterministic_inference else None
        started_version = self.weight_version if started_version is None else started_version
        draws = {
            version: random.Random(
                hashlib.sha256(
                    json.dumps([prompt, seed if seed is not None else f"unseeded-{unseeded}", version]).encode()
                ).hexdigest()
            )
            for version in (started_version, self.weight_version)
        }
        key = json.dumps([prompt, seed if seed is not None else f"unseeded-{unseeded}", self.weight_version])
        rng = draws[started_version]
        length = rng.randint(1, max_new) if max_new else 0
        split = length // 2 if started_version != self.weight_version else 0  # tokens out before the update
        tokens = [_draw_token(rng, self.vocab_size, set(stop_ids)) for _ in range(length)]
        old_log_probs = [-4.0 * rng.random() for _ in tokens]
        if split:
            new_draw = draws[self.weight_version]
            tokens[split:] = [_draw_token(new_draw, self.vocab_size, set(stop_ids)) for _ in tokens[split:]]
            old_log_probs[split:] = [-4.0 * new_draw.random() for _ in tokens[split:]]
        if 0 < length < max_new:
            tokens[-1] = stop_ids[0]
            finish = {"type": "stop", "matched": stop_ids[0]}
        else:
            finish = {"type": "length", "length": max_new}
        if aborted:
            tokens = tokens[: max(1, length // 2)] if tokens else tokens
            old_log_probs, split = old_log_probs[: len(tokens)], min(split, len(tokens))
            finish = {"type": "abort", "message": "Abort before prefill", "status_code": 503}
        log_probs = [[value, token, None] for value, token in zip(old_log_probs, tokens, strict=True)]
        if self.faults.mismatched_logprob_ids and tokens:
            log_probs[0][1] = tokens[0] + 1
        # in_place keeps the KV (and routing row) of every position fed before the update: the prompt and the
        # first split - 1 tokens; retract computes them again under the new weights
        kept = len(prompt) + split - 1 if split and self.last_pause_mode == "in_place" else 0
        rows, cached = self._routed_rows((list(prompt) + tokens)[:-1], len(prompt), kept, started_version)
        meta = {
            "id": hashlib.md5(key.encode()).hexdigest(),
            "finish_reason": finish,
            "prompt_tokens": len(prompt),
            "completion_tokens": len(tokens),
            "cached_tokens": cached,
            "weight_version": self.weight_version,
            "weight_versions": _weight_version_spans(started_version, self.weight_version, split, len(tokens)),
            "output_token_logprobs": log_probs,
        }
        if body.get("return_routed_experts") and self.enable_return_routed_experts:
            rows = rows[: len(rows) - 1] if self.faults.wrong_routed_experts else rows
            values = [value for row in rows for value in row]
            meta["routed_experts"] = base64.b64encode(struct.pack(f"<{len(values)}i", *values)).decode()
        return {"text": "", "output_ids": tokens, "meta_info": meta}

    def _routed_rows(
        self, fed: list[int], prompt_length: int, kept: int = 0, kept_version: str | None = None
    ) -> tuple[list[list[int]], int]:
        """The rows of the ``fed`` positions (input and generated tokens but the last) and how many leading
        positions the prefix cache served (module docstring); the first ``kept`` positions were computed under
        ``kept_version`` (an in-place update landed after them)."""
        rows: list[list[int]] = []
        key, served = "", 0
        with self._lock:
            for position, token in enumerate(fed):
                key = hashlib.sha256(f"{key}/{token}".encode()).hexdigest()
                cached = self._prefix_rows.get(key) if self.radix_cache else None
                if cached is not None and served == position and position < prompt_length - 1:
                    served += 1
                    rows.append(cached)
                    continue
                draw = random.Random(f"{key}@{kept_version if position < kept else self.weight_version}")
                rows.append([draw.randrange(self.num_experts) for _ in range(self.num_layers * self.top_k)])
                if self.radix_cache:
                    self._prefix_rows.setdefault(key, rows[-1])  # an existing entry keeps its KV (and row)
        return rows, served

    def _pause(self, body):
        mode = (body or {}).get("mode", "abort")
        if mode not in _PAUSE_MODES:
            return 400, {"error": {"message": f"mode {mode!r} not in {sorted(_PAUSE_MODES)}"}}
        self.pause_mode = self.last_pause_mode = mode
        self._running.clear()
        self._paused_event.set()
        return 200, {"message": "Generation paused successfully.", "status": "ok"}

    def _continue(self, _body):
        self.pause_mode = None
        self._paused_event.clear()
        self._running.set()
        return 200, {"message": "Generation continued successfully.", "status": "ok"}

    def _flush_cache(self, _body):
        # SGLang flushes only with an empty running batch: a pause in mode in_place keeps requests in
        # it (retract and abort take them out), and an unpaused server is running whatever is in flight.
        with self._lock:
            running = self._in_flight > 0 and self.pause_mode not in ("retract", "abort")
            if not running:
                self._prefix_rows.clear()
        if running:
            return 400, "Flush cache failed: there are running requests.\n"
        return 200, "Cache flushed.\n"

    def _abort_request(self, body):
        if not isinstance(body, dict) or not ("rid" in body or body.get("abort_all")):
            return 400, {"error": {"message": "abort_request needs rid or abort_all"}}
        return 200, None

    @property
    def session_open(self) -> bool:
        return self._weights.in_update

    def _state(self, _body):
        with self._lock:
            calls = list(self.calls)
        return 200, {
            "calls": calls,
            "generate_count": self.generate_count,
            "received": self._weights.received,
            "weight_version": self.weight_version,
            "session_open": self._weights.in_update,
            "group_names": list(self._weights.groups),
        }

    def _authorized(self, method: str, path: str, authorization: str | None) -> bool:
        """SGLang's ``decide_request_auth`` for an api_key without an admin key (see the module's notes)."""
        if self.api_key is None or method == "OPTIONS" or path == "/_double/state":
            return True
        if path.startswith(OPEN_PATH_PREFIXES):
            return True
        parts = (authorization or "").split(" ", 1)
        return len(parts) == 2 and parts[0].lower() == "bearer" and secrets.compare_digest(parts[1], self.api_key)

    def _die(self) -> None:
        if not self.dead:
            self.dead = True
            threading.Thread(target=self.stop, daemon=True).start()

    _ROUTES = {
        ("GET", "/health"): "_health",
        ("GET", "/health_generate"): "_health",
        ("GET", "/server_info"): "_server_info",
        ("GET", "/get_server_info"): "_server_info",
        ("POST", "/generate"): "_generate",
        ("POST", "/pause_generation"): "_pause",
        ("POST", "/continue_generation"): "_continue",
        ("POST", "/flush_cache"): "_flush_cache",
        ("GET", "/flush_cache"): "_flush_cache",
        ("POST", "/abort_request"): "_abort_request",
        ("POST", "/begin_weight_update"): "_begin_weight_update",
        ("POST", "/end_weight_update"): "_end_weight_update",
        ("POST", "/init_weights_update_group"): "_init_group",
        ("POST", "/destroy_weights_update_group"): "_destroy_group",
        ("POST", "/update_weights_from_distributed"): "_update_distributed",
        ("POST", "/update_weights_from_disk"): "_update_from_disk",
        ("POST", "/update_weight_version"): "_update_weight_version",
        ("GET", "/_double/state"): "_state",
    }

    def _handler_class(self):
        double = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):  # keep test output quiet
                pass

            def do_GET(self):
                self._dispatch("GET")

            def do_POST(self):
                self._dispatch("POST")

            def _dispatch(self, method: str) -> None:
                if double.dead:
                    return self._drop()
                length = int(self.headers.get("Content-Length") or 0)
                raw = self.rfile.read(length) if length else b""
                try:
                    body = json.loads(raw) if raw else None
                except ValueError:
                    return self._answer(400, {"error": {"message": "request body is not JSON"}})
                path = self.path.split("?")[0]
                if not double._authorized(method, path, self.headers.get("Authorization")):
                    return self._answer(401, dict(UNAUTHORIZED_BODY))
                route = double._ROUTES.get((method, path))
                if route is None:
                    return self._answer(404, {"detail": "Not Found"})
                if route != "_state":
                    with double._lock:
                        double.calls.append((self.path, body))
                result = getattr(double, route)(body)
                if result is None:
                    return self._drop()
                self._answer(*result)

            def _answer(self, status: int, payload: Any) -> None:
                if payload is None:
                    data, kind = b"", "text/plain"
                elif isinstance(payload, str):
                    data = payload.encode()
                    kind = "application/json" if payload.startswith("{") else "text/plain; charset=utf-8"
                else:
                    data, kind = json.dumps(payload).encode(), "application/json"
                self.send_response(status)
                self.send_header("Content-Type", kind)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def _drop(self) -> None:
                self.close_connection = True
                with contextlib.suppress(OSError):
                    self.connection.shutdown(socket.SHUT_RDWR)

        return Handler


def _weight_version_spans(started: str, current: str, split: int, count: int) -> list[dict]:
    """``meta_info.weight_versions`` as SGLang 0.5.23 answers a finished request (``utils/weight_versions.py``:
    ``compute_weight_version_spans`` over one event (started, split) recorded when the version changed, then
    ``add_weight_versions_to_meta_info``): one span, or two when the update landed after ``split`` tokens."""
    if split and started != current:
        return [{"version": started, "start": 0, "end": split}, {"version": current, "start": split, "end": count}]
    return [{"version": current, "start": 0, "end": count}]


def _draw_token(rng: random.Random, vocab_size: int, stop_ids: set) -> int:
    while True:
        token = rng.randrange(3, vocab_size)
        if token not in stop_ids:
            return token


def _config_api_key(path: str | None) -> str | None:
    """``api-key`` (or ``api_key``) from SGLang's ``--config`` YAML file."""
    if path is None:
        return None
    import yaml

    config = yaml.safe_load(Path(path).read_text()) or {}
    value = config.get("api-key", config.get("api_key"))
    return None if value is None else str(value)


def main(argv: list[str] | None = None) -> None:
    """Serve a double with ``sglang.launch_server``'s arguments (unknown ones are ignored)."""
    parser = argparse.ArgumentParser(description="SGLang server TEST DOUBLE")
    parser.add_argument("--model-path", default="double-model")
    parser.add_argument("--tp-size", dest="tp", type=int, default=1)  # SGLang has no --tp (an abbreviation)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=30000)
    parser.add_argument("--enable-return-routed-experts", action="store_true")
    parser.add_argument("--enable-deterministic-inference", action="store_true")
    parser.add_argument("--startup-503", type=int, default=0, help="double only: 503 on the first K /health")
    parser.add_argument("--die-after", type=int, default=None, help="double only: stop after N /generate")
    parser.add_argument("--join-weight-groups", action="store_true", help="double only: receive broadcasts")
    parser.add_argument(
        "--spawn-child", action="store_true", help="double only: fork a child (like SGLang's scheduler)"
    )
    parser.add_argument("--fail-distributed-updates", type=int, default=0, help="double only: fail N updates")
    parser.add_argument("--exit-code", type=int, default=None, help="double only: exit at once with this code")
    parser.add_argument("--api-key", default=None)
    parser.add_argument("--disable-radix-cache", action="store_true")
    parser.add_argument("--config", default=None, help="SGLang's YAML config file (only api-key is read)")
    args, unknown = parser.parse_known_args(argv)
    api_key = args.api_key or _config_api_key(args.config)
    shown = {key: value for key, value in vars(args).items() if key != "api_key"}
    print(f"[sglang double] args={shown} api_key={'set' if api_key else 'none'} ignored={unknown}", flush=True)
    if args.exit_code is not None:
        print("[sglang double] exiting on purpose", flush=True)
        sys.exit(args.exit_code)
    layers, top_k, experts = 2, 2, 8
    config_path = Path(args.model_path) / "config.json"
    if config_path.is_file():
        hf = json.loads(config_path.read_text())
        layers = hf.get("num_hidden_layers", layers)
        top_k = hf.get("num_experts_per_tok", top_k)
        experts = hf.get("num_experts", experts)
    if args.spawn_child:
        child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
        print(f"[sglang double] child pid {child.pid}", flush=True)
    double = SGLangServerDouble(
        host=args.host,
        port=args.port,
        num_layers=layers,
        top_k=top_k,
        num_experts=experts,
        tp_size=args.tp,
        enable_return_routed_experts=args.enable_return_routed_experts,
        join_weight_groups=args.join_weight_groups,
        faults=DoubleFaults(
            startup_503=args.startup_503,
            die_after=args.die_after,
            fail_distributed_updates=args.fail_distributed_updates,
        ),
        model_path=args.model_path,
        deterministic_inference=args.enable_deterministic_inference,
        api_key=api_key,
        radix_cache=not args.disable_radix_cache,
    )
    print(f"[sglang double] serving on {double.url}", flush=True)
    double.serve_forever()


if __name__ == "__main__":
    main()
