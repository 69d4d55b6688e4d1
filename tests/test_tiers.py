"""The test tiers hold: a test without exactly one tier marker stops the collection, and a
``unit`` test that starts a process fails (``tiers.py``, wired in by ``conftest.py``)."""

from __future__ import annotations

import sys
import threading

import pytest

from tiers import GUARD, TIERS, SpawnGuard, tier_problems

pytestmark = pytest.mark.unit

MIXED = """
import pytest

pytestmark = pytest.mark.unit

def test_module_tier():
    pass

@pytest.mark.ray
def test_two_tiers():
    pass

@pytest.mark.parametrize("x", [1, 2])
def test_param(x):
    pass
"""


def test_the_tiers_are_the_markers_pyproject_declares(pytestconfig):
    declared = [line.split(":", 1)[0] for line in pytestconfig.getini("markers")]
    assert declared[:len(TIERS)] == list(TIERS)
    assert not set(declared[len(TIERS):]) & set(TIERS)


def test_each_test_without_exactly_one_tier_is_named(pytester):
    untiered = pytester.getitems(pytester.makepyfile(test_none="def test_nothing():\n    pass\n"))
    mixed = pytester.getitems(pytester.makepyfile(test_mixed=MIXED))
    assert tier_problems(untiered) == [f"{untiered[0].nodeid}: no tier"]
    assert [i.name for i in mixed] == ["test_module_tier", "test_two_tiers", "test_param[1]",
                                       "test_param[2]"]
    assert tier_problems(mixed) == [f"{mixed[1].nodeid}: ray + unit"]


def test_a_collection_with_an_untiered_test_is_refused_whatever_is_selected(pytester):
    pytester.makeconftest("from tiers import check_tiers\n\n"
                          "def pytest_collection_modifyitems(items):\n"
                          "    check_tiers(items)\n")
    pytester.makepyfile(test_a="import pytest\n\n@pytest.mark.unit\ndef test_one():\n    pass\n",
                        test_b="def test_forgotten():\n    pass\n")
    # -m unit would deselect the untiered test: the check sees the collection before that.
    result = pytester.runpytest("-m", "unit", "-p", "no:cacheprovider")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(["*1 test(s) need exactly one tier marker of unit, proc, dist, "
                                 "ray, gpu*", "*test_b.py::test_forgotten: no tier"])
    (pytester.path / "test_b.py").write_text("import pytest\n\n@pytest.mark.proc\n"
                                             "def test_forgotten():\n    pass\n")
    result = pytester.runpytest("-m", "unit", "-p", "no:cacheprovider")
    result.assert_outcomes(passed=1, deselected=1)


def test_the_guard_records_process_starts_between_begin_and_end_on_the_main_thread():
    guard = SpawnGuard()  # not installed: its events are fed by hand
    guard("subprocess.Popen", ("/bin/true", ["/bin/true", "-x"], None, None))
    guard.begin("t")
    guard("open", ("f", "r", 0))
    guard("subprocess.Popen", ("/bin/true", ["/bin/true", "-x"], None, None))
    guard("os.fork", ())
    side = threading.Thread(target=guard, args=("os.fork", ()))
    side.start()
    side.join()
    assert guard.end() == ["subprocess.Popen ['/bin/true', '-x']", "os.fork ()"]
    guard("os.fork", ())
    assert guard.end() == []


def test_a_unit_test_is_watched_by_the_installed_guard(request):
    # The event alone, as Popen would raise it before starting anything; then the guard is
    # handed back to this test, for the rest of it.
    sys.audit("os.posix_spawn", "/bin/true", ["/bin/true"], {})
    try:
        assert GUARD.test == request.node.nodeid
        assert GUARD.end() == ["os.posix_spawn ('/bin/true',)"]
    finally:
        GUARD.begin(request.node.nodeid)


def test_a_multiprocessing_start_is_seen_whatever_its_start_method(request):
    # spawn and forkserver raise no audit event of their own; the guard's wrapper of
    # Process.start does. The process is never started: its launcher fails first.
    import multiprocessing

    from tiers import MP_START

    seen = []
    try:
        for method in ("spawn", "forkserver", "fork"):
            proc = multiprocessing.get_context(method).Process(target=print)
            proc._Popen = lambda _p: (_ for _ in ()).throw(RuntimeError("not started"))
            with pytest.raises(RuntimeError, match="not started"):
                proc.start()
        seen = GUARD.end()
    finally:
        GUARD.begin(request.node.nodeid)
    assert seen == [f"{MP_START} ('spawn',)", f"{MP_START} ('forkserver',)",
                    f"{MP_START} ('fork',)"]
