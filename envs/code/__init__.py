"""The ``code`` environment package: problems, sandboxed grading and the environment."""

from envs.code.env import CODERL_REWARDS, CodeConfig, CodeEnv, make_code_env

__all__ = ["CODERL_REWARDS", "CodeConfig", "CodeEnv", "make_code_env"]
