"""The public API is what we mean to export (httpx's tests/test_exported_members.py)."""

import memfit


def test_all_is_what_we_export() -> None:
    exported = {name for name in dir(memfit) if not name.startswith("_")}
    expected = set(memfit.__all__) - {"__version__"}
    # every name in __all__ exists, and nothing public is left out of __all__ but submodules
    assert expected <= exported
    import types
    extra = {n for n in exported - expected
             if not isinstance(getattr(memfit, n), types.ModuleType)}
    assert extra == set()


def test_profile_and_watch_are_functions() -> None:
    # memfit.profile is the context manager, not the subpackage it lives in
    assert callable(memfit.profile) and callable(memfit.watch)
    import importlib

    assert importlib.import_module("memfit.profile.cpu").measure_cpu_peak
    assert callable(memfit.profile)  # importing the subpackage does not rebind the name


def test_fit_and_guard_are_functions() -> None:
    # memfit.fit / memfit.guard are the functions of issue 5, not their modules
    assert callable(memfit.fit) and callable(memfit.guard) and callable(memfit.find_batch_size)
    assert memfit.Plan.__module__ == "memfit.fit.plan"
