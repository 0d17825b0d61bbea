"""Other implementations of the engine's forward, by name: a wrapper with GPT's interface that the engine runs
instead of the model itself.

What it adds: `step_model(name, model)` returns `model` wrapped by the implementation registered as `name`, and
`register_step_model(name, factory)` adds one. Chapter 13 ships "fused-cpp" (`minillm.compile.fused_engine`: each
short step of the engine one C++ call over the paged pools, the rest of the model's linears in C++ too). As with the
attention backends (`minillm.paged.backends`), a shipped name imports the module that registers it on first use,
so an earlier chapter's benchmark can run on a later chapter's implementation, picked by name, without importing
it. The wrapper must give the model's own tokens: the engine checks nothing more than GPT's interface.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any

SHIPPED_STEP_MODELS: dict[str, str] = {"fused-cpp": "minillm.compile.fused_engine"}  # name -> registering module
_FACTORIES: dict[str, Callable[[Any], Any]] = {}


def _check_registration(name: Any, factory: Any) -> None:
    """Both registration functions' argument checks, before any lookup: a name that is not a non-empty str (a list
    would fail the dict lookup as "unhashable type", naming nothing) or a factory that is not callable (it would
    replace a working one and fail only at the next `step_model`, as "'int' object is not callable") is a
    TypeError naming the argument."""
    if not isinstance(name, str) or not name:
        raise TypeError(f"name must be a non-empty str, got {name!r}")
    if not callable(factory):
        raise TypeError(f"factory must be callable (model -> wrapped model), got {type(factory).__name__}")


def register_step_model(name: str, factory: Callable[[Any], Any]) -> None:
    """Register `factory(model) -> wrapped model` as `name` (a non-empty str, not yet registered, and not one of
    SHIPPED_STEP_MODELS: those are registered by their own modules, `register_shipped_step_model`)."""
    _check_registration(name, factory)
    if name in SHIPPED_STEP_MODELS:  # it would shadow the shipped one, whose module then could not register it
        raise ValueError(f"step model {name!r} is shipped by {SHIPPED_STEP_MODELS[name]}, which registers it on first "
                         "use; pick another name")
    if name in _FACTORIES:
        raise ValueError(f"step model {name!r} is already registered")
    _FACTORIES[name] = factory


def register_shipped_step_model(name: str, factory: Callable[[Any], Any]) -> None:
    """What a module of SHIPPED_STEP_MODELS calls when it is imported. Registering again replaces the factory:
    `python -m minillm.compile.fused_engine` runs that module as `__main__`, and a later `step_model` imports it
    once more under its own name. The arguments are checked as `register_step_model` checks them."""
    _check_registration(name, factory)
    if name not in SHIPPED_STEP_MODELS:
        raise ValueError(f"{name!r} is not a shipped step model ({sorted(SHIPPED_STEP_MODELS)}); use "
                         "register_step_model")
    _FACTORIES[name] = factory


def step_model_names() -> list[str]:
    """Every name `step_model` takes: the shipped ones and any registered since."""
    return sorted({*SHIPPED_STEP_MODELS, *_FACTORIES})


def step_model(name: str, model: Any) -> Any:
    """`model` wrapped by the implementation registered as `name` (its module imported on first use); a ValueError
    naming the known names for any other."""
    if not isinstance(name, str):
        raise TypeError(f"step model must be a name (str), one of {step_model_names()}, got {type(name).__name__}")
    if name not in _FACTORIES and name in SHIPPED_STEP_MODELS:
        importlib.import_module(SHIPPED_STEP_MODELS[name])
    if name not in _FACTORIES:
        raise ValueError(f"step model must be one of {step_model_names()}, got {name!r}")
    return _FACTORIES[name](model)
