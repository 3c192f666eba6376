"""``python -m sdvg``: the command line (``commands``) and the arguments its subcommands share (``args``)."""
