"""A Hugging Face MoE model's own load-balancing loss where the engines split what it is computed from: its routers
are found as transformers records them, and pipeline stages carry their logits down to the last stage, whose loss
is then the unsplit model's. (Gathering them over a sequence's shares runs in the parity runs:
tests/strategies/test_hf_models.py.)"""

import pytest
import torch

from meshlight.parallel.pipeline import ModelRoot, plan_stages
from meshlight.parallel.pipeline_stages import root_stages
from meshlight.parallel.router_logits import routers

transformers = pytest.importorskip("transformers")


@pytest.mark.parametrize(("family", "router", "index"), [
    ("mixtral", "MixtralTopKRouter", 0),
    ("llama4", "Llama4Router", 1),  # its router returns (scores, logits)
    ("minimax", "MiniMaxTopKRouter", 0),  # recorded by class and by the layer name "mlp.gate"
])
def test_the_routers_are_the_modules_transformers_records_router_logits_from(family, router, index):
    from tests.strategies.hf_models import lit_causal_lm

    model = lit_causal_lm(f"{family}-aux").model
    found = routers(model)
    every = [module for module in model.modules() if type(module).__name__ == router]  # one per MoE layer
    assert every and [module for module, _ in found] == every and {i for _, i in found} == {index}
    assert routers(lit_causal_lm("llama").model) == []


def test_pipeline_stages_carry_the_router_logits_to_the_last_whose_loss_is_the_unsplit_models():
    """Mixtral adding its load-balancing loss to its own (labels): stage 0 hands on its router's logits beside the
    hidden state; the last stage's loss and load-balancing loss are the unsplit model's, exactly. A scalar the root
    returns travels as one element per microbatch; merged over microbatches it reads as their mean."""
    from tests.strategies.hf_models import lit_causal_lm

    root = lit_causal_lm("mixtral-aux").model  # 2 layers, 4 experts
    ids = torch.randint(0, root.config.vocab_size, (2, 6))
    with torch.no_grad():
        expected = root(input_ids=ids, labels=ids)
        place = ModelRoot("", "model", "layers", ("lm_head",))
        first, last = root_stages(root, place, plan_stages(root.model, "layers", 2), [0, 1])
        handed = first(ids, labels=ids)
        assert len(handed) == 2 and handed[1].shape == (12, 4)  # the hidden state, then layer 0's router logits
        held = last(*handed, labels=ids)
        output = last.rebuild(held)
        merged = last.rebuild(tuple(torch.cat([tensor, 2 * tensor]) for tensor in held))
    assert len(output.router_logits) == 2
    torch.testing.assert_close(output.aux_loss, expected.aux_loss, rtol=0, atol=0)
    torch.testing.assert_close(output.loss, expected.loss, rtol=0, atol=0)
    torch.testing.assert_close(merged.aux_loss, 1.5 * expected.aux_loss)
