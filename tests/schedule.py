"""The test files of one of ``make test``'s pytest runs, heaviest first.

``python tests/schedule.py RUNS K`` prints the files of run ``K`` (1-based) of ``RUNS``,
one per line. The files are dealt out by their measured seconds (``tests/durations.json``: each
file's test time, setup included, summed over the tests of a full run on 2 cores; a file not listed
counts as the median), heaviest first, each to the run with the least so far, so the runs
take about the same time; within a run the heaviest come first, so that pytest-xdist (with
``--dist loadfile --no-loadscope-reorder``) starts them first and no worker is left alone with a
long file at the end.

``python tests/schedule.py --record JUNIT.xml ...`` rewrites ``tests/durations.json`` from the JUnit
reports of a full run (``pytest --junitxml``).
"""

from __future__ import annotations

import json
import statistics
import sys
import xml.etree.ElementTree as ET
from collections import defaultdict
from pathlib import Path

TESTS = Path(__file__).resolve().parent
DURATIONS = TESTS / "durations.json"


def files() -> list[str]:
    return sorted(f"tests/{p.name}" for p in TESTS.glob("test_*.py"))


def seconds() -> dict[str, float]:
    """Each test file's seconds: measured, or the median of the measured for a file without a figure."""
    measured = json.loads(DURATIONS.read_text()) if DURATIONS.is_file() else {}
    default = statistics.median(measured.values()) if measured else 1.0
    return {f: float(measured.get(f, default)) for f in files()}


def runs(n: int) -> list[list[str]]:
    """The files dealt into ``n`` runs of about equal seconds, each heaviest first."""
    if n < 1:
        raise ValueError(f"{n} runs: at least 1")
    took = seconds()
    out: list[list[str]] = [[] for _ in range(n)]
    load = [0.0] * n
    for f in sorted(took, key=lambda f: (-took[f], f)):
        k = load.index(min(load))
        out[k].append(f)
        load[k] += took[f]
    return out


def record(reports: list[str]) -> dict[str, float]:
    """Seconds per test file from JUnit reports (a test case's time is its setup, call and teardown)."""
    total: dict[str, float] = defaultdict(float)
    for report in reports:
        for case in ET.parse(report).getroot().iter("testcase"):
            # classname: "tests.test_x" or "tests.test_x.TestClass"
            name = next((part for part in case.get("classname", "").split(".") if part.startswith("test_")), None)
            if name is not None:
                total[f"tests/{name}.py"] += float(case.get("time", 0))
    return {f: round(s, 1) for f, s in sorted(total.items())}


def main(argv: list[str]) -> int:
    if argv[:1] == ["--record"]:
        DURATIONS.write_text(json.dumps(record(argv[1:]), indent=1) + "\n")
        return 0
    if len(argv) != 2:
        print(__doc__, file=sys.stderr)
        return 2
    n, k = int(argv[0]), int(argv[1])
    if not 1 <= k <= n:
        print(f"run {k} of {n}: choose 1 to {n}", file=sys.stderr)
        return 2
    print("\n".join(runs(n)[k - 1]))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
