"""A tiny synthetic course for the homework tool's tests (tests/test_homework*.py), built in a
temporary folder: a git checkout with a copy of helpers/, homework/ and pytest.ini, the fixture labs 90 (two
exercises, no torch) and 91 (one exercise run on 2 ranks) with their public and hidden tests, a
notebook, README, run.sh and .instructor-only. Instructor only (listed in .instructor-only).
"""
from __future__ import annotations

import io
import json
import shutil
import subprocess
import tarfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
FIXTURES = Path(__file__).resolve().parent
BEGIN, END = "### BEGIN " + "SOLUTION", "### END " + "SOLUTION"


def notebook(cells: list[dict]) -> str:
    return json.dumps({"cells": cells, "metadata": {"kernelspec": {"name": "python3",
                       "display_name": "Python 3", "language": "python"}},
                       "nbformat": 4, "nbformat_minor": 5}, indent=1)


def make_course(folder: Path, labs: tuple[str, ...] = ("90",)) -> Path:
    root = folder / "course"
    for package in ("helpers", "homework"):
        shutil.copytree(REPO / package, root / package,
                        ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    shutil.copy(REPO / "pytest.ini", root / "pytest.ini")
    for sub in ("labs", "tests/public", "tests/hidden", "notebooks"):
        (root / sub).mkdir(parents=True, exist_ok=True)
    for package in ("labs", "tests", "tests/public", "tests/hidden"):
        (root / package / "__init__.py").write_text("")
    for lab in labs:
        shutil.copy(FIXTURES / f"lab{lab}_fixture.py", root / "labs" / f"lab{lab}_fixture.py")
        shutil.copy(FIXTURES / f"public_lab{lab}.py", root / "tests/public" / f"test_lab{lab}_fixture.py")
        if (FIXTURES / f"hidden_lab{lab}.py").exists():
            shutil.copy(FIXTURES / f"hidden_lab{lab}.py", root / "tests/hidden" / f"test_lab{lab}_fixture.py")
    (root / "notebooks" / "90_fixture.ipynb").write_text(notebook([
        {"cell_type": "markdown", "id": "a", "metadata": {}, "source": ["# Fixture notebook\n"]},
        {"cell_type": "code", "id": "b", "metadata": {"execution": {"x": 1}}, "execution_count": 3,
         "outputs": [{"output_type": "stream", "name": "stdout", "text": ["9\n"]}],
         "source": ["from labs.lab90_fixture import add_vectors\n", "print(add_vectors([1], [2]))\n"]}]))
    (root / "README.md").write_text("# Fixture course\n\nRun `./run.sh check`.\n")
    (root / "run.sh").write_text("#!/usr/bin/env bash\necho fixture\n")
    (root / "run.sh").chmod(0o755)
    (root / ".gitignore").write_text("/submissions/\n/runs/\n/grades/\n")
    shutil.copy(REPO / ".instructor-only", root / ".instructor-only")
    subprocess.run(["git", "init", "-q", str(root)], check=True)
    return root


def tar_with(path: Path, members: list[tuple[tarfile.TarInfo, bytes | None]]) -> Path:
    with tarfile.open(path, "w:gz") as tar:
        for info, data in members:
            if data is not None:
                info.size = len(data)
            tar.addfile(info, io.BytesIO(data) if data is not None else None)
    return path


def file_member(name: str, data: bytes) -> tuple[tarfile.TarInfo, bytes]:
    return tarfile.TarInfo(name), data


def submission(path: Path, labs: dict[str, bytes], student: str | None = None) -> Path:
    """A submission archive as `submit` writes it: labs, and a manifest naming `student`."""
    members = [file_member(f"labs/{name}", data) for name, data in labs.items()]
    if student is not None:
        members.append(file_member("manifest.json", json.dumps({"student": student}).encode()))
    return tar_with(path, members)
