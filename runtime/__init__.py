"""The runtime: the op table, executor, memory tiers, collectives and simulator.

Importing it registers every schedule op in the table (``runtime.ops.OPS``): those that move values
(``ops_move``), those that compute (``ops_compute``, and the optimizer's ``ops_step``), the gradient all-reduce
(``ops_comm``) and the data-parallel state synchronisation (``shard``), the partitioned state's gather and
reduce-scatter (``partitioned``), the pipeline's send and recv (``pipeline``).
"""
from harmony.runtime import ops, ops_comm, ops_compute, ops_move, ops_step, partitioned, pipeline, shard  # noqa: F401
