"""`bench._loadgen_proc.serving`: a phase gets the run's shared load generator only when
that server's latency profile is the phase's own (`bench workers --smoke` shares one)."""

from __future__ import annotations

import asyncio

import pytest

from bench._loadgen_proc import Server, serving

SHARED = Server("http://127.0.0.1:9", median_ms=5.0, sigma=0.3)


def test_a_phase_of_the_shared_profile_gets_the_shared_server() -> None:
    async def url() -> str:
        async with serving(SHARED, 5.0, 0.3) as got:
            return got

    assert asyncio.run(url()) == SHARED.url


@pytest.mark.parametrize(("median_ms", "sigma"), [(100.0, 0.3), (5.0, 1.0)])
def test_a_phase_of_another_profile_is_refused(median_ms: float, sigma: float) -> None:
    with pytest.raises(ValueError, match=r"shared load generator serves 5\.0 ms"):
        serving(SHARED, median_ms, sigma)
