"""Measurement: a chain profile from one instrumented training step.

* :mod:`remat.measure.step` runs the tracked and the timing steps (:func:`measure_chain`);
* :mod:`remat.measure.instrument` is what those steps install on the stages;
* :mod:`remat.measure.assemble` turns what they saw into the grouped profile.
"""

from remat.measure.assemble import ChainMeasurement
from remat.measure.instrument import StageMeasurement
from remat.measure.isolation import isolated_inputs, preserved_model_state
from remat.measure.step import measure_chain

__all__ = ["ChainMeasurement", "StageMeasurement", "isolated_inputs", "measure_chain", "preserved_model_state"]
