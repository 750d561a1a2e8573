"""benchmarks/largest.py: the search keeps the deepest plan that fits; the model it finds trains within its budgets."""
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_largest_quick_search_and_run(tmp_path):
    out = tmp_path / "largest.json"
    cmd = [sys.executable, str(ROOT / "benchmarks" / "largest.py"), "--quick", "--run", "--steps", "2",
           "--offload-dir", str(tmp_path / "off"), "--json", str(out)]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert p.returncode == 0, p.stdout + p.stderr
    res = json.loads(out.read_text())
    best, tried = res["largest"], res["tried"]
    assert best["fits"] and best["disk_GiB"] > 0     # the quick limits put state on disk
    # the search's verdicts: the depth it keeps fits, the next depth it tried does not
    deeper = [r for r in tried if r["layers"] > best["layers"]]
    assert deeper and not any(r["fits"] for r in deeper)
    assert min(deeper, key=lambda r: r["layers"])["layers"] == best["layers"] + 1
    assert all(r["fits"] for r in tried if r["layers"] <= best["layers"])
    assert all("why" in r for r in deeper)
    run = res["run"]
    assert run["layers"] == best["layers"] and run["measured_peak_GiB"] <= run["budget_GiB"]
    assert run["disk_read_GB"] > 0 and run["disk_write_GB"] > 0 and len(run["losses"]) == 2
    assert not any((tmp_path / "off").iterdir())     # the disk tier's directory went with the run
    assert "largest:" in p.stdout and "measured" in p.stdout
