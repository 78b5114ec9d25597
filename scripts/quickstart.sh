#!/usr/bin/env bash
# Set up .venv and run trakcli on the bundled digits data: train 10 MLP checkpoints,
# featurize the 1437 training examples, score the 360 targets, show (and draw) proponents/opponents,
# write the HTML report of all of them, and measure the scores against 100 retrained models (LDS).
# Extra arguments are config overrides, e.g.  ./scripts/quickstart.sh projector.proj_dim=512
set -euo pipefail
source "$(dirname "$0")/_env.sh" ""
CONFIG=configs/digits.yaml
trak optimize  "$CONFIG" "$@"
trak featurize "$CONFIG" "$@"
trak score     "$CONFIG" "$@" --out runs/digits/scores.npy --plot runs/digits/top.png
# every target with its proponents and opponents on one page: open it in a browser (no server needed)
trak report    "$CONFIG" "$@" --out runs/digits/report.html
# how good are the scores? 100 models retrained on random halves (~40 s), their LDS
trak eval lds  "$CONFIG" "$@" --workers 2 --out runs/digits/lds.json
echo "report: file://$(pwd)/runs/digits/report.html" >&2
