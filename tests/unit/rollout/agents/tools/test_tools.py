"""The agent tools that run in-process (``rollout/agents/tools/``): the runner's checks and bounds (bad
arguments, unknown tool, a raising tool, a hanging tool, an answer too large), the calculator's arithmetic
and refusals, and the corpus lookup's choice, "no match" and refusal of symlinks leaving its directory.
Values are worked out by hand. The Python sandbox's tests start processes: ``test_python_sandbox.py``."""

from __future__ import annotations

import asyncio
import threading
from typing import Any

import pytest

from gspo_megatron.rollout.agents.tools.base import Tool, ToolResult, ToolSpec
from gspo_megatron.rollout.agents.tools.calculator import Calculator
from gspo_megatron.rollout.agents.tools.corpus import NO_MATCH, CorpusLookup
from gspo_megatron.rollout.agents.tools.runner import ToolRunner


class _Recorder:
    """A tool with every simple argument type; answers "ok" and records what it was called with."""

    def __init__(self, name: str = "record", timeout_s: float = 5.0):
        self.calls: list[dict[str, Any]] = []
        self.timeout_s = timeout_s
        self.spec = ToolSpec(
            name=name,
            description="records its arguments",
            parameters={
                "type": "object",
                "properties": {
                    "text": {"type": "string"},
                    "count": {"type": "integer"},
                    "scale": {"type": "number"},
                    "flag": {"type": "boolean"},
                },
                "required": ["text"],
                "additionalProperties": False,
            },
        )

    def call(self, arguments: dict[str, Any]) -> ToolResult:
        self.calls.append(arguments)
        return ToolResult("ok")


class _Answers:
    """A tool whose call does what it is given (return a value, raise, wait)."""

    def __init__(self, behave, name: str = "answers", timeout_s: float = 5.0):
        self.behave, self.timeout_s = behave, timeout_s
        self.spec = ToolSpec(name=name, description="test double")

    def call(self, arguments: dict[str, Any]):
        return self.behave()


def _call(runner: ToolRunner, name: str, arguments: Any) -> ToolResult:
    return asyncio.run(runner.call(name, arguments))


# ---------------------------------------------------------------------------------------------- runner
@pytest.mark.parametrize(
    "arguments, says",
    [
        ({}, "missing required argument(s): text"),
        ({"text": 3}, "'text' must be a string, got int"),
        ({"text": "a", "count": 2.5}, "'count' must be an integer, got float"),
        ({"text": "a", "count": True}, "'count' must be an integer, got bool"),  # JSON keeps bool apart
        ({"text": "a", "scale": "1"}, "'scale' must be a number, got str"),
        ({"text": "a", "flag": 1}, "'flag' must be a boolean, got int"),
        ({"text": "a", "colour": "red"}, "unknown argument(s): colour"),
        (["text"], "must be a JSON object, got list"),
    ],
)
def test_runner_refuses_arguments_that_do_not_fit_the_schema(arguments, says):
    tool = _Recorder()
    result = _call(ToolRunner([tool]), "record", arguments)
    assert result.error == "bad_arguments"
    assert says in result.content
    assert tool.calls == []  # the tool never saw them


def test_runner_passes_arguments_that_fit():
    tool = _Recorder()
    arguments = {"text": "a", "count": 2, "scale": 2, "flag": False}  # an integer is a number too
    assert _call(ToolRunner([tool]), "record", arguments) == ToolResult("ok")
    assert _call(ToolRunner([tool]), "record", {"text": "b", "scale": 0.5}) == ToolResult("ok")
    assert tool.calls == [arguments, {"text": "b", "scale": 0.5}]


def test_runner_names_the_tools_when_one_is_unknown():
    runner = ToolRunner([_Recorder("alpha"), _Recorder("beta")])
    result = _call(runner, "gamma", {"text": "a"})
    assert result.error == "unknown_tool"
    assert "'gamma'" in result.content and "alpha, beta" in result.content


def test_runner_refuses_a_second_tool_of_the_same_name_and_lists_specs_in_order():
    runner = ToolRunner([_Recorder("b"), _Recorder("a")])
    with pytest.raises(ValueError, match="'a' is already registered"):
        runner.register(_Recorder("a"))
    assert [spec.name for spec in runner.specs()] == ["b", "a"]


def test_runner_reports_an_exception_with_its_type_and_message():
    result = _call(ToolRunner([_Answers(lambda: 1 // 0)]), "answers", {})
    assert result.error == "raised"
    assert "ZeroDivisionError: integer division or modulo by zero" in result.content


def test_runner_reports_an_answer_that_is_not_a_tool_result():
    result = _call(ToolRunner([_Answers(lambda: "plain text")]), "answers", {})
    assert result.error == "raised" and "returned a str" in result.content


def test_runner_abandons_a_hanging_call_at_its_timeout():
    release, finished = threading.Event(), threading.Event()

    def hang() -> ToolResult:
        release.wait(30)  # sleeps 30 s unless the test lets it go
        finished.set()
        return ToolResult("late")

    try:
        result = _call(ToolRunner([_Answers(hang, timeout_s=0.5)]), "answers", {})
        # asyncio.run returned while the call still runs: its thread is not joined at the loop's shutdown
        assert not finished.is_set()
    finally:
        release.set()
    assert result.error == "timeout"
    assert "no answer within 0.5 s" in result.content


def test_runner_refuses_an_answer_too_large_by_its_utf8_size():
    huge = _call(ToolRunner([_Answers(lambda: ToolResult("x" * 10_000_000))]), "answers", {})
    assert huge.error == "too_large"
    assert "10000000 bytes" in huge.content and len(huge.content) < 200  # its size, never its text
    # "é" is 2 bytes: 9000 characters are 18000 bytes, over 16384; 8000 are 16000, under it
    assert _call(ToolRunner([_Answers(lambda: ToolResult("é" * 9000))]), "answers", {}).error == "too_large"
    assert _call(ToolRunner([_Answers(lambda: ToolResult("é" * 8000))]), "answers", {}).error is None
    small = ToolRunner([_Answers(lambda: ToolResult("12345"))], max_result_bytes=4)
    assert _call(small, "answers", {}).error == "too_large"


# ---------------------------------------------------------------------------------------------- calculator
@pytest.mark.parametrize(
    "expression, value",
    [
        ("17 * 514", "8738"),
        ("(2 + 3) * 4", "20"),
        ("2 + 3 * 4", "14"),
        ("7 / 2", "3.5"),
        ("10 / 2", "5"),  # a float with an integral value loses its ".0"
        ("7 // 2", "3"),
        ("-7 // 2", "-4"),  # floor, as Python
        ("-7 % 3", "2"),
        ("7.5 // 2", "3"),
        ("2 ** 10", "1024"),
        ("2 ** -2", "0.25"),
        ("2 ** 100", "1267650600228229401496703205376"),
        ("1.5 * 4", "6"),
        ("0.1 + 0.2", "0.30000000000000004"),
        ("-(3 - 5)", "2"),
        ("+4", "4"),
        ("3.25e2", "325"),
        ("1_000 * 3", "3000"),
        ("-0.0", "0"),
    ],
)
def test_calculator_evaluates_arithmetic(expression, value):
    assert Calculator().call({"expression": expression}) == ToolResult(value)


@pytest.mark.parametrize(
    "expression, says",
    [
        ("x + 1", "the name 'x'"),
        ("abs(-1)", "a function call"),
        ("(1).real", "an attribute"),
        ("__import__('os').system('true')", "a function call"),
        ("True + 1", "the constant True"),
        ("'a' * 3", "the constant 'a'"),
        ("1 < 2", "Compare"),
        ("1 if 1 else 2", "IfExp"),
        ("3 & 1", "the operator BitAnd"),
        ("2 ** 101", "exponents are limited"),
        ("2 ** 10 ** 10", "exponents are limited"),  # would take minutes and gigabytes unbounded
        ("11 ** 99", "magnitude passes 1e+100"),  # 99 * log10(11) = 103.1
        ("10 ** 60 * 10 ** 60", "magnitude passes 1e+100"),
        ("1e999", "magnitude passes 1e+100"),
        ("1 / 0", "division by zero"),
        ("5 % 0", "division by zero"),
        ("0 ** -1", "division by zero"),
        ("(-8) ** 0.5", "not a real number"),
        ("1 +", "not a valid expression"),
        ("1" * 1001, "longer than 1000 characters"),
    ],
)
def test_calculator_refuses_everything_else(expression, says):
    result = Calculator().call({"expression": expression})
    assert result.error == "bad_arguments"
    assert says in result.content


def test_calculator_through_the_runner():
    runner = ToolRunner([Calculator()])
    assert _call(runner, "calculator", {"expression": "12 * 12"}) == ToolResult("144")
    assert _call(runner, "calculator", {"expression": 144}).error == "bad_arguments"
    assert Calculator().timeout_s == 1.0


# ---------------------------------------------------------------------------------------------- lookup
CAPITALS = {
    "b_paris.txt": "Paris is the capital of France.",
    "a_rome.txt": "Rome is the capital of Italy.",
    "c_tokyo.txt": "Tokyo is the capital of Japan.",
}


@pytest.mark.parametrize(
    "query, answer",
    [
        ("capital of France", CAPITALS["b_paris.txt"]),  # 3 words shared against 2
        ("FRANCE?", CAPITALS["b_paris.txt"]),  # lowercased, punctuation not a word
        ("What is the capital?", CAPITALS["a_rome.txt"]),  # is, the, capital: a 3-way tie, the first name wins
        ("Japan japan JAPAN", CAPITALS["c_tokyo.txt"]),
        ("Berlin, Germany", NO_MATCH),
        ("", NO_MATCH),
    ],
)
def test_lookup_returns_the_document_sharing_most_words(query, answer):
    assert CorpusLookup(CAPITALS).call({"query": query}) == ToolResult(answer)


def test_lookup_counts_distinct_words_not_repetitions():
    lookup = CorpusLookup({"a.txt": "cat cat cat cat", "b.txt": "cat dog"})
    assert lookup.call({"query": "cat dog"}).content == "cat dog"  # 2 distinct against 1
    assert lookup.call({"query": "cat cat cat"}).content == "cat cat cat cat"  # 1 against 1: the name decides


def test_lookup_cuts_the_answer_to_max_chars():
    text = "needle " + "x" * 5000
    assert CorpusLookup({"d.txt": text}).call({"query": "needle"}).content == text[:2000]
    assert CorpusLookup({"d.txt": text}, max_chars=10).call({"query": "needle"}).content == "needle xxx"


def test_lookup_reads_a_directory(tmp_path):
    corpus = tmp_path / "corpus"
    (corpus / "europe").mkdir(parents=True)
    (corpus / "europe" / "paris.txt").write_text("Paris, capitale de la France — the capital.", encoding="utf-8")
    (corpus / "tokyo.txt").write_text("Tokyo is the capital of Japan.", encoding="utf-8")
    (corpus / ".hidden.txt").write_text("france france", encoding="utf-8")
    (corpus / "paris-link.txt").symlink_to(corpus / "europe" / "paris.txt")  # inside: allowed
    lookup = CorpusLookup(corpus)
    assert [d.name for d in lookup.documents] == ["europe/paris.txt", "paris-link.txt", "tokyo.txt"]
    assert lookup.call({"query": "capitale France"}).content == "Paris, capitale de la France — the capital."
    assert asyncio.run(ToolRunner([lookup]).call("lookup", {"query": "Japan"})).content.startswith("Tokyo")


def test_lookup_refuses_a_symlink_leaving_its_directory(tmp_path):
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    (corpus / "fine.txt").write_text("fine", encoding="utf-8")
    (tmp_path / "secret.txt").write_text("the password", encoding="utf-8")
    (corpus / "leak.txt").symlink_to(tmp_path / "secret.txt")
    with pytest.raises(ValueError, match=r"leak\.txt leads outside the corpus directory"):
        CorpusLookup(corpus)
    (corpus / "leak.txt").unlink()
    (corpus / "up").symlink_to(tmp_path)  # a folder leaving it is refused too, though it is not walked
    with pytest.raises(ValueError, match="up leads outside"):
        CorpusLookup(corpus)


def test_lookup_refuses_a_file_that_is_not_utf8(tmp_path):
    (tmp_path / "latin1.txt").write_bytes("café".encode("latin-1"))
    with pytest.raises(ValueError, match=r"latin1\.txt is not UTF-8"):
        CorpusLookup(tmp_path)


def test_tool_specs_are_openai_functions_with_required_string_arguments(tmp_path):
    from gspo_megatron.rollout.agents.tools.python_sandbox import PythonSandbox  # constructing starts nothing

    tools: list[Tool] = [Calculator(), CorpusLookup(CAPITALS), PythonSandbox(tmp_path / "scratch")]
    runner = ToolRunner(tools)
    assert runner.tools() == tools
    specs = {spec.name: spec for spec in runner.specs()}
    assert list(specs) == ["calculator", "lookup", "python"]
    for spec, argument in zip(specs.values(), ("expression", "query", "code"), strict=True):
        function = spec.openai()["function"]
        assert function["parameters"]["required"] == [argument]
        assert function["parameters"]["properties"][argument]["type"] == "string"
    assert (tmp_path / "scratch").is_dir()  # the scratch directory is created
