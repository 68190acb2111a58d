"""User-facing errors. Anything raised as `LeantrainError` is the user's to fix (bad config,
missing file, unknown preset); the CLI prints its message on one line and exits with code 2."""


class LeantrainError(ValueError):
    """An input problem the user can act on; the message names the field and what was expected."""
