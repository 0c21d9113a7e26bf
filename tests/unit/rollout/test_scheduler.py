"""One-step asynchronous rollout with the real embedded engine: a generation in flight finishes on
the weights it started with (its routed experts -- what R3 replays -- are the stale policy's), the
staleness bound is enforced, and max_staleness=0 never starts a thread."""

import threading

import pytest
import torch
from transformers import Qwen3MoeForCausalLM

from gspo_megatron.contracts.samples import SamplingParams
from gspo_megatron.rollout.config import EmbeddedConfig
from gspo_megatron.rollout.embedded.engine import EmbeddedEngine
from gspo_megatron.rollout.scheduler import RolloutScheduler, StalenessError
from gspo_megatron.testing.model_fixtures import tiny_qwen3_moe_hf_config as _hf_config

PROMPTS = [[1, 2, 3, 4, 5], [7, 8, 9]]
PARAMS = SamplingParams(temperature=1.0, max_new_tokens=6, n=2, seed=3, return_routed_experts=True)


def _weights(seed):
    torch.manual_seed(seed)
    model = Qwen3MoeForCausalLM(_hf_config())
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            parameter.normal_(1.0 if name.endswith("norm.weight") else 0.0, 0.1 if "norm" in name else 0.4)
    return dict(model.state_dict())


def _experts(samples):
    return [s.routed_experts for group in samples for s in group]


class _RecordingEngine(EmbeddedEngine):
    """The real engine; generation signals when it has started, so the test can change weights then."""

    started = None

    def generate(self, prompts, params):
        if self.started is not None:
            self.started.set()
        return super().generate(prompts, params)


def _scheduler(engine, max_staleness):
    return RolloutScheduler(
        lambda step: (engine.generate(PROMPTS, PARAMS), {}),
        max_staleness,
        last_step=10,
        versions_of=lambda samples: [s.weight_version for group in samples for s in group],
    )


def test_in_flight_generation_keeps_the_stale_policys_experts():
    old, new = _weights(1), _weights(2)
    engine = _RecordingEngine(_hf_config(), EmbeddedConfig())
    engine.update_weights(old.items(), version=0)
    with_old = _experts(engine.generate(PROMPTS, PARAMS))
    engine.update_weights(new.items(), version=1)
    with_new = _experts(engine.generate(PROMPTS, PARAMS))
    assert any(not torch.equal(a, b) for a, b in zip(with_old, with_new, strict=True))  # the weights change routing

    engine.update_weights(old.items(), version=0)
    scheduler = _scheduler(engine, max_staleness=1)
    _, metrics = scheduler.take(0)
    assert metrics["async/staleness_max"] == 0.0
    engine.started = threading.Event()
    scheduler.start_next(1)  # generates on version 0 while "training" happens here
    assert engine.started.wait(timeout=60)
    scheduler.before_weight_sync()  # the trainer's sync waits for the generation ...
    engine.update_weights(new.items(), version=1)  # ... before the weights change
    samples, metrics = scheduler.take(1)
    assert all(s.weight_version == 0 for group in samples for s in group)
    assert metrics["async/staleness_max"] == 1.0 and metrics["async/policy_version_min"] == 0.0
    assert all(torch.equal(a, b) for a, b in zip(_experts(samples), with_old, strict=True))  # what R3 will replay


def test_staleness_bound_is_enforced_and_zero_means_synchronous():
    engine = EmbeddedEngine(_hf_config(), EmbeddedConfig())
    engine.update_weights(_weights(1).items(), version=0)
    scheduler = _scheduler(engine, max_staleness=0)
    scheduler.start_next(1)
    assert scheduler._pending is None  # no background thread in synchronous mode
    scheduler.take(0)
    with pytest.raises(StalenessError, match="staleness 1 exceeds rollout.max_staleness=0"):
        scheduler.take(1)  # the engine still holds version 0: one step stale
    with pytest.raises(ValueError, match=r"rollout.max_staleness=2: .* supports 0 \(synchronous\) or 1"):
        _scheduler(engine, max_staleness=2)


def test_with_the_sglang_engine_the_update_waits_for_the_in_flight_generation(tmp_path):
    """Against the SGLang test double: the prefetch's requests finish before the weight update
    begins, and their samples carry the old version read back from meta_info."""
    import json
    import time

    from gspo_megatron.rollout.sglang import SGLangConfig, SGLangEngine
    from gspo_megatron.testing.sglang_double import SGLangServerDouble
    from gspo_megatron.testing.sglang_double_faults import DoubleFaults

    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"num_hidden_layers": 2, "num_experts_per_tok": 2}))
    double = SGLangServerDouble(faults=DoubleFaults(generate_delay_s=0.2)).start()
    try:
        config = SGLangConfig(
            mode="attach",
            urls=[double.url],
            weight_sync="disk",
            model_path=str(model),
            disk_sync_dir=str(tmp_path / "sync"),
            health_poll_interval_s=0.01,
        )
        tensors = [("w", torch.ones(2))]
        params = SamplingParams(max_new_tokens=3, n=2, seed=1)
        with SGLangEngine(config) as engine:
            engine.update_weights(iter(tensors), version=0)
            finished = []

            def produce(step):
                out = engine.generate([[1, 2], [3, 4]], params)  # ~0.2 s per request in the double
                finished.append(time.perf_counter())
                return out, {}

            scheduler = RolloutScheduler(
                produce, 1, 10, versions_of=lambda out: [s.weight_version for g in out for s in g]
            )
            scheduler.take(0)
            scheduler.start_next(1)
            scheduler.before_weight_sync()
            update_started = time.perf_counter()
            engine.update_weights(iter(tensors), version=1)
            samples, metrics = scheduler.take(1)
        assert finished[-1] <= update_started  # the prefetch finished before the update began
        assert all(s.weight_version == 0 for g in samples for s in g) and metrics["async/staleness_max"] == 1.0
    finally:
        double.stop()
