"""`--function` / `reward_function` given as a file path, or naming a module the standard library shadows: the
error says what to write instead (before: "put myrewards/py.py there"; "test has no callable 'reward'" without
saying that the standard library's `test` was imported). `load_function` on real files in a temp folder."""

from __future__ import annotations

import pytest

from tlt.services.trainer.rewards import RewardFunctionError, load_function


@pytest.fixture
def folder(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "myrewards_spec.py").write_text("def ok(prompts, completions, **kw):\n    return [1.0]\n")
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "myrewards_spec.py").write_text("def ok(prompts, completions, **kw):\n    return [1.0]\n")
    (tmp_path / "test.py").write_text("def reward(prompts, completions, **kw):\n    return [1.0]\n")
    return tmp_path


@pytest.mark.parametrize("spec", ["myrewards_spec.py:ok", "{folder}/other/myrewards_spec.py:ok", "./myrewards_spec.py:ok"])
def test_a_file_path_is_answered_with_the_module_name_to_use(folder, spec) -> None:
    with pytest.raises(RewardFunctionError) as e:
        load_function(spec.format(folder=folder))
    says = str(e.value)
    assert "'myrewards_spec:ok'" in says and "module name" in says and "/py.py" not in says, says
    if "{folder}" in spec:
        assert str(folder / "other") in says and "PYTHONPATH" in says, says


def test_a_module_the_standard_library_shadows_is_named_so(folder) -> None:
    with pytest.raises(RewardFunctionError) as e:
        load_function("test:reward")
    says = str(e.value)
    assert "standard library" in says and "rename" in says and str(folder / "test.py") in says, says


def test_a_package_module_in_the_current_directory_is_found(tmp_path, monkeypatch) -> None:
    """"pkg.mod:f" with the package in the current directory, not on the path (the `tlt` script's case): the failed
    import names the package, not the module, and that too means "look in the current directory"; before, it was
    taken for an import inside the user's module and reported as its failure."""
    import sys

    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", str(tmp_path))])
    (tmp_path / "mypkg_spec").mkdir()
    (tmp_path / "mypkg_spec" / "__init__.py").write_text("")
    (tmp_path / "mypkg_spec" / "scoring.py").write_text("def reward(prompts, completions, **kw):\n    return [2.0]\n")
    for name in ("mypkg_spec", "mypkg_spec.scoring"):
        monkeypatch.delitem(sys.modules, name, raising=False)
    try:
        fn = load_function("mypkg_spec.scoring:reward")
    finally:
        for name in ("mypkg_spec.scoring", "mypkg_spec"):
            sys.modules.pop(name, None)
    assert fn(["p"], ["c"]) == [2.0]
