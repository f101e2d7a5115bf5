#!/bin/bash
# Kept for its old command line: scripts/multifd-bench.sh RUNS "1 N" runs
# scripts/multifd-bench.py --runs RUNS --connections N (which also runs
# QEMU plain and multifd, and measures each side's CPU; see its --help).
#   flock /work/bench.lock scripts/multifd-bench.sh 3 "1 4"
set -euo pipefail
conns=${2:-"1 4"}
exec python3 "$(dirname "$0")/multifd-bench.py" --runs "${1:-3}" --connections "${conns##* }"
