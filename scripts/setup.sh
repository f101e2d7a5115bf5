#!/usr/bin/env bash
# Installs everything kemari's build, tests, demo and benchmarks need on a fresh
# Debian 12 machine (run as root). Idempotent: only what is missing is installed.
#   scripts/setup.sh             # build, tests, demo, benchmarks
#   scripts/setup.sh --package   # also cargo-deb (scripts/package.sh)
set -euo pipefail

packages=(
  build-essential binutils pkg-config  # as/ld for the PVH stub kernel used by tests
  qemu-system-x86 qemu-utils           # peer VMM for benchmarks; lab virtual hosts
  busybox-static cpio e2fsprogs        # lab images, ext4 disk images
  nbdkit libnbd-bin fio                # NBD peers and clients
  libssl-dev openssl                   # kemari-nbd's TLS (openssl crate); test certificates
  iproute2 iputils-ping socat          # TAP devices, namespaces
  hyperfine python3
  prometheus                           # promtool: `promtool check metrics` on GET /metrics
  protobuf-compiler libprotobuf-dev    # protoc and its well-known types: the etcd client's gRPC code (etcd-client crate)
  etcd-server etcd-client              # the etcd fence's tests: a 3-member cluster, etcdctl
  resource-agents libxml2-utils        # ocf-tester, ocf-shellfuncs, xmllint: the Pacemaker agent's test
  chromium                             # the fleet page's test: headless screenshot and DOM
)
missing=()
for p in "${packages[@]}"; do
  dpkg -s "$p" >/dev/null 2>&1 || missing+=("$p")
done
if ((${#missing[@]})); then
  echo "setup: installing ${missing[*]}"
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq
  apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
fi

if ! command -v cargo >/dev/null; then
  echo "setup: cargo not found; install Rust with rustup first" >&2
  exit 1
fi
rustup target list --installed | grep -qx x86_64-unknown-none \
  || rustup target add x86_64-unknown-none
rustup component list --installed | grep -q '^clippy' || rustup component add clippy rustfmt
# Supply-chain checks (deny.toml, scripts/deny.sh): built once, kept in ~/.cargo/bin.
if ! cargo deny --version >/dev/null 2>&1; then
  echo "setup: installing cargo-deny (a few minutes, once)"
  nice -n 19 cargo install --locked cargo-deny
fi
# The Debian package (scripts/package.sh, `scripts/setup.sh --package`):
# cargo-deb, built once and kept in ~/.cargo/bin; not for the tests.
if [[ "${1:-}" == --package ]] && ! cargo deb --version >/dev/null 2>&1; then
  echo "setup: installing cargo-deb (a few minutes, once)"
  nice -n 19 cargo install --locked cargo-deb
fi
echo "setup: done"
python3 -m pytest --version >/dev/null 2>&1 || python3 -m pip install -q pytest
