"""The command line's exit codes (README, "errors and faults"): 0 done; 2 a bad input refused before anything loads,
a fault in a block (the finished blocks are written) or an output that could not be written; 130 Ctrl-C; 143 SIGTERM.
A module of its own, importable before torch (``python -m sdvg`` guards its imports with it)."""

EXIT_OK, EXIT_ERROR, EXIT_CANCELLED, EXIT_SIGTERM = 0, 2, 130, 143
