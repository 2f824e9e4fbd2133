"""The tuning space and how to search it.

`expand_space(spec)` turns the spec's `tuning:` section into the configs worth compiling
(constraints and the family's own checks prune the rest, each with its reason).

Search strategies work on plain (config, bucket) pairs and a batch evaluator
`evaluate(pairs) -> [seconds]` (inf = failed), so every rung is one batch of
independent tasks that any executor can spread over machines:

- exhaustive: every config on every bucket.
- hillclimb: neighbourhood descent over the ordered parameter grid, per bucket, in
  waves. Wave 0 measures the default config on every bucket; each later wave
  measures, for every bucket, the unmeasured neighbours of its current best (one
  parameter moved one value up or down) and the current bests of its two nearest
  buckets (log batch x log context); a neighbour that failed (inf: compile error,
  resources, wrong output) is stepped over, its own neighbours proposed instead.
  A bucket is done when nothing new is proposed.
  Launch times are close to unimodal along threads and partition size, and
  neighbouring buckets have neighbouring optima, so the descent reaches the optimum
  in a fraction of the configs x buckets measurements; random sampling of the same
  count leaves each bucket's optimum unmeasured with probability 1 - count/total.
  A space with several separated optima can trap it in a local one: give such a
  space the budget for `exhaustive`. (Successive halving over buckets, ranking
  configs on the corner buckets first, was tried and dropped: it discards configs
  that are best only for the middle buckets.)
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from kgen.errors import KgenUserError
from kgen.families.base import resolve_config
from kgen.families.registry import family_for

Bucket = tuple[int, int]  # (batch, context)
ConfigKey = tuple[tuple[str, int], ...]
Evaluate = Callable[[list[tuple[dict, Bucket]]], list[float]]

# Small default buckets on the CPU backend: the fiber runtime runs a 256 x 32768 launch for minutes.
GPU_BUCKETS = {"batch": [1, 8, 64, 256], "context": [128, 1024, 8192, 32768]}
CPU_BUCKETS = {"batch": [1, 4], "context": [128, 1024]}


def config_key(config: dict) -> ConfigKey:
    return tuple(sorted((k, int(v)) for k, v in config.items()))


def spec_names(spec) -> dict[str, int]:
    """The spec-derived names a constraint may use besides the tuning parameters."""
    a = spec.attention
    return {"group_size": spec.group_size, "head_dim": a.head_dim, "block_size": spec.kv_cache.block_size,
            "num_q_heads": a.num_q_heads, "num_kv_heads": a.num_kv_heads}


def eval_constraint(expr: str, names: dict[str, int]) -> bool:
    """Safe: the spec validated the AST (names, numbers, arithmetic, comparisons and logic only)."""
    code = compile(expr, "<constraint>", "eval")
    missing = [n for n in code.co_names if n not in names]
    if missing:
        raise KgenUserError(f"tuning constraint {expr!r}: unknown name {missing[0]!r} "
                            f"(allowed: {', '.join(sorted(names))})")
    try:
        return bool(eval(code, {"__builtins__": {}}, dict(names)))  # noqa: S307 - validated AST
    except ZeroDivisionError:
        return False


@dataclass
class Space:
    configs: list[dict]  # survivors, in enumeration order
    pruned: list[dict] = field(default_factory=list)  # {"config", "reason"}
    defaults: dict = field(default_factory=dict)

    @property
    def size(self) -> int:
        return len(self.configs) + len(self.pruned)


def expand_space(spec) -> Space:
    """Every combination of the spec's tuning parameters, pruned by its constraints and the
    family's checks. Errors: no tuning section, an empty space, an unknown parameter, or
    constraints that leave nothing to try."""
    tuning = spec.tuning
    family = family_for(spec)
    if tuning is None or not tuning.params:
        raise KgenUserError(f"{spec.name}: nothing to tune: the spec has no tuning.params "
                            f"(add e.g. `tuning: {{params: {family.default_space(spec)}}}`; see docs/tuning.md)")
    unknown = sorted(set(tuning.params) - set(family.params))
    if unknown:
        raise KgenUserError(f"{spec.name}: tuning.params.{unknown[0]}: not a parameter of the {family.kind} "
                            f"template (known: {', '.join(sorted(family.params))})")
    for name, values in tuning.params.items():
        bad = [v for v in values if isinstance(v, bool) or not isinstance(v, int)]
        if bad:
            raise KgenUserError(f"{spec.name}: tuning.params.{name}: values must be integers (got {bad[0]!r})")
    base = spec_names(spec)
    names = list(tuning.params)
    space = Space([], [], resolve_config(family, spec, None))
    for values in itertools.product(*(tuning.params[n] for n in names)):
        config = resolve_config(family, spec, dict(zip(names, values, strict=True)))
        env = {**base, **config}
        failed = [c for c in tuning.constraints if not eval_constraint(c, env)]
        problems = [f"constraint {c!r} is false" for c in failed] + family.check_config(spec, config)
        if problems:
            space.pruned.append({"config": config, "reason": "; ".join(problems)})
        else:
            space.configs.append(config)
    if not space.configs:
        shown = "\n".join(f"  {p['config']}: {p['reason']}" for p in space.pruned[:8])
        raise KgenUserError(f"{spec.name}: every one of the {space.size} configs of tuning.params is rejected "
                            f"by the constraints or the template's checks:\n{shown}")
    return space


def resolve_buckets(spec, backend: str, override: dict | None = None) -> list[Bucket]:
    """Buckets to tune: --buckets, else the spec's tuning.buckets, else the backend's defaults."""
    if override is not None:
        axes = override
    elif spec.tuning is not None and spec.tuning.buckets is not None:
        axes = {"batch": spec.tuning.buckets.batch, "context": spec.tuning.buckets.context}
    else:
        axes = CPU_BUCKETS if backend == "cpu" else GPU_BUCKETS
    for axis in ("batch", "context"):
        values = axes.get(axis) or []
        if not values or any(isinstance(v, bool) or not isinstance(v, int) or v < 1 for v in values):
            raise KgenUserError(f"buckets: {axis} must be a non-empty list of positive integers (got {values!r})")
    return [(b, c) for b in sorted(set(axes["batch"])) for c in sorted(set(axes["context"]))]


def parse_buckets(text: str) -> dict:
    """'1,8x128,1024' -> {"batch": [1, 8], "context": [128, 1024]} (the --buckets syntax)."""
    parts = text.lower().replace(" ", "").split("x")
    try:
        if len(parts) != 2:
            raise ValueError
        batch, context = ([int(v) for v in p.split(",")] for p in parts)
    except ValueError:
        raise KgenUserError(f"--buckets: expected BATCHES x CONTEXTS like '1,8x128,1024', got {text!r}") from None
    return {"batch": batch, "context": context}


# ------------------------------------------------------------------ strategies

def exhaustive(configs: Sequence[dict], buckets: Sequence[Bucket], evaluate: Evaluate,
               start: dict | None = None) -> dict:
    """Every config on every bucket, bucket by bucket from the cheapest (batch x context), `start`
    (the defaults) first in each: a run the budget cuts short has compared the configs on the
    buckets it reached (on the CPU backend one launch of a large prefill bucket takes minutes)."""
    first = [c for c in configs if start is not None and config_key(c) == config_key(start)]
    order = first + [c for c in configs if c not in first]
    pairs = [(c, b) for b in sorted(buckets, key=lambda b: (b[0] * b[1], b)) for c in order]
    return dict(zip(((config_key(c), b) for c, b in pairs), evaluate(pairs), strict=True))


def _neighbours(key: ConfigKey, keys: Sequence[ConfigKey]) -> list[ConfigKey]:
    """Configs that differ from `key` in one parameter, by the next smaller or larger value
    present among `keys` (pruned configs leave holes; the step skips over them)."""
    mine = dict(key)
    out = []
    for name in mine:
        same = [k for k in keys if all(v == mine[n] for n, v in k if n != name)]
        lower = [k for k in same if dict(k)[name] < mine[name]]
        higher = [k for k in same if dict(k)[name] > mine[name]]
        if lower:
            out.append(max(lower, key=lambda k: dict(k)[name]))
        if higher:
            out.append(min(higher, key=lambda k: dict(k)[name]))
    return out


def _log_dist(a: Bucket, b: Bucket) -> float:
    return math.dist((math.log2(a[0]), math.log2(a[1])), (math.log2(b[0]), math.log2(b[1])))


def hill_climb(configs: Sequence[dict], buckets: Sequence[Bucket], evaluate: Evaluate, max_evals: int,
               start: dict | None = None, seeds: int = 2) -> dict:
    """See the module docstring. Stops when every bucket's best has no better neighbour, or
    when the next wave would exceed max_evals (then each bucket keeps its best so far)."""
    by_key = {config_key(c): c for c in configs}
    keys = list(by_key)
    first = config_key(start) if start is not None and config_key(start) in by_key else keys[0]
    measured: dict = {}
    todo = [(first, b) for b in buckets]
    while todo and len(measured) + len(todo) <= max(max_evals, len(buckets)):
        for (k, b), t in zip(todo, evaluate([(by_key[k], b) for k, b in todo]), strict=True):
            measured[(k, b)] = t
        best = {b: min((t, k) for (k, bb), t in measured.items() if bb == b) for b in buckets}
        wanted: dict = {}
        for b in buckets:
            near = sorted((x for x in buckets if x != b), key=lambda x: _log_dist(x, b))[:seeds]
            cands = _neighbours(best[b][1], keys) + [best[x][1] for x in near]
            # Step around configs that failed (inf): their neighbours may still beat ours.
            cands += [n2 for n in _neighbours(best[b][1], keys) if measured.get((n, b)) == math.inf
                      for n2 in _neighbours(n, keys)]
            for k in cands:
                if (k, b) not in measured:
                    wanted[(k, b)] = True
        todo = list(wanted)
    return measured


def winners(measured: dict, buckets: Sequence[Bucket]) -> dict[Bucket, ConfigKey | None]:
    """The fastest finite config per bucket (None where every config failed)."""
    out: dict[Bucket, ConfigKey | None] = {}
    for b in buckets:
        times = [(t, k) for (k, bb), t in measured.items() if bb == b and math.isfinite(t)]
        out[b] = min(times)[1] if times else None
    return out


STRATEGIES = ("auto", "exhaustive", "hillclimb")


def search(strategy: str, configs: Sequence[dict], buckets: Sequence[Bucket], evaluate: Evaluate,
           max_evals: int, start: dict | None = None) -> tuple[str, dict]:
    """Run `strategy` (auto | exhaustive | hillclimb); auto is exhaustive when it fits max_evals."""
    if strategy not in STRATEGIES:
        raise KgenUserError(f"strategy must be one of {', '.join(STRATEGIES)} (got {strategy!r})")
    if strategy == "auto":
        strategy = "exhaustive" if len(configs) * len(buckets) <= max_evals else "hillclimb"
    if strategy == "exhaustive":
        return strategy, exhaustive(configs, buckets, evaluate, start=start)
    return strategy, hill_climb(configs, buckets, evaluate, max_evals, start=start)
