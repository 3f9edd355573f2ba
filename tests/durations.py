"""Writes tests/durations.json, the seconds of each test that took half a second or more in a
whole-suite run, read from the output of ``python -m pytest --durations=0 > LOG``:
``python tests/durations.py LOG``. The root conftest.py gives pytest-xdist the files longest
first by it (a test not listed counts as 0.1 s)."""

import collections
import json
import re
import sys
from pathlib import Path

LINE = re.compile(r"\s*([\d.]+)s (?:call|setup|teardown)\s+(.+?)\s*$")
SHORTEST = 0.5  # seconds: a shorter test is not listed


def main(log: str) -> None:
    seconds: dict[str, float] = collections.Counter()
    with open(log, encoding="utf-8", errors="replace") as lines:
        for line in lines:
            found = LINE.match(line)
            if found:
                seconds[found.group(2)] += float(found.group(1))
    if not seconds:
        sys.exit(f"{log}: no durations in it; write it with python -m pytest --durations=0")
    table = {test: round(s, 1) for test, s in sorted(seconds.items()) if s >= SHORTEST}
    out = Path(__file__).with_name("durations.json")
    out.write_text(json.dumps(table, indent=0) + "\n")
    print(f"{out}: {len(table)} tests of {len(seconds)}, {sum(table.values()):,.0f} s "
          f"of {sum(seconds.values()):,.0f}")


if __name__ == "__main__":
    main(sys.argv[1])
