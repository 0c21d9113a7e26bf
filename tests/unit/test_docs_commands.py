"""Every command the README and docs/ show in a ```bash block is checked against the code it names.

- ``python3 -m gspo_megatron.train OVERRIDES`` (and the launch scripts that pass overrides on): the
  overrides compose into a valid config, as ``train.py`` composes them (keys, types, closed choices).
- scripts (``bash launch/X.sh``, ``sbatch launch/train.slurm``, ``bash tools/X.sh``): the file exists
  and ``bash -n`` parses it; a study script's experiment exists.
- ``python3 tools/X.py``: the tool exists; its arguments parse (``--help`` exits 0); a planner
  command that needs no ranking runs as written and prints its verdict.
- the launcher with ``--script``: the script exists and its arguments parse.
- another ``python3 -m gspo_megatron.X`` (the routing report): the module exists and ``--help`` exits 0.
- ``torchrun ... -m gspo_megatron.train OVERRIDES``: torchrun's own parser takes its options and the
  overrides compose.
- every launch that says how many ranks it starts (torchrun's ``--nnodes`` x ``--nproc-per-node``,
  ``NPROC=`` for ``launch/train_local.sh``, ``NNODES=`` x 8 GPUs for ``launch/train_multinode.sh``,
  ``sbatch --nodes`` x 8 for ``launch/train.slurm``) is planned on H100s at that world size by the
  planner's own API (``tools/planning/job.py``, as ``tools/plan.py`` plans it) and must fit: a command a
  user copies onto a cluster runs there.
Placeholders a reader fills in (``...``, ``<date>``, ``CKPT``) are dropped or taken as they are.
The set-up and test commands themselves are what CI runs, so they are only parsed here.
"""

from __future__ import annotations

import functools
import importlib.util
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from gspo_megatron.config.compose import compose
from gspo_megatron.config.schema import to_train_config

ROOT = Path(__file__).resolve().parents[2]
DOCUMENTS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
ENV_PREFIX = re.compile(r"^(?:[A-Z_][A-Z0-9_]*=\S+\s+)+")
GPUS_PER_NODE = 8  # launch/train.slurm's default (SLURM_GPUS_ON_NODE) and the docs' H100 nodes
PROMPT_TOKENS = 1024  # tools/plan.py's default --prompt-tokens


def _commands() -> list[tuple[str, str]]:
    """(document:line, command) for every command line of every ```bash block, continuations joined."""
    found = []
    for document in DOCUMENTS:
        lines = document.read_text().splitlines()
        inside, pending, start = False, "", 0
        for number, line in enumerate(lines, start=1):
            if line.lstrip().startswith("```"):  # a block inside a list item is indented
                inside = line.strip() == "```bash"
                continue
            if not inside:
                continue
            text = line.split(" #")[0].rstrip() if not line.lstrip().startswith("#") else ""
            if not pending:
                start = number
            if text.endswith("\\"):
                pending += text[:-1] + " "
                continue
            command = (pending + text).strip()
            pending = ""
            if command:
                found.append((f"{document.relative_to(ROOT)}:{start}", command))
    return found


COMMANDS = _commands()


def _words(command: str) -> list[str]:
    return [w for w in shlex.split(ENV_PREFIX.sub("", command)) if w != "..."]


def _overrides(words: list[str]) -> list[str]:
    return [w for w in words if "=" in w and not w.startswith("-")]


def _compose_ok(overrides: list[str]) -> None:
    sweeps = [o.split(",")[0] if "," in o and "[" not in o else o for o in overrides]  # --multirun a=x,y: x
    to_train_config(compose(sweeps))


def _kind(command: str) -> str:
    words = _words(command)
    if " && " in command:
        return "setup"
    if words[:3] == ["python3", "-m", "gspo_megatron.train"]:
        return "train"
    if words[:3] == ["python3", "-m", "gspo_megatron.launcher"]:
        return "launcher"
    if words[:2] == ["python3", "-m"] and words[2].startswith("gspo_megatron."):
        return "module"
    if words[0] == "torchrun" and "gspo_megatron.train" in words:
        return "torchrun"
    if words[0] in ("bash", "sbatch"):
        return "script"
    if words[0] == "python3" and words[1].startswith("tools/"):
        return "tool"
    return "other"


def test_the_documents_show_commands_and_each_is_of_a_known_kind():
    assert len(COMMANDS) > 20
    unknown = [(where, c) for where, c in COMMANDS if _kind(c) == "other"]
    assert not unknown, f"commands this test does not know how to check: {unknown}"


@pytest.mark.parametrize("where, command", [c for c in COMMANDS if _kind(c[1]) == "train"], ids=lambda v: v)
def test_training_commands_compose(where, command):
    _compose_ok(_overrides(_words(command)))


@pytest.mark.parametrize("where, command", [c for c in COMMANDS if _kind(c[1]) == "script"], ids=lambda v: v)
def test_scripts_exist_parse_and_their_overrides_compose(where, command):
    words = _words(command)
    script = next(ROOT / w for w in words if w.endswith((".sh", ".slurm")))
    assert script.is_file(), f"{where}: {script} does not exist"
    assert subprocess.run(["bash", "-n", str(script)], capture_output=True).returncode == 0
    if script.name == "routing_study.sh":
        experiment = words[words.index(str(script.relative_to(ROOT))) + 1]
        assert (ROOT / "gspo_megatron" / "conf" / "experiment" / f"{experiment}.yaml").is_file(), where
    else:
        _compose_ok(_overrides(words))


@pytest.mark.parametrize("where, command", [c for c in COMMANDS if _kind(c[1]) == "setup"], ids=lambda v: v)
def test_setup_commands_name_scripts_that_parse(where, command):
    for part in command.split(" && "):
        words = _words(part)
        if words[0] == "bash":
            assert subprocess.run(["bash", "-n", str(ROOT / words[1])], capture_output=True).returncode == 0, where


def _distinct(kind: str) -> list[tuple[str, str]]:
    """The commands of one kind, each once (a command shown in several places runs once; ``where``
    names every place)."""
    places: dict[str, list[str]] = {}
    for where, command in COMMANDS:
        if _kind(command) == kind:
            places.setdefault(" ".join(command.split()), []).append(where)
    return [(", ".join(wheres), command) for command, wheres in places.items()]


@functools.cache  # one --help per tool, however many commands name it
def _help_exits_zero(script: Path) -> bool:
    done = subprocess.run([sys.executable, str(script), "--help"], cwd=ROOT, capture_output=True, timeout=300)
    return done.returncode == 0


@pytest.mark.slow
@pytest.mark.parametrize("where, command", _distinct("tool"), ids=lambda v: v)
def test_tools_exist_and_parse_their_arguments(where, command):
    words = _words(command)
    tool = ROOT / words[1]
    assert tool.is_file(), f"{where}: {tool} does not exist"
    assert _help_exits_zero(tool), f"{where}: {tool} --help failed"
    if tool.name == "plan.py" and "--rank" not in words and "--calibrate" not in words:
        done = subprocess.run([sys.executable, *words[1:]], cwd=ROOT, capture_output=True, text=True, timeout=300)
        assert done.returncode in (0, 1) and "fits" in done.stdout, f"{where}: {done.stderr[-2000:]}"  # 1: no fit
    elif tool.name == "plan.py":
        _compose_ok([w for w in _overrides(words) if not w.startswith("--")])


@pytest.mark.parametrize("where, command", _distinct("module"), ids=lambda v: v)
def test_package_modules_exist_and_parse_their_arguments(where, command):
    module = _words(command)[2]
    assert importlib.util.find_spec(module) is not None, f"{where}: no module {module}"
    done = subprocess.run([sys.executable, "-m", module, "--help"], cwd=ROOT, capture_output=True, timeout=300)
    assert done.returncode == 0, f"{where}: {module} --help failed: {done.stderr[-2000:]!r}"


@pytest.mark.parametrize("where, command", [c for c in COMMANDS if _kind(c[1]) == "launcher"], ids=lambda v: v)
def test_launcher_scripts_exist_and_parse_their_arguments(where, command):
    words = _words(command)
    at = words.index("--script") + 1
    script = ROOT / words[at]
    assert script.is_file(), f"{where}: {script} does not exist"
    spec = importlib.util.spec_from_file_location(script.stem, script)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    module.parse_args(words[at + 1 :])  # argparse exits (a SystemExit failure) on arguments it does not take


@pytest.mark.parametrize("where, command", [c for c in COMMANDS if _kind(c[1]) == "torchrun"], ids=lambda v: v)
def test_torchrun_commands_parse_and_their_overrides_compose(where, command):
    from torch.distributed.run import get_args_parser

    words = _words(command)
    arguments = get_args_parser().parse_args(words[1:])  # argparse exits (a failure) on what it does not take
    assert arguments.module and arguments.training_script == "gspo_megatron.train", where
    _compose_ok(_overrides(arguments.training_script_args))


def _environment(command: str) -> dict[str, str]:
    """The ``KEY=value`` words before the command (``NPROC=2 bash ...``)."""
    prefix = ENV_PREFIX.match(command)
    return dict(word.split("=", 1) for word in prefix.group(0).split()) if prefix else {}


def _world_size(command: str) -> int | None:
    """How many ranks a launch command starts, where it says so; None for a command that does not launch."""
    words, env = _words(command), _environment(command)
    if words[0] == "torchrun":
        from torch.distributed.run import get_args_parser

        arguments = get_args_parser().parse_args(words[1:])
        return int(arguments.nnodes) * int(arguments.nproc_per_node)
    if "launch/train_local.sh" in words:
        return int(env.get("NPROC", "1"))
    if "launch/train_multinode.sh" in words:
        return int(env["NNODES"]) * int(env.get("NPROC_PER_NODE", GPUS_PER_NODE))
    if words[0] == "sbatch" and "launch/train.slurm" in words:
        return int(words[words.index("--nodes") + 1]) * GPUS_PER_NODE
    return None


LAUNCHES = [(where, c, _world_size(c)) for where, c in _distinct("torchrun") + _distinct("script") if _world_size(c)]


def test_the_documents_show_cluster_launches_to_plan():
    assert any(world >= 16 for _, _, world in LAUNCHES), "no multi-node launch found in README.md and docs/"


@pytest.mark.parametrize("where, command, world", LAUNCHES, ids=lambda v: str(v))
def test_launch_commands_plan_as_fitting_their_gpus(where, command, world):
    """The issue 64 commands: README's two-node torchrun line (``parallel=tp4_ep8`` on the default model, refused
    by the layout check) and docs/training.md's 30B line (the toy job's 128-row micro-batches: 122.5 GiB)."""
    from planning.hardware import gpu_spec
    from planning.job import compose_job, plan_job

    words = _words(command)
    args = get_torchrun_script_args(words) if words[0] == "torchrun" else words
    plan = plan_job(compose_job(_overrides(args), world, PROMPT_TOKENS), gpu_spec("h100"))
    assert plan.fits, f"{where}: {command}\n does not fit {world} H100s: {plan.problems}"


def get_torchrun_script_args(words: list[str]) -> list[str]:
    from torch.distributed.run import get_args_parser

    return get_args_parser().parse_args(words[1:]).training_script_args


SIZE_NOTE = re.compile(r"\((?:[^()]*?\s)?(?P<total>[\d.]+)B(?: here)?, (?P<active>[\d.]+)B active")


def _planned_sizes() -> list[tuple[str, str, str, str]]:
    """(where, model, total, active) for each ``tools/plan.py MODEL ...`` line whose comment states the sizes."""
    found = []
    for document in DOCUMENTS:
        for number, line in enumerate(document.read_text().splitlines(), start=1):
            note = SIZE_NOTE.search(line.partition(" #")[2])
            if line.startswith("python3 tools/plan.py ") and note:
                found.append(
                    (f"{document.relative_to(ROOT)}:{number}", line.split()[2], *note.group("total", "active"))
                )
    return found


@pytest.mark.parametrize("where, model, total, active", _planned_sizes(), ids=lambda v: str(v))
def test_the_sizes_a_plan_comment_states_are_the_planners(where, model, total, active):
    """Issue 64: docs/training.md said GLM-4.5-Air has 12B active parameters where the planner counts 13.42B
    (the figure a model card gives may leave out the embeddings; the comment says the planner's)."""
    sys.path.insert(0, str(ROOT / "tools"))
    from plan import load_model

    counts = load_model(model).parameter_count()
    for written, counted in ((total, counts["total"]), (active, counts["active"])):
        decimals = len(written.partition(".")[2])
        assert float(written) == round(counted / 1e9, decimals), (
            f"{where}: {model} {written}B, planner {counted / 1e9:.2f}B"
        )
