#!/usr/bin/env bash
# The test command: set up the machine, build the test guest, run every test.
#   scripts/test.sh            # unit + integration tests (boot real guests on /dev/kvm)
#   KEMARI_LAB=1 scripts/test.sh   # also the lab (QEMU/TCG virtual hosts, a few minutes)
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
cargo build -p guest --target x86_64-unknown-none --release
if [[ "${KEMARI_LAB:-0}" == 1 ]]; then
  # The lab's release build (kemari inside the virtual hosts) starts now in
  # its own target folder, at the lowest priority: it takes the CPU the tests
  # leave idle, and its cargo lock is not the one the tests' guest builds
  # take. lab/setup.sh's build waits for it (same folder) and reports errors.
  export KEMARI_RELEASE_TARGET_DIR=${KEMARI_RELEASE_TARGET_DIR:-$PWD/target/lab}
  mkdir -p "$KEMARI_RELEASE_TARGET_DIR"
  CARGO_TARGET_DIR=$KEMARI_RELEASE_TARGET_DIR nice -n 19 \
    cargo build --release --locked -p kemari -p kemari-nbd \
    >"$KEMARI_RELEASE_TARGET_DIR/background-build.log" 2>&1 &
  lab_build=$!
  trap 'kill "$lab_build" 2>/dev/null || true' EXIT
fi
cargo test --workspace --features kemari/fault-injection -- --test-threads=2
# The bench scripts' own logic (what they report), on fixtures and loopback.
python3 -m pytest -q scripts/tests
if [[ "${KEMARI_LAB:-0}" == 1 ]]; then
  wait "$lab_build" || echo "test: the lab's background release build failed; lab/setup.sh builds again and shows why"
  sh lab/ci.sh
fi
