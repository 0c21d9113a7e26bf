"""A real-size model composed with the toy job's settings: the start-up notice that names the recipe to use.

Design decisions:
- The toy job's settings (3 new tokens, the 65-symbol tokenizer, lr 1e-3 for a random init) live with the
  toy tasks (``conf/task/running_max.yaml`` ...), so ``model=qwen3_30b_a3b`` alone composes them: the job
  runs, trains nothing a user wants, and on GPUs its 128-row micro-batches do not fit. The trainer
  warns, not refuses: the planner and the tests compose such jobs on purpose (a model's shape and
  layout alone), and the user may mean it.
- "Real size" is the model's shape, not its name: at least ``REAL_SIZE_PARAMETERS`` parameters
  (``ModelSection.parameter_count``; the checkpoint's shape when ``model.hf_checkpoint`` is given). The
  CPU models here have under 10M; the smallest real MoE this project plans (OLMoE-1B-7B) has 6.9B.
- Each toy setting is named with the key and the value a real run uses, so the fix is in the message;
  the recipe is the cluster recipe for the model's preset where there is one (``RECIPES``), else
  ``task=jsonl_math`` (which brings a real run's lengths, lr and batches) or your own task's values.
"""

from __future__ import annotations

from gspo_megatron.config.schema import TrainConfig

REAL_SIZE_PARAMETERS = 1_000_000_000
TOY_LR = 1e-4  # above it: a random init's lr; RL from a pretrained model uses ~1e-6 (slime's and verl's recipes)
TOY_MAX_NEW_TOKENS = 64  # below it: answers of a few tokens; a pretrained model's responses need hundreds

RECIPES = {  # model.preset -> the cluster recipe that runs it (conf/experiment/, README "Several nodes")
    "qwen3_30b_a3b": "+experiment=qwen3_30b_a3b_8xh100 rollout.sglang.model_path=/ckpt",
    "qwen3_235b_a22b": "+experiment=qwen3_235b_a22b_64xh100 rollout.sglang.model_path=/ckpt",
    "qwen3_5_35b_a3b": "+experiment=qwen3_5_35b_a3b_8xh100 rollout.sglang.model_path=/ckpt",
}
GENERAL_RECIPE = "task=jsonl_math (a real run's lengths, lr and batches) or your task with the values above"


def toy_settings(cfg: TrainConfig) -> list[str]:
    """The toy job's settings in ``cfg``, each as 'key=value (why; what a real run uses)'."""
    found = []
    if cfg.tokenizer.kind == "symbol":
        found.append("tokenizer.kind=symbol (65 symbols for the synthetic tasks; tokenizer.kind=hf tokenizer.path=DIR)")
    if cfg.optimizer.lr > TOY_LR:
        found.append(f"optimizer.lr={cfg.optimizer.lr:g} (a random init's; ~1e-6 from a pretrained model)")
    if cfg.rollout.max_new_tokens < TOY_MAX_NEW_TOKENS:
        found.append(f"rollout.max_new_tokens={cfg.rollout.max_new_tokens} (toy answers; hundreds to thousands)")
    return found


def toy_settings_notice(cfg: TrainConfig) -> str | None:
    """One message when a real-size model meets the toy job's settings, naming them and the recipe; else None."""
    parameters = cfg.model.parameter_count()["total"]
    if parameters < REAL_SIZE_PARAMETERS:
        return None
    found = toy_settings(cfg)
    if not found:
        return None
    recipe = RECIPES.get(cfg.model.preset or "", GENERAL_RECIPE)
    model = cfg.model.hf_checkpoint or f"model={cfg.model.preset}"
    return (
        f"[gspo] warning: a real-size model ({model}, {parameters / 1e9:.1f}B parameters) with the toy "
        f"job's settings: {'; '.join(found)}. Use the recipe: {recipe}"
    )
