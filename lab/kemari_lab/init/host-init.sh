#!/bin/sh
# Init of a kemari lab virtual host (busybox). Kernel command line:
#   klab.name=NAME klab.ip=ADDR/PREFIX
# Brings up kvm-amd and a bridge br0 over eth0 (so that guests' TAPs join the
# lab network), prints KLAB-HOST-READY, then reads commands from the console
# (see kemari_lab/vhost.py for the marker protocol).
mount -t proc proc /proc
mount -t sysfs sys /sys
mount -t devtmpfs dev /dev
mkdir -p /dev/pts /dev/shm
mount -t devpts devpts /dev/pts
mount -t tmpfs tmp /tmp
mount -t tmpfs shm /dev/shm
dmesg -n 1
for m in $(cat /etc/klab-modules); do
    insmod /lib/modules/$m || echo "KLAB-WARN insmod $m failed"
done
name=vhost
ip=
for arg in $(cat /proc/cmdline); do
    case "$arg" in
        klab.name=*) name=${arg#klab.name=} ;;
        klab.ip=*) ip=${arg#klab.ip=} ;;
        klab.shmem_thp=*) echo "${arg#klab.shmem_thp=}" > /sys/kernel/mm/transparent_hugepage/shmem_enabled ;;
    esac
done
hostname "$name"
/sbin/ip link set lo up
/sbin/ip link add br0 type bridge forward_delay 0 stp_state 0
if [ -e /sys/class/net/eth0 ]; then
    /sbin/ip link set eth0 master br0
    /sbin/ip link set eth0 up
fi
/sbin/ip link set br0 up
[ -n "$ip" ] && /sbin/ip addr add "$ip" dev br0
[ -c /dev/kvm ] || echo "KLAB-WARN no /dev/kvm"
stty -echo 2>/dev/null
echo "KLAB-HOST-READY name=$name ip=$ip kvm=$([ -c /dev/kvm ] && echo yes || echo no)"
# A shell reading the console, without a prompt; if it exits, start another.
export PS1='' PS2=''
while true; do
    sh -s
    echo "KLAB-SHELL-RESTART"
done
