#!/usr/bin/env bash
# Set up .venv and run trakcli on the bundled digits data: train 10 MLP checkpoints,
# featurize the 1437 training examples, score the 360 targets, show proponents/opponents.
# Extra arguments are config overrides, e.g.  ./scripts/quickstart.sh projector.proj_dim=512
set -euo pipefail
source "$(dirname "$0")/_env.sh" ""
CONFIG=configs/digits.yaml
trak optimize  "$CONFIG" "$@"
trak featurize "$CONFIG" "$@"
trak score     "$CONFIG" "$@" --out runs/digits/scores.npy
