"""The fuzz stage (``make fuzz-core``): the core's hypothesis properties, randomized, within a wall-clock budget.

Loaded with ``-p tests.fuzz_plugin`` under ``HYPOTHESIS_PROFILE=fuzz-core``; the ``ci`` profile (derandomized,
the same examples every run) stays the regression suite, and this stage looks for new failures:

* only ``@given`` tests run, in an order shuffled by the seed; ``--fuzz-shard=I/N`` keeps every N-th of
  them, so N processes split the work;
* each property runs in rounds of the profile's ``max_examples``, round ``r`` of a run with ``--fuzz-seed=S``
  seeded ``S + r`` (``hypothesis.seed``), until its share of ``--fuzz-seconds`` is spent: the time left
  divided by the properties left, so a slow property's overrun comes out of the others' shares. Each runs
  at least one round while time is left; once the budget is spent (a loaded machine), the rest are skipped
  as such, and the shuffle makes them others next run;
* the summary lists each property's examples, rounds and seconds; a failure adds the failing example
  (hypothesis prints it) and the one command that reproduces it: the profile, ``--hypothesis-seed`` of the
  failing round (the same ``Random(seed)`` as ``hypothesis.seed``) and the test id. The profile keeps no
  example database, so that command depends on nothing else. A failure found here is pinned as an
  ``@example`` or a named test in the commit that fixes it.
"""

from __future__ import annotations

import functools
import os
import random
import shlex
import sys
import time

import attrs
import pytest
from hypothesis import is_hypothesis_test, settings
from hypothesis import seed as seed_test

PROFILE = "fuzz-core"


@attrs.define
class Fuzzed:
    """What one property's rounds did."""

    nodeid: str
    examples: int = 0
    rounds: int = 0
    seconds: float = 0.0
    seed: int | None = None  # the last round's, the failing one when it failed
    failed: bool = False


def pytest_addoption(parser):
    group = parser.getgroup("fuzz-core")
    group.addoption("--fuzz-seed", type=int, required=True, help="round r of each property is seeded SEED + r")
    group.addoption("--fuzz-seconds", type=float, required=True, help="this process's wall-clock budget")
    group.addoption("--fuzz-shard", default="0/1", help="I/N: keep every N-th property, from the I-th")


def pytest_configure(config):
    if os.environ.get("HYPOTHESIS_PROFILE") != PROFILE:
        raise pytest.UsageError(f"tests.fuzz_plugin runs under HYPOTHESIS_PROFILE={PROFILE} (see tests/conftest.py)")
    config.fuzzed = {}


def reproduce_command(config, fuzzed: Fuzzed) -> str:
    """The shell command that replays ``fuzzed``'s failing round, and nothing else."""
    root = str(config.rootpath)
    pytest_args = ["-m", "pytest", "-p", "no:cacheprovider", f"--hypothesis-seed={fuzzed.seed}", fuzzed.nodeid]
    command = [f"HYPOTHESIS_PROFILE={PROFILE}", f"PYTHONPATH={root}", sys.executable, *pytest_args]
    return f"cd {shlex.quote(root)} && " + " ".join(shlex.quote(part) for part in command)


@attrs.define
class Clock:
    """Shares what is left of the budget among the properties not yet run."""

    deadline: float
    left: int

    def share(self) -> float:
        return max(0.0, self.deadline - time.monotonic()) / max(1, self.left)

    def done(self) -> None:
        self.left -= 1


_running: list[Fuzzed] = []  # the property whose round is running: the example counter adds to it


def count_examples(test) -> None:
    """Count ``test``'s examples into whichever property is running (parametrized items share one function)."""
    inner = test.hypothesis.inner_test
    if getattr(inner, "counts_fuzz_examples", False):
        return

    @functools.wraps(inner)
    def counted(*args, **kwargs):
        _running[-1].examples += 1
        return inner(*args, **kwargs)

    counted.counts_fuzz_examples = True
    test.hypothesis.inner_test = counted  # hypothesis's documented hook for wrapping each example


def in_rounds(item, fuzzed: Fuzzed, first_seed: int, clock: Clock) -> None:
    """Replace ``item``'s test with rounds of it, each freshly seeded, until its share of ``clock`` is spent."""
    test = item.obj
    count_examples(test)

    @functools.wraps(test)
    def rounds(*args, **kwargs):
        started = time.monotonic()
        budget = clock.share()
        if budget <= 0:
            clock.done()
            pytest.skip("fuzz-core: the budget was spent before this property's turn")
        _running.append(fuzzed)
        try:
            while True:
                fuzzed.seed = first_seed + fuzzed.rounds
                seed_test(fuzzed.seed)(test)
                fuzzed.rounds += 1
                test(*args, **kwargs)
                if time.monotonic() - started >= budget:
                    return
        finally:
            _running.pop()
            fuzzed.seconds = time.monotonic() - started
            clock.done()

    item.obj = rounds


def pytest_collection_modifyitems(session, config, items):
    index, count = (int(part) for part in config.getoption("fuzz_shard").split("/"))
    properties = [item for item in items if is_hypothesis_test(getattr(item, "obj", None))]
    first_seed = config.getoption("fuzz_seed")
    random.Random(first_seed).shuffle(properties)
    kept = properties[index::count]
    config.hook.pytest_deselected(items=[item for item in items if item not in kept])
    items[:] = kept
    seconds = config.getoption("fuzz_seconds")
    clock = Clock(deadline=time.monotonic() + seconds, left=len(kept))
    for item in kept:
        config.fuzzed[item.nodeid] = Fuzzed(item.nodeid)
        in_rounds(item, config.fuzzed[item.nodeid], first_seed, clock)
    reporter = config.pluginmanager.get_plugin("terminalreporter")
    if reporter is not None:
        reporter.write_line(
            f"fuzz-core: seed {first_seed}, shard {index}/{count}: {len(kept)} properties "
            f"sharing {seconds:.0f} s, rounds of {settings.default.max_examples} examples"
        )


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    fuzzed = item.config.fuzzed.get(item.nodeid)
    if fuzzed is not None and report.when == "call" and report.failed:
        fuzzed.failed = True
        report.sections.append(("fuzz-core: reproduce with", reproduce_command(item.config, fuzzed)))


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    ran = [fuzzed for fuzzed in config.fuzzed.values() if fuzzed.rounds]
    if not ran:
        return
    terminalreporter.section("fuzz-core: examples per property")
    for fuzzed in ran:
        state = f"FAILED in round seeded {fuzzed.seed}" if fuzzed.failed else "passed"
        terminalreporter.write_line(
            f"{fuzzed.examples:7d} examples {fuzzed.rounds:4d} rounds {fuzzed.seconds:6.1f} s  {fuzzed.nodeid}  {state}"
        )
    total = sum(fuzzed.examples for fuzzed in ran)
    terminalreporter.write_line(f"{total} examples over {len(ran)} properties")
    for fuzzed in ran:
        if fuzzed.failed:
            terminalreporter.write_line(f"reproduce {fuzzed.nodeid}:\n  {reproduce_command(config, fuzzed)}")
