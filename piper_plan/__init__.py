"""piper: capacity planner, auto-configurator and launcher for MoE training on HPC machines."""

__version__ = "0.1.0"
