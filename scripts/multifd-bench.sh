#!/bin/bash
# Live migration over 1 vs N TCP connections, encrypted and --plaintext-link,
# alternated in one run, over loopback: a 1 GiB test guest whose dirtier
# (10,000 pages/s over 900 MiB) has touched its 900 MiB before each
# migration. Prints one JSON line per migration (kemarictl's report plus
# each process's CPU seconds over the migration).
#   flock /work/bench.lock scripts/multifd-bench.sh RUNS "1 4" > out.jsonl
set -euo pipefail
RUNS=${1:-3}
CONNS=${2:-"1 4"}
ROOT=$(cd "$(dirname "$0")/.." && pwd)
BIN=${BIN:-$ROOT/target/release}
ELF=${ELF:-$ROOT/target/x86_64-unknown-none/release/guest}
FILL_S=${FILL_S:-26}
W=$(mktemp -d /tmp/multifd-bench.XXXX)
trap 'kill $(jobs -p) 2>/dev/null || true; rm -rf "$W"' EXIT
printf 'kemari-multifd-bench-key-0123456789' > "$W/key"; chmod 600 "$W/key"
# CPU seconds of a process outside its vCPU threads (the guest's own work),
# polled until it exits: "<total> <vcpus>" of the last poll.
poll() {
  local pid=$1 f=$2
  while [ -d "/proc/$pid" ]; do
    t=$(awk '{print $14+$15}' "/proc/$pid/stat" 2>/dev/null) || break
    v=0
    for task in /proc/$pid/task/*; do
      if grep -q '^vcpu' "$task/comm" 2>/dev/null; then
        v=$((v + $(awk '{print $14+$15}' "$task/stat" 2>/dev/null || echo 0)))
      fi
    done
    [ -n "$t" ] && echo "$t $v" > "$f"
    sleep 0.05
  done
}
nonvcpu() { awk '{printf "%.2f", ($1-$2)/100}' "$1"; }
port=47100
for run in $(seq 1 "$RUNS"); do
  for plain in "" "--plaintext-link"; do
    for n in $CONNS; do
      port=$((port + 1))
      rm -f "$W"/*.sock
      "$BIN/kemari" --incoming "127.0.0.1:$port" --migration-key-file "$W/key" $plain \
        --serial "file:$W/dst.log" --api-socket "$W/dst.sock" > "$W/dst.out" 2>&1 &
      dst=$!
      "$BIN/kemari" --kernel "$ELF" --memory 1G --cmdline "counter=100 dirty=10000,900" \
        --serial "file:$W/src.log" --api-socket "$W/src.sock" > "$W/src.out" 2>&1 &
      src=$!
      sleep "$FILL_S"
      poll $src "$W/src.cpu" & p1=$!
      poll $dst "$W/dst.cpu" & p2=$!
      sleep 0.2
      s0=$(nonvcpu "$W/src.cpu"); d0=$(nonvcpu "$W/dst.cpu")
      out=$("$BIN/kemarictl" --api-socket "$W/src.sock" migrate --to "127.0.0.1:$port" \
        --key-file "$W/key" --connections "$n" $plain || true)
      wait $src 2>/dev/null || true
      sleep 0.5
      kill $p1 $p2 2>/dev/null || true
      s1=$(nonvcpu "$W/src.cpu"); d1=$(nonvcpu "$W/dst.cpu")
      echo "{\"run\":$run,\"connections\":$n,\"plaintext\":$([ -n "$plain" ] && echo true || echo false),\"src_cpu_s\":$(awk -v a=$s1 -v b=$s0 'BEGIN{printf "%.2f", a-b}'),\"dst_cpu_s_to_0.5s_after\":$(awk -v a=$d1 -v b=$d0 'BEGIN{printf "%.2f", a-b}'),\"report\":${out:-null}}"
      "$BIN/kemarictl" --api-socket "$W/dst.sock" shutdown > /dev/null 2>&1 || kill $dst
      wait $dst 2>/dev/null || true
    done
  done
done
