"""A black-box agent program for the sandbox: a stdlib-only tool loop over chat completions.

It runs inside an episode's sandbox session (``agent@{"command": ["python3",
"shell_agent.py"], "files": {"shell_agent.py": "examples/sandbox_shell_agent.py"}, "task":
"..."}``): it reads ``FARM_PROMPT``, talks to ``OPENAI_BASE_URL`` with ``OPENAI_API_KEY``
as any OpenAI client would, runs the ``shell`` calls the model makes in its own work dir,
and stops when the model calls ``submit``, answers without a tool call, or after
``MAX_TURNS``; its last reply's text is left in ``answer.txt``. The environment's check
then scores the work dir. Nothing here imports the
farm: it is the kind of program a user brings.
"""

import json
import os
import subprocess
import sys
import urllib.error
import urllib.request

MAX_TURNS = 4
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "shell",
            "description": "Run a bash command in the work directory.",
            "parameters": {
                "type": "object",
                "properties": {"command": {"type": "string"}},
                "required": ["command"],
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "submit",
            "description": "Say the task is done.",
            "parameters": {"type": "object", "properties": {}},
        },
    },
]


def chat(messages: list) -> dict:
    body = json.dumps(
        {
            "model": os.environ.get("OPENAI_MODEL", "policy"),
            "messages": messages,
            "tools": TOOLS,
            "max_tokens": int(os.environ.get("AGENT_MAX_TOKENS", "32")),
        }
    ).encode()
    request = urllib.request.Request(
        os.environ["OPENAI_BASE_URL"].rstrip("/") + "/chat/completions",
        data=body,
        headers={
            "Authorization": "Bearer " + os.environ["OPENAI_API_KEY"],
            "Content-Type": "application/json",
        },
    )
    with urllib.request.urlopen(request, timeout=300) as reply:
        return json.loads(reply.read())["choices"][0]["message"]


def shell(arguments: str) -> str:
    try:
        command = json.loads(arguments or "{}").get("command", "")
    except ValueError:
        return "error: the arguments are not JSON"
    done = subprocess.run(
        ["bash", "-c", str(command)], capture_output=True, text=True, timeout=30, check=False
    )
    return (done.stdout + done.stderr)[-2000:] + f"\n[exit {done.returncode}]"


def main() -> int:
    messages = [{"role": "user", "content": os.environ["FARM_PROMPT"]}]
    try:
        loop(messages)
    finally:
        replies = [m for m in messages if m["role"] == "assistant"]
        with open("answer.txt", "w") as out:
            out.write((replies[-1]["content"] or "") if replies else "")
    return 0


def loop(messages: list) -> None:
    for _ in range(MAX_TURNS):
        try:
            message = chat(messages)
        except urllib.error.HTTPError as exc:  # a limit of the episode: it is over
            print(f"the endpoint refused: {exc.code} {exc.read()[:200]!r}", file=sys.stderr)
            return
        calls = message.get("tool_calls") or []
        reply = {"role": "assistant", "content": message.get("content")}
        messages.append({**reply, "tool_calls": calls} if calls else reply)
        if not calls:
            return
        for call in calls:
            name = call["function"]["name"]
            if name == "submit":
                return
            result = shell(call["function"]["arguments"]) if name == "shell" else "unknown tool"
            messages.append({"role": "tool", "tool_call_id": call["id"], "content": result})


if __name__ == "__main__":
    sys.exit(main())
