"""The sampler's own errors, torch-free: the driver catches them by type when a sampler's call
raises one (they cross processes as themselves, `asyncrl.errors.remote_error_class`) without
importing the backends."""

from __future__ import annotations

from asyncrl.errors import AsyncrlError


class SamplerError(AsyncrlError):
    """Base class of the sampler's own errors."""


class SamplerClosedError(SamplerError):
    """``generate`` on a backend that was closed."""


class WeightsUnreadableError(SamplerError):
    """``--run.check_weights``: the weights this sampler generates with cannot be read as they were
    sent (vLLM on the CPU repacks them; a vLLM loader that transforms them), so there is no digest
    of them; the message says why. Not the sampler's failure, and a restart would not change it: the
    driver stops the run at its first weight check, naming the fix."""


class SamplerTimeoutError(SamplerError, TimeoutError):
    """A pause, a resume or a weight sync did not happen within its deadline; the message says which."""
