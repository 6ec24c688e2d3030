"""The GEARS networks by model.impl: fast (network.py) and reference (reference.py), one
contract and one state_dict; config.CHOICES["model.impl"] lists the names."""

from gears.model.network import GEARSNet
from gears.model.reference import GEARSReference

NETWORKS = {"fast": GEARSNet, "reference": GEARSReference}
