"""The exceptions Harmony raises, for ``except harmony.errors.BudgetError:`` (defined in ``harmony.base.errors``)."""
from harmony.base.errors import *  # noqa: F401,F403
from harmony.base.errors import __all__  # noqa: F401
