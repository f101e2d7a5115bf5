#!/usr/bin/env bash
# The test command: set up the machine, build the test guest, run every test.
#   scripts/test.sh            # unit + integration tests (boot real guests on /dev/kvm)
#   KEMARI_LAB=1 scripts/test.sh   # also the lab (QEMU/TCG virtual hosts, a few minutes)
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
cargo build -p guest --target x86_64-unknown-none --release
cargo test --workspace --features kemari/fault-injection -- --test-threads=2
if [[ "${KEMARI_LAB:-0}" == 1 ]]; then
  sh lab/ci.sh
fi
