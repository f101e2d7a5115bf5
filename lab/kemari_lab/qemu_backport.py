"""A newer QEMU for the virtual hosts, unpacked beside the system's: Debian
bookworm-backports' qemu-system-x86, -common and -data, fetched from the
Debian archive, checked against the archive's SHA-256 and unpacked with
``dpkg-deb -x`` under lab/build/cache/ — nothing installed. Run with
``KEMARI_LAB_QEMU=<the directory printed>`` (vhost.qemu_binary); docs/lab.md,
"Platform faults", says why and what it changed.
"""

from __future__ import annotations

import hashlib
import lzma
import shutil
import subprocess
import tempfile
import urllib.request
from pathlib import Path

from kemari_lab import paths
from kemari_lab.errors import LabError

MIRROR = "http://deb.debian.org/debian"
SUITE = "bookworm-backports"
PACKAGES = ("qemu-system-x86", "qemu-system-common", "qemu-system-data")


def parse_packages(index: str, wanted: tuple[str, ...] = PACKAGES) -> dict[str, dict[str, str]]:
    """The newest stanza of each wanted package in a Debian ``Packages``
    index: its Version, Filename and SHA256. A package missing is an error."""
    found: dict[str, dict[str, str]] = {}
    for stanza in index.split("\n\n"):
        fields: dict[str, str] = {}
        for line in stanza.splitlines():
            if line and not line[0].isspace() and ":" in line:
                key, _, value = line.partition(":")
                fields[key] = value.strip()
        name = fields.get("Package")
        if name not in wanted or not {"Version", "Filename", "SHA256"} <= fields.keys():
            continue
        old = found.get(name)
        if old is None or _newer(fields["Version"], old["Version"]):
            found[name] = {k: fields[k] for k in ("Version", "Filename", "SHA256")}
    missing = [p for p in wanted if p not in found]
    if missing:
        raise LabError(f"{SUITE} lists no {', '.join(missing)}")
    return found


def _newer(a: str, b: str) -> bool:
    """Whether Debian version `a` is newer than `b` (dpkg decides)."""
    return subprocess.run(["dpkg", "--compare-versions", a, "gt", b], check=False).returncode == 0


def _get(url: str) -> bytes:
    try:
        with urllib.request.urlopen(url, timeout=120) as r:
            return r.read()
    except OSError as e:
        raise LabError(f"cannot fetch {url}: {e}") from e


def fetch() -> Path:
    """Fetches and unpacks the backported QEMU (once); returns the directory
    to give as KEMARI_LAB_QEMU."""
    index = lzma.decompress(_get(f"{MIRROR}/dists/{SUITE}/main/binary-amd64/Packages.xz")).decode()
    pkgs = parse_packages(index)
    version = pkgs["qemu-system-x86"]["Version"].replace(":", "_")
    root = paths.CACHE_DIR / f"qemu-{version}"
    if (root / "usr/bin/qemu-system-x86_64").is_file():
        return root
    paths.CACHE_DIR.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=paths.CACHE_DIR))
    try:
        for name, p in pkgs.items():
            data = _get(f"{MIRROR}/{p['Filename']}")
            if hashlib.sha256(data).hexdigest() != p["SHA256"]:
                raise LabError(f"{p['Filename']}: SHA-256 differs from the archive's index")
            deb = tmp / f"{name}.deb"
            deb.write_bytes(data)
            subprocess.run(["dpkg-deb", "-x", str(deb), str(tmp / "root")], check=True)
            deb.unlink()
        (tmp / "root").rename(root)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return root
