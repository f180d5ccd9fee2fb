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
#     display_name: Python 3
#     language: python
#     name: python3
# ---

# %% [markdown]
# # Inspecting an oocjax plan
#
# `ooc_jit(step, budget=...).plan(*args)` plans a training step without running it. The plan explains
# itself: a one-line `repr`, a text `summary()`, a memory timeline (`plot()`, or the inline SVG that
# notebooks show), and the step as it runs: segments with every transfer and wait (`pretty_jaxpr()`).
#
# Here: a small Flax CNN trained with Adam, planned at 60% and at 40% of its in-core estimate. The
# step donates its state (`donate_argnums=0`), as a training loop does, so the plan may move it to
# host. Arguments passed in device memory and not donated (here the batch) stay on the device for
# the whole step: you hold them, and the plan counts them there. To let a step stream state you keep,
# pass it in host memory instead (`oocjax.to_host(state)`).

# %%
import flax.linen as nn
import jax
import jax.numpy as jnp
import optax
from IPython.display import display
from models import Transformer, next_token_step  # examples/models.py: the zoo the tests and benchmarks use

from oocjax import Plan, ooc_jit


# %%
class CNN(nn.Module):
    @nn.compact
    def __call__(self, x):
        for _ in range(8):
            x = nn.relu(nn.Conv(16, (3, 3))(x))
        return nn.Dense(10)(x.mean(axis=(1, 2)))


model, optimizer = CNN(), optax.adam(1e-3)
params = model.init(jax.random.key(0), jnp.zeros((1, 16, 16, 3)))
state = (params, optimizer.init(params))
batch = (jnp.zeros((32, 16, 16, 3)), jnp.zeros((32,), jnp.int32))


def train_step(state, batch):
    params, opt_state = state
    images, labels = batch

    def loss_fn(p):
        return optax.softmax_cross_entropy_with_integer_labels(model.apply(p, images), labels).mean()

    loss, grads = jax.value_and_grad(loss_fn)(params)
    updates, opt_state = optimizer.update(grads, opt_state, params)
    return (optax.apply_updates(params, updates), opt_state), loss


in_core = ooc_jit(train_step, budget=2**62).plan(state, batch).baseline_peak_bytes
plans = {}
for fraction in (0.6, 0.4):
    step = ooc_jit(train_step, budget=int(in_core * fraction), min_offload_bytes=16 * 1024, donate_argnums=0)
    plans[fraction] = step.plan(state, batch)  # plans without running: the donated state is untouched
print(plans)

# %% [markdown]
# ## The summary
# Budget, peaks (the planner's estimate, and the executed peak measured from the compiled segments
# on this machine's device), traffic each way, and the largest moves: how long each value stays on
# host, in equations, and which line of the model made it. With `profile=`, the step time simulated
# on a model of a GPU (here a PCIe H100): a model, not a measurement.

# %%
print(plans[0.4].summary(profile="h100"))

# %% [markdown]
# ## Memory over the program
# In-core (grey) against planned (blue), with the budget, what is on host (dotted) and every offload
# and prefetch. The x axis is the step's equations, numbered as in the summary; the shading says which
# are the forward, the backward and the optimizer's update, and thin lines mark where each of the
# model's layers (`Conv_0`, ... here, the root module's children) begins: a layer too narrow to name
# goes unnamed. Under the plot, the largest moves, with the phase and layer each leaves and returns in.

# %%
for fraction, plan in plans.items():
    memory_ax = plan.plot()
    memory_ax.set_title(f"budget {round(fraction * 100)}% of in-core: " + memory_ax.get_title())

# %% [markdown]
# The notebook view needs no matplotlib: the plan renders itself as a summary and an SVG timeline.

# %%
display(plans[0.6])

# %% [markdown]
# ## The step as it runs
# A chain of separately compiled segments; before each, the waits for offloads whose memory it
# needs and the prefetches it reads; after it, the offloads of what it produced.

# %%
print("\n".join(plans[0.4].pretty_jaxpr().splitlines()[:30]))

# %% [markdown]
# Plans can be saved next to experiment logs: by default a small summary of what moved
# (`full=True` keeps the planner's program and the segments too, and loads back as a `Plan`, without
# the jaxprs).

# %%
print(plans[0.4].to_json()[:400])
Plan.from_json(plans[0.4].to_json(full=True))

# %% [markdown]
# ## A scan over layers
# Large models stack their layers' parameters and run them with `nn.scan` (here over remat'd
# blocks). oocjax runs such a scan one iteration at a time: each layer's values can move to host
# and back, so the scanned model plans at the budgets an unrolled one does: here at 35% of its
# in-core estimate. The summary says which loops ran per iteration.


# %%
decoder = Transformer(vocab=64, width=64, heads=4, layers=8, causal=True, scan=True, remat=True)
adamw = optax.adamw(1e-3)
tokens = jax.random.randint(jax.random.key(1), (16, 65), 0, 64)
decoder_params = decoder.init(jax.random.key(0), tokens[:, :-1])
decoder_step = next_token_step(decoder, adamw)
decoder_state = (decoder_params, adamw.init(decoder_params))
decoder_in_core = ooc_jit(decoder_step, budget=2**62).plan(decoder_state, tokens).baseline_peak_bytes
scanned = ooc_jit(decoder_step, budget=int(decoder_in_core * 0.35), min_offload_bytes=16 * 1024, donate_argnums=0)
print(scanned.plan(decoder_state, tokens).summary(largest=3))
