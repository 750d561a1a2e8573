"""examples/: every script runs at its --tiny size and prints what its docstring promises; the demo's --help.

Each script runs as a user runs it, in a fresh interpreter (the torchrun ones under
``torch.distributed.run`` with 2 gloo ranks), and the test reads its output.
"""
from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = ROOT / "examples"


def _run(args, cwd, timeout=300) -> str:
    env = dict(os.environ, OMP_NUM_THREADS="1", HARMONY_COMM_TIMEOUT="120")
    done = subprocess.run([sys.executable, *map(str, args)], cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=timeout)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return done.stdout


def _torchrun(script, cwd, *args) -> str:
    with socket.socket() as s:          # a free port for the rendezvous
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    return _run(["-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_addr", "127.0.0.1",
                 "--master_port", port, EXAMPLES / script, "--tiny", *args], cwd)


def _losses(out: str) -> list[float]:
    return [float(v) for v in re.findall(r"step +\d+ +loss (\d+\.\d+)", out)]


@pytest.mark.slow
def test_hf_finetune_trains_validates_checkpoints_and_resumes(tmp_path):
    pytest.importorskip("transformers")
    out = _run([EXAMPLES / "hf_finetune.py", "--tiny", "--epochs", "2", "--out", tmp_path], tmp_path)
    losses = _losses(out)
    assert len(losses) >= 4 and losses[-1] < losses[0], out
    assert "validation loss" in out and (tmp_path / "checkpoint" / "manifest.json").exists()
    shapes, planned = map(int, re.search(r"(\d+) batch shapes trained, (\d+) planned after compile", out).groups())
    assert shapes > 2 and planned == 0, out       # dynamic padding on the compiled plan
    steps = int(re.findall(r"checkpoint .* at step (\d+)", out)[-1])
    again = _run([EXAMPLES / "hf_finetune.py", "--tiny", "--epochs", "3", "--out", tmp_path, "--resume"], tmp_path)
    assert f"resumed from {tmp_path / 'checkpoint'} at step {steps} (epoch 2)" in again
    assert "epoch 1 " not in again and re.search(r"epoch 2 step +\d+ +loss", again), again


@pytest.mark.slow
def test_bf16_trains_in_bf16_and_resumes(tmp_path):
    out = _run([EXAMPLES / "bf16.py", "--tiny", "--out", tmp_path], tmp_path)
    assert "bf16: device copies in bfloat16" in out
    head, tail = re.search(r"loss (\d+\.\d+) -> (\d+\.\d+)", out).groups()
    assert float(tail) < float(head), out
    assert "resumed from" in out and "at step 24" in out


@pytest.mark.slow
def test_lora_trains_the_adapters_under_a_budget_below_the_weights_and_saves_them(tmp_path):
    pytest.importorskip("peft")
    out = _run([EXAMPLES / "lora.py", "--tiny", "--out", tmp_path / "adapters"], tmp_path)
    share = float(re.search(r"\((\d+)% of the weights\)", out).group(1))
    assert share < 100, out
    assert re.search(r"frozen +[\d.]+ \w+ of weights in bfloat16 on the host", out), out
    head, tail = re.search(r"loss (\d+\.\d+) -> (\d+\.\d+)", out).groups()
    assert float(tail) < float(head), out
    back, full = map(float, re.search(r"([\d.]+) MiB back .* gradient, ([\d.]+) MiB in fp32", out).groups())
    assert back < full / 2, out
    assert (tmp_path / "adapters" / "adapter_config.json").exists()


@pytest.mark.slow
def test_trainer_fine_tunes_with_transformers_trainer_stops_and_resumes(tmp_path):
    pytest.importorskip("accelerate")
    out = _run([EXAMPLES / "trainer.py", "--tiny", "--out", tmp_path / "run", "--stop-at", "4"], tmp_path)
    assert "trained to step 4" in out and (tmp_path / "run" / "checkpoint-4" / "harmony" / "manifest.json").exists()
    again = _run([EXAMPLES / "trainer.py", "--tiny", "--out", tmp_path / "run", "--resume"], tmp_path)
    assert "resumed from checkpoint-4 at step 4" in again and "trained to step 8 (sm.steps 8)" in again
    losses = _losses(out) + _losses(again)
    assert len(losses) == 4 and losses[-1] < losses[0], out + again
    norms = [float(v) for v in re.findall(r"grad norm (\d+\.\d+)", out + again)]
    assert len(norms) == 4 and all(n > 0 for n in norms) and "peak " in again
    assert "validation loss" in again and "from_pretrained gives the trained weights: True" in again


@pytest.mark.slow
def test_disk_offload_puts_state_on_disk_and_reports_it(tmp_path):
    out = _run([EXAMPLES / "disk_offload.py", "--tiny", "--offload-dir", tmp_path], tmp_path)
    tiers = re.search(r"between steps .*?disk ([\d.]+) (\w+)", out, flags=re.S)
    assert tiers and float(tiers.group(1)) > 0, out
    assert "== offload:" in out and re.search(r"\bdisk\b +disk", out)     # weights and optimizer state on disk
    assert "disk_read_bytes" in out and "disk_write_bytes" in out
    assert "made by compile as it placed them" in out                     # built under harmony.empty_weights
    assert list(tmp_path.glob("harmony-offload-*")) == []                 # sm.close() removed the files


@pytest.mark.slow
def test_data_parallel_two_ranks_with_the_4bit_allreduce(tmp_path):
    out = _torchrun("data_parallel.py", tmp_path)
    assert "2 ranks" in out and "gradients all-reduced as 4bit" in out
    assert "parameters equal on every rank: True" in out
    assert "compression 4-bit" in out and len(_losses(out)) >= 2


@pytest.mark.slow
def test_hybrid_two_nodes_of_two_ranks_train_one_grid(tmp_path):
    """Two torchrun invocations as two servers, joined by the c10d rendezvous, as users launch on two machines."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    args = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc_per_node", "2", "--rdzv-backend",
            "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", "hybrid-test", str(EXAMPLES / "hybrid.py"),
            "--tiny", "--out", str(tmp_path / "ckpt")]
    env = dict(os.environ, OMP_NUM_THREADS="1", HARMONY_COMM_TIMEOUT="120")
    nodes = [subprocess.Popen(args, cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for _ in range(2)]
    outs = []
    for node in nodes:
        try:
            out, err = node.communicate(timeout=400)
        finally:
            node.kill()
        assert node.returncode == 0, out[-3000:] + err[-3000:]
        outs.append(out)
    out = "".join(outs)       # rank 0 prints, on whichever node it landed
    assert "4 ranks as 2 x 2 (pipeline x data parallel)" in out and "== grid: 2 x 2" in out
    assert "replicas equal (the ranks holding the same packs): True" in out and len(_losses(out)) >= 2
    assert sorted(os.listdir(tmp_path / "ckpt")) == [f"rank-{r}-of-4" for r in range(4)]


@pytest.mark.slow
def test_zero3_partitions_a_llama_over_two_ranks_and_trains_like_the_replicated_run(tmp_path):
    pytest.importorskip("transformers")
    outs = {m: _torchrun("zero3.py", tmp_path, "--out", tmp_path / m, *(["--replicated"] if m == "rep" else []))
            for m in ("full", "rep")}
    digest = {m: re.search(r"parameters equal on every rank: True \((\w+)\)", out).group(1) for m, out in outs.items()}
    assert digest["full"] == digest["rep"], outs          # bitwise the replicated run
    kept = {m: [(float(a), float(b)) for a, b in re.findall(r"^rank \d: keeps (\d+\.\d+) MiB .* \(of (\d+\.\d+)\)",
                                                            out, flags=re.M)] for m, out in outs.items()}
    assert len(kept["full"]) == 2 and all(abs(a - b / 2) <= 0.02 * b for a, b in kept["full"]), outs["full"]
    assert all(a == b for a, b in kept["rep"]), outs["rep"]
    assert _losses(outs["full"]) == _losses(outs["rep"]) and len(_losses(outs["full"])) >= 3
    assert "validation loss" in outs["full"] and (tmp_path / "full" / "checkpoint").exists()
    assert "each rank's chunks" in outs["full"]


@pytest.mark.slow
def test_mismatched_devices_balance_gives_the_slow_small_rank_less(tmp_path):
    out = _torchrun("mismatched_devices.py", tmp_path)
    assert "== balance:" in out and "EMULATED" in out
    shares = {int(r): int(s) for r, s in re.findall(r"^rank (\d): (\d+) samples", out, flags=re.M)}
    assert sum(shares.values()) == 12 and shares[1] < shares[0], out


@pytest.mark.slow
def test_inspect_plan_prints_report_code_drawings_and_a_simulated_gpu_step(tmp_path):
    out = _run([EXAMPLES / "inspect_plan.py", "--tiny", "--out", tmp_path, "--code-lines", "5"], tmp_path)
    assert out.startswith("Harmony report:") and "== terms ==" in out
    assert "the schedule as Python (sm.code)" in out and "def forward(self):" in out
    assert re.search(r"^Simulation\(step .* on device 0 \(A100 SXM4 40GB\); busy .*ops in \.events\)$", out,
                     flags=re.M), out
    assert "simulated step" in out and "SimEvent(" not in out
    for name in ("gpt_timeline.json", "simulated_a100-40gb.json"):
        assert (tmp_path / name).exists()
    assert list(tmp_path.glob("gpt_model.*")) and list(tmp_path.glob("gpt_schedule.*"))


def test_every_example_has_a_test_and_a_tiny_flag():
    scripts = sorted(p.stem for p in EXAMPLES.glob("*.py"))
    assert scripts == ["bf16", "data_parallel", "disk_offload", "hf_finetune", "hybrid", "inspect_plan", "lora",
                       "mismatched_devices", "trainer", "zero3"]
    here = Path(__file__).read_text()
    for name in scripts:
        assert f'"{name}.py"' in here and "--tiny" in (EXAMPLES / f"{name}.py").read_text()


def test_the_docs_show_the_dict_batch_list_the_examples_and_say_what_checkpoints_hold():
    readme = (ROOT / "README.md").read_text()
    examples = readme.split("## Examples", 1)[1].split("\n## ", 1)[0]
    for p in EXAMPLES.glob("*.py"):
        assert f"`{p.name}`" in examples, p.name
    loop = (ROOT / "docs" / "training-loop.md").read_text()
    assert "example_batch=batch" in loop and "sm(**batch)" in loop
    checkpoints = (ROOT / "docs" / "checkpoints.md").read_text()
    assert "weights-only" not in readme + checkpoints and "optimizer state" in checkpoints


def test_demo_help_documents_every_option_with_its_default(capsys):
    from harmony.__main__ import main

    with pytest.raises(SystemExit):
        main(["demo", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    options = re.findall(r"\[(--[\w-]+)", text)
    assert len(options) == 14
    for opt in options:
        entry = text.split(f" {opt} ", 2)[-1]              # the option's line in the options list
        assert re.match(r"\S+ .*?\(default: [^)]*\)", entry), opt


def test_demo_raises_its_default_budget_to_what_a_small_model_needs_and_refuses_a_users_own(capsys, tmp_path):
    """40% of a tiny GPT's state is below one layer's activations: the default share is raised to the smallest
    budget that works, and said so; a budget the user chose is never changed (exit 2 with the reason)."""
    from harmony.__main__ import main

    small = ["demo", "--layers", "1", "--width", "32", "--steps", "1", "--out", str(tmp_path)]
    assert main(small + ["--budget", "0.1"]) == 2
    err = capsys.readouterr().err
    assert "error: memory_budget=" in err and "the smallest budget that works is" in err
    assert main(small) == 0
    out = capsys.readouterr().out
    assert "is below what this model needs: using the smallest budget that works" in out
    assert "validation loss" in out
