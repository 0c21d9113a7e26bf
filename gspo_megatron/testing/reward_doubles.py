"""Reward functions that misbehave on purpose, importable by path (``task.reward=import:...``)."""

from __future__ import annotations


def always_raises(response, record):
    raise RuntimeError("this verifier is broken on purpose")


def misbehaves_by_digit(response, record):
    """max_digit's exact match, except that the first character of the response picks a failure:
    0 raises, 1 returns a string reward, 2 NaN, 3 inf, 4 hangs, 5 kills its process."""
    import math
    import os
    import signal
    import time

    from gspo_megatron.rollout.rewards.builtin import exact_match
    from gspo_megatron.rollout.rewards.types import RewardResult

    first = response.strip()[:1]
    if first == "0":
        raise ValueError("verifier bug")
    if first == "1":
        # deliberately not a number (a verifier bug): the reward phase must refuse it
        return RewardResult(reward="high", correct=True, format_ok=True)  # type: ignore[arg-type]
    if first in ("2", "3"):
        return RewardResult(reward=math.nan if first == "2" else math.inf, correct=False, format_ok=True)
    if first == "4":
        time.sleep(3600)
    if first == "5":
        os.kill(os.getpid(), signal.SIGKILL)
    return exact_match(response, record)


def varied_by_response(response, record):
    """A reward in [0, 1) that differs between responses (a checksum of the text): every group has
    reward variance, so every step has a gradient even before the policy can solve the task."""
    import zlib

    from gspo_megatron.rollout.rewards.types import RewardResult

    return RewardResult(reward=(zlib.crc32(response.encode()) % 97) / 97, correct=False, format_ok=True)


def announces_and_hangs(response, record):
    """Creates the file named by ``GSPO_TEST_REWARD_STARTED`` (the test's signal that rewards are being
    computed), then never returns: the run is inside its reward phase for as long as the test needs."""
    import os
    import time
    from pathlib import Path

    Path(os.environ["GSPO_TEST_REWARD_STARTED"]).touch()
    time.sleep(3600)


def starts_a_detached_service(response, record):
    """max_digit's exact match; the first call in a run also starts a long-lived service the way a user's
    verifier might (``setsid nohup sleep 600``: out of the trainer's session) and writes its pid to the
    file named by ``GSPO_TEST_SERVICE_PID``."""
    import os
    import subprocess

    from gspo_megatron.rollout.rewards.builtin import exact_match

    try:
        claim = os.open(os.environ["GSPO_TEST_SERVICE_PID"] + ".claim", os.O_CREAT | os.O_EXCL | os.O_WRONLY)
    except FileExistsError:  # another worker started it
        return exact_match(response, record)
    os.close(claim)
    service = subprocess.Popen(
        ["setsid", "nohup", "sleep", "600"],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    tmp = os.environ["GSPO_TEST_SERVICE_PID"] + ".tmp"
    with open(tmp, "w") as file:
        file.write(str(service.pid))
    os.replace(tmp, os.environ["GSPO_TEST_SERVICE_PID"])
    return exact_match(response, record)
