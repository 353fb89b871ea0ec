"""Fig 5b/5c: how well a LoGRA sketch reconstructs the true dense gradient, per layer and module.

For the tiny recipe's warm-started model and k batches of real training text (prompt +
reference answer of the RL task), each target's true dense gradient ``G_t`` comes from
ordinary autograd (targets trainable); the sketch ``S_t`` comes from the project's capture
path (``install_sketches``: frozen targets, forward hook, identity autograd function), and the
reconstruction is ``Ĝ_t = S_t·A_t`` with the projection the optimizer would use at update
t − 1 (refreshed) or 0 (fixed). Measured per target:

* single step: mean over t of ``cos(G_t, Ĝ_t)``, and over t and ``cosine_draws`` further
  projections (``single_mc``, many draws, the figure shown) — compared with sqrt(r / (r + n_in)), the
  cosine's large-dimension value (E⟨G, G·AᵀA⟩ = ‖G‖², E‖G·AᵀA‖² ≈ ‖G‖²·(1 + n_in/r));
* accumulated: ``cos(Σ_t G_t, Σ_t Ĝ_t)`` after k steps, fixed vs refreshed projection
  (refreshing averages independent projections, so the cosine grows with k; a fixed A keeps
  the same subspace and does not);
for Rademacher and Gaussian entries (``logra.distribution``). The sketch is also checked to
equal ``G_t·A_tᵀ`` (the capture path computes exactly that, in another order).
"""

from __future__ import annotations

import logging
import math
from pathlib import Path

import torch

from megatron_logra.bench.config import PaperBenchConfig
from megatron_logra.plot import pyplot, save_figure

logger = logging.getLogger(__name__)

__all__ = ["cosine", "theory_cosine", "reconstruction_cosines", "measure_cosines", "plot_cosines"]

MODULES = ("linear_qkv", "linear_proj", "linear_fc1", "linear_fc2")
SETTINGS = (("rademacher", True), ("rademacher", False), ("gaussian", True), ("gaussian", False))


def cosine(a: torch.Tensor, b: torch.Tensor) -> float:
    """Frobenius cosine of two same-shape tensors, in float64."""
    a, b = a.double().reshape(-1), b.double().reshape(-1)
    return float(a @ b / (a.norm() * b.norm()).clamp_min(1e-300))


def theory_cosine(rank: int, n_in: int) -> float:
    """sqrt(r / (r + n_in)): the expected cosine between G and G·AᵀA for E[AᵀA] = I, large n_in."""
    return math.sqrt(rank / (rank + n_in))


def reconstruction_cosines(grads: list[torch.Tensor], sketches: list[torch.Tensor],
                           projections: list[torch.Tensor]) -> tuple[float, float]:
    """(mean single-step cosine, accumulated cosine) of dense ``grads`` G_t vs ``sketches`` S_t · A_t."""
    recon = [s.double() @ a.double() for s, a in zip(sketches, projections)]
    single = sum(cosine(g, r) for g, r in zip(grads, recon)) / len(grads)
    return single, cosine(sum(g.double() for g in grads), sum(recon))


def _setup(cfg: PaperBenchConfig):
    from megatron_logra.config import parse_args_to_config
    from megatron_logra.data.tokenizer import build_tokenizer, load_tokenizer
    from megatron_logra.models.gpt import build_gpt
    from megatron_logra.parallel import initialize_parallel
    from megatron_logra.rewards import build_task
    from megatron_logra.rl.sft import load_weights

    job = parse_args_to_config("tiny-adam", [])
    groups = initialize_parallel(job.parallel, seed=1)
    task = build_task(job.task)
    if job.tokenizer.path:
        tok = load_tokenizer(job.tokenizer.path)
    else:
        tok = build_tokenizer(job.tokenizer, [task.train_problem(i).prompt + " " + task.train_problem(i).answer
                                              for i in range(64)])
    model = build_gpt(job.model, groups, seed=1)
    warm = bool(job.sft.init_path) and Path(job.sft.init_path).exists()
    if warm:
        load_weights(model, groups, Path(job.sft.init_path))
    else:
        logger.warning("no shipped warm start: the cosines are measured on the randomly initialised model")
    return job, groups, task, tok, model, warm


def _batches(cfg: PaperBenchConfig, job, task, tok) -> list:
    from megatron_logra.rl.batching import pack_sequences
    from megatron_logra.rl.prompts import rl_prompt_ids

    out = []
    for t in range(cfg.cosine_steps):
        prompts, answers = [], []
        for i in range(cfg.cosine_batch):
            p = task.train_problem(7_000_000 + t * cfg.cosine_batch + i)  # away from the RL and warm-start streams
            prompts.append(rl_prompt_ids(tok, job.rl, p.prompt))
            answers.append(tok(p.answer, add_special_tokens=False)["input_ids"] + [tok.eos_token_id])
        n = len(prompts)
        out.append(pack_sequences(prompts, answers, rollout_logprobs=[[0.0] * len(a) for a in answers],
                                  advantages=[1.0] * n, finished=[True] * n, pad_id=tok.pad_token_id,
                                  max_length=job.model.seq_length))
    return out


def measure_cosines(cfg: PaperBenchConfig) -> dict:
    """Per (distribution, refresh) and target: single-step and accumulated cosines, theory, n_in.

    Returns ``{"rows": [...], "rank", "k", "warm_start", "capture_max_rel_err"}``; each row has
    layer, module, n_in, theory, distribution, refresh, single, accumulated.
    """
    from megatron_logra.parallel import destroy_parallel
    from megatron_logra.sketch.capture import install_sketches
    from megatron_logra.train.step import forward_backward

    torch.set_num_threads(cfg.threads)
    job, groups, task, tok, model, warm = _setup(cfg)
    try:
        batches = _batches(cfg, job, task, tok)
        weights = {name: mod.weight for name, mod in model.named_modules() if name.split(".")[-1] in MODULES}
        dense: dict[str, list[torch.Tensor]] = {n: [] for n in weights}
        for batch in batches:  # true dense gradients by autograd
            model.zero_grad(set_to_none=True)
            forward_backward(model, [batch], groups)
            for n, w in weights.items():
                dense[n].append(w.grad.detach().clone())
        rows, max_err = [], 0.0
        for distribution, refresh in SETTINGS:
            sk = install_sketches(model, MODULES, cfg.cosine_rank, seed=job.optimizer.logra.seed,
                                  distribution=distribution, refresh=refresh)
            by_module = {t.module_name: t for t in sk.targets}
            sketches = {n: [] for n in weights}
            projs = {n: [] for n in weights}
            for batch in batches:
                sk.zero_()
                model.zero_grad(set_to_none=True)
                forward_backward(model, [batch], groups)
                for n in weights:
                    t = by_module[n]
                    sketches[n].append(t.sketch.detach().clone())
                    projs[n].append(sk.projection_for(t).detach().clone())
                sk.advance()
            sk.remove()
            for w in weights.values():
                w.requires_grad_(True)
            for n in weights:
                t = by_module[n]
                for g, s, a in zip(dense[n], sketches[n], projs[n]):
                    ref = g.double() @ a.double().t()
                    max_err = max(max_err, float((s.double() - ref).norm() / ref.norm().clamp_min(1e-300)))
                single, acc = reconstruction_cosines(dense[n], sketches[n], projs[n])
                mc, mc_se = _monte_carlo_single(cfg, dense[n], t.name, t.n_in, job.optimizer.logra.seed, distribution)
                rows.append({"layer": _layer_of(n), "module": t.kind, "n_in": t.n_in,
                             "theory": theory_cosine(cfg.cosine_rank, t.n_in), "distribution": distribution,
                             "refresh": refresh, "single": single, "single_mc": mc, "single_mc_se": mc_se, "accumulated": acc, "name": t.name})
        logger.info("cosines: %d targets x %d settings, capture vs G·Aᵀ max rel err %.2e", len(weights),
                    len(SETTINGS), max_err)
    finally:
        destroy_parallel()
    return {"rows": rows, "rank": cfg.cosine_rank, "k": cfg.cosine_steps, "warm_start": warm,
            "capture_max_rel_err": max_err}


def _monte_carlo_single(cfg: PaperBenchConfig, grads: list[torch.Tensor], name: str, n_in: int, seed: int,
                        distribution: str) -> tuple[float, float]:
    """(mean, standard error) of cos(G_t, G_t·AᵀA) over the k gradients x ``cosine_draws`` further
    projections of the layer (update indices 10_000 + j, never used by training): many independent
    draws, so the comparison with the theory is not dominated by Monte-Carlo noise. ``S = G·Aᵀ``
    exactly (checked against the capture path), so no further backward pass is needed."""
    from megatron_logra.sketch.random_projection import projection

    values = []
    for j in range(cfg.cosine_draws):
        a = projection(seed, name, 10_000 + j, cfg.cosine_rank, n_in, distribution=distribution).double()
        values += [cosine(g.double(), (g.double() @ a.t()) @ a) for g in grads]
    t = torch.tensor(values, dtype=torch.float64)
    se = float(t.std() / math.sqrt(len(values))) if len(values) > 1 else float("nan")
    return float(t.mean()), se


def _layer_of(module_name: str) -> int:
    parts = module_name.split(".")
    for a, b in zip(parts, parts[1:]):
        if a == "layers" and b.isdigit():
            return int(b)
    raise ValueError(f"cannot find the layer index of {module_name}")


def _grid(rows: list[dict], value: str, distribution: str, refresh: bool) -> tuple[list[int], torch.Tensor]:
    sel = [r for r in rows if r["distribution"] == distribution and r["refresh"] == refresh]
    layers = sorted({r["layer"] for r in sel})
    grid = torch.full((len(layers), len(MODULES)), float("nan"))
    for r in sel:
        grid[layers.index(r["layer"]), MODULES.index(r["module"])] = r[value] if value != "ratio" else r["single_mc"] / r["theory"]
    return layers, grid


def plot_cosines(result: dict, path_single: Path, path_acc: Path) -> tuple[Path, Path]:
    """Fig 5b (single step: Rademacher, Gaussian, theory, measured/theory) and Fig 5c
    (accumulated over k steps: refreshed vs fixed, both distributions) as annotated heatmaps."""
    plt = pyplot()

    rows, k, r = result["rows"], result["k"], result["rank"]
    panels_b = [("single_mc", "rademacher", True, "single step, Rademacher"),
                ("single_mc", "gaussian", True, "single step, Gaussian"),
                ("theory", "rademacher", True, "theory sqrt(r/(r+n_in))"),
                ("ratio", "rademacher", True, "Rademacher measured / theory")]
    panels_c = [("accumulated", "rademacher", True, f"Σ{k} steps, Rademacher, refreshed"),
                ("accumulated", "rademacher", False, f"Σ{k} steps, Rademacher, fixed"),
                ("accumulated", "gaussian", True, f"Σ{k} steps, Gaussian, refreshed"),
                ("accumulated", "gaussian", False, f"Σ{k} steps, Gaussian, fixed")]
    out = []
    for panels, path, title in ((panels_b, path_single, f"cos(G, S·A) per layer/module, r={r}"),
                                (panels_c, path_acc, f"cos(ΣG, ΣS·A) after k={k} steps, r={r}")):
        fig, axes = plt.subplots(1, len(panels), figsize=(3.2 * len(panels), 3.0), dpi=80)
        for ax, (value, dist, refresh, label) in zip(axes, panels):
            layers, grid = _grid(rows, value, dist, refresh)
            vmin, vmax = (0.8, 1.2) if value == "ratio" else (0.0, 1.0)
            ax.imshow(grid.numpy(), vmin=vmin, vmax=vmax, cmap="RdBu" if value == "ratio" else "viridis",
                      aspect="auto")
            for i in range(grid.shape[0]):
                for j in range(grid.shape[1]):
                    ax.text(j, i, f"{grid[i, j]:.2f}", ha="center", va="center", fontsize=7,
                            color="k" if value == "ratio" or grid[i, j] > 0.6 else "w")
            ax.set_xticks(range(len(MODULES)), [m.replace("linear_", "") for m in MODULES], fontsize=7)
            ax.set_yticks(range(len(layers)), [f"L{i}" for i in layers], fontsize=7)
            ax.set_title(label, fontsize=8)
        fig.suptitle(title, fontsize=9)
        out.append(save_figure(fig, path))
    return out[0], out[1]
