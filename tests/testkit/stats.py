"""Statistics for the distribution tests."""

import math


def chi2_critical(df, alpha=1e-4):
    # Wilson-Hilferty approximation of the chi-square quantile
    z = 3.719  # one-sided normal quantile for 1e-4
    return df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3
