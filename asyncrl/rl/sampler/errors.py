"""The sampler's own errors, torch-free: the driver catches them by type when a sampler's call
raises one (they cross processes as themselves, `asyncrl.errors.remote_error_class`) without
importing the backends."""

from __future__ import annotations

from asyncrl.errors import AsyncrlError


class SamplerError(AsyncrlError):
    """Base class of the sampler's own errors."""


class SamplerClosedError(SamplerError):
    """``generate`` on a backend that was closed."""


class SamplerTimeoutError(SamplerError, TimeoutError):
    """A pause, a resume or a weight sync did not happen within its deadline; the message says which."""
