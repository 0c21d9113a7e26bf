"""Every /generate body the project builds is accepted by SGLang's own app and validators; the test
double accepts and refuses exactly what SGLang does on a table of valid and invalid bodies."""

from __future__ import annotations

import httpx
import pytest

from gspo_megatron.contracts.samples import SamplingParams
from gspo_megatron.rollout.sglang.protocol import build_generate_request
from gspo_megatron.testing.sglang_double import SGLangServerDouble


def _project_bodies() -> list[tuple[str, dict]]:
    """Bodies ``build_generate_request`` produces for the sampling settings the project allows."""
    settings = {
        "defaults": SamplingParams(),
        "greedy": SamplingParams(temperature=0.0, max_new_tokens=8),
        "top_p_top_k": SamplingParams(temperature=0.7, top_p=0.9, top_k=20, max_new_tokens=1),
        "stops": SamplingParams(stop=("</answer>", "\n\n"), stop_token_ids=(2, 151645)),
        "routed": SamplingParams(return_routed_experts=True, max_new_tokens=4096),
    }
    bodies = [("project-rid", build_generate_request([1, 2, 3], SamplingParams(max_new_tokens=9), rid="gspo-ab-0"))]
    for name, params in settings.items():
        bodies.append((f"project-{name}", build_generate_request([1, 2, 3], params)))
        bodies.append(
            (
                f"project-{name}-seeded",
                build_generate_request(
                    [7], params, sampling_seed=2**31 + 5, skip_special_tokens=True, no_stop_trim=False
                ),
            )
        )
    return bodies


def _body(**sampling) -> dict:
    return {"input_ids": [5, 6, 7], "sampling_params": sampling, "return_logprob": True}


TABLE: list[tuple[str, dict]] = _project_bodies() + [
    # valid
    ("max-new-tokens-0", _body(max_new_tokens=0)),
    ("temperature-int", _body(temperature=1)),
    ("temperature-0-top-k-0", _body(temperature=0.0, top_k=0)),  # greedy turns top_k into 1 first
    ("top-p-1", _body(top_p=1.0)),
    ("stop-string", _body(stop="x")),
    ("min-p", _body(min_p=0.5)),
    ("penalties-at-bounds", _body(frequency_penalty=2.0, presence_penalty=-2.0, repetition_penalty=2.0)),
    ("min-new-equals-max-new", _body(min_new_tokens=4, max_new_tokens=4)),
    ("ignore-eos", _body(ignore_eos=True)),
    ("null-top-p", _body(top_p=None)),
    ("no-sampling-params", {"input_ids": [1]}),
    ("negative-seed", _body(sampling_seed=-3)),
    # invalid
    ("top-p-0", _body(top_p=0)),
    ("top-p-above-1", _body(top_p=1.5)),
    ("top-k-0", _body(top_k=0)),
    ("top-k-minus-2", _body(top_k=-2)),
    ("top-k-float", _body(top_k=1.0)),
    ("temperature-string", _body(temperature="hot")),
    ("temperature-bool", _body(temperature=True)),
    ("temperature-negative", _body(temperature=-0.5)),
    ("max-new-tokens-negative", _body(max_new_tokens=-1)),
    ("max-new-tokens-float", _body(max_new_tokens=3.5)),
    ("min-new-above-max-new", _body(min_new_tokens=5, max_new_tokens=4)),
    ("min-p-above-1", _body(min_p=1.5)),
    ("frequency-penalty-3", _body(frequency_penalty=3.0)),
    ("repetition-penalty-0", _body(repetition_penalty=0.0)),
    ("unknown-sampling-field", _body(temprature=1.0)),
    ("stop-token-ids-floats", _body(stop_token_ids=[1.0])),
    ("seed-string", _body(sampling_seed="7")),
    ("seed-too-large", _body(sampling_seed=2**63)),
    ("input-ids-floats", {"input_ids": [1.0, 2.0]}),
    ("return-logprob-string", {"input_ids": [1], "return_logprob": "yes"}),
    ("skip-special-tokens-string", _body(skip_special_tokens="no")),
]


def test_table_is_large_and_mixed(sglang_reference):
    verdicts = [sglang_reference.generate_verdict(body).accepted for _, body in TABLE]
    assert len(TABLE) >= 30 and sum(verdicts) >= 10 and len(verdicts) - sum(verdicts) >= 10


@pytest.mark.parametrize("name, body", _project_bodies(), ids=[name for name, _ in _project_bodies()])
def test_every_project_body_is_accepted_by_sglang(sglang_reference, name, body):
    verdict = sglang_reference.generate_verdict(body)
    assert verdict.accepted, f"{name}: SGLang refuses a body the project sends: {verdict.reason}"


def test_double_accepts_exactly_what_sglang_accepts(sglang_reference):
    disagreements = []
    with SGLangServerDouble() as double, httpx.Client(base_url=double.url, trust_env=False) as http:
        for name, body in TABLE:
            sglang = sglang_reference.generate_verdict(body)
            response = http.post("/generate", json=body)
            assert response.status_code in (200, 400), f"{name}: double answered {response.status_code}"
            if sglang.accepted != (response.status_code == 200):
                disagreements.append(
                    f"{name}: SGLang {sglang.reason!r}, double HTTP {response.status_code} {response.text[:120]}"
                )
    assert not disagreements, "the double and SGLang disagree:\n" + "\n".join(disagreements)
