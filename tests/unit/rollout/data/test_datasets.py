import json
import os

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from gspo_megatron.rollout.data import DatasetConfig, PromptDataset, SymbolTokenizer, TaskConfig, build_task

TOK = SymbolTokenizer()


def _write_jsonl(path, rows):
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def _rows(n):
    return [{"question": f"sum {i}=", "solution": {"final": i % 10}, "level": i} for i in range(n)]


def _config(path, **overrides):
    base = dict(
        path=str(path),
        prompt_field="question",
        answer_field="solution.final",
        apply_chat_template=False,
        shuffle=False,
    )
    base.update(overrides)
    return DatasetConfig(**base)


def test_jsonl_records_fields_and_metadata(tmp_path):
    path = _write_jsonl(tmp_path / "d.jsonl", _rows(3))
    ds = PromptDataset(_config(path, metadata_fields=["level"], prompt_suffix="?"), TOK)
    assert len(ds) == 3
    first = ds.records[0]
    assert (first.prompt, first.answer) == ("sum 0=?", "0")  # numbers become text; suffix appended
    assert first.prompt_ids == tuple(TOK.encode("sum 0=?"))
    assert first.metadata["level"] == 0 and first.metadata["stop_strings"] == ["<eos>"]
    assert first.metadata["source"] == f"{path}:1"


def test_parquet_matches_jsonl(tmp_path):
    rows = _rows(4)
    jsonl = _write_jsonl(tmp_path / "d.jsonl", rows)
    parquet = tmp_path / "d.parquet"
    pq.write_table(pa.Table.from_pylist(rows), parquet)
    from_jsonl = PromptDataset(_config(jsonl), TOK).records
    from_parquet = PromptDataset(_config(parquet), TOK).records
    assert [(r.prompt, r.answer) for r in from_parquet] == [(r.prompt, r.answer) for r in from_jsonl]
    assert from_parquet[2].metadata["source"] == f"{parquet}:row 3"


def test_chat_rendering_with_system_prompt(tmp_path):
    path = _write_jsonl(tmp_path / "d.jsonl", [{"prompt": "sum 12=", "answer": "3"}])
    ds = PromptDataset(DatasetConfig(path=str(path), system_prompt="be brief", apply_chat_template=True), TOK)
    assert ds.records[0].prompt == "be brief\nsum 12="  # SymbolTokenizer joins messages line by line
    messages = [{"role": "user", "content": "sum 1="}]
    _write_jsonl(path, [{"prompt": messages, "answer": "1"}])
    with pytest.raises(ValueError, match=r"d.jsonl:1: .*apply_chat_template=true"):
        PromptDataset(DatasetConfig(path=str(path), apply_chat_template=False), TOK)


def test_missing_field_names_field_line_and_fields_present(tmp_path):
    rows = _rows(3)
    del rows[1]["solution"]
    path = _write_jsonl(tmp_path / "d.jsonl", rows)
    with pytest.raises(KeyError) as info:
        PromptDataset(_config(path), TOK)
    message = str(info.value)
    assert "d.jsonl:2" in message and "'solution.final'" in message and "['level', 'question']" in message


def test_overlong_prompts_are_dropped_and_counted(tmp_path):
    rows = [{"question": "sum 1=", "solution": {"final": 1}}, {"question": "sum 123456789=", "solution": {"final": 5}}]
    path = _write_jsonl(tmp_path / "d.jsonl", rows * 2)
    ds = PromptDataset(_config(path, max_prompt_tokens=6), TOK)  # "sum 1=" is 4 tokens, the other 12
    assert len(ds) == 2 and ds.stats.too_long == 2 and ds.stats.rows == 4
    with pytest.raises(ValueError, match="all 4 prompts are longer"):
        PromptDataset(_config(path, max_prompt_tokens=3), TOK)


def test_prompts_past_the_model_context_are_dropped_naming_the_budget(tmp_path):
    """D8: the context's prompt budget (max_position_embeddings - max_new_tokens) drops rows too, not
    only dataset.max_prompt_tokens; a task built with it keeps only prompts that fit."""
    rows = [{"question": "sum 1=", "solution": {"final": 1}}, {"question": "sum 123456789=", "solution": {"final": 5}}]
    path = _write_jsonl(tmp_path / "d.jsonl", rows * 2)
    ds = PromptDataset(_config(path, max_prompt_tokens=1024), TOK, prompt_budget=6)  # 4 and 12 tokens
    assert len(ds) == 2 and ds.stats.too_long == 2
    assert all(len(r.prompt_ids) <= 6 for r in ds.records)
    with pytest.raises(ValueError, match=r"all 4 prompts are longer than the 3 tokens the model's context leaves"):
        PromptDataset(_config(path, max_prompt_tokens=1024), TOK, prompt_budget=3)
    task_config = TaskConfig(name="jsonl", reward="exact_match", dataset=_config(path, max_prompt_tokens=1024))
    assert len(build_task(task_config, TOK, prompt_budget=6).dataset) == 2
    assert len(build_task(task_config, TOK).dataset) == 4  # no model: only dataset.max_prompt_tokens


def test_directory_and_all_bad_utf8_files_are_named_for_what_they_are(tmp_path):
    """D19: a directory is not reported as missing, a file of undecodable lines not as empty."""
    with pytest.raises(IsADirectoryError, match=r"is a directory; name the .jsonl or .parquet file"):
        PromptDataset(_config(tmp_path), TOK)
    latin1 = tmp_path / "latin1.jsonl"
    latin1.write_bytes(b'{"question": "sum \xe9="}\n{"question": "\xff"}\n')
    with pytest.raises(ValueError, match=r"all 2 non-blank lines are not valid UTF-8 .*on_bad_utf8=skip"):
        PromptDataset(_config(latin1, on_bad_utf8="skip"), TOK)


def test_fifo_and_device_are_named_for_what_they_are(tmp_path):
    """Issue 63 item 7: a FIFO or a character device is not reported as missing (nor opened: a FIFO's
    open would block this test), while a missing file still is."""
    fifo = tmp_path / "prompts.jsonl"
    os.mkfifo(fifo)
    with pytest.raises(ValueError, match=r"prompts.jsonl' is a FIFO, not a regular file; name the .jsonl"):
        PromptDataset(_config(fifo), TOK)
    with pytest.raises(ValueError, match=r"'/dev/zero' is a character device, not a regular file"):
        PromptDataset(_config("/dev/zero"), TOK)
    with pytest.raises(FileNotFoundError, match=r"missing.jsonl' does not exist"):
        PromptDataset(_config(tmp_path / "missing.jsonl"), TOK)


def test_empty_and_missing_files(tmp_path):
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n  \n")
    with pytest.raises(ValueError, match="is empty"):
        PromptDataset(_config(empty), TOK)
    empty_parquet = tmp_path / "empty.parquet"
    pq.write_table(pa.table({"question": pa.array([], pa.string())}), empty_parquet)
    with pytest.raises(ValueError, match="is empty"):
        PromptDataset(_config(empty_parquet), TOK)
    with pytest.raises(FileNotFoundError, match="nope.jsonl"):
        PromptDataset(_config(tmp_path / "nope.jsonl"), TOK)
    with pytest.raises(ValueError, match="dataset.format"):
        unknown_suffix = tmp_path / "d.txt"
        unknown_suffix.write_text("{}")
        PromptDataset(_config(unknown_suffix), TOK)


def test_non_utf8_line_errors_with_line_number_or_is_skipped(tmp_path):
    path = tmp_path / "d.jsonl"
    good = [json.dumps(row).encode() for row in _rows(3)]
    path.write_bytes(good[0] + b"\n" + b'{"question": "sum \xff="}\n' + good[1] + b"\n" + good[2] + b"\n")
    with pytest.raises(ValueError, match=r"d.jsonl:2: line is not valid UTF-8.*on_bad_utf8=skip"):
        PromptDataset(_config(path), TOK)
    ds = PromptDataset(_config(path, on_bad_utf8="skip"), TOK)
    assert len(ds) == 3 and ds.stats.bad_utf8 == 1
    assert [r.metadata["source"] for r in ds.records] == [f"{path}:1", f"{path}:3", f"{path}:4"]


def test_malformed_json_names_line(tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_text(json.dumps(_rows(1)[0]) + "\n\n" + '{"question": "sum 1=", \n')
    with pytest.raises(ValueError, match=r"d.jsonl:3: malformed JSON"):
        PromptDataset(_config(path), TOK)
    path.write_text("[1, 2]\n")
    with pytest.raises(ValueError, match=r"d.jsonl:1: expected a JSON object"):
        PromptDataset(_config(path), TOK)


def test_unencodable_prompt_names_line(tmp_path):
    path = _write_jsonl(tmp_path / "d.jsonl", _rows(1) + [{"question": "SUM 1=", "solution": {"final": 1}}])
    with pytest.raises(ValueError, match=r"d.jsonl:2: SymbolTokenizer cannot encode character 'S'"):
        PromptDataset(_config(path), TOK)


def test_empty_prompt_names_file_and_line_at_load(tmp_path):
    """Issue 63 item 7: an empty prompt was accepted here and failed only at the first rollout, in the
    engine ("prompt 0 is empty", no file or line); it is refused while the file is read, naming both."""
    path = _write_jsonl(tmp_path / "d.jsonl", _rows(2) + [{"question": "", "solution": {"final": 1}}])
    with pytest.raises(ValueError, match=r"d.jsonl:3: the prompt \(field 'question'\) is empty"):
        PromptDataset(_config(path), TOK)


def _answers(batches):
    return [[int(r.answer) for r in batch] for batch in batches]


def test_shuffle_is_deterministic_per_seed_and_epoch(tmp_path):
    path = _write_jsonl(tmp_path / "d.jsonl", [{"question": "sum 1=", "solution": {"final": i}} for i in range(10)])
    a = PromptDataset(_config(path, shuffle=True, seed=1), TOK)
    b = PromptDataset(_config(path, shuffle=True, seed=1), TOK)
    batches = [a.next_batch(4) for _ in range(5)]  # 20 records = two full epochs
    assert _answers(batches) == _answers([b.next_batch(4) for _ in range(5)])
    flat = [x for batch in _answers(batches) for x in batch]
    epoch0, epoch1 = flat[:10], flat[10:]
    assert sorted(epoch0) == sorted(epoch1) == list(range(10))  # each epoch is a permutation
    assert epoch0 != list(range(10)) and epoch0 != epoch1  # shuffled, and differently per epoch
    assert (a.state_dict()["epoch"], a.state_dict()["position"]) == (1, 10)  # epoch advances lazily
    c = PromptDataset(_config(path, shuffle=True, seed=2), TOK)
    assert [int(r.answer) for r in c.next_batch(10)] != epoch0


def test_resume_position_across_epochs(tmp_path):
    path = _write_jsonl(tmp_path / "d.jsonl", [{"question": "sum 1=", "solution": {"final": i}} for i in range(7)])
    config = _config(path, shuffle=True, seed=3)
    a = PromptDataset(config, TOK)
    a.next_batch(5)
    a.next_batch(5)  # now 3 records into epoch 1
    state = a.state_dict()
    assert (state["epoch"], state["position"]) == (1, 3)
    expected = _answers([a.next_batch(5) for _ in range(3)])
    b = PromptDataset(config, TOK)
    b.load_state_dict(state)
    assert _answers([b.next_batch(5) for _ in range(3)]) == expected
    other_seed = PromptDataset(_config(path, shuffle=True, seed=4), TOK)
    with pytest.raises(ValueError, match="does not belong to this dataset"):
        other_seed.load_state_dict(state)


def test_config_validation():
    DatasetConfig()  # a section without a path is valid: only a dataset task needs one
    with pytest.raises(ValueError, match="dataset.path is required"):
        PromptDataset(DatasetConfig(), tokenizer=None)
    with pytest.raises(ValueError, match="on_bad_utf8"):
        DatasetConfig(path="x.jsonl", on_bad_utf8="ignore").validate()
