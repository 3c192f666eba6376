"""Exit codes and the stop signals of a long job (a run, a training), importable before torch (``python -m sdvg``
guards its imports with it). Exit codes (README, "errors and faults"): 0 done; 2 a bad input refused before anything
loads, a fault in a block (the finished blocks are written) or an output that could not be written; 130 Ctrl-C;
143 SIGTERM."""

from __future__ import annotations

import signal

EXIT_OK, EXIT_ERROR, EXIT_CANCELLED, EXIT_SIGTERM = 0, 2, 130, 143


class StopSignals:
    """Ctrl-C (SIGINT) and SIGTERM (container stops, ``timeout``, job schedulers) during a run or a training: the
    first stops after the current step and what is finished is written; a second one aborts."""

    NAMES = {signal.SIGINT: "Ctrl-C", signal.SIGTERM: "SIGTERM"}

    def __init__(self, log) -> None:
        self.log = log
        self.received: int | None = None
        self._previous: dict = {}

    def __enter__(self) -> StopSignals:
        self._previous = {sig: signal.signal(sig, self._handle) for sig in self.NAMES}
        return self

    def __exit__(self, *exc) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)

    def _handle(self, signum, frame) -> None:
        if self.received is not None:  # the second signal: abort now
            if signum == signal.SIGTERM:
                raise SystemExit(EXIT_SIGTERM)
            raise KeyboardInterrupt
        self.received = signum
        self.log(f"\n{self.NAMES[signum]}: stopping after the current step and writing what is finished "
                 f"({self.NAMES[signum]} again to abort).")

    def requested(self) -> bool:
        return self.received is not None

    @property
    def exit_code(self) -> int:
        return EXIT_SIGTERM if self.received == signal.SIGTERM else EXIT_CANCELLED
