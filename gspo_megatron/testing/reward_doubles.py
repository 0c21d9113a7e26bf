"""Reward functions that misbehave on purpose, importable by path (``task.reward=import:...``)."""

from __future__ import annotations


def always_raises(response, record):
    raise RuntimeError("this verifier is broken on purpose")
