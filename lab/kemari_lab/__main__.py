"""Command line: python3 -m kemari_lab {setup,run,shell,clean} (run from lab/)."""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

from kemari_lab import images, netns, qemu_backport, soak_rounds
from kemari_lab.errors import LabError
from kemari_lab.guests import VMMS
from kemari_lab.lab import Lab
from kemari_lab.scenarios import SCENARIOS


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="kemari_lab", description=__doc__)
    sub = p.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("setup", help="fetch packages and build the images (idempotent)")
    s.add_argument("--kemari", action="store_true", help="also cargo build --release kemari, kemarictl and kemari-nbd")
    r = sub.add_parser("run", help="run one scenario")
    r.add_argument("scenario", choices=sorted(SCENARIOS))
    r.add_argument("--vmm", choices=list(VMMS), default="qemu")
    r.add_argument("--minutes", type=float, help="soak, soak-moves: how long (sets KEMARI_SOAK_MINUTES; default 60, 10)")
    sh = sub.add_parser("shell", help="boot N virtual hosts and type commands to vh0 (or 'vhN: cmd')")
    sh.add_argument("--hosts", type=int, default=1)
    sub.add_parser("clean", help="delete namespaces left by dead lab runs")
    sub.add_parser(
        "fetch-qemu", help="unpack bookworm-backports' QEMU under lab/build/cache; prints the KEMARI_LAB_QEMU to give"
    )
    sub.add_parser("list", help="list scenarios")
    st = sub.add_parser("soak-totals", help="the soak-moves rounds recorded so far, added up")
    st.add_argument("--file", help="results file (default: KEMARI_SOAK_RESULTS or lab/build/soak-rounds.json)")
    args = p.parse_args(argv)
    try:
        if args.cmd == "setup":
            print(images.setup(with_kemari=args.kemari))
        elif args.cmd == "list":
            for sc in SCENARIOS.values():
                print(f"{sc.name:14} hosts={sc.hosts}  {sc.doc}")
        elif args.cmd == "soak-totals":
            path = Path(args.file) if args.file else soak_rounds.results_path()
            print(soak_rounds.totals_text(soak_rounds.totals(soak_rounds.load_rounds(path))), end="")
        elif args.cmd == "fetch-qemu":
            print(qemu_backport.fetch())
        elif args.cmd == "clean":
            print("\n".join(netns.remove_stale()) or "nothing to clean")
        elif args.cmd == "run":
            sc = SCENARIOS[args.scenario]
            if args.minutes is not None:
                os.environ["KEMARI_SOAK_MINUTES"] = str(args.minutes)
            t0 = time.monotonic()
            with Lab(hosts=sc.hosts, **sc.lab_options) as lab:
                times = {f"{vh.name}_boot_s": vh.boot_seconds or 0.0 for vh in lab.hosts}
                times.update(sc.run(lab, args.vmm))
            times["total_s"] = time.monotonic() - t0
            print(json.dumps({k: round(v, 2) for k, v in times.items()}))
        elif args.cmd == "shell":
            with Lab(hosts=args.hosts) as lab:
                print(f"lab up: client namespace {lab.network.client_ns}; Ctrl-D ends", file=sys.stderr)
                for line in sys.stdin:
                    target = lab.hosts[0]
                    if line.startswith("vh") and ":" in line:
                        name, line = line.split(":", 1)
                        target = next((h for h in lab.hosts if h.name == name.strip()), target)
                    res = target.run(line.strip(), timeout=300, check=False)
                    print(res.output, end="")
                    print(f"[{target.name} status {res.status}]", file=sys.stderr)
    except LabError as e:
        print(f"lab error: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
