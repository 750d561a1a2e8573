"""Issue 29: nothing a step, a file or a peer does wrong may damage training.

Each test pins one finding of the issue (its number in the test's docstring). Faults are injected at schedule
ops (tests/faults.py), as a bad batch, as exceptions and as signals, and the module must come back to its
state before the step and then train bitwise as eager PyTorch does after skipping the failed step.
"""
from __future__ import annotations

import copy
import io
import os
import pickle
import signal

import pytest
import torch

import harmony
from faults import fail_at, schedule_ops
from harmony.errors import InputError, TornStepError
from models import assert_bitwise, eager_accumulate, mlp_case, params, training_state_bytes, withheld


def compiled(frac: float, seed: int = 0, **kw):
    model, data = mlp_case(seed=seed)
    data = data + mlp_case(seed=seed + 1)[1]         # six batches
    ref = copy.deepcopy(model)
    sm = harmony.compile(model, data[0], memory_budget=int(training_state_bytes(model) * frac), microbatches=4, **kw)
    return sm, ref, data


def expected(ref, batches) -> dict:
    model, _ = eager_accumulate(ref, batches, 4)
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def holds(sm) -> tuple:
    rt = sm.runtime
    return rt.meter.live, {k: n for k, n in rt.state.refs.items() if n}


# -- 1. a step is a transaction -------------------------------------------------------------------
@pytest.mark.parametrize("frac", [0.4, 3.0])
def test_a_bad_batch_rolls_the_step_back_and_training_goes_on_as_eager(frac):
    """Finding 1: an out-of-range label (eager raises the same IndexError) under swapping (0.4x the state) and
    with everything resident (3x): device holds back to before the step, no gradient left over, and the next
    steps train bitwise as eager does without the bad batch."""
    sm, ref, data = compiled(frac)
    sm(*data[0])
    before = holds(sm)
    x, y = data[1]
    bad = y.clone()
    bad[-1] = 99
    with pytest.raises(IndexError) as info:
        sm(x, bad)
    assert any("rolled back" in note for note in getattr(info.value, "__notes__", []))
    assert holds(sm) == before
    assert all(p.grad is None for p in sm.program.gm.parameters())
    assert sm.steps == 1
    for batch in data[2:4]:
        sm(*batch)
    assert sm.steps == 3
    assert_bitwise(sm, expected(ref, [data[0]] + data[2:4]))
    sm.close()


@pytest.mark.parametrize("policy", ["sequential", "ondemand"])
def test_the_baseline_policies_roll_a_failed_step_back_too(policy):
    """Finding 1 under the other schedules. The on-demand runtime keeps what it fetched on the device as a cache it
    evicts under pressure: what the failed step left beyond the pre-step level is that cache, all of it evictable."""
    sm, ref, data = compiled(0.4, policy=policy)
    sm(*data[0])
    live = sm.runtime.meter.live
    x, y = data[1]
    with pytest.raises(IndexError):
        sm(x, torch.full_like(y, 99))
    if policy == "ondemand" and sm.runtime.meter.live > live:
        sm.runtime.on_demand.evict(sm.runtime.meter.live - live)
    assert sm.runtime.meter.live <= live and all(p.grad is None for p in sm.program.gm.parameters())
    sm(*data[2])
    fused = {"fused": False} if policy == "ondemand" else {}      # ondemand steps with torch's loop
    model, _ = eager_accumulate(ref, [data[0], data[2]], 4, **fused)
    assert_bitwise(sm, {n: p.detach() for n, p in model.named_parameters()})
    sm.close()


def _first_step(sm) -> int:
    return schedule_ops(sm).index("step")


@pytest.mark.parametrize("error", [RuntimeError("injected"), KeyboardInterrupt()], ids=["error", "interrupt"])
@pytest.mark.parametrize("where", [0.3, "before-first-step"])
def test_a_step_that_raises_before_any_update_is_rolled_back_whole(error, where):
    """Finding 1: an exception or Ctrl-C at 30% of a step, or just before the first pack's optimizer update,
    under swapping: the next steps train bitwise as eager without the failed one, and sm.steps counts truly."""
    sm, ref, data = compiled(0.4)
    sm(*data[0])
    before = holds(sm)
    n = len(schedule_ops(sm))
    at = int(n * where) if isinstance(where, float) else _first_step(sm) - 1
    with fail_at(at, error) as hit, pytest.raises(type(error)) as info:
        sm(*data[1])
    assert hit["hit"] and at < _first_step(sm)
    assert any("rolled back" in note for note in info.value.__notes__)
    assert holds(sm) == before and sm.steps == 1
    for batch in data[2:4]:
        sm(*batch)
    assert_bitwise(sm, expected(ref, [data[0]] + data[2:4]))
    sm.close()


def test_ctrl_c_while_packs_step_finishes_the_step_then_stops():
    """Finding 1 (Ctrl-C at 70% of a step, after the first pack's update): the interrupt is held until every
    pack has stepped, then raised; the step counts, and training matches eager that took it."""
    sm, ref, data = compiled(0.4)
    after_first_step = _first_step(sm) + 1
    assert "backward" in schedule_ops(sm)[after_first_step:]        # packs still to do their backward
    # Ctrl-C as an interactive Python process has it: a pytest started as a background job of a non-interactive shell
    # (`cmd &`) inherits SIGINT ignored, Python then keeps it so, and the runtime rightly has nothing to hold
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        with fail_at(after_first_step, signum=signal.SIGINT) as hit, pytest.raises(KeyboardInterrupt) as info:
            sm(*data[0])
        assert hit["hit"] and "finished first" in " ".join(info.value.__notes__)
        assert sm.steps == 1 and signal.getsignal(signal.SIGINT) is signal.default_int_handler
    finally:                       # the process's handler as the test found it, for the tests after this one
        signal.signal(signal.SIGINT, previous)
    sm(*data[1])
    assert_bitwise(sm, expected(ref, data[:2]))
    sm.close()


def test_an_error_after_some_packs_stepped_is_recorded_and_refused_until_resolved(tmp_path):
    """Finding 1: a failure once some packs have stepped cannot be undone (optimizers update in place): the error
    names the packs that stepped, the module refuses to train on or save the mix (TornStepError) until a
    checkpoint is loaded, after which it trains bitwise as eager from that checkpoint."""
    sm, ref, data = compiled(0.4)
    sm(*data[0])
    harmony.save(sm, tmp_path / "ck")
    before = holds(sm)
    with fail_at(_first_step(sm) + 1, RuntimeError("injected")), pytest.raises(RuntimeError) as info:
        sm(*data[1])
    note = " ".join(info.value.__notes__)
    assert "had updated packs" in note and "harmony.load" in note
    assert holds(sm) == before and sm.steps == 1
    with pytest.raises(TornStepError, match="updated packs"):
        sm(*data[2])
    with pytest.raises(TornStepError):
        harmony.save(sm, tmp_path / "mixed")
    harmony.load(sm, tmp_path / "ck")
    sm(*data[2])
    assert_bitwise(sm, expected(ref, [data[0], data[2]]))
    sm.close()


def test_accepting_a_partial_step_trains_on_with_exactly_the_packs_it_updated():
    """Finding 1: ``sm.accept_partial_step()`` keeps a torn step's updates; it returns which packs stepped, and
    the weights are those of eager stepping exactly those parameters (their gradients for that batch)."""
    sm, ref, data = compiled(0.4)
    with fail_at(_first_step(sm) + 1, RuntimeError("injected")), pytest.raises(RuntimeError):
        sm(*data[0])
    torn = sm.accept_partial_step()
    assert torn["stepped"] and torn["not_stepped"] and sm.accept_partial_step() is None
    sm(*data[1])
    model = copy.deepcopy(ref)
    opt = torch.optim.AdamW(model.parameters(), fused=True)
    for batch, only in ((data[0], set(torn["params"])), (data[1], None)):
        for mb in zip(*(t.chunk(4) for t in batch)):
            (model(*mb) / 4).backward()
        for n, p in model.named_parameters():
            if only is not None and n not in only:
                p.grad = None
        opt.step()
        opt.zero_grad()
    assert_bitwise(sm, {n: p.detach() for n, p in model.named_parameters()})
    sm.close()


@pytest.mark.parametrize("mode", ["no_grad", "inference_mode"])
def test_a_step_under_no_grad_evaluates_and_poisons_nothing(mode):
    """Finding 1: sm(...) under torch.no_grad() (or inference_mode) evaluates (issue 28: tests/test_evaluate.py)
    instead of failing half-way; it trains nothing, and the next step trains as if it had not been called."""
    sm, ref, data = compiled(0.4)
    before = holds(sm)
    with getattr(torch, mode)():
        loss = sm(*data[0])
    assert sm.steps == 0 and holds(sm) == before and torch.equal(loss, sm.evaluate(*data[0]))
    sm(*data[1])
    assert sm.steps == 1
    assert_bitwise(sm, expected(ref, data[1:2]))
    sm.close()


# -- 6. the arguments of sm(...) --------------------------------------------------------------------
def test_the_arguments_of_a_step_are_checked():
    """Finding 6: an unknown keyword, a tensor given twice or missing, a 0-row batch: InputError naming it."""
    sm, _, data = compiled(3.0)
    x, y = data[0]
    with pytest.raises(InputError, match="unknown keyword argument 'bogus'"):
        sm(x, y, bogus=y)
    with pytest.raises(InputError, match="'y' both by position and by keyword"):
        sm(x, y, y=y)
    with pytest.raises(InputError, match="missing batch tensor 'y'"):
        sm(x=x)
    with pytest.raises(InputError, match=r"x float32\[0, 32\].* has 0 rows"):
        sm(x[:0], y[:0])
    sm(x, y=y)
    assert sm.steps == 1
    assert params(sm)
    sm.close()


# -- 2 and 7. checkpoints: validated before anything changes; private files; symlinked paths --------
def _manifest(ck):
    import json
    return json.loads((ck / "manifest.json").read_text())


def _write_manifest(ck, manifest, reseal=True):
    import json

    from harmony.driver.checkpoint.check import seal
    (ck / "manifest.json").write_text(json.dumps(seal(manifest) if reseal else manifest))


@pytest.fixture
def saved(tmp_path):
    sm, ref, data = compiled(0.4)
    sm(*data[0])
    harmony.save(sm, tmp_path / "ck")
    sm(*data[1])                      # the module now differs from the checkpoint
    yield sm, tmp_path / "ck", data
    sm.close()


def _edit_group(m, key, value):
    m["param_groups"][0][0][key] = value
    return m


TAMPERING = {   # what was changed -> (edit of the manifest, whether it is resealed, what the error names)
    "lr edited": (lambda m: _edit_group(m, "lr", 1000.0), False, "sha256"),
    "step edited": (lambda m: {**m, "step": 9}, False, "sha256"),
    "step not a number": (lambda m: {**m, "step": "two"}, True, "'step'"),
    "lr not a number": (lambda m: _edit_group(m, "lr", "fast"), True, "'lr'"),
    "lr infinite": (lambda m: _edit_group(m, "lr", float("inf")), True, "'lr'"),
    "betas out of range": (lambda m: _edit_group(m, "betas", [0.9, 1.5]), True, "'betas'"),
    "a file entry not a dict": (lambda m: {**m, "files": ["pack-000.pt"] + m["files"][1:]}, True, "files[0]"),
    "no checksum": (lambda m: {k: v for k, v in m.items() if k != "manifest_sha256"}, False, "checksum"),
}


@pytest.mark.parametrize("case", list(TAMPERING))
def test_a_tampered_manifest_is_refused_naming_the_field_and_nothing_changes(saved, case):
    """Finding 2: an edited lr or step (not resealed: the manifest's own sha256 finds it), a step or lr of the
    wrong type or out of range, a non-dict file entry: CheckpointError naming it, before anything changed."""
    from harmony.errors import CheckpointError
    sm, ck, data = saved
    edit, reseal, named = TAMPERING[case]
    _write_manifest(ck, edit(_manifest(ck)), reseal)
    now, steps = params(sm), sm.steps
    with pytest.raises(CheckpointError, match="nothing was changed") as info:
        harmony.load(sm, ck)
    assert named in str(info.value)
    assert sm.steps == steps
    assert_bitwise(sm, now)
    sm(*data[2])                      # and it trains on


@pytest.mark.parametrize("change", ["shape", "dtype"])
def test_a_data_file_whose_tensor_differs_from_the_model_is_refused_before_any_copy(saved, change):
    """Finding 2: a data file whose tensor has another shape or dtype than the model's (its sha256 and the
    manifest's checksum updated, as a careful forger would) is refused naming the tensor; nothing changes."""
    import hashlib

    from harmony.errors import CheckpointError
    sm, ck, _ = saved
    m = _manifest(ck)
    f = next(f for f in m["files"] if not f.get("rng"))
    data = torch.load(ck / f["name"], weights_only=True)
    name = next(iter(data["model"]))
    t = data["model"][name]
    data["model"][name] = torch.full((1,), 123.0) if change == "shape" else t.double()
    (ck / f["name"]).unlink()
    torch.save(data, ck / f["name"])
    raw = (ck / f["name"]).read_bytes()
    f["bytes"], f["sha256"] = len(raw), hashlib.sha256(raw).hexdigest()
    _write_manifest(ck, m)
    now = params(sm)
    with pytest.raises(CheckpointError, match=f"tensor '{name}'"):
        harmony.load(sm, ck)
    assert_bitwise(sm, now)


def test_checkpoints_are_private_and_a_symlinked_path_saves_again_and_again(tmp_path):
    """Finding 7: checkpoint files are 0600 in a 0700 directory; a checkpoint path that is a symbolic link is
    resolved once, so every save after the first works too and the link keeps pointing at the checkpoint."""
    sm, ref, data = compiled(3.0)
    real = tmp_path / "real"
    link = tmp_path / "link"
    link.symlink_to(real)
    for batch in data[:3]:
        sm(*batch)
        harmony.save(sm, link)
    assert link.is_symlink() and (link / "manifest.json").is_file()
    assert oct(real.stat().st_mode & 0o777) == oct(0o700)
    assert {oct(p.stat().st_mode & 0o777) for p in real.iterdir()} == {oct(0o600)}
    assert [p.name for p in tmp_path.iterdir() if p.name not in ("real", "link")] == []
    at3 = params(sm)
    sm(*data[3])
    harmony.load(sm, link)
    assert_bitwise(sm, at3) and sm.steps == 3
    sm.close()


# -- 4 and 5. offload directories: removed on SIGTERM and SIGHUP; swept only when provably dead ----
def _dead_pid() -> int:
    import subprocess
    import sys
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    return p.pid


def _fake_dir(parent, pid, tag=None):
    from harmony.runtime.tiers.disk import PREFIX
    from harmony.runtime.tiers.dirs import machine_tag
    d = parent / (f"{PREFIX}{pid}-{machine_tag() if tag is None else tag}-x" if tag != "" else f"{PREFIX}{pid}-x")
    d.mkdir(mode=0o700)
    (d / "pack-000.bin").write_bytes(b"state")
    return d


def test_the_sweep_removes_only_directories_it_can_prove_dead(tmp_path):
    """Finding 4: on shared scratch another machine's directory (whose pid means nothing here), an earlier boot's,
    one without the record (the old naming), one whose lock a live process holds, and one of a live pid all stay;
    only this host's, this boot's, dead and unlocked one goes."""
    import fcntl

    from harmony.runtime.tiers.disk import DiskStore
    from harmony.runtime.tiers.dirs import machine_tag
    dead = _dead_pid()
    other_machine = _fake_dir(tmp_path, dead, tag="0123456789")
    no_record = _fake_dir(tmp_path, dead, tag="")
    locked = _fake_dir(tmp_path, dead)
    os.rename(locked, locked.with_name(locked.name + "locked"))
    locked = locked.with_name(locked.name + "locked")
    alive = _fake_dir(tmp_path, os.getppid())
    gone = _fake_dir(tmp_path, dead)
    holder = os.open(locked, os.O_RDONLY)
    fcntl.flock(holder, fcntl.LOCK_EX)         # as a live owner holds it (an open file description of its own)
    try:
        with DiskStore(tmp_path) as store:
            assert store.stale_removed == [gone.name]
            assert machine_tag() in store.path.name
    finally:
        os.close(holder)
    assert not gone.exists()
    assert all(d.exists() for d in (other_machine, no_record, locked, alive))


def test_the_disk_tier_writes_nothing_through_a_link_planted_in_its_directory(tmp_path):
    """Finding 7: a symbolic link planted where a pack's file goes is refused (O_NOFOLLOW), its target untouched."""
    from harmony.errors import OffloadError
    from harmony.runtime.tiers.disk import DiskStore
    victim = tmp_path / "victim"
    victim.write_bytes(b"keep me")
    with DiskStore(tmp_path / "scratch") as store:
        store.file(0).symlink_to(victim)
        (t,) = store.empty([((1000,), torch.float32)])
        with pytest.raises((OffloadError, OSError)):
            store.write(0, [t]).result()
    assert victim.read_bytes() == b"keep me"


SIGNALLED = """
import os, signal, sys, time
sys.path.insert(0, {tests!r})
from test_disk import compile_gpt, DATA, TINY, smallest_host_budget
signal.signal(signal.{sig}, signal.SIG_DFL)    # not what a launcher left (nohup ignores SIGHUP for its children)
if {handler!r} == "exit":
    signal.signal(signal.{sig}, lambda *a: sys.exit(3))
if {handler!r} == "ignore":
    signal.signal(signal.{sig}, signal.SIG_IGN)
sm = compile_gpt(cfg=TINY, host_memory_budget=smallest_host_budget(TINY), offload_dir={dir!r})
sm(*DATA[0])
print(sm.runtime.state.disk.store.path, flush=True)
time.sleep(60)
"""


@pytest.mark.parametrize("sig,handler", [("SIGTERM", None), ("SIGHUP", None), ("SIGTERM", "exit"),
                                         ("SIGHUP", "ignore")])
def test_sigterm_and_sighup_remove_the_offload_directory(tmp_path, sig, handler):
    """Finding 5: SIGTERM and SIGHUP remove the private directory as SIGINT does; the process still dies of the
    signal, and a handler the user installed still runs (here it exits with status 3). A signal the process
    ignores stays ignored (a job under nohup outlives its terminal's hangup): then SIGTERM ends it, and cleans."""
    import subprocess
    import sys
    from pathlib import Path
    tests = str(Path(__file__).parent)
    script = SIGNALLED.format(tests=tests, handler=handler, sig=sig, dir=str(tmp_path))
    p = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True,
                         cwd=str(Path(tests).parent))
    made = Path(p.stdout.readline().strip())
    assert made.is_dir() and any(made.iterdir())
    p.send_signal(getattr(signal, sig))
    if handler == "ignore":
        with pytest.raises(subprocess.TimeoutExpired):
            p.wait(timeout=2)
        assert made.is_dir()
        p.send_signal(signal.SIGTERM)
        sig = "SIGTERM"
    rc = p.wait(timeout=60)
    assert rc == (3 if handler == "exit" else -getattr(signal, sig))
    assert not made.exists()


# -- 8. the user's model under weights_on="disk" ------------------------------------------------------
def test_the_users_model_refuses_to_be_read_while_its_weights_are_on_disk_until_synced(tmp_path):
    """Finding 8: with weights on disk the model passed to compile holds placeholders between steps: its forward
    and state_dict raise OffloadError saying to call sm.sync_model(), which brings the trained weights (bitwise
    those of sm.training_state_dict()) into it; the next step puts placeholders back, and refuses again."""
    from test_disk_params import DATA, compile_gpt

    from harmony.errors import OffloadError
    sm = compile_gpt(offload_dir=tmp_path)
    model = sm.model
    sm(*DATA[0])
    with pytest.raises(OffloadError, match=r"sm\.sync_model\(\)"):
        model(*DATA[1])
    with pytest.raises(OffloadError, match="live on disk"):
        model.state_dict()
    p = model.tok.weight          # each parameter on disk refuses to be read, and still describes itself
    assert set(withheld(model)) == {n for n, _ in model.named_parameters()} and p.shape == (64, 64)
    for read in (lambda: p.data.clone(), lambda: p.T @ p, lambda: copy.deepcopy(model), lambda: pickle.dumps(p),
                 lambda: model.to(torch.float64), lambda: torch.save(model.state_dict(keep_vars=True), io.BytesIO())):
        with pytest.raises(OffloadError, match=r"(tok\.weight).*sm\.sync_model\(\)"):
            read()
    assert "sync_model" in repr(p) and p.requires_grad and p.grad is None
    assert sm.sync_model()
    assert withheld(model) == [] and type(p) is torch.nn.Parameter      # its own class again
    trained = sm.training_state_dict()["model"]
    name_of = {id(p): n for n, p in sm.program.gm.named_parameters()}   # the traced graph's names
    for p in model.parameters():
        assert torch.equal(p.detach(), trained[name_of[id(p)]])
    assert model.state_dict()
    model(*DATA[1])                                  # a whole model now: evaluating it works
    sm(*DATA[1])
    with pytest.raises(OffloadError):
        model(*DATA[2])
    assert len(withheld(model)) == len(list(model.parameters()))     # placeholders again: refuses again
    sm.close()


def test_sync_model_is_nothing_to_do_where_weights_stay_in_memory():
    """Finding 8: on every other tier the model holds its trained weights between steps."""
    sm, ref, data = compiled(0.4)
    sm(*data[0])
    assert sm.sync_model() == []
    trained = params(sm)
    name_of = {id(p): n for n, p in sm.program.gm.named_parameters()}
    for p in sm.model.parameters():
        assert torch.equal(p.detach(), trained[name_of[id(p)]])
    sm.close()


@pytest.mark.parametrize("value", ["full", 1, "yes"])
def test_shard_state_takes_only_true_false_or_none(value):
    """Finding 8: shard_state="full" (any truthy value) was taken as True; now a ConfigError names it."""
    from harmony.errors import ConfigError
    model, data = mlp_case()
    with pytest.raises(ConfigError, match=f"shard_state={value!r}"):
        harmony.compile(model, data[0], memory_budget="1MiB", shard_state=value)


# -- 3. data parallel: save on one rank only; another world size ----------------------------------------
def _save_on_rank_0_only(rank, world):
    import tempfile
    from pathlib import Path

    import harmony.data
    os.environ["HARMONY_COMM_TIMEOUT"] = "5"
    model, data = mlp_case(batch=8)
    sm = harmony.compile(model, example_batch=harmony.data.shard(data[0]), microbatches=2,
                         memory_budget=int(training_state_bytes(model) * 3))
    sm(*harmony.data.shard(data[0]))
    if rank == 0:        # the DDP habit: only rank 0 saves
        try:
            harmony.save(sm, Path(tempfile.mkdtemp()) / "ck")
            return "no error"
        except Exception as e:      # noqa: BLE001 (the test reads its type and message)
            return f"{type(e).__name__}: {e}"
    try:
        sm(*harmony.data.shard(data[1]))
    except Exception as e:          # noqa: BLE001
        return f"{type(e).__name__}: {e}"
    return "stepped"


def test_saving_on_one_rank_only_is_a_communication_error_naming_it_within_the_timeout():
    """Finding 3: harmony.save on rank 0 alone gave a raw gloo error after the whole timeout; now a
    CommunicationError at once (the ranks' handshake, driver/handshake.py) names each rank's call and says that
    every rank must call it."""
    from test_collectives import _spawn
    res = _spawn(2, _save_on_rank_0_only, timeout=120, pg_timeout=30, wait_for={0})
    assert res[0].startswith("CommunicationError: harmony.save on rank 0 of 2"), res
    assert "Every rank must call harmony.save" in res[0] and "rank 1: sm(...)" in res[0]   # at once, not after 5 s


def test_a_sharded_checkpoint_of_another_world_size_names_both_sizes(tmp_path):
    """Finding 3: a 2-rank sharded checkpoint loaded by one process said "no manifest.json"; now the error names
    the 2 ranks it was saved by and this run's 1, and nothing changes."""
    from harmony.errors import CheckpointError
    sm, _, data = compiled(3.0)
    sm(*data[0])
    for r in range(2):
        (tmp_path / "ck" / f"rank-{r}-of-2").mkdir(parents=True)
        (tmp_path / "ck" / f"rank-{r}-of-2" / "manifest.json").write_text("{}")
    now = params(sm)
    with pytest.raises(CheckpointError, match="saved by 2 ranks.*this run has 1 rank "):
        harmony.load(sm, tmp_path / "ck")
    assert_bitwise(sm, now)
    sm.close()


def test_sm_steps_counts_a_step_whose_updates_were_applied_though_its_disk_write_failed(tmp_path, monkeypatch):
    """Finding 7: a step that raised OffloadError (ENOSPC writing the offload directory) after every pack had
    stepped did update the weights: sm.steps counts it, the error says so, and the state kept in host memory is
    written by the next step."""
    import errno

    import harmony.runtime.tiers.disk as disk
    from test_disk import DATA, TINY, compile_gpt, smallest_host_budget

    from harmony.errors import OffloadError
    sm = compile_gpt(cfg=TINY, host_memory_budget=smallest_host_budget(TINY), offload_dir=tmp_path)
    sm(*DATA[0])

    def full(fd, data, offset):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
    monkeypatch.setattr(disk, "_pwrite", full)
    with pytest.raises(OffloadError) as info:
        sm(*DATA[1])
    assert sm.steps == 2 and "counts in sm.steps" in " ".join(info.value.__notes__)
    monkeypatch.setattr(disk, "_pwrite", os.pwrite)
    sm(*DATA[2])
    assert sm.steps == 3
    sm.close()


# -- 6. harmony.compile's own arguments: the config-objects rework checks them (not this change) ---------------
COMPILE_ARGS = {
    "memory_budget=nan": dict(memory_budget=float("nan")),
    "memory_budget=inf": dict(memory_budget=float("inf")),
    "memory_budget='1e400'": dict(memory_budget="1e400"),
    "microbatches=True": dict(microbatches=True),
    "passes=()": dict(passes=()),
}


@pytest.mark.parametrize("case", list(COMPILE_ARGS))
def test_bad_compile_arguments_are_config_errors_naming_them(case):
    """Finding 6 (compile's half): each bad argument is a ConfigError that names it, not a raw traceback."""
    from harmony.errors import ConfigError
    model, data = mlp_case()
    with pytest.raises(ConfigError, match=case.split("=")[0]):
        harmony.compile(model, data[0], **{"memory_budget": "1MiB", **COMPILE_ARGS[case]})


def test_a_zero_row_example_batch_is_an_input_error():
    model, data = mlp_case()
    x, y = data[0]
    with pytest.raises(InputError, match="example_batch"):
        harmony.compile(model, (x[:0], y[:0]), memory_budget="1MiB")
