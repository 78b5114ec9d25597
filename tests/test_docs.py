"""The docs: the generated config reference and benchmarks page, the README, and wording.

The site itself is built with ``mkdocs build --strict`` by scripts/test.sh; these
tests check what the build cannot: that the generated pages are complete.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import subprocess
import typing
from pathlib import Path

import pytest
from pydantic import BaseModel

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def gen_docs():
    spec = importlib.util.spec_from_file_location("gen_docs", ROOT / "docs" / "gen_docs.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _sections(annotation) -> list[type[BaseModel]]:
    """The pydantic models inside a field's annotation (``X``, ``X | None``, ``Optional[X]``)."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return [annotation]
    return [m for arg in typing.get_args(annotation) for m in _sections(arg)]


def _config_keys(model: type[BaseModel], prefix: str = "") -> list[tuple[str, object]]:
    """Every (dotted key, FieldInfo) of the config schema, sections walked recursively."""
    keys = []
    for name, field in model.model_fields.items():
        keys.append((prefix + name, field))
        for section in _sections(field.annotation):
            keys += _config_keys(section, f"{prefix}{name}.")
    return keys


def test_every_config_field_is_in_the_generated_reference(gen_docs):
    from trakcli.config.schema import Config

    page = gen_docs.config_reference()
    keys = _config_keys(Config)
    assert len(keys) > 80  # the walk reaches the nested sections (data.train.*, eval.sweep.*, ...)
    missing = [key for key, _ in keys if f"`{key}`" not in page]
    assert not missing, f"config keys missing from the generated reference: {missing}"
    for key in ("data.validation.max_length", "eval.sweep.proj_dims", "optimize.projection.update_gap",
                "optimize.projection.rank", "optimize.out_dir", "store.dtype"):
        assert f"`{key}`" in page


def test_every_config_field_has_a_description():
    """The reference's descriptions are the fields' own (a section's may be its class docstring): none is blank."""
    from trakcli.config.schema import Config

    def described(field) -> bool:
        sections = _sections(field.annotation)
        return bool((field.description or "").strip() or (sections and (sections[0].__doc__ or "").strip()))

    blank = [key for key, field in _config_keys(Config) if not described(field)]
    assert not blank, f"config fields without description=: {blank}"


def test_the_reference_shows_types_defaults_and_descriptions(gen_docs):
    page = gen_docs.config_reference()
    row = next(line for line in page.splitlines() if line.startswith("| `projector.proj_dim`"))
    cells = [c.strip() for c in row.strip("|").split("|")]
    assert cells[1] == "`int > 0`" and cells[2] == "`2048`" and cells[3] == "Output dimension of the projection."
    row = next(line for line in page.splitlines() if line.startswith("| `store.path`"))
    assert "**required**" in row
    assert "`projector.max_chunk_size`" in page  # the kind-specific options of projector:


def test_markdown_escaping_keeps_code_spans_and_escapes_the_rest(gen_docs):
    assert gen_docs.md_text("f [n] | `a|b` <dir> x_y") == r"f \[n\] \| `a|b` &lt;dir&gt; x\_y"
    assert gen_docs.md_text(":class:`trakcli.Task` and ``x``") == "`trakcli.Task` and `x`"


def test_the_benchmarks_page_has_a_table_for_every_committed_result(gen_docs):
    results = gen_docs.committed_results()
    assert results, "no committed bench_results/*.json"
    page = gen_docs.benchmarks_page()
    assert gen_docs.RESULTS_MARK not in page
    for path in results:
        assert f"(`{path.name}`)" in page
    # numbers from the JSON, rendered: the LDS of the digits benchmark and the LM's time
    lds = json.loads((ROOT / "bench_results" / "lds_digits.json").read_text())
    first = next(r for r in lds["results"] if r["method"] != "traker")
    assert f"{first['lds']:.3f}" in page
    lm = json.loads((ROOT / "bench_results" / "lm.json").read_text())
    assert f"{lm['variants']['kronecker']['seconds']:,.1f}" in page


def test_every_committed_result_records_its_date_commit_and_version(gen_docs):
    results = gen_docs.committed_results()
    assert results, "no committed bench_results/*.json"
    bad = []
    for path in results:
        data = json.loads(path.read_text())
        date, commit, version = data.get("date"), data.get("commit"), data.get("version")
        if not (isinstance(date, str) and re.match(r"\d{4}-\d{2}-\d{2}", date)):
            bad.append(f"{path.name}: date {date!r}")
        if not (isinstance(commit, str) and re.fullmatch(r"[0-9a-f]{7,40}", commit)):
            bad.append(f"{path.name}: commit {commit!r}")
        if not (isinstance(version, str) and re.fullmatch(r"\d+\.\d+\.\d+\S*", version)):
            bad.append(f"{path.name}: version {version!r}")
        if data.get("provenance_source", "git log of this file") != "git log of this file":
            bad.append(f"{path.name}: provenance_source {data['provenance_source']!r}")
    assert not bad, f"results without their date, commit or trakcli version (benchmarks/benchjson.py): {bad}"


def test_committed_results_are_named_by_what_they_measure(gen_docs):
    history = re.compile(r"_s\d+\b|session|_v\d+\b|_old\b|_new\b", re.IGNORECASE)
    named = [p.name for p in gen_docs.committed_results() if history.search(p.stem)]
    assert not named, f"result files named by when they were made, not by what they measure: {named}"


def test_the_benchmarks_page_gives_each_results_date_commit_and_version(gen_docs):
    page = gen_docs.benchmarks_page()
    for path in gen_docs.committed_results():
        data = json.loads(path.read_text())
        section = page[page.index(f"(`{path.name}`)"):]
        section = section[: section.find("\n## ", 1) if "\n## " in section[1:] else len(section)]
        assert f"Recorded {data['date']}, commit {data['commit'][:8]}, trakcli {data['version']}" in section
        if "provenance_source" in data:
            assert "(from the git log of this file)" in section


def test_each_result_is_made_by_a_module_of_the_benchmarks_package(gen_docs):
    """The "Made by" command runs the result's benchmark as ``python -m benchmarks.NAME``, whichever way the
    result recorded the command (a file path or the module), with the recorded arguments."""
    page = gen_docs.benchmarks_page()
    commands = re.findall(r"Made by\n\n```bash\n(.*)\n```", page)
    assert len(commands) == len(gen_docs.committed_results())
    for command in commands:
        module = re.match(r"python -m benchmarks\.(\w+)(?: |$)", command)
        assert module, f"not a command of the benchmarks package: {command}"
        assert (ROOT / "benchmarks" / f"{module.group(1)}.py").is_file(), command
    for path in gen_docs.committed_results():
        recorded = json.loads(path.read_text()).get("command", "")
        words = recorded.split(" ")
        if words[0] != "python":
            continue
        name, args = (words[2], words[3:]) if words[1] == "-m" else (Path(words[1]).stem, words[2:])
        name = name.removeprefix("benchmarks.")
        assert gen_docs.shown_command(recorded) == " ".join(["python", "-m", f"benchmarks.{name}", *args]), path.name
    assert gen_docs.shown_command("trak select a.yaml --json") == "trak select a.yaml --json"


def test_a_result_without_its_provenance_is_an_error_naming_the_fix(gen_docs, tmp_path):
    path = tmp_path / "topk.json"
    path.write_text(json.dumps({"benchmark": "bench_topk", "results": []}))
    with pytest.raises(ValueError, match="no date, commit, version .*benchjson.py write_result"):
        gen_docs.render_result(path)


@pytest.fixture(scope="module")
def benchjson():
    from benchmarks import benchjson

    return benchjson


def test_write_result_adds_the_provenance_and_keeps_the_result(benchjson, tmp_path):
    out = tmp_path / "sub" / "r.json"
    written = benchjson.write_result(out, {"benchmark": "b", "seconds": 1.25, "machine": {"threads": 2}})
    data = json.loads(out.read_text())
    assert data == written
    assert list(data)[:2] == ["benchmark", "date"]
    assert set(benchjson.PROVENANCE_KEYS) <= set(data)
    assert data["seconds"] == 1.25 and data["machine"] == {"threads": 2}
    assert re.fullmatch(r"\d{4}-\d{2}-\d{2}T\d{2}:\d{2}:\d{2}\+00:00", data["date"])
    import trakcli

    assert data["version"] == trakcli.__version__
    assert data["cpus"] == os.cpu_count()
    head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True)
    if head.returncode == 0:
        assert data["commit"] == head.stdout.strip() and isinstance(data["dirty"], bool)
    assert [p.name for p in out.parent.iterdir()] == ["r.json"]  # no temporary file left


def test_write_result_keeps_the_previous_file_when_the_result_cannot_be_written(benchjson, tmp_path):
    out = tmp_path / "r.json"
    out.write_text('{"old": 1}\n')
    with pytest.raises(TypeError):
        benchjson.write_result(out, {"benchmark": "b", "bad": object()})
    assert out.read_text() == '{"old": 1}\n'
    assert [p.name for p in tmp_path.iterdir()] == ["r.json"]
    with pytest.raises(TypeError, match="must be a dict"):
        benchjson.write_result(out, [1, 2])


def test_a_result_without_a_renderer_is_an_error_naming_the_fix(gen_docs, tmp_path):
    path = tmp_path / "new.json"
    path.write_text(json.dumps({"benchmark": "something_new"}))
    with pytest.raises(ValueError, match="RENDERERS"):
        gen_docs.render_result(path)


def test_readme_is_short_and_its_commands_and_links_exist():
    readme = (ROOT / "README.md").read_text()
    assert len(readme.splitlines()) <= 200
    for command in ("./scripts/quickstart.sh", "./scripts/test.sh"):
        assert command in readme
        assert (ROOT / command).is_file()
    links = re.findall(r"\]\(((?:docs/|CHANGELOG)[^)#]*)", readme)
    assert len(links) >= 10
    for link in links:
        assert (ROOT / link).is_file(), f"README links to {link}, which does not exist"


def test_the_docs_speak_of_the_product_not_of_its_history():
    pattern = re.compile(r"session [0-9]|issue [0-9]+", re.IGNORECASE)
    files = [ROOT / "README.md", ROOT / "CHANGELOG.md"]
    for folder in ("trakcli", "tests", "docs"):
        files += [p for p in (ROOT / folder).rglob("*") if p.suffix in (".py", ".md", ".yaml", ".txt")]
    found = [f"{p.relative_to(ROOT)}:{i}" for p in files for i, line in enumerate(p.read_text().splitlines(), 1)
             if pattern.search(line)]
    assert not found, f"development history in the docs or code: {found}"


def test_every_docs_page_is_in_the_nav():
    import yaml

    class _Loader(yaml.SafeLoader):
        pass

    _Loader.add_multi_constructor("tag:yaml.org,2002:python/", lambda loader, suffix, node: None)
    config = yaml.load((ROOT / "mkdocs.yml").read_text(), Loader=_Loader)

    def pages(nav):
        for item in nav:
            value = next(iter(item.values())) if isinstance(item, dict) else item
            if isinstance(value, list):
                yield from pages(value)
            else:
                yield value

    in_nav = set(pages(config["nav"]))
    written = {str(p.relative_to(ROOT / "docs")) for p in (ROOT / "docs").rglob("*.md")}
    generated = {"reference/config.md", "benchmarks.md", "changelog.md"}
    excluded = {"benchmarks_intro.md"}
    assert written - excluded <= in_nav, f"pages not in mkdocs.yml nav: {sorted(written - excluded - in_nav)}"
    assert in_nav - written <= generated, f"nav entries without a page: {sorted(in_nav - written - generated)}"


def test_committed_results_lists_the_git_files():
    out = subprocess.run(["git", "ls-files", "bench_results"], cwd=ROOT, capture_output=True, text=True)
    if out.returncode != 0:
        pytest.skip("not a git checkout")
    spec = importlib.util.spec_from_file_location("gen_docs_2", ROOT / "docs" / "gen_docs.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    assert [p.relative_to(ROOT).as_posix() for p in module.committed_results()] == sorted(
        p for p in out.stdout.split() if p.endswith(".json")
    )


def test_every_tests_path_named_in_the_repository_exists():
    """A path under tests/ named in the code, the docs, the configs or the scripts is a file or folder (or a glob
    that matches one)."""
    named = re.compile(r"(?<![\w./-])tests/[\w./*-]*[\w*]")
    skip = {"site", "build", "dist", "__pycache__", "node_modules"}
    stale = []
    for folder, dirs, files in os.walk(ROOT):
        dirs[:] = sorted(d for d in dirs if not d.startswith(".") and d not in skip and not d.endswith(".egg-info"))
        for name in sorted(files):
            path = Path(folder) / name
            if path.suffix not in (".py", ".md", ".yaml", ".yml", ".sh", ".toml"):
                continue
            for i, line in enumerate(path.read_text().splitlines(), 1):
                stale += [f"{path.relative_to(ROOT)}:{i}: {m}" for m in named.findall(line) if not list(ROOT.glob(m))]
    assert stale == []
