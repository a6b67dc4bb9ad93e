"""requirements.lock, the constraints `make install` passes to pip, agrees with pyproject.toml: a pin outside
a requirement's range would make a fresh install fail, and a requirement without a pin would go unlocked."""

import importlib.metadata
import re
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

tomllib = pytest.importorskip("tomllib")

ROOT = Path(__file__).resolve().parents[1]


def lock_pins(text: str) -> dict[str, Version]:
    """The lock's pins by canonical name; a line that is not `name==version` fails."""
    pins = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        match = re.fullmatch(r"([A-Za-z0-9][A-Za-z0-9._-]*)==([^\s;#]+)", line)
        assert match, f"not an exact pin: {line!r}"
        name = canonicalize_name(match.group(1))
        assert name not in pins, f"pinned twice: {name}"
        pins[name] = Version(match.group(2))
    return pins


def unmet(requirements: list[str], pins: dict[str, Version]) -> list[str]:
    """The requirements (markers evaluated, extras' own markers left out) that no pin satisfies."""
    missing = []
    for text in requirements:
        requirement = Requirement(text)
        if requirement.marker is not None and not requirement.marker.evaluate({"extra": ""}):
            continue
        pin = pins.get(canonicalize_name(requirement.name))
        if pin is None or not requirement.specifier.contains(pin, prereleases=True):
            missing.append(f"{text} (locked: {pin})")
    return missing


def makefile_extras() -> list[str]:
    match = re.search(r"^EXTRAS\s*:?=\s*(.+)$", (ROOT / "Makefile").read_text(encoding="utf-8"), re.MULTILINE)
    assert match, "the Makefile names no EXTRAS"
    return match.group(1).strip().split(",")


def test_a_pin_outside_a_range_or_a_missing_pin_is_found():
    pins = lock_pins("# header\nnumpy==2.4.6\nClick==8.5.1\n")
    assert unmet(["numpy>=1.26,<3", "click>=8.1"], pins) == []
    assert unmet(["numpy<2"], pins) == ["numpy<2 (locked: 2.4.6)"]
    assert unmet(["rich>=13"], pins) == ["rich>=13 (locked: None)"]
    assert unmet(["pywin32; sys_platform == 'nonexistent'"], pins) == []
    with pytest.raises(AssertionError, match="not an exact pin"):
        lock_pins("numpy>=2\n")
    with pytest.raises(AssertionError, match="pinned twice"):
        lock_pins("click==8.5.1\nclick==8.5.0\n")


def test_every_requirement_make_install_asks_for_is_pinned_within_its_range():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))["project"]
    pins = lock_pins((ROOT / "requirements.lock").read_text(encoding="utf-8"))
    extras = makefile_extras()
    assert set(extras) <= set(project["optional-dependencies"]), extras
    requirements = project["dependencies"] + [text for extra in extras for text in project["optional-dependencies"][extra]]
    assert unmet(requirements, pins) == []


def test_what_the_locked_packages_need_is_locked_too():
    """The lock is closed: each installed locked package's own requirements are pinned, within their ranges."""
    pins = lock_pins((ROOT / "requirements.lock").read_text(encoding="utf-8"))
    checked = 0
    for name in pins:
        try:
            requirements = importlib.metadata.requires(name) or []
        except importlib.metadata.PackageNotFoundError:
            continue  # not installed in this environment
        checked += 1
        assert unmet(requirements, pins) == [], name
    assert checked > len(pins) // 2, "most locked packages should be installed where the suite runs"
