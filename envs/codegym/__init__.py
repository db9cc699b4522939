"""The ``codegym`` environments: tool use over coding problems, transactional in the sandbox."""

from envs.codegym.env import CodeGym, CodeGymConfig, make_codegym_env
from envs.codegym.loader import LoadReport, load_directory
from envs.codegym.sources import CodeGymSource, library

__all__ = [
    "CodeGym",
    "CodeGymConfig",
    "CodeGymSource",
    "LoadReport",
    "library",
    "load_directory",
    "make_codegym_env",
]
