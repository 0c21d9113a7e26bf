"""Registry: duplicates rejected, unknown names listed, the shipped registries hold what configs name."""

import pytest

from gspo_megatron.algorithms import ADVANTAGE_ESTIMATORS, POLICY_LOSSES, Registry, UnknownNameError


def test_register_as_decorator_and_call_returns_the_object():
    registry = Registry("widget")

    @registry.register("a")
    def a():
        return 1

    b = registry.register("b", lambda: 2)
    assert registry.get("a") is a and registry.get("b") is b
    assert registry.names() == ["a", "b"] and "a" in registry and len(registry) == 2


def test_duplicate_name_is_rejected_and_first_registration_kept():
    registry = Registry("widget")
    first = registry.register("x", object())
    with pytest.raises(ValueError, match=r"widget 'x' is already registered"):
        registry.register("x", object())
    assert registry.get("x") is first


def test_unknown_name_error_lists_valid_names():
    registry = Registry("policy loss")
    registry.register("gspo", 1)
    registry.register("grpo", 2)
    with pytest.raises(UnknownNameError, match=r"unknown policy loss 'gsop'; valid names: grpo, gspo"):
        registry.get("gsop")


def test_empty_registry_says_so():
    with pytest.raises(UnknownNameError, match=r"\(none registered\)"):
        Registry("shaper").get("x")


def test_shipped_registries():
    assert POLICY_LOSSES.names() == ["grpo", "gspo", "gspo_token"]
    assert "group_relative" in ADVANTAGE_ESTIMATORS
