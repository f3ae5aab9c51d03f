"""Pick the fast tier (`pytest -m fast`) from a full run's timings: a few of the quickest
tests of every test file, so the tier touches every module the suite does, in well under a
minute on two cores.

    python -m pytest -q -n 2 --durations=0 > durations.txt
    python tools/pick_fast_tier.py durations.txt > tests/fast_tier.txt

A test counts by the sum of its setup, call and teardown times. Per file: every test under
`--quick` seconds up to `--per-file`, else the single quickest one if it is under `--max`.
"""

from __future__ import annotations

import argparse
import re
from collections import defaultdict

LINE = re.compile(r"^\s*([\d.]+)s\s+(setup|call|teardown)\s+(\S.*?)\s*$")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("durations", help="output of pytest --durations=0")
    ap.add_argument("--per-file", type=int, default=4)
    ap.add_argument("--quick", type=float, default=0.5)
    ap.add_argument("--max", type=float, default=4.0)
    args = ap.parse_args()
    total: dict[str, float] = defaultdict(float)
    with open(args.durations, encoding="utf-8") as f:
        for line in f:
            m = LINE.match(line)
            if m:
                total[m.group(3)] += float(m.group(1))
    by_file: dict[str, list[tuple[float, str]]] = defaultdict(list)
    for node, t in total.items():
        by_file[node.split("::")[0]].append((t, node))
    picked, seconds = [], 0.0
    for file in sorted(by_file):
        tests = sorted(by_file[file])
        chosen = [n for t, n in tests if t < args.quick][: args.per_file]
        if not chosen and tests[0][0] < args.max:
            chosen = [tests[0][1]]
        picked += chosen
        seconds += sum(t for t, n in tests if n in chosen)
    print(f"# the fast tier: {len(picked)} tests, {seconds:.0f} s of test time in the run they were picked from")
    print("# (tools/pick_fast_tier.py; tests/conftest.py marks them `fast`)")
    for n in picked:
        print(n)


if __name__ == "__main__":
    main()
