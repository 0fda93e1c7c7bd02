"""Loading the user's reward function: `[trainer] reward_function` / `[reward] function`, "module:function".

    load_function(spec) -> RewardFn       # RewardFunctionError: a configuration error, found before training

Split from rewards.py (which re-exports every name here); `_is_signal` is shared with the in-process batch.
"""

from __future__ import annotations

import importlib
import os
import sys
import sysconfig
import threading
import traceback
from collections.abc import Callable
from typing import Any

RewardFn = Callable[..., list[float]]


def _is_signal(e: BaseException) -> bool:
    """Whether `e` is a signal that stops the process rather than the function's own raise: Ctrl-C's
    KeyboardInterrupt, or common/signals.py's Terminated (SIGTERM; it carries `signum`), in the main thread, where
    Python delivers them. Any other BaseException (sys.exit, func_timeout's FunctionTimedOut, a KeyboardInterrupt a
    reward server's worker thread raised) is the function's failure: the step's error, or the item's ok=false."""
    return threading.current_thread() is threading.main_thread() and (
        isinstance(e, KeyboardInterrupt) or isinstance(getattr(e, "signum", None), int))


class RewardFunctionError(ValueError):
    """reward_function names no function that can be imported: a configuration error, found before training."""


def load_function(spec: str) -> RewardFn:
    """'package.module:function' -> the function (the user's reward). The module is imported from the Python path,
    else from the current directory: `python -m tlt.cli` puts that directory on the path, the `tlt` script does not,
    and a reward file beside the config should be found either way."""
    module_name, _, attr = spec.partition(":")
    if not module_name or not attr:
        raise RewardFunctionError(f"reward function {spec!r} must look like 'module:function'")
    if module_name.endswith(".py") or "/" in module_name or os.sep in module_name:
        raise RewardFunctionError(_file_given(spec, module_name, attr))
    module = _import_user_module(spec, module_name)
    fn = getattr(module, attr, None)
    if not callable(fn):
        raise RewardFunctionError(f"{spec!r}: {module_name} has no callable {attr!r}{_shadowed(module_name, module)}")
    return fn


def _file_given(spec: str, path: str, attr: str) -> str:
    """The hint for a file path where a module name belongs (verl's custom_reward_function.path habit)."""
    p = os.path.abspath(path if path.endswith(".py") else path + ".py")
    name = os.path.splitext(os.path.basename(p))[0]
    folder = os.path.dirname(p)
    where = ("" if folder == os.getcwd() else
             f", with {folder} on PYTHONPATH (or run from there: the current directory is searched)")
    return (f"reward function {spec!r} names a file; give its module name: '{name}:{attr}'{where}")


def _shadowed(name: str, module: Any) -> str:
    """What to say when `name` is another module than the user's file: the standard library's `test` or `math`
    (found first on the path: the current directory comes last), or an installed package."""
    top = name.split(".")[0]
    file = getattr(module, "__file__", None)
    mine = os.path.join(os.getcwd(), top + ".py")
    stdlib = sysconfig.get_paths()["stdlib"]
    in_stdlib = file is None or (file.startswith(stdlib) and "site-packages" not in file) or (
        top in sys.stdlib_module_names)
    if not in_stdlib and not (os.path.exists(mine) and os.path.abspath(file or "") != mine):
        return ""
    what = "the standard library's module" if in_stdlib else "an installed module"
    yours = f" instead of your {mine}" if os.path.exists(mine) else ""
    return (f": {name} is {what} ({file or 'built in'}), imported{yours}; rename your file "
            f"(e.g. my_{top}.py) and the spec with it")


def _import_user_module(spec: str, name: str) -> Any:
    def missing(e: ModuleNotFoundError) -> bool:  # the module itself (or its package), not something it imports
        return e.name is not None and (name == e.name or name.startswith(e.name + "."))

    try:
        return _user_import(spec, name)
    except ModuleNotFoundError as e:
        if not missing(e):
            raise RewardFunctionError(_import_failed(spec, name, e)) from None
    cwd = os.getcwd()
    if cwd not in sys.path and "" not in sys.path:
        sys.path.append(cwd)  # last: the directory never shadows an installed package
        try:
            return _user_import(spec, name)
        except ModuleNotFoundError as e:
            if not missing(e):
                raise RewardFunctionError(_import_failed(spec, name, e)) from None
    raise RewardFunctionError(
        f"reward_function {spec!r}: no module {name!r} on the Python path or in the current directory {cwd}; "
        f"put {name.replace('.', '/')}.py there or add its folder to PYTHONPATH")


def _user_import(spec: str, name: str) -> Any:
    """Import the user's module; what its own code raises (a syntax error, a failing import of its own, an
    exception at module level) is a RewardFunctionError naming the file and line, one line for the CLI instead of
    the traceback of our import machinery. ModuleNotFoundError passes through: the caller tells whether the
    module itself is missing (look in the current directory) or something it imports."""
    argv = sys.argv
    sys.argv = [name]  # a module that parses arguments at import (argparse) must not read tlt's own as its
    try:
        return importlib.import_module(name)
    except ModuleNotFoundError:
        raise
    except BaseException as e:  # noqa: BLE001 - anything the user's module-level code raises; sys.exit too
        if _is_signal(e):
            raise
        raise RewardFunctionError(_import_failed(spec, name, e)) from None
    finally:
        sys.argv = argv


def _import_failed(spec: str, name: str, e: BaseException) -> str:
    """"reward function 'm:f': importing m failed at m.py:2: SyntaxError: '[' was never closed"."""
    if isinstance(e, SyntaxError) and e.filename:
        where = f"{e.filename}:{e.lineno}"
        what = f"{type(e).__name__}: {e.msg}"
    else:
        frames = traceback.extract_tb(e.__traceback__)
        stdlib = sysconfig.get_paths()["stdlib"]  # argparse's exit, json's error: the user's line that called it
        user = [f for f in frames if "importlib" not in f.filename and not f.filename.startswith(stdlib)]
        where = f"{user[-1].filename}:{user[-1].lineno}" if user else name
        what = f"{type(e).__name__}: {e}"
        if isinstance(e, SystemExit):  # argparse's error, or an explicit exit: run only under __main__
            return (f"reward function {spec!r}: {name} exited while being imported ({what}) at {where}; code that "
                    "parses arguments or exits belongs under `if __name__ == \"__main__\":`")
    return f"reward function {spec!r}: importing {name} failed at {where}: {what}"
