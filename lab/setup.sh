#!/bin/sh
# The lab's set-up step: Debian packages, the Debian cloud kernel, the virtual
# host and guest images, cached under lab/build/ (idempotent).
#   lab/setup.sh            images only
#   lab/setup.sh --kemari   also cargo build --release kemari, kemarictl and kemari-nbd
set -e
cd "$(dirname "$0")"
exec python3 -m kemari_lab setup "$@"
