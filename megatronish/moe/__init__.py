"""Mixture of experts: routing (router), token dispatch over the ep group (dispatch), grouped
expert FFNs (experts), the layer (layer), its step metrics (stats), the routing biases'
balancing (balance) and routing replay (replay)."""

from megatronish.moe.balance import Balancer
from megatronish.moe.experts import is_expert
from megatronish.moe.layer import MoELayer
from megatronish.moe.stats import step_metrics

__all__ = ["Balancer", "MoELayer", "is_expert", "step_metrics"]
