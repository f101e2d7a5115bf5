#!/usr/bin/env python3
"""Page-cache census of files: how many folios hold their resident pages.

    sudo crates/nbd/bench/folio_census.py FILE...

For each file: mmap it, ask mincore(2) which pages are resident (so that
pages not in the page cache are not read in), touch the resident ones,
read their page frame numbers from /proc/self/pagemap and each frame's
flags from /proc/kpageflags (KPF_COMPOUND_HEAD = bit 15, KPF_COMPOUND_TAIL
= bit 16). A folio is a compound head or a page that is neither head nor
tail. Needs root (frame numbers are hidden from other users).

the benchmark notebook (`git show fd35298:docs/benchmarks.md`, "Proxy writes and the page cache") used this to show
that a file written 4 KiB at a time sits in one-page folios.
"""
import ctypes
import mmap
import os
import struct
import sys

PAGE = os.sysconf("SC_PAGE_SIZE")
HEAD, TAIL = 1 << 15, 1 << 16

libc = ctypes.CDLL(None, use_errno=True)
libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]


def census(path):
    size = os.path.getsize(path)
    pages = (size + PAGE - 1) // PAGE
    if pages == 0:
        return f"{path}: empty"
    with open(path, "rb") as f:
        m = mmap.mmap(f.fileno(), size, prot=mmap.PROT_READ)
    view = memoryview(m)
    # The mapping's address: mmap objects do not expose it, so ask the
    # kernel where it is through /proc/self/maps (the newest mapping of
    # this file with this size).
    start = None
    with open("/proc/self/maps") as maps:
        for line in maps:
            fields = line.split()
            if len(fields) >= 6 and os.path.realpath(fields[5]) == os.path.realpath(path):
                lo, hi = (int(x, 16) for x in fields[0].split("-"))
                if hi - lo >= size:
                    start = lo
    if start is None:
        return f"{path}: mapping not found"
    vec = (ctypes.c_ubyte * pages)()
    if libc.mincore(start, size, ctypes.addressof(vec)) != 0:
        return f"{path}: mincore failed: {os.strerror(ctypes.get_errno())}"
    heads = singles = absent = 0
    # Unbuffered: a buffered reader would serve entries read ahead before
    # their pages were touched.
    with open("/proc/self/pagemap", "rb", buffering=0) as pm, open(
        "/proc/kpageflags", "rb", buffering=0
    ) as kf:
        for i in range(pages):
            if not vec[i] & 1:
                absent += 1
                continue
            view[i * PAGE]  # make sure this mapping has the page
            pm.seek((start // PAGE + i) * 8)
            (entry,) = struct.unpack("<Q", pm.read(8))
            if not entry >> 63:
                absent += 1
                continue
            kf.seek((entry & ((1 << 55) - 1)) * 8)
            (flags,) = struct.unpack("<Q", kf.read(8))
            if flags & HEAD:
                heads += 1
            elif not flags & TAIL:
                singles += 1
    view.release()
    m.close()
    folios = heads + singles
    resident = pages - absent
    avg = resident / folios if folios else 0.0
    return (
        f"{path}: {pages} pages, {resident} resident in {folios} folios "
        f"({heads} large, {singles} of one page), {avg:.1f} pages per folio"
    )


if __name__ == "__main__":
    if len(sys.argv) < 2:
        sys.exit(__doc__)
    for p in sys.argv[1:]:
        print(census(p))
