"""The project's one exception type: an expected failure with a one-line message."""


class Cudal2Error(Exception):
    """A failure the user can act on (bad input, missing tool, no GPU).

    The CLI prints its message on one line and exits with code 1; anything else that
    escapes is a bug and keeps its traceback.
    """
