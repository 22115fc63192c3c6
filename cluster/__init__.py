"""Cluster integration (imported as ``resume.cluster``): Slurm, the 640-node layout, simulation.

Nothing here yet; the core (``resume``) never reads ``SLURM_*``: this package
passes cluster facts in.
"""

__all__: list[str] = []
