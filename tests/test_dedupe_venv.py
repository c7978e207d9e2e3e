"""tools/dedupe_venv.py, which `make test` runs after each framework venv: files identical to an earlier venv's at
the same relative path become hard links to it, and nothing else changes.

Why it exists: five venvs each with their own torch/Triton filled a CI machine's disk. What can go wrong is a
link to a file that only looks the same (same name and size, other bytes, or another mode), which would change
what the later venv runs; these cases check that only true copies are linked and every file reads as before."""
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tools"))
import dedupe_venv  # noqa: E402


def _write(path: Path, data: bytes, mode: int = 0o644) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)
    os.chmod(path, mode)
    return path


def test_only_true_copies_become_links_and_every_file_reads_the_same(tmp_path):
    core, verl, target = tmp_path / "core", tmp_path / "verl", tmp_path / "target"
    same = _write(core / "lib/torch/a.py", b"x" * 1000)
    _write(target / "lib/torch/a.py", b"x" * 1000)
    _write(core / "lib/torch/b.py", b"old!" * 10)
    _write(target / "lib/torch/b.py", b"new!" * 10)            # same size, other bytes
    _write(core / "bin/tool", b"#!/bin/sh\n", 0o755)
    _write(target / "bin/tool", b"#!/bin/sh\n", 0o644)          # same bytes, other mode
    only_in_verl = _write(verl / "lib/triton/c.so", b"\0\1" * 300)
    _write(target / "lib/triton/c.so", b"\0\1" * 300)
    _write(target / "lib/own.py", b"mine")                       # in no source
    before = {p: p.read_bytes() for p in target.rglob("*") if p.is_file()}

    files, nbytes = dedupe_venv.dedupe(target, [core, tmp_path / "missing", verl])

    assert (files, nbytes) == (2, 1000 + 600)
    assert os.path.samefile(target / "lib/torch/a.py", same)
    assert os.path.samefile(target / "lib/triton/c.so", only_in_verl)
    for unlinked in ("lib/torch/b.py", "bin/tool", "lib/own.py"):
        assert (target / unlinked).stat().st_nlink == 1, unlinked
    assert (target / "bin/tool").stat().st_mode & 0o777 == 0o644
    assert {p: p.read_bytes() for p in target.rglob("*") if p.is_file()} == before
    assert not list(target.rglob("*.dedupe-tmp"))
    # a second pass finds nothing left to link
    assert dedupe_venv.dedupe(target, [core, verl]) == (0, 0)


def test_unlinking_one_venvs_copy_leaves_the_other_intact(tmp_path):
    """pip uninstall/upgrade in one venv removes its link; the earlier venv's file must survive."""
    core, target = tmp_path / "core", tmp_path / "target"
    source = _write(core / "lib/m.py", b"payload")
    _write(target / "lib/m.py", b"payload")
    dedupe_venv.dedupe(target, [core])
    (target / "lib/m.py").unlink()
    assert source.read_bytes() == b"payload"


def test_the_command_line_names_a_missing_target(tmp_path):
    run = subprocess.run([sys.executable, str(REPO / "tools/dedupe_venv.py"), str(tmp_path / "nope"),
                          str(tmp_path)], capture_output=True, text=True)
    assert run.returncode != 0 and "target venv" in run.stderr and "nope" in run.stderr
