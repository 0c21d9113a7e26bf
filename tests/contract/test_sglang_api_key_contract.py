"""The API key (issue 63, item 1) against SGLang's own code: the launcher's key file is read by SGLang's
argument parser, and the test double refuses and admits exactly the requests SGLang's api-key middleware
does (``sglang/srt/utils/auth.py``: ``add_api_key_middleware`` over the app's own routes), with the same
status and body."""

from __future__ import annotations

import httpx
import pytest

from gspo_megatron.rollout.sglang.auth import new_launch_key, private_key_config
from gspo_megatron.rollout.sglang.launcher import build_launch_command
from gspo_megatron.testing.sglang_double import SGLangServerDouble

KEY = "gspo-contract-key"
HEADERS = {
    "no key": {},
    "wrong key": {"Authorization": "Bearer not-the-key"},
    "not bearer": {"Authorization": f"Basic {KEY}"},
    "the key": {"Authorization": f"Bearer {KEY}"},
    "the key, lower-case scheme": {"Authorization": f"bearer {KEY}"},
}


def test_the_launchers_key_file_reaches_sglangs_server_args(sglang_reference):
    key = new_launch_key()
    with private_key_config(key) as key_config:
        argv = build_launch_command(
            [],
            model_path="/models/m",
            tp=1,
            host="127.0.0.1",
            port=31000,
            enable_return_routed_experts=False,
            key_config=key_config,
        )
        args = sglang_reference.prepare_server_args(argv[3:])
    assert args.api_key == key.value and key.value not in " ".join(argv)


@pytest.fixture(scope="module")
def keyed_sglang_app(sglang_reference):
    """SGLang's app routes behind SGLang's api-key middleware, as ``http_server.py`` wires it with --api-key."""
    from fastapi import FastAPI
    from sglang.srt.utils.auth import add_api_key_middleware
    from starlette.testclient import TestClient

    app = FastAPI()
    app.router.routes.extend(sglang_reference.app.router.routes)  # the same endpoints, so the same auth levels
    add_api_key_middleware(app, api_key=KEY, admin_api_key=None)
    return TestClient(app, raise_server_exceptions=False)


def _routes() -> list[tuple[str, str]]:
    routes = [route for route in SGLangServerDouble._ROUTES if route[1] != "/_double/state"]  # the double's own
    return routes + [("GET", "/no_such_route"), ("POST", "/update_weights_from_tensor"), ("GET", "/metrics")]


def test_the_double_enforces_the_key_as_sglang_does(keyed_sglang_app):
    disagreements = []
    with SGLangServerDouble(api_key=KEY) as double, httpx.Client(base_url=double.url, trust_env=False) as http:
        for method, path in _routes():
            for name, headers in HEADERS.items():
                real = keyed_sglang_app.request(method, path, headers=headers, json={} if method == "POST" else None)
                fake = http.request(method, path, headers=headers, json={} if method == "POST" else None)
                real_refused, fake_refused = real.status_code == 401, fake.status_code == 401
                same_body = not real_refused or real.json() == fake.json() == {"error": "Unauthorized"}
                if real_refused != fake_refused or not same_body:
                    disagreements.append(
                        f"{method} {path} with {name}: SGLang HTTP {real.status_code} {real.text[:80]!r}, "
                        f"double HTTP {fake.status_code} {fake.text[:80]!r}"
                    )
    assert not disagreements, "the double and SGLang disagree on the API key:\n" + "\n".join(disagreements)
