"""``megatron-logra bench paper``: the paper's evidence regenerated at small scale on a CPU.

What each figure shows and which module makes it:

* Fig 1 — :mod:`~megatron_logra.bench.memory_fig`: measured peak and average live tensor
  memory of one training step, dense AdamW vs LoGRA vs GaLore vs APOLLO, at three small
  megatron-core GPTs; beside it the memory planner's per-GPU totals at 1.5B / 7B / 27B.
* Fig 2 and Fig 5a — :mod:`~megatron_logra.bench.accuracy_fig`: held-out accuracy over RL
  updates (mean ± sd over seeds) of the four optimizers on the tiny RL recipe, and LoGRA's
  final accuracy against its rank. Every run is the project's RL job (``rl.job.run_rl``).
* Fig 5b/5c — :mod:`~megatron_logra.bench.cosine_fig`: cosine between the true dense gradient
  and its LoGRA reconstruction per layer and module, single step and accumulated over k
  steps, fixed vs refreshed projection, Rademacher vs Gaussian, with sqrt(r/(r+n_in)).
* Fig 6 — :mod:`~megatron_logra.bench.kl_fig`: no KL control vs a k3 penalty vs
  predicted-KL step control vs predicted KL with closed-loop calibration.

:mod:`~megatron_logra.bench.peers` wraps GaLore (``galore_torch``) and APOLLO
(``apollo_torch``) around the project's dense-gradient optimizer so they see the same model,
data and seeds; both are optional (the ``bench`` extra) and a missing one is skipped and
reported. :mod:`~megatron_logra.bench.config` holds the typed budget (``--quick`` vs full),
:mod:`~megatron_logra.bench.report` writes ``docs/results.md`` with a verdict computed from
the numbers (:mod:`~megatron_logra.bench.verdicts`), a header naming the command and machine
(:mod:`~megatron_logra.bench.provenance`) and a file name naming the settings
(:mod:`~megatron_logra.bench.report_names`). :mod:`~megatron_logra.bench.cli` is the command line;
:mod:`~megatron_logra.bench.paper_run` runs the figures and :mod:`~megatron_logra.bench.rerender`
rewrites a report from its JSON (:mod:`~megatron_logra.bench.results_file`)::

    megatron-logra bench paper --quick     # about 3 minutes on 2 cores
    megatron-logra bench paper             # about 20 minutes

    from megatron_logra.bench.config import PaperBenchConfig
    from megatron_logra.bench.paper_run import run_paper
    run_paper(PaperBenchConfig.preset(quick=True, figures=["cosine"]))  # writes docs/results-quick-cosine.md

A run of some figures or with other settings writes a report named after them
(:func:`~megatron_logra.bench.report_names.report_stem`) and never replaces the full ``docs/results.md``.
"""

import logging

logger = logging.getLogger(__name__)

__all__: list[str] = []
