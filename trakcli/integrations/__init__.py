"""Integrations with other training libraries: checkpoints that trakcli reads, written while they train.

* :class:`TrakCallback` (:mod:`trakcli.integrations.trainer`): a ``transformers.TrainerCallback`` for
  ``transformers.Trainer`` and TRL's ``SFTTrainer`` that writes checkpoints along training, their
  AdamW state and a manifest, in the layout of `trak optimize` (``checkpoints: OUT/manifest.json``).

Importing this package imports transformers (and torch).
"""

from __future__ import annotations

from trakcli.integrations.trainer import TrakCallback

__all__ = ["TrakCallback"]
