"""A newer QEMU for the virtual hosts, unpacked beside the system's: Debian
bookworm-backports' qemu-system-x86, -common and -data, fetched from the
Debian archive — the suite's InRelease checked with gpgv against Debian's
archive keyring, the package index against InRelease's SHA-256, each
package against the index's — and unpacked with
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
INDEX = "main/binary-amd64/Packages.xz"
KEYRING = "/usr/share/keyrings/debian-archive-keyring.gpg"


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


def index_digest(release: str, index: str = INDEX) -> str:
    """The SHA-256 a (verified) Release text gives for `index`."""
    section = ""
    for line in release.splitlines():
        if line and not line[0].isspace():
            section = line.split(":", 1)[0]
            continue
        parts = line.split()
        if section == "SHA256" and len(parts) == 3 and parts[2] == index:
            return parts[0]
    raise LabError(f"{SUITE}'s Release has no SHA-256 for {index}")


def verified_release(signed: bytes) -> str:
    """The text of an InRelease file whose signature gpgv accepts with
    Debian's archive keyring; anything else is an error."""
    r = subprocess.run(
        ["gpgv", "--keyring", KEYRING, "--output", "-", "-"], input=signed, capture_output=True, check=False
    )
    if r.returncode != 0:
        raise LabError(f"{SUITE}'s InRelease: bad or unknown signature ({r.stderr.decode(errors='replace').strip()})")
    return r.stdout.decode()


def _checked(data: bytes, digest: str, what: str) -> bytes:
    if hashlib.sha256(data).hexdigest() != digest:
        raise LabError(f"{what}: SHA-256 differs from the signed archive's")
    return data


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
    release = verified_release(_get(f"{MIRROR}/dists/{SUITE}/InRelease"))
    packed = _checked(_get(f"{MIRROR}/dists/{SUITE}/{INDEX}"), index_digest(release), INDEX)
    pkgs = parse_packages(lzma.decompress(packed).decode())
    version = pkgs["qemu-system-x86"]["Version"].replace(":", "_")
    root = paths.CACHE_DIR / f"qemu-{version}"
    if (root / "usr/bin/qemu-system-x86_64").is_file():
        return root
    paths.CACHE_DIR.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=paths.CACHE_DIR))
    try:
        for name, p in pkgs.items():
            data = _checked(_get(f"{MIRROR}/{p['Filename']}"), p["SHA256"], p["Filename"])
            deb = tmp / f"{name}.deb"
            deb.write_bytes(data)
            subprocess.run(["dpkg-deb", "-x", str(deb), str(tmp / "root")], check=True)
            deb.unlink()
        (tmp / "root").rename(root)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return root
