"""Print, one per line, the `uv pip install` options that make uv read the package sources pip is configured with.

uv does not read pip's configuration files or PIP_* variables; `pip config list` gives both (``global.find-links='...'``,
``:env:.extra-index-url='...'``). The most specific source of a key wins, as in pip: environment, then site, user, global.
"""
import ast
import subprocess
import sys

RANK = {":env:": 0, "site": 1, "user": 2, "global": 3}
OPTIONS = ("index-url", "extra-index-url", "find-links", "constraint", "no-index", "cert")

listed = subprocess.run([sys.executable, "-m", "pip", "config", "list"], capture_output=True, text=True).stdout
chosen = {}
for line in listed.splitlines():
    key, _, value = line.partition("=")
    where, _, option = key.rpartition(".")
    if option in OPTIONS and where in RANK and RANK[where] < chosen.get(option, (9, ""))[0]:
        chosen[option] = (RANK[where], ast.literal_eval(value))
for option, (_, value) in sorted(chosen.items()):
    if option == "no-index":
        if value.lower() in ("1", "true", "yes", "on"):
            print("--no-index")
    else:  # cert: one path; the others: whitespace-separated lists, as pip reads them
        for item in value.split():
            print(f"--{option}={item}")
