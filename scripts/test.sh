#!/usr/bin/env bash
# Set up .venv with the test and hf (transformers) extras and run the test suite. Extra arguments go to pytest.
set -euo pipefail
source "$(dirname "$0")/_env.sh" "test,hf,cuda"  # cuda: triton, so the kernel tests run under TRITON_INTERPRET=1
set +e
python -m pytest "$@"
code=$?
set -e
if [ "$code" -eq 5 ]; then
    echo "pytest collected no tests: treated as a failure" >&2
    exit 1
fi
exit "$code"
