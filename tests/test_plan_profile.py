"""ChainProfile: validation, convenience properties, JSON round trips."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest

from remat.errors import RematError
from remat.plan import ChainProfile, InvalidProfile
from remat.testing import random_chain


def two_stage_profile(**overrides: object) -> ChainProfile:
    fields: dict[str, object] = {
        "names": ("embed", "head"),
        "forward_time_s": (0.5, 1.5),
        "backward_time_s": (1.0, 2.0),
        "activation_bytes": (100, 10, 20),
        "gradient_bytes": (0, 10, 20),
        "saved_bytes": (5, 7),
        "saves_input": (True, False),
        "saves_output": (False, True),
        "forward_temp_bytes": (1, 2),
        "backward_temp_bytes": (3, 4),
    }
    fields.update(overrides)
    return ChainProfile(**fields)  # type: ignore[arg-type]


def test_properties() -> None:
    profile = two_stage_profile()
    assert profile.n_stages == 2
    assert profile.total_forward_time_s == 2.0
    assert profile.total_backward_time_s == 3.0
    assert profile.total_time_s == 5.0
    assert profile.input_bytes == 100
    assert profile.output_bytes == 20
    # Stage 0 saves its input x_0, which belongs to the caller: not counted.
    assert profile.stored_bytes(0) == 5
    # Stage 1 saves its output x_2.
    assert profile.stored_bytes(1) == 7 + 20


def test_lists_and_numpy_values_become_tuples_of_python_values() -> None:
    profile = two_stage_profile(
        activation_bytes=np.array([100, 10, 20]),
        saves_input=[np.bool_(True), np.bool_(False)],
        forward_time_s=[np.float32(0.5), 1],
    )
    assert profile.activation_bytes == (100, 10, 20)
    assert all(type(value) is int for value in profile.activation_bytes)
    assert profile.saves_input == (True, False)
    assert profile.forward_time_s == (0.5, 1.0)


@pytest.mark.parametrize(
    ("overrides", "fragment"),
    [
        ({"names": ()}, "at least one stage"),
        ({"saved_bytes": (1, 2, 3)}, "saved_bytes has 3 values"),
        ({"activation_bytes": (1, 2)}, "expected 3, one per boundaries"),
        ({"saved_bytes": (1, -2)}, "saved_bytes[1] (stage 'head') is negative"),
        ({"gradient_bytes": (0, 1.5, 2)}, "whole number of bytes"),
        ({"forward_time_s": (0.1, math.nan)}, "finite"),
        ({"backward_time_s": (0.1, -1.0)}, "finite and >= 0"),
        ({"saves_output": (True, 2)}, "must be a bool"),
        ({"names": ("a", 3)}, "names[1] must be a str"),
        ({"metadata": [1, 2]}, "metadata must be a dict"),
    ],
)
def test_invalid_profiles_say_what_is_wrong(overrides: dict[str, object], fragment: str) -> None:
    with pytest.raises(InvalidProfile) as raised:
        two_stage_profile(**overrides)
    assert fragment in str(raised.value)
    assert isinstance(raised.value, RematError)
    assert isinstance(raised.value, ValueError)


def test_json_round_trip() -> None:
    profile = two_stage_profile(metadata={"device": "cuda:0", "dtype": "float16", "shapes": [[2, 3]]})
    text = profile.to_json()
    data = json.loads(text)
    assert data["format"] == "remat.chain_profile" and data["version"] == 1
    again = ChainProfile.from_json(text)
    assert again == profile
    assert again.metadata == profile.metadata
    assert ChainProfile.from_dict(profile.to_dict()) == profile


@pytest.mark.parametrize("seed", range(5))
def test_json_round_trip_of_random_chains(seed: int) -> None:
    profile = random_chain(seed, 1 + seed * 3, unit_bytes=4096)
    assert ChainProfile.from_json(profile.to_json(indent=None)) == profile


def test_save_and_load(tmp_path: Path) -> None:
    profile = random_chain(7, 6)
    path = tmp_path / "profile.json"
    profile.save(path)
    assert ChainProfile.load(path) == profile
    assert ChainProfile.load(str(path)) == profile


@pytest.mark.parametrize(
    ("edit", "fragment"),
    [
        (lambda data: data.update(format="other"), "not a remat chain profile"),
        (lambda data: data.update(version=99), "version 99 is not supported"),
        (lambda data: data.pop("saved_bytes"), "lacks the keys ['saved_bytes']"),
        (lambda data: data.update(extra=1), "unknown keys ['extra']"),
        (lambda data: data.update(saved_bytes=[1]), "saved_bytes has 1 values"),
    ],
)
def test_from_dict_rejects_bad_documents(edit, fragment: str) -> None:  # type: ignore[no-untyped-def]
    data = two_stage_profile().to_dict()
    edit(data)
    with pytest.raises(InvalidProfile, match=None) as raised:
        ChainProfile.from_dict(data)
    assert fragment in str(raised.value)


def test_from_json_rejects_non_json_and_load_names_the_file(tmp_path: Path) -> None:
    with pytest.raises(InvalidProfile, match="must be JSON"):
        ChainProfile.from_json("{not json")
    path = tmp_path / "broken.json"
    path.write_text('{"format": "remat.chain_profile", "version": 1}')
    with pytest.raises(InvalidProfile) as raised:
        ChainProfile.load(path)
    assert str(path) in str(raised.value)


def test_metadata_that_json_cannot_hold_is_reported() -> None:
    profile = two_stage_profile(metadata={"device": object()})
    with pytest.raises(InvalidProfile, match="not JSON-able"):
        profile.to_json()


def test_profiles_are_hashable_and_frozen() -> None:
    profile = two_stage_profile(metadata={"a": 1})
    assert hash(profile) == hash(two_stage_profile(metadata={"b": 2}))
    with pytest.raises(AttributeError):
        profile.names = ("x", "y")  # type: ignore[misc]
