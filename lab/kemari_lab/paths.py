"""Where the lab keeps things. Everything built or fetched lives under lab/build/."""

import os
from pathlib import Path

LAB_DIR = Path(__file__).resolve().parent.parent
REPO_DIR = LAB_DIR.parent
BUILD_DIR = LAB_DIR / "build"
CACHE_DIR = BUILD_DIR / "cache"
IMAGES_DIR = BUILD_DIR / "images"
RUNS_DIR = BUILD_DIR / "runs"
# Where `cargo build --release` puts kemari for the virtual hosts: the
# workspace's target/release, or KEMARI_RELEASE_TARGET_DIR/release (CI builds
# it there while the tests run: scripts/test.sh).
RELEASE_TARGET_DIR = Path(os.environ.get("KEMARI_RELEASE_TARGET_DIR") or REPO_DIR / "target")
RELEASE_DIR = RELEASE_TARGET_DIR / "release"

# Debian packages the lab needs on this machine (apt-get install).
HOST_PACKAGES = ["qemu-system-x86", "qemu-utils", "seabios", "busybox-static", "e2fsprogs", "iproute2", "kmod", "nbd-client", "kexec-tools"]
# What `setup --kemari`'s cargo build needs besides Rust (protoc: the etcd
# client's gRPC code; scripts/setup.sh has the full list for tests and benches).
KEMARI_BUILD_PACKAGES = ["build-essential", "pkg-config", "libssl-dev", "protobuf-compiler", "libprotobuf-dev"]
# The kernel meta-package whose dependency names the exact kernel version.
KERNEL_META_PACKAGE = "linux-image-cloud-amd64"
