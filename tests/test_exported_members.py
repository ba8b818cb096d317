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


def test_each_name_means_one_thing() -> None:
    # No public name is also a submodule: importing every submodule (which binds each on
    # memfit, importlib._bootstrap._find_and_load_unlocked) leaves every public name as it was.
    import importlib
    import pkgutil

    modules = {m.name for m in pkgutil.iter_modules(memfit.__path__)}
    assert modules & set(memfit.__all__) == set()
    before = {name: getattr(memfit, name) for name in memfit.__all__}
    for info in pkgutil.walk_packages(memfit.__path__, "memfit."):
        try:
            importlib.import_module(info.name)
        except ImportError as exc:  # an optional extra (lightning) that is not installed
            assert "pip install" in str(exc), exc
    assert {name: getattr(memfit, name) for name in memfit.__all__} == before


def test_profile_and_watch_are_functions() -> None:
    assert callable(memfit.profile) and callable(memfit.watch)


def test_fit_and_guard_are_functions() -> None:
    assert callable(memfit.fit) and callable(memfit.guard) and callable(memfit.find_batch_size)
    assert memfit.Plan.__module__ == "memfit.fitting.plan"
