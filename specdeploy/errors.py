"""The one exception type a user sees: its message is the whole one-line explanation."""


class SpecdeployError(Exception):
    """Bad input or an unusable artifact; the CLI prints the message and exits non-zero."""
