"""Activation offloading (TRL's `activation_offloading`, `ModelConfig.activation_offloading`):
for every remat policy, scanned or not, the same logits and gradients as without it, with the
saved activations moved to host memory in the traced program; and the trainers' option."""

import chex
import jax
import jax.numpy as jnp
from flax import nnx

from jaxrl.models import from_pretrained
from tests.models.conftest import padded_batch


def _loss_fn(model, ids, mask):
    graphdef, params = nnx.split(model)

    def loss(params):
        logits = nnx.merge(graphdef, params)(ids, mask)
        return jnp.sum(jnp.square(logits) * mask[..., None])

    return jax.value_and_grad(loss), params


def _loss_and_embed_grad(out):
    loss, grads = out
    return loss, grads["model"]["embed_tokens"]["embedding"][...]


def _host_puts(model, ids, mask) -> int:
    """How many values the traced forward + backward moves to host memory."""
    fn, params = _loss_fn(model, ids, mask)
    return str(jax.make_jaxpr(fn)(params)).count("MemorySpace.Host")


def test_same_numbers_with_activations_on_the_host(hf_causal):
    """Scanned with nothing recomputed (every saved value offloaded), and unrolled with full
    remat (each layer's saved input offloaded): the numbers of the plain model (scan and remat
    change them within 1e-5, test_model_options)."""
    path = hf_causal("qwen2").path
    ids, right, _ = padded_batch()
    ids, mask = jnp.asarray(ids), jnp.asarray(right)
    plain = from_pretrained(path, scan_layers=True)
    assert _host_puts(plain, ids, mask) == 0
    want_fn, want_params = _loss_fn(plain, ids, mask)
    want = _loss_and_embed_grad(jax.jit(want_fn)(want_params))
    assert float(jnp.abs(want[1]).max()) > 0
    puts = {}
    for scan, policy in [(True, "none"), (False, "full")]:
        model = from_pretrained(
            path, scan_layers=scan, remat_policy=policy, activation_offloading=True
        )
        assert model.config.activation_offloading
        puts[policy] = _host_puts(model, ids, mask)
        got_fn, got_params = _loss_fn(model, ids, mask)
        # The loss and the embedding's gradient (every layer's backward reaches it; the layer
        # params' trees differ between scanned and unrolled stacks).
        chex.assert_trees_all_close(
            _loss_and_embed_grad(jax.jit(got_fn)(got_params)), want, atol=1e-5, rtol=1e-5
        )
    # Full remat moves each layer's input (one per unrolled layer: 2); saving everything moves
    # every saved value of the one scanned layer program, many more.
    assert puts["full"] == 2 and puts["none"] > 2, puts
