"""Auto-parallelism planner and advisor for PyTorch training.

Three stages with one typed output each: ``model.py`` -> ModelHandle -> ModelProfile (profile/),
ModelProfile + Cluster -> Plan (search/), Plan -> RunReport (runtime/).
"""

__version__ = "0.1.0"
