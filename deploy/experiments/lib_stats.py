"""Statistics helpers of the experiments (see lib.py): mean and median of
the values present, and their NaN-for-a-gap variants for plotting."""


def mean(xs):
    """Mean of the values that are present; None when there are none."""
    xs = [x for x in xs if x is not None]
    return sum(xs) / len(xs) if xs else None


def nan_mean(xs):
    """mean() for plotting: NaN (a gap) when nothing is present."""
    m = mean(xs)
    return float("nan") if m is None else m


def median(xs):
    """Median of the values that are present (robust to a run slowed by
    the rest of the machine); None when there are none."""
    xs = sorted(x for x in xs if x is not None)
    if not xs:
        return None
    mid = len(xs) // 2
    return xs[mid] if len(xs) % 2 else (xs[mid - 1] + xs[mid]) / 2


def nan_median(xs):
    """median() for plotting: NaN (a gap) when nothing is present."""
    m = median(xs)
    return float("nan") if m is None else m
