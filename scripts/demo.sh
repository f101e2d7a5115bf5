#!/usr/bin/env bash
# The main demo: sets up the machine, builds kemari and its test guest, boots the
# guest with a disk and a network device, and drives it: serial output, the
# guest's HTTP and TCP echo services through a TAP, pause/resume via kemarictl,
# a zero-copy migration into a fresh kemari process (the guest runs on, its
# memory is not copied), metrics, shutdown. Run as root (TAP devices, /dev/kvm).
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
cargo build -p guest --target x86_64-unknown-none --release -q
cargo build --release -q -p kemari

guest=target/x86_64-unknown-none/release/guest
work=$(mktemp -d /tmp/kemari-demo.XXXX)
tap=kdemo$$
tap=${tap:0:15}
vmm_pid=
cleanup() {
  [[ -n "$vmm_pid" ]] && kill "$vmm_pid" 2>/dev/null || true
  ip link del "$tap" 2>/dev/null || true
  rm -rf "$work"
}
trap cleanup EXIT

ip tuntap add "$tap" mode tap
ip addr add 10.199.0.1/24 dev "$tap"
ip link set "$tap" up
truncate -s 64M "$work/disk.img"

echo "== booting the test guest (256 MiB, virtio-blk, virtio-net on $tap)"
target/release/kemari --kernel "$guest" --memory 256M \
  --cmdline "counter=1000 ip=10.199.0.2/24 disk=write,1000,seq" \
  --disk "$work/disk.img" --net "tap=$tap" \
  --serial "file:$work/console.log" --api-socket "$work/api.sock" &
vmm_pid=$!
for _ in $(seq 50); do grep -q "net: up" "$work/console.log" 2>/dev/null && break; sleep 0.1; done
ctl() { target/release/kemarictl --api-socket "$work/api.sock" "$@"; }

echo "== guest console so far"; cat "$work/console.log"
echo "== kemarictl info"; ctl info
echo "== HTTP from the host to the guest"; curl -s -m 5 http://10.199.0.2/
echo "== TCP echo (port 7)"; echo "hello, kemari" | socat -t 2 - TCP:10.199.0.2:7
echo "== pause for 2 s: the counter stops"
ctl pause >/dev/null; before=$(grep -c '^counter' "$work/console.log"); sleep 2
after=$(grep -c '^counter' "$work/console.log")
echo "counter lines while paused: $before -> $after"
ctl resume >/dev/null; sleep 1.5
echo "after resume: $(grep '^counter' "$work/console.log" | tail -n 1)"
echo "== zero-copy migration into a fresh kemari process (memory stays in its memfd)"
target/release/kemari --incoming-local "$work/incoming.sock" \
  --serial "file:$work/console-2.log" --api-socket "$work/api-2.sock" &
new_pid=$!
for _ in $(seq 100); do [[ -S "$work/incoming.sock" ]] && break; sleep 0.1; done
ctl migrate-local "$work/incoming.sock" |
  python3 -c 'import json, sys; r = json.load(sys.stdin); print("downtime %.1f ms, %d bytes of state sent, memory not copied" % (r["downtime_ms"], r["state_bytes"]))'
wait "$vmm_pid" && echo "the old kemari (pid $vmm_pid) exited with status 0"
vmm_pid=$new_pid
ctl() { target/release/kemarictl --api-socket "$work/api-2.sock" "$@"; }
echo "the VM now runs in pid $(ctl info | python3 -c 'import json, sys; print(json.load(sys.stdin)["pid"])')"
sleep 1.5
echo "its counter goes on: $(grep '^counter' "$work/console-2.log" | tail -n 1)"
echo "the guest's HTTP service kept its state: $(curl -s -m 5 http://10.199.0.2/)"
echo "== metrics"; ctl metrics | head -n 20
echo "== shutdown"; ctl shutdown >/dev/null; wait "$vmm_pid"; vmm_pid=
echo "kemari exited with status 0"
