"""The whole RL step's per-rank memory (``tools/planning/rl_step_memory.py``) by hand on a tiny shape.

Checked against the real trainer on gloo ranks in tests/distributed/test_planner_rl_step_memory.py.
"""

from __future__ import annotations

from gspo_megatron.policy.parallel.layout import ParallelLayout
from gspo_megatron.testing.model_fixtures import tiny_test_config
from planning.parameters import StateBytes
from planning.planner import MemoryRow, PlanOptions
from planning.rl_step_memory import (
    EmbeddedEngineShape,
    batch_bytes_per_row,
    engine_weight_bytes,
    generation_bytes,
    pipeline_output_bytes,
    rl_step_memory,
    sequence_parallel_buffer_bytes,
    sync_sender_bytes,
)
from planning.step_time import RolloutShape

# tiny_test_config: V 32, h 32, 2 MoE layers, 4 heads / 2 kv heads of d 8, 4 experts of F 16, top-2
# HF tensors: embedding and head 32*32 each, final norm 32; a layer: two norms 32 + 32, q and o
# projections 32*32 each, k and v 16*32 each, q/k norms 8 + 8, router 4*32, experts 4 * 3 * 16*32
LAYER = 32 + 32 + 2 * 1024 + 2 * 512 + 8 + 8 + 128 + 4 * 3 * 512
ENGINE = EmbeddedEngineShape(dtype="float32", max_batch_size=4)


def test_engine_weights_and_sync_sender_by_hand():
    model = tiny_test_config()
    assert engine_weight_bytes(model, ENGINE) == (2 * 1024 + 32 + 2 * LAYER) * 4 == 83712
    assert engine_weight_bytes(model, EmbeddedEngineShape("bfloat16")) == 83712 // 2
    assert sync_sender_bytes(model, "float32") == 2 * 1024 * 4  # the largest HF tensor, gathered + converted


def test_generation_by_hand():
    model = tiny_test_config()
    # 6 rows in chunks of 4: the prefill of 4 rows x 5 prompt tokens, T = 20, fp32 (w = 4)
    t, w = 20, 4
    held = t * 32 * w + 2 * t * 8 * w + 2 * 2 * t * 16 * w + t * 32 * w  # embeddings, cos/sin, KV, layer input
    assert held == 2560 + 1280 + 5120 + 2560
    routing = t * 4 * (w + 4) + 2 * t * 2 * (4 + 8)  # logits + fp32 probabilities; top-k; sort
    experts = t * 2 * (32 + 2 * 16 + 16 + 16) * w  # permuted rows, fc1, SiLU, product
    prefill = held + 2 * t * 32 * w + routing + experts
    assert prefill == 33600
    # decoding: the cache of 4 rows x 8 tokens and the sampled logits (fp32 softmax and log)
    decode = 2 * 2 * 4 * 8 * 16 * w + 4 * 32 * (w + 8)
    assert decode == 9728 < prefill
    assert generation_bytes(model, ENGINE, rows=6, prompt_tokens=5, new_tokens=3) == 33600
    capture = 4 * 8 * 2 * 2 * 4  # R3: int32 [R, P + N, layers, k]
    assert generation_bytes(model, ENGINE, 6, 5, 3, routed_experts=True) == 33600 + capture
    # the prefill feeds each distinct prompt once: groups of 2, a chunk of 4 rows holds 2 prompts (T = 10, every
    # prefill term above halves); groups of 3, rows 0-3 span 2 prompts (T = 10); groups of 4 or more, one
    # prompt a chunk (T = 5), and the decode's cache of all 4 rows is the larger moment
    assert generation_bytes(model, ENGINE, 6, 5, 3, samples_per_prompt=2) == 33600 // 2
    assert generation_bytes(model, ENGINE, 6, 5, 3, samples_per_prompt=3) == 33600 // 2
    assert generation_bytes(model, ENGINE, 6, 5, 3, samples_per_prompt=6) == decode > 33600 // 4


def test_batch_row_by_hand():
    s = 4  # fed tokens
    batch_row = 8 * (s + 1) + 4 * 4 * s + 3 * 4 + 4 * 8  # tokens; 4 fp32 [s]; 3 fp32 + 4 int64 per row
    micro_row = 2 * 8 * s + 4 * 4 * s + 4 + 8  # tokens + targets; 4 fp32 [s]; advantage, row id
    assert batch_bytes_per_row(s, reference=False) == batch_row + micro_row == 288
    assert batch_bytes_per_row(s, reference=True) == 288 + 4 * s


def test_rl_step_by_phase_by_hand():
    model = tiny_test_config()
    layout = ParallelLayout(world_size=2).validate(model)  # dp 2: each rank holds 3 of the 6 rows
    options = PlanOptions(
        seq_len=4,
        micro_batch_tokens=12,
        global_batch_tokens=24,
        group_size=2,
        dtype="float32",
        rollout=RolloutShape(sequences=6, prompt_tokens=5, response_tokens=3, servers=1, engine_tp=1, colocated=True),
        embedded_engine=ENGINE,
    )
    row = MemoryRow(
        StateBytes(1000, 1000, 0, 2000), activations=50000, loss_head=3000, old_log_prob_pass=7000, routing_replay=0
    )
    driver = rl_step_memory(model, layout, options, row, driver=True)
    assert driver.resident == 4000 + 83712  # model state + the engine's weights
    assert driver.across_phases == 3 * 288
    assert driver.phases == {
        "rollout": 33600 // 2,  # generation (groups of 2: test_generation_by_hand) > the whole batch (6 x 288)
        "old_logp": 7000,
        "ref_logp": 0,  # no reference model
        "update": 53000,
        "weight_sync": 8192,
    }
    assert driver.phase_total("rollout") == 87712 + 33600 // 2  # the rows held across phases do not exist yet
    assert driver.peak_phase == "update" and driver.peak == 87712 + 864 + 53000
    other = rl_step_memory(model, layout, options, row, driver=False)
    assert other.resident == 4000 and other.phases["rollout"] == 864  # it receives its rows
    assert other.peak == 4000 + 864 + 53000
    sglang = PlanOptions(**{**options.__dict__, "embedded_engine": None, "sync_bucket_bytes": 5000})
    on_driver = rl_step_memory(model, layout, sglang, row, driver=True)
    assert on_driver.resident == 4000  # the engine is elsewhere
    assert on_driver.phases["rollout"] == 6 * 288 and on_driver.phases["weight_sync"] == 5000 + 4096


def test_sequence_parallel_buffer_is_resident_by_hand():
    model = tiny_test_config()
    options = PlanOptions(seq_len=4, micro_batch_tokens=12, global_batch_tokens=24, group_size=2, dtype="float32")
    tp2 = ParallelLayout(tp=2, world_size=2).validate(model)  # sequence parallelism: on with tp > 1
    assert sequence_parallel_buffer_bytes(model, tp2, options) == 12 * 32 * 4  # megatron's "mpu" [T, h]
    assert sequence_parallel_buffer_bytes(model, ParallelLayout(world_size=2).validate(model), options) == 0
    row = MemoryRow(StateBytes(1000, 1000, 0, 2000), activations=0, loss_head=0, old_log_prob_pass=0, routing_replay=0)
    assert rl_step_memory(model, tp2, options, row, driver=False).resident == 4000 + 1536


def test_pipeline_outputs_held_for_the_backward_by_hand():
    model = tiny_test_config()
    options = PlanOptions(seq_len=4, micro_batch_tokens=12, global_batch_tokens=24, group_size=2, dtype="float32")
    pp2 = ParallelLayout(pp=2, world_size=2).validate(model)
    # stage 0, 3 micro-batches: min(pp - 0, 3) = 2 in flight, each output [12, 32] fp32, + the received gradient
    assert pipeline_output_bytes(model, pp2, options, pp_rank=0, micro_batches=3) == (2 + 1) * 12 * 32 * 4
    assert pipeline_output_bytes(model, pp2, options, pp_rank=1, micro_batches=3) == 0  # the last stage


def test_generation_with_a_dense_last_layer_by_hand():
    model = tiny_test_config(dense_layers=[1], dense_intermediate_size=24)
    t, w = 20, 4  # 4 rows x 5 prompt tokens, fp32
    held = 2560 + 1280 + 5120 + 2560  # as in test_generation_by_hand
    dense = 2 * t * 32 * w + 4 * t * 24 * w  # residual + normed input; gate, up, SiLU, product
    assert generation_bytes(model, ENGINE, rows=6, prompt_tokens=5, new_tokens=3) == held + dense
