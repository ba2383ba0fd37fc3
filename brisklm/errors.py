"""User-facing errors: the CLI prints their message on one line and exits with 2."""
import contextlib


class BriskError(Exception):
    """A problem with the user's input (file, field or value), not a bug."""


@contextlib.contextmanager
def as_user_error():
    """A ValueError raised inside (a bad value the caller gave a lower layer) as a BriskError."""
    try:
        yield
    except ValueError as e:
        raise BriskError(str(e)) from None
