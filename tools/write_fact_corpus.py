"""Write the ``fact_lookup`` task's corpus (``gspo_megatron/rollout/data/fact_lookup.py``) into the repository.

    python3 tools/write_fact_corpus.py            # examples/fact_lookup/corpus, from the shipped world's seed

The corpus is a pure function of ``fact_lookup.WORLD_SEED`` and ``ENTITIES``; a unit test holds the shipped
files to it, so this is run only when that function changes.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # this checkout's package, whatever is installed


def main(argv: list[str] | None = None) -> None:
    from gspo_megatron.rollout.data.fact_lookup import CORPUS_DIR, world, write_corpus

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=ROOT / CORPUS_DIR)
    args = parser.parse_args(argv)
    facts = world()
    write_corpus(args.out, facts)
    print(f"wrote {len(facts)} documents to {args.out}")


if __name__ == "__main__":
    main()
