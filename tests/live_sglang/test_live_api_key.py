"""The real server answers to the run's API key only (issue 63, item 1): the engine launched it with the
key (``rollout/sglang/auth.py``: SGLang's ``--config`` file), every call of the engine carries it, and
another client on the host without it cannot change the server's weights or pause it."""

from __future__ import annotations

import httpx
from test_live_engine import GREEDY, PROMPTS

UNAUTHORIZED = (401, {"error": "Unauthorized"})


def test_a_second_client_without_the_key_cannot_change_the_servers_weights(live_engine, tiny_checkpoint):
    (url,) = live_engine.server_urls
    version = live_engine.generate([PROMPTS[0]], GREEDY)[0][0].weight_version
    body = {"model_path": str(tiny_checkpoint), "weight_version": "stranger"}
    with httpx.Client(trust_env=False, timeout=120) as stranger:
        refused = stranger.post(url + "/update_weights_from_disk", json=body)
        wrong_key = {"Authorization": "Bearer not-the-runs-key"}
        paused = stranger.post(url + "/pause_generation", json={"mode": "abort"}, headers=wrong_key)
        health = stranger.get(url + "/health")
    assert (refused.status_code, refused.json()) == UNAUTHORIZED
    assert (paused.status_code, paused.json()) == UNAUTHORIZED
    assert health.status_code == 200  # SGLang leaves /health open (decide_request_auth)
    # the run's own client still generates, on the version it set
    assert live_engine.generate([PROMPTS[0]], GREEDY)[0][0].weight_version == version
