"""Integrations with other training libraries: checkpoints that trakcli reads, written while they train.

* :class:`TrakCallback` (:mod:`trakcli.integrations.trainer`): a ``transformers.TrainerCallback`` for
  ``transformers.Trainer`` and TRL's ``SFTTrainer`` that writes checkpoints along training, their
  AdamW state and a manifest, in the layout of `trak optimize` (``checkpoints: OUT/manifest.json``).

Imported on first use: ``import trakcli.integrations`` imports neither torch nor transformers.
"""

from __future__ import annotations

from trakcli.lazy import lazy_getattr

__all__ = ["TrakCallback"]

__getattr__ = lazy_getattr(__name__, {"TrakCallback": "trakcli.integrations.trainer"}, globals())


def __dir__() -> list[str]:
    return sorted([*globals(), *__all__])
