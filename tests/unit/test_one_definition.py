"""Names that cross processes are defined once, in the contract (`protocol/`): a second
spelling drifts from the first without any test noticing."""

from __future__ import annotations

import ast
from pathlib import Path

from temporalio.common import SearchAttributeKey
from timeslice.protocol import group

REPO = Path(__file__).resolve().parents[2]
PACKAGES = ("activities", "cli", "client", "integrations", "plan", "report", "snapshot",
            "transport", "workers", "workflows", "workloads")  # fmt: skip


def _search_attribute_keys_made(path: Path) -> list[int]:
    """Lines of ``path`` that make a search-attribute key (``SearchAttributeKey.for_*(...)``)."""
    lines = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and isinstance(node.func.value, ast.Name)
            and node.func.value.id == "SearchAttributeKey"
        ):
            lines.append(node.lineno)
    return lines


def test_search_attribute_keys_are_made_only_in_the_contract() -> None:
    offenders = [
        f"{path.relative_to(REPO)}:{line}"
        for package in PACKAGES
        for path in sorted((REPO / package).rglob("*.py"))
        for line in _search_attribute_keys_made(path)
    ]
    assert not offenders, f"make search-attribute keys in protocol/group.py: {offenders}"


def test_the_checker_sees_a_key_made_elsewhere(tmp_path: Path) -> None:
    module = tmp_path / "elsewhere.py"
    module.write_text('JOB = SearchAttributeKey.for_keyword("TimesliceJob")\n')
    assert _search_attribute_keys_made(module) == [1]


def test_every_key_is_registered_by_setup() -> None:
    """`timeslice setup` and the embedded server register SEARCH_ATTRIBUTES: every key the
    workflows and clients set is among them, as a keyword."""
    keys = [v for v in vars(group).values() if isinstance(v, SearchAttributeKey)]
    assert {key.name for key in keys} == set(group.SEARCH_ATTRIBUTES)
    assert all(group.SEARCH_ATTRIBUTES[key.name] == "Keyword" for key in keys)
