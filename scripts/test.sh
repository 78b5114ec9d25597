#!/usr/bin/env bash
# Set up .venv with the test, hf (transformers) and docs extras, build the docs and run the test suite.
# Extra arguments go to pytest (-n 0: one process).
set -euo pipefail
source "$(dirname "$0")/_env.sh" "test,hf,cuda,docs"  # cuda: triton, so the kernel tests run under TRITON_INTERPRET=1
# the browser tests of `trak report` drive Debian's chromium through playwright (skipped without it; needs root)
if ! command -v chromium >/dev/null 2>&1 && [ "$(id -u)" -eq 0 ] && command -v apt-get >/dev/null 2>&1; then
    echo "installing chromium (apt-get) for the browser tests" >&2
    (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends chromium) \
        >/dev/null 2>&1 || echo "chromium could not be installed: the browser tests will be skipped" >&2
fi
# the docs site, strict: a broken link, a missing page or a docstring griffe cannot read fails (a few seconds)
site="$(mktemp -d)"
NO_MKDOCS_2_WARNING=1 python -m mkdocs build --strict --quiet --site-dir "$site"
rm -rf "$site"
set +e
# one pytest worker per core (pytest-xdist), each test module on one worker (its module fixtures made once)
python -m pytest -n auto --dist loadfile "$@"
code=$?
set -e
if [ "$code" -eq 5 ]; then
    echo "pytest collected no tests: treated as a failure" >&2
    exit 1
fi
exit "$code"
