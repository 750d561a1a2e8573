"""harmony.Config: every option of compile in documented groups, each checked with an error that names it."""
import ast
import inspect
from pathlib import Path

import pytest
import torch

import harmony
from harmony.compiler import config as config_module
from harmony.errors import ConfigError, InputError


def mlp():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))
    return model, (torch.randn(8, 8), torch.randn(8, 1))


def compile_mlp(**kw):
    model, batch = mlp()
    kw.setdefault("loss_fn", torch.nn.functional.mse_loss)
    return harmony.compile(model, batch, **kw)


@pytest.mark.parametrize("name, bad", [
    ("memory_budget", float("nan")), ("memory_budget", float("inf")), ("memory_budget", "1e400"),
    ("memory_budget", 0), ("memory_budget", -1), ("memory_budget", 0.5), ("memory_budget", "0MiB"),
    ("host_memory_budget", float("nan")), ("host_memory_budget", -(1 << 20)), ("host_memory_budget", "1e400"),
    ("disk_group_bytes", 0), ("disk_group_bytes", "-5MiB"), ("disk_group_bytes", float("inf")),
])
def test_bad_sizes_name_the_argument(name, bad):
    with pytest.raises(ConfigError, match=name):
        compile_mlp(**{name: bad})


@pytest.mark.parametrize("name, bad, accepted", [
    ("policy", "lru", "'harmony', 'sequential', 'ondemand'"),
    ("precision", "fp8", "'fp32', 'bf16', 'fp16'"),
    ("recompute", "never", "'auto', 'device', 'always'"),
    ("optimizer_on", "gpu", "'auto', 'device', 'host'"),
    ("weights_on", "nvme", "'auto', 'host', 'disk'"),
])
def test_unknown_choices_name_the_accepted_values(name, bad, accepted):
    with pytest.raises(ConfigError, match=f"{name}={bad!r}; choose one of {accepted}"):
        compile_mlp(**{name: bad})


@pytest.mark.parametrize("kw, match", [
    (dict(microbatches=True), "microbatches=True must be a positive integer"),
    (dict(microbatches=0), "microbatches=0 must be a positive integer"),
    (dict(microbatches=2.0), "microbatches=2.0"),
    (dict(microbatches=3), "positive divisor of the batch size 8"),
    (dict(shard_state="half"), "shard_state='half': use None .*, True or False, or 'full'"),
    (dict(shard_state=1), "shard_state=1: use None"),
    (dict(data_parallel="yes"), "data_parallel='yes': use None"),
    (dict(min_size=-1), "min_size=-1"),
    (dict(passes=()), r"passes=\(\): give a tuple of pass names"),
    (dict(passes=[]), r"passes=\[\]: give a tuple of pass names"),
    (dict(passes=3), "passes=3: give a tuple"),
    (dict(optimizer_kwargs=[("lr", 1)]), "optimizer_kwargs="),
    (dict(loss_fn="mse"), "loss_fn='mse' is not callable"),
    (dict(hardware=3), "hardware=3: give a Hardware"),
    (dict(offload_dir=3), "offload_dir=3"),
    (dict(balance="fast"), "balance='fast'"),
    (dict(read_depth=0), "read_depth=0"),
    (dict(keep_free=-1), "keep_free=-1"),
    (dict(direct_io="yes"), "direct_io='yes'"),
    (dict(comm_timeout=float("nan")), "comm_timeout=nan"),
    (dict(memory_budgt="1GiB"), "unknown option memory_budgt=; did you mean memory_budget="),
    (dict(config={"memory_budget": "1GiB"}), "config=.*give a harmony.Config"),
])
def test_bad_arguments_name_themselves(kw, match):
    with pytest.raises(ConfigError, match=match):
        compile_mlp(**kw)


def test_empty_example_batch_is_an_input_error():
    model, _ = mlp()
    with pytest.raises(InputError, match="example_batch has 0 rows"):
        harmony.compile(model, (torch.randn(0, 8), torch.randn(0, 1)), loss_fn=torch.nn.functional.mse_loss)


def test_a_bare_pass_name_is_one_pass():
    sm = compile_mlp(passes="partition")
    assert [name for name, _ in sm.history] == ["partition"]
    assert sm.program.config.passes == ("partition",)


def test_config_object_and_keywords_are_one_way():
    """config= gives every field at once; keywords beside it replace fields; the plan is the same either way."""
    cfg = harmony.Config(memory_budget="64MiB", microbatches=4, loss_fn=torch.nn.functional.mse_loss)
    a = compile_mlp(memory_budget="64MiB", microbatches=4)
    b = harmony.compile(*mlp(), config=cfg)
    c = harmony.compile(*mlp(), config=cfg, microbatches=2)
    assert a.code == b.code
    assert b.program.config.memory_budget == 64 << 20 and b.program.config.microbatches == 4
    assert c.program.config.microbatches == 2 and cfg.microbatches == 4
    assert isinstance(b.program.config, harmony.Config)     # program.config is the same options, resolved


def test_groups_check_their_fields_on_their_own():
    assert harmony.MemoryConfig(memory_budget="1KiB").memory_budget == 1024
    with pytest.raises(ConfigError, match="memory_budget=nan must be a positive, finite number of bytes"):
        harmony.MemoryConfig(memory_budget=float("nan"))
    assert harmony.DiskConfig(disk_group_bytes="1MiB").disk_group_bytes == 1 << 20
    with pytest.raises(ConfigError, match="loss_scaling is for precision='fp16'"):
        harmony.NumericsConfig(loss_scaling={"init_scale": 8.0})
    assert harmony.NumericsConfig(precision="fp16", loss_scaling={"init_scale": 8.0}).scaling()["init_scale"] == 8.0


@pytest.mark.parametrize("variable, field, raw, value", [
    ("HARMONY_READ_DEPTH", "read_depth", "2", 2),
    ("HARMONY_KEEP_FREE", "keep_free", "4096", 4096),
    ("HARMONY_DIRECT_IO", "direct_io", "0", False),
    ("HARMONY_DIRECT_IO", "direct_io", "1", None),
    ("HARMONY_COMM_TIMEOUT", "comm_timeout", "12.5", 12.5),
    ("HARMONY_CACHE_DIR", "cache_dir", "/tmp/x", "/tmp/x"),
])
def test_environment_variables_are_field_defaults(monkeypatch, variable, field, raw, value):
    monkeypatch.setenv(variable, raw)
    assert getattr(harmony.Config(), field) == value
    explicit = {"read_depth": 7, "keep_free": 0, "direct_io": True, "comm_timeout": 1.0, "cache_dir": "/c"}[field]
    assert getattr(harmony.Config(**{field: explicit}), field) == explicit     # the field given wins


@pytest.mark.parametrize("variable, raw", [
    ("HARMONY_READ_DEPTH", "four"), ("HARMONY_READ_DEPTH", "0"), ("HARMONY_KEEP_FREE", "-3"),
    ("HARMONY_KEEP_FREE", "lots"), ("HARMONY_DIRECT_IO", "maybe"), ("HARMONY_COMM_TIMEOUT", "-1"),
    ("HARMONY_COMM_TIMEOUT", "inf"),
])
def test_bad_environment_variables_are_named(monkeypatch, variable, raw):
    monkeypatch.setenv(variable, raw)
    with pytest.raises(ConfigError, match=f"{variable}={raw!r}"):
        compile_mlp()


def test_disk_store_takes_its_settings_from_the_config_or_the_environment(monkeypatch, tmp_path):
    from harmony.runtime.tiers.disk import DiskStore
    monkeypatch.setenv("HARMONY_READ_DEPTH", "3")
    with DiskStore(tmp_path) as store:
        assert store.read_depth == 3
    with DiskStore(tmp_path, **harmony.DiskConfig(read_depth=1, keep_free=0, direct_io=False).disk_io()) as store:
        assert store.read_depth == 1 and store.buffers.keep == 0 and not store.direct


def test_no_variable_is_read_at_import():
    """The HARMONY_* variables are read in base/env.py alone, when an object that needs one is made."""
    root = Path(harmony.__file__).resolve().parent.parent
    readers = [p.relative_to(root) for folder in ("harmony", "base", "compiler", "passes", "runtime", "viz")
               for p in (root / folder).rglob("*.py") if "os.environ" in p.read_text() and "HARMONY_" in
               "".join(line for line in p.read_text().splitlines() if "os.environ" in line)]
    assert [str(p) for p in readers] == [], readers


def test_every_field_has_a_docstring():
    from harmony.compiler import loss_weighting      # LossConfig lives with its feature
    source = inspect.getsource(config_module) + inspect.getsource(loss_weighting)
    groups = {c.name: c for c in ast.parse(source).body if isinstance(c, ast.ClassDef) and c.name.endswith("Config")
              and c.name not in ("Config", "CompileConfig")}
    assert set(groups) == {"TrainConfig", "MemoryConfig", "DiskConfig", "ParallelConfig", "NumericsConfig",
                           "PlanConfig", "LossConfig"}
    for name, cls in groups.items():
        body = cls.body
        for i, node in enumerate(body):
            if isinstance(node, ast.AnnAssign):
                doc = body[i + 1] if i + 1 < len(body) else None
                assert isinstance(doc, ast.Expr) and isinstance(doc.value, ast.Constant), \
                    f"{name}.{node.target.id} has no docstring"
    fields = {f.name for f in harmony.Config.__dataclass_fields__.values()}
    keywords = {"optimizer", "optimizer_kwargs", "memory_budget", "microbatches", "policy", "loss_fn", "leaf_modules",
                "passes", "device", "hardware", "optimizer_on", "host_memory_budget", "offload_dir", "weights_on",
                "disk_group_bytes", "data_parallel", "compression", "min_size", "precision", "loss_scaling",
                "balance", "shard_state", "recompute"}       # compile's keywords before the groups came in
    variables = {"comm_timeout", "cache_dir", "direct_io", "read_depth", "keep_free"}
    added = {"param_groups",       # fields that came after the groups: sm.optimizer's param groups, clipping
             "clip_grad_norm", "clip_norm_type", "parallel", "placement", "pipeline_group",   # and the pipeline's
             "init",     # how a model built under empty_weights is filled
             "accounting",     # the runtime's meter: each op's allocations, or (CUDA) the caching allocator's
             "loss_weighting",     # the microbatches' losses: the whole batch's token mean, or by rows
             "shape_plans",     # batches up to the example's run its plan, or a plan per shape
             "pipeline_size",   # parallel=("pipeline", "data"): the ranks of one pipeline
             "plan_margin"}     # budget left unplanned for the cost model's misses (learned, or the user's)
    assert fields == keywords | variables | added
