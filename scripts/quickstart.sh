#!/usr/bin/env bash
# Set up .venv and run trakcli on the bundled digits data: train 10 MLP checkpoints,
# featurize the 1437 training examples, score the 360 targets, show (and draw) proponents/opponents,
# write the HTML report of all of them, and measure the scores against 100 retrained models (LDS).
# Extra arguments are config overrides, e.g.  ./scripts/quickstart.sh projector.proj_dim=512
# A run with overrides keeps its own store and outputs in runs/digits-<overrides>/ (the checkpoints are
# shared): it neither refuses the first run's store nor overwrites its files.
set -euo pipefail
source "$(dirname "$0")/_env.sh" ""
CONFIG=configs/digits.yaml
OUT=runs/digits
if [ "$#" -gt 0 ]; then
    OUT="runs/digits-$(printf '%s' "$*" | tr -c 'A-Za-z0-9.=-' '_' | cut -c1-80)"
    set -- "$@" "store.path=$OUT/attrib.zarr"
fi
mkdir -p "$OUT"
trak optimize  "$CONFIG" "$@"
trak featurize "$CONFIG" "$@"
trak score     "$CONFIG" "$@" --out "$OUT/scores.npy" --plot "$OUT/top.png"
# every target with its proponents and opponents on one page: open it in a browser (no server needed)
trak report    "$CONFIG" "$@" --out "$OUT/report.html"
# how good are the scores? 100 models retrained on random halves (~40 s), their LDS
trak eval lds  "$CONFIG" "$@" --workers 2 --out "$OUT/lds.json"
echo "report: file://$(pwd)/$OUT/report.html" >&2
