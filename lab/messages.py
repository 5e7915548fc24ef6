"""What a person reads when something fails: an exception as one paragraph saying what went wrong
and what to do (the app's error boxes, ``lab.ui.guard``), never a traceback."""

from __future__ import annotations

import torch


def explain(exc: BaseException) -> str:
    """A one-paragraph message for the user: what went wrong and what to do."""
    text = str(exc) or type(exc).__name__
    kind = type(exc).__name__
    if isinstance(exc, (torch.OutOfMemoryError, MemoryError)):
        return f"Out of memory ({text}). Select fewer layers, fewer samples or a shorter sequence length."
    if "CUDA is not available" in text or "no CUDA" in text.lower():
        return f"{text}. This machine has no usable GPU: choose device 'auto' or 'cpu'."
    if kind == "FileTooLargeError":
        return f"{text}. Open the checkpoint as a local directory instead of uploading it."
    if kind == "LayerNotFoundError":
        return f"{text}. Pick layers from the table on the Model page."
    if kind == "ActivationsUnavailableError":
        return f"{text}. Untick the activation tensors on the Model page, or open a full model directory."
    if kind == "ModelSourceError":
        return f"{text}. Check the path or id, or choose a built-in sample model."
    if isinstance(exc, ValueError):
        return text
    return f"{kind}: {text}"
