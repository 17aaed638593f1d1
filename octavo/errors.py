"""Error types. Every error a user can cause is an OctavoError with a one-line message."""


class OctavoError(Exception):
    """Base class for errors caused by input (models, artifacts, requests, options)."""


class ModelSourceError(OctavoError):
    """The model source cannot be found or read (missing path, no model in a directory, ...)."""


class UnsupportedArchitectureError(OctavoError):
    """The model's model_type is not in the architecture table."""


class PassError(OctavoError):
    """A compiler pass failed, or a pass that must match found nothing."""


class ArtifactError(OctavoError):
    """An artifact is missing files, has a checksum mismatch, or is of another format version."""


class RequestError(OctavoError):
    """A generation request is invalid (too long, bad sampling parameters, ...)."""


class WorkerFailedError(OctavoError):
    """A rank of a parallel engine died, or a collective timed out: the engine cannot go on.

    The message names the rank(s) and what happened to them. The engine is
    dead afterwards: every later step raises this error again.
    """
