"""Error types. Every message names the problem and the fix; ComfyUI shows it as the node's error."""


class SDVGError(Exception):
    """Base class of all errors raised on purpose by the engine."""


class ConfigError(SDVGError, ValueError):
    """An invalid setting: NaN/inf where not allowed, impossible sizes, unknown names, mismatched models."""


class ModelFileError(SDVGError, ValueError):
    """A model file is missing, corrupt, unsafe, or not the kind of model that was asked for."""


class CancelledError(SDVGError):
    """Raised by a cancel callback to stop a run between denoising steps."""
