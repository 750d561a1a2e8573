"""Data parallelism: every rank runs every pack on its share of the batch and the gradients are all-reduced.

``DataParallel`` replicates the training state on every rank (the compress pass all-reduces each pack's
gradients right after its backward, compressed as ``compression=`` says); ``balance=`` gives ranks of unequal
speed and memory uneven shares of the batch (driver/modes/balance.py). ``ShardedOptimizer`` (ZeRO-1,
``shard_state=True``) gives each parameter's optimizer state to one owning rank, which steps it and
broadcasts the weights; ``Partitioned`` (ZeRO-3, ``shard_state="full"``) cuts every pack's weights, gradients
and optimizer state into one chunk per rank, gathered when a pack runs (the shard pass, runtime/partitioned/).
"""
from __future__ import annotations

from harmony.base.errors import HarmonyError
from harmony.base.units import nbytes
from harmony.compiler.passmanager import split_choices
from harmony.driver.modes.balance import plan_this_rank
from harmony.driver.modes.base import Mode
from harmony.passes import compress, shard
from harmony.runtime.partitioned import Shares
from harmony.runtime.shard import owners


def shard_state(options):
    """``shard_state`` as a compile resolves it: given, else sharded optimizer state under ``balance=``."""
    return (options.balance is not None) if options.shard_state is None else options.shard_state


class DataParallel(Mode):
    name = "data parallel"

    @classmethod
    def applies(cls, options, world: dict) -> bool:
        return bool(world["data_parallel"]) and options.parallel != "pipeline"

    def check(self, cfg, options) -> None:
        pass

    def ranks_meet(self, cfg, plan) -> bool:
        return (cfg.world_size or 1) > 1

    def plan_rank(self, model, gm, batch, cfg):
        if cfg.balance is None:
            return super().plan_rank(model, gm, batch, cfg)
        # this rank's share of the global batch
        return plan_this_rank(model, gm, batch, cfg.balance, cfg, cfg.hardware, sharded=cfg.shard_state)

    def run_passes(self, program, passes):
        """A rank that fails before the compress pass tells the others, which would wait for it there."""
        names = split_choices(passes)[0]
        try:
            return super().run_passes(program, passes)
        except HarmonyError as e:
            # the pass that failed is the first one not in the history; the others wait in the next pass that
            # checks the ranks' plans (compress, then shard): compress itself has met the others already
            checks = [names.index(p) for p in ("compress", "shard") if p in names]
            # (not where the failure is one a check heard from another rank: every rank met that check already)
            if (program.config.world_size or 1) > 1 and any(i > len(program.history) for i in checks) \
                    and not getattr(e, "harmony_echo", False):
                compress.report_failure(f"{type(e).__name__}: {str(e).splitlines()[0]}")
            raise


class ShardedOptimizer(DataParallel):
    name = "data parallel, optimizer state sharded (ZeRO-1)"

    @classmethod
    def applies(cls, options, world: dict) -> bool:
        return super().applies(options, world) and shard_state(options) is True

    def plan_rank(self, model, gm, batch, cfg):
        balanced = super().plan_rank(model, gm, batch, cfg)
        shares = balanced.shares if balanced else [1.0] * cfg.world_size
        # each parameter's owning rank, from byte shares
        cfg.state_owner = owners([(n, nbytes(p)) for n, p in gm.named_parameters() if p.requires_grad], shares)
        return balanced

    def checkpoint_layout(self, plan) -> str:
        return "zero1" if plan.state_owner else "whole"    # each rank its owned parameters' optimizer state


class Partitioned(DataParallel):
    name = "data parallel, state partitioned (ZeRO-3)"

    @classmethod
    def applies(cls, options, world: dict) -> bool:
        return super().applies(options, world) and shard_state(options) == "full"

    def passes(self, entries) -> tuple:
        entries = tuple(entries)     # the shard pass last, where the compress pass is there to rewrite
        names = split_choices(entries)[0]
        return entries + ("shard",) if "compress" in names and "shard" not in names else entries

    def check(self, cfg, options) -> None:
        shard.check_config(cfg, options.optimizer_kwargs or {})  # what it does not do yet is refused there

    def plan_rank(self, model, gm, batch, cfg):
        balanced = super().plan_rank(model, gm, batch, cfg)
        if balanced is not None:     # the partition's chunks: the plan's uneven shares
            cfg.state_shares = list(balanced.shares)
        return balanced

    def checkpoint_layout(self, plan) -> str:
        return "full" if any(r.shares is not None for r in plan.residency.values()) else "whole"   # its chunks

    def shares(self, plan, tensors: dict, cfg, fill=None):
        if not any(r.shares is not None for r in plan.residency.values()):
            return None
        return Shares(plan, tensors, cfg.comm_timeout, fill=fill, device=cfg.device)   # (pinned chunks on a GPU)
