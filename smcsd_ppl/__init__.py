"""SMC speculative decoding as a probabilistic-programming extension of LLaMPPL."""

from .config import SMCConfig
from .generate import SMCSD
from .inference.engine import BlockEngine
from .inference.program import SMCSDModel
from .inference.smc import SMCResult, run_smc_sd, smc_sd
from .models import LoadedModel, load_model
from .results import Generation, RunStats

__all__ = [
    "SMCConfig",
    "SMCSD",
    "Generation",
    "RunStats",
    "BlockEngine",
    "SMCSDModel",
    "SMCResult",
    "smc_sd",
    "run_smc_sd",
    "LoadedModel",
    "load_model",
]
