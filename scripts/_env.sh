# Sourced by quickstart.sh and test.sh: create .venv (once) and install trakcli into it.
# Reinstalls only when pyproject.toml changes. PYTHON picks the interpreter (default python3, >= 3.11).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
VENV="${TRAK_VENV:-.venv}"
EXTRAS="${1:-}"
if [ ! -x "$VENV/bin/python" ]; then
    echo "creating virtual environment $VENV" >&2
    "${PYTHON:-python3}" -m venv "$VENV"
fi
stamp="$VENV/.trakcli-installed-${EXTRAS:-base}"
want="$(sha256sum pyproject.toml | cut -c1-16)"
if [ ! -f "$stamp" ] || [ "$(cat "$stamp")" != "$want" ]; then
    echo "installing trakcli${EXTRAS:+[$EXTRAS]} into $VENV (torch==2.13.0 CPU build)" >&2
    # this project was installed as distribution "trakcli" before it became trakcli-attribution
    "$VENV/bin/python" -m pip uninstall -qq -y --disable-pip-version-check trakcli 2>/dev/null || true
    # torch==2.13.0 on the same command line: the metadata's range alone would pull a CUDA build
    # uv installs the same set in seconds where pip takes a minute or more; pip stays the fallback
    uv_ok=0
    if "$VENV/bin/python" -m pip install -qq --disable-pip-version-check "uv==0.13.9" 2>/dev/null; then
        # uv reads neither pip's configuration files nor PIP_* variables: `pip config list` gives both, and the
        # most specific source of a key wins, as in pip (environment, site, user, global)
        mapfile -t sources < <("$VENV/bin/python" - <<'PY'
import ast, subprocess, sys
rank = {":env:": 0, "site": 1, "user": 2, "global": 3}
chosen = {}
listed = subprocess.run([sys.executable, "-m", "pip", "config", "list"], capture_output=True, text=True).stdout
for line in listed.splitlines():
    key, _, value = line.partition("=")
    where, _, option = key.rpartition(".")
    if option in ("index-url", "extra-index-url", "find-links", "constraint", "no-index", "cert") \
            and where in rank and rank[where] < chosen.get(option, (9, ""))[0]:
        chosen[option] = (rank[where], ast.literal_eval(value))
for option, (_, value) in sorted(chosen.items()):
    if option == "no-index":
        if value.lower() in ("1", "true", "yes", "on"):
            print("--no-index")
    else:  # cert: one path; the others: whitespace-separated lists, as pip reads them
        for item in value.split():
            print(f"--{option}={item}")
PY
)
        # unsafe-best-match: every index is searched for every package, as pip does; --compile-bytecode: as pip
        # does, since with PYTHONDONTWRITEBYTECODE set no process would ever cache torch's compiled modules
        "$VENV/bin/uv" pip install -q --compile-bytecode --python "$VENV/bin/python" --index-strategy unsafe-best-match \
            "${sources[@]}" -e ".${EXTRAS:+[$EXTRAS]}" "torch==2.13.0" && uv_ok=1 \
            || echo "uv could not install trakcli: pip installs it" >&2
    fi
    if [ "$uv_ok" -eq 0 ]; then
        "$VENV/bin/python" -m pip install -qq --disable-pip-version-check -e ".${EXTRAS:+[$EXTRAS]}" "torch==2.13.0"
    fi
    echo "$want" > "$stamp"
fi
export PATH="$ROOT/$VENV/bin:$PATH"
