"""Integrations with other training libraries: :class:`TrakCallback` (:mod:`trakcli.integrations.trainer`) writes
checkpoints, their AdamW state and a manifest while ``transformers.Trainer`` or TRL's ``SFTTrainer`` trains.
Importing this package imports transformers (and torch).
"""

from __future__ import annotations

from trakcli.integrations.trainer import TrakCallback

__all__ = ["TrakCallback"]
