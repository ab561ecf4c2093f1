"""``python -m timeslice.cli``: the ``timeslice`` command."""

from timeslice.cli.main import entry

entry()
