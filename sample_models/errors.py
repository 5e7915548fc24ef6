"""Errors raised by the model side.

All are ValueError subclasses so that a UI can catch one family of errors for anything the user
typed or uploaded, and every message names the file, directory or layer at fault.
"""


class ModelSourceError(ValueError):
    """A model source (name, directory, file or hub id) cannot be opened or read."""


class HubUnreachableError(ModelSourceError):
    """A well-formed hub id whose files are neither reachable (offline, no connection) nor in the
    local hub cache. Its own class because the fix differs from a mistyped id: download elsewhere."""


class FileTooLargeError(ModelSourceError):
    """A single-file load is larger than the caller's ``max_file_bytes`` limit."""


class LayerNotFoundError(ValueError):
    """A layer or attention-block name does not exist in the opened model."""


class ActivationsUnavailableError(ValueError):
    """Activations were asked of a source that has weights only (a bare weights file, an architecture
    transformers does not know, no usable tokenizer); the message is the model's ``weights_only_reason``."""


class SequentialUnsupportedError(ValueError):
    """Sequential (block-by-block) calibration cannot run on this model: its blocks cannot be found,
    or its checkpoint names tensors differently from the modules that would hold them."""
