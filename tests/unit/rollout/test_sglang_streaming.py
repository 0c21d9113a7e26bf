"""The streaming mode and in-flight updates over SGLang, against the SGLang test double (real HTTP, SGLang
0.5.23's protocol; ``testing/sglang_double.py``).

- Streaming (``rollout/streaming.py``) with the SGLang engine over two servers: the producer thread's rounds
  spread over both, a weight sync takes its turn between rounds, so every sample is one version's (no spans) and
  under ``wait`` the ages climb to k and stay there, as with the embedded engine.
- An in-flight update (``SGLangEngine.update_weights_in_flight`` through ``load_in_flight``) lands in requests
  held running at the servers: each pauses in the update's mode, the tokens after the update carry the new
  version (``Sample.extra["token_versions"]``, from SGLang's ``meta_info.weight_versions`` spans), the sample's
  version is its oldest token's; ``in_place`` keeps the rows of the positions computed before the update,
  ``retract`` computes them again under the new version.
"""

from __future__ import annotations

import json
import threading

import pytest
import torch

from gspo_megatron.contracts.samples import TOKEN_VERSIONS, SamplingParams
from gspo_megatron.rollout.config import InflightUpdateMode, StalenessMode
from gspo_megatron.rollout.inflight_sync import load_in_flight
from gspo_megatron.rollout.sglang import SGLangConfig, SGLangEngine
from gspo_megatron.rollout.streaming import StreamingScheduler
from gspo_megatron.testing.sglang_double_faults import DoubleFaults

BOUND_S = 60.0  # each wait's bound; no test races it
WEIGHTS = [("w", torch.ones(2))]
PROMPTS = [[5, 6, 7], [8, 9]]


def _engine(tmp_path, doubles) -> SGLangEngine:
    model = tmp_path / "model"
    model.mkdir(exist_ok=True)
    (model / "config.json").write_text(json.dumps({"num_hidden_layers": 2, "num_experts_per_tok": 2}))
    return SGLangEngine(
        SGLangConfig(
            mode="attach",
            urls=[double.url for double in doubles],
            weight_sync="disk",
            model_path=str(model),
            disk_sync_dir=str(tmp_path / "sync"),
            health_poll_interval_s=0.01,
            enable_return_routed_experts=True,
        )
    )


def _token_versions(sample) -> list[int]:
    return sample.extra.get(TOKEN_VERSIONS, [sample.weight_version] * len(sample.output_ids))


def test_streaming_over_two_sglang_servers_syncs_between_rounds_and_trains_within_k(tmp_path, doubles):
    servers = [doubles(enable_return_routed_experts=True), doubles(enable_return_routed_experts=True)]
    params = SamplingParams(max_new_tokens=6, n=2, return_routed_experts=True)
    with _engine(tmp_path, servers) as engine:
        engine.update_weights(iter(WEIGHTS), version=0)
        scheduler = StreamingScheduler(
            lambda round_index: engine.generate(PROMPTS, params),  # G = 2 groups a round
            lambda step, groups: (groups, {}),
            lambda group: [v for sample in group for v in _token_versions(sample)],
            lambda groups: [sample.weight_version for group in groups for sample in group],
            max_staleness=2,
            mode=StalenessMode.wait,
            groups_per_step=2,
            last_step=6,
            wait_bound_s=BOUND_S,
        )
        scheduler.start(0)
        metrics, samples = [], []
        try:
            blocks = scheduler.wait_until_blocked(0, BOUND_S)  # the producer ran to the bound
            for step in range(6):
                groups, step_metrics = scheduler.take(step)
                metrics.append(step_metrics)
                samples += [sample for group in groups for sample in group]
                scheduler.before_weight_sync()  # the trainer's turn: after the round in flight
                engine.update_weights(iter(WEIGHTS), version=step + 1)
                scheduler.after_weight_sync(step + 1)
                blocks = scheduler.wait_until_blocked(blocks, BOUND_S)  # the next round drawn (or none left)
        finally:
            scheduler.close()
    # k = 2, G = 2: rounds 0..2 start on version 0, then one round per sync; step s trains round s
    assert [m["async/staleness_max"] for m in metrics] == [0.0, 1.0, 2.0, 2.0, 2.0, 2.0]
    assert all(m["async/groups_dropped"] == 0.0 for m in metrics)
    # each sample is one version's: no update landed inside a round
    assert all(TOKEN_VERSIONS not in s.extra and "weight_versions" not in s.extra for s in samples)
    assert {s.extra["server"] for s in samples} == {server.url for server in servers}  # both served rounds
    assert [p for p in servers[0].paths() if "pause" in p or "continue" in p] == [
        "/pause_generation",
        "/continue_generation",
    ] * 7


@pytest.mark.parametrize("mode", [InflightUpdateMode.in_place, InflightUpdateMode.retract])
def test_an_in_flight_update_lands_in_running_requests_and_splits_their_tokens_by_version(tmp_path, doubles, mode):
    # the double holds each request until a pause, then until the generation continues: the update certainly
    # lands while they run
    held = doubles(enable_return_routed_experts=True, radix_cache=False, faults=DoubleFaults())
    params = SamplingParams(max_new_tokens=16, n=2, return_routed_experts=True, temperature=1.0)
    with _engine(tmp_path, [held]) as engine:
        engine.update_weights(iter(WEIGHTS), version=3)
        before = engine.generate([PROMPTS[0]], params)[0]  # the prompt's rows under version 3
        held.faults.hold_until_paused = True
        out: list = []
        producer = threading.Thread(target=lambda: out.append(engine.generate([PROMPTS[0]], params)))
        producer.start()
        assert held.wait_in_flight(2, BOUND_S)
        load_in_flight(engine, iter(WEIGHTS), 4, mode, BOUND_S)
        producer.join(BOUND_S)
        assert not producer.is_alive()
        held.faults.hold_until_paused = False
        after = engine.generate([PROMPTS[0]], params)[0]  # the prompt's rows under version 4
    pauses = [body for path, body in held.calls if path == "/pause_generation"]
    assert pauses[-1] == {"mode": str(mode)}
    prompt_rows = len(PROMPTS[0]) - 1  # the prompt's positions but the last feed the first token
    for sample in out[0][0]:
        versions = sample.extra[TOKEN_VERSIONS]
        split = len(sample.output_ids) // 2  # the double's: half the tokens out before the update
        assert split >= 1 and versions == [3] * split + [4] * (len(versions) - split)
        assert sample.weight_version == 3  # the oldest token's: staleness is never under-counted
        kept = sample.routed_experts[:prompt_rows]
        expected = before if mode is InflightUpdateMode.in_place else after
        assert torch.equal(kept, expected[0].routed_experts[:prompt_rows])
        other = after if mode is InflightUpdateMode.in_place else before
        assert not torch.equal(kept, other[0].routed_experts[:prompt_rows])
