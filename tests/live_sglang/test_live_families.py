"""A family other than Qwen3-MoE served by the real SGLang server on CPU: GLM-4.5 (tiny) -- sigmoid router with
an expert bias, group-limited top-k and routed scaling, an un-gated shared expert, a dense first layer, partial
RoPE, q/k/v biases -- trained for a few steps, its weights synced from the trainer by tensor handles at every
step. Without routing replay, the server's routed experts (dense layer left out by index) and its log-probs
must be the trainer's up to kernel rounding: with weights not synced, or a router computed otherwise, they would
differ at most tokens (the trainer's initial weights are not the checkpoint's).

DeepSeek-V3 (multi-latent attention) is not served on this CPU server: SGLang's CPU MLA path is its
``intel_amx`` attention backend, and with ``torch_native`` the absorbed-MLA shapes fail in
``torch_native_backend.py`` (docs/sglang.md); the GPU tier serves it (``tests/gpu/test_sglang_gpu.py``).
"""

from __future__ import annotations

from support.live_server import LIVE_KEY_ENV, launch_live_server
from support.tiny_checkpoint import write_tiny_checkpoint

from gspo_megatron.testing.distributed import run_distributed
from gspo_megatron.testing.train_runs import train_worker

STEPS = 3
MISMATCH = "mismatch/abs_log_prob_diff_mean"
ROUTING_CHANGED = "routing/rollout_vs_train_changed_frac"


def test_glm4_moe_is_served_with_the_trainers_weights_and_routes(tmp_path):
    checkpoint = write_tiny_checkpoint(tmp_path / "glm4_moe_tiny_hf", model="glm4_moe_tiny")
    server = launch_live_server(checkpoint, tmp_path / "server", "live_glm")
    try:
        overrides = [
            "model=glm4_moe_tiny",
            "task=max_digit",
            "rollout.max_new_tokens=4",
            # 16 samples a step (the task's default is 256): what is checked is a per-token mean over
            # every fed token and MoE layer, and one near-tie flip among them stays far below the bound
            "trainer.prompts_per_step=4",
            "rollout.group_size=4",
            "trainer.micro_batch_size=16",
            "rollout=sglang",
            "algorithm=grpo",
            "routing.kinds=[rollout_vs_train]",
            f"trainer.steps={STEPS}",
            "trainer.eval_every=0",
            "logging.progress=false",
            "logging.tensorboard=false",
            "logging.charts=false",
            "rollout.sglang.mode=attach",
            f"rollout.sglang.api_key_env={LIVE_KEY_ENV}",
            f"rollout.sglang.urls=[{','.join(server.server_urls)}]",
            f"rollout.sglang.model_path={checkpoint}",
            f"rollout.sglang.disk_sync_dir={tmp_path / 'disk_sync'}",
            "rollout.sglang.weight_sync=tensor",
            "rollout.sglang.fallback_to_disk=false",
            "rollout.sglang.request_timeout_s=600",
        ]
        (metrics,) = run_distributed(train_worker, 1, overrides, str(tmp_path / "run"), timeout=840)
    finally:
        server.shutdown()
    print(
        f"live GLM-4.5: mismatch {[round(m[MISMATCH], 4) for m in metrics]}; routing changed "
        f"{[round(m[ROUTING_CHANGED], 4) for m in metrics]}"
    )
    assert [m["step"] for m in metrics] == list(range(1, STEPS + 1))
    assert all(0 < m[MISMATCH] < 0.05 for m in metrics)  # half-precision kernels vs fp32, same weights
    assert all(m[ROUTING_CHANGED] < 0.05 for m in metrics)  # near-ties may flip, nothing more
