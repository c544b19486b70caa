"""The benchmark's round order (tests/benchmarks/bench_models.py ``round_order``): each round
runs every job once, and a job's predecessor changes from round to round (a plain rotation kept
it, so one neighbour's after-effects weighed on all of a job's runs)."""

from __future__ import annotations

import math

import pytest

from tests.benchmarks.bench_models import round_order


@pytest.mark.parametrize("n", range(1, 13))
def test_every_round_runs_every_job_once(n: int) -> None:
    names = [f"job{i}" for i in range(n)]
    for rnd in range(6):
        assert sorted(round_order(names, rnd)) == sorted(names)


@pytest.mark.parametrize("n", [3, 4, 5, 6, 8, 9, 10, 12])
def test_a_job_follows_a_different_job_in_each_of_the_first_rounds(n: int) -> None:
    names = [f"job{i}" for i in range(n)]
    # As many rounds as there are strides coprime to n (at least 2 for n >= 3).
    rounds = sum(1 for s in range(1, n) if math.gcd(s, n) == 1)
    for name in names:
        before = []
        for rnd in range(rounds):
            order = round_order(names, rnd)
            at = order.index(name)
            if at:
                before.append(order[at - 1])
        assert len(before) == len(set(before)), (name, before)


def test_the_eight_job_pass_of_three_rounds() -> None:
    # A pass of objfs's rows (``--only objfs``): the main row ("A") first, "objfs torch_io"
    # ("H") last; under the old rotation "A" followed "H" in every round after the first.
    names = list("ABCDEFGH")
    orders = ["".join(round_order(names, rnd)) for rnd in range(3)]
    assert orders == ["ABCDEFGH", "BEHCFADG", "CHEBGDAF"]
    rotation = ["".join(names[r:] + names[:r]) for r in range(3)]
    assert [o[o.index("A") - 1] for o in rotation[1:]] == ["H", "H"]
    assert [o[o.index("A") - 1] for o in orders[1:]] == ["F", "D"]
