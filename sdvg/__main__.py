"""``python -m sdvg``."""

import os
import sys

# numpy's OpenBLAS starts (cores - 1) worker threads when numpy loads (torch imports it) and joins them at exit; that
# join once hung forever after a long CPU run. SDVG never uses numpy's BLAS (torch has its own), so one BLAS thread
# costs nothing and leaves no worker to join. Set before anything imports numpy, unless the user chose a value.
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

from .stop import EXIT_CANCELLED  # noqa: E402 - no torch: constants and signal handling only

try:  # Ctrl-C while torch and the rest import (seconds): a plain exit 130, not a traceback out of some import
    from .cli.commands import main
except KeyboardInterrupt:
    sys.stderr.write("aborted\n")
    sys.exit(EXIT_CANCELLED)

sys.exit(main())
