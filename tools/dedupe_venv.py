"""Hard-link a virtual environment's files to identical copies in environments built before it.

`make test` builds one venv per framework (core, verl, vLLM, TorchTitan, SGLang), and each installs the same
CPU torch 2.13.0 (~750 MB) and often the same Triton, sympy, numpy... Five full copies came to ~12.4 GB, which
ran a CI machine out of disk. After a venv is installed, this replaces every file whose relative path, size
and bytes match a file in one of the earlier venvs with a hard link to it: pip, imports and entry points see
the same tree, and the disk holds one copy.

Safe because nothing edits installed files in place: pip uninstall/upgrade unlinks (the other venv keeps its
link), and Python writes bytecode to a temporary file that it renames over the old one.

    python tools/dedupe_venv.py TARGET_VENV SOURCE_VENV [SOURCE_VENV ...]

Sources that do not exist are skipped (a lone `make test-vllm` has no core venv to link against).
"""
from __future__ import annotations

import argparse
import filecmp
import os
import sys
from pathlib import Path


def _same_bytes(a: Path, b: Path, size: int) -> bool:
    return b.stat().st_size == size and filecmp.cmp(a, b, shallow=False)  # shallow=False: compare the bytes


def dedupe(target: Path, sources: list[Path]) -> tuple[int, int]:
    """Link target's files to identical files at the same relative path in sources; returns (files, bytes) linked."""
    sources = [s for s in sources if s.is_dir() and s.resolve() != target.resolve()]
    linked_files = linked_bytes = 0
    for root, _dirs, files in os.walk(target):
        rel_root = Path(root).relative_to(target)
        for name in files:
            path = Path(root) / name
            if path.is_symlink() or not path.is_file():
                continue
            stat = path.stat()
            if stat.st_nlink > 1 or stat.st_size == 0:
                continue
            for source in sources:
                twin = source / rel_root / name
                if twin.is_symlink() or not twin.is_file():
                    continue
                twin_stat = twin.stat()
                if twin_stat.st_dev != stat.st_dev or twin_stat.st_mode != stat.st_mode:
                    continue  # a link shares its mode; a different mode stays a copy
                if not _same_bytes(path, twin, stat.st_size):
                    continue
                tmp = path.with_name(f".{name}.dedupe-tmp")
                os.link(twin, tmp)
                os.replace(tmp, path)
                linked_files += 1
                linked_bytes += stat.st_size
                break
    return linked_files, linked_bytes


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("target", type=Path, help="the venv just installed")
    parser.add_argument("sources", type=Path, nargs="+", help="venvs built before it")
    args = parser.parse_args(argv)
    if not args.target.is_dir():
        parser.error(f"target venv {args.target} does not exist")
    files, nbytes = dedupe(args.target, args.sources)
    print(f"dedupe_venv: {args.target}: {files} files ({nbytes / 2**20:.0f} MiB) now hard links to earlier venvs")
    return 0


if __name__ == "__main__":
    sys.exit(main())
