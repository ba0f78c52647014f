"""``python -m forge``: the ``forge-rs`` command line (quantize, inspect, verify).

Runs the same Rust CLI code as the ``forge-rs`` binary, compiled into the extension module, so a
source install without the binary still has the full command line. ``main`` is also the
``forge-rs`` console-script entry point.
"""

from __future__ import annotations

import signal
import sys

from . import _native


def main(argv: list[str] | None = None) -> int:
    """Runs the CLI on ``argv`` (default ``sys.argv``) and returns its exit code."""
    args = list(sys.argv if argv is None else argv)
    if args:
        args[0] = "forge-rs"
    # Ctrl-C stops the run at once, as it does for the binary; `--resume` continues it.
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    sys.stdout.flush()
    return int(_native.cli_main(args))


if __name__ == "__main__":
    sys.exit(main())
