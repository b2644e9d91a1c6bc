"""``remat.policies``: which operations of a recomputed block keep their outputs.

The public home of :mod:`remat.manual.policies` (see there): ``from remat.policies import
save_matmuls`` and ``remat.policies.save_matmuls`` name the same objects.
"""

from remat.manual.policies import (
    Decision,
    OpCall,
    Policy,
    PolicyLike,
    as_policy,
    both,
    either,
    offload_names,
    offload_ops,
    recompute_ops,
    save_all,
    save_collectives,
    save_matmuls,
    save_names,
    save_nothing,
    save_ops,
)

__all__ = [
    "Decision",
    "OpCall",
    "Policy",
    "PolicyLike",
    "as_policy",
    "both",
    "either",
    "offload_names",
    "offload_ops",
    "recompute_ops",
    "save_all",
    "save_collectives",
    "save_matmuls",
    "save_names",
    "save_nothing",
    "save_ops",
]
