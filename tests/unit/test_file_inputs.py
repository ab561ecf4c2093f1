"""Every file a user names is read through one bounded reader, and every count a command takes
is range-checked: a clear message and exit status 2, never a read without end or a count taken
for a name (issue 36: `timeslice plan /dev/zero` read until the kernel killed it at 24 GB;
`--sampler-groups -1` planned a group named "-1")."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from timeslice.cli.main import main
from timeslice.errors import InvalidArgumentError
from timeslice.files import read_small_file

PROFILE = Path(__file__).resolve().parents[2] / "bench" / "async_profiles" / "job0.json"


def test_the_reader_reads_a_small_regular_file(tmp_path: Path) -> None:
    path = tmp_path / "config.json"
    path.write_text('{"epochs": 2}')
    assert read_small_file(path, "--config") == '{"epochs": 2}'


@pytest.mark.parametrize(
    ("make", "said"),
    [
        (lambda tmp: Path("/dev/zero"), "not a regular file"),
        (lambda tmp: tmp, "not a regular file"),
        (lambda tmp: (os.mkfifo(tmp / "fifo"), tmp / "fifo")[1], "not a regular file"),
        (lambda tmp: tmp / "missing.json", "cannot read (No such file or directory)"),
        (lambda tmp: (tmp / "big").write_bytes(b" " * 2049) and tmp / "big", "larger than 2048"),
        (lambda tmp: (tmp / "bin").write_bytes(b"\xff\xfe") and tmp / "bin", "not UTF-8 text"),
    ],
    ids=["device", "folder", "fifo-without-writer", "missing", "too-large", "not-utf8"],
)
def test_the_reader_refuses_what_is_no_small_text_file(make, said: str, tmp_path: Path) -> None:
    path = make(tmp_path)
    with pytest.raises(InvalidArgumentError, match="--in") as caught:
        read_small_file(path, "--in", max_bytes=2048)
    assert said in str(caught.value)


@pytest.mark.parametrize(
    ("argv", "said"),
    [
        (["plan", "/dev/zero", "--groups", "1"], "profile /dev/zero: not a regular file"),
        (["plan", str(PROFILE), "--overheads", "/dev/zero", "--groups", "1"], "not a regular"),
        (
            ["plan", str(PROFILE), "--sampler-groups", "-1", "--trainer-groups", "2"],
            "--sampler-groups -1: a number of groups is 1..256, not -1",
        ),
        (["plan", str(PROFILE), "--groups", "0"], "--groups 0: a number of groups is 1..256"),
        (["plan", str(PROFILE), "--groups", "100000000"], "is 1..256, not 100000000"),
        (["plan", str(PROFILE), "--groups", "a,-b"], "invalid group name '-b'"),
        (["plan", str(PROFILE), "--groups", "1", "--top", "0"], "--top 0: must be within"),
        (["plan", str(PROFILE), "--groups", "1", "--time-limit", "1e9"], "--time-limit 1e+09"),
        (["plan", str(PROFILE), "--groups", "1", "--gpus-per-group", "0"], "--gpus-per-group"),
        (["job", "start", "--config", "/dev/zero"], "--config /dev/zero: not a regular file"),
    ],
)
def test_commands_refuse_unbounded_files_and_counts_out_of_range(
    argv: list[str], said: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert said in err, err
    assert "Traceback" not in err
