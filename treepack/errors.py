"""Exceptions the library raises; the CLI maps every one of them to ``Error: <message>`` and exit 1."""


class TreepackError(Exception):
    """Base class: the message is complete and fit to show a user on one line."""


class InputError(TreepackError):
    """Bad input data: the message names the file, the line (or row) and the field."""


class CapacityError(TreepackError):
    """A sequence does not fit the packing capacity."""


class ConfigError(TreepackError):
    """A bad configuration value or key."""
