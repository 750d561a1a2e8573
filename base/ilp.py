"""The solver behind Harmony's integer programs (heterogeneous balance, adaptive bits): HiGHS through PuLP.

PuLP 3.3 deprecates its bundled CBC (``PULP_CBC_CMD``, to be removed in PuLP 4.0) and variables
made apart from their problem; HiGHS (``highspy``, installed by ``pulp[highs]``) is an exact MILP
solver that runs in-process, with no binary to find::

    prob = pulp.LpProblem("p", pulp.LpMinimize)
    x = prob.add_variable("x", 0, 1, cat=pulp.LpBinary)
    ...
    if not ilp.solve(prob, time_limit=10):
        ...   # no solution: say why, with ilp.status(prob)
"""
from __future__ import annotations

import pulp

from harmony.base.errors import ConfigError

_FOUND = (pulp.LpSolutionOptimal, pulp.LpSolutionIntegerFeasible)


def solve(prob: pulp.LpProblem, time_limit: float | None = None) -> bool:
    """Solve ``prob`` with HiGHS; True when it holds a feasible solution (optimal, or the best found in time)."""
    solver = pulp.HiGHS(msg=False, timeLimit=time_limit)
    if not solver.available():
        raise ConfigError("Harmony's integer programs need the HiGHS solver, which is not installed: "
                          "pip install 'pulp[highs]' (or highspy)")
    prob.solve(solver)          # a time limit hit before any solution leaves status Not Solved
    return prob.status == pulp.LpStatusOptimal and prob.sol_status in _FOUND


def status(prob: pulp.LpProblem) -> str:
    """The solver's verdict, in words: 'Optimal', 'Infeasible', 'Not Solved', ..."""
    return pulp.LpStatus[prob.status] if prob.sol_status != pulp.LpSolutionIntegerFeasible else \
        "a feasible solution, not proven optimal (time limit)"
