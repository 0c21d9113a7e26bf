"""The servers answer to their run only (issue 63, item 1): launched servers get a fresh API key per run,
the client sends it on every call, attached servers take it from ``rollout.sglang.api_key_env``, a server
that does not enforce it is refused at start-up, and the key is in no config, argv or log.

The servers are the test double (``gspo_megatron/testing/sglang_double.py``), which enforces the key as
SGLang 0.5.23 does (tests/contract/test_sglang_api_key_contract.py compares the two)."""

import json
import stat
import sys
from pathlib import Path

import httpx
import pytest
import torch
from safetensors.torch import save_file

from gspo_megatron.contracts.samples import SamplingParams
from gspo_megatron.rollout.sglang import SGLangConfig, SGLangEngine
from gspo_megatron.rollout.sglang.auth import ApiKey
from gspo_megatron.rollout.sglang.client import RequestRejectedError, SGLangClientError
from gspo_megatron.rollout.sglang.group_sender import SenderBrief

FAKE_LAUNCH_SERVER = [sys.executable, "-m", "gspo_megatron.testing.sglang_double"]
# A launch wrapper that drops SGLang's --config (where the key travels): the server then takes no key.
KEY_DROPPING_LAUNCHER = [
    sys.executable,
    "-c",
    "import sys; from gspo_megatron.testing.sglang_double import main; a = sys.argv[1:]; "
    "i = a.index('--config'); main(a[:i] + a[i + 2 :])",
]
PARAMS = SamplingParams(max_new_tokens=4, n=1)
KEY_VARIABLE = "GSPO_TEST_SGLANG_KEY"


def _model(tmp_path: Path) -> Path:
    model = tmp_path / "model"
    model.mkdir(parents=True, exist_ok=True)
    (model / "config.json").write_text(json.dumps({"num_hidden_layers": 2, "num_experts_per_tok": 2}))
    save_file({"w": torch.zeros(2)}, str(model / "model.safetensors"))
    return model


def _launch_config(tmp_path: Path, **overrides) -> SGLangConfig:
    settings = dict(
        mode="launch",
        model_path=str(_model(tmp_path)),
        launch_command=FAKE_LAUNCH_SERVER,
        log_dir=str(tmp_path / "logs"),
        startup_timeout_s=60.0,
        health_poll_interval_s=0.05,
        shutdown_grace_s=5.0,
        backoff_base_s=0.01,
        weight_sync="disk",
        disk_sync_dir=str(tmp_path / "sync"),
    )
    settings.update(overrides)
    return SGLangConfig(**settings)


def _attach_config(url: str, tmp_path: Path, **overrides) -> SGLangConfig:
    settings = dict(
        mode="attach",
        urls=[url],
        model_path=str(_model(tmp_path)),
        health_poll_interval_s=0.01,
        backoff_base_s=0.01,
        weight_sync="disk",
        disk_sync_dir=str(tmp_path / "sync"),
    )
    settings.update(overrides)
    return SGLangConfig(**settings)


def test_a_second_client_cannot_change_a_launched_servers_weights(tmp_path):
    """Another local user's POST /update_weights_from_disk (its own checkpoint) returned 200 and the run
    then sampled from those weights; now every control route answers 401 without the run's key."""
    foreign = _model(tmp_path / "foreign")
    engine = SGLangEngine(_launch_config(tmp_path))
    try:
        url = engine.server_urls[0]
        with httpx.Client(trust_env=False, timeout=10.0) as stranger:
            body = {"model_path": str(foreign), "weight_version": "foreign"}
            refused = stranger.post(url + "/update_weights_from_disk", json=body)
            paused = stranger.post(url + "/pause_generation", json={"mode": "abort"})
            assert stranger.get(url + "/health").status_code == 200  # SGLang leaves /health open
            state = stranger.get(url + "/_double/state").json()
        assert (refused.status_code, refused.json()) == (401, {"error": "Unauthorized"})
        assert paused.status_code == 401
        assert state["weight_version"] != "foreign" and "/update_weights_from_disk" not in str(state["calls"])
        # the run's own client holds the key: generation and a weight update work
        assert engine.generate([[5, 6, 7]], PARAMS)[0][0].output_ids
        engine.update_weights([("w", torch.ones(2))], version=3)
        assert engine.generate([[5, 6, 7]], PARAMS)[0][0].weight_version == 3
    finally:
        engine.shutdown()


def test_each_run_gets_its_own_key_unless_one_is_named(tmp_path, monkeypatch):
    keys = []
    for run in ("a", "b"):
        engine = SGLangEngine(_launch_config(tmp_path / run))
        try:
            keys.append(engine.api_key.value)
        finally:
            engine.shutdown()
    assert keys[0] != keys[1] and all(len(key) > 40 for key in keys)
    # a named key: another process that knows it attaches to the launched server
    monkeypatch.setenv(KEY_VARIABLE, "shared-key")
    launched = SGLangEngine(_launch_config(tmp_path / "c", api_key_env=KEY_VARIABLE))
    try:
        attached = SGLangEngine(_attach_config(launched.server_urls[0], tmp_path / "c", api_key_env=KEY_VARIABLE))
        assert attached.generate([[1, 2]], PARAMS)[0][0].output_ids
        attached.shutdown()
    finally:
        launched.shutdown()


def test_the_key_is_in_no_config_argv_or_log(tmp_path, capfd):
    config = _launch_config(tmp_path)
    engine = SGLangEngine(config)
    try:
        key = engine.api_key.value
        server = engine.launched_servers[0]
        argv = Path(f"/proc/{server.pid}/cmdline").read_bytes().decode(errors="replace")
        key_file = Path(argv.split("\0")[argv.split("\0").index("--config") + 1])
        engine.update_weights([("w", torch.ones(2))], version=1)
        engine.generate([[1, 2, 3]], PARAMS)
    finally:
        engine.shutdown()
    output = capfd.readouterr()
    log = server.log_path.read_text()
    assert "api_key=set" in log  # the double did read the key
    for where, text in {"argv": argv, "server log": log, "stdout": output.out, "stderr": output.err}.items():
        assert key not in text, f"the key is in the {where}"
    assert key not in repr(config) and key not in repr(engine.api_key) and key not in str(engine.api_key)
    assert key not in repr(SenderBrief(("u",), {"u": 1}, api_key=engine.api_key))
    assert not key_file.exists() and not key_file.parent.exists()  # removed once the server was up
    # SGLang logs its resolved arguments, the key among them: the server log is private
    assert stat.S_IMODE(server.log_path.stat().st_mode) == 0o600


def test_an_attached_server_takes_the_key_from_the_named_variable(doubles, tmp_path, monkeypatch):
    double = doubles(api_key="attached-secret")
    monkeypatch.setenv(KEY_VARIABLE, "attached-secret")
    engine = SGLangEngine(_attach_config(double.url, tmp_path, api_key_env=KEY_VARIABLE))
    try:
        engine.update_weights([("w", torch.ones(2))], version=2)
        assert engine.generate([[1, 2]], PARAMS)[0][0].weight_version == 2
    finally:
        engine.shutdown()
    assert "/update_weights_from_disk" in double.paths() and "/generate" in double.paths()
    with pytest.raises(RequestRejectedError, match="HTTP 401.*rollout.sglang.api_key_env"):
        SGLangEngine(_attach_config(double.url, tmp_path))  # no key configured
    monkeypatch.setenv(KEY_VARIABLE, "a-wrong-key")
    with pytest.raises(RequestRejectedError, match="HTTP 401.*refused this run's API key") as refused:
        SGLangEngine(_attach_config(double.url, tmp_path, api_key_env=KEY_VARIABLE))
    assert "a-wrong-key" not in str(refused.value)


def test_a_server_that_does_not_enforce_the_key_is_refused_at_start_up(doubles, tmp_path, monkeypatch):
    open_double = doubles()  # takes no key: answers everyone
    monkeypatch.setenv(KEY_VARIABLE, "attached-secret")
    with pytest.raises(SGLangClientError, match=f"{open_double.url} answered GET /server_info without the API key"):
        SGLangEngine(_attach_config(open_double.url, tmp_path, api_key_env=KEY_VARIABLE))
    assert "/generate" not in open_double.paths()
    # a launch wrapper that drops the key's --config: the launched server is refused too (and stopped)
    with pytest.raises(SGLangClientError, match="does not enforce the key.*--api-key"):
        SGLangEngine(_launch_config(tmp_path, launch_command=KEY_DROPPING_LAUNCHER))


@pytest.mark.parametrize("arg", [["--api-key", "k"], ["--api-key=k"], ["--admin-api-key", "k"], ["--config", "c.yaml"]])
def test_a_key_in_extra_args_is_refused(tmp_path, arg):
    with pytest.raises(ValueError, match=r"rollout.sglang.extra_args holds --"):
        _launch_config(tmp_path, extra_args=["--mem-fraction-static", "0.5", *arg]).validate()


def test_api_key_env_names_a_set_variable(tmp_path, monkeypatch):
    with pytest.raises(ValueError, match="NAME of an environment variable") as refused:
        _attach_config("http://127.0.0.1:1", tmp_path, api_key_env="gspo-Zx0/+secret").validate()
    assert "secret" not in str(refused.value)
    monkeypatch.delenv(KEY_VARIABLE, raising=False)
    with pytest.raises(ValueError, match=f"the environment variable {KEY_VARIABLE} is unset"):
        SGLangEngine(_attach_config("http://127.0.0.1:1", tmp_path, api_key_env=KEY_VARIABLE))


def test_the_double_decides_as_sglangs_decide_request_auth(doubles):
    """SGLang 0.5.23 ``sglang/srt/utils/auth.py`` ``decide_request_auth`` (api_key only, NORMAL and
    ADMIN_OPTIONAL routes alike): /health*, /ready*, /metrics* open; else ``Bearer <key>``, the scheme in
    any case; 401 ``{"error": "Unauthorized"}`` otherwise (the contract tier checks the real app too)."""
    double = doubles(api_key="k1")
    cases = {
        ("GET", "/health", None): 200,
        ("GET", "/health_generate", None): 200,
        ("GET", "/server_info", None): 401,
        ("GET", "/server_info", "Bearer k1"): 200,
        ("GET", "/server_info", "bearer k1"): 200,
        ("GET", "/server_info", "Bearer k2"): 401,
        ("GET", "/server_info", "Bearerk1"): 401,
        ("GET", "/server_info", "k1"): 401,
        ("GET", "/no_such_route", None): 401,  # the middleware runs before routing
        ("POST", "/update_weights_from_disk", "Basic k1"): 401,
    }
    with httpx.Client(trust_env=False, timeout=10.0) as http:
        for (method, path, header), expected in cases.items():
            headers = {"Authorization": header} if header else {}
            response = http.request(method, double.url + path, headers=headers)
            assert response.status_code == expected, (method, path, header, response.text)
            if expected == 401:
                assert response.json() == {"error": "Unauthorized"}
    assert ApiKey("k1").header() == {"Authorization": "Bearer k1"}
