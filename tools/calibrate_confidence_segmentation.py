"""Calibrate GRSP's confidence segmentation against keyword segmentation on a warm-started model.

    python tools/calibrate_confidence_segmentation.py --checkpoint checkpoints/tiny_long_reasoner \
        --out reports/shaping_study/confidence_calibration.json

Samples responses from the checkpoint (the study's task, temperature 1), takes their rollout token
log-probs, and compares, for every (window, threshold) on a grid, the confidence boundaries (local
minima of the log-prob, ``shaping.segmentation.confidence_boundaries``) with the keyword boundaries
(positions of the trigger tokens of ``shaping.grsp.keywords``). A confidence boundary agrees when it
lies within ``--tolerance`` tokens of a keyword boundary; agreement is the F1 of precision (agreeing
confidence boundaries / all) and recall (matched keyword boundaries / all). The best pair is what
``GRSPConfig``'s defaults are set from; the JSON holds the whole grid, the commit and the command.
``tools/shaping_study.py`` runs this on its own warm start and stores the result beside its report.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout's package, whatever is installed


def boundary_matches(predicted: list[int], reference: list[int], tolerance: int) -> tuple[int, int]:
    """(predicted boundaries near a reference one, reference boundaries near a predicted one)."""
    agree = sum(any(abs(p - r) <= tolerance for r in reference) for p in predicted)
    matched = sum(any(abs(p - r) <= tolerance for p in predicted) for r in reference)
    return agree, matched


def f1(agree: int, predicted: int, matched: int, reference: int) -> dict[str, float]:
    precision = agree / predicted if predicted else 0.0
    recall = matched / reference if reference else 0.0
    score = 2 * precision * recall / (precision + recall) if precision + recall else 0.0
    return {"precision": precision, "recall": recall, "f1": score}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--checkpoint", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--prompts", type=int, default=32)
    parser.add_argument("--samples", type=int, default=4)
    parser.add_argument("--tolerance", type=int, default=1)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)

    import torch
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    from gspo_megatron.config.compose import compose
    from gspo_megatron.config.schema import to_train_config
    from gspo_megatron.config.store import register_configs
    from gspo_megatron.contracts.samples import SamplingParams
    from gspo_megatron.core.provenance import provenance
    from gspo_megatron.rollout.config import EmbeddedConfig
    from gspo_megatron.rollout.data.tasks import build_task
    from gspo_megatron.rollout.data.tokenizer import SymbolTokenizer
    from gspo_megatron.rollout.embedded.engine import EmbeddedEngine
    from gspo_megatron.rollout.shaping.segmentation import confidence_boundaries

    register_configs()
    cfg = to_train_config(compose(["+experiment=shaping_from_sft", "shaping=grsp"]))
    tokenizer = SymbolTokenizer(cfg.model.vocab_size)  # the keyword lookup below needs its token table
    task = build_task(cfg.task, tokenizer)
    model = Qwen3MoeForCausalLM.from_pretrained(args.checkpoint, torch_dtype=torch.float32).eval()
    hf_config = Qwen3MoeConfig.from_pretrained(args.checkpoint)
    engine = EmbeddedEngine(hf_config, EmbeddedConfig(), tokenizer.decode)
    engine.update_weights(model.state_dict().items(), version=0)
    records = task.eval_records(args.prompts)
    params = SamplingParams(
        temperature=1.0,
        max_new_tokens=cfg.rollout.max_new_tokens,
        n=args.samples,
        stop_token_ids=tuple(tokenizer.stop_token_ids),
        seed=args.seed,
    )
    samples = [s for group in engine.generate([list(r.prompt_ids or ()) for r in records], params) for s in group]
    keyword_ids = {tokenizer.token_id(k) for k in cfg.shaping.grsp.keywords if k in tokenizer.tokens}
    references = [[t for t, token in enumerate(s.output_ids) if token in keyword_ids and t > 0] for s in samples]

    grid = []
    for window in (1, 2, 3, 4, 6):
        for threshold in (-0.05, -0.1, -0.25, -0.5, -1.0, -1.5, -2.0):
            agree = predicted = matched = reference = 0
            for sample, ref in zip(samples, references, strict=True):
                found = confidence_boundaries(sample.output_log_probs, window, threshold).tolist()
                a, m = boundary_matches(found, ref, args.tolerance)
                agree, matched = agree + a, matched + m
                predicted, reference = predicted + len(found), reference + len(ref)
            grid.append(
                {
                    "window": window,
                    "threshold": threshold,
                    "confidence_boundaries": predicted,
                    "keyword_boundaries": reference,
                    **f1(agree, predicted, matched, reference),
                }
            )
    best = max(grid, key=lambda g: (g["f1"], g["precision"]))
    result = {
        **provenance(),
        "checkpoint": str(args.checkpoint),
        "responses": len(samples),
        "tolerance": args.tolerance,
        "keywords": list(cfg.shaping.grsp.keywords),
        "best": best,
        "grid": grid,
        "mean_response_tokens": sum(len(s.output_ids) for s in samples) / len(samples),
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2))
    print(json.dumps({"best": best, "responses": len(samples)}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
