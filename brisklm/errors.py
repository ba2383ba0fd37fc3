"""User-facing errors: the CLI prints their message on one line and exits with 2."""


class BriskError(Exception):
    """A problem with the user's input (file, field or value), not a bug."""
