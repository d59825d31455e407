"""Tier chains: several stores as one, fastest first, with budgets and movers.
"""

from __future__ import annotations

from tensorstore_hooks.storage.chain._chain import TierChain, check_budgets, check_chain_options
from tensorstore_hooks.storage.chain._stats import ChainStats, TierStats

__all__ = [
    "ChainStats",
    "TierChain",
    "TierStats",
    "check_budgets",
    "check_chain_options",
]
