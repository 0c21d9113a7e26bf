"""Misbehaving verifiers for the RewardPool tests, importable by worker processes as
``import:verifier_doubles:<name>`` (pytest puts this directory on sys.path, and spawned/forkserver
workers inherit the parent's sys.path). Each one misbehaves only for the response "bad", so a batch
shows that one bad sample does not cost the others."""

import os
import signal
import threading
import time

from gspo_megatron.rollout.rewards import RewardResult


def _ok(response, record):
    correct = response == record.answer
    return RewardResult(reward=float(correct), correct=correct, format_ok=True)


def hangs_on_bad(response, record):
    if response == "bad":
        time.sleep(3600)
    return _ok(response, record)


RELEASE = threading.Event()  # blocks_on_bad waits for it; a test sets it when done, so no thread stays behind
CALLS: list[str] = []  # blocks_on_bad's responses, in the order it was called (in-process tests read it)


def blocks_on_bad(response, record):
    """Never returns for "bad" while the test holds RELEASE (an in-process call cannot be killed)."""
    CALLS.append(response)
    if response == "bad":
        RELEASE.wait(600)
    return _ok(response, record)


def raises_on_bad(response, record):
    if response == "bad":
        raise ZeroDivisionError("verifier bug")
    return _ok(response, record)


def kills_process_on_bad(response, record):
    if response == "bad":
        os.kill(os.getpid(), signal.SIGKILL)
    return _ok(response, record)


def returns_str(response, record):
    return "1.0"


def plain_float(response, record):
    """A TRL-style reward: a float, 1.0 for the right answer, 0.1 for a number, -1.0 otherwise."""
    if response == record.answer:
        return 1.0
    return 0.1 if response.isdigit() else -1.0


def plain_bool(response, record):
    """A TRL-style binary reward: a bool."""
    return response == record.answer


def plain_by_response(response, record):
    """The response names the plain value returned: nan, inf, none, int."""
    return {"nan": float("nan"), "inf": float("inf"), "none": None, "int": 1}[response]


def fails_on_import_in_worker(response, record):
    return _ok(response, record)


def _refuse_to_start():
    raise RuntimeError("this verifier cannot start")


fails_on_import_in_worker.warm_up = _refuse_to_start


def misbehaves_by_response(response, record):
    """The response names the failure: raise, type, string, nan, inf, hang, die; anything else scores."""
    if response == "raise":
        raise ValueError("verifier bug")
    if response == "type":
        return {"reward": 1.0}
    if response == "string":
        return RewardResult(reward="high", correct=True, format_ok=True)
    if response in ("nan", "inf"):
        return RewardResult(reward=float(response), correct=False, format_ok=True)
    if response == "hang":
        time.sleep(3600)
    if response == "die":
        os.kill(os.getpid(), signal.SIGKILL)
    return _ok(response, record)


def returns_record_fields(response, record):
    """A RewardResult of whatever fields the record carries in ``metadata["result"]`` (typed or not)."""
    return RewardResult(**record.metadata["result"])


def reports_its_threads(response, record):
    """The torch intra-op thread count of the process scoring: torch imported by the verifier's warm-up,
    as a verifier that needs it would (reward workers import no torch of their own)."""
    import torch

    return float(torch.get_num_threads())


def _import_torch():
    import torch  # noqa: F401 - the import is the warm-up


reports_its_threads.warm_up = _import_torch
