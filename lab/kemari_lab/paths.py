"""Where the lab keeps things. Everything built or fetched lives under lab/build/."""

from pathlib import Path

LAB_DIR = Path(__file__).resolve().parent.parent
REPO_DIR = LAB_DIR.parent
BUILD_DIR = LAB_DIR / "build"
CACHE_DIR = BUILD_DIR / "cache"
IMAGES_DIR = BUILD_DIR / "images"
RUNS_DIR = BUILD_DIR / "runs"

# Debian packages the lab needs on this machine (apt-get install).
HOST_PACKAGES = ["qemu-system-x86", "qemu-utils", "seabios", "busybox-static", "e2fsprogs", "iproute2", "kmod", "nbd-client", "kexec-tools"]
# The kernel meta-package whose dependency names the exact kernel version.
KERNEL_META_PACKAGE = "linux-image-cloud-amd64"
