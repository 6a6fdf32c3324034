"""Render: template spaces (templates/<name>/space.toml) and Jinja rendering of candidates."""

from __future__ import annotations

import functools
import itertools
import json
import re
import tomllib
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import jinja2

from ..errors import Cudal2Error
from ..problem import Problem
from .candidate import Candidate

# Opt-in shared memory per block by compute capability (CUDA programming guide, table of
# technical specifications); a template's `max_smem` constraint is checked against it.
MAX_SMEM = {80: 166912, 86: 101376, 87: 166912, 89: 101376, 90: 232448, 100: 232448, 120: 101376}


def max_smem(cc: int) -> int:
    """Opt-in shared memory per block of a target (the newest known where cc is not listed)."""
    return MAX_SMEM.get(cc, 232448)


def target_facts(cc: int) -> dict[str, int]:
    """What constraints may read about the target besides the parameters."""
    return {"cc": cc, "max_smem": max_smem(cc)}


def bundled_dir(name: str) -> Path:
    """A data folder shipped with the package (wheel) or beside it (source checkout)."""
    package = Path(__file__).resolve().parent.parent
    for candidate in (package / name, package.parent / name):
        if candidate.is_dir():
            return candidate
    raise Cudal2Error(f"cannot find the {name}/ folder next to {package}")


def arch_cc(arch: str) -> int:
    """'sm_90a' -> 90; a name nvcc would not take, or a target no template knows, is an error."""
    found = re.fullmatch(r"sm_(\d+)[af]?", arch)
    if not found or int(found[1]) not in MAX_SMEM:
        raise Cudal2Error(f"unknown architecture {arch!r}; expected one of "
                          f"{', '.join(f'sm_{cc}' + ('a' if cc in (90, 100) else '') for cc in MAX_SMEM)}")
    return int(found[1])


def newest_cc(template: str) -> int:
    """The target `template`'s parameters are checked against before a GPU says which one it
    is (on a machine without one, or before it is started): of those it runs on, the one with
    the most shared memory, the newest of those, so that no configuration some GPU runs is
    refused (the newest, sm_120, has less than half of sm_90's)."""
    space = get_template(template).space
    return max((cc for cc in MAX_SMEM if space.runs_on(cc)), key=lambda cc: (MAX_SMEM[cc], cc))


@functools.cache
def _compiled(expr: str):
    return compile(expr, "<space.toml>", "eval")


def _names(code) -> list[str]:
    """Every name a compiled expression reads, comprehensions included."""
    found = list(code.co_names) + list(code.co_varnames)
    for const in code.co_consts:
        if hasattr(const, "co_names"):
            found += _names(const)
    return found


_GLOBALS = {"__builtins__": {}, "min": min, "max": max}  # what a space's expressions may call


def _evaluate(expr: str, names: dict[str, Any]) -> Any:
    return eval(_compiled(expr), _GLOBALS, names)  # trusted: shipped files


def _assignments(table: dict[str, str]):
    """A table of `name = expression` (derived values, cost keys) as one code object: each
    may read the names above it; one call instead of one per expression."""
    return compile("\n".join(f"{name} = ({expr})" for name, expr in table.items()), "<space.toml>", "exec")


@dataclass(frozen=True)
class Param:
    name: str
    values: tuple[Any, ...]
    default: Any
    help: str
    # The value that kernels recorded before this parameter existed were built with (when
    # that is not the default): what a recorded row without it is read as.
    before: Any = None

    @property
    def recorded_absent(self) -> Any:
        return self.default if self.before is None else self.before

    def coerce(self, raw: Any) -> Any:
        """A command-line string to the value it names: 'auto' stays text, '4' becomes 4."""
        if not isinstance(raw, str) or raw in self.values:
            return raw
        try:
            return int(raw)
        except ValueError:
            if all(isinstance(v, int) for v in self.values):
                raise Cudal2Error(f"parameter {self.name} takes an integer, got {raw!r}") from None
            return raw


@dataclass(frozen=True)
class Space:
    """A template's parameter space: values per parameter, derived values, constraints."""

    description: str
    min_cc: int
    max_cc: int | None
    dtypes: tuple[str, ...]
    layouts: tuple[str, ...]
    params: dict[str, Param]
    derived: dict[str, str]
    constraints: tuple[str, ...]
    cost: dict[str, str]
    # [launch]: parameter -> the value that launches the same kernel work on a problem (a cap
    # above what the problem can use); see launched().
    launch: dict[str, str] = field(default_factory=dict)
    compile_s: float = 60.0  # nvcc seconds (one core) of one configuration: the search's price of a build
    # Valid configurations per compute capability, as value tuples in parameter order: the
    # enumeration is the larger part of ranking a space (seconds), and the same for every problem.
    _valid: dict[int, tuple[tuple[Any, ...], ...]] = field(default_factory=dict, compare=False, repr=False)
    # The `derived` and `cost` tables compiled (see _assignments), by table name.
    _code: dict[str, Any] = field(default_factory=dict, compare=False, repr=False)
    _cost_reads: list[str] = field(default_factory=list, compare=False, repr=False)  # see cost_params

    @classmethod
    def load(cls, path: Path) -> Space:
        doc = tomllib.loads(path.read_text())
        params = {
            name: Param(name, tuple(spec["values"]), spec["default"], spec.get("help", ""), spec.get("before"))
            for name, spec in doc.get("params", {}).items()
        }
        if strays := sorted(set(doc.get("launch", {})) - set(params)):
            raise Cudal2Error(f"{path}: [launch] names {', '.join(strays)}, which are not parameters of the space")
        return cls(
            description=doc.get("description", ""),
            min_cc=doc.get("min_cc", 0),
            max_cc=doc.get("max_cc"),
            dtypes=tuple(doc.get("dtypes", ("fp16", "bf16"))),
            layouts=tuple(doc.get("layouts", ("nn", "nt"))),
            params=params,
            derived=dict(doc.get("derived", {})),
            constraints=tuple(doc.get("constraints", ())),
            cost=dict(doc.get("cost", {})),
            launch=dict(doc.get("launch", {})),
            compile_s=float(doc.get("compile_s", 60.0)),
        )

    def runs_on(self, cc: int) -> bool:
        return cc >= self.min_cc and (self.max_cc is None or cc <= self.max_cc)

    def defaults(self) -> dict[str, Any]:
        return {name: p.default for name, p in self.params.items()}

    def complete(self, params: dict[str, Any]) -> dict[str, Any] | None:
        """Recorded parameters as a configuration of this space: parameters added since
        take the value that reproduces the older kernels: `before` where the space names
        one, else the default, and the default where `before` would break a constraint
        (the older kernel then did what the default does); None if a parameter or value is
        no longer in the space."""
        if any(k not in self.params or v not in self.params[k].values for k, v in params.items()):
            return None
        filled = {**{name: p.recorded_absent for name, p in self.params.items()}, **params}
        newest = max(MAX_SMEM)  # the kernel ran somewhere: judge it on the newest target
        if self.violations(filled, newest):
            plain = {**self.defaults(), **params}
            if not self.violations(plain, newest):
                return plain
        return filled

    def facts(self, params: dict[str, Any], cc: int) -> dict[str, Any]:
        """Parameters plus derived values and target facts, as constraints see them."""
        names: dict[str, Any] = {**params, **target_facts(cc)}
        self._assign("derived", names)
        return names

    def cost_inputs(self, params: dict[str, Any], cc: int, problem: Problem, sm_count: int) -> dict[str, Any]:
        """The [cost] table for one configuration on one problem: tile_m, tile_n,
        ctas_per_sm, efficiency, split_k (default 1), warps per block (optional: enables the
        occupancy term), requires (default True; False means it cannot run this shape),
        extra_bytes / extra_launches (default 0: memory passes around the GEMM, such as
        copies of operands with unaligned rows), extra_us (default 0: fixed set-up time
        per call), ordered_reduction (default False: split-K slices are summed in a fixed
        order, one after another) and slices_wait (default True: the split-K slices of a tile
        run together and wait for each other; False where they run as independent batches)
        and waiting_slices (default 0: as slices_wait says; else how many of a tile's split_k
        slices wait for each other, such as the CTAs of one of several clusters sharing a tile)
        and exposed_epilogue_bytes (default 0: bytes of a tile's output that its SM stores
        while no other tile's mainloop runs) and stream_k_tiles (default 0: tiles whose K
        iterations are spread evenly over all SMs, stream-K) and walked_tiles (default 0: the
        output tiles; more where a scheduler pads their count and runs the padding tiles too)
        and tiles (default: M and N each cut by tile_m and tile_n) and in_flight_bytes (default 0:
        not modelled; else the bytes of loads a CTA keeps in flight, cost.IN_FLIGHT_BYTES) and
        cluster_ctas (default 1: the CTAs of a launched cluster, which share one GPC).
        A key may read the keys above it in the table."""
        if "pricer" not in self._code:
            self._code["pricer"] = self._pricer()
        inputs: dict[str, Any] = self._code["pricer"](params, target_facts(cc), problem.m, problem.n, problem.k,
                                                      problem.layout, sm_count)
        for name, default in (("requires", True), ("split_k", 1), ("extra_bytes", 0), ("extra_launches", 0),
                              ("extra_us", 0.0), ("ordered_reduction", False), ("slices_wait", True),
                              ("waiting_slices", 0), ("exposed_epilogue_bytes", 0), ("stream_k_tiles", 0),
                              ("walked_tiles", 0), ("pipeline_stages", 0), ("tile_k", 0), ("in_flight_bytes", 0),
                              ("cluster_ctas", 1)):
            inputs.setdefault(name, default)
        # Output tiles: M cut by tile_m and N by tile_n, unless the table counts them itself (a
        # kernel that swaps the operands cuts N by tile_m and M by tile_n).
        inputs.setdefault("tiles", -(-problem.m // int(inputs["tile_m"])) * -(-problem.n // int(inputs["tile_n"])))
        return inputs

    def launched(self, params: dict[str, Any], cc: int, problem: Problem, sm_count: int) -> dict[str, Any]:
        """`params` with each parameter of the [launch] table replaced by the value that runs the
        same kernel work on `problem`: two configurations whose launched parameters agree are one
        measurement on it (caps above the problem's need), so the search takes one of them."""
        if not self.launch:
            return params
        names = {**self.facts(params, cc), "m": problem.m, "n": problem.n, "k": problem.k,
                 "layout": problem.layout, "sm_count": sm_count}
        return {**params, **{name: _evaluate(expr, names) for name, expr in self.launch.items()}}

    def launch_key(self, params: dict[str, Any], cc: int, problem: Problem, sm_count: int) -> str:
        """launched() as one comparable string: configurations of this space with equal keys run
        the same kernel work on `problem`."""
        return json.dumps(self.launched(params, cc, problem, sm_count), sort_keys=True)

    def violations(self, params: dict[str, Any], cc: int) -> list[str]:
        names = self.facts(params, cc)
        return [rule for rule in self.constraints if not _evaluate(rule, names)]

    def resolve(self, given: dict[str, Any], cc: int, template: str) -> dict[str, Any]:
        """Defaults filled in, values coerced and checked; raises on anything invalid."""
        unknown = sorted(set(given) - set(self.params))
        if unknown:
            raise Cudal2Error(
                f"unknown parameter {', '.join(unknown)} for template {template}; "
                f"its parameters are {', '.join(self.params)}"
            )
        params = self.defaults()
        for name, raw in given.items():
            spec = self.params[name]
            value = spec.coerce(raw)
            if value not in spec.values:
                raise Cudal2Error(
                    f"{name}={value} is outside template {template}'s space "
                    f"({', '.join(map(str, spec.values))})"
                )
            params[name] = value
        broken = self.violations(params, cc)
        if broken:
            shown = ", ".join(f"{k}={v}" for k, v in params.items())
            raise Cudal2Error(f"invalid {template} configuration ({shown}): fails {'; '.join(broken)}")
        return params

    def _pricer(self):
        """The [cost] table as one function of (params, target facts, m, n, k, layout,
        sm_count) -> the table's values: the parameters and derived values it reads become
        local variables, each key one assignment in file order. Ranking a space calls it for
        every configuration the model tells apart (100,000 for sm90_cutlass), 4x faster than
        running the tables on a dictionary of names."""
        params, derived = set(), set()
        for expr in self.cost.values():
            read = self.reads(expr)
            params |= read[0]
            derived |= read[1]
        lines = ["def cost_table(params, facts, m, n, k, layout, sm_count):"]
        lines += [f"    {name} = params[{name!r}]" for name in self.params if name in params]
        lines += [f"    {name} = facts[{name!r}]" for name in target_facts(0)]
        lines += [f"    {name} = ({self.derived[name]})" for name in self.derived if name in derived]
        lines += [f"    {name} = ({expr})" for name, expr in self.cost.items()]
        lines.append("    return {" + ", ".join(f"{name!r}: {name}" for name in self.cost) + "}")
        scope = dict(_GLOBALS)
        exec(compile("\n".join(lines), "<space.toml [cost]>", "exec"), scope)  # trusted: shipped files
        return scope["cost_table"]

    def _assign(self, table: str, names: dict[str, Any]) -> None:
        """Runs the table `derived` on `names`, adding each of its keys."""
        if table not in self._code:
            self._code[table] = _assignments(getattr(self, table))
        exec(self._code[table], _GLOBALS, names)  # trusted: shipped files

    def configurations(self, cc: int) -> Iterator[dict[str, Any]]:
        """Every valid parameter set, in the order of the values lists (that of
        itertools.product); enumerated once per compute capability."""
        names = list(self.params)
        return (dict(zip(names, values)) for values in self.value_sets(cc))

    def value_sets(self, cc: int) -> tuple[tuple[Any, ...], ...]:
        """The valid parameter sets as tuples of values in parameter order (configurations'
        order): what a ranking keeps of each, since a dictionary apiece would take 170 MB per
        problem on Hopper."""
        if cc not in self._valid:
            self._valid[cc] = tuple(self._enumerate(cc))
        return self._valid[cc]

    def _enumerate(self, cc: int) -> Iterator[tuple[Any, ...]]:
        """The valid parameter sets, as value tuples. Each constraint is checked as soon as
        the parameters it reads are chosen, so whole subtrees of the product are skipped, not
        enumerated; the checks of one depth run as one compiled function (_depth_check)."""
        names = list(self.params)
        depth = {name: i for i, name in enumerate(names)}
        # Per depth: the constraints whose last parameter is chosen there, in file order.
        rules: list[list[str]] = [[] for _ in names]
        for rule in self.constraints:
            params, _ = self.reads(rule)
            rules[max((depth[n] for n in params), default=0)].append(rule)
        checks = [self._depth_check(names[: i + 1], found, cc) if found else None for i, found in enumerate(rules)]
        values = [self.params[name].values for name in names]
        last = len(names) - 1

        def walk(i: int, chosen: list[Any]) -> Iterator[tuple[Any, ...]]:
            check = checks[i]
            for value in values[i]:
                chosen.append(value)
                if check is None or check(*chosen):
                    if i == last:
                        yield tuple(chosen)
                    else:
                        yield from walk(i + 1, chosen)
                chosen.pop()

        yield from walk(0, [])

    def _depth_check(self, names: list[str], rules: list[str], cc: int):
        """One function of the parameters chosen so far (`names`, in order) that says whether
        `rules` all hold on target `cc`: each rule in turn, after the derived values it reads
        (in file order, each computed once), stopping at the first that fails."""
        lines = [f"def check({', '.join(names)}):"]
        done: set[str] = set()
        for rule in rules:
            _, derived = self.reads(rule)
            for name in self.derived:
                if name in derived and name not in done:
                    done.add(name)
                    lines.append(f"    {name} = ({self.derived[name]})")
            lines.append(f"    if not ({rule}):")
            lines.append("        return False")
        lines.append("    return True")
        scope = {**_GLOBALS, **target_facts(cc)}
        exec(compile("\n".join(lines), "<space.toml constraints>", "exec"), scope)  # trusted: shipped files
        return scope["check"]

    def binding(self, cc: int) -> tuple[str, ...]:
        """The constraints that some values of the parameters they read break on target `cc`.
        A constraint reads parameters, derived values and the target's facts only, so each
        of the others holds for every parameter set there."""
        found = []
        for rule in self.constraints:
            params, derived = self.reads(rule)
            names, steps = sorted(params), tuple(d for d in self.derived if d in derived)
            if not all(self._holds(rule, steps, {**target_facts(cc), **dict(zip(names, values))})
                       for values in itertools.product(*(self.params[name].values for name in names))):
                found.append(rule)
        return tuple(found)

    def _holds(self, rule: str, derived: tuple[str, ...], env: dict[str, Any]) -> bool:
        """Whether `rule` holds for the parameters and target facts in `env`, once the derived
        values it reads (`derived`, in file order) are added to it."""
        for name in derived:
            env[name] = _evaluate(self.derived[name], env)
        return bool(_evaluate(rule, env))

    def admits(self, problem: Problem) -> bool:
        """False where the [cost] table's `requires` rules the problem out whatever the
        parameters (an expression of m, n, k, layout and parameters: each combination of the
        values of those it reads is tried); True otherwise, and where it reads derived values."""
        rule = self.cost.get("requires")
        if rule is None:
            return True
        params, derived = self.reads(rule)
        if derived:
            return True
        names = sorted(params)
        shape = {"m": problem.m, "n": problem.n, "k": problem.k, "layout": problem.layout}
        return any(
            _evaluate(rule, shape | dict(zip(names, values)))
            for values in itertools.product(*(self.params[name].values for name in names))
        )

    def cost_params(self) -> tuple[str, ...]:
        """The parameters the [cost] table reads (through derived values): two configurations
        alike in these have the same cost inputs on every problem."""
        if not self._cost_reads:
            self._cost_reads.extend(sorted(set().union(*(self.reads(expr)[0] for expr in self.cost.values()))))
        return tuple(self._cost_reads)

    def reads(self, expr: str) -> tuple[set[str], set[str]]:
        """(parameters, derived values) an expression reads, through derived values."""
        params: set[str] = set()
        derived: set[str] = set()
        pending = _names(_compiled(expr))
        while pending:
            name = pending.pop()
            if name in self.params:
                params.add(name)
            elif name in self.derived and name not in derived:
                derived.add(name)
                pending.extend(_names(_compiled(self.derived[name])))
        return params, derived


@dataclass(frozen=True)
class Template:
    name: str
    path: Path
    space: Space

    def supports(self, problem: Problem, cc: int) -> bool:
        """Whether some configuration can run `problem`: its dtype, layout and target, and
        its [cost] table's `requires` where that reads the problem alone (gemv's few rows)."""
        return (
            problem.dtype in self.space.dtypes
            and problem.layout in self.space.layouts
            and self.space.runs_on(cc)
            and self.space.admits(problem)
        )

    def render(self, params: dict[str, Any], problem: Problem) -> str:
        return _jinja(self.path).render(**params, dtype=problem.dtype, layout=problem.layout)


INCLUDE = "include"  # the templates' shared folder (no kernel.cu.j2, so not a template)


@functools.cache
def _jinja(folder: Path) -> jinja2.Template:
    """A template folder's kernel.cu.j2, parsed once per process (renders are then ~0.1 ms). It
    may include its own files and those of the templates' shared folder, include/ (device code
    two templates share, rendered into each source: a source stays whole)."""
    env = jinja2.Environment(
        loader=jinja2.FileSystemLoader([folder, folder.parent / INCLUDE]),
        undefined=jinja2.StrictUndefined,
        keep_trailing_newline=True,
    )
    return env.get_template("kernel.cu.j2")


@functools.cache
def load_templates(root: Path | None = None) -> dict[str, Template]:
    """Every template folder (one holding kernel.cu.j2 and space.toml) under `root`."""
    root = root or bundled_dir("templates")
    return {
        folder.name: Template(folder.name, folder, Space.load(folder / "space.toml"))
        for folder in sorted(root.iterdir())
        if (folder / "kernel.cu.j2").is_file() and (folder / "space.toml").is_file()
    }


def get_template(name: str) -> Template:
    templates = load_templates()
    if name not in templates:
        raise Cudal2Error(f"unknown template {name!r}; available: {', '.join(templates)}")
    return templates[name]


def template_candidate(name: str, given: dict[str, Any], cc: int) -> Candidate:
    """A validated candidate for template `name` with `given` parameters (defaults filled)."""
    return Candidate.from_template(name, get_template(name).space.resolve(given, cc, name))


def template_grid(name: str, grid: dict[str, list[str]], cc: int) -> list[Candidate]:
    """Candidates for every combination of the listed values (defaults elsewhere).

    A single combination must be valid; in a larger grid the invalid combinations are
    skipped, and an empty result is an error.
    """
    names = list(grid)
    combos = [dict(zip(names, values)) for values in itertools.product(*(grid[n] for n in names))]
    if len(combos) == 1:
        return [template_candidate(name, combos[0], cc)]
    found, last_error = [], None
    for combo in combos:
        try:
            found.append(template_candidate(name, combo, cc))
        except Cudal2Error as exc:
            if "outside" in str(exc) or "unknown parameter" in str(exc):
                raise
            last_error = exc
    if not found:
        raise Cudal2Error(f"no valid configuration in that grid; for example: {last_error}")
    return list(dict.fromkeys(found))


def recorded_params(row: Mapping[str, Any], templates: dict[str, Template] | None = None) -> dict[str, Any] | None:
    """A leaderboard row's template parameters as a configuration of today's space (see
    Space.complete), or None: a free-form kernel, a template no longer known, or parameters
    that left the space."""
    templates = load_templates() if templates is None else templates
    name, params = row.get("template"), row.get("params")
    if not isinstance(name, str) or name not in templates or not isinstance(params, str):
        return None
    return templates[name].space.complete(json.loads(params))


def render(candidate: Candidate, problem: Problem) -> str:
    """The CUDA source of `candidate` for `problem`'s dtype and layout."""
    if candidate.source is not None:
        return candidate.source
    template = get_template(candidate.template)
    if problem.dtype not in template.space.dtypes or problem.layout not in template.space.layouts:
        raise Cudal2Error(f"template {template.name} does not support {problem.dtype} {problem.layout}")
    return template.render(candidate.param_dict, problem)
