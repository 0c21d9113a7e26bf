"""Where the main leg's pytest time went, from its JUnit XML: seconds per test folder and the slowest
tests. Printed last by .ci/run, so that the tail CI keeps of its output shows it.

    python3 .ci/timing_summary.py .ci-main.xml

The leg runs on two xdist workers: the seconds are each test's own (setup, call and teardown),
summed; their total exceeds the leg's wall time by up to the number of workers. ``--dist loadgroup``
appends ``@<group>`` to every test's id (tests/conftest.py names the groups); the names here leave it out.
"""

from __future__ import annotations

import re
import sys
import xml.etree.ElementTree as ET
from collections import Counter

XDIST_GROUP = re.compile(r"@[^@\]]*$")  # loadgroup's suffix: after the last ']' of the parameters


def main(path: str, slowest: int = 12) -> None:
    cases = [
        (case.get("classname", ""), XDIST_GROUP.sub("", case.get("name", "")), float(case.get("time", 0.0)))
        for case in ET.parse(path).getroot().iter("testcase")
    ]
    by_folder: Counter[str] = Counter()
    for classname, _, seconds in cases:
        parts = classname.split(".")
        by_folder[".".join(parts[:2]) if parts[0] == "tests" else parts[0] or "collection"] += seconds
    total = sum(by_folder.values())
    print(
        f"[ci] main leg's tests: {total:.0f} s in {len(cases)} tests; by folder: "
        + ", ".join(f"{folder.removeprefix('tests.')} {seconds:.0f}" for folder, seconds in by_folder.most_common())
    )
    print(
        "[ci] slowest: "
        + "; ".join(
            f"{classname.rsplit('.', 1)[-1]}::{name} {seconds:.0f}"
            for classname, name, seconds in sorted(cases, key=lambda c: -c[2])[:slowest]
        )
    )


if __name__ == "__main__":
    main(sys.argv[1])
