"""The runtime: the op table, executor, memory tiers, collectives and simulator.

Importing it registers every schedule op (``runtime.ops.OPS``), those of the data-parallel state
synchronisation (``runtime.shard``) too.
"""
from harmony.runtime import ops, shard  # noqa: F401  (registration)
