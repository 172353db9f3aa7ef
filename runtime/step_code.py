"""A phase of the per-rank program as one generated Python function, written once per program.

Most steps of a lowered program are a plain call of an op on values already in place: no
reshard, no parameter gather, no rank-aware kernel, no in-op reduction, at most global sizes
rewritten by a static localizer (a view's shape, localized once beforehand by the caller).
Interpreting such a step (walking its inputs, checking each case) cost more than writing the
call out: on the benchmark MLP the interpreted forward and backward took 4.99 ms against
4.80 ms for the same ops written out in straight-line code. So :func:`compile_steps` writes
each plain step as one line, ``env['addmm'] = F1(env['p2'], env['x'], env['t'])``, and hands
every other step to the interpreter's general path (``exec_step``). Frees, dropped parameter
groups and gradient-sync launches come after each step, as the interpreter ran them.

With ``fuse`` (``parallelize(..., compile=True)``), each run of plain steps between the others
is one call of an Inductor-compiled function instead (:mod:`.inductor_segments`).
"""

from __future__ import annotations

from collections.abc import Callable, Collection
from typing import Any

from autopar.runtime.inductor_segments import CompiledRun, runs

# exec_step(step, env, comm, grad_loss, gathered, gathers): the general path for one step
ExecStep = Callable[[Any, dict, Any, Any, dict, list], None]
# run(env, comm, grad_loss, step_done, gathered, gathers, exec_step): one phase on ``env``
Program = Callable[[dict, Any, Any, Any, dict, list, ExecStep], None]
# call_localized(fn, target, args, kwargs): a call whose args were localized beforehand
CallLocalized = Callable[[Any, Any, tuple, dict], Any]


def compile_steps(steps: list[Any], call_localized: CallLocalized,
                  launches: Collection[int] = (), seed: str | None = None,
                  fuse: bool = False, marks: dict[int, str] | None = None,
                  marker: Callable[[str | None], None] | None = None) -> Program:
    """``steps`` as one function, which takes the general path (``exec_step``) as its last
    argument (so the code holds no reference to its caller). A step whose ``localized`` holds
    its args made local runs through ``call_localized``; ``launches``: the steps after which
    the backward may start gradient syncs (``step_done(k)``); ``seed``: the step that scales
    by the loss's gradient (run by ``exec_step``, which knows how); ``fuse``: runs of plain
    steps become Inductor-compiled calls (:mod:`.inductor_segments`); ``marks`` (step index
    -> name) and ``marker``: ``marker(name)`` is called before those steps and
    ``marker(None)`` at the end (the profiler's ranges, :mod:`.profiling`; a mark inside a
    fused run is not taken)."""
    ns: dict[str, Any] = {"S": steps, "C": call_localized, "M": marker}
    marks = marks if marker is not None else None
    lines = ["def run(env, comm, grad_loss, step_done, gathered, gathers, X):",
             "    pop = env.pop"]
    fused = runs(steps, lambda s: _is_plain(s, seed, nested=True), launches) if fuse else {}
    compiled: list[CompiledRun] = []
    k = 0
    while k < len(steps):
        end = fused.get(k)
        if marks and k in marks:
            lines.append(f"    M({marks[k]!r})")
        if end is not None:  # a run of plain steps as one Inductor-compiled call
            fused_run = CompiledRun(steps[k:end], _template)
            ns[f"G{k}"] = fused_run
            compiled.append(fused_run)
            lines += fused_run.code(f"G{k}", _value_of)
            lines += [f"    pop({name!r}, None)" for name in fused_run.frees]
        else:
            s = steps[k]
            call = _plain_call(k, s, seed, ns)
            if call is None:
                lines.append(f"    X(S[{k}], env, comm, grad_loss, gathered, gathers)")
            else:
                lines.append(f"    env[{s.name!r}] = {call}")
            lines += [f"    pop({name!r}, None)" for name in s.free_after]
            end = k + 1
        lines += [f"    gathered.pop({gid}, None)" for t in steps[k:end] for gid in t.drop_gathers]
        if end - 1 in launches:
            lines.append(f"    step_done({end - 1})")
        k = end
    if marks:
        lines.append("    M(None)")
    if len(lines) == 2:
        lines.append("    pass")
    source = "\n".join(lines) + "\n"
    exec(compile(source, "<autopar per-rank program>", "exec"), ns)
    run = ns["run"]
    run.source = source  # what this rank runs, for reading and debugging
    run.compiled_runs = compiled  # its runs of plain steps compiled by Inductor, if fused
    return run


def _is_plain(s: Any, seed: str | None, nested: bool = False) -> bool:
    """The step is a call of its op on values in place (see the module docstring); with
    ``nested``, also one whose tensors sit in lists (``cat``), which the generated call does
    not take but a compiled run does."""
    if any(i.group is not None or i.moves for i in s.inputs):
        return False
    if s.is_getitem:
        return True
    plain = s.direct or s.localized is not None
    flat = s.flat is not None or (nested and s.direct)
    return plain and flat and not s.strategy.raw_outs and s.name != seed


def _template(s: Any) -> tuple[tuple, dict]:
    """A plain step's args and kwargs, tensor slots not yet filled in."""
    return (s.args, s.kwargs) if s.localized is None else s.localized


def _plain_call(k: int, s: Any, seed: str | None, ns: dict[str, Any]) -> str | None:
    """The step as an expression over ``env``, or None if it needs the general path."""
    if not _is_plain(s, seed):
        return None
    if s.is_getitem:
        return _value(s.inputs[0])
    template, kwargs = _template(s)
    at = dict(zip(s.flat, s.inputs))
    ns[f"F{k}"], ns[f"A{k}"], ns[f"K{k}"] = s.fn, template, kwargs
    args = [_value(at[i]) if i in at else f"A{k}[{i}]" for i in range(len(template))]
    if s.localized is not None:
        ns[f"T{k}"] = s.node.target
        return f"C(F{k}, T{k}, ({''.join(a + ', ' for a in args)}), K{k})"
    if kwargs:
        args.append(f"**K{k}")
    return f"F{k}({', '.join(args)})"


def _value(i: Any) -> str:
    return _value_of(i.producer, i.item)


def _value_of(producer: str, item: int | None) -> str:
    v = f"env[{producer!r}]"
    return v if item is None else f"{v}[{item}]"
