"""Models: building them (:mod:`~trakcli.models.build`: ``model.entrypoint`` -> ``nn.Module``), their
checkpoints (:mod:`~trakcli.models.checkpoints`), the forward pass (:mod:`~trakcli.models.forward`), and
Hugging Face models, Hub names and PEFT adapters (:mod:`~trakcli.models.hf`, :mod:`~trakcli.models.hub`,
:mod:`~trakcli.models.peft`).
"""

from trakcli.models.build import build_model
from trakcli.models.checkpoints import file_sha256, load_checkpoint

__all__ = ["build_model", "file_sha256", "load_checkpoint"]
