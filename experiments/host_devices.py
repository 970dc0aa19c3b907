"""Forcing CPU host devices for a study that needs several (imports nothing that starts JAX)."""

from __future__ import annotations

import os

DEVICE_COUNT_FLAG = "--xla_force_host_platform_device_count"


def force_host_devices(n: int) -> None:
    """Adds ``--xla_force_host_platform_device_count=n`` to ``XLA_FLAGS`` unless it already names
    a device count, keeping the other flags. Call it before JAX starts: JAX reads the variable
    once, when its backend starts."""
    flags = os.environ.get("XLA_FLAGS", "").split()
    if not any(f.startswith(DEVICE_COUNT_FLAG) for f in flags):
        os.environ["XLA_FLAGS"] = " ".join([*flags, f"{DEVICE_COUNT_FLAG}={n}"])
