"""The lab's set-up step: fetch what it needs and build its images.

Everything comes from Debian packages (apt-get) and is cached under
lab/build/; running :func:`setup` again only redoes what is missing or stale.

Images (under lab/build/images/):

- ``vmlinuz``: the Debian cloud kernel, for virtual hosts and guests alike;
- ``host-base.cpio``: the virtual host's initramfs (busybox, kvm-amd, virtio,
  tun, bridge, netem, nbd, legacy pmem modules, QEMU, iproute2's ip and nbd-client with
  their libraries, QEMU's firmware);
- ``guest-initrd.cpio``: the guest's initramfs (busybox, virtio modules, the
  virtio-pmem ones loaded on request, an init that mounts the disk, starts
  services and reports on the console);
- ``guest-disk.ext4``: the guest's ext4 disk;
- ``host-initrd.cpio``: host-base plus a payload archive (the guest images and
  the kemari binaries), composed by :func:`host_initrd` before each run.
"""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from kemari_lab import paths
from kemari_lab.cpio import CpioWriter
from kemari_lab.errors import LabError

# Modules each side needs (dependencies are added from the modules' own
# "depends=" records, in load order).
HOST_MODULES = [
    "kvm_amd",
    "virtio_pci",
    "virtio_net",
    "virtio_blk",
    "tun",
    "bridge",
    "sch_netem",
    "nbd",
    # Legacy persistent memory (memmap=SIZE!OFFSET -> /dev/pmem0), for a
    # host's Warm-VM Reboot (docs/warm-reboot.md).
    "nd_e820",
    "nd_pmem",
]
GUEST_MODULES = [
    "virtio_mmio",
    "virtio_pci",
    "virtio_blk",
    "virtio_net",
]
# Loaded only by a guest whose data disk is a virtio-pmem device
# (klab.disk=pmem0: /dev/pmem0 mounted with -o dax, the warm-cache bench's
# dax guest, docs/warm-cache.md): listed apart in /etc/klab-modules-pmem,
# without what GUEST_MODULES already loads.
GUEST_PMEM_MODULES = ["virtio_pmem", "nd_pmem"]

# QEMU firmware files the nested QEMU needs for `-M pc -kernel` boots.
QEMU_FIRMWARE = [
    "bios-256k.bin",
    "kvmvapic.bin",
    "linuxboot_dma.bin",
    "linuxboot.bin",
    "pvh.bin",
    "qboot.rom",
    "bios-microvm.bin",
]

# Tools from Debian packages copied into the virtual host as /sbin/NAME, with
# their libraries (name -> the package that has it, see paths.HOST_PACKAGES).
# iproute2's ip: busybox ip lacks tuntap and bridge options, and this busybox
# prefers its applets to PATH, so it is called as /sbin/ip. nbd-client
# connects the kernel's NBD client (/dev/nbdN) to an export. kexec and
# mkfs.ext4: a host's Warm-VM Reboot (scripts/host-warm-reboot, docs/warm-reboot.md).
HOST_TOOLS = {"ip": "iproute2", "nbd-client": "nbd-client", "kexec": "kexec-tools", "mkfs.ext4": "e2fsprogs"}
# The operator's Warm-VM Reboot command, copied into each virtual host.
WARM_REBOOT_SCRIPT = paths.REPO_DIR / "scripts" / "host-warm-reboot"

GUEST_DISK_SIZE_MB = 32
# The one file on the guest's ext4 disk, /hello.txt.
GUEST_DISK_HELLO = "hello from the kemari lab disk\n"
# Binaries copied into each virtual host (kemarictl drives migrations there;
# kemari-agent is the fleet scenarios' host agent, docs/fleet.md).
KEMARI_BINARIES = ["kemari", "kemarictl", "kemari-agent"]
# Runs on this machine, in the lab namespace: the shared-disk NBD server, proxies.
KEMARI_NBD_BINARY = "kemari-nbd"

_INIT_DIR = Path(__file__).resolve().parent / "init"


def log(msg: str) -> None:
    """Progress messages go to stderr so that command output stays clean."""
    print(f"[lab] {msg}", file=sys.stderr, flush=True)


def run(cmd: list[str], **kwargs: object) -> subprocess.CompletedProcess[str]:
    """Runs a set-up command; failures name the command and show its output."""
    proc = subprocess.run(cmd, capture_output=True, text=True, check=False, **kwargs)  # type: ignore[call-overload]
    if proc.returncode != 0:
        raise LabError(f"set-up command failed ({proc.returncode}): {' '.join(cmd)}\n{proc.stdout}{proc.stderr}")
    return proc


# ---------------------------------------------------------------- packages


def ensure_host_packages(with_kemari: bool = False) -> None:
    """apt-get installs the tools the lab runs on this machine (and, with
    `with_kemari`, what building kemari needs), if missing."""
    missing = []
    for pkg in paths.HOST_PACKAGES + (paths.KEMARI_BUILD_PACKAGES if with_kemari else []):
        q = subprocess.run(["dpkg-query", "-W", "-f=${Status}", pkg], capture_output=True, text=True, check=False)
        if "install ok installed" not in q.stdout:
            missing.append(pkg)
    if not missing:
        return
    log(f"installing Debian packages: {' '.join(missing)}")
    run(["apt-get", "update"])
    run(["apt-get", "install", "-y", "--no-install-recommends", *missing], env={**os.environ, "DEBIAN_FRONTEND": "noninteractive"})


def kernel_version() -> str:
    """The Debian cloud kernel version, e.g. 6.1.0-56-cloud-amd64.

    Pinned by the first fetch (lab/build/cache/kernel-version) so that runs are
    reproducible; delete that file to move to a newer kernel.
    """
    pin = paths.CACHE_DIR / "kernel-version"
    if pin.exists():
        return pin.read_text().strip()
    out = subprocess.run(["apt-cache", "depends", paths.KERNEL_META_PACKAGE], capture_output=True, text=True, check=False).stdout
    m = re.search(r"Depends: linux-image-(\S+-cloud-amd64)", out)
    if m is None:
        run(["apt-get", "update"])
        out = run(["apt-cache", "depends", paths.KERNEL_META_PACKAGE]).stdout
        m = re.search(r"Depends: linux-image-(\S+-cloud-amd64)", out)
    if m is None:
        raise LabError(f"cannot find the kernel version from `apt-cache depends {paths.KERNEL_META_PACKAGE}`:\n{out}")
    paths.CACHE_DIR.mkdir(parents=True, exist_ok=True)
    pin.write_text(m.group(1) + "\n")
    return m.group(1)


def fetch_kernel() -> Path:
    """Downloads and unpacks the Debian cloud kernel package; returns its root."""
    ver = kernel_version()
    root = paths.CACHE_DIR / f"kernel-{ver}"
    if (root / "boot" / f"vmlinuz-{ver}").exists():
        return root
    paths.CACHE_DIR.mkdir(parents=True, exist_ok=True)
    pkg = f"linux-image-{ver}"
    debs = list(paths.CACHE_DIR.glob(f"{pkg}_*.deb"))
    if not debs:
        log(f"downloading {pkg}")
        run(["apt-get", "download", pkg], cwd=paths.CACHE_DIR)
        debs = list(paths.CACHE_DIR.glob(f"{pkg}_*.deb"))
    if not debs:
        raise LabError(f"apt-get download {pkg} left no .deb in {paths.CACHE_DIR}")
    tmp = Path(tempfile.mkdtemp(dir=paths.CACHE_DIR))
    run(["dpkg-deb", "-x", str(debs[0]), str(tmp)])
    tmp.rename(root)
    return root


# ---------------------------------------------------------------- modules


@dataclass
class KernelTree:
    """An unpacked kernel package: the image and a module index."""

    root: Path
    version: str

    @property
    def vmlinuz(self) -> Path:
        return self.root / "boot" / f"vmlinuz-{self.version}"

    @property
    def modules_dir(self) -> Path:
        return self.root / "lib" / "modules" / self.version

    def module_index(self) -> dict[str, Path]:
        """Module name (with '_') -> .ko path."""
        index = {}
        for ko in self.modules_dir.rglob("*.ko"):
            index[ko.stem.replace("-", "_")] = ko
        return index

    def resolve(self, wanted: list[str]) -> list[Path]:
        """The .ko files for `wanted` and their dependencies, in load order."""
        index = self.module_index()
        order: list[Path] = []
        seen: set[str] = set()

        def visit(name: str) -> None:
            name = name.replace("-", "_")
            if name in seen:
                return
            seen.add(name)
            ko = index.get(name)
            if ko is None:
                raise LabError(f"kernel {self.version} has no module {name}")
            m = re.search(rb"\x00depends=([^\x00]*)\x00", ko.read_bytes())
            deps = m.group(1).decode().split(",") if m and m.group(1) else []
            for dep in deps:
                visit(dep)
            order.append(ko)

        for name in wanted:
            visit(name)
        return order


# ---------------------------------------------------------------- initramfs


def _add_busybox(w: CpioWriter, skip: tuple[str, ...] = ()) -> None:
    busybox = shutil.which("busybox")
    if busybox is None:
        raise LabError("busybox not found: run the lab set-up (busybox-static)")
    ldd = subprocess.run(["ldd", busybox], capture_output=True, text=True, check=False)
    if "not a dynamic executable" not in ldd.stdout + ldd.stderr:
        raise LabError(f"{busybox} is not static: install busybox-static")
    w.add_file("bin/busybox", Path(busybox), 0o755)
    for applet in run([busybox, "--list-full"]).stdout.split():
        if applet in ("bin/busybox", "linuxrc") or applet.rsplit("/", 1)[-1] in skip:
            continue
        depth = applet.count("/")
        w.add_symlink(applet, "../" * (depth - 1) + "bin/busybox" if depth > 1 else "busybox")


def _add_modules(
    w: CpioWriter, tree: KernelTree, wanted: list[str], listing: str = "etc/klab-modules", skip: Sequence[str] = ()
) -> None:
    """The modules `wanted` and their dependencies (but those of `skip` and
    theirs, already added), with `listing` naming them in load order."""
    have = {ko.name for ko in tree.resolve(list(skip))}
    names = []
    for ko in tree.resolve(wanted):
        if ko.name in have:
            continue
        w.add_file(f"lib/modules/{ko.name}", ko, 0o644)
        names.append(ko.name)
    w.add_bytes(listing, ("\n".join(names) + "\n").encode())


def shared_libraries(binary: Path) -> list[Path]:
    """The shared libraries `binary` loads (from ldd), the loader included."""
    out = run(["ldd", str(binary)]).stdout
    libs = []
    for line in out.splitlines():
        line = line.strip()
        if "=>" in line:
            target = line.split("=>", 1)[1].split("(")[0].strip()
            if target and target != "not found":
                libs.append(Path(target))
            elif target == "not found":
                raise LabError(f"{binary}: shared library missing: {line}")
        elif line.startswith("/"):
            libs.append(Path(line.split()[0]))
    return libs


def _add_dynamic_binary(w: CpioWriter, binary: Path, dest: str, added: set[str], image: Path | None = None) -> None:
    """Adds `binary` (or `image`, a copy of it, such as a stripped one) and its libraries."""
    w.add_file(dest, image or binary, 0o755)
    for lib in shared_libraries(binary):
        key = str(lib).lstrip("/")
        if key not in added:
            added.add(key)
            w.add_file(key, lib, 0o755)


def _strip_debug(binary: Path) -> Path:
    """A copy of `binary` without its debug sections (symbols kept, so a panic's
    backtrace still names functions). The release builds' line tables are 4/5
    of their size; every byte of the initramfs is copied by an emulated CPU at
    each boot and hashed again by the kexec purgatory (docs/warm-reboot.md)."""
    objcopy = shutil.which("objcopy")
    if objcopy is None:
        raise LabError("objcopy not found (Debian package binutils): run the lab set-up with --kemari")
    out = paths.IMAGES_DIR / "bin" / binary.name
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(f".tmp{os.getpid()}")
    proc = subprocess.run([objcopy, "--strip-debug", str(binary), str(tmp)], capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        raise LabError(f"objcopy --strip-debug {binary} failed: {proc.stderr.strip()}")
    tmp.rename(out)
    return out


def _add_qemu(w: CpioWriter, added: set[str]) -> None:
    qemu = shutil.which("qemu-system-x86_64")
    if qemu is None:
        raise LabError("qemu-system-x86_64 not found: run the lab set-up")
    _add_dynamic_binary(w, Path(qemu), "usr/bin/qemu-system-x86_64", added)
    found = set()
    for share in (Path("/usr/share/qemu"), Path("/usr/share/seabios")):
        for name in QEMU_FIRMWARE:
            src = share / name
            if src.exists():
                w.add_file(f"{str(share).lstrip('/')}/{name}", src.resolve(), 0o644)
                found.add(name)
    if "bios-256k.bin" not in found:
        raise LabError("QEMU firmware bios-256k.bin not found (Debian package seabios)")


def _host_tool(name: str) -> Path:
    """The path of one of HOST_TOOLS on this machine."""
    found = shutil.which(name) or shutil.which(name, path="/usr/sbin:/sbin")
    if found is None:
        raise LabError(f"{name} not found (Debian package {HOST_TOOLS[name]}): run the lab set-up")
    return Path(found)


def _inputs_digest(*parts: object) -> str:
    h = hashlib.sha256()
    # This builder's own source: changing how images are made remakes them.
    h.update(Path(__file__).read_bytes())
    for p in parts:
        if isinstance(p, Path):
            st = p.stat()
            h.update(f"{p}:{st.st_size}:{st.st_mtime_ns}".encode())
        else:
            h.update(repr(p).encode())
    return h.hexdigest()


def _fresh(target: Path, digest: str) -> bool:
    stamp = target.with_suffix(target.suffix + ".digest")
    return target.exists() and stamp.exists() and stamp.read_text() == digest


def _stamp(target: Path, digest: str) -> None:
    target.with_suffix(target.suffix + ".digest").write_text(digest)


def build_host_base(tree: KernelTree) -> Path:
    """The virtual host's initramfs without the payload."""
    out = paths.IMAGES_DIR / "host-base.cpio"
    init = _INIT_DIR / "host-init.sh"
    qemu = Path(shutil.which("qemu-system-x86_64") or "/usr/bin/qemu-system-x86_64")
    tools = [_host_tool(name) for name in HOST_TOOLS]
    digest = _inputs_digest(tree.version, HOST_MODULES, QEMU_FIRMWARE, init, qemu, *tools, init.read_bytes())
    if _fresh(out, digest):
        return out
    log("building the virtual host initramfs")
    tmp = out.with_suffix(f".tmp{os.getpid()}")
    with tmp.open("wb") as f:
        w = CpioWriter(f)
        for d in ("dev", "proc", "sys", "tmp", "run", "mnt", "lab", "root", "etc"):
            w.add_dir(d)
        _add_busybox(w, skip=tuple(HOST_TOOLS))
        _add_modules(w, tree, HOST_MODULES)
        added: set[str] = set()
        _add_qemu(w, added)
        for name, path in zip(HOST_TOOLS, tools):
            _add_dynamic_binary(w, path, f"sbin/{name}", added)
        w.add_file("init", init, 0o755)
        w.close()
    tmp.rename(out)
    _stamp(out, digest)
    return out


def build_guest_initrd(tree: KernelTree) -> Path:
    """The guest's initramfs."""
    out = paths.IMAGES_DIR / "guest-initrd.cpio"
    init = _INIT_DIR / "guest-init.sh"
    digest = _inputs_digest(tree.version, GUEST_MODULES, GUEST_PMEM_MODULES, init, init.read_bytes())
    if _fresh(out, digest):
        return out
    log("building the guest initramfs")
    tmp = out.with_suffix(f".tmp{os.getpid()}")
    with tmp.open("wb") as f:
        w = CpioWriter(f)
        for d in ("dev", "proc", "sys", "tmp", "run", "mnt", "root", "etc"):
            w.add_dir(d)
        _add_busybox(w)
        _add_modules(w, tree, GUEST_MODULES)
        _add_modules(w, tree, GUEST_PMEM_MODULES, "etc/klab-modules-pmem", skip=GUEST_MODULES)
        w.add_file("init", init, 0o755)
        w.close()
    tmp.rename(out)
    _stamp(out, digest)
    return out


def build_guest_disk() -> Path:
    """A small ext4 image with a known file (mkfs.ext4 -d, no root needed)."""
    out = paths.IMAGES_DIR / "guest-disk.ext4"
    digest = _inputs_digest(GUEST_DISK_SIZE_MB, "v1")
    if _fresh(out, digest):
        return out
    log("building the guest ext4 disk")
    with tempfile.TemporaryDirectory() as d:
        (Path(d) / "hello.txt").write_text(GUEST_DISK_HELLO)
        tmp = out.with_suffix(f".tmp{os.getpid()}")
        tmp.unlink(missing_ok=True)
        run(["mkfs.ext4", "-q", "-F", "-L", "klabdisk", "-d", d, str(tmp), f"{GUEST_DISK_SIZE_MB}M"])
        tmp.rename(out)
    _stamp(out, digest)
    return out


def kemari_binaries() -> list[Path]:
    """The kemari binaries from `cargo build --release`, if built."""
    rel = paths.RELEASE_DIR
    return [rel / b for b in KEMARI_BINARIES if (rel / b).exists()]


def kemari_nbd_binary() -> Path | None:
    """The kemari-nbd binary from `cargo build --release`, if built."""
    path = paths.RELEASE_DIR / KEMARI_NBD_BINARY
    return path if path.exists() else None


def build_kemari() -> None:
    """cargo build --release of kemari and kemarictl (used inside virtual hosts)
    and of kemari-nbd (the lab's shared-disk server)."""
    log("cargo build --release -p kemari -p kemari-nbd")
    env = dict(os.environ, CARGO_TARGET_DIR=str(paths.RELEASE_TARGET_DIR))
    proc = subprocess.run(
        ["cargo", "build", "--release", "-p", "kemari", "-p", "kemari-nbd"], cwd=paths.REPO_DIR, env=env, check=False
    )
    if proc.returncode != 0:
        raise LabError("cargo build --release -p kemari -p kemari-nbd failed")


def host_initrd(tree: KernelTree) -> Path:
    """host-base.cpio + a payload archive with the guest images and kemari."""
    base = build_host_base(tree)
    guest_initrd = build_guest_initrd(tree)
    disk = build_guest_disk()
    bins = kemari_binaries()
    out = paths.IMAGES_DIR / "host-initrd.cpio"
    digest = _inputs_digest(base, guest_initrd, disk, tree.vmlinuz, *bins, WARM_REBOOT_SCRIPT.read_bytes())
    if _fresh(out, digest):
        return out
    log("composing the virtual host initramfs with its payload")
    tmp = out.with_suffix(f".tmp{os.getpid()}")
    with tmp.open("wb") as f:
        with base.open("rb") as b:
            shutil.copyfileobj(b, f)
        w = CpioWriter(f)
        w.add_file("lab/guest/vmlinuz", tree.vmlinuz, 0o644)
        w.add_file("lab/guest/initrd.cpio", guest_initrd, 0o644)
        w.add_file("lab/guest/disk.ext4", disk, 0o644)
        w.add_file("usr/bin/host-warm-reboot", WARM_REBOOT_SCRIPT, 0o755)
        added: set[str] = set()
        for binary in bins:
            _add_dynamic_binary(w, binary, f"usr/bin/{binary.name}", added, image=_strip_debug(binary))
        w.close()
    tmp.rename(out)
    _stamp(out, digest)
    return out


@dataclass
class Images:
    """Paths of the built images."""

    vmlinuz: Path
    host_initrd: Path
    has_kemari: bool
    # The guest's ext4 image on this machine (the shared disk is a copy of it).
    guest_disk: Path


def setup(with_kemari: bool = False) -> Images:
    """The whole set-up step (idempotent)."""
    ensure_host_packages(with_kemari)
    paths.IMAGES_DIR.mkdir(parents=True, exist_ok=True)
    root = fetch_kernel()
    tree = KernelTree(root, kernel_version())
    if with_kemari:
        build_kemari()
    initrd = host_initrd(tree)
    return Images(
        vmlinuz=tree.vmlinuz,
        host_initrd=initrd,
        has_kemari=bool(kemari_binaries()),
        guest_disk=build_guest_disk(),
    )
