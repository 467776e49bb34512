"""The wheel a user installs: built offline, it ships every module, and installed outside the clone each
module imports or names the extra it needs, with each extra's packages missing in turn; its console scripts run.

On 3.12 only (one build per ``make test``, whose 3.10 suite runs beside it). The build runs on a temporary copy
of the tree: an in-tree build writes ``build/`` and ``*.egg-info``, which the other suite would race.
"""

from __future__ import annotations

import functools
import json
import os
import shutil
import subprocess
import sys
import zipfile
from email.parser import Parser
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("prefill_core", "prefill_shell")
SHELL_WITHOUT_TORCH = ("prefill_shell", "prefill_shell.console", "prefill_shell.extras")
"""The shell's modules that import without the ``shell`` extra, so a console script can name it in one line."""
PRELOAD = ("torch",)  # the one import that costs seconds: the child imports it once for every run that keeps it

pytestmark = pytest.mark.skipif(sys.version_info[:2] != (3, 12), reason="the wheel is built and checked on 3.12 only")


def outside_env(**extra: str) -> dict[str, str]:
    """The environment without PYTHONPATH (the clone) and without an index: nothing but the wheel is found."""
    env = {key: value for key, value in os.environ.items() if key != "PYTHONPATH"}
    env.update(PIP_NO_INDEX="1", PYTHONDONTWRITEBYTECODE="1", **extra)
    return env


def run(command: list, cwd: Path, **extra: str) -> subprocess.CompletedProcess:
    done = subprocess.run(command, cwd=cwd, env=outside_env(**extra), capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, f"{command} exited {done.returncode}:\n{done.stdout}\n{done.stderr}"
    return done


def source_files() -> list[str]:
    """Every file of the two packages in the source tree, as wheel paths (caches excluded)."""
    files = []
    for package in PACKAGES:
        for path in (ROOT / package).rglob("*"):
            if path.is_file() and "__pycache__" not in path.parts and path.suffix != ".pyc":
                files.append(path.relative_to(ROOT).as_posix())
    return sorted(files)


@pytest.fixture(scope="module")
def work(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("wheel")


@pytest.fixture(scope="module")
def wheel(work: Path) -> Path:
    """``pip wheel --no-deps --no-build-isolation`` of a copy of the tree, offline."""
    tree = work / "tree"
    tree.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy2(ROOT / name, tree / name)
    for package in PACKAGES:
        shutil.copytree(ROOT / package, tree / package, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    pip = [sys.executable, "-m", "pip", "-q", "--disable-pip-version-check"]
    run([*pip, "wheel", "--no-deps", "--no-build-isolation", "-w", str(work / "dist"), str(tree)], cwd=work)
    (built,) = (work / "dist").glob("*.whl")
    return built


@pytest.fixture(scope="module")
def target(work: Path, wheel: Path) -> Path:
    """The wheel installed with ``--no-deps`` into a scratch directory (its console scripts under ``bin/``)."""
    installed = work / "target"
    pip = [sys.executable, "-m", "pip", "-q", "--disable-pip-version-check"]
    run([*pip, "install", "--no-deps", "--no-compile", "--target", str(installed), str(wheel)], cwd=work)
    return installed


def wheel_metadata(wheel: Path):
    with zipfile.ZipFile(wheel) as archive:
        (name,) = (n for n in archive.namelist() if n.endswith(".dist-info/METADATA"))
        return Parser().parsestr(archive.read(name).decode())


@functools.cache
def import_names(dist_name: str) -> frozenset[str]:
    """The top-level modules an installed distribution provides (none where it is not installed here).

    Its ``top_level.txt`` where it has one, else the first component of the ``.py`` and ``.so`` paths in its
    RECORD (read as text: building torch's 15,000 ``PackagePath`` objects takes seconds).
    """
    from importlib.metadata import PackageNotFoundError, distribution

    try:
        dist = distribution(dist_name)
    except PackageNotFoundError:
        return frozenset()
    listed = dist.read_text("top_level.txt")
    if listed is not None:
        return frozenset(listed.split())
    paths = (line.partition(",")[0] for line in (dist.read_text("RECORD") or "").splitlines())
    tops = {path.split("/")[0] for path in paths if path.endswith((".py", ".so")) and not path.startswith("..")}
    return frozenset(top.partition(".")[0] for top in tops if not top.endswith((".dist-info", ".data")))


def refused_by_extra(wheel: Path) -> dict[str, set[str]]:
    """Each extra of the wheel's metadata -> the top-level import names of the packages it installs here.

    ``prefill-runtime[other]`` lines are expanded; a line whose marker excludes this Python installs nothing.
    """
    from packaging.requirements import Requirement
    from packaging.utils import canonicalize_name

    meta = wheel_metadata(wheel)
    own = canonicalize_name(meta["Name"])
    requirements = [Requirement(line) for line in meta.get_all("Requires-Dist")]

    def installs(extra: str) -> set[str]:
        names: set[str] = set()
        for req in requirements:
            if req.marker is None or not req.marker.evaluate({"extra": extra}):
                continue
            if canonicalize_name(req.name) == own:
                names |= set().union(*(installs(other) for other in req.extras))
            else:
                names |= import_names(req.name)
        return names

    return {extra: installs(extra) for extra in meta.get_all("Provides-Extra")}


def module_names(wheel: Path) -> list[str]:
    """Every module the wheel ships; ``__main__`` modules run a command when imported, so ``--help`` covers them."""
    with zipfile.ZipFile(wheel) as archive:
        paths = [n for n in archive.namelist() if n.endswith(".py") and not n.endswith("__main__.py")]
    return sorted(p[: -len(".py")].removesuffix("/__init__").replace("/", ".") for p in paths)


def test_wheel_ships_every_file_of_both_packages(wheel: Path):
    """The wheel holds exactly the source tree's files of prefill_core and prefill_shell, plus its dist-info."""
    with zipfile.ZipFile(wheel) as archive:
        shipped = sorted(n for n in archive.namelist() if not n.split("/", 1)[0].endswith(".dist-info"))
    assert shipped == source_files()


def test_every_module_imports_or_names_the_extra_it_needs(wheel: Path, target: Path, work: Path):
    """Installed outside the clone, each module imports with each extra's packages refused, or says which extra.

    prefill_core imports with every extra missing; without ``shell`` no prefill_shell module imports but the
    three ``SHELL_WITHOUT_TORCH`` names.
    """
    refused = refused_by_extra(wheel)
    modules = module_names(wheel)
    child = work / "wheel_imports.py"
    shutil.copy2(Path(__file__).with_name("wheel_imports.py"), child)
    spec = {"target": str(target), "modules": modules, "preload": PRELOAD, "runs": {"none": []}}
    spec["runs"].update({extra: sorted(names) for extra, names in refused.items()})
    results = json.loads(run([sys.executable, "-I", str(child), json.dumps(spec)], cwd=work).stdout)

    problems = []
    for label, result in results.items():
        for module, error in result["imports"].items():
            if error is None:
                continue
            missing = (error["missing"] or "").partition(".")[0]
            extras = sorted(extra for extra, names in refused.items() if missing in names)
            named = any(f"prefill-runtime[{extra}]" in error["message"] for extra in extras)
            if label == "none" or module.startswith("prefill_core") or not named:
                problems.append(f"without {label!r}: {module}: {error['type']}: {error['message']}")
    assert not problems, "\n".join(problems)
    files = results["none"]["files"]
    assert sorted(files) == modules
    assert all(Path(file).is_relative_to(target) for file in files.values()), files
    shell_failed = {module for module, error in results["shell"]["imports"].items() if error is not None}
    light = set(SHELL_WITHOUT_TORCH)  # the package root (its re-exports load on use) and what the scripts need
    assert shell_failed == {module for module in modules if module.startswith("prefill_shell")} - light


def test_console_scripts_run_help_from_outside_the_clone(target: Path, work: Path):
    """Every console script of pyproject.toml is installed and answers ``--help`` (all at once: each imports torch)."""
    import tomllib

    scripts = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
    assert sorted(path.name for path in (target / "bin").iterdir()) == sorted(scripts)
    env = outside_env(PYTHONPATH=str(target))
    running = {
        name: subprocess.Popen(
            [str(target / "bin" / name), "--help"], cwd=work, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE
        )
        for name in scripts
    }
    for name, process in running.items():
        out, err = (stream.decode() for stream in process.communicate(timeout=300))
        assert process.returncode == 0, f"{name} --help exited {process.returncode}:\n{out}\n{err}"
        assert "usage" in out.lower(), f"{name} --help printed:\n{out}"


def test_console_scripts_without_an_extra_say_so_in_one_line(wheel: Path, target: Path, work: Path):
    """Each console script's ``--help`` with each extra's packages refused: it answers, or it prints one
    ``error:`` line naming an extra those packages come from and its ``pip install`` line, and exits 2.

    The installed script file itself runs (``runpy``), after the wheel test's finder refuses the names, so the
    import its wrapper makes comes first, as on a machine without them. Those that need torch must say so.
    """
    import tomllib

    scripts = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
    refused = refused_by_extra(wheel)
    shutil.copy2(Path(__file__).with_name("wheel_imports.py"), work / "wheel_imports.py")
    env = outside_env(PYTHONPATH=str(target))
    running = {}
    for name in scripts:
        script = str(target / "bin" / name)
        for extra, names in refused.items():
            child = (
                f"import runpy, sys; sys.path.insert(0, {str(work)!r}); from wheel_imports import Refuse; "
                f"sys.meta_path.insert(0, Refuse({sorted(names)!r})); sys.argv = [{script!r}, '--help']; "
                f"runpy.run_path({script!r}, run_name='__main__')"
            )
            running[name, extra] = subprocess.Popen(
                [sys.executable, "-c", child], cwd=work, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE
            )
    failed = {}
    for (name, extra), process in running.items():
        out, err = (stream.decode() for stream in process.communicate(timeout=300))
        if process.returncode == 0:
            assert "usage" in out.lower(), f"{name} without {extra!r}: --help printed:\n{out}"
            continue
        lines = err.strip().splitlines()
        assert process.returncode == 2 and len(lines) == 1, (
            f"{name} without {extra!r}: exit {process.returncode}:\n{err}"
        )
        (line,) = lines
        named = [e for e, names in refused.items() if f"prefill-runtime[{e}]" in line]
        assert line.startswith("error: ") and "pip install" in line and "Traceback" not in err, line
        assert any(refused[e] & refused[extra] for e in named), (name, extra, line)  # an extra the refused names are in
        failed[name, extra] = line
    needs_torch = [name for name, entry in scripts.items() if entry.startswith("prefill_shell")]
    assert needs_torch and all((name, "shell") in failed for name in needs_torch), failed
    assert ("prefill-lm-eval", "lm-eval") in failed, failed


def test_the_wheel_metadata_keeps_ttnn_and_its_numpy_pin_out_of_the_shell_extra(wheel: Path):
    """In the wheel's metadata, ``[shell]`` asks for torch, numpy (2 allowed) and safetensors and no ttnn on 3.10 or
    3.12; ``[tt]`` asks for the shell, ttnn and numpy < 2 there."""
    from packaging.requirements import Requirement

    meta = wheel_metadata(wheel)
    assert {"shell", "tt"} <= set(meta.get_all("Provides-Extra"))
    requirements = [Requirement(line) for line in meta.get_all("Requires-Dist")]
    for python in ("3.10", "3.12"):

        def asked(extra: str) -> list[Requirement]:
            env = {"extra": extra, "python_version": python}
            return [r for r in requirements if r.marker is not None and r.marker.evaluate(env)]

        shell, tt = asked("shell"), asked("tt")
        assert {r.name for r in shell} == {"torch", "numpy", "safetensors"}, [str(r) for r in shell]
        assert all(r.specifier.contains("2.2.0") for r in shell if r.name == "numpy")
        assert "ttnn" in {r.name for r in tt} and any(r.name == "prefill-runtime" and r.extras == {"shell"} for r in tt)
        assert any(not r.specifier.contains("2.2.0") for r in tt if r.name == "numpy")
