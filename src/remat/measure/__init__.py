"""Measurement: a chain profile from one instrumented training step."""

from remat.measure.step import ChainMeasurement, StageMeasurement, measure_chain, preserved_model_state

__all__ = ["ChainMeasurement", "StageMeasurement", "measure_chain", "preserved_model_state"]
