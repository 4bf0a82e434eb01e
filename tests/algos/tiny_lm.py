"""A tiny stand-in for a causal LM and its NumPy twin, for the algos tests: log-probs and
entropies of completions computed by hand, without a transformer.

`TinyLM` has what the online forward helpers call (`hidden_states`, `unembed_weight`,
`config.final_logit_softcap`, `config.vision.image_token_id`): the hidden state of position t is
`(emb[id_t] + pos[t]) * attention_mask_t` (plus, for image prompts, the mean pixel value on
positions whose `token_type_ids` is 1), so a wrong position, target or mask changes the numbers.
"""

from __future__ import annotations

from types import SimpleNamespace

import jax.numpy as jnp
import numpy as np

V, D, MAX_LEN = 11, 4, 16
IMAGE_TOKEN = 10


def tiny_params(seed: int = 0) -> dict[str, jnp.ndarray]:
    rng = np.random.default_rng(seed)
    return {
        "emb": jnp.asarray(rng.normal(size=(V, D)), jnp.float32),
        "pos": jnp.asarray(0.5 * rng.normal(size=(MAX_LEN, D)), jnp.float32),
        "w": jnp.asarray(rng.normal(size=(D, V)), jnp.float32),
    }


class TinyLM:
    def __init__(self, params: dict, softcap: float | None = None):
        self.params = params
        self.config = SimpleNamespace(
            final_logit_softcap=softcap, vision=SimpleNamespace(image_token_id=IMAGE_TOKEN)
        )
        self.calls: list[dict] = []

    def hidden_states(self, ids_BT, attention_mask_BT, **kwargs):
        self.calls.append(kwargs)
        p = self.params
        h_BTD = p["emb"][ids_BT] + p["pos"][: ids_BT.shape[1]]
        if "token_type_ids" in kwargs:
            h_BTD = h_BTD + kwargs["token_type_ids"][..., None] * jnp.mean(kwargs["pixel_values"])
        return h_BTD * attention_mask_BT[..., None]

    def unembed_weight(self):
        return self.params["w"]


def rollout_batch(seed: int = 0, B: int = 4, P: int = 3, C: int = 4) -> dict[str, np.ndarray]:
    """`prompt + completion` rows: left-padded prompts, completions ending early (mask 0)."""
    rng = np.random.default_rng(seed)
    ids = rng.integers(1, IMAGE_TOKEN, size=(B, P + C)).astype(np.int32)
    prompt_mask = np.ones((B, P), np.int32)
    prompt_mask[1, 0] = 0
    prompt_mask[2, :2] = 0
    completion_mask = np.ones((B, C), np.int32)
    completion_mask[0, 3:] = 0
    completion_mask[2, 2:] = 0
    return {
        "input_ids": ids,
        "attention_mask": np.concatenate([prompt_mask, completion_mask], axis=1),
        "completion_mask": completion_mask,
    }


def np_completion_logits(params, batch, *, temperature=1.0, softcap=None):
    """`([B, C, V] logits, [B, C] targets)` of the completion tokens, in float64."""
    p = {k: np.asarray(v, np.float64) for k, v in params.items()}
    ids, attn = np.asarray(batch["input_ids"]), np.asarray(batch["attention_mask"])
    C = batch["completion_mask"].shape[1]
    T = ids.shape[1]
    P = T - C
    h = (p["emb"][ids] + p["pos"][:T]) * attn[..., None]
    z = h[:, P - 1 : T - 1] @ p["w"]
    if softcap is not None:
        z = softcap * np.tanh(z / softcap)
    return z / temperature, ids[:, P:]


def np_log_softmax(z):
    z = z - z.max(axis=-1, keepdims=True)
    return z - np.log(np.exp(z).sum(axis=-1, keepdims=True))


def np_logprobs_and_entropy(params, batch, *, temperature=1.0, softcap=None):
    """`([B, C] log-probs of the completion tokens, [B, C] entropies)`."""
    z, targets = np_completion_logits(params, batch, temperature=temperature, softcap=softcap)
    logp = np_log_softmax(z)
    taken = np.take_along_axis(logp, targets[..., None], axis=-1)[..., 0]
    return taken, -(np.exp(logp) * logp).sum(axis=-1)
