"""Engine settings: ``EngineConfig`` (every engine setting, checked at construction),
``SpeculativeConfig`` and the support matrix (`paged.config.support`: which mechanisms may be
combined). Below everything that reads them; imports only ``paged.util``."""

from paged.config.engine_config import EngineConfig
from paged.config.speculative import SpeculativeConfig

__all__ = ["EngineConfig", "SpeculativeConfig"]
