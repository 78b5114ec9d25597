"""mkdocs hook: adds the generated pages (config reference, benchmarks, changelog) to the site.

The pages are made by ``gen_docs.py`` beside this file at build time and never written to docs/,
so they always follow the pydantic schema and the committed ``bench_results/*.json``.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

from mkdocs.structure.files import File

REPO = Path(__file__).resolve().parent.parent

#: Generated page -> the function of docs/gen_docs.py that writes it.
PAGES = {"reference/config.md": "config_reference", "benchmarks.md": "benchmarks_page"}


def _generator():
    if str(REPO) not in sys.path:
        sys.path.insert(0, str(REPO))  # trakcli from this checkout
    spec = importlib.util.spec_from_file_location("gen_docs", Path(__file__).resolve().parent / "gen_docs.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def on_files(files, config):
    gen = _generator()
    for uri, fn in PAGES.items():
        files.append(File.generated(config, uri, content=getattr(gen, fn)()))
    # CHANGELOG.md stays at the repository root, where people look for it
    files.append(File.generated(config, "changelog.md", content=(REPO / "CHANGELOG.md").read_text()))
    return files
