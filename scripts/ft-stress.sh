#!/usr/bin/env bash
# Fault-tolerance stress: the primary is killed with SIGKILL at a random
# moment, N times (default 50), each with a fresh protected guest (counter,
# flushed disk writes, a byte-checked TCP echo stream); every run checks that
# the standby took over within the timeout + 1 s, the stream continued
# byte-exact, every acknowledged block verifies and the counter went on.
#   scripts/ft-stress.sh [N]
set -euo pipefail
cd "$(dirname "$0")/.."
runs="${1:-50}"
scripts/setup.sh
cargo build -p guest --target x86_64-unknown-none --release
KEMARI_FT_KILLS="$runs" cargo test -p kemari --test fault_tolerance \
  primary_killed_at_random_moments -- --nocapture 2>&1 |
  grep --line-buffered -E -A3 "^run |failover after|test result|panicked|FAILED" |
  grep --line-buffered -vE "^(--|note:|stack backtrace)"
