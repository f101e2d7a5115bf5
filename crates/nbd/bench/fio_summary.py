#!/usr/bin/env python3
"""Reads fio --output-format=json (after any banner lines) from stdin and
prints 'IOPS MB/s' for the job's read or write side (argv[1])."""
import json
import sys

raw = sys.stdin.read()
doc = json.loads(raw[raw.index("{"):])
side = doc["jobs"][0][sys.argv[1]]
print(f"{side['iops']:.0f} {side['bw_bytes'] / 1e6:.1f}")
