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
