"""``rollout/inflight_sync.py`` with the real embedded engine under a streaming scheduler: with
``inflight_update_mode=in_place`` a weight sync does not wait for the round in flight but lands in it, the stream
read on the trainer's thread and handed over one tensor at a time; an idle engine takes it at once in the
trainer's thread; an update the generating thread refuses fails the sync and stops the feed.

The round pauses inside one forward (a forward hook waiting for an event), and the sync's stream signals its first
read, so the update is posted while the round decodes: events, no clock."""

import threading

import pytest
import torch

from gspo_megatron.rollout.config import EmbeddedConfig, InflightUpdateMode, StalenessMode
from gspo_megatron.rollout.embedded.engine import EmbeddedEngine
from gspo_megatron.rollout.inflight_sync import load_in_flight
from gspo_megatron.rollout.streaming import StreamingScheduler
from gspo_megatron.testing.model_fixtures import tiny_qwen3_moe_hf_config as _hf_config
from gspo_megatron.testing.model_fixtures import tiny_qwen3_moe_hf_weights as _weights
from tests.unit.rollout.test_streaming import BOUND_S, PARAMS, _versions


class _Stream:
    """A weight stream that records the thread each tensor was read on, and signals its first read."""

    def __init__(self, named_tensors):
        self.named_tensors = list(named_tensors)
        self.threads: list[int] = []
        self.first_read = threading.Event()

    def __iter__(self):
        for item in self.named_tensors:
            self.threads.append(threading.get_ident())
            self.first_read.set()
            yield item


class _PauseInForward:
    """Forward ``step`` of the model (hooked on its ``lm_head``, the last module of every forward, transformers' and
    the lean one) waits for ``release`` (bounded) after setting ``reached``."""

    def __init__(self, model, step):
        self.step, self.count = step, 0
        self.reached, self.release = threading.Event(), threading.Event()
        self.handle = model.register_forward_hook(self._hook)

    def _hook(self, module, inputs, output):
        if self.count == self.step:
            self.reached.set()
            if not self.release.wait(BOUND_S):
                raise TimeoutError(f"forward {self.step} was not released within {BOUND_S} s")
        self.count += 1


def _scheduler(engine, draw_round):
    return StreamingScheduler(
        draw_round,
        lambda step, groups: (groups, {}),
        _versions,
        lambda groups: [s.weight_version for group in groups for s in group],
        2,
        StalenessMode.wait,
        groups_per_step=1,
        last_step=4,
        wait_bound_s=BOUND_S,
        inflight_update_mode=InflightUpdateMode.in_place,
    )


def test_an_in_place_sync_lands_inside_the_round_in_flight_read_on_the_trainers_thread():
    engine = EmbeddedEngine(_hf_config(), EmbeddedConfig())
    engine.update_weights(_weights(0).items(), 0)
    pause = _PauseInForward(engine.model.lm_head, 1)  # forward 0 is the prefill: the first token is version 0's
    scheduler = _scheduler(engine, lambda round_index: engine.generate([[1, 2, 3]], PARAMS))
    scheduler.start(0)
    assert pause.reached.wait(BOUND_S)
    stream, trainer = _Stream(_weights(1).items()), threading.get_ident()
    scheduler.before_weight_sync()  # takes no turn: the round is paused inside a forward, and this returns
    stream_read = threading.Thread(target=lambda: stream.first_read.wait(BOUND_S) and pause.release.set())
    stream_read.start()  # the round goes on once the update is posted (its stream read from)
    load_in_flight(engine, stream, 1, scheduler.inflight_update_mode, BOUND_S)
    scheduler.after_weight_sync(1)
    stream_read.join(BOUND_S)
    pause.handle.remove()
    groups, _ = scheduler.take(0)
    scheduler.close()
    assert set(stream.threads) == {trainer} and len(stream.threads) == len(stream.named_tensors)
    for sample in groups[0]:
        versions = sample.extra["token_versions"]
        assert versions[:2] == [0, 0] and set(versions[2:]) == {1}  # forwards 0 and 1 old, the rest new
        assert sample.weight_version == 0  # the oldest: what the bound and the batch's versions read
    assert engine.weight_version == 1


def test_an_idle_engine_takes_the_update_at_once_in_the_trainers_thread():
    engine = EmbeddedEngine(_hf_config(), EmbeddedConfig())
    stream = _Stream(_weights(1).items())
    load_in_flight(engine, stream, 1, InflightUpdateMode.in_place, BOUND_S)
    assert engine.weight_version == 1 and set(stream.threads) == {threading.get_ident()}
    assert torch.equal(engine.model.state_dict()["lm_head.weight"], _weights(1)["lm_head.weight"])


def test_an_update_the_generating_thread_refuses_fails_the_sync_and_the_round():
    engine = EmbeddedEngine(_hf_config(), EmbeddedConfig())
    engine.update_weights(_weights(0).items(), 0)
    pause = _PauseInForward(engine.model.lm_head, 1)
    failures = []

    def generate():
        try:
            engine.generate([[1, 2, 3]], PARAMS)
        except Exception as error:  # noqa: BLE001 - the round's failure, asserted below
            failures.append(error)

    round_thread = threading.Thread(target=generate)
    round_thread.start()
    assert pause.reached.wait(BOUND_S)
    stream = _Stream([("model.no_such_weight", torch.zeros(1)), *_weights(1).items()])
    releaser = threading.Thread(target=lambda: stream.first_read.wait(BOUND_S) and pause.release.set())
    releaser.start()
    with pytest.raises(RuntimeError, match="failed in the generating thread"):
        load_in_flight(engine, stream, 1, InflightUpdateMode.in_place, BOUND_S)
    round_thread.join(BOUND_S)
    releaser.join(BOUND_S)
    pause.handle.remove()
    assert len(failures) == 1 and engine.weight_version == 0
    assert len(stream.threads) < len(stream.named_tensors)  # the feed stopped once the engine took no more
