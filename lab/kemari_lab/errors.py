"""The lab's one error type."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager


class LabError(Exception):
    """Anything in the lab that failed: set-up, a virtual host, a command."""


@contextmanager
def step(what: str) -> Iterator[None]:
    """Names the scenario step in any LabError raised inside it."""
    try:
        yield
    except LabError as e:
        raise LabError(f"{what}: {e}") from None
