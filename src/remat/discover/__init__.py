"""Discovery: the chain of stages in a model's forward, and the interception of their calls."""

from remat.discover.chain import Chain, discover_chain, sequential_chain
from remat.discover.intercept import call_original, call_stage, intercept_stages

__all__ = [
    "Chain",
    "call_original",
    "call_stage",
    "discover_chain",
    "intercept_stages",
    "sequential_chain",
]
