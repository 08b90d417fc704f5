"""Per-test time of two suite runs: the tests both ran, and what each run added.

    .venv/bin/python -m pytest -q -n 2 --dist worksteal --durations=0 tests > new.log
    python3 scripts/compare_durations.py old.log new.log

Reads pytest's `--durations` lines (setup + call + teardown summed per test id; pytest leaves out
phases under 5 ms). Says whether a change made the same tests slower, apart from the tests that
were added meanwhile.
"""

import re
import sys
from collections import defaultdict

LINE = re.compile(r"^\s*([\d.]+)s (setup|call|teardown)\s+(tests/\S+)")


def durations(path: str) -> dict[str, float]:
    out: dict[str, float] = defaultdict(float)
    for line in open(path, errors="replace"):
        m = LINE.match(line)
        if m:
            out[m.group(3)] += float(m.group(1))
    return out


def main() -> None:
    old, new = durations(sys.argv[1]), durations(sys.argv[2])
    common = sorted(set(old) & set(new))
    so, sn = sum(old[k] for k in common), sum(new[k] for k in common)
    added = set(new) - set(old)
    print(f"old: {len(old)} tests, {sum(old.values()):.0f} s; new: {len(new)} tests, {sum(new.values()):.0f} s")
    print(f"in both: {len(common)} tests, {so:.0f} s -> {sn:.0f} s ({sn / so if so else 0:.2f}x)")
    print(f"only in new: {len(added)} tests, {sum(new[k] for k in added):.0f} s")
    for k in sorted(common, key=lambda k: new[k] - old[k], reverse=True)[:8]:
        print(f"  {new[k] - old[k]:+7.1f} s  {old[k]:6.1f} -> {new[k]:6.1f}  {k}")


if __name__ == "__main__":
    main()
