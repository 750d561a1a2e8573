"""One call at a time on a module (driver/guard.py): steps, evaluations and checkpoints from two threads wait for
each other and train as one thread would; a closed module refuses every call, saying it is closed."""
import copy
import threading

import pytest
import torch

import harmony
from harmony.errors import ClosedError
from harmony.models import GPT, GPTConfig, copy_task
from models import params

CFG = GPTConfig(layers=2, width=32, vocab=64, seq=16, tie=False)
X, Y = next(iter(copy_task(CFG, 8, 1)))
STEPS = 6


def compiled(model):
    """Under half its training state: every step swaps packs in and out, what two threads at once interleaved."""
    budget = int(8 * sum(p.numel() for p in model.parameters()) * 0.7)
    return harmony.compile(model, example_batch=(X, Y), memory_budget=budget, microbatches=4,
                           optimizer=torch.optim.SGD, optimizer_kwargs={"lr": 0.1, "momentum": 0.9})


@pytest.fixture(scope="module")
def reference():
    """The model, and its parameters after 0..STEPS steps on the same batch, one thread."""
    torch.manual_seed(0)
    model = GPT(CFG)
    sm = compiled(copy.deepcopy(model))
    out = [params(sm)]
    for _ in range(STEPS):
        sm(X, Y)
        out.append(params(sm))
    sm.close()
    return model, out


def together(*jobs):
    """Run each job in a thread of its own, all starting at once; the errors they raised."""
    start, errors = threading.Barrier(len(jobs)), []

    def run(job):
        start.wait()
        try:
            job()
        except Exception as e:  # noqa: BLE001 (the test asserts there were none)
            errors.append(f"{type(e).__name__}: {e}")
    threads = [threading.Thread(target=run, args=(job,)) for job in jobs]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return errors


def same(a: dict, b: dict) -> bool:
    """The same state, to far below one update: a step lost, run twice or on a mix of two steps' tensors is far off.
    Not bitwise: a step that a thread other than the main one runs may round some gradient sums otherwise (eager
    torch does not; seen on CPU), which is also why the optimizer is SGD, whose update does not magnify a gradient's
    last bits as Adam's does where the gradient is near zero."""
    return a.keys() == b.keys() and all(torch.allclose(a[n], b[n], rtol=0, atol=1e-6) for n in a)


def test_two_threads_stepping_one_module_train_as_one_thread_would(reference):
    """Every step uses the same batch, so any order of the two threads' steps is the one-thread run."""
    model, at = reference
    sm = compiled(copy.deepcopy(model))

    def steps():
        for _ in range(STEPS // 2):
            sm(X, Y)
    assert together(steps, steps) == []
    assert sm.steps == STEPS and same(params(sm), at[STEPS])
    sm.close()


def test_evaluate_save_and_load_from_another_thread_while_one_trains(reference, tmp_path):
    """A thread evaluates, saves and loads the step-0 checkpoint while another trains: each call sees a whole step's
    state, so the module ends at the reference's state for its step count, and the checkpoint saved mid-training
    holds the reference's state at its step."""
    model, at = reference
    sm = compiled(copy.deepcopy(model))
    harmony.save(sm, tmp_path / "start")
    losses = []

    def train():
        for _ in range(4):
            sm(X, Y)

    def meanwhile():
        losses.append(sm.evaluate(X, Y))
        harmony.save(sm, tmp_path / "mid")
        harmony.load(sm, tmp_path / "start")
        losses.append(sm.evaluate(X, Y))
    assert together(train, meanwhile) == []
    assert all(torch.isfinite(v) for v in losses)
    assert same(params(sm), at[sm.steps])
    assert together(lambda: sm(X, Y)) == []      # and it trains on
    assert same(params(sm), at[sm.steps])
    other = compiled(copy.deepcopy(model))
    info = harmony.load(other, tmp_path / "mid")
    assert same(params(other), at[info.step])
    for m in (sm, other):
        m.close()


def test_a_closed_module_refuses_every_call_saying_it_is_closed(reference, tmp_path):
    model, at = reference
    sm = compiled(copy.deepcopy(model))
    sm(X, Y)
    harmony.save(sm, tmp_path / "ck")
    sm.close()
    calls = {"sm(...)": lambda: sm(X, Y), "sm.evaluate(...)": lambda: sm.evaluate(X, Y),
             "harmony.save": lambda: harmony.save(sm, tmp_path / "after"),
             "harmony.load": lambda: harmony.load(sm, tmp_path / "ck"),
             "sm.load_state_dict()": lambda: sm.load_state_dict(weights)}
    weights = sm.state_dict()     # what training left in memory stays readable after close
    assert torch.equal(weights[next(iter(weights))], sm.training_state_dict()["model"][next(iter(weights))])
    for call, run in calls.items():
        with pytest.raises(ClosedError, match=rf"^{call.replace('(', '[(]').replace(')', '[)]')}: this module was "
                                              r"closed .*compile the model again"):
            run()
    with pytest.raises(ClosedError, match="closed"):
        sm.eval()(X, Y)                            # evaluation through sm(...) in eval mode
    assert not (tmp_path / "after").exists()
    sm.close()                                   # a second close does nothing
