"""`specgen serve` with every round of the engine logged: width, and per row its method, the k it
was allowed, what it proposed, what it committed and its floor's ceiling; and every floor start/keep."""

import sys
import time

from specgen.decoding import floor

LOG = open(sys.argv.pop(1), "w", buffering=1)
measure_before = floor.PlainSteps.measure
start_before = floor.PlainSteps.start
keep_before = floor.PlainSteps.keep


def ceiling(f):
    c = getattr(f, "ceiling", floor.NONE)
    return "-" if c >= floor.NONE else c


def measure(self, rows, ks, proposals, results, seconds, verify_seconds, cost):
    measure_before(self, rows, ks, proposals, results, seconds, verify_seconds, cost)
    cells = " ".join(
        f"{s.config.method.value[:2]}:{k}:{p.size}:{len(r.emitted)}:{ceiling(s.floor)}"
        for s, k, p, r in zip(rows, ks, proposals, results)
    )
    plain = self.seconds(len(rows))
    plain_ms = plain and round(1000 * plain)
    LOG.write(f"{time.time():.2f} w{len(rows)} {1000 * seconds:.0f}ms plain={plain_ms} {cells}\n")


def start(self, f, method, width):
    before = ceiling(f)
    start_before(self, f, method, width)
    LOG.write(f"start {method.value} w{width} {before}->{ceiling(f)} left={self.left.get((method, width))}\n")


def keep(self, f, method, width):
    keep_before(self, f, method, width)
    LOG.write(f"keep {method.value} w{width} ceiling={ceiling(f)} rounds={getattr(f, 'rounds', None)}\n")


floor.PlainSteps.measure, floor.PlainSteps.start, floor.PlainSteps.keep = measure, start, keep
from specgen.cli.app import main  # noqa: E402

sys.argv = ["specgen", "serve", *sys.argv[1:]]
main()
