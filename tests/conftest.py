import atexit
import os
import shutil
import sys
import tempfile
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))

# Plans must not depend on the machine profile a user or a benchmark cached (Hardware.profile saves one for
# Hardware.this_machine(), which compile and the balance tests plan with): with one measured on this machine,
# the balanced replicated and partitioned runs of test_zero3_uneven planned different packs, so their 4-bit
# all-reduces drew their stochastic rounding in different groups and the bitwise checks failed. Every test, and
# every rank it spawns, gets an empty cache of its own instead.
_cache = tempfile.mkdtemp(prefix="harmony-test-cache-")
os.environ["HARMONY_CACHE_DIR"] = _cache
atexit.register(shutil.rmtree, _cache, ignore_errors=True)

# Under pytest-xdist (the README's `-n 2`) each worker's OpenMP team shares the cores with the other worker's
# and with the processes they start: a team waiting at a barrier for a member another process descheduled
# stalls every small op, so each worker, and what it starts, takes its share of the cores (the commit that
# made this has the figures).
_workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
if _workers > 1:
    import torch

    from harmony.compiler.hardware.machine import cores
    _share = max(1, cores() // _workers)
    torch.set_num_threads(_share)
    os.environ["OMP_NUM_THREADS"] = str(_share)      # and the processes a test starts (ranks, scripts, probes)


# The modules that take longest here, first: under xdist (``--dist loadscope --no-loadscope-reorder``) a
# worker takes a whole module and the next in this order when it is done, so starting the long ones
# leaves short ones to even out the end. A stale list costs only time.
LONGEST_FIRST = ("test_zoo", "test_zero3_more", "test_examples", "test_data_parallel", "test_architectures",
                 "test_pipeline", "test_numerics", "test_zero3_disk", "test_passes", "test_reshard",
                 "test_zero3_uneven", "test_materialize", "test_shapes", "test_faults", "test_memory",
                 "test_zero3_carry", "test_docs")


def pytest_collection_modifyitems(config, items):
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    # a stable sort: each module keeps its own order
    items.sort(key=lambda item: rank.get(getattr(item.module, "__name__", ""), len(rank)))


@pytest.fixture(autouse=True)
def _no_learned_plan_margins():
    """Plan misses one test's steps taught (driver/misses.py) do not change the plans of the next."""
    from harmony.driver import misses
    misses.forget()
    yield
    misses.forget()
