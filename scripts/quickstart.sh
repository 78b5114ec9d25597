#!/usr/bin/env bash
# Set up .venv and run trakcli on the bundled digits data: train 10 MLP checkpoints,
# featurize the 1437 training examples, score the 360 targets, show (and draw) proponents/opponents,
# write the HTML report of all of them, and measure the scores against 100 retrained models (LDS).
# Extra arguments are config overrides, e.g.  ./scripts/quickstart.sh projector.proj_dim=512
# A run with overrides keeps its store and outputs in runs/digits-<overrides>/: it neither refuses the
# first run's store nor overwrites its files. The checkpoints of runs/digits/ckpts are shared unless an
# override changes the training (optimize.*, model.*, task, data.train, data.validation): then that run
# trains its own in runs/digits-<overrides>/ckpts. `trak optimize` gets only those overrides (and
# device, num_threads); featurize, score, report and eval get them all.
set -euo pipefail
source "$(dirname "$0")/_env.sh" ""
CONFIG=configs/digits.yaml
OUT=runs/digits
TRAIN_ARGS=()
if [ "$#" -gt 0 ]; then
    OUT="runs/digits-$(printf '%s' "$*" | tr -c 'A-Za-z0-9.=-' '_' | cut -c1-80)"
    OWN=("store.path=$OUT/attrib.zarr")
    for arg in "$@"; do
        case "${arg%%=*}" in
            optimize.*|model|model.*|task|data.train|data.train.*|data.validation|data.validation.*)
                TRAIN_ARGS+=("$arg")
                OWN_CKPTS=1 ;;
            device|num_threads)
                TRAIN_ARGS+=("$arg") ;;
        esac
    done
    if [ -n "${OWN_CKPTS:-}" ]; then
        OWN+=("optimize.out_dir=$OUT/ckpts" "checkpoints=$OUT/ckpts/manifest.json")
        TRAIN_ARGS=("optimize.out_dir=$OUT/ckpts" "${TRAIN_ARGS[@]}")
    fi
    # the run's own paths first: an override of the same key given on the command line wins
    set -- "${OWN[@]}" "$@"
fi
mkdir -p "$OUT"
trak optimize  "$CONFIG" ${TRAIN_ARGS[@]+"${TRAIN_ARGS[@]}"}
trak featurize "$CONFIG" "$@"
trak score     "$CONFIG" "$@" --out "$OUT/scores.npy" --plot "$OUT/top.png"
# every target with its proponents and opponents on one page: open it in a browser (no server needed)
trak report    "$CONFIG" "$@" --out "$OUT/report.html"
# how good are the scores? 100 models retrained on random halves (~40 s), their LDS
trak eval lds  "$CONFIG" "$@" --workers 2 --out "$OUT/lds.json"
echo "report: file://$(pwd)/$OUT/report.html" >&2
