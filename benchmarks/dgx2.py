"""ZeRO-Infinity's single-node setting, SIMULATED: the largest GPT Harmony can plan on a DGX-2 under
``shard_state="full"``, and its predicted throughput, beside the paper's figures.

Not a measurement: one rank's plan (rank 0 of 16), compiled on the meta device under a fake 16-rank process group
(torch's ``fake`` backend: nothing is sent; the plan's gathers and reduce-scatters are simulated on the network
stream) and simulated on a hardware description. The DGX-2 as the ZeRO-Infinity paper (SC'21, section 8) describes
it: 16 NVIDIA V100 SXM3 32 GB (the ``v100-32gb`` preset's datasheet figures), 1.5 TB of host memory, and NVMe; here
each GPU gets a sixteenth of the host memory (``host_memory_budget``) and of the NVMe bandwidth
(``--nvme-read``/``--nvme-write``, aggregate GB/s over the node's drives), its own PCIe 3 x16 host link, and NVSwitch
between GPUs (``--nvswitch``, GB/s per GPU per direction: six NVLink 2 links of 25 GB/s).

The model grows (``--shapes``, layers x width, in the order given) until the planner refuses it (a
``BudgetError``: a pack's working set or the host's minimum does not fit): the last one planned is the largest.
Width stops at what one V100's 32 GB holds of a layer's working set at microbatch 1; depth then grows the model,
and past the host budget the weights' shares go to disk too. For each: parameters; where the plan put the state
(packs whose weights' share is on disk, packs whose optimizer state's share is); the node's fp32 weights and
optimizer state (``state_TB_node``: the DGX-2's datasheet lists 30 TB of NVMe, 8 x 3.84 TB, and the planner does not
check disk capacity); the seconds the rank's disk and network streams are busy per step; the predicted step; and
model TFLOP/s per GPU (the packs' forward and backward FLOPs over the predicted step; recomputed forwards are work
the step does but not counted).

Differences from the paper's runs, which make this a plan-size and throughput estimate, not a like-for-like figure:
by default Harmony trains in fp32 here (16 bytes of state per parameter with AdamW; ``--precision fp16`` plans the
paper's mixed precision: fp16 device copies on the tensor cores, fp32 masters and AdamW state on the host); it runs
one data-parallel GPT per rank without tensor slicing (ZeRO-Infinity's memory-centric tiling splits a layer that
does not fit; Harmony needs a layer's working set at microbatch 1 to fit a GPU); and the simulator's compute is the
datasheet's peak for the compute dtype times ``--efficiency``.

    python benchmarks/dgx2.py                       # 52B .. 1.6T parameters
    python benchmarks/dgx2.py --shapes 32x4096 32x8192
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import add_json_arg, save_json, table  # noqa: E402

GB, GiB, TB = 1e9, 2**30, 10**12
RANKS = 16
PAPER = ("ZeRO-Infinity (SC'21): a trillion-parameter model fine-tuned on a single DGX-2 node (16 V100 32 GB, "
         "1.5 TB host memory, NVMe); over 25 PFLOP/s on 512 V100s, 40% of their peak (about 49 TFLOP/s per GPU, "
         "fp16 tensor cores)")


def hardware(args):
    from harmony.compiler.hardware import Hardware
    hw = Hardware.preset("v100-32gb", link="pcie3")
    dev = hw.devices[0]
    if args.efficiency != 1.0:
        dev = dev.replace(efficiency=args.efficiency)
    return hw.replace(devices=(dev,), host_memory=int(1.5 * TB / RANKS),
                      disk_read_bandwidth=args.nvme_read * GB / RANKS,
                      disk_write_bandwidth=args.nvme_write * GB / RANKS,
                      network_bandwidth=args.nvswitch * GB, network_latency=10e-6,
                      notes=("a sixteenth of a DGX-2 (ZeRO-Infinity's setting), from datasheet and paper figures",))


def plan(args, layers: int, width: int, hw) -> dict:
    """Compile one rank's plan of a GPT of ``layers`` x ``width`` on the meta device and simulate it."""
    import torch

    import harmony
    from harmony.models import GPT, GPTConfig
    heads = max(1, width // 128)
    c = GPTConfig(layers=layers, width=width, heads=heads, vocab=args.vocab, seq=args.seq, tie=False)
    with torch.device("meta"):
        model = GPT(c)
    params = sum(p.numel() for p in model.parameters())
    x = torch.zeros(args.batch, args.seq, dtype=torch.long, device="meta")
    t0 = time.perf_counter()
    sm = harmony.compile(model, example_batch=(x, x), device="meta", hardware=hw, memory_budget="32GiB",
                         microbatches=args.microbatches, optimizer=torch.optim.AdamW, shard_state="full",
                         host_memory_budget=hw.host_memory, precision=args.precision)
    compile_s = time.perf_counter() - t0
    sim = sm.simulate(hw)
    plan_ = sm.program.plan
    placed = [(r.optim_on, r.master_on) for r in plan_.residency.values()]
    tokens = args.batch * args.seq
    # model FLOPs: each pack's forward and backward per microbatch (the embedding lookup is none; recomputed
    # forwards are work the step does but not counted as useful)
    flops = sum(s.fwd_flops + s.bwd_flops for s in plan_.packs) * plan_.microbatches
    shard = next(r for r in sm.program.reports if r.title.startswith("shard")).totals
    state = shard["master_bytes_this_rank"] + shard["optim_bytes_this_rank"]     # this rank's share, host or disk
    return dict(layers=layers, width=width, params_B=params / 1e9, packs=len(plan_.packs),
                on_disk=sum(m == "disk" for _, m in placed), state_on_disk=sum(o == "disk" for o, _ in placed),
                state_TB_node=RANKS * state / TB, step_s=sim.step_seconds, disk_s=sim.busy.get("disk", 0.0),
                network_s=sim.busy.get("network", 0.0), tflops_per_gpu=flops / sim.step_seconds / 1e12,
                tokens_per_s_node=RANKS * tokens / sim.step_seconds, compile_s=compile_s)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", nargs="+", default=["64x8192", "64x16384", "128x16384", "256x16384", "512x16384"],
                    help="layers x width, tried in order until one is refused")
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--vocab", type=int, default=50304)
    ap.add_argument("--batch", type=int, default=4, help="sequences per GPU per step")
    ap.add_argument("--microbatches", type=int, default=4)
    ap.add_argument("--nvme-read", type=float, default=25.0, help="GB/s, the node's drives together")
    ap.add_argument("--nvme-write", type=float, default=20.0, help="GB/s, the node's drives together")
    ap.add_argument("--nvswitch", type=float, default=150.0, help="GB/s per GPU per direction")
    ap.add_argument("--efficiency", type=float, default=1.0, help="share of the datasheet peak compute reaches")
    ap.add_argument("--precision", default="fp32", choices=["fp32", "fp16"],
                    help="fp16: device copies in fp16 on the tensor cores, fp32 masters and AdamW on the host, as "
                         "ZeRO-Infinity trains")
    add_json_arg(ap)
    args = ap.parse_args()

    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from harmony.errors import BudgetError
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=RANKS)
    hw = hardware(args)
    rows, largest = [], None
    for shape in args.shapes:
        layers, width = (int(v) for v in shape.lower().split("x"))
        try:
            row = plan(args, layers, width, hw)
        except BudgetError as e:
            rows.append(dict(layers=layers, width=width, params_B=None, refused=str(e).split(".")[0][:90]))
            break
        rows.append(row)
        largest = row
    print(f"SIMULATED, not measured: one rank of {RANKS} on {hw.devices[0].name}, "
          f"host budget {hw.host_memory / GiB:.0f} GiB, NVMe {args.nvme_read:g}/{args.nvme_write:g} GB/s per node, "
          f"NVSwitch {args.nvswitch:g} GB/s per GPU, {args.precision} AdamW, {args.batch} x {args.seq} tokens per GPU")
    print(table(rows, "the largest GPT Harmony plans on a DGX-2 under shard_state='full' (simulated)"))
    print(f"paper: {PAPER}")
    figures = {}
    if largest is not None:
        figures = {"largest_params_B": largest["params_B"], "largest_step_s": largest["step_s"],
                   "largest_tflops_per_gpu": largest["tflops_per_gpu"]}
    save_json(args.json, figures)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
