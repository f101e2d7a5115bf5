#!/usr/bin/env bash
# kemari-nbd benchmarks and the 1 GiB relocation scenario (needs root for
# the WAN part: network namespaces, veth, tc tbf).
#
#   crates/nbd/bench/run.sh [loopback|wan|all]     (default: all)
#
# loopback: kemari-nbd target vs nbdkit (file plugin) vs qemu-nbd on the same
#           image, fio's nbd engine: 4 KiB random read and write at QD1 and
#           QD32, 1 MiB sequential read and write at QD8, each on one
#           connection and on four (multi-conn: four fio jobs, one connection
#           and the case's queue depth each); ROUNDS rounds with the servers'
#           order rotated per round; medians, spread, kemari-nbd ÷ the best
#           other, server CPU per request. Then proxy fully cached vs direct
#           target (PROXY=0 skips it).
# wan:      two namespaces joined by veth with tbf 100 Mbit/s on both ends and
#           a userspace relay adding 10 ms each way (20 ms RTT; this kernel has
#           no netem). A 1 GiB ext4 image on the target, a proxy at the other
#           end: the paper's Table 4 (uncached random reads with background copy
#           off / on / precached), WAN link utilization during the copy, and
#           the relocation test (client I/O during the copy, proxy SIGKILLed
#           and restarted, cut-over, target stopped, every byte checked).
#
# Servers and fio run at nice -10 (NICE=0 to run them at 0): the host is shared
# with builds at nice 0, and without it a server's throughput under load follows
# how many threads it has more than its work per request.
# Env: SECS (fio runtime per loopback run, default 4), ROUNDS (default 3), LOOP_CASES
# ("RW BS QD CONNS|..." to run fewer cases), WAN_SECS (per Table 4
# case, default 30), WORK (scratch dir, default /tmp/knbd-bench), BIN, BASELINE_BIN (an older
# kemari-nbd build to add as a fourth loopback column), TABLE4_CASES (default "off on pre"),
# RELOCATION (0 skips the relocation test), JSON (write the results as JSON to
# this file, "-" for standard output with the text on standard error; the
# envelope of kemari-bench --json, read by scripts/bench-report).
set -euo pipefail
if [ "${NICE:--10}" != 0 ] && [ -z "${KNBD_BENCH_NICED:-}" ]; then
    export KNBD_BENCH_NICED=1
    exec nice -n "${NICE:--10}" "$0" "$@"
fi

HERE=$(cd "$(dirname "$0")" && pwd)
ROOT=$(cd "$HERE/../../.." && pwd)
MODE=${1:-all}
STARTED=$(date -u +%Y-%m-%dT%H:%M:%SZ)
export KNBD_LOAD_START=${KNBD_LOAD_START:-$(cut -d' ' -f1-3 /proc/loadavg)}
if [ "${JSON:-}" = - ]; then exec 3>&1 1>&2; fi
SECS=${SECS:-4}
ROUNDS=${ROUNDS:-3}
WAN_SECS=${WAN_SECS:-30}
WORK=${WORK:-/tmp/knbd-bench}
BIN=${BIN:-$ROOT/target/release/kemari-nbd}
SUM="$HERE/fio_summary.py"
NS_SRC=knbd-src
NS_DST=knbd-dst
PIDS=()

log() { printf '%s\n' "$*" >&2; }

cleanup() {
    for p in "${PIDS[@]}"; do kill "$p" 2>/dev/null || true; done
    wait 2>/dev/null || true
    ip netns del "$NS_SRC" 2>/dev/null || true
    ip netns del "$NS_DST" 2>/dev/null || true
}
trap cleanup EXIT

need() { command -v "$1" >/dev/null || { log "missing tool: $1"; exit 2; }; }
for t in fio nbdkit qemu-nbd nbdcopy qemu-io mkfs.ext4 python3; do need "$t"; done
if [ ! -x "$BIN" ]; then (cd "$ROOT" && cargo build --release -p kemari-nbd); fi
mkdir -p "$WORK"
rm -f "$WORK/proxy.jsonl" "$WORK/wan.jsonl" "$WORK/loop-runs.txt"
LOOP_NAMES=""

wait_port() { # [netns] port
    local ns=$1 port=$2 i
    for i in $(seq 1 200); do
        if [ -n "$ns" ]; then
            ip netns exec "$ns" bash -c "exec 3<>/dev/tcp/127.0.0.1/$port" 2>/dev/null && return 0
        else
            bash -c "exec 3<>/dev/tcp/127.0.0.1/$port" 2>/dev/null && return 0
        fi
        sleep 0.05
    done
    log "port $port never opened"; return 1
}

server_cpu() { awk '{ print $14 + $15 }' "/proc/$1/stat"; }

LAST_PID=
bg() { "$@" & LAST_PID=$!; PIDS+=("$LAST_PID"); }

# fio against an NBD URI: fio_case URI RW BS QD CONNS [extra...] -> "IOPS MB/s".
# CONNS > 1 runs that many fio jobs, one NBD connection each (multi-conn), at
# QD each; sequential jobs get regions of their own.
fio_case() {
    local uri=$1 rw=$2 bs=$3 qd=$4 conns=$5; shift 5
    local side=read span=$LOOP_SIZE_MB
    case $rw in write|randwrite) side=write ;; esac
    local per=()
    if [ "$conns" -gt 1 ]; then
        per=(--numjobs="$conns" --group_reporting)
        case $rw in read|write) span=$((LOOP_SIZE_MB / conns)); per+=(--offset_increment="${span}M") ;; esac
    fi
    fio --name=b --ioengine=nbd --uri="$uri" --rw="$rw" --bs="$bs" --iodepth="$qd" --size="${span}M" \
        "${per[@]}" --runtime="$SECS" --time_based --output-format=json "$@" 2>/dev/null | "$SUM" "$side"
}

# The loopback cases: "RW BS QD CONNS".
LOOP_CASES=${LOOP_CASES:-"randread 4k 1 1|randread 4k 32 1|randwrite 4k 1 1|randwrite 4k 32 1|read 1M 8 1|write 1M 8 1|randread 4k 1 4|randread 4k 32 4|randwrite 4k 1 4|randwrite 4k 32 4|read 1M 8 4|write 1M 8 4"}
LOOP_SIZE_MB=512

loopback() {
    local img=$WORK/loop.img
    log "== loopback: ${LOOP_SIZE_MB} MiB image in page cache, ${SECS}s per run, $ROUNDS rotated rounds"
    rm -f "$img"
    dd if=/dev/urandom of="$img" bs=1M count=$LOOP_SIZE_MB status=none
    local P1=21809 P2=21810 P3=21811 P4=21812
    declare -A SPID NAME
    bg env KEMARI_LOG=warn "$BIN" serve --export "disk=$img" --listen 127.0.0.1:$P1 >/dev/null
    SPID[$P1]=$LAST_PID; NAME[$P1]=kemari-nbd
    bg nbdkit -f -i 127.0.0.1 -p $P2 file "file=$img" >/dev/null
    SPID[$P2]=$LAST_PID; NAME[$P2]=nbdkit
    bg qemu-nbd -f raw -x disk -b 127.0.0.1 -p $P3 --persistent --shared=16 "$img" >/dev/null
    SPID[$P3]=$LAST_PID; NAME[$P3]=qemu-nbd
    wait_port "" $P1; wait_port "" $P2; wait_port "" $P3
    local ports="$P1 $P2 $P3"
    if [ -n "${BASELINE_BIN:-}" ]; then
        # An older build of kemari-nbd, side by side (before/after figures).
        bg env KEMARI_LOG=warn "$BASELINE_BIN" serve --export "disk=$img" --listen 127.0.0.1:21813 >/dev/null
        SPID[21813]=$LAST_PID; NAME[21813]=baseline
        wait_port "" 21813
        ports="$ports 21813"
    fi
    # Every run: "CASE PORT IOPS MBPS CPU_US_PER_REQUEST ROUND". The machine is
    # shared: each round runs every case on every server, the servers'
    # order rotated by one per round, and the tables show medians and the
    # spread (min-max) over the rounds.
    local raw=$WORK/loop-runs.txt
    : > "$raw"
    local -a plist=($ports)
    local n=${#plist[@]} r i k c
    local IFS_SAVE=$IFS
    IFS='|' read -r -a cases <<< "$LOOP_CASES"; IFS=$IFS_SAVE
    for r in $(seq 1 "$ROUNDS"); do
        for c in "${cases[@]}"; do
            set -- $c
            for k in $(seq 0 $((n - 1))); do
                local p=${plist[$(( (k + r - 1) % n ))]}
                # The server's CPU time per request (less sensitive to the
                # machine's load than throughput): /proc/PID/stat utime+stime.
                # Each run starts without dirty pages (no writeback left
                # over from the runs before it).
                local c0 c1 out
                sync
                c0=$(server_cpu "${SPID[$p]}")
                out=$(fio_case nbd://127.0.0.1:$p/disk "$1" "$2" "$3" "$4")
                c1=$(server_cpu "${SPID[$p]}")
                python3 -c "print('$1:$2:$3:$4', $p, '$out', f'{($c1 - $c0) / $(getconf CLK_TCK) * 1e6 / max(1, ${out%% *} * $SECS):.1f}', $r)" >> "$raw"
            done
        done
        log "round $r of $ROUNDS done"
    done
    local names=""
    for p in $ports; do names+="$p=${NAME[$p]} "; done
    python3 "$HERE/loop_table.py" "$raw" $names
    LOOP_NAMES=$names
    [ "${PROXY:-1}" = 1 ] || { stop_all; return 0; }
    log "== proxy fully cached (after cut-over) vs direct target"
    rm -rf "$WORK/loopcache"
    bg env KEMARI_LOG=warn "$BIN" proxy --upstream nbd://127.0.0.1:$P1/disk --cache "$WORK/loopcache" \
        --export disk --listen 127.0.0.1:$P4 --control "$WORK/loop.ctl" >/dev/null
    wait_port "" $P4
    "$BIN" cutover --wait --control "$WORK/loop.ctl" >/dev/null
    # Both files start clean (the copy just wrote the whole cache file), so
    # no writeback of it runs during the proxy's cases only.
    sync
    printf '%-26s %14s %14s %8s\n' "case (IOPS/MB/s)" target proxy ratio
    for c in "read 1M 8 1" "write 1M 8 1" "randread 4k 1 1" "randread 4k 32 1"; do
        set -- $c
        local res=()
        for r in $(seq 1 "$ROUNDS"); do
            for p in $P1 $P4; do
                res+=("$p $(fio_case nbd://127.0.0.1:$p/disk "$1" "$2" "$3" "$4")")
            done
        done
        local a b
        a=$(printf '%s\n' "${res[@]}" | median_of $P1)
        b=$(printf '%s\n' "${res[@]}" | median_of $P4)
        printf '%-26s %14s %14s %8s\n' "$1 bs=$2 qd=$3" "$a" "$b" \
            "$(python3 -c "print(f'{${b%%/*}/max(1,${a%%/*}):.3f}')")"
        python3 -c "import json; print(json.dumps({'case': '$2 $1 QD$3', 'target_iops': ${a%%/*}, 'target_mb_s': ${a#*/}, 'proxy_iops': ${b%%/*}, 'proxy_mb_s': ${b#*/}, 'ratio': ${b%%/*} / max(1, ${a%%/*})}))" >> "$WORK/proxy.jsonl"
    done
    stop_all
}

stop_all() {
    for p in "${PIDS[@]}"; do kill "$p" 2>/dev/null || true; done
    wait 2>/dev/null || true
    PIDS=()
}

# Lines "PORT IOPS MBPS" on stdin -> "IOPS/MBPS" of the median-IOPS run for PORT.
median_of() {
    awk -v p="$1" '$1 == p { print $2, $3 }' | sort -n | awk '{ a[NR] = $1 "/" $2 } END { print a[int((NR + 1) / 2)] }'
}
SRC_IP=10.231.0.1
DST_IP=10.231.0.2
RELAY_PORT=10900

wan_setup() {
    ip netns del $NS_SRC 2>/dev/null || true
    ip netns del $NS_DST 2>/dev/null || true
    ip netns add $NS_SRC
    ip netns add $NS_DST
    ip link add knbd-vs type veth peer name knbd-vd
    ip link set knbd-vs netns $NS_SRC
    ip link set knbd-vd netns $NS_DST
    ip -n $NS_SRC addr add $SRC_IP/24 dev knbd-vs
    ip -n $NS_DST addr add $DST_IP/24 dev knbd-vd
    for ns in $NS_SRC $NS_DST; do ip -n $ns link set lo up; done
    ip -n $NS_SRC link set knbd-vs up
    ip -n $NS_DST link set knbd-vd up
    # 100 Mbit/s each way; GSO/TSO off so tbf shapes real packets.
    ip netns exec $NS_SRC ethtool -K knbd-vs tso off gso off gro off 2>/dev/null || true
    ip netns exec $NS_DST ethtool -K knbd-vd tso off gso off gro off 2>/dev/null || true
    tc -n $NS_SRC qdisc add dev knbd-vs root tbf rate 100mbit burst 50kb latency 60ms
    tc -n $NS_DST qdisc add dev knbd-vd root tbf rate 100mbit burst 50kb latency 60ms
}

# Starts the target (in the source namespace) and the 10 ms/10 ms relay.
wan_target() {
    local img=$1
    bg ip netns exec $NS_SRC env KEMARI_LOG=warn "$BIN" serve --export "disk=$img" --listen 127.0.0.1:10809 >/dev/null
    wait_port $NS_SRC 10809
    bg ip netns exec $NS_SRC "$BIN" relay --listen $SRC_IP:$RELAY_PORT --to 127.0.0.1:10809 --delay-ms 10 >/dev/null
    sleep 0.2
}

# wan_proxy CACHE_DIR PORT [args...]
wan_proxy() {
    local cache=$1 port=$2; shift 2
    bg ip netns exec $NS_DST env KEMARI_LOG=info "$BIN" proxy --upstream nbd://$SRC_IP:$RELAY_PORT/disk \
        --cache "$cache" --export disk --listen 127.0.0.1:$port --control "$cache.ctl" "$@" \
        >/dev/null 2>>"$WORK/proxy.log"
    wait_port $NS_DST "$port"
}

stop_pid() { kill "$1" 2>/dev/null || true; wait "$1" 2>/dev/null || true; }

# sample_bytes CTL OUT MAXSECS: "time bytes phase" lines (bytes fetched
# upstream, on-demand + background) every 0.5 s until the copy completes or
# MAXSECS pass.
sample_bytes() {
    python3 - "$BIN" "$1" "$2" "$3" <<'EOF'
import json, subprocess, sys, time
binary, ctl, out, maxsecs = sys.argv[1], sys.argv[2], sys.argv[3], float(sys.argv[4])
start = time.time()
with open(out, "w") as f:
    while True:
        try:
            st = json.loads(subprocess.check_output([binary, "status", "--control", ctl]))["status"]
        except Exception:
            break
        now = time.time()
        f.write(f"{now:.3f} {st['ondemand_bytes'] + st['background_bytes']} {st['phase']}\n")
        f.flush()
        if st["phase"] == "complete" or now - start >= maxsecs:
            break
        time.sleep(0.5)
EOF
}

status_field() { "$BIN" status --control "$1" | python3 -c "import json,sys; print(json.load(sys.stdin)['status']['$2'])"; }

wan() {
    local img=$WORK/fs.img
    log "== WAN: building a 1 GiB ext4 image with 192 MiB of files"
    rm -rf "$WORK/files" "$img"; mkdir -p "$WORK/files"
    local i
    for i in $(seq 1 6); do head -c 32M /dev/urandom > "$WORK/files/f$i"; done
    truncate -s 1G "$img"
    mkfs.ext4 -q -F -b 4096 -d "$WORK/files" "$img"
    wan_setup
    wan_target "$img"
    local P=10810

    # Direct (remote) access without a proxy, for reference.
    local remote
    remote=$(ip netns exec $NS_DST fio --name=r --ioengine=nbd --uri=nbd://$SRC_IP:$RELAY_PORT/disk \
        --rw=randread --bs=4k --iodepth=1 --runtime=10 --time_based --offset=16M --size=192M \
        --output-format=json 2>/dev/null | "$SUM" read)
    local remote16
    remote16=$(ip netns exec $NS_DST fio --name=r --ioengine=nbd --uri=nbd://$SRC_IP:$RELAY_PORT/disk \
        --rw=randread --bs=4k --iodepth=16 --runtime=10 --time_based --offset=16M --size=192M \
        --output-format=json 2>/dev/null | "$SUM" read)
    local seqwan
    seqwan=$(ip netns exec $NS_DST fio --name=s --ioengine=nbd --uri=nbd://$SRC_IP:$RELAY_PORT/disk \
        --rw=read --bs=1M --iodepth=16 --runtime=10 --time_based --offset=256M --size=512M \
        --output-format=json 2>/dev/null | "$SUM" read)
    log "remote (no proxy): 4k randread QD1 ${remote% *} IOPS, QD16 ${remote16% *} IOPS; 1M seq read QD16 ${seqwan#* } MB/s"
    echo "{\"job\": \"remote\", \"qd1_iops\": ${remote% *}, \"qd16_iops\": ${remote16% *}, \"seq_mb_s\": ${seqwan#* }}" >> "$WORK/wan.jsonl"

    # The paper's workload reads files: random 4 KiB reads of the files' blocks.
    for i in $(seq 1 6); do debugfs -R "blocks /f$i" "$img" 2>/dev/null; done > "$WORK/blocks.txt"
    log "file blocks: $(wc -w < "$WORK/blocks.txt")"
    table4_case() { # name cache-dir proxy-args...
        local name=$1 cache=$2; shift 2
        local pid
        wan_proxy "$cache" $P "$@"; pid=$LAST_PID
        local r pct
        # Bytes fetched over the WAN, sampled while the client runs.
        sample_bytes "$cache.ctl" "$WORK/$name.bytes" "$WAN_SECS" & local sp=$!
        r=$(ip netns exec $NS_DST "$BIN" random-reads nbd://127.0.0.1:$P/disk \
            --blocks "$WORK/blocks.txt" --secs "$WAN_SECS" 2>/dev/null)
        wait $sp 2>/dev/null || true
        pct=$(status_field "$cache.ctl" cached_percent)
        stop_pid "$pid"
        python3 - "$name" "$pct" "$r" "$WORK/$name.bytes" "$WORK/wan.jsonl" <<'PY'
import json, sys
name, pct, r = sys.argv[1], float(sys.argv[2]), json.loads(sys.argv[3])
t = r["timeline"]
last = sum(t[-10:]) / max(1, len(t[-10:]))
s = [tuple(map(float, l.split()[:2])) for l in open(sys.argv[4]) if l.strip()]
# Link use while the client's working set is being copied: from the first
# sample to the first second whose ops reach half the last 10 s rate.
knee = next((i for i, x in enumerate(t) if x >= last / 2), len(t))
w = [x for x in s if x[0] - s[0][0] <= knee] if s else []
util = (w[-1][1] - w[0][1]) / max(1e-9, w[-1][0] - w[0][0]) if len(w) > 1 else 0.0
print(f"{name:<14} {r['ops_per_sec']:>10.0f} {last:>12.0f} {pct:>10.1f}   knee {knee:>3} s, "
      f"fetched {util/1e6:5.2f} MB/s until then = {util*8/1e8*100:5.1f}% of 100 Mbit/s")
print(f"{'':<14} per-second: {' '.join(str(x) for x in t)}")
with open(sys.argv[5], "a") as f:
    f.write(json.dumps({"job": "table4", "case": name, "ops_per_sec": r["ops_per_sec"], "last10": last,
                        "cached_percent": pct, "knee_s": knee, "link_util_pct": util * 8 / 1e8 * 100,
                        "timeline_ops": t,
                        "fetched": [[round(x[0] - s[0][0], 2), x[1]] for x in s] if s else []}) + "\n")
PY
    }
    if [ -n "${ONLY_BGCOPY_ON:-}" ]; then
        printf '%-14s %10s %12s %10s\n' case "ops/s" "last10s/s" "cached%"
        rm -rf "$WORK/c-on"
        table4_case "bgcopy on" "$WORK/c-on" ${PROXY_ARGS:-}
        return
    fi
    log "== Table 4: 4 KiB random reads (QD1) over the used region, ${WAN_SECS}s, through the proxy"
    rm -rf "$WORK/c-pre" "$WORK/c-off" "$WORK/c-on"
    # precached: let a proxy copy everything first.
    local pid
    wan_proxy "$WORK/c-pre" $P --no-auto-cutover; pid=$LAST_PID
    # Link utilization from the bytes fetched over time (sampled every 0.5 s
    # until the copy completes).
    sample_bytes "$WORK/c-pre.ctl" "$WORK/precopy.bytes" 100000
    stop_pid "$pid"
    printf '%-14s %10s %12s %10s\n' case "ops/s" "last10s/s" "cached%"
    local cases=" ${TABLE4_CASES:-off on pre} "
    [[ $cases == *" off "* ]] && table4_case "bgcopy off" "$WORK/c-off" --no-background
    [[ $cases == *" on "* ]] && table4_case "bgcopy on" "$WORK/c-on"
    [[ $cases == *" pre "* ]] && table4_case "precached" "$WORK/c-pre"
    python3 - "$WORK/precopy.bytes" "$WORK/wan.jsonl" <<'EOF'
import json, sys
s = [tuple(map(float, l.split()[:2])) for l in open(sys.argv[1]) if l.strip()]
t0, t1 = s[0][0], s[-1][0]
mid = [x for x in s if t0 + 2 <= x[0] <= t1 - 2] or s
rate = (mid[-1][1] - mid[0][1]) / max(1e-9, mid[-1][0] - mid[0][0])
whole = (s[-1][1] - s[0][1]) / max(1e-9, t1 - t0)
print(f"background copy of 1 GiB over the WAN: {t1 - t0:.1f} s, {s[-1][1]/2**20:.0f} MiB fetched; "
      f"bytes over time, excluding the first and last 2 s: {rate/1e6:.2f} MB/s = "
      f"{rate*8/1e8*100:.1f}% of the 100 Mbit/s line rate (whole copy: {whole*8/1e8*100:.1f}%)")
with open(sys.argv[2], "a") as f:
    f.write(json.dumps({"job": "background_copy", "secs": t1 - t0, "mib": s[-1][1] / 2**20,
                        "util_pct": rate * 8 / 1e8 * 100, "whole_util_pct": whole * 8 / 1e8 * 100,
                        "fetched": [[round(x[0] - t0, 2), x[1]] for x in s]}) + "\n")
EOF
    # Bound for Table 4's average: the client's reads cannot all be local
    # before its working set has crossed the link.
    python3 - "$WORK/blocks.txt" "$WAN_SECS" <<'EOF'
import sys
ws = len(open(sys.argv[1]).read().split()) * 4096; secs = float(sys.argv[2])
t = ws / 12.5e6
print(f"working set {ws/2**20:.0f} MiB: at least {t:.1f} s at the 100 Mbit/s line rate; "
      f"bgcopy on can reach at most {(secs - t) / secs * 100:.0f}% of precached over {secs:.0f} s "
      f"(plus the few ops served during the copy)")
EOF

    [ "${RELOCATION:-1}" = 1 ] || return 0
    log "== relocation test: client I/O during the copy, SIGKILL + restart, cut-over, target stopped"
    cp --sparse=always "$img" "$WORK/expect.img"
    local cache=$WORK/c-reloc
    rm -rf "$cache"
    wan_proxy "$cache" $P; pid=$LAST_PID
    local uri=nbd://127.0.0.1:$P/disk
    local cmds=(-c "write -P 0x5a 4096 65536" -c "write -P 0x33 1000 300" -c "write -P 0x44 300000000 1000000"
                -c "write -z 700000000 8192" -c "write -P 0x66 1073737728 4096")
    ip netns exec $NS_DST qemu-io -f raw "${cmds[@]}" -c flush "$uri" >/dev/null
    qemu-io -f raw "${cmds[@]}" "$WORK/expect.img" >/dev/null
    # fio writes and verifies its own region through the proxy while the copy runs.
    ip netns exec $NS_DST fio --name=v --ioengine=nbd --uri=$uri --rw=randwrite --bs=4k --iodepth=16 \
        --offset=512M --size=32M --verify=crc32c --do_verify=1 --output-format=json 2>/dev/null \
        | python3 -c "import json,sys; r=sys.stdin.read(); j=json.loads(r[r.index('{'):]); print('fio verify errors:', j['jobs'][0]['error'])"
    # Bring expect.img up to date with what fio wrote (read back through the proxy later).
    sleep 3
    local before after persisted
    before=$(status_field "$cache.ctl" cached_blocks)
    kill -9 "$pid"; wait "$pid" 2>/dev/null || true
    persisted=$(python3 -c "
import sys; b=open('$cache/cache.bitmap','rb').read()[64:]; print(sum(bin(x).count('1') for x in b))")
    wan_proxy "$cache" $P; pid=$LAST_PID
    after=$(status_field "$cache.ctl" cached_blocks)
    log "killed at $before cached blocks in memory; persisted $persisted; after restart $after"
    "$BIN" cutover --wait --control "$cache.ctl" >/dev/null
    local total_fetched
    total_fetched=$(python3 -c "
import json,subprocess
s=json.loads(subprocess.check_output(['$BIN','status','--control','$cache.ctl']))['status']
print(s['ondemand_bytes']+s['background_bytes'])")
    log "after restart fetched $total_fetched bytes for $(( (262144 - after) * 4096 )) bytes uncached"
    # Stop the target and its relay: the proxy is now the only copy.
    for p in "${PIDS[@]}"; do [ "$p" = "$pid" ] || kill "$p" 2>/dev/null || true; done
    ip netns exec $NS_DST nbdcopy "$uri" "$WORK/after.img"
    # fio's region: take it from the proxy (fio verified it), everything else must match exactly.
    local checked=0
    python3 - "$WORK/expect.img" "$WORK/after.img" <<'EOF' || checked=$?
import sys
a = open(sys.argv[1], 'rb'); b = open(sys.argv[2], 'rb')
lo, hi = 512 << 20, (512 + 32) << 20
off = 0; bad = 0
while True:
    x = a.read(1 << 20); y = b.read(1 << 20)
    if not x and not y: break
    if not (lo <= off < hi) and x != y: bad += 1
    off += 1 << 20
print("relocation check:", "OK: every byte outside fio's verified region matches" if bad == 0 else f"FAIL: {bad} MiB differ")
sys.exit(1 if bad else 0)
EOF
    echo "{\"job\": \"relocation\", \"ok\": $([ "$checked" = 0 ] && echo true || echo false), \"killed_at_blocks\": $before, \"persisted_blocks\": $persisted, \"after_restart_blocks\": $after, \"fetched_after_restart\": $total_fetched}" >> "$WORK/wan.jsonl"
    stop_pid "$pid"
    [ "$checked" = 0 ]
}

case $MODE in
    loopback) loopback ;;
    wan) wan ;;
    all) loopback; wan ;;
    *) log "usage: $0 [loopback|wan|all]"; exit 2 ;;
esac

if [ -n "${JSON:-}" ]; then
    params=$(python3 -c "import json,sys; print(json.dumps({'mode': sys.argv[1], 'secs': int(sys.argv[2]), 'rounds': int(sys.argv[3]), 'wan_secs': int(sys.argv[4]), 'loop_cases': sys.argv[5].split('|'), 'loop_size_mb': int(sys.argv[6])}))" \
        "$MODE" "$SECS" "$ROUNDS" "$WAN_SECS" "$LOOP_CASES" "$LOOP_SIZE_MB")
    cmd="JSON=$JSON SECS=$SECS ROUNDS=$ROUNDS WAN_SECS=$WAN_SECS crates/nbd/bench/run.sh $MODE"
    if [ "$JSON" = - ]; then
        python3 "$HERE/to_json.py" "$WORK" - "$cmd" "$STARTED" "$params" $LOOP_NAMES >&3
    else
        python3 "$HERE/to_json.py" "$WORK" "$JSON" "$cmd" "$STARTED" "$params" $LOOP_NAMES
        log "results: $JSON"
    fi
fi
