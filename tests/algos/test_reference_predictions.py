"""`jaxrl.algos.reference` (where a reference lives in a train state) and
`jaxrl.algos.predictions` (HF's predict layout), on hand-made pytrees and arrays."""

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxrl.algos import predictions, reference
from jaxrl.models.adapters import SavedParam, adapter_disabled, adapter_off, without_adapter


class _Adapted(nnx.Module):
    def __init__(self):
        self.lora_a = nnx.LoRAParam(jnp.ones((2, 2)))
        self.head = SavedParam(jnp.full((2,), 3.0))


def test_lora_base_keeps_the_initial_saved_modules_only():
    adapter = nnx.state(_Adapted())
    frozen = reference.lora_base_frozen(adapter)
    assert set(frozen) == {reference.REF_SAVED}
    assert [p[-1] for p, _ in nnx.to_flat_state(frozen[reference.REF_SAVED])] == ["head"]
    trained = jax.tree.map(lambda x: x * 2.0, adapter)  # a training step changed every trainable param
    seen = reference.lora_base_adapter(trained, frozen)
    np.testing.assert_array_equal(seen["head"].get_value(), [3.0, 3.0])  # back at its start
    np.testing.assert_array_equal(seen["lora_a"].get_value(), np.full((2, 2), 2.0))


def test_lora_base_without_saved_modules_needs_nothing_frozen():
    class OnlyLora(nnx.Module):
        def __init__(self):
            self.lora_a = nnx.LoRAParam(jnp.ones((2,)))

    adapter = nnx.state(OnlyLora())
    assert reference.lora_base_frozen(adapter) == {}
    assert reference.lora_base_adapter(adapter, {}) is adapter


def test_adapter_switches_are_scoped():
    assert not adapter_disabled()
    with adapter_off(False):
        assert not adapter_disabled()
    with adapter_off():
        assert adapter_disabled()
    assert not adapter_disabled()

    class Probe:
        def ask(self):
            return adapter_disabled()

    assert without_adapter(Probe()).ask() is True
    assert Probe().ask() is False


def test_labels_from_loss_mask_shift_by_one_and_skip_position_zero():
    ids = jnp.array([[5, 6, 7, 8]])
    loss_mask = jnp.array([[1, 0, 1, 0]])  # targets 1 and 3 are trained
    labels = predictions.label_ids_from_loss_mask(ids, loss_mask)
    np.testing.assert_array_equal(labels, [[-100, 6, -100, 8]])
    trained_first = predictions.label_ids_from_trained(ids, jnp.array([[1, 1, 0, 0]]))
    np.testing.assert_array_equal(trained_first, [[-100, 6, -100, -100]])


def test_beyond_widths_pads_each_block_of_rows():
    x = jnp.arange(12, dtype=jnp.int32).reshape(4, 3)  # 2 examples, chosen then rejected rows
    out = predictions.beyond_widths(x, jnp.array([1, 2]), axis=1)
    np.testing.assert_array_equal(
        out, [[0, -100, -100], [3, 4, -100], [6, -100, -100], [9, 10, -100]]
    )


def test_predict_step_composes_widths_and_preprocess():
    def predict(model, mb):
        return mb["logits"] * model, mb["labels"]

    step = predictions.make_predict_step(
        predict,
        apply_model=lambda params: params["scale"],
        input_ids=lambda mb: mb["ids"],
        widths=lambda mb: jnp.array([2]),
        preprocess=lambda logits, labels: logits.argmax(-1),
        per_position=True,
    )
    batch = {
        "logits": jnp.array([[[[0.0, 1.0], [1.0, 0.0], [0.0, 1.0]]]]),
        "labels": jnp.array([[[1, 0, 1]]]),
        "ids": jnp.array([[[4, 5, 6]]]),
    }
    logits, labels, ids, widths = step({"scale": 2.0}, batch)
    # -100 past width 2 first (argmax then sees the -100 row as [-100, -100] -> index 0)
    np.testing.assert_array_equal(logits, [[1, 0, 0]])
    np.testing.assert_array_equal(labels, [[1, 0, -100]])
    np.testing.assert_array_equal(ids, [[4, 5, -100]])
    np.testing.assert_array_equal(widths, [2])
