"""The soak after moves (issue 24): guests that were live-migrated or failed
over, under the same load as fresh ones, kemari and QEMU side by side, in
short rounds whose results add up in one file.

The virtual hosts do not survive much more than 20 minutes of the soak's load
(their kernels die in KVM_RUN under either VMM, docs/lab.md), so a long soak
is made of rounds, each on freshly booted virtual hosts: ``python3 -m
kemari_lab run soak-moves --minutes 10`` is one round. Round n (numbered by
the results file) runs four guests, 2 vCPUs / 512 MiB, booted verbose, each
with the soak's echo stream and disk writer (soak.py) from its boot on:

    vh0  kemari       shared disk  --live migration (kemarictl migrate)--> vh1
    vh0  QEMU -M pc   shared disk  --QEMU live migration (-incoming)-----> vh1
    vh1  kemari       shared disk  --FT: standby on vh0, ft start, the primary's
                                     VMM killed (SIGKILL), standby fails over--> vh0
    vh0  fresh guest  private disk (QEMU -M pc in odd rounds, kemari in even ones)

QEMU's guests are ``-M pc`` (virtio-pci), not the soak's ``-M microvm``:
microvm cannot live-migrate.

Debian's QEMU has no fault tolerance (COLO is not built in), so failed-over
guests exist only under kemari; they are compared with QEMU's migrated and
fresh guests. The moves run one at a time once all four guests are ready;
the soak's N minutes count from the last move. The standby runs without a
fence: the harness itself killed the primary's VMM (its virtual host keeps
running the other guests). A guest's time is counted by what it is at the
moment — ``fresh`` (until its move), ``ft-protected`` (under FT, before the
failover), ``migrated``, ``failed-over`` — and each crash record carries
``guest_kind``. A guest that crashes is booted again, fresh, on its slot's
first host. A virtual host that dies is recorded as ``host_deaths`` (with
its console's panic lines), not as a crash of its guests.

Each round appends its record to the results file (``KEMARI_SOAK_RESULTS``,
default ``lab/build/soak-rounds.json``) and prints the totals of all rounds
so far (``python3 -m kemari_lab soak-totals`` prints them again): per VMM
and kind, guest-minutes, guests, crashes by kind, guests lost with their host.
"""

from __future__ import annotations

import fcntl
import json
import os
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kemari_lab import images, paths
from kemari_lab.errors import LabError
from kemari_lab.fault_tolerance import protect, start_standby, wait_ft_state
from kemari_lab.guests import GuestSpec
from kemari_lab.lab import Lab
from kemari_lab.migration import install_key, live_migrate
from kemari_lab.qemu_migration import qemu_live_migrate
from kemari_lab.shared_disk import SharedDisk
from kemari_lab.soak import Slot, crash_excerpt
from kemari_lab.vhost import VirtualHost, tcg_accel

# QEMU's -M microvm cannot live-migrate (docs/system/i386/microvm.rst: "Live
# migration" under Limitations): QEMU's guests here are -M pc (virtio-pci).
QEMU = "qemu"
KINDS = ("fresh", "ft-protected", "migrated", "failed-over")
# Guest ends that are no crash of the guest: its virtual host died, or it powered off when asked.
NOT_GUEST_CRASHES = ("host-died", "poweroff")
DEFAULT_MINUTES = 10.0
# How long the FT-protected guest runs under protection before its primary is killed.
FT_PROTECTED_S = 30.0
FT_TIMEOUT_MS = 3000
SHARED_DISK_PORT = 10820
MONITOR_PORT = 4500
# Three guests boot at once on vh0: on a loaded machine that took more than
# the soak's 7 minutes.
READY_TIMEOUT_S = 15 * 60
# Longest wait for all four guests to boot and be moved before the soak starts.
MOVES_TIMEOUT_S = 40 * 60


def results_path() -> Path:
    return Path(os.environ.get("KEMARI_SOAK_RESULTS", str(paths.BUILD_DIR / "soak-rounds.json")))


@dataclass(frozen=True)
class SlotPlan:
    """One guest of a round: its VMM, first host, guest index (TAP g<index>,
    unique in the round), and its move (None, "migrate" or "failover") to host `to`."""

    vmm: str
    host: int
    index: int
    move: str | None = None
    to: int | None = None

    @property
    def shared_disk(self) -> bool:
        return self.move is not None


def round_plan(round_no: int) -> list[SlotPlan]:
    """The four guests of round `round_no` (1, 2, …): the fresh guest's VMM alternates."""
    fresh = QEMU if round_no % 2 else "kemari"
    return [
        SlotPlan("kemari", 0, 0, "migrate", 1),
        SlotPlan(QEMU, 0, 1, "migrate", 1),
        SlotPlan("kemari", 1, 2, "failover", 0),
        SlotPlan(fresh, 0, 3),
    ]


def load_rounds(path: Path) -> list[dict[str, Any]]:
    """The rounds recorded so far (none if the file does not exist)."""
    try:
        rounds: list[dict[str, Any]] = json.loads(path.read_text())
    except FileNotFoundError:
        return []
    except ValueError as e:
        raise LabError(f"{path}: not a soak results file ({e}); move it away to start afresh") from None
    if not isinstance(rounds, list):
        raise LabError(f"{path}: not a soak results file (a JSON list of rounds expected)")
    return rounds


def add_round(path: Path, record: dict[str, Any]) -> list[dict[str, Any]]:
    """Appends a round to the results file (written whole, then renamed,
    under a lock: two lab slots may end rounds at once); its ``round`` is
    its place in the file. Returns all rounds."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.with_name(path.name + ".lock").open("a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        rounds = load_rounds(path)
        rounds.append(dict(record, round=len(rounds) + 1))
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text(json.dumps(rounds, indent=1) + "\n")
        tmp.replace(path)
    return rounds


def totals(rounds: list[dict[str, Any]]) -> dict[str, Any]:
    """All rounds added up: ``per`` [vmm][kind] = guest_minutes (host
    stalls taken off), guests (guest lives that spent time as that kind),
    crashes (guest crashes, not host deaths, boots that timed out or
    asked-for poweroffs), by_kind (crash kind → count), host_died (guests
    lost with their virtual host), boot_failures;
    ``rounds``, ``soak_minutes`` (wall clock after the moves), ``host_deaths``,
    ``moves`` [vmm][move] = {"ok", "failed", "not_done"} (the round ended first)."""
    per: dict[str, dict[str, dict[str, Any]]] = {}
    moves: dict[str, dict[str, dict[str, int]]] = {}
    host_deaths = 0
    soak_minutes = 0.0

    def cell(vmm: str, kind: str) -> dict[str, Any]:
        return per.setdefault(vmm, {}).setdefault(
            kind, {"guest_minutes": 0.0, "guests": 0, "crashes": 0, "by_kind": {}, "host_died": 0, "boot_failures": 0}
        )

    for r in rounds:
        host_deaths += len(r.get("host_deaths", []))
        soak_minutes += float(r.get("soak_minutes", 0.0))
        for s in r.get("slots", []):
            vmm = s["vmm"]
            stalled = s.get("stalled_seconds_by_kind", {})
            for kind, seconds in s.get("seconds_by_kind", {}).items():
                c = cell(vmm, kind)
                c["guest_minutes"] += max(0.0, seconds - stalled.get(kind, 0.0)) / 60
            for kind in s.get("lives_by_kind", {}):
                cell(vmm, kind)["guests"] += s["lives_by_kind"][kind]
            for crash in s.get("crashes", []):
                c = cell(vmm, crash.get("guest_kind", "fresh"))
                if crash["kind"] == "host-died":
                    c["host_died"] += 1
                elif crash["kind"] == "boot-failure":
                    c["boot_failures"] += 1
                elif crash["kind"] not in NOT_GUEST_CRASHES:
                    c["crashes"] += 1
                    c["by_kind"][crash["kind"]] = c["by_kind"].get(crash["kind"], 0) + 1
            if s.get("move"):
                m = moves.setdefault(vmm, {}).setdefault(s["move"], {"ok": 0, "failed": 0, "not_done": 0})
                report = s.get("move_report")
                m["not_done" if report is None else "failed" if report.get("error") else "ok"] += 1
    for kinds in per.values():
        for c in kinds.values():
            c["guest_minutes"] = round(c["guest_minutes"], 2)
    return {
        "rounds": len(rounds),
        "soak_minutes": round(soak_minutes, 2),
        "host_deaths": host_deaths,
        "per": per,
        "moves": moves,
    }


def totals_text(t: dict[str, Any]) -> str:
    """The totals as a table for a terminal."""
    head = f"soak after moves: {t['rounds']} rounds, {t['soak_minutes']:.1f} min of soak after the moves,"
    lines = [
        f"{head} {t['host_deaths']} virtual host deaths",
        f"  {'VMM':13} {'kind':13} {'guest-min':>9} {'guests':>6} {'crashes':>7}  {'lost w/ host':>12} {'boot fail':>9}  crash kinds",
    ]
    for vmm, kinds in sorted(t["per"].items()):
        for kind in KINDS:
            c = kinds.get(kind)
            if c is None:
                continue
            by = ", ".join(f"{k} {n}" for k, n in sorted(c["by_kind"].items())) or "-"
            lines.append(
                f"  {vmm:13} {kind:13} {c['guest_minutes']:9.1f} {c['guests']:6} {c['crashes']:7}"
                f"  {c['host_died']:12} {c['boot_failures']:9}  {by}"
            )
    for vmm, ms in sorted(t["moves"].items()):
        for move, m in sorted(ms.items()):
            lines.append(f"  moves: {vmm} {move}: {m['ok']} done, {m['failed']} failed, {m['not_done']} not reached")
    return "\n".join(lines) + "\n"


@dataclass
class MoveSlot(Slot):
    """A soak slot whose guest may be moved once (``plan_move`` to ``dest``),
    with its time counted per kind of guest."""

    plan_move: str | None = None
    dest: VirtualHost | None = None
    moves_lock: threading.Lock = field(default_factory=threading.Lock)
    kind: str = "fresh"
    seconds_by_kind: dict[str, float] = field(default_factory=dict)
    stalled_seconds_by_kind: dict[str, float] = field(default_factory=dict)
    lives_by_kind: dict[str, int] = field(default_factory=dict)
    move_report: dict[str, Any] | None = None
    moved: threading.Event = field(default_factory=threading.Event)
    shared_url: str | None = None
    ready_timeout: float = READY_TIMEOUT_S

    def guest_name(self) -> str:
        # Two QEMU guests start on vh0: the index tells them apart.
        return f"soak-{self.vmm}-{self.host.name}-g{self.index}-{self.boots}"

    def spec_for(self, name: str) -> GuestSpec:
        spec = super().spec_for(name)
        if self.shared_url and self.plan_move and not self.moved.is_set():
            # A boot that failed before the move is retried on the shared
            # disk (seen: three guests booting at once on a loaded vh0 took
            # more than 7 minutes), so that the move can still happen.
            spec.disk_url = self.shared_url
        if self.vmm.startswith("qemu"):
            spec.monitor_port = MONITOR_PORT + self.index
        return spec

    def boot(self) -> None:
        self._set_kind("fresh")
        super().boot()

    def _set_kind(self, kind: str) -> None:
        """Counts the time so far as the current kind; from now on the guest is `kind`."""
        running = bool(self.ready_at)
        self._count_time()
        self.kind = kind
        self.lives_by_kind[kind] = self.lives_by_kind.get(kind, 0) + 1
        if running:
            self.ready_at = time.monotonic()

    def _count_time(self) -> None:
        if self.ready_at:
            spent = time.monotonic() - self.ready_at
            self.seconds_by_kind[self.kind] = self.seconds_by_kind.get(self.kind, 0.0) + spent
        super()._count_time()

    def _stall_over(self) -> None:
        if self.stall_since is not None:
            lasted = time.monotonic() - self.stall_since
            self.stalled_seconds_by_kind[self.kind] = self.stalled_seconds_by_kind.get(self.kind, 0.0) + lasted
        super()._stall_over()

    def record(
        self, status: int | None, client_error: str | None, boot_failure: bool = False, host_died: bool = False
    ) -> dict[str, Any]:
        kind = self.kind
        crash = super().record(status, client_error, boot_failure, host_died)
        crash["guest_kind"] = kind
        return crash

    def move(self) -> None:
        """The planned move, one slot at a time; the slot's time counts as the new kind afterwards."""
        try:
            if self.plan_move is None or self.dest is None:
                return
            with self.moves_lock:
                g = self.guest
                if g is None or g.exit_status() is not None:
                    self.move_report = {"error": "the guest was not running when its move was due"}
                    return
                images.log(f"soak: {self.plan_move} of {g.spec.name} {g.host.name} -> {self.dest.name}")
                try:
                    if self.plan_move == "failover":
                        self.move_report = self._failover()
                    elif self.vmm == "kemari":
                        report = live_migrate(g, self.dest)
                        keys = ("wall_s", "total_ms", "downtime_ms", "round", "bytes_sent")
                        self.move_report = {k: report.get(k) for k in keys}
                        self._set_kind("migrated")
                    else:
                        self.move_report = qemu_live_migrate(g, self.dest)
                        self._set_kind("migrated")
                    images.log(f"soak: {self.plan_move} of {g.spec.name} done: {self.move_report}")
                except LabError as e:
                    self.move_report = {"error": str(e)[:3000]}
                    images.log(f"soak: {self.plan_move} of {g.spec.name} failed: {e}")
        finally:
            self.moved.set()

    def _failover(self) -> dict[str, Any]:
        """Standby on `dest` (no fence: the harness kills the primary itself),
        ft start, FT_PROTECTED_S under protection, SIGKILL to the primary's
        VMM, then waits for the standby's `failed_over`."""
        g = self.guest
        dest = self.dest
        assert g is not None and dest is not None
        start_standby(g, dest)
        started = protect(g, dest, timeout_ms=FT_TIMEOUT_MS)
        self._set_kind("ft-protected")
        time.sleep(FT_PROTECTED_S)
        primary = g.host
        killed_at = time.monotonic()
        images.log(f"soak: killing the FT primary of {g.spec.name} on {primary.name} (SIGKILL to its VMM)")
        g.kill_vmm()
        status = wait_ft_state(g, dest, {"failed_over"}, timeout=120, poll=1.0)
        g.host = dest
        self._set_kind("failed-over")
        return {
            "ft_start_wall_s": round(float(started.get("wall_s", 0.0)), 2),
            "kill_to_failed_over_s": round(status["seen_at"] - killed_at, 2),
            "failover_ms": status.get("failover_ms"),
            "epoch": status.get("epoch"),
        }

    def move_summary(self) -> dict[str, Any]:
        return {
            **self.summary(),
            "index": self.index,
            "move": self.plan_move,
            "dest": self.dest.name if self.dest else None,
            "move_report": self.move_report,
            "seconds_by_kind": {k: round(v, 1) for k, v in self.seconds_by_kind.items()},
            "stalled_seconds_by_kind": {k: round(v, 1) for k, v in self.stalled_seconds_by_kind.items()},
            "lives_by_kind": self.lives_by_kind,
            "crashes": self.crashes,
        }


def host_death(host: VirtualHost) -> dict[str, Any]:
    """What a dead virtual host's console says (its panic lines, its last lines)."""
    ex = crash_excerpt(host.console_text(), tail=15, marks=15)
    return {"host": host.name, "marked": ex["marked"], "tail": ex["tail"]}


def soak_round(lab: Lab, vmm: str = "", minutes: float | None = None) -> dict[str, float]:
    """One round of the soak after moves (see the module's doc); --vmm ignored."""
    if minutes is None:
        minutes = float(os.environ.get("KEMARI_SOAK_MINUTES", str(DEFAULT_MINUTES)))
    path = results_path()
    round_no = len(load_rounds(path)) + 1
    plan = round_plan(round_no)
    images.log(f"soak round {round_no} (results {path}): {plan}")
    hosts = lab.hosts[:2]
    install_key(hosts)
    lock = threading.Lock()
    disks: list[SharedDisk] = []
    slots: list[MoveSlot] = []
    for p in plan:
        slot = MoveSlot(lab, hosts[p.host], p.vmm, p.index, plan_move=p.move, moves_lock=lock)
        if p.to is not None:
            slot.dest = hosts[p.to]
        if p.shared_disk:
            disk = SharedDisk(lab, export=f"g{p.index}", port=SHARED_DISK_PORT + p.index).start()
            disks.append(disk)
            slot.disk_url = slot.shared_url = disk.url
        slots.append(slot)
    go = threading.Event()
    deadline = [float("inf")]
    threads = [threading.Thread(target=s.run, args=(go, deadline), name=f"soak-{s.label}") for s in slots]
    t_start = time.monotonic()
    t_soak = t_start
    started = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    try:
        for th in threads:
            th.start()
        for s in slots:
            s.booted.wait()
        images.log("soak: all guests booted; moving")
        go.set()
        limit = time.monotonic() + MOVES_TIMEOUT_S
        while not all(s.moved.is_set() or s.guest is None or s.given_up for s in slots):
            if time.monotonic() > limit:
                raise LabError(f"the moves did not end within {MOVES_TIMEOUT_S / 60:.0f} min")
            time.sleep(2)
        t_soak = time.monotonic()
        deadline[0] = t_soak + minutes * 60
        images.log(f"soak: moves done ({(t_soak - t_start) / 60:.1f} min after boot); load for {minutes:g} min")
        while any(th.is_alive() for th in threads):
            for th in threads:
                th.join(timeout=120)
            live = ", ".join(f"{s.label}/{s.kind} boot {s.boots} crashes {len(s.crashes)}" for s in slots)
            images.log(f"soak: {(time.monotonic() - t_soak) / 60:.1f}/{minutes:g} min: {live}")
    finally:
        deadline[0] = 0.0
        go.set()
        for th in threads:
            th.join(timeout=600)
        for d in disks:
            d.stop()
        for s in slots:
            s._stall_over()
            s._count_time()
            if s.conn is not None or s.disk is not None:
                s._close_clients()
        record: dict[str, Any] = {
            "plan_round": round_no,
            "started": started,
            "run_dir": str(lab.run_dir),
            "minutes_requested": minutes,
            "soak_minutes": round((time.monotonic() - t_soak) / 60, 2) if t_soak > t_start else 0.0,
            "wall_minutes": round((time.monotonic() - t_start) / 60, 2),
            "slots": [s.move_summary() for s in slots],
            "host_deaths": [host_death(h) for h in hosts if not h.alive()],
            "virtual_hosts": {"accel": tcg_accel(), "shmem_thp": os.environ.get("KEMARI_LAB_SHMEM_THP", "")},
        }
        (lab.run_dir / "soak-round.json").write_text(json.dumps(record, indent=1) + "\n")
        all_rounds = add_round(path, record)
        round_no = all_rounds[-1]["round"]
        text = totals_text(totals([record])) + "all rounds so far:\n" + totals_text(totals(all_rounds))
        (lab.run_dir / "soak-summary.txt").write_text(text)
        sys.stderr.write(text)
        images.log(f"soak: round {round_no} in {lab.run_dir}/soak-round.json; all rounds in {path}")
    out: dict[str, float] = {"round": float(round_no), "soak_min": float(record["soak_minutes"])}
    for s in slots:
        out[f"{s.vmm.replace('-', '_')}_{s.index}_crashes"] = float(len(s.crashes))
    return out
