"""GEARS perturbation-response models: fast data layer, model, and one training engine."""

from gears.compat.api import GEARS
from gears.data.pertdata import PertData

__all__ = ["GEARS", "PertData"]
