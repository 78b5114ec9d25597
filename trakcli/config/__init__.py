"""The YAML config of every trakcli command, validated by pydantic.

A config is a YAML mapping (see ``configs/*.yaml``) plus optional
``key=value`` overrides given after the config path on the command line::

    trak featurize run.yaml projector.proj_dim=512 data.batch_size=64

Override values are parsed as YAML (``512`` is an int, ``[a, b]`` a list).
Every problem (unknown keys, with a did-you-mean; wrong types; missing
files) is collected and raised at once as one :class:`~trakcli.errors.ConfigError`
whose lines each start with the dotted key concerned.

Relative paths in the config are relative to the current working directory.
"""

from __future__ import annotations

from trakcli.config.load import load_config, parse_overrides, validate_section
from trakcli.config.recipe import (
    RUN_ONLY_KEYS,
    OptimizeConfig,
    recipe_identity,
)
from trakcli.config.schema import (
    BUILTIN_DATASETS,
    KRONECKER_OPTIONS,
    Config,
    CurvatureConfig,
    DataConfig,
    DatasetConfig,
    EvalConfig,
    ModelConfig,
    ProjectorConfig,
    ScoreConfig,
    SecondMomentConfig,
    StoreConfig,
    SweepConfig,
)

__all__ = [
    "BUILTIN_DATASETS",
    "KRONECKER_OPTIONS",
    "RUN_ONLY_KEYS",
    "Config",
    "DataConfig",
    "DatasetConfig",
    "EvalConfig",
    "ModelConfig",
    "OptimizeConfig",
    "ProjectorConfig",
    "ScoreConfig",
    "SecondMomentConfig",
    "CurvatureConfig",
    "StoreConfig",
    "SweepConfig",
    "load_config",
    "parse_overrides",
    "validate_section",
    "recipe_identity",
]

