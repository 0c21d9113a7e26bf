"""Contract tier: the project's SGLang wire format checked against SGLang's own code, without a GPU.

SGLang 0.5.x imports without CUDA when installed as ``launch/setup_sglang.sh`` does it, in
the SGLang tiers' own venv ``.venv-sglang/`` (SGLang's pins -- triton, torchvision, xgrammar, a CUDA torch
-- never enter the training environment). Its FastAPI app is driven with Starlette's TestClient: a
body that passes the app's validation reaches the (absent) tokenizer manager and answers 500; an
invalid one 400/422. The checks the tokenizer manager would run next (``SamplingParams.normalize``/
``verify``, ``GenerateReqInput.normalize_batch_and_arguments``) are run here directly.

Where the tier runs (``contract_tier_placement``), so that a plain ``python3 -m pytest`` runs it once:
- inside the contract venv: here, in this interpreter;
- elsewhere, when the contract venv exists or the set-up is making it in the background
  (``tests/sglang_venv_setup.py``): in the venv, as one test (``test_contract_tier_in_its_venv.py``, which
  waits for that set-up); the tier's own tests are deselected in this interpreter;
- elsewhere, without the venv: in this interpreter (a machine with a real SGLang install). If SGLang
  cannot be imported the tier FAILS, so CI can never pass by silently skipping it; set
  ``GSPO_SKIP_SGLANG=1`` only where the contract dependencies are intentionally absent.
"""

from __future__ import annotations

import enum
import os
import sys
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from sglang_venv_setup import background_setup_started, wait_for_sglang_setup

SKIP_ENV = "GSPO_SKIP_SGLANG"
VOCAB_SIZE = 1000  # the double's vocabulary; SamplingParams.verify only uses it for logit_bias
CONTRACT_DIR = Path(__file__).resolve().parent
CONTRACT_VENV = CONTRACT_DIR.parents[1] / ".venv-sglang"
VENV_RUNNER = "test_contract_tier_in_its_venv.py"


class Placement(enum.Enum):
    HERE = "here"  # the tier's tests run in this interpreter
    IN_VENV = "in_venv"  # one test runs the tier in .venv-sglang


def contract_tier_placement() -> Placement:
    in_contract_venv = Path(sys.prefix).resolve() == CONTRACT_VENV.resolve()
    venv_made_or_in_the_making = (CONTRACT_VENV / "bin" / "python").exists() or background_setup_started()
    if not in_contract_venv and venv_made_or_in_the_making:
        return Placement.IN_VENV
    return Placement.HERE


def pytest_collection_modifyitems(config, items):
    placement = contract_tier_placement()
    kept, deselected = [], []
    for item in items:
        path = Path(str(item.fspath)).resolve()
        if CONTRACT_DIR not in path.parents:
            kept.append(item)
            continue
        item.add_marker(pytest.mark.contract)
        runs_here = (path.name == VENV_RUNNER) == (placement is Placement.IN_VENV)
        (kept if runs_here else deselected).append(item)
    if deselected:
        config.hook.pytest_deselected(items=deselected)
        items[:] = kept


@dataclass
class Verdict:
    accepted: bool
    reason: str


class SGLangReference:
    """SGLang's own validators and HTTP app, imported once per session (the import takes seconds)."""

    def __init__(self):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            import sglang
            from sglang.srt.entrypoints import http_server
            from sglang.srt.managers import io_struct
            from sglang.srt.sampling.sampling_params import SamplingParams
            from sglang.srt.server_args import prepare_server_args
        from starlette.testclient import TestClient

        self.version = sglang.__version__
        self.io_struct = io_struct
        self.SamplingParams = SamplingParams
        self.prepare_server_args = prepare_server_args
        self.app = http_server.app
        self.client = TestClient(http_server.app, raise_server_exceptions=False)
        self.tokenizer = _word_level_tokenizer()

    def post(self, path: str, body: Any) -> Verdict:
        """The app's verdict: 400/422 = refused by validation; 500 = passed it (no tokenizer manager)."""
        response = self.client.post(path, json=body)
        if response.status_code in (400, 422):
            return Verdict(False, f"HTTP {response.status_code}: {response.text[:300]}")
        if response.status_code != 500:
            raise AssertionError(f"unexpected HTTP {response.status_code} from SGLang's app: {response.text[:300]}")
        return Verdict(True, "passed the app's validation")

    def generate_verdict(self, body: Any) -> Verdict:
        """Accepted by the app AND by what the tokenizer manager checks before scheduling."""
        verdict = self.post("/generate", body)
        if not verdict.accepted:
            return verdict
        try:
            request = self.io_struct.GenerateReqInput(**body)
            request.normalize_batch_and_arguments()
            params = self.SamplingParams(**(body.get("sampling_params") or {}))
            params.normalize(self.tokenizer)  # a served model has a tokenizer (no --skip-tokenizer-init)
            params.verify(VOCAB_SIZE)
        except (ValueError, TypeError) as error:
            return Verdict(False, f"{type(error).__name__}: {error}")
        return verdict


def _word_level_tokenizer():
    """A real (tiny, in-memory) Hugging Face tokenizer: SamplingParams.normalize encodes stop strings."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"[UNK]": 0, "<s>": 1, "</s>": 2}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, unk_token="[UNK]", eos_token="</s>")


_REFERENCE: SGLangReference | None = None


@pytest.fixture(scope="session")
def contract_venv() -> Path:
    wait_for_sglang_setup()
    return CONTRACT_VENV


@pytest.fixture(scope="session")
def sglang_reference() -> SGLangReference:
    global _REFERENCE
    if _REFERENCE is None:
        try:
            _REFERENCE = SGLangReference()
        except ImportError as error:
            if os.environ.get(SKIP_ENV) == "1":
                pytest.skip(f"SGLang contract deps intentionally absent ({SKIP_ENV}=1): {error}")
            pytest.fail(
                f"SGLang cannot be imported ({error}); make the contract tier's venv with "
                f"`bash launch/setup_sglang.sh` (launch/setup_tests.sh does it), or set {SKIP_ENV}=1 "
                "where it is intentionally absent",
                pytrace=False,
            )
    return _REFERENCE
