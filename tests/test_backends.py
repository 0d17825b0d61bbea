"""Attention backends by name, always: every shipped name works in a fresh interpreter, whatever was imported.

Each shipped backend registers itself when its module is imported; `minillm.paged.backends.SHIPPED_BACKENDS` says
which module that is, so a name works before anyone imported it. A fresh interpreter (a subprocess) is the only way
to test that: in this one, other tests have imported most modules already. Each subprocess builds
`EngineConfig(attention_backend=name)` and, for the backends that need no C++ compiler, an `LLM` on
`tests/helpers.context_model`, and prints its greedy tokens; the default backend's are computed here, in this test.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from minillm.core.sampling import SamplingParams
from minillm.engine import LLM, EngineConfig
from minillm.engine.selective_cache import SelectiveKVCache
from minillm.paged.backends import (
    SHIPPED_BACKENDS,
    _BACKENDS,
    attention_backends,
    check_attention_backend,
    make_attention_backend,
    register_attention_backend,
    unregister_attention_backend,
)

from helpers import context_model, random_prompts

ROOT = Path(__file__).resolve().parent.parent
NEEDS_COMPILER = {"selective-cpp"}  # builds chapter 13's C++ extension
ENGINE = dict(num_blocks=32, block_size=4, max_num_seqs=4, max_num_batched_tokens=8)
PROMPT_LENGTHS = (9, 3, 14)
NEW_TOKENS = 6

# What each subprocess runs: nothing of minillm imported before the EngineConfig but the engine itself.
CHILD = f"""
import json, sys
sys.path.insert(0, "tests")
from minillm.engine import EngineConfig
name = sys.argv[1]
cfg = EngineConfig(attention_backend=name, **{ENGINE!r})
out = {{"config": cfg.attention_backend}}
if sys.argv[2] == "generate":
    from minillm.core.sampling import SamplingParams
    from minillm.engine import LLM
    from helpers import context_model, random_prompts
    llm = LLM(context_model("tiny"), None, cfg)
    prompts = random_prompts({len(PROMPT_LENGTHS)}, llm.model.config.vocab_size, {PROMPT_LENGTHS!r})
    params = SamplingParams(max_new_tokens={NEW_TOKENS}, temperature=0.0)
    out["cache"] = type(llm.runner.cache).__name__
    out["tokens"] = [o.output_token_ids for o in llm.generate(prompts, params)]
print(json.dumps(out))
"""


def run_fresh(name: str, mode: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", CHILD, name, mode], cwd=ROOT, capture_output=True, text=True,
                          timeout=300, env=env)


@pytest.fixture(scope="module")
def default_tokens() -> list[list[int]]:
    llm = LLM(context_model("tiny"), None, EngineConfig(**ENGINE))
    assert type(llm.runner.cache) is SelectiveKVCache
    prompts = random_prompts(len(PROMPT_LENGTHS), llm.model.config.vocab_size, PROMPT_LENGTHS)
    return [o.output_token_ids for o in llm.generate(prompts, SamplingParams(max_new_tokens=NEW_TOKENS,
                                                                              temperature=0.0))]


def test_every_shipped_name_is_listed_and_checked_without_importing_its_module():
    assert set(SHIPPED_BACKENDS) <= set(attention_backends())
    assert {"selective", "paged", "paged-reference", "verify", "paged-int8", "selective-cpp"} <= set(SHIPPED_BACKENDS)
    for name in SHIPPED_BACKENDS:
        assert check_attention_backend(name) == name


def test_every_registered_name_is_in_the_shipped_table_or_registered_by_a_test():
    """A backend registered by a minillm module without a row in the table would work only after that import."""
    import minillm.compile.cpu_paged  # noqa: F401  (registers "selective-cpp")
    import minillm.quant.kv_cache  # noqa: F401
    import minillm.speculative.verify_cache  # noqa: F401

    for name, factory in _BACKENDS.items():
        module = getattr(factory, "__module__", None) or factory.func.__module__  # a class, or a functools.partial
        if module.startswith("minillm."):
            assert SHIPPED_BACKENDS.get(name) == module, f"{module} registers {name!r} but the table says otherwise"


@pytest.mark.parametrize("name", sorted(SHIPPED_BACKENDS))
def test_a_shipped_backend_works_in_a_fresh_interpreter(name, default_tokens):
    mode = "config" if name in NEEDS_COMPILER else "generate"
    result = run_fresh(name, mode)
    assert result.returncode == 0, result.stderr
    out = json.loads(result.stdout)
    assert out["config"] == name
    if mode == "generate":
        assert out["tokens"] == default_tokens, f"{name} ({out['cache']}) gave other greedy tokens"


def test_a_backend_without_its_compiler_says_so_when_built_not_when_named(tmp_path):
    """No C++ compiler on the PATH: the name is still valid (listed, checked, EngineConfig), building it names the
    backend and what is missing."""
    env = {**os.environ, "PATH": str(tmp_path), "MINILLM_KERNELS_CACHE": str(tmp_path / "cache")}
    result = run_fresh("selective-cpp", "config", env=env)
    assert result.returncode == 0, result.stderr
    result = run_fresh("selective-cpp", "generate", env=env)
    assert result.returncode != 0
    assert "attention backend 'selective-cpp' cannot be built" in result.stderr
    assert "no C++ compiler" in result.stderr


# ---------------------------------------------------------------------------------------------- user backends


class ToyKVCache(SelectiveKVCache):
    """A user backend: the default cache under another name."""


def test_register_and_unregister_a_user_backend():
    register_attention_backend("toy", ToyKVCache)
    try:
        assert "toy" in attention_backends()
        assert isinstance(make_attention_backend("toy", context_model("tiny").config, 8, 4), ToyKVCache)
        register_attention_backend("toy", ToyKVCache)  # the same factory again is fine
        with pytest.raises(ValueError, match="'toy' is already registered"):
            register_attention_backend("toy", SelectiveKVCache)
    finally:
        unregister_attention_backend("toy")
    assert "toy" not in attention_backends()
    with pytest.raises(ValueError, match="unknown attention backend 'toy'"):
        make_attention_backend("toy", context_model("tiny").config, 8, 4)


def test_a_shipped_name_is_taken_before_its_module_is_imported():
    """Registering "paged-int8" imports chapter 09's module first, so the clash is this call's error."""
    with pytest.raises(ValueError, match="'paged-int8' is already registered"):
        register_attention_backend("paged-int8", ToyKVCache)
    with pytest.raises(TypeError, match="non-empty str"):
        register_attention_backend("", ToyKVCache)
    with pytest.raises(TypeError, match="callable"):
        register_attention_backend("toy", 3)
