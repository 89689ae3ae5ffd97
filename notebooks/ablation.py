# ---
# jupyter:
#   jupytext:
#     formats: ipynb,py:percent
#     text_representation:
#       extension: .py
#       format_name: percent
#       format_version: '1.3'
#       jupytext_version: 1.19.6
#   kernelspec:
#     display_name: Python 3 (ipykernel)
#     language: python
#     name: python3
# ---

# %% [markdown]
# # Ablation, α sweep and convergence
#
# * **Ablation** (7B, 8 GPUs, TP=4, CP=2, 64K–896K): full recomputation without and with the
#   memory plan, full swapping with the plan, and MEMO (token-wise swapping and recomputation)
#   with the plan.
# * **α sweep**: α, the fraction of tokens whose skeletal activations are swapped to the host
#   (the rest are recomputed), from 0 to 1 at 192K–384K.
# * **Convergence**: loss curves of MEMO at several α against Megatron-LM's full recomputation.
#
# Results are read from the sweep directories in the environment variable `MEMO_RESULTS`
# (separated by commas; default `multirun`; relative paths from the repository root). The CPU
# smoke versions of the experiments (`<name>_cpu_smoke`) show in the same way. In the tables,
# `OOM` is out of device memory, `OOHM` out of host memory for offloaded activations, `ERR` an
# error.

# %%
# %matplotlib inline
from IPython.display import Markdown, display

from analysis import figures, report, rows, tables

dirs = rows.dirs_from_env()
results = rows.load_results(*dirs)
steps = rows.read_steps(results)
print(f"Runs under {', '.join(map(str, dirs))}:", report.summary(results), sep="\n")

# %% [markdown]
# ## Ablation
# MFU, peak memory (bytes shown in GiB) and allocator retries by variant and sequence length;
# then MFU and TGS against sequence length, and the time of each step.

# %%
for name, runs in rows.experiment_groups(results, "ablation").items():
    display(Markdown(f"### {name}"), tables.ablation_table(runs, display=True))
    display(figures.metric_vs_seq(runs, "mfu"), figures.metric_vs_seq(runs, "tgs"))
    display(figures.step_times(rows.steps_of(steps, runs)))

# %% [markdown]
# ## α sweep
# Iteration time and MFU by α and sequence length; `*` marks the best α of each length.

# %%
for name, runs in rows.experiment_groups(results, "alpha_sweep").items():
    display(Markdown(f"### {name}"), tables.alpha_sweep_table(runs, display=True))
    display(figures.alpha_sweep(runs))

# %% [markdown]
# ## Convergence
# Loss against step for each run, and the time of each step.

# %%
for name, runs in rows.experiment_groups(results, "convergence").items():
    display(Markdown(f"### {name}"))
    display(figures.loss_curves(rows.steps_of(steps, runs)))
    display(figures.step_times(rows.steps_of(steps, runs)))
