"""The YAML config of every trakcli command, validated by pydantic: a YAML mapping plus ``key=value`` overrides
(parsed as YAML: ``trak featurize run.yaml projector.proj_dim=512``). Every problem is raised at once as one
:class:`~trakcli.errors.ConfigError`, each line starting with the dotted key. Relative paths are relative to the
working directory.
"""

from __future__ import annotations

from trakcli.config.load import load_config, parse_overrides, validate_section
from trakcli.config.recipe import RUN_ONLY_KEYS, OptimizeConfig, recipe_identity
from trakcli.config.schema import (
    KRONECKER_OPTIONS, Config, CurvatureConfig, DataConfig, DatasetConfig, EvalConfig, ModelConfig, ProjectorConfig,
    ScoreConfig, SecondMomentConfig, StoreConfig, SweepConfig,
)

__all__ = [
    "KRONECKER_OPTIONS", "RUN_ONLY_KEYS", "Config", "DataConfig", "DatasetConfig", "EvalConfig", "ModelConfig",
    "OptimizeConfig", "ProjectorConfig", "ScoreConfig", "SecondMomentConfig", "CurvatureConfig", "StoreConfig",
    "SweepConfig", "load_config", "parse_overrides", "validate_section", "recipe_identity",
]
