"""SGLangEngine in attach mode against real HTTP test doubles (gspo_megatron.testing.sglang_double)."""

import pytest

from gspo_megatron.contracts.samples import FinishReason, SamplingParams
from gspo_megatron.rollout.sglang import SGLangConfig, SGLangEngine
from gspo_megatron.rollout.sglang.client import NoServersLeftError, RequestFailedError, RequestRejectedError
from gspo_megatron.rollout.sglang.protocol import ProtocolError
from gspo_megatron.testing.sglang_double_faults import DoubleFaults


def _engine(urls, **overrides):
    settings = dict(
        mode="attach",
        urls=urls,
        health_poll_interval_s=0.01,
        backoff_base_s=0.01,
        backoff_max_s=0.05,
        startup_timeout_s=10.0,
        request_timeout_s=10.0,
    )
    settings.update(overrides)
    return SGLangEngine(SGLangConfig(**settings))


PARAMS = SamplingParams(max_new_tokens=6, n=2, seed=100)


def test_startup_503s_are_waited_out(doubles):
    double = doubles(faults=DoubleFaults(startup_503=3))
    with _engine([double.url]) as engine:
        assert double.paths() == ["/health"] * 4 + ["/server_info"]  # three 503s, then 200; version check
        samples = engine.generate([[11, 12, 13]], PARAMS)
    assert len(samples) == 1 and len(samples[0]) == 2
    sample = samples[0][0]
    assert sample.prompt_ids == [11, 12, 13]
    assert sample.output_log_probs.shape == (len(sample.output_ids),)
    assert (sample.output_log_probs <= 0).all()
    assert sample.finish_reason in (FinishReason.STOP, FinishReason.LENGTH)
    if sample.finish_reason is FinishReason.STOP:
        assert sample.output_ids[-1] == 2  # the double's EOS
    else:
        assert len(sample.output_ids) == 6


def test_attach_deadline_names_the_server(doubles):
    double = doubles(faults=DoubleFaults(startup_503=10_000))
    # a deadline long enough for the double's instant 503s to be the last answer: at 0.2 s a probe cut
    # short by the deadline on a busy machine ("no answer within ...") was quoted instead
    with pytest.raises(RuntimeError, match=rf"{double.url} not healthy .*HTTP 503"):
        _engine([double.url], attach_timeout_s=2.0)


def test_seeds_make_samples_reproducible_and_distinct(doubles):
    double = doubles(deterministic_inference=True)  # SGLang honours seeds only with this launch flag
    with _engine([double.url]) as engine:
        first = engine.generate([[1, 2], [3, 4]], PARAMS)
        second = engine.generate([[1, 2], [3, 4]], PARAMS)
    assert [[s.output_ids for s in row] for row in first] == [[s.output_ids for s in row] for row in second]
    seeds = [call[1]["sampling_params"]["sampling_seed"] for call in double.calls if call[0] == "/generate"][:4]
    assert sorted(seeds) == [100, 101, 102, 103]  # seed + prompt_index * n + k
    assert first[0][0].output_ids != first[0][1].output_ids


def test_generate_503_is_retried_with_backoff(doubles):
    double = doubles(faults=DoubleFaults(generate_503=2))
    with _engine([double.url], max_concurrency=1) as engine:
        samples = engine.generate([[5, 6]], SamplingParams(max_new_tokens=4))
    assert double.generate_count == 3 and len(samples[0][0].output_ids) >= 1


def test_5xx_beyond_the_retry_budget_fails_clearly(doubles):
    double = doubles(faults=DoubleFaults(generate_503=100))
    with (
        _engine([double.url], max_retries=2) as engine,
        pytest.raises(RequestFailedError, match="failed 3 times.*HTTP 503"),
    ):
        engine.generate([[5, 6]], SamplingParams(max_new_tokens=4))
    assert double.generate_count == 3


def test_aborted_sample_is_resubmitted_then_reported(doubles):
    double = doubles(faults=DoubleFaults(abort_first=1))
    with _engine([double.url], max_concurrency=1, abort_retries=1) as engine:
        sample = engine.generate([[5, 6]], SamplingParams(max_new_tokens=4))[0][0]
    assert sample.finish_reason is not FinishReason.ABORT and sample.extra["abort_retries"] == 1
    assert double.generate_count == 2

    double = doubles(faults=DoubleFaults(abort_first=5))
    with _engine([double.url], max_concurrency=1, abort_retries=1) as engine:
        sample = engine.generate([[5, 6]], SamplingParams(max_new_tokens=4))[0][0]
    assert sample.finish_reason is FinishReason.ABORT
    assert double.generate_count == 2  # first try + one resubmission, then reported as ABORT


def test_server_dying_mid_batch_fails_over(doubles):
    dying = doubles(faults=DoubleFaults(die_after=2, generate_delay_s=0.05))
    healthy = doubles(faults=DoubleFaults(generate_delay_s=0.05))
    with _engine([dying.url, healthy.url], max_concurrency=2) as engine:
        samples = engine.generate([[1], [2], [3], [4]], SamplingParams(max_new_tokens=4, n=3, seed=0))
        state = engine.health()["servers"]
    assert all(len(row) == 3 for row in samples) and len(samples) == 4
    assert state[dying.url]["alive"] is False and state[healthy.url]["alive"] is True
    # It answered at most its 2 requests before dying (one may be dropped in flight); the rest moved.
    # ("served" also counts each server's /server_info version check at start-up: + 1 each.)
    assert 1 <= state[dying.url]["served"] - 1 <= 2 and dying.generate_count >= 3
    assert state[dying.url]["served"] + state[healthy.url]["served"] - 2 == 12


def test_all_servers_dead_names_them(doubles):
    first = doubles(faults=DoubleFaults(die_after=1))
    second = doubles(faults=DoubleFaults(die_after=1))
    with _engine([first.url, second.url], max_concurrency=2) as engine:
        with pytest.raises(NoServersLeftError) as error:
            engine.generate([[1], [2], [3]], SamplingParams(max_new_tokens=3, n=2))
        with pytest.raises(RuntimeError, match="no SGLang server is alive"):
            engine.health()
    message = str(error.value)
    assert f"{first.url}: DEAD" in message and f"{second.url}: DEAD" in message
    assert "last error: " in message and "last error: -" not in message


def test_two_servers_share_the_load(doubles):
    a = doubles(faults=DoubleFaults(generate_delay_s=0.05))
    b = doubles(faults=DoubleFaults(generate_delay_s=0.05))
    with _engine([a.url, b.url]) as engine:
        engine.generate([[1, 2, 3]] * 4, SamplingParams(max_new_tokens=4, n=2))
    assert a.generate_count == 4 and b.generate_count == 4


def test_a_group_stays_on_one_server_and_each_sample_names_it(doubles):
    """A prompt's samples go to one server (its prefix is cached there); groups alternate by load."""
    a, b = doubles(), doubles()
    with _engine([a.url, b.url]) as engine:
        groups = engine.generate([[1, 2], [3, 4], [5, 6], [7, 8], [9, 10]], SamplingParams(max_new_tokens=3, n=3))
    servers = [{sample.extra["server"] for sample in group} for group in groups]
    assert all(len(group_servers) == 1 for group_servers in servers)  # one server per group
    assert [next(iter(group_servers)) for group_servers in servers] == [a.url, b.url, a.url, b.url, a.url]
    assert (a.generate_count, b.generate_count) == (9, 6)


def test_a_group_whose_server_dies_finishes_on_another(doubles):
    dying = doubles(faults=DoubleFaults(die_after=1, generate_delay_s=0.05))
    healthy = doubles(faults=DoubleFaults(generate_delay_s=0.05))
    with _engine([dying.url, healthy.url], max_concurrency=4) as engine:
        groups = engine.generate([[1], [2]], SamplingParams(max_new_tokens=3, n=3))
    assert [len(group) for group in groups] == [3, 3]
    # the first group's server died after one answer: the rest of that group was re-sent to the healthy one
    first = [sample.extra["server"] for sample in groups[0]]
    assert first.count(healthy.url) >= 2 and all(s.extra["server"] == healthy.url for s in groups[1])


def test_malformed_json_is_an_error(doubles):
    double = doubles(faults=DoubleFaults(malformed_json=True))
    with _engine([double.url]) as engine, pytest.raises(RequestFailedError, match="malformed JSON"):
        engine.generate([[1]], SamplingParams(max_new_tokens=3))


def test_mismatched_logprob_token_ids_are_an_error(doubles):
    double = doubles(faults=DoubleFaults(mismatched_logprob_ids=True))
    with _engine([double.url]) as engine, pytest.raises(ProtocolError, match="do not belong"):
        engine.generate([[1]], SamplingParams(max_new_tokens=3))


def test_routed_experts_round_trip_and_wrong_size(doubles):
    double = doubles(enable_return_routed_experts=True, num_layers=3, top_k=2, num_experts=4)
    params = SamplingParams(max_new_tokens=5, return_routed_experts=True, seed=1)
    with _engine([double.url], enable_return_routed_experts=True, num_hidden_layers=3, num_experts_per_tok=2) as engine:
        sample = engine.generate([[1, 2, 3, 4]], params)[0][0]
    assert sample.routed_experts.shape == (4 + len(sample.output_ids) - 1, 3, 2)
    assert sample.routed_experts.min() >= 0 and sample.routed_experts.max() < 4

    wrong = doubles(
        enable_return_routed_experts=True, num_layers=3, top_k=2, faults=DoubleFaults(wrong_routed_experts=True)
    )
    with (
        _engine([wrong.url], enable_return_routed_experts=True, num_hidden_layers=3, num_experts_per_tok=2) as engine,
        pytest.raises(ProtocolError, match="expected .* layers, top_k 2"),
    ):
        engine.generate([[1, 2, 3, 4]], params)


def test_routed_experts_need_the_flag_and_layout(doubles):
    double = doubles()
    with _engine([double.url]) as engine, pytest.raises(ValueError, match="enable_return_routed_experts"):
        engine.generate([[1]], SamplingParams(return_routed_experts=True))
    with pytest.raises(ValueError, match="num_hidden_layers"):
        _engine([double.url], enable_return_routed_experts=True)
    # attach to a server launched without the flag: the answer lacks routed_experts
    with (
        _engine([double.url], enable_return_routed_experts=True, num_hidden_layers=2, num_experts_per_tok=2) as engine,
        pytest.raises(ProtocolError, match="--enable-return-routed-experts"),
    ):
        engine.generate([[1]], SamplingParams(return_routed_experts=True))


def test_bad_request_is_rejected_without_retries(doubles):
    double = doubles()
    with _engine([double.url]) as engine:
        client = engine._client
        with pytest.raises(RequestRejectedError, match="HTTP 400.*input_ids"):
            engine._loop.run(client.post_balanced("/generate", {"input_ids": []}))
    assert double.paths().count("/generate") == 1


def test_concurrency_limit_holds_over_all_servers(doubles):
    a = doubles(faults=DoubleFaults(generate_delay_s=0.02))
    b = doubles(faults=DoubleFaults(generate_delay_s=0.02))
    with _engine([a.url, b.url], max_concurrency=1) as engine:
        engine.generate([[1]] * 3, SamplingParams(max_new_tokens=2, n=2))
    assert a.max_in_flight == 1 and b.max_in_flight == 1 and a.generate_count + b.generate_count == 6
    # the server holds each request until 3 are in flight at once (was: a 0.1 s delay, which a busy
    # machine did not always fill with 3 requests); more than 3 would break the limit
    c = doubles(faults=DoubleFaults(hold_until_in_flight=3))
    with _engine([c.url], max_concurrency=3) as engine:
        engine.generate([[1]] * 6, SamplingParams(max_new_tokens=2))
    assert c.max_in_flight == 3


def test_sync_generate_works_inside_a_running_event_loop(doubles):
    import asyncio

    double = doubles()

    async def driver():
        with _engine([double.url]) as engine:
            return engine.generate([[1, 2]], SamplingParams(max_new_tokens=3))

    samples = asyncio.run(driver())
    assert len(samples[0][0].output_ids) >= 1


def test_a_socket_torn_down_while_connecting_counts_as_a_dead_server(doubles):
    # anyio 4.16 / httpcore 1.0.9: a server dying during connection set-up raises AttributeError
    # ('NoneType' object has no attribute 'getpeername') from the transport; it must fail over like
    # any lost connection instead of escaping as a crash (seen flaky in test_all_servers_dead_names_them).
    import httpx

    class TornDown(httpx.AsyncBaseTransport):
        async def handle_async_request(self, request):
            raise AttributeError("'NoneType' object has no attribute 'getpeername'")

    dying, live = doubles(), doubles()
    with _engine([dying.url, live.url], max_concurrency=2) as engine:
        client = engine._client
        real = client._http
        client._http = httpx.AsyncClient(mounts={dying.url: TornDown()}, trust_env=False)
        try:
            samples = engine.generate([[1], [2]], SamplingParams(max_new_tokens=2))
        finally:
            engine._loop.run(client._http.aclose())
            client._http = real
        assert len(samples) == 2
        assert "connection lost" in (client.pool.servers[0].last_error or "")


def test_idle_connections_are_not_reused_after_keepalive_expiry():
    """The client drops a pooled connection idle longer than keepalive_expiry_s (SGLangConfig), so it
    never reuses one the server is closing: a second request after the expiry opens a new connection."""
    import asyncio

    from gspo_megatron.rollout.sglang.client import RetryPolicy, SGLangHTTPClient

    async def run() -> int:
        connections = 0

        async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            nonlocal connections
            connections += 1
            while await reader.readuntil(b"\r\n\r\n"):  # requests without a body (GET); keeps it alive
                writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: 2\r\n\r\n{}")
                await writer.drain()

        server = await asyncio.start_server(serve, "127.0.0.1", 0)
        url = f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"
        client = SGLangHTTPClient([url], retry=RetryPolicy(0, 0.01, 0.01, 2), keepalive_expiry_s=0.05)
        try:
            (state,) = client.pool.servers
            await client.call(state, "GET", "/server_info")
            await asyncio.sleep(0.3)  # idle past the expiry (the server would keep it open forever)
            await client.call(state, "GET", "/server_info")
        finally:
            await client.aclose()
            server.close()
        return connections

    assert asyncio.run(run()) == 2


def test_turns_stay_on_their_trajectorys_server_and_return_the_rows_their_call_fed(doubles):
    from gspo_megatron.rollout.engine import TurnRequest

    servers = [doubles(enable_return_routed_experts=True, num_layers=2, top_k=2, num_experts=4) for _ in range(2)]
    params = SamplingParams(max_new_tokens=4, return_routed_experts=True, seed=3)
    layout = {"enable_return_routed_experts": True, "num_hidden_layers": 2, "num_experts_per_tok": 2}
    with _engine([s.url for s in servers], **layout) as engine:
        first = engine.generate_turns([TurnRequest([1, 2, 3], params), TurnRequest([4, 5], params)])
        assert {r.session.state for r in first} == {s.url for s in servers}  # spread over the servers
        contexts = [[1, 2, 3] + first[0].output_ids + [9, 9], [4, 5] + first[1].output_ids + [8]]
        second = engine.generate_turns(
            [TurnRequest(ids, params, r.session) for ids, r in zip(contexts, first, strict=True)]
        )
    for ids, before, after in zip(contexts, first, second, strict=True):
        assert after.session.state == before.session.state  # the prefix cache's server, turn after turn
        assert before.routed_experts.shape[0] == before.session.fed
        assert after.routed_experts.shape[0] == after.session.fed - before.session.fed  # only the new positions
        assert after.session.fed == len(ids) + len(after.output_ids) - 1
