"""Simulate one rank of a W-rank CP job in this process: plan its step with the fake backend and
report what the step would cost it (``cpshard plan``, ``cpshard bench --ops planning``), and
predict each rank's peak memory of a training step (``cpshard plan --memory``)."""

from cpshard.simulation.documents import document_ids, document_lengths
from cpshard.simulation.fake_rank import EchoStore, simulated_rank
from cpshard.simulation.head_shape import HeadShape, shape_from_model
from cpshard.simulation.rank_plan import RankPlan, plan_step, rank_plan, simulate_rank
from cpshard.simulation.step_memory import Predictor, RankMemory
from cpshard.simulation.training_step import StepSpec

__all__ = [
    "document_ids",
    "document_lengths",
    "EchoStore",
    "HeadShape",
    "plan_step",
    "Predictor",
    "rank_plan",
    "RankMemory",
    "RankPlan",
    "shape_from_model",
    "simulate_rank",
    "simulated_rank",
    "StepSpec",
]
