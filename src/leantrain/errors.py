"""User-facing errors. Anything raised as `LeantrainError` is the user's to fix (bad config,
missing file, unknown preset); the CLI prints its message on one line and exits with code 2."""


class LeantrainError(ValueError):
    """An input problem the user can act on; the message names the field and what was expected."""


class NotBuiltError(LeantrainError, NotImplementedError):
    """Settings that are each valid but whose combination is not built yet; the message names
    the settings and what runs instead. A `LeantrainError` (the CLI prints one line) and a
    `NotImplementedError` (it is ours to build, not the user's mistake)."""
