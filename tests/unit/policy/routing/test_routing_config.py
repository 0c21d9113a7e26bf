import pytest

from gspo_megatron.policy.routing.config import DIAGNOSTIC_KINDS, RoutingConfig


def test_unknown_kind_lists_valid_names():
    with pytest.raises(ValueError, match="update, rollout_vs_train, minibatch"):
        RoutingConfig(kinds=["updates"])


def test_schedule():
    cfg = RoutingConfig(every_n_steps=3, kinds=["update"])
    assert [s for s in range(7) if cfg.is_due(s, "update")] == [0, 3, 6]
    assert not cfg.is_due(3, "minibatch")
    assert not RoutingConfig(enabled=False).is_due(0, "update")
    assert set(DIAGNOSTIC_KINDS) == {"update", "rollout_vs_train", "minibatch", "ratio_decomposition"}


def test_bad_values():
    with pytest.raises(ValueError, match="every_n_steps"):
        RoutingConfig(every_n_steps=0)
    with pytest.raises(ValueError, match="duplicates"):
        RoutingConfig(kinds=["update", "update"])
