"""``python -m sdvg``."""

import os
import sys

# numpy's OpenBLAS starts (cores - 1) worker threads when numpy loads (torch imports it) and joins them at exit; that
# join once hung forever after a long CPU run. SDVG never uses numpy's BLAS (torch has its own), so one BLAS thread
# costs nothing and leaves no worker to join. Set before anything imports numpy, unless the user chose a value.
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

from .cli.commands import main  # noqa: E402

sys.exit(main())
