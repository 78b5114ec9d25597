"""Example data for trakcli's configs: BBC news articles as documents, and a planted-facts corpus.

Not part of the installed ``trakcli`` package. Each module is a command (``python -m examples.NAME OUT_DIR``)
and the benchmarks import its functions (``from examples.bbc_docs import bbc_articles``).
"""
