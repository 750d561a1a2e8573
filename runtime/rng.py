"""Each microbatch of a step draws its random numbers from a stream of its own, so dropout does not depend on the plan.

A schedule runs a pack for several microbatches before the next pack, and where the packs begin and end moves with
the budget (and the device, and recompute). Drawing every forward's random numbers from the one global generator
would make each dropout mask depend on that interleaving: the same seed would train another model at another
budget, and a run resumed under another budget or on another card would follow another trajectory.

So a step gives every microbatch a generator state of its own (``MicrobatchStreams``), and a pack's forward of
microbatch ``m`` continues ``m``'s stream where the previous pack's left it. Microbatch 0 continues the global
generator, as eager PyTorch would; microbatch ``m > 0`` starts from a state seeded by a number drawn from a copy of
the step's starting state. What a step draws then depends on the seed, the model and the number of microbatches
only: with one microbatch it is eager's; with several, it is the eager loop's that starts each microbatch from
``microbatch_states`` (tests/test_rng.py). After the step the global generator continues from microbatch 0's
stream; a step that fails leaves it where the step found it (runtime/transaction.py), as if it had not run.
"""
from __future__ import annotations

import torch

# microbatch m > 0 is seeded with base + m * _STRIDE (mod 2**63): streams far apart in seed space
_STRIDE = 0x9E3779B97F4A7C15


def rng_state(device: torch.device) -> tuple:
    """The generators a pack's random ops draw from: the CPU's, and on a GPU the GPU's (dropout there uses it)."""
    return (torch.get_rng_state(), torch.cuda.get_rng_state(device) if device.type == "cuda" else None)


def set_rng_state(device: torch.device, state: tuple) -> None:
    torch.set_rng_state(state[0])
    if state[1] is not None:
        torch.cuda.set_rng_state(state[1], device)


def microbatch_states(microbatches: int, device: torch.device | str = "cpu", start: tuple | None = None) -> list:
    """The generator states a step's microbatches start from, given the state it starts in (default: the current
    one). Changes no generator. For an eager reference: set ``microbatch_states(k)[m]`` (``set_rng_state``) before
    microbatch ``m``'s forward, then microbatch 0's end state after the last, and the masks are the step's."""
    device = torch.device(device)
    start = rng_state(device) if start is None else start
    if microbatches == 1:
        return [start]
    g = torch.Generator()
    g.set_state(start[0])
    base = int(torch.randint(0, 2**62, (1,), generator=g))
    states = [start]
    for m in range(1, microbatches):
        seed = (base + m * _STRIDE) % 2**63
        cpu = torch.Generator().manual_seed(seed).get_state()
        gpu = torch.Generator(device=device).manual_seed(seed).get_state() if start[1] is not None else None
        states.append((cpu, gpu))
    return states


class MicrobatchStreams:
    """One step's per-microbatch generator states; ``draw(m)`` wraps a forward of microbatch ``m``."""

    def __init__(self, device: torch.device, microbatches: int):
        self.device = device
        self.start = rng_state(device)
        self.states = microbatch_states(microbatches, device, self.start)

    def enter(self, mb: int) -> None:
        """Before a random pack's forward of ``mb``: the global generators continue ``mb``'s stream."""
        set_rng_state(self.device, self.states[mb])

    def leave(self, mb: int) -> None:
        """After it: ``mb``'s stream is where the forward left the generators."""
        self.states[mb] = rng_state(self.device)

    def finish(self) -> None:
        """The step is over: the global generators continue microbatch 0's stream (eager's, with one microbatch)."""
        set_rng_state(self.device, self.states[0])

    def restore(self) -> None:
        """The step failed: the generators are as the step found them."""
        set_rng_state(self.device, self.start)
