"""The planner under memory pressure: planning time and the plan's predicted step, six kinds of
model, at budgets of 1.0, 0.7, 0.5 and 0.35 of each one's unconstrained peak (issue 22).

    python benchmarks/solver.py [--models mlp,cnn,...] [--budgets 1,0.7,0.5,0.35]
                                [--time-limit 30] [--no-long] [--write]

Each model is planned on a 2 x 2 mesh (``cpu`` profile) once with no memory limit, for its
peak; then at each fraction of that peak with the time limit (``--time-limit``, the default
is :data:`autopar.ir.options.TIME_LIMIT_S`) and again with ten times it (``--no-long``
skips those). Times are wall seconds of the ``make_plan`` call as ``autopar plan`` makes it
(on every core this process may use, ``default_workers``: the modes after the first are
planned side by side): tracing, building, every mode and the memory fit; the process start and
imports are not in them. A
budget no plan fits is reported as such. Targets: under 10 s each, and the step within 2% of
the ten-times-longer search.

The models: the issue's 3-layer MLP (widths 30, 70, 50, 6), a CNN with batch norm, a
bidirectional encoder with a classification head, the issue's 2-layer decoder LM (width 48,
3 heads, tied embedding), ``moe-tiny`` and an encoder-decoder with cross-attention; the
hand-made ones are small and written here.
"""

from __future__ import annotations

import argparse
import math
import sys
import time

import torch
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, "benchmarks")
from _common import machine, table, update_results  # noqa: E402

from autopar.ir.errors import PlanError  # noqa: E402
from autopar.ir.mesh import Mesh  # noqa: E402
from autopar.ir.options import TIME_LIMIT_S, Options  # noqa: E402
from autopar.models import MLP, MLPConfig, get_preset  # noqa: E402
from autopar.planning.memory_fit import NOT_COMBINED  # noqa: E402
from autopar.planning.parallel_map import default_workers  # noqa: E402
from autopar.planning.planner import make_plan  # noqa: E402

MESH = Mesh((2, 2), ("dp", "tp"), "cpu")
BUDGETS = (1.0, 0.7, 0.5, 0.35)


class _Attention(nn.Module):
    def __init__(self, d: int, heads: int, causal: bool) -> None:
        super().__init__()
        self.heads, self.causal = heads, causal
        self.q, self.kv, self.proj = nn.Linear(d, d), nn.Linear(d, 2 * d), nn.Linear(d, d)

    def forward(self, x: torch.Tensor, memory: torch.Tensor | None = None) -> torch.Tensor:
        b, t, d = x.shape
        src = x if memory is None else memory
        k, v = self.kv(src).split(d, -1)
        q = self.q(x)
        q, k, v = (z.view(b, -1, self.heads, d // self.heads).transpose(1, 2) for z in (q, k, v))
        a = F.scaled_dot_product_attention(q, k, v, is_causal=self.causal and memory is None)
        return self.proj(a.transpose(1, 2).reshape(b, t, d))


class _Block(nn.Module):
    """Pre-norm transformer block; ``cross``: a cross-attention on an encoder's output too."""

    def __init__(self, d: int, heads: int, causal: bool, cross: bool = False) -> None:
        super().__init__()
        self.n1, self.n2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.attn = _Attention(d, heads, causal)
        self.cross = _Attention(d, heads, False) if cross else None
        self.nc = nn.LayerNorm(d) if cross else None
        self.fc, self.out = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

    def forward(self, x: torch.Tensor, memory: torch.Tensor | None = None) -> torch.Tensor:
        x = x + self.attn(self.n1(x))
        if self.cross is not None:
            x = x + self.cross(self.nc(x), memory)
        return x + self.out(F.gelu(self.fc(self.n2(x))))


class DecoderLM(nn.Module):
    """The issue's LM: token and position embeddings, causal blocks, a tied output head."""

    def __init__(self, vocab: int = 128, d: int = 48, heads: int = 3, layers: int = 2,
                 seq: int = 32) -> None:
        super().__init__()
        self.emb, self.pos = nn.Embedding(vocab, d), nn.Embedding(seq, d)
        self.blocks = nn.ModuleList(_Block(d, heads, True) for _ in range(layers))
        self.norm, self.head = nn.LayerNorm(d), nn.Linear(d, vocab, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        x = self.emb(idx) + self.pos(torch.arange(idx.shape[1], device=idx.device))
        for b in self.blocks:
            x = b(x)
        return F.cross_entropy(self.head(self.norm(x)).flatten(0, 1), targets.flatten())


class Encoder(nn.Module):
    """Bidirectional blocks over embedded tokens, mean-pooled into a classifier."""

    def __init__(self, vocab: int = 128, d: int = 64, heads: int = 4, layers: int = 2,
                 classes: int = 10) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        self.blocks = nn.ModuleList(_Block(d, heads, False) for _ in range(layers))
        self.norm, self.cls = nn.LayerNorm(d), nn.Linear(d, classes)

    def forward(self, idx: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        x = self.emb(idx)
        for b in self.blocks:
            x = b(x)
        return F.cross_entropy(self.cls(self.norm(x).mean(1)), labels)


class EncoderDecoder(nn.Module):
    """An encoder's output read by a causal decoder's cross-attention (T5/BART-shaped)."""

    def __init__(self, vocab: int = 128, d: int = 48, heads: int = 3, layers: int = 2) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        self.enc = nn.ModuleList(_Block(d, heads, False) for _ in range(layers))
        self.dec = nn.ModuleList(_Block(d, heads, True, cross=True) for _ in range(layers))
        self.norm, self.head = nn.LayerNorm(d), nn.Linear(d, vocab, bias=False)

    def forward(self, src: torch.Tensor, tgt: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        m = self.emb(src)
        for b in self.enc:
            m = b(m)
        x = self.emb(tgt)
        for b in self.dec:
            x = b(x, m)
        return F.cross_entropy(self.head(self.norm(x)).flatten(0, 1), labels.flatten())


class ConvNet(nn.Module):
    """Two conv + batch-norm + ReLU stages, pooled, and a linear classifier."""

    def __init__(self, channels: int = 16, classes: int = 10) -> None:
        super().__init__()
        self.c1, self.b1 = nn.Conv2d(3, channels, 3, padding=1), nn.BatchNorm2d(channels)
        self.c2, self.b2 = nn.Conv2d(channels, 2 * channels, 3, padding=1), nn.BatchNorm2d(
            2 * channels)
        self.fc = nn.Linear(2 * channels, classes)

    def forward(self, x: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        x = F.relu(self.b1(self.c1(x)))
        x = F.relu(self.b2(self.c2(F.max_pool2d(x, 2))))
        return F.cross_entropy(self.fc(x.mean((2, 3))), labels)


def _ints(*shape: int, high: int = 128) -> torch.Tensor:
    return torch.randint(0, high, shape)


def build(name: str) -> tuple[nn.Module, tuple]:
    torch.manual_seed(0)
    if name == "mlp":
        return (MLP(MLPConfig(in_dim=30, hidden=(70, 50), out_dim=6, activation="relu")),
                (torch.randn(16, 30), torch.randn(16, 6)))
    if name == "cnn-bn":
        return ConvNet(), (torch.randn(8, 3, 16, 16), _ints(8, high=10))
    if name == "encoder":
        return Encoder(), (_ints(8, 32), _ints(8, high=10))
    if name == "decoder-lm":
        return DecoderLM(), (_ints(8, 32), _ints(8, 32))
    if name == "moe":
        preset = get_preset("moe-tiny")
        return preset.build("cpu"), preset.example_inputs(8, 32, "cpu")
    if name == "enc-dec":
        return EncoderDecoder(), (_ints(8, 32), _ints(8, 32), _ints(8, 32))
    raise SystemExit(f"unknown model {name!r}: use one of {', '.join(MODELS)}")


MODELS = ("mlp", "cnn-bn", "encoder", "decoder-lm", "moe", "enc-dec")


def plan_once(model: nn.Module, inputs: tuple, budget: float, limit_s: float
              ) -> tuple[float, float | None, str]:
    """(wall seconds, predicted step or None where nothing fits, a note)."""
    t0 = time.perf_counter()
    try:
        planned = make_plan(model, MESH, inputs,
                            options=Options.of(memory_budget=budget, time_limit_s=limit_s,
                                               workers=default_workers()))
    except PlanError as e:
        # the leanest layouts fit: the search found no plan that does
        why = "none found" if NOT_COMBINED in str(e) else "infeasible"
        return time.perf_counter() - t0, None, why
    wall = time.perf_counter() - t0
    plan = planned.plan
    note = plan.decided.recompute.mode
    if plan.provenance.solver.limit_cut:
        note += ", cut by the limit"
    return wall, plan.predicted.cost.step_s, note


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", default=",".join(MODELS))
    ap.add_argument("--budgets", default=",".join(map(str, BUDGETS)))
    ap.add_argument("--time-limit", type=float, default=TIME_LIMIT_S)
    ap.add_argument("--no-long", action="store_true", help="skip the 10x time limit runs")
    ap.add_argument("--write", action="store_true", help="update benchmarks/RESULTS.md")
    args = ap.parse_args()
    fractions = [float(x) for x in args.budgets.split(",")]
    rows = []
    over, far = 0, 0
    for name in args.models.split(","):
        model, inputs = build(name)
        free = make_plan(model, MESH, inputs, options=Options.of(memory_budget=math.inf))
        peak = free.plan.predicted.cost.mem_bytes
        for f in fractions:
            wall, step, note = plan_once(model, inputs, f * peak, args.time_limit)
            long_wall, long_step, long_note = (math.nan, None, "skipped") if args.no_long \
                else plan_once(model, inputs, f * peak, 10 * args.time_limit)
            ratio = (f"{step / long_step:.3f}" if step is not None and long_step is not None
                     else "-")
            over += wall > 10.0
            far += ratio != "-" and float(ratio) > 1.02
            rows.append([name, f"{f:g}", f"{wall:.1f}",
                         f"{step * 1e3:.3f}" if step is not None else "-", note,
                         "-" if math.isnan(long_wall) else f"{long_wall:.1f}",
                         f"{long_step * 1e3:.3f}" if long_step is not None else long_note[:30],
                         ratio])
            print(" | ".join(rows[-1]), flush=True)
    head = ["model", "budget", "time s", "step ms", "mode", f"time s ({10 * args.time_limit:g} s"
            " limit)", "step ms (10x)", "step / 10x"]
    body = table(head, rows)
    print(body)
    print(f"{over} of {len(rows)} over 10 s; {far} more than 2% above the 10x search")
    if args.write:
        cmd = "python benchmarks/solver.py " + " ".join(sys.argv[1:])
        update_results("The planner under memory budgets (issue 22)",
                       f"`{cmd}` on {machine()}, 2 x 2 mesh, `cpu` profile, time limit "
                       f"{args.time_limit:g} s; budget = fraction of the unconstrained plan's "
                       "peak.\n\n" + body)


if __name__ == "__main__":
    main()
