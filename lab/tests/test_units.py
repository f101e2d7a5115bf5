"""Fast tests of the harness's parts that need no virtual host."""

from __future__ import annotations

import io
import re

import pytest

from kemari_lab import cleanup
from kemari_lab.cpio import CpioWriter, read_names
from kemari_lab.errors import LabError
from kemari_lab.guests import GuestSpec
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
