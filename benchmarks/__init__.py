"""The benchmarks of trakcli: one module per measurement, each run as ``python -m benchmarks.NAME``.

Not part of the installed ``trakcli`` package. Every benchmark writes its JSON result with
:func:`benchmarks.benchjson.write_result`, which records the machine, date, commit and trakcli
version; ``benchmarks/README.md`` lists what each one measures.
"""
