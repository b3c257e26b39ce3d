"""Test-run-wide setup: processes the tests start import this tree, and under CI a skipped
test fails the run.

The packages are installed in editable mode, pointing at whichever checkout installed them;
PYTHONPATH makes every `train.py`, torchrun worker and script the tests start import the
packages of the tree under test (a clone, or tests/mutation/run.py's mutated copy).

`./run_tests.sh` prints every skip with its reason in the short summary (`-ra` in
pyproject.toml's addopts). That is enough on a laptop, where a missing GPU or package is a
fine reason not to run something, but in CI a skip hides a test that never ran behind a
green run. So when the `CI` environment variable holds a true value (anything but "", "0",
"false", "no", "off"; CI services set CI=true), every skip - `pytest.skip`, a `skipif` mark,
`pytest.importorskip`, in a test, in a fixture or while collecting a module - is turned into
a failure whose message names the test and the skip's reason.

The CI machine (2-core CPU, no GPU, root, Debian, PyPI and the Debian mirrors reachable) can
run every test of this suite, so no skip is allowed there: CI_ALLOWED_SKIPS, the one place to
list exceptions, is empty. The SLURM test and the parity layouts may never be listed
(CI_NEVER_SKIP); pytest refuses to start if they are.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

os.environ["PYTHONPATH"] = str(Path(__file__).resolve().parent.parent)

pytest_plugins = [
    "pytester"
]  # tests/integration/test_slurm.py runs inner pytest runs to prove this

# Skips that are fine under CI: a test id ("tests/unit/test_x.py::test_y", which also covers its
# parametrizations) or a whole file ("tests/unit/test_x.py"), mapped to why CI cannot run it.
CI_ALLOWED_SKIPS: dict[str, str] = {}

# Files whose tests must run under CI, whatever CI_ALLOWED_SKIPS says.
CI_NEVER_SKIP = (
    "tests/integration/test_slurm.py",
    "tests/integration/test_parallel_parity.py",
    "tests/integration/test_pipeline_parity.py",
    "tests/integration/test_checkpoint_train.py",
)

_FALSE = {"", "0", "false", "no", "off"}


def ci_enabled() -> bool:
    return os.environ.get("CI", "").strip().lower() not in _FALSE


def _covers(key: str, nodeid: str) -> bool:
    return nodeid == key or nodeid.startswith((key + "::", key + "["))


def skip_allowed_in_ci(nodeid: str) -> bool:
    if any(_covers(path, nodeid) for path in CI_NEVER_SKIP):
        return False
    return any(_covers(key, nodeid) for key in CI_ALLOWED_SKIPS)


@pytest.hookimpl(trylast=True)  # after -k / -m deselection
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    # read back through tests/dist_utils.SELECTED_ITEMS; spelled out here because this file is
    # also copied alone into the inner pytest runs of tests/integration/test_slurm.py
    config.meshtrain_selected_items = list(items)
    by_module: dict = {}
    for item in items:
        if hasattr(item.module, "pool_runs"):
            by_module.setdefault(item.module, []).append(item)
    if by_module:
        from run_pool import Pool  # tests/run_pool.py: every train.py run of the test run

        pool = Pool(config._tmp_path_factory.mktemp("pool", numbered=False))
        for module, selected in by_module.items():
            pool.declare(module.__name__, module.pool_runs(selected))
        config.meshtrain_pool = pool
        if not config.option.collectonly:  # launching starts as the tests do, alongside them
            pool.start()


@pytest.fixture(scope="module")  # one pool for all: kept on the config
def pool(request):
    """The run pool of this pytest run (tests/run_pool.py), for runs a test makes as it runs."""
    from run_pool import Pool

    config = request.config
    if getattr(config, "meshtrain_pool", None) is None:
        config.meshtrain_pool = Pool(config._tmp_path_factory.mktemp("pool", numbered=False))
    return config.meshtrain_pool


@pytest.fixture(scope="module")
def quiet_pool(request):
    """No pool run alongside this module's tests (their deadlines assume an idle machine)."""
    pool = getattr(request.config, "meshtrain_pool", None)
    if pool is None:
        yield
        return
    with pool.quiet():
        yield


@pytest.fixture(scope="module")
def runs(request, pool):
    """The runs this module declares in `pool_runs`, by name, once all have finished."""
    return pool.wait(request.module.__name__)


def pytest_unconfigure(config: pytest.Config) -> None:
    pool = getattr(config, "meshtrain_pool", None)
    if pool is not None:
        pool.close()


# seconds per test file (setup, call and teardown of its tests), for the closing table
_FILE_SECONDS: dict[str, list[float]] = {}


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    entry = _FILE_SECONDS.setdefault(report.nodeid.split("::")[0], [0.0, 0])
    entry[0] += report.duration
    entry[1] += report.when == "call"


def pytest_terminal_summary(terminalreporter, config: pytest.Config) -> None:
    """Where the time went: every test file's seconds (a module's first test carries the wait
    for its runs), then what the run pool launched and de-duplicated."""
    if len(_FILE_SECONDS) > 1:
        terminalreporter.section("seconds per test file")
        total = sum(s for s, _ in _FILE_SECONDS.values())
        for path, (seconds, tests) in sorted(_FILE_SECONDS.items(), key=lambda x: -x[1][0]):
            terminalreporter.write_line(f"{seconds:8.1f} s {tests:5d} tests  {path}")
        terminalreporter.write_line(f"{total:8.1f} s in all")
    pool = getattr(config, "meshtrain_pool", None)
    if pool is not None:
        terminalreporter.write_line(pool.summary())


def pytest_configure(config: pytest.Config) -> None:
    banned = [k for k in CI_ALLOWED_SKIPS if any(_covers(p, k) for p in CI_NEVER_SKIP)]
    if banned:
        raise pytest.UsageError(
            f"tests/conftest.py: CI_ALLOWED_SKIPS lists {banned}, which must never skip in CI "
            f"(CI_NEVER_SKIP: {', '.join(CI_NEVER_SKIP)})"
        )


def _skip_reason(report: pytest.TestReport | pytest.CollectReport) -> str:
    longrepr = report.longrepr
    if isinstance(longrepr, tuple) and len(longrepr) == 3:  # (path, line, "Skipped: why")
        return str(longrepr[2]).removeprefix("Skipped: ")
    return str(longrepr)


def _fail_skip(node: pytest.Item | pytest.Collector, report) -> None:
    """Turns a skip report into a failure naming the test and the reason (CI only)."""
    if not report.skipped or hasattr(report, "wasxfail") or not ci_enabled():
        return
    if skip_allowed_in_ci(report.nodeid):
        return
    message = (
        f"{report.nodeid} skipped under CI={os.environ['CI']!r}: {_skip_reason(report)} "
        "(a skip fails CI: make it run there, or list it in CI_ALLOWED_SKIPS in tests/conftest.py)"
    )
    try:
        pytest.fail(message, pytrace=False)
    except pytest.fail.Exception:
        excinfo = pytest.ExceptionInfo.from_current()
    report.outcome = "failed"
    report.longrepr = node.repr_failure(excinfo)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo):
    report = yield
    _fail_skip(item, report)
    return report


@pytest.hookimpl(wrapper=True)
def pytest_make_collect_report(collector: pytest.Collector):
    report = yield
    _fail_skip(collector, report)
    return report
