"""The run summary printed at the end of a job and the routing report agree on every number they share.

Issue 64: the summary's "clip frac (seq) mean 0.1959" was the last 20% of the steps while the report's
"clip_frac_seq_mean" 0.2450 was the whole run. Now every summary number names its window and the report
carries the same number under the same label. This builds a run directory the way the trainer does
(``RunLog`` writing metrics.jsonl and routing.jsonl; the routing metrics and records formed from one
``RoutingVolatility`` as ``policy/routing/diagnostics.py`` forms them) and compares each shared number.
"""

from __future__ import annotations

import html
import re

import torch

from gspo_megatron.policy.routing.log import routing_record
from gspo_megatron.policy.routing.volatility import RoutingVolatility
from gspo_megatron.run.routing_report import write_routing_report
from gspo_megatron.run.run_log import RunLog

STEPS, TOKENS, LAYERS = 12, 20, 2


def _volatility(changed_tokens: int) -> RoutingVolatility:
    changed = torch.tensor([changed_tokens] * LAYERS)
    return RoutingVolatility(
        changed_count=changed,
        intersection_count=2 * TOKENS - changed,
        tokens=torch.tensor(TOKENS),
        top_k=2,
        changed_any_count=torch.tensor(changed_tokens),
    )


def _step(step: int) -> tuple[dict, list[dict]]:
    metrics = {
        "reward/mean": 0.05 * step,
        "response/length_mean": 3.0 + step,
        "loss/clip_frac_seq": 0.3 - 0.02 * step,
        "loss/clip_frac_token": 0.01 * (step % 4),
    }
    records = []
    for kind, changed_tokens in (("update", step % 7), ("rollout_vs_train", 12 - step)):
        volatility = _volatility(changed_tokens)
        metrics[f"routing/{kind}_changed_frac"] = float(volatility.changed_frac_overall)  # as diagnostics.py
        records.append(routing_record(step, kind, volatility=volatility))
    return metrics, records


def _summary_numbers(text: str) -> dict[str, str]:
    """The summary's numbers by the report's labels: '<name>, <window>'
    (routing: '<kind>: expert sets changed, ...')."""
    numbers = {}
    for name in ("reward/mean", "response length"):
        match = re.search(rf"{re.escape(name)} +first 20%: ([0-9.]+) +last 20%: ([0-9.]+)", text)
        numbers[f"{name}, first 20%"], numbers[f"{name}, last 20%"] = match.groups()
    match = re.search(r"clip frac \(seq\) +last 20%: ([0-9.]+) +\(token\) last 20%: ([0-9.]+)", text)
    assert match, f"the summary's clip fractions name no window: {text}"
    numbers["clip frac (seq), last 20%"], numbers["clip frac (token), last 20%"] = match.groups()
    match = re.search(
        r"expert sets changed by an update: ([0-9.]+) of tokens per layer \(whole run; first 20%: ([0-9.]+), "
        r"last 20%: ([0-9.]+)\); engine vs trainer \(last 20%\): ([0-9.]+)",
        text,
    )
    for window, value in zip(("whole run", "first 20%", "last 20%"), match.groups()[:3], strict=True):
        numbers[f"update: expert sets changed, {window}"] = value
    numbers["rollout_vs_train: expert sets changed, last 20%"] = match.group(4)
    return numbers


def _report_rows(page: str) -> dict[str, str]:
    section = page.split('<section id="summary">', 1)[1].split("</section>", 1)[0]
    return {html.unescape(k): v for k, v in re.findall(r"<tr><td>([^<]*)</td><td>([^<]*)</td></tr>", section)}


def test_every_number_the_summary_prints_is_the_reports_under_the_same_label(tmp_path):
    log = RunLog(
        tmp_path,
        STEPS,
        tensorboard=False,
        wandb_project=None,
        progress=False,
        config_yaml="",
        charts=False,
        routing=True,
    )
    for step in range(1, STEPS + 1):
        log.log_step(step, *_step(step))
    text = log.close()
    _, html_path = write_routing_report(tmp_path, charts=False)
    rows = _report_rows(html_path.read_text())
    numbers = _summary_numbers(text)
    assert len(numbers) == 10
    for label, printed in numbers.items():
        assert label in rows, f"the report has no row {label!r} (rows: {sorted(rows)})"
        digits = len(printed.split(".")[1])
        assert f"{float(rows[label]):.{digits}f}" == printed, (label, rows[label], printed)
    # the windows differ on this run, so a number under the wrong label would not pass
    assert numbers["clip frac (seq), last 20%"] != f"{float(rows['clip frac (seq), whole run']):.4f}"
