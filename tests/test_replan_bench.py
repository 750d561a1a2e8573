"""benchmarks/replan.py: a recorded GPU run planned again on its card's figures. The record here is the H200's
committed one with the model shrunk, so that the test checks the plumbing (the card's figures reach the plan, each
option set gives a row, the measured step sits beside the prediction), not the card's figures."""
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))

import replan  # noqa: E402


def small_record():
    record = json.loads((ROOT / "benchmarks/results/h200-fp32.json").read_text())
    record["args"].update(width=128, layers=4, seq=64, vocab=512, batch=4, microbatches=2)
    return record


def test_each_budget_and_option_set_gives_a_row_planned_on_the_card():
    record = small_record()
    hw = replan.card_hardware(record["card"], "fp32")
    assert hw.devices[0].peak_flops["fp32"] == record["card"]["fp32_flops"] and hw.devices[0].queued
    assert hw.devices[0].h2d_bandwidth == record["card"]["h2d"]
    rows = replan.replan(record, [0.5, 0.25], [{"recompute": "always"}, {}])
    assert [(r["budget"], r["options"]) for r in rows] == [("50%", "recompute=always"), ("50%", "-"),
                                                         ("25%", "recompute=always"), ("25%", "-")]
    for r in rows:
        assert r["predicted_s"] > 0 and r["measured_s"] == {"50%": 1.374, "25%": 1.44}[r["budget"]]
        assert r["vs_eager"] == round(0.994 / r["predicted_s"], 2)
    assert all(r["graphs"] == 0 for r in rows if r["options"] == "recompute=always")


def test_the_command_line_prints_the_table(tmp_path):
    path = tmp_path / "small.json"
    path.write_text(json.dumps(small_record()))
    out = subprocess.run([sys.executable, str(ROOT / "benchmarks/replan.py"), str(path), "--fracs", "0.5",
                          "--options", "recompute=device"], capture_output=True, text=True, check=True).stdout
    assert "NVIDIA H200, fp32" in out and "recompute=device" in out and "predicted_s" in out
