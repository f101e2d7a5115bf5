"""scripts/bench-report over small fixture results (scripts/tests/fixtures):
every known section, an unknown file through the generic section, the
plots, the length limit, and a file that does not fit its section.

    python3 -m pytest scripts/tests/test_bench_report.py
"""
import json
import os
import shutil
import subprocess

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
SCRIPT = os.path.join(os.path.dirname(HERE), "bench-report")



@pytest.fixture
def bench_dir(tmp_path):
    d = tmp_path / "bench"
    shutil.copytree(os.path.join(HERE, "fixtures"), d)
    return d


def render(bench_dir, tmp_path):
    out = tmp_path / "benchmarks.md"
    # As a user runs it (it finds or installs Debian's python3-matplotlib).
    subprocess.run([SCRIPT, "--dir", str(bench_dir), "--out", str(out)], check=True)
    return out.read_text()


def test_every_section_and_plot(bench_dir, tmp_path):
    text = render(bench_dir, tmp_path)
    for title in ("## Boot", "## Snapshot, warm restart, zero-copy migration",
                  "## Live migration (pre-copy over TCP) vs QEMU", "## Fault tolerance",
                  "## NBD: kemari-nbd vs nbdkit and qemu-nbd", "## Facts behind the floors"):
        assert title in text
    # Commands and conditions come from the files.
    assert "kemari-bench boot --kernel g" in text
    assert "commit abc1234" in text
    # Tables carry the JSON's numbers.
    assert "| 256M | 12.0 | 60.0 | 5.00 |" in text
    assert "| 4k randread QD1 | 20,000 | 11,000 | 10,000 | 1.82 |" in text
    # A cell that failed says so.
    assert "failed" in text
    # Two sections from one run show its command once.
    migration = text.split("## Live migration (pre-copy over TCP) vs QEMU")[1].split("\n## ")[0]
    assert "Same run and command as the section above." in migration
    assert "```sh" not in migration
    # Plots exist, are SVG, and the doc links them.
    for name in ("boot", "whole-vm-downtime", "migration-downtime", "ft-ratios", "nbd-loopback",
                 "nbd-relocation-timeline"):
        svg = bench_dir / f"{name}.svg"
        assert svg.read_text().lstrip().startswith("<?xml"), name
        assert f"](bench/{name}.svg)" in text
    # The benches without results are listed, not silently dropped.
    assert "No results yet for: `api`, `dirty-harvest`" in text
    assert text.count("\n") <= 400


def test_unknown_files_get_a_generic_section(bench_dir, tmp_path):
    text = render(bench_dir, tmp_path)
    assert "## warm-cache" in text
    assert "cache kept across a warm restart, ms:" in text
    assert "| warm | 5.00 | 0.050 |" in text
    assert "- goal: warm <= 0.1 of cold: met" in text


def test_a_file_that_does_not_fit_its_section_is_shown_as_is(bench_dir, tmp_path):
    boot = json.loads((bench_dir / "boot.json").read_text())
    boot["tables"][0]["columns"] = ["size", "a", "b"]  # not the boot columns
    boot["tables"][0]["rows"] = [["1G", 1.0, 2.0]]
    (bench_dir / "boot.json").write_text(json.dumps(boot))
    text = render(bench_dir, tmp_path)
    assert "## boot" in text and "| 1G | 1.00 | 2.00 |" in text


def test_long_tables_are_cut_and_the_doc_stays_short(bench_dir, tmp_path):
    doc = json.loads((bench_dir / "warm-cache.json").read_text())
    doc["tables"][0]["rows"] = [[f"case {i}", float(i), 1.0] for i in range(500)]
    (bench_dir / "warm-cache.json").write_text(json.dumps(doc))
    text = render(bench_dir, tmp_path)
    assert "more rows in the JSON" in text
    assert text.count("\n") <= 400


def test_the_output_is_deterministic(bench_dir, tmp_path):
    first = render(bench_dir, tmp_path)
    svg = (bench_dir / "ft-ratios.svg").read_text()
    assert render(bench_dir, tmp_path) == first
    assert (bench_dir / "ft-ratios.svg").read_text() == svg


def load_script():
    """bench-report as a module (it has no .py suffix)."""
    import importlib.machinery
    import importlib.util
    loader = importlib.machinery.SourceFileLoader("bench_report", SCRIPT)
    spec = importlib.util.spec_from_loader("bench_report", loader)
    mod = importlib.util.module_from_spec(spec)
    loader.exec_module(mod)
    return mod


def test_headlines_that_differ_in_their_last_part_share_a_row():
    merged = load_script().merged_headlines([
        ("Boot", "QEMU ÷ kemari, 256M", "6.88x"),
        ("Live", "downtime, 4G, dirty 0/s", "0.86x"),
        ("Boot", "QEMU ÷ kemari, 4G", "5.40x"),
        ("Live", "downtime, 4G, dirty 10000/s", "0.59x"),
        ("NBD", "kemari-nbd ÷ best (12 cases)", "1.10–2.46x"),
        ("FT", "rr x1 ÷ unprotected, 256M", "0.22x"),
    ])
    assert merged == [
        ["Boot", "QEMU ÷ kemari, 256M / 4G", "6.88x / 5.40x"],
        ["Live", "downtime, 4G, dirty 0/s / dirty 10000/s", "0.86x / 0.59x"],
        ["NBD", "kemari-nbd ÷ best (12 cases)", "1.10–2.46x"],
        ["FT", "rr x1 ÷ unprotected, 256M", "0.22x"],
    ]
