"""Models: building them, their checkpoints, and the forward pass.

* :mod:`trakcli.models.build`: ``model.entrypoint`` -> ``nn.Module`` (built-in ``mlp``,
  ``"file.py:function"``, ``"package.module:function"``, ``"hf:DIR"``).
* :mod:`trakcli.models.checkpoints`: state dict files, their sha256, loading with checked keys and shapes.
* :mod:`trakcli.models.forward`: logits of a batch (a tensor, or text tensors for a transformers model).
* :mod:`trakcli.models.hf`: Hugging Face ``transformers`` models from local directories.
"""

from trakcli.models.build import BUILTIN_MODELS, build_model, load_function, make_mlp
from trakcli.models.checkpoints import (
    WEIGHT_PATTERNS,
    checkpoint_files,
    describe_mismatch,
    file_sha256,
    load_checkpoint,
    read_state_dict,
)
from trakcli.models.forward import additive_mask, forward, logits_of, model_kwargs
from trakcli.models.hf import build_hf_model, is_causal, is_hf_model, resolve_hf_path

__all__ = [
    "BUILTIN_MODELS",
    "WEIGHT_PATTERNS",
    "additive_mask",
    "build_hf_model",
    "build_model",
    "checkpoint_files",
    "describe_mismatch",
    "file_sha256",
    "forward",
    "is_causal",
    "is_hf_model",
    "load_checkpoint",
    "load_function",
    "logits_of",
    "make_mlp",
    "model_kwargs",
    "read_state_dict",
    "resolve_hf_path",
]
