"""Every key a run is given is a key of the schema: anything else is refused at compose time, naming the
closest known key (torch-free).

Design decisions:
- Hydra's struct mode refuses ``trainer.stepz=3``, but its message advises ``+trainer.stepz=3``, and an
  override with ``+`` (or ``++``) is merged under ``open_dict``, past the schema; ``OmegaConf.to_object``
  then sets it as an attribute nothing reads (issue 63). So the composed tree is checked against the
  schema's keys where it is typed (``config/schema.py:to_train_config``, which every entry point and tool
  goes through), and the command line's overrides before Hydra composes (``train.py:main``,
  ``config/compose.py``), so both forms get the same message and nothing of a refused run is written.
- The schema's keys come from ``OmegaConf.structured(TrainConfig)``, the tree Hydra merges into: a section
  (a dataclass) admits only its fields; a dict-typed field (none today) admits any key below it.
- The closest key: ``difflib`` over the full dotted keys with a high cutoff (0.8: a typo, not a neighbour
  that shares the section's prefix), else the same last name in another section (``trainer.lr`` ->
  ``optimizer.lr``), else the keys of the section it was put in.
- Overrides that are not keys of the run's config pass: a config group's choice (``+experiment=...``,
  ``model=tiny``: a folder of ``conf/``), a package (``model@x=...``), Hydra's own (``hydra.*``,
  ``hydra/launcher=...``) and deletions (Hydra refuses an unknown one itself).
- A key the schema lost names what replaces it (``core/config_migrations.py:REMOVED``), not a neighbour.
"""

from __future__ import annotations

import difflib
import functools
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

from gspo_megatron.core.config_migrations import REMOVED


class UnknownConfigKeyError(ValueError):
    """A key the schema does not have; the message names the closest known key or the replacement."""


@dataclass(frozen=True)
class SchemaKeys:
    """The dotted paths of a config schema: every section and leaf, and the dict-typed fields (open)."""

    sections: frozenset[str]
    leaves: frozenset[str]
    open: frozenset[str]  # mappings: any key below them is the user's

    def knows(self, dotted: str) -> bool:
        if dotted in self.sections or dotted in self.leaves or dotted in self.open:
            return True
        return any(dotted.startswith(prefix + ".") for prefix in self.open)

    def error(self, dotted: str, source: str) -> UnknownConfigKeyError:
        parts = dotted.split(".")
        for removed in (".".join(parts[:n]) for n in range(len(parts), 0, -1)):
            if removed in REMOVED:
                return UnknownConfigKeyError(f"{source}: {removed} was removed: {REMOVED[removed]}")
        return UnknownConfigKeyError(
            f"{source}: {dotted} is not a config key ({self._hint(dotted)}); a '+' does not add settings, every "
            "key the trainer reads is in the schema (gspo_megatron/config/schema.py)"
        )

    def _hint(self, dotted: str) -> str:
        known = sorted(self.sections | self.leaves | self.open)
        candidates = [key for key in known if not dotted.startswith(key + ".")]  # not its own sections
        close = difflib.get_close_matches(dotted, candidates, n=1, cutoff=0.8)
        parent, _, name = dotted.rpartition(".")
        close = close or [key for key in known if key.rpartition(".")[2] == name][:1]
        if close:
            return f"did you mean {close[0]}?"
        scope = parent if parent in self.sections else ""
        siblings = [key.rpartition(".")[2] for key in known if key.rpartition(".")[0] == scope]
        return (
            f"the keys of {scope} are {', '.join(siblings)}"
            if scope
            else f"the top-level keys are {', '.join(siblings)}"
        )


@functools.cache
def schema_keys(schema: type) -> SchemaKeys:
    """The dotted paths of a structured config class, as Hydra merges into it."""
    from omegaconf import DictConfig, OmegaConf

    sections: set[str] = set()
    leaves: set[str] = set()
    open_: set[str] = set()

    def walk(node: DictConfig, prefix: str) -> None:
        for key in node:
            path = prefix + str(key)
            child = node._get_node(key)
            if isinstance(child, DictConfig) and OmegaConf.get_type(child) is dict:
                open_.add(path)
            elif isinstance(child, DictConfig):
                sections.add(path)
                walk(child, path + ".")
            else:
                leaves.add(path)

    walk(OmegaConf.structured(schema), "")
    return SchemaKeys(frozenset(sections), frozenset(leaves), frozenset(open_))


def config_paths(tree: Mapping[str, Any], keys: SchemaKeys, prefix: str = "") -> Iterator[str]:
    """Every dotted key of a composed config (plain nested data), not below a dict-typed field."""
    for key, value in tree.items():
        path = f"{prefix}{key}"
        yield path
        if isinstance(value, Mapping) and path in keys.sections:
            yield from config_paths(value, keys, path + ".")


def check_config_keys(tree: Mapping[str, Any], schema: type) -> None:
    """Refuse a composed config (plain data) holding a key ``schema`` does not have."""
    keys = schema_keys(schema)
    for path in config_paths(tree, keys):
        if not keys.knows(path):
            raise keys.error(path, "the composed config")


def check_override_keys(overrides: Iterable[str], schema: type, groups: Iterable[str]) -> None:
    """Refuse a command-line override that sets a key ``schema`` does not have, with or without '+'; a
    choice of one of the config ``groups`` passes. An override Hydra cannot parse is left to Hydra,
    which names it."""
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.errors import HydraException

    try:
        parsed = OverridesParser.create().parse_overrides(list(overrides))
    except HydraException:
        return
    keys = schema_keys(schema)
    for override in parsed:
        key = override.key_or_group
        if override.is_delete() or override.package is not None or "/" in key or key.split(".")[0] == "hydra":
            continue
        if key in groups or keys.knows(key):
            continue
        raise keys.error(key, f"override {override.input_line!r}")
