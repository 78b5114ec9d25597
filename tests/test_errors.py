"""Errors whose fix is data (trakcli.errors.Fix): the CLI's words in str(), the Python API's through for_front."""

from __future__ import annotations

import pickle

import pytest

from trakcli.errors import FIX_WORDS, FRONTS, Fix, Note, StoreError, StoreMismatchError, worded


@pytest.mark.parametrize(("kind", "cli", "api"), [
    ("start_over", "rerun with --overwrite to start over",
     "give Attributor another store path, or delete out/a.zarr to start over"),
    ("start_over_or_new_path", "rerun with --overwrite to start over, or choose another store path",
     "give Attributor another store path, or delete out/a.zarr to start over"),
    ("recompute_experiment", "rerun with --overwrite to recompute them, or set score.experiment to a new name",
     "pass overwrite=True to recompute them, or another experiment="),
    ("recompute_scores", "rerun with --overwrite to recompute the scores, or set score.experiment to a new name",
     "pass overwrite=True to recompute the scores, or another experiment="),
    ("rescore", "rescore with `trak score CONFIG --overwrite`", "rescore with overwrite=True"),
    ("rescore_call", "`trak score CONFIG --overwrite`", "overwrite=True"),
])
def test_each_fix_is_worded_by_the_cli_and_by_the_api(kind, cli, api):
    fix = Fix(kind, store="out/a.zarr")
    assert fix.words() == fix.words("cli") == cli
    assert fix.words("api") == api


def test_every_fix_kind_has_the_words_of_every_front():
    assert all(set(words) == set(FRONTS) for words in FIX_WORDS.values())


def test_an_error_carries_its_fix_and_is_worded_for_each_front():
    e = StoreMismatchError("the store differs; ", fix=Fix("start_over", store="out/a.zarr"), after=" (see inspect)")
    assert str(e) == "the store differs; rerun with --overwrite to start over (see inspect)"
    assert e.fix == Fix("start_over", store="out/a.zarr")
    api = e.for_front("api")
    assert type(api) is StoreMismatchError and api.fix == e.fix
    assert str(api) == ("the store differs; give Attributor another store path, or delete out/a.zarr to start over "
                        "(see inspect)")
    assert api.worded("cli") == str(e)
    copied = pickle.loads(pickle.dumps(e))  # e.g. sent from a worker process
    assert str(copied) == str(e) and copied.worded("api") == str(api)


def test_a_fix_is_replaced_keeping_the_message_around_it():
    e = StoreMismatchError("targets differ\n", fix=Fix("recompute_experiment"))
    select = e.with_fix(Fix("recompute_experiment", experiment_key="select.experiment"))
    assert str(select) == ("targets differ\n"
                           "rerun with --overwrite to recompute them, or set select.experiment to a new name")
    assert str(select.for_front("api")) == "targets differ\npass overwrite=True to recompute them, or another experiment="


def test_an_error_without_a_fix_says_it_in_its_own_words():
    e = StoreError("no trakcli store at out/a.zarr")
    assert e.fix is None and e.for_front("api") is e and e.worded("api") == str(e)
    with pytest.raises(ValueError, match="no fix to replace"):
        e.with_fix(Fix("start_over"))


def test_a_note_is_the_cli_string_and_worded_for_the_api():
    note = Note("stale until rescored (", Fix("rescore_call"), ")")
    assert note == "stale until rescored (`trak score CONFIG --overwrite`)"
    assert worded(note, "api") == "stale until rescored (overwrite=True)"
    assert worded("a plain note", "api") == "a plain note"
    assert worded(pickle.loads(pickle.dumps(note)), "api") == "stale until rescored (overwrite=True)"


def test_an_unknown_kind_or_front_is_refused():
    with pytest.raises(ValueError, match="'restart' is not one of"):
        Fix("restart")
    with pytest.raises(ValueError, match="front 'gui'"):
        Fix("rescore").words("gui")
