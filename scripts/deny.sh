#!/usr/bin/env bash
# Supply chain: `cargo deny check` — advisories (RustSec), licences, bans,
# sources (deny.toml). The advisory database is fetched from GitHub; where
# that cannot be reached, a copy fetched earlier is used (its age is shown),
# and with none the other three checks still run and the missing one is said
# loudly — never passed in silence.
set -euo pipefail
cd "$(dirname "$0")/.."
db_root="${CARGO_HOME:-$HOME/.cargo}/advisory-dbs"
# The checks below run offline (cargo metadata --offline), so every crate of
# the lock file, for every platform, must be in the local registry first.
cargo fetch --locked
if timeout 120 cargo deny fetch db; then
  cargo deny --locked --offline check
elif compgen -G "$db_root/*/.git" >/dev/null; then
  echo "deny: the advisory database cannot be fetched; using the copy in $db_root" \
       "(last commit $(git -C "$(compgen -G "$db_root/*/.git" | head -1)/.." log -1 --format=%cs))"
  cargo deny --locked --offline check
else
  echo "deny: ADVISORIES NOT CHECKED: the RustSec database cannot be fetched here and no copy" \
       "exists in $db_root; licences, bans and sources are checked"
  cargo deny --locked --offline check bans licenses sources
fi
