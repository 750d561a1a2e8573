"""Tier: the one enum naming where state lives; a config's tier strings become members, and nothing printed changes."""
import json

import torch

import harmony
from harmony.base.tiers import Tier
from harmony.viz.report import summary


def test_config_tier_strings_become_members_and_the_rest_stay():
    cfg = harmony.Config(optimizer_on="host", weights_on="disk", recompute="device")
    assert cfg.optimizer_on is Tier.HOST and cfg.weights_on is Tier.DISK and cfg.recompute is Tier.DEVICE
    auto = harmony.Config()
    assert type(auto.optimizer_on) is str and auto.optimizer_on == "auto" and auto.recompute == "auto"
    assert harmony.Config(recompute="always").recompute == "always"
    assert cfg.optimizer_on == "host" and f"{cfg.optimizer_on}" == "host" and repr(cfg.weights_on) == "'disk'"


def test_schedule_report_and_json_keep_the_plain_names():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))
    x, y = torch.randn(8, 8), torch.randn(8, 1)
    sm = harmony.compile(model, (x, y), loss_fn=torch.nn.functional.mse_loss, optimizer_on="host", microbatches=2)
    try:
        assert sm.program.config.optimizer_on is Tier.HOST
        assert set(sm.plan.by_pack("step_on").values()) == {Tier.HOST}
        # fx would print an enum argument as Tier.HOST: the schedule holds the plain name
        assert "where = 'host'" in sm.code and "Tier" not in sm.code
        offload = next(r for r in sm.program.reports if r.title.startswith("offload"))
        assert json.loads(json.dumps(offload.totals))["step_on"] == "host"
        assert {row["weights"] for row in json.loads(json.dumps(offload.rows))} == {"host"}
        tiers = json.loads(sm.report("json"))["tiers"]
        assert tiers == json.loads(json.dumps(summary(sm)["tiers"]))
        assert "step_on host" in sm.report() and "Tier." not in sm.report()
    finally:
        sm.close()
