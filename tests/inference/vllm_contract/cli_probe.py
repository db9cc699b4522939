"""Parse `vllm serve` command lines with vLLM 0.33's own CLI, in the contract environment.

Run with the vLLM environment on PYTHONPATH (tests/farm/test_vllm_serve.py does). Reads
``{"cases": [{"argv": ["vllm", "serve", ...], "env": {...}}, ...]}`` on stdin and prints
one JSON list: for each case either ``{"ok": false, "error": "..."}`` or ``{"ok": true,
"engine": {...}, "frontend": {...}, "envs": {...}}``.

The parser is built as `vllm`'s entry point builds it (`vllm/entrypoints/cli/main.py`): a
`FlexibleArgumentParser` with the `serve` subcommand's parser from
`ServeSubcommand.subparser_init` (`make_arg_parser`: the frontend's and every engine
argument), then `ServeSubcommand.validate` (`validate_parsed_serve_args`) and
`AsyncEngineArgs.from_cli_args`, which is what `vllm serve` turns the namespace into.
`engine` holds the engine arguments, `frontend` the server's own (host, port, ...), and
`envs` what `vllm.envs` reads from the case's environment.

vLLM fills some defaults from its platform (DeviceConfig's default asks
`current_platform.device_type`), and with no accelerator and no CPU build nothing is
detected: ``VLLM_TARGET_DEVICE=cpu`` makes it the CPU platform, which no argument read here
depends on.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import io
import json
import os
import sys
from typing import Any

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")

FRONTEND = ("host", "port", "api_key", "model_tag", "uvicorn_log_level")
ENVS = ("VLLM_SERVER_DEV_MODE", "VLLM_ALLOW_RUNTIME_LORA_UPDATING")


def _jsonable(value: Any) -> Any:
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: _jsonable(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_jsonable(v) for v in value]
    if value is None or isinstance(value, bool | int | float | str):
        return value
    return str(value)


def _parser() -> tuple[argparse.ArgumentParser, Any]:
    from vllm.entrypoints.cli.serve import ServeSubcommand
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    root = FlexibleArgumentParser(description="vLLM CLI")
    subparsers = root.add_subparsers(required=False, dest="subparser")
    serve = ServeSubcommand()
    serve.subparser_init(subparsers).set_defaults(dispatch_function=serve.cmd)
    return root, serve


def _one(root: argparse.ArgumentParser, serve: Any, case: dict[str, Any]) -> dict[str, Any]:
    import vllm.envs
    from vllm.engine.arg_utils import AsyncEngineArgs

    argv = list(case["argv"])
    if argv[1:2] != ["serve"]:
        return {"ok": False, "error": f"not a `vllm serve` command: {argv[:2]}"}
    saved = dict(os.environ)
    os.environ.update(case.get("env", {}))
    said = io.StringIO()  # argparse writes its complaint to stderr, then exits
    try:
        with contextlib.redirect_stderr(said):
            args = root.parse_args(argv[1:])
        serve.validate(args)
        if args.model_tag is not None:  # as ServeSubcommand.cmd does
            args.model = args.model_tag
        engine = AsyncEngineArgs.from_cli_args(args)
        envs = {name: getattr(vllm.envs, name) for name in ENVS}
    except (Exception, SystemExit) as exc:
        return {"ok": False, "error": f"{type(exc).__name__}: {exc} {said.getvalue()[-500:]}"}
    finally:
        os.environ.clear()
        os.environ.update(saved)
    return {
        "ok": True,
        "engine": _jsonable(dataclasses.asdict(engine)),
        "frontend": {name: _jsonable(getattr(args, name, None)) for name in FRONTEND},
        "envs": envs,
    }


def main() -> None:
    cases = json.load(sys.stdin)["cases"]
    root, serve = _parser()
    json.dump([_one(root, serve, case) for case in cases], sys.stdout)


if __name__ == "__main__":
    main()
