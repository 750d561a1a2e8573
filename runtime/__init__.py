"""The runtime: the op table, executor, memory tiers, collectives and simulator.

Sub-packages by concept: ``ops`` (the op table and the ops' implementations: ``ops.move``, ``ops.compute``,
``ops.update`` (the optimizer step), ``ops.reduce`` (the all-reduce)), ``tiers`` (the state's tiers:
``TieredState``, the device's meter, the disk stores), ``comm`` (collectives, compression, the process group and the
world), ``partitioned`` (ZeRO-3's shares) and ``simulate`` (the simulator, one device and a node). Importing it
registers every schedule op in the table (``runtime.ops.OPS``): those that move values, compute, step and
all-reduce, the data-parallel state synchronisation (``shard``), the partitioned state's gather and reduce-scatter
(``partitioned``), the pipeline's send and recv (``pipeline``).
"""
# imported for their register calls; bound to no name here (``from harmony.runtime.ops import comm`` would hide the
# comm sub-package behind the op module's name)
import harmony.runtime.ops.compute  # noqa: F401
import harmony.runtime.ops.move  # noqa: F401
import harmony.runtime.ops.reduce  # noqa: F401
import harmony.runtime.ops.update  # noqa: F401
import harmony.runtime.partitioned  # noqa: F401
import harmony.runtime.pipeline  # noqa: F401
import harmony.runtime.shard  # noqa: F401
