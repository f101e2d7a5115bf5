"""The lab's one error type."""


class LabError(Exception):
    """Anything in the lab that failed: set-up, a virtual host, a command."""
