#!/bin/sh
# The lab in CI: set-up (Debian packages, kernel, images, kemari release build),
# then the harness and acceptance tests. Needs root. Takes a few minutes.
set -e
cd "$(dirname "$0")"
./setup.sh --kemari
exec python3 -m pytest -v --durations=0 tests/
