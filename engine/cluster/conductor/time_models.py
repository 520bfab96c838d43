"""The Conductor's estimates of prefill time and time between tokens, fitted from measurements.

Prefill time is a polynomial in new tokens ``n`` and cached tokens ``p`` (Mooncake §4.1: "a
polynomial regression model fitted with offline data"): ``c0 + c1 n + c2 p + c3 n^2 + c4 n p``,
which holds a prefill's linear layers (n), attention over the new and cached tokens (n^2, n p)
and loading the cached blocks (p). The time between tokens of a decode instance is linear in its
running batch and the KV tokens it holds: ``c0 + c1 batch + c2 tokens`` (a step reads the weights
once and every running request's KV once).

Both start from a prior (least squares on a grid of a CostModel's times, the "offline data") and
are refitted on the last ``window`` measurements once ``min_samples`` have arrived, every
``refit_every`` new ones, so an instance that is slower than the prior is soon estimated as such.

A refit keeps every coefficient >= 0 (each term is a cost that grows with its feature) and pulls
the coefficients the measurements hardly determine towards the prior's (a ridge of weight
``PRIOR_WEIGHT``). Plain least squares on a workload of one prompt length (the chaos suite's)
solved the near-collinear columns with coefficients in the thousands of opposite signs: right at
the measured points, and 171 s for a 68-token prefill a few tokens away, which refused every
request of an idle cluster as over its TTFT SLO (and, refused, the model never learned again).
"""

from __future__ import annotations

from collections import deque

import numpy as np

from engine.cluster.conductor.cost_model import CostModel

_SCALE = 1e-3  # tokens in thousands keeps the normal equations well conditioned
PRIOR_WEIGHT = 0.05  # ridge towards the prior's coefficients (features in thousands of tokens)


def _prefill_features(n: float, p: float) -> list[float]:
    n, p = n * _SCALE, p * _SCALE
    return [1.0, n, p, n * n, n * p]


def _tbt_features(batch: float, tokens: float) -> list[float]:
    return [1.0, float(batch), tokens * _SCALE]


class _Fitted:
    """Least squares over a sliding window of measurements, with a prior until enough arrive."""

    def __init__(self, prior_x, prior_y, window: int, min_samples: int, refit_every: int) -> None:
        if min_samples < 1 or window < min_samples or refit_every < 1:
            raise ValueError(
                f"need 1 <= min_samples <= window and refit_every >= 1, got "
                f"min_samples={min_samples} window={window} refit_every={refit_every}"
            )
        self.coef = np.linalg.lstsq(np.asarray(prior_x), np.asarray(prior_y), rcond=None)[0]
        self._prior = np.maximum(self.coef, 0.0)
        self._x: deque[list[float]] = deque(maxlen=window)
        self._y: deque[float] = deque(maxlen=window)
        self.min_samples = min_samples
        self.refit_every = refit_every
        self._since = 0
        self.fitted = False  # True once measurements replaced the prior

    def add(self, x: list[float], y: float) -> None:
        self._x.append(x)
        self._y.append(y)
        self._since += 1
        if len(self._y) >= self.min_samples and (
            self._since >= self.refit_every or not self.fitted
        ):
            self.coef = self._refit()
            self._since = 0
            self.fitted = True

    def predict(self, x: list[float]) -> float:
        return max(0.0, float(np.dot(self.coef, x)))

    def _refit(self) -> np.ndarray:
        k = len(self._prior)
        w = np.sqrt(PRIOR_WEIGHT)
        a = np.vstack([np.asarray(self._x), w * np.eye(k)])
        b = np.concatenate([np.asarray(self._y), w * self._prior])
        return nnls(a, b)


def nnls(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """argmin ||a x - b|| subject to x >= 0 (Lawson and Hanson's active set method)."""
    n = a.shape[1]
    active = np.zeros(n, dtype=bool)  # the coefficients free to be > 0
    x = np.zeros(n)
    w = a.T @ (b - a @ x)
    for _ in range(3 * n):
        if active.all() or w[~active].max() <= 1e-12 * max(1.0, float(np.abs(w).max())):
            break
        active[int(np.argmax(np.where(active, -np.inf, w)))] = True
        while True:
            z = np.zeros(n)
            z[active] = np.linalg.lstsq(a[:, active], b, rcond=None)[0]
            if (z[active] > 0).all():
                break
            neg = active & (z <= 0)
            alpha = float(np.min(x[neg] / (x[neg] - z[neg])))
            x = x + alpha * (z - x)
            active &= x > 1e-15
        x = z
        w = a.T @ (b - a @ x)
    return x


class PrefillTimeModel:
    def __init__(
        self,
        prior: CostModel,
        max_tokens: int = 131072,
        window: int = 512,
        min_samples: int = 16,
        refit_every: int = 16,
    ) -> None:
        grid = np.linspace(0, max_tokens, 17)
        xs, ys = [], []
        for n in grid[1:]:
            for p in grid:
                if n + p <= max_tokens:
                    xs.append(_prefill_features(n, p))
                    ys.append(prior.prefill_s(int(n), int(p)))
        self._fit = _Fitted(xs, ys, window, min_samples, refit_every)

    @property
    def fitted(self) -> bool:
        return self._fit.fitted

    def observe(self, new_tokens: int, cached_tokens: int, seconds: float) -> None:
        self._fit.add(_prefill_features(new_tokens, cached_tokens), seconds)

    def predict(self, new_tokens: int, cached_tokens: int) -> float:
        if new_tokens <= 0:
            return 0.0
        return self._fit.predict(_prefill_features(new_tokens, cached_tokens))


class TbtModel:
    def __init__(
        self,
        prior: CostModel,
        window: int = 512,
        min_samples: int = 16,
        refit_every: int = 256,  # decode steps come every few ms: refit on a fresh window
    ) -> None:
        xs, ys = [], []
        for batch in (1, 2, 4, 8, 16, 32, 64, 128, prior.max_batch):
            for frac in (0.0, 0.1, 0.25, 0.5, 0.75, 1.0):
                tokens = int(frac * prior.decode_kv_capacity_tokens)
                xs.append(_tbt_features(batch, tokens))
                ys.append(prior.decode_step_s(batch, tokens))
        self._fit = _Fitted(xs, ys, window, min_samples, refit_every)

    @property
    def fitted(self) -> bool:
        return self._fit.fitted

    def observe(self, batch: int, tokens: int, seconds: float) -> None:
        self._fit.add(_tbt_features(batch, tokens), seconds)

    def predict(self, batch: int, tokens: int) -> float:
        if batch <= 0:
            return 0.0
        return self._fit.predict(_tbt_features(batch, tokens))
