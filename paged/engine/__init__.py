"""The engine: ``Engine`` (requests in, tokens out, one replica or a data-parallel fleet), the
device step, placement on devices, warmup, speculative decoding and multi-host runs."""

from paged.engine.engine import Engine, RequestOutput

__all__ = ["Engine", "RequestOutput"]
