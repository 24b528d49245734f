"""The top frames of py-spy's collapsed stacks (``--format raw``): where a process spends its samples.

    python bench/profile_summary.py PROFILE.txt [--top 25]

Prints, per frame (function and file), its share of all samples on the stack (inclusive) and as
the innermost frame (self), highest inclusive first; idle waits (epoll, select, sleeping in
the event loop) show as such, so compare processes by their busy frames.
"""

from __future__ import annotations

import argparse
import collections
import re
import sys
from pathlib import Path

_FRAME = re.compile(r"^(?P<fn>.*?) \((?P<file>[^:()]*)(?::\d+)?\)$")


def _name(frame: str) -> str:
    m = _FRAME.match(frame.strip())
    if not m:
        return frame.strip()
    file = m["file"]
    for marker in ("site-packages/", "lib/python3", "/work/main/"):
        if marker in file:
            file = file.split(marker, 1)[1]
    return f"{m['fn']} ({file})"


def summarise(path: Path, top: int = 25) -> list[tuple[str, float, float]]:
    inclusive: collections.Counter = collections.Counter()
    own: collections.Counter = collections.Counter()
    total = 0
    for line in path.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        if not stack or not count.isdigit():
            continue
        n = int(count)
        total += n
        frames = [_name(f) for f in stack.split(";")]
        for frame in set(frames):
            inclusive[frame] += n
        own[frames[-1]] += n
    return [(frame, 100.0 * n / total, 100.0 * own[frame] / total) for frame, n in inclusive.most_common(top)]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("profile", type=Path)
    parser.add_argument("--top", type=int, default=25)
    args = parser.parse_args(argv)
    print(f"{'incl %':>7} {'self %':>7}  frame")
    for frame, incl, self_pct in summarise(args.profile, args.top):
        print(f"{incl:7.1f} {self_pct:7.1f}  {frame}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
