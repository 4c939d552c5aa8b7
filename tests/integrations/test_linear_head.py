"""``cpshard.integrations.linear_head``: a transformers causal LM's loss from its final hidden
states (``cp_linear_cross_entropy``) equals, in float64, the cross entropy of the model's own
logits (Llama; Gemma 2, whose logits the model soft-caps), loss and every parameter gradient,
with labels the loss shifts and with labels given shifted over a token count; without the keyword
the model's own forward runs. Models it cannot serve are named with the reason."""

from __future__ import annotations

import sys

import pytest
import torch
import torch.nn.functional as F

from tests.helpers import EXAMPLES

transformers = pytest.importorskip("transformers")
sys.path.insert(0, str(EXAMPLES))

import tiny_training  # noqa: E402

from cpshard.integrations import linear_head  # noqa: E402


def _gemma2() -> torch.nn.Module:
    config = transformers.Gemma2Config(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=8, final_logit_softcapping=3.0,
        max_position_embeddings=256, pad_token_id=0,
    )  # fmt: skip
    torch.manual_seed(0)
    return transformers.Gemma2ForCausalLM(config).to(torch.float64)


MODELS = {"llama": tiny_training.tiny_llama, "gemma2": _gemma2}


def _reference_loss(model: torch.nn.Module, ids: torch.Tensor, targets: torch.Tensor, count) -> torch.Tensor:
    """The model's own (soft-capped) logits, float64 cross entropy summed over ``count``."""
    logits = model(input_ids=ids).logits
    total = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1), reduction="sum")
    return total / count


@pytest.mark.parametrize("name", MODELS)
@pytest.mark.parametrize("given", [False, True])
def test_loss_and_gradients_equal_the_logits_loss(name, given):
    model, ref = MODELS[name](), MODELS[name]()
    assert linear_head.head_problem(model) is None
    linear_head.install(model)
    gen = torch.Generator().manual_seed(4)
    ids = torch.randint(4, 64, (2, 17), generator=gen)
    labels = ids.clone()
    labels[0, :5] = -100
    targets = F.pad(labels, (0, 1), value=-100)[:, 1:]
    if given:  # pre-shifted, over a count of the whole batch (as under CP)
        count = torch.tensor(40)
        kwargs = {"labels": labels, "shift_labels": targets, "num_items_in_batch": count}
    else:
        count = (targets != -100).sum()
        kwargs = {"labels": labels}
    out = model(input_ids=ids, cp_linear_loss=True, **kwargs)
    assert out.logits is None
    want = _reference_loss(ref, ids, targets, count)
    torch.testing.assert_close(out.loss, want, rtol=0, atol=1e-13)
    out.loss.backward()
    want.backward()
    for (pname, p), q in zip(model.named_parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=0, atol=1e-12, msg=pname)
    # without the keyword: the model's own forward, logits and all
    plain = model(input_ids=ids, labels=labels)
    torch.testing.assert_close(plain.logits, ref(input_ids=ids).logits, rtol=0, atol=0)


def test_models_it_cannot_serve_are_named_with_the_reason():
    model = tiny_training.tiny_llama()
    model.config.logit_scale = 0.5
    assert linear_head.head_problem(model) == "its config scales the logits (logit_scale=0.5)"
    model = tiny_training.tiny_llama()
    model.config.output_router_logits = True
    assert "router loss" in linear_head.head_problem(model)
    model = tiny_training.tiny_llama()

    class Scaled(torch.nn.Linear):
        pass

    model.lm_head = Scaled(32, 64)
    assert linear_head.head_problem(model) == "its LM head is Scaled, not a plain torch.nn.Linear"
    assert "not a transformers model" in linear_head.head_problem(torch.nn.Linear(2, 2))
