"""Where training state lives between uses: ``TieredState`` (state.py) moves weights, gradients and optimizer
state between the device, the host and the disk on copy engines; ``MemoryMeter`` (memory.py) counts every device
byte against the budget; the disk tier is a store of aligned files read and written by a thread pool (disk.py,
its I/O buffers in iobuffers.py, its private directories in dirs.py), holding a pack's optimizer state
(optim_disk.py) or its weights too (params_disk.py, grouped into files by params_groups.py).
"""
