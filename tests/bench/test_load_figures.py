"""The load's decode rate (tokens after the first over the time after the first
token, per stream, summed over streams) and the bench's counterbalanced layout order
(no cluster)."""

from __future__ import annotations

import pytest

from afd_ray.bench.config import BenchConfig
from afd_ray.bench.load import LoadResult, RequestTiming
from afd_ray.bench.runner import deployments


def test_decode_rate_leaves_out_the_first_token() -> None:
    # two streams; requests of 5, 3 and 5 tokens, whose tokens after the first took
    # 0.4, 0.5 and 0.4 s after their first token: 10 tokens in 1.3 s, times 2 streams
    requests = [
        RequestTiming(sent_s=0.0, token_times_s=(1.0, 1.2, 1.4), output_tokens=5, prompt_tokens=7),
        RequestTiming(sent_s=0.0, token_times_s=(0.5, 1.0), output_tokens=3, prompt_tokens=7),
        RequestTiming(sent_s=1.4, token_times_s=(2.0, 2.4), output_tokens=5, prompt_tokens=7),
    ]
    load = LoadResult(wall_s=2.4, requests=requests, streams=2)
    assert load.decode_tokens_per_s == pytest.approx(2 * 10 / 1.3)
    assert requests[0].tpot_s == pytest.approx(0.1) and requests[0].decode_s == pytest.approx(0.4)
    # a request whose tokens came in one chunk shows no decode time: left out
    one_chunk = RequestTiming(sent_s=0.0, token_times_s=(0.3,), output_tokens=4, prompt_tokens=7)
    assert LoadResult(2.4, [*requests, one_chunk], 2).decode_tokens_per_s == pytest.approx(2 * 10 / 1.3)
    with pytest.raises(ValueError, match="one chunk"):
        _ = LoadResult(0.3, [one_chunk], 1).decode_tokens_per_s


def test_layouts_run_in_abba_order() -> None:
    cfg = BenchConfig.model_validate({"topologies": ["plain", "1A1F"], "repeats": 3})
    order = [(t.label, repeats) for t, repeats in deployments(cfg)]
    assert order == [("plain", [0]), ("1A1F", [0]), ("1A1F", [1]), ("plain", [1]), ("plain", [2]), ("1A1F", [2])]
    # keeping a deployment at each turn: 4 deployments instead of 6
    kept = [(t.label, repeats) for t, repeats in deployments(cfg.model_copy(update={"redeploy": False}))]
    assert kept == [("plain", [0]), ("1A1F", [0, 1]), ("plain", [1, 2]), ("1A1F", [2])]
    three = BenchConfig.model_validate({"topologies": ["plain", "2A1F", "2A1F-dbo"], "repeats": 2})
    assert [t.label for t, _ in deployments(three)] == ["plain", "2A1F", "2A1F-dbo", "2A1F-dbo", "2A1F", "plain"]


@pytest.mark.parametrize(("field", "value"), [("repeats", 0), ("min_round_s", -1.0)])
def test_repeats_and_round_length_are_checked(field: str, value: float) -> None:
    with pytest.raises(ValueError, match=field):
        BenchConfig.model_validate({field: value})
