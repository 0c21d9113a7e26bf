"""Supervised warm start: teach a model preset a *verbose* reasoning format, export it as an HF checkpoint.

    python tools/sft_warmstart.py --out checkpoints/tiny_verbose_reasoner
    python -m gspo_megatron.train --multirun +experiment=shaping_from_sft \
        model.hf_checkpoint=checkpoints/tiny_verbose_reasoner
    python tools/sft_warmstart.py --model small_moe --out checkpoints/small_moe_reasoner   # any preset
    python -m gspo_megatron.train +experiment=multi_token_demo model.hf_checkpoint=checkpoints/small_moe_reasoner
    python tools/sft_warmstart.py --demos lookup --model fine_moe --steps 1500 --out checkpoints/lookup   # a tool

Why: the efficiency shapers (Step-GRPO, GRSP) act on a policy that *already reasons verbosely* --
the papers start from reasoning models that hesitate ("Wait ...") more than they need to. A tiny
model trained from scratch never produces that structure, so there is nothing to shorten. This tool
fits the tiny model, with megatron's own schedule and optimizer, to responses of the
``reasoning_max_digit`` task that re-check their answer a random number of times:

    "<think> step 3 step 8 step 8 Wait 8 Wait 8 </think> answer 8"   (0..--max-waits re-checks)

Every re-check is correct but useless, so a shaper that counts steps or short segments can shorten
the responses without losing accuracy, while plain GSPO has no reason to. The loss is the mean
negative log-likelihood of the response tokens (the prompt is context only).

Beside the weights it writes ``warm_start.json`` (``gspo_megatron.core.provenance``: commit, command, thread
count, weights' sha256); every run started from the checkpoint records it. The same command at the
same commit and thread count writes the same weights. ``--keep-if-current`` keeps an existing
checkpoint only when its record says exactly that (same command, same clean commit, same threads),
and rebuilds it otherwise -- what the study scripts use instead of "reuse whatever is there".
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout's package, whatever is installed

KEEP_FLAG = "--keep-if-current"


def record_command(argv: list[str]) -> str:
    """The command a warm start records (without ``--keep-if-current``, which changes no weight)."""
    from gspo_megatron.core.provenance import command_line

    return command_line([a for a in argv if a != KEEP_FLAG])


def is_current(record: dict | None, command: str, threads: int, version: dict | None = None) -> bool:
    """Whether an existing warm start is what this command would write now."""
    from gspo_megatron.core.provenance import same_clean_code

    return (
        record is not None
        and record.get("command") == command
        and record.get("cpu_threads") == threads
        and same_clean_code(record, version)
    )


def verbose_response(record, rng: random.Random, max_waits: int, long_tail: tuple[float, int] = (0.0, 0)) -> str:
    """The task's reference reasoning with 0..max_waits extra re-checks of the answer; with ``long_tail``
    = (fraction, waits), that fraction of the responses re-checks ``waits`` times instead (a long-tailed
    length distribution: ``--long-tail``)."""
    thinking = record.metadata["reference_response"].split(" </think>")[0]
    head = thinking.rsplit(" Wait ", 1)[0]  # the steps, without the reference's single re-check
    fraction, long_waits = long_tail
    count = long_waits if fraction and rng.random() < fraction else rng.randint(0, max_waits)
    waits = "".join(f" Wait {record.answer}" for _ in range(count))
    return f"{head}{waits} </think> answer {record.answer}"


def calculator_demo(record, rng: random.Random, tool_fraction: float) -> list[tuple[str, bool]]:
    """A ``calculator_add`` demonstration as (text, trained) segments: with probability ``tool_fraction`` the
    tool-using trajectory -- the call, the calculator's answer (inserted: not trained), the answer copied --
    else a direct answer the model cannot check, with its last two digits guessed (usually wrong), so RL
    has something to learn: that the calling trajectories are the ones that are right."""
    if rng.random() < tool_fraction:
        call, rest = record.metadata["reference_response"].split("> ", 1)
        answer, final = rest.split("\n", 1)
        return [(call + ">", True), (" " + answer + "\n", False), (final, True)]
    guess = record.answer[:-2] + "".join(str(rng.randrange(10)) for _ in record.answer[-2:])
    return [(guess, True)]


def lookup_demo(record, rng: random.Random, tool_fraction: float) -> list[tuple[str, bool]]:
    """A ``fact_lookup`` demonstration, as ``calculator_demo``'s: with probability ``tool_fraction`` the call,
    the document (inserted: not trained) and the code copied from it; else a guessed code (almost always wrong:
    the facts are in the corpus alone). The records come from another world than the run's (``--demos lookup``
    asks about ``fact_lookup.WARM_START_WORLD``), so the warm start has seen none of the run's facts."""
    if rng.random() < tool_fraction:
        call, rest = record.metadata["reference_response"].split("> ", 1)
        document, code = rest.split("\n", 1)
        return [(call + ">", True), (" " + document + "\n", False), (code, True)]
    return [(str(rng.randint(1000, 9999)), True)]


DEMOS = {"calculator": calculator_demo, "lookup": lookup_demo}


def demo_rows(records, tokenizer, rng, args) -> list[tuple[list[int], list[int], list[float]]]:
    """(prompt ids, response ids with EOS, per-response-token weight: 1 trained, 0 inserted) per record."""
    rows = []
    for record in records:
        if args.demos in DEMOS:
            segments = DEMOS[args.demos](record, rng, args.tool_fraction)
        else:
            long_tail = (args.long_tail[0], int(args.long_tail[1]))
            segments = [(verbose_response(record, rng, args.max_waits, long_tail), True)]
        ids: list[int] = []
        weights: list[float] = []
        for text, trained in segments:
            piece = tokenizer.encode(text)
            ids += piece
            weights += [1.0 if trained else 0.0] * len(piece)
        rows.append((list(record.prompt_ids), ids + [tokenizer.eos_token_id], weights + [1.0]))
    return rows


def build_batch(rows, pad_token_id: int):
    """Right-padded [b, s] inputs/targets, weighted on the trained response targets (EOS included)."""
    import torch

    from gspo_megatron.contracts.micro_batch import MicroBatch

    width = max(len(p) + len(r) for p, r, _ in rows)
    tokens = torch.full((len(rows), width), pad_token_id, dtype=torch.long)
    mask = torch.zeros(len(rows), width - 1)
    for i, (prompt, response, weights) in enumerate(rows):
        tokens[i, : len(prompt) + len(response)] = torch.tensor(prompt + response)
        mask[i, len(prompt) - 1 : len(prompt) + len(response) - 1] = torch.tensor(weights)
    return MicroBatch(tokens=tokens[:, :-1].contiguous(), targets=tokens[:, 1:].contiguous(), weights=mask)


def demo_task(args, tokenizer):
    """The task whose records the demonstrations answer (``--demos``)."""
    from gspo_megatron.rollout.data.config import TaskConfig
    from gspo_megatron.rollout.data.fact_lookup import WARM_START_WORLD, world
    from gspo_megatron.rollout.data.tasks import FactLookupTask, build_task

    if args.demos == "lookup":
        return FactLookupTask(TaskConfig(name="fact_lookup", seed=args.seed), tokenizer, facts=world(WARM_START_WORLD))
    name = "calculator_add" if args.demos == "calculator" else "reasoning_max_digit"
    digits = {"min_digits": args.min_digits or args.digits, "max_digits": args.digits}
    return build_task(TaskConfig(name=name, seed=args.seed, **digits), tokenizer)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="HF checkpoint directory to write")
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument(
        "--demos",
        choices=("verbose_reasoner", "calculator", "lookup"),
        default="verbose_reasoner",
        help="what to demonstrate: verbose reasoning (reasoning_max_digit), calculator tool use (calculator_add) "
        "or lookup tool use (fact_lookup, on the warm start's own world of facts)",
    )
    parser.add_argument("--tool-fraction", type=float, default=0.3, help="tool demos: the fraction that call the tool")
    parser.add_argument("--max-waits", type=int, default=3)
    parser.add_argument(
        "--long-tail",
        nargs=2,
        type=float,
        default=(0.0, 0),
        metavar=("FRACTION", "WAITS"),
        help="that fraction of the responses re-checks WAITS times (a long tail of lengths, for over-sampling)",
    )
    parser.add_argument("--digits", type=int, default=3, help="most digits per problem (task max_digits)")
    parser.add_argument("--min-digits", type=int, default=None, help="fewest digits (default: --digits)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--model", default="tiny", help="model preset (conf/model/<name>.yaml), e.g. small_moe")
    parser.add_argument(KEEP_FLAG, action="store_true", help="keep --out if its warm_start.json says it is current")
    parser.add_argument("overrides", nargs="*", help="Hydra overrides for the model, e.g. model.hidden_size=128")
    return parser


def main(argv=None) -> None:
    args = build_parser().parse_args(argv)
    import torch

    from gspo_megatron.core.provenance import WARM_START_FILE, provenance, warm_start_record, weights_sha256

    command = record_command(sys.argv if argv is None else ["tools/sft_warmstart.py", *argv])
    if args.keep_if_current and is_current(warm_start_record(args.out), command, torch.get_num_threads()):
        print(f"kept {args.out} (its {WARM_START_FILE} names this command, commit and thread count)")
        return
    (Path(args.out) / WARM_START_FILE).unlink(missing_ok=True)  # a stale record must not outlive a failed rebuild

    from gspo_megatron.algorithms.logprobs import vocab_parallel_log_probs
    from gspo_megatron.config.compose import compose
    from gspo_megatron.config.schema import to_train_config
    from gspo_megatron.config.store import register_configs
    from gspo_megatron.policy.build import random_hf_weights
    from gspo_megatron.policy.config import OptimizerSection
    from gspo_megatron.policy.cpu_bridges import apply_cpu_bridges
    from gspo_megatron.policy.models.builder import build_model
    from gspo_megatron.policy.models.conversion import load_hf_weights
    from gspo_megatron.policy.models.hf_checkpoint import save_hf_checkpoint
    from gspo_megatron.policy.models.schedule import run_schedule, wrap_for_training
    from gspo_megatron.policy.optimizer import build_optimizer
    from gspo_megatron.policy.parallel.layout import ParallelLayout
    from gspo_megatron.policy.parallel.mesh import initialize_parallel
    from gspo_megatron.rollout.data.tokenizer import build_tokenizer

    register_configs()
    cfg = to_train_config(compose([f"model={args.model}", *args.overrides]))
    layout = ParallelLayout(world_size=1).validate(cfg.model)
    apply_cpu_bridges()
    mesh = initialize_parallel(layout, seed=args.seed)
    try:
        tokenizer = build_tokenizer("symbol", model_vocab_size=cfg.model.vocab_size)
        task = demo_task(args, tokenizer)
        model = build_model(
            cfg.model, layout, token_dispatcher=cfg.model.token_dispatcher, expert_mlp=cfg.model.expert_mlp
        )
        load_hf_weights(model, cfg.model, random_hf_weights(cfg.model), mesh)
        ddp = wrap_for_training(model, model.config)
        optimizer, scheduler = build_optimizer(
            ddp, OptimizerSection(lr=args.lr, min_lr=args.lr / 10, warmup_steps=10), args.steps
        )
        rng = random.Random(args.seed)

        def nll(logits, batch):
            logp, _ = vocab_parallel_log_probs(logits, batch.targets, tp_group=mesh.tp_group)
            loss = -(logp * batch.weights).sum() / batch.weights.sum()
            return loss, {"nll": loss.detach()}

        for step in range(1, args.steps + 1):
            batch = build_batch(demo_rows(task.next_batch(args.batch), tokenizer, rng, args), tokenizer.pad_token_id)
            ddp.zero_grad_buffer()
            optimizer.zero_grad()
            (out,) = run_schedule([ddp], [batch], nll, forward_only=False)
            optimizer.step()
            scheduler.step(increment=1)
            if step % 25 == 0 or step == 1:
                print(f"step {step:4d}  response NLL per token {float(out['nll']):.4f}", flush=True)
        save_hf_checkpoint(model, cfg.model, mesh, Path(args.out))
        record = provenance(
            command=command, cpu_threads=torch.get_num_threads(), weights_sha256=weights_sha256(args.out)
        )
        (Path(args.out) / WARM_START_FILE).write_text(json.dumps(record, indent=2) + "\n")
        print(f"wrote {args.out}")
    finally:
        mesh.destroy()


if __name__ == "__main__":
    main()
