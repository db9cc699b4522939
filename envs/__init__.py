"""Environments for the rollout farm: API, registry, tool calling, wrappers, built-ins.

Public surface::

    import envs
    env = envs.make('toy@{"difficulty": 0}')          # EnvSpecError on unknown name / bad kwargs
    envs.registered(); envs.register(name, factory)
    envs.check_spec(spec)                             # the same checks as make, nothing built
    obs, info = await envs.areset(env, seed=123)      # sync and async envs alike
    obs, reward, terminated, truncated, info = await envs.astep(env, action_text)
    await envs.aclose(env)

Optional attributes of an environment: ``system_prompt``, ``tools`` (OpenAI tool
schemas) and ``action_vocabulary``. A malformed tool call is reported as
``info["error"] == ErrorCategory.FORMAT``; infrastructure failures raise
``envs.errors.EnvInfraError``. See docs/envs.md.
"""

from envs.api import Env, aclose, areset, astep
from envs.errors import EnvError, EnvInfraError, EnvSpecError, EnvStateError
from envs.registry import check_spec, make, parse_spec, register, registered

__all__ = [
    "Env",
    "EnvError",
    "EnvInfraError",
    "EnvSpecError",
    "EnvStateError",
    "aclose",
    "areset",
    "astep",
    "check_spec",
    "make",
    "parse_spec",
    "register",
    "registered",
]
