"""The paired study's statistics: the sign-flip interval and p over seeds, and the t tools the page compares.

The interval is the sign-flip test inverted (Hartigan's subset means): the 2^n - 1 means of the nonempty subsets
of the n seeds' differences cut the line into 2^n gaps, and when the differences are symmetric about their true
mean, each gap holds it with probability 1 / 2^n; the interval from the k-th smallest subset mean to the k-th
largest holds it with probability 1 - 2k / 2^n exactly, k the largest that keeps this at `level` or more (column
`level`: the interval's exact level). Over seeds, because a seed is the unit the experiment repeats: it fixes the
initialisation and the data of both twins, and what varies most from one seed to another is whether and when a
model forms the lookup, not the evaluation samples (which are the same for both twins, so their own noise largely
cancels in the paired difference). Paired, because a seed's twins are not independent draws. Why not a percentile
bootstrap: over few seeds it covers the true mean less often than it says (at 6 seeds, 81-86% of the time for a
95% interval); why not a t interval: the outcomes are bimodal (a model forms a lookup or does not), far from
normal. At 6 seeds the 95% interval is the range of the six differences (its exact level 62/64 = 96.9%); at 5 or
fewer no interval reaches 95%, and the range is given with its lower level.

The p column is the exact paired permutation test of "no difference" (Fisher's sign-flip test, two-sided, by
`scipy.stats.permutation_test`): under the null hypothesis each seed's difference is as likely to have the other
sign, so p is the share of the 2^n sign assignments whose mean difference is at least as far from zero as the one
observed. It assumes nothing about the differences' distribution but their symmetry, and its smallest value is
2 / 2^n: 0.25 with 3 seeds, 0.0625 with 5, 0.031 with 6, 0.0078 with 8. The interval and p are one test read two
ways: at 6 seeds, the 95% interval excludes 0 exactly when every seed's difference has the same sign, p = 0.031.

Beside them, for the study page: the t interval (`t_interval`), Holm's adjustment (`holm`) and the paired t test's
power (`paired_t_power`, `seeds_for_power`).
"""

from __future__ import annotations

import numpy as np
import scipy.stats

MAX_EXACT_SEEDS = 20  # up to 2^20 subsets enumerated; beyond, 2^20 drawn at random


def subset_means(differences: np.ndarray, seed: int = 0) -> np.ndarray:
    """The means of the nonempty subsets of the differences, unsorted.

    Args:
        differences: the n seeds' paired differences.
        seed: the random seed of the subsets drawn for more than MAX_EXACT_SEEDS differences.

    Returns:
        The 2^n - 1 subset means; for more than MAX_EXACT_SEEDS differences, those of 2^20 subsets drawn at random
        with numpy's `default_rng(seed)`.
    """
    differences = np.asarray(differences, dtype=float)
    if len(differences) <= MAX_EXACT_SEEDS:
        sums, counts = np.zeros(1), np.zeros(1, dtype=np.int64)
        for value in differences:  # each subset without the value, then with it
            sums, counts = np.concatenate([sums, sums + value]), np.concatenate([counts, counts + 1])
        return sums[1:] / counts[1:]
    picks = np.random.default_rng(seed).random((2**20, len(differences))) < 0.5
    picks = picks[picks.any(axis=1)]
    return (picks @ differences) / picks.sum(axis=1)


def sign_flip_interval(differences: np.ndarray, level: float = 0.95) -> tuple[float, float, float]:
    """The sign-flip test inverted (module docstring): (low, high, the interval's exact level).

    Args:
        differences: each seed's paired difference.
        level: the least level wanted; with too few seeds for it, the range of the differences at its own level.

    Returns:
        The k-th smallest and k-th largest subset mean and 1 - 2k / 2^n, k = max(1, floor((1 - level) 2^(n-1))).
    """
    n = len(differences)
    means = np.sort(subset_means(differences))
    if n > MAX_EXACT_SEEDS:
        low, high = np.quantile(means, [(1 - level) / 2, (1 + level) / 2])
        return float(low), float(high), level
    k = max(1, int(np.floor((1 - level) * 2 ** (n - 1) + 1e-9)))
    return float(means[k - 1]), float(means[len(means) - k]), 1 - 2 * k / 2**n


def t_interval(differences: np.ndarray, level: float = 0.95) -> tuple[float, float]:
    """The paired t interval of the mean difference (it assumes normal differences), for comparison.

    Args:
        differences: each seed's paired difference.
        level: the confidence level.

    Returns:
        (low, high).
    """
    differences = np.asarray(differences, dtype=float)
    half = scipy.stats.t.ppf((1 + level) / 2, len(differences) - 1) * scipy.stats.sem(differences)
    return float(differences.mean() - half), float(differences.mean() + half)


def holm(p_values) -> np.ndarray:
    """Holm's step-down adjustment of a family of p-values (family-wise error), in their order.

    Args:
        p_values: the family's p-values.

    Returns:
        The adjusted p-values, in the order given.
    """
    p_values = np.asarray(p_values, dtype=float)
    order = np.argsort(p_values)
    steps = p_values[order] * (len(p_values) - np.arange(len(p_values)))
    adjusted = np.empty_like(p_values)
    adjusted[order] = np.minimum(1.0, np.maximum.accumulate(steps))
    return adjusted


def paired_t_power(effect: float, sd: float, seeds: int, alpha: float = 0.05) -> float:
    """The power of the two-sided paired t test to detect a mean difference `effect`.

    The noncentral t; the sign-flip test's power is close to it, and a little lower at few seeds, where its p-values
    are coarse.

    Args:
        effect: the mean difference to detect.
        sd: the differences' standard deviation.
        seeds: the pairs.
        alpha: the test's level.

    Returns:
        The power.
    """
    df, shift = seeds - 1, effect / sd * np.sqrt(seeds)
    critical = scipy.stats.t.ppf(1 - alpha / 2, df)
    return float(scipy.stats.nct.sf(critical, df, shift) + scipy.stats.nct.cdf(-critical, df, shift))


def seeds_for_power(effect: float, sd: float, power: float = 0.8, alpha: float = 0.05) -> int:
    """The fewest pairs at which `paired_t_power` reaches `power`.

    Args:
        effect: the mean difference to detect.
        sd: the differences' standard deviation.
        power: the power wanted.
        alpha: the test's level.

    Returns:
        The number of pairs, at least 2.
    """
    seeds = 2
    while paired_t_power(effect, sd, seeds, alpha) < power:
        seeds += 1
    return seeds


def paired_permutation_p(differences: np.ndarray) -> float:
    """Exact two-sided sign-flip permutation test of a zero mean paired difference (every 2^n sign assignment).

    Args:
        differences: each seed's paired difference.

    Returns:
        The p-value; 1 for one seed or where every difference is zero.
    """
    if len(differences) < 2 or not np.any(differences):
        return 1.0  # one seed, or every difference zero: every sign assignment is as far from zero as the observed
    result = scipy.stats.permutation_test(
        (differences,), np.mean, permutation_type="samples", n_resamples=np.inf, alternative="two-sided"
    )
    return float(result.pvalue)
