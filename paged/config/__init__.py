"""Engine settings: ``EngineConfig`` (every engine setting, checked at construction) and
``SpeculativeConfig``. Below everything that reads them; imports only ``paged.util``."""

from paged.config.engine_config import EngineConfig
from paged.config.speculative import SpeculativeConfig

__all__ = ["EngineConfig", "SpeculativeConfig"]
