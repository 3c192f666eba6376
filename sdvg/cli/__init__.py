"""``python -m sdvg``: the command line (``commands``) and the arguments its subcommands share (``args``)."""

from ..facade import lazy_exports

__getattr__, __dir__, __all__ = lazy_exports(__name__, {"commands": "build_parser main"})
