"""The faults an SGLang server double can be told to show (``sglang_double.py``), one field each."""

from __future__ import annotations

from dataclasses import dataclass

HOLD_TIMEOUT_S = 30.0  # the hold_* / never_answers faults give up after this (the test then fails on what it counts)


@dataclass
class DoubleFaults:
    startup_503: int = 0  # /health answers 503 this many times before 200 (server warming up)
    generate_503: int = 0  # the first N /generate requests answer 503
    abort_first: int = 0  # the first N /generate requests finish with {"type": "abort"}
    die_after: int | None = None  # after N /generate answers the server stops serving
    malformed_json: bool = False  # /generate answers a truncated JSON body
    wrong_routed_experts: bool = False  # routed_experts has one token row too few
    mismatched_logprob_ids: bool = False  # output_token_logprobs names other tokens than output_ids
    generate_delay_s: float = 0.0  # keeps requests in flight (load-balancing and dying tests)
    # each /generate is accepted and never answered: held until the double stops (at most HOLD_TIMEOUT_S),
    # then its connection is dropped -- a stuck server, for the client's request timeout
    generate_never_answers: bool = False
    # each /generate waits until this many have been in flight at once (at most HOLD_TIMEOUT_S): a
    # test of a concurrency limit then sees the limit reached without racing a clock
    hold_until_in_flight: int = 0
    # each /generate waits until the server is paused (at most HOLD_TIMEOUT_S), then until it continues:
    # a request is certainly in flight when a test pauses, without racing a clock
    hold_until_paused: bool = False
    fail_distributed_updates: int = 0  # the first N /update_weights_from_distributed answer 400
    fail_disk_updates: int = 0  # the first N /update_weights_from_disk answer 400
    die_on_disk_update: bool = False  # the server stops serving when an /update_weights_from_disk arrives
    # each /update_weights_from_disk is accepted and never answered (held until the double stops, at most
    # HOLD_TIMEOUT_S): a weight sync stuck on its server
    disk_update_never_answers: bool = False
