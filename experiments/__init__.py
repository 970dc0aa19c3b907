"""Experiment scripts (absl entry points, one per study) and their shared helpers."""

import logging

# JAX logs at INFO that it found no TPU on every CPU/GPU machine; keep study output readable.
logging.getLogger("jax._src.xla_bridge").setLevel(logging.WARNING)
