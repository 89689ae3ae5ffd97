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
# # End to end and scalability
#
# * **End to end**: 7B/13B/30B/65B on 8/16/32/64 GPUs, sequences of 4K to 1408K, MEMO against
#   Megatron-LM's recomputation; MFU, TGS (tokens per GPU per second) and the longest sequence
#   each method trains. Each cell is the best parallel configuration that was run.
# * **Scalability**: the longest sequence and its MFU of 7B on 8 to 64 GPUs.
#
# Results are read from the sweep directories in the environment variable `MEMO_RESULTS`
# (separated by commas; default `multirun`; relative paths from the repository root). Runs
# without an experiment name show as `end_to_end`. In the tables, `OOM` is out of device memory,
# `OOHM` out of host memory for offloaded activations, `ERR` an error.

# %%
# %matplotlib inline
from IPython.display import Markdown, display

from analysis import figures, report, rows, tables

dirs = rows.dirs_from_env()
results = rows.load_results(*dirs)
groups = {name: runs for family in ("end_to_end", "scalability")
          for name, runs in rows.experiment_groups(results, family).items()}
print(f"Runs under {', '.join(map(str, dirs))}:", report.summary(results), sep="\n")

# %% [markdown]
# ## MFU and TGS by sequence length

# %%
for name, runs in groups.items():
    display(Markdown(f"### {name}: MFU"), tables.end_to_end_table(runs, "mfu", display=True))
    display(Markdown(f"### {name}: TGS"), tables.end_to_end_table(runs, "tgs", display=True))
    display(figures.metric_vs_seq(runs, "mfu"), figures.metric_vs_seq(runs, "tgs"))

# %% [markdown]
# ## Longest sequence

# %%
for name, runs in groups.items():
    display(Markdown(f"### {name}"), tables.longest_sequence(runs, display=True))
