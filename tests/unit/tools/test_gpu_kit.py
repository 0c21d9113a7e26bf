"""The GPU-day kit's plan (tools/gpu_kit.py) without downloading: what the lent image satisfies, the pins
against pyproject's ranges, and the refusal of a kit that would not travel. The build itself (downloads,
the offline install in a Python 3.12 venv) is tests/e2e/test_gpu_day_dry_run.py."""

from __future__ import annotations

import pytest
from gpu_kit import (
    IMAGE_VERSIONS,
    KitError,
    KitWheel,
    check_fits,
    image_requirements,
    image_satisfies,
    kit_pins,
    project_requirements,
)
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name


def test_the_lent_pythons_megatron_range_is_the_312_one():
    megatron = [r for r in project_requirements() if canonicalize_name(r.name) == "megatron-core"]
    assert [str(r.specifier) for r in megatron] == ["<=0.19.2,>=0.16.1"]


def test_an_image_version_outside_the_range_is_not_satisfied():
    assert image_satisfies(Requirement("transformers>=5.0,<=5.24.0"))
    assert not image_satisfies(Requirement(f"transformers>{IMAGE_VERSIONS['transformers']}"))
    assert not image_satisfies(Requirement("megatron-core>=0.16.1"))  # the image lacks it


def test_every_package_the_image_lacks_has_a_tested_pin_within_pyprojects_range():
    pins = kit_pins()
    for requirement in project_requirements():
        if not image_satisfies(requirement):
            name = canonicalize_name(requirement.name)
            assert name in pins, f"{name}: no tested version for the kit"
            assert requirement.specifier.contains(pins[name]), (name, pins[name], str(requirement))


def test_the_image_stand_in_pins_the_images_recorded_versions():
    lines = image_requirements()
    for name, version in IMAGE_VERSIONS.items():
        assert f"{name}=={version}" in lines
    assert not any(line.startswith("megatron-core") for line in lines)


def test_a_kit_over_its_budget_is_refused_naming_the_package_and_its_size():
    wheels = [KitWheel("small", "1.0", "small.whl", 2**20, "x"), KitWheel("big", "2.0", "big.whl", 5 * 2**20, "y")]
    check_fits(wheels, 6 * 2**20)
    with pytest.raises(KitError, match=r"big 2\.0 \(5\.0 MiB\) brings it to 6\.0 MiB, over the 5\.0 MiB"):
        check_fits(wheels, 5 * 2**20)
