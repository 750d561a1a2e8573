"""Between ranks: the collectives (a compressed, bucketed all-reduce and reduce-scatter over gloo or NCCL), the
codecs and CGX's layer-wise adaptive bits, the per-pack communicator the allreduce op drives, and the world a
plan runs in (the process group from torchrun's environment, and the check that a plan runs on its world size).
"""
