"""The parity references are required, not optional: no test skips when one is missing, and a
session without them (or with other versions) stops before running anything."""

import pathlib

from helpers.references import REFERENCES, reference_problems

TESTS = pathlib.Path(__file__).resolve().parents[1]


def test_no_test_skips_for_a_missing_reference():
    offenders = [str(p.relative_to(TESTS)) for p in TESTS.rglob("*.py") if p.name != pathlib.Path(__file__).name
                 and "importorskip" in p.read_text()]
    assert offenders == []


def test_a_missing_or_other_reference_is_named():
    good = {"torch": "2.13.0", "transformers": "5.24.0", "diffusers": "0.42.1"}
    assert reference_problems(good) == [] and set(good) == set(REFERENCES)
    assert reference_problems({**good, "torch": "2.5.1"}) == [
        "torch 2.5.1 is installed; the tests compare against 2.13.0"]
    assert reference_problems({**good, "transformers": "5.25.0"}) == []
    assert reference_problems({**good, "transformers": "5.23.0"}) == [
        "transformers 5.23.0 is installed; the tests compare against 5.24.0 or 5.25.0"]
    missing = dict(good)
    del missing["diffusers"]
    assert reference_problems(missing) == ["diffusers is not installed"]
