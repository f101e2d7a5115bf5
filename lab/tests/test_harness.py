"""The harness on real virtual hosts: console commands, errors, teardown."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from kemari_lab import netns
from kemari_lab.errors import LabError
from kemari_lab.lab import Lab

LAB_DIR = Path(__file__).resolve().parent.parent


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


@pytest.fixture(scope="module")
def lab(lab_images: object) -> Iterator[Lab]:
    with Lab(hosts=1) as lab:
        yield lab


def test_virtual_host_has_kvm_and_runs_commands(lab: Lab) -> None:
    vh = lab.hosts[0]
    assert vh.run("uname -r").output.strip().endswith("cloud-amd64")
    assert vh.run("ls /dev/kvm").output.strip() == "/dev/kvm"
    res = vh.run("echo out; echo err >&2; exit 3", check=False)
    assert res.status == 3
    assert res.output.splitlines() == ["out", "err"]
    # Several lines of output and a command with quotes survive the protocol.
    assert vh.run("seq 1 200 | tail -n 2; echo 'a \"b\" c'").output == '199\n200\na "b" c\n'


def test_failing_and_hanging_commands_name_the_host_and_command(lab: Lab) -> None:
    vh = lab.hosts[0]
    with pytest.raises(LabError, match=r"vh0: command failed with status 1: false"):
        vh.run("false")
    with pytest.raises(LabError, match=r"(?s)vh0: timed out.*sleep 3"):
        vh.run("sleep 3", timeout=0.5)
    # The console is still usable afterwards.
    assert vh.run("echo still-here", timeout=10).output == "still-here\n"


def test_client_reaches_virtual_host(lab: Lab) -> None:
    vh = lab.hosts[0]
    proc = lab.client(["busybox", "ping", "-c", "1", "-W", "5", vh.ip])
    assert proc.returncode == 0, proc.stdout + proc.stderr
    # And nothing of the lab is in this machine's root namespace.
    links = subprocess.run(["ip", "-o", "link"], capture_output=True, text=True, check=True).stdout
    assert "klbr" not in links and " vh0" not in links


def test_teardown_after_an_exception_leaves_nothing(lab_images: object) -> None:
    seen: dict[str, object] = {}
    with pytest.raises(RuntimeError, match="scenario failed"), Lab(hosts=1, tag=f"{os.getpid()}-fail") as lab:
        vh = lab.hosts[0]
        seen.update(pid=vh.pid, ns=lab.network.ns, client=lab.network.client_ns)
        vh.run("/sbin/ip tuntap add g0 mode tap")
        raise RuntimeError("scenario failed")
    assert isinstance(seen["pid"], int) and not alive(seen["pid"])
    spaces = netns.list_namespaces()
    assert seen["ns"] not in spaces and seen["client"] not in spaces


def test_teardown_on_sigterm(lab_images: object) -> None:
    """A lab process killed by SIGTERM tears its lab down before exiting."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "kemari_lab", "shell"],
        cwd=LAB_DIR,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stdin is not None and proc.stdout is not None
        proc.stdin.write("echo pid-$$ ok\n")  # answered once vh0 is up
        proc.stdin.flush()
        line = proc.stdout.readline()
        assert line.startswith("pid-") and line.strip().endswith("ok"), line
        ns = f"klab-{proc.pid}"
        assert ns in netns.list_namespaces()
        qemu_pids = netns.namespace_pids(ns)
        assert qemu_pids
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 128 + signal.SIGTERM
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    deadline = time.monotonic() + 10
    while any(alive(p) for p in qemu_pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not any(alive(p) for p in qemu_pids)
    assert ns not in netns.list_namespaces() and f"{ns}-c" not in netns.list_namespaces()
