"""tools/write_fact_corpus.py writes the fact_lookup task's corpus: the shipped world's documents, one per entity."""

from __future__ import annotations

import write_fact_corpus

from gspo_megatron.rollout.agents.tools.corpus import read_corpus
from gspo_megatron.rollout.data.fact_lookup import ENTITIES, corpus_texts, world


def test_the_tool_writes_the_worlds_corpus(tmp_path, capsys):
    write_fact_corpus.main(["--out", str(tmp_path / "corpus")])
    written = read_corpus(tmp_path / "corpus")
    assert written == corpus_texts(world()) and len(written) == ENTITIES
    assert f"wrote {ENTITIES} documents" in capsys.readouterr().out
