"""The example configs shipped inside the package (``trakcli/configs/*.yaml``), for ``trak init``.

In a checkout, ``configs/`` at the repository root is a link to the same files.
"""

from __future__ import annotations

from importlib import resources
from pathlib import Path

from trakcli.errors import UsageError
from trakcli.files import write_text


def example_configs() -> dict[str, str]:
    """The shipped example configs: name (file stem, e.g. ``"digits"``) -> the first comment line, as a summary."""
    out = {}
    for entry in sorted(resources.files("trakcli").joinpath("configs").iterdir(), key=lambda e: e.name):
        if entry.name.endswith(".yaml"):
            first = next((ln for ln in entry.read_text(encoding="utf-8").splitlines() if ln.startswith("#")), "#")
            out[entry.name.removesuffix(".yaml")] = first.lstrip("# ").strip()
    return out


def example_config_text(name: str) -> str:
    """The text (comments included) of the shipped config ``name`` (``digits`` or ``digits.yaml``).

    Raises:
        UsageError: no shipped config has that name (the message lists them).
    """
    stem = name.removesuffix(".yaml")
    names = example_configs()
    if stem not in names:
        raise UsageError(f"no example config named {name!r}; choose one of: {', '.join(names)} (trak init --list)")
    return resources.files("trakcli").joinpath("configs", f"{stem}.yaml").read_text(encoding="utf-8")


def write_example_config(name: str, path: str | Path | None = None, *, force: bool = False) -> Path:
    """Copy the shipped config ``name`` with its comments to ``path`` (default ``./NAME.yaml``; a directory gets
    ``NAME.yaml``) atomically, its comments naming the copy instead of ``configs/NAME.yaml``; the path written.

    Raises:
        UsageError: unknown ``name``; ``path`` exists and ``force`` is not set; its folder does not exist.
        OSError: the write failed (an existing file is then unchanged).
    """
    text = example_config_text(name)
    stem = name.removesuffix(".yaml")
    dest = Path(path) if path is not None else Path(f"{stem}.yaml")
    if dest.is_dir():
        dest = dest / f"{stem}.yaml"
    if dest.exists() and not force:
        raise UsageError(f"{dest} already exists; choose another path or add --force to overwrite it")
    if not dest.parent.exists():
        raise UsageError(f"directory {dest.parent} does not exist; create it or choose another path")
    shipped = f"configs/{stem}.yaml"  # the header's commands name the shipped file: name the copy instead
    text = "".join(line.replace(shipped, str(dest)) if line.lstrip().startswith("#") else line
                   for line in text.splitlines(keepends=True))
    write_text(dest, text)
    return dest
