#!/usr/bin/env python3
"""Checks the test guest's network services from the host.

usage: net-check.py <guest-ip> [megabytes]

Streams N MiB (default 1) of pseudo-random bytes to TCP echo (port 7) while
reading the echo back, and compares byte for byte; then checks UDP echo,
HTTP GET / and GET /bytes/N. Prints one line per check; exits non-zero on a
mismatch.
"""
import os
import socket
import sys
import threading
import time
import urllib.request


def tcp_echo(ip, size):
    data = os.urandom(size)
    received = bytearray()
    s = socket.create_connection((ip, 7), timeout=20)
    start = time.monotonic()

    def reader():
        while len(received) < size:
            chunk = s.recv(65536)
            if not chunk:
                break
            received.extend(chunk)

    t = threading.Thread(target=reader)
    t.start()
    s.sendall(data)
    t.join(60)
    elapsed = time.monotonic() - start
    s.close()
    ok = bytes(received) == data
    print(f"tcp echo: {'ok' if ok else 'MISMATCH'} bytes={len(received)}/{size} "
          f"seconds={elapsed:.3f} MiB_per_s={size / elapsed / 2**20:.1f}")
    return ok


def udp_echo(ip):
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    s.settimeout(5)
    msg = b"kemari udp echo " + os.urandom(16).hex().encode()
    s.sendto(msg, (ip, 7))
    reply, _ = s.recvfrom(2048)
    ok = reply == msg
    print(f"udp echo: {'ok' if ok else 'MISMATCH'}")
    return ok


def http(ip):
    body = urllib.request.urlopen(f"http://{ip}/", timeout=10).read().decode()
    ok1 = body.startswith("requests=") and "uptime_ms=" in body
    print(f"http /: {'ok' if ok1 else 'BAD'} {body.strip()}")
    n = 100_000
    data = urllib.request.urlopen(f"http://{ip}/bytes/{n}", timeout=10).read()
    want = bytes(ord('a') + i % 26 for i in range(n))
    ok2 = data == want
    print(f"http /bytes/{n}: {'ok' if ok2 else 'MISMATCH'} len={len(data)}")
    return ok1 and ok2


def main():
    ip = sys.argv[1]
    mib = float(sys.argv[2]) if len(sys.argv) > 2 else 1
    ok = tcp_echo(ip, int(mib * 2**20))
    ok = udp_echo(ip) and ok
    ok = http(ip) and ok
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
