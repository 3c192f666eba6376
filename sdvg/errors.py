"""Error types. Every message names the problem and the fix; ComfyUI shows it as the node's error."""


class SDVGError(Exception):
    """Base class of all errors raised on purpose by the engine."""


class ConfigError(SDVGError, ValueError):
    """An invalid setting: NaN/inf where not allowed, impossible sizes, unknown names, mismatched models."""


class ModelFileError(SDVGError, ValueError):
    """A model file is missing, corrupt, unsafe, or not the kind of model that was asked for."""


class CancelledError(SDVGError):
    """Raised by a cancel callback to stop a run between denoising steps."""


class NonFiniteError(SDVGError):
    """A model produced NaN or inf values (named in the message, with the block and the likely fix)."""


class RunFailed(SDVGError):
    """A generation stopped by a fault in one block. ``result`` holds every block finished before it (``partial``),
    so nothing finished is lost; the message names the block, the stage and what failed."""

    def __init__(self, message: str, result) -> None:
        super().__init__(message)
        self.result = result
