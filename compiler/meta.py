"""The keys Harmony writes into ``node.meta``: one key per analysis, registered here."""

MODULE_PATH = "harmony.module_path"  # str: dotted path of the user's module that made the node (trace)
COST = "harmony.cost"                # NodeCost: bytes and FLOPs of the node (cost)
STATE = "harmony.state"              # tuple[str, ...]: parameters/buffers the node reads (cost)
PACK = "harmony.pack"                # int: index of the layer pack holding the node (partition)
SCHEDULE = "harmony.op"              # dict: pack/microbatch/bytes of a schedule op (schedule, swap, ...)

ALL = (MODULE_PATH, COST, STATE, PACK, SCHEDULE)
