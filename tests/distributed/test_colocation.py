"""Colocated placement on gloo ranks with the embedded engine: the hand-over of ``loop/colocation.py``
happens in every step, in order, and changes no number.

On CPU the devices are the host, so what is checked is the protocol and the outputs: while the engine
generates (and through the weight sync) every rank's gradient buffers hold no storage -- megatron's
``offload_grad_buffers`` frees it on CPU as on a GPU -- and they are back, zeroed, for the update; the
driver's engine is released after each generation and resumed before each weight sync (the embedded
engine's release moves nothing on a CPU device); the metrics equal the separate placement's exactly.
"""

from __future__ import annotations

import pytest

from gspo_megatron.testing.distributed import run_distributed
from gspo_megatron.testing.train_runs import TINY_JOB, without_time

pytestmark = pytest.mark.distributed

STEPS = 2


def placement_worker(ctx, placement: str, run_dir: str) -> dict:
    from pathlib import Path

    from omegaconf import OmegaConf

    from gspo_megatron.config.compose import compose
    from gspo_megatron.config.schema import to_train_config
    from gspo_megatron.loop.build import build_trainer
    from gspo_megatron.loop.distribute import DriverFeed

    composed = compose([*TINY_JOB, "trainer.eval_every=0", f"rollout.placement={placement}"])
    config = to_train_config(composed)
    trainer = build_trainer(config, Path(run_dir), OmegaConf.to_yaml(composed), world_size=ctx.world_size)
    model = trainer.policy.model

    def grad_bytes() -> int:
        return sum(grad.untyped_storage().nbytes() for grad in model.grad_buffers())

    events: list[tuple[str, int]] = [("built", grad_bytes())]  # the engine was launched after this
    try:
        if isinstance(trainer.feed, DriverFeed):  # the driver: what the engine sees of the trainer's gradients
            engine = trainer.feed.rollout.engine
            generate, release, resume = engine.generate, engine.release_memory, engine.resume_memory

            def generating(*args, **kwargs):
                events.append(("generate", grad_bytes()))
                return generate(*args, **kwargs)

            def releasing():
                events.append(("release", grad_bytes()))
                release()

            def resuming():
                events.append(("resume", grad_bytes()))
                resume()

            engine.generate, engine.release_memory, engine.resume_memory = generating, releasing, resuming
        update = trainer.policy.update

        def updating(*args, **kwargs):
            events.append(("update", grad_bytes()))
            return update(*args, **kwargs)

        trainer.policy.update = updating
        trainer.sync_weights(version=0)
        metrics = []
        for _ in range(STEPS):
            metrics.append(trainer.train_step().metrics)
            trainer.step += 1
        return {"metrics": without_time(metrics), "events": events, "allocated": grad_bytes()}
    finally:
        trainer.close()


def test_colocated_steps_hand_over_in_order_and_equal_the_separate_placement(tmp_path):
    separate = run_distributed(placement_worker, 2, "separate", str(tmp_path / "separate"), timeout=600)
    colocated = run_distributed(placement_worker, 2, "colocated", str(tmp_path / "colocated"), timeout=600)
    counts = ("colocation/engine_releases", "colocation/engine_resumes")
    hand_overs = [{key: m.pop(key) for key in counts} for m in colocated[0]["metrics"]]
    assert hand_overs == [dict.fromkeys(counts, float(step)) for step in range(1, STEPS + 1)]
    assert colocated[0]["metrics"] == separate[0]["metrics"]
    driver = colocated[0]["events"]
    kinds = [kind for kind, _ in driver]
    # freed before the engine was launched; per step: generate and release (grads freed), update (grads
    # back), resume (grads freed again first)
    assert kinds == ["built"] + ["generate", "release", "update", "resume"] * STEPS, kinds
    for kind, nbytes in driver:
        assert (nbytes > 0) == (kind == "update"), (kind, nbytes)
    other = colocated[1]["events"]
    assert other == [("built", 0)] + [("update", n) for _, n in other[1:]] and all(n > 0 for _, n in other[1:])
    assert all(result["allocated"] == 0 for result in colocated)  # freed since the last weight sync
    # separate placement: nothing moves
    assert all(n > 0 for result in separate for _, n in result["events"])
    assert [kind for kind, _ in separate[0]["events"]] == ["built"] + ["generate", "update"] * STEPS
