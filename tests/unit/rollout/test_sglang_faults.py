"""Behaviours a real SGLang 0.5.23 server would break, proven against the double that now models them:
seeds without deterministic inference, flush under an in_place pause, aborts as HTTP 503, unsupported
versions, weight-version spans, and the attach wait."""

import threading
import time

import httpx
import pytest

from gspo_megatron.contracts.samples import SamplingParams
from gspo_megatron.rollout.sglang import SGLangConfig, SGLangEngine
from gspo_megatron.rollout.sglang.client import RequestFailedError
from gspo_megatron.rollout.sglang.protocol import parse_generate_response
from gspo_megatron.rollout.sglang.server_calls import retry_policy
from gspo_megatron.rollout.sglang.version import UnsupportedSGLangError
from gspo_megatron.testing.sglang_double_faults import DoubleFaults


def _engine(urls, **overrides):
    settings = dict(
        mode="attach",
        urls=urls,
        health_poll_interval_s=0.01,
        backoff_base_s=0.01,
        backoff_max_s=0.05,
        request_timeout_s=10.0,
    )
    settings.update(overrides)
    return SGLangEngine(SGLangConfig(**settings))


def test_seed_is_not_sent_to_a_server_without_deterministic_inference(doubles):
    """Behaviour 1: SGLang ignores sampling_seed then; claiming reproducibility would be false."""
    double = doubles()
    with _engine([double.url]) as engine, pytest.warns(RuntimeWarning, match="enable-deterministic-inference"):
        first = engine.generate([[1, 2]], SamplingParams(max_new_tokens=8, seed=5))
        second = engine.generate([[1, 2]], SamplingParams(max_new_tokens=8, seed=5))
    bodies = [body for path, body in double.calls if path == "/generate"]
    assert all("sampling_seed" not in body["sampling_params"] for body in bodies)
    assert first[0][0].output_ids != second[0][0].output_ids  # as a real non-deterministic server behaves


def test_seed_is_sent_and_honoured_with_deterministic_inference(doubles):
    double = doubles(deterministic_inference=True)
    with _engine([double.url]) as engine:
        first = engine.generate([[1, 2]], SamplingParams(max_new_tokens=8, seed=5))
        second = engine.generate([[1, 2]], SamplingParams(max_new_tokens=8, seed=5))
    assert first[0][0].output_ids == second[0][0].output_ids


@pytest.mark.parametrize("pause_mode", ["in_place", "retract"])
def test_weight_update_under_load_succeeds(doubles, tmp_path, pause_mode):
    """Behaviour 2: after an in_place pause the running batch is not empty and SGLang's flush answers 400."""
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text("{}")
    double = doubles(faults=DoubleFaults(hold_until_paused=True))  # in flight until the update pauses
    with _engine(
        [double.url],
        weight_sync="disk",
        model_path=str(model),
        disk_sync_dir=str(tmp_path / "sync"),
        pause_mode=pause_mode,
    ) as engine:
        import torch

        results = []
        worker = threading.Thread(
            target=lambda: results.append(engine.generate([[1, 2], [3]], SamplingParams(max_new_tokens=4)))
        )
        worker.start()
        deadline = time.monotonic() + 10
        while double.generate_count < 2 and time.monotonic() < deadline:
            time.sleep(0.01)
        engine.update_weights([("w", torch.ones(2))], version=1)
        worker.join(timeout=30)
    assert engine.weight_version == 1 and len(results[0]) == 2
    flushed = "/flush_cache" in double.paths()
    assert flushed == (pause_mode != "in_place")


def test_double_flush_refuses_while_requests_run(doubles):
    double = doubles(faults=DoubleFaults(hold_until_paused=True))  # in flight until paused, then held
    with httpx.Client(base_url=double.url, trust_env=False, timeout=10) as http:
        worker = threading.Thread(target=lambda: http.post("/generate", json={"input_ids": [1]}))
        worker.start()
        while double.generate_count < 1:
            time.sleep(0.01)
        assert http.post("/pause_generation", json={"mode": "in_place"}).status_code == 200
        assert http.post("/flush_cache").status_code == 400
        assert http.post("/continue_generation", json={}).status_code == 200
        worker.join()
        assert http.post("/flush_cache").status_code == 200


def test_double_answers_a_non_streaming_abort_with_503(doubles):
    """Behaviour 5: non-streaming SGLang answers an aborted request with HTTP 503 (the body still says abort)."""
    double = doubles(faults=DoubleFaults(abort_first=1))
    response = httpx.post(double.url + "/generate", json={"input_ids": [1, 2]}, trust_env=False)
    assert response.status_code == 503 and response.json()["meta_info"]["finish_reason"]["type"] == "abort"


@pytest.mark.parametrize("version", ["0.5.22", "0.6.0", "default"])
def test_unsupported_server_version_is_refused_at_attach(doubles, version):
    double = doubles(version=version)
    with pytest.raises(UnsupportedSGLangError, match=rf"{double.url} reports version '{version}'.*>=0.5.23,<0.6"):
        _engine([double.url])


def test_retracted_sample_records_its_oldest_weight_version():
    body = {
        "output_ids": [5, 6, 7],
        "meta_info": {
            "output_token_logprobs": [[-0.1, 5, None], [-0.2, 6, None], [-0.3, 7, None]],
            "finish_reason": {"type": "length", "length": 3},
            "weight_version": "4",
            "weight_versions": [{"version": "3", "start": 0, "end": 2}, {"version": "4", "start": 2, "end": 3}],
        },
    }
    result = parse_generate_response(body, prompt_len=2)
    assert result.weight_version == 4 and result.oldest_weight_version == 3
    assert result.weight_versions == ((3, 0, 2), (4, 2, 3))


def test_attach_to_a_dead_url_reports_progress_and_fails_fast(capsys):
    with socket_port() as port:
        url = f"http://127.0.0.1:{port}"
    start = time.monotonic()
    with pytest.raises(RuntimeError, match=rf"{url} not healthy after 1s.*attach_timeout_s"):
        _engine([url], attach_timeout_s=0.6, progress_every_s=0.2)
    assert time.monotonic() - start < 30
    assert f"waiting for {url}/health" in capsys.readouterr().out
    assert SGLangConfig().attach_timeout_s <= 120  # a short default, not the 900 s launch deadline


class socket_port:
    """A port nothing listens on (bound, then released)."""

    def __enter__(self):
        import socket

        self._sock = socket.socket()
        self._sock.bind(("127.0.0.1", 0))
        return self._sock.getsockname()[1]

    def __exit__(self, *exc):
        self._sock.close()


def test_attach_to_a_server_that_never_answers_fails_within_attach_timeout():
    """The connection is accepted (the kernel completes it for the listening socket) but no byte comes
    back: the attach must give up at ``attach_timeout_s`` (+10 s), not at ``request_timeout_s``."""
    import socket

    attach_timeout_s = 1.0
    outcome: list[BaseException] = []

    def attach(url: str) -> None:
        try:
            _engine([url], attach_timeout_s=attach_timeout_s, request_timeout_s=600.0)
        except BaseException as error:  # noqa: BLE001 - reported to the test thread below
            outcome.append(error)

    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as mute:
        mute.bind(("127.0.0.1", 0))
        mute.listen(64)
        url = f"http://127.0.0.1:{mute.getsockname()[1]}"
        worker = threading.Thread(target=attach, args=(url,), daemon=True)
        worker.start()
        worker.join(timeout=attach_timeout_s + 10)
        assert not worker.is_alive(), "attach still waiting past attach_timeout_s + 10 s"
    assert len(outcome) == 1 and isinstance(outcome[0], RuntimeError), outcome
    message = str(outcome[0])
    assert f"{url} not healthy after 1s" in message and "no answer within" in message, message


async def _answer_quoted_after_polling(url: str) -> str:
    """What ``wait_until_healthy``'s error quotes after polling ``url`` for 1 s ("healthy" if it answered 200)."""
    import asyncio

    import httpx

    from gspo_megatron.rollout.sglang.health import wait_until_healthy

    loop = asyncio.get_running_loop()
    try:
        async with httpx.AsyncClient(trust_env=False) as http:
            await wait_until_healthy(http, url, loop.time() + 1.0, 0.01, give_up=lambda last: RuntimeError(last))
    except RuntimeError as error:
        return str(error)
    return "healthy"


def test_a_probe_cut_short_by_the_deadline_does_not_hide_the_last_answer():
    """A server that answered 503 and then went quiet: the last probe, bounded by the deadline, times
    out, and the error still quotes the 503 (it used to quote the deadline's own timeout, which made
    the message depend on how busy the machine was)."""
    import asyncio

    async def scenario() -> str:
        requests = 0

        async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            nonlocal requests
            while await reader.readuntil(b"\r\n\r\n"):
                requests += 1
                if requests == 1:  # the first probe gets an answer; every later one none
                    writer.write(b"HTTP/1.1 503 Service Unavailable\r\ncontent-length: 0\r\n\r\n")
                    await writer.drain()

        server = await asyncio.start_server(serve, "127.0.0.1", 0)
        try:
            return await _answer_quoted_after_polling(f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}")
        finally:
            server.close()

    assert asyncio.run(scenario()) == "HTTP 503"


def test_a_connect_cut_short_by_the_deadline_does_not_hide_the_last_answer():
    """As above, but the later probes cannot even connect: the server answered 503 (and closed the
    connection), then its accept queue stayed full, so the kernel drops the next SYNs and the last probe's
    connect times out at the deadline. CI's busy machine saw exactly this (``ConnectTimeout`` quoted instead
    of the double's 503, tests/unit/rollout/test_sglang_client.py); a full backlog makes it happen at once."""
    import asyncio
    import socket
    import threading

    def serve(listener: socket.socket, finished: threading.Event) -> None:
        conn, _ = listener.accept()
        request = b""
        while b"\r\n\r\n" not in request:
            request += conn.recv(4096)
        fillers = []  # connections nobody accepts: with backlog 1 they fill the accept queue
        for _ in range(4):
            filler = socket.socket()
            filler.settimeout(0.5)
            try:
                filler.connect(listener.getsockname())
            except OSError:
                filler.close()
                break
            fillers.append(filler)
        conn.sendall(b"HTTP/1.1 503 Service Unavailable\r\ncontent-length: 0\r\nconnection: close\r\n\r\n")
        conn.close()
        finished.wait(timeout=30)
        for filler in fillers:
            filler.close()

    async def scenario() -> str:
        listener = socket.create_server(("127.0.0.1", 0), backlog=1)
        url = f"http://127.0.0.1:{listener.getsockname()[1]}"
        finished = threading.Event()
        server = threading.Thread(target=serve, args=(listener, finished), daemon=True)
        server.start()
        try:
            return await _answer_quoted_after_polling(url)
        finally:
            finished.set()
            server.join(timeout=30)
            listener.close()

    assert asyncio.run(scenario()) == "HTTP 503"


def test_a_server_that_never_answers_generate_fails_naming_the_keys_after_a_warning(doubles):
    """Issue 63, item 6: an attached server that accepts /generate and never answers held the run silent
    for 5 x 1800 s. Now a warning names the server and the key at half the timeout, and the request fails
    after its stated bound (timeout x attempts) with an error naming the keys."""
    double = doubles(faults=DoubleFaults(generate_never_answers=True))
    keys = r"2 attempts \(rollout\.sglang\.max_retries=1\) of rollout\.sglang\.request_timeout_s=0\.5 s"
    slow = rf"SGLang server {double.url}: POST /generate has had no answer for 0\.25 s, 50% of rollout\.sglang\."
    with (
        _engine([double.url], request_timeout_s=0.5, max_retries=1) as engine,
        pytest.warns(RuntimeWarning, match=slow) as seen,
        pytest.raises(RequestFailedError, match=rf"no answer within {keys} each"),
    ):
        engine.generate([[5, 6]], SamplingParams(max_new_tokens=4))
    assert double.generate_count == 2  # the first try and one retry, each timed out
    assert sum("has had no answer" in str(w.message) for w in seen) == 1  # once per server, not per attempt


def test_the_default_request_bound_is_the_one_the_config_states():
    """``SGLangConfig.request_timeout_s``'s comment: 600 s x 5 attempts + 7.5 s of backoff (was 2.5 h)."""
    assert retry_policy(SGLangConfig()).bound_s == 600.0 * 5 + (0.5 + 1 + 2 + 4)
