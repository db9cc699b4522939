"""CodeGym runtime: the stdlib-only module that runs *inside* the sandbox.

It is shipped into the sandbox session next to an environment's source file and
never imported by the host. One process answers one request (``request.json``)
and writes ``response.json``:

- ``init``: instantiate the class with a task config; reply with the task text
  and the state (the instance's ``__dict__``, which must be JSON);
- ``call``: rebuild the instance from ``state.json`` (the committed snapshot the
  host sent), run one tool, reply with its output and the new state;
- ``solve``: rebuild from the snapshot and run the oracle ``solve()``.

The host commits the new state only when the process finished within its time
limit, so a tool that hangs or blows a limit leaves the state as it was.
Environment authors subclass ``CodeGymEnv`` and mark tools with ``@tool``.
"""

import json
import os
import sys

# inspect and traceback are imported only where needed: with typing they cost
# ~30 ms per sandboxed process, more than the rest of a tool call.
_SCALARS = {str: "string", int: "integer", float: "number", bool: "boolean"}
_BY_NAME = {"str": str, "int": int, "float": float, "bool": bool, "list": list, "dict": dict}


def tool(method):
    """Mark a method as a tool the agent may call."""
    method.__codegym_tool__ = True
    return method


class CodeGymEnv:
    """Base class: subclasses set attributes in ``__init__(**config)`` and define tools."""

    CONFIGS = []  # task configs (kwargs of __init__) shipped with the environment

    def task(self):
        """The task statement shown to the agent."""
        import inspect

        return inspect.cleandoc(type(self).__doc__ or type(self).__name__)

    def get_ref_answer(self):
        """The correct answer for this configuration."""
        raise NotImplementedError

    @tool
    def Done(self, answer: str) -> str:
        """Submit the final answer and end the episode.

        Args:
            answer: The final answer.
        """
        correct = str(answer).strip() == str(self.get_ref_answer()).strip()
        self._codegym_done = True
        self._codegym_reward = 1.0 if correct else 0.0
        return "Correct." if correct else "Incorrect."


def _tools(cls):
    return {
        n: getattr(cls, n) for n in dir(cls) if getattr(getattr(cls, n), "__codegym_tool__", False)
    }


def _find_class(module, name):
    cls = getattr(module, name, None)
    if not (isinstance(cls, type) and issubclass(cls, CodeGymEnv)):
        raise LookupError(f"no CodeGymEnv subclass named {name!r}")
    return cls


def _restore(cls):
    with open("state.json") as f:
        state = json.load(f)
    obj = cls.__new__(cls)
    obj.__dict__.update(state)
    return obj


def _coerce(value, hint):
    if hint is int and isinstance(value, str) and value.strip().lstrip("-").isdigit():
        return int(value)
    if hint is float and isinstance(value, (int, str)) and not isinstance(value, bool):
        return float(value)
    if hint is str and isinstance(value, (int, float)) and not isinstance(value, bool):
        return str(value)
    if (hint in _SCALARS and not isinstance(value, hint)) or (
        hint is int and isinstance(value, bool)
    ):
        raise TypeError(f"expected {_SCALARS[hint]}, got {type(value).__name__}")
    return value


def _bind(function, arguments):
    """Check keyword arguments against a plain method without importing inspect."""
    code = function.__code__
    names = code.co_varnames[1 : code.co_argcount + code.co_kwonlyargcount]
    unknown = [k for k in arguments if k not in names]
    if unknown:
        raise TypeError(f"unexpected argument(s) {unknown}; expected {list(names)}")
    positional = code.co_varnames[1 : code.co_argcount]
    optional = set(positional[len(positional) - len(function.__defaults__ or ()) :])
    optional |= set(function.__kwdefaults__ or {})
    missing = [n for n in names if n not in arguments and n not in optional]
    if missing:
        raise TypeError(f"missing required argument(s) {missing}")
    hints = {
        k: _BY_NAME.get(v, v) if isinstance(v, str) else v
        for k, v in function.__annotations__.items()
    }
    return {k: _coerce(v, hints.get(k)) for k, v in arguments.items()}


def _call(obj, cls, name, arguments):
    tools = _tools(cls)
    if name not in tools:
        return {"format_error": f"unknown tool {name!r}; available: {', '.join(sorted(tools))}"}
    method = getattr(obj, name)
    try:
        kwargs = _bind(tools[name], arguments)
    except TypeError as exc:
        return {"format_error": f"bad arguments for {name}: {exc}"}
    try:
        return {"output": str(method(**kwargs))}
    except Exception as exc:  # the tool's own failure: reported to the agent, state rolled back
        return {"tool_error": f"{type(exc).__name__}: {exc}"}


def _handle(request):
    module = __import__(request["module"])
    cls = _find_class(module, request["class"])
    op = request["op"]
    if op == "init":
        obj = cls(**request["config"])
        reply = {"task": obj.task()}
    elif op == "call":
        obj = _restore(cls)
        reply = _call(obj, cls, request["tool"], request["arguments"])
    elif op == "solve":
        obj = _restore(cls)
        obj.solve()
        reply = {}
    else:
        raise ValueError(f"unknown op {op!r}")
    reply["done"] = bool(getattr(obj, "_codegym_done", False))
    reply["reward"] = float(getattr(obj, "_codegym_reward", 0.0))
    reply["state"] = vars(obj)
    return reply


def main():
    # A stale reply must never be mistaken for this request's: remove it first.
    if os.path.exists("response.json"):
        os.remove("response.json")
    with open("request.json") as f:
        request = json.load(f)
    try:
        reply = _handle(request)
        reply["nonce"] = request["nonce"]
        text = json.dumps(reply)
    except Exception:
        import traceback

        text = json.dumps(
            {"env_error": traceback.format_exc(limit=3)[-1500:], "nonce": request["nonce"]}
        )
    with open("response.json", "w") as f:
        f.write(text)


if __name__ == "__main__":
    sys.exit(main())
