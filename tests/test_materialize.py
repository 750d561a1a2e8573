"""A model built without its weights (``harmony.empty_weights``): compile fills it as it places it, a disk group at a
time; the weights do not depend on the plan; training is bitwise eager's on the same weights; bad inputs are refused
before anything is made."""
import weakref

import pytest
import torch
import torch.nn as nn
from hypothesis import given, settings
from hypothesis import strategies as st

import harmony
import harmony.runtime.tiers.disk as disk
from harmony.errors import ConfigError, InputError
from harmony.driver.materialize import Filler, is_empty
from harmony.models import GPT, GPTConfig, copy_task
from harmony.runtime.tiers.params_disk import written_names
from harmony.runtime.placeholders import is_placeholder
from models import ARCHITECTURES, eager_accumulate, hf_bert_case, params, training_state_bytes

CFG = GPTConfig(layers=3, width=64, vocab=64, seq=16, tie=False)
DATA = list(copy_task(CFG, 8, 3))
STATE = 16 * GPT(CFG).config.n_params()


def empty_gpt(seed=0, c=CFG):
    torch.manual_seed(seed)
    with harmony.empty_weights():
        return GPT(c)


def compile_empty(m, **kw):
    kw = dict(dict(memory_budget=STATE // 3, microbatches=4), **kw)
    return harmony.compile(m, example_batch=DATA[0], **kw)


def train_bitwise(sm, expected):
    """Train ``sm`` on DATA; its parameters then equal ``expected``'s (eager on the same weights) bit for bit."""
    for x, y in DATA:
        sm(x, y)
    got = params(sm)
    for n, p in expected.named_parameters():
        assert torch.equal(got[n], p), n
    sm.close()


def test_empty_weights_makes_parameters_meta_and_leaves_buffers_and_ties():
    torch.manual_seed(0)
    with harmony.empty_weights():
        tied = GPT(GPTConfig(layers=1, width=32, tie=True))
        bn = nn.BatchNorm1d(4)
    assert all(p.device.type == "meta" for p in [*tied.parameters(), *bn.parameters()]) and is_empty(tied)
    assert tied.head.weight is tied.tok.weight
    assert bn.running_var.device.type == "cpu" and torch.equal(bn.running_var, torch.ones(4))
    assert not is_empty(nn.Linear(2, 2))        # the patch is gone once the block ends, also after an error
    with pytest.raises(RuntimeError), harmony.empty_weights():
        raise RuntimeError("in the block")
    assert nn.Linear(2, 2).weight.device.type == "cpu"


@pytest.mark.parametrize("where", ["host", "disk"])
def test_an_empty_gpt_trains_bitwise_as_eager_on_the_weights_materialize_makes(where, tmp_path):
    ref = harmony.materialize(empty_gpt())
    assert not is_empty(ref)
    expected, _ = eager_accumulate(ref, DATA, 4)
    m = empty_gpt()
    extra = dict(weights_on="disk", optimizer_on="host", disk_group_bytes="24KiB", offload_dir=tmp_path) \
        if where == "disk" else {}
    sm = compile_empty(m, **extra)
    assert set(sm.plan.by_pack("master_on").values()) == {where}
    assert sm.filled["bytes"] == 4 * CFG.n_params()
    train_bitwise(sm, expected)
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(disk.PREFIX)] == []


def test_the_filled_weights_depend_on_the_seed_not_on_the_plan(tmp_path):
    a = compile_empty(empty_gpt(), memory_budget=2 * STATE)       # every pack's weights in host memory
    b = compile_empty(empty_gpt(), memory_budget=STATE // 4, weights_on="disk", optimizer_on="host",
                      offload_dir=tmp_path, disk_group_bytes="16KiB")
    assert len(a.plan.packs) < len(b.plan.packs) and set(b.plan.by_pack("master_on").values()) == {"disk"}
    wa, wb = params(a), params(b)
    assert all(torch.equal(wa[n], wb[n]) for n in wa)
    c = compile_empty(empty_gpt(seed=1))
    assert not torch.equal(params(c)["blocks.0.fc.weight"], wa["blocks.0.fc.weight"])
    for sm in (a, b, c):
        sm.close()
    # and what they are: the model's own init per module (GPT-2's: N(0, 0.02) for Linear and Embedding weights)
    w = wa["blocks.1.fc.weight"]
    assert abs(w.std().item() - 0.02) < 0.002 and torch.equal(wa["blocks.1.fc.bias"], torch.zeros(4 * CFG.width))
    assert torch.equal(wa["ln.weight"], torch.ones(CFG.width))


@settings(max_examples=15, deadline=None)
@given(st.randoms(use_true_random=False), st.booleans())
def test_the_weights_do_not_depend_on_the_order_the_parameters_are_asked_for(rng, tie):
    c = GPTConfig(layers=2, width=16, vocab=32, seq=8, tie=tie)
    expected = dict(harmony.materialize(empty_gpt(c=c)).named_parameters())
    m = empty_gpt(c=c)
    filler = Filler(m)
    names = [n for n, _ in m.named_parameters()]
    rng.shuffle(names)
    named = dict(m.named_parameters())
    for i in range(0, len(names), 3):       # a few at a time, as the disk tier asks group by group
        filler.fill([named[n] for n in names[i:i + 3]])
    assert not is_empty(m) and filler.filled == 4 * c.n_params()
    assert all(torch.equal(p, expected[n]) for n, p in m.named_parameters())


def test_filling_leaves_the_process_random_stream_as_it_was():
    m = empty_gpt(seed=3)
    sm = compile_empty(m)
    after = torch.rand(4)
    torch.manual_seed(3)
    assert torch.equal(after, torch.rand(4))
    sm.close()


def test_the_host_holds_one_disk_group_beside_the_weights_it_keeps(monkeypatch, tmp_path):
    """Weights of packs on disk are made a group at a time as their files are written, not all at once."""
    c = GPTConfig(layers=8, width=64, vocab=64, seq=16, tie=False)
    m = empty_gpt(c=c)
    held: list[int] = []
    fill = Filler.fill

    def fill_and_count(self, ps):
        fill(self, ps)
        real = {p.untyped_storage().data_ptr(): p.untyped_storage().nbytes() for p in m.parameters()
                if p.device.type == "cpu" and not is_placeholder(p)}
        held.append(sum(real.values()))
    monkeypatch.setattr(Filler, "fill", fill_and_count)
    sm = harmony.compile(m, example_batch=DATA[0], memory_budget=16 * c.n_params() // 6, microbatches=4,
                         weights_on="disk", optimizer_on="host", disk_group_bytes="32KiB", offload_dir=tmp_path)
    on_disk = written_names(sm.plan)
    named = dict(m.named_parameters())
    kept = sum(p.numel() * 4 for n, p in named.items() if n not in on_disk)
    group = max(sum(named[n].numel() * 4 for n in g) for r in sm.plan.residency.values() for g in r.disk_groups)
    widest = max(sum(p.numel() * 4 for p in mod.parameters(recurse=False)) for mod in m.modules())
    assert len(on_disk) > len(named) // 2
    # a module's parameters are made together, and may straddle two groups
    assert max(held) <= kept + group + widest < 4 * c.n_params() // 2
    assert all(is_placeholder(named[n]) for n in on_disk)
    sm(*DATA[0])
    sm.close()


@pytest.mark.parametrize("arch", ["llama", "mixtral", "t5", "gpt2", "bert"])
def test_hugging_face_models_built_empty_train_bitwise_as_eager_on_the_same_weights(arch):
    """Built from their configs under empty_weights: traced on fake twins (a MoE router that branches on the device
    type takes the CPU's branch), filled by their own _init_weights, and trained bitwise as eager on those weights."""
    pytest.importorskip("transformers")
    model, data = hf_bert_case() if arch == "bert" else ARCHITECTURES[arch]()

    def build():
        torch.manual_seed(0)
        with harmony.empty_weights():
            return type(model)(model.config)
    ref = build()
    assert is_empty(ref) and all(b.device.type == "cpu" for b in ref.buffers())
    expected, _ = eager_accumulate(harmony.materialize(ref), data, 2)     # (trains a copy)
    if arch == "llama":      # its norms are filled by its own _init_weights
        norm = ref.model.layers[0].input_layernorm.weight
        assert torch.equal(norm, torch.ones_like(norm))
    m = build()
    sm = harmony.compile(m, example_batch=data[0], memory_budget=training_state_bytes(model) // 2 + 2 ** 17,
                         microbatches=2)
    assert len(sm.plan.packs) > 1
    for batch in data:
        sm(**batch)
    got = params(sm)
    # a weight tied into several packs adds its gradients in another order than eager: allclose (README); AdamW
    # moves an element whose gradient is near zero by up to its lr (1e-3) either way, so the sum's last bits show,
    # and from the next step on in every weight the tied one feeds (T5's embedding feeds them all)
    names = [id(p) for _, p in m.named_parameters(remove_duplicate=False)]
    tied = {n for n, p in m.named_parameters() if names.count(id(p)) > 1}
    for n, p in expected.named_parameters():
        assert torch.equal(got[n], p) or tied and torch.allclose(got[n], p, atol=1e-4), (n, (got[n] - p).abs().max())
    sm.close()


class Scale(nn.Module):
    """A module with a parameter and no reset_parameters (as many hand-written ones)."""

    def __init__(self, n):
        super().__init__()
        self.gamma = nn.Parameter(torch.ones(n))
        self.beta = nn.Parameter(torch.zeros(n))

    def forward(self, x):
        return x * self.gamma + self.beta


def scaled_mlp():
    with harmony.empty_weights():
        return nn.Sequential(nn.Linear(8, 16), Scale(16), nn.ReLU(), nn.Linear(16, 4))


MLP_BATCH = (torch.randn(8, 8), torch.randint(0, 4, (8,)))
CE = nn.functional.cross_entropy


def test_a_module_without_an_init_is_refused_before_anything_is_made(tmp_path):
    m = scaled_mlp()
    with pytest.raises(ConfigError, match=r"1 modules .* have no reset_parameters\(\) .* \(first: 1 \(Scale\)\); "
                                          r"pass init=fn"):
        harmony.compile(m, MLP_BATCH, loss_fn=CE, offload_dir=tmp_path, weights_on="disk", optimizer_on="host",
                        memory_budget="64KiB")
    assert is_empty(m) and all(p.device.type == "meta" for p in m.parameters()) and list(tmp_path.iterdir()) == []

    def init(module):        # the user's: fills what it knows, the Linear layers through their own
        if isinstance(module, Scale):
            nn.init.ones_(module.gamma)
            nn.init.zeros_(module.beta)
        else:
            module.reset_parameters()
    sm = harmony.compile(m, MLP_BATCH, loss_fn=CE, init=init, memory_budget="64KiB")
    assert torch.equal(m[1].gamma, torch.ones(16)) and torch.isfinite(sm(*MLP_BATCH))
    sm.close()


def test_an_init_that_leaves_a_parameter_unfilled_is_named_and_nothing_is_left_behind(tmp_path):
    def partial(module):
        if isinstance(module, Scale):
            nn.init.ones_(module.gamma)            # beta forgotten
        elif hasattr(module, "reset_parameters"):
            module.reset_parameters()
    with pytest.raises(ConfigError, match=r"1\.beta \(Scale\) was left unfilled by init \(it still holds the NaN"):
        harmony.compile(scaled_mlp(), MLP_BATCH, loss_fn=CE, init=partial, memory_budget="64KiB",
                        offload_dir=tmp_path, weights_on="disk", optimizer_on="host", disk_group_bytes="4KiB")
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(disk.PREFIX)] == []
    # the same found while the disk packs' files are being written: they are removed with their directory
    m = empty_gpt()

    def forgets_the_last_fc(module):
        if module is not m.blocks[-1].fc:
            m._init_weights(module)
    with pytest.raises(ConfigError, match=r"blocks\.2\.fc\.weight \(Linear\) was left unfilled by init"):
        compile_empty(m, init=forgets_the_last_fc, weights_on="disk", optimizer_on="host", offload_dir=tmp_path,
                      disk_group_bytes="16KiB")
    assert list(tmp_path.iterdir()) == []
    with pytest.raises(ConfigError, match="init='normal' is not callable"):
        harmony.compile(scaled_mlp(), MLP_BATCH, loss_fn=CE, init="normal")


def test_buffers_on_the_meta_device_are_refused_with_what_to_do():
    with torch.device("meta"):
        m = nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.Linear(16, 4))
    with pytest.raises(InputError, match=r"3 buffers of the model are on the meta device \(first: 1.running_mean\).*"
                                         r"build the model under harmony.empty_weights\(\)"):
        harmony.compile(m, MLP_BATCH, loss_fn=CE, memory_budget="64KiB")


def test_an_empty_model_plans_on_the_meta_device_without_being_filled():
    m = empty_gpt()
    x = DATA[0][0].to("meta")
    sm = harmony.compile(m, (x, x), memory_budget=STATE // 3, microbatches=4, device="meta")
    assert is_empty(m) and sm.simulate("v100-16gb").step_seconds > 0


def _rank(rank, world, offload_dir, how):
    """An empty GPT on 2 ranks: pipelined with each rank's packs' weights on disk (each rank makes its own packs'
    weights only), or with its state partitioned (ZeRO-3: each rank makes them all, a pack at a time, keeping its
    chunks of each before it makes the next)."""
    out = {}
    for built in ("empty", "made") if how == "zero3" else ("empty",):     # ZeRO-3: and the same weights made first
        m = empty_gpt() if built == "empty" else harmony.materialize(empty_gpt())
        sizes = {n: p.numel() * p.element_size() for n, p in m.named_parameters()}
        held, fill = [], Filler.fill

        def fill_and_count(self, ps):     # the model's whole weights in host memory after each fill
            fill(self, ps)
            held.append(sum(p.untyped_storage().nbytes() for p in m.parameters()
                            if p.device.type == "cpu" and not is_placeholder(p)))
        Filler.fill = fill_and_count
        parallel = dict(parallel="pipeline", weights_on="disk") if how == "pipeline" else dict(shard_state="full")
        try:
            sm = harmony.compile(m, DATA[0], memory_budget=STATE // 2, microbatches=4, comm_timeout=20,
                                 offload_dir=offload_dir, optimizer_on="host", **parallel)
        finally:
            Filler.fill = fill
        widest = max(sum(p.numel() * p.element_size() for p in mod.parameters(recurse=False)) for mod in m.modules())
        packs = len(sm.plan.packs)
        bound = max(sum(sizes.get(n, 0) for n in spec.params) for spec in sm.plan.packs) + widest
        for x, y in DATA:
            sm(x, y)
        if how == "zero3":
            sm.sync_model()
            mine = dict(m.named_parameters())
        else:
            mine = sm.training_state_dict()["model"]
        params = dict(m.named_parameters())
        out[built] = dict(params={n: t.detach().numpy().copy() for n, t in mine.items()},
                          filled=sm.filled and sm.filled["bytes"], held=max(held, default=0), bound=bound,
                          packs=packs, mine=sum(t.numel() * t.element_size() for n, t in mine.items() if n in params))
        sm.close()
    return out


@pytest.mark.slow
@pytest.mark.parametrize("how", ["pipeline", "zero3"])
def test_ranks_make_the_weights_they_hold_and_train_bitwise_as_eager(tmp_path, how):
    from test_collectives import _spawn
    threads = torch.get_num_threads()
    torch.set_num_threads(1)          # as the ranks run: the same bits
    try:
        expected, _ = eager_accumulate(harmony.materialize(empty_gpt()), DATA, 4)
    finally:
        torch.set_num_threads(threads)
    out = _spawn(2, _rank, str(tmp_path), how, timeout=300)
    assert all(isinstance(out.get(r), dict) for r in (0, 1)), out
    res = {r: out[r]["empty"] for r in (0, 1)}
    whole = 4 * CFG.n_params()
    if how == "pipeline":    # bitwise eager gradient accumulation, as any pipeline run
        assert res[0]["filled"] == res[0]["mine"] and res[1]["filled"] == res[1]["mine"]
        assert res[0]["filled"] + res[1]["filled"] == whole and min(res[0]["filled"], res[1]["filled"]) > 0
        ref = dict(expected.named_parameters())
        assert set(res[0]["params"]) | set(res[1]["params"]) >= set(ref)
    else:                    # every rank makes them all, keeping its chunks of each pack before it makes the next
        assert res[0]["filled"] == res[1]["filled"] == whole        # bitwise the run given them made
        for r in (0, 1):    # one pack's whole weights at a time (a module's straddling two packs made together)
            assert res[r]["packs"] >= 2 and res[r]["held"] <= res[r]["bound"] < whole, res[r]
        ref = {n: torch.from_numpy(a) for n, a in out[0]["made"]["params"].items()}
        assert set(res[0]["params"]) == set(ref)
    for r in (0, 1):
        for n, a in res[r]["params"].items():
            if n in ref:
                assert torch.equal(torch.from_numpy(a), ref[n].detach()), f"rank {r}: {n}"


def test_a_meta_parameter_takes_its_data_as_the_same_object_or_says_why_not():
    from harmony.runtime.placeholders import take
    p = nn.Parameter(torch.empty(3, device="meta"))
    p.tag = "kept"
    before = id(p)
    take(p, torch.ones(3))
    assert id(p) == before and p.tag == "kept" and p.device.type == "cpu" and torch.equal(p, torch.ones(3))
    held = nn.Parameter(torch.empty(3, device="meta"))
    ref = weakref.ref(held)        # not torch's fake-tensor cache: it cannot be dropped for it
    with pytest.raises(ConfigError, match=r"something outside torch's fake-tensor caches holds a weak reference"):
        take(held, torch.ones(3))
    assert ref() is held and held.device.type == "meta"


def test_a_checkpoint_is_read_a_module_at_a_time_into_an_empty_model(tmp_path):
    """Fine-tuning a checkpoint bigger than the host: memory-mapped, each module's weights copied in as compile
    places them, the disk packs' straight into their files; training is bitwise the model that loaded it whole."""
    torch.manual_seed(5)
    pretrained = GPT(CFG)
    torch.save(pretrained.state_dict(), tmp_path / "model.pt")
    expected, _ = eager_accumulate(pretrained, DATA, 4)
    m = empty_gpt(seed=9)          # another seed: nothing is drawn
    state = torch.load(tmp_path / "model.pt", mmap=True, weights_only=True)
    sm = compile_empty(m, init=harmony.from_state_dict(m, state), weights_on="disk", optimizer_on="host",
                       offload_dir=tmp_path, disk_group_bytes="24KiB")
    train_bitwise(sm, expected)
    wrong = empty_gpt()
    with pytest.raises(ConfigError, match=r"from_state_dict: the state dict has no 'blocks.0.fc.weight'"):
        compile_empty(wrong, init=harmony.from_state_dict(wrong, {k: v for k, v in state.items() if "fc.w" not in k}))


def test_a_batch_that_does_not_fit_an_empty_model_gets_the_model_s_error_not_the_meta_device_s():
    with harmony.empty_weights():
        m = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    with pytest.raises(InputError, match=r"fails on the example batch: RuntimeError: a and b must have same "
                                         r"reduction dim, but got \[8, 9\] X \[8, 16\]"):
        harmony.compile(m, (torch.randn(8, 9), MLP_BATCH[1]), loss_fn=CE, memory_budget="64KiB")
    assert is_empty(m)


@pytest.mark.parametrize("arch", ["gpt2", "t5", "llama", "bert"])
def test_hugging_face_weights_made_empty_follow_the_model_s_own_init(arch):
    """Each weight has the spread the model's own init gives it built eagerly, also where that init reaches from a
    parent into its children (GPT-2 scales c_proj by the depth from GPT2MLP and GPT2Attention; T5 draws its
    feed-forward and attention weights from their parents and its embeddings from the model), and constants
    (norms, biases) are equal."""
    pytest.importorskip("transformers")
    model, _ = hf_bert_case() if arch == "bert" else ARCHITECTURES[arch]()
    torch.manual_seed(0)
    eager = type(model)(model.config)
    with harmony.empty_weights():
        empty = type(model)(model.config)
    harmony.materialize(empty)
    for (n, a), b in zip(eager.named_parameters(), empty.parameters()):
        if a.numel() >= 256:
            assert abs(b.std().item() / a.std().item() - 1) < 0.15, (n, b.std().item(), a.std().item())
        elif a.std() == 0:
            assert torch.equal(a, b), n
