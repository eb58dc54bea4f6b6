"""Same batch against same batch: each AFD layout's runs against plain vLLM's.

Pairs: within one bench result, the AFD layout's run of family f at batch b in repeat
k is paired with plain vLLM's run of f at b in repeat k (the two ran back to back,
`BenchConfig.repeats`). Per pair, AFD / plain of every figure of `Figures`; per
(family, layout, batch), the median and range of each side's figures and of the
paired ratios over the pairs. Several bench results (runs of one commit made in
several calls) pool their pairs.

Imports only the result models, so `afd_ray.bench.summary` runs without Ray or vLLM.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from afd_ray.bench.schema import Figures, RunResult, SameBatch, Stat

__all__ = ["FIGURES", "PLAIN", "compare"]

PLAIN = "plain"
"""`Topology.label` of plain vLLM."""

FIGURES: dict[str, Callable[[RunResult], float]] = {
    "output_tok_s": lambda run: run.output_tokens_per_s,
    "decode_tok_s": lambda run: _decode(run),
    "tpot_p50_ms": lambda run: run.tpot.p50_ms,
    "tpot_p90_ms": lambda run: run.tpot.p90_ms,
    "ttft_p50_ms": lambda run: run.ttft.p50_ms,
}
"""How each field of `Figures` is read off a run."""

_Key = tuple[str, str, int]
"""(family, AFD layout label, batch)."""


def _decode(run: RunResult) -> float:
    if run.decode_tokens_per_s is None:
        raise ValueError(
            f"runs[]: {run.family} {run.label} batch {run.concurrency} has no decode_tokens_per_s "
            "(a result of schema 2 or older); rerun the bench"
        )
    return run.decode_tokens_per_s


def _figures(values: Sequence[dict[str, float]]) -> Figures:
    return Figures(**{name: Stat.of([v[name] for v in values]) for name in FIGURES})


def _pairs(runs: Sequence[RunResult]) -> dict[_Key, list[tuple[RunResult, RunResult]]]:
    """The (plain, AFD) pairs of one bench result's runs; AFD runs of a family with no
    plain run at all are left out (a result without the baseline).

    Raises:
        ValueError: an AFD run has no plain run of its family, batch and repeat, while
            the family has plain runs; or two runs share family, layout, batch and repeat.
    """
    plain: dict[tuple[str, int, int], RunResult] = {}
    afd: dict[tuple[str, str, int, int], RunResult] = {}
    for run in runs:
        key = (run.family, run.label, run.concurrency, run.repeat)
        side, at = (plain, (run.family, run.concurrency, run.repeat)) if run.label == PLAIN else (afd, key)
        if at in side:
            raise ValueError(
                f"runs[]: two runs of {run.family} {run.label} batch {run.concurrency} repeat {run.repeat}"
            )
        side[at] = run
    families = {family for family, _, _ in plain}
    out: dict[_Key, list[tuple[RunResult, RunResult]]] = {}
    for (family, label, batch, repeat), run in afd.items():
        if family not in families:
            continue
        base = plain.get((family, batch, repeat))
        if base is None:
            raise ValueError(f"runs[]: {family} {label} batch {batch} repeat {repeat} has no plain run to pair with")
        out.setdefault((family, label, batch), []).append((base, run))
    return out


def compare(*groups: Sequence[RunResult]) -> list[SameBatch]:
    """Every AFD layout against plain vLLM, per family and batch, sorted by family,
    layout and batch; each group is one bench result's runs, paired within the group
    and pooled across groups (module docstring).

    Raises:
        ValueError: an AFD run lacks its plain pair, two runs share a key (`_pairs`),
            or a paired run has no decode rate (a result of schema 2 or older).
    """
    pooled: dict[_Key, list[tuple[RunResult, RunResult]]] = {}
    for runs in groups:
        for key, pairs in _pairs(runs).items():
            pooled.setdefault(key, []).extend(pairs)
    out = []
    for (family, label, batch), pairs in sorted(pooled.items()):
        plain = [{name: read(p) for name, read in FIGURES.items()} for p, _ in pairs]
        afd = [{name: read(a) for name, read in FIGURES.items()} for _, a in pairs]
        ratios = [{name: a[name] / p[name] for name in FIGURES} for p, a in zip(plain, afd, strict=True)]
        out.append(
            SameBatch(
                family=family,
                layout=label,
                batch=batch,
                repeats=len(pairs),
                plain=_figures(plain),
                afd=_figures(afd),
                ratio=_figures(ratios),
            )
        )
    return out
