"""Errors raised by ALOE. Every message names what was checked and what was expected."""


class AloeError(Exception):
    """Base class of every error ALOE raises on purpose."""


class ArtifactError(AloeError, ValueError):
    """An operator artifact (or an operator built in memory) is invalid."""


class PatchError(AloeError, ValueError):
    """An operator cannot be applied to (or removed from) a model."""
