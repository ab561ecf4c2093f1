"""The front door of the project: the licence pyproject.toml declares, a changelog with its
Unreleased section on top, a contributing guide whose markers and paths are the real ones,
all three linked from the README."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_the_licence_is_the_apache_text_the_package_declares() -> None:
    declared = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["license"]
    assert declared == {"text": "Apache-2.0"}
    text = (REPO / "LICENSE").read_text()
    assert "Apache License" in text and "Version 2.0, January 2004" in text
    # The whole text, not a stub: all nine sections and the end of the terms.
    for section in range(1, 10):
        assert re.search(rf"^\s+{section}\. \w", text, re.MULTILINE), f"section {section}"
    assert "END OF TERMS AND CONDITIONS" in text


def test_the_readme_links_the_front_door() -> None:
    readme = (REPO / "README.md").read_text()
    for name in ("LICENSE", "CONTRIBUTING.md", "CHANGELOG.md"):
        assert f"]({name})" in readme, f"README.md does not link {name}"


def test_the_changelog_starts_with_unreleased() -> None:
    headings = re.findall(r"^## (.+)$", (REPO / "CHANGELOG.md").read_text(), re.MULTILINE)
    assert headings[0] == "Unreleased", headings
    version = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["version"]
    assert any(h.startswith(version) for h in headings), f"no section for {version}"


def test_the_contributing_guide_names_real_markers_and_paths() -> None:
    guide = (REPO / "CONTRIBUTING.md").read_text()
    markers = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["pytest"]["ini_options"]
    for line in markers["markers"]:
        name = line.split(":", 1)[0]
        assert f"| `{name}` |" in guide, f"marker {name} is not described"
    named = set(
        re.findall(r"`((?:tests|snapshot|workloads|protocol|workflows)/[\w/.]+\.py)`", guide)
    )
    assert named, "the guide names no files"
    missing = sorted(path for path in named if not (REPO / path).exists())
    assert not missing, f"CONTRIBUTING.md names files that do not exist: {missing}"


def test_one_verb_for_taking_state_off_the_device() -> None:
    """docs/architecture.md names the verb (evict) and the names kept for compatibility; the
    user-facing packages no longer say "snapshotted" for it."""
    architecture = (REPO / "docs" / "architecture.md").read_text()
    glossary = architecture.split("## Glossary", 1)[1].split("\n## ", 1)[0]
    assert "**Evict**" in glossary and "**Restore**" in glossary
    for kept in ("SnapshotBackend", "report_moved", "snapshot_backends=", "offload"):
        assert kept in glossary, f"the glossary does not say {kept} stays"
    said = [
        f"{path.relative_to(REPO)}"
        for package in ("client", "transport", "cli", "snapshot", "workloads")
        for path in sorted((REPO / package).rglob("*.py"))
        if "snapshotted" in path.read_text()
    ]
    assert not said, f"say evicted, not snapshotted: {said}"
