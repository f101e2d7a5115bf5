#!/usr/bin/env bash
# The Debian package, built from the workspace by cargo-deb
# ([package.metadata.deb] in crates/kemari/Cargo.toml; docs/operations.md):
#   scripts/package.sh           # target/debian/kemari_<version>-1_<arch>.deb
#   scripts/package.sh --check   # then install it here, check it, remove it (CI; root)
# The release build is reused when it is current (lab/setup.sh --kemari makes
# the same one); man pages and completions are rendered into target/ from
# the binaries' clap definitions (crates/xtask), never committed.
set -euo pipefail
cd "$(dirname "$0")/.."
start=$(date +%s)
check=0
compression=()
if [[ "${1:-}" == --check ]]; then
  check=1
  compression=(--fast)   # the same files, compressed in half the time
fi
scripts/setup.sh --package
# CI builds the lab's release binaries in their own folder (scripts/test.sh).
if [[ -n "${KEMARI_RELEASE_TARGET_DIR:-}" ]]; then
  export CARGO_TARGET_DIR=$KEMARI_RELEASE_TARGET_DIR
fi
cargo build --release --locked -p kemari -p kemari-nbd -p xtask
target=$(cargo metadata --format-version 1 --no-deps --locked \
  | python3 -c 'import json, sys; print(json.load(sys.stdin)["target_directory"])')
docs="$target/release/deb-docs"
rm -rf "$docs"
"$target/release/xtask" man "$docs/man"
gzip -9n "$docs"/man/*.1
"$target/release/xtask" completions "$docs/completions"
# Stripped, as Debian ships binaries (the release build keeps its line tables).
deb=$(cargo deb -p kemari --no-build --strip "${compression[@]}" --quiet)
echo "package: $deb ($(du -h "$deb" | cut -f1), built in $(( $(date +%s) - start ))s)"
((check)) || exit 0

# The check: install, run, read, verify, remove. A kemari installed here by
# someone else is never replaced (nor removed at the end).
if dpkg -s kemari >/dev/null 2>&1; then
  echo "package: the Debian package kemari is installed on this machine already;" \
       "not replacing it (remove it first: dpkg -r kemari)" >&2
  exit 1
fi
trap 'dpkg -r kemari >/dev/null 2>&1 || true' EXIT
dpkg -i "$deb"
for bin in kemari kemarictl kemari-agent kemari-nbd; do
  /usr/bin/$bin --version
done
for page in kemari kemarictl kemari-agent kemari-nbd kemarictl-migrate kemarictl-fleet kemari-nbd-proxy; do
  man -w "$page" >/dev/null
done
page=$(man kemari 2>/dev/null)
grep -q -- "--api-socket" <<<"$page"
grep -q "EXIT STATUS" <<<"$page"
sed -n 1,6p <<<"$page"
bash -c 'source /usr/share/bash-completion/completions/kemarictl && complete -p kemarictl' >/dev/null
# The host setting the package brings (applied at boot, not here).
grep -q "^w /sys/kernel/mm/transparent_hugepage/shmem_enabled .* advise$" /usr/lib/tmpfiles.d/kemari.conf
for f in /usr/share/zsh/vendor-completions/_kemari /usr/share/fish/vendor_completions.d/kemari-nbd.fish; do
  test -s "$f"
done
if command -v systemd-analyze >/dev/null; then
  # Instances of the templates, as systemd would load them (offline).
  for unit in kemari@check.service kemari-nbd@check.service; do
    out=$(systemd-analyze verify "$unit" 2>&1) || { echo "$out" >&2; exit 1; }
    # verify exits 0 on some warnings: any line about our units fails.
    if grep -i "kemari" <<<"$out" >&2; then
      echo "package: systemd-analyze verify $unit warns (above)" >&2
      exit 1
    fi
  done
  echo "package: systemd-analyze verify: both units pass"
else
  echo "package: systemd-analyze not found: the units are NOT verified"
fi
dpkg -r kemari >/dev/null
trap - EXIT
if dpkg -s kemari >/dev/null 2>&1 || [[ -e /usr/bin/kemari ]]; then
  echo "package: kemari is still installed after dpkg -r" >&2
  exit 1
fi
echo "package: installed, checked and removed in $(( $(date +%s) - start ))s"
