import pytest

from cudal2.errors import Cudal2Error
from cudal2.problem import Problem


def test_problem_counts_flops_and_bytes():
    p = Problem(64, 128, 32, "bf16", "nt")
    assert p.flops == 2 * 64 * 128 * 32
    assert p.min_bytes == 2 * (64 * 32 + 32 * 128 + 64 * 128)
    assert p.b_shape == (128, 32)
    assert str(p) == "64x128x32 bf16 nt"


@pytest.mark.parametrize("args, message", [
    ((0, 1, 1), "m must be >= 1"),
    ((1, -3, 1), "n must be >= 1"),
    ((1, 1, 2.5), "k must be an integer"),
    ((1, 1, 1, "fp8"), "unknown dtype 'fp8'"),
    ((1, 1, 1, "fp16", "tn"), "unknown layout 'tn'"),
])
def test_bad_problems_are_rejected_with_a_named_reason(args, message):
    with pytest.raises(Cudal2Error, match=message):
        Problem(*args)


def test_parse_rejects_non_integers():
    assert Problem.parse("4096", " 17 ", "1") == Problem(4096, 17, 1)
    with pytest.raises(Cudal2Error, match="m must be an integer, got 'abc'"):
        Problem.parse("abc", "1", "1")
