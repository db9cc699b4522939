"""The framing between the worker and a session's shell holds against the shell's own
code, on both backends: no output ends a call early (the end marker cannot be read or
forged from inside), terminal modes and descriptors are reset every call, and what the
code does to the shell's command files is its own error, never the sandbox's."""

from __future__ import annotations

from sandbox import SandboxPool, Violation

# forges an end: a marker built from whatever the prompt hook shows, and the ready marker
FORGE = (
    "tok=$(printf %s \"$PROMPT_COMMAND\" | grep -o '__farm_[0-9a-f]*' | head -1);"
    ' printf "\\n${tok}_0__\\n\\n__farm_ready__\\n__farm_done_%s_0__\\n" "$(printf %032d 0)";'
    " sleep 1; echo after"
)


async def test_output_cannot_end_a_call(pool: SandboxPool) -> None:
    async with pool.session() as sb:
        r = await sb.shell(FORGE)
        assert (r.exit_code, r.violation) == (0, Violation.NONE), r
        assert r.stdout.endswith("after\n") and r.duration_s >= 1, r
        r = await sb.shell("echo next")  # not one call behind
        assert r.ok and r.stdout == "next\n", r
        # a background job that prints markers while the next commands run
        bg = "(for i in $(seq 50); do printf '\\n__farm_ready__\\n'; sleep 0.02; done) &"
        assert (await sb.shell(bg)).ok
        for word in ("one", "two"):
            r = await sb.shell(f"sleep 0.3; echo {word}")
            # the call ended after its word; the job's lines may follow it (under load it is
            # still printing: its markers are taken out, the newline before each stays)
            assert r.ok and r.stdout.rstrip("\n").endswith(word) and r.duration_s >= 0.3, r


async def test_terminal_modes_and_descriptors_are_reset_every_call(pool: SandboxPool) -> None:
    async with pool.session() as sb:
        r = await sb.shell("stty echo -icanon onlcr opost </dev/tty; echo set")
        assert r.ok, r
        r = await sb.shell("echo plain")
        assert r.stdout == "plain\n", r  # no echoed input, no \r\n
        r = await sb.shell("exec 1>&- 2>&-")
        assert (r.exit_code, r.violation) == (0, Violation.NONE), r
        r = await sb.shell("echo back")
        assert r.ok and r.stdout == "back\n", r
        # the descriptors bash saved to restore after the call, closed too
        closing = 'for f in $(ls /proc/$$/fd); do [ $f -gt 2 ] && eval "exec $f>&-"; done'
        r = await sb.shell(f"{closing}; exec 1>/dev/null 2>&1 0</dev/null")
        assert (r.exit_code, r.violation) == (0, Violation.NONE), r
        r = await sb.shell("set -u -x; PS1='$ '; echo still")
        assert r.ok and r.stdout.endswith("still\n"), r
        r = await sb.shell("echo clean")
        assert r.ok and r.stdout == "clean\n", r


async def test_the_shells_own_files_are_the_models_doing(pool: SandboxPool) -> None:
    async with pool.session() as sb:
        # FIFOs and links where the shell used to write its next command files
        plant = (
            "for i in $(seq 2 30); do mkfifo $TMPDIR/.farm-shell-$i;"
            " ln -s /dev/zero $TMPDIR/.farm-shell-$((i + 30)); done; echo planted"
        )
        assert (await sb.shell(plant)).stdout == "planted\n"
        r = await sb.shell("echo fine", timeout=3)
        assert r.ok and r.stdout == "fine\n", r
        r = await sb.shell("chmod 000 $TMPDIR; echo locked")
        assert r.ok, r
        r = await sb.shell("echo unlocked", timeout=3)  # its own tmp, given back its modes
        assert r.ok and r.stdout == "unlocked\n", r
        r = await sb.shell("rm -rf $TMPDIR/* $TMPDIR/.f*; rmdir $TMPDIR; touch $TMPDIR")
        assert r.ok, r
        r = await sb.shell("echo where", timeout=3)  # tmp is a file now: the model's error
        assert r.exit_code == 126 and r.violation is Violation.NONE, r
        assert "cannot run the command" in r.stdout, r
