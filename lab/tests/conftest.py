"""pytest set-up: make kemari_lab importable and skip lab tests where they cannot run."""

from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def lab_unavailable() -> str | None:
    """Why virtual hosts cannot run here, or None."""
    if os.geteuid() != 0:
        return "the lab needs root (network namespaces, TAPs)"
    if shutil.which("ip") is None:
        return "iproute2 is missing"
    return None


@pytest.fixture(scope="session")
def lab_images():  # type: ignore[no-untyped-def]
    """Runs the lab's set-up step once per session (cached under lab/build/)."""
    reason = lab_unavailable()
    if reason:
        pytest.skip(reason)
    from kemari_lab import images

    return images.setup()
