#!/bin/sh
# Init of a kemari lab guest (busybox). Kernel command line: klab.ip=ADDR/PREFIX
# Reports on the console:
#   KLAB-GUEST-BOOTED            init started
#   KLAB-DISK-OK / KLAB-DISK-FAIL  /dev/vda mounted, written, read back
#   KLAB-NET-OK / KLAB-NET-FAIL    eth0 configured
#   KLAB-GUEST-READY ip=...      httpd (port 80) and nc echo (port 7) running
# GET /cgi-bin/disk?TOKEN writes TOKEN to /mnt/klab-token.txt and reads it back;
# GET /cgi-bin/poweroff makes the guest unmount its disk and power off;
# GET /cgi-bin/writer starts the disk writer (load): numbered records appended
# to /mnt/records.log, each synced, and a 256 KiB file rewritten with fsync
# (?pace=S: S seconds' pause after each);
# GET /cgi-bin/records stops the writer and counts its records on the disk
# (page cache dropped) against those it synced; GET /cgi-bin/clock prints the
# guest's uptime and wall clock;
# GET /cgi-bin/fill?MB fills MB MiB of its memory with non-zero data (a tmpfs
# file: memory in use, as a loaded guest's), printing KLAB-FILL;
# GET /cgi-bin/read?FILE reads /mnt/FILE (dd, 1 MiB blocks) and prints
# KLAB-READ bytes=… start=… end=… (/proc/uptime), KLAB-READ-NS start=… end=…
# (the same in ns), KLAB-READ-DISK ios=… sectors=… ticks_ms=… (the disk's read
# requests meanwhile) and KLAB-READ-MOUNT (/mnt's device and options); /www/data is /mnt/www
# (files on the disk, served by httpd) when the disk has one;
# GET /cgi-bin/reboot makes the guest stop the writer, unmount its disk and
# reboot (`reboot -f`), printing KLAB-GUEST-REBOOT lines=<records on disk>;
# before mounting, every boot prints KLAB-FS clean|dirty (the ext4
# superblock's state: cleanly unmounted, no journal to replay) and, after,
# KLAB-RECORDS lines=<records> bad=<malformed lines>;
# klab.poweroff=1 on the command line makes it power off right after READY,
# klab.poweroff=reboot makes it reboot instead.
# klab.verbose=1 keeps the kernel's console log level (no `dmesg -n 1`): soak
# runs boot with loglevel=7 and want every oops and panic on the console.
# klab.disk=pmem0 makes the data disk a virtio-pmem device instead of /dev/vda:
# the modules of /etc/klab-modules-pmem loaded, /dev/pmem0 mounted at /mnt
# with -o dax, KLAB-MOUNT dev=… opts=… (its /proc/mounts options) and its
# kernel messages (KLAB-DMESG …) printed; `read` uses that device's counters.
mount -t proc proc /proc
mount -t sysfs sys /sys
mount -t devtmpfs dev /dev
mount -t tmpfs tmp /tmp
echo "KLAB-GUEST-BOOTED cpus=$(grep -c ^processor /proc/cpuinfo) mem_kb=$(awk '/MemTotal/{print $2}' /proc/meminfo)"
grep -q 'klab\.verbose=1' /proc/cmdline || dmesg -n 1
# What the firmware tables described (ACPI device IDs), for debugging VMMs.
echo "KLAB-GUEST-ACPI $(ls /sys/bus/acpi/devices 2>/dev/null | tr '\n' ' ')"
for m in $(cat /etc/klab-modules); do
    insmod /lib/modules/$m 2>/dev/null
done
ip=
poweroff_when_ready=
disk=vda
mount_opts=
for arg in $(cat /proc/cmdline); do
    case "$arg" in
        klab.ip=*) ip=${arg#klab.ip=} ;;
        klab.poweroff=1) poweroff_when_ready=poweroff ;;
        klab.poweroff=reboot) poweroff_when_ready=reboot ;;
        klab.disk=pmem0) disk=pmem0 mount_opts="-o dax" ;;
    esac
done
echo "$disk" > /tmp/klab-disk
waits=50
if [ "$disk" = pmem0 ]; then
    for m in $(cat /etc/klab-modules-pmem); do
        insmod /lib/modules/$m || echo "KLAB-WARN insmod $m failed"
    done
    # The nvdimm bus probes its namespace asynchronously: up to 30 s.
    waits=300
fi
for i in $(seq $waits); do
    [ -b /dev/$disk ] && [ -e /sys/class/net/eth0 ] && break
    sleep 0.1
done
# The ext4 superblock (at 1024): s_state (offset 58, bit 0: valid/clean)
# and s_feature_incompat (offset 96, bit 2: the journal needs recovery).
if [ -b /dev/$disk ]; then
    state=$(od -An -tu2 -j 1082 -N 2 /dev/$disk | tr -d ' ')
    incompat=$(od -An -tu4 -j 1120 -N 4 /dev/$disk | tr -d ' ')
    if [ $((state & 1)) = 1 ] && [ $((incompat & 4)) = 0 ]; then
        echo "KLAB-FS clean state=$state incompat=$incompat"
    else
        echo "KLAB-FS dirty state=$state incompat=$incompat"
    fi
fi
# shellcheck disable=SC2086 # mount_opts: none, or "-o dax"
if mount -t ext4 $mount_opts /dev/$disk /mnt; then
    touch /mnt/records.log
    echo "KLAB-RECORDS lines=$(wc -l < /mnt/records.log) bad=$(grep -cv '^rec [0-9]* [0-9]*$' /mnt/records.log)"
    token="written-$(cat /proc/sys/kernel/random/uuid)"
    echo "$token" > /mnt/written.txt && sync && echo 3 > /proc/sys/vm/drop_caches
    if [ "$(cat /mnt/written.txt)" = "$token" ] && grep -q "kemari lab" /mnt/hello.txt; then
        echo "KLAB-DISK-OK $token"
    else
        echo "KLAB-DISK-FAIL readback"
    fi
else
    echo "KLAB-DISK-FAIL mount"
fi
if [ "$disk" != vda ]; then
    # Whether the mount really is DAX (a page-cache fallback would make the
    # warm-cache figures meaningless), and what the kernel said about it.
    echo "KLAB-MOUNT dev=/dev/$disk opts=$(awk '$2 == "/mnt" {print $4}' /proc/mounts)"
    dmesg | grep -aiE 'pmem|nvdimm|nd_|dax|ext4|EXT4' | tail -15 | sed 's/^/KLAB-DMESG /'
fi
ip link set lo up
if [ -n "$ip" ] && ip link set eth0 up && ip addr add "$ip" dev eth0; then
    echo "KLAB-NET-OK ip=$ip"
else
    echo "KLAB-NET-FAIL ip=$ip"
fi
mkdir -p /www/cgi-bin
echo "hello from the kemari lab guest" > /www/index.html
cat > /www/cgi-bin/poweroff <<'CGI'
#!/bin/sh
echo "Content-Type: text/plain"
echo
echo "powering off"
( sleep 1; umount /mnt; echo KLAB-GUEST-POWEROFF > /dev/console; poweroff -f ) >/dev/null 2>&1 </dev/null &
CGI
cat > /www/cgi-bin/writer <<'CGI'
#!/bin/sh
# The disk writer (load), once per boot.
echo "Content-Type: text/plain"
echo
if [ -e /tmp/writer.pid ]; then
    echo "writer running"
    exit 0
fi
boot=$(tr -cd '0-9' < /proc/sys/kernel/random/boot_id | cut -c1-9)
# ?pace=S: a pause of S whole seconds after each record (a lighter load).
pace=$(echo "$QUERY_STRING" | sed -n 's/.*pace=\([0-9]*\).*/\1/p')
echo running > /tmp/writer.pid
(
    n=0
    while [ ! -e /tmp/writer.stop ]; do
        n=$((n + 1))
        echo "rec $boot $n" >> /mnt/records.log && sync && echo "$n" > /tmp/writer.synced
        dd if=/dev/urandom of=/mnt/blob bs=64k count=4 conv=fsync 2>/dev/null
        [ -n "$pace" ] && sleep "$pace"
    done
    rm -f /tmp/writer.pid
) >/dev/null 2>&1 </dev/null &
echo "writer started"
CGI
cat > /www/cgi-bin/reboot <<'CGI'
#!/bin/sh
echo "Content-Type: text/plain"
echo
echo "rebooting"
(
    sleep 1
    # The writer stops after its current record (a service stopped).
    touch /tmp/writer.stop
    while [ -e /tmp/writer.pid ]; do sleep 0.1; done
    lines=$(wc -l < /mnt/records.log)
    sync
    umount /mnt || echo "KLAB-UMOUNT-FAIL" > /dev/console
    echo "KLAB-GUEST-REBOOT lines=$lines" > /dev/console
    reboot -f
) >/dev/null 2>&1 </dev/null &
CGI
cat > /www/cgi-bin/disk <<'CGI'
#!/bin/sh
# GET /cgi-bin/disk?TOKEN: write TOKEN to /mnt/klab-token.txt, sync, drop the
# page cache and read it back from the disk.
echo "Content-Type: text/plain"
echo
token=$(echo "$QUERY_STRING" | tr -cd 'A-Za-z0-9-')
if [ -n "$token" ] && echo "$token" > /mnt/klab-token.txt && sync && echo 3 > /proc/sys/vm/drop_caches \
    && [ "$(cat /mnt/klab-token.txt)" = "$token" ]; then
    echo "KLAB-DISK-OK $token"
else
    echo "KLAB-DISK-FAIL $token"
fi
CGI
cat > /www/cgi-bin/records <<'CGI'
#!/bin/sh
# GET /cgi-bin/records: stop the writer after its current record, drop the
# page cache and count the records the disk holds (vs. those it synced).
echo "Content-Type: text/plain"
echo
touch /tmp/writer.stop
while [ -e /tmp/writer.pid ]; do sleep 0.1; done
synced=$(cat /tmp/writer.synced 2>/dev/null || echo 0)
sync && echo 3 > /proc/sys/vm/drop_caches
lines=$(wc -l < /mnt/records.log)
bad=$(grep -cv '^rec [0-9]* [0-9]*$' /mnt/records.log)
rm -f /tmp/writer.stop
echo "KLAB-RECORDS-NOW lines=$lines synced=$synced bad=$bad"
CGI
cat > /www/cgi-bin/clock <<'CGI'
#!/bin/sh
# GET /cgi-bin/clock: the guest's clocks (seconds since boot, wall clock).
echo "Content-Type: text/plain"
echo
read -r up _ < /proc/uptime
echo "KLAB-CLOCK uptime=$up realtime=$(date +%s)"
CGI
cat > /www/cgi-bin/fill <<'CGI'
#!/bin/sh
# GET /cgi-bin/fill?MB: MB MiB of non-zero data in a tmpfs file (a random
# 4 MiB seed repeated), so that this much guest memory is in use.
echo "Content-Type: text/plain"
echo
mb=$(echo "$QUERY_STRING" | tr -cd '0-9')
# /tmp is a tmpfs of half the memory by default: room for the data first.
mount -o remount,size=$((${mb:-0} + 16))m /tmp 2>&1
dd if=/dev/urandom of=/tmp/fill.seed bs=1M count=4 2>/dev/null
read -r a _ < /proc/uptime
i=0
while [ $i -lt $((${mb:-0} / 4)) ]; do cat /tmp/fill.seed; i=$((i + 1)); done > /tmp/fill.data
read -r b _ < /proc/uptime
echo "KLAB-FILL mb=$(($(stat -c %s /tmp/fill.data) >> 20)) avail_kb=$(awk '/MemAvailable/{print $2}' /proc/meminfo) start=$a end=$b"
CGI
cat > /www/cgi-bin/read <<'CGI'
#!/bin/sh
# GET /cgi-bin/read?FILE: reads /mnt/FILE once (1 MiB blocks); the time from /proc/uptime.
echo "Content-Type: text/plain"
echo
f=/mnt/$(echo "$QUERY_STRING" | tr -cd 'A-Za-z0-9._-')
dev=$(cat /tmp/klab-disk 2>/dev/null || echo vda)
disk_before=$(cat /sys/block/$dev/stat)
read -r a _ < /proc/uptime
# The same interval in nanoseconds (/proc/timer_list's "now at N nsecs",
# CLOCK_MONOTONIC, read by the shell itself): /proc/uptime counts 10 ms,
# 5% of a 256 MiB read at 1.2 GB/s.
{ read -r _; read -r _; read -r _ _ a_ns _; } 2>/dev/null < /proc/timer_list
if dd if="$f" of=/dev/null bs=1M 2>/dev/null; then
    { read -r _; read -r _; read -r _ _ b_ns _; } 2>/dev/null < /proc/timer_list
    read -r b _ < /proc/uptime
    echo "KLAB-READ bytes=$(stat -c %s "$f") start=$a end=$b"
    echo "KLAB-READ-NS start=$a_ns end=$b_ns"
    # The disk's read requests and sectors during the read (block/stat.rst).
    set -- $disk_before; ios=$1 sectors=$3 ticks=$4; set -- $(cat /sys/block/$dev/stat)
    echo "KLAB-READ-DISK ios=$(($1 - ios)) sectors=$(($3 - sectors)) ticks_ms=$(($4 - ticks))"
    # The data disk's mount options (dax: reads are copies from the window).
    echo "KLAB-READ-MOUNT $(awk '$2 == "/mnt" {print $1, $4}' /proc/mounts)"
else
    echo "KLAB-READ-FAIL $f"
fi
CGI
[ -d /mnt/www ] && ln -s /mnt/www /www/data
chmod +x /www/cgi-bin/poweroff /www/cgi-bin/disk /www/cgi-bin/writer /www/cgi-bin/reboot \
    /www/cgi-bin/records /www/cgi-bin/clock /www/cgi-bin/fill /www/cgi-bin/read
httpd -p 80 -h /www
# Debian's busybox nc has no -k: -ll with -e is its persistent server.
nc -ll -p 7 -e cat >/dev/null 2>&1 &
echo "KLAB-GUEST-READY ip=$ip"
if [ "$poweroff_when_ready" = poweroff ]; then
    umount /mnt 2>/dev/null
    echo KLAB-GUEST-POWEROFF
    poweroff -f
elif [ "$poweroff_when_ready" = reboot ]; then
    umount /mnt 2>/dev/null
    echo KLAB-GUEST-REBOOT
    reboot -f
fi
while true; do sleep 3600; done
