import sys

import specgen.runtime.lean as lean

lean.SHARED_SCALE_ROWS = int(sys.argv.pop(1))
from specgen.cli.app import app  # noqa: E402 (after the constant is set)

app()
