#!/usr/bin/env bash
# Runs the test guest's workloads under QEMU, for side-by-side figures with
# kemari. Usage:
#   guest/run-qemu.sh [counter|dirty|disk|net|fault|cmdline|all]
# ACCEL=tcg (default) or ACCEL=kvm. `net` needs root (it creates and deletes
# the TAP device tapg0 with 10.0.2.1/24; the guest is 10.0.2.15).
# Exit status: QEMU's isa-debug-exit turns the guest's code c into 2c+1, so a
# clean poweroff is 1 here; the script maps that back to 0.
set -euo pipefail
cd "$(dirname "$0")/.."

ACCEL=${ACCEL:-tcg}
ELF=target/x86_64-unknown-none/release/guest
cargo build -q -p guest --target x86_64-unknown-none --release

cpu=()
# Without ARCH_CAPABILITIES: this host's KVM lists the MSR but refuses QEMU's write.
[ "$ACCEL" = kvm ] && cpu=(-cpu host,-arch-capabilities)

qemu() { # <memory> <cmdline> [extra qemu args...]
    local mem=$1 cmdline=$2
    shift 2
    local rc=0
    qemu-system-x86_64 -accel "$ACCEL" "${cpu[@]}" -M microvm,acpi=off -m "$mem" \
        -display none -serial stdio -no-reboot -kernel "$ELF" -append "$cmdline" \
        -device isa-debug-exit,iobase=0xf4,iosize=0x04 \
        -global virtio-mmio.force-legacy=false "$@" </dev/null || rc=$?
    echo "== guest exit code $(((rc - 1) / 2)) (qemu status $rc)"
}

counter() { qemu 256M "counter=100 poweroff_after=2000"; }

dirty() { qemu 1536M "dirty=0,1024 poweroff_after=6000"; }

disk() {
    local img
    img=$(mktemp /tmp/guest-disk.XXXXXX)
    truncate -s 64M "$img"
    local drive=(-drive "id=d0,file=$img,format=raw,if=none" -device virtio-blk-device,drive=d0)
    qemu 256M "disk=write,10000,rand poweroff=done" "${drive[@]}"
    qemu 256M "disk=verify,10000 poweroff=done" "${drive[@]}"
    qemu 256M "disk=write,1000,seq,flush disk=verify,1000 poweroff=done" "${drive[@]}"
    rm -f "$img"
}

net() {
    ip tuntap add tapg0 mode tap
    trap 'ip link del tapg0' RETURN
    ip addr add 10.0.2.1/24 dev tapg0
    ip link set tapg0 up
    qemu 256M "ip=10.0.2.15/24 gw=10.0.2.1 counter=1000 poweroff_after=15000" \
        -netdev tap,id=n0,ifname=tapg0,script=no,downscript=no \
        -device virtio-net-device,netdev=n0 &
    local pid=$!
    sleep 2
    python3 guest/tools/net-check.py 10.0.2.15 1 || true
    wait "$pid"
}

fault() { qemu 256M "fault=page"; }

cmdline() { qemu 256M "dirty=fast"; }

case "${1:-all}" in
    all) for w in counter dirty disk fault cmdline; do echo "### $w"; "$w"; done
         if [ "$(id -u)" = 0 ]; then echo "### net"; net; fi ;;
    counter | dirty | disk | net | fault | cmdline) "$1" ;;
    *) echo "usage: $0 [counter|dirty|disk|net|fault|cmdline|all]" >&2; exit 2 ;;
esac
