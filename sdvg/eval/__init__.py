"""``python -m sdvg eval``: the quality-vs-speed evaluation (``run``), its summary with bootstrap intervals and its
Ray twin."""
