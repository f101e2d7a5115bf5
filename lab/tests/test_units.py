"""Fast tests of the harness's parts that need no virtual host."""

from __future__ import annotations

import dataclasses
import hashlib
import io
import json
import random
import re
import os
import shutil
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from kemari_lab import cleanup
from kemari_lab.cpio import CpioWriter, read_names
from kemari_lab.errors import LabError
from kemari_lab.guests import GuestSpec, vmm_log
from kemari_lab.netns import guest_ip, host_ip


def test_cpio_round_trip_and_concatenation() -> None:
    buf = io.BytesIO()
    w = CpioWriter(buf)
    w.add_bytes("etc/hostname", b"vh0\n")
    w.add_symlink("bin/sh", "busybox")
    w.add_dir("tmp")
    w.close()
    second = io.BytesIO()
    w2 = CpioWriter(second)
    w2.add_bytes("lab/guest/x", b"123")
    w2.close()
    data = buf.getvalue() + second.getvalue()
    assert len(buf.getvalue()) % 4 == 0
    assert read_names(data) == ["etc", "etc/hostname", "bin", "bin/sh", "tmp", "lab", "lab/guest", "lab/guest/x"]


def test_cleanup_runs_newest_first_once_and_survives_failures() -> None:
    order: list[str] = []

    def failing() -> None:
        order.append("failing")
        raise OSError("boom")

    reg = cleanup.CleanupRegistry()
    a = reg.register("a", lambda: order.append("a"))
    reg.register("failing", failing)
    reg.register("c", lambda: order.append("c"))
    forgotten = reg.register("forgotten", lambda: order.append("forgotten"))
    reg.forget(forgotten)
    reg.run_one(a)
    assert reg.pending() == ["failing", "c"]
    reg.run_all()
    reg.run_all()
    assert order == ["a", "c", "failing"]
    assert reg.pending() == []


def test_addresses_and_guest_specs() -> None:
    assert host_ip(0) == "10.77.0.10" and host_ip(1) == "10.77.0.11"
    assert guest_ip(0, 0) == "10.77.0.100" and guest_ip(1, 2) == "10.77.0.112"
    spec = GuestSpec(name="g", vmm="kemari", host_index=1, index=2)
    cmd = spec.vmm_command()
    assert "--vcpus 2" in cmd and "--memory 512M" in cmd and "tap=g2" in cmd
    assert re.search(r"klab\.ip=10\.77\.0\.112/24", cmd)
    assert "-enable-kvm" in GuestSpec(name="q").vmm_command()
    with pytest.raises(LabError):
        GuestSpec(name="x", vmm="firecracker")


def test_qemu_memfd_variant_backs_guest_memory_with_a_memfd(monkeypatch: pytest.MonkeyPatch) -> None:
    from kemari_lab.soak import SOAK_VMMS, soak_vmms

    cmd = GuestSpec(name="m", vmm="qemu-microvm-memfd", memory_mb=768).vmm_command()
    assert "-M microvm," in cmd and ",memory-backend=m0" in cmd
    assert "-object memory-backend-memfd,id=m0,size=768M,share=on" in cmd
    assert "virtio-blk-device" in cmd
    assert "memory-backend" not in GuestSpec(name="a", vmm="qemu-microvm").vmm_command()
    monkeypatch.delenv("KEMARI_SOAK_VMMS", raising=False)
    assert soak_vmms() == SOAK_VMMS
    monkeypatch.setenv("KEMARI_SOAK_VMMS", "qemu-microvm, qemu-microvm-memfd")
    assert soak_vmms() == ("qemu-microvm", "qemu-microvm-memfd")
    for bad in ("kemari", "kemari,kemari", "kemari,firecracker", "kemari,qemu,qemu-microvm"):
        monkeypatch.setenv("KEMARI_SOAK_VMMS", bad)
        with pytest.raises(LabError):
            soak_vmms()


def test_virtual_hosts_tcg_thread_mode_is_chosen_or_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    from kemari_lab.vhost import tcg_accel

    monkeypatch.delenv("KEMARI_LAB_TCG_THREAD", raising=False)
    assert tcg_accel() == "tcg"
    monkeypatch.setenv("KEMARI_LAB_TCG_THREAD", "single")
    assert tcg_accel() == "tcg,thread=single"
    monkeypatch.setenv("KEMARI_LAB_TCG_THREAD", "one")
    with pytest.raises(LabError, match="single or multi"):
        tcg_accel()


def test_virtual_hosts_qemu_is_the_systems_or_an_unpacked_one(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    from kemari_lab.vhost import qemu_binary

    monkeypatch.delenv("KEMARI_LAB_QEMU", raising=False)
    assert qemu_binary() == ["qemu-system-x86_64"]
    monkeypatch.setenv("KEMARI_LAB_QEMU", str(tmp_path))
    with pytest.raises(LabError, match="unpack the QEMU packages"):
        qemu_binary()
    (tmp_path / "usr/bin").mkdir(parents=True)
    (tmp_path / "usr/bin/qemu-system-x86_64").write_text("")
    (tmp_path / "usr/share/qemu").mkdir(parents=True)
    assert qemu_binary() == [
        str(tmp_path / "usr/bin/qemu-system-x86_64"),
        "-L", str(tmp_path / "usr/share/qemu"),
        "-L", "/usr/share/qemu",
    ]  # fmt: skip


def test_backported_qemu_packages_are_found_newest_first_or_refused() -> None:
    from kemari_lab.qemu_backport import parse_packages

    def stanza(name: str, version: str) -> str:
        return (
            f"Package: {name}\nSource: qemu\nVersion: {version}\n"
            f"Depends: libc6 (>= 2.34),\n libfdt1\nFilename: pool/{name}_{version}.deb\nSHA256: {name[:4]}{version}\n"
        )

    index = "\n".join(
        [
            stanza("qemu-system-x86", "1:9.2.0~bpo12+1"),
            stanza("qemu-system-x86", "1:10.0.2+ds-2~bpo12+1"),
            stanza("qemu-system-common", "1:10.0.2+ds-2~bpo12+1"),
            stanza("qemu-utils", "1:10.0.2+ds-2~bpo12+1"),
        ]
    )
    found = parse_packages(index, ("qemu-system-x86", "qemu-system-common"))
    assert found["qemu-system-x86"] == {
        "Version": "1:10.0.2+ds-2~bpo12+1",
        "Filename": "pool/qemu-system-x86_1:10.0.2+ds-2~bpo12+1.deb",
        "SHA256": "qemu1:10.0.2+ds-2~bpo12+1",
    }
    assert set(found) == {"qemu-system-x86", "qemu-system-common"}
    with pytest.raises(LabError, match="lists no qemu-system-data"):
        parse_packages(index, ("qemu-system-x86", "qemu-system-data"))


def test_backported_qemu_index_is_taken_from_a_signed_release_only() -> None:
    from kemari_lab.qemu_backport import index_digest, verified_release

    release = (
        "Origin: Debian Backports\nMD5Sum:\n 0123 300424 main/binary-amd64/Packages.xz\n"
        "SHA256:\n " + "a" * 64 + " 12 main/binary-all/Packages.xz\n "
        + "b" * 64 + " 300424 main/binary-amd64/Packages.xz\n"
    )
    assert index_digest(release) == "b" * 64
    with pytest.raises(LabError, match="no SHA-256 for main/binary-i386"):
        index_digest(release, "main/binary-i386/Packages.xz")
    if shutil.which("gpgv") is None:
        pytest.skip("no gpgv here: the signature check is not exercised")
    with pytest.raises(LabError, match="bad or unknown signature"):
        verified_release(b"-----BEGIN PGP SIGNED MESSAGE-----\nHash: SHA256\n\n" + release.encode())


def test_guest_spec_shared_disk_and_api_socket() -> None:
    spec = GuestSpec(name="roam", vmm="kemari", disk_url="nbd://10.77.0.1:10809/disk")
    cmd = spec.vmm_command()
    assert "--disk nbd://10.77.0.1:10809/disk" in cmd and "/tmp/roam.disk" not in cmd
    assert "--api-socket /tmp/roam.sock" in cmd
    assert "--disk /tmp/g.disk" in GuestSpec(name="g", vmm="kemari").vmm_command()
    assert "file=nbd://h:1/e,format=raw" in GuestSpec(name="q", disk_url="nbd://h:1/e").vmm_command()


class _EchoServer:
    """A local TCP echo server for echo_client.py; `corrupt_after` flips one
    echoed byte once that many bytes have gone through."""

    def __init__(self, corrupt_after: int | None = None) -> None:
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.corrupt_after = corrupt_after
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        conn, _ = self.sock.accept()
        seen = 0
        with conn:
            while data := conn.recv(65536):
                out = bytearray(data)
                if self.corrupt_after is not None and seen <= self.corrupt_after < seen + len(out):
                    out[self.corrupt_after - seen] ^= 0xFF
                seen += len(out)
                conn.sendall(out)


def _echo_client(port: int) -> subprocess.Popen[str]:
    script = Path(__file__).resolve().parent.parent / "kemari_lab" / "echo_client.py"
    return subprocess.Popen(
        [sys.executable, str(script), "127.0.0.1", str(port), "--interval", "0.01", "--stall-limit", "5"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )


def test_echo_client_verifies_echoes_on_one_connection() -> None:
    server = _EchoServer()
    proc = _echo_client(server.port)
    assert proc.stdout is not None
    first = json.loads(proc.stdout.readline())
    assert first["connected"] and first["local"].startswith("127.0.0.1:")
    time.sleep(0.5)
    out, _ = proc.communicate("stats\nstop\n", timeout=30)
    stats, final = (json.loads(line) for line in out.splitlines())
    assert proc.returncode == 0
    assert stats["error"] is None and stats["exchanges"] > 5 and stats["bytes"] > 0
    assert final["exchanges"] >= stats["exchanges"] and final["error"] is None


def test_echo_client_reports_a_corrupted_echo() -> None:
    server = _EchoServer(corrupt_after=20000)
    proc = _echo_client(server.port)
    assert proc.stdout is not None
    assert json.loads(proc.stdout.readline())["connected"]
    time.sleep(1.0)
    out, _ = proc.communicate("stop\n", timeout=30)
    final = json.loads(out.splitlines()[-1])
    assert proc.returncode == 1
    assert "differs from what was sent" in final["error"]


def test_echo_client_fails_when_it_cannot_connect() -> None:
    free = socket.create_server(("127.0.0.1", 0))
    port = free.getsockname()[1]
    free.close()
    script = Path(__file__).resolve().parent.parent / "kemari_lab" / "echo_client.py"
    proc = subprocess.run(
        [sys.executable, str(script), "127.0.0.1", str(port), "--connect-timeout", "0"],
        check=False,
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert proc.returncode == 1
    reply = json.loads(proc.stdout)
    assert reply["connected"] is False and "cannot connect" in reply["error"]


def test_kemari_log_lines_are_found_in_a_console() -> None:
    spec = GuestSpec(name="r", vmm="kemari", log_level="info")
    assert spec.vmm_command().endswith(" --log-level info --log-json")
    assert "--log-level" not in GuestSpec(name="q", log_level="info").vmm_command()
    committed = '{"timestamp":"t","level":"INFO","fields":{"message":"live migration committed","restore_ms":402}}'
    console = f"KLAB-GUEST-READY ip=x\n{committed}\n" + '{"timestamp":"t","level":"INFO","fie\nguest text\n'
    assert [e["fields"]["restore_ms"] for e in vmm_log(console, "live migration committed")] == [402]
    assert len(vmm_log(console)) == 1


def _fence_server(tmp_path: Path, targets: dict[str, int]) -> tuple[subprocess.Popen[bytes], int, Path]:
    free = socket.create_server(("127.0.0.1", 0))
    port = free.getsockname()[1]
    free.close()
    log = tmp_path / "fence.log"
    script = Path(__file__).resolve().parent.parent / "kemari_lab" / "fence_server.py"
    args = [f"--target={ip}={pid}" for ip, pid in targets.items()]
    proc = subprocess.Popen([sys.executable, str(script), "--listen", f"127.0.0.1:{port}", "--log", str(log), *args])
    deadline = time.monotonic() + 10
    while not (log.exists() and "listening" in log.read_text()):
        assert proc.poll() is None and time.monotonic() < deadline
        time.sleep(0.05)
    return proc, port, log


def test_fence_server_powers_off_the_named_host_only_once(tmp_path: Path) -> None:
    """The lab's STONITH: kills the QEMU (here: a sleep) of the host the
    standby names, says so, and says "already-off" afterwards; unknown
    addresses are refused."""
    import urllib.error
    import urllib.request

    victim = subprocess.Popen(["sleep", "60"])
    bystander = subprocess.Popen(["sleep", "60"])
    server, port, log = _fence_server(tmp_path, {"10.9.9.10": victim.pid, "10.9.9.11": bystander.pid})
    try:

        def get(peer: str) -> tuple[int, str]:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/fence?peer={peer}", timeout=10) as r:
                    return r.status, r.read().decode()
            except urllib.error.HTTPError as e:
                return e.code, e.read().decode()

        assert get("10.9.9.10:40000") == (200, "KLAB-FENCED ip=10.9.9.10 action=killed\n")
        assert victim.wait(timeout=5) == -9
        assert get("10.9.9.10:40000")[1] == "KLAB-FENCED ip=10.9.9.10 action=already-off\n"
        assert get("10.9.9.99:1")[0] == 404
        assert bystander.poll() is None
        events = [json.loads(line) for line in log.read_text().splitlines()][1:]
        assert [e.get("action") for e in events] == ["killed", "already-off", None]
    finally:
        server.terminate()
        server.wait(timeout=5)
        bystander.kill()
        bystander.wait()


@pytest.mark.skipif(shutil.which("busybox") is None, reason="needs busybox (sh, nc) like the virtual hosts")
def test_fence_command_succeeds_only_on_confirmation(tmp_path: Path) -> None:
    """kemari's --ft-fence-cmd as the standby runs it (busybox sh -c, with
    KEMARI_FT_PEER): exit 0 when the fence server confirms, non-zero otherwise."""
    from kemari_lab.fault_tolerance import fence_command

    busybox = shutil.which("busybox") or "busybox"
    victim = subprocess.Popen(["sleep", "60"])
    server, port, _ = _fence_server(tmp_path, {"10.9.9.10": victim.pid})
    try:

        def run(peer: str) -> int:
            env = {"KEMARI_FT_PEER": peer, "PATH": str(tmp_path / "bin")}
            (tmp_path / "bin").mkdir(exist_ok=True)
            for applet in ("sh", "printf", "nc", "grep"):
                link = tmp_path / "bin" / applet
                if not link.exists():
                    link.symlink_to(busybox)
            cmd = fence_command("127.0.0.1", port)
            return subprocess.run([busybox, "sh", "-c", cmd], env=env, timeout=30, check=False).returncode

        assert run("10.9.9.10:5555") == 0
        assert victim.wait(timeout=5) == -9
        assert run("10.9.9.77:5555") != 0
    finally:
        server.terminate()
        server.wait(timeout=5)
    # Nothing listening: the standby must not fail over.
    assert subprocess.run(
        [busybox, "sh", "-c", fence_command("127.0.0.1", port)],
        env={"KEMARI_FT_PEER": "10.9.9.10:1", "PATH": str(tmp_path / "bin")},
        timeout=30,
        check=False,
    ).returncode != 0


def test_kernel_nbd_writes_cover_the_cases() -> None:
    """The kernel-nbd scenario's writes: disjoint, inside the export and the
    pattern, whole dd blocks; one O_DIRECT write starts inside a 4 KiB block
    and ends inside another, one crosses 16 MiB, one is the last block."""
    from kemari_lab import kernel_nbd as kn

    ends = 0
    for w in kn.WRITES:
        assert w.offset >= ends and w.end <= kn.EXPORT_SIZE, w
        assert w.length % w.bs == 0 and w.source + w.length <= kn.PATTERN_SIZE, w
        ends = w.end
    assert any(w.direct and w.offset % 4096 and w.end % 4096 for w in kn.WRITES)
    assert any(w.offset < 16 << 20 < w.end for w in kn.WRITES)
    assert kn.WRITES[-1].end == kn.EXPORT_SIZE and kn.EXPORT_SIZE % (1 << 20)


@pytest.mark.skipif(shutil.which("busybox") is None, reason="needs busybox (dd, sha256sum) like the virtual hosts")
def test_kernel_nbd_writes_land_where_the_image_check_looks(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The scenario's dd commands, run by busybox on a file standing in for
    /dev/nbd0 (without O_DIRECT), put each pattern slice where image_problems
    looks for it, and read it back; image_problems finds one wrong byte."""
    from kemari_lab import kernel_nbd as kn

    busybox = shutil.which("busybox") or "busybox"
    pattern = random.Random(1).randbytes(kn.PATTERN_SIZE)
    base = random.Random(2).randbytes(kn.EXPORT_SIZE)
    (tmp_path / "pattern").write_bytes(pattern)
    (tmp_path / "device").write_bytes(base)
    for name in ("PATTERN", "DEVICE", "_READ_BACK", "_WANTED"):
        monkeypatch.setattr(kn, name, str(tmp_path / name.lower()))

    def sh(cmd: str) -> str:
        proc = subprocess.run([busybox, "sh", "-c", cmd], capture_output=True, text=True, check=False, timeout=60)
        assert proc.returncode == 0, f"{cmd}\n{proc.stdout}{proc.stderr}"
        return proc.stdout

    written: dict[kn.Write, str] = {}
    for w in kn.WRITES:
        local = dataclasses.replace(w, direct=False)
        sh(local.write_command())
        sums = kn._sha256_lines(sh(local.read_back_command()))
        want = hashlib.sha256(pattern[w.source : w.source + w.length]).hexdigest()
        assert sums[kn._READ_BACK] == sums[kn._WANTED] == want, w
        written[w] = want
    data = (tmp_path / "device").read_bytes()
    whole = hashlib.sha256(data).hexdigest()
    assert kn.image_problems(data, base, written, whole) == []

    def flipped(offset: int) -> bytes:
        bad = bytearray(data)
        bad[offset] ^= 1
        return bytes(bad)

    problems = kn.image_problems(flipped(kn.WRITES[1].offset + 100), base, written, whole)
    assert len(problems) == 2 and problems[0].startswith(kn.WRITES[1].what) and "whole image" in problems[1]
    problems = kn.image_problems(flipped(3 << 20), base, written, whole)
    assert len(problems) == 2 and f"at offset {3 << 20} " in problems[0]
    assert "bytes, the export had" in kn.image_problems(data[:-4096], base, written, whole)[0]


def test_guest_spec_verbose_cmdline() -> None:
    quiet = GuestSpec(name="q").cmdline
    assert quiet.startswith("console=ttyS0 quiet panic=-1 klab.ip=")
    verbose = GuestSpec(name="v", vmm="kemari", verbose=True).cmdline
    assert "quiet" not in verbose
    assert "loglevel=7 oops=panic panic=-1 klab.verbose=1" in verbose and "klab.ip=10.77.0.100/24" in verbose


def test_soak_classifies_guest_ends() -> None:
    from kemari_lab.soak import classify, crash_excerpt

    booted = "KLAB-GUEST-BOOTED cpus=2\nKLAB-GUEST-READY ip=10.77.0.100/24\n"
    kemari_tf = booted + (
        "2026-11-26T01:00:00Z ERROR vmm::vstate::vcpu::runner: guest crashed: triple fault vcpu=0 rip=0xfff0"
        " cs=0xf000 cr0=0x10\nKLAB-VMM-EXIT=4\n"
    )
    tf = classify("kemari", 4, kemari_tf)
    assert tf["kind"] == "triple-fault" and tf["triple_fault"] and not tf["panic_text"]
    assert classify("kemari", 4, booted)["kind"] == "triple-fault"  # exit 4 alone says so
    panic = booted + "[  812.1] BUG: kernel NULL pointer dereference\n[  812.2] Kernel panic - not syncing: Fatal\n"
    p = classify("qemu-microvm", 0, panic + "KLAB-VMM-EXIT=0\n")
    assert p["kind"] == "panic" and p["panic_text"] and not p["triple_fault"]
    assert classify("qemu-microvm", 0, booted + "KLAB-VMM-EXIT=0\n")["kind"] == "silent-reset"
    assert classify("kemari", 0, booted + "KLAB-VMM-EXIT=0\n")["kind"] == "silent-reset"
    assert classify("kemari", 0, booted + "KLAB-GUEST-POWEROFF\nKLAB-VMM-EXIT=0\n")["kind"] == "poweroff"
    assert classify("qemu-microvm", 1, booted)["kind"] == "exit-1"
    c = classify("kemari", None, booted, client_error="echo: ConnectionResetError")
    assert c["kind"] == "client-error" and c["client_error"] == "echo: ConnectionResetError"
    # A WARNING or a soft lockup at boot is quoted but is no panic.
    lockup = "[ 66.2] watchdog: BUG: soft lockup - CPU#1 stuck for 28s! [swapper/0:1]\n"
    w = classify("qemu-microvm", 0, "[ 0.5] WARNING: CPU: 0 PID: 0 at foo\n" + lockup + booted)
    assert w["kind"] == "silent-reset"
    ex = crash_excerpt(
        "[ 0.5] WARNING: CPU: 0 at boot\n" + "\n".join(f"line {i}" for i in range(99)) + "\n" + panic, tail=5
    )
    assert ex["tail"][-1].endswith("Kernel panic - not syncing: Fatal") and len(ex["tail"]) == 5
    assert ex["marked"] == [
        "103: [  812.1] BUG: kernel NULL pointer dereference",
        "104: [  812.2] Kernel panic - not syncing: Fatal",
    ]


def test_soak_rounds_plan_alternates_the_fresh_guest_and_moves_each_kind() -> None:
    from kemari_lab.soak_rounds import round_plan

    for n in (1, 2):
        plan = round_plan(n)
        assert len({p.index for p in plan}) == len(plan)  # one TAP name per guest in the round
        moves = {(p.vmm, p.move) for p in plan}
        assert {("kemari", "migrate"), ("qemu", "migrate"), ("kemari", "failover")} <= moves
        assert all(p.shared_disk == (p.move is not None) and (p.to is None) == (p.move is None) for p in plan)
        assert all(p.to != p.host for p in plan if p.move)
    assert [p.vmm for p in round_plan(1) if p.move is None] == ["qemu"]
    assert [p.vmm for p in round_plan(2) if p.move is None] == ["kemari"]


def _round(n: int, slots: list[dict[str, object]], deaths: int = 0) -> dict[str, object]:
    return {"round": n, "soak_minutes": 10.0, "slots": slots, "host_deaths": [{"host": "vh1"}] * deaths}


def test_soak_rounds_add_up_per_vmm_and_kind(tmp_path: Path) -> None:
    from kemari_lab.soak_rounds import add_round, load_rounds, totals, totals_text

    path = tmp_path / "rounds.json"
    assert load_rounds(path) == []
    kemari_mig = {
        "vmm": "kemari",
        "move": "migrate",
        "move_report": {"downtime_ms": 80},
        "seconds_by_kind": {"fresh": 120.0, "migrated": 600.0},
        "stalled_seconds_by_kind": {"migrated": 60.0},
        "lives_by_kind": {"fresh": 2, "migrated": 1},
        "crashes": [
            {"kind": "triple-fault", "guest_kind": "migrated"},
            {"kind": "poweroff", "guest_kind": "fresh"},  # asked for: no crash
        ],
    }
    kemari_fo = {
        "vmm": "kemari",
        "move": "failover",
        "move_report": {"error": "ft start failed"},
        "seconds_by_kind": {"fresh": 300.0},
        "lives_by_kind": {"fresh": 1},
        "crashes": [{"kind": "host-died", "guest_kind": "fresh"}],
    }
    qemu_fresh = {
        "vmm": "qemu-microvm",
        "move": None,
        "seconds_by_kind": {"fresh": 630.0},
        "lives_by_kind": {"fresh": 1},
        # No guest_kind: a fresh guest. A boot that timed out is no crash.
        "crashes": [{"kind": "silent-reset"}, {"kind": "boot-failure", "guest_kind": "fresh"}],
    }
    add_round(path, _round(1, [kemari_mig, kemari_fo]))
    rounds = add_round(path, _round(2, [kemari_mig, qemu_fresh], deaths=1))
    assert load_rounds(path) == rounds and [r["round"] for r in rounds] == [1, 2]
    t = totals(rounds)
    assert (t["rounds"], t["soak_minutes"], t["host_deaths"]) == (2, 20.0, 1)
    k = t["per"]["kemari"]
    # 2 x 10 migrated minutes less 2 x 1 stalled; fresh: 2 x 2 + 5.
    assert k["migrated"]["guest_minutes"] == 18.0 and k["fresh"]["guest_minutes"] == 9.0
    assert k["migrated"]["crashes"] == 2 and k["migrated"]["by_kind"] == {"triple-fault": 2}
    assert k["migrated"]["guests"] == 2 and k["fresh"]["guests"] == 5
    assert k["fresh"]["crashes"] == 0 and k["fresh"]["host_died"] == 1  # host deaths are not guest crashes
    q = t["per"]["qemu-microvm"]["fresh"]
    assert (q["guest_minutes"], q["crashes"], q["by_kind"]) == (10.5, 1, {"silent-reset": 1})
    assert q["boot_failures"] == 1 and k["fresh"]["boot_failures"] == 0
    assert t["moves"]["kemari"] == {
        "migrate": {"ok": 2, "failed": 0, "not_done": 0},
        "failover": {"ok": 0, "failed": 1, "not_done": 0},
    }
    not_reached = totals([_round(1, [dict(kemari_mig, move_report=None)])])
    assert not_reached["moves"]["kemari"]["migrate"] == {"ok": 0, "failed": 0, "not_done": 1}
    assert "qemu-microvm" not in t["moves"]
    text = totals_text(t)
    assert "2 rounds" in text and "1 virtual host deaths" in text
    assert re.search(r"kemari +migrated +18\.0 +2 +2 +0 +0  triple-fault 2", text), text
    # A file that is not a results file is refused, not overwritten.
    bad = tmp_path / "bad.json"
    bad.write_text("{}")
    with pytest.raises(LabError, match="not a soak results file"):
        add_round(bad, _round(1, []))
    assert bad.read_text() == "{}"


def test_soak_move_slot_counts_time_per_kind() -> None:
    from types import SimpleNamespace

    from kemari_lab.soak_rounds import MoveSlot

    host = SimpleNamespace(name="vh0", index=0)  # only named in log lines here
    s = MoveSlot(lab=None, host=host, vmm="kemari", index=0)  # type: ignore[arg-type]
    s._set_kind("fresh")
    s.ready_at = time.monotonic() - 120  # ready two minutes ago
    s._set_kind("migrated")
    assert s.kind == "migrated" and s.ready_at > 0 and s.seconds_by_kind["fresh"] >= 120
    s.stall_since = time.monotonic() - 30
    s.host_stalls.append({"host": "vh1"})
    s._stall_over()
    assert s.stalled_seconds_by_kind["migrated"] >= 30 and s.stall_since is None
    s.ready_at -= 60
    s._count_time()
    assert s.ready_at == 0.0 and s.seconds_by_kind["migrated"] >= 60
    assert s.guest_seconds == pytest.approx(sum(s.seconds_by_kind.values()))
    assert s.lives_by_kind == {"fresh": 1, "migrated": 1}
    s._set_kind("fresh")  # a guest that is not running: no time counted, none started
    assert s.ready_at == 0.0


def test_qemu_monitor_port_and_info_migrate() -> None:
    from kemari_lab.qemu_migration import parse_info_migrate

    assert "-monitor none" in GuestSpec(name="q", vmm="qemu-microvm").vmm_command()
    spec = GuestSpec(name="q", vmm="qemu-microvm", monitor_port=4501)
    assert "-monitor tcp:127.0.0.1:4501,server=on,wait=off" in spec.vmm_command()
    out = (
        "QEMU 7.2.15 monitor - type 'help' for more information\r\n(qemu) \x1b[Kinfo migrate\r\n"
        "globals:\r\nstore-global-state: on\r\nMigration status: completed\r\n"
        "total time: 8123 ms\r\ndowntime: 96 ms\r\nsetup: 12 ms\r\ntransferred ram: 61234 kbytes\r\n"
        "throughput: 62.13 mbps\r\n(qemu) "
    )
    info = parse_info_migrate(out)
    assert info == {
        "status": "completed",
        "total_ms": 8123.0,
        "downtime_ms": 96.0,
        "setup_ms": 12.0,
        "transferred_kb": 61234.0,
        "throughput_mbps": 62.13,
    }
    assert parse_info_migrate("(qemu) ")["status"] is None


def test_disk_client_counts_acknowledged_writes_and_stops_on_a_lost_write() -> None:
    import http.server
    from urllib.parse import urlparse

    answers: list[str] = []

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            token = urlparse(self.path).query
            body = f"KLAB-DISK-{'FAIL' if len(answers) >= 3 else 'OK'} {token}\n"
            answers.append(body)
            self.send_response(200)
            self.end_headers()
            self.wfile.write(body.encode())

        def log_message(self, *args: object) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        script = Path(__file__).resolve().parent.parent / "kemari_lab" / "disk_client.py"
        # stdin stays open: its end would stop the writer.
        proc = subprocess.Popen(
            [sys.executable, str(script), f"127.0.0.1:{server.server_address[1]}", "--interval", "0.05"],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        )  # fmt: skip
        status = proc.wait(timeout=30)
        assert proc.stdout is not None and proc.stdin is not None
        out = proc.stdout.read()
        proc.stdin.close()
    finally:
        server.shutdown()
    lines = [json.loads(line) for line in out.splitlines()]
    assert status == 1, out
    assert lines[-1]["acks"] == 3 and "failed to write and read back" in lines[-1]["error"]


def test_platform_reset_is_told_from_other_failures(tmp_path: Path) -> None:
    from kemari_lab.platform_reset import platform_reset_in

    assert platform_reset_in(tmp_path) is None
    (tmp_path / "vh0.console").write_text("[    1.0] booted\n")
    (tmp_path / "vh0-kemari0.console").write_text("KLAB-GUEST-READY\nkemari: failed to open disk\nKLAB-VMM-EXIT=1\n")
    (tmp_path / "vh1-qemu0.console").write_text("KLAB-GUEST-POWEROFF\nKLAB-VMM-EXIT=0\n")
    assert platform_reset_in(tmp_path) is None
    (tmp_path / "vh0-roam.console").write_text(
        'KLAB-GUEST-READY\n{"level":"ERROR","fields":{"message":"guest crashed: triple fault"}}\nKLAB-VMM-EXIT=4\n'
    )
    found = platform_reset_in(tmp_path)
    assert found is not None and "vh0-roam.console" in found and "triple fault" in found
    (tmp_path / "vh0-roam.console").unlink()
    (tmp_path / "vh1-qemu1.console").write_text("KLAB-GUEST-READY ip=10.77.0.101/24\nKLAB-VMM-EXIT=0\n")
    found = platform_reset_in(tmp_path)
    assert found is not None and "vh1-qemu1.console" in found


def test_a_dead_or_locked_up_virtual_host_is_told_from_other_failures(tmp_path: Path) -> None:
    from kemari_lab.platform_reset import host_fault_in, platform_fault_in

    timeout = "vh0: timed out after 118s waiting for command `cat /tmp/qemu0.console`"
    host = tmp_path / "vh0.console"
    # Short lockups come and go in passing runs; a nested guest's own panic
    # and a kemari that exits non-zero are never the platform's.
    host.write_text("[   52.8] watchdog: BUG: soft lockup - CPU#1 stuck for 26s! [vcpu1:150]\n")
    (tmp_path / "vh0-kemari0.console").write_text("Kernel panic - not syncing: Attempted to kill init!\nKLAB-VMM-EXIT=159\n")
    assert host_fault_in(tmp_path, timeout) is None
    # A long lockup explains a timeout, not another failure.
    host.write_text(
        "[   80.8] watchdog: BUG: soft lockup - CPU#1 stuck for 52s! [qemu-system-x86:150]\n"
        "[  136.8] watchdog: BUG: soft lockup - CPU#1 stuck for 104s! [qemu-system-x86:150]\n"
    )
    found = host_fault_in(tmp_path, timeout)
    assert found is not None and "104 s" in found and "qemu-system-x86" in found
    assert platform_fault_in(tmp_path, "vh0: guest did not report 2 CPUs") is None
    # The virtual host's kernel dying inside KVM_RUN, whatever the error said.
    host.write_text(
        "[   52.79] BUG: TASK stack guard page was hit at 0000000040b3512e\n"
        "[   54.38] Kernel panic - not syncing: corrupted stack end detected inside scheduler\n"
    )
    found = platform_fault_in(tmp_path, "reboot 1 of 5: vh0: QEMU exited while waiting for command")
    assert found is not None and "vh0.console" in found and "died" in found
    # A virtual host whose QEMU ended by itself, nothing on its console (a
    # CI rehearsal, 2026-11-29): most likely a reset under -no-reboot. One the lab stopped, or wrong
    # data with it, is not the platform's.
    host.write_text("[    1.0] booted\n")
    ended = "reboot 2 of 5: vh0: cannot run `cat /tmp/kemari0.console`: the virtual host is not running"
    found = platform_fault_in(tmp_path, ended + " (its QEMU exited by itself (status 0))")
    assert found is not None and "vh0" in found and "reset" in found
    found = platform_fault_in(tmp_path, "vh1: QEMU exited while waiting for x (its QEMU exited by itself (status -11))")
    assert found is not None and "vh1" in found and "signal 11" in found
    assert platform_fault_in(tmp_path, ended + " (stopped by the lab)") is None
    assert platform_fault_in(tmp_path, "records lost; vh0: x (its QEMU exited by itself (status 0))") is None


def test_a_stall_is_retried_wrong_data_never(tmp_path: Path) -> None:
    from kemari_lab.platform_reset import platform_fault_in

    stalled = "after the resume: client connection 10.77.0.2:1 -> 10.77.0.100:7 failed: after 30 echoes: TimeoutError: timed out"
    found = platform_fault_in(tmp_path, stalled)
    assert found is not None and "timeout" in found and "after the resume" in found
    # A guest silent on ARP is silence too (seen in CI: the virtual host
    # stopped answering while its guest wrote its disk).
    unreachable = (
        "reboot 5 of 5: client: GET http://10.77.0.100/cgi-bin/reboot failed (1): Traceback (most recent call last):\n"
        "OSError: [Errno 113] No route to host"
    )
    found = platform_fault_in(tmp_path, unreachable)
    assert found is not None and "reboot 5 of 5" in found
    # Diagnostics attached to a stall do not make it wrong data.
    attached = stalled + "\nkemari0 on vh0:\n  console:\n{\"message\":\"dirty tracker ready\"} lost"
    assert platform_fault_in(tmp_path, attached) is not None
    for wrong in (
        "client connection failed: corrupted echo after 12 exchanges (timed out waiting for the rest)",
        "records after reboot 3: lost 2 synced records; the request timed out once",
        "vh0: KLAB-FS dirty after reboot 2",
        "vh0: kemari exited before guest kemari0 was ready: KLAB-VMM-EXIT=159",
    ):
        assert platform_fault_in(tmp_path, wrong) is None, wrong


WARM_SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "host-warm-reboot"


def _warm(args: list[str], tmp_path: Path) -> subprocess.CompletedProcess[str]:
    sh = shutil.which("busybox")
    cmd = ([sh, "sh"] if sh else ["sh"]) + [str(WARM_SCRIPT), "--region", str(tmp_path / "region"), *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=30, check=False)


def test_warm_reboot_refuses_a_region_without_dax(tmp_path: Path) -> None:
    """Guest memory outside a DAX mount would sit in the page cache, which a
    kexec drops: freeze refuses, saying so, and freezes nothing."""
    table = tmp_path / "table"
    table.write_text("# name sock taps log\ng0 /nonexistent.sock br0:g0 /tmp/g0.log\n")
    res = _warm(["freeze", str(table)], tmp_path)
    assert res.returncode != 0
    assert "is not a DAX mount" in res.stderr
    assert not (tmp_path / "region" / "warm-reboot" / "frozen").exists()


def test_warm_reboot_needs_a_loaded_kernel_and_a_freeze_list(tmp_path: Path) -> None:
    res = _warm(["resume"], tmp_path)
    assert res.returncode != 0 and ("not a block device" in res.stderr or "no freeze list" in res.stderr)
    res = _warm(["bogus"], tmp_path)
    assert res.returncode != 0 and "unknown command bogus" in res.stderr


def test_warm_reboot_fast_load_keeps_the_image_below_the_region(tmp_path: Path) -> None:
    """`load --fast` uses kexec_load, whose placement comes from the firmware's
    memory map (where the region is RAM): --mem-max must end below the lowest
    memmap=SIZE!OFFSET region, whatever its notation."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "kexec").write_text(f'#!/bin/sh\necho "$@" > {tmp_path}/kexec.args\n')
    (bin_dir / "kexec").chmod(0o755)
    cmdline = tmp_path / "cmdline"

    def load(line: str, *args: str) -> subprocess.CompletedProcess[str]:
        cmdline.write_text(line + "\n")
        sh = shutil.which("busybox")
        cmd = ([sh, "sh"] if sh else ["sh"]) + [str(WARM_SCRIPT), "load", *args, "/k", "/i"]
        env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "KEMARI_WARM_CMDLINE": str(cmdline)}
        return subprocess.run(cmd, capture_output=True, text=True, timeout=30, check=False, env=env)

    res = load("console=ttyS0 memmap=2G!8G memmap=1G!4G quiet", "--fast")
    assert res.returncode == 0, res.stderr
    assert (tmp_path / "kexec.args").read_text().split() == [
        "-l", "-i", f"--mem-max={(4 << 30) - 1}", "/k", "--initrd=/i", "--reuse-cmdline"
    ]
    assert load("memmap=0x40000000!0x100000000", "--fast").returncode == 0
    assert f"--mem-max={(1 << 32) - 1}" in (tmp_path / "kexec.args").read_text()
    assert load("memmap=512M!4096M").returncode == 0
    assert (tmp_path / "kexec.args").read_text().split()[:2] == ["-s", "-l"]
    res = load("console=ttyS0 memmap=4G$8G", "--fast")
    assert res.returncode != 0 and "no memmap=SIZE!OFFSET region" in res.stderr


def test_warm_reboot_step_lines_are_parsed() -> None:
    from kemari_lab.warm_reboot import lab_options, steps

    out = "warm-reboot frozen name=w0 ms=120\nwarm-reboot frozen name=w1 ms=90\nwarm-reboot freeze-all vms=2 ms=130\n"
    assert steps(out) == {"frozen_w0_s": 0.12, "frozen_w1_s": 0.09, "freeze_all_s": 0.13}
    assert steps("warm-reboot resumed name=w0 ms=2010\nwarm-reboot resume-all vms=1 ms=2020") == {
        "resumed_w0_s": 2.01,
        "resume_all_s": 2.02,
    }
    opts = lab_options(3)
    assert opts["host_append"] == "memmap=3G!4G" and opts["host_memory_mb"] == 3072 + 3072


def test_warm_bench_summary_takes_medians_and_ratios() -> None:
    from kemari_lab.warm_bench import lab_options, summary

    times: dict[str, float] = {}
    for r, (f_small, f_big) in enumerate([(1.0, 1.1), (2.0, 2.4), (3.0, 2.2)], start=1):
        times[f"warm_r{r}_s0_freeze_s"], times[f"warm_r{r}_b0_freeze_s"] = f_small, f_big
        times[f"warm_r{r}_s0_resume_s"], times[f"warm_r{r}_b0_resume_s"] = 1.0, 1.0
        times[f"disk_r{r}_b0_snapshot_exit_s"], times[f"disk_r{r}_b0_restore_s"] = 20.0, 12.8
        times[f"vms6_r{r}_s{r}_stall_s"] = float(r)
    s = summary(times)
    assert s["warm_freeze_2g_over_512m"] == pytest.approx(2.2 / 2.0)
    assert s["warm_2g_median_s"] == pytest.approx(3.2)
    assert s["disk_over_warm_2g"] == pytest.approx(32.8 / 3.2)
    assert s["vms6_stall_max_s"] == 3.0
    assert "warm_over_cold_downtime" not in s
    times.update({"kexec_freeze_all_s": 5.0, "kexec_s0_stall_s": 40.0, "kexec_b0_stall_s": 55.0})
    times.update({"kexec_s0_serving_again_s": 30.0, "kexec_b0_serving_again_s": 45.0})
    times.update({"cold_s0_serving_again_s": 105.0, "cold_b0_serving_again_s": 117.0, "cold_guests_off_s": 9.0})
    s = summary(times)
    assert s["cold_service_downtime_max_s"] == 117.0
    assert s["warm_service_downtime_max_s"] == 45.0
    assert s["warm_over_cold_downtime"] == pytest.approx(45.0 / 117.0)
    assert s["warm_stall_over_cold_downtime"] == pytest.approx(55.0 / 117.0)
    assert lab_options()["host_memory_mb"] <= 9 * 1024


def test_warm_bench_round_counts_and_order(monkeypatch: pytest.MonkeyPatch) -> None:
    from kemari_lab.errors import LabError
    from kemari_lab.warm_bench import env_rounds, warm_order

    monkeypatch.delenv("KLAB_TEST_ROUNDS", raising=False)
    assert env_rounds("KLAB_TEST_ROUNDS", 3) == 3
    monkeypatch.setenv("KLAB_TEST_ROUNDS", "0")
    assert env_rounds("KLAB_TEST_ROUNDS", 3) == 0
    monkeypatch.setenv("KLAB_TEST_ROUNDS", "-1")
    with pytest.raises(LabError, match="KLAB_TEST_ROUNDS=-1"):
        env_rounds("KLAB_TEST_ROUNDS", 3)
    pair = ["s0", "b0"]
    assert warm_order(3, pair) == ["s0", "b0"]  # type: ignore[arg-type]
    assert warm_order(4, pair) == ["b0", "s0"]  # type: ignore[arg-type]


def test_warm_bench_reads_kemaris_last_setup_timing() -> None:
    from kemari_lab.warm_bench import setup_times

    def line(started_us: int) -> str:
        fields = {
            "message": "machine set-up timing", "memory_us": 900, "memslots_done_us": 1500,
            "devices_done_us": 4000, "vcpus_done_us": 9000, "started_us": started_us,
        }
        return json.dumps({"timestamp": "t", "level": "DEBUG", "fields": fields, "target": "vmm::machine::builder"})

    console = "\n".join(["KLAB-GUEST-READY ip=10.0.0.1/24", line(250_000), "guest text", line(120_000)])
    t = setup_times(console, "warm_r1_b0")
    assert t["warm_r1_b0_kemari_started_s"] == pytest.approx(0.12)  # the last start
    assert t["warm_r1_b0_kemari_memslots_s"] == pytest.approx(0.0015)
    assert setup_times("no kemari log here", "x") == {}


def test_warm_cache_summary_and_http_bench(tmp_path: Path) -> None:
    import http.server

    from kemari_lab.warm_cache import summary

    s = summary(
        {
            "warm_r1_read_before_mb_s": 500.0, "warm_r1_read_after_mb_s": 450.0,
            "cold_r1_read_before_mb_s": 500.0, "cold_r1_read_after_mb_s": 30.0,
            "warm_r1_http_before_mb_s": 40.0, "warm_r1_http_after_mb_s": 38.0,
            "cold_r1_http_before_mb_s": 40.0, "cold_r1_http_after_mb_s": 10.0,
        }
    )  # fmt: skip
    assert s["read_warm_after_over_cold_after"] == pytest.approx(15.0)
    assert s["read_warm_after_over_before"] == pytest.approx(0.9)
    assert s["http_warm_after_over_before"] == pytest.approx(0.95)
    assert "warm_http_dropped_over_before" not in s
    # With the extra passes (KEMARI_WARM_CACHE_HTTP_EXTRA=1): their ratios too.
    e = summary(
        {
            "warm_r1_read_before_mb_s": 500.0, "warm_r1_read_after_mb_s": 450.0,
            "cold_r1_read_before_mb_s": 500.0, "cold_r1_read_after_mb_s": 30.0,
            "warm_r1_http_before_mb_s": 40.0, "warm_r1_http_after_mb_s": 36.0,
            "warm_r1_http_dropped_mb_s": 38.0, "warm_r1_http_after_again_mb_s": 39.0,
            "cold_r1_http_before_mb_s": 40.0, "cold_r1_http_after_mb_s": 10.0,
        }
    )  # fmt: skip
    assert e["warm_http_dropped_over_before"] == pytest.approx(0.95)
    assert e["warm_http_after_again_over_before"] == pytest.approx(0.975)
    assert "cold_http_dropped_over_before" not in e
    # The floor run: the cached guest against one whose disk is in RAM.
    f = summary(
        {
            "warm_r1_read_before_mb_s": 170.0, "warm_r1_read_after_mb_s": 2.6,
            "ram_r1_read_before_mb_s": 172.0, "ram_r1_read_after_mb_s": 2.5,
            "warm_r1_http_before_mb_s": 4.0, "warm_r1_http_after_mb_s": 4.1,
            "ram_r1_http_before_mb_s": 4.0, "ram_r1_http_after_mb_s": 4.0,
        }
    )  # fmt: skip
    assert f["read_warm_after_over_ram_after"] == pytest.approx(1.04)
    assert "read_warm_after_over_cold_after" not in f
    # The HTTP client against a real server on loopback: one file missing.
    for i in range(3):
        (tmp_path / f"f{i:03d}").write_bytes(b"x" * 1000)

    class Quiet(http.server.SimpleHTTPRequestHandler):
        def __init__(self, *a: object, **kw: object) -> None:
            super().__init__(*a, directory=str(tmp_path), **kw)  # type: ignore[arg-type]

        def log_message(self, *a: object) -> None:
            pass

    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Quiet)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    try:
        script = Path(__file__).resolve().parents[1] / "kemari_lab" / "http_bench.py"
        addr = f"127.0.0.1:{srv.server_address[1]}"
        ok = json.loads(subprocess.check_output([sys.executable, str(script), addr, "f", "3"], text=True))
        assert ok["requests"] == 3 and ok["bytes"] == 3000 and ok["errors"] == 0 and ok["mb_s"] > 0
        bad = json.loads(subprocess.check_output([sys.executable, str(script), addr, "f", "4"], text=True))
        assert bad["errors"] == 1 and "f003" in bad["first_error"]
    finally:
        srv.shutdown()


def test_warm_cache_paired_medians_and_the_guest_alone() -> None:
    from kemari_lab.warm_cache import summary

    # Two rounds of the dax guest alone: the rounds' own ratios are 0.5 and
    # 1.0 (median 0.75), the ratio of the medians (1050/1250) differs.
    times = {
        "dax_r1_read_before_mb_s": 2000.0, "dax_r1_read_after_mb_s": 1000.0,
        "dax_r2_read_before_mb_s": 500.0, "dax_r2_read_after_mb_s": 500.0,
        "dax_r1_read_after_again_mb_s": 1100.0, "dax_r2_read_after_again_mb_s": 600.0,
        "dax_r1_http_before_mb_s": 2.0, "dax_r1_http_after_mb_s": 2.0,
        "dax_r2_http_before_mb_s": 4.0, "dax_r2_http_after_mb_s": 2.0,
        # What ran beside a read is not a rate: it must not count as one.
        "dax_r1_read_before_cpu_s_vh": 0.5, "dax_r1_read_before_dax_vcpu0_on": 1.0,
    }  # fmt: skip
    s = summary(times)
    assert s["read_dax_after_over_before_paired_median"] == pytest.approx(0.75)
    assert s["read_dax_after_over_before"] == pytest.approx(750 / 1250)
    assert s["dax_read_after_again_median_mb_s"] == pytest.approx(850)
    assert s["http_dax_after_over_before_paired_median"] == pytest.approx(0.75)
    assert not any("cold" in k for k in s)


def test_warm_cache_pmem_variant_summary_and_dax_check() -> None:
    from kemari_lab.warm_cache import dax_problem, summary

    s = summary(
        {
            "dax_r1_read_before_mb_s": 900.0, "dax_r1_read_after_mb_s": 850.0,
            "cold_r1_read_before_mb_s": 800.0, "cold_r1_read_after_mb_s": 50.0,
            "dax_r1_http_before_mb_s": 2.0, "dax_r1_http_after_mb_s": 1.9,
            "cold_r1_http_before_mb_s": 2.0, "cold_r1_http_after_mb_s": 1.0,
        }
    )  # fmt: skip
    assert s["read_dax_after_over_cold_after"] == pytest.approx(17.0)
    assert s["read_dax_after_over_before"] == pytest.approx(850 / 900)
    assert s["http_dax_after_over_before"] == pytest.approx(0.95)
    assert s["http_cold_after_over_before"] == pytest.approx(0.5)
    assert not any("warm" in k for k in s)
    # The mount reports: the boot's (console) and a read's (CGI answer).
    boot = "KLAB-DISK-OK x\nKLAB-MOUNT dev=/dev/pmem0 opts=rw,relatime,dax=always\nKLAB-NET-OK"
    assert dax_problem(boot) is None
    assert dax_problem("KLAB-READ bytes=1 start=1 end=2\nKLAB-READ-MOUNT /dev/pmem0 rw,dax\n") is None
    # The last report counts: a later boot without DAX is caught.
    assert "without DAX" in (dax_problem(boot + "\nKLAB-MOUNT dev=/dev/pmem0 opts=rw,relatime\n") or "")
    assert "without DAX" in (dax_problem("KLAB-READ-MOUNT /dev/pmem0 rw,dax=never") or "")
    assert "not mounted from a pmem" in (dax_problem("KLAB-MOUNT dev=/dev/pmem0 opts=") or "")
    assert "not mounted from a pmem" in (dax_problem("KLAB-READ-MOUNT /dev/vda rw,dax") or "")
    assert "not mounted from a pmem" in (dax_problem("KLAB-READ-MOUNT \n") or "")
    assert "no mount report" in (dax_problem("KLAB-UMOUNT-FAIL\nKLAB-DISK-OK") or "")
    # The read's time: nanoseconds where the guest had them, else its 10 ms uptime.
    from kemari_lab.warm_cache import read_seconds

    whole = f"KLAB-READ bytes={256 << 20} start=10.00 end=10.21\n"
    assert read_seconds(whole) == pytest.approx(0.21)
    assert read_seconds(whole + "KLAB-READ-NS start=1000000000 end=1214000000\n") == pytest.approx(0.214)
    assert read_seconds(whole + "KLAB-READ-NS start= end=\n") == pytest.approx(0.21)
    assert read_seconds(f"KLAB-READ bytes={256 << 20} start=3.00 end=3.00") == pytest.approx(0.01)
    assert read_seconds("KLAB-READ bytes=4096 start=1 end=2") is None
    assert read_seconds("KLAB-READ-FAIL /mnt/big.bin") is None


def test_guest_spec_pmem_data_disk() -> None:
    spec = GuestSpec(name="dax", vmm="kemari", disk=False, pmem="/dev/nbd1")
    cmd = spec.vmm_command()
    assert "--pmem /dev/nbd1" in cmd and "--disk" not in cmd
    assert "klab.disk=pmem0" in spec.cmdline
    plain = GuestSpec(name="g", vmm="kemari")
    assert "--pmem" not in plain.vmm_command() and "klab.disk" not in plain.cmdline
    with pytest.raises(LabError, match="for kemari guests"):
        GuestSpec(name="q", vmm="qemu", pmem="/dev/nbd1")


def test_guest_pmem_modules_are_listed_apart_without_the_others(tmp_path: Path) -> None:
    from kemari_lab.images import KernelTree, _add_modules

    mods = tmp_path / "lib" / "modules" / "v" / "kernel"
    mods.mkdir(parents=True)
    for name, deps in {
        "virtio": "", "virtio_mmio": "virtio", "virtio_blk": "virtio",
        "libnvdimm": "", "nd_virtio": "virtio,libnvdimm", "virtio_pmem": "nd_virtio,libnvdimm,virtio",
        "nd_btt": "libnvdimm", "nd_pmem": "libnvdimm,nd_btt",
    }.items():  # fmt: skip
        (mods / f"{name}.ko").write_bytes(b"\x7fELF\x00depends=" + deps.encode() + b"\x00name=x\x00")

    class Writer:
        def __init__(self) -> None:
            self.files: list[str] = []
            self.lists: dict[str, list[str]] = {}

        def add_file(self, path: str, src: Path, mode: int) -> None:
            self.files.append(path)

        def add_bytes(self, path: str, data: bytes, mode: int = 0o644) -> None:
            self.lists[path] = data.decode().split()

    w = Writer()
    tree = KernelTree(tmp_path, "v")
    _add_modules(w, tree, ["virtio_mmio", "virtio_blk"])  # type: ignore[arg-type]
    _add_modules(w, tree, ["virtio_pmem", "nd_pmem"], "etc/klab-modules-pmem", skip=["virtio_mmio", "virtio_blk"])  # type: ignore[arg-type]
    assert w.lists["etc/klab-modules"] == ["virtio.ko", "virtio_mmio.ko", "virtio_blk.ko"]
    assert w.lists["etc/klab-modules-pmem"] == [
        "libnvdimm.ko", "nd_virtio.ko", "virtio_pmem.ko", "nd_btt.ko", "nd_pmem.ko",
    ]  # fmt: skip
    assert len(w.files) == len(set(w.files)) == 8


def test_the_etcd_leader_is_found_by_its_member_id() -> None:
    from kemari_lab.etcd import leader_index

    def entry(ip: str, member: int, leader: int) -> dict:
        return {"Endpoint": f"{ip}:2379", "Status": {"header": {"member_id": member}, "leader": leader}}

    ips = ["10.77.0.3", "10.77.0.4", "10.77.0.5"]
    # etcdctl's member ids are 64-bit: beyond a double's exact range.
    big = 10276657743932975437
    status = json.dumps([entry("10.77.0.3", 1, big), entry("10.77.0.4", big, big), entry("http://10.77.0.5", 3, big)])
    assert leader_index(status, ips) == 1
    # A leader that did not answer, no answer, or garbage: unknown.
    assert leader_index(json.dumps([entry("10.77.0.3", 1, 7)]), ips) is None
    assert leader_index("", ips) is None
    assert leader_index("not json", ips) is None


def test_memory_digests_are_read_from_plain_and_json_logs() -> None:
    from kemari_lab.migration import last_digests

    plain = 'T  WARN transfer::memory_digest: memory digest side="source" chunk_bytes=2097152 took_ms=50 digests="0a0b,0c0d"\n'
    js = '{"timestamp":"T","level":"WARN","fields":{"message":"memory digest","side":"destination","digests":"0a0b,ffff"},"target":"t"}\n'
    assert last_digests(plain + js, "source") == ["0a0b", "0c0d"]
    assert last_digests(plain + js, "destination") == ["0a0b", "ffff"]
    assert last_digests("nothing here", "source") is None


def test_exit_rates_reads_each_vm_s_debugfs_directory_and_counters() -> None:
    from types import SimpleNamespace

    from kemari_lab.exit_rates import _read_counters, _vm_dirs

    class FakeHost:
        def __init__(self, output: str) -> None:
            self.output = output
            self.commands: list[str] = []

        def run(self, cmd: str, timeout: float = 0) -> SimpleNamespace:
            self.commands.append(cmd)
            return SimpleNamespace(output=self.output)

    h = FakeHost(
        "/sys/kernel/debug/kvm/412-11 kemari --kernel /lab/guest/vmlinuz --disk /tmp/soak-kemari-vh0-1.disk \n"
        "/sys/kernel/debug/kvm/530-14 qemu-system-x86_64 -drive file=/tmp/soak-qemu-vh0-1.disk,if=virtio \n"
        "mount: already mounted\n"
    )
    dirs = _vm_dirs(h)
    assert list(dirs) == ["/sys/kernel/debug/kvm/412-11", "/sys/kernel/debug/kvm/530-14"]
    assert "/tmp/soak-qemu-vh0-1.disk" in dirs["/sys/kernel/debug/kvm/530-14"]
    h = FakeHost("exits 1500\nmmio_exits 240\npf_fixed -1\nnoise 7\n")
    assert _read_counters(h, "/sys/kernel/debug/kvm/412-11") == {"exits": 1500, "mmio_exits": 240, "pf_fixed": -1}
    assert "cat /sys/kernel/debug/kvm/412-11/$f" in h.commands[0]


def test_warm_cache_cpu_seconds_reads_proc_and_names_a_kemari_that_is_gone() -> None:
    from types import SimpleNamespace

    from kemari_lab.errors import LabError
    from kemari_lab.warm_cache import cpu_seconds

    class FakeHost:
        name = "vh0"

        def __init__(self, output: str) -> None:
            self.output = output

        def run(self, cmd: str, timeout: float = 0) -> SimpleNamespace:
            return SimpleNamespace(output=self.output)

    stat = "cpu  8141 0 8646 8271 49 0 1154 0 7208 0\n"
    dax = "154 (kemari) S 153 0 0 0 -1 4194560 43842 0 2 0 7695 7891 0 0 20 0 7 0\n"
    cold = "160 (kemari) S 153 0 0 0 -1 4194560 43842 0 2 0 100 50 0 0 20 0 7 0\n"
    vcpu = "180 (vcpu0) S " + " ".join(["0"] * 35) + " 1 0\n"
    out = cpu_seconds(FakeHost(stat + dax + cold + vcpu + "-\n"), {"dax": 154, "cold": 160})
    assert out["vh"] == (8141 + 8646 + 1154) / 100
    assert out["dax"] == (7695 + 7891) / 100 and out["cold"] == 1.5
    assert out["dax_vcpu0_on"] == 1.0 and out["cold_vcpu0_on"] == -1.0
    # What the 2026-11-30 01:08 run got when the cold guest's kemari had exited.
    gone = "cat: can't open '/proc/160/stat': No such file or directory\n"
    with pytest.raises(LabError, match=r"vh0: cold's kemari \(pid 160\) is gone: cat: can't open"):
        cpu_seconds(FakeHost(stat + dax + gone + vcpu + "-\n"), {"dax": 154, "cold": 160})
