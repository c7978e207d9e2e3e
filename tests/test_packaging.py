"""`pip install .` (not editable) gives a working `k3`: the wheel holds every module of the source tree and they
all import from the installed copy.

The editable install of the dev venv hides packaging mistakes: its finder serves any directory of the repo, so a
package without `__init__.py` (find_packages leaves it out of the wheel; k3/jobs was one) still imports. Here a
wheel is built from a copy of the sources (setuptools writes build/ and *.egg-info beside them, so never into the
repo), installed into a fresh venv without dependencies, and used from outside the repo. The fresh venv sees the
dev venv's third-party packages (torch, ...) through a .pth line naming its site-packages: a directory added by a
.pth line gets no .pth processing of its own, so the repo's editable finder (a .pth file there) stays inactive,
which the import check verifies."""
import os
import shutil
import subprocess
import sys
import sysconfig
import time
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
# import name -> source directory (setup.py's package_dir); what the wheel must hold
PACKAGE_DIRS = {"k3": "k3", "k3_kernels": "kernels", "k3_verl": "plugins/verl_k3", "k3_vllm": "plugins/vllm_k3",
                "k3_torchtitan": "plugins/torchtitan_k3", "k3_sglang": "plugins/sglang_k3"}
BUILD_FILES = ("pyproject.toml", "setup.py")


def _source_modules() -> set[str]:
    """Wheel paths of every .py file of the source packages (k3/jobs/rl.py, k3_kernels/kda/chunk.py, ...)."""
    out = set()
    for name, src in PACKAGE_DIRS.items():
        root = REPO / src
        for f in root.rglob("*.py"):
            if "__pycache__" not in f.parts:
                out.add(f"{name}/{f.relative_to(root).as_posix()}")
    return out


def test_every_source_directory_is_a_package():
    """Fast form of the wheel check: find_packages leaves a directory of modules without __init__.py out of the
    wheel (data-only directories such as kernels/norm/csrc need none)."""
    modules = [f for src in PACKAGE_DIRS.values() for f in (REPO / src).rglob("*.py") if "__pycache__" not in f.parts]
    missing = sorted({str(f.parent.relative_to(REPO)) for f in modules if not (f.parent / "__init__.py").exists()})
    assert not missing, f"directories with modules but no __init__.py: {missing}"


_IMPORT_ALL = r"""
import importlib, importlib.util, sys, zipfile
wheel = sys.argv[1]
names = sorted(n[:-3].replace("/", ".").removesuffix(".__init__") for n in zipfile.ZipFile(wheel).namelist()
               if n.endswith(".py"))
assert not any("editable" in repr(f) for f in sys.meta_path), sys.meta_path
# each plugin imports its framework, which only that framework's venv has (its files are checked in the wheel)
FRAMEWORKS = {"k3_verl": "verl", "k3_vllm": "vllm", "k3_torchtitan": "torchtitan", "k3_sglang": "sglang"}
missing = {p for p, fw in FRAMEWORKS.items() if importlib.util.find_spec(fw) is None}
imported = 0
for name in names:
    if name.split(".")[0] in missing:
        continue
    mod = importlib.import_module(name)
    assert mod.__file__.startswith(sys.prefix + "/"), f"{name} imported from {mod.__file__}, not {sys.prefix}"
    imported += 1
print("imported", imported, "of", len(names))
"""


@pytest.mark.slow
def test_wheel_installs_and_runs_outside_the_repo(tmp_path):
    t0 = time.perf_counter()
    src = tmp_path / "src"
    src.mkdir()
    for f in BUILD_FILES:
        shutil.copy2(REPO / f, src / f)
    for src_dir in PACKAGE_DIRS.values():
        shutil.copytree(REPO / src_dir, src / src_dir, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    wheels = tmp_path / "wheels"
    run = lambda *cmd, **kw: subprocess.run(cmd, capture_output=True, text=True, timeout=120, **kw)  # noqa: E731
    r = run(sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "--no-index",
            "--disable-pip-version-check", "-w", str(wheels), str(src))
    assert r.returncode == 0, r.stdout + r.stderr
    (wheel,) = wheels.glob("k3_plugins-*.whl")
    in_wheel = set(zipfile.ZipFile(wheel).namelist())
    missing = sorted(_source_modules() - in_wheel)
    assert not missing, f"modules left out of the wheel: {missing}"
    assert {n.split("/")[0] for n in in_wheel if n.endswith(".py")} == set(PACKAGE_DIRS)

    venv = tmp_path / "venv"
    r = run(sys.executable, "-m", "venv", "--without-pip", str(venv))
    assert r.returncode == 0, r.stdout + r.stderr
    python = venv / "bin" / "python"
    purelib = run(str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])").stdout.strip()
    (Path(purelib) / "dev_venv_packages.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    r = run(sys.executable, "-m", "pip", "--python", str(python), "install", "-q", "--no-deps", "--no-index",
            "--disable-pip-version-check", str(wheel))
    assert r.returncode == 0, r.stdout + r.stderr

    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTHON")}
    r = run(str(venv / "bin" / "k3"), "--help", cwd=tmp_path, env=env)
    assert r.returncode == 0 and "{demo,sft,rl" in r.stdout, r.stdout + r.stderr
    r = run(str(python), "-I", "-c", _IMPORT_ALL, str(wheel), cwd=tmp_path, env=env)
    assert r.returncode == 0 and r.stdout.startswith("imported "), r.stdout + r.stderr
    print(f"packaging check: {time.perf_counter() - t0:.1f} s; {r.stdout.strip()}")
