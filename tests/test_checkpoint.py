"""Checkpoints: resume is bitwise, saving is atomic (SIGKILL, full disk, unwritable path), loading is safe."""
import errno
import json
import os
import shutil
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

import harmony
import harmony.driver.checkpoint.files as ckfiles
from harmony.errors import CheckpointError
from harmony.models import GPT, GPTConfig, copy_task
from harmony.base.process import peak_rss_bytes
from models import assert_bitwise, params

CFG = GPTConfig(layers=4, width=64, vocab=64, seq=16, tie=False)
TINY = GPTConfig(layers=1, width=32, vocab=64, seq=16, tie=False)
DATA = list(copy_task(CFG, 8, 4))


def compile_gpt(cfg=CFG, frac=0.5, seed=0):
    """The GPT under ``frac`` of its 16 B/param training state: 0.5 forces swapping, 4 keeps all resident."""
    torch.manual_seed(seed)
    model = GPT(cfg)
    budget = int(16 * sum(p.numel() for p in model.parameters()) * frac)
    return harmony.compile(model, example_batch=DATA[0], memory_budget=budget, microbatches=4)


def train(sm, batches):
    for x, y in batches:
        sm(x, y)


def no_temps(target: Path):
    return [p.name for p in target.parent.iterdir() if p.name.startswith(target.name + ".")]


@pytest.fixture(scope="module")
def run_a(tmp_path_factory):
    """The uninterrupted run: 2 steps, save, 2 more steps, under a budget that swaps every pack."""
    root = tmp_path_factory.mktemp("run_a")
    sm = compile_gpt()
    assert len(sm.plan.packs) > 1
    train(sm, DATA[:2])
    assert sm.stats["h2d_bytes"] > 0 and not set(sm.plan.kept())
    at2 = params(sm)
    harmony.save(sm, root / "ck")
    draw = torch.rand(4)           # the RNG right after saving, as a resumed run must see it
    train(sm, DATA[2:])
    yield dict(sm=sm, dir=root / "ck", at2=at2, at4=params(sm), draw=draw)
    sm.close()


def test_resume_from_a_directory_is_bitwise_under_swapping(run_a):
    b = compile_gpt(seed=1)        # other initial weights: everything must come from the checkpoint
    info = harmony.load(b, run_a["dir"])
    assert (info.step, info.recovered, b.steps) == (2, False, 2)
    assert_bitwise(b, run_a["at2"])
    assert torch.equal(torch.rand(4), run_a["draw"])
    train(b, DATA[2:])
    assert b.stats["h2d_bytes"] > 0
    assert_bitwise(b, run_a["at4"])
    assert b.steps == 4
    b.close()


def test_resume_into_another_plan_creates_resident_optimizer_state_on_the_device(run_a):
    """A checkpoint saved at one budget loads at another; fresh optimizer state goes to its resident tier."""
    b = compile_gpt(frac=4.0, seed=1)
    assert (0, "optim") in set(b.plan.kept())
    harmony.load(b, run_a["dir"])
    st = b.runtime.state
    p = st.tensors["blocks.0.fc.weight"]
    assert st.meter.holds(st.optimizers["blocks.0.fc.weight"].state[p]["exp_avg"])
    train(b, DATA[2:])
    assert b.stats["measured_peak"] <= b.stats["budget"]
    assert_bitwise(b, run_a["at4"])
    b.close()


@pytest.mark.parametrize("chosen_by", ["greedy", "integer program"])
def test_resume_into_a_mixed_plan_is_bitwise(run_a, chosen_by, monkeypatch):
    """A plan that steps one pack on the device (all its state resident) and the other on the host, as the swap
    pass's greedy picks it; and the plan its integer program picks, single parameters of host-stepped packs
    stepped on the device (``Residency.device_parts``)."""
    import harmony.passes.swap.lp as swap_lp
    if chosen_by == "greedy":
        monkeypatch.setattr(swap_lp, "applies", lambda *a: False)
    torch.manual_seed(1)
    model = GPT(CFG)
    b = harmony.compile(model, example_batch=DATA[0], microbatches=4, hardware="gtx1080ti",
                        memory_budget=int(16 * sum(p.numel() for p in model.parameters()) * 0.8))
    assert next(r for r in b.program.reports if r.title.startswith("swap")).totals["chosen_by"] == chosen_by
    if chosen_by == "greedy":
        assert set(b.plan.by_pack("step_on").values()) == {"device", "host"}
    else:
        assert b.plan.per_param("device_parts") and set(b.plan.by_pack("step_on").values()) == {"host"}
    harmony.load(b, run_a["dir"])
    assert_bitwise(b, run_a["at2"])
    train(b, DATA[2:])
    assert b.stats["measured_peak"] <= b.stats["budget"]
    assert_bitwise(b, run_a["at4"])
    b.close()


def test_state_dict_references_live_tensors_and_round_trips_in_memory(run_a):
    a = run_a["sm"]
    sd = a.training_state_dict()
    assert sorted(sd) == ["format", "model", "model_groups", "optimizer", "param_groups", "rng", "schedulers", "step"]
    live = dict(a.program.gm.named_parameters())
    for n, t in sd["model"].items():   # references, not copies
        assert t.untyped_storage().data_ptr() == live[n].data.untyped_storage().data_ptr(), n
    opt = a.runtime.state.optimizers["head.weight"]
    assert sd["optimizer"]["head.weight"]["exp_avg"] is opt.state[live["head.weight"]]["exp_avg"]
    assert sd["param_groups"][0][0]["betas"] == (0.9, 0.999)
    saved = dict(sd, model={n: t.clone() for n, t in sd["model"].items()},
                 optimizer={n: {k: v.clone() for k, v in s.items()} for n, s in sd["optimizer"].items()},
                 rng={k: v.clone() for k, v in sd["rng"].items()})
    before, steps = params(a), a.steps
    train(a, DATA[:1])
    expected = params(a)
    a.load_training_state_dict(saved)       # back one step, in place, through the host masters
    assert a.steps == steps
    assert_bitwise(a, before)
    train(a, DATA[:1])
    assert_bitwise(a, expected)


@pytest.fixture(scope="module")
def tiny():
    """A one-pack model that fits its budget: another model's state, and small enough for a tiny disk."""
    sm = compile_gpt(cfg=TINY, frac=4.0)
    train(sm, DATA[:1])
    yield sm
    sm.close()


def test_a_mismatched_state_dict_is_refused_before_anything_changes(run_a, tiny):
    a = run_a["sm"]
    before = params(a)
    good = a.training_state_dict()

    def broken(**edit):
        sd = dict(good, model=dict(good["model"]))
        for k, v in edit.items():
            if v is None:
                sd["model"].pop(k)
            else:
                sd["model"][k] = v
        return sd
    with pytest.raises(CheckpointError, match=r"missing \(head.weight\).*Nothing was changed"):
        a.load_training_state_dict(broken(**{"head.weight": None}))
    with pytest.raises(CheckpointError, match=r"blocks.0.fc.weight: checkpoint \(3, 3\) float32, model \(256, 64\)"):
        a.load_training_state_dict(broken(**{"blocks.0.fc.weight": torch.zeros(3, 3)}))
    with pytest.raises(CheckpointError, match=r"not in the model \(extra.weight\)"):
        a.load_training_state_dict(broken(**{"extra.weight": torch.zeros(1)}))
    with pytest.raises(CheckpointError, match="format"):
        a.load_training_state_dict(dict(good, format=99))
    with pytest.raises(CheckpointError, match="does not match the compiled model"):
        a.load_training_state_dict(tiny.training_state_dict())
    assert_bitwise(a, before)


def test_hyperparameters_are_restored_and_another_optimizer_class_is_refused(tiny):
    sd = tiny.training_state_dict()
    group = tiny.optimizers[0].param_groups[0]
    lr = group["lr"]
    group["lr"], group["betas"] = 1.0, (0.5, 0.5)
    tiny.load_training_state_dict(sd)
    assert (group["lr"], group["betas"]) == (lr, (0.9, 0.999))
    sgd = dict(sd, param_groups=[[dict(g, momentum=0.9) for g in per] for per in sd["param_groups"]])
    with pytest.raises(CheckpointError, match=r"\['momentum'\] are unknown to this model's AdamW"):
        tiny.load_training_state_dict(sgd)


def test_directory_layout_manifest_and_damaged_files(run_a, tmp_path):
    src = tmp_path / "ck"
    shutil.copytree(run_a["dir"], src)
    manifest = json.loads((src / "manifest.json").read_text())
    assert (manifest["format"], manifest["version"], manifest["step"]) == ("harmony-checkpoint", 1, 2)
    names = sorted(f["name"] for f in manifest["files"])
    assert names == sorted([f"pack-{i:03d}.pt" for i in range(len(run_a["sm"].plan.packs))] + ["rng.pt"])
    for f in manifest["files"]:
        assert (src / f["name"]).stat().st_size == f["bytes"] and len(f["sha256"]) == 64
        torch.load(src / f["name"], weights_only=True)    # plain tensors and containers only
    b = run_a["sm"]
    before = params(b)
    with open(src / "pack-001.pt", "r+b") as fh:          # one flipped byte
        fh.seek(100)
        byte = fh.read(1)
        fh.seek(100)
        fh.write(bytes([byte[0] ^ 0xFF]))
    with pytest.raises(CheckpointError, match=r"pack-001.pt is damaged.*nothing was changed"):
        harmony.load(b, src)
    assert_bitwise(b, before)
    manifest["files"][0]["name"] = "../escape.pt"
    from harmony.driver.checkpoint.check import seal           # resealed, as a forger would: the name itself is refused
    (src / "manifest.json").write_text(json.dumps(seal({k: v for k, v in manifest.items() if k != "manifest_sha256"})))
    with pytest.raises(CheckpointError, match="outside the checkpoint"):
        harmony.load(b, src)
    with pytest.raises(CheckpointError, match="no checkpoint at"):
        harmony.load(b, tmp_path / "nothing")


KILLED_SAVE = textwrap.dedent("""
    import sys, time, torch, harmony
    from harmony.models import GPT, GPTConfig, copy_task
    cfg = GPTConfig(layers=1, width=32, vocab=64, seq=16, tie=False)
    data = list(copy_task(cfg, 8, 1))
    sm = harmony.compile(GPT(cfg), example_batch=data[0], memory_budget="64MiB")
    def progress(done, total, path):
        print("wrote", done, total, path, flush=True)
        time.sleep(60)                       # the parent kills us here
    harmony.save(sm, sys.argv[1], progress=progress)
""")


def test_sigkill_during_save_leaves_the_previous_checkpoint_loadable(run_a, tmp_path):
    target = tmp_path / "ck"
    shutil.copytree(run_a["dir"], target)                # the previous checkpoint: step 2
    child = subprocess.Popen([sys.executable, "-c", KILLED_SAVE, str(target)], stdout=subprocess.PIPE, text=True)
    try:
        line = child.stdout.readline()
        assert line.startswith("wrote 1 "), line
        temp = target.with_name(f"ck.tmp-{child.pid}")
        assert (temp / "pack-000.pt").is_file()             # the new checkpoint is half written
    finally:
        os.kill(child.pid, signal.SIGKILL)
        child.wait(timeout=30)
    assert child.returncode == -signal.SIGKILL
    b = run_a["sm"]
    assert harmony.load(b, target).step == 2
    assert_bitwise(b, run_a["at2"])
    harmony.save(b, target)                              # the next save sweeps the dead process's temp dir
    assert not temp.exists() and no_temps(target) == []


def test_a_save_interrupted_between_its_renames_falls_back_to_old(run_a, tmp_path):
    target = tmp_path / "ck"
    shutil.copytree(run_a["dir"], target)
    os.rename(target, tmp_path / "ck.old")               # killed after renaming the old one away
    b = run_a["sm"]
    with pytest.warns(UserWarning, match="interrupted"):
        info = harmony.load(b, target)
    assert info.recovered and info.path.name == "ck.old"
    assert_bitwise(b, run_a["at2"])
    harmony.save(b, target)                              # puts ck.old back, then replaces it
    assert harmony.load(b, target).recovered is False and no_temps(target) == []


def test_injected_enospc_on_the_second_file_keeps_the_last_good_checkpoint(run_a, tmp_path, monkeypatch):
    target = tmp_path / "ck"
    shutil.copytree(run_a["dir"], target)
    write, calls = ckfiles.write_file, []

    def full_disk(path, obj):
        calls.append(path)
        if len(calls) == 2:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))
        return write(path, obj)
    monkeypatch.setattr(ckfiles, "write_file", full_disk)
    sm = run_a["sm"]
    with pytest.raises(CheckpointError, match=r"No space left on device.*is full.*previous checkpoint at .* intact"):
        harmony.save(sm, target)
    assert no_temps(target) == []
    harmony.load(sm, target)
    assert_bitwise(sm, run_a["at2"])


@pytest.fixture
def small_tmpfs(tmp_path):
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    size = 300 * 1024
    if subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(mnt)],
                      capture_output=True).returncode:
        pytest.skip("cannot mount a tmpfs here (needs root / CAP_SYS_ADMIN)")
    yield mnt
    subprocess.run(["umount", str(mnt)], check=True)


def test_a_full_filesystem_keeps_the_last_good_checkpoint(small_tmpfs, tiny, monkeypatch):
    sm = tiny
    target = small_tmpfs / "ck"
    harmony.save(sm, target)                             # fits: about 200 KiB of 300 KiB
    good = params(sm)
    train(sm, DATA[1:2])
    with pytest.raises(CheckpointError, match="is full"):    # refused up front: not enough room for both
        harmony.save(sm, target)
    assert no_temps(target) == []
    real = shutil.disk_usage
    monkeypatch.setattr(shutil, "disk_usage", lambda p: real(p)._replace(free=1 << 40))
    with pytest.raises(CheckpointError, match=r"No space left on device.*previous checkpoint at .* intact") as e:
        harmony.save(sm, target)                         # the kernel's ENOSPC in the middle of a file
    assert isinstance(e.value.__cause__, OSError) and e.value.__cause__.errno == errno.ENOSPC
    assert no_temps(target) == [] and sorted(os.listdir(small_tmpfs)) == ["ck"]
    harmony.load(sm, target)
    assert_bitwise(sm, good)


def test_an_unwritable_path_raises_a_clear_error(run_a, tmp_path):
    sm = run_a["sm"]
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    with pytest.raises(CheckpointError, match=r"could not save the checkpoint to .*a-file/ck.*not a directory"):
        harmony.save(sm, blocker / "ck")
    with pytest.raises(CheckpointError, match=r"could not save the checkpoint to /proc/harmony-ck"):
        harmony.save(sm, "/proc/harmony-ck")             # fails for root too
    with pytest.raises(CheckpointError, match="not a Harmony checkpoint"):
        (tmp_path / "mine").mkdir()
        (tmp_path / "mine" / "notes.txt").write_text("keep me")
        harmony.save(sm, tmp_path / "mine")
    assert (tmp_path / "mine" / "notes.txt").read_text() == "keep me"
    assert sorted(os.listdir(tmp_path)) == ["a-file", "mine"]


def test_peak_rss_bytes_agrees_with_the_kernels_high_water_mark():
    hwm_kib = next(int(line.split()[1]) for line in Path("/proc/self/status").read_text().splitlines()
                   if line.startswith("VmHWM:"))
    assert peak_rss_bytes() == pytest.approx(hwm_kib * 1024, rel=0.05)   # per-thread counters lag a little
