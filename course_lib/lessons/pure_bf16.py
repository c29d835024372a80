"""True low-precision training (notebook 03): the weights, their gradients and AdamW's state all in bf16, with no fp32
master copy. 8 bytes per parameter instead of 16, and a new way to fail: an update smaller than half the gap between
neighbouring bf16 values around its weight is rounded away, and the weight does not move.

- `apply_update_`: w <- w + update, stored in w's format by one of three roundings, returning what was applied
  (`lost_updates`: a nonzero update of which nothing was applied): "nearest" (what `p.add_(u)` in bf16 does),
  "stochastic" (`stochastic_round`: up or down at random, right on average) and "kahan" (`kahan_add_`: a bf16
  compensation buffer keeps what rounding dropped and adds it back later).
- `replay`: one sequence of updates applied to bf16 weights with each rounding and to fp32 weights (the reference):
  the share of the movement each lost, and its error per weight.
- `LowPrecisionAdamW`: AdamW's rule (optimizers_by_hand.adamw_update, the same function as notebook 05's) computed
  one format wider than the weights from state stored in the weights' format, written back with one of the roundings;
  it logs, every step, the share of parameters whose update was lost, the share of the update that reached the
  weights, and the share of all updates so far that never did (`lost_so_far`: what rounding to nearest loses for
  good).
- `train`: the course's loop (train.Trainer) with that optimizer on a model stored in bf16 (or fp32: the master-weights
  reference); `bytes_per_parameter`: weights + gradients + optimizer state, measured from the tensors.

bf16 arithmetic gives the same results on every device; where the hardware has no bf16 instructions it is emulated
(slower, not different), so what this module counts holds on any CPU or GPU.
"""

from __future__ import annotations

import dataclasses

import torch

from .. import measure, techniques, train as train_mod
from ..config import TrainConfig
from ..model import GPT
from ..results import RunResult
from .optimizers_by_hand import HandAdamW, adamw_update

ROUNDINGS = ("nearest", "stochastic", "kahan")


# ---- the roundings ------------------------------------------------------------------------------------


def stochastic_round(x: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
    """fp32 -> bf16, rounding up or down at random with probabilities that make the result right on average:
    E[stochastic_round(x)] = x. bf16 is the top 16 bits of an fp32, so add 16 random low bits and cut them off: a
    value 30% of the way from one bf16 neighbour to the next is carried up with probability 0.3."""
    bits = x.to(torch.float32).view(torch.int32)
    noise = torch.randint(0, 1 << 16, x.shape, dtype=torch.int32, device=x.device, generator=generator)
    return ((bits + noise) & -(1 << 16)).view(torch.float32).to(torch.bfloat16)  # low bits zero: this cast is exact


@torch.no_grad()
def kahan_add_(w: torch.Tensor, update: torch.Tensor, comp: torch.Tensor) -> None:
    """w <- w + update with Kahan's compensated summation: `comp` (stored like w) holds what rounding w dropped, and
    is added to the next update, so tiny updates accumulate until they move w instead of vanishing one by one."""
    y = update + comp.to(update.dtype)  # this step's update plus what earlier roundings dropped
    new = (w.to(update.dtype) + y).to(w.dtype)  # the weight, rounded to nearest in its own format
    comp.copy_(y - (new.to(update.dtype) - w.to(update.dtype)))  # what this rounding dropped, kept for later
    w.copy_(new)


@torch.no_grad()
def apply_update_(
    w: torch.Tensor,
    update: torch.Tensor,
    rounding: str = "nearest",
    comp: torch.Tensor | None = None,
    generator: torch.Generator | None = None,
) -> torch.Tensor:
    """w <- w + update (update in a wider format than w), stored in w's format with `rounding`. Returns what was
    applied, exactly (fp64): the change of the stored value, w (w + comp with Kahan)."""

    def stored() -> torch.Tensor:
        return w.double() + (comp.double() if rounding == "kahan" else 0.0)

    before = stored()
    if rounding == "kahan":
        kahan_add_(w, update, comp)
    elif rounding == "stochastic":
        w.copy_(stochastic_round(w.to(update.dtype) + update, generator))
    elif rounding == "nearest":
        w.copy_(w.to(update.dtype) + update)  # copy_ rounds to w's format, to nearest
    else:
        raise ValueError(f"rounding={rounding!r}: use one of {', '.join(ROUNDINGS)}")
    return stored() - before


def lost_updates(update: torch.Tensor, applied: torch.Tensor) -> torch.Tensor:
    """The mask of lost updates: a nonzero update, and nothing applied (the stored value did not move)."""
    return (update != 0) & (applied == 0)


def replay(
    weights: torch.Tensor, updates: list[torch.Tensor], roundings=ROUNDINGS, seed: int = 0
) -> dict[str, dict[str, float]]:
    """The same updates (fp32, one tensor per step) applied to copies of `weights` stored in bf16 with each rounding,
    and to fp32 copies rounded to nearest: the reference, mixed precision's master weights. Every copy starts from the
    same bf16 values. Per rounding, against the reference's total movement d = ref - w0:
    `lost`: the share of d that did not arrive, 1 - (w - w0)·d / d·d (0 when everything arrived, on average too);
    `rms_error`: the root mean square of w - ref over that of d (per weight: stochastic rounding's noise shows here);
    `never_moved`: the share of the weights (with a nonzero total update) still at their starting value."""
    w0 = weights.detach().to(torch.bfloat16)
    ref = w0.float()
    for u in updates:
        ref.add_(u)
    d = ref.double() - w0.double()
    gen = torch.Generator(device=w0.device).manual_seed(seed)
    out = {"fp32 (master weights)": ref}
    for rounding in roundings:
        w, comp = w0.clone(), torch.zeros_like(w0)
        for u in updates:
            apply_update_(w, u, rounding, comp, gen)
        out[f"bf16, {rounding}"] = w
    moved = d != 0
    return {
        name: {
            "lost": 1 - float(((w.double() - w0.double()) * d).sum() / (d * d).sum()),
            "rms_error": float((w.double() - ref.double()).norm() / d.norm()),
            "never_moved": float((w.double() == w0.double())[moved].double().mean()),
        }
        for name, w in out.items()
    }


# ---- AdamW on low-precision weights and state ------------------------------------------------------------


class LowPrecisionAdamW(HandAdamW):
    """AdamW whose weights and moments stay in the parameters' own format (bf16: 2 + 2 + 2 bytes per parameter; Kahan
    adds a 2-byte compensation buffer). Each step reads them one format wider (fp32 for bf16, fp64 for fp32, so that
    what the weights' rounding loses is visible), applies optimizers_by_hand.adamw_update there, and stores the
    moments back rounded to nearest and the weights with `rounding`. After every step, `lost[-1]` is the share of
    parameters whose update was lost, and `kept[-1]` the share of the update that reached the weights, sum(applied x
    update) / sum(update^2): 1 when every update lands, in expectation too (stochastic rounding moves a weight by a
    whole gap, or not at all, but right on average). `lost_so_far[-1]` is the same share for the sums over all steps
    so far, 1 - sum(A·U)/sum(U·U) with U a parameter's updates summed and A what was applied: rounding to nearest
    rounds some updates up and others away, so one step's share can be near 0 while the small updates are lost for
    good."""

    def __init__(self, params, rounding: str = "nearest", seed: int = 0, **adamw):
        """adamw: HandAdamW's lr, betas, eps, weight_decay (and its defaults)."""
        if rounding not in ROUNDINGS:
            raise ValueError(f"rounding={rounding!r}: use one of {', '.join(ROUNDINGS)}")
        super().__init__(params, **adamw)
        self.rounding, self.seed = rounding, seed
        # one per device: stochastic rounding's own random stream
        self.generators: dict[torch.device, torch.Generator] = {}
        self.lost: list[float] = []
        self.kept: list[float] = []
        # Per parameter, the sum of its updates and of what was applied (fp32), for `lost_so_far`: kept here, not in
        # self.state, so that bytes_per_parameter counts only what training needs.
        self.totals: dict[torch.Tensor, tuple[torch.Tensor, torch.Tensor]] = {}
        self.lost_so_far: list[float] = []

    def state_names(self, group):
        return ("m", "v", "comp") if self.rounding == "kahan" else ("m", "v")

    def _generator(self, device: torch.device) -> torch.Generator:
        if device not in self.generators:
            self.generators[device] = torch.Generator(device=device).manual_seed(self.seed)
        return self.generators[device]

    def update(self, p, g, state, group):
        wide = torch.float64 if p.dtype in (torch.float32, torch.float64) else torch.float32
        w, m, v = p.to(wide, copy=True), state["m"].to(wide, copy=True), state["v"].to(wide, copy=True)
        adamw_update(w, g.to(wide), m, v, state["t"], group["lr"], group["betas"], group["eps"], group["weight_decay"])
        state["m"].copy_(m)
        state["v"].copy_(v)
        update = w - p.to(wide)
        applied = apply_update_(p, update, self.rounding, state.get("comp"), self._generator(p.device))
        total_update, total_applied = self.totals.setdefault(
            p, (torch.zeros_like(p, dtype=torch.float32), torch.zeros_like(p, dtype=torch.float32))
        )
        total_update.add_(update)
        total_applied.add_(applied)
        self._lost += int(lost_updates(update, applied).sum())
        self._n += p.numel()
        update = update.double()
        self._num += float((applied * update).sum())
        self._den += float((update * update).sum())

    @torch.no_grad()
    def step(self, closure=None):
        self._lost, self._n, self._num, self._den = 0, 0, 0.0, 0.0
        super().step(closure)
        self.lost.append(self._lost / max(1, self._n))
        self.kept.append(self._num / self._den if self._den else 1.0)
        num = sum(float((a.double() * u.double()).sum()) for u, a in self.totals.values())
        den = sum(float(u.double().square().sum()) for u, _ in self.totals.values())
        self.lost_so_far.append(1 - num / den if den else 0.0)


# ---- training and memory ------------------------------------------------------------------------------


def bytes_per_parameter(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, float]:
    """Bytes per parameter of the weights, their gradients and the optimizer state, measured from the tensors
    (measure.static_bytes: each storage once), and their total."""
    n = sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())
    per = {k: b / n for k, b in measure.static_bytes(model, optimizer).items()}
    return {**per, "total": sum(per.values())}


# How notebook 03 stores the weights: (dtype of the weights, gradients and AdamW state; rounding of the update)
SCHEMES = {
    "fp32 master weights": (torch.float32, "nearest"),
    "pure bf16, nearest": (torch.bfloat16, "nearest"),
    "pure bf16, stochastic rounding": (torch.bfloat16, "stochastic"),
    "pure bf16, Kahan": (torch.bfloat16, "kahan"),
}


def train(
    cfg: TrainConfig,
    rounding: str = "nearest",
    weights: torch.dtype = torch.bfloat16,
    label: str | None = None,
    callback=None,
    **trainer_kwargs,
) -> RunResult:
    """The course's loop (train.Trainer, so the same batches, schedule and autocast as any run of `cfg`) on the
    course's GPT stored in `weights`, with LowPrecisionAdamW in place of the loop's optimizer. weights=torch.float32
    with cfg.precision="bf16" is ordinary mixed precision (fp32 master weights, bf16 autocast): the reference.
    The result's details hold each step's lost share, kept share, and the bytes per parameter at the end."""
    torch.manual_seed(cfg.seed)  # the initial weights the loop would draw for cfg, rounded to `weights`
    model = GPT(cfg.model).to(weights)
    trainer = train_mod.Trainer(cfg, model, **trainer_kwargs)
    opt = LowPrecisionAdamW(
        techniques.param_groups(model, cfg.weight_decay, cfg.decay_2d_only),
        lr=cfg.lr,
        betas=cfg.betas,
        eps=cfg.eps,
        rounding=rounding,
        seed=cfg.seed,
    )
    # the loop's hook point: what it built is .setup, replaced before fit() (the schedule drives the new optimizer)
    trainer.setup = dataclasses.replace(trainer.setup, optimizer=opt, scheduler=techniques.make_scheduler(cfg, opt))
    result = trainer.fit(label or f"{str(weights).removeprefix('torch.')} weights, {rounding}", callback)
    return result.with_details(
        lost=opt.lost, kept=opt.kept, lost_so_far=opt.lost_so_far, bytes_per_parameter=bytes_per_parameter(model, opt)
    )


def update_lost(result: RunResult) -> float | None:
    """The share of a run's updates, summed over its steps, that never reached the weights (None for a run without
    it)."""
    so_far = (result.details or {}).get("lost_so_far")
    return so_far[-1] if so_far else None


def run_rows(results: list[RunResult]) -> list[dict[str, str]]:
    """One row per run of `train`: bytes per parameter, the update lost, the weights that did not move, the loss against
    the first run's (the fp32 master weights)."""
    first = results[0]
    rows = []
    for r in results:
        d, b = r.details, r.details["bytes_per_parameter"]
        rows.append(
            {
                "weights": r.label,
                "bytes/param: weights + grads + AdamW state": f"{b['parameters']:g} + {b['gradients']:g} + "
                f"{b['optimizer state']:g} = {b['total']:g}",
                "updates lost over the run": f"{round(100 * update_lost(r), 2) + 0.0:.2f}%",
                "weights not moved, mean per step": f"{100 * sum(d['lost']) / len(d['lost']):.3f}%",
                "final loss": f"{r.losses[-1]:.4f}",
                "largest difference from the first run's loss": (
                    f"{100 * max(abs(a - b) / b for a, b in zip(r.losses, first.losses)):.3f}%"
                ),
            }
        )
    return rows


def placeholder(ax, text: str) -> None:
    """Grey text in the middle of an empty panel plot, saying which run would fill it."""
    ax.text(0.5, 0.5, text, ha="center", va="center", transform=ax.transAxes, fontsize=8, color="grey")


def plot_update_lost(results: list[RunResult], ax):
    """Per optimizer step, the share of the updates so far that never reached the weights (details["lost_so_far"]) of
    every run of `train` (a panel plot: fn(results, ax)); other runs are left out."""
    drawn = 0
    for r in results:
        so_far = (getattr(r, "details", None) or {}).get("lost_so_far")
        if so_far:
            ax.plot([100 * x for x in so_far], lw=1.2, label=f"{r.label}: {round(100 * so_far[-1], 2) + 0.0:.2f}% lost")
            drawn += 1
    ax.axhline(0, color="grey", lw=0.8, ls=":")
    if drawn:
        ax.legend(fontsize=7, loc="upper left")
    else:
        placeholder(ax, "no run with its weights in bf16 yet\n(weights: pure bf16 ...)")
    ax.set(xlabel="optimizer step", ylabel="% of the updates so far")
    ax.set_title(
        "Updates that never reached the weights\n(1 - applied . update / update . update, summed over steps)",
        fontsize=9,
    )
    return ax.figure
