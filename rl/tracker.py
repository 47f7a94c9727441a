"""SPO: a persistent per-prompt Beta baseline instead of a group (seed 002).

Per task id: Beta(alpha, beta) over the success rate, estimate v = alpha / (alpha + beta).
A visit with reward r in {0, 1} first discounts old evidence, then adds the new (Eq. 5):

    alpha <- rho * alpha + r,   beta <- rho * beta + (1 - r)
    rho = clip(2 ** (-D / D_half), rho_min, rho_max)        (defaults 0.875, 0.96, 0.06)

D is how far the policy moved since it last acted on the prompt: the token mean of
|logp_then - logp_now| over that visit's whole stored response (scored in its context),
logp_then taken right after that visit's update and logp_now right after this step's
update. First visit: D = 0, rho = rho_max. Which tokens of a multi-turn episode the
mean runs over is `drift_mask`'s choice (spo.drift_tokens): the tokens the policy
generated (default), or every token after the prompt, tool outputs included, as the
official code does.

One training step, in the official order (verl-recipe spo_ray_trainer.py; rl.algos.spo
runs it):

    ids = sampler.sample(pool, B)                      # weights sqrt(v(1-v)) + 0.05
    ...one rollout per id -> rewards[B]...
    v_before = tracker.values(ids)                     # estimate before this step
    adv = spo_advantages(rewards, v_before)            # Eq. 8, then batch-normalised
    ...learner update with adv...
    reqs = tracker.pending_d_requests(ids)             # {id: StoredResponse}
    logp_now = {i: score(r.ids, r.mask) for i, r in reqs.items()}   # updated params
    tracker.update(ids, rewards, D=tracker.drift(ids, logp_now))
    for each sample: tracker.store_response(id, ids, score(ids, mask), mask)  # updated params

The `spo` section's choices (defaults in configs.common.spo_defaults) next to the
official code's; where they differ, the official behaviour is one option away:

    key                  default              official
    spo.duplicates       "sequential"         "last"
    spo.prior            (1, 1)               (0.5, 0.5) when no offline samples are used
    spo.unseen           "draw"               "skip"
    spo.drift_tokens     "generated"          "response"
    spo.adv_std_ddof     1                    1 (torch's unbiased std)
    spo.init_form        "reference"          "reference"

- duplicates: a prompt drawn twice in one batch is updated once per sample in batch
  order ("sequential": no evidence is dropped), or every sample is computed from the
  pre-step (alpha, beta) and the last one written wins ("last").
- prior, unseen: a prompt with no offline value starts at `prior` (Beta(1, 1): v = 0.5,
  the largest sampling weight) and is drawn ("draw"), or is never drawn ("skip").
- drift_tokens: the tokens D averages over (drift_mask).
- adv_std_ddof: 1, torch's unbiased std; 0, the population std.
- init_form: the offline start in the official "+0.5" form ("reference") or the paper's
  Eq. 6 ("paper"); see offline_prior.

A prompt drawn twice in one batch shares one v_before and one D, and keeps the last
sample's response, in both duplicate modes (as the official code does).

Seed 002 reads v after each update in its worked examples: from alpha = beta = 4,
rho = 0.875, rewards (1, 0, 1) give v = 0.5625, 0.492188, 0.555664. The advantage uses the
value before the update (Eq. 8), not Algorithm 1's in-place order.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping, Sequence
from typing import Any, Literal

import numpy as np

from env.tasks import decode_line


def rho_from_drift(D, d_half: float = 0.06, rho_min: float = 0.875,
                   rho_max: float = 0.96) -> np.ndarray:
    """rho[B] = clip(2 ** (-D / d_half), rho_min, rho_max) for D[B] >= 0."""
    D = np.asarray(D, dtype=np.float64)
    return np.clip(np.exp2(-D / d_half), rho_min, rho_max)


DRIFT_TOKENS = ("generated", "response")


def drift_mask(loss_mask, prompt_len: int, tokens: str = "generated") -> np.ndarray:
    """The tokens D averages over, bool[T], in one episode's token stream[T].

    "generated": loss_mask, the tokens the policy wrote (tool outputs, which the policy
      did not choose and whose log-probs it is not trained on, left out).
    "response": every position >= prompt_len, tool outputs included: the official
      code's D, whose mask is verl's compute_response_mask (the attention mask over the
      whole response part of the sequence, which in a multi-turn rollout holds the
      tool observations between the policy's turns).
    """
    loss_mask = np.asarray(loss_mask)
    if tokens == "generated":
        return loss_mask.astype(bool)
    if tokens == "response":
        return np.arange(loss_mask.shape[0]) >= prompt_len
    raise ValueError(f"drift tokens must be one of {DRIFT_TOKENS}, got {tokens!r}")


def policy_drift(logp_then, logp_now, mask) -> float:
    """D = sum(mask * |logp_then - logp_now|) / sum(mask) over one response[T]; 0 if no
    token is scored."""
    then, now = np.asarray(logp_then, np.float64), np.asarray(logp_now, np.float64)
    m = np.asarray(mask, bool)
    if not then.shape == now.shape == m.shape:
        raise ValueError(f"logp_then {then.shape}, logp_now {now.shape} and mask {m.shape} "
                         "must have one shape")
    n = int(m.sum())
    return float(np.abs(then - now)[m].sum() / n) if n else 0.0


def spo_advantages(rewards, v_before, ddof: int = 1, eps: float = 1e-8) -> np.ndarray:
    """A[B] = r - v_before, then (A - mean(A)) / (std(A) + eps) over the batch.

    std with `ddof` (1: torch's unbiased std, as the official code; 0: population std);
    a batch of one sample (no spread to measure) gets A = 0.
    """
    r, v = np.asarray(rewards, np.float64), np.asarray(v_before, np.float64)
    if r.shape != v.shape or r.ndim != 1:
        raise ValueError(f"rewards {r.shape} and v_before {v.shape} must be equal 1-D shapes")
    if ddof not in (0, 1):
        raise ValueError(f"ddof must be 0 or 1, got {ddof}")
    a = r - v
    if a.size <= ddof:
        return np.zeros_like(a)
    return (a - a.mean()) / (a.std(ddof=ddof) + eps)


def offline_prior(successes, n0, rho_min: float, form: Literal["paper", "reference"]
                  ) -> tuple[np.ndarray, np.ndarray]:
    """(alpha0[P], beta0[P]) from s[P] successes in n0 (int or [P]) offline samples,
    N0 = 1 / (1 - rho_min).

    The run's form is `spo.init_form` (configs.common.spo_defaults: "reference").
    paper (Eq. 6, Algorithm 2; the form that reproduces seed 002's worked examples:
      s = 2 of 8 gives alpha0 = 2, beta0 = 6):
        alpha0 = N0 * s / n0,               beta0 = N0 * (n0 - s) / n0
    reference (adds a half, so no estimate starts at exactly 0 or 1):
        alpha0 = N0 * (s + 0.5) / (n0 + 1), beta0 = N0 * (n0 - s + 0.5) / (n0 + 1)
    """
    s = np.asarray(successes, np.float64)
    n0 = np.broadcast_to(np.asarray(n0, np.float64), s.shape)
    if np.any(n0 < 1) or np.any((s < 0) | (s > n0)):
        raise ValueError(f"need n0 >= 1 and 0 <= successes <= n0, got successes {s.tolist()} "
                         f"of n0 {n0.tolist()}")
    big_n = 1.0 / (1.0 - rho_min)
    if form == "paper":
        return big_n * s / n0, big_n * (n0 - s) / n0
    if form == "reference":
        return big_n * (s + 0.5) / (n0 + 1), big_n * (n0 - s + 0.5) / (n0 + 1)
    raise ValueError(f"offline init form must be 'paper' or 'reference', got {form!r}")


MAX_OFFLINE_N = 1_000_000  # offline samples of one prompt; more is a broken file


class OfflineValuesError(ValueError):
    """A line of an offline values file that is not a valid row; names file, line, field."""


def load_offline_values(path: str) -> tuple[list[str], np.ndarray, np.ndarray]:
    """(task_ids, successes[P], n[P]) from a JSONL file of offline samples, one line per
    prompt: {"task_id": non-empty str, "successes": int, "n": int} with 0 <= successes
    <= n and 1 <= n <= MAX_OFFLINE_N, counts written as JSON integers (not 1.7, "3",
    true or 1e30). OfflineValuesError names the file, line and field."""
    ids, succ, n, lines = [], [], [], {}
    with open(path, "rb") as f:
        for line_no, raw in enumerate(f, 1):
            where = f"{path}:{line_no}"
            line = decode_line(raw, where, OfflineValuesError)
            if not line.strip():
                continue
            task_id, s, k = _offline_row(line, where)
            if task_id in lines:
                raise OfflineValuesError(f"{where}: field 'task_id' {task_id!r} repeats "
                                         f"line {lines[task_id]}")
            lines[task_id] = line_no
            ids.append(task_id)
            succ.append(s)
            n.append(k)
    return ids, np.array(succ, np.int64), np.array(n, np.int64)


def _offline_row(line: str, where: str) -> tuple[str, int, int]:
    try:
        row = json.loads(line, parse_constant=lambda name: name)  # NaN: a string, refused
    except (json.JSONDecodeError, RecursionError) as e:
        raise OfflineValuesError(f"{where}: invalid JSON: {getattr(e, 'msg', e)}") from None
    if not isinstance(row, dict):
        raise OfflineValuesError(f"{where}: a row must be a JSON object with task_id, "
                                 f"successes and n, got {row!r}"[:300])
    for field in ("task_id", "successes", "n"):
        if field not in row:
            raise OfflineValuesError(f"{where}: missing field '{field}'")
    task_id, s, k = row["task_id"], row["successes"], row["n"]
    if not isinstance(task_id, str) or not task_id:
        raise OfflineValuesError(f"{where}: field 'task_id' must be a non-empty string, "
                                 f"got {task_id!r}")
    for field, value in (("successes", s), ("n", k)):
        if type(value) is not int:
            raise OfflineValuesError(f"{where}: field '{field}' must be an integer count, "
                                     f"got {value!r}")
    if not 1 <= k <= MAX_OFFLINE_N:
        raise OfflineValuesError(f"{where}: field 'n' must be in [1, {MAX_OFFLINE_N}], "
                                 f"got {k}")
    if not 0 <= s <= k:
        raise OfflineValuesError(f"{where}: field 'successes' must satisfy 0 <= "
                                 f"successes <= n (n = {k}), got {s}")
    return task_id, s, k


@dataclasses.dataclass
class StoredResponse:
    """A prompt's last response with its context: ids int32[T], mask bool[T] (tokens D
    averages over), logp float32[T] (under the policy right after that visit's update)."""

    ids: np.ndarray
    mask: np.ndarray
    logp: np.ndarray


@dataclasses.dataclass(frozen=True)
class SPOConfig:
    """The `spo` section, `SPOConfig(**config.spo)`: one field per key, each documented
    with its default in configs.common.spo_defaults. `prior` is kept as a tuple of
    floats."""

    rho_type: Literal["kl", "constant"]
    d_half: float
    rho_min: float
    rho_max: float
    prior: tuple[float, float]
    sampler_eps: float
    pool_size: int
    in_flight: int
    init_samples: int
    init_values: str
    init_form: Literal["paper", "reference"]
    duplicates: Literal["sequential", "last"]
    adv_std_ddof: int
    unseen: str
    drift_tokens: str

    def __post_init__(self):
        # Each key's range and choices: configs.common (RANGES, CHOICES); here the
        # section's combinations.
        object.__setattr__(self, "prior", (float(self.prior[0]), float(self.prior[1])))
        if self.rho_min > self.rho_max:
            raise ValueError(f"spo.rho_min ({self.rho_min}) must be <= spo.rho_max "
                             f"({self.rho_max})")
        if self.init_samples and self.init_values:
            raise ValueError("set one of spo.init_samples and spo.init_values, not both")


class BetaTracker:
    """Host-side float64 alpha[P], beta[P], rows keyed by task id (grows by doubling from
    `capacity` rows).

    rho_type: "kl" (rho from the drift D) or "constant" (rho = rho_min, whose stationary
      evidence 1 / (1 - rho) equals the offline N0).
    prior: (alpha, beta) of a task never initialised nor updated. Seed 002 initialises
      every prompt offline (init_offline) and gives no prior for unseen ones; the
      official code starts every prompt at Beta(0.5, 0.5) when it uses no offline samples.
    duplicates: how a batch that holds one id several times updates it: "sequential"
      (once per sample, in batch order) or "last" (each sample from the pre-step value,
      the last one written wins: the official code).
    """

    def __init__(self, cfg: SPOConfig, capacity: int = 1024):
        self.rho_type, self.d_half, self.duplicates = cfg.rho_type, cfg.d_half, cfg.duplicates
        self.rho_min, self.rho_max = cfg.rho_min, cfg.rho_max
        self.prior = cfg.prior
        self._index: dict[str, int] = {}
        self._ids: list[str] = []
        self._responses: list[StoredResponse | None] = []
        self.alpha = np.full(max(capacity, 1), self.prior[0])
        self.beta = np.full(max(capacity, 1), self.prior[1])

    def __len__(self) -> int:
        return len(self._ids)

    def __contains__(self, task_id: str) -> bool:
        return task_id in self._index

    def _add(self, task_id: str) -> int:
        if not isinstance(task_id, str):
            raise TypeError(f"task ids are str, got {type(task_id).__name__}: {task_id!r}")
        row = len(self._ids)
        if row == self.alpha.size:
            grow = self.alpha.size
            self.alpha = np.concatenate([self.alpha, np.full(grow, self.prior[0])])
            self.beta = np.concatenate([self.beta, np.full(grow, self.prior[1])])
        self._index[task_id] = row
        self._ids.append(str(task_id))
        self._responses.append(None)
        return row

    def rows(self, task_ids: Sequence[str], insert: bool = False) -> np.ndarray:
        """Row of each id, int64[B]; -1 for unknown ids unless insert (then new rows)."""
        get = self._index.get
        found = list(map(get, task_ids))
        if None in found:
            found = [-1 if row is None else row for row in found]
        rows = np.array(found, np.int64)
        if insert:
            for i in np.flatnonzero(rows < 0):
                row = get(task_ids[i])
                rows[i] = self._add(task_ids[i]) if row is None else row
        return rows

    def values(self, task_ids: Sequence[str]) -> np.ndarray:
        """v[B] = alpha / (alpha + beta); the prior mean for unknown ids. Read-only."""
        rows = self.rows(task_ids)
        a = np.where(rows >= 0, self.alpha[rows], self.prior[0])
        b = np.where(rows >= 0, self.beta[rows], self.prior[1])
        return a / (a + b)

    def rho(self, D=None, size: int | None = None) -> np.ndarray:
        """rho[B] for drifts D[B] ("kl") or the constant rho_min (then D is ignored)."""
        if self.rho_type == "constant":
            n = size if D is None else np.asarray(D).shape[0]
            return np.full(n, self.rho_min)
        if D is None:
            raise ValueError("rho_type='kl' needs D per sample (tracker.drift)")
        return rho_from_drift(D, self.d_half, self.rho_min, self.rho_max)

    def update(self, task_ids: Sequence[str], rewards, *, D=None, rho=None) -> np.ndarray:
        """Apply Eq. 5 per sample; returns rho[B] used.

        rho may be given directly (float or [B]); otherwise it comes from D (rho_type "kl",
        D[B] from drift()) or the constant. Repeated ids follow `self.duplicates`:
        "sequential" is exactly a per-sample Python loop in batch order (samples are
        applied in passes by occurrence rank, each the same float64 `rho * alpha + r`);
        "last" computes every sample from the pre-step value and keeps the last.
        """
        n = len(task_ids)
        r = np.asarray(rewards, np.float64).reshape(-1)
        if r.shape[0] != n:
            raise ValueError(f"{n} task ids but {r.shape[0]} rewards")
        if not np.all((r == 0) | (r == 1)):
            raise ValueError(f"SPO rewards must be 0 or 1, got {np.unique(r).tolist()}")
        rho = (self.rho(D, size=n) if rho is None
               else np.broadcast_to(np.asarray(rho, np.float64), (n,)))
        if rho.shape != (n,):
            raise ValueError(f"rho/D must have one value per sample ({n}), got {rho.shape}")
        if not np.all((rho > 0) & (rho <= 1)):
            raise ValueError(f"rho must be in (0, 1], got min {rho.min()} max {rho.max()}")
        rows = self.rows(task_ids, insert=True)
        if self.duplicates == "last":
            alpha, beta = rho * self.alpha[rows] + r, rho * self.beta[rows] + (1.0 - r)
            last = _last_occurrences(rows)
            self.alpha[rows[last]], self.beta[rows[last]] = alpha[last], beta[last]
            return rho
        for sel in _occurrence_passes(rows):
            rw, rh, rr = rows[sel], rho[sel], r[sel]
            self.alpha[rw] = rh * self.alpha[rw] + rr
            self.beta[rw] = rh * self.beta[rw] + (1.0 - rr)
        return rho

    def init_offline(self, task_ids: Sequence[str], successes, n0,
                     form: Literal["paper", "reference"]) -> None:
        """Set (alpha, beta) from offline sampling (offline_prior; n0 an int or one per
        id); ids must be distinct."""
        if len(set(task_ids)) != len(task_ids):
            raise ValueError("init_offline task ids must be distinct")
        a0, b0 = offline_prior(successes, n0, self.rho_min, form)
        rows = self.rows(task_ids, insert=True)
        self.alpha[rows], self.beta[rows] = a0, b0

    def store_response(self, task_id: str, ids, logp_after_update, mask=None) -> None:
        """Keep this visit's whole response (ids[T], mask[T]: the tokens D averages over)
        and its log-probs under the just-updated policy; replaces the previous one. The
        task must have been updated."""
        row = self._index.get(task_id)
        if row is None:
            raise KeyError(f"store_response for {task_id!r} before any update() of it")
        ids = np.asarray(ids, np.int32)
        logp = np.asarray(logp_after_update, np.float32)
        mask = np.ones(ids.shape, bool) if mask is None else np.asarray(mask, bool)
        if not ids.shape == logp.shape == mask.shape or ids.ndim != 1:
            raise ValueError(f"ids {ids.shape}, logp {logp.shape}, mask {mask.shape} must be "
                             "equal 1-D shapes")
        self._responses[row] = StoredResponse(ids.copy(), mask.copy(), logp.copy())

    def pending_d_requests(self, task_ids: Sequence[str]) -> dict[str, StoredResponse]:
        """Stored responses of the distinct ids in the batch that have one (first-visit ids
        are absent: their D is 0). The trainer scores each under the current params."""
        out = {}
        for t in task_ids:
            row = self._index.get(t)
            if row is not None and self._responses[row] is not None and t not in out:
                out[t] = self._responses[row]
        return out

    def drift(self, task_ids: Sequence[str], logp_now: Mapping[str, Any]) -> np.ndarray:
        """D[B]: policy_drift of each id's stored response against logp_now[id]; 0 when
        the id has no stored response."""
        D = np.zeros(len(task_ids))
        for i, t in enumerate(task_ids):
            row = self._index.get(t)
            req = None if row is None else self._responses[row]
            if req is None:
                continue
            if t not in logp_now:
                raise KeyError(f"no logp_now for {t!r}, which has a stored response")
            D[i] = policy_drift(req.logp, logp_now[t], req.mask)
        return D

    def state_dict(self) -> dict[str, Any]:
        """Row-ordered ids (JSON), alpha/beta float64 and packed stored responses."""
        n = len(self._ids)
        stored = [(row, s) for row, s in enumerate(self._responses) if s is not None]
        return {
            "task_ids": list(self._ids),
            "alpha": self.alpha[:n].copy(),
            "beta": self.beta[:n].copy(),
            "resp_rows": np.array([row for row, _ in stored], np.int64),
            "resp_len": np.array([s.ids.size for _, s in stored], np.int64),
            "resp_ids": _cat([s.ids for _, s in stored], np.int32),
            "resp_mask": _cat([s.mask for _, s in stored], bool),
            "resp_logp": _cat([s.logp for _, s in stored], np.float32),
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        ids = [str(t) for t in state["task_ids"]]
        n = len(ids)
        cap = max(1024, 1 << max(n - 1, 0).bit_length())
        self.alpha = np.full(cap, self.prior[0])
        self.beta = np.full(cap, self.prior[1])
        self.alpha[:n], self.beta[:n] = state["alpha"], state["beta"]
        self._ids, self._index = ids, {t: i for i, t in enumerate(ids)}
        self._responses = [None] * n
        ends = np.cumsum(np.asarray(state["resp_len"], np.int64))
        for row, end, size in zip(state["resp_rows"], ends, state["resp_len"], strict=True):
            sl = slice(int(end - size), int(end))
            self._responses[int(row)] = StoredResponse(
                np.asarray(state["resp_ids"][sl], np.int32).copy(),
                np.asarray(state["resp_mask"][sl], bool).copy(),
                np.asarray(state["resp_logp"][sl], np.float32).copy())


def _cat(arrays: Sequence[np.ndarray], dtype) -> np.ndarray:
    return np.concatenate(arrays).astype(dtype) if arrays else np.zeros(0, dtype)


def _last_occurrences(rows: np.ndarray) -> np.ndarray:
    """Batch positions of each distinct row's last occurrence."""
    _, first_in_reversed = np.unique(rows[::-1], return_index=True)
    return rows.size - 1 - first_in_reversed


def _occurrence_passes(rows: np.ndarray) -> list[np.ndarray]:
    """Split batch positions into passes where pass j holds every row's j-th occurrence
    (in batch order); each pass has distinct rows, so fancy-index updates are safe."""
    if rows.size == 0:
        return []
    order = np.argsort(rows, kind="stable")
    srt = rows[order]
    starts = np.r_[True, srt[1:] != srt[:-1]]
    first = np.maximum.accumulate(np.where(starts, np.arange(rows.size), 0))
    rank_sorted = np.arange(rows.size) - first
    if rank_sorted.max() == 0:
        return [np.arange(rows.size)]
    return [order[rank_sorted == j] for j in range(int(rank_sorted.max()) + 1)]


class PrioritizedSampler:
    """Draws B task ids from a candidate pool with weight w = sqrt(v (1 - v)) + eps (Eq. 11).

    replace=False (default) is successive sampling without replacement (Gumbel top-B:
    the first id is drawn with probability w / sum(w), the next from the rest, ...), so
    a batch spends one response per prompt; seed 002 says only "draw B prompts by the
    weights". replace=True draws B independent categorical samples.
    """

    def __init__(self, tracker: BetaTracker, seed: int = 0, eps: float = 0.05,
                 replace: bool = False):
        self.tracker, self.eps, self.replace = tracker, eps, replace
        self.rng = np.random.default_rng(seed)

    def weights(self, pool: Sequence[str]) -> np.ndarray:
        v = self.tracker.values(pool)
        return np.sqrt(v * (1.0 - v)) + self.eps

    def sample(self, pool: Sequence[str], batch_size: int) -> list[str]:
        """batch_size ids from pool, in draw order."""
        if not self.replace and batch_size > len(pool):
            raise ValueError(f"cannot draw {batch_size} distinct ids from a pool of {len(pool)}")
        w = self.weights(pool)
        if self.replace:
            picks = self.rng.choice(len(pool), size=batch_size, p=w / w.sum())
        else:
            keys = np.log(w) + self.rng.gumbel(size=len(pool))
            top = np.argpartition(-keys, batch_size - 1)[:batch_size] if batch_size else []
            picks = np.asarray(top, np.int64)[np.argsort(-keys[top], kind="stable")]
        return [pool[i] for i in picks]

    def state_dict(self) -> dict[str, Any]:
        return {"rng": self.rng.bit_generator.state}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.rng.bit_generator.state = state["rng"]
