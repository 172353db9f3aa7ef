"""Sharding rules keyed by ATen op, one module per op family (see ``registry``)."""

from autopar.passes.strategies.registry import (
    OpInfo,
    Rule,
    Strategy,
    node_strategies,
    register,
    registered_ops,
)

__all__ = ["OpInfo", "Rule", "Strategy", "node_strategies", "register", "registered_ops"]
