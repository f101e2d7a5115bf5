"""crates/nbd/bench/to_json.py: run.sh's leftovers (loopback runs, proxy
cases, WAN records) become the bench envelope scripts/bench-report reads.

    python3 -m pytest scripts/tests/test_nbd_bench_json.py
"""
import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TO_JSON = os.path.join(ROOT, "crates", "nbd", "bench", "to_json.py")


def test_run_sh_results_become_one_document(tmp_path):
    runs = [
        # case port iops mbps cpu round: kemari-nbd ahead in round 1, behind in 2
        "randread:4k:1:1 1 200 0.8 10.0 1", "randread:4k:1:1 2 100 0.4 12.0 1", "randread:4k:1:1 3 150 0.6 11.0 1",
        "randread:4k:1:1 1 100 0.4 10.0 2", "randread:4k:1:1 2 200 0.8 12.0 2", "randread:4k:1:1 3 150 0.6 11.0 2",
        "read:1M:8:4 1 900 943.7 250.0 1", "read:1M:8:4 2 1000 1048.6 200.0 1", "read:1M:8:4 3 800 838.9 210.0 1",
        "a malformed line is skipped",
    ]
    (tmp_path / "loop-runs.txt").write_text("\n".join(runs) + "\n")
    (tmp_path / "proxy.jsonl").write_text(json.dumps(
        {"case": "1M read QD8", "target_iops": 900, "target_mb_s": 943.7, "proxy_iops": 880,
         "proxy_mb_s": 922.0, "ratio": 0.978}) + "\n")
    wan = [{"job": "table4", "case": "bgcopy on", "ops_per_sec": 900.0, "last10": 2500.0, "cached_percent": 100.0,
            "knee_s": 12, "link_util_pct": 91.0, "timeline_ops": [10, 20, 2500], "fetched": [[0, 0], [0.5, 1e6]]},
           {"job": "relocation", "ok": True, "killed_at_blocks": 100, "persisted_blocks": 90,
            "after_restart_blocks": 90, "fetched_after_restart": 4096}]
    (tmp_path / "wan.jsonl").write_text("".join(json.dumps(w) + "\n" for w in wan))
    out = tmp_path / "nbd.json"
    params = json.dumps({"mode": "all", "secs": 4, "rounds": 2})
    subprocess.run([sys.executable, TO_JSON, str(tmp_path), str(out), "crates/nbd/bench/run.sh all",
                    "2026-11-26T08:00:00Z", params, "1=kemari-nbd", "2=nbdkit", "3=qemu-nbd"], check=True)
    doc = json.loads(out.read_text())
    assert doc["schema"] == 1 and doc["bench"] == "nbd"
    assert doc["params"]["rounds"] == 2
    assert doc["host"]["cpus"] >= 1
    loop = [r for r in doc["runs"] if r["job"] == "loopback"]
    assert len(loop) == 9 and loop[0]["server"] == "kemari-nbd" and loop[0]["conns"] == 1
    t = doc["tables"][0]
    assert t["columns"][:4] == ["case", "kemari-nbd", "nbdkit", "qemu-nbd"]
    rr = dict(zip(t["columns"], t["rows"][0]))
    assert rr["case"] == "4k randread QD1"
    assert rr["kemari-nbd"] == 150 and rr["nbdkit"] == 150
    assert rr["kemari-nbd ÷ best"] == 1.0
    assert (rr["per round min"], rr["per round max"]) == (0.5, 4 / 3)
    seq = dict(zip(t["columns"], t["rows"][1]))
    assert seq["case"] == "1M read QD8 ×4 conns" and seq["kemari-nbd ÷ best"] == 0.9
    titles = [x["title"] for x in doc["tables"]]
    assert any(x.startswith("proxy fully cached") for x in titles)
    assert any(x.startswith("Table 4") for x in titles)
    assert [r["timeline_ops"] for r in doc["runs"] if r["job"] == "table4"] == [[10, 20, 2500]]
    assert any(n.startswith("relocation: OK") for n in doc["notes"])
