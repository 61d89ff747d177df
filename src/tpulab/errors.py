"""The one exception type users see: a one-line message, a non-zero exit, no traceback."""


class TpulabError(Exception):
    """A problem with the user's input or environment, stated in one line.

    The CLI prints ``error: <message>`` and exits with ``exit_code``; anything else is a bug and
    keeps its traceback.
    """

    exit_code = 2

    def __init__(self, message: str, exit_code: int | None = None):
        super().__init__(" ".join(str(message).split()))
        if exit_code is not None:
            self.exit_code = exit_code


class ConfigError(TpulabError):
    """A config key or value that cannot be used."""


class CheckpointError(TpulabError):
    """A checkpoint that is missing, corrupt or belongs to another run."""
